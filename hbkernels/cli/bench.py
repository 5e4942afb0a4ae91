"""``hbkernels bench``: the op benchmarks of :mod:`hbkernels.bench` against their peers.

    hbkernels bench                                     # CPU, every op -> ./hbkernels-bench/
    hbkernels bench --device cuda --ops embedding_bag,unique --out results/
    hbkernels bench --smoke                             # tiny sizes: proves it runs

It runs the ops of ``hbkernels.bench.run_all`` through one
``hbkernels.bench.common.Context``: first the device's own copy bandwidth,
then every op, each verified against its peers (NumPy or CuPy, torch, JAX
where installed) and timed next to them.

The console shows a progress bar, then the table (op, mode, dtype, size,
provider, median ms, GB/s, % of the copy bandwidth, speedup vs the case's
fastest peer); what the benchmarks print goes to the log. Files in ``--out`` (a
folder, default ``./hbkernels-bench/``), ``<device>`` being the slug of the
CPU or GPU name:

* ``bench-<device>.csv``: the rows (``hbkernels.bench.common.COLUMNS``), a fresh file each run;
* ``bench-<device>.json``: device, copy GB/s, versions, arguments, timestamp and
  every row with its speedup and % of copy bandwidth as numbers;
* ``bench-<device>.png``: hbkernels' speedup vs its fastest peer per case (matplotlib);
* ``bench-<device>.log``: the benchmarks' output and the tracebacks of failed ops.

An op that fails is reported in one line and the others still run; the exit
status is then 1. ``--providers a,b`` times only those: each must be one that the ops
chosen time (``hbkernels.bench.run_all.PROVIDERS``; hash_table, host_per_call and
checkpoint time all theirs), else the command stops with an error naming them; a case
where none of them runs here (a peer not installed) is verified, not timed, with a note.
"""
import contextlib
import datetime
import platform
import sys
from pathlib import Path

from ._errors import CLIError
from ._help import HelpFormatter, plain
from .._files import write_json_atomic
from .progress import Progress

DEFAULT_OUT = "hbkernels-bench"
VERSIONS_OF = ("hbkernels", "numba", "numba_cuda", "numpy", "torch", "jax", "cupy")


def add_command(subparsers):
    p = subparsers.add_parser(
        "bench", help="op benchmarks vs peers (torch, NumPy, CuPy, JAX): table, CSV, JSON, PNG",
        description=plain(__doc__), formatter_class=HelpFormatter)
    from ..bench.options import add_run_arguments

    add_run_arguments(p)
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"folder of the CSV, JSON, PNG and log (default: ./{DEFAULT_OUT}/)")
    p.add_argument("--ops", default=None,
                   help="comma-separated ops of hbkernels.bench.run_all, e.g. embedding_bag,unique "
                        "(default: all)")
    p.set_defaults(run=run)


def run(args):
    from ..bench import common, run_all

    try:
        ops = run_all.select_ops(args.ops)
        run_all.check_providers(args.providers, ops, args.device)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.device == "cuda":
        problem = common.cuda_problem()
        if problem:
            raise CLIError(problem)
    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise CLIError(f"--out {out_dir} is a file, not a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        ctx = common.Context(args.device, None, smoke=args.smoke, reps=args.reps,
                             warmup=args.warmup, providers=args.providers, seed=args.seed)
    except SystemExit as exc:  # what the scripts exit with (e.g. no CuPy)
        raise CLIError(str(exc.code)) from None
    stem = out_dir / f"bench-{common.slug(ctx.device_name)}"
    paths = {ext: Path(f"{stem}.{ext}") for ext in ("csv", "json", "png", "log")}
    ctx.out = paths["csv"]
    paths["csv"].unlink(missing_ok=True)  # Context appends: start a fresh file
    paths["png"].unlink(missing_ok=True)  # never leave an old chart beside new rows

    print(f"hbkernels bench: {ctx.device_name} ({args.device}), {len(ops)} ops"
          f"{' (smoke sizes)' if args.smoke else ''}; benchmark output -> {paths['log']}",
          flush=True)
    console = sys.stderr

    def progress(step, done):
        bar.update(1 if done else 0, op=step)

    with open(paths["log"], "w") as log, Progress(len(ops) + 1, "bench", stream=console) as bar:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            print(f"device: {ctx.device_name} ({ctx.device}); rows -> {ctx.out}")
            failed = run_all.run_ops(ctx, ops, progress)

    rows = ctx.results()
    print()
    print(common.format_table(rows))
    for note in ctx.notes:
        print(f"note: {note}")
    write_json(paths["json"], ctx, rows, args, ops, failed)
    chart_note = write_chart(paths["png"], rows, ctx.device_name, args.smoke)
    if chart_note:
        print(f"note: {chart_note}")
    print()
    for ext in ("csv", "json", "png"):
        if paths[ext].exists():
            print(f"{ext:>4}: {paths[ext]}")
    if failed:
        print(f"\n{len(failed)} of {len(ops)} ops failed (tracebacks in {paths['log']}):")
        for line in failed:
            print(f"  FAILED {line}")
        return 1
    return 0


def versions():
    """``__version__`` of the libraries this run loaded (None: not used)."""
    found = {"python": platform.python_version()}
    for name in VERSIONS_OF:
        module = sys.modules.get(name)
        found[name] = getattr(module, "__version__", None) if module is not None else None
    return found


def write_json(path, ctx, rows, args, ops, failed):
    doc = {
        "device": {"name": ctx.device_name, "kind": ctx.device},
        "copy_gbps": ctx.copy_gbps,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "platform": platform.platform(),
        "args": {"device": args.device, "out": str(args.out), "ops": ops, "smoke": args.smoke,
                 "reps": args.reps, "warmup": args.warmup, "providers": args.providers,
                 "seed": args.seed},
        "failed": failed,
        "notes": list(ctx.notes),
        "rows": rows,
    }
    write_json_atomic(path, doc)


def write_chart(path, rows, device_name, smoke=False):
    """Horizontal bars of hbkernels' speedup vs its fastest peer per case, log x, line at 1x.
    Returns a note when there is no chart to draw."""
    bars = [r for r in rows if r["provider"] == "hbkernels" and r["speedup"]]
    if not bars:
        return "no hbkernels-vs-peer speedup was measured: no chart"
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return "matplotlib is not installed: no chart (pip install 'hbkernels[bench]')"

    labels = [f"{r['op']} {r['mode']} {r['dtype']}" for r in bars]
    if len(set(labels)) < len(labels):  # one case at several sizes: tell them apart
        labels = [f"{label} [{r['size']}]" for label, r in zip(labels, bars)]
    speedups = [r["speedup"] for r in bars]
    lo, hi = min(min(speedups), 1.0), max(max(speedups), 1.0)

    fig = Figure(figsize=(9, 1.2 + 0.4 * len(bars)))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    y = range(len(bars))
    ax.barh(y, [s - 1 for s in speedups], left=1, height=0.6,
            color=["tab:green" if s >= 1 else "tab:red" for s in speedups])
    for i, (s, r) in enumerate(zip(speedups, bars)):
        ax.text(max(s, 1) * 1.08, i, f"{s:.2f}x vs {r['vs']}", va="center", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xlim(lo / 1.6, hi * 3.5)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup of hbkernels (peer time / hbkernels time, log scale)")
    ax.set_title(f"hbkernels vs the fastest peer on {device_name}{' (smoke sizes)' if smoke else ''}",
                 fontsize=10)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return None
