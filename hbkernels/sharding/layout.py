"""Who holds what: every rank's shards of every table, the route of each table
slice, and the fused arrays they make up.

A table (:class:`~hbkernels.TableSpec`) placed by the plan is cut into column
slices; each slice is held by one or more ranks as :class:`Shard` s, rows
``row_start + row_step * k`` (``k < num_rows``). Slices of one width, dtype and
device (a :class:`FusedGroup`) are stacked, on each rank, into one array: a
shard is rows ``[base, base + num_rows)`` of its group's array. Replicated
(``data_parallel``) slices come first in every group, at the same rows on every
rank, so their gradients travel between ranks as fused row numbers. Which rank
holds which rows is the placement's business (:mod:`hbkernels.sharding.kinds`);
this module only stacks what they hand out.
"""
import dataclasses
import functools
import zlib
from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np

from .. import _validate as check
from .._bits import seed_key
from ..cpu.initializer import uniform_rows
from ..types import table_spec
from .kinds import SHARDINGS

_INIT_CHUNK = 1 << 22  # elements generated at a time by initial_weights


class FusedGroup(NamedTuple):
    """Slices stacked into one array per rank: their width, dtype name and device.
    Dynamic tables' rows (``dynamic``) are addressed through each rank's hash tables,
    not by id, and are not stacked with static ones: on one rank those of one width,
    dtype and device share an array; on several each has its own (``table``: its
    name), so that the ids its exchange carries need no table tag. A table kept in
    a slow tier (``storage`` ``"host"`` or ``"mmap"``) has arrays of its own too, and
    so has every table of a collection whose optimizer step counts per table.
    ``bits``: 8, 4 or 2 for the slices of quantized tables (their array a
    :class:`~hbkernels.QuantizedTable`, ``dtype`` the float32 of their output), else 0."""

    width: int
    dtype: str
    device: str
    dynamic: bool = False
    table: Any = None
    storage: str = "device"
    bits: int = 0


class Shard(NamedTuple):
    """Rows ``row_start + row_step * k`` (``k < num_rows``) and columns ``[c0, c1)``
    of table ``table`` (column slice ``slice``), held by ``rank`` as rows
    ``[base, base + num_rows)`` of its fused array ``group``."""

    table: str
    slice: int
    rank: int
    row_start: int
    row_step: int
    num_rows: int
    c0: int
    c1: int
    group: FusedGroup
    base: int


class Route(NamedTuple):
    """How the ids of one column slice of a table reach their rows."""

    table: str
    slice: int
    kind: str  # the placement kind (a key of SHARDINGS)
    group: FusedGroup
    c0: int
    c1: int
    bases: Any  # int64 [N]: each rank's base of this slice (-1 where it holds none)
    owner: int  # the one holding rank (table_wise, column_wise), else -1
    holders: Any = None  # int64 [holders]: the holding ranks, in the placement's order


def _group_order(group):
    return repr(tuple(group))


@dataclasses.dataclass(frozen=True)
class Layout:
    """The shards and routes of every table on ``world_size`` ranks.

    ``shards``: table -> [Shard] (every rank's); ``routes``: table -> [Route] by
    slice; ``rows``: (rank, group) -> rows of that rank's fused array."""

    world_size: int
    shards: dict
    routes: dict
    rows: dict

    def local_shards(self, rank, group=None):
        """The shards ``rank`` holds (of fused array ``group``, or all)."""
        return [s for shards in self.shards.values() for s in shards
                if s.rank == rank and (group is None or s.group == group)]

    def groups(self, rank):
        """The fused arrays ``rank`` holds, in one global order."""
        return sorted({g for (r, g) in self.rows if r == rank}, key=_group_order)

    def _route_groups(self, replicated):
        return sorted({r.group for routes in self.routes.values() for r in routes
                       if SHARDINGS[r.kind].replicated == replicated}, key=_group_order)

    @functools.cached_property  # (a frozen layout: found once)
    def exchange_groups(self):
        """Groups with sharded slices: one exchange each, every rank taking part."""
        return self._route_groups(False)

    @functools.cached_property
    def replica_groups(self):
        """Groups with replicated slices: one gradient allgather each."""
        return self._route_groups(True)


