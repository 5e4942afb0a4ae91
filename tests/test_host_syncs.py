"""Host synchronisations and kernel launches per CUDA op and bounds mode, as
docs/kernels.md states them.

Every device-to-host read of the CUDA backend goes through
``hbkernels.cuda._device.read``, which counts them; every kernel launch through
``hbkernels.cuda._launcher.launch``, which counts them; scratch comes from
``_device`` (CuPy's pool on a GPU), never from Numba's ``device_array``
(cuMemAlloc/cuMemFree synchronise the device). Checks an op leaves pending are
read by a later wait, so the ops that need no result on the host never wait.
Runs on the CUDA path (the simulator here, a GPU where there is one)."""
import ast
from pathlib import Path

import numpy as np
import pytest
from helpers import recorded_launches

import hbkernels as hbk

PACKAGE = Path(hbk.__file__).parent


@pytest.fixture
def cuda(cuda_backend):
    from hbkernels.cuda import _device

    hbk.synchronize()  # nothing left pending by an earlier test

    def syncs(call):
        before = _device.HOST_SYNCS[0]
        call()
        return _device.HOST_SYNCS[0] - before

    def launches(call):
        """Kernel launches of ``call``, not counting the fills of a Numba array family's
        allocations (CuPy arrays get theirs from a memset)."""
        from hbkernels.cuda._launch import fill_kernel

        call()  # compiles, and takes the error ledger, outside the count
        _, seen = recorded_launches(call)
        return sum(kernel is not fill_kernel for kernel in seen)

    cuda_backend.syncs, cuda_backend.launches = syncs, launches
    yield cuda_backend
    hbk.synchronize()


def inputs(backend, rng, dim=4):
    table = backend.put(rng.standard_normal((30, dim)).astype(np.float32))
    values = backend.put(rng.integers(0, 30, 24))
    offsets = backend.put(np.array([0, 5, 5, 12, 24]))
    grad_out = backend.put(rng.standard_normal((4, dim)).astype(np.float32))
    return table, values, offsets, grad_out


@pytest.mark.parametrize("bounds", ["raise", "zero", "unchecked"])
def test_embedding_bag(cuda, rng, bounds):
    table, values, offsets, _ = inputs(cuda, rng)
    call = lambda: hbk.embedding_bag(table, values, offsets, bounds=bounds)  # noqa: E731
    assert cuda.syncs(call) == 0
    assert cuda.launches(call) == 1


@pytest.mark.parametrize("bounds", ["raise", "zero", "unchecked"])
def test_lookup(cuda, rng, bounds):
    table, values, _, _ = inputs(cuda, rng)
    call = lambda: hbk.lookup(table, values, bounds=bounds)  # noqa: E731
    assert cuda.syncs(call) == 0
    assert cuda.launches(call) == 1


@pytest.mark.parametrize("bounds", ["raise", "zero", "unchecked"])
@pytest.mark.parametrize("padded", [False, True])
def test_embedding_bag_backward(cuda, rng, bounds, padded):
    _, values, offsets, grad_out = inputs(cuda, rng)
    expected = 0 if (padded and bounds == "unchecked") else 1
    call = lambda: hbk.embedding_bag_backward(grad_out, values, offsets, num_rows=30,  # noqa: E731
                                              bounds=bounds, padded=padded)
    assert cuda.syncs(call) == expected


@pytest.mark.parametrize("bounds", ["raise", "zero", "unchecked"])
@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_fused_step(cuda, rng, bounds, nonfinite):
    table, values, offsets, grad_out = inputs(cuda, rng)
    opt = hbk.optim.RowWiseAdagrad(lr=0.1, nonfinite=nonfinite)
    state = opt.init_state(table)
    call = lambda: opt.fused_step(table, state, grad_out, values, offsets,  # noqa: E731
                                  bounds=bounds)
    assert cuda.syncs(call) == 0
    # the per-bag pass (with the gradient's finiteness check) and the update (CuPy's sort
    # between them); with unchecked offsets, first every position's key and bag set to -1
    unset = int(bounds == "unchecked")
    assert cuda.launches(call) == 2 + unset
    psw = cuda.put(rng.random(int(values.shape[0])).astype(np.float32))
    weighted = lambda: opt.fused_step(table, state, grad_out, values, offsets,  # noqa: E731
                                      bounds=bounds, per_sample_weights=psw)
    # + the weights' check
    assert cuda.launches(weighted) == (3 if nonfinite == "raise" else 2) + unset


