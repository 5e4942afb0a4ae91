"""Every CUDA kernel the suite launched under the simulator compiles for an H100.

conftest runs this module last; :mod:`compile_kernels` has recorded each launch
(kernel and argument types) of the tests before it, and a background worker
(:class:`compile_kernels.Background`) has compiled most of them while those tests
ran. Under pytest-xdist each worker records its own launches: the worker running
this module gathers them and compiles them in the background until the other tests
have ended. Here processes without the simulator (one per
core, up to :data:`MAX_SHARDS`, each with a share of the launches the background
worker was not given) rebuild the rest and compile them through Numba, NVVM and ptxas for sm_90,
which the simulator never does: every launch, except that of the launches of one kernel
factory differing only in sizes (a width D), the smallest, the largest and two between
are compiled (:func:`compile_kernels.representatives`). In a whole-suite run every
kernel in ``hbkernels.cuda`` must have been launched, so a kernel with no
simulator test fails here too.
"""
import os
import sys

import pytest

import compile_kernels
from conftest import HAVE_NUMBA_CUDA, SESSION, SIMULATOR, WORKER

MAX_SHARDS = 4  # compiler processes run side by side, one per core
WAIT = 1800  # s, under pytest-xdist: for the other workers' tests to end

pytestmark = [
    pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda is not installed"),
    pytest.mark.skipif(not SIMULATOR, reason="on a real GPU the suite compiles and runs every "
                       "kernel itself"),
    pytest.mark.timeout(WAIT + 900),
]


@pytest.fixture(scope="module", autouse=True)
def every_workers_launches(tmp_path_factory):
    """Under pytest-xdist, the launches of every worker's tests (each records its own),
    those seen so far compiled while the other workers' tests still run."""
    if WORKER is not None and os.environ.get("HBK_SUITE_DIR"):
        if SESSION["compiler"] is None and compile_kernels.have_cuda_compilers():
            SESSION["compiler"] = compile_kernels.Background(
                str(tmp_path_factory.mktemp("compile")), every=0.0)
        compile_kernels.gather(os.environ["HBK_SUITE_DIR"], WORKER, timeout=WAIT,
                               compiler=SESSION["compiler"])
    if os.environ.get("HBK_SAVE_LAUNCHES"):  # every launch of the suite, for compile_kernels.py
        compile_kernels.save(compile_kernels.LAUNCHES, os.environ["HBK_SAVE_LAUNCHES"])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The compile report of every launch recorded so far in this session."""
    if not compile_kernels.have_cuda_compilers():
        missing = "NVVM, NVRTC or nvJitLink is missing: pip install -e '.[test]'"
        if sys.platform == "linux":  # where the test extra installs them
            pytest.fail(missing)
        pytest.skip(missing)
    if not compile_kernels.LAUNCHES:
        pytest.skip("no CUDA kernel was launched before this test in this session")
    background = SESSION["compiler"] or compile_kernels.Background(
        str(tmp_path_factory.mktemp("compile")))
    rows = background.finish(max(1, min(MAX_SHARDS, os.cpu_count() or 1)), timeout=900)
    chosen = compile_kernels.representatives(compile_kernels.LAUNCHES)
    assert chosen <= background.sent and len(rows) == len(background.sent), \
        "a launch has no compile report"
    return rows


def test_every_launched_kernel_compiles_for_sm90(compiled):
    failed = [f"{r['kernel']} {r['factory_args']} {r['argtypes']}: {r['error']}"
              for r in compiled if "error" in r]
    assert not failed, "\n".join(failed)
    assert all(r["registers"] > 0 for r in compiled), "ptxas reported no registers"


def test_no_kernel_spills_registers(compiled):
    spilling = [f"{r['kernel']} {r['argtypes']}: {r['spill_store_bytes']} B stored"
                for r in compiled if "error" not in r and r["spill_store_bytes"]]
    assert not spilling, "\n".join(spilling)


def test_every_kernel_was_launched():
    """Each kernel factory and module-level kernel of hbkernels.cuda ran at least once."""
    if not SESSION["whole_suite"]:
        pytest.skip("only a run of the whole suite launches every kernel")
    launched = {(source[0], source[1]) for source, _ in compile_kernels.LAUNCHES}
    missing = compile_kernels.defined_kernels() - launched
    assert not missing, f"never launched under the simulator: {sorted(missing)}"
