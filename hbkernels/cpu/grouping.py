"""The occurrences of a batch grouped by distinct id, in parallel: the first half
of the CPU backward and of the fused optimizer step.

Given the ids ``values`` of bags ``offsets`` (per-sample weights optional), each
kept occurrence ``j`` of bag ``b`` is ``(id, bag, c_b·w_j)``, ``c_b`` the bag's
scale (1, ``1/Σw`` or ``1/sqrt(Σw²)`` over its in-range ids, 0 where that is 0;
bad ids are dropped when asked). Bags are int32 (int64 from 2**31 bags on). With
combiner sum and no weights every coefficient is 1: the coefficients are then an
empty array and none is written or read (:func:`coefficient` reads them).

Every id goes to one of ``2**bits`` partitions by the top bits of its Fibonacci
hash (``bits`` grows with the batch: about :data:`OCCURRENCES_PER_PARTITION`
occurrences a partition, at most :data:`MAX_PARTITIONS`), so the partitions are
independent:

1. chunks of bags count their occurrences per partition in parallel;
2. a prefix sum (partition-major, chunks in input order) gives each chunk's
   place in each partition; the chunks scatter ``(id, bag, c_b·w_j)`` there in
   parallel, so each partition holds its occurrences in input order
   (:func:`partition_occurrences`, a :class:`Partitions`);
3. the partitions, in parallel, find their distinct ids in a hash table of
   their own (small: it stays in cache) and number each occurrence by its
   distinct id (:func:`group_occurrences`, a :class:`Groups`).

Nothing is sorted: a caller walks a partition's occurrences in input order and
adds each one's gradient row into the row of its distinct id, in a block of the
partition's rows that stays in cache; every sum so runs in input order. The
groups depend on the batch alone, not on the number of threads: deterministic.

The occurrence arrays live in per-thread scratch buffers kept between calls
(up to :data:`SCRATCH_MAX_BYTES` each): a fresh array of a few MB costs a
page fault per 4 KiB on first touch, which took longer than the grouping. They
are valid until the calling thread's next call.
"""
import threading
from typing import NamedTuple

import numpy as np
from numba import njit, prange

from .._modes import Combiner
from ._common import cached_njit, chunk_count, fib_hash

OCCURRENCES_PER_PARTITION = 2048
MAX_PARTITIONS = 256
# the partitions are the parallel work items of the sums over groups: at least 2**6 of them
MIN_PARTITION_BITS = 6


SCRATCH_MAX_BYTES = 256 << 20
_scratch = threading.local()


def scratch(name, size, dtype):
    """A 1-d array of ``size`` elements of ``dtype``, uninitialised: a view of this
    thread's buffer ``name`` (grown as needed) when it takes at most
    :data:`SCRATCH_MAX_BYTES`, else a fresh array."""
    dtype = np.dtype(dtype)
    if size * dtype.itemsize > SCRATCH_MAX_BYTES:
        return np.empty(size, dtype)
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get(name)
    if buffer is None or buffer.dtype != dtype or buffer.shape[0] < size:
        buffer = buffers[name] = np.empty(max(size, 1024), dtype)
    return buffer[:size]


def partition_bits(num_occurrences):
    """log2 of the number of partitions for a batch of ``num_occurrences``."""
    bits = 0
    while (1 << bits) < MAX_PARTITIONS and (num_occurrences >> bits) > OCCURRENCES_PER_PARTITION:
        bits += 1
    return bits


@njit(inline="always")
def _partition(key, bits):
    if bits == 0:
        return 0
    return np.int64(fib_hash(np.uint64(key)) >> np.uint64(64 - bits))


@njit(inline="always")
def coefficient(occ_coef, s, one):
    """The coefficient of occurrence ``s``: ``occ_coef[s]``, or ``one`` when
    ``occ_coef`` is empty (all ones)."""
    return one if occ_coef.shape[0] == 0 else occ_coef[s]


@njit(inline="always")
def _bad(v, num_rows, skip_bad):
    return skip_bad and (v < 0 or v >= num_rows)


@cached_njit(parallel=True)
def _histogram(values, offsets, num_rows, skip_bad, bits, chunk_bags, first_bad):
    """``[chunks, partitions]`` counts of the (kept) occurrences of each bag chunk; the
    first bad position of chunk ``c`` (dropped when ``skip_bad``) to ``first_bad[c]``, -1
    where none."""
    num_chunks = chunk_bags.shape[0] - 1
    hist = np.zeros((num_chunks, 1 << bits), np.int64)
    for c in prange(num_chunks):
        bad = -1
        for j in range(offsets[chunk_bags[c]], offsets[chunk_bags[c + 1]]):
            v = values[j]
            if _bad(v, num_rows, skip_bad):
                if bad == -1:
                    bad = j
            else:
                hist[c, _partition(v, bits)] += 1
        first_bad[c] = bad
    return hist


