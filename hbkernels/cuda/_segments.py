"""The work decomposition of the sparse backward: occurrences grouped by id, and
long groups cut into chunks, so that no row group sums more than ``CHUNK`` items
one after another, whatever the id frequencies.

Written against an array module ``xp`` (CuPy on a GPU, NumPy under the simulator
and in CPU-only tests), with every size a host-known upper bound: building it
reads nothing back to the host.

* :func:`group`: the positions ``0..n-1`` stably sorted by key (``xp.argsort``:
  CUB radix sort on a GPU), so each distinct key's occurrences are contiguous and
  in input order; ``seg[i]`` is the distinct index (0, 1, ...) of sorted
  position ``i``, ``ids[r]`` the ``r``-th distinct key, ``count[0]`` their number
  ``K`` (a device array).
* :func:`plan`: level 0 has the ``n`` sorted occurrences as items, each with its
  segment (distinct index). A segment of at most ``CHUNK`` items is *final* at
  that level: its consumer sums the items itself. A longer one is cut into
  chunks of ``CHUNK`` items (the last shorter); each chunk's sum is one item of
  the next level (a *partial* row), with the same segment. Level ``t + 1`` has
  at most ``m_t // CHUNK + m_t // (CHUNK + 1)`` items and its segments at most
  ``ceil(len_t / CHUNK)`` of them, so after ``ceil(log_CHUNK(n)) - 1`` levels
  every segment is final. The sums are taken in a fixed order (chunks in
  position order, partials in chunk order): the result has the same bits on
  every run.

Per segment ``r`` the plan records ``final_level[r]`` and the item range
``[final_lo[r], final_hi[r])``: sorted positions at level 0, rows of the partial
buffer at levels >= 1 (one buffer; level ``t`` starts at row ``base[t]``).
Per level ``t >= 1`` it records the chunks that make its items:
``chunk_lo/hi`` (items of level ``t - 1``, in that level's coordinates) and the
number of partial rows (``Level.rows``, a bound; unused rows are empty chunks).
"""
from dataclasses import dataclass, field

import numpy as np

CHUNK = 256  # items one row group sums serially, at most (occurrences or partial rows)


@dataclass
class Grouping:
    """Occurrences grouped by key: ``order`` (sorted position -> input position),
    ``seg`` (sorted position -> distinct index), ``starts`` (distinct index ->
    first sorted position; ``n`` from ``K`` on), ``ids`` (distinct keys; entries
    past ``count[0]`` are padding), ``count`` (``[K]``, on the device)."""

    order: object
    seg: object
    starts: object
    ids: object
    count: object


@dataclass
class Level:
    """The partial rows of one level >= 1: row ``base + c`` is the sum of items
    ``[lo[c], hi[c])`` of the level below (``lo == hi`` for unused rows)."""

    base: int
    rows: int
    lo: object
    hi: object


@dataclass
class Plan:
    final_level: object
    final_lo: object
    final_hi: object
    levels: list = field(default_factory=list)

    @property
    def partial_rows(self):
        """Rows of the partial buffer (0: no segment needs partials)."""
        return sum(level.rows for level in self.levels)


def stable_argsort(xp, keys):
    """Positions sorting ``keys``, ties in input order. CuPy's ``argsort`` is
    Thrust's ``stable_sort_by_key`` (CUB radix sort for integer keys), queued on
    the current stream with no synchronisation."""
    if xp is np:
        return np.argsort(keys, kind="stable")
    return xp.argsort(keys)


def group(xp, keys):
    """:class:`Grouping` of ``keys`` (a 1-D integer array, at least one entry)."""
    n = keys.shape[0]
    order = stable_argsort(xp, keys)
    sorted_keys = keys[order]
    head = xp.empty(n, np.bool_)
    head[0] = True
    head[1:] = sorted_keys[1:] != sorted_keys[:-1]
    seg = xp.cumsum(head, dtype=np.int64) - 1
    starts = xp.full(n + 2, n, np.int64)  # entry n + 1 collects the positions that start nothing
    starts[xp.where(head, seg, n + 1)] = xp.arange(n, dtype=np.int64)
    return Grouping(order, seg, starts[:n + 1], sorted_keys[xp.minimum(starts[:n], n - 1)],
                    seg[n - 1:] + 1)


def plan(xp, grouping, chunk):
    """:class:`Plan` of the sums of a :class:`Grouping`'s segments."""
    seg = grouping.seg
    num_segments_bound = seg.shape[0]
    nseg = num_segments_bound
    final_level = xp.zeros(nseg + 1, np.int64)  # entry nseg collects non-final items
    final_lo = xp.zeros(nseg + 1, np.int64)
    final_hi = xp.zeros(nseg + 1, np.int64)
    result = Plan(final_level[:nseg], final_lo[:nseg], final_hi[:nseg])
    items_seg = seg
    longest = seg.shape[0]  # host bound on a segment's items at this level
    offset = 0  # where this level's items start in the partial buffer (level >= 1)
    level = 0
    while True:
        m = items_seg.shape[0]
        idx = xp.arange(m, dtype=np.int64)
        if level == 0:  # the items' segments are their runs: the grouping has their bounds
            head = grouping.starts[seg] == idx
            lo = grouping.starts[seg]
            hi = grouping.starts[seg + 1]
        else:
            head = xp.empty(m, np.bool_)
            head[0] = True
            head[1:] = items_seg[1:] != items_seg[:-1]
            tail = xp.empty(m, np.bool_)
            tail[-1] = True
            tail[:-1] = head[1:]
            run = xp.cumsum(head, dtype=np.int64) - 1
            run_lo = xp.zeros(m + 1, np.int64)
            run_hi = xp.zeros(m + 1, np.int64)
            run_lo[xp.where(head, run, m)] = idx
            run_hi[xp.where(tail, run, m)] = idx + 1
            lo = run_lo[run]
            hi = run_hi[run]
        valid = items_seg < nseg  # padding items carry segment nseg
        is_long = valid & (hi - lo > chunk)
        where = xp.where(valid & head & ~is_long, items_seg, nseg)
        final_level[where] = level
        final_lo[where] = lo + offset
        final_hi[where] = hi + offset
        if longest <= chunk:
            return result
        cut = is_long & ((idx - lo) % chunk == 0)
        rows = m // chunk + m // (chunk + 1)  # chunks of segments longer than chunk, at most
        slot = xp.where(cut, xp.cumsum(cut, dtype=np.int64) - 1, rows)
        next_seg = xp.full(rows + 1, nseg, np.int64)
        chunk_lo = xp.zeros(rows + 1, np.int64)
        chunk_hi = xp.zeros(rows + 1, np.int64)
        next_seg[slot] = items_seg
        chunk_lo[slot] = idx + offset
        chunk_hi[slot] = xp.minimum(idx + chunk, hi) + offset
        offset = result.partial_rows
        result.levels.append(Level(offset, rows, chunk_lo[:rows], chunk_hi[:rows]))
        items_seg = next_seg[:rows]
        longest = -(-longest // chunk)
        level += 1


def max_serial_items(xp, keys, chunk=CHUNK):
    """The most items any row group sums one after another in the decomposition
    :func:`group` and :func:`plan` build for ``keys``: the longest chunk or final
    segment (computed with ``xp``; NumPy for the figures of the kernel model)."""
    grouping = group(xp, keys)
    p = plan(xp, grouping, chunk)
    k = int(grouping.count[0])
    longest = int((p.final_hi[:k] - p.final_lo[:k]).max())
    for level in p.levels:
        if level.rows:
            longest = max(longest, int((level.hi - level.lo).max()))
    return longest
