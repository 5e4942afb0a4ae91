"""Restoring a collection from a checkpoint: the optimizer rebuilt through its
constructor (:func:`optimizer_from_json`), and :class:`Restore`, what
:meth:`EmbeddingCollection.load <hbkernels.EmbeddingCollection.load>` asks of an
opened checkpoint (constructor arguments, initial weights, optimizer state, dynamic
tables)."""
import functools
import inspect
import os

import numpy as np

from ... import optim as _optim
from ..._dispatch import classify, host
from ...errors import CheckpointError
from ...quantize import QuantizedRows
from ..kinds.row_wise import dynamic_owner
from ..layout import initial_rows, shard_rows
from ._format import CHUNK_ROWS, MANIFEST


@functools.lru_cache(maxsize=None)
def _constructor_options(cls):
    """The keyword arguments ``cls(...)`` takes (its own and, through ``**options``,
    those of the classes above it)."""
    names = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        names |= {p.name for p in params if p.name != "self" and p.kind != p.VAR_KEYWORD}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return frozenset(names)


def optimizer_from_json(d, where):
    """The optimizer of manifest entry ``d``, made by its constructor (so its checks run);
    saved attributes the constructor does not take are derived ones and are dropped."""
    cls = getattr(_optim, str(d.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, _optim.SparseOptimizer)):
        raise CheckpointError(f"{where}: unknown optimizer {d.get('type')!r} in the manifest")
    accepted = _constructor_options(cls)
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in d["options"].items() if k in accepted}
    try:
        return cls(**options)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: bad {cls.__name__} options in the manifest ({e})") from None


