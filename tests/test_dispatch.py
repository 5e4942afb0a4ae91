import subprocess
import sys

import numpy as np
import pytest

import hbkernels as hbk


def test_import_loads_no_gpu_module():
    code = ("import sys, hbkernels as hbk, numpy as np;"
            "hbk.embedding_bag(np.ones((2, 2), np.float32), np.array([1]), np.array([0, 1]));"
            "bad = [m for m in ('numba.cuda', 'cupy') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_numpy_in_numpy_out():
    out = hbk.lookup(np.ones((2, 3), np.float32), np.array([1, 0]))
    assert type(out) is np.ndarray


def test_mixing_families_is_a_type_error(cuda_backend):
    backend = cuda_backend
    weights = np.ones((4, 2), np.float32)
    ids = np.array([0, 1])
    with pytest.raises(TypeError, match="move them to one device"):
        hbk.lookup(weights, backend.put(ids))
    with pytest.raises(TypeError, match="move them to one device"):
        hbk.embedding_bag(backend.put(weights), ids, backend.put(np.array([0, 2])))


def test_cuda_results_stay_on_device(cuda_backend):
    backend = cuda_backend
    out = hbk.lookup(backend.put(np.ones((2, 3), np.float32)), backend.put(np.array([1])))
    assert not isinstance(out, np.ndarray)
    np.testing.assert_array_equal(backend.get(out), np.ones((1, 3)))


@pytest.mark.parametrize("obj", [[0, 1], 3, "ids", None])
def test_non_arrays_are_refused(obj):
    with pytest.raises(TypeError, match="NumPy array or a CUDA array|NumPy or CUDA array, got None"):
        hbk.unique(obj)


def test_a_numba_cuda_that_cannot_import_is_named(monkeypatch):
    """numba-cuda 0.30 under NumPy 2.5 (``np.row_stack`` removed): a clear error with the
    versions, not a traceback from inside numba-cuda."""
    from hbkernels import _machine
    from hbkernels.errors import MissingDependencyError

    def broken(name):
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    monkeypatch.setattr(_machine.importlib, "import_module", broken)
    with pytest.raises(MissingDependencyError, match=r"numba-cuda cannot be imported with this "
                       r"NumPy \(numba-cuda .*, numba .*, NumPy .*\).*numpy<2\.5"):
        _machine.numba_cuda()

    def missing(name):
        raise ModuleNotFoundError("No module named 'numba.cuda'")

    monkeypatch.setattr(_machine.importlib, "import_module", missing)
    with pytest.raises(MissingDependencyError, match=r"hbkernels\[cuda12\]"):
        _machine.numba_cuda()
