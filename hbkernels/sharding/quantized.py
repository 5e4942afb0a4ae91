"""Quantized tables of a collection: what :meth:`EmbeddingCollection.quantized
<hbkernels.EmbeddingCollection.quantized>` and the checkpoints of its result use.

A quantized table's slices are rows of a :class:`~hbkernels.QuantizedTable` per
fused group (``FusedGroup.bits``). Each *table row* is quantized as a whole
(:func:`hbkernels.quantize.quantize_values` of the row's minimum and maximum), so
every column slice of a row carries the same scale and bias and a quantized table
is the same whatever its plan: equal to ``hbk.quantize_rows`` of the float table,
and loadable at any world size without quantizing again. On a column_wise table
the ranks agree on each row's range in one ``allreduce``.
"""
import numpy as np

from .._dispatch import host
from ..quantize import (
    CHUNK_ROWS, QuantizedRows, QuantizedTable, check_bits, quantize_values, row_bytes, row_range,
)
from .layout import initial_weights, shard_rows
from .tier import FusedArrays


def request(coll, bits, tables):
    """``{table: bits}`` of ``coll.quantized(bits, tables)``, checked: ``tables`` None
    (all) or names of static tables; every table left out must be static and in
    the collection's memory (it is copied as it is)."""
    bits = check_bits(bits)
    names = list(coll.tables) if tables is None else (
        [tables] if isinstance(tables, str) else list(tables))
    unknown = sorted(set(names) - set(coll.tables))
    if unknown:
        raise ValueError(f"no tables {unknown}; the tables are {sorted(coll.tables)}")
    if coll.quantize:
        raise ValueError("this collection is quantized already")
    for name, spec in coll.tables.items():
        if spec.dynamic:
            raise ValueError(f"table {name!r} is dynamic: a collection with dynamic tables "
                             f"cannot be quantized")
        if spec.tiered and name not in names:
            raise ValueError(f"table {name!r} is in a slow tier ({spec.storage!r}): quantize it "
                             f"too (it is then held quantized in memory)")
    return {name: bits for name in names}


def quantized_spec(spec):
    """The :class:`~hbkernels.TableSpec` of ``spec`` quantized: float32 output, held in
    the collection's memory."""
    return spec._replace(dtype="float32", storage="device", path=None, cache_rows=None)


def _chunks(rows):
    for s in range(0, rows.shape[0], CHUNK_ROWS):
        yield s, rows[s:s + CHUNK_ROWS]


def _weight_chunks(coll, shard):
    """``(k, float32 rows k of shard's weights)``, a chunk of rows at a time."""
    weights = coll.shard_arrays(shard)["weights"]
    for s, rows in _chunks(np.arange(shard.num_rows)):
        yield rows, host(weights[s:s + rows.shape[0]]).astype(np.float32)


def _range(shard, rows, x):
    """:func:`~hbkernels.quantize.row_range` of rows ``x``, rows ``rows`` of ``shard``."""
    return row_range(np, x, shard.row_start + shard.row_step * int(rows[0]), shard.row_step)


def _quantize_shard(coll, shard, bits, ranges=None):
    """:class:`QuantizedRows` of ``shard``'s weights, read once: each row quantized over
    ``ranges`` (``(lo, hi)`` per row of the shard) or, None, over its own values."""
    codes = np.empty((shard.num_rows, shard.c1 - shard.c0), np.uint8)
    scale = np.empty(shard.num_rows, np.float16)
    bias = np.empty(shard.num_rows, np.float16)
    for rows, x in _weight_chunks(coll, shard):
        lo, hi = _range(shard, rows, x) if ranges is None else (ranges[0][rows], ranges[1][rows])
        codes[rows], scale[rows], bias[rows] = quantize_values(np, x, bits, lo, hi)
    return QuantizedRows(codes, scale, bias)


