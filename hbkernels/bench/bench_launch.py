"""Host cost per call: each op at a tiny size (B=256 one-id bags, D=16, E=1000), where the
device work is a few microseconds and the call's time is what the host spends on it
(validation, launches, allocations, waits), against torch's ``F.embedding_bag``; on a GPU,
also each kind of event the null device charges a cost for (an allocation, CuPy's library
calls), alone.

Each provider runs ``calls`` times back to back, then waits once for the device; the
row's median is the wall time per call over such loops. On a GPU every case of
:mod:`.host_cases` runs (every public op, each optimizer's fused step, a hash table's
lookup, the main job's sparse step, a collection's forward and step over seven widths), and a note
gives hbkernels' kernel launches and host synchronisations per call (the backend's own
counters).

``--device null`` runs the same cases on the null device (:mod:`.null_device`): the CUDA
path's host code with **no kernel run and no GPU**, counting per call the kernel launches,
library calls, host synchronisations and device allocations, and reporting the host's
Python time plus those events at stated costs (assumed until a GPU measures them),
against the host-cost targets. Its rows go to a CSV of their own (``--out``). On a GPU,
``--null CSV`` prints each case's measured host time beside that profile's figure.

    python3 -m hbkernels.bench.bench_launch --device null --out null.csv
    python3 -m hbkernels.bench.bench_launch --device cuda --null null.csv
"""
import argparse
import contextlib
import csv
import datetime
import sys
import time


import hbkernels as hbk
from hbkernels._machine import cpu_name
from .common import HBK, Timing, append_rows, cli_main

OP = "host_per_call"
B, D, E = 256, 16, 1000
NULL_COLUMNS = ("op", "mode", "us", "python_us", "python_us_min", "python_us_max", "launches",
                "library", "syncs", "allocations", "events_us", "costs", "host", "date")
#: ``(op, mode) -> (most µs, events not counted)`` on the null device: the host-cost targets
TARGETS = {("embedding_bag", "raise"): (15, ()), ("lookup", "raise"): (15, ()),
           ("RowWiseAdagrad.fused_step", "raise"): (45, ()),
           ("embedding_bag_backward", "raise"): (45, ("syncs",)),
           ("main job sparse step", "8 tables, batch 1024"): (250, ())}


def sizes(ctx):
    """``(B, D, E)``: :data:`B`, :data:`D`, :data:`E`, or tiny ones in the CUDA simulator."""
    return (4, 4, 64) if ctx.simulated else (B, D, E)


def counters(ctx):
    """``() -> (launches, syncs)`` so far, on a GPU; None on the CPU."""
    if not ctx.is_cuda:
        return None
    from hbkernels.cuda import _device, _launcher

    return lambda: (_launcher.LAUNCHES[0], _device.HOST_SYNCS[0])


def per_call(ctx, call, calls, loops):
    """``(Timing of ms per call, launches per call, syncs per call)``."""
    count = counters(ctx)
    for _ in range(3):
        call()
    ctx.sync()
    before = count() if count else None
    call()
    ctx.sync()
    counted = (None, None) if count is None else tuple(a - b for a, b in zip(count(), before))
    times = []
    for _ in range(loops):
        ctx.sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        ctx.sync()
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return Timing.of(times), counted


def cases(ctx):
    """``(op, provider, call)`` of this run: on a GPU every host case, elsewhere the
    forward, the fused step and the backward; torch's forward where it runs."""
    xp, torch = ctx.xp, ctx.torch
    b, d, e = sizes(ctx)
    if ctx.on_gpu:
        from . import host_cases

        out = [(f"{c.op} {c.mode}", HBK, c.call)
               for c in host_cases.op_cases(xp, lambda answers: contextlib.nullcontext(), b, d, e)]
        out += [(f"{c.op} {c.mode}", HBK, c.call) for c in host_cases.collection_cases(xp)]
        out += [(f"event {name}", ctx.xp_name, call) for name, call in event_cases(xp, b, d, e)]
    else:
        table = ctx.random_table(e, d, "float32")
        ids = ctx.zipf_ids(b, e, 1.05)
        grad = xp.ones((b, d), dtype=xp.float32)
        offsets = xp.arange(b + 1, dtype=xp.int64)
        opt = hbk.optim.RowWiseAdagrad(lr=0.01)
        state = opt.init_state(table)
        out = [
            ("embedding_bag", HBK, lambda: hbk.embedding_bag(table, ids, offsets)),
            ("embedding_bag", HBK + "-unchecked",
             lambda: hbk.embedding_bag(table, ids, offsets, bounds="unchecked")),
            ("lookup", HBK, lambda: hbk.lookup(table, ids)),
            ("fused_step", HBK, lambda: opt.fused_step(table, state, grad, ids, offsets)),
            ("embedding_bag_backward", HBK,
             lambda: hbk.embedding_bag_backward(grad, ids, offsets, num_rows=e)),
        ]
    if torch is not None:
        table, ids = ctx.random_table(e, d, "float32"), ctx.zipf_ids(b, e, 1.05)
        t = ctx.as_torch({"w": table, "ids": ids, "offsets": xp.arange(b, dtype=xp.int64)})
        bag = torch.nn.functional.embedding_bag
        out.append(("embedding_bag", "torch",
                    lambda: bag(t["ids"], t["w"], t["offsets"], mode="sum")))
    return out


