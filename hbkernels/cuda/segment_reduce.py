"""CSR segment reduction on the GPU: the pooling kernel of embedding_bag over rows in place.

Segment ``b`` reduces rows ``data[offsets[b]:offsets[b+1]]`` (row = position,
weight 1): sum, mean (/ length) or sqrtn (/ sqrt(length)); empty gives zeros.
Offsets are always validated; the check is left pending (:mod:`._pending`).
"""
from .._validate import raise_bad_offsets
from . import _pending
from .embedding_bag import empty_batch_bad_offset, pool


def segment_reduce(family, data, offsets, combiner):
    n_rows = data.shape[0]
    if offsets.shape[0] == 1:
        bad_offset = empty_batch_bad_offset(family, offsets, n_rows)
        return family.empty((0, data.shape[1]), data.dtype), bad_offset

    def report(bad):
        raise_bad_offsets(family, offsets, n_rows, bad[0], "data.shape[0]")

    with _pending.checks(2, "segment_reduce", report, (offsets,)) as slots:
        out = pool(family, data, None, offsets, n_rows, None, combiner, True, True, False, slots)
    return out, -1
