"""hbk.dist under torchrun and over existing process groups: the scripts in
tests/mpi/ under ``torchrun --standalone --nproc-per-node N`` (``python -m
torch.distributed.run``) and ``mpiexec -n N``, each bounded by a wall-clock
timeout (a hang is a failure, and the job is terminated), and launches whose
ranks cannot be connected, which must fail with a clear error, never run as N
one-rank jobs.

The collectives are checked against NumPy references by the same scripts
that check the MPI backend (tests/mpi/collectives.py, tests/mpi/errors.py),
run here with ``HBK_EXPECT_BACKEND=torch``. ``hbkernels train`` under
torchrun must follow the same trajectory as under mpiexec.
"""
import json
import socket
import subprocess
import sys

import numpy as np
import pytest

from mpirun import (
    HAVE_MPI4PY, ROOT, _env, _gpu_count, assert_ok, mpirun, needs_mpi, torchrun,
)

pytest.importorskip("torch")
pytest.importorskip("torch.distributed")


# -- (a) every collective under torchrun, against NumPy ------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_under_torchrun(n):
    """Every op, dtype (float32 and int64 among them), reduce op, uneven and zero
    counts, a rank that sends nothing, empty arrays, wire dtypes, Numba-family
    arrays: tests/mpi/collectives.py, with ``init()`` picking the torch backend."""
    rc, out, _ = torchrun(n, "collectives.py", env=_env(HBK_EXPECT_BACKEND="torch"), timeout=240)
    assert_ok(rc, out, range(n))


def test_bad_input_and_mismatches_raise_everywhere_under_torchrun():
    rc, out, _ = torchrun(2, "errors.py", timeout=240)
    assert_ok(rc, out, range(2))


# -- (b) existing groups ----------------------------------------------------------------------
def test_joins_torch_process_groups():
    """``init(group=...)`` with ``group.WORLD`` and a ``new_group`` of ranks {2, 0};
    a non-member is refused; a second ``init()`` joins the default group."""
    rc, out, _ = torchrun(3, "torch_group.py", timeout=240)
    assert_ok(rc, out, range(3))


@needs_mpi
def test_joins_mpi4py_communicators():
    """``init(group=...)`` with a ``Split`` (reordered ranks), a ``Dup``, ``COMM_WORLD``;
    ``COMM_NULL``, an intercommunicator and wrong group types are refused."""
    rc, out, _ = mpirun(3, "mpi_group.py", timeout=240)
    assert_ok(rc, out, range(3))


# -- (c) a peer that leaves, a launch that cannot connect ----------------------------------------
@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_dead_or_silent_peer_raises_comm_error_within_the_timeout(mode):
    """The last rank leaves (gloo reports it at once) or stays away from the call
    (the survivors wait HBK_COMM_TIMEOUT=5 s); either way CommError, no hang."""
    rc, out, seconds = torchrun(2, "torch_fault.py", mode, env=_env(HBK_COMM_TIMEOUT=5), timeout=120)
    assert "DYING rank 1" in out, out
    assert "OK rank 1" not in out, out
    assert_ok(rc, out, [0])
    assert seconds < 60, seconds


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROBE = """
import time, hbkernels as hbk
t0 = time.perf_counter()
try:
    comm = hbk.dist.init({backend!r})
except Exception as e:
    print("RAISED", type(e).__name__, "after %.1f s:" % (time.perf_counter() - t0), e)
else:
    print("CONNECTED", comm)
"""


def probe(env, backend="auto", hide=(), timeout=120):
    """``hbk.dist.init(backend)`` in a fresh process with the launcher variables
    ``env``; modules in ``hide`` cannot be imported there."""
    code = "".join(f"import sys; sys.modules[{m!r}] = None\n" for m in hide)
    code += PROBE.format(backend=backend)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=_env(**env), timeout=timeout)
    return res.stdout + res.stderr


@pytest.mark.parametrize("env, missing", [
    ({"RANK": 0, "WORLD_SIZE": 2}, "MASTER_ADDR, MASTER_PORT are unset"),
    ({"RANK": 1, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is unset"),
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1",
      "MASTER_PORT": 29500}, "RANK is unset"),
    ({"RANK": 1}, "WORLD_SIZE, MASTER_ADDR, MASTER_PORT are unset"),
    ({"WORLD_SIZE": 4, "LOCAL_RANK": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29700},
     "RANK is unset"),
])
def test_torchrun_variables_that_cannot_connect_are_an_error(env, missing):
    out = probe(env)
    assert "RAISED RuntimeError" in out, out
    assert "torchrun launch: the ranks cannot be connected" in out and missing in out, out
    assert f"WORLD_SIZE={env.get('WORLD_SIZE', '<unset>')}" in out, out


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rendezvous_without_peers_fails_within_the_timeout(rank):
    """Rank 0 hosts the store and nobody joins; rank 1 finds no store: CommError
    naming the launcher's variables, after about HBK_COMM_TIMEOUT, never a hang."""
    env = {"RANK": rank, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _free_port(),
           "HBK_COMM_TIMEOUT": 3}
    out = probe(env, timeout=90)
    assert "RAISED CommError" in out, out
    assert "torchrun" in out and "WORLD_SIZE=2" in out and "MASTER_PORT=" in out, out
    seconds = float(out.split("after ")[1].split(" s:")[0])
    assert seconds < 30, out


