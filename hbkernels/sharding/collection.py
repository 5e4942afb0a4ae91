"""Sharded embedding tables: placement, forward and backward across ranks.

An :class:`EmbeddingCollection` holds many tables split over the ranks of a
communicator (``hbk.dist``) by a :mod:`plan <hbkernels.plan>`:

* ``data_parallel``: every rank holds the table; forward is a local pooled
  lookup; backward all-gathers every rank's sparse gradient and applies the
  same update everywhere (replicas stay bit-identical);
* ``row_wise``: rank ``id % N`` holds row ``id`` (as its local row ``id // N``);
* ``table_wise``: one rank holds the table;
* ``column_wise``: column slices of the table on different ranks.

Forward of a sharded table, per rank: dedup the ids of each feature
(``unique``), route each distinct id to its owner (``partition``),
``alltoallv`` the ids, look the owned rows up (dedup again on the owner),
``alltoallv`` the rows back (optionally as ``wire_dtype``), restore the order
and pool with the table's combiner (``embedding_bag`` over the received rows).
Tables whose slices have the same width and dtype share one fused array per
rank, one exchange and one pooling launch per combiner (coalescing). Backward
mirrors it: ``embedding_bag_backward`` into the distinct rows, gradients back
to the owners, one optimizer step per fused array on the owned rows only.
At world size 1 nothing is exchanged: every fused array is pooled from its own
rows (no dedup), and a fused array pooled in one launch takes
``optimizer.fused_step`` (backward and update in one pass over its distinct rows).
On a GPU the static, unquantized fused arrays of one dtype are blocks of one flat
array (:attr:`EmbeddingCollection.flats`): the features a rank pools from its own
rows over them take one launch, whatever the widths and combiners
(:mod:`hbkernels.cuda.pool_tables`), and at world size 1 their backward and update
take the launches of one ``fused_step`` (:mod:`hbkernels.cuda.update_tables`; their
optimizer state lies in flat arrays the same way, :attr:`EmbeddingCollection.state_flats`).
A fused array in a slow tier first turns the rows a batch asks of it into rows of
its cache (:mod:`hbkernels.sharding.tier`); the kernels then run on the cache.

Gradients of all ranks are *summed* (the loss is a sum over the global batch):
N ranks given their slices of a batch train exactly like one rank given the
whole batch, up to float summation order. Initial weights depend only on the
seed and the table (:func:`initial_weights`), never on the plan or world size.

>>> import numpy as np, hbkernels as hbk
>>> coll = hbk.EmbeddingCollection([hbk.TableSpec("user", num_rows=10, dim=4)],
...                                comm=hbk.dist.init("local"), optimizer=hbk.optim.SGD(lr=0.1))
>>> out = coll.forward({"user": hbk.Ragged(np.array([1, 2, 2]), np.array([0, 1, 3]))})
>>> out["user"].shape
(2, 4)
>>> coll.backward({"user": np.ones((2, 4), np.float32)})
>>> coll.full_weights("user").shape
(10, 4)
"""
import bisect
import contextlib
import json
import math
import os
import time
import warnings
import zlib
from collections import Counter, defaultdict
from typing import Any, NamedTuple

import numpy as np

from .. import _rules
from .. import _validate as check
from .. import dist as _dist
from .. import optim as _optim
from .._dispatch import cupy_family_of, device_family, device_family_of, host, kernels, resolve
from .._machine import cupy, simulator_enabled
from .._modes import Combiner
from ..dist import _wire
from ..errors import CapacityError
from ..hash_table import HashTable
from ..ops import (
    embedding_bag, embedding_bag_backward, lookup, partition, synchronize, unique,
)
from ..types import JaggedRows, Ragged, SparseGrad, table_spec
from ..memory import aligned_empty
from ..quantize import BITS, check_bits
from . import checkpoint
from . import quantized as quantized_tables
from .kjt import features_from_kjt, is_keyed_jagged_tensor
from .kinds import SHARDINGS
from .kinds.row_wise import dynamic_owner
from .layout import initial_rows, initial_weights, make_layout, shard_rows
from .plan import Plan, make_plan
from .tier import FusedArrays, Store, Tier


CHAIN_LIMIT = 0.5  # save(incremental=True): a full save once the chain holds this x a full one
FLAT_ALIGN = 256  # bytes: where each fused array starts in its flat array on a GPU


class Pool(NamedTuple):
    """One ``embedding_bag`` launch of a forward: its combiner and CSR input over the
    fused rows, and ``pieces`` ``[(feature, c0, c1, first bag, bags)]`` of the output;
    ``bounds``: ``"zero"`` for a dynamic table's rows (an id not admitted is row -1),
    else ``"unchecked"``."""

    combiner: Any
    values: Any
    offsets: Any
    psw: Any
    pieces: list
    bounds: str = "unchecked"
    at: Any = None  # (first value, first bound) in its flat launch's rows and bounds

    @property
    def n_values(self):
        return int(self.values.shape[0])

    @property
    def bags(self):
        return int(self.offsets.shape[0]) - 1


class FlatPool:
    """A :class:`Pool` of a flat launch (:meth:`EmbeddingCollection._pool_flat`): its
    ``n_values`` values and ``bags`` bags from ``at`` in the launch's rows and bounds, whose
    views (``values``, ``offsets``, ``psw``) are made where they are read (a view costs
    the host a call)."""

    __slots__ = ("combiner", "pieces", "at", "n_values", "bags", "_flat", "_weighted")
    bounds = "unchecked"

    def __init__(self, combiner, flat, at, n_values, bags, pieces, weighted):
        self.combiner, self.pieces, self.at, self.n_values, self.bags = (combiner, pieces, at,
                                                                         n_values, bags)
        self._flat, self._weighted = flat, weighted  # (rows, bounds, weights or None)

    @property
    def values(self):
        return self._flat[0][self.at[0]:self.at[0] + self.n_values]

    @property
    def offsets(self):
        return self._flat[1][self.at[1]:self.at[1] + self.bags + 1]

    @property
    def psw(self):
        return self._flat[2][self.at[0]:self.at[0] + self.n_values] if self._weighted else None


class ExchangeContext(NamedTuple):
    """What backward needs of one sharded fused array's forward exchange (world size > 1)."""

    group: Any
    pools: list
    rows: int  # distinct ids requested by this rank
    order: Any  # the partition's order
    send_counts: Any
    recv_keys: Any  # fused rows this rank served, as received
    recv_counts: Any


class LocalContext(NamedTuple):
    """What backward needs of a fused array pooled from this rank's own rows; ``flat``:
    ``(key, rows, bounds, per-sample weights or None)`` of the flat array's launch that
    pooled it, if one did."""

    group: Any
    pools: list
    flat: Any = None


class Saved(NamedTuple):
    inputs: dict
    exchanges: list
    locals: list
    flat: Any = None  # a forward of the flat path (_forward_flat): its _FlatCall


class _Door(NamedTuple):
    """What the flat path (:meth:`EmbeddingCollection._forward_flat`) takes from a
    forward's signature, its features' names (in the order given) and batches."""

    at: list  # per feature of the launch (in its order), its index in the order given
    order: list  # the features, in the launch's order
    limits: list  # each one's table rows (its ids are checked against them)
    inputs: dict  # feature -> _Feature (no arrays): what backward reads of the forward
    lay: Any  # the launch's _FlatLayout
    tables: list  # each feature's table
    # the check's table (ragged.features_table), then the launch's plan from element
    # ``base``, the fields that counts change left 0; where those fields are (the
    # first values, the counts, pool_tables.placed's columns)
    host: Any
    base: int
    placed: Any


class _FlatCall(NamedTuple):
    """A forward of the flat path, for its backward."""

    door: _Door
    counts: list  # each feature's values, in the launch's order
    rows_at: list  # each segment's first row in ``rows``, then their total
    rows: Any  # what the launch wrote for the backward
    bounds: Any


class _FlatPlan(NamedTuple):
    """One flat array's update (:meth:`EmbeddingCollection._flat_plan`)."""

    tables: list  # update_tables.Table
    pools: list  # update_tables.Pool
    places: list  # (first element in the flat gradient, feature, c0, c1, bags) per piece
    counters: list  # each fused array's step count (its state's "step")
    hp: Any  # the rule's hyper-parameters (the last array's step)
    size: int  # elements of the flat gradient


