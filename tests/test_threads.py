"""hbkernels.threads: one size for Numba's and torch's pools, the free-core rule,
and the spin setting of Numba's pool."""
import os
import subprocess
import sys
import textwrap

import numba
import pytest

from hbkernels import threads


@pytest.fixture
def restore_threads():
    before = numba.get_num_threads()
    torch = sys.modules.get("torch")
    torch_before = torch.get_num_threads() if torch else None
    yield
    numba.set_num_threads(before)
    if torch:
        torch.set_num_threads(torch_before)


def test_set_num_threads_sizes_both_pools(restore_threads):
    torch = pytest.importorskip("torch")
    assert threads.set_num_threads(1) == 1
    assert numba.get_num_threads() == 1 and torch.get_num_threads() == 1
    most = numba.config.NUMBA_NUM_THREADS
    assert threads.set_num_threads(most + 3) == most   # Numba's pool cannot grow past its start size
    assert torch.get_num_threads() == most + 3


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2", None])
def test_set_num_threads_refuses_non_positive_ints(bad):
    with pytest.raises(ValueError, match="positive int"):
        threads.set_num_threads(bad)


def test_pools_report_both_pools_and_the_environment(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # conftest's, for the test workers
    info = threads.pools()
    assert info["cores"] == threads.usable_cores() >= 1
    assert info["numba"]["threads"] == numba.get_num_threads()
    assert info["numba"]["max"] == numba.config.NUMBA_NUM_THREADS
    assert info["torch"]["threads"] >= 1 and info["torch"]["parallel"]
    assert info["environment"] == {"OMP_NUM_THREADS": "7"}


@pytest.mark.parametrize("others, cores, limit, expected", [
    (0.0, 2, 2, 2),      # quiet: every core
    (1.0, 2, 2, 1),      # one core burnt by another process
    (0.6, 2, 2, 1),      # it gets 0.6 of a core while we hold both: 1.4 free
    (0.4, 2, 2, 2),
    (3.9, 4, 4, 1),      # never below 1
    (0.0, 16, 8, 8),     # never above the limit (a rank's share of the node)
    (None, 16, 8, 8),    # no /proc: the limit
])
def test_governor_sizes_pools_to_the_free_cores(monkeypatch, restore_threads, others, cores,
                                                limit, expected):
    sizes = []
    monkeypatch.setattr(threads, "set_num_threads", lambda n: sizes.append(n) or n)
    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    governor = threads.Governor(limit, interval=0.0)
    monkeypatch.setattr(governor.load, "others", lambda: others)
    assert sizes == [limit]
    assert governor.tick() == expected
    assert sizes == [limit] + ([expected] if expected != limit else [])


def test_governor_measures_once_per_interval(monkeypatch, restore_threads):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    governor = threads.Governor(2, interval=3600.0)
    calls = []
    monkeypatch.setattr(governor.load, "others", lambda: calls.append(1) or 1.0)
    for _ in range(5):
        assert governor.tick() == 2
    assert calls == [] and governor.changes == 0


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc")
def test_cpu_load_counts_other_processes_not_this_one():
    load = threads.CpuLoad()
    x = 0
    for i in range(3_000_000):   # this process busy: not counted
        x += i
    mine = load.others()
    burner = subprocess.Popen([sys.executable, "-c",
                               "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    try:
        load.others()
        burner.wait(timeout=30)
        theirs = load.others()
    finally:
        burner.kill()
    assert mine is not None and theirs is not None
    assert theirs > mine and theirs > 0.5, (mine, theirs)


def run_fresh(code, env=None):
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120,
                         env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None})
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


SEEN_BY_NUMBA = """
    import os, numba
    from hbkernels import threads
    seen = []
    launch = numba.set_num_threads
    numba.set_num_threads = lambda n: seen.append(os.environ.get("GOMP_SPINCOUNT")) or launch(n)
    threads.start_numba_pool()
    threads.start_numba_pool()
    print(seen, os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"))
"""


def test_numba_pool_starts_spinning_and_the_environment_is_restored():
    out = run_fresh(SEEN_BY_NUMBA, {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": None})
    assert out == f"['{threads.NUMBA_SPIN_COUNT}'] None None"


@pytest.mark.parametrize("name, value", [("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "7")])
def test_a_wait_policy_the_user_set_is_kept(name, value):
    out = run_fresh(SEEN_BY_NUMBA, {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": None, name: value})
    seen = value if name == "GOMP_SPINCOUNT" else None
    assert out.split(" ", 1)[0] == f"[{seen!r}]"
