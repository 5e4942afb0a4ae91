"""Small containers of the public contract."""
from typing import Any, NamedTuple


class Ragged(NamedTuple):
    """A batch of variable-length id lists in CSR form.

    ``values[offsets[b]:offsets[b + 1]]`` are the ids of bag ``b``; ``offsets``
    has ``B + 1`` entries, starts at 0, never decreases and ends at ``len(values)``.

    >>> import numpy as np, hbkernels as hbk
    >>> r = hbk.Ragged(np.array([3, 1, 4]), np.array([0, 2, 2, 3]))
    >>> r.batch_size
    3
    """

    values: Any
    offsets: Any

    @property
    def batch_size(self) -> int:
        return int(self.offsets.shape[0]) - 1


class Partitioned(NamedTuple):
    """Ids grouped by owning shard: ``ids == input[order]``; shard ``s`` holds
    ``ids[sum(counts[:s]) : sum(counts[:s + 1])]``, in input order (stable)."""

    ids: Any
    counts: Any
    order: Any


class SparseGrad(NamedTuple):
    """A row-sparse gradient of a table: ``rows[k]`` is the gradient of row ``ids[k]``.

    :func:`hbkernels.embedding_bag_backward` returns distinct ids; a
    ``SparseGrad`` built by hand may repeat ids (the optimizers sum duplicates).
    """

    ids: Any
    rows: Any
