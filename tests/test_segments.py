"""The work decomposition of the sparse backward (:mod:`hbkernels.cuda._segments`):
the grouping its kernels build (under the simulator) against NumPy, and its
arithmetic, evaluated here as the partial and final kernels evaluate it, against
plain sums: every occurrence is summed once, and no row group walks more than
CHUNK items, at the bench's full size too."""
import numpy as np
import pytest

from hbkernels.cuda import _device, _segments


def evaluate(keys, values, chunk):
    """Per distinct key, the sum of ``values`` the decomposition computes (float64,
    through the partial rows, slot by slot as ``partial_kernel`` writes them), and
    the longest serial walk."""
    order = np.argsort(keys, kind="stable")
    starts = _segments.run_bounds(keys)
    n, k = keys.shape[0], starts.shape[0] - 1
    run = np.repeat(np.arange(1, k + 1), np.diff(starts))
    levels, rows = _segments.partial_levels(n, chunk)
    partials = np.full(max(rows, 1), np.nan)  # a row read before it is written stays NaN
    items = values[order]
    longest = 0

    def total(level, first, last, lo, base, width):
        if level == 0:
            return items[first:last].sum()
        return sum(partials[_segments.partial_row(lo, m, width, base)] for m in range(first, last))

    width = 1
    for level in range(1, levels + 1):
        width *= chunk
        base = _segments.level_base(n, level, chunk)
        below = _segments.level_base(n, level - 1, chunk)
        for s in range(2 * -(-n // width)):
            window = s // 2
            w_lo = window * width
            r = run[w_lo if s % 2 == 0 else min(w_lo + width, n) - 1] - 1
            lo, hi = starts[r], starts[r + 1]
            if s % 2 == 1 and lo <= w_lo or _segments.final_level(lo, hi, chunk)[0] < level:
                continue
            first, last = _segments.piece(lo, hi, level, window, chunk)
            assert 0 < last - first <= chunk
            longest = max(longest, last - first)
            partials[base + s] = total(level - 1, first, last, lo, below, width // chunk)
    sums = np.empty(k)
    for r in range(k):
        lo, hi = starts[r], starts[r + 1]
        level, first, last, width = _segments.final_level(lo, hi, chunk)
        longest = max(longest, last - first)
        sums[r] = total(level, first, last, lo, _segments.level_base(n, level, chunk), width)
    return sums, longest


def reference(keys, values):
    uniq, inverse = np.unique(keys, return_inverse=True)
    return uniq, np.bincount(inverse, weights=values, minlength=len(uniq))


CASES = {
    "random": lambda rng, n: rng.integers(-1, 20, n),
    "one id": lambda rng, n: np.full(n, 7),
    "all distinct": lambda rng, n: rng.permutation(n) * 3 - 1,
    "zipf": lambda rng, n: rng.zipf(1.2, n) % 500,
    "hot among few": lambda rng, n: np.where(rng.random(n) < 0.9, 5, rng.integers(0, 9, n)),
}


@pytest.mark.parametrize("chunk", [2, 3, 4, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_every_occurrence_is_summed_once(rng, chunk, case):
    n = int(rng.integers(1, 3000))
    keys = CASES[case](rng, n)
    values = rng.random(n)
    sums, longest = evaluate(keys, values, chunk)
    np.testing.assert_allclose(sums, reference(keys, values)[1], rtol=1e-12)
    assert longest <= chunk
    assert _segments.max_serial_items(keys, chunk) == longest


@pytest.mark.parametrize("length", [1, 4, 5, 16, 17, 64, 65, 257])
@pytest.mark.parametrize("before", [0, 1, 3, 4])
def test_runs_across_window_boundaries(length, before):
    """A hot id after ``before`` smaller ones: every alignment against the windows."""
    keys = np.concatenate([np.arange(before), np.full(length, 20), [30, 31, 31]])
    values = np.arange(keys.shape[0], dtype=np.float64) + 1
    sums, longest = evaluate(keys, values, 4)
    assert sums[before] == values[before:before + length].sum()
    np.testing.assert_array_equal(sums, reference(keys, values)[1])
    assert longest <= 4


def test_levels_cover_any_run():
    """partial_levels(n) levels suffice for every run inside n positions."""
    for chunk in (2, 3, 4, 256):
        for n in (1, 2, chunk, chunk + 1, chunk**2, chunk**2 + 1, 10_000):
            levels = _segments.partial_levels(n, chunk)[0]
            for lo, hi in [(0, n), (1, n), (n // 3, n), (0, max(1, n - 1))]:
                if lo < hi:
                    assert _segments.final_level(lo, hi, chunk)[0] <= levels


@pytest.mark.parametrize("case", ["random", "one id", "all distinct", "hot among few"])
@pytest.mark.parametrize("size", ["one tile", "tiles"])
def test_group_kernels_match_numpy(rng, case, size):
    """group() on the device (simulator): the runs of the stably sorted keys, in one
    launch up to a tile of sorted positions, in three past it (tiles of 256 under the
    simulator: a run across a tile's edge, a tile of one run); no library call but the
    sort."""
    from hbkernels.cuda import _launcher, _runs

    tile = _runs.ITEMS * 32
    n = int(rng.integers(1, 40)) if size == "one tile" else int(rng.choice([tile + 1, 3 * tile + 5]))
    keys = CASES[case](rng, n).astype(np.int32)
    device_keys = _device.xp().asarray(keys)
    launches = _launcher.LAUNCHES[0]
    g = _segments.group(device_keys)
    assert _launcher.LAUNCHES[0] - launches == (1 if n <= tile else 3)
    order, run, starts = (_device.to_host(a) for a in (g.order, g.run, g.starts))
    ids, k = _device.to_host(g.ids), int(_device.to_host(g.count)[0])
    uniq = np.unique(keys)
    assert k == uniq.shape[0]
    np.testing.assert_array_equal(ids[:k], uniq)
    np.testing.assert_array_equal(starts[:k + 1], _segments.run_bounds(keys))
    np.testing.assert_array_equal(order, np.argsort(keys, kind="stable"))
    np.testing.assert_array_equal(run, np.searchsorted(uniq, keys[order]) + 1)


def test_bench_ids_walk_at_most_a_chunk():
    """The issue's case: Zipf(1.05) over 1e7 rows, B*L = 2,097,152 ids; the top id occurs
    ~180,000 times, yet no row group sums more than CHUNK items (<= 1024)."""
    from hbkernels.bench.common import zipf_ids

    ids = zipf_ids(2_097_152, 10**7, 1.05, seed=0)
    assert np.unique(ids, return_counts=True)[1].max() > 50_000
    assert _segments.max_serial_items(ids) == _segments.CHUNK <= 1024


def test_one_id_two_million_times():
    assert _segments.max_serial_items(np.zeros(2_097_152, np.int64)) <= _segments.CHUNK


@pytest.mark.parametrize("case", list(CASES))
def test_run_bounds_from_any_position(rng, case):
    """run_start and run_end (the kernels' searches, here as plain Python) give every sorted
    position its run's bounds, within any range of sorted positions holding it."""
    n = int(rng.integers(1, 300))
    keys = CASES[case](rng, n)
    order = np.argsort(keys, kind="stable")
    starts = _segments.run_bounds(keys)
    run = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    first, last = sorted(rng.integers(0, n + 1, 2))
    for i in range(n):
        lo, hi = starts[run[i]], starts[run[i] + 1]
        assert _segments.run_start(keys, order, 0, i) == lo
        assert _segments.run_end(keys, order, i, n) == hi
        if first <= i < last:
            assert _segments.run_start(keys, order, first, i) == max(lo, first)
            assert _segments.run_end(keys, order, i, last) == min(hi, last)


def test_run_bounds_of_a_run_of_millions():
    keys = np.concatenate([np.zeros(3), np.ones(2_000_000), np.full(5, 2)]).astype(np.int64)
    order = np.arange(keys.shape[0])
    for i in (3, 4, 1_000_000, 2_000_002):
        assert _segments.run_start(keys, order, 0, i) == 3
        assert _segments.run_end(keys, order, i, keys.shape[0]) == 2_000_003


@pytest.mark.parametrize("chunk", [2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_slot_runs_give_the_exact_runs_sums(rng, chunk, case):
    """slot_run's bounds (stand-ins inside a long run) give every window slot of every
    level what the run's exact bounds give: whether it sums, its piece and the partial
    rows it reads, within a range of sorted positions (a table's) as within all."""
    n = int(rng.integers(1, 200))
    keys = CASES[case](rng, n)
    order = np.argsort(keys, kind="stable")
    starts = _segments.run_bounds(keys)
    run = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    for first, last in [(0, n), tuple(sorted(rng.integers(0, n + 1, 2)))]:
        m = last - first
        width = 1
        for level in range(1, _segments.partial_levels(m, chunk)[0] + 1):
            width *= chunk
            for s in range(2 * -(-m // width)):
                w_lo = first + (s // 2) * width
                w_hi = min(w_lo + width, last)
                at = w_lo if s % 2 == 0 else w_hi - 1
                lo = max(starts[run[at]], first)
                hi = min(starts[run[at] + 1], last)
                exact = not (s % 2 == 1 and lo <= w_lo) and \
                    _segments.final_level(lo - first, hi - first, chunk)[0] >= level
                got_lo, got_hi = _segments.slot_run(keys, order, first, last, w_lo, w_hi,
                                                    s % 2 == 1)
                got = got_lo >= 0 and _segments.final_level(got_lo - first, got_hi - first,
                                                            chunk)[0] >= level
                assert got == exact, (first, last, level, s)
                if not exact:
                    continue
                piece = _segments.piece(lo - first, hi - first, level, s // 2, chunk)
                assert _segments.piece(got_lo - first, got_hi - first, level, s // 2,
                                       chunk) == piece
                for q in range(*piece):  # the partial rows (or positions) it sums
                    assert _segments.partial_row(got_lo - first, q, width // chunk, 0) == \
                        _segments.partial_row(lo - first, q, width // chunk, 0)
