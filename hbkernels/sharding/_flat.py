"""The flat path of an :class:`~hbkernels.EmbeddingCollection` on a GPU: the static,
unquantized fused arrays of one device and dtype are blocks of one flat array
(:attr:`~hbkernels.EmbeddingCollection.flats`), their optimizer state blocks of
:attr:`~hbkernels.EmbeddingCollection.state_flats`; the features a rank pools from
its own rows over them take one launch (:mod:`hbkernels.cuda.pool_tables`), and at
world size 1 their backward and update take the launches of one ``fused_step``
(:mod:`hbkernels.cuda.update_tables`). A reserved step (:meth:`FlatPath.reserve`)
sizes that memory once; a captured one (:meth:`FlatPath.capture`) replays it as a
CUDA graph."""
import bisect
import contextlib
from collections import defaultdict

import numpy as np

from .. import _rules
from .. import _validate as check
from .._dispatch import device_family_of, kernels
from .._modes import Combiner
from ..types import Ragged
from ._records import (CapturedStep, Door, FlatCall, FlatLayout, FlatPlan, FlatPool, LocalContext,
                       Pool, Feature, Reservation, ReservedFlat, Saved, flat_members)
from .kinds import SHARDINGS

FLAT_ALIGN = 256  # bytes: where each fused array starts in its flat array on a GPU


def _columns(a, c0, c1):
    """Columns ``[c0, c1)`` of the 2-D ``a``: ``a`` itself when they are all of them."""
    return a if c0 == 0 and c1 == a.shape[1] else a[:, c0:c1]


class FlatPath:
    """The flat path's methods of :class:`~hbkernels.EmbeddingCollection` (see the module doc)."""

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
        self._reserved = Reservation(batch, caps, weighted, firsts, staged, table, psw,
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
        """The :class:`ReservedFlat` of flat array ``key`` for ``pairs`` (group,
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
        plan = self._flat_plan(flat_members(contexts.values()))
        step = kernels(space, "update_tables").reserve(space, plan.tables, plan.pools,
                                                       self.flats[key].dtype, psw is not None)
        return ReservedFlat(pooled, contexts, outputs, step,
                             space.zeros((max(plan.size, 1),), np.float32), row_psw, firsts_of_rows)

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
        self._saved = Saved(door.inputs, [], [], FlatCall(door, counts, rows_at, rows, bounds))
        return lay.results(out)

    def _door(self, space, features, batches):
        """The :class:`Door` of :meth:`_forward_flat` for ``features`` (names, the
        lengths of their offsets ``batches``), made once per such signature; None where
        :meth:`forward` reads them (an unknown feature, empty offsets)."""
        if any(f not in self.feature_table for f in features) or min(batches) < 1:
            return None
        given = {f: k for k, f in enumerate(features)}
        inputs = {}
        for f in sorted(features, key=self._feature_order.get):
            inputs[f] = Feature(self.feature_table[f], None, None, None, batches[given[f]] - 1,
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
        door = self._doors[(*features, *batches)] = Door(
            [given[f] for f in lay.order], lay.order, limits, inputs, lay, tables,
            np.concatenate([table, lay.launch.plan]), table.shape[0],
            np.concatenate([*ragged.table_positions(n), lay.launch.placed + table.shape[0]]))
        return door

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
        """The :class:`FlatLayout` of :meth:`_pool_flat`'s launch for ``pairs`` over the
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
        found = self._flat_layouts[signature] = FlatLayout(
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
        """The :class:`FlatPlan` of the update of one flat array's ``members`` (as
        :func:`flat_members` gives them); ``stepped``: as :meth:`_stepped_tables` gives it."""
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
        return FlatPlan(tables, pools, places, counters, hp, grad_at)

    def _flat_step(self, flat, members, grads, stepped, reserved):
        """The fused backward and optimizer step of the fused arrays of ``members`` (one
        flat array's, as :func:`flat_members` gives them, pooled by its launch, which wrote
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