def make_layout(tables, plan, world_size, device_of=lambda spec: "cpu", bits_of=lambda spec: 0,
                own_arrays=False):
    """The :class:`Layout` of ``tables`` (name -> TableSpec) under ``plan`` on
    ``world_size`` ranks; ``device_of(spec)`` is the device of a table's arrays,
    ``bits_of(spec)`` its bits when it is quantized (0: float); ``own_arrays``: every
    table's slices in arrays of their own (each with its own optimizer step count)."""
    next_base = defaultdict(int)  # (rank, group) -> rows so far
    shards, routes = {}, {}
    # replicated tables first: the same rows of the fused arrays on every rank
    for name, spec in sorted(tables.items(), key=lambda item: not SHARDINGS[plan[item[0]].kind].replicated):
        place = plan[name]
        sharding = SHARDINGS[place.kind]
        cuts = place.columns
        shards[name], routes[name] = [], []
        for i in range(len(cuts) - 1):
            c0, c1 = int(cuts[i]), int(cuts[i + 1])
            own = own_arrays or spec.tiered or (spec.dynamic and world_size > 1)
            group = FusedGroup(c1 - c0, spec.dtype, device_of(spec), spec.dynamic,
                               spec.name if own else None, spec.storage, bits_of(spec))
            holders = sharding.holders(spec, place, i, world_size)
            bases = np.full(world_size, -1, np.int64)
            for rank, start, step, rows in holders:
                base = next_base[rank, group]
                next_base[rank, group] += rows
                bases[rank] = base
                shards[name].append(Shard(name, i, rank, start, step, rows, c0, c1, group, base))
            owner = holders[0][0] if len(holders) == 1 else -1
            routes[name].append(Route(name, i, place.kind, group, c0, c1, bases, owner,
                                      np.array([h[0] for h in holders], np.int64)))
    return Layout(world_size, shards, routes, dict(next_base))


def shard_rows(shard):
    """The table rows ``shard`` holds, in its order (int64)."""
    return shard.row_start + shard.row_step * np.arange(shard.num_rows, dtype=np.int64)


def table_key(seed, name):
    """The 64-bit key (a Python int) of table ``name``'s initial rows under ``seed``
    (:func:`hbkernels._validate.seed`): :func:`hbkernels._bits.seed_key` of the seed and
    ``crc32(name)``.

    >>> len({table_key(s, "t") for s in (0, 2**32, -2**32, -1, 2**64 - 1)})
    5
    """
    return seed_key(check.seed(seed), zlib.crc32(name.encode()))


def initial_weights(spec, seed, rows=None, c0=0, c1=None):
    """Initial values of rows ``rows`` (default all) and columns ``[c0, c1)`` of
    table ``spec``: uniform in ``±spec.scale`` (by default ``1/sqrt(num_rows)``,
    TorchRec's). ``seed``: any integer in ``[-2**63, 2**64)``, every bit of it
    counts (:func:`hbkernels._validate.seed`; else a ``ValueError``). Each row is a SplitMix64
    stream started from the row and :func:`table_key` ``(seed, name)``
    (:mod:`hbkernels.cpu.initializer` gives the formula), computed in float64 and
    rounded to the table's dtype: distinct rows never share the 64-bit draw of a column.
    Any shard is made alone, so every plan and world size starts from the same table.
    A dynamic table's rows are its ids (any int64, a negative one as its two's
    complement), so id ``i`` starts as a static table's row ``i`` with the same scale
    would. :func:`hbkernels.reference.initial_weights` is the plain-Python model.

    >>> import hbkernels as hbk
    >>> from hbkernels.sharding import initial_weights
    >>> spec = hbk.TableSpec("t", num_rows=4, dim=3)
    >>> bool((initial_weights(spec, 0)[2:, 1:] == initial_weights(spec, 0, [2, 3], 1, 3)).all())
    True
    """
    return initial_rows(table_spec(spec), seed, rows, c0, c1)


def initial_rows(spec, seed, rows=None, c0=0, c1=None):
    """:func:`initial_weights` of a checked ``spec`` (:func:`~hbkernels.types.table_spec`)."""
    key = table_key(seed, spec.name)
    c1 = spec.dim if c1 is None else c1
    if rows is None and spec.dynamic:
        raise ValueError(f"table {spec.name!r} is dynamic: name the ids whose rows to make")
    rows = np.arange(spec.num_rows, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
    out = np.empty((rows.shape[0], c1 - c0), spec.dtype)
    step = max(1, _INIT_CHUNK // max(1, c1 - c0))
    for s in range(0, rows.shape[0], step):  # float64, rounded to the table's dtype
        out[s:s + step] = uniform_rows(key, rows[s:s + step], c0, c1, spec.scale)
    return out