def event_cases(xp, b, d, e):
    """``(name, call)`` of each kind of event the null device charges a cost for, alone on
    CuPy at the cases' sizes: an allocation, and the library calls the ops make (a sort, a
    join, a conversion, a scan, a copy to the device), each with its result's allocation.
    What each costs the host on a GPU is what the null device's assumed costs stand for (a
    launch's: ``check_ragged``, one launch and nothing else, less its Python time on the
    null device)."""
    import numpy as np

    ids = xp.asarray(np.random.default_rng(0).integers(0, e, b))
    pieces = [ids[k::8] for k in range(8)]
    small = np.arange(2 * b, dtype=np.int64)
    return [
        ("allocation (empty)", lambda: xp.empty((b, d), xp.float32)),
        ("library (argsort)", lambda: xp.argsort(ids)),
        ("library (concatenate of 8)", lambda: xp.concatenate(pieces)),
        ("library (astype)", lambda: ids.astype(xp.int32)),
        ("library (cumsum)", lambda: xp.cumsum(ids)),
        ("library (copy to the device)", lambda: xp.asarray(small)),
    ]


def run(ctx):
    calls, loops = (1, 1) if ctx.simulated else (5, 2) if ctx.smoke else (200, 7)
    b, d, e = sizes(ctx)
    for op, provider, call in cases(ctx):
        timing, (launches, syncs) = per_call(ctx, call, calls, loops)
        if launches is not None:
            ctx.note(f"{provider} {op}: {launches} kernel launches, {syncs} host syncs per call")
        ctx.record(OP, provider, op, f"B={b} L=1 D={d} E={e}", "float32", timing, 0,
                   reference=("torch",))


# -- the null device --------------------------------------------------------------------------
def profile_null(calls=100, loops=5, out=None):
    """Every host case on the null device (installed here): a row each, printed and,
    with ``out``, appended to that CSV. Returns the rows."""
    from . import host_cases, null_device

    null_device.install()
    cp = sys.modules["cupy"]
    costs = ", ".join(f"{k} {v:g} µs" for k, v in null_device.COSTS.items())
    print(f"null device: hbkernels' CUDA path with no GPU: NO KERNEL RAN. Host µs per call = "
          f"the host's Python time + each event at its cost ({costs}; "
          f"{null_device.COSTS_SOURCE})")
    print(f"{'op':<30} {'mode':<22} {'µs':>8} {'python µs [min, max]':>26} "
          f"{'launch':>6} {'lib':>4} {'sync':>4} {'alloc':>5}")
    todo = host_cases.op_cases(cp, null_device.answers) + host_cases.collection_cases(cp)
    rows = []
    for case in todo:
        with null_device.answers(case.answers):
            r = null_device.per_call(case.call, calls, loops, sync=hbk.synchronize)
        row = {"op": case.op, "mode": case.mode, "us": round(r["us"], 2),
               "python_us": round(r["median_python_us"], 2),
               "python_us_min": round(min(r["python_us"]), 2),
               "python_us_max": round(max(r["python_us"]), 2),
               **{k: r[k] for k in null_device.EVENTS}, "events_us": round(r["events_us"], 2),
               "costs": f"{costs} ({null_device.COSTS_SOURCE})", "host": cpu_name(),
               "date": datetime.date.today().isoformat()}
        rows.append(row)
        print(f"{row['op']:<30} {row['mode']:<22} {row['us']:8.1f} {row['python_us']:10.1f} "
              f"[{row['python_us_min']:6.1f}, {row['python_us_max']:6.1f}] {row['launches']:6d} "
              f"{row['library']:4d} {row['syncs']:4d} {row['allocations']:5d}")
    for line in verdicts(rows):
        print(line)
    if out:
        append_rows(out, rows, NULL_COLUMNS)
        print(f"rows -> {out}")
    return rows


def verdicts(rows):
    """A line per host-cost target: the null device's µs per call against it."""
    from . import null_device

    out = []
    for row in rows:
        target = TARGETS.get((row["op"], row["mode"]))
        if target is None:
            continue
        most, left_out = target
        us = row["us"] - sum(row[k] * null_device.COSTS[k] for k in left_out)
        beside = f" (+ {', '.join(left_out)})" if left_out else ""
        out.append(f"target {row['op']} {row['mode']}: <= {most} µs{beside}: {us:.1f} µs "
                   f"({'met' if us <= most else 'missed'})")
    return out


def beside_null(ctx, path):
    """A line per case of this GPU run: its host µs per call beside the null device's
    figure for it in the CSV ``path`` (what the profile predicted)."""
    with open(path, newline="") as f:
        null = {f"{r['op']} {r['mode']}": float(r["us"]) for r in csv.DictReader(f)}
    lines = []
    for row in ctx.rows:
        if row["op"] == OP and row["provider"] == HBK and row["mode"] in null:
            measured, predicted = 1e3 * float(row["median_ms"]), null[row["mode"]]
            lines.append(f"host {row['mode']}: {measured:.1f} µs measured, {predicted:.1f} µs "
                         f"on the null device ({measured / predicted:.2f}x)")
    return lines


def main(argv=None):
    args = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--device")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    p.add_argument("--null")
    known, rest = p.parse_known_args(args)
    if known.device == "null":
        calls, loops = (5, 2) if known.smoke else (200, 7)
        return profile_null(calls, loops, known.out)
    if known.null is None:
        return cli_main(run, argv, __doc__)
    at = args.index("--null") if "--null" in args else None
    others = args[:at] + args[at + 2:] if at is not None else \
        [a for a in args if not a.startswith("--null=")]
    ctx = cli_main(run, others, __doc__)
    for line in beside_null(ctx, known.null):
        print(line)
    return ctx


if __name__ == "__main__":
    main()