@cached_njit(parallel=True)
def _scatter(values, offsets, weights, weighted, combiner, num_rows, skip_bad, bits,
             chunk_bags, base, s_ids, s_bag, s_coef):
    """Each chunk writes its kept occurrences from ``base[c, p]`` on in partition ``p``
    (their coefficients only when ``s_coef`` is not empty)."""
    unit = s_coef.shape[0] == 0
    for c in prange(chunk_bags.shape[0] - 1):
        pos = base[c].copy()
        for b in range(chunk_bags[c], chunk_bags[c + 1]):
            lo, hi = offsets[b], offsets[b + 1]
            scale = 1.0
            if combiner != Combiner.SUM:
                w_sum = 0.0
                w_sq = 0.0
                for j in range(lo, hi):
                    if _bad(values[j], num_rows, skip_bad):
                        continue
                    w = weights[j] if weighted else 1.0
                    w_sum += w
                    w_sq += w * w
                if combiner == Combiner.MEAN:
                    scale = 1.0 / w_sum if w_sum != 0.0 else 0.0
                else:
                    scale = 1.0 / np.sqrt(w_sq) if w_sq != 0.0 else 0.0
            for j in range(lo, hi):
                v = values[j]
                if _bad(v, num_rows, skip_bad):
                    continue
                p = _partition(v, bits)
                k = pos[p]
                pos[p] = k + 1
                s_ids[k] = v
                s_bag[k] = b
                if not unit:
                    s_coef[k] = scale * weights[j] if weighted else scale


@cached_njit(parallel=True)
def _distinct_partitions(bits, part_lo, s_ids, t_ids, local, num_distinct):
    """Step 3 per partition ``p`` (occurrences ``[lo, hi)``): its ``n`` distinct ids to
    ``t_ids[lo:lo+n]`` in first-occurrence order, each occurrence's index among them
    to ``local``, ``n`` to ``num_distinct[p]``. A hash table of the partition's own,
    at least twice its size, finds them."""
    for p in prange(part_lo.shape[0] - 1):
        lo, hi = part_lo[p], part_lo[p + 1]
        table_bits = 4
        while (1 << table_bits) < 2 * (hi - lo):
            table_bits += 1
        mask = (1 << table_bits) - 1
        slots = np.full(1 << table_bits, -1, np.int32)  # (< 2**31 distinct ids a partition)
        n = 0
        for i in range(lo, hi):
            key = s_ids[i]
            h = np.int64((fib_hash(np.uint64(key)) << np.uint64(bits))
                         >> np.uint64(64 - table_bits))
            while True:
                u = slots[h]
                if u == -1:
                    u = n
                    slots[h] = u
                    t_ids[lo + u] = key
                    n += 1
                    break
                if t_ids[lo + u] == key:
                    break
                h = (h + 1) & mask
            local[i] = u
        num_distinct[p] = n


def bag_chunks(offsets):
    """Boundaries (int64, first 0, last B) cutting the bags into
    :func:`._common.chunk_count` runs of about equal numbers of occurrences."""
    num_bags = offsets.shape[0] - 1
    num_chunks = chunk_count(num_bags)
    targets = np.arange(1, num_chunks, dtype=np.float64) * (offsets[-1] / num_chunks)
    inner = np.searchsorted(offsets, targets, side="left")
    return np.concatenate(([0], np.minimum(inner, num_bags), [num_bags])).astype(np.int64)


class Partitions(NamedTuple):
    """A batch's kept occurrences scattered into hash partitions, each in input order:
    partition ``p`` holds ``[lo[p], lo[p+1])`` of ``ids`` (the id, in
    :func:`kept_id_dtype`), ``bag`` and
    ``coef`` (``c_b·w_j``; empty when all are 1). ``bits``: log2 of their number.
    ``first_bad``: the first position of an id outside the table (-1: none, or not
    looked for); when the caller stops there the arrays are left empty.
    The arrays are this thread's scratch (see the module's note)."""
    bits: int
    lo: np.ndarray
    ids: np.ndarray
    bag: np.ndarray
    coef: np.ndarray
    first_bad: int = -1

    @property
    def count(self):
        return self.lo.shape[0] - 1

    @property
    def total(self):
        return int(self.lo[-1])


