"""The graph-safe grouping (:mod:`hbkernels.cuda.radix_sort`), under the simulator (or on
a GPU): the stable order and the runs of NumPy's stable argsort and unique, for every
number of passes and both key widths, with no allocation and no library call."""
import numpy as np
import pytest

from hbkernels.cuda import _device, _launcher, _segments, radix_sort

pytestmark = pytest.mark.cuda


def grouped(space, keys):
    """The space's grouping of ``keys`` (NumPy), on the host: order, run, starts, ids."""
    g = space.group(_device.xp().asarray(keys))
    k = int(_device.to_host(g.count)[0])
    order, run = _device.to_host(g.order), _device.to_host(g.run)
    return order, run, _device.to_host(g.starts)[:k + 1], _device.to_host(g.ids)[:k]


def check(keys, order, run, starts, ids):
    expected = np.argsort(keys, kind="stable")
    np.testing.assert_array_equal(order, expected)
    uniq = np.unique(keys)
    np.testing.assert_array_equal(ids, uniq)
    np.testing.assert_array_equal(starts, _segments.run_bounds(keys))
    np.testing.assert_array_equal(run, np.searchsorted(uniq, keys[expected]) + 1)


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
    check(keys, *grouped(space, keys))


@pytest.mark.parametrize("n", [1, 2, 255, 256, 257, 2 * 256 + 3])
def test_sizes_around_the_tiles(rng, n):
    """One key, a tile's worth (under the simulator a tile is 256 keys), one more."""
    keys = rng.integers(0, 600, n).astype(np.int32)
    check(keys, *grouped(radix_sort.SortSpace(n, 600, np.int32), keys))


def test_a_space_serves_every_call(rng, monkeypatch):
    """The same space groups new keys each call, allocating nothing and calling no library:
    5 launches a pass and 3 for the runs."""
    n = 300
    space = radix_sort.SortSpace(n, 5000, np.int32)
    batches = [rng.integers(0, 5001, n).astype(np.int32), np.full(n, 5000, np.int32),
               (rng.zipf(1.1, n) % 5001).astype(np.int32)]
    on_device = [_device.xp().asarray(k) for k in batches]

    def refused(*args, **kwargs):
        raise AssertionError("the grouping allocated or called a library")

    for name in ("xp", "scratch", "zeros", "full", "read", "to_host"):
        monkeypatch.setattr(_device, name, refused)
    found = []
    for keys in on_device:
        before = _launcher.LAUNCHES[0]
        g = space.group(keys)
        assert _launcher.LAUNCHES[0] - before == 5 * space.passes + 3
        found.append([np.array(a) for a in (g.order, g.run, g.starts, g.ids, g.count)])
    monkeypatch.undo()
    for keys, (order, run, starts, ids, count) in zip(batches, found):
        k = int(count[0])
        check(keys, order, run, starts[:k + 1], ids[:k])


def test_capacity_is_checked():
    with pytest.raises(ValueError, match="capacity"):
        radix_sort.SortSpace(0, 10, np.int32)
