"""Whole tables of an :class:`~hbkernels.EmbeddingCollection`: gathered
(:meth:`WholeTables.full_weights`, :meth:`WholeTables.full_state`), quantized for
serving (:meth:`WholeTables.quantized`), saved and loaded
(:mod:`hbkernels.sharding.checkpoint`)."""
import math
import os

import numpy as np

from .. import optim as _optim
from .._dispatch import host
from . import checkpoint
from . import quantized as quantized_tables
from .kinds import SHARDINGS

CHAIN_LIMIT = 0.5  # save(incremental=True): a full save once the chain holds this x a full one


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


class WholeTables:
    """The whole-table methods of :class:`~hbkernels.EmbeddingCollection`."""

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

    def rows_written_elsewhere(self):
        """Rows were written other than by :meth:`backward` (a restore): the next save
        is a full one, since no incremental save could say what changed."""
        self._chain_bytes = math.inf