def partition_occurrences(values, offsets, per_sample_weights, combiner, num_rows, skip_bad,
                          coef_dtype, stop_at_bad=False):
    """Steps 1 and 2 above: the :class:`Partitions` of a batch (at least
    ``2**MIN_PARTITION_BITS`` of them); coefficients in ``coef_dtype``, bad ids (outside
    ``[0, num_rows)``) dropped when ``skip_bad``, their first position found; with
    ``stop_at_bad`` (and ``skip_bad``) a batch with one stops after step 1."""
    weighted = per_sample_weights is not None
    weights = (per_sample_weights.astype(coef_dtype, copy=False) if weighted
               else np.ones(1, coef_dtype))
    bits = max(partition_bits(values.shape[0]), MIN_PARTITION_BITS)
    chunks = bag_chunks(offsets)
    bad = np.empty(chunks.shape[0] - 1, np.int64)
    hist = _histogram(values, offsets, num_rows, skip_bad, bits, chunks, bad)
    found = bad[bad >= 0]
    first_bad = int(found[0]) if found.shape[0] else -1  # (chunks in input order)
    if stop_at_bad and first_bad != -1:
        empty = np.empty(0, values.dtype)
        return Partitions(bits, np.zeros(1, np.int64), empty, np.empty(0, bag_dtype(offsets)),
                          np.empty(0, coef_dtype), first_bad)
    flat = hist.T.reshape(-1)      # partition-major: a partition's chunks in input order
    ends = np.cumsum(flat)
    base = np.ascontiguousarray((ends - flat).reshape(hist.shape[1], hist.shape[0]).T)
    total = int(ends[-1]) if ends.shape[0] else 0
    part_lo = np.zeros(hist.shape[1] + 1, np.int64)
    part_lo[1:] = ends.reshape(hist.shape[1], hist.shape[0])[:, -1]
    num_coefs = 0 if combiner == Combiner.SUM and not weighted else total
    s_ids = scratch("s_ids", total, kept_id_dtype(values, num_rows, skip_bad))
    s_bag = scratch("s_bag", total, bag_dtype(offsets))
    s_coef = scratch("s_coef", num_coefs, weights.dtype)
    _scatter(values, offsets, weights, weighted, combiner, num_rows, skip_bad, bits, chunks,
             base, s_ids, s_bag, s_coef)
    return Partitions(bits, part_lo, s_ids, s_bag, s_coef, first_bad)


def kept_id_dtype(values, num_rows, skip_bad):
    """The dtype the partitions hold ids in: int32 where every kept id fits (all kept
    ids are in ``[0, num_rows)`` when ``skip_bad``), else that of ``values``."""
    if skip_bad and num_rows <= np.iinfo(np.int32).max + 1:
        return np.dtype(np.int32)
    return values.dtype


def bag_dtype(offsets):
    """int32 bag numbers, int64 from 2**31 bags on."""
    return np.int32 if offsets.shape[0] - 1 <= np.iinfo(np.int32).max else np.int64


class Groups(NamedTuple):
    """A batch's occurrences grouped by distinct id inside each of its
    :class:`Partitions`: partition ``p``'s distinct ids are ``ids[lo[p]:lo[p]+n]``
    (``n = first[p+1] - first[p]``; the dtype of ``parts.ids``), in first-occurrence
    order, and ``local[i]`` is
    occurrence ``i``'s index among them. Numbered over the whole batch, they are the
    ``first[p] + u``-th, ``first[-1]`` in all. Arrays are this thread's scratch."""
    parts: Partitions
    ids: np.ndarray
    local: np.ndarray
    first: np.ndarray

    @property
    def count(self):
        return int(self.first[-1])


def group_occurrences(values, offsets, per_sample_weights, combiner, num_rows, skip_bad,
                      coef_dtype, stop_at_bad=False):
    """The :class:`Groups` of a batch: steps 1 to 3 above; coefficients in
    ``coef_dtype``, bad ids (outside ``[0, num_rows)``) dropped when ``skip_bad``; with
    ``stop_at_bad`` a batch with one is not grouped (no groups; ``parts.first_bad``)."""
    parts = partition_occurrences(values, offsets, per_sample_weights, combiner, num_rows,
                                  skip_bad, coef_dtype, stop_at_bad)
    if stop_at_bad and parts.first_bad != -1:
        return Groups(parts, parts.ids, np.empty(0, np.int32), np.zeros(1, np.int64))
    ids = scratch("t_ids", parts.total, parts.ids.dtype)
    local = scratch("local", parts.total, np.int32 if parts.total < 2**31 else np.int64)
    num_distinct = np.zeros(parts.count, np.int64)
    _distinct_partitions(parts.bits, parts.lo, parts.ids, ids, local, num_distinct)
    first = np.zeros(parts.count + 1, np.int64)
    np.cumsum(num_distinct, out=first[1:])
    return Groups(parts, ids, local, first)
