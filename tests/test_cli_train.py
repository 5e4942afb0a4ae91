"""``hbkernels train``: one process and two ranks follow the same trajectory,
resume continues exactly, the Criteo sample learns, user errors are one line.

Single-process runs go through ``hbkernels.cli.main`` in this process (the
kernels are compiled once); the two-rank runs and the error-format checks
start ``python -m hbkernels`` (under ``mpiexec -n 2`` for the former).
"""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import TRAIN_SMALL
from mpirun import ROOT, _env, mpirun, needs_mpi

pytest.importorskip("torch")
pytest.importorskip("pyarrow")

from hbkernels.cli import main  # noqa: E402
from hbkernels.sharding.plan import Plan  # noqa: E402


def train(tmp_path, name, *args):
    metrics = tmp_path / f"{name}.json"
    assert main(["train", *TRAIN_SMALL, *map(str, args), "--metrics", str(metrics)]) == 0
    return json.loads(metrics.read_text())


def losses(metrics):
    return np.array([h["loss"] for h in metrics["train"]])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """20 steps in one process, no checkpoint: the trajectory the others must follow."""
    return train(tmp_path_factory.mktemp("straight"), "straight", "--steps", 20)


def test_one_process_metrics(straight):
    assert straight["world_size"] == 1 and straight["backend"] == "local"
    assert [h["step"] for h in straight["train"]] == list(range(1, 21))
    assert all(h["samples"] == 128 for h in straight["train"])
    assert np.isfinite(losses(straight)).all() and straight["samples_per_s"] > 0
    assert 0 < straight["first_step_seconds"] < straight["train_seconds"]
    # the 19 timed steps' phases: nearly all of their wall time (the thread governor's tick
    # is left out)
    phases = straight["step_phases_ms"]
    assert list(phases) == ["data", "inputs", "step", "wait"] and min(phases.values()) >= 0
    assert sum(phases.values()) / 1e3 == pytest.approx(128 / straight["samples_per_s"], rel=0.05)
    # the sparse step: the collection's calls (medians of the 19 timed steps), inside the
    # step phase, beside the planner's prediction by its built-in constants
    sparse = straight["sparse_step_ms"]
    assert 0 < sparse["forward"] and 0 < sparse["backward"] and sparse["steps"] == 19
    assert sparse["measured"] >= 0.5 * (sparse["forward"] + sparse["backward"])
    assert sparse["mean"] < phases["step"]
    predicted = Plan.from_json(straight["plan"]).predict()
    assert sparse["predicted"] == pytest.approx(1e3 * predicted.seconds)
    assert sparse["predicted_parts"] == pytest.approx(predicted.parts_ms(0))
    assert "built-in defaults, not measured" in sparse["predicted_by"]
    final = straight["final"]
    assert final["eval_samples"] == 512 and 0.0 <= final["eval_auc"] <= 1.0
    assert final["eval_logloss"] > 0 and final["train_loss"] == straight["train"][-1]["loss"]
    # the planted model is learnable: the training loss falls
    assert losses(straight)[-5:].mean() < losses(straight)[:5].mean()


def test_batches_made_ahead_train_the_same(tmp_path, straight):
    ahead = train(tmp_path, "ahead", "--steps", 20, "--batch-threads", 2)
    np.testing.assert_array_equal(losses(ahead), losses(straight))
    assert ahead["final"] == straight["final"]


