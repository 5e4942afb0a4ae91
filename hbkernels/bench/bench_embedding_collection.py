"""EmbeddingCollection: a training step of a synthetic "tiny" model, sharded over N ranks.

The model (``TINY``, after NVIDIA distributed-embeddings' synthetic "tiny",
scaled to a 2-core CPU VM): 24 tables of 500k down to 50 rows, dims 4 to 128
(74.5 M weights, 298 MB fp32, as much again of Adagrad state); 25 features,
one-hot except four multi-hot (hotness 10 to 50; one ``mean``), one table
shared by two features; ids Zipf(1.1). Each rank draws its own local batch
(``--batch``, default 2048) and a fixed gradient (``make_batch``).
``--smoke``: 4 small tables, batch 64, 3 repetitions.

Measured at the N ranks ``mpiexec`` gave (1 without it), Adagrad(lr=0.05):

1. Step time (forward + backward) of each plan against the "one big process"
   peer: torch ``EmbeddingBag(sparse=True)`` per table + ``optim.Adagrad``,
   same initial weights, the GLOBAL batch on rank 0 while the other ranks
   sleep. Two steps of every plan are first checked against torch (else the
   first plan): outputs, and the weights of the tables of <= 100k rows. The
   runs of a group alternate repetition by repetition; a step starts after a
   barrier and its time is the slowest rank's. Refused plans (ValueError) are skipped.
2. Bytes on the wire per step, all ranks (``coll.stats``), of ``row_wise`` and
   ``auto`` with dedup on/off and wire float32/float16 (also checked, timed).
3. Framework overhead of ``auto`` with ``profile=True``, per rank:
   1 - (``timings["kernels"]`` + ``timings["comm"]``) / step time.

Rank 0 appends the CSV rows of 1 (op=embedding_collection, provider hbkernels
with mode = plan or torch with mode single-process-global-batch, size
``tiny-N{N}-B{batch}``, gbps = all ranks' ids x dim x 4 B / median step) and
a report of 1-3 to ``<csv stem>-embedding-collection.md``.

    python3 -m hbkernels.bench.bench_embedding_collection [--smoke] [--out CSV] [--device cpu|cuda]
    mpiexec -n 2 python3 -m mpi4py -m hbkernels.bench.bench_embedding_collection [--batch B] [--plans row_wise,auto]
"""
import datetime
import gc
import sys
import time
import warnings
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np  # noqa: E402

import hbkernels as hbk  # noqa: E402
from .common import (  # noqa: E402
    HBK, RESULTS_DIR, Timing, append_csv, cpu_name, gpu_name, optional_module, parser, slug, to_host,
    zipf_ids,
)
from hbkernels.sharding import initial_weights  # noqa: E402
from hbkernels.types import PLACEMENTS  # noqa: E402

OP = "embedding_collection"
PLANS = PLACEMENTS + ("auto",)
WIRE_PLANS = ("row_wise", "auto")
WIRE_VARIANTS = ((True, None), (False, None), (True, "float16"), (False, "float16"))  # (dedup, wire dtype)
STATS = ("ids_bytes", "rows_bytes", "grads_bytes", "replica_grads_bytes")  # coll.stats, bytes per step
TORCH_MODE = "single-process-global-batch"
LR = 0.05
CHECK_MAX_ROWS = 100_000  # weights of tables up to this size are compared after the checked steps

TINY_ROWS = [500_000, 400_000, 250_000, 200_000, 100_000, 100_000, 50_000, 20_000, 10_000, 10_000, 5_000,
             5_000, 2_000, 1_000, 1_000, 500, 500, 200, 200, 100, 100, 64, 50, 50]
TINY_DIMS = [32, 16, 64, 128, 8, 32, 64, 128, 16, 4, 8, 32, 64, 128, 16, 4, 8, 32, 64, 16, 4, 8, 128, 4]
TINY_FEATURES = {"t03": (("t03", 20),), "t05": (("t05a", 1), ("t05b", 30)), "t08": (("t08", 50),),
                 "t11": (("t11", 10),)}  # the others: one 1-hot feature named after the table
