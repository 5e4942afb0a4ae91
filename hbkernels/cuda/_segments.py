"""The work decomposition of the sparse backward: occurrences grouped by id, and
long groups summed in pieces, so that no row group sums more than ``CHUNK`` items
one after another, whatever the id frequencies.

:func:`group` (CuPy's argsort, NumPy's under the simulator, then :mod:`._runs`)
sorts the positions ``0..n-1`` stably by key, so each distinct key's occurrences
are contiguous and in input order, and finds the runs:
``run[i]`` is 1 + the distinct index of sorted position ``i``, ``starts[r]`` the
first sorted position of distinct key ``r`` (``starts[K] = n``), ``ids[r]`` the
key, ``count[0] = K``. Sizes are host-known bounds (``n``): nothing is read back.
Without numbered runs, :func:`run_end` and :func:`slot_run` find a sorted position's
run from the sorted keys alone (the fused step's kernels do, after the sort alone).

The sums need no plan arrays: they follow from a run's bounds ``[lo, hi)`` by the
arithmetic of :func:`final_level`, :func:`piece`, :func:`level_base` and
:func:`partial_row`, plain Python functions compiled for the device (``device_*``)
and, with ``numba.njit``, for the CPU (:func:`walks`). Level ``t >= 1`` cuts the
sorted positions into *windows* of ``W_t = CHUNK^t`` positions, aligned to
multiples of ``W_t``; window ``M`` owns two partial rows, ``2M`` for the run
holding its first position and ``2M + 1`` for a run starting inside it and
reaching past its end (at most one does). A run's piece in a window is the sum of
its level ``t - 1`` items there (positions at level 1, else the partial rows of the
window's ``CHUNK`` sub-windows), at most ``CHUNK`` of them. A run whose items at
level ``t`` number more than ``CHUNK`` is summed from its level ``t + 1`` pieces;
its *final level* is the first with at most ``CHUNK`` items, which its consumer
sums in order. Windows are fixed by position, so every sum is taken in a fixed
order: the same bits on every run, and partial rows need no allocation, scan or
atomics (a run with final level ``T`` reaches past every window it starts inside
at levels ``< T``).
"""
import functools
from dataclasses import dataclass

import numba
import numpy as np

from . import _device
from ._launch import inline_device
from ._runs import find_runs, index_dtype

CHUNK = 256  # items one row group sums serially, at most (occurrences or partial rows)


@dataclass
class Grouping:
    """Occurrences grouped by key (``xp`` arrays; entries past ``K`` are undefined):
    ``order`` (sorted position -> input position), ``run`` (sorted position -> 1 +
    distinct index), ``starts`` (``K + 1`` run bounds), ``ids`` (distinct keys),
    ``count`` (``[K, ...]``: see :func:`group`; ``run`` and ``ids`` empty unless numbered)."""

    order: object
    run: object
    starts: object
    ids: object
    count: object


def stable_argsort(xp, keys):
    """Positions sorting ``keys``, ties in input order. CuPy's ``argsort`` is
    Thrust's ``stable_sort_by_key`` (CUB radix sort for integer keys), queued on
    the current stream with no synchronisation."""
    if xp is np:
        return np.argsort(keys, kind="stable")
    return xp.argsort(keys)


def group(keys, count=None, order=None, numbered=True):
    """:class:`Grouping` of ``keys`` (a 1-D integer ``xp`` array, at least one entry),
    queued on the current stream. ``count``: where the count goes (an int64 array: the
    count, then the first key where it has a second entry; any entries past those are
    left as they are), else one allocated here; ``order``: the positions sorted
    (:func:`stable_argsort`), else sorted here; ``numbered=False``: ``run`` and ``ids``
    are left empty (a run's key is ``keys[order[starts[r]]]``)."""
    n = keys.shape[0]
    index = index_dtype(n)
    if order is None:
        order = stable_argsort(_device.xp(), keys)
    grouping = Grouping(order, _device.scratch(n if numbered else 0, index),
                        _device.scratch(n + 1, index),
                        _device.scratch(n if numbered else 0, keys.dtype),
                        _device.scratch(1, np.int64) if count is None else count)
    find_runs(keys, order, grouping.run, grouping.starts, grouping.ids, grouping.count)
    return grouping


