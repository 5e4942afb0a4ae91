"""The work decomposition of the sparse backward: occurrences grouped by id, and
long groups summed in pieces, so that no row group sums more than ``CHUNK`` items
one after another, whatever the id frequencies.

:func:`group` (CuPy's argsort and cumsum around two Numba kernels; NumPy under
the simulator) sorts the positions ``0..n-1`` stably by key, so each distinct
key's occurrences are contiguous and in input order, and finds the runs:
``run[i]`` is 1 + the distinct index of sorted position ``i``, ``starts[r]`` the
first sorted position of distinct key ``r`` (``starts[K] = n``), ``ids[r]`` the
key, ``count[0] = K``. Sizes are host-known bounds (``n``): nothing is read back.

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
from numba import cuda

from . import _device
from ._launch import blocks_for, inline_device, threads_per_block
from ._launcher import launch

CHUNK = 256  # items one row group sums serially, at most (occurrences or partial rows)


@dataclass
class Grouping:
    """Occurrences grouped by key (``xp`` arrays; entries past ``K`` are undefined):
    ``order`` (sorted position -> input position), ``run`` (sorted position -> 1 +
    distinct index), ``starts`` (``K + 1`` run bounds), ``ids`` (distinct keys),
    ``count`` (``[K]``)."""

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


def index_dtype(n):
    """Positions and run numbers of ``n`` items: int32 when they fit."""
    return np.dtype(np.int32) if n < 2**31 - 1 else np.dtype(np.int64)


@cuda.jit
def heads_kernel(keys, order, heads):
    """``heads[i] = 1`` where sorted position ``i`` starts a run, else 0."""
    for i in range(cuda.grid(1), order.shape[0], cuda.gridsize(1)):
        here = keys[order[i]]
        heads[i] = 1 if i == 0 or keys[order[i - 1]] != here else 0


@cuda.jit
def compact_kernel(keys, order, run, starts, ids, count):
    """Run bounds, distinct keys and their count from the inclusive scan of the heads."""
    n = run.shape[0]
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        here = run[i]
        before = run[i - 1] if i > 0 else 0
        p = order[i]  # loaded with the run numbers, used at heads only
        r = here - 1
        if here != before:
            starts[r] = i
            ids[r] = keys[p]
        if i == n - 1:
            starts[r + 1] = n
            count[0] = r + 1


def group(keys):
    """:class:`Grouping` of ``keys`` (a 1-D integer ``xp`` array, at least one entry),
    queued on the current stream."""
    xp = _device.xp()
    n = keys.shape[0]
    index = index_dtype(n)
    order = stable_argsort(xp, keys)
    heads = _device.scratch(n, np.int8)
    tpb = threads_per_block()
    blocks = blocks_for(n, tpb)
    launch(heads_kernel, blocks, tpb, keys, order, heads)
    run = xp.cumsum(heads, dtype=index)
    starts = _device.scratch(n + 1, index)
    ids = _device.scratch(n, keys.dtype)
    count = _device.scratch(1, np.int64)
    launch(compact_kernel, blocks, tpb, keys, order, run, starts, ids, count)
    return Grouping(order, run, starts, ids, count)


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


device_final_level = inline_device(final_level)
device_piece = inline_device(piece)
device_level_base = inline_device(level_base)
device_partial_row = inline_device(partial_row)


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
