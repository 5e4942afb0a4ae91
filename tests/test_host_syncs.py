"""Host synchronisations per CUDA op and bounds mode, as docs/kernels.md states them.

Every device-to-host read of the CUDA backend goes through
``hbkernels.cuda._device.to_host``, which counts them; scratch comes from
``_device`` (CuPy's pool on a GPU), never from Numba's ``device_array``
(cuMemAlloc/cuMemFree synchronise the device). Runs on the CUDA path (the
simulator here, a GPU where there is one)."""
import ast
from pathlib import Path

import numpy as np
import pytest

import hbkernels as hbk

PACKAGE = Path(hbk.__file__).parent


@pytest.fixture
def cuda(cuda_backend):
    from hbkernels.cuda import _device

    def syncs(call):
        before = _device.HOST_SYNCS[0]
        call()
        return _device.HOST_SYNCS[0] - before

    cuda_backend.syncs = syncs
    return cuda_backend


def inputs(backend, rng, dim=4):
    table = backend.put(rng.standard_normal((30, dim)).astype(np.float32))
    values = backend.put(rng.integers(0, 30, 24))
    offsets = backend.put(np.array([0, 5, 5, 12, 24]))
    grad_out = backend.put(rng.standard_normal((4, dim)).astype(np.float32))
    return table, values, offsets, grad_out


@pytest.mark.parametrize("bounds, expected", [("raise", 1), ("zero", 1), ("unchecked", 0)])
def test_embedding_bag(cuda, rng, bounds, expected):
    table, values, offsets, _ = inputs(cuda, rng)
    assert cuda.syncs(lambda: hbk.embedding_bag(table, values, offsets, bounds=bounds)) == expected


@pytest.mark.parametrize("bounds, expected", [("raise", 1), ("zero", 0), ("unchecked", 0)])
def test_lookup(cuda, rng, bounds, expected):
    table, values, _, _ = inputs(cuda, rng)
    assert cuda.syncs(lambda: hbk.lookup(table, values, bounds=bounds)) == expected


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
    expected = 0 if (bounds == "unchecked" and nonfinite == "skip") else 1
    call = lambda: opt.fused_step(table, state, grad_out, values, offsets,  # noqa: E731
                                  bounds=bounds)
    assert cuda.syncs(call) == expected


def test_unique_reads_its_size_once(cuda, rng):
    ids = cuda.put(rng.integers(0, 9, 40))
    assert cuda.syncs(lambda: hbk.unique(ids, return_inverse=True, return_counts=True,
                                         sorted=True)) == 1


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


@pytest.mark.parametrize("bounds, expected", [("raise", 1), ("zero", 0), ("unchecked", 0)])
def test_segment_sum(cuda, rng, bounds, expected):
    data = cuda.put(rng.standard_normal((24, 3)).astype(np.float32))
    segs = cuda.put(rng.integers(0, 5, 24))
    assert cuda.syncs(lambda: hbk.segment_sum(data, segs, 5, bounds=bounds)) == expected


@pytest.mark.parametrize("bounds, expected", [("raise", 1), ("zero", 1), ("unchecked", 0)])
def test_per_sample_weights_backward(cuda, rng, bounds, expected):
    weights = cuda.put(rng.standard_normal((10, 3)).astype(np.float32))
    grad = cuda.put(rng.standard_normal((2, 3)).astype(np.float32))
    values, offsets = cuda.put(rng.integers(0, 10, 6)), cuda.put(np.array([0, 4, 6]))
    psw = cuda.put(rng.random(6).astype(np.float32))
    assert cuda.syncs(lambda: hbk.per_sample_weights_backward(
        grad, weights, values, offsets, psw, bounds=bounds)) == expected


def test_segment_reduce_and_partition_read_once(cuda, rng):
    data = cuda.put(rng.standard_normal((12, 3)).astype(np.float32))
    assert cuda.syncs(lambda: hbk.segment_reduce(data, cuda.put(np.array([0, 5, 12])))) == 1
    ids = cuda.put(rng.integers(0, 50, 30))
    assert cuda.syncs(lambda: hbk.partition(ids, 3)) == 1
