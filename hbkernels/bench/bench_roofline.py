"""The roofline sweep of issue 9: every target of "GPU kernels at the memory
roofline" measured in one run, against the device's own copy bandwidth and peers.

The roofline is a large device-to-device copy (bytes read + written, measured
first); each case's GB/s counts the bytes it must move (as in the op scripts)
and is reported as % of it. Timing, input rotation (copies spanning 4x the L2)
and verification against a peer before timing are :class:`hbkernels.bench.common.Context`'s.

Cases (GPU sizes; ``--device cpu`` runs smaller ones, ``--smoke`` tiny ones):

1. ``embedding_bag`` sum, fp32, D in {16, 64, 128, 256} x L in {1, 32}, B=65536,
   E=1e7 rows, Zipf(1.05): hbk (and hbk ``bounds="unchecked"``, no host sync) vs
   torch ``F.embedding_bag`` and a gather-then-sum. Targets: >= 1.5x torch;
   >= 75% of copy bandwidth at D >= 64.
2. The same at D=128, L=32 with an fp16 table. Target: hbk fp16 time <= 0.6x fp32.
3. 26 tables of D=128 (1e6 rows each, stacked in one array), B=65536 bags per
   table, L in {1, 32}: one coalesced ``embedding_bag`` over the stacked table
   (ids shifted by each table's first row, made untimed, as a collection keeps
   them) vs 26 calls on the tables' row slices (hbk and torch; a gather-then-sum
   verifies hbk when torch is missing). Target: >= 2x.
4. Fused backward + ``RowWiseAdagrad`` at D=128, L=32: ``bwd+rowwise_adagrad``
   (``fused_step`` alone; the unfused backward + step and a unique/scatter-add
   path beside it), target >= 50% of copy bandwidth; ``fwd+bwd+rowwise_adagrad``
   against torch's path: ``F.embedding_bag(sparse=True)``, autograd, and the
   same row-wise Adagrad in torch ops on the coalesced sparse gradient (torch
   has no row-wise Adagrad), target >= 2x. The fused step again with 97% of the ids one
   id (``hot=0.97``). Beside each fused step, ``embedding_bag_backward`` alone
   (``hbkernels-backward``, not verified). At the GPU sizes: the fused step <= 0.6 ms,
   the backward alone <= 0.4 ms.
5. ``unique(return_inverse=True)`` on 4M and 64M ids (``bench_unique``'s cases):
   target >= 2x ``torch.unique``.

``--cases`` picks some of ``forward``, ``tables``, ``step`` and ``unique`` (default all).

Files (default ``bench/results/<device>-<date>``): ``.csv`` (the rows), ``.md``
(targets met or missed, then every row) and ``.png`` (% of copy bandwidth per
case; needs matplotlib, which ``--report`` can add later on another machine).

    python3 -m hbkernels.bench.bench_roofline --device cuda
    python3 -m hbkernels.bench.bench_roofline --report bench/results/<device>-<date>.csv
"""
import csv
import datetime
import re
import sys
from pathlib import Path

import numpy as np

import hbkernels as hbk
from . import bench_unique
from .bench_embedding_bag import gather_reduce
from .bench_embedding_bag_backward import LR, hbk_provider
from .common import (HBK, RESULTS_DIR, Context, Provider, as_arrays, format_table, parser, results, slug,
                     to_host)

BAG, TABLES, STEP = "embedding_bag", "embedding_bag_tables", "embedding_bag_backward"
NUM_TABLES = 26
EPS = 1e-10
UNCHECKED = HBK + "-unchecked"
PER_TABLE = HBK + "-per-table"
UNFUSED = HBK + "-unfused"
BACKWARD = HBK + "-backward"  # embedding_bag_backward alone, timed beside the fused step
HOT_SHARE = 0.97  # the step's second id stream: this share of the ids is one id
CASES = ("forward", "tables", "step", "unique")


def sizes(ctx):
    if ctx.simulated:
        return dict(E=64, B=2, dims=(3,), lengths=(2,), alpha=1.1, table_rows=8, wide=3)
    if ctx.smoke:
        return dict(E=1000, B=64, dims=(1, 8), lengths=(1, 4), alpha=1.1, table_rows=100, wide=8)
    if ctx.is_cuda:
        return dict(E=10**7, B=65536, dims=(16, 64, 128, 256), lengths=(1, 32), alpha=1.05,
                    table_rows=10**6, wide=128)
    return dict(E=10**6, B=8192, dims=(16, 64, 128), lengths=(1, 32), alpha=1.1,
                table_rows=10**5, wide=128)


