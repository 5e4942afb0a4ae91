"""hbk.dist across processes: the scripts in tests/mpi/ under
``mpiexec -n 2`` and ``-n 3`` (``python -m mpi4py script.py``), each bounded
by a wall-clock timeout (a hang is a failure, and the job is terminated).
Every script asserts against NumPy references and prints ``OK rank r`` last.

Skipped when ``mpiexec`` or mpi4py is missing (``pip install 'hbkernels[mpi]'``).
"""
import csv
import subprocess
import sys

import pytest
from mpirun import (  # noqa: F401  (re-exported: other test modules used to import them from here)
    HAVE_MPI4PY, MPIEXEC, ROOT, SCRIPTS, _env, _gpu_count, _hydra, assert_ok, mpirun,
)

pytestmark = pytest.mark.skipif(not (MPIEXEC and HAVE_MPI4PY),
                                reason="needs mpiexec and mpi4py (pip install 'hbkernels[mpi]')")


@pytest.mark.parametrize("n", [2, 3])
def test_collectives(n):
    """Every op, every dtype and reduce op, uneven/zero counts, a silent rank,
    wire dtypes, Numba-family arrays, results equal on every rank."""
    rc, out, _ = mpirun(n, "collectives.py")
    assert_ok(rc, out, range(n))


@pytest.mark.parametrize("n", [2, 3])
def test_bad_input_and_mismatches_raise_everywhere_without_hanging(n):
    rc, out, _ = mpirun(n, "errors.py")
    assert_ok(rc, out, range(n))


@pytest.mark.parametrize("n", [2, 3])
def test_backend_selection(n):
    rc, out, _ = mpirun(n, "selection.py")
    assert_ok(rc, out, range(n))


@pytest.mark.skipif(not _hydra(), reason="the fault test drives MPICH's hydra (-disable-auto-cleanup)")
@pytest.mark.parametrize("n, mode", [(2, "before"), (3, "during")])
def test_dead_peer_raises_comm_error_within_the_timeout(n, mode):
    """The last rank exits mid-run (before alltoallv, or inside it after the
    metadata exchange); the survivors raise CommError within HBK_COMM_TIMEOUT=5 s.
    ``-disable-auto-cleanup`` keeps hydra from killing the survivors."""
    rc, out, seconds = mpirun(n, "fault.py", mode, launcher=["-disable-auto-cleanup"],
                              env=_env(HBK_COMM_TIMEOUT=5), timeout=90)
    victim = n - 1
    assert f"DYING rank {victim}" in out, out
    assert f"OK rank {victim}" not in out, out
    missing = [r for r in range(victim) if f"OK rank {r}" not in out]
    assert not missing, f"survivors {missing} did not finish:\n{out}"
    assert rc != 0, out  # the victim's exit status
    assert seconds < 60, seconds


@pytest.mark.parametrize("n", [2, 3])
def test_backend_torch_under_mpiexec_is_an_error_not_n_one_rank_jobs(n):
    """``init("torch")`` under ``mpiexec -n N`` with torch.distributed's variables
    unset (or saying one rank) raises on every rank, naming the N ranks."""
    rc, out, _ = mpirun(n, "torch_under_mpiexec.py")
    assert_ok(rc, out, range(n))


