"""Launching the scripts of tests/mpi/ under ``mpiexec -n N`` (``python -m
mpi4py script.py``) or ``torchrun --nproc-per-node N`` (``python -m
torch.distributed.run --standalone``) from pytest, each bounded by a
wall-clock timeout: a hang is a failure, and the job is terminated. Shared by
tests/test_dist_mpi.py, tests/test_dist_torch.py, tests/test_cli_train.py and
tests/test_embedding_collection.py."""
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "mpi"
MPIEXEC = shutil.which("mpiexec") or next(  # the mpich wheel puts it beside the interpreter
    (str(p) for p in [Path(sys.executable).parent / "mpiexec"] if p.exists()), None)
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None
HAVE_TORCH = importlib.util.find_spec("torch") is not None
# variables of an enclosing launcher would confuse the one we start (pytest-xdist's too: a
# pytest started from a worker would take itself for one)
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_LOCAL", "TORCHELASTIC_",
                      "PYTEST_XDIST_", "HBK_SUITE_DIR")
# ... except what lets Open MPI's mpiexec run as root (it refuses without both)
_KEPT = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                  "MASTER_PORT")

needs_mpi = pytest.mark.skipif(not (MPIEXEC and HAVE_MPI4PY),
                               reason="needs mpiexec and mpi4py (pip install 'hbkernels[mpi]')")
needs_torchrun = pytest.mark.skipif(not HAVE_TORCH, reason="needs PyTorch (torchrun)")


def _hydra():
    if not MPIEXEC:
        return False
    try:
        out = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "HYDRA" in out.stdout.upper()


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k in _KEPT or not (k.startswith(_LAUNCHER_PREFIXES) or k in _LAUNCHER_VARS)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    # a hang inside a script fails it before the test's timeout; a rank compiling its first
    # kernels on cores shared with the other test workers does not
    env["HBK_COMM_TIMEOUT"] = "90"
    if os.geteuid() == 0:  # Open MPI's mpiexec refuses root without these
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if not (shutil.which("ssh") or shutil.which("rsh")):  # Open MPI 4 fails without its remote
        env.setdefault("OMPI_MCA_plm", "^rsh")  # launcher's program, even on one node
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _target(script):
    if str(script).startswith("-m "):
        return ["-m", str(script)[3:]]
    return [str(script if os.path.isabs(str(script)) else SCRIPTS / script)]


def mpirun(n, script, *args, timeout=120, launcher=(), env=None, cwd=ROOT):
    """Run ``script`` (a path, or ``"-m module"``) on ``n`` ranks; returns
    (returncode, output, seconds). Past ``timeout`` the job is terminated and
    the test fails as a hang. The ``OK rank r`` lines the ranks left as marker
    files (tests/mpi/harness.finish) are added to the output where mpiexec's
    forwarding lost them."""
    cmd = [MPIEXEC, *launcher, "-n", str(n), sys.executable, "-m", "mpi4py", *_target(script),
           *map(str, args)]
    return _run_ranks(cmd, cwd, env, timeout)


def torchrun(n, script, *args, timeout=120, env=None, cwd=ROOT):
    """:func:`mpirun`, with ``torchrun --standalone --nproc-per-node n`` (a free
    rendezvous port on localhost) as the launcher."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(n), *_target(script), *map(str, args)]
    return _run_ranks(cmd, cwd, env, timeout)


def _run_ranks(cmd, cwd, env, timeout):
    with tempfile.TemporaryDirectory(prefix="hbk-ok-") as ok_dir:
        env = {**(env or _env()), "HBK_TEST_OK_DIR": ok_dir}
        rc, out, seconds = _launch(cmd, cwd, env, timeout)
        for marker in sorted(Path(ok_dir).iterdir()):
            line = marker.read_text().strip()
            if line not in out:
                out += f"\n{line} (from its marker file; the launcher lost the printed line)\n"
    return rc, out, seconds


def _launch(cmd, cwd, env, timeout):
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # hydra and torchrun forward it and end every rank
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"hang: {' '.join(cmd)} did not finish within {timeout} s\n{out[-6000:]}")
    return proc.returncode, out, time.perf_counter() - t0


def assert_ok(rc, out, ranks):
    missing = [r for r in ranks if f"OK rank {r}" not in out]
    assert rc == 0 and not missing, f"exit status {rc}, no OK from ranks {missing}:\n{out[-6000:]}"


def _gpu_count():
    if importlib.util.find_spec("cupy") is None:
        return 0
    probe = "import cupy; print(cupy.cuda.runtime.getDeviceCount())"
    try:
        res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=120, env=_env())
        return int(res.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0