def size_label(**params):
    return " ".join(f"{k}={v}" for k, v in params.items())


def parse_size(size):
    return {k: v for k, v in re.findall(r"(\w+)=(\S+)", size)}


# -- 1 and 2: one table ----------------------------------------------------------
def forward_cases(ctx, s):
    torch = ctx.torch
    for dim in s["dims"]:
        dtypes = ("float32", "float16") if dim == s["wide"] else ("float32",)
        for dtype in dtypes:
            w = ctx.random_table(s["E"], dim, dtype)
            item = w.dtype.itemsize
            for length in s["lengths"] if dtype == "float32" else s["lengths"][-1:]:
                B = s["B"]
                ids = ctx.zipf_ids(B * length, s["E"], s["alpha"])
                offsets = ctx.xp.arange(B + 1, dtype=ctx.xp.int64) * length
                fp16 = dtype == "float16"
                ctx.compare(BAG, "sum", size_label(E=s["E"], D=dim, B=B, L=length, zipf=s["alpha"]),
                            dtype, {"w": w, "ids": ids, "offsets": offsets}, [
                                Provider(HBK, lambda a: hbk.embedding_bag(a["w"], a["ids"], a["offsets"])),
                                Provider(UNCHECKED, lambda a: hbk.embedding_bag(
                                    a["w"], a["ids"], a["offsets"], bounds="unchecked")),
                                torch and Provider("torch", lambda a: torch.nn.functional.embedding_bag(
                                    a["ids"], a["w"], a["offsets"], mode="sum", include_last_offset=True),
                                    prepare=ctx.as_torch),
                                Provider(ctx.xp_name, gather_reduce(ctx.xp, "sum", B, length)),
                            ],
                            nbytes=B * length * dim * item + ids.nbytes + offsets.nbytes + B * dim * item,
                            rtol=1e-2 if fp16 else 1e-5, atol=1e-2 if fp16 else 1e-4)
                del ids, offsets
            del w
            ctx.release()


# -- 3: many tables in one launch -----------------------------------------------------
def tables_cases(ctx, s):
    xp, torch = ctx.xp, ctx.torch
    T, rows, dim, B = NUM_TABLES, s["table_rows"], s["wide"], s["B"]
    w = ctx.random_table(T * rows, dim, "float32")
    for length in s["lengths"]:
        local = xp.stack([ctx.zipf_ids(B * length, rows, s["alpha"], seed_offset=t) for t in range(T)])
        shifted = (local + (xp.arange(T, dtype=xp.int64) * rows)[:, None]).reshape(-1)
        offsets = xp.arange(B + 1, dtype=xp.int64) * length
        all_offsets = xp.arange(T * B + 1, dtype=xp.int64) * length

        def per_table(embedding_bag):
            def run(a):
                table, ids, offs = a["w"], a["local"], a["offsets"]
                return tuple(embedding_bag(table[t * rows:(t + 1) * rows], ids[t], offs) for t in range(T))
            return run

        def torch_bag(table, ids, offs):
            return torch.nn.functional.embedding_bag(ids, table, offs, mode="sum", include_last_offset=True)

        ctx.compare(TABLES, f"sum x{T}", size_label(T=T, E=rows, D=dim, B=B, L=length, zipf=s["alpha"]),
                    "float32", {"w": w, "shifted": shifted, "all_offsets": all_offsets,
                                "local": local, "offsets": offsets}, [
                        Provider(HBK, lambda a: hbk.embedding_bag(a["w"], a["shifted"], a["all_offsets"])),
                        Provider(PER_TABLE, per_table(hbk.embedding_bag)),
                        torch and Provider("torch", per_table(torch_bag), prepare=ctx.as_torch),
                        # the gather peer holds T*B*L rows at once (28 GB on the GPU): a verifier only without torch
                        None if torch else Provider(ctx.xp_name, lambda a: gather_reduce(xp, "sum", T * B, length)(
                            {"w": a["w"], "ids": a["shifted"]})),
                    ],
                    nbytes=T * B * (length * dim * 4 + dim * 4) + shifted.nbytes + all_offsets.nbytes,
                    canon=lambda r: (np.concatenate(as_arrays(r)),),
                    rtol=1e-5, atol=1e-4)
        del local, shifted, offsets, all_offsets
    del w
    ctx.release()