def test_resume_continues_exactly(tmp_path, straight, capsys):
    ckpt = tmp_path / "ckpt"
    first = train(tmp_path, "first", "--steps", 10, "--checkpoint", ckpt)
    np.testing.assert_array_equal(losses(first), losses(straight)[:10])
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000010"]
    capsys.readouterr()
    resumed = train(tmp_path, "resumed", "--steps", 20, "--checkpoint", ckpt, "--resume")
    np.testing.assert_array_equal(losses(resumed), losses(straight))
    assert resumed["final"] == straight["final"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000020"]
    last = capsys.readouterr().out.strip().splitlines()[-1]  # this run's steps, not all 20
    assert last.startswith("10 steps (steps 11-20) x 128 samples on 1 rank(s)"), last


def test_the_time_left_leaves_the_first_step_out(monkeypatch):
    """The first step compiles: the estimate is '?' until a second step is done, then
    counts only the steps after the first."""
    import io

    from hbkernels.cli import progress

    clock = iter([0.0, 30.0, 30.0, 31.0, 31.0, 32.0, 32.0])  # start; the first step takes 30 s
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    bar = progress.Progress(10, "train", stream=out, warm=1)
    bar.update()
    assert bar.line(30.0).endswith("30.0s<?")
    bar.update()
    assert bar.line(31.0).endswith("31.0s<8.0s")  # 8 steps left at 1 s each, not 8 x 15.5 s
    bar.update()
    assert bar.line(32.0).endswith("32.0s<7.0s")


def snapshot(directory):
    """``{relative path: bytes}`` of every file under ``directory``."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_checkpoint_is_replaced_only_by_overwrite_and_only_once_the_new_one_is_written(
        tmp_path, straight, monkeypatch, capsys):
    ckpt = tmp_path / "ckpt"
    train(tmp_path, "first", "--steps", 10, "--checkpoint", ckpt)
    kept = snapshot(ckpt)
    # without --resume or --overwrite: refused before any step, the checkpoint untouched
    assert main(["train", *TRAIN_SMALL, "--steps", "5", "--checkpoint", str(ckpt),
                 "--metrics", str(tmp_path / "refused.json")]) == 1
    err = capsys.readouterr().err
    assert "holds a checkpoint (step-00000010)" in err and "--overwrite" in err
    assert snapshot(ckpt) == kept and not (tmp_path / "refused.json").exists()
    # --overwrite, the run failing before its first checkpoint: the old one is still whole
    from hbkernels.train import Trainer

    def disk_full(self):
        raise OSError(28, "No space left on device", str(ckpt))

    with monkeypatch.context() as m:
        m.setattr(Trainer, "save_checkpoint", disk_full)
        assert main(["train", *TRAIN_SMALL, "--steps", "10", "--checkpoint", str(ckpt),
                     "--overwrite", "--metrics", str(tmp_path / "failed.json")]) == 1
    assert snapshot(ckpt) == kept
    # --overwrite at the same step: written beside the old one, which goes once it is written
    replaced = train(tmp_path, "replaced", "--steps", 10, "--checkpoint", ckpt, "--overwrite")
    np.testing.assert_array_equal(losses(replaced), losses(straight)[:10])
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000010.1"]
    assert (ckpt / "latest").read_text() == "step-00000010.1"
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(
        f"checkpoint -> {ckpt / 'step-00000010.1'}")
    resumed = train(tmp_path, "resumed", "--steps", 20, "--checkpoint", ckpt, "--resume")
    np.testing.assert_array_equal(losses(resumed), losses(straight))


def test_resume_without_a_checkpoint_starts_fresh_and_says_so(tmp_path, straight, capsys):
    run = train(tmp_path, "fresh", "--steps", 10, "--checkpoint", tmp_path / "new", "--resume")
    np.testing.assert_array_equal(losses(run), losses(straight)[:10])
    assert f"--resume: no checkpoint in {tmp_path / 'new'} (no latest): starting fresh" in \
        capsys.readouterr().out


def test_periodic_checkpoints_keep_only_the_latest(tmp_path, straight):
    ckpt = tmp_path / "ckpt"
    run = train(tmp_path, "periodic", "--steps", 12, "--checkpoint", ckpt, "--checkpoint-every", 5,
                "--eval-every", 6)
    np.testing.assert_array_equal(losses(run), losses(straight)[:12])
    assert [e["step"] for e in run["eval"]] == [6, 12]
    assert (ckpt / "latest").read_text() == "step-00000012"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000012"]


@needs_mpi
def test_two_ranks_follow_one_process(tmp_path, straight):
    """Same seed, same global batches: 2 ranks (row-wise tables, summed gradients)
    reach the one-process losses, and resume a one-process checkpoint."""
    m2 = tmp_path / "two.json"
    rc, out, _ = mpirun(2, "-m hbkernels", "train", *TRAIN_SMALL, "--steps", 20, "--plan", "row_wise",
                        "--metrics", m2, timeout=240, cwd=tmp_path)
    assert rc == 0, out[-4000:]
    two = json.loads(m2.read_text())
    assert two["world_size"] == 2 and two["plan"]["placements"]["a"]["kind"] == "row_wise"
    np.testing.assert_allclose(losses(two), losses(straight), rtol=2e-5, atol=1e-6)
    for key in ("eval_logloss", "eval_auc"):
        assert two["final"][key] == pytest.approx(straight["final"][key], rel=1e-4)
    assert two["final"]["eval_samples"] == 512

    ckpt = tmp_path / "ckpt"
    train(tmp_path, "first", "--steps", 10, "--checkpoint", ckpt)
    m3 = tmp_path / "resumed.json"
    rc, out, _ = mpirun(2, "-m hbkernels", "train", *TRAIN_SMALL, "--steps", 20, "--checkpoint", ckpt,
                        "--resume", "--metrics", m3, timeout=240, cwd=tmp_path)
    assert rc == 0, out[-4000:]
    np.testing.assert_allclose(losses(json.loads(m3.read_text())), losses(straight),
                               rtol=2e-5, atol=1e-6)


def test_criteo_sample_logloss_falls(tmp_path):
    from hbkernels.data import convert_criteo

    data = tmp_path / "criteo.parquet"
    convert_criteo(ROOT / "tests" / "data" / "criteo_sample.txt", data)
    metrics = tmp_path / "criteo.json"
    # 200 rows, batches of 64: 4 steps per epoch; evaluate after each of 5 epochs
    assert main(["train", "--data", str(data), "--epochs", "5", "--batch-size", "64",
                 "--num-rows", "1000", "--eval-every", "4", "--metrics", str(metrics)]) == 0
    run = json.loads(metrics.read_text())
    evals = [e["logloss"] for e in run["eval"]]
    assert [e["step"] for e in run["eval"]] == [4, 8, 12, 16, 20]
    assert all(e["samples"] == 200 for e in run["eval"])
    assert all(b < a for a, b in zip(evals, evals[1:])), evals
    assert evals[-1] < 0.8 * evals[0]
    assert sum(h["samples"] for h in run["train"][:4]) == 200   # one epoch is every row once
    assert run["final"]["eval_split"] == "training data"   # no --eval-data: said so


def test_eval_split_is_named_and_the_curve_is_drawn(tmp_path, straight):
    assert straight["final"]["eval_split"] == "held-out synthetic samples"
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "curve.json"
    assert main(["train", *TRAIN_SMALL, "--steps", "6", "--eval-every", "2", "--metrics", str(metrics)]) == 0
    png = metrics.with_suffix(".png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_help_shows_defaults_and_no_markup():
    res = run_cli("train", "--help", cwd=ROOT)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    for default in ("(default: 300)", "(default: 1024)", "(default: auto)", "(default: 0.05)",
                    "(default: 64,32)"):
        assert default in text, default
    for markup in ("``", ":class:", ":func:", ":mod:"):
        assert markup not in text, markup
    assert "torchrun" in text


def run_cli(*args, cwd, **env):
    return subprocess.run([sys.executable, "-m", "hbkernels", *map(str, args)], cwd=cwd,
                          env=_env(**env), capture_output=True, text=True, timeout=180)


def cuda_gpu_present():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0 and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1"
    except Exception:  # noqa: BLE001
        return False


def test_a_plan_profile_ranks_the_placements_and_predicts_the_step(tmp_path, capsys):
    from hbkernels.sharding.profile import MEASURED, Spread, assumed_profile

    assumed = assumed_profile([16])
    profile = dataclasses.replace(  # a machine where a collection's step costs 1 ms more
        assumed, source=MEASURED, machine={"cpu": "the test's CPU", "world_size": 1},
        step_us=dict.fromkeys(assumed.step_us, Spread.exactly(1000.0)))
    profile.save(tmp_path / "profile.json")
    metrics = train(tmp_path, "profiled", "--steps", 3, "--plan-profile", tmp_path / "profile.json")
    plan = Plan.from_json(metrics["plan"])
    assert plan.profile == profile
    sparse = metrics["sparse_step_ms"]
    assert sparse["predicted"] == pytest.approx(1e3 * plan.predict().seconds)
    assert sparse["predicted_parts"]["host"] == pytest.approx(1.0)
    assert "profile measured on the test's CPU at 1 rank(s)" in sparse["predicted_by"]
    out = capsys.readouterr().out
    assert "predicted sparse step:" in out and f"{sparse['predicted']:.3f} predicted (host 1.000" in out
    assert plan.id_layout == "scattered"
    uniform = train(tmp_path, "uniform", "--steps", 2, "--alpha", 0, "--plan-profile", tmp_path / "profile.json")
    assert Plan.from_json(uniform["plan"]).id_layout == "uniform"  # synthetic ids of exponent 0


@pytest.fixture(scope="module")
def criteo_parquet(tmp_path_factory):
    from hbkernels.data import convert_criteo

    path = tmp_path_factory.mktemp("criteo") / "criteo.parquet"
    convert_criteo(ROOT / "tests" / "data" / "criteo_sample.txt", path)
    return path


@pytest.mark.parametrize("case", ["missing file", "bad column", "bad label", "unknown plan",
                                  "no gpu", "checkpoint held", "epochs on synthetic",
                                  "batch threads on Parquet", "bad profile"])
def test_user_errors_are_one_line(tmp_path, criteo_parquet, case):
    if case == "no gpu" and cuda_gpu_present():
        pytest.skip("a CUDA GPU is present")
    args, expected = {
        "missing file": (["--data", tmp_path / "nope.parquet"], "no such file"),
        "bad column": (["--data", criteo_parquet, "--sparse-columns", "C1,C99"], "no column 'C99'"),
        "bad label": (["--data", criteo_parquet, "--label", "click"], "no label column 'click'"),
        "unknown plan": (["--plan", "everywhere"], "unknown plan 'everywhere'"),
        "no gpu": (["--device", "cuda"], "--device cuda: no CUDA GPU"),
        "checkpoint held": (["--checkpoint", tmp_path / "ck"],
                            "ck holds a checkpoint (step-00000007): --resume continues it"),
        "epochs on synthetic": (["--epochs", "2"], "need Parquet --data"),
        "batch threads on Parquet": (["--data", criteo_parquet, "--batch-threads", "2"],
                                     "--batch-threads makes synthetic batches"),
        "bad profile": (["--plan-profile", tmp_path / "ck" / "latest"],
                        "--plan-profile: ")
    }[case]
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "latest").write_text("step-00000007")
    # no simulator either: under it, --device cuda runs the CUDA kernels there
    res = run_cli("train", *args, "--steps", 2, cwd=tmp_path, NUMBA_ENABLE_CUDASIM="0")
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hbkernels train: error: "), res.stderr
    assert expected in lines[0] and "Traceback" not in res.stderr


MISUSE = {
    "steps text": (["train", "--steps", "text"], "argument --steps: expected a number, got 'text'"),
    "bad device": (["train", "--device", "tpu"], "invalid choice: 'tpu'"),
    "bad bottom": (["train", "--bottom", "x"], "expected comma-separated integers"),
    "zero bottom": (["train", "--bottom", "0"], "--bottom and --top sizes must be >= 1"),
    "empty table": (["train", "--table", "c0:0:1"], "ROWS, HOTNESS >= 1"),
    "negative lr": (["train", "--sparse-lr", "-1"], "must be a finite number > 0, got -1"),
    "nan lr": (["train", "--dense-lr", "nan"], "must be a finite number > 0, got nan"),
    "zero batch": (["train", "--batch-size", "0"], "must be a finite number >= 1, got 0"),
    "zero threads": (["train", "--threads", "0"], "expected 'auto' or a positive integer, got '0'"),
    "warmup dims": (["warmup", "--dims", "16,x"], "--dims must be a comma-separated list"),
    "warmup dtype": (["warmup", "--dtypes", "int8"], "'int8' is not a float dtype"),
    "eval bits": (["train", "--eval-bits", "8,3"], "--eval-bits takes 8, 4, 2, got [3]"),
    "eval bits dynamic": (["train", "--eval-bits", "8", "--dynamic"], "dynamic tables"),
    "quantize bits": (["quantize", "ck", "--bits", "3", "--out", "q"], "invalid choice: 3"),
    "quantize nothing": (["quantize", "nowhere", "--bits", "8", "--out", "q"],
                         "no checkpoint directory nowhere"),
    "corrupt data": (["train", "--data", "garbage.parquet"], "garbage.parquet"),
    "unwritable metrics": (["train", "--metrics", "no/such/dir/m.json"], "cannot write"),
    "checkpoint under a file": (["train", "--checkpoint", "garbage.parquet/ck"], "is a file"),
    "checkpoint not makeable": (["train", "--checkpoint", "/proc/nope"],
                                "cannot write in directory /proc/nope"),
    "resume and overwrite": (["train", "--checkpoint", "ck", "--resume", "--overwrite"],
                             "give one of them"),
    "overwrite alone": (["train", "--overwrite"], "--overwrite needs --checkpoint DIR"),
    "unknown format": (["data", "convert", "nosuch", "a", "b"], "invalid choice: 'nosuch'"),
    "negative rows": (["data", "synthetic", "out", "--rows", "-5"], "got -5"),
    "no command": ([], "the following arguments are required: command"),
}


@pytest.mark.parametrize("case", MISUSE)
def test_misuse_is_one_line_and_exit_1(tmp_path, case):
    """Every documented misuse: one line naming the problem, exit status 1, found
    before any work is done (no step runs, no file is written)."""
    (tmp_path / "garbage.parquet").write_bytes(b"not parquet at all")
    argv, expected = MISUSE[case]
    res = run_cli(*argv, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1, res.stdout + res.stderr
    assert len(lines) == 1 and ": error: " in lines[0], res.stderr
    assert expected in lines[0] and "Traceback" not in res.stderr
    assert "step" not in res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.parquet"]


def test_resume_with_another_configuration_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    train(tmp_path, "first", "--steps", 2, "--checkpoint", ckpt)
    res = run_cli("train", *TRAIN_SMALL[:-2], "--seed", "4", "--steps", 4, "--checkpoint", ckpt,
                  "--resume", cwd=tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "another configuration" in res.stderr and "seed: 3 -> 4" in res.stderr


def clicks_parquet(path, label, n=64, **columns):
    """A small Parquet file: ``label`` (None: none) as float column ``y``, a float column
    ``x`` and an id column ``id``; ``columns`` adds columns, or drops one given None.
    Returns ``path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = {"y": None if label is None else pa.array(label, pa.float32()),
             "x": np.arange(n, dtype=np.float32), "id": np.arange(n) % 7, **columns}
    pq.write_table(pa.table({k: v for k, v in table.items() if v is not None}), path)
    return path


PARQUET_TINY = ["--label", "y", "--batch-size", "16", "--num-rows", "10", "--threads", "1",
                "--dim", "4", "--bottom", "4", "--top", "4"]


def train_error(tmp_path, capsys, monkeypatch, *args):
    """``hbkernels train ARGS`` in this process (no progress bar): exit status 1 and one
    error line (returned); no metrics are written."""
    monkeypatch.setenv("HBK_PROGRESS", "0")
    metrics = tmp_path / "m.json"
    assert main(["train", *PARQUET_TINY, *map(str, args), "--metrics", str(metrics)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hbkernels train: error: "), lines
    assert not metrics.exists()
    return lines[0]


@pytest.mark.parametrize("case", ["ratings", "nan", "eval data"])
def test_labels_outside_0_1_are_refused(tmp_path, capsys, monkeypatch, case):
    """Labels are clicks (0 or 1) or probabilities (soft labels): a value outside [0, 1]
    or NaN, in the training or the evaluation data, is one line naming the column, the
    file and the values; soft labels train."""
    good = clicks_parquet(tmp_path / "good.parquet", [0.0, 0.25, 1.0, 0.5] * 16)
    args, path, shown = {
        "ratings": (["--steps", 2],
                    clicks_parquet(tmp_path / "r.parquet", [1, 2, 3, 4, 5] * 12 + [1] * 4),
                    "holds 2, 3, 4, 5"),
        "nan": (["--steps", 2], clicks_parquet(tmp_path / "n.parquet", [0, 1, np.nan, 1] * 16),
                "holds nan"),
        "eval data": (["--steps", 3, "--data", good],
                      clicks_parquet(tmp_path / "e.parquet", [0.0, 1.0, 2.0, -1.0] * 16),
                      "holds -1, 2"),
    }[case]
    flag = "--eval-data" if case == "eval data" else "--data"
    line = train_error(tmp_path, capsys, monkeypatch, flag, path, *args)
    assert line.endswith(f"labels must be in [0, 1] (0 or 1, or a probability in between), "
                         f"but column 'y' of {path} {shown}"), line


def test_no_rows_or_too_few_features_are_one_line(tmp_path, capsys, monkeypatch):
    """An empty training or evaluation file (--epochs too), and data with one categorical
    column and no dense one: the command's one error line, not a traceback."""
    empty = clicks_parquet(tmp_path / "empty.parquet", [], n=0)
    good = clicks_parquet(tmp_path / "good.parquet", [0.0, 1.0] * 32)

    def error(*args):
        return train_error(tmp_path, capsys, monkeypatch, *args)

    assert error("--data", empty, "--epochs", 1).endswith(f"no rows to train on in {empty}")
    assert error("--data", good, "--eval-data", empty, "--steps", 2).endswith(
        f"no rows to evaluate on in {empty}")
    sparse_only = clicks_parquet(tmp_path / "sparse.parquet", None, x=None,
                                 a=np.arange(64) % 2)
    assert error("--data", sparse_only, "--label", "a", "--steps", 2).endswith(
        f"the DLRM needs two categorical features, or one and dense features, to interact; "
        f"{sparse_only} (label 'a') has categorical ['id'] and no dense features")
    assert error("--data", "synthetic", "--table", "t:50:1", "--dense-features", 0,
                 "--steps", 2).endswith(
        "the synthetic data (--table, --dense-features) has categorical ['t'] and no dense "
        "features")


@needs_mpi
def test_an_error_on_one_rank_ends_every_rank(tmp_path):
    """A null label in rank 1's rows only: rank 1 fails mid-epoch, says so in one
    line, and the job ends (MPI_Abort) instead of rank 0 waiting in a collective."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 64
    label = [float(i % 2) for i in range(n)]
    label[50] = None                                   # rows 32..63 are rank 1's
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"label": pa.array(label, pa.float32()),
                             "x": np.arange(n, dtype=np.float32),
                             "id": np.arange(n) % 7}), path)
    rc, out, seconds = mpirun(2, "-m hbkernels", "train", "--data", path, "--batch-size", 16,
                              "--num-rows", 10, "--steps", 8, "--metrics", tmp_path / "m.json",
                              timeout=120, cwd=tmp_path)
    assert rc != 0, out[-3000:]
    assert "hbkernels train: error on rank 1: column 'label' has a null at row 50" in out, out[-3000:]
    assert "Traceback" not in out and not (tmp_path / "m.json").exists()


def _rank_pid(rank, marker):
    """The pid of the rank-``rank`` process whose command line holds ``marker``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmdline and b"hbkernels" in cmdline and \
                f"PMI_RANK={rank}".encode() in environ:
            return int(entry)
    return None


@needs_mpi
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank's process in /proc")
def test_a_frozen_peer_is_one_line_on_the_other_rank(tmp_path):
    """Rank 1 stops (SIGSTOP) mid-training: rank 0's collective gives up after
    HBK_COMM_TIMEOUT and the job ends with one line naming the CommError, no traceback."""
    import signal
    import threading
    import time

    ckpt = tmp_path / "ck"
    result = {}

    def job():
        result["run"] = mpirun(2, "-m hbkernels", "train", *TRAIN_SMALL, "--steps", 10**6,
                               "--checkpoint", ckpt, "--checkpoint-every", 10,
                               "--metrics", tmp_path / "m.json", timeout=300, cwd=tmp_path,
                               env=_env(HBK_COMM_TIMEOUT="10"))

    runner = threading.Thread(target=job)
    runner.start()
    deadline = time.monotonic() + 200
    while not (ckpt / "latest").exists():  # both ranks are past start-up and training
        assert runner.is_alive() and time.monotonic() < deadline, result.get("run")
        time.sleep(0.2)
    pid = _rank_pid(1, str(ckpt))
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        runner.join(timeout=280)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    rc, out, _ = result["run"]
    assert rc != 0
    errors = [line for line in out.splitlines() if "error" in line]
    assert errors and errors[0].startswith("hbkernels train: error on rank 0: CommError"), out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_warmup_runs_every_op(tmp_path):
    res = subprocess.run([sys.executable, "-m", "hbkernels", "warmup", "--dims", "16", "--no-train"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=_env())
    assert res.returncode == 0, res.stderr
    assert "ops D=16 float32" in res.stdout and res.stdout.rstrip().splitlines()[-1].startswith("done")


TINY = ["--steps", "2", "--batch-size", "16", "--eval-samples", "16", "--threads", "1",
        "--table", "a:50:2", "--table", "b:30:1", "--dim", "4", "--bottom", "4", "--top", "4",
        "--dense-features", "2"]


@pytest.mark.cuda
@pytest.mark.timeout(300)  # three runs in the simulator, on cores shared with other workers
def test_train_on_the_cuda_path_gives_the_cpu_results(tmp_path):
    """``hbkernels train --device cuda`` with the CUDA kernels in Numba's simulator (the
    tables on the simulator's CUDA arrays, torch on the CPU): the CPU's losses and eval;
    with ``--cuda-graph`` (the step in memory sized once, its inputs padded to fixed
    sizes, uncaptured on the simulator), the same losses bit for bit."""
    metrics = {}
    runs = {"cpu": ["--device", "cpu"], "cuda": ["--device", "cuda"],
            "graph": ["--device", "cuda", "--cuda-graph"]}
    for name, how in runs.items():
        out = tmp_path / f"{name}.json"
        res = subprocess.run([sys.executable, "-m", "hbkernels", "train", *how, *TINY,
                              "--steps", "3", "--table", "v:40:2:var", "--metrics", str(out)],
                             capture_output=True, text=True, timeout=600, cwd=tmp_path,
                             env=_env(NUMBA_ENABLE_CUDASIM="1"))
        assert res.returncode == 0, res.stderr[-3000:]
        metrics[name] = json.loads(out.read_text())
    assert metrics["cuda"]["device"] == "cuda"
    np.testing.assert_allclose(losses(metrics["cuda"]), losses(metrics["cpu"]), rtol=1e-5)
    np.testing.assert_array_equal(losses(metrics["graph"]), losses(metrics["cuda"]))
    cpu, cuda = metrics["cpu"]["final"], metrics["cuda"]["final"]
    assert cuda["eval_auc"] == pytest.approx(cpu["eval_auc"], abs=1e-9)
    assert cuda["eval_logloss"] == pytest.approx(cpu["eval_logloss"], rel=1e-5)
    assert metrics["graph"]["final"] == cuda


def test_lagged_losses_come_back_one_step_late():
    """``--cuda-graph``'s loss reads: each put's value (its dtype's, as ``float()`` reads
    it) comes back, with its info, at the next take; a take with nothing put is None."""
    torch = pytest.importorskip("torch")
    from hbkernels.train import LaggedLoss

    lagged = LaggedLoss(torch, "cpu")
    assert lagged.take() is None
    for i, value in enumerate((0.1, 2.5, -3.75)):
        loss = torch.tensor(value, dtype=torch.float32)
        lagged.put(loss, i)
        loss.add_(100.0)  # the step's loss tensor changed after the put: the copy holds
        assert lagged.take() == (float(np.float32(value)), i)
        assert lagged.take() is None
    lagged.put(torch.tensor(1.5, dtype=torch.float64), "x")  # another dtype: its own buffer
    assert lagged.take() == (1.5, "x")


@pytest.mark.parametrize("staged", [False, True])
def test_staged_inputs_are_the_batches_arrays(rng, staged):
    """``--cuda-graph``'s fixed inputs: views of one buffer, refilled with one copy (through
    two host buffers in turn when ``staged``, as on a GPU), each cut to its array's length."""
    torch = pytest.importorskip("torch")
    from hbkernels.train import StagedInputs

    parts = [(np.float32, (4, 3)), (np.int64, (9,)), (np.float32, (4,)), (np.float32, (4, 0)),
             (np.int32, (5,))]
    inputs = StagedInputs(torch, "cpu", parts, staged=staged)
    base = inputs.buffer.data_ptr()
    assert all((t.data_ptr() - base) % StagedInputs.ALIGN == 0 for t in inputs.tensors)
    assert [tuple(t.shape) for t in inputs.tensors] == [s for _, s in parts]
    for n in (4, 2, 3, 4):
        arrays = [rng.standard_normal((n, 3)).astype(np.float32), rng.integers(0, 99, 2 * n + 1),
                  rng.random(n).astype(np.float32), np.zeros((n, 0), np.float32),
                  rng.integers(0, 9, n + 1).astype(np.int32)]
        cut = inputs.fill(arrays)
        for t, whole, a in zip(cut, inputs.tensors, arrays):
            assert t.data_ptr() == whole.data_ptr() and t.dtype == torch.from_numpy(a).dtype
            np.testing.assert_array_equal(t.numpy(), a)


@pytest.mark.parametrize("how, message", [
    (["--device", "cpu"], "--cuda-graph captures the step of one rank on a GPU"),
    (["--device", "cuda", "--dynamic"], "--cuda-graph captures steps of static tables")])
def test_cuda_graph_refuses_what_it_cannot_capture(tmp_path, how, message):
    res = subprocess.run([sys.executable, "-m", "hbkernels", "train", "--cuda-graph", *how, *TINY,
                          "--metrics", str(tmp_path / "m.json")], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env=_env(NUMBA_ENABLE_CUDASIM="1"))
    assert res.returncode != 0 and message in res.stderr + res.stdout, res.stderr[-2000:]


@pytest.mark.cuda
def test_warmup_runs_every_op_on_the_cuda_path(tmp_path):
    """``--device cuda``: every op on CUDA arrays (the simulator here; on a GPU each
    kernel is compiled into the kernel cache)."""
    res = subprocess.run([sys.executable, "-m", "hbkernels", "warmup", "--device", "cuda",
                          "--dims", "3", "--no-train"], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path,
                         env=_env(NUMBA_ENABLE_CUDASIM="1", HBK_CUDA_CACHE_DIR=str(tmp_path)))
    assert res.returncode == 0, res.stderr
    assert f"cuda kernel cache {tmp_path}" in res.stdout and "ops D=3 float32" in res.stdout


DYNAMIC = ["--dynamic", "--table", "a:2000:2", "--table", "b:5000:1:var", "--batch-size", "256",
           "--eval-samples", "256", "--dim", "7", "--bottom", "16", "--top", "16", "--threads", "1",
           "--capacity-fraction", "0.2", "--admit-count", "2", "--evict", "lfu"]


def test_dynamic_tables_train_evict_and_resume_exactly(tmp_path):
    """--dynamic: raw 64-bit ids into hash tables that admit at the second sight and
    evict; the metrics count both; a resumed run follows the straight one exactly."""
    def run(name, *args):
        metrics = tmp_path / f"{name}.json"
        assert main(["train", *DYNAMIC, *map(str, args), "--metrics", str(metrics)]) == 0
        return json.loads(metrics.read_text())

    straight = run("straight", "--steps", 16)
    counts = straight["dynamic"]
    assert set(counts) == {"a", "b"} and counts["a"]["size"] <= 400
    assert all(c["admitted"] > 0 for c in counts.values()) and counts["a"]["evicted"] > 0
    assert counts["a"]["admitted"] - counts["a"]["evicted"] == counts["a"]["size"]
    assert np.isfinite(losses(straight)).all()
    ckpt = tmp_path / "ckpt"
    run("first", "--steps", 8, "--checkpoint", ckpt)
    resumed = run("resumed", "--steps", 16, "--checkpoint", ckpt, "--resume")
    np.testing.assert_array_equal(losses(resumed), losses(straight))
    assert resumed["final"] == straight["final"]
    assert {t: c["size"] for t, c in resumed["dynamic"].items()} == {
        t: c["size"] for t, c in counts.items()}
