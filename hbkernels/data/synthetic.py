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

Memory: each rank's CDF, row and effect, and the guide table (28 bytes per table row), plus
one row group.
"""
from typing import NamedTuple

import numpy as np
from numba import njit

from .._numba_cache import cached_njit
from ..cpu._common import prefetch
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
    """Sampler of ids in ``[0, num_rows)``: bounded Zipf(alpha) ranks, permuted.

    ``ranks[r]`` holds rank ``r``'s CDF, its row and that row's effect (float64; 0
    until :meth:`set_effect`), so the lookups that make one id share a cache line."""

    def __init__(self, num_rows, alpha, rng):
        weights = np.arange(1, num_rows + 1, dtype=np.float64) ** -alpha
        cdf = np.cumsum(weights)
        cdf /= cdf[-1]
        self.ranks = np.zeros((num_rows, 3), np.float64)
        self.ranks[:, CDF] = cdf
        self.ranks[:, ROW] = rng.permutation(num_rows)  # (exact: rows < 2**53)
        # guide[j, 0]: the first rank whose CDF exceeds j / num_rows
        index = np.int32 if num_rows <= np.iinfo(np.int32).max else np.int64
        self.guide = np.searchsorted(cdf, np.arange(num_rows) / num_rows,
                                     side="right").astype(index)[:, None]

    @property
    def cdf(self):
        return self.ranks[:, CDF]

    def set_effect(self, effect):
        """Row ``i``'s effect becomes ``effect[i]``, as :meth:`rows` gives it."""
        self.ranks[:, EFFECT] = effect[self.ranks[:, ROW].astype(np.int64)]

    def sample(self, size, rng):
        """``size`` ids (int64) from ``rng.random(size)``."""
        return self.rows(rng.random(size))[0]

    def rows(self, u):
        """``(ids, effects)``: the int64 ids of uniforms ``u`` and their rows' effects."""
        ids = np.empty(u.shape[0], np.int64)
        effects = np.empty(u.shape[0], np.float64)
        zipf_rows(self.ranks, self.guide, u, ids, effects)
        return ids, effects


CDF, ROW, EFFECT = range(3)


def _scan_start(x, m):
    """Where the scan for ``x`` starts in a guide of ``m`` steps: one step below ``x``'s,
    so float rounding of ``x * m`` cannot start it past the answer."""
    return max(min(int(x * m), m - 1) - 1, 0)


def _rank(ranks, guide, x):
    """The first rank whose CDF (``ranks[:, 0]``) exceeds ``x``, at most ``len(ranks)
    - 1`` (``np.minimum(np.searchsorted(cdf, x, side="right"), len(cdf) - 1)``, the
    same bits). ``guide[j, 0]`` is the first rank whose CDF exceeds ``j / len(guide)``:
    the scan starts there (:func:`_scan_start`) and walks a few entries (a
    mispredicted branch per level of a binary search costs more)."""
    i = np.int64(guide[_scan_start(x, guide.shape[0]), 0])
    while i < ranks.shape[0] - 1 and ranks[i, 0] <= x:
        i += 1
    return i


_scan_start = njit(inline="always")(_scan_start)
_rank = njit(inline="always")(_rank)
# uniforms ahead whose guide entry, and (half as far ahead) whose first rank, are prefetched:
# a batch's tables are far larger than the cache and each id reads both at random
GUIDE_AHEAD, RANK_AHEAD = 32, 16


def _zipf_rows(ranks, guide, u, ids, effects):
    """For each ``u[k]`` of rank ``r``: ``ids[k]`` its row, ``effects[k]`` that row's effect."""
    m, count = guide.shape[0], u.shape[0]
    for k in range(count):
        if k + GUIDE_AHEAD < count:
            prefetch(guide, _scan_start(u[k + GUIDE_AHEAD], m), 0)
        if k + RANK_AHEAD < count:
            prefetch(ranks, guide[_scan_start(u[k + RANK_AHEAD], m), 0], 0)
        r = _rank(ranks, guide, u[k])
        ids[k] = np.int64(ranks[r, 1])
        effects[k] = ranks[r, 2]


zipf_rows = cached_njit(_zipf_rows, nogil=True)  # batches may be made on several threads


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