# ---------------------------------------------------------------------------
# the sums' arithmetic (device functions and, through numba.njit, CPU functions)
# ---------------------------------------------------------------------------
def final_level(lo, hi, chunk):
    """``(T, first, last, W_T)`` of the run ``[lo, hi)``: its final level ``T`` and
    the items ``[first, last)`` summed there (positions at level 0, window numbers
    at level ``T >= 1``), at most ``chunk`` of them."""
    level = 0
    first = lo
    last = hi
    width = 1
    while last - first > chunk:
        width *= chunk
        level += 1
        first = lo // width
        last = (hi - 1) // width + 1
    return level, first, last, width


def piece(lo, hi, level, window, chunk):
    """``(first, last)``: the level ``level - 1`` items of the run ``[lo, hi)`` inside
    window ``window`` of level ``level >= 1`` (positions, or sub-window numbers)."""
    sub = 1
    for _ in range(level - 1):
        sub *= chunk
    a = lo // sub
    b = (hi - 1) // sub + 1
    return max(a, window * chunk), min(b, (window + 1) * chunk)


def level_base(n, level, chunk):
    """First partial row of level ``level >= 1`` for ``n`` sorted positions (level
    ``t`` has two rows per window: ``2 * ceil(n / W_t)``)."""
    base = 0
    width = 1
    for _ in range(level - 1):
        width *= chunk
        base += 2 * ((n + width - 1) // width)
    return base


def partial_row(lo, m, width, base):
    """The partial row of window ``m`` (level of window size ``width``) holding the
    run starting at ``lo``: ``2m`` when the run holds the window's first position."""
    return base + 2 * m + (1 if lo > m * width else 0)


def run_edge(keys, order, i, bound, direction):
    """The first sorted position from ``i`` in ``direction`` (+1 or -1) whose key (at
    sorted position ``p``: ``keys[order[p]]``) differs from position ``i``'s, else
    ``bound`` (exclusive): a galloping search, then a binary one, ``O(log L)`` reads for
    a run of ``L``."""
    key = keys[order[i]]
    inside = i  # holds the key
    step = 1
    probe = i + direction
    while (probe - bound) * direction < 0 and keys[order[probe]] == key:
        inside = probe
        step *= 2
        probe = inside + direction * step
    if (probe - bound) * direction > 0:
        probe = bound
    while (probe - inside) * direction > 1:  # probe is the bound or holds another key
        mid = (inside + probe) // 2
        if keys[order[mid]] == key:
            inside = mid
        else:
            probe = mid
    return probe


def _searches(edge):
    """``(run_end, run_start, slot_run)`` built on ``edge`` (:func:`run_edge`, or its
    device function)."""

    def run_end(keys, order, i, last):
        """The end of the run holding sorted position ``i`` among the sorted positions
        ``[.., last)`` (:func:`run_edge`)."""
        return edge(keys, order, i, last, 1)

    def run_start(keys, order, first, i):
        """The start of the run holding sorted position ``i`` among the sorted positions
        ``[first, ..)`` (:func:`run_edge`)."""
        return edge(keys, order, i, first - 1, -1) + 1

    def slot_run(keys, order, first, last, w_lo, w_hi, odd):
        """``(lo, hi)`` of the run of a window slot (the window's sorted positions ``[w_lo,
        w_hi)`` among the sorted positions ``[first, last)``, a table's; the even slot's run
        holds ``w_lo``, the odd slot's starts inside the window and reaches past its end),
        or ``(-1, -1)`` when the odd slot has no such run. Exact where the slot's piece or
        the run's final level depend on them; for a run reaching past both ends of the
        window, ``(w_lo - 1, w_hi + 1)``, which give its piece, a final level above the
        window's and its partial rows: only a run's first and last windows search past
        their own."""
        p = w_hi - 1 if odd else w_lo
        key = keys[order[p]]
        right = w_hi < last and keys[order[w_hi]] == key
        if odd:
            if keys[order[w_lo]] == key or not right:
                return -1, -1
            return edge(keys, order, p, w_lo - 1, -1) + 1, edge(keys, order, w_hi, last, 1)
        left = w_lo > first and keys[order[w_lo - 1]] == key
        if left and right:
            return w_lo - 1, w_hi + 1
        lo = edge(keys, order, p, first - 1, -1) + 1 if left else w_lo
        hi = edge(keys, order, w_hi, last, 1) if right else edge(keys, order, p, w_hi, 1)
        return lo, hi

    return run_end, run_start, slot_run


run_end, run_start, slot_run = _searches(run_edge)


device_final_level = inline_device(final_level)
device_piece = inline_device(piece)
device_level_base = inline_device(level_base)
device_partial_row = inline_device(partial_row)
device_run_edge = inline_device(run_edge)
device_run_end, _, device_slot_run = (inline_device(f) for f in _searches(device_run_edge))


def partial_levels(n, chunk):
    """``(levels, rows)``: the partial levels any run of ``n`` sorted positions may
    need, and the partial rows they take (two per window of each level)."""
    levels, rows, width = 0, 0, 1
    while -(-n // width) > chunk:
        width *= chunk
        levels += 1
        rows += 2 * -(-n // width)
    return levels, rows


# ---------------------------------------------------------------------------
# the decomposition's figures, with NumPy
# ---------------------------------------------------------------------------
def run_bounds(keys):
    """``starts`` of the runs of ``keys`` stably sorted (NumPy), as :func:`group` builds
    them on the device: ``K + 1`` entries."""
    counts = np.unique(np.asarray(keys), return_counts=True)[1]
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


@functools.lru_cache(maxsize=None)
def _walks_on_cpu():
    """:func:`walks` of the runs ``starts``, compiled for the CPU on first use."""
    final_level_cpu = numba.njit(final_level)
    piece_cpu = numba.njit(piece)

    @numba.njit(cache=False)
    def walks_of(starts, chunk, levels):
        final = np.zeros(levels + 1, np.int64)
        pieces = np.zeros(levels + 1, np.int64)
        rows = np.zeros(levels + 1, np.int64)
        longest = 0
        for r in range(starts.shape[0] - 1):
            lo = starts[r]
            hi = starts[r + 1]
            level, first, last, _ = final_level_cpu(lo, hi, chunk)
            final[level] += last - first
            longest = max(longest, last - first)
            width = 1
            for t in range(1, level + 1):
                width *= chunk
                for m in range(lo // width, (hi - 1) // width + 1):
                    a, b = piece_cpu(lo, hi, t, m, chunk)
                    pieces[t] += b - a
                    rows[t] += 1
                    longest = max(longest, b - a)
        return final, pieces, rows, longest

    return walks_of


@dataclass
class Walks:
    """What the sums of :func:`group`'s runs read, per level ``t`` (NumPy arrays):
    ``final[t]`` items summed by the final sums of the runs whose final level is
    ``t`` (occurrences at 0, partial rows above), ``pieces[t]`` items summed into
    level ``t``'s partial rows (``t >= 1``), ``rows[t]`` those rows; ``longest``:
    the most items one row group sums one after another."""

    final: object
    pieces: object
    rows: object
    longest: int


def walks(keys, chunk=None):
    """:class:`Walks` of the decomposition of ``keys`` (NumPy)."""
    chunk = CHUNK if chunk is None else chunk
    starts = run_bounds(keys)
    final, pieces, rows, longest = _walks_on_cpu()(starts, chunk,
                                                   partial_levels(int(starts[-1]), chunk)[0])
    return Walks(final, pieces, rows, int(longest))


def max_serial_items(keys, chunk=None):
    """The most items any row group sums one after another for ``keys``."""
    return walks(keys, chunk).longest
