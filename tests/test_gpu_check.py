"""``bench/gpu-check.sh`` and what it relies on, without a GPU: its rehearsal
(``--simulate``) leaves the files a device run brings back and no more, a stage killed at
its limit still leaves its summary line and the work folder's tarball; the ``cuda``
marker selects every test that takes the CUDA path; where nvidia-smi sees a GPU that
Numba cannot use, the suite refuses to fall back to the simulator; a run's tally and
failures are written as it goes; the MPI tests' environment keeps what lets Open MPI
run as root."""
import json
import os
import re
import stat
import subprocess
import sys
import tarfile
import textwrap

import pytest

from conftest import cuda_path, takes_cuda_path
from mpirun import ROOT, _env

SUMMARY = re.compile(r"(?P<stage>\w+) rc=(?P<rc>\d+|skipped) seconds=\d+ limit=(?P<limit>\d+) "
                     r"selected=(?P<selected>\d+|-) passed=(?P<passed>\d+|-) failed=(\d+|-) "
                     r"errors=(\d+|-) skipped=(\d+|-)(?: -- (?P<why>.+))?")
STAGES = ["env", "preflight", "warmup", "tests", "null", "host", "roofline", "quantized", "train",
          "graph", "second"]
OUT_FILES = {"summary.txt", "failures.txt", "junit.xml", "roofline.csv", "env.log", "results.tgz",
             "kernel-cache.tgz"}


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """One ``--simulate`` run whose last stage is given a 2-second limit (and the null
    profile 120 s: its 30 s are for a GPU machine's cores, not a loaded 2-core one)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the check is a bash script for Linux machines")
    pytest.importorskip("numba.cuda")
    root = tmp_path_factory.mktemp("gpu-check")
    out, work = root / "out", root / "work"
    env = {**_env(), "HBK_CHECK_WORK": str(work), "HBK_CHECK_LIMITS": "second=2 null=120"}
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # the script sets it
    done = subprocess.run(["bash", "bench/gpu-check.sh", "--simulate", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    return done, out, work


def test_the_rehearsal_leaves_only_what_a_device_run_brings_back(rehearsal):
    done, out, _ = rehearsal
    assert done.returncode == 0, done.stderr[-3000:]
    entries = list(out.iterdir())
    names = {e.name for e in entries}
    assert names <= OUT_FILES and len(names) <= 7, names
    assert {"summary.txt", "failures.txt", "junit.xml", "roofline.csv", "env.log",
            "results.tgz"} <= names
    for e in entries:  # flat plain files with plain names, each well under the size cap
        assert stat.S_ISREG(e.lstat().st_mode) and re.fullmatch(r"[A-Za-z0-9._-]+", e.name)
        assert e.stat().st_size < 16 << 20
    assert sum(e.stat().st_size for e in entries) < 64 << 20


def test_the_summary_has_a_line_per_stage(rehearsal):
    done, out, _ = rehearsal
    lines = (out / "summary.txt").read_text().splitlines()
    parsed = [SUMMARY.fullmatch(line) for line in lines]
    assert all(parsed), lines
    by_stage = {m["stage"]: m for m in parsed}
    assert sorted(by_stage) == sorted(STAGES) and len(lines) == len(STAGES)
    for name in set(STAGES) - {"second"}:
        assert by_stage[name]["rc"] == "0", (name, (out / "failures.txt").read_text()[-3000:])
    tests = by_stage["tests"]
    assert int(tests["selected"]) > 20 and tests["passed"] == tests["selected"]
    assert by_stage["preflight"]["selected"] == by_stage["preflight"]["passed"] == "4"
    assert by_stage["host"]["selected"] == "-"
    # the script ends by printing the summary (what the last lines of a device run show)
    assert done.stdout.rstrip().endswith(lines[-1]) or "== the head of" in done.stdout
    assert "\n".join(lines) in done.stdout
    junit = (out / "junit.xml").read_text()
    assert f'tests="{tests["selected"]}"' in junit


def test_a_stage_killed_at_its_limit_leaves_its_line_and_the_tarball(rehearsal):
    _, out, work = rehearsal
    second = next(m for m in map(SUMMARY.fullmatch, (out / "summary.txt").read_text().splitlines())
                  if m["stage"] == "second")
    assert second["rc"] == "124" and second["limit"] == "2"
    assert second["why"] == "killed at its limit of 2 s"
    failures = (out / "failures.txt").read_text()
    assert "FAILED stage second: rc=124 (killed at its limit of 2 s)" in failures
    with tarfile.open(out / "results.tgz") as tar:
        members = {m.name.removeprefix("./") for m in tar.getmembers()}
    for log in ("env.log", "preflight.log", "tests.log", "warmup.log", "null.log", "null.csv",
                "host.log", "roofline.log", "quantized.log", "train.log", "graph.log", "second.log", "host.csv",
                "summary.txt", "tests/tally.json", "tests/failures.txt"):
        assert log in members, (log, sorted(members))
    assert not any(m.startswith(("kernels", "numba-cache", "shim")) for m in members)
    assert (work / "second.log").exists()


# -- the cuda marker ----------------------------------------------------------------------------
def test_every_test_of_the_cuda_path_carries_the_cuda_marker(request):
    """Whatever this session collected: each test taking the ``cuda_backend`` fixture, or
    ``"cuda"`` as its ``backend`` or ``device`` parameter, is selected by ``-m cuda``;
    the CPU side of a ``backend`` test is not."""
    items = request.session.items
    cuda, cpu = [], []
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        marked = item.get_closest_marker("cuda") is not None
        if "cuda_backend" in item.fixturenames or "cuda" in (params.get("backend"),
                                                               params.get("device")):
            cuda.append((item.nodeid, marked))
        elif params.get("backend") == "cpu":
            cpu.append((item.nodeid, marked))
    assert [n for n, marked in cuda if not marked] == []
    assert [n for n, marked in cpu if marked] == []
    assert takes_cuda_path(request.node) is False


def test_the_marker_is_set_by_fixtures_and_parameters(tmp_path):
    """In a fresh collection: the marker comes from the fixture and the parameters, not
    from a test's name."""
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "cuda", "tests/test_host_syncs.py", "tests/test_tiered_storage.py",
         "tests/test_dispatch.py", "tests/test_lookup.py"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ids = [line for line in res.stdout.splitlines() if "::" in line]
    assert "tests/test_dispatch.py::test_mixing_families_is_a_type_error" in ids  # cuda_backend
    assert any(i.startswith("tests/test_host_syncs.py::test_fused_step") for i in ids)
    assert any("test_tiered_storage.py" in i and "[cuda" in i for i in ids)  # device="cuda"
    assert any("test_lookup.py" in i and "cuda" in i for i in ids)  # backend="cuda"
    assert not any("[cpu" in i or "-cpu" in i for i in ids)


