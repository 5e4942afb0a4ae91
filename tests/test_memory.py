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


@pytest.fixture
def recycler(monkeypatch):
    """The recycler from 4 KiB on, keeping at most 64 KiB, starting empty."""
    from hbkernels import memory

    monkeypatch.setattr(memory, "RECYCLE_FROM_BYTES", 4096)
    monkeypatch.setattr(memory, "RECYCLE_KEEP_BYTES", 64 << 10)
    monkeypatch.setattr(memory, "_KEPT", {})
    monkeypatch.setattr(memory, "_KEPT_BYTES", [0])
    return memory


def test_recycled_empty_reuses_a_buffer_once_nothing_holds_it(recycler):
    a = recycler.recycled_empty((100, 30), np.float32)  # 12000 bytes
    assert a.shape == (100, 30) and a.dtype == np.float32 and a.ctypes.data % 64 == 0
    assert a.flags.c_contiguous and a.flags.writeable
    a[...] = 7
    address, view = a.ctypes.data, a[5:9]
    del a
    b = recycler.recycled_empty((100, 30), np.float32)  # a view still holds the first
    assert b.ctypes.data != address and (view == 7).all()
    b[...] = 0
    assert (view == 7).all(), "two live arrays never share memory"
    del view
    c = recycler.recycled_empty((95, 31), np.float32)  # the same size class
    assert c.ctypes.data == address and c.shape == (95, 31)
    d = recycler.recycled_empty((3, 4), np.float64)  # below the threshold: a plain array
    assert type(d.base) is np.ndarray and d.ctypes.data % 64 == 0


def test_recycled_empty_keeps_at_most_its_cap(recycler):
    arrays = [recycler.recycled_empty(20000, np.uint8) for _ in range(6)]  # 6 x ~20 KiB
    del arrays
    assert 0 < recycler._KEPT_BYTES[0] <= 64 << 10
    assert sum(len(v) * k for k, v in recycler._KEPT.items()) == recycler._KEPT_BYTES[0]


def test_release_recycled_frees_the_kept_buffers(recycler):
    a = recycler.recycled_empty(10000, np.uint8)
    del a
    kept = recycler._KEPT_BYTES[0]
    assert kept > 0 and recycler.release_recycled() == kept
    assert recycler._KEPT_BYTES[0] == 0 and not recycler._KEPT


def test_a_buffer_dropped_while_the_lock_is_held_is_freed_not_waited_for(recycler):
    a = recycler.recycled_empty(10000, np.uint8)
    with recycler._LOCK:  # as when a collection runs inside recycled_empty
        del a
    assert recycler._KEPT_BYTES[0] == 0


def test_the_cpu_backward_rows_come_from_the_recycler(recycler):
    grad = np.ones((4, 600), np.float32)  # rows of 2400 bytes, two ids: over 4 KiB
    first = hbk.embedding_bag_backward(grad, np.array([1, 3, 1, 3]), np.arange(5), num_rows=4)
    address = first.rows.ctypes.data
    np.testing.assert_array_equal(first.rows, np.full((2, 600), 2, np.float32))
    del first
    again = hbk.embedding_bag_backward(grad, np.array([0, 2, 2, 0]), np.arange(5), num_rows=4)
    assert again.rows.ctypes.data == address
    np.testing.assert_array_equal(again.rows, np.full((2, 600), 2, np.float32))