@pytest.mark.parametrize("backend, env", [
    ("auto", {"SLURM_PROCID": 1, "SLURM_STEP_NUM_TASKS": 2}),                 # srun without MPI
    ("mpi", {"OMPI_COMM_WORLD_RANK": 1, "OMPI_COMM_WORLD_SIZE": 2}),  # another MPI's mpiexec
    ("nccl", {"PMI_RANK": 0, "PMI_SIZE": 3}),
])
def test_a_launcher_whose_ranks_mpi_cannot_see_is_an_error(backend, env):
    """The launcher's variables say several ranks, but MPI's COMM_WORLD holds this
    process alone: RuntimeError naming them and the fix, never a world of one."""
    code = ("import hbkernels as hbk\n"
            f"try:\n    c = hbk.dist.init({backend!r})\n"
            "except RuntimeError as e:\n    print('RAISED', e)\n"
            "else:\n    print('CONNECTED', c)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_env(**env), cwd=ROOT, timeout=120)
    out = res.stdout + res.stderr
    shown = ", ".join(f"{k}={v}" for k, v in env.items())
    ranks = max(v + k.endswith(("RANK", "PROCID")) for k, v in env.items())
    assert f"RAISED backend {backend!r}: the launcher started {ranks} ranks ({shown}) but MPI " \
           "(mpi4py over " in out, out
    assert "sees this process alone" in out and "launch with the mpiexec of the MPI library " \
           "mpi4py was built with" in out and "hbk.dist.init('local')" in out, out


def test_mpi_backend_without_a_launcher_is_a_world_of_one():
    probe = ("import numpy as np, hbkernels as hbk\n"
             "c = hbk.dist.init('mpi')\n"
             "assert (c.backend, c.rank, c.world_size) == ('mpi', 0, 1), c\n"
             "r, n = c.alltoallv(np.arange(6.0).reshape(3, 2), [3])\n"
             "assert r.tolist() == [[0, 1], [2, 3], [4, 5]] and n.tolist() == [3]\n"
             "assert c.allreduce(np.array([3]), op='prod').tolist() == [3]\n"
             "print('fine')\n")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=_env(), cwd=ROOT, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "fine", res.stdout + res.stderr


def test_bench_alltoallv_smoke(tmp_path):
    out_csv = tmp_path / "bench.csv"
    rc, out, _ = mpirun(2, "-m hbkernels.bench.bench_alltoallv", "--smoke", "--out", str(out_csv))
    assert rc == 0, out
    assert "overhead" in out, out
    sys.path.insert(0, str(ROOT))
    try:
        from hbkernels.bench.common import COLUMNS
    finally:
        sys.path.remove(str(ROOT))
    with open(out_csv, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        rows = list(reader)
    assert {r["provider"] for r in rows} == {"hbkernels", "mpi4py", "mpi4py+counts"}
    for r in rows:
        assert r["op"] == "alltoallv" and r["mode"] == "mpi" and r["dtype"] == "float32"
        assert float(r["p20_ms"]) <= float(r["median_ms"]) <= float(r["p80_ms"])
        assert float(r["median_ms"]) > 0 and float(r["gbps"]) > 0 and r["device"]


# -- real GPUs -----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_mpi_backend_with_cupy_arrays():
    """CuPy arrays over MPI: staged through pinned host memory (or direct with a
    CUDA-aware MPI); two ranks may share one GPU here."""
    if _gpu_count() < 1:
        pytest.skip("needs CuPy and a GPU")
    rc, out, _ = mpirun(2, "gpu.py", "mpi", env=_env(NUMBA_ENABLE_CUDASIM=0))
    assert_ok(rc, out, range(2))


@pytest.mark.gpu
def test_nccl_backend():
    if _gpu_count() < 2:
        pytest.skip("the NCCL backend needs one GPU per rank: 2 GPUs")
    rc, out, _ = mpirun(2, "gpu.py", "nccl", env=_env(NUMBA_ENABLE_CUDASIM=0))
    assert_ok(rc, out, range(2))


@pytest.mark.gpu
def test_bench_alltoallv_gpu_smoke(tmp_path):
    if _gpu_count() < 2:
        pytest.skip("the NCCL benchmark needs one GPU per rank: 2 GPUs")
    rc, out, _ = mpirun(2, "-m hbkernels.bench.bench_alltoallv", "--device", "cuda", "--smoke",
                        "--out", str(tmp_path / "bench.csv"), env=_env(NUMBA_ENABLE_CUDASIM=0))
    assert rc == 0 and "overhead" in out, out