# -- no silent fall back to the simulator -------------------------------------------------------
def test_the_cuda_path_is_chosen_or_refused():
    works, broken = (lambda: (True, None)), (lambda: (False, "libnvvm.so not found"))
    assert cuda_path("1", 0, broken) == ("1", None)
    assert cuda_path("0", 1, works) == ("0", None)
    assert cuda_path(None, 1, works) == ("0", None)
    setting, refusal = cuda_path(None, 2, broken)
    assert setting is None and "nvidia-smi lists 2 GPU(s)" in refusal
    assert "libnvvm.so not found" in refusal and "NUMBA_ENABLE_CUDASIM=1" in refusal
    setting, refusal = cuda_path("0", 0, broken)
    assert setting is None and "NUMBA_ENABLE_CUDASIM=0 asks for a real GPU" in refusal


def test_a_gpu_that_numba_cannot_use_stops_the_run(tmp_path):
    """nvidia-smi lists a GPU (a stand-in on PATH), no driver works here: the run stops
    with the reason instead of running the simulator."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    env = {**_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                          "no:cacheprovider", "tests/test_types.py"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 4, res.stdout[-2000:] + res.stderr[-2000:]
    assert "nvidia-smi lists 1 GPU(s), but Numba cannot use it" in res.stderr


# -- results written as a run goes ----------------------------------------------------------------
def test_the_run_report_writes_the_tally_and_failures_as_it_goes(tmp_path):
    (tmp_path / "test_some.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.fixture
        def broken():
            raise RuntimeError("setup broke")

        def test_passes():
            pass

        def test_fails():
            assert 1 == 2, "one is not two"

        def test_errors(broken):
            pass

        @pytest.mark.skip(reason="not here")
        def test_skipped():
            pass
        """))
    report = tmp_path / "report"
    runner = ("import sys, pytest; sys.path.insert(0, sys.argv[1]); import run_report; "
              "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'test_some.py'], "
              "plugins=[run_report.Reporter(sys.argv[2])]))")
    res = subprocess.run([sys.executable, "-c", runner, str(ROOT / "tests"), str(report)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout[-2000:]
    assert json.loads((report / "tally.json").read_text()) == {
        "selected": 4, "passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    failures = (report / "failures.txt").read_text()
    assert "FAILED test_some.py::test_fails\n" in failures and "one is not two" in failures
    assert "ERROR (at setup) test_some.py::test_errors\n" in failures and "setup broke" in failures


def test_mpi_tests_keep_what_lets_open_mpi_run_as_root(monkeypatch):
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("PMI_RANK", "3")
    env = _env()
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert "OMPI_COMM_WORLD_SIZE" not in env and "PMI_RANK" not in env
