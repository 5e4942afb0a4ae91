"""What a case's rows cost the machine's memory: a same-run bound for the training-path
benchmarks (:meth:`.common.Context.compare`'s ``bounds``).

:func:`gather_scatter` reads each distinct row the case's ids name once, in the order the
ids first name them (a random gather for scattered and uniform ids, a run of neighbouring
rows for ids ranked by frequency), and for a step writes each back once, with the
machine's threads and the library's prefetch distance (``prefetch_ids``), and nothing
else: no pooling, no sums per bag, no sort, no optimizer state. Its time is the least
traffic of that layout's rows, so a provider's time over it reads as what the provider
pays on top of the memory its layout takes.
"""
import numba
import numpy as np

from ..cpu._common import prefetch_ids, prefetch_row
from .common import Provider

BOUND = "gather-scatter"


@numba.njit(parallel=True, cache=True, fastmath=True)  # (the sum vectorised: loads, not adds)
def _read(table, rows, out):
    ahead = prefetch_ids(table.shape[1] * table.itemsize)
    for i in numba.prange(rows.shape[0]):
        if i + ahead < rows.shape[0]:
            prefetch_row(table, rows[i + ahead], table.shape[1])
        row = rows[i]
        total = table[row, 0] * 0
        for d in range(table.shape[1]):
            total += table[row, d]
        out[i] = total


@numba.njit(parallel=True, cache=True)
def _read_write(table, rows):
    ahead = prefetch_ids(table.shape[1] * table.itemsize)
    for i in numba.prange(rows.shape[0]):
        if i + ahead < rows.shape[0]:
            prefetch_row(table, rows[i + ahead], table.shape[1])
        row = rows[i]
        for d in range(table.shape[1]):
            table[row, d] = table[row, d] + 0.0  # (not folded: -0.0 + 0.0 is +0.0)


def gather_scatter(step=True, table="w", ids="ids"):
    """The :data:`BOUND` provider of a case whose inputs hold its 2-D ``table`` and its
    ``ids``: each distinct row read once, in the order the ids first name them, and
    (``step``) written back once (its values unchanged). CPU arrays only."""

    def prepare(a):
        named = np.asarray(a[ids], np.int64)
        distinct, first = np.unique(named, return_index=True)
        rows = distinct[np.argsort(first)]
        return {"w": a[table], "rows": rows, "out": np.empty(rows.shape[0], a[table].dtype)}

    def run(a):
        if step:
            _read_write(a["w"], a["rows"])
            return a["rows"]
        _read(a["w"], a["rows"], a["out"])
        return a["out"]

    return Provider(BOUND, run, prepare=prepare)
