"""checkpoint: incremental saves of a dynamic table, and loading a chain of them.

One dynamic table (D = 16, Adagrad, LRU) with every slot taken by ``live`` ids (40,000
and 4,000,000), a full save, then 100 steps each touching 12 ids (4 of them new, so 4
are evicted) and followed by ``save(incremental=True)``; then a full save of the same
state. Rows:

* ``save`` / ``hbkernels-incremental``: the 100 incremental saves (``size`` names their
  median bytes and the full save's);
* ``load`` / ``hbkernels-chain-100`` and ``hbkernels-full``: ``EmbeddingCollection.load``
  of the chain's last save (the chain replayed) and of the full save, interleaved; the
  ratio is what the chain costs.

GB/s counts the full save's bytes for both loads.

    python3 -m hbkernels.bench.bench_checkpoint --device cpu
"""
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
    return [dict(live=live, chain=CHAIN) for live in (40_000, 4_000_000)]


def save_bytes(path):
    """Bytes of the save at ``path``: its manifest and the files of its save directory."""
    total = os.path.getsize(os.path.join(path, "manifest.json"))
    for directory, _, files in os.walk(path):
        if directory != str(path):
            total += sum(os.path.getsize(os.path.join(directory, f)) for f in files)
    return total


def run(ctx):
    if ctx.is_cuda:
        ctx.note(f"{OP_SAVE}: checkpoints are written from host memory; run on the CPU")
        return
    for cfg in configs(ctx):
        live, chain = cfg["live"], cfg["chain"]
        rng = np.random.default_rng(ctx.seed)
        spec = hbk.TableSpec("d", num_rows=None, dim=DIM, capacity=live, evict="lru")
        coll = hbk.EmbeddingCollection([spec], comm=hbk.dist.init("local"), device="cpu",
                                       optimizer=hbk.optim.Adagrad(lr=0.05))
        ids = rng.choice(2**62, live, replace=False).astype(np.int64)
        coll.forward({"d": ids})
        size = f"live={live} D={DIM} touched={TOUCHED} chain={chain}"
        with tempfile.TemporaryDirectory(prefix="hbkernels-bench-checkpoint-") as tmp:
            coll.save(os.path.join(tmp, "0"))
            full_bytes = save_bytes(os.path.join(tmp, "0"))
            times, sizes = [], []
            for k in range(1, chain + 1):
                touched = rng.choice(ids, TOUCHED)
                touched[:NEW] = rng.integers(2**62, 2**63 - 1, NEW)
                out = coll.forward({"d": touched})
                coll.backward({"d": np.ones_like(out["d"])})
                path = os.path.join(tmp, str(k))
                t0 = time.perf_counter()
                coll.save(path, incremental=True, chain_limit=np.inf)
                times.append((time.perf_counter() - t0) * 1e3)
                sizes.append(save_bytes(path))
            ctx.record(OP_SAVE, f"{HBK}-incremental", "save",
                       f"{size} bytes={int(np.median(sizes))} full_bytes={full_bytes}",
                       "float32", Timing.of(times), int(np.median(sizes)))
            final = os.path.join(tmp, "final")
            coll.save(final)
            last = os.path.join(tmp, str(chain))

            def load(path):
                return lambda _: hbk.EmbeddingCollection.load(path, comm=hbk.dist.init("local"))

            timings = ctx.measure_together([(load(last), [None], None), (load(final), [None], None)])
            for name, timing in zip((f"{HBK}-chain-{chain}", f"{HBK}-full"), timings):
                ctx.record(OP_LOAD, name, "load", size, "float32", timing, full_bytes,
                           reference=(f"{HBK}-full",))
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
