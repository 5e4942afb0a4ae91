"""CSR segment reduction on the CPU: the pooling kernel of embedding_bag over rows in place."""
from ._common import first_bad_offset
from .embedding_bag import pool


def segment_reduce(family, data, offsets, combiner):
    bad_offset = first_bad_offset(offsets, data.shape[0])
    if bad_offset != -1:
        return None, bad_offset
    out, _, _ = pool(data, None, offsets, None, combiner, False, True)
    return out, -1
