"""The planner's predicted sparse step against the measured one, per placement and world size.

For each world size N of ``--ranks`` (``mpiexec -n N`` beyond 1): ``hbkernels plan
--calibrate`` measures a profile of this machine at N ranks (by default on the tables and
batch of ``hbkernels train``), then ``hbkernels train``
(its default tables and batch unless ``--train-args`` says otherwise) runs ``--steps``
steps under each placement of ``--plans`` with ``--plan-profile`` that profile. Each run's
``sparse_step_ms`` gives the measured step (the median over the timed steps of rank 0's
collection ``forward`` and ``backward``) beside the prediction (the busiest rank's, and
rank 0's parts). Rank 0 of every run writes; this process appends one row per run to
``--out`` (CSV) and prints the table in Markdown, with measured / predicted; ``--profiles
DIR`` keeps the profiles.

    python3 -m hbkernels.bench.prediction --ranks 1,2 --steps 150 --out prediction.csv
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..types import PLACEMENTS
from .common import append_rows

COLUMNS = ("ranks", "plan", "placements", "steps", "measured_ms", "forward_ms", "backward_ms",
           "predicted_ms", "host_ms", "lookup_ms", "update_ms", "exchange_ms", "ratio",
           "samples_per_s", "profile")
PLANS = ("auto",) + PLACEMENTS


def train_tables(dim=16):
    """``hbkernels train``'s default tables as ``NAME:ROWS:DIM``."""
    from ..cli.train import DEFAULT_TABLES
    from ..data.__main__ import parse_table

    return [f"{t.name}:{t.num_rows}:{dim}" for t in map(parse_table, DEFAULT_TABLES)]


def launcher(world):
    """The command prefix that starts ``world`` ranks of ``python -m hbkernels``."""
    if world == 1:
        return [sys.executable, "-m", "hbkernels"]
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    return [mpiexec, "-n", str(world), sys.executable, "-m", "hbkernels"]


def run(command, timeout):
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def measure(world, plans, steps, calibrate_args, train_args, workdir, timeout, profiles):
    """One row (:data:`COLUMNS`) per plan at ``world`` ranks; the profile goes in
    ``profiles`` (a directory)."""
    profile = os.path.join(profiles, f"profile-{world}-ranks.json")
    run(launcher(world) + ["plan", "--calibrate", "--out", profile, *calibrate_args], timeout)
    rows = []
    for plan in plans:
        metrics = os.path.join(workdir, f"train-{world}-{plan}.json")
        run(launcher(world) + ["train", "--plan", plan, "--plan-profile", profile, "--steps", str(steps),
                               "--metrics", metrics, *train_args], timeout)
        with open(metrics, encoding="utf-8") as f:
            m = json.load(f)
        ms = m["sparse_step_ms"]
        kinds = sorted({p["kind"] for p in m["plan"]["placements"].values()})
        parts = ms["predicted_parts"]
        rows.append({"ranks": world, "plan": plan, "placements": "+".join(kinds), "steps": ms["steps"],
                     "measured_ms": ms["measured"], "forward_ms": ms["forward"],
                     "backward_ms": ms["backward"], "predicted_ms": ms["predicted"],
                     "host_ms": parts["host"], "lookup_ms": parts["lookup"],
                     "update_ms": parts["update"], "exchange_ms": parts["exchange"],
                     "ratio": ms["measured"] / ms["predicted"], "samples_per_s": m["samples_per_s"],
                     "profile": ms["predicted_by"]})
    return rows


def markdown(rows):
    head = ("| ranks | plan | measured | predicted | host | lookups | updates | exchange | "
            "measured / predicted |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [f"| {r['ranks']} | {r['plan']} | {r['measured_ms']:.3f} | {r['predicted_ms']:.3f} | "
             f"{r['host_ms']:.3f} | {r['lookup_ms']:.3f} | {r['update_ms']:.3f} | "
             f"{r['exchange_ms']:.3f} | {r['ratio']:.2f} |" for r in rows]
    return "\n".join([head, *lines])


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m hbkernels.bench.prediction",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,2", help="world sizes, comma-separated")
    p.add_argument("--plans", default=",".join(PLANS), help="placements, comma-separated")
    p.add_argument("--steps", type=int, default=150, help="training steps per run")
    p.add_argument("--calibrate-args", default=f"--widths 16,4,8,64 --layouts scattered --batch-size 1024 "
                                                f"--tables {' '.join(train_tables())}",
                   help="more arguments of hbkernels plan --calibrate (default: on hbkernels train's "
                        "default tables and batch)")
    p.add_argument("--train-args", default="", help="more arguments of hbkernels train")
    p.add_argument("--out", default="prediction.csv", help="CSV the rows are appended to")
    p.add_argument("--profiles", default=None, metavar="DIR",
                   help="where the profiles are kept (profile-N-ranks.json; default: not kept)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    a = p.parse_args(argv)
    plans = a.plans.split(",")
    unknown = [x for x in plans if x not in PLANS]
    if unknown:
        p.error(f"--plans takes some of {', '.join(PLANS)}, got {unknown}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="hbkernels-prediction-") as workdir:
        for world in (int(x) for x in a.ranks.split(",")):
            if a.profiles:
                os.makedirs(a.profiles, exist_ok=True)
            rows += measure(world, plans, a.steps, a.calibrate_args.split(), a.train_args.split(),
                            workdir, a.timeout, a.profiles or workdir)
    append_rows(a.out, rows, COLUMNS)
    print(markdown(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