class _FlatLayout(NamedTuple):
    """What a flat pooling launch takes from its signature
    (:meth:`EmbeddingCollection._flat_layout`): the rest comes from its features' counts
    of values."""

    order: list  # the features, in the order of their values in the launch
    segment_features: list  # per segment: its feature's index in ``order``
    segment_pools: list  # per segment: the first segment of its pool
    launch: Any  # pool_tables.Layout, the counts' fields left 0
    out_size: int  # output elements
    bounds_size: int  # the pools' bounds
    width: int  # the one width of every output, else 0
    outputs: list  # (feature, first output element, batch, dim), in the order of ``order``
    pools: list  # ((group, replicated), [(combiner, first segment, end segment, first bound,
    #              bags, pieces, weighted)])

    def columns(self, counts):
        """``(columns, rows_at, firsts)`` of a call whose features (in :attr:`order`) hold
        ``counts`` values: the fields ``pool_tables.placed`` writes, per segment its
        first value, count, first row and first row in its pool; each segment's first
        row, then their total; each feature's first value, then their total."""
        firsts = [0]
        for n in counts:
            firsts.append(firsts[-1] + n)
        rows_at, columns = [0], []
        for k, pool_first in zip(self.segment_features, self.segment_pools):
            at = rows_at[-1]
            columns += (firsts[k], counts[k], at, at - rows_at[pool_first])
            rows_at.append(at + counts[k])
        return columns, rows_at, firsts

    def pooled(self, rows_at):
        """``[((group, replicated), [(combiner, first row, values, first bound, bags, pieces,
        weighted)])]``: each pair's pools in a call whose segments start at ``rows_at``
        (:meth:`columns`)."""
        return [(pair, [(combiner, rows_at[s0], rows_at[s1] - rows_at[s0], first_bound, bags,
                         pieces, weighted)
                        for combiner, s0, s1, first_bound, bags, pieces, weighted in pools])
                for pair, pools in self.pools]

    def results(self, out):
        """``{feature: its [batch, dim] output}``: views of the launch's ``out``."""
        if self.width:  # one width: rows
            by_rows, width = out.reshape(-1, self.width), self.width
            return {f: by_rows[first // width:first // width + batch]
                    for f, first, batch, _ in self.outputs}
        return {f: out[first:first + batch * dim].reshape(batch, dim)
                for f, first, batch, dim in self.outputs}


class _ReservedFlat(NamedTuple):
    """A flat array's part of a :class:`_Reservation`."""

    pooled: Any  # the pooling launch's pool_tables.Pooled
    contexts: dict  # (group, replicated) -> LocalContext, its pools views of what it writes
    outputs: dict  # feature -> [(0, dim, [B, dim] view of the launch's output)]
    step: Any  # update_tables.StepSpace
    grad: Any  # the flat fp32 gradient the update reads
    psw: Any  # the per-sample weights of the launch's rows, or None
    segments: list  # (feature, first row) of each pool, in the rows


class _Reservation(NamedTuple):
    """The memory of a training step sized once (:meth:`EmbeddingCollection.reserve`)."""

    batch: int
    capacity: dict  # feature -> ids at most
    weighted: frozenset
    firsts: dict  # feature -> (first value, first offset) in the staged inputs
    staged: Any  # ragged.Staged: every feature's values and offsets, the check's table
    table: Any  # the check's table on the host (its counts rewritten each forward)
    psw: Any  # per-sample weights (ones where a feature has none), or None
    ones: Any  # offsets of one-id bags, 0..batch
    flats: dict  # flat key -> _ReservedFlat


class CapturedStep:
    """A training step captured into a CUDA graph (:meth:`EmbeddingCollection.capture`);
    :meth:`replay` runs it with the host's part of a step around it."""

    def __init__(self):
        self._checks = None  # the checks' graphs.Captured
        self._before = []  # what the host does before each replay
        self._after = []  # and after it

    def replay(self, launch):
        """One step: ``launch()`` queues a replay of the graph (``graph.replay`` in torch,
        on the current stream). Before it, the step's id counts and its step sizes
        (Adam's) or rounding keys reach the device where they changed; after it, the
        step's checks are noted (their errors raise at the next wait, as an uncaptured
        step's do), each table's step count advances, and the rows it updated are noted
        for an incremental save."""
        for before in self._before:
            before()
        launch()
        self._checks.replayed()
        for after in self._after:
            after()


def _device_of(device):
    """``"cpu"`` or ``"cuda"`` for the collection's ``device`` argument."""
    if device in ("cpu", "cuda"):
        return device
    if device != "auto":
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if simulator_enabled():
        return "cpu"
    try:
        return "cuda" if cupy().cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:  # noqa: BLE001 - no CuPy or no driver: the CPU
        return "cpu"


_UNTIMED = contextlib.nullcontext()  # EmbeddingCollection._phase's context when not profiling


def _members(contexts):
    """``[(group, [(combiner, first row, values, first bound, bags, pieces)])]``: what
    a flat array's update takes of the pools of ``contexts`` (the LocalContexts of its
    launch)."""
    return [(ctx.group, [(p.combiner, p.at[0], p.n_values, p.at[1], p.bags, p.pieces)
                         for p in ctx.pools]) for ctx in contexts]


def _columns(a, c0, c1):
    """Columns ``[c0, c1)`` of the 2-D ``a``: ``a`` itself when they are all of them."""
    return a if c0 == 0 and c1 == a.shape[1] else a[:, c0:c1]


class _class_only(classmethod):
    """A class method that refuses to be called on an instance (whose state it would
    leave as it is, returning a new object)."""

    def __get__(self, obj, cls=None):
        if obj is None:
            return super().__get__(obj, cls)
        name = self.__func__.__name__

        def refused(*args, **kwargs):
            raise TypeError(f"{type(obj).__name__}.{name} is a class method returning a new "
                            f"collection; nothing is loaded into this one: "
                            f"coll = hbk.{type(obj).__name__}.{name}(path, comm)")

        return refused


def _memory_per_rank(device, world_size):
    """Bytes a rank may hold by default: 80% of the GPU's memory, or of the host's
    memory shared by ``world_size`` ranks (they may all be on this host; under Numba's
    CUDA simulator the "GPU" is host memory too)."""
    if device == "cuda" and not simulator_enabled():
        return int(0.8 * cupy().cuda.Device().mem_info[1])
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
    return int(0.8 * total / world_size)


class _Feature(NamedTuple):
    table: str
    values: Any  # int64 ids
    offsets: Any
    psw: Any
    batch: int
    uniq: Any  # ids to send: distinct ones (the values themselves when dedup is off); None at world size 1
    inverse: Any  # values == uniq[inverse]; None at world size 1
    sequence_offsets: Any = None  # a sequence table's input offsets (its bags are single ids)


class EmbeddingCollection:
    """Embedding tables sharded over the ranks of ``comm`` (see the module doc).

    ``tables``: :class:`hbkernels.TableSpec` list. ``plan``: ``"auto"`` (cost
    model of :func:`hbkernels.plan.make_plan`), a placement for every table, or
    a dict table -> placement. ``optimizer``: a ``hbk.optim`` optimizer
    (default ``Adagrad(lr=0.05)``), applied to the owned rows in
    :meth:`backward`. ``wire_dtype``: ``"float16"``/``"bfloat16"`` rows and
    gradients on the wire. ``device``: ``"auto"`` (the GPU when CuPy sees one),
    ``"cpu"`` or ``"cuda"``; a table's own ``TableSpec.device="cpu"`` keeps it in
    host memory. ``dedup=False`` sends every id, duplicates included. ``memory_per_rank``:
    bytes of weights and optimizer state a rank may hold (``"auto"``: 80% of
    the GPU, or of host memory / world size; ``None``: unlimited).
    ``profile=True`` records the seconds of each phase in :attr:`timings`.
    ``initializer(shard, rows)``: the initial values of rows ``rows`` of
    :class:`~hbkernels.sharding.layout.Shard` ``shard`` (its columns
    ``[shard.c0, shard.c1)``), default :func:`~hbkernels.sharding.initial_weights`
    of ``(seed, table)``. ``quantize``: ``{table: bits}`` holds those tables
    row-wise quantized (8, 4 or 2 bits; static tables only) for a forward-only
    collection (:meth:`quantized`); their ``initializer`` gives
    :class:`~hbkernels.quantize.QuantizedRows`. Every rank constructs the collection
    with the same arguments. ``plan_profile``: a machine profile of ``hbkernels plan
    --calibrate`` (:class:`~hbkernels.sharding.profile.MachineProfile`, the path of its
    JSON file or its dict) the planner ranks placements and predicts the sparse step by, for
    ids laid out as ``id_layout`` (``"scattered"``, ``"ranked"`` or ``"uniform"``);
    ``None``: its built-in constants (:meth:`estimate` labels them). Not saved: pass it
    to :meth:`load` again.

    Who holds what is :attr:`layout` (:class:`~hbkernels.sharding.layout.Layout`);
    this rank's arrays are :attr:`arrays` (fused group -> :class:`FusedArrays`). A
    table kept in a slow tier (``TableSpec.storage``) has a fused array of its own,
    its store's arrays in :attr:`arrays` and its cache in :attr:`tiers` (fused group ->
    :class:`~hbkernels.sharding.tier.Tier`); ``docs/tiered.md``. On a GPU the weights of
    the static, unquantized fused arrays are views of one flat array per device and
    dtype, :attr:`flats` (``(device, dtype) -> array``), and their optimizer state views
    of :attr:`state_flats`.
    """

    def __init__(self, tables, comm=None, optimizer=None, plan="auto", batch_size_hint=None,
                 wire_dtype=None, seed=0, *, device="auto", dedup=True, memory_per_rank="auto",
                 profile=False, initializer=None, quantize=None, plan_profile=None,
                 id_layout="scattered"):
        self.comm = _dist.init() if comm is None else comm
        if not isinstance(self.comm, _dist.Communicator):
            raise TypeError(f"comm must be a hbk.dist communicator, got {type(self.comm).__name__}")
        self.tables = {}
        for spec in (tables if isinstance(tables, (list, tuple)) else [tables]):
            spec = table_spec(spec)
            if spec.name in self.tables:
                raise ValueError(f"two tables are named {spec.name!r}")
            self.tables[spec.name] = spec
        if not self.tables:
            raise ValueError("an EmbeddingCollection needs at least one table")
        #: ``{table: bits}`` of the tables held quantized (forward only when not empty)
        self.quantize = {}
        for name, bits in ({} if quantize is None else dict(quantize)).items():
            if name not in self.tables or self.tables[name].dynamic:
                raise ValueError(f"quantize must map static tables to bits in "
                                 f"{BITS}, got {name!r}: {bits!r}")
            try:
                self.quantize[name] = check_bits(bits)
            except ValueError as e:
                raise ValueError(f"quantize must map static tables to bits: table {name!r}: {e}") from None
            self.tables[name] = quantized_tables.quantized_spec(self.tables[name])
        self.optimizer = _optim.Adagrad(lr=0.05) if optimizer is None else optimizer
        if not isinstance(self.optimizer, _optim.SparseOptimizer):
            raise TypeError(f"optimizer must be a hbk.optim optimizer, got {type(optimizer).__name__}")
        self.seed = check.seed(seed)
        self.wire_dtype = _wire.normalize(wire_dtype)  # None, "float16" or "bfloat16"
        self.dedup = bool(dedup)
        self.profile = bool(profile)
        self.device = _device_of(device)
        self.batch_size_hint = batch_size_hint
        if isinstance(memory_per_rank, str) and memory_per_rank == "auto":
            memory_per_rank = _memory_per_rank(self.device, self.comm.world_size)
        self.memory_per_rank = memory_per_rank
        self.plan_request = plan.request if isinstance(plan, Plan) else plan
        per_row = sum(1 for _, row in self.optimizer.slots if row)
        self.plan = make_plan(
            list(self.tables.values()), self.comm.world_size, plan,
            batch_size_hint=batch_size_hint, memory_per_rank=memory_per_rank,
            state_floats_per_element=len(self.optimizer.slots) - per_row,
            state_floats_per_row=per_row,
            wire_itemsize=self._wire_itemsize(np.float32),
            element_bytes={name: bits / 8 for name, bits in self.quantize.items()},
            profile=plan_profile, id_layout=id_layout,
        )
        self._agree_across_ranks()
        for name, place in self.plan.items():
            if place.kind == "column_wise" and per_row and len(place.ranks) > 1:
                raise ValueError(
                    f"table {name!r}: {type(self.optimizer).__name__} keeps one state value per "
                    "whole row, which column_wise slices cannot share; use another placement")
        self.feature_table = {f: t.name for t in self.tables.values() for f in t.features}
        self._feature_order = {f: i for i, f in enumerate(self.feature_table)}
        self._families = {}
        for spec in self.tables.values():
            if spec.dynamic and spec.capacity < self.comm.world_size:
                raise ValueError(f"table {spec.name!r}: capacity {spec.capacity} is less than one "
                                 f"slot for each of the {self.comm.world_size} ranks")
        #: whether each table counts its own optimizer steps (see :meth:`backward`)
        self.step_per_table = _optim.counts_steps(self.optimizer)
        self.layout = make_layout(self.tables, self.plan, self.comm.world_size, self._table_device,
                                  lambda spec: self.quantize.get(spec.name, 0),
                                  own_arrays=self.step_per_table)
        self._fresh = {}  # (group, on the host) -> optimizer state of a row never updated
        self.arrays = self._allocate(initializer)
        #: a dynamic table's id -> row map on this rank (its slots are the rows of its fused array)
        self.hash_tables = {
            s.table: HashTable(s.num_rows, evict=self.tables[s.table].evict, device=s.group.device,
                               admit_count=self.tables[s.table].admit_count,
                               name=self._hash_table_name(s.table))
            for s in self.local_shards() if s.group.dynamic}
        self._saved = None
        self._changed = None  # group -> bool per fused row: changed since the last save
        self._insert = True  # the current forward's: dynamic tables admit ids
        self._last_save = None  # (path, link) of the last save (what checkpoint.save returns)
        self._chain = []  # directories of the last full save and the incremental ones after it
        self._full_bytes, self._chain_bytes = 0, 0  # of the last full save; of the saves after it
        self._marks = {}  # dynamic table -> what its next incremental save compares with
        self._reserved = None  # a _Reservation: the memory of a step, sized once (reserve)
        self._capturing = None  # while a step is captured (capture): its CapturedStep
        self.stats = {}
        #: host seconds of all :meth:`forward` and :meth:`backward` calls (on a GPU a call
        #: returns once its work is queued)
        self.call_seconds = {"forward": 0.0, "backward": 0.0}
        self.timings = defaultdict(float)
        self._timing = False
        #: the flat array pooling every table in one launch where :meth:`_forward_flat`
        #: may take a forward, else None
        self._flat_key = self._single_flat()
        self._doors = {}  # a forward's signature -> its _Door (_door)

    # -- layout -------------------------------------------------------------------------------
    def _family(self, device):
        """The array family of ``device`` (NumPy, or CuPy on the current GPU)."""
        if device not in self._families:
            self._families[device] = device_family(device)
        return self._families[device]

    def _table_device(self, spec):
        """Where a table's kernels run: its ``device``; the CPU for an uncached slow
        tier; else the collection's device (a cache lives there)."""
        if spec.tiered and spec.cache_rows is None:
            return "cpu"
        return spec.device or self.device

    def _allocate(self, initializer):
        """This rank's fused arrays: weights (initial values) and optimizer state; a
        tiered group's are its store's, its :class:`~hbkernels.sharding.tier.Tier` in
        :attr:`tiers`."""
        arrays = {}
        self.tiers = {}
        blocks, sizes, keys = self._plan_flats()
        #: ``(device, dtype) -> the flat device array`` whose blocks are the weights of
        #: this rank's static device groups of that dtype (:meth:`_plan_flats`)
        self.flats = {key: self._family(key[0]).empty((size,), key[1])
                      for key, size in sizes.items()}
        #: ``((device, dtype), slot) -> the flat array`` of that optimizer slot's state of
        #: the same groups: a per-element slot at the weights' element offsets, a per-row
        #: one at the groups' first keys
        self.state_flats = {
            (key, slot): self._family(key[0]).empty((keys[key] if per_row else size,),
                                                    check.accumulator_dtype(key[1]))
            for key, size in sizes.items() for slot, per_row in self.optimizer.slots}
        self._flat_of = {group: key for group, (key, _, _) in blocks.items()}
        #: group -> (element offset, first key) in its flat array
        self._flat_blocks = {group: (at, first) for group, (_, at, first) in blocks.items()}
        self._flat_plans = {}  # (group, replicated) -> what _flat_requests gives
        self._flat_layouts = {}  # a flat launch's signature -> its _FlatLayout (_flat_layout)
        self._unchecked = None  # a forward's input check left for its pooling launch
        for group in self.layout.groups(self.comm.rank):
            if group.bits:
                arrays[group] = quantized_tables.allocate(
                    group, self.local_shards(group), self.layout.rows[self.comm.rank, group],
                    initializer or (lambda shard, rows: quantized_tables.initial_values(
                        self.tables[shard.table], self.seed, group.bits, shard, rows)),
                    self._family(group.device))
                continue
            if group.storage == "mmap":
                arrays[group] = self._tier(group, initializer)
                continue
            shape = (self.layout.rows[self.comm.rank, group], group.width)
            weights = aligned_empty(shape, group.dtype)
            for shard in self.local_shards(group):
                if group.dynamic:  # a dynamic table's rows are made as ids arrive
                    weights[shard.base:shard.base + shard.num_rows] = 0
                    continue
                rows = shard_rows(shard)
                block = (initializer(shard, rows) if initializer is not None else
                         initial_weights(self.tables[shard.table], self.seed, rows, shard.c0, shard.c1))
                weights[shard.base:shard.base + shard.num_rows] = block
            if group.storage == "host":
                arrays[group] = self._tier(group, initializer, weights)
                continue
            family = self._family(group.device)
            state = None
            if group in blocks:  # its block of the flat array, filled from the host copy
                key, at, first = blocks[group]
                block = self.flats[key][at:at + shape[0] * shape[1]].reshape(shape)
                block[...] = family.put(weights)
                weights = block
                state = {slot: (self.state_flats[key, slot][first:first + shape[0]] if per_row else
                                self.state_flats[key, slot][at:at + block.size].reshape(shape))
                         for slot, per_row in self.optimizer.slots}
            else:
                weights = family.put(weights)
            arrays[group] = FusedArrays(weights, self.optimizer.init_state(weights, arrays=state))
        return arrays

    def _plan_flats(self):
        """``({group: ((device, dtype), element offset, first key)}, {(device, dtype):
        elements}, {(device, dtype): keys})``: where each static, unquantized fused array
        this rank keeps on a GPU lies in the one flat array of its device and dtype (blocks
        of :data:`FLAT_ALIGN` bytes), so that a forward pools all of them in one launch and
        a backward updates them in the launches of one fused step; its rows' keys (one more
        for ids outside it, :mod:`hbkernels.cuda.update_tables`) follow the previous
        array's."""
        blocks, sizes, keys = {}, defaultdict(int), defaultdict(int)
        for group in self.layout.groups(self.comm.rank):
            if (group.bits or group.dynamic or group.storage != "device"
                    or not self._family(group.device).is_cuda):
                continue
            key = (group.device, np.dtype(group.dtype))
            step = FLAT_ALIGN // key[1].itemsize
            blocks[group] = (key, sizes[key], keys[key])
            rows = int(self.layout.rows[self.comm.rank, group])
            sizes[key] += max(step, -(-rows * group.width // step) * step)
            keys[key] += rows + 1
        return blocks, dict(sizes), dict(keys)

    def estimate(self):
        """The planner's predicted sparse step (``forward`` and ``backward``) per rank, with
        its parts: a :class:`~hbkernels.sharding.cost.StepEstimate` (``.seconds``, the
        busiest rank's; ``.parts_ms()``; ``.label()``, where its constants come from)."""
        return self.plan.predict()

    def _agree_across_ranks(self):
        """:class:`~hbkernels.dist.CommError` on every rank, naming what differs, unless
        every rank made this collection with the same tables (their ``path`` aside: a
        rank's own disk), plan, optimizer and options. Collective at world size > 1."""
        n = self.comm.world_size
        if n == 1:
            return
        parts = {
            "tables": [{k: v for k, v in spec._asdict().items() if k != "path"}
                       for spec in self.tables.values()],
            "plan": self.plan.to_json(),
            "optimizer": [type(self.optimizer).__name__, sorted(vars(self.optimizer).items())],
            "seed": self.seed,
            "dedup, wire_dtype, quantize": [self.dedup, self.wire_dtype, sorted(self.quantize.items())],
        }
        mine = np.array([zlib.crc32(json.dumps(v, sort_keys=True, default=repr).encode())
                         for v in parts.values()], np.int64)
        everyone = host(self.comm.allgather(mine))
        differ = everyone != everyone[0]
        if differ.any():
            rank, what = (int(i) for i in np.argwhere(differ)[0])
            raise _dist.CommError(f"ranks made EmbeddingCollection differently: rank {rank} and "
                                  f"rank 0 disagree on its {list(parts)[what]} (every rank must pass "
                                  f"the same tables, plan, optimizer and options)")

    def _hash_table_name(self, table):
        """How errors name dynamic ``table``'s hash table on this rank: at world size > 1
        a share of the table's capacity (ids go to ranks by a hash of the id)."""
        n = self.comm.world_size
        if n == 1:
            return table
        return (f"{table} on rank {self.comm.rank} (its share of capacity "
                f"{self.tables[table].capacity} over {n} ranks, which take ids by a hash of the id)")

    def _tier(self, group, initializer, weights=None):
        """The store of tiered ``group`` (``weights``: its rows in host memory; else
        files, rows made on first touch), its tier put in :attr:`tiers`."""
        spec = self.tables[group.table]
        if weights is not None:
            store = Store(FusedArrays(weights, self.optimizer.init_state(weights)), self.optimizer.slots)
        else:
            shards, seed = self.local_shards(group), self.seed

            def make(rows):  # (no reference to the collection: its files' lock goes with it)
                out = np.empty((rows.shape[0], group.width), group.dtype)
                for shard in shards:
                    inside = (rows >= shard.base) & (rows < shard.base + shard.num_rows)
                    if not inside.any():
                        continue
                    at = shard.row_start + shard.row_step * (rows[inside] - shard.base)
                    out[inside] = (initializer(shard, at) if initializer is not None else
                                   initial_weights(spec, seed, at, shard.c0, shard.c1))
                return out

            store = Store.in_files(spec.path, f"rank{self.comm.rank}.w{group.width}",
                                   self.layout.rows[self.comm.rank, group], group.width, group.dtype,
                                   self.optimizer.slots, None if group.dynamic else make,
                                   self._fresh_state(group, host=True),
                                   records=spec.cache_rows is not None)
        self.tiers[group] = Tier(store, group.width, group.dtype, group.device, spec.cache_rows,
                                 spec.cache_policy, name=spec.name)
        return store.arrays

    @staticmethod
    def _store_device(group):
        """Where :attr:`arrays` of ``group`` live: a tiered group's on the host."""
        return "cpu" if group.storage != "device" else group.device

    def _fast(self, group):
        """The :class:`FusedArrays` the kernels run on: a tiered group's fast tier."""
        return self.tiers[group].fast if group in self.tiers else self.arrays[group]

    def _settle(self, make=False):
        """Write every cached row back to its store (before whole tables are read);
        ``make``: also make the rows a file store has never touched."""
        for group, tier in self.tiers.items():
            tier.flush()
            if make and not group.dynamic:
                tier.store.ensure_all()

    def local_shards(self, group=None):
        """The shards this rank holds (of fused array ``group``, or all)."""
        return self.layout.local_shards(self.comm.rank, group)

    def shard_arrays(self, shard):
        """``{"weights": rows, slot: rows}``: views of this rank's rows of ``shard`` in
        the weights and in each optimizer state slot (writes go to the collection); of
        a quantized table, copies ``{"codes", "scale", "bias"}``
        (:func:`~hbkernels.sharding.quantized.shard_values`)."""
        if shard.group.bits:  # codes (one per byte), scale and bias
            return quantized_tables.shard_values(self.arrays[shard.group], shard)
        if shard.group in self.tiers:  # the store's rows: written back, made, cache emptied
            tier = self.tiers[shard.group]
            tier.clear()
            if not shard.group.dynamic:
                tier.store.ensure_all()
        fused = self.arrays[shard.group]
        rows = slice(shard.base, shard.base + shard.num_rows)
        out = {"weights": fused.weights[rows]}
        out.update({slot: fused.state[slot][rows] for slot, _ in self.optimizer.slots})
        return out

    # -- timing -----------------------------------------------------------------------------------
    def _phase(self, name):
        """The context adding the seconds of its block to ``timings[name]`` (under
        ``profile``; a phase inside another counts once, in the outer one)."""
        if not self.profile or self._timing:
            return _UNTIMED
        return self._timed(name)

    @contextlib.contextmanager
    def _timed(self, name):
        for family in self._families.values():
            family.sync()
        self._timing = True
        t0 = time.perf_counter()
        try:
            yield
        finally:
            for family in self._families.values():
                family.sync()
            self.timings[name] += time.perf_counter() - t0
            self._timing = False

    def _exchange(self, x, counts, wire=False):
        """alltoallv (world size > 1: at world size 1 nothing is exchanged)."""
        with self._phase("comm"):
            return self.comm.alltoallv(x, counts, wire_dtype=self.wire_dtype if wire else None)

    # -- forward ------------------------------------------------------------------------------------
    def _read_inputs(self, features, per_sample_weights, defer=False):
        """``(inputs, joined)``: each feature's :class:`_Feature`, checked (the check left
        pending on a GPU), in the collection's feature order; ``joined``: the
        ``ragged.Staged`` the check joined their values and offsets into, one feature's
        after another, where a pooling launch may read them there (no weights, no
        sequence table), else None. ``defer`` (a forward at world size 1 on a GPU): the
        check of such inputs is left to :meth:`_launch_check`, ``joined``'s table on
        the host."""
        if is_keyed_jagged_tensor(features):
            features, per_sample_weights = features_from_kjt(features, per_sample_weights)
        if not isinstance(features, dict):
            raise TypeError(f"features must be a dict name -> hbk.Ragged or ids, or a torchrec "
                            f"KeyedJaggedTensor, got {type(features).__name__}")
        psws = per_sample_weights or {}
        unknown = sorted(set(features) - set(self.feature_table)) + sorted(set(psws) - set(features))
        if unknown:
            raise ValueError(f"unknown features {unknown}; this collection has "
                             f"{sorted(self.feature_table)}")
        space = self._family(self.device)
        # C-contiguous CuPy arrays of the collection's device and no weights: as they are
        as_given = (features and not psws and space.is_cuda
                    and all(isinstance(x, Ragged) for x in features.values())
                    and cupy_family_of(*(a for x in features.values() for a in x),
                                       contiguous=True) is space)
        inputs = {}
        checked = []  # (name, values, offsets, row limit or None: ids unchecked) per feature
        plain = True  # no feature with weights or a sequence table's
        for f in sorted(features, key=self._feature_order.get):
            spec = self.tables[self.feature_table[f]]
            x = features[f]
            if as_given:
                values, offsets, psw = x.values, x.offsets, None
            elif isinstance(x, Ragged):
                values, offsets = x.values, x.offsets
            else:  # one id per sample
                values = resolve(values=x)[1]["values"]
                if values.ndim != 1:
                    raise ValueError(f"feature {f!r}: one-hot ids must be 1-D, got shape {tuple(values.shape)}")
                reserved = self._reserved
                offsets = (reserved.ones if reserved is not None and values.shape[0] == reserved.batch
                           else space.xp.arange(values.shape[0] + 1, dtype=np.int64))
            if not as_given:
                family, a = resolve(("psw",), values=values, offsets=offsets, psw=psws.get(f))
                if family != space:
                    raise TypeError(f"feature {f!r} is a {family.name} array but the collection "
                                    f"lives on {self.device} ({space.name} arrays)")
                values, offsets, psw = a["values"], a["offsets"], a["psw"]
            check.ids(f"{f}.values", values, ndim=1)
            try:  # the errors name the feature
                check.offsets(offsets)
                check.per_sample_weights(psw, values)
            except ValueError as e:
                raise ValueError(f"feature {f!r}: {e}") from None
            # a dynamic table takes any int64 id: its offsets only
            checked.append((f, values, offsets, None if spec.dynamic else spec.num_rows))
            if self._reserved is None:  # (a reserved step copies them into its own int64 array)
                if values.dtype != np.int64:
                    values = values.astype(np.int64)
            sequence_offsets = None
            if spec.combiner is None:  # a sequence table: each id is a bag of its own
                sequence_offsets, offsets = offsets, space.xp.arange(values.shape[0] + 1, dtype=np.int64)
            uniq = inverse = None
            if self.comm.world_size > 1:  # ids to send: distinct ones unless dedup is off
                with self._phase("kernels"):
                    if self.dedup:
                        uniq, inverse = unique(values, return_inverse=True)
                    else:
                        uniq, inverse = values, space.xp.arange(values.shape[0], dtype=np.int64)
            psw = None if psw is None else psw.astype(np.float32, copy=False)
            inputs[f] = _Feature(spec.name, values, offsets, psw, int(offsets.shape[0]) - 1,
                                 uniq, inverse, sequence_offsets)
            plain = plain and psw is None and sequence_offsets is None
        joined = None
        if self._reserved is not None:
            kernels(space, "ragged").check_features(space, *zip(*checked),
                                                    staged=self._stage(space, inputs), padded=True)
        elif (checked and defer and plain and space.is_cuda and self.comm.world_size == 1
              and not self.hash_tables):  # (a dynamic table's capacity check reads the device)
            # joined, the check's table on the host: the check is launched where the pooling
            # launch's plan is copied, with its table (one copy), or else by the forward
            joined = kernels(space, "ragged").join_features(space, *list(zip(*checked))[1:])
            self._unchecked = checked
        elif checked:
            staged = kernels(space, "ragged").check_features(space, *zip(*checked))
            joined = staged if plain else None  # the pooling launch may read them there
        if space.is_cuda and self.comm.world_size > 1:
            synchronize()  # the checks' errors here, where the peers are told, not mid-exchange
        return inputs, joined

    def _launch_check(self, space, joined, table=None):
        """Launch the check :meth:`_read_inputs` left (if any) over ``joined``, its table
        in ``table`` (a device array starting with ``joined``'s host table), else copied
        here."""
        if self._unchecked is None:
            return
        checked, self._unchecked = self._unchecked, None
        table = space.put(joined.table) if table is None else table
        kernels(space, "ragged").check_features(space, *zip(*checked),
                                                staged=joined._replace(table=table))

    def _stage(self, space, inputs):
        """Copy this forward's inputs into the reserved arrays (nothing allocated): the
        check's ``Staged`` arrays. Refuses a batch the reservation does not hold."""
        r = self._reserved
        if list(inputs) != list(r.capacity):
            raise ValueError(f"a reserved step takes every feature {list(r.capacity)}, got "
                             f"{list(inputs)}")
        for f, feature in inputs.items():
            n = int(feature.values.shape[0])
            if feature.batch > r.batch:
                raise ValueError(f"feature {f!r}: {feature.batch} bags, more than the {r.batch} "
                                 f"reserved (reserve's batch_size)")
            if n > r.capacity[f]:
                raise ValueError(f"feature {f!r}: {n} ids, more than the {r.capacity[f]} reserved "
                                 f"(reserve's max_ids)")
            if (feature.psw is not None) != (f in r.weighted):
                raise ValueError(f"feature {f!r}: per-sample weights "
                                 f"{'missing' if f in r.weighted else 'not reserved'} "
                                 f"(reserve's weighted={sorted(r.weighted)})")
        count, changed = len(inputs), False
        for k, (f, feature) in enumerate(inputs.items()):
            n = int(feature.values.shape[0])
            v0, o0 = r.firsts[f]
            if n:
                r.staged.values[v0:v0 + n] = feature.values
                if feature.psw is not None:
                    r.psw[v0:v0 + n] = feature.psw
            r.staged.offsets[o0:o0 + feature.batch + 1] = feature.offsets
            if feature.batch < r.batch:  # the bags past the batch's: empty, at its last offset
                r.staged.offsets[o0 + feature.batch + 1:o0 + r.batch + 1] = \
                    feature.offsets[feature.batch:feature.batch + 1]
            if r.table[3 * count + 2 + k] != n:
                r.table[3 * count + 2 + k] = n
                changed = True
        if changed:  # (inputs padded to fixed sizes copy nothing here)
            if self._capturing is not None:
                raise RuntimeError("a captured step's features must have the id counts of the "
                                   "step before it (pad values to fixed sizes)")
            space.copy_in(r.staged.table, r.table)
        if self._capturing is not None:  # a step between two replays may have changed them
            captured = r.table.copy()

            def restore():
                if not np.array_equal(r.table, captured):
                    space.copy_in(r.staged.table, captured)
                    r.table[:] = captured

            self._capturing._before.append(restore)
        return r.staged

    def reserve(self, batch_size, max_ids, *, weighted=()):
        """Size, once, the device memory of a training step on the GPU. After it, a
        :meth:`forward` of every feature with at most ``batch_size`` bags each and at most
        ``max_ids`` ids (an int, or ``{feature: int}``), per-sample weights for exactly the
        features in ``weighted``, and the :meth:`backward` after it allocate nothing on the
        device and wait for nothing; their launches, and the shapes of their kernels, do
        not depend on the batch (a feature's bags are padded to ``batch_size`` with empty
        ones, its ids to its reserved count). A feature's ``values`` may also come padded:
        ids past its last offset are not read or checked, so inputs of fixed shapes make
        every step copy the same. A forward outside these sizes raises ``ValueError``
        naming the feature. The outputs of a forward are views of reserved memory: the
        next forward overwrites them.

        For one rank (``world_size`` 1) with static, unquantized tables of pooled bags on
        a GPU; anything else raises ``ValueError``. Calling it again replaces the
        reservation."""
        space = self._family(self.device)
        if not space.is_cuda:
            raise ValueError(f"reserve sizes a step on a GPU; this collection lives on {self.device}")
        if self.comm.world_size != 1:
            raise ValueError(f"reserve takes one rank; this collection has {self.comm.world_size}")
        outside = sorted({t for t in self.tables if any(
            route.group not in self._flat_of for route in self.layout.routes[t])})
        sequence = sorted(t for t, spec in self.tables.items() if spec.combiner is None)
        if outside or sequence:
            raise ValueError(f"reserve covers static, unquantized tables of pooled bags on the GPU; "
                             f"not {outside + sequence}")
        batch = check.count("batch_size", batch_size, minimum=1)
        features = list(self.feature_table)
        caps = max_ids if isinstance(max_ids, dict) else dict.fromkeys(features, max_ids)
        if set(caps) != set(features):
            raise ValueError(f"max_ids must name every feature {features}, got {sorted(caps)}")
        caps = {f: check.count(f"max_ids of {f!r}", caps[f], minimum=1) for f in features}
        for f, c in caps.items():
            if c >= 2**30:
                raise ValueError(f"max_ids of {f!r} must be < 2**30, got {c}")
        weighted = frozenset(weighted)
        if weighted - set(features):
            raise ValueError(f"weighted names unknown features {sorted(weighted - set(features))}")
        self._reserved = None
        firsts, value, offset = {}, 0, 0
        for f in features:
            firsts[f] = (value, offset)
            value += caps[f]
            offset += batch + 1
        table = kernels(space, "ragged").features_table(
            [firsts[f][0] for f in features] + [value], [k * batch for k in range(len(features) + 1)],
            [self.tables[self.feature_table[f]].num_rows for f in features], [0] * len(features),
            padded=True)
        staged = kernels(space, "ragged").Staged(space.zeros((value,), np.int64),
                                                 space.zeros((offset,), np.int64), space.put(table))
        psw = space.full((value,), 1.0, np.float32) if weighted else None
        by_key = defaultdict(list)
        for pair in self._own_pairs():
            by_key[self._flat_of[pair[0]]].append(pair)
        flats = {key: self._reserve_flat(space, key, pairs, batch, caps, firsts, psw)
                 for key, pairs in by_key.items()}
        self._reserved = _Reservation(batch, caps, weighted, firsts, staged, table, psw,
                                      space.xp.arange(batch + 1, dtype=np.int64), flats)

    @contextlib.contextmanager
    def capture(self):
        """The context in which a training step (a :meth:`forward` and its
        :meth:`backward`) is captured into a CUDA graph: enter it after :meth:`reserve`
        and at least one step of the same sizes, and outside the graph's capture (it
        waits for the device first). The step inside is recorded, not counted: its
        :class:`CapturedStep` (what the context gives) runs each replay with the host's
        part of a step around it (``step.replay(graph.replay)``). Before each replay, the
        next batch is copied into the captured step's input arrays, each feature's values
        padded to the captured length. Steps outside the graph may run between replays.
        A captured step that would copy from the host (id counts other than those of the
        step before it) raises ``RuntimeError``."""
        if self._reserved is None:
            raise RuntimeError("capture needs reserve first (a captured step allocates nothing)")
        if self._capturing is not None:
            raise RuntimeError("a step of this collection is being captured already")
        step = CapturedStep()
        with kernels(self._family(self.device), "graphs").capture_checks() as checks:
            self._capturing = step
            try:
                yield step
            finally:
                self._capturing = None
        step._checks = checks

    def _reserve_flat(self, space, key, pairs, batch, caps, firsts, psw):
        """The :class:`_ReservedFlat` of flat array ``key`` for ``pairs`` (group,
        replicated): one pool per feature's slice, over the feature's reserved ids."""
        pool_tables = kernels(space, "pool_tables")
        segments, layouts, outs = [], [], {}
        out_at, row_at, bound_at = 0, 0, 0
        for group, replicated in pairs:
            pools = []
            for combiner, members in self._flat_requests(space, group, replicated):
                for f, route, block, code, row_start, dim in members:
                    if f not in outs:
                        outs[f] = (out_at, dim)
                        out_at += batch * dim
                    segments.append(pool_tables.Segment(
                        block, firsts[f][0], caps[f], firsts[f][1], batch, row_start, code,
                        outs[f][0], dim, route.c0, row_at, bound_at, 0))
                    pools.append((combiner, row_at, row_at + caps[f], bound_at,
                                  [(f, route.c0, route.c1, 0, batch)]))
                    row_at += caps[f]
                    bound_at += batch + 1
            layouts.append(((group, replicated), pools))
        pooled = pool_tables.reserve(space, self.flats[key], segments,
                                     None if psw is None else psw.dtype, (out_at, row_at, bound_at))
        rows, bounds = pooled.rows, pooled.pool_offsets
        row_psw = None if psw is None else space.full((row_at,), 1.0, np.float32)
        contexts, firsts_of_rows = {}, []
        for pair, pools in layouts:
            contexts[pair] = LocalContext(pair[0], [
                Pool(combiner, rows[r0:r1], bounds[b0:b0 + batch + 1],
                     None if row_psw is None else row_psw[r0:r1], pieces, at=(r0, b0))
                for combiner, r0, r1, b0, pieces in pools], (key, rows, bounds, row_psw))
            firsts_of_rows += [(pieces[0][0], r0) for _, r0, _, _, pieces in pools]
        outputs = {f: [(0, dim, pooled.out[at:at + batch * dim].reshape(batch, dim))]
                   for f, (at, dim) in outs.items()}
        plan = self._flat_plan(_members(contexts.values()))
        step = kernels(space, "update_tables").reserve(space, plan.tables, plan.pools,
                                                       self.flats[key].dtype, psw is not None)
        return _ReservedFlat(pooled, contexts, outputs, step,
                             space.zeros((max(plan.size, 1),), np.float32), row_psw, firsts_of_rows)

    def forward(self, features, *, per_sample_weights=None, insert=True):
        """Pooled embeddings of this rank's batch: ``{feature: [B, dim]}`` (table dtype);
        for a sequence table (``combiner=None``) a :class:`hbkernels.types.JaggedRows`
        ``([N, dim] rows of every id, the input's offsets)``.

        ``features``: ``{feature: hbk.Ragged(values, offsets)}`` or a 1-D id array
        (one id per sample), or a TorchRec ``KeyedJaggedTensor`` (its keys the
        features, its weights the ``per_sample_weights``); ``per_sample_weights``:
        optional ``{feature: weights}`` (one per value). Collective: every rank calls it (with its own batch).
        Ids outside a table raise :class:`hbkernels.BoundsError` here and
        :class:`hbkernels.dist.CommError` on the other ranks. ``insert=False``
        (evaluation): dynamic tables only look their ids up, an id they do not hold
        reads as a zero row, and nothing is admitted or counted as a use.
        """
        start = time.perf_counter()
        try:
            return self._forward(features, per_sample_weights, insert)
        finally:
            self.call_seconds["forward"] += time.perf_counter() - start

    def _forward(self, features, per_sample_weights, insert):
        self._insert = bool(insert)
        self.stats = {"ids_bytes": 0, "rows_bytes": 0, "grads_bytes": 0, "replica_grads_bytes": 0}
        if (self._flat_key is not None and per_sample_weights is None and type(features) is dict
                and self._reserved is None and self._capturing is None):
            result = self._forward_flat(features)
            if result is not None:
                return result
        try:
            inputs, joined = self._read_inputs(features, per_sample_weights, defer=True)
        except Exception as error:
            if self.layout.exchange_groups and self.comm.world_size > 1:
                self.comm.fail_collectively("alltoallv", error)
            raise
        space = self._family(self.device)
        try:
            return self._pool_inputs(space, inputs, joined)
        finally:
            if self._unchecked is not None:  # a raise before any pooling launch
                self._launch_check(space, joined)

    def _own_pairs(self):
        """``(group, replicated)`` of every group, sharded then replicated: what a rank
        pools from its own rows at world size 1."""
        return ([(group, False) for group in self.layout.exchange_groups]
                + [(group, True) for group in self.layout.replica_groups])

    def _single_flat(self):
        """The key of the flat array whose one launch pools every table (world size 1, a
        GPU, every table static, unquantized, in the device's memory, pooled), else None."""
        if (self.comm.world_size != 1 or self.quantize or self.hash_tables or self.tiers
                or not self._family(self.device).is_cuda
                or any(spec.combiner is None for spec in self.tables.values())):
            return None
        keys = {self._flat_of.get(group) for group, _ in self._own_pairs()}
        return keys.pop() if len(keys) == 1 and None not in keys else None

    def _forward_flat(self, features):
        """:meth:`forward` of ``features`` where each is an ``hbk.Ragged`` of 1-D
        C-contiguous int32 or int64 arrays on the collection's device (no weights) and one
        launch pools every table (:attr:`_flat_key`): the check of the inputs and that
        launch, their plans in one copy, what the signature decides laid out once
        (:meth:`_door`). None where the inputs are not such: :meth:`forward` reads them."""
        arrays = []  # each feature's values and offsets
        for x in features.values():
            if type(x) is not Ragged:
                return None
            arrays += x
        space = self._family(self.device)
        if not arrays or device_family_of(*arrays, contiguous=True) is not space:
            return None
        for a in arrays:
            if a.ndim != 1 or a.dtype not in check.ID_DTYPES:
                return None
        batches = [arrays[k].shape[0] for k in range(1, len(arrays), 2)]  # (offsets: B + 1)
        door = self._doors.get((*features, *batches)) or self._door(space, features, batches)
        if door is None:
            return None
        values = [arrays[2 * k] for k in door.at]
        offsets = [arrays[2 * k + 1] for k in door.at]
        counts = [v.shape[0] for v in values]
        lay = door.lay
        columns, rows_at, firsts = lay.columns(counts)
        host = door.host.copy()  # the check's table, then the pooling plan: one copy
        host[door.placed] = firsts[1:] + counts + columns
        ragged = kernels(space, "ragged")
        with self._phase("kernels"):
            device = space.put(host)
            joined = ragged.join_arrays(space, values, offsets, device)
            ragged.check_features(space, door.order, values, offsets, door.limits, staged=joined)
            out, rows, bounds = kernels(space, "pool_tables").pool_tables(
                space, self.flats[self._flat_key], None, joined.values, joined.offsets, None,
                (lay.out_size, rows_at[-1], lay.bounds_size),
                plan=(lay.launch, device, door.base))
        self._saved = Saved(door.inputs, [], [], _FlatCall(door, counts, rows_at, rows, bounds))
        return lay.results(out)

    def _door(self, space, features, batches):
        """The :class:`_Door` of :meth:`_forward_flat` for ``features`` (names, the
        lengths of their offsets ``batches``), made once per such signature; None where
        :meth:`forward` reads them (an unknown feature, empty offsets)."""
        if any(f not in self.feature_table for f in features) or min(batches) < 1:
            return None
        given = {f: k for k, f in enumerate(features)}
        inputs = {}
        for f in sorted(features, key=self._feature_order.get):
            inputs[f] = _Feature(self.feature_table[f], None, None, None, batches[given[f]] - 1,
                                 None, None)
        lay = self._flat_layout(space, self._flat_key, self._own_pairs(), inputs, True)
        if lay is None or len(lay.outputs) != len(features):  # (each feature in the launch)
            return None
        if len(self._doors) >= 64:  # (batch sizes that vary: at most 64, cleared when full)
            self._doors.clear()
        tables = [inputs[f].table for f in lay.order]
        limits = [self.tables[t].num_rows for t in tables]
        ragged, n = kernels(space, "ragged"), len(lay.order)
        bags = [0]
        for f in lay.order:
            bags.append(bags[-1] + inputs[f].batch)
        table = ragged.features_table([0] * (n + 1), bags, limits, [0] * n)
        door = self._doors[(*features, *batches)] = _Door(
            [given[f] for f in lay.order], lay.order, limits, inputs, lay, tables,
            np.concatenate([table, lay.launch.plan]), table.shape[0],
            np.concatenate([*ragged.table_positions(n), lay.launch.placed + table.shape[0]]))
        return door

    def _pool_inputs(self, space, inputs, joined):
        """The rest of :meth:`forward`, from its checked ``inputs``."""
        outputs = {}
        if self.comm.world_size == 1:  # nothing leaves the rank: every group pools its own rows
            self._check_capacity(self._local_ids(inputs))
            exchanges = []
            local = [(group, False) for group in self.layout.exchange_groups]
        else:
            sent = [self._send_ids(group, inputs) for group in self.layout.exchange_groups]
            self._check_capacity({group.table: ids for group, ids in
                                  zip(self.layout.exchange_groups, (s[6] for s in sent))
                                  if group.dynamic}, collective=True)
            exchanges = [self._forward_exchange(group, inputs, outputs, s)
                         for group, s in zip(self.layout.exchange_groups, sent)]
            local = []
        local += [(group, True) for group in self.layout.replica_groups]
        local = self._forward_locals(local, inputs, outputs, joined)
        self._saved = Saved(inputs, exchanges, local)
        result = {}
        for f, feature in inputs.items():
            pieces = outputs[f]
            if len(pieces) == 1:  # the whole width
                result[f] = space.put(pieces[0][2])
            else:
                spec = self.tables[feature.table]
                result[f] = space.xp.empty((feature.batch, spec.dim), spec.dtype)
                for c0, c1, piece in pieces:
                    result[f][:, c0:c1] = space.put(piece)
            if feature.sequence_offsets is not None:
                result[f] = JaggedRows(result[f], feature.sequence_offsets)
        return result

    def prefetch(self, features, *, per_sample_weights=None):
        """Start reading, in a background thread, the rows the forward of ``features``
        (the next batch, as :meth:`forward` takes it) will fetch into the caches of
        tables in a slow tier (``cache_rows``): those each cache lacks now. The next
        :meth:`forward` takes them from there instead of the store; rows written to
        the store in between are read again. Call it after a step's forward (the
        current batch's rows are cached by then). Only looks ids up: nothing is
        admitted, counted as a use or evicted. Collective at world size > 1 when a
        sharded table has a cache (its ids go to their owners)."""
        cached = {g for routes in self.layout.routes.values() for g in (r.group for r in routes)
                  if g.table is not None and self.tables[g.table].cache_rows is not None}
        if not cached:
            return
        sharded = [g for g in self.layout.exchange_groups if g in cached]
        collective = self.comm.world_size > 1 and bool(sharded)
        try:
            inputs, _ = self._read_inputs(features, per_sample_weights)
        except Exception as error:
            if collective:
                self.comm.fail_collectively("alltoallv", error)
            raise
        insert, self._insert = self._insert, False  # dynamic tables only look up
        try:
            local = [(g, True) for g in self.layout.replica_groups if g in cached]
            if self.comm.world_size == 1:
                local += [(g, False) for g in sharded]
            else:
                for group in sharded:
                    keys, counts = self._send_keys(group, inputs)[3:5]
                    recv_keys, _ = self._exchange(keys, counts)
                    if group in self.tiers:
                        self.tiers[group].prefetch(self._rows_of_ids(group.table, recv_keys)
                                                   if group.dynamic else recv_keys)
            for group, replicated in local:
                requests = self._requests(group, inputs, replicated)
                if group in self.tiers and requests:
                    self.tiers[group].prefetch(self._joined_rows(
                        group, *self._local_rows(group, requests, inputs)))
        finally:
            self._insert = insert

    def cache_stats(self, name):
        """``{"lookups", "misses", "evictions", "prefetched", "rows"}`` of the cache of
        table ``name`` (``cache_rows``), summed over the ranks: distinct rows asked of it
        per batch, those fetched from the store (``prefetched`` of them read ahead),
        rows written back on eviction, and rows it holds now. Collective."""
        if name not in self.tables or self.tables[name].cache_rows is None:
            raise ValueError(f"table {name!r} has no cache (cache_rows)")
        keys = ("lookups", "misses", "evictions", "prefetched", "rows")
        counts = np.zeros(len(keys), np.int64)
        for group, tier in self.tiers.items():
            if group.table == name:
                counts += [tier.stats[k] for k in keys[:-1]] + [tier.capacity]
        if self.comm.world_size > 1:
            counts = host(self.comm.allreduce(counts))
        return dict(zip(keys, counts.tolist()))

    def _requests(self, group, inputs, replicated):
        """(feature, route) pairs of ``group``'s replicated (or sharded) slices, in a fixed order."""
        return [(f, route) for f, feature in inputs.items() for route in self.layout.routes[feature.table]
                if route.group == group and SHARDINGS[route.kind].replicated == replicated]

    @staticmethod
    def _joined_weights(space, features):
        """The per-sample weights of ``features`` one after another (ones for a feature
        without), or None where none has any."""
        if all(feature.psw is None for feature in features):
            return None
        return space.xp.concatenate([space.put(feature.psw) if feature.psw is not None else
                                     space.xp.ones(feature.values.shape[0], np.float32)
                                     for feature in features])

    def _pool(self, space, group_rows, requests, starts, inputs, ids_of, outputs, bounds="unchecked"):
        """One ``embedding_bag`` per combiner over ``group_rows`` for the ``requests``
        (the ids of request k are ``ids_of(k) + starts[k]``); pieces go to ``outputs``."""
        pools = []
        by_combiner = defaultdict(list)
        for k, (f, route) in enumerate(requests):
            by_combiner[self.tables[route.table].combiner or "sum"].append(k)  # None: 1-id bags
        for combiner, ks in sorted(by_combiner.items()):
            pieces, bag = [], 0
            for k in ks:
                f, route = requests[k]
                pieces.append((f, route.c0, route.c1, bag, inputs[f].batch))
                bag += inputs[f].batch
            values, offsets = kernels(space, "join_bags").join_bags(
                space, [space.put(ids_of(k)) for k in ks], [starts[k] for k in ks],
                [space.put(inputs[requests[k][0]].offsets) for k in ks])
            pool = Pool(combiner, values, offsets,
                        self._joined_weights(space, [inputs[requests[k][0]] for k in ks]),
                        pieces, bounds)
            with self._phase("kernels"):
                out = embedding_bag(group_rows, pool.values, pool.offsets, combiner=combiner,
                                    per_sample_weights=pool.psw, bounds=bounds)
            for f, c0, c1, b0, batch in pieces:
                outputs.setdefault(f, []).append((c0, c1, out[b0:b0 + batch]))
            pools.append(pool)
        return pools

    def _send_keys(self, group, inputs):
        """Route the ids of ``group``'s sharded requests: ``(requests, their starts in the
        distinct ids, total, keys in send order, send counts, the partition's order)``."""
        space = self._family(group.device)
        xp, n = space.xp, self.comm.world_size
        requests = self._requests(group, inputs, replicated=False)
        keys, dests, starts, total = [], [], [], 0
        for f, route in requests:
            uniq = space.put(inputs[f].uniq)
            dest, key = SHARDINGS[route.kind].route_ids(xp, uniq, route, n)
            keys.append(key)
            dests.append(dest)
            starts.append(total)
            total += int(uniq.shape[0])
        keys = xp.concatenate(keys) if keys else xp.zeros(0, np.int64)
        dests = xp.concatenate(dests) if dests else keys
        with self._phase("kernels"):
            if not group.dynamic:  # a row and its rank in one key: one partition moves both
                parted = partition(keys * n + dests, n)
                keys = parted.ids // n
            else:  # raw ids: any int64
                parted = partition(dests, n)
                keys = keys[parted.order]
        return requests, starts, total, keys, host(parted.counts), parted.order

    def _send_ids(self, group, inputs):
        """:meth:`_send_keys` of ``group`` plus the keys and counts this rank receives
        in their exchange."""
        sent = self._send_keys(group, inputs)
        return sent + self._exchange(sent[3], sent[4])

    def _local_ids(self, inputs):
        """``{dynamic table: its ids in this forward}`` at world size 1 where this
        forward asks several dynamic tables for ids (else ``{}``: see
        :meth:`_check_capacity`)."""
        by_table = defaultdict(list)
        for group in self.layout.exchange_groups:
            if group.dynamic:
                for f, route in self._requests(group, inputs, replicated=False):
                    by_table[route.table].append(inputs[f].values)
        if len(by_table) < 2:
            return {}
        xp = self._family(self.device).xp
        return {t: v[0] if len(v) == 1 else xp.concatenate(v) for t, v in by_table.items()}

    def _check_capacity(self, ids, collective=False):
        """Raise :class:`~hbkernels.CapacityError` before any dynamic table admits an id
        when the ids of some table (``{table: ids}``: those it would be asked for) do not
        fit, so that a forward that fails changes nothing; ``collective``: the ranks
        agree (the failing one raises, the others :class:`~hbkernels.dist.CommError`).
        One table's own call is already all or nothing: alone, it needs no check."""
        if not self._insert or len(ids) + collective < 2:
            return
        if collective and self.comm.world_size > 1:
            try:
                for table, keys in ids.items():
                    self.hash_tables[table].check_fits(keys)
            except CapacityError as error:
                self.comm.fail_collectively("allreduce", error)
                raise
            self.comm.allreduce(np.zeros(1, np.int64))  # every rank's ids fit: admit them
            return
        for table, keys in ids.items():
            self.hash_tables[table].check_fits(keys)

    def _forward_exchange(self, group, inputs, outputs, sent):
        """Pool ``group``'s sharded requests from the rows their owners send back;
        ``sent``: what :meth:`_send_ids` gave for ``group``."""
        space = self._family(group.device)
        xp, me = space.xp, self.comm.rank
        requests, starts, total, keys, send_counts, order, recv_keys, recv_counts = sent
        with self._phase("kernels"):
            bounds = "unchecked"
            if group.dynamic:  # the owner turns ids into rows (-1: not admitted)
                bounds = "zero"
                try:
                    if self.dedup:
                        owned, again = unique(recv_keys, return_inverse=True)
                        recv_keys = self._rows_of_ids(group.table, owned)[again]
                    else:  # (the table's own array on this rank: its slots are its rows)
                        recv_keys = self._rows_of_ids(group.table, recv_keys)
                except CapacityError as error:  # the peers are in the rows' exchange
                    self.comm.fail_collectively("alltoallv", error)
                    raise
            if group in self.tiers:  # store rows -> rows of the fast tier
                recv_keys = self.tiers[group].rows(recv_keys)
            table = self._fast(group).weights if group in self.arrays else None
            if recv_keys.shape[0] == 0:
                rows = xp.empty((0, group.width), group.dtype)
            elif self.dedup and not group.dynamic:
                owned, again = unique(recv_keys, return_inverse=True)
                rows = lookup(lookup(table, owned, bounds=bounds), again, bounds="unchecked")
            else:
                rows = lookup(table, recv_keys, bounds=bounds)
        rows, _ = self._exchange(rows, recv_counts, wire=True)
        with self._phase("kernels"):
            rows = lookup(rows, self._inverse_permutation(xp, order), bounds="unchecked")
        away_ids = int(send_counts.sum() - send_counts[me])
        away_rows = int(recv_counts.sum() - recv_counts[me])
        self.stats["ids_bytes"] += 8 * away_ids
        self.stats["rows_bytes"] += away_rows * group.width * self._wire_itemsize(group.dtype)
        pools = self._pool(space, rows, requests, starts, inputs,
                           lambda k: inputs[requests[k][0]].inverse, outputs)
        return ExchangeContext(group, pools, total, order, send_counts, recv_keys, recv_counts)

    def _forward_locals(self, pairs, inputs, outputs, joined=None):
        """:meth:`_forward_local` of each ``(group, replicated)`` of ``pairs``; those in a
        flat array pooled together, one launch per flat array (:meth:`_pool_flat`, which
        reads ``joined`` as :meth:`_read_inputs` gives it)."""
        flat = defaultdict(list)
        for group, replicated in pairs:
            if group in self._flat_of:
                flat[self._flat_of[group]].append((group, replicated))
        pooled = {}
        for key, members in flat.items():
            pooled.update(self._pool_flat(key, members, inputs, outputs, joined))
        if self._unchecked is not None:  # no flat launch took the check: before the others
            self._launch_check(self._family(self.device), joined)
        return [pooled[pair] if pair in pooled else
                self._forward_local(pair[0], inputs, outputs, pair[1]) for pair in pairs]

    def _pool_flat(self, key, pairs, inputs, outputs, joined=None):
        """Pool the requests of ``pairs`` ``(group, replicated)`` (static fused arrays in
        :attr:`flats` ``[key]``, their replicated or sharded slices) in one launch
        (:mod:`hbkernels.cuda.pool_tables`), reading the values and offsets in ``joined``
        (:meth:`_read_inputs`) or joining them; each feature's output, whole, goes to
        ``outputs`` (every slice of its table is in the launch). Returns ``{pair:
        LocalContext}``, their pools (one per combiner, as :meth:`_pool` makes them) views
        of what the launch wrote."""
        space = self._family(key[0])
        xp = space.xp
        pool_tables = kernels(space, "pool_tables")
        if self._reserved is not None:  # the reserved launch, over the staged inputs
            r = self._reserved
            flat = r.flats[key]
            for f, first_row in flat.segments:
                n = int(inputs[f].values.shape[0])
                if f in r.weighted and n:
                    flat.psw[first_row:first_row + n] = inputs[f].psw
            with self._phase("kernels"):
                pool_tables.pool_tables(space, self.flats[key], None, r.staged.values,
                                        r.staged.offsets, r.psw, None, into=flat.pooled)
            for f, pieces in flat.outputs.items():  # a smaller batch: its bags' rows
                batch = inputs[f].batch
                outputs[f] = pieces if batch == r.batch else [(0, pieces[0][1], pieces[0][2][:batch])]
            return flat.contexts
        lay = self._flat_layout(space, key, pairs, inputs, joined is not None)
        if lay is None:
            return {}
        columns, rows_at, _ = lay.columns([int(inputs[f].values.shape[0]) for f in lay.order])
        with self._phase("kernels"):
            if joined is not None:  # (no feature has weights)
                values, offsets, weights = joined.values, joined.offsets, None
            else:
                values = xp.concatenate([inputs[f].values for f in lay.order], dtype=np.int64)
                offsets = xp.concatenate([inputs[f].offsets for f in lay.order], dtype=np.int64)
                weights = self._joined_weights(space, [inputs[f] for f in lay.order])
            plan = pool_tables.placed(lay.launch, columns)
            if self._unchecked is not None:  # the input check's table, then the plan: one copy
                device = space.put(np.concatenate([joined.table, plan]))
                self._launch_check(space, joined, device)
                plan = (lay.launch, device, joined.table.shape[0])
            else:
                plan = (lay.launch, space.put(plan), 0)
            out, rows, bounds = pool_tables.pool_tables(
                space, self.flats[key], None, values, offsets, weights,
                (lay.out_size, rows_at[-1], lay.bounds_size), plan=plan)
        for f, result in lay.results(out).items():
            outputs[f] = [(0, result.shape[1], result)]
        # each row's weight, or None
        psw = None if joined is not None else self._joined_weights(
            space, [inputs[lay.order[k]] for k in lay.segment_features])
        flat = (rows, bounds, psw)
        return {pair: LocalContext(pair[0], [
            FlatPool(combiner, flat, (first_row, first_bound), count, bags, pieces, weighted)
            for combiner, first_row, count, first_bound, bags, pieces, weighted in pools],
            (key, *flat)) for pair, pools in lay.pooled(rows_at)}

    def _flat_layout(self, space, key, pairs, inputs, joined):
        """The :class:`_FlatLayout` of :meth:`_pool_flat`'s launch for ``pairs`` over the
        features of ``inputs`` (their batches and whether each has weights), their values
        ``joined`` in the order of ``inputs`` or else joined in the launch's order; None
        when no feature reads those pairs. Made once per such signature."""
        signature = (key, tuple(pairs), joined,
                     tuple((f, x.batch, x.psw is not None) for f, x in inputs.items()))
        found = self._flat_layouts.get(signature, False)
        if found is not False:
            return found
        pool_tables = kernels(space, "pool_tables")
        order = list(inputs) if joined else []  # the features, in the order of their values
        outs = {}  # feature -> its first output element
        out_at = bound_at = 0
        segments, features, pools_of = [], [], []  # (segment, feature), the pools per pair
        for group, replicated in pairs:
            pools = []
            for combiner, members in self._flat_requests(space, group, replicated):
                first, bag, pieces = len(segments), 0, []
                for f, route, block, code, row_start, dim in members:
                    feature = inputs.get(f)
                    if feature is None:
                        continue
                    if f not in outs:
                        if not joined:
                            order.append(f)
                        outs[f] = out_at
                        out_at += feature.batch * dim
                    segments.append((block, feature.batch, row_start, code, outs[f], dim,
                                     route.c0, bound_at + bag, first))
                    features.append(f)
                    pieces.append((f, route.c0, route.c1, bag, feature.batch))
                    bag += feature.batch
                if pieces:
                    pools.append((combiner, first, len(segments), bound_at, bag, tuple(pieces),
                                  any(inputs[f].psw is not None for f, *_ in pieces)))
                    bound_at += bag + 1
            pools_of.append(((group, replicated), pools))
        if len(self._flat_layouts) >= 64:  # (batch sizes that vary: the newest kept)
            self._flat_layouts.clear()
        if not segments:
            self._flat_layouts[signature] = None
            return None
        offset_firsts, at = {}, 0  # each feature's first offset
        for f in order:
            offset_firsts[f] = at
            at += inputs[f].batch + 1
        # the fields a call's counts change left 0 (pool_tables.placed writes them)
        launch = pool_tables.layout(self.flats[key], [
            pool_tables.Segment(block, 0, 0, offset_firsts[f], batch, row_start, code, out, dim,
                                c0, 0, bound, 0)
            for f, (block, batch, row_start, code, out, dim, c0, bound, _) in zip(features,
                                                                               segments)],
            np.dtype(np.float32) if any(inputs[f].psw is not None for f in order) else None)
        index = {f: k for k, f in enumerate(order)}
        dims = {self.tables[inputs[f].table].dim for f in outs}
        found = self._flat_layouts[signature] = _FlatLayout(
            order, [index[f] for f in features], [s[-1] for s in segments], launch, out_at,
            bound_at, dims.pop() if len(dims) == 1 else 0,
            [(f, outs[f], inputs[f].batch, self.tables[inputs[f].table].dim)
             for f in order if f in outs], pools_of)
        return found

    def _flat_requests(self, space, group, replicated):
        """``[(combiner, [(feature, route, block, combiner code, first row, dim), ...])]``:
        every request of ``group``'s ``replicated`` (or sharded) slices a forward may
        make, by combiner, in :meth:`_pool`'s order (made once)."""
        key = (group, replicated)
        found = self._flat_plans.get(key)
        if found is None:
            pool_tables = kernels(space, "pool_tables")
            block = pool_tables.block_of(space, self.flats[self._flat_of[group]],
                                         self.arrays[group].weights)
            by_combiner = defaultdict(list)
            for f in self.feature_table:
                spec = self.tables[self.feature_table[f]]
                for route in self.layout.routes[spec.name]:
                    if route.group == group and SHARDINGS[route.kind].replicated == replicated:
                        combiner = spec.combiner or "sum"  # None: 1-id bags
                        code = int(Combiner[combiner.upper()])
                        by_combiner[combiner].append((f, route, block, code,
                                                      int(route.bases[self.comm.rank]), spec.dim))
            found = self._flat_plans[key] = sorted(by_combiner.items())
        return found

    def _forward_local(self, group, inputs, outputs, replicated):
        """Pool ``group``'s requests from this rank's own rows: a replicated group at
        any world size, a sharded one at world size 1 (where this rank holds every row)."""
        space = self._family(group.device)
        requests = self._requests(group, inputs, replicated)
        ids, starts = self._local_rows(group, requests, inputs)
        if group in self.tiers and requests:  # one call for the group: store rows -> fast rows
            rows = self.tiers[group].rows(self._joined_rows(group, ids, starts))
            cuts = np.cumsum([0] + [int(i.shape[0]) for i in ids])
            ids = [rows[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
            starts = [0] * len(requests)
        pools = self._pool(space, self._fast(group).weights, requests, starts, inputs,
                           lambda k: ids[k], outputs, "zero" if group.dynamic else "unchecked")
        return LocalContext(group, pools)

    def _local_rows(self, group, requests, inputs):
        """``(ids, starts)``: request k reads rows ``ids[k] + starts[k]`` of ``group``'s
        fused array on this rank (a dynamic table's slots, -1 for an id it lacks)."""
        space = self._family(group.device)
        starts = [int(route.bases[self.comm.rank]) for _, route in requests]
        ids = [inputs[f].values for f, _ in requests]
        if group.dynamic:  # one call of each table for all its features; rows with -1 kept
            for table in dict.fromkeys(route.table for _, route in requests):
                ks = [k for k, (_, route) in enumerate(requests) if route.table == table]
                rows = self._rows_of_ids(table, ids[ks[0]] if len(ks) == 1 else
                                         space.xp.concatenate([ids[k] for k in ks]))
                if starts[ks[0]]:
                    rows = space.xp.where(rows >= 0, rows + starts[ks[0]], -1)
                cuts = np.cumsum([0] + [int(ids[k].shape[0]) for k in ks])
                for k, a, b in zip(ks, cuts[:-1], cuts[1:]):
                    ids[k] = rows[a:b]
            starts = [0] * len(requests)
        return ids, starts

    def _joined_rows(self, group, ids, starts):
        """The rows ``ids[k] + starts[k]`` of :meth:`_local_rows`, one array on the
        group's device."""
        space = self._family(group.device)
        return space.xp.concatenate([space.put(ids[k]) + starts[k] for k in range(len(ids))])

    def _dynamic_shard(self, name):
        """This rank's shard of dynamic table ``name``."""
        return next(s for s in self.layout.shards[name] if s.rank == self.comm.rank)

    def _rows_of_ids(self, name, ids):
        """Dynamic table ``name``'s slots for ``ids`` (one call of its hash table: every
        id is a use; -1 for an id not admitted yet). Slots given out in the call get the
        rows their ids start with and fresh optimizer state."""
        if not self._insert:
            return self.hash_tables[name].slots(ids, insert=False)
        slots, new_ids, new_slots = self.hash_tables[name].slots(ids, return_new=True)
        if new_slots.shape[0]:
            shard = self._dynamic_shard(name)
            fused, space = self.arrays[shard.group], self._family(shard.group.device)
            at = new_slots + shard.base
            self._mark_changed(shard.group, at, store=True)
            rows = initial_rows(self.tables[name], self.seed, host(new_ids))
            if shard.group in self.tiers:
                self.tiers[shard.group].write(host(at), rows, self._fresh_state(shard.group, host=True))
                return slots
            fused.weights[at] = space.put(rows)
            for slot, value in self._fresh_state(shard.group).items():
                fused.state[slot][at] = value
        return slots

    def _fresh_state(self, group, host=False):
        """Each optimizer slot's value in a row of ``group`` that no update has touched
        (``init_state``'s: a row for a per-element slot, a number for a per-row one), on
        the group's device or, ``host``, in NumPy."""
        if (group, host) not in self._fresh:
            space = self._family("cpu" if host else group.device)
            state = self.optimizer.init_state(space.zeros((1, group.width), group.dtype))
            self._fresh[group, host] = {slot: state[slot][0] for slot, _ in self.optimizer.slots}
        return self._fresh[group, host]

    @staticmethod
    def _inverse_permutation(xp, order):
        inv = xp.empty_like(order)
        inv[order] = xp.arange(order.shape[0], dtype=order.dtype)
        return inv

    def _wire_itemsize(self, dtype):
        """Bytes per element of ``dtype`` data on the wire (2 with a wire dtype)."""
        return 2 if self.wire_dtype else np.dtype(dtype).itemsize

    # -- backward ------------------------------------------------------------------------------------
    def backward(self, grads):
        """Apply the optimizer for ``grads = {feature: d loss / d output}`` ([B, dim]
        per feature of the last :meth:`forward`; [N, dim] for a sequence table's
        rows) to the rows this rank owns.
        Collective; gradients of all ranks are summed. A quantized collection
        (:meth:`quantized`) refuses it with a ``TypeError``. On the CPU, under the
        optimizer's ``nonfinite="raise"``, a NaN or Inf in ``grads`` raises ``ValueError``
        (naming the feature and row) before any table changes, and
        :class:`hbkernels.dist.CommError` on the other ranks; on a GPU the optimizer
        checks each fused array's gradient as it updates it (the error is raised at the
        next wait, :func:`hbkernels.synchronize`). Step counts: with
        :attr:`step_per_table` (Adam, stochastic rounding) each table counts the
        backwards whose global batch held at least one of its ids (as torch counts the
        steps of a parameter with a gradient); otherwise every fused array counts every
        backward."""
        start = time.perf_counter()
        try:
            self._backward(grads)
        finally:
            self.call_seconds["backward"] += time.perf_counter() - start

    def _backward(self, grads):
        if self.quantize:
            raise TypeError(f"tables {sorted(self.quantize)} are quantized: this collection is "
                            f"for inference (forward only), it takes no backward")
        if self._saved is None:
            raise RuntimeError("backward needs a forward first (each forward allows one backward)")
        if self._saved.flat is not None:
            self._backward_flat(grads)
            return
        inputs = self._saved.inputs
        try:
            grads = self._read_grads(grads, inputs)
        except Exception as error:
            exchanges = self.layout.exchange_groups
            if (exchanges or self.layout.replica_groups) and self.comm.world_size > 1:
                self.comm.fail_collectively("alltoallv" if exchanges else "allgatherv", error)
            raise
        updates = defaultdict(list)  # group -> [(ids, rows)]
        for ctx in self._saved.exchanges:
            group = ctx.group
            space = self._family(group.device)
            xp = space.xp
            with self._phase("kernels"):
                request_grads = xp.zeros((ctx.rows, group.width), np.float32)
                for ids, rows in self._pool_backward(space, ctx.pools, grads, ctx.rows):
                    request_grads[ids] = rows
                request_grads = lookup(request_grads, ctx.order, bounds="unchecked")
            received, counts = self._exchange(request_grads, ctx.send_counts, wire=True)
            self.stats["grads_bytes"] += (int(ctx.send_counts.sum() - ctx.send_counts[self.comm.rank])
                                          * group.width * self._wire_itemsize(np.float32))
            updates[group].append((ctx.recv_keys, received))
        fused_steps = {}  # group -> (its one pool, that pool's gradient): a fused backward and step
        flat_steps = defaultdict(list)  # flat array -> its groups' contexts: one fused step
        # a group pooled once (a fused array may hold a replicated table and a sharded one)
        pooled_once = Counter(ctx.group for ctx in self._saved.locals if ctx.pools)
        for ctx in self._saved.locals:
            if self.comm.world_size == 1 and ctx.flat is not None:
                flat_steps[ctx.flat[0]].append(ctx)
                continue
            group = ctx.group
            space = self._family(group.device)
            if self.comm.world_size == 1 and len(ctx.pools) == 1 and pooled_once[group] == 1:
                fused_steps[group] = (ctx.pools[0], self._pool_grad(space, ctx.pools[0], grads))
                continue
            num_rows = int(self._fast(group).weights.shape[0])
            parts = self._pool_backward(space, ctx.pools, grads, num_rows)
            if parts:
                ids = space.xp.concatenate([p[0].astype(np.int64) for p in parts])
                rows = space.xp.concatenate([p[1] for p in parts])
            else:  # none of the group's features was in the forward: nothing to add
                ids = space.xp.zeros(0, np.int64)
                rows = space.xp.zeros((0, group.width), np.float32)
            if self.comm.world_size > 1:
                with self._phase("comm"):
                    wire = self._wire_itemsize(np.float32)
                    self.stats["replica_grads_bytes"] += ((self.comm.world_size - 1) * int(ids.shape[0])
                                                          * (8 + group.width * wire))
                    if group in self.tiers:  # rows of each rank's own cache: send store rows
                        ids = space.put(self.tiers[group].store_rows(ids))
                    ids, _ = self.comm.allgatherv(ids)
                    rows, _ = self.comm.allgatherv(rows, wire_dtype=self.wire_dtype)
                    if group in self.tiers:
                        ids = self.tiers[group].rows(ids)
            updates[group].append((ids, rows))
        self._saved = None
        stepped = self._stepped_tables(inputs)  # (after the peers' exchanges: collective)
        flat_groups = set()
        for contexts in flat_steps.values():
            with self._phase("kernels"):
                key = contexts[0].flat[0]
                self._flat_step(contexts[0].flat, _members(contexts), grads, stepped,
                                None if self._reserved is None else self._reserved.flats[key])
            for ctx in contexts:
                flat_groups.add(ctx.group)
                for pool in ctx.pools:  # (rows past a reserved pool's bags are -1)
                    if self._capturing is not None:  # after each replay
                        self._capturing._after.append(
                            lambda group=ctx.group, rows=pool.values: self._mark_changed(group, rows))
                    elif self._changed is not None:
                        self._mark_changed(ctx.group, pool.values)
        for group in self.arrays:
            if group in flat_groups:
                continue
            fused = self._fast(group)
            if stepped is not None and group.table not in stepped:
                continue  # none of its table's ids in the global batch: no step to count
            if group in fused_steps:
                pool, grad = fused_steps[group]
                with self._phase("kernels"):
                    self.optimizer.fused_step(fused.weights, fused.state, grad, pool.values, pool.offsets,
                                              combiner=pool.combiner, per_sample_weights=pool.psw,
                                              bounds=pool.bounds)
                self._mark_changed(group, pool.values)
                continue
            xp = self._family(group.device).xp
            parts = updates.get(group, [])
            ids = xp.concatenate([p[0] for p in parts]) if parts else xp.zeros(0, np.int64)
            rows = (xp.concatenate([p[1] for p in parts]) if parts
                    else xp.zeros((0, group.width), np.float32))
            if group.dynamic:  # ids not admitted (-1) get no update
                kept = ids >= 0
                ids, rows = ids[kept], rows[kept]
            with self._phase("kernels"):
                self.optimizer.step(fused.weights, fused.state, SparseGrad(ids, rows))
            self._mark_changed(group, ids)

    def _stepped_tables(self, inputs):
        """The tables whose step this backward counts, when each counts its own
        (:attr:`step_per_table`): those the global batch holds ids of (an allreduce at
        world size > 1); None when every array counts every step."""
        if not self.step_per_table:
            return None
        held = {x.table for x in inputs.values() if x.values.shape[0]}
        if self.comm.world_size == 1:
            return held
        names = list(self.tables)
        flags = host(self.comm.allreduce(np.array([name in held for name in names], np.int64)))
        return {name for name, flag in zip(names, flags) if flag}

    def _backward_flat(self, grads):
        """:meth:`backward` after a forward of :meth:`_forward_flat`."""
        call = self._saved.flat
        grads = self._read_grads(grads, self._saved.inputs)
        self._saved = None
        stepped = ({t for t, n in zip(call.door.tables, call.counts) if n}
                   if self.step_per_table else None)
        members = [(pair[0], [p[:6] for p in pools])
                   for pair, pools in call.door.lay.pooled(call.rows_at)]
        with self._phase("kernels"):  # (no reservation: the forward took none)
            self._flat_step((self._flat_key, call.rows, call.bounds, None), members, grads,
                            stepped, None)
        if self._changed is not None:
            for group, pools in members:
                for _, first, count, *_ in pools:
                    self._mark_changed(group, call.rows[first:first + count])

    def _flat_plan(self, members, stepped=None):
        """The :class:`_FlatPlan` of the update of one flat array's ``members`` (as
        :func:`_members` gives them); ``stepped``: as :meth:`_stepped_tables` gives it."""
        update_tables = kernels(self._family(members[0][0].device), "update_tables")
        stochastic = self.optimizer.rounding == "stochastic"
        tables, pools, places, counters = [], [], [], []
        grad_at = 0
        hp = None
        constants = {}  # step number -> the optimizer's constants of that step
        by_group = {}  # (a fused array may hold a replicated table and a sharded one: one table)
        for group, group_pools in members:
            by_group[group] = by_group.get(group, []) + group_pools
        for group, group_pools in sorted(by_group.items(), key=lambda m: self._flat_blocks[m[0]][1]):
            fused = self.arrays[group]
            if stepped is None or group.table in stepped:
                counters.append(fused.state["step"])
            step = int(fused.state["step"][0]) + 1
            found = constants.get(step)
            if found is None:
                found = constants[step] = self.optimizer.step_constants(step)
            hp, rounding = found
            width = group.width
            bags = ids = 0
            for combiner, first_row, count, first_bound, n_bags, pieces in group_pools:
                pools.append(update_tables.Pool(len(tables), first_row, count, first_bound,
                                                n_bags, bags, int(Combiner[combiner.upper()])))
                for f, c0, c1, b0, batch in pieces:
                    places.append((grad_at + (bags + b0) * width, f, c0, c1, batch))
                bags += n_bags
                ids += count
            at, first_key = self._flat_blocks[group]
            tables.append(update_tables.Table(at, int(fused.weights.shape[0]), width, first_key,
                                              grad_at, bags, ids, hp[_rules.STEP_SIZE],
                                              rounding if stochastic else 0))
            grad_at += bags * width
        return _FlatPlan(tables, pools, places, counters, hp, grad_at)

    def _flat_step(self, flat, members, grads, stepped, reserved):
        """The fused backward and optimizer step of the fused arrays of ``members`` (one
        flat array's, as :func:`_members` gives them, pooled by its launch, which wrote
        ``flat``: ``(key, rows, bounds, weights or None)``) in the launches of one
        ``fused_step`` (:mod:`hbkernels.cuda.update_tables`): the same results as a
        ``fused_step`` of each. Each array's step count advances (taken back if the
        gradient's check fails at the next wait), of those of ``stepped`` tables (None:
        all); ``reserved``: the flat array's part of the reservation the forward took, or
        None."""
        key, rows, bounds, psw = flat
        space = self._family(key[0])
        xp = space.xp
        plan = self._flat_plan(members, stepped)
        if reserved is not None:  # the gradient copied into the reserved one, piece by piece
            grad = reserved.grad
            for start, f, c0, c1, batch in plan.places:
                block = grad[start:start + batch * (c1 - c0)].reshape(batch, c1 - c0)
                given = int(grads[f].shape[0])
                block[:given] = _columns(grads[f], c0, c1)
                if given < batch:  # the empty bags' rows: checked, never read
                    block[given:] = 0
        elif plan.places:
            pieces = [_columns(grads[f], c0, c1) for _, f, c0, c1, _ in plan.places]
            if len({p.shape[1] for p in pieces}) == 1:  # one width: joined by rows
                grad = xp.concatenate(pieces)
            else:
                grad = xp.concatenate([p.reshape(-1) for p in pieces])
            grad = grad.astype(np.float32, copy=False)
        else:
            grad = xp.zeros(0, np.float32)
        def report(element):  # the step did not count
            for counter in plan.counters:
                counter[0] -= 1
            starts = [place[0] for place in plan.places]
            start, f, c0, c1, _ = plan.places[bisect.bisect_right(starts, element) - 1]
            check.raise_nonfinite(f"grad of {f!r}", (element - start) // (c1 - c0))

        opt = self.optimizer  # hp: the last array's; the rule's constants other than its
        #                       step size (taken from each table) are the same for all
        kernels(space, "update_tables").update_tables(
            space, opt.rule, self.flats[key], *[self.state_flats[key, slot] for slot, _ in opt.slots],
            *[None] * (2 - len(opt.slots)), [per_row for _, per_row in opt.slots] + [False] * 2,
            plan.hp, plan.tables, plan.pools, grad, rows, bounds, psw, opt.nonfinite == "raise",
            opt.nonfinite == "skip", opt.rounding == "stochastic", report,
            into=None if reserved is None else reserved.step, upload=self._capturing is None)

        def counted():
            for counter in plan.counters:
                counter[0] += 1

        if self._capturing is None:
            counted()
            return

        uploaded = [None]  # each table's step size and rounding key in the device's plan

        def upload():  # the plan of the step after the counted ones, where it changed
            constants = [self.optimizer.step_constants(int(counter[0]) + 1)
                         for counter in plan.counters]
            key = [(hp[_rules.STEP_SIZE], rounding) for hp, rounding in constants]
            if key != uploaded[0]:
                upcoming = self._flat_plan(members, stepped)
                kernels(space, "update_tables").upload_plan(space, reserved.step,
                                                            upcoming.tables, upcoming.pools)
                uploaded[0] = key

        self._capturing._before.append(upload)
        self._capturing._after.append(counted)

    def _mark_changed(self, group, rows, store=False):
        """Note ``rows`` (of ``group``'s fused array, or its fast tier's unless ``store``;
        -1 ignored) as changed since the last save, once a save has started the count
        (for ``save(incremental=True)``)."""
        if self._changed is not None and rows.shape[0]:
            if group in self.tiers and not store:
                rows = self._family(group.device).put(self.tiers[group].store_rows(rows))
            self._changed[group][rows[rows >= 0]] = True

    def _read_grads(self, grads, inputs):
        if not isinstance(grads, dict):
            raise TypeError(f"grads must be a dict feature -> [B, dim] array, got {type(grads).__name__}")
        if grads.keys() != inputs.keys():
            raise ValueError(f"backward needs a gradient for exactly the features of the forward "
                             f"{sorted(inputs)}, got {sorted(grads)}")
        space = self._family(self.device)
        # C-contiguous CuPy arrays of the collection's device: as they are
        as_given = (bool(grads) and space.is_cuda
                    and cupy_family_of(*grads.values(), contiguous=True) is space)
        out = {}
        read_nonfinite = self.optimizer.nonfinite == "raise" and not space.is_cuda
        for f, feature in inputs.items():
            g = grads[f]
            if isinstance(g, JaggedRows):
                g = g.values
            if not as_given:
                family, a = resolve(grad=g)
                g = a["grad"]
                if family != space:
                    raise TypeError(f"grad of {f!r} is a {family.name} array; the collection "
                                    f"lives on {self.device}")
            dim = self.tables[feature.table].dim
            if g.ndim != 2 or g.shape != (feature.batch, dim):
                rows = "N" if feature.sequence_offsets is not None else "B"
                raise ValueError(f"grad of {f!r} must be [{rows}, dim] = [{feature.batch}, {dim}], "
                                 f"got {tuple(g.shape)}")
            if g.dtype not in check.TABLE_DTYPES:
                check.floating(f"grad of {f!r}", g)
            if read_nonfinite:  # before any update
                check.raise_nonfinite(f"grad of {f!r}",
                                      kernels(family, "sparse_update").first_nonfinite_row(family, g))
            out[f] = g
        return out

    def _pool_backward(self, space, pools, grads, num_rows):
        """[(ids, rows)] of each pool's sparse gradient w.r.t. the pooled rows."""
        parts = []
        for pool in pools:
            with self._phase("kernels"):
                sg = embedding_bag_backward(self._pool_grad(space, pool, grads), pool.values,
                                            pool.offsets, num_rows=num_rows, combiner=pool.combiner,
                                            per_sample_weights=pool.psw, bounds=pool.bounds)
            parts.append((sg.ids, sg.rows))
        return parts

    @staticmethod
    def _pool_grad(space, pool, grads):
        """The fp32 gradient of ``pool``'s output: its pieces of ``grads``, stacked."""
        grad = space.xp.concatenate([space.put(grads[f][:, c0:c1]) for f, c0, c1, _, _ in pool.pieces])
        return grad.astype(np.float32, copy=False)

    # -- whole tables ---------------------------------------------------------------------------------
    def _gather(self, name, pick, per_column, dtype):
        """Table ``name``'s array made of ``pick(shard)`` (this rank's rows of a shard:
        ``[rows, cols]`` when ``per_column``, else ``[rows]``), whole, on every rank."""
        if name not in self.tables:
            raise KeyError(f"no table {name!r}; tables: {sorted(self.tables)}")
        shards = sorted(self.layout.shards[name], key=lambda s: s.slice)
        xp = self._family(self._store_device(shards[0].group)).xp
        return SHARDINGS[self.plan[name].kind].gather(
            self.comm, self.tables[name], shards, lambda s: xp.ascontiguousarray(pick(s)),
            per_column, dtype, xp)  # (a store's records hold its arrays' rows a record apart)

    def _rows_of(self, shard, array):
        return array[shard.base:shard.base + shard.num_rows]

    def full_weights(self, name):
        """Table ``name`` gathered whole ([num_rows, dim]), the same on every rank: a
        new array (later steps do not change it); for a dynamic table ``(ids, rows)``,
        its live ids ascending and their rows; for a quantized table its rows
        dequantized (float32). Collective.

        >>> import hbkernels as hbk
        >>> coll = hbk.EmbeddingCollection([hbk.TableSpec("t", num_rows=5, dim=2)],
        ...                                comm=hbk.dist.init("local"))
        >>> coll.full_weights("t").shape
        (5, 2)
        """
        self._settle(make=True)
        if name in self.tables and self.tables[name].dynamic:
            return self._gather_dynamic(name, lambda fused: fused.weights)
        if name in self.quantize:
            return self._gather(name, lambda s: self.arrays[s.group].weights.dequantize(
                slice(s.base, s.base + s.num_rows)), True, np.float32)
        return self._gather(
            name, lambda s: self._rows_of(s, self.arrays[s.group].weights), True,
            self.tables.get(name, self.tables[next(iter(self.tables))]).dtype)

    def _gather_dynamic(self, name, pick):
        """``(ids, rows)`` of dynamic table ``name``: its live ids over all ranks, ascending,
        and their rows of ``pick(fused arrays)``, the same on every rank. Collective."""
        shard = self._dynamic_shard(name)
        space = self._family(self._store_device(shard.group))
        ids, slots = (space.put(a) for a in self.hash_tables[name].items())
        rows = space.xp.ascontiguousarray(pick(self.arrays[shard.group])[slots + shard.base])
        if self.comm.world_size > 1:
            ids, _ = self.comm.allgatherv(ids)
            rows, _ = self.comm.allgatherv(rows)
            order = space.xp.argsort(ids)
            ids, rows = ids[order], rows[order]
        return ids, rows

    def dynamic_scores(self, name):
        """``(ids, last, count)`` of dynamic table ``name`` over all ranks, ascending by
        id: each live id's last use and its uses, as its rank's hash table counts
        them. Collective."""
        state = self.hash_tables[name].state()
        return self._gathered_by_id(state["ids"], state["last"], state["count"])

    def dynamic_pending(self, name):
        """``(ids, last, count)`` of the ids of dynamic table ``name`` waiting for
        admission, over all ranks, ascending by id (``count``: their sightings), or
        None for a table that admits on first sight (``admit_count=1``). Collective."""
        pending = self.hash_tables[name].pending_state()
        if pending is None:
            return None
        return self._gathered_by_id(pending["ids"], pending["last"], pending["count"])

    def _gathered_by_id(self, ids, last, count):
        if self.comm.world_size > 1:
            ids, last, count = (host(self.comm.allgatherv(a)[0]) for a in (ids, last, count))
            order = np.argsort(ids)
            ids, last, count = ids[order], last[order], count[order]
        return ids, last, count

    def rows_written_elsewhere(self):
        """Rows were written other than by :meth:`backward` (a restore): the next save
        is a full one, since no incremental save could say what changed."""
        self._chain_bytes = math.inf

    def restore_dynamic(self, name, ids, last, count, rows, pending=None, clock=0):
        """Put the saved ids of dynamic table ``name`` back (NumPy arrays over all
        ranks; this rank takes the ids it owns), replacing what the table held here:
        ``last`` and ``count`` their scores, ``rows`` ``{"weights" or an optimizer slot:
        rows}`` aligned with ``ids``, ``pending`` ``(ids, last, count)`` of ids waiting
        for admission. The table's call counter (one clock for every rank's share: each
        counts every call) becomes the largest of ``clock`` and the ``last`` of the ids
        given, live and pending. A shard given more ids than its slots leaves out
        those its policy evicts first (:meth:`hbkernels.HashTable.restore`), with a
        ``RuntimeWarning``. Not collective."""
        shard = self._dynamic_shard(name)
        n, me = self.comm.world_size, self.comm.rank
        table = self.hash_tables[name]
        table.clear()
        self.rows_written_elsewhere()
        mine = dynamic_owner(np, ids, n) == me
        step = max(int(clock), int(last.max()) if last.shape[0] else 0)  # the call counter
        waiting = None
        if pending is not None:
            theirs = dynamic_owner(np, pending[0], n) == me
            waiting = tuple(a[theirs] for a in pending)
            if pending[1].shape[0]:
                step = max(step, int(pending[1].max()))
            waiting += (step,)
        slots = table.restore(ids[mine], last[mine], count[mine], step, waiting)
        kept = slots >= 0
        if not kept.all():
            warnings.warn(f"{table.name}: {int((~kept).sum())} of the {kept.shape[0]} ids restored "
                          f"here do not fit its capacity; those its policy "
                          f"(evict={table.evict!r}) evicts first were left out", RuntimeWarning,
                          stacklevel=2)
        fused = self.arrays[shard.group]
        space = self._family(shard.group.device)
        if shard.group in self.tiers:  # into the store, the cache emptied
            self.tiers[shard.group].clear()
            space = self._family(self._store_device(shard.group))
        at = space.put(slots[kept] + shard.base)
        for array, values in rows.items():
            target = fused.weights if array == "weights" else fused.state[array]
            target[at] = space.put(np.ascontiguousarray(np.asarray(values)[mine][kept]))

    def dynamic_counts(self, name):
        """``{"size", "admitted", "evicted", "forgotten"}`` of dynamic table ``name``,
        summed over the ranks: live ids, ids given a row or evicted so far, and ids
        waiting for admission whose sightings were forgotten so far because the pending
        table (``capacity`` ids per rank's share) was full. Collective."""
        table = self.hash_tables[name]
        counts = np.array([table.size, table.admitted, table.evicted, table.forgotten], np.int64)
        if self.comm.world_size > 1:
            counts = host(self.comm.allreduce(counts))
        return dict(zip(("size", "admitted", "evicted", "forgotten"), counts.tolist()))

    def full_state(self, name):
        """The optimizer state of table ``name`` gathered whole (slot -> array shaped
        as ``init_state`` of the whole table) plus ``"step"`` (int); for a dynamic
        table each slot's rows of its live ids, and those ``"ids"`` (ascending). Collective."""
        out = {}
        self._settle(make=True)
        for slot, per_row in self.optimizer.slots:
            if name in self.quantize:  # (no optimizer state)
                break
            if name in self.tables and self.tables[name].dynamic:
                out["ids"], out[slot] = self._gather_dynamic(name, lambda f, slot=slot: f.state[slot])
                continue
            out[slot] = self._gather(
                name, lambda s, slot=slot: self._rows_of(s, self.arrays[s.group].state[slot]),
                not per_row, np.float32)
        holder = min(self.layout.shards[name], key=lambda s: (s.slice, s.rank))
        step = int(self.arrays[holder.group].state["step"][0]) if holder.rank == self.comm.rank else 0
        if self.comm.world_size > 1:
            step = int(self.comm.broadcast(np.array([step], np.int64), root=holder.rank)[0])
        out["step"] = step
        return out

    # -- inference ------------------------------------------------------------------------------------
    def quantized(self, bits=8, tables=None):
        """A forward-only collection with the same tables, plan and ranks, ``tables``
        (default: all) held row-wise quantized to ``bits`` (8, 4 or 2;
        :func:`hbkernels.quantize_rows`), the others copied as they are. Each table row
        is quantized whole, so its forward equals the float forward on
        ``quantize_rows(full_weights(name)).dequantize()`` up to float32 summation
        order, its :meth:`full_weights` is that table, and it saves and loads at any
        world size as exactly the same codes. Its forward returns float32 for the
        quantized tables; :meth:`backward` raises ``TypeError``; a collection with dynamic
        tables is a ``ValueError``. Tables in a slow tier are read whole and held quantized
        in memory.
        Collective.

        >>> import numpy as np, hbkernels as hbk
        >>> coll = hbk.EmbeddingCollection([hbk.TableSpec("t", num_rows=100, dim=8)],
        ...                                comm=hbk.dist.init("local"))
        >>> q = coll.quantized(bits=4)
        >>> q.arrays[next(iter(q.arrays))].weights.nbytes   # 100 rows of 4 + 4 bytes
        800
        >>> q.forward({"t": np.array([3, 7])})["t"].dtype
        dtype('float32')
        """
        quantize = quantized_tables.request(self, bits, tables)
        self._settle(make=True)
        values = quantized_tables.quantize_shards(self, quantize)

        def rows_of(shard, rows):
            if shard.table in quantize:
                return quantized_tables.select(values[shard.table, shard.slice], shard, rows)
            mine = next(s for s in self.layout.shards[shard.table]  # same plan: the same rows
                        if (s.slice, s.rank) == (shard.slice, shard.rank))
            weights = self.shard_arrays(mine)["weights"]
            return host(weights[self._family(mine.group.device).put(
                (rows - mine.row_start) // mine.row_step)])

        return type(self)(list(self.tables.values()), comm=self.comm, optimizer=_optim.SGD(lr=1.0),
                          plan=self.plan, batch_size_hint=self.batch_size_hint,
                          wire_dtype=self.wire_dtype, seed=self.seed, device=self.device,
                          dedup=self.dedup, memory_per_rank=None, profile=self.profile,
                          initializer=rows_of, quantize=quantize)

    # -- checkpoints ----------------------------------------------------------------------------------
    def save(self, path, incremental=False, *, chain_limit=CHAIN_LIMIT):
        """Write a checkpoint directory (see :mod:`hbkernels.sharding.checkpoint`):
        arrays plus a JSON manifest, atomically; collective. ``incremental``: only what
        changed since this collection's previous save (rows and optimizer state of the
        rows touched; of a dynamic table the ids used, admitted and evicted and their
        scores), into a new directory ``path`` chained to that save (``load`` replays the
        chain). Once the incremental saves since the last full one hold ``chain_limit``
        times its bytes (each counted as at least
        :data:`~hbkernels.sharding.checkpoint.CHAIN_SAVE_BYTES`, what opening a save costs
        a load), or number :data:`~hbkernels.sharding.checkpoint.MAX_CHAIN`, or
        after rows were written other than by :meth:`backward` (:meth:`restore_dynamic`,
        a torch ``load_state_dict``), an incremental save is written full instead (a new
        chain).
        Returns ``"full"`` or ``"incremental"``: what was written."""
        where = os.path.abspath(os.fspath(path))
        parent = None
        if incremental:
            if self.quantize:
                raise ValueError("a quantized collection does not change: save it whole")
            if self._last_save is None:
                raise ValueError("save(incremental=True) needs an earlier save of this collection")
            if where in self._chain:
                raise ValueError(f"{path} holds a save this incremental save chains to; save it "
                                 f"to a new directory")
            parent = self._last_save
            if (self._chain_bytes >= chain_limit * self._full_bytes
                    or len(self._chain) > checkpoint.MAX_CHAIN):
                parent, incremental = None, False  # the chain is long enough: start a new one
        self._settle()
        link, written, self._marks = checkpoint.save(
            self, path, parent=parent, changed=self._changed if incremental else None,
            since=self._marks if incremental else None)
        self._chain = self._chain + [where] if incremental else [where]
        self._last_save = (where, link)
        if incremental:
            self._chain_bytes += max(written, checkpoint.CHAIN_SAVE_BYTES)
        else:
            self._full_bytes, self._chain_bytes = written, 0
        if not self.quantize:
            self._changed = {group: self._family(group.device).xp.zeros(int(f.weights.shape[0]), bool)
                             for group, f in self.arrays.items()}
        return "incremental" if incremental else "full"

    @_class_only
    def load(cls, path, comm=None, *, paths=None, tables=None, **overrides):
        """A new collection: the one saved at ``path``, sharded for ``comm`` (any world
        size); ``tables``: the names of the saved tables to load (default: all), with
        their features, state and step counts; ``overrides`` replace saved constructor
        arguments (``plan``, ``optimizer``, ...; not ``quantize``: quantize a loaded
        collection with :meth:`quantized`); ``paths``: ``{table: directory}`` for the
        files of ``storage="mmap"`` tables (default: the saved ``TableSpec.path``).
        Called on the class (``hbk.EmbeddingCollection.load(path, comm)``): called on a
        collection it raises ``TypeError``, as a collection is not loaded in place."""
        if "quantize" in overrides:
            raise ValueError("load keeps the checkpoint's tables as saved (quantized or not): "
                             "call .quantized(bits) on the loaded collection instead")
        saved = checkpoint.Checkpoint(path)
        specs = saved.tables
        if tables is not None:
            names = [tables] if isinstance(tables, str) else list(tables)
            unknown = sorted(set(names) - {t.name for t in specs})
            if unknown or not names:
                raise ValueError(f"tables must name tables of {path} ({[t.name for t in specs]}), "
                                 f"got {names!r}")
            specs = [t for t in specs if t.name in names]
        chosen = {t.name for t in specs}
        paths = paths or {}
        unknown = sorted(set(paths) - {t.name for t in specs if t.storage == "mmap"})
        if unknown:
            raise ValueError(f"paths names {unknown}, not tables of storage='mmap' in {path}")
        specs = [t._replace(path=os.fspath(paths[t.name])) if t.name in paths else t
                 for t in specs]
        args = saved.constructor_args(**overrides)
        for key in ("plan", "quantize"):  # a saved dict naming every table: the chosen ones
            if isinstance(args.get(key), dict) and key not in overrides:
                args[key] = {name: v for name, v in args[key].items() if name in chosen}
        coll = cls(specs, comm=comm, initializer=saved.initial_weights, **args)
        try:  # every rank restores its shards, or every rank raises
            saved.restore_state(coll)
        except Exception as error:
            if coll.comm.world_size > 1:
                coll.comm.fail_collectively("allreduce", error)
            raise
        if coll.comm.world_size > 1:
            coll.comm.allreduce(np.zeros(1, np.int64))
        return coll

    def __repr__(self):
        return (f"<hbk.EmbeddingCollection: {len(self.tables)} tables on rank {self.comm.rank} of "
                f"{self.comm.world_size}, {self.device}>\n{self.plan}")