# -- 4: fused backward + row-wise Adagrad ----------------------------------------------
def array_step(ctx, B, L):
    """NumPy/CuPy: dedup, scatter-add the bag gradients per distinct id, row-wise Adagrad."""
    xp = ctx.xp
    add_at = ctx.add_at

    def prepare(a):
        w = a["w"].copy()
        return dict(a, w=w, m=xp.zeros(w.shape[0], xp.float32), bag_of=xp.repeat(xp.arange(B), L))

    def run(a):
        w, m = a["w"], a["m"]
        uniq, inverse = xp.unique(a["ids"], return_inverse=True)
        g = xp.zeros((uniq.shape[0], w.shape[1]), w.dtype)
        add_at(g, inverse.reshape(-1), a["grad"][a["bag_of"]])
        m[uniq] += (g * g).mean(axis=1)
        w[uniq] -= LR * g / (xp.sqrt(m[uniq]) + EPS)[:, None]
        return w

    return Provider(ctx.xp_name, run, prepare=prepare)


def torch_step(ctx):
    """torch's path: sparse autograd of F.embedding_bag, then row-wise Adagrad in torch ops."""
    torch = ctx.torch
    if torch is None:
        return None

    def prepare(a):
        t = ctx.as_torch(a)
        weight = torch.nn.Parameter(t["w"].clone())
        return dict(t, weight=weight, m=torch.zeros(weight.shape[0], device=weight.device))

    def run(a):
        weight, m = a["weight"], a["m"]
        out = torch.nn.functional.embedding_bag(
            a["ids"], weight, a["offsets"], mode="sum", sparse=True, include_last_offset=True)
        out.backward(a["grad"])
        g = weight.grad.coalesce()
        rows, values = g.indices()[0], g.values()
        with torch.no_grad():
            m_rows = m.index_select(0, rows) + (values * values).mean(dim=1)
            m.index_copy_(0, rows, m_rows)
            weight.index_add_(0, rows, values * (-LR / (m_rows.sqrt() + EPS)).unsqueeze(1))
        weight.grad = None
        return weight.detach()

    return Provider("torch", run, prepare=prepare)


def backward_alone(num_rows):
    """``embedding_bag_backward`` alone (the sparse gradient a user's own optimizer takes)."""
    return Provider(BACKWARD, lambda a: hbk.embedding_bag_backward(a["grad"], a["ids"], a["offsets"],
                                                                   num_rows=num_rows))


def hot_ids(ctx, ids, share):
    """``ids`` with a random ``share`` of its positions set to one id (the first's)."""
    host = to_host(ids)
    rng = np.random.default_rng(ctx.seed + 7)
    host = np.where(rng.random(host.shape[0]) < share, host[0], host)
    return ctx.xp.asarray(host)


def step_cases(ctx, s):
    xp = ctx.xp
    E, dim, B, length = s["E"], s["wide"], s["B"], s["lengths"][-1]
    zipf = ctx.zipf_ids(B * length, E, s["alpha"])
    offsets = xp.arange(B + 1, dtype=xp.int64) * length
    w = ctx.random_table(E, dim, "float32")
    grad = ctx.random_table(B, dim, "float32", seed_offset=1)
    forward = B * length * dim * 4 + B * dim * 4

    def hbk_step(name, *, fused, forward):
        return hbk_provider(ctx, name, fused=fused, forward=forward,
                            optimizer=hbk.optim.RowWiseAdagrad(lr=LR, eps=EPS))

    for hot in (None, HOT_SHARE):
        ids = zipf if hot is None else hot_ids(ctx, zipf, hot)
        rows = np.unique(to_host(ids))  # the rows a step changes: the only ones compared
        touched = rows.shape[0]

        def changed(result, rows=rows):
            return (as_arrays(result)[0][rows],)

        update = grad.nbytes + 2 * touched * dim * 4 + 2 * touched * 4 + ids.nbytes + offsets.nbytes
        size = size_label(E=E, D=dim, B=B, L=length, zipf=s["alpha"], touched=touched,
                          **({} if hot is None else {"hot": hot}))
        inputs = {"w": w, "ids": ids, "offsets": offsets, "grad": grad}
        ctx.compare(STEP, "bwd+rowwise_adagrad", size, "float32", inputs, [
            hbk_step(HBK, fused=True, forward=False),
            hbk_step(UNFUSED, fused=False, forward=False),
            array_step(ctx, B, length),
        ], nbytes=update, rtol=1e-4, atol=1e-5, parts=[backward_alone(E)], canon=changed)
        peer = torch_step(ctx) if hot is None else None  # (the Zipf stream's alone)
        if hot is None and peer is None:
            ctx.note("torch is not installed (or disabled): the fwd+bwd+rowwise_adagrad step is skipped")
        elif peer is not None:
            ctx.compare(STEP, "fwd+bwd+rowwise_adagrad", size, "float32", inputs, [
                hbk_step(HBK, fused=True, forward=True),
                hbk_step(UNFUSED, fused=False, forward=True),
                peer,
            ], nbytes=update + forward, rtol=1e-4, atol=1e-5, canon=changed)
        del ids
    del w, grad, zipf, offsets
    ctx.release()