def test_rank_zero_of_one_is_a_world_of_one():
    out = probe({"RANK": 0})
    assert "CONNECTED <hbk.dist torch communicator: rank 0 of 1" in out, out


def test_torchrun_without_pytorch_is_an_error():
    out = probe({"RANK": 0, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500},
                hide=("torch", "torch.distributed"))
    assert "RAISED RuntimeError" in out and "needs PyTorch" in out, out


@pytest.mark.skipif(not HAVE_MPI4PY, reason="needs mpi4py")
@pytest.mark.parametrize("backend", ["mpi", "nccl"])
def test_mpi_backends_under_torchrun_refuse_to_run_alone(backend):
    out = probe({"RANK": 0, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500,
                 "TORCHELASTIC_RUN_ID": "x"}, backend=backend)
    assert "RAISED RuntimeError" in out, out
    assert "WORLD_SIZE=2 ranks but MPI sees this process alone" in out, out


LAUNCHER_PROBE = """
import hbkernels as hbk, sys
print("LAUNCHER", hbk.dist.launcher(), "torch" in sys.modules, "mpi4py" in sys.modules)
"""


@pytest.mark.parametrize("env, expect", [
    ({}, "None"),
    ({"WORLD_SIZE": 1}, "None"),
    ({"WORLD_SIZE": 2, "MASTER_PORT": 29500}, "torch"),  # several ranks, RANK unset: init raises
    ({"SLURM_PROCID": 1, "SLURM_STEP_NUM_TASKS": 2}, "mpi"),     # srun
    ({"RANK": 1, "WORLD_SIZE": 2}, "torch"),
    ({"RANK": 0}, "torch"),
    ({"TORCHELASTIC_RUN_ID": "job"}, "torch"),
    ({"PMI_RANK": 0, "RANK": 1, "WORLD_SIZE": 2}, "mpi"),   # MPI's variables win
])
def test_launcher_detection_imports_nothing(env, expect):
    res = subprocess.run([sys.executable, "-c", LAUNCHER_PROBE], capture_output=True, text=True,
                         cwd=ROOT, env=_env(**env), timeout=120)
    assert res.stdout.split() == ["LAUNCHER", expect, "False", "False"], res.stdout + res.stderr


def test_backend_torch_without_a_launcher_is_a_world_of_one():
    code = ("import numpy as np, hbkernels as hbk\n"
            "c = hbk.dist.init('torch')\n"
            "assert (c.backend, c.rank, c.world_size) == ('torch', 0, 1), c\n"
            "r, n = c.alltoallv(np.arange(6.0).reshape(3, 2), [3])\n"
            "assert r.tolist() == [[0, 1], [2, 3], [4, 5]] and n.tolist() == [3]\n"
            "assert c.allreduce(np.array([3]), op='prod').tolist() == [3]\n"
            "assert hbk.dist.init().backend == 'torch'  # torch.distributed is initialised now\n"
            "print('fine')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_env(), cwd=ROOT, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "fine", res.stdout + res.stderr


def test_bad_group_arguments():
    import hbkernels as hbk

    for bad in (object(), "world", 3):
        with pytest.raises(TypeError, match="mpi4py communicator .* ProcessGroup"):
            hbk.dist.init(group=bad)
    with pytest.raises(ValueError, match="'local' takes no group"):
        hbk.dist.init("local", group=object())


# -- (d) hbkernels train: torchrun and mpiexec follow the same trajectory ------------------------
SMALL = ["--table", "a:5000:1", "--table", "b:2000:4:var", "--table", "c:300:1",
         "--dense-features", "5", "--batch-size", "128", "--eval-samples", "512",
         "--dim", "7", "--bottom", "16", "--top", "16", "--seed", "3",
         "--steps", "20", "--plan", "row_wise"]


@needs_mpi
def test_train_under_torchrun_matches_mpiexec(tmp_path):
    mt, mm = tmp_path / "torchrun.json", tmp_path / "mpiexec.json"
    rc, out, _ = torchrun(2, "-m hbkernels", "train", *SMALL, "--metrics", mt, timeout=300,
                          cwd=tmp_path)
    assert rc == 0, out[-4000:]
    rc, out, _ = mpirun(2, "-m hbkernels", "train", *SMALL, "--metrics", mm, timeout=300,
                        cwd=tmp_path)
    assert rc == 0, out[-4000:]
    t, m = json.loads(mt.read_text()), json.loads(mm.read_text())
    assert (t["backend"], t["world_size"]) == ("torch", 2), t["backend"]
    assert (m["backend"], m["world_size"]) == ("mpi", 2), m["backend"]
    assert [h["step"] for h in t["train"]] == list(range(1, 21))
    np.testing.assert_allclose([h["loss"] for h in t["train"]], [h["loss"] for h in m["train"]],
                               rtol=1e-5, atol=1e-7)
    for key in ("eval_logloss", "eval_auc", "train_loss"):
        assert t["final"][key] == pytest.approx(m["final"][key], rel=1e-5), key
    assert t["final"]["eval_samples"] == m["final"]["eval_samples"] == 512


# -- CUDA arrays over NCCL (real GPUs only) -----------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() < 2, reason="needs CuPy and two GPUs")
def test_cupy_arrays_over_nccl_under_torchrun():
    rc, out, _ = torchrun(2, "torch_gpu.py", timeout=300)
    assert_ok(rc, out, range(2))