class Restore:
    """What a load asks of a checkpoint (a base class of
    :class:`~hbkernels.sharding.checkpoint.Checkpoint`): the collection's constructor
    arguments, the saved weights of a shard, the saved optimizer state and a dynamic
    table's ids, read through the checkpoint's chain (its ``manifest``, ``path`` and
    ``steps``, :meth:`spec`, :meth:`sparse`, :meth:`saved`, :meth:`saved_rows`,
    :meth:`fill`, :meth:`dynamic_rows`, :meth:`dynamic_index`)."""

    def constructor_args(self, **overrides):
        """The saved constructor arguments of the collection (``plan``,
        ``batch_size_hint``, ``wire_dtype``, ``seed``, ``dedup``, ``optimizer``, and
        ``quantize`` of a quantized collection),
        with ``overrides`` replacing them."""
        m = self.manifest
        kwargs = {"plan": m["plan_request"], "batch_size_hint": m["batch_size_hint"],
                  "wire_dtype": m["wire_dtype"], "seed": m["seed"], "dedup": m["dedup"]}
        if m.get("quantize"):
            kwargs["quantize"] = m["quantize"]
        if "optimizer" not in overrides:
            kwargs["optimizer"] = optimizer_from_json(m["optimizer"], os.path.join(self.path, MANIFEST))
        kwargs.update(overrides)
        return kwargs

    def initial_weights(self, shard, rows):
        """The saved weights of rows ``rows`` of ``shard`` (its columns); a sparse
        table's rows it did not save are remade from the seed; a quantized table's
        :class:`~hbkernels.quantize.QuantizedRows`."""
        if shard.table in self.manifest.get("quantize", {}):
            codes = np.empty((rows.shape[0], shard.c1 - shard.c0), np.uint8)
            self.fill(shard.table, "codes", rows, shard.c0, shard.c1, codes)
            scale, bias = (np.empty(rows.shape[0], np.float32) for _ in range(2))
            self.fill(shard.table, "scale", rows, shard.c0, shard.c1, scale)
            self.fill(shard.table, "bias", rows, shard.c0, shard.c1, bias)
            self._check_quantized(shard.table, rows, codes, scale, bias)
            return QuantizedRows(codes, scale.astype(np.float16), bias.astype(np.float16))
        if self.sparse(shard.table):
            out = initial_rows(self.spec(shard.table), self.manifest["seed"], rows, shard.c0, shard.c1)
        else:
            out = np.empty((rows.shape[0], shard.c1 - shard.c0), shard.group.dtype)
        self.fill(shard.table, "weights", rows, shard.c0, shard.c1, out)
        return out

    def _check_quantized(self, table, rows, codes, scale, bias):
        """A CheckpointError unless the saved codes fit the table's bits and its scales
        and biases are finite float16 values (scale >= 0), as a save writes them."""
        levels = (1 << self.manifest["quantize"][table]) - 1
        with np.errstate(over="ignore", invalid="ignore"):
            bad = (codes > levels).any(axis=1) | ~(scale >= 0)
            for v in (scale, bias):  # finite float16 values
                bad |= ~np.isfinite(v) | (v.astype(np.float16).astype(np.float32) != v)
        if bad.any():
            raise CheckpointError(f"{os.path.join(self.path, MANIFEST)}: table {table!r}, row "
                                  f"{int(rows[np.argmax(bad)])}: codes beyond "
                                  f"{self.manifest['quantize'][table]} bits, or a scale or bias "
                                  f"that is not a float16 (scale >= 0)")


    def restore_state(self, coll):
        """Write the saved optimizer state of every shard ``coll``'s rank holds into its
        state arrays (slots the checkpoint has for the table; others keep their
        initial values), and each fused array's step; a dynamic table's ids go to
        the ranks that own them now, with their rows, state and scores."""
        saved = self.saved()
        for group, fused in coll.arrays.items():
            shards = coll.local_shards(group)
            fused.state["step"][0] = max([self.steps[s.table] for s in shards] or [0])
            if group.bits:  # codes, scales and biases only (initial_weights)
                continue
            if group.dynamic:
                for shard in shards:
                    self._restore_dynamic(coll, shard.table, saved)
                continue
            if group.storage == "mmap":
                for shard in shards:
                    self._restore_files(coll, shard, saved)
                continue
            for slot, _ in coll.optimizer.slots:
                state = host(fused.state[slot]).copy()
                for shard in shards:
                    if (shard.table, slot) in saved:
                        self.fill(shard.table, slot, shard_rows(shard), shard.c0, shard.c1,
                                   state[shard.base:shard.base + shard.num_rows])
                target = fused.state[slot]
                target[...] = classify(target)[0].put(state)

    def _restore_files(self, coll, shard, saved):
        """Write the saved rows of sparse ``shard`` (weights and state) into its store;
        its other rows are made as they are touched."""
        every = self.saved_rows(shard.table)
        k, rem = np.divmod(every - shard.row_start, shard.row_step)
        every = every[(rem == 0) & (k >= 0) & (k < shard.num_rows)]
        store = coll.tiers[shard.group].store
        for s in range(0, every.shape[0], CHUNK_ROWS):  # a chunk of rows in memory at a time
            rows = every[s:s + CHUNK_ROWS]
            state = {}
            for slot, per_row in coll.optimizer.slots:
                shape = (rows.shape[0],) if per_row else (rows.shape[0], shard.c1 - shard.c0)
                state[slot] = np.empty(shape, np.float32)
                state[slot][...] = store.fresh[slot]
                if (shard.table, slot) in saved:
                    self.fill(shard.table, slot, rows, shard.c0, shard.c1, state[slot])
            local = (rows - shard.row_start) // shard.row_step
            store.write(local + shard.base, self.initial_weights(shard, rows), state)

    def _restore_dynamic(self, coll, name, saved):
        """Dynamic table ``name``'s ids, scores, pending ids, rows and state as of this
        save, the ids this rank owns now handed to
        :meth:`EmbeddingCollection.restore_dynamic`."""
        ids, last, count = self.dynamic_index(name, "")
        mine = dynamic_owner(np, ids, coll.comm.world_size) == coll.comm.rank
        arrays = ["weights"] + [slot for slot, _ in coll.optimizer.slots if (name, slot) in saved]
        rows = self.dynamic_rows(name, arrays, ids[mine])  # only the rows it keeps
        pending = self.dynamic_index(name, "pending_") if (name, "pending_ids") in saved else None
        clock = int(last.max()) if last.shape[0] else 0  # every rank's ids: one clock for all shares
        coll.restore_dynamic(name, ids[mine], last[mine], count[mine], rows, pending, clock)
