"""The graph-safe sort (:mod:`hbkernels.cuda.radix_sort`), under the simulator (or on a
GPU): the stable order of NumPy's stable argsort, for every number of passes and both key
widths, with no allocation and no library call."""
import numpy as np
import pytest

from hbkernels.cuda import _device, _launcher, radix_sort

pytestmark = pytest.mark.cuda


def sorted_by(space, keys):
    """The space's order of ``keys`` (NumPy), on the host."""
    return _device.to_host(space.sort(_device.xp().asarray(keys)))


def check(keys, order):
    np.testing.assert_array_equal(order, np.argsort(keys, kind="stable"))


KEYS = {
    "uniform": lambda rng, n, top: rng.integers(0, top + 1, n),
    "one key thousands of times": lambda rng, n, top: np.where(rng.random(n) < 0.97, top // 3,
                                                              rng.integers(0, top + 1, n)),
    "zipf": lambda rng, n, top: (rng.zipf(1.2, n) - 1) % (top + 1),
    "all equal": lambda rng, n, top: np.full(n, top),
    "the range's edges": lambda rng, n, top: rng.choice([0, 1, top - 1, top], n),
}


@pytest.mark.parametrize("case, top, dtype", [
    *((case, top, dtype) for case in KEYS for top, dtype in [(255, np.int64), (70_000, np.int32)]),
    *((case, top, dtype) for case in ("uniform", "one key thousands of times")
      for top, dtype in [(3, np.int32), (2**31 - 2, np.int64), (2**40, np.int64)])])
def test_equals_numpy_stable_argsort(rng, case, top, dtype):
    """One pass (keys < 256) to six (keys < 2^41), int32 and int64 keys."""
    n = int(rng.integers(1, 600))
    keys = KEYS[case](rng, n, top).astype(dtype)
    space = radix_sort.SortSpace(n, top, dtype)
    assert space.passes == max(1, -(-top.bit_length() // 8))
    check(keys, sorted_by(space, keys))


@pytest.mark.parametrize("n", [1, 2, 255, 256, 257, 2 * 256 + 3])
def test_sizes_around_the_tiles(rng, n):
    """One key, a tile's worth (under the simulator a tile is 256 keys), one more."""
    keys = rng.integers(0, 600, n).astype(np.int32)
    check(keys, sorted_by(radix_sort.SortSpace(n, 600, np.int32), keys))


def test_a_space_serves_every_call(rng, monkeypatch):
    """The same space sorts new keys each call, allocating nothing and calling no library:
    5 launches a pass."""
    n = 300
    space = radix_sort.SortSpace(n, 5000, np.int32)
    batches = [rng.integers(0, 5001, n).astype(np.int32), np.full(n, 5000, np.int32),
               (rng.zipf(1.1, n) % 5001).astype(np.int32)]
    on_device = [_device.xp().asarray(k) for k in batches]

    def refused(*args, **kwargs):
        raise AssertionError("the sort allocated or called a library")

    for name in ("xp", "scratch", "zeros", "full", "read", "to_host"):
        monkeypatch.setattr(_device, name, refused)
    found = []
    for keys in on_device:
        before = _launcher.LAUNCHES[0]
        order = space.sort(keys)
        assert _launcher.LAUNCHES[0] - before == 5 * space.passes
        found.append(order.get() if hasattr(order, "get") else np.array(order))  # CuPy or the simulator
    monkeypatch.undo()
    for keys, order in zip(batches, found):
        check(keys, order)


def test_capacity_is_checked():
    with pytest.raises(ValueError, match="capacity"):
        radix_sort.SortSpace(0, 10, np.int32)