def run(ctx, cases=CASES):
    s = sizes(ctx)
    for name, case in (("forward", forward_cases), ("tables", tables_cases), ("step", step_cases),
                       ("unique", lambda c, _: bench_unique.run(c))):
        if name in cases:
            case(ctx, s)


# -- the targets, from the rows alone (a run's, or a CSV's) ------------------------------
def _median(rows, op, mode, size, dtype, provider):
    for r in rows:
        if (r["op"], r["mode"], r["size"], r["dtype"], r["provider"]) == (op, mode, size, dtype, provider):
            return float(r["median_ms"])
    return None


def _verdict(name, value, threshold, at_most=False, unit="x"):
    fmt = (lambda v: f"{v:.0f}%") if unit == "%" else (lambda v: f"{v:.2f}{unit}")
    if value is None:
        return dict(target=name, measured="not measured", met=None)
    met = value <= threshold if at_most else value >= threshold
    return dict(target=name, measured=fmt(value), met=met)


def targets(rows):
    """Issue 9's targets, one dict (target, measured, met: True/False/None) per check."""
    copy = next((float(r["gbps"]) for r in rows if r["op"] == "copy" and r["gbps"]), None)
    out = []
    for r in rows:
        if r["provider"] != HBK:
            continue
        key = (r["op"], r["mode"], r["size"], r["dtype"])
        p = parse_size(r["size"])
        ms = float(r["median_ms"])

        def vs(peer):
            other = _median(rows, *key, peer)
            return None if other is None else other / ms

        pct = 100 * float(r["gbps"]) / copy if copy and r["gbps"] else None
        where = f"D={p.get('D')} L={p.get('L')}"
        if r["op"] == BAG and r["dtype"] == "float32":
            out.append(_verdict(f"embedding_bag {where}: >= 1.5x torch", vs("torch"), 1.5))
            if int(p["D"]) >= 64:
                out.append(_verdict(f"embedding_bag {where}: >= 75% of copy bandwidth", pct, 75, unit="%"))
        elif r["op"] == BAG and r["dtype"] == "float16":
            fp32 = _median(rows, r["op"], r["mode"], r["size"], "float32", HBK)
            out.append(_verdict(f"embedding_bag fp16 {where}: <= 0.6x the fp32 time",
                                None if fp32 is None else ms / fp32, 0.6, at_most=True))
        elif r["op"] == TABLES:
            out.append(_verdict(f"{p['T']} tables {where}: one call >= 2x {p['T']} calls", vs(PER_TABLE), 2))
        elif r["op"] == STEP and r["mode"] == "bwd+rowwise_adagrad":
            where += f" hot={p['hot']}" if "hot" in p else ""
            out.append(_verdict(f"fused backward + row-wise Adagrad {where}: >= 50% of copy bandwidth",
                                pct, 50, unit="%"))
            if p.get("E") == "10000000" and p.get("D") == "128":  # the GPU sizes' time targets
                out.append(_verdict(f"fused backward + row-wise Adagrad {where}: <= 0.6 ms", ms, 0.6,
                                    at_most=True, unit=" ms"))
                out.append(_verdict(f"embedding_bag_backward alone {where}: <= 0.4 ms",
                                    _median(rows, *key, BACKWARD), 0.4, at_most=True, unit=" ms"))
        elif r["op"] == STEP:
            out.append(_verdict(f"forward + fused backward + row-wise Adagrad {where}: >= 2x torch",
                                vs("torch"), 2))
        elif r["op"] == bench_unique.OP:
            out.append(_verdict(f"unique, inverse, N={p['N']}: >= 2x torch.unique", vs("torch"), 2))
    return out