# (table, rows, dim, ((feature, hotness), ...), combiner)
TINY = [(t, rows, dim, TINY_FEATURES.get(t, ((t, 1),)), "mean" if t == "t08" else "sum")
        for t, rows, dim in zip((f"t{i:02d}" for i in range(24)), TINY_ROWS, TINY_DIMS)]
SMOKE = [("s0", 1000, 16, (("s0", 1),), "sum"), ("s1", 500, 8, (("s1", 10),), "mean"),
         ("s2", 200, 4, (("s2a", 1), ("s2b", 5)), "sum"), ("s3", 100, 16, (("s3", 1),), "sum")]


# the mpi4py COMM_WORLD calls used here, for a world of one without mpi4py
SOLO = SimpleNamespace(Get_rank=lambda: 0, Get_size=lambda: 1, bcast=lambda obj, root=0: obj,
                       gather=lambda obj, root=0: [obj], allgather=lambda obj: [obj], Barrier=lambda: None,
                       Ibarrier=lambda: SimpleNamespace(Test=lambda: True))


def make_batch(model, batch, ranks, seed):
    """The batches of ``ranks``, concatenated in order: ({feature: (ids, offsets)},
    {feature: gradient [samples, dim]}), NumPy. A bag of hotness h holds h - h//2 to
    h + h//2 ids, Zipf(1.1) over its table; the gradient is uniform in [0.5, 1.5)."""
    feats, grads = {}, {}
    features = [(f, rows, dim, h) for _, rows, dim, fs, _ in model for f, h in fs]
    for k, (f, rows, dim, h) in enumerate(features):
        ids, lengths, g = [], [], []
        for r in ranks:
            rng = np.random.default_rng([seed, r, k])
            lengths.append(np.ones(batch, np.int64) if h == 1 else rng.integers(h - h // 2, h + h // 2 + 1, batch))
            ids.append(zipf_ids(int(lengths[-1].sum()), rows, 1.1, seed=int(rng.integers(2**31))))
            g.append(rng.uniform(0.5, 1.5, size=(batch, dim)).astype(np.float32))
        feats[f] = (np.concatenate(ids), np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64))
        grads[f] = np.concatenate(g)
    return feats, grads


class Bench:
    def __init__(self, args):
        self.args = args
        MPI = optional_module("mpi4py.MPI")
        self.world = SOLO if MPI is None else MPI.COMM_WORLD
        self.N, self.R = self.world.Get_size(), self.world.Get_rank()
        self.model = SMOKE if args.smoke else TINY
        self.batch = args.batch or (64 if args.smoke else 2048)
        self.specs = [hbk.TableSpec(name, num_rows=rows, dim=dim, combiner=combiner,
                                    features=tuple(f for f, _ in feats), hotness=float(np.mean([h for _, h in feats])))
                      for name, rows, dim, feats, combiner in self.model]
        self.cp = optional_module("cupy") if args.device == "cuda" else None
        if args.device == "cuda":
            if self.cp is None:
                raise SystemExit("--device cuda needs CuPy (pip install 'hbkernels[cuda13]')")
            self.comm = hbk.dist.init("auto")  # nccl when every rank has a GPU, else mpi
            if self.comm.backend == "local":
                self.cp.cuda.Device(0).use()
            self.device_name, xp = gpu_name(self.cp), self.cp
        else:
            self.comm = hbk.dist.init("local" if MPI is None else "mpi")
            self.device_name, xp = cpu_name(), np
        assert (self.comm.rank, self.comm.world_size) == (self.R, self.N), "hbk.dist and mpi4py disagree"
        self.out = Path(args.out) if args.out else RESULTS_DIR / f"{slug(self.device_name)}.csv"
        self.md = self.out.with_name(f"{self.out.stem}-embedding-collection.md")
        self.size = f"{'smoke' if args.smoke else 'tiny'}-N{self.N}-B{self.batch}"
        feats, grads = make_batch(self.model, self.batch, [self.R], args.seed)
        self.feats = {f: hbk.Ragged(xp.asarray(v), xp.asarray(o)) for f, (v, o) in feats.items()}
        self.grads = {f: xp.asarray(g) for f, g in grads.items()}
        self.payload = self.sum(sum(ids.shape[0] * grads[f].shape[1] * 4 for f, (ids, _) in feats.items()))
        self.check_tables = [s.name for s in self.specs if args.smoke or s.num_rows <= CHECK_MAX_ROWS]
        self.reference = None  # rank 0: (source, {label: array}) of the first verified model
        self.rows, self.skipped, self.wire = [], [], []  # for the report
        self.overhead = self.torch_ms = None

    def log(self, msg):
        if self.R == 0:
            print(msg, flush=True)

    def sum(self, value):
        return sum(self.world.allgather(int(value)))

    def sync(self):
        if self.cp is not None:
            self.cp.cuda.get_current_stream().synchronize()

    def quiet_barrier(self):
        """A barrier that sleeps instead of spinning (leaves the cores to rank 0's torch peer)."""
        req = self.world.Ibarrier()
        while not req.Test():
            time.sleep(0.002)

    def free(self):
        gc.collect()
        if self.cp is not None:
            self.sync()
            self.cp.get_default_memory_pool().free_all_blocks()

    # -- hbk ----------------------------------------------------------------------------------------
    def build(self, what, plan, **kw):
        """The collection, or None on every rank when a rank refuses the plan with ValueError."""
        try:
            coll, error = hbk.EmbeddingCollection(
                self.specs, comm=self.comm, optimizer=hbk.optim.Adagrad(lr=LR), plan=plan,
                batch_size_hint=self.batch, seed=self.args.seed, device=self.args.device, **kw), None
        except ValueError as e:
            coll, error = None, f"{type(e).__name__}: {e}"
        reason = next((e for e in self.world.allgather(error) if e), None)
        if reason:
            self.log(f"  skip {what}: {reason}")
            self.skipped.append((what, reason.splitlines()[0]))
        return None if reason else coll

    def step(self, coll):
        coll.forward(self.feats)
        coll.backward(self.grads)

    def verify(self, what, coll, loose=False):
        """Two steps of ``coll``, checked against the reference on rank 0 (or made it)."""
        outs = {}
        for i in (1, 2):
            outs.update({f"step {i} output {f}": to_host(v) for f, v in coll.forward(self.feats).items()})
            coll.backward(self.grads)
        gathered = self.world.gather(outs, root=0)
        weights = {f"weights {t}": to_host(coll.full_weights(t)) for t in self.check_tables}
        error = None
        if self.R == 0 and self.reference is None:
            self.reference = (what, {k: np.concatenate([g[k] for g in gathered]) for k in outs} | weights)
            print(f"  {what}: no torch peer, so it is the reference of the other plans")
        elif self.R == 0:
            (source, ref), (rtol, atol) = self.reference, ((2e-2, 2e-3) if loose else (1e-4, 1e-5))
            try:
                for label, expected in ref.items():
                    got = weights[label] if label in weights else np.concatenate([g[label] for g in gathered])
                    np.testing.assert_allclose(got, expected, rtol, atol, err_msg=f"{what}: {label}")
                print(f"  verified {what} against {source} (2 steps: outputs, {len(weights)} tables' weights)")
            except AssertionError as e:
                error = f"{what} vs {source}: {e}"
        error = self.world.bcast(error, root=0)
        if error:
            raise AssertionError(error)

    # -- timing: the runs of a group alternate, repetition by repetition ------------------------------
    def run_once(self, name, step):
        """Seconds of one step on this rank: on every rank after a barrier, or (torch: a
        no-op on the other ranks) on rank 0 while the others sleep."""
        self.sync()
        if name != "torch":
            self.world.Barrier()
        t0 = time.perf_counter()
        step()
        self.sync()
        dt = time.perf_counter() - t0
        if name == "torch":
            self.quiet_barrier()
        return dt

    def run_group(self, items, budget_s, cap=50, extra=None):
        """Build and verify ``items`` ([(what, plan, kwargs)]), then time them with the ``extra``
        runs: {what: (collection or None, Timing of the slowest rank, this rank's seconds)}.
        A warm round sizes the repetitions; repetition i runs them in an order rotated by i."""
        runs, colls = dict(extra or {}), {}
        for what, plan, kw in items:
            self.log(f"\n== {what}")
            if (coll := self.build(what, plan, **kw)) is not None:
                self.verify(what, coll, loose=kw.get("wire_dtype") is not None)
                runs[what], colls[what] = partial(self.step, coll), coll
        if not runs:
            return {}
        self.log(f"\n== timing {', '.join(runs)} (alternating)")
        names = list(runs)
        est = max(self.world.allgather(sum(self.run_once(n, runs[n]) for n in names)))
        reps = 3 if self.args.smoke else self.args.reps or int(np.clip(budget_s / max(est, 1e-6), 5, cap))
        for coll in colls.values():
            coll.timings.clear()
        times = np.zeros((len(names), reps))
        for i in range(reps):
            for j in np.roll(np.arange(len(names)), -i):
                times[j, i] = self.run_once(names[j], runs[names[j]])
        slowest = np.max(self.world.allgather(times), axis=0) * 1e3
        return {n: (colls.get(n), Timing.of(slowest[j]), times[j]) for j, n in enumerate(names)}

    def wire_stats(self, coll):
        return [self.sum(coll.stats.get(k, 0)) for k in STATS]

    def run_plans(self, torch_step):
        """Every plan and the torch peer, timed side by side: the CSV rows."""
        res = self.run_group([(p, p, {}) for p in self.args.plans], 3.0 if self.N == 1 else 12.0,
                             extra=None if torch_step is None else {"torch": torch_step})
        if "auto" in res:
            self.log("\n".join(str(res["auto"][0].plan).splitlines()[:len(self.specs) + 2]))
        for what, (coll, t, _) in res.items():
            if coll is None:
                self.record("torch", TORCH_MODE, t, None)
            else:
                self.record(HBK, what, t, sum(self.wire_stats(coll)))
        del res
        self.free()

    def run_wire_variants(self):
        """Per plan of WIRE_PLANS: dedup on/off x wire float32/float16, timed side by side."""
        for plan in [p for p in WIRE_PLANS if p in self.args.plans]:
            variants = {f"{plan} dedup={'on' if d else 'off'} wire={w or 'float32'}": (d, w)
                        for d, w in WIRE_VARIANTS}
            res = self.run_group([(what, plan, dict(dedup=d, wire_dtype=w)) for what, (d, w) in variants.items()],
                                 2.0 if self.N == 1 else 8.0, cap=20)
            self.wire += [(plan, *variants[what], self.wire_stats(c), t) for what, (c, t, _) in res.items()]
            del res
            self.free()

    def run_profile(self):
        """auto with profile=True, alternating with auto without (the cost of profiling)."""
        if "auto" not in self.args.plans:
            return
        res = self.run_group([("auto", "auto", {}), ("auto profile=True", "auto", {"profile": True})],
                             2.0 if self.N == 1 else 6.0)
        if len(res) == 2:
            coll, t, own = res["auto profile=True"]
            mine = [1e3 * x / len(own) for x in (own.sum(), coll.timings["kernels"], coll.timings["comm"])]
            self.overhead = (t, res["auto"][1], self.world.gather(mine, root=0))
        del res
        self.free()

    # -- torch: the one big process ---------------------------------------------------------------
    def torch_step(self):
        """Rank 0 builds the torch model and the reference (two checked steps). The step
        to time (a no-op on the other ranks), or None everywhere without torch on rank 0."""
        torch = step = None
        if self.R == 0 and "torch" in (self.args.providers or "torch").split(","):
            torch = optional_module("torch")
            torch = None if torch and self.args.device == "cuda" and not torch.cuda.is_available() else torch
        if self.R == 0 and torch is None:
            print("note: no torch peer (torch missing, disabled, not in --providers, or without CUDA)")
        try:
            if torch is not None:
                step = self._torch_on_rank0(torch)
        finally:
            self.quiet_barrier()
        return (step or (lambda: None)) if self.world.bcast(step is not None, root=0) else None

    def _torch_on_rank0(self, torch):
        dev = torch.device("cuda" if self.args.device == "cuda" else "cpu")
        warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch's Adagrad, sparse grads
        feats, grads = make_batch(self.model, self.batch, range(self.N), self.args.seed)
        feats = {f: (torch.from_numpy(v).to(dev), torch.from_numpy(o).to(dev)) for f, (v, o) in feats.items()}
        grads = {f: torch.from_numpy(g).to(dev) for f, g in grads.items()}
        table_of = {f: s.name for s in self.specs for f in s.features}
        bags = {s.name: torch.nn.EmbeddingBag(
            s.num_rows, s.dim, mode=s.combiner, sparse=True, include_last_offset=True,
            _weight=torch.from_numpy(initial_weights(s, self.args.seed)).to(dev)) for s in self.specs}
        opt = torch.optim.Adagrad([b.weight for b in bags.values()], lr=LR)

        def step():
            outs = {f: bags[table_of[f]](v, o) for f, (v, o) in feats.items()}
            torch.autograd.backward([outs[f] for f in feats], [grads[f] for f in feats])
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            return outs

        ref = {}
        for i in (1, 2):
            ref.update({f"step {i} output {f}": v.detach().cpu().numpy() for f, v in step().items()})
        ref.update({f"weights {t}": bags[t].weight.detach().cpu().numpy().copy() for t in self.check_tables})
        self.reference = ("torch", ref)
        print(f"\n== torch: reference of 2 steps on the global batch of {self.N * self.batch}", flush=True)
        return step

    # -- output -----------------------------------------------------------------------------------
    def record(self, provider, mode, t, wire):
        if self.R == 0:
            append_csv(self.out, {
                "op": OP, "provider": provider, "mode": mode, "size": self.size, "dtype": "float32",
                "median_ms": f"{t.median_ms:.6g}", "p20_ms": f"{t.p20_ms:.6g}", "p80_ms": f"{t.p80_ms:.6g}",
                "gbps": f"{self.payload / (t.median_ms * 1e6):.6g}", "device": self.device_name})
            self.rows.append((provider, mode, t, wire))
            self.torch_ms = t.median_ms if provider == "torch" else self.torch_ms

    def report(self):
        """Print the summary and append it to self.md (rank 0)."""
        if self.R != 0:
            return
        launcher = f"mpiexec -n {self.N} python3 -m mpi4py" if self.N > 1 else "python3"
        md = [f"## {self.size}: {self.N} rank(s), local batch {self.batch}, {self.device_name} "
              f"({self.args.device}, backend {self.comm.backend}), {datetime.datetime.now():%Y-%m-%d %H:%M}\n",
              f"`{' '.join([launcher, '-m', 'hbkernels.bench.bench_embedding_collection', *sys.argv[1:]])}`; "
              f"lookup payload {self.payload / 1e6:.1f} MB/step (all ranks)\n",
              "### Step time (forward + backward + Adagrad, slowest rank)\n",
              "| provider | plan / mode | median ms | p20 ms | p80 ms | payload GB/s | wire MB/step | vs torch |",
              "|---|---|---|---|---|---|---|---|"]
        for provider, mode, t, wire in self.rows:
            ratio = f"{t.median_ms / self.torch_ms:.2f}x" if self.torch_ms and provider != "torch" else ""
            md.append(f"| {provider} | {mode} | {t.median_ms:.3f} | {t.p20_ms:.3f} | {t.p80_ms:.3f} | "
                      f"{self.payload / (t.median_ms * 1e6):.2f} | {'' if wire is None else f'{wire / 1e6:.3f}'} "
                      f"| {ratio} |")
        if self.torch_ms:
            md.append(f"\nvs torch = hbk step / torch step (one process, global batch {self.N * self.batch}).")
        md += [f"\nSkipped {what}: {reason}" for what, reason in self.skipped]
        md += ["\n### Bytes on the wire per step (all ranks, MB)\n",
               "| plan | dedup | wire dtype | ids | rows | grads | replica grads | total | step ms |",
               "|---|---|---|---|---|---|---|---|---|"]
        md += [f"| {plan} | {'on' if d else 'off'} | {w or 'float32'} | "
               + " | ".join(f"{v / 1e6:.3f}" for v in stats) + f" | {sum(stats) / 1e6:.3f} | {t.median_ms:.3f} |"
               for plan, d, w, stats, t in self.wire]
        md.append("")
        for plan in WIRE_PLANS:
            total = {(d, w): sum(s) for p, d, w, s, _ in self.wire if p == plan}
            if self.N == 1 and total:
                md.append(f"- {plan}: savings n/a (nothing leaves the rank at N=1)")
            elif len(total) == len(WIRE_VARIANTS):
                save = {k: f"{100 * (1 - total[k] / total[(False, None)]):.1f} %" for k in total}
                md.append(f"- {plan}, saved of the bytes without dedup in float32: dedup {save[(True, None)]}, "
                          f"fp16 wire {save[(False, 'float16')]}, both {save[(True, 'float16')]}")
        if self.overhead:
            t, plain, per_rank = self.overhead
            md += ["\n### Framework overhead (auto, profile=True)\n",
                   f"Step {t.median_ms:.3f} ms median with profiling, {plain.median_ms:.3f} ms without "
                   "(slowest rank, alternating). overhead = 1 - (kernels + comm) / step, per rank; "
                   "comm includes waiting for the other ranks.\n",
                   "| rank | step ms | kernels ms | comm ms | overhead |", "|---|---|---|---|---|"]
            md += [f"| {r} | {s:.3f} | {k:.3f} | {c:.3f} | {100 * (1 - (k + c) / s):.1f} % |"
                   for r, (s, k, c) in enumerate(per_rank)]
        text = "\n".join(md) + "\n"
        print("\n" + text)
        fresh = not self.md.exists() or self.md.stat().st_size == 0
        with open(self.md, "a") as f:
            f.write(("# EmbeddingCollection: training step of the synthetic tiny model\n\nWritten by "
                     "`hbkernels/bench/bench_embedding_collection.py` (see its docstring), one section per run.\n\n"
                     if fresh else "\n") + text)
        print(f"rows appended to {self.out}; report appended to {self.md}")


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=None, help="local batch per rank (default 2048, smoke 64)")
    p.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated subset of {','.join(PLANS)}")
    args = p.parse_args(argv)
    args.plans = [s.strip() for s in args.plans.split(",") if s.strip()]
    if unknown := [s for s in args.plans if s not in PLANS]:
        p.error(f"unknown plans {unknown}; choose from {list(PLANS)}")
    b = Bench(args)
    b.log(f"{OP}: {b.N} rank(s), {len(b.specs)} tables, local batch {b.batch}, {b.device_name} "
          f"({args.device}, hbk.dist backend {b.comm.backend}); rows -> {b.out}")
    b.run_plans(b.torch_step())
    b.run_wire_variants()
    b.run_profile()
    b.report()
    b.world.Barrier()
    return b


if __name__ == "__main__":
    main()
