"""Sharded embedding tables: placement, forward and backward across ranks.

An :class:`EmbeddingCollection` holds many tables split over the ranks of a
communicator (``hbk.dist``) by a :mod:`plan <hbkernels.plan>`:

* ``data_parallel``: every rank holds the table; forward is a local pooled
  lookup; backward all-gathers every rank's sparse gradient and applies the
  same update everywhere (replicas stay bit-identical);
* ``row_wise``: rank ``id % N`` holds row ``id`` (as its local row ``id // N``);
* ``table_wise``: one rank holds the table;
* ``column_wise``: column slices of the table on different ranks;
* ``table_row_wise``, ``table_column_wise``, ``grid``: the same within the ranks of one
  node (``grid``: a column slice per node, each row-wise over its ranks).

Forward of a sharded table, per rank: dedup the ids of each feature
(``unique``), route each distinct id to its owner (``partition``),
``alltoallv`` the ids, look the owned rows up (dedup again on the owner),
``alltoallv`` the rows back (optionally as ``wire_dtype``), restore the order
and pool with the table's combiner (``embedding_bag`` over the received rows). Where
nodes hold several ranks the ids, rows and gradients go through a rank of the sender's node
(:mod:`hbkernels.sharding._hierarchical`).
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
import contextlib
import json
import os
import time
import zlib
from collections import Counter, defaultdict

import numpy as np

from .. import _validate as check
from .. import dist as _dist
from .. import optim as _optim
from .._dispatch import cupy_family_of, device_family, host, kernels, resolve
from .._machine import cupy, simulator_enabled
from ..dist import _wire
from ..hash_table import HashTable
from ..ops import embedding_bag, embedding_bag_backward, synchronize, unique
from ..types import JaggedRows, Ragged, SparseGrad, table_spec
from ..memory import aligned_empty
from ..quantize import BITS, check_bits
from . import quantized as quantized_tables
from .kjt import features_from_kjt, is_keyed_jagged_tensor
from ._alltoall import AlltoallExchange
from ._dynamic import DynamicTables
from ._flat import FlatPath
from ._hierarchical import HierarchicalExchange
from ._replicas import ReplicaExchange
from ._records import CapturedStep, Feature, LocalContext, Pool, Saved, flat_members  # noqa: F401 - CapturedStep: capture's
from ._whole import WholeTables
from .kinds import SHARDINGS
from .layout import initial_weights, make_layout, shard_rows
from .plan import Plan, exchange_of, make_plan
from .tier import FusedArrays, Store, Tier


#: :attr:`EmbeddingCollection.stats`: bytes this rank sent in the last step, by what and where
STATS = ("ids_bytes", "rows_bytes", "grads_bytes", "replica_grads_bytes", "within_node_bytes",
         "across_node_bytes")


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


class EmbeddingCollection(FlatPath, AlltoallExchange, HierarchicalExchange, ReplicaExchange,
                          DynamicTables, WholeTables):
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
    to :meth:`load` again. ``ranks_per_node``: ranks ``[k·G, (k+1)·G)`` share node k
    (default: the launcher's, :func:`hbkernels.dist.ranks_per_node`, else one node);
    ``exchange``: ``"auto"`` (hierarchical where the ranks span nodes of more than one
    rank), ``"flat"`` or ``"hierarchical"`` (:mod:`hbkernels.sharding._hierarchical`).

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
                 id_layout="scattered", ranks_per_node=None, exchange="auto"):
        self.comm = _dist.init() if comm is None else comm
        if not isinstance(self.comm, _dist.Communicator):
            raise TypeError(f"comm must be a hbk.dist communicator, got {type(self.comm).__name__}")
        n = self.comm.world_size
        if ranks_per_node is None:
            ranks_per_node = _dist.ranks_per_node() or n
        #: ranks of a node: ranks ``[k·G, (k+1)·G)`` share node k
        self.ranks_per_node = min(check.count("ranks_per_node", ranks_per_node, minimum=1), n)
        #: how sharded tables' ids and rows move: ``"flat"`` (each rank to each) or
        #: ``"hierarchical"`` (through a rank of the sender's node: :mod:`._hierarchical`)
        self.exchange = exchange_of(exchange, n, self.ranks_per_node)
        self._remote = np.arange(n) // self.ranks_per_node != self.comm.rank // self.ranks_per_node
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
            profile=plan_profile, id_layout=id_layout, ranks_per_node=self.ranks_per_node,
            exchange=self.exchange,
        )
        self._agree_across_ranks()
        for name, place in self.plan.items():
            if per_row and len(place.columns) > 2:
                raise ValueError(
                    f"table {name!r}: {type(self.optimizer).__name__} keeps one state value per "
                    f"whole row, which {place.kind} column slices cannot share; use another placement")
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
        self._reserved = None  # a Reservation: the memory of a step, sized once (reserve)
        self._capturing = None  # while a step is captured (capture): its CapturedStep
        self.stats = dict.fromkeys(STATS, 0)
        #: host seconds of all :meth:`forward` and :meth:`backward` calls (on a GPU a call
        #: returns once its work is queued)
        self.call_seconds = {"forward": 0.0, "backward": 0.0}
        self.timings = defaultdict(float)
        self._timing = False
        #: the flat array pooling every table in one launch where :meth:`_forward_flat`
        #: may take a forward, else None
        self._flat_key = self._single_flat()
        self._doors = {}  # a forward's signature -> its Door (_door)

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
        self._flat_layouts = {}  # a flat launch's signature -> its FlatLayout (_flat_layout)
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
            "ranks_per_node, exchange": [self.ranks_per_node, self.exchange],
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
        """``(inputs, joined)``: each feature's :class:`Feature`, checked (the check left
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
            inputs[f] = Feature(spec.name, values, offsets, psw, int(offsets.shape[0]) - 1,
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
        self.stats = dict.fromkeys(STATS, 0)
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
                    self._prefetch_exchange(group, inputs)
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

    def _count_sent(self, kind, counts, row_bytes):
        """Add to :attr:`stats` the bytes of ``counts`` rows of ``row_bytes`` this rank sends
        to each rank (as ``kind``, and within or across nodes); none to itself."""
        sent = np.asarray(counts, np.int64) * row_bytes
        sent[self.comm.rank] = 0
        total, across = int(sent.sum()), int(sent[self._remote].sum())
        self.stats[kind] += total
        self.stats["across_node_bytes"] += across
        self.stats["within_node_bytes"] += total - across

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
            updates[ctx.group].append(self._backward_exchange(ctx, grads))
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
                ids, rows = self._gather_replica_grads(group, ids, rows)
            updates[group].append((ids, rows))
        self._saved = None
        stepped = self._stepped_tables(inputs)  # (after the peers' exchanges: collective)
        flat_groups = set()
        for contexts in flat_steps.values():
            with self._phase("kernels"):
                key = contexts[0].flat[0]
                self._flat_step(contexts[0].flat, flat_members(contexts), grads, stepped,
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


    # -- inference ------------------------------------------------------------------------------------

    # -- checkpoints ----------------------------------------------------------------------------------

    def __repr__(self):
        return (f"<hbk.EmbeddingCollection: {len(self.tables)} tables on rank {self.comm.rank} of "
                f"{self.comm.world_size}, {self.device}>\n{self.plan}")