def with_peers(rows):
    """``rows`` with each case's peers for speedups (the fastest is used): every
    provider but hbkernels' own (a CSV keeps no reference; a run's own rows get the same)."""
    return [{**r, "_reference": tuple(q["provider"] for q in rows if not q["provider"].startswith(HBK))}
            for r in rows]


def report(rows, path, command):
    """Write ``path`` (.md): the targets, then the table of every row."""
    device = rows[0]["device"] if rows else "?"
    copy = next((r for r in rows if r["op"] == "copy"), None)
    mark = {True: "met", False: "**missed**", None: "not measured"}
    lines = [f"# Roofline sweep (issue 9) on {device}", "",
             f"Command: `{command}`", ""]
    if copy:
        lines += [f"Roofline: device copy {float(copy['gbps']):.1f} GB/s (bytes read + written, "
                  f"{copy['size']}).", ""]
    lines += ["| target | measured | |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {mark[t['met']]} |" for t in targets(rows)]
    lines += ["", "Every row (speedup vs the case's fastest peer):", "", "```",
              format_table(results(with_peers(rows))), "```", ""]
    Path(path).write_text("\n".join(lines))


def chart(rows, path):
    """Bars of % of copy bandwidth per case, hbk and torch side by side. Returns a note or None."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return "matplotlib is not installed: no chart (bench_roofline.py --report CSV makes it later)"
    res = [r for r in results(with_peers(rows)) if r["pct_copy"] is not None and r["op"] != "copy"]
    cases = list(dict.fromkeys((r["op"], r["mode"], r["size"], r["dtype"]) for r in res))
    if not cases:
        return "no case with GB/s: no chart"
    fig = Figure(figsize=(9, 1.5 + 0.45 * len(cases)))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for k, (provider, color) in enumerate(((HBK, "tab:blue"), ("torch", "tab:orange"))):
        pct = [next((r["pct_copy"] for r in res if (r["op"], r["mode"], r["size"], r["dtype"]) == c
                     and r["provider"] == provider), 0) for c in cases]
        ax.barh([i + 0.38 * k for i in range(len(cases))], pct, height=0.36, color=color, label=provider)
    ax.axvline(75, color="black", linestyle="--", linewidth=1, label="75% (forward target)")
    labels = []
    for op, mode, size, dtype in cases:
        p = parse_size(size)
        shape = " ".join(f"{k}={p[k]}" for k in ("T", "N", "D", "L") if k in p)
        labels.append(f"{op} {mode} {dtype} {shape}")
    ax.set_yticks([i + 0.19 for i in range(len(cases))], labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("% of the device's copy bandwidth (bytes the op must move / time)")
    ax.set_title(f"hbkernels roofline on {rows[0]['device']}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return None


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_outputs(rows, csv_path, command):
    stem = Path(csv_path).with_suffix("")
    report(rows, f"{stem}.md", command)
    note = chart(rows, f"{stem}.png")
    print(f"report -> {stem}.md" + (f"; {note}" if note else f"; chart -> {stem}.png"))
    for t in targets(rows):
        print(f"  {t['target']}: {t['measured']} ({'met' if t['met'] else 'missed' if t['met'] is False else '-'})")


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"the cases to run, comma-separated, of {', '.join(CASES)} (default: all)")
    p.add_argument("--report", metavar="CSV", default=None,
                   help="measure nothing: write the .md and .png of an earlier run's CSV (one run's rows)")
    args = p.parse_args(argv)
    command = "python3 -m hbkernels.bench.bench_roofline " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.report:
        write_outputs(read_csv(args.report), args.report, command)
        return None
    ctx = Context.from_args(args)
    if args.out is None:  # a fresh file per run; a given --out is appended to
        ctx.out = RESULTS_DIR / f"{slug(ctx.device_name)}-{datetime.date.today().isoformat()}.csv"
        ctx.out.unlink(missing_ok=True)
    print(f"device: {ctx.device_name} ({ctx.device}); rows -> {ctx.out}")
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        p.error(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(CASES)}")
    ctx.copy_bandwidth()
    run(ctx, cases)
    print()
    print(ctx.summary())
    write_outputs(ctx.rows, ctx.out, command)
    return ctx


if __name__ == "__main__":
    main()
