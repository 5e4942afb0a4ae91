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
import os
import sys
import time
import zlib
from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np

from . import _validate as check
from . import dist as _dist
from .dist import _wire
from . import optim as _optim
from ._dispatch import NUMPY, CudaFamily, kernels, resolve, simulator_enabled
from .memory import aligned_empty
from .ops import _raise_ragged_errors, embedding_bag, embedding_bag_backward, lookup, partition, unique
from .plan import make_plan
from .types import JaggedRows, Ragged, SparseGrad, table_spec

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_INIT_CHUNK = 1 << 22  # elements generated at a time by initial_weights


def _splitmix64(x):
    """splitmix64 finaliser of a uint64 array (wraps, as the reference algorithm)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def initial_weights(spec, seed, rows=None, c0=0, c1=None):
    """Initial values of rows ``rows`` (default all) and columns ``[c0, c1)`` of
    table ``spec``: uniform in ``±1/sqrt(num_rows)`` (TorchRec's default), from a
    splitmix64 hash of ``(seed, crc32(name), row * dim + column)``. Any shard is
    made alone, so every plan and world size starts from the same table.

    >>> import hbkernels as hbk
    >>> from hbkernels.embedding_collection import initial_weights
    >>> spec = hbk.TableSpec("t", num_rows=4, dim=3)
    >>> bool((initial_weights(spec, 0)[2:, 1:] == initial_weights(spec, 0, [2, 3], 1, 3)).all())
    True
    """
    spec = table_spec(spec)
    c1 = spec.dim if c1 is None else c1
    rows = np.arange(spec.num_rows, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
    key = _splitmix64(np.uint64(((int(seed) & 0xFFFFFFFF) << 32) | zlib.crc32(spec.name.encode())))
    scale = 1.0 / np.sqrt(spec.num_rows)
    cols = np.arange(c0, c1, dtype=np.uint64)
    out = np.empty((rows.shape[0], c1 - c0), spec.dtype)
    step = max(1, _INIT_CHUNK // max(1, c1 - c0))
    for s in range(0, rows.shape[0], step):
        counter = rows[s:s + step].astype(np.uint64)[:, None] * np.uint64(spec.dim) + cols[None, :]
        with np.errstate(over="ignore"):
            bits = _splitmix64(counter ^ key)
        unit = (bits >> np.uint64(40)).astype(np.float64) * (1.0 / (1 << 24))
        out[s:s + step] = (2.0 * unit - 1.0) * scale
    return out


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
    group: tuple  # (width, dtype name, device)
    base: int


class _Route(NamedTuple):
    """How the ids of one column slice of a table reach their rows."""

    table: str
    slice: int
    kind: str  # placement kind
    group: tuple
    c0: int
    c1: int
    bases: Any  # int64 [N]: each rank's base of this slice (-1 where it holds none)
    owner: int  # the holding rank (table_wise, column_wise), else -1


def _device_of(device):
    """``"cpu"`` or ``"cuda"`` for the collection's ``device`` argument."""
    if device in ("cpu", "cuda"):
        return device
    if device != "auto":
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if simulator_enabled():
        return "cpu"
    try:
        import cupy

        return "cuda" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:  # noqa: BLE001 - no CuPy or no driver: the CPU
        return "cpu"


def _memory_per_rank(device, world_size):
    """Bytes a rank may hold by default: 80% of the GPU's memory, or of the host's
    memory shared by ``world_size`` ranks (they may all be on this host)."""
    if device == "cuda":
        import cupy

        return int(0.8 * cupy.cuda.Device().mem_info[1])
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
    return int(0.8 * total / world_size)


class _Space:
    """Array module and family of one device (``cpu``: NumPy; ``cuda``: CuPy)."""

    def __init__(self, device):
        self.device = device
        if device == "cpu":
            self.xp, self.family = np, NUMPY
        else:
            import cupy

            self.xp = cupy
            self.family = CudaFamily("cupy", int(cupy.cuda.Device().id))

    def put(self, a):
        """``a`` on this device (a copy only when it lives elsewhere)."""
        if self.device == "cpu":
            return a if isinstance(a, np.ndarray) else a.get()
        return self.xp.asarray(a)

    def host(self, a):
        return a if isinstance(a, np.ndarray) else a.get()

    def sync(self):
        if self.device == "cuda":
            self.xp.cuda.get_current_stream().synchronize()


class _Feature(NamedTuple):
    table: str
    values: Any  # int64 ids
    offsets: Any
    psw: Any
    batch: int
    uniq: Any  # distinct ids (the values themselves when dedup is off)
    inverse: Any  # values == uniq[inverse]
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
    Every rank constructs the collection with the same arguments.
    """

    def __init__(self, tables, comm=None, optimizer=None, plan="auto", batch_size_hint=None,
                 wire_dtype=None, seed=0, *, device="auto", dedup=True, memory_per_rank="auto",
                 profile=False, _initial=None):
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
        self.optimizer = _optim.Adagrad(lr=0.05) if optimizer is None else optimizer
        if not isinstance(self.optimizer, _optim.SparseOptimizer):
            raise TypeError(f"optimizer must be a hbk.optim optimizer, got {type(optimizer).__name__}")
        self.seed = int(seed)
        self.wire_dtype = _wire.normalize(wire_dtype)  # None, "float16" or "bfloat16"
        self.dedup = bool(dedup)
        self.profile = bool(profile)
        self.device = _device_of(device)
        self.batch_size_hint = batch_size_hint
        if isinstance(memory_per_rank, str) and memory_per_rank == "auto":
            memory_per_rank = _memory_per_rank(self.device, self.comm.world_size)
        self.memory_per_rank = memory_per_rank
        self.plan_request = plan
        per_row = sum(1 for _, row in self.optimizer.slots if row)
        self.plan = make_plan(
            list(self.tables.values()), self.comm.world_size, plan,
            batch_size_hint=batch_size_hint, memory_per_rank=memory_per_rank,
            state_floats_per_element=len(self.optimizer.slots) - per_row,
            state_floats_per_row=per_row,
            wire_itemsize=self._wire_itemsize(np.float32),
        )
        for name, place in self.plan.items():
            if place.kind == "column_wise" and per_row and len(place.ranks) > 1:
                raise ValueError(
                    f"table {name!r}: {type(self.optimizer).__name__} keeps one state value per "
                    "whole row, which column_wise slices cannot share; use another placement")
        self.feature_table = {f: t.name for t in self.tables.values() for f in t.features}
        self._feature_order = {f: i for i, f in enumerate(self.feature_table)}
        self._spaces = {}
        self._layout(_initial)
        self._saved = None
        self.stats = {}
        self.timings = defaultdict(float)
        self._timing = False

    # -- layout -------------------------------------------------------------------------------
    def _space(self, device):
        if device not in self._spaces:
            self._spaces[device] = _Space(device)
        return self._spaces[device]

    def _table_device(self, spec):
        return spec.device or self.device

    def _layout(self, initial):
        """Shards of every rank, routes of every table slice, and this rank's fused arrays."""
        n, me = self.comm.world_size, self.comm.rank
        next_base = defaultdict(int)  # (rank, group) -> rows so far
        self.shards = {}  # table -> [Shard] (every rank's)
        self.routes = {}  # table -> [_Route] by slice
        # replicated tables first: the same rows of the fused arrays on every rank, so
        # their gradients can travel between ranks as fused row numbers
        for name, spec in sorted(self.tables.items(),
                                 key=lambda item: self.plan[item[0]].kind != "data_parallel"):
            place = self.plan[name]
            cuts = place.columns
            shards, routes = [], []
            for i in range(len(cuts) - 1):
                c0, c1 = int(cuts[i]), int(cuts[i + 1])
                group = (c1 - c0, spec.dtype, self._table_device(spec))
                if place.kind == "row_wise":
                    holders = [(r, r, n, max(0, -(-(spec.num_rows - r) // n))) for r in range(n)]
                elif place.kind == "data_parallel":
                    holders = [(r, 0, 1, spec.num_rows) for r in range(n)]
                else:
                    holders = [(int(place.ranks[i if place.kind == "column_wise" else 0]), 0, 1,
                                spec.num_rows)]
                bases = np.full(n, -1, np.int64)
                for rank, start, step, rows in holders:
                    base = next_base[rank, group]
                    next_base[rank, group] += rows
                    bases[rank] = base
                    shards.append(Shard(name, i, rank, start, step, rows, c0, c1, group, base))
                owner = holders[0][0] if len(holders) == 1 else -1
                routes.append(_Route(name, i, place.kind, group, c0, c1, bases, owner))
            self.shards[name], self.routes[name] = shards, routes
        # the exchanges every rank takes part in, in one global order
        all_routes = [r for rs in self.routes.values() for r in rs]
        self._exchange_groups = sorted({r.group for r in all_routes if r.kind != "data_parallel"},
                                       key=repr)
        self._replica_groups = sorted({r.group for r in all_routes if r.kind == "data_parallel"},
                                      key=repr)
        # this rank's fused arrays: weights and optimizer state
        self.groups = {}
        for group in sorted({g for (rank, g) in next_base if rank == me}, key=repr):
            width, dtype, device = group
            space = self._space(device)
            weights = aligned_empty((next_base[me, group], width), dtype)
            for shard in self.local_shards(group):
                rows = shard.row_start + shard.row_step * np.arange(shard.num_rows, dtype=np.int64)
                block = (initial(shard, rows) if initial is not None else
                         initial_weights(self.tables[shard.table], self.seed, rows, shard.c0, shard.c1))
                weights[shard.base:shard.base + shard.num_rows] = block
            weights = space.put(weights)
            self.groups[group] = {"weights": weights, "state": self.optimizer.init_state(weights)}

    def local_shards(self, group=None):
        """The shards this rank holds (of fused array ``group``, or all)."""
        me = self.comm.rank
        return [s for shards in self.shards.values() for s in shards
                if s.rank == me and (group is None or s.group == group)]

    # -- timing -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _phase(self, name):
        """Add the seconds of the block to ``timings[name]`` (under ``profile``; a
        phase inside another counts once, in the outer one)."""
        if not self.profile or self._timing:
            yield
            return
        for space in self._spaces.values():
            space.sync()
        self._timing = True
        t0 = time.perf_counter()
        try:
            yield
        finally:
            for space in self._spaces.values():
                space.sync()
            self.timings[name] += time.perf_counter() - t0
            self._timing = False

    def _exchange(self, x, counts, wire=False):
        """alltoallv, skipped at world size 1 (nothing leaves the rank)."""
        if self.comm.world_size == 1:
            return x, np.asarray(counts, np.int64)
        with self._phase("comm"):
            return self.comm.alltoallv(x, counts, wire_dtype=self.wire_dtype if wire else None)

    # -- forward ------------------------------------------------------------------------------------
    def _read_inputs(self, features, per_sample_weights):
        if "torchrec.sparse.jagged_tensor" in sys.modules:  # only then can it be a KJT
            from .adapters.torch import features_from_kjt, is_keyed_jagged_tensor

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
        space = self._space(self.device)
        inputs = {}
        for f in sorted(features, key=self._feature_order.get):
            spec = self.tables[self.feature_table[f]]
            x = features[f]
            if isinstance(x, Ragged):
                values, offsets = x.values, x.offsets
            else:  # one id per sample
                values = resolve(values=x)[1]["values"]
                if values.ndim != 1:
                    raise ValueError(f"feature {f!r}: one-hot ids must be 1-D, got shape {tuple(values.shape)}")
                offsets = space.xp.arange(values.shape[0] + 1, dtype=np.int64)
            family, a = resolve(("psw",), values=values, offsets=offsets, psw=psws.get(f))
            if family != space.family:
                raise TypeError(f"feature {f!r} is a {family.name} array but the collection lives on "
                                f"{self.device} ({space.family.name} arrays)")
            values, offsets, psw = a["values"], a["offsets"], a["psw"]
            check.ids(f"{f}.values", values, ndim=1)
            check.offsets(offsets)
            check.per_sample_weights(psw, values)
            bad_offset, bad_id = kernels(family, "sparse_update").check_ragged(
                family, values, offsets, spec.num_rows, check.BOUNDS["raise"])
            _raise_ragged_errors(family, values, offsets, bad_offset, bad_id, spec.num_rows)
            values = values.astype(np.int64, copy=False)
            sequence_offsets = None
            if spec.combiner is None:  # a sequence table: each id is a bag of its own
                sequence_offsets, offsets = offsets, space.xp.arange(values.shape[0] + 1, dtype=np.int64)
            with self._phase("kernels"):
                if self.dedup:
                    uniq, inverse = unique(values, return_inverse=True)
                else:
                    uniq, inverse = values, space.xp.arange(values.shape[0], dtype=np.int64)
            psw = None if psw is None else psw.astype(np.float32, copy=False)
            inputs[f] = _Feature(spec.name, values, offsets, psw, int(offsets.shape[0]) - 1,
                                 uniq, inverse, sequence_offsets)
        return inputs

    def forward(self, features, *, per_sample_weights=None):
        """Pooled embeddings of this rank's batch: ``{feature: [B, dim]}`` (table dtype);
        for a sequence table (``combiner=None``) a :class:`hbkernels.types.JaggedRows`
        ``([N, dim] rows of every id, the input's offsets)``.

        ``features``: ``{feature: hbk.Ragged(values, offsets)}`` or a 1-D id array
        (one id per sample), or a TorchRec ``KeyedJaggedTensor`` (its keys the
        features, its weights the ``per_sample_weights``); ``per_sample_weights``:
        optional ``{feature: weights}`` (one per value). Collective: every rank calls it (with its own batch).
        Ids outside a table raise :class:`hbkernels.BoundsError` here and
        :class:`hbkernels.dist.CommError` on the other ranks.
        """
        self.stats = {"ids_bytes": 0, "rows_bytes": 0, "grads_bytes": 0, "replica_grads_bytes": 0}
        try:
            inputs = self._read_inputs(features, per_sample_weights)
        except Exception as error:
            if self._exchange_groups and self.comm.world_size > 1:
                self.comm.fail_collectively("alltoallv", error)
            raise
        space = self._space(self.device)
        outputs, saved = {}, {"inputs": inputs, "exchanges": [], "replicas": []}
        for group in self._exchange_groups:
            saved["exchanges"].append(self._forward_exchange(group, inputs, outputs))
        for group in self._replica_groups:
            saved["replicas"].append(self._forward_replica(group, inputs, outputs))
        self._saved = saved
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

    def _requests(self, group, inputs, replicated):
        """(feature, route) pairs of ``group``'s replicated (or sharded) slices, in a fixed order."""
        return [(f, route) for f, feature in inputs.items() for route in self.routes[feature.table]
                if route.group == group and (route.kind == "data_parallel") == replicated]

    def _pool(self, space, group_rows, requests, starts, inputs, ids_of, outputs):
        """One ``embedding_bag`` per combiner over ``group_rows`` for the ``requests``
        (the ids of request k are ``ids_of(k) + starts[k]``); pieces go to ``outputs``."""
        xp = space.xp
        pools = []
        by_combiner = defaultdict(list)
        for k, (f, route) in enumerate(requests):
            by_combiner[self.tables[route.table].combiner or "sum"].append(k)  # None: 1-id bags
        for combiner, ks in sorted(by_combiner.items()):
            values, offsets, psws, pieces, shift, bag = [], [space.xp.zeros(1, np.int64)], [], [], 0, 0
            any_psw = any(inputs[requests[k][0]].psw is not None for k in ks)
            for k in ks:
                f, route = requests[k]
                feature = inputs[f]
                values.append(space.put(ids_of(k)) + starts[k])
                offsets.append(space.put(feature.offsets[1:]).astype(np.int64) + shift)
                if any_psw:
                    psws.append(space.put(feature.psw) if feature.psw is not None else
                                xp.ones(feature.values.shape[0], np.float32))
                shift += int(feature.values.shape[0])
                pieces.append((f, route.c0, route.c1, bag, feature.batch))
                bag += feature.batch
            pool = (combiner, xp.concatenate(values), xp.concatenate(offsets),
                    xp.concatenate(psws) if any_psw else None, pieces)
            with self._phase("kernels"):
                out = embedding_bag(group_rows, pool[1], pool[2], combiner=combiner,
                                    per_sample_weights=pool[3], bounds="unchecked")
            for f, c0, c1, b0, batch in pieces:
                outputs.setdefault(f, []).append((c0, c1, out[b0:b0 + batch]))
            pools.append(pool)
        return pools

    def _forward_exchange(self, group, inputs, outputs):
        width, dtype, device = group
        space = self._space(device)
        xp, n, me = space.xp, self.comm.world_size, self.comm.rank
        requests = self._requests(group, inputs, replicated=False)
        keys, dests, starts, total = [], [], [], 0
        for f, route in requests:
            uniq = space.put(inputs[f].uniq)
            if route.kind == "row_wise":
                dest = uniq % n
                key = space.put(route.bases)[dest] + uniq // n
            else:
                dest = xp.full(uniq.shape[0], route.owner, np.int64)
                key = uniq + int(route.bases[route.owner])
            keys.append(key)
            dests.append(dest)
            starts.append(total)
            total += int(uniq.shape[0])
        keys = xp.concatenate(keys) if keys else xp.zeros(0, np.int64)
        order = None
        if n == 1:
            send_counts = np.array([keys.shape[0]], np.int64)
        else:
            with self._phase("kernels"):
                parted = partition(keys * n + (xp.concatenate(dests) if dests else keys), n)
            keys, send_counts, order = parted.ids // n, space.host(parted.counts), parted.order
        recv_keys, recv_counts = self._exchange(keys, send_counts)
        table = self.groups.get(group, {}).get("weights")
        with self._phase("kernels"):
            if recv_keys.shape[0] == 0:
                rows = xp.empty((0, width), dtype)
            elif self.dedup:
                owned, again = unique(recv_keys, return_inverse=True)
                rows = lookup(lookup(table, owned, bounds="unchecked"), again, bounds="unchecked")
            else:
                rows = lookup(table, recv_keys, bounds="unchecked")
        rows, _ = self._exchange(rows, recv_counts, wire=True)
        if order is not None:
            with self._phase("kernels"):
                rows = lookup(rows, self._inverse_permutation(xp, order), bounds="unchecked")
        away_ids = int(send_counts.sum() - send_counts[me])
        away_rows = int(recv_counts.sum() - recv_counts[me])
        self.stats["ids_bytes"] += 8 * away_ids
        self.stats["rows_bytes"] += away_rows * width * self._wire_itemsize(dtype)
        pools = self._pool(space, rows, requests, starts, inputs,
                           lambda k: inputs[requests[k][0]].inverse, outputs)
        return {"group": group, "pools": pools, "rows": total, "order": order,
                "send_counts": send_counts, "recv_keys": recv_keys, "recv_counts": recv_counts}

    def _forward_replica(self, group, inputs, outputs):
        space = self._space(group[2])
        requests = self._requests(group, inputs, replicated=True)
        starts = [int(route.bases[self.comm.rank]) for _, route in requests]
        pools = self._pool(space, self.groups[group]["weights"], requests, starts, inputs,
                           lambda k: inputs[requests[k][0]].values, outputs)
        return {"group": group, "pools": pools}

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
        Collective; gradients of all ranks are summed."""
        if self._saved is None:
            raise RuntimeError("backward needs a forward first (each forward allows one backward)")
        inputs = self._saved["inputs"]
        try:
            grads = self._read_grads(grads, inputs)
        except Exception as error:
            if (self._exchange_groups or self._replica_groups) and self.comm.world_size > 1:
                self.comm.fail_collectively("alltoallv" if self._exchange_groups else "allgatherv", error)
            raise
        updates = defaultdict(list)  # group -> [(ids, rows)]
        for ctx in self._saved["exchanges"]:
            group = ctx["group"]
            space = self._space(group[2])
            xp = space.xp
            with self._phase("kernels"):
                request_grads = xp.zeros((ctx["rows"], group[0]), np.float32)
                for ids, rows in self._pool_backward(space, ctx["pools"], grads, ctx["rows"]):
                    request_grads[ids] = rows
                if ctx["order"] is not None:
                    request_grads = lookup(request_grads, ctx["order"], bounds="unchecked")
            received, counts = self._exchange(request_grads, ctx["send_counts"], wire=True)
            self.stats["grads_bytes"] += (int(ctx["send_counts"].sum() - ctx["send_counts"][self.comm.rank])
                                          * group[0] * self._wire_itemsize(np.float32))
            updates[group].append((ctx["recv_keys"], received))
        for ctx in self._saved["replicas"]:
            group = ctx["group"]
            space = self._space(group[2])
            num_rows = int(self.groups[group]["weights"].shape[0])
            parts = self._pool_backward(space, ctx["pools"], grads, num_rows)
            if parts:
                ids = space.xp.concatenate([p[0].astype(np.int64) for p in parts])
                rows = space.xp.concatenate([p[1] for p in parts])
            else:  # none of the group's features was in the forward: nothing to add
                ids = space.xp.zeros(0, np.int64)
                rows = space.xp.zeros((0, group[0]), np.float32)
            if self.comm.world_size > 1:
                with self._phase("comm"):
                    wire = self._wire_itemsize(np.float32)
                    self.stats["replica_grads_bytes"] += ((self.comm.world_size - 1) * int(ids.shape[0])
                                                          * (8 + group[0] * wire))
                    ids, _ = self.comm.allgatherv(ids)
                    rows, _ = self.comm.allgatherv(rows, wire_dtype=self.wire_dtype)
            updates[group].append((ids, rows))
        self._saved = None
        for group, fused in self.groups.items():
            xp = self._space(group[2]).xp
            parts = updates.get(group, [])
            ids = xp.concatenate([p[0] for p in parts]) if parts else xp.zeros(0, np.int64)
            rows = (xp.concatenate([p[1] for p in parts]) if parts
                    else xp.zeros((0, group[0]), np.float32))
            with self._phase("kernels"):
                self.optimizer.step(fused["weights"], fused["state"], SparseGrad(ids, rows))

    def _read_grads(self, grads, inputs):
        if not isinstance(grads, dict):
            raise TypeError(f"grads must be a dict feature -> [B, dim] array, got {type(grads).__name__}")
        if set(grads) != set(inputs):
            raise ValueError(f"backward needs a gradient for exactly the features of the forward "
                             f"{sorted(inputs)}, got {sorted(grads)}")
        space = self._space(self.device)
        out = {}
        for f, feature in inputs.items():
            g = grads[f]
            if isinstance(g, JaggedRows):
                g = g.values
            family, a = resolve(grad=g)
            g = a["grad"]
            if family != space.family:
                raise TypeError(f"grad of {f!r} is a {family.name} array; the collection lives on "
                                f"{self.device}")
            dim = self.tables[feature.table].dim
            if g.ndim != 2 or tuple(g.shape) != (feature.batch, dim):
                rows = "N" if feature.sequence_offsets is not None else "B"
                raise ValueError(f"grad of {f!r} must be [{rows}, dim] = [{feature.batch}, {dim}], "
                                 f"got {tuple(g.shape)}")
            check.floating(f"grad of {f!r}", g)
            out[f] = g
        return out

    def _pool_backward(self, space, pools, grads, num_rows):
        """[(ids, rows)] of each pool's sparse gradient w.r.t. the pooled rows."""
        xp = space.xp
        parts = []
        for combiner, values, offsets, psw, pieces in pools:
            grad = xp.concatenate([space.put(grads[f][:, c0:c1]) for f, c0, c1, _, _ in pieces])
            with self._phase("kernels"):
                sg = embedding_bag_backward(grad.astype(np.float32, copy=False), values, offsets,
                                            num_rows=num_rows, combiner=combiner,
                                            per_sample_weights=psw, bounds="unchecked")
            parts.append((sg.ids, sg.rows))
        return parts

    # -- whole tables ---------------------------------------------------------------------------------
    def _gather(self, name, pick, per_column, dtype):
        """Table ``name``'s array made of ``pick(shard)`` (this rank's rows of a shard:
        ``[rows, cols]`` when ``per_column``, else ``[rows]``), whole, on every rank."""
        if name not in self.tables:
            raise KeyError(f"no table {name!r}; tables: {sorted(self.tables)}")
        spec, kind = self.tables[name], self.plan[name].kind
        n, me = self.comm.world_size, self.comm.rank
        shards = sorted(self.shards[name], key=lambda s: s.slice)
        xp = self._space(shards[0].group[2]).xp
        if kind == "row_wise":  # rank r holds rows r, r + n, ...
            local = pick(shards[me])
            blocks, counts = (local.copy(), [local.shape[0]]) if n == 1 else self.comm.allgatherv(local)
            out = xp.empty((spec.num_rows,) + tuple(local.shape[1:]), dtype)
            start = 0
            for r, c in enumerate(np.asarray(counts).tolist()):
                out[r::n] = blocks[start:start + c]
                start += c
            return out
        if kind == "data_parallel":  # rank 0's replica
            local = pick(shards[me])
            return local.copy() if n == 1 else self.comm.broadcast(local, root=0)
        pieces = []
        for s in shards:  # table_wise: one slice; column_wise: one per holder
            shape = (spec.num_rows, s.c1 - s.c0) if per_column else (spec.num_rows,)
            local = pick(s) if s.rank == me else xp.zeros(shape, dtype)
            pieces.append(local.copy() if n == 1 else self.comm.broadcast(local, root=s.rank))
        return pieces[0] if len(pieces) == 1 else xp.concatenate(pieces, axis=1)

    def _rows_of(self, shard, array):
        return array[shard.base:shard.base + shard.num_rows]

    def full_weights(self, name):
        """Table ``name`` gathered whole ([num_rows, dim]), the same on every rank: a
        new array (later steps do not change it). Collective.

        >>> import hbkernels as hbk
        >>> coll = hbk.EmbeddingCollection([hbk.TableSpec("t", num_rows=5, dim=2)],
        ...                                comm=hbk.dist.init("local"))
        >>> coll.full_weights("t").shape
        (5, 2)
        """
        return self._gather(
            name, lambda s: self._rows_of(s, self.groups[s.group]["weights"]), True,
            self.tables.get(name, self.tables[next(iter(self.tables))]).dtype)

    def full_state(self, name):
        """The optimizer state of table ``name`` gathered whole (slot -> array shaped
        as ``init_state`` of the whole table) plus ``"step"`` (int). Collective."""
        out = {}
        for slot, per_row in self.optimizer.slots:
            out[slot] = self._gather(
                name, lambda s, slot=slot: self._rows_of(s, self.groups[s.group]["state"][slot]),
                not per_row, np.float32)
        holder = min(self.shards[name], key=lambda s: (s.slice, s.rank))
        step = int(self.groups[holder.group]["state"]["step"][0]) if holder.rank == self.comm.rank else 0
        if self.comm.world_size > 1:
            step = int(self.comm.broadcast(np.array([step], np.int64), root=holder.rank)[0])
        out["step"] = step
        return out

    # -- checkpoints ----------------------------------------------------------------------------------
    def save(self, path):
        """Write a checkpoint directory (see :mod:`hbkernels.checkpoint`): arrays plus
        a JSON manifest, atomically; collective."""
        from . import checkpoint

        checkpoint.save(self, path)

    @classmethod
    def load(cls, path, comm=None, **overrides):
        """The collection saved at ``path``, sharded for ``comm`` (any world size);
        ``overrides`` replace saved constructor arguments (``plan``, ``optimizer``, ...)."""
        from . import checkpoint

        return checkpoint.load(path, comm, **overrides)

    def __repr__(self):
        return (f"<hbk.EmbeddingCollection: {len(self.tables)} tables on rank {self.comm.rank} of "
                f"{self.comm.world_size}, {self.device}>\n{self.plan}")
