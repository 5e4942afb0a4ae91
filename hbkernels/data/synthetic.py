"""Synthetic multi-table click data with Zipf-distributed ids, as Parquet.

Each table ``t`` with ``N`` rows gives one id column. Ids follow the bounded
Zipf law over ranks ``k = 1..N``:

    P(rank k) = k**-alpha / H,   H = sum(j**-alpha for j in 1..N)

drawn by inverse CDF (a uniform ``u`` -> the first rank whose CDF exceeds it,
found from a guide table: the first rank past each of ``N`` equal steps of ``u``,
then a short scan); rank ``k`` is then sent through one fixed random permutation of ``0..N-1``, so
the hot rows are scattered over the table. A row holds one id (``hotness = 1``,
not variable: an int64 column) or a bag of ids (a ``list<int64>`` column) of
``hotness`` ids, or of a length uniform in ``[1, 2 * hotness - 1]`` (mean
``hotness``) when variable. Ids inside a bag may repeat. Every row also has a
``label`` (int32, 1 with probability :data:`POSITIVE_RATE`) and ``dense``
float32 features ``d0, d1, ...`` uniform in ``[0, 1)``.

Memory: the CDF, the guide table and the permutation (24 bytes per table row), plus
one row group.
"""
from typing import NamedTuple

import numpy as np

from .._numba_cache import cached_njit
from ._io import ROW_GROUP_SIZE, RowGroupWriter, require_pyarrow

POSITIVE_RATE = 0.25
"""Probability that a synthetic ``label`` is 1."""


class SyntheticTable(NamedTuple):
    """One id column of :func:`write_synthetic`: ids in ``[0, num_rows)``, bags of
    ``hotness`` ids (mean ``hotness`` when ``variable``)."""

    name: str
    num_rows: int
    hotness: int = 1
    variable: bool = False


class ZipfIds:
    """Sampler of ids in ``[0, num_rows)``: bounded Zipf(alpha) ranks, permuted."""

    def __init__(self, num_rows, alpha, rng):
        weights = np.arange(1, num_rows + 1, dtype=np.float64) ** -alpha
        self.cdf = np.cumsum(weights)
        self.cdf /= self.cdf[-1]
        self.row_of_rank = rng.permutation(num_rows)
        # guide[j]: the first rank whose CDF exceeds j / num_rows
        self.guide = np.searchsorted(self.cdf, np.arange(num_rows) / num_rows, side="right")

    def sample(self, size, rng):
        return self.row_of_rank[inverse_cdf(self.cdf, self.guide, rng.random(size))]


def _inverse_cdf(cdf, guide, u):
    """For each ``u``: the first index whose ``cdf`` exceeds it, at most ``len(cdf) - 1``
    (``np.minimum(np.searchsorted(cdf, u, side="right"), len(cdf) - 1)``, the same
    bits). ``guide[j]`` is the first index whose ``cdf`` exceeds ``j / len(guide)``:
    the scan for ``u`` starts one step below ``u``'s, so float rounding of
    ``u * len(guide)`` cannot start it past the answer, and walks a few entries
    (a mispredicted branch per level of a binary search costs more)."""
    n, m = cdf.shape[0], guide.shape[0]
    out = np.empty(u.shape[0], np.int64)
    for k in range(u.shape[0]):
        x = u[k]
        j = min(int(x * m), m - 1)
        i = guide[max(j - 1, 0)]
        while i < n - 1 and cdf[i] <= x:
            i += 1
        out[k] = i
    return out


inverse_cdf = cached_njit(_inverse_cdf, nogil=True)  # batches may be made on several threads


def write_synthetic(path, num_rows, tables, *, alpha=1.05, seed=0,
                    row_group_size=ROW_GROUP_SIZE, dense=0):
    """Write ``num_rows`` rows of Zipf(``alpha``) ids for each of ``tables`` to
    the Parquet file ``path``, with ``label`` and ``dense`` float columns
    ``d0..`` (the law and the layout in :mod:`hbkernels.data.synthetic`).

    ``tables``: :class:`SyntheticTable`, tuples ``(name, num_rows, hotness[,
    variable])`` or dicts with those keys. The same arguments write the same
    file. Returns a :class:`~hbkernels.data._io.WriteSummary`.

    >>> import os, tempfile
    >>> from hbkernels.data import write_synthetic
    >>> path = os.path.join(tempfile.mkdtemp(), "synthetic.parquet")
    >>> print(write_synthetic(path, 1000, [("user", 100, 1), ("items", 5000, 4, True)],
    ...                       dense=2, row_group_size=256))
    wrote 1000 rows in 4 row groups to ...synthetic.parquet
    """
    require_pyarrow()
    import pyarrow as pa

    tables = [_table_spec(t) for t in tables]
    if int(num_rows) != num_rows or num_rows < 0:
        raise ValueError(f"num_rows must be a non-negative integer, got {num_rows!r}")
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    dense_names = [f"d{i}" for i in range(int(dense))]
    names = ["label", *dense_names, *[t.name for t in tables]]
    if len(set(names)) != len(names):
        raise ValueError(f"column names must be distinct, got {names}")
    schema = pa.schema([("label", pa.int32()), *[(d, pa.float32()) for d in dense_names],
                        *[(t.name, pa.int64() if _is_scalar(t) else pa.list_(pa.int64()))
                          for t in tables]])
    rng = np.random.default_rng(seed)
    samplers = [ZipfIds(t.num_rows, alpha, rng) for t in tables]
    writer = RowGroupWriter(path, schema, row_group_size)
    try:
        for start in range(0, int(num_rows), writer.row_group_size):
            size = min(writer.row_group_size, int(num_rows) - start)
            columns = [pa.array((rng.random(size) < POSITIVE_RATE).astype(np.int32))]
            columns += [pa.array(rng.random(size, dtype=np.float32)) for _ in dense_names]
            columns += [_id_column(t, sampler, size, rng) for t, sampler in zip(tables, samplers)]
            writer.write(pa.RecordBatch.from_arrays(columns, schema=schema))
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def _table_spec(table):
    spec = SyntheticTable(**table) if isinstance(table, dict) else SyntheticTable(*table)
    if spec.num_rows < 1 or spec.hotness < 1:
        raise ValueError(f"table {spec.name!r}: num_rows and hotness must be >= 1, got {spec}")
    return SyntheticTable(str(spec.name), int(spec.num_rows), int(spec.hotness),
                          bool(spec.variable))


def _is_scalar(table):
    return table.hotness == 1 and not table.variable


def _id_column(table, sampler, size, rng):
    """The ids of ``size`` rows: an int64 array, or a list<int64> array of bags."""
    import pyarrow as pa

    if _is_scalar(table):
        return pa.array(sampler.sample(size, rng))
    if table.variable:
        lengths = rng.integers(1, 2 * table.hotness, size=size)
    else:
        lengths = np.full(size, table.hotness)
    offsets = np.zeros(size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError(f"table {table.name!r}: {offsets[-1]} ids in one row group overflow "
                         "list<int64> offsets; use a smaller row_group_size")
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                    pa.array(sampler.sample(offsets[-1], rng)))