def test_unique_reads_its_size_once(cuda, rng):
    ids = cuda.put(rng.integers(0, 9, 40))
    assert cuda.syncs(lambda: hbk.unique(ids, return_inverse=True, return_counts=True,
                                         sorted=True)) == 1


def test_synchronize_waits_once(cuda, rng):
    table, values, _, _ = inputs(cuda, rng)
    hbk.lookup(table, values)
    assert cuda.syncs(hbk.synchronize) == 1


AFTER_UNIQUE_ONLY = """
import sys
import numpy as np
from numba import cuda
import hbkernels as hbk
from hbkernels.cuda import _device

waits = []
wait = _device.wait
_device.wait = lambda stream=None: waits.append(stream) or wait(stream)
hbk.unique(cuda.to_device(np.array([3, 1, 3, 7])))
assert "hbkernels.cuda._pending" not in sys.modules, "the test needs a process without the ledger"
before, syncs = len(waits), _device.HOST_SYNCS[0]
hbk.synchronize()
print(len(waits) - before, waits[before:] == [None], _device.HOST_SYNCS[0] - syncs)
"""


def test_synchronize_waits_for_work_any_op_queued(cuda_backend):
    """A process whose only CUDA op is ``unique`` (no op with deferred checks loaded):
    ``hbk.synchronize()`` still waits for the whole device, once."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", AFTER_UNIQUE_ONLY], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(PACKAGE.parent)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "True", "1"]


def test_no_launch_outside_the_launcher():
    """Every kernel launch goes through ``_launcher.launch`` (no ``kernel[grid, block](...)``)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_launcher.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.slice, ast.Tuple)
                    and len(node.func.slice.elts) in (2, 3, 4)):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, "launched outside _launcher.launch:\n" + "\n".join(found)


def test_no_allocation_or_read_outside_the_device_module():
    """Only ``cuda/_device.py`` allocates device memory or reads it back."""
    banned = {"device_array", "device_array_like", "to_device", "copy_to_host", "synchronize",
              "asnumpy"}
    found = []
    for path in sorted((PACKAGE / "cuda").glob("*.py")):
        if path.name == "_device.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in banned):
                found.append(f"{path.name}:{node.lineno} .{node.func.attr}(...)")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("bounds", ["raise", "zero", "unchecked"])
def test_segment_sum(cuda, rng, bounds):
    data = cuda.put(rng.standard_normal((24, 3)).astype(np.float32))
    segs = cuda.put(rng.integers(0, 5, 24))
    call = lambda: hbk.segment_sum(data, segs, 5, bounds=bounds)  # noqa: E731
    assert cuda.syncs(call) == 0
    assert cuda.launches(call) == 1


@pytest.mark.parametrize("bounds", ["raise", "zero", "unchecked"])
def test_per_sample_weights_backward(cuda, rng, bounds):
    weights = cuda.put(rng.standard_normal((10, 3)).astype(np.float32))
    grad = cuda.put(rng.standard_normal((2, 3)).astype(np.float32))
    values, offsets = cuda.put(rng.integers(0, 10, 6)), cuda.put(np.array([0, 4, 6]))
    psw = cuda.put(rng.random(6).astype(np.float32))
    call = lambda: hbk.per_sample_weights_backward(  # noqa: E731
        grad, weights, values, offsets, psw, bounds=bounds)
    assert cuda.syncs(call) == 0
    assert cuda.launches(call) == (2 if bounds == "unchecked" else 3)  # the check, dots, scale


def test_segment_reduce_never_waits_and_partition_reads_once(cuda, rng):
    data = cuda.put(rng.standard_normal((12, 3)).astype(np.float32))
    offsets = cuda.put(np.array([0, 5, 12]))
    assert cuda.syncs(lambda: hbk.segment_reduce(data, offsets)) == 0
    assert cuda.launches(lambda: hbk.segment_reduce(data, offsets)) == 1
    ids = cuda.put(rng.integers(0, 50, 30))
    assert cuda.syncs(lambda: hbk.partition(ids, 3)) == 1
