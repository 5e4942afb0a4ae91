import ml_dtypes
import numpy as np
import pytest

import hbkernels as hbk


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, ml_dtypes.bfloat16, np.uint8])
@pytest.mark.parametrize("shape", [(0, 64), (1, 1), (7, 3), (1000, 64), 5])
@pytest.mark.parametrize("alignment", [64, 4096])
def test_aligned_empty_starts_on_the_alignment(shape, dtype, alignment):
    out = hbk.aligned_empty(shape, dtype, alignment=alignment)
    expected_shape = (shape,) if isinstance(shape, int) else shape
    assert out.shape == expected_shape and out.dtype == np.dtype(dtype)
    assert out.flags.c_contiguous and out.flags.writeable and out.flags.aligned
    assert out.size == 0 or out.ctypes.data % alignment == 0  # an empty array has no data
    out[...] = 1  # every byte is ours
    assert (out == 1).all()


def test_aligned_empty_never_below_the_dtypes_alignment():
    assert hbk.aligned_empty(3, np.float64, alignment=1).ctypes.data % 8 == 0


def test_aligned_full():
    out = hbk.aligned_full((5, 3), 0.25, ml_dtypes.bfloat16)
    assert out.ctypes.data % 64 == 0
    np.testing.assert_array_equal(out.astype(np.float32), np.full((5, 3), 0.25, np.float32))


@pytest.mark.parametrize("alignment", [0, 3, 48, -64])
def test_bad_alignment(alignment):
    with pytest.raises(ValueError, match="power of two"):
        hbk.aligned_empty((2, 2), alignment=alignment)


def test_negative_shape():
    with pytest.raises(ValueError, match="must not be negative"):
        hbk.aligned_empty((2, -1))


def test_tables_hbkernels_makes_on_the_cpu_are_aligned():
    """EmbeddingCollection's weights and an optimizer's per-element state start on a
    cache line (rows of 64 bytes then take one line, not two)."""
    from hbkernels.dist import init

    coll = hbk.EmbeddingCollection(
        tables=[hbk.TableSpec("a", num_rows=300, dim=16), hbk.TableSpec("b", num_rows=7, dim=5)],
        comm=init(backend="local"), optimizer=hbk.optim.Adam(lr=0.1), plan="data_parallel")
    for fused in coll.arrays.values():
        assert fused.weights.ctypes.data % 64 == 0
        assert fused.state["exp_avg"].ctypes.data % 64 == 0
        assert fused.state["exp_avg_sq"].ctypes.data % 64 == 0
    state = hbk.optim.Adagrad(lr=0.1).init_state(np.zeros((1000, 16), np.float32))
    assert state["sum"].ctypes.data % 64 == 0 and (state["sum"] == 0).all()
