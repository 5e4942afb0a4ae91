"""checkpoint: incremental saves of a dynamic table, and loading a chain of them.

One dynamic table (D = 16, Adagrad, LRU) with every slot taken by ``live`` ids (4,000,
40,000 and 4,000,000), a full save, then 100 steps each touching 12 ids (4 of them new,
so 4 are evicted) and followed by ``save(incremental=True, chain_limit=inf)``; then a
full save of the same state. Rows:

* ``save`` / ``hbkernels-incremental``: the 100 incremental saves (``size`` names their
  median bytes and the full save's), and ``hbkernels-full``: the first and the last full
  save of the same collection;
* ``load`` / ``hbkernels-chain-100`` and ``hbkernels-full``: ``EmbeddingCollection.load``
  of the chain's last save (the chain replayed) and of the full save, interleaved; the
  ratio is what the chain costs;
* ``load`` / ``hbkernels-chain-default`` (tables of up to 40,000 ids): the same 100 steps
  saved by a twin collection under the default ``chain_limit``, the end of its longest
  chain loaded (a note says how many incremental saves that chain holds).

GB/s counts the full save's bytes for every load.

    python3 -m hbkernels.bench.bench_checkpoint --device cpu
"""
import json
import os
import shutil
import tempfile
import time

import numpy as np

import hbkernels as hbk
from .common import HBK, Timing, cli_main

OP_SAVE, OP_LOAD = "checkpoint_save", "checkpoint_load"
DIM, TOUCHED, NEW, CHAIN = 16, 12, 4, 100


def configs(ctx):
    if ctx.smoke:
        return [dict(live=2000, chain=5)]
    return [dict(live=live, chain=CHAIN) for live in (4_000, 40_000, 4_000_000)]


def save_bytes(path):
    """Bytes the save at ``path`` added to disk: its manifest and the files of its save
    directory, less, of a file its parent's pack is in too (a chain's one file per
    rank), the bytes up to where that pack ends."""
    with open(os.path.join(path, "manifest.json")) as f:
        parent = json.load(f).get("parent") or {}
    ends = {}
    for name, size, _, *offset in parent.get("packs") or []:
        if offset:
            ends[os.stat(os.path.join(path, parent["path"], name)).st_ino] = offset[0] + size
    total = os.path.getsize(os.path.join(path, "manifest.json"))
    for directory, _, files in os.walk(path):
        if directory != str(path):
            for name in files:
                st = os.stat(os.path.join(directory, name))
                total += st.st_size - ends.get(st.st_ino, 0)
    return total


def collection(live):
    spec = hbk.TableSpec("d", num_rows=None, dim=DIM, capacity=live, evict="lru")
    return hbk.EmbeddingCollection([spec], comm=hbk.dist.init("local"), device="cpu",
                                   optimizer=hbk.optim.Adagrad(lr=0.05))


def run(ctx):
    if ctx.is_cuda:
        ctx.note(f"{OP_SAVE}: checkpoints are written from host memory; run on the CPU")
        return
    for cfg in configs(ctx):
        live, chain = cfg["live"], cfg["chain"]
        rng = np.random.default_rng(ctx.seed)
        colls = [collection(live)] + ([collection(live)] if live <= 40_000 else [])
        ids = rng.choice(2**62, live, replace=False).astype(np.int64)
        for coll in colls:
            coll.forward({"d": ids})
        size = f"live={live} D={DIM} touched={TOUCHED} chain={chain}"
        with tempfile.TemporaryDirectory(prefix="hbkernels-bench-checkpoint-") as tmp:
            full_times = []  # of colls[0]'s full saves: the first and the last
            for n, coll in enumerate(colls):
                t0 = time.perf_counter()
                coll.save(os.path.join(tmp, f"{n}-0"))
                if not n:
                    full_times.append((time.perf_counter() - t0) * 1e3)
            full_bytes = save_bytes(os.path.join(tmp, "0-0"))
            times, sizes, depth, longest = [], [], 0, (0, os.path.join(tmp, "1-0"))
            for k in range(1, chain + 1):
                touched = rng.choice(ids, TOUCHED)
                touched[:NEW] = rng.integers(2**62, 2**63 - 1, NEW)
                for n, coll in enumerate(colls):
                    out = coll.forward({"d": touched})
                    coll.backward({"d": np.ones_like(out["d"])})
                    path = os.path.join(tmp, f"{n}-{k}")
                    if n:  # the twin, under the default chain limit: its longest chain
                        depth = depth + 1 if coll.save(path, incremental=True) == "incremental" else 0
                        longest = max(longest, (depth, path))
                        continue
                    t0 = time.perf_counter()
                    coll.save(path, incremental=True, chain_limit=np.inf)
                    times.append((time.perf_counter() - t0) * 1e3)
                    sizes.append(save_bytes(path))
            final = os.path.join(tmp, "final")
            t0 = time.perf_counter()
            colls[0].save(final)
            full_times.append((time.perf_counter() - t0) * 1e3)
            case = f"{size} bytes={int(np.median(sizes))} full_bytes={full_bytes}"
            ctx.record(OP_SAVE, f"{HBK}-incremental", "save", case, "float32", Timing.of(times),
                       int(np.median(sizes)), reference=(f"{HBK}-full",))
            ctx.record(OP_SAVE, f"{HBK}-full", "save", case, "float32", Timing.of(full_times),
                       full_bytes, reference=(f"{HBK}-full",))

            def load(path):
                return lambda _: hbk.EmbeddingCollection.load(path, comm=hbk.dist.init("local"))

            cases = [(f"{HBK}-chain-{chain}", os.path.join(tmp, f"0-{chain}")),
                     (f"{HBK}-full", final)]
            if len(colls) > 1:
                cases.append((f"{HBK}-chain-default", longest[1]))
                ctx.note(f"{OP_LOAD} live={live}: under the default chain_limit the longest chain "
                         f"holds {longest[0]} incremental saves")
            timings = ctx.measure_together([(load(path), [None], None) for _, path in cases])
            for (name, _), timing in zip(cases, timings):
                ctx.record(OP_LOAD, name, "load", size, "float32", timing, full_bytes,
                           reference=(f"{HBK}-full",))
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
