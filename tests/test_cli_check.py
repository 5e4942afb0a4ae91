"""``hbkernels check``: every check runs on the CUDA path (the simulator here, the GPU where
there is one) and passes; a check whose op is broken is reported FAILED with the reason,
the others still run, and the exit status says so; without a GPU and without the simulator
it is a one-line error."""
import subprocess
import sys

import pytest

import hbkernels as hbk
from hbkernels.cli import check

from conftest import SIMULATOR
from mpirun import ROOT, _env

pytestmark = pytest.mark.cuda


def run_cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "hbkernels", *args], cwd=ROOT,
                          env={**_env(), **env}, capture_output=True, text=True, timeout=300)


def test_every_check_passes_on_the_cuda_path():
    pytest.importorskip("numba.cuda")
    res = run_cli("check")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    for name in check.CHECKS:
        assert any(line.startswith("ok") and f" {name} " in line for line in lines), res.stdout
    assert "raised at hbk.synchronize(): embedding_bag: values[9] = 30 is out of range" in res.stdout
    assert lines[-1].startswith("hbkernels check: every check passed in")


def test_a_broken_op_fails_its_check_and_the_others_run(cuda_backend, monkeypatch):
    hbk.synchronize()
    real = hbk.embedding_bag
    monkeypatch.setattr(hbk, "embedding_bag", lambda *a, **k: real(*a, **k) * 1.001)
    monkeypatch.setattr(hbk, "synchronize", lambda: None)  # an error that never surfaces
    lines = []
    assert check.run_checks(lines.append) == 2
    failed = {line.split()[1] for line in lines if line.startswith("FAILED")}
    assert failed == {"embedding_bag", "bounds"}, lines
    assert any("Not equal to tolerance" in line for line in lines)
    assert any("hbk.synchronize() raised nothing for an id out of range" in line for line in lines)
    monkeypatch.undo()
    with pytest.raises(hbk.BoundsError):  # the planted error, still pending
        hbk.synchronize()


def test_a_wrong_optimizer_update_fails_its_check(cuda_backend, monkeypatch):
    hbk.synchronize()
    monkeypatch.setattr(hbk.optim.RowWiseAdagrad, "fused_step", lambda self, *a, **k: None)
    lines = []
    assert check.run_checks(lines.append) == 1
    assert [line.split()[1] for line in lines if line.startswith("FAILED")] == ["fused_step"]


@pytest.mark.skipif(not SIMULATOR, reason="a machine with a GPU checks it")
def test_without_a_gpu_or_the_simulator_it_is_one_line():
    env = _env(NUMBA_ENABLE_CUDASIM="0")
    res = subprocess.run([sys.executable, "-m", "hbkernels", "check"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert res.stderr.startswith("hbkernels check: error: no CUDA GPU (")
    assert "NUMBA_ENABLE_CUDASIM=1" in res.stderr and "Traceback" not in res.stderr
