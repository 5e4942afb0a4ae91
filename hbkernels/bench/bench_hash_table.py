"""hash_table: ``hbk.HashTable.slots`` on batches of 1M int64 ids, 10% of them new, in
a table of 2^22 slots filled to 50% and 90%, against a Python dict and TorchRec's
managed-collision module (``MCHManagedCollisionModule``, LRU), when installed.

Modes: ``insert`` (``slots(ids)``: every hit is a use, every new id gets a slot;
the dict does ``get``, then a new slot for a miss; MCH runs its forward,
eviction interval 1, which is when it takes new ids in) and ``find``
(``slots(ids, insert=False)``; ``dict.get``; MCH's ``remap``). Ids are uniform
over int64 (raw hashes); the 90% known ids are drawn from the live ones.

A call changes the table, so the providers take turns on one batch per round
(fresh new ids each round, order shuffled), and after an ``insert`` round the
new ids are erased again from hbkernels' table and the dict, untimed; MCH's
table drifts up by 100K ids a round. The first call checks hbkernels against
the dict: every id gets a slot, distinct ids distinct slots.

    python3 -m hbkernels.bench.bench_hash_table --device cpu
"""
import time

import numpy as np

import hbkernels as hbk
from hbkernels._sorted import distinct
from .common import HBK, Timing, cli_main, optional_module, to_host

OP = "hash_table"


def configs(ctx):
    if ctx.smoke:
        return dict(capacity=1 << 12, batch=4096, rounds=2)
    return dict(capacity=1 << 22, batch=1 << 20, rounds=ctx.reps or 7)


class DictTable:
    """The dict baseline: id -> slot, a new slot per new id (no scores, no eviction)."""

    def __init__(self, ids):
        self.d = dict(zip(ids.tolist(), range(len(ids))))
        self.next = len(ids)

    def insert(self, batch):
        d, get, out = self.d, self.d.get, []
        for k in batch.tolist():
            v = get(k)
            if v is None:
                v = d[k] = self.next
                self.next += 1
            out.append(v)
        return np.array(out, np.int64)

    def find(self, batch):
        get = self.d.get
        return np.array([get(k, -1) for k in batch.tolist()], np.int64)

    def erase(self, ids):
        for k in ids.tolist():
            self.d.pop(k, None)


class Mch:
    """TorchRec's managed-collision module over the same ids (LRU, eviction every call)."""

    def __init__(self, torch, capacity, ids, chunk):
        from torchrec.modules.mc_modules import LRU_EvictionPolicy, MCHManagedCollisionModule

        self.torch = torch
        self.m = MCHManagedCollisionModule(zch_size=capacity, device=torch.device("cpu"),
                                           eviction_policy=LRU_EvictionPolicy(),
                                           eviction_interval=1)
        self.m.train()
        for i in range(0, len(ids), chunk):
            self.insert(ids[i:i + chunk])

    def _features(self, batch):
        from torchrec.sparse.jagged_tensor import JaggedTensor

        values = self.torch.from_numpy(batch)
        return {"f": JaggedTensor(values=values, lengths=self.torch.ones(len(batch),
                                                                          dtype=self.torch.int32))}

    def insert(self, batch):
        return self.m(self._features(batch))["f"].values()

    def find(self, batch):
        return self.m.remap(self._features(batch))["f"].values()


def random_ids(rng, n):
    """Uniform int64 ids (raw hashes), positive for MCH, which takes ids < 2^63 - 1."""
    return rng.integers(0, np.iinfo(np.int64).max - 1, n, dtype=np.int64)


def modelled_gpu_bytes(table, sector=32, key_bytes=8):
    """DRAM bytes a GPU lookup of a live id moves (modelled, from this table's probe
    lengths): ``(find, insert)``. A find reads its id, the key sectors its probe spans,
    one sector of slots, and writes its slot; an insert-mode hit also reads and writes
    back the sectors of ``last`` and ``count`` (``_touch``)."""
    home, length = table.probe_lengths()
    per_sector = sector // key_bytes
    key_sectors = float(np.mean((home % per_sector + length + per_sector - 1) // per_sector))
    find = 2 * key_bytes + sector * (key_sectors + 1)
    return find, find + 4 * sector


def check(slots, batch):
    """Every id of ``batch`` got a live slot: one slot per id, distinct ids distinct slots
    (one sort of the batch, not ``np.unique``: see :func:`hbkernels._sorted.distinct`)."""
    slots = to_host(slots)
    order = np.argsort(batch, kind="stable")
    ids, slots = batch[order], slots[order]
    first = np.ones(ids.shape[0], bool)
    first[1:] = ids[1:] != ids[:-1]
    assert (slots >= 0).all(), "an id got no slot"
    repeat = np.flatnonzero(~first)
    assert (slots[repeat] == slots[repeat - 1]).all(), "an id got two slots"
    assert distinct(slots[first]).shape[0] == int(first.sum()), "distinct ids share a slot"


def run(ctx):
    cfg = configs(ctx)
    capacity, n = cfg["capacity"], cfg["batch"]
    torch = ctx.torch if not ctx.is_cuda else None
    mch_ok = torch is not None and optional_module("torchrec.modules.mc_modules") is not None
    if not mch_ok:
        ctx.note("torchrec is not installed (or disabled): the MCH peer is skipped")
    for load in (0.5, 0.9):
        rng = np.random.default_rng([ctx.seed, int(load * 10)])
        live = random_ids(rng, int(load * capacity))
        table = hbk.HashTable(capacity, evict="lru", device=ctx.device)
        for i in range(0, len(live), n):
            table.slots(ctx.xp.asarray(live[i:i + n]))
        find, insert = modelled_gpu_bytes(table)
        ctx.note(f"load {load}: a lookup reads {table.probe_lengths()[1].mean():.2f} index "
                 f"positions; modelled GPU DRAM bytes per id: find {find:.0f}, insert {insert:.0f}")
        providers = {HBK: table}
        if not ctx.is_cuda:
            providers["dict"] = DictTable(live)
        if mch_ok:
            providers["torchrec-mch"] = Mch(torch, capacity, live, n)
        size = f"capacity=2^{capacity.bit_length() - 1} load={load} batch={n} new=10%"
        for mode in ("insert", "find"):
            times = {name: [] for name in providers}
            for r in range(cfg["rounds"] + 1):  # round 0 warms up and checks
                new = random_ids(rng, n // 10)
                batch = np.concatenate([live[rng.integers(0, len(live), n - len(new))], new])
                batch = batch[rng.permutation(n)]
                on_device = ctx.xp.asarray(batch)
                for name in rng.permutation(list(providers)):
                    p = providers[name]
                    ctx.sync()
                    t0 = time.perf_counter()
                    if name == HBK:
                        out = p.slots(on_device, insert=mode == "insert")
                    else:
                        out = getattr(p, mode)(batch)
                    ctx.sync()
                    elapsed = (time.perf_counter() - t0) * 1e3
                    if r == 0 and name == HBK and mode == "insert":
                        check(out, batch)
                    if r:
                        times[name].append(elapsed)
                if mode == "insert":
                    table.erase(ctx.xp.asarray(new))
                    if "dict" in providers:
                        providers["dict"].erase(new)
            for name, t in times.items():  # bytes: ids read, slots written
                ctx.record(OP, name, mode, size, "int64", Timing.of(t), 16 * n,
                           reference=tuple(p for p in providers if p != HBK))
        del providers, table
        ctx.release()


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