def quantize_shards(coll, quantize):
    """``{(table, slice): QuantizedRows}`` (NumPy) of this rank's shards of the tables
    in ``quantize``, rows in :func:`~hbkernels.sharding.layout.shard_rows` order.
    A shard's weights are read once; a column_wise table's twice (each row's range
    over every rank's columns, then the codes). Collective at world size > 1: a row
    of NaN or Inf, or beyond float16's range, is a ``ValueError`` on its rank and a
    :class:`~hbkernels.dist.CommError` on the others. ``coll``'s tiers are settled
    (every row made) first."""
    shards = [s for s in coll.local_shards() if s.table in quantize]
    names = sorted(t for t in quantize if len(coll.plan[t].columns) > 2)  # cut into column slices
    out, ranges = {}, {}  # ranges: (table, slice) -> (lo, hi) of a column_wise shard's rows
    try:
        for shard in shards:
            if shard.table not in names:
                out[shard.table, shard.slice] = _quantize_shard(coll, shard, quantize[shard.table])
                continue
            lo = np.empty(shard.num_rows, np.float32)
            hi = np.empty(shard.num_rows, np.float32)
            for rows, x in _weight_chunks(coll, shard):
                lo[rows], hi[rows] = _range(shard, rows, x)
            ranges[shard.table, shard.slice] = lo, hi
    except Exception as error:  # noqa: BLE001 - the peers wait in the allreduce below
        if coll.comm.world_size > 1:
            coll.comm.fail_collectively("allreduce", error)
        raise
    # a row's range over its column slices: every rank's for each column_wise table
    parts = []
    for name in names:
        lo = np.full(coll.tables[name].num_rows, np.inf, np.float32)
        hi = np.full(coll.tables[name].num_rows, np.inf, np.float32)  # of -max
        for shard in shards:
            if shard.table == name:
                at = shard_rows(shard)
                lo[at] = np.minimum(lo[at], ranges[name, shard.slice][0])
                hi[at] = np.minimum(hi[at], -ranges[name, shard.slice][1])
        parts += [lo, hi]
    agreed = np.concatenate(parts + [np.zeros(1, np.float32)])
    if coll.comm.world_size > 1:  # (every rank takes part, column_wise tables or not)
        agreed = host(coll.comm.allreduce(agreed, op="min"))
    start = 0
    for name in names:
        n = coll.tables[name].num_rows
        lo, hi = agreed[start:start + n], -agreed[start + n:start + 2 * n]
        start += 2 * n
        for shard in shards:
            if shard.table == name:
                at = shard_rows(shard)
                out[name, shard.slice] = _quantize_shard(coll, shard, quantize[name], (lo[at], hi[at]))
    return out


def select(values, shard, rows):
    """The :class:`QuantizedRows` of table rows ``rows`` out of ``values``, the rows of
    ``shard`` in order."""
    k = (np.asarray(rows) - shard.row_start) // shard.row_step
    return QuantizedRows(values.codes[k], values.scale[k], values.bias[k])


def initial_values(spec, seed, bits, shard, rows):
    """The :class:`QuantizedRows` of ``shard``'s columns of rows ``rows`` of a new
    quantized table: its initial weights (:func:`initial_weights`), each row whole
    quantized."""
    x = initial_weights(spec, seed, rows, 0, spec.dim).astype(np.float32)
    q = quantize_values(np, x, bits, *row_range(np, x))
    return QuantizedRows(q.codes[:, shard.c0:shard.c1], q.scale, q.bias)


def allocate(group, shards, num_rows, values, family):
    """The :class:`FusedArrays` of quantized ``group`` on this rank: a
    :class:`QuantizedTable` of its ``num_rows`` rows in ``family``, shard by shard from
    ``values(shard, rows)`` (:class:`QuantizedRows`), and a step counter."""
    packed = np.empty((num_rows, row_bytes(group.width, group.bits) + 4), np.uint8)
    for shard in shards:
        for s, rows in _chunks(shard_rows(shard)):
            q = QuantizedTable.from_values(values(shard, rows), group.bits)
            packed[shard.base + s:shard.base + s + rows.shape[0]] = q.rows
    table = QuantizedTable.from_rows(family.put(packed), group.bits, group.width)
    return FusedArrays(table, {"step": np.zeros(1, np.int64)})


def shard_values(fused, shard):
    """``{"codes", "scale", "bias"}`` of ``shard``'s rows in quantized ``fused`` (NumPy),
    as a checkpoint saves them: the codes as the table packs them (several a byte below
    8 bits, each row's rounded up to whole bytes), scale and bias float16."""
    q = fused.weights
    rows = host(q.rows[shard.base:shard.base + shard.num_rows])
    halves = np.ascontiguousarray(rows[:, q.width:]).view(np.float16)
    return {"codes": np.ascontiguousarray(rows[:, :q.width]), "scale": halves[:, 0].copy(),
            "bias": halves[:, 1].copy()}
