"""Checks a GPU op leaves pending (hbkernels.cuda._pending): each error is raised once,
at ``hbk.synchronize()`` or the next hbkernels call that waits for the device, naming
the op, the first bad position and value; a failed fused step writes nothing; a full
ledger makes the next call wait. On the CPU every op raises itself."""
import numpy as np
import pytest

import hbkernels as hbk


@pytest.fixture
def cuda(cuda_backend):
    hbk.synchronize()  # nothing left pending by an earlier test
    yield cuda_backend
    hbk.synchronize()


def table_and_bags(backend, rng, bad=None):
    table = backend.put(rng.standard_normal((20, 3)).astype(np.float32))
    values = rng.integers(0, 20, 9)
    if bad is not None:
        values[bad] = 20 + bad
    return table, backend.put(values), backend.put(np.array([0, 4, 4, 9]))


def test_error_is_raised_once_at_synchronize(cuda, rng):
    table, values, offsets = table_and_bags(cuda, rng, bad=6)
    out = hbk.embedding_bag(table, values, offsets)  # returns: the check is pending
    assert out.shape == (3, 3)
    with pytest.raises(hbk.BoundsError, match=r"embedding_bag: values\[6\] = 26 is out of range"):
        hbk.synchronize()
    hbk.synchronize()  # raised once: nothing left


def test_the_next_call_that_waits_raises(cuda, rng):
    table, values, offsets = table_and_bags(cuda, rng, bad=2)
    hbk.lookup(table, values)  # ids[2] = 22
    with pytest.raises(hbk.BoundsError, match=r"lookup: ids\[2\] = 22"):
        hbk.unique(values)  # reads its size back: a wait
    hbk.synchronize()


def test_several_errors_each_once_in_order(cuda, rng):
    table, values, offsets = table_and_bags(cuda, rng, bad=1)
    _, values2, _ = table_and_bags(cuda, rng, bad=7)
    hbk.embedding_bag(table, values, offsets)
    hbk.embedding_bag(table, values, offsets)  # clean calls between them add nothing
    hbk.embedding_bag(table, values2, offsets, bounds="zero")
    hbk.lookup(table, values2)
    with pytest.raises(hbk.BoundsError, match=r"values\[1\] = 21"):
        hbk.synchronize()
    with pytest.raises(hbk.BoundsError, match=r"values\[1\] = 21"):
        hbk.synchronize()
    with pytest.raises(hbk.BoundsError, match=r"ids\[7\] = 27"):
        hbk.synchronize()
    hbk.synchronize()


def test_malformed_offsets_and_nonfinite_gradients(cuda, rng):
    table, values, _ = table_and_bags(cuda, rng)
    hbk.embedding_bag(table, values, cuda.put(np.array([0, 5, 3, 9])))
    with pytest.raises(ValueError, match=r"embedding_bag: malformed offsets: offsets\[2\] = 3"):
        hbk.synchronize()
    opt = hbk.optim.SGD(lr=0.1)
    state = opt.init_state(table)
    grad = np.ones((3, 3), np.float32)
    grad[1, 2] = np.nan
    opt.fused_step(table, state, cuda.put(grad), values, cuda.put(np.array([0, 4, 4, 9])))
    with pytest.raises(ValueError, match=r"fused_step: grad_out has NaN or Inf in row 1"):
        hbk.synchronize()


@pytest.mark.parametrize("bounds", ["raise", "zero"])
def test_failed_fused_step_writes_nothing(cuda, rng, bounds):
    table, values, offsets = table_and_bags(cuda, rng, bad=3)
    if bounds == "zero":
        offsets = cuda.put(np.array([0, 6, 4, 9]))
    opt = hbk.optim.Adagrad(lr=0.5)
    state = opt.init_state(table)
    before = cuda.get(table).copy(), cuda.get(state["sum"]).copy()
    opt.fused_step(table, state, cuda.put(np.ones((3, 3), np.float32)), values, offsets,
                   bounds=bounds)
    with pytest.raises((hbk.BoundsError, ValueError), match="fused_step"):
        hbk.synchronize()
    np.testing.assert_array_equal(cuda.get(table), before[0])
    np.testing.assert_array_equal(cuda.get(state["sum"]), before[1])


def test_a_full_ledger_makes_the_next_call_wait(cuda, rng, monkeypatch):
    from hbkernels.cuda import _device, _pending

    table, values, offsets = table_and_bags(cuda, rng)
    monkeypatch.setattr(_pending, "MAX_PENDING", 3)
    syncs = _device.HOST_SYNCS[0]
    for _ in range(3):
        hbk.embedding_bag(table, values, offsets)
    assert _device.HOST_SYNCS[0] == syncs and _pending.pending() == 3
    hbk.embedding_bag(table, values, offsets)  # no room: reads the three first
    assert _device.HOST_SYNCS[0] == syncs + 1 and _pending.pending() == 1
    _, bad, _ = table_and_bags(cuda, rng, bad=0)
    monkeypatch.setattr(_pending, "MAX_HELD_BYTES", 1)
    hbk.embedding_bag(table, bad, offsets)  # held arrays over the limit: reads the one before
    with pytest.raises(hbk.BoundsError, match=r"values\[0\] = 20"):
        hbk.embedding_bag(table, values, offsets)  # raised before this call queued anything
    assert _pending.pending() == 0


def test_cpu_ops_raise_at_once(rng):
    table, values, offsets = table_and_bags(type("Cpu", (), {"put": staticmethod(lambda a: a)}),
                                            rng, bad=4)
    with pytest.raises(hbk.BoundsError, match=r"values\[4\] = 24"):
        hbk.embedding_bag(table, values, offsets)
    hbk.synchronize()  # a no-op on the CPU
