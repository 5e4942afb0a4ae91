"""Processes that need the same CPU kernel at the same time compile it once: the others
wait for the first and load its compile from the cache (hbkernels._numba_cache)."""
import json
import os
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from hbkernels._numba_cache import cached_njit

    def total(a):
        s = 0.0
        for x in a:
            s += x * x
        return s

    kernel = cached_njit(total)
    while not os.path.exists(sys.argv[1]):  # both start compiling together
        time.sleep(0.01)
    import numpy as np
    kernel(np.ones(4))
    print(json.dumps({"misses": sum(kernel.stats.cache_misses.values()),
                      "hits": sum(kernel.stats.cache_hits.values())}))
""")


def test_concurrent_processes_compile_a_kernel_once(tmp_path):
    script = tmp_path / f"kernel_{os.getpid()}_{time.monotonic_ns()}.py"  # a function never cached
    script.write_text(SCRIPT)
    go = tmp_path / "go"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(script), str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    time.sleep(3)  # both imported and waiting
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["misses"] for r in results) == [0, 1], results
    assert sorted(r["hits"] for r in results) == [0, 1], results
