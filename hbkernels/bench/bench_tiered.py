"""tiered: training steps of one table kept in files (``TableSpec(storage="mmap")``)
with a cache of K hot rows in RAM, against the same table with no cache (the OS
page cache alone, the kernels reading the memory-mapped files in place) and,
where it fits, the table in RAM (``storage="device"`` on the CPU).

Two sizes: one that fits in RAM (1/8 of it, with its optimizer state) and one of
twice this machine's RAM (sparse files: a row is made on first touch, from the
same ``(seed, table, row)`` rule as a table in RAM). D = 64, row-wise Adagrad,
Zipf(1.1) ids (hot rows scattered over the table), bags of 8 ids, 4096 bags a
step; a step is ``forward``, ``prefetch`` of the next batch, ``backward``. K is
1%, 5% and 20% of the rows. Each provider owns the machine (and its page cache)
while it runs its steps in turn, from fresh files; a cache first fills until it
evicts, and the providers without a cache warm up as long as the 1% cache did.

A cache evicts K/32 rows or more at once, so a step that evicts is much slower
than one that does not: a cache is timed over at least 30 steps and until 3 steps
have evicted (at most 3000), and steps/s is 1000 / ``mean_ms`` (in ``size``), not
the median. A row's ``size`` also names the table, the steps warmed up and timed,
the cache's hit rate over the timed steps (distinct rows found in the cache /
distinct rows asked, per step) and the peak of anonymous memory (RssAnon: what
cannot be paged out; mapped file pages are not in it) above what the process held
before the collection was built.

    python3 -m hbkernels.bench.bench_tiered --device cpu
"""
import os
import shutil
import tempfile
import time

import numpy as np

import hbkernels as hbk
from .common import HBK, Timing, cli_main, zipf_cdf

OP = "tiered"
DIM, BAGS, HOT, ALPHA = 64, 4096, 8, 1.1
FRACTIONS = (0.01, 0.05, 0.20)
PASSES, MAX_TIMED = 3, 3000  # a cache is timed over 3 steps that evict, at most 3000 steps


def configs(ctx):
    if ctx.smoke:
        return dict(sizes=[("smoke", 20000)], steps=3, warmup=1, bags=64, max_fill=50)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    row = DIM * 4 + 4  # fp32 weights and one row-wise Adagrad value
    return dict(sizes=[("1/8 RAM", ram // 8 // row), ("2x RAM", 2 * ram // row)],
                steps=ctx.reps or 30, warmup=ctx.warmup or 5, bags=BAGS, max_fill=20000)


def anon_kb():
    """This process's anonymous resident memory (kB, Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def providers(rows, fits):
    """(name, TableSpec keywords) of each provider at ``rows`` rows: the smallest cache
    first (the providers without one then warm up as long as it did)."""
    caches = [(f"{HBK}-cache-{f:.0%}", {"storage": "mmap", "cache_rows": max(1, int(f * rows))})
              for f in FRACTIONS]
    return caches[:1] + ([("in-ram", {})] if fits else []) + [("mmap-no-cache", {"storage": "mmap"})] + caches[1:]


class Batches:
    """Step ``k``'s bags of Zipf ids over ``rows`` rows (the same for every provider):
    ranks from the bounded law's inverse CDF, scattered by one fixed permutation."""

    def __init__(self, rows, bags, seed):
        self.cdf = zipf_cdf(rows, ALPHA)
        self.perm = np.random.default_rng(seed).permutation(rows)
        self.rows, self.bags, self.seed = rows, bags, seed
        self.offsets = np.arange(0, bags * HOT + 1, HOT, dtype=np.int64)

    def __getitem__(self, k):
        u = np.random.default_rng([self.seed, k]).random(self.bags * HOT)
        ranks = np.minimum(np.searchsorted(self.cdf, u, side="right"), self.rows - 1)
        return hbk.Ragged(self.perm[ranks], self.offsets)


def run(ctx):
    if ctx.is_cuda:
        ctx.note("tiered: a CPU benchmark (tables larger than this machine's RAM); skipped on cuda")
        return
    cfg = configs(ctx)
    steps = cfg["steps"]
    ctx.note(f"tiered: a cache is warmed up until it first evicts (at most {cfg['max_fill']} "
             f"steps), the other providers as long as the 1% cache; then at least {steps} "
             f"steps are timed")
    for label, rows in cfg["sizes"]:
        work = Batches(rows, cfg["bags"], ctx.seed)
        grad = np.ones((cfg["bags"], DIM), np.float32)
        size = f"{label}: rows={rows} dim={DIM} zipf={ALPHA} bags={cfg['bags']}x{HOT}"
        warmup = cfg["warmup"]
        for name, kw in providers(rows, label != "2x RAM"):
            if not ctx.selected(name):
                continue
            where = tempfile.mkdtemp(prefix="hbk-tiered-")
            try:
                before = anon_kb()
                spec = hbk.TableSpec("t", num_rows=rows, dim=DIM,
                                     path=os.path.join(where, "t") if kw else None, **kw)
                coll = hbk.EmbeddingCollection([spec], comm=hbk.dist.init("local"), device="cpu",
                                               optimizer=hbk.optim.RowWiseAdagrad(lr=0.05))
                times, peak, k, cached = [], anon_kb(), 0, "cache_rows" in kw
                start, passes, evicted = None, 0, 0
                while len(times) < steps or (cached and passes < PASSES and len(times) < MAX_TIMED):
                    warm = (k < cfg["warmup"] or (not cached and k < warmup) or (
                        cached and k < cfg["max_fill"] and not coll.cache_stats("t")["evictions"]))
                    if not warm and start is None:
                        start = coll.cache_stats("t") if cached else {}
                        evicted, fill = start.get("evictions", 0), k
                    now, after = work[k], work[k + 1]
                    t0 = time.perf_counter()
                    coll.forward({"t": now})
                    coll.prefetch({"t": after})
                    coll.backward({"t": grad})
                    if not warm:
                        times.append((time.perf_counter() - t0) * 1e3)
                        if cached:  # a step that evicted: one more pass over the cache
                            now_evicted = coll.cache_stats("t")["evictions"]
                            passes += now_evicted > evicted
                            evicted = now_evicted
                    peak = max(peak, anon_kb())
                    k += 1
                if name == providers(rows, False)[0][0]:
                    warmup = max(warmup, fill)  # the smallest cache's warm-up, for the others
                extra = f" warmup={fill} timed={len(times)} mean_ms={np.mean(times):.3f}"
                if cached:
                    end = coll.cache_stats("t")
                    asked, missed = (end[key] - start[key] for key in ("lookups", "misses"))
                    extra += f" hit={1 - missed / max(asked, 1):.3f} evictions={passes}"
                ctx.record(OP, name, "step", f"{size}{extra} anon_peak_MB={(peak - before) / 1024:.0f}",
                           "float32", Timing.of(times), 0, reference=("in-ram", "mmap-no-cache"))
                del coll
            finally:
                shutil.rmtree(where, ignore_errors=True)
        del work
        ctx.release()


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
