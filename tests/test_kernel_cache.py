"""The CPU kernels are cached on disk by Numba, which keys a cached function on its
own file only; the kernels inline helpers of ``hbkernels/cpu/_common.py``, so an edit
there must make them compile again instead of loading the old machine code."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import hbkernels

SCRIPT = textwrap.dedent("""
    import numpy as np
    import hbkernels as hbk
    from hbkernels.cpu import embedding_bag as eb

    out = hbk.embedding_bag(np.ones((4, 3), np.float32), np.array([0, 3]), np.array([0, 2]))
    assert out.tolist() == [[2.0, 2.0, 2.0]]
    kernel = eb.pool_kernel(3, True, False)
    print(sum(kernel.stats.cache_hits.values()), sum(kernel.stats.cache_misses.values()))
""")


def cache_hits_and_misses(root):
    env = {**os.environ, "PYTHONPATH": str(root), "NUMBA_CACHE_DIR": str(root / "numba-cache")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return tuple(int(n) for n in done.stdout.split())


def test_an_edit_to_the_shared_helpers_recompiles_the_kernels(tmp_path):
    package = tmp_path / "hbkernels"
    shutil.copytree(Path(hbkernels.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert cache_hits_and_misses(tmp_path) == (0, 1)  # compiled, written to the cache
    assert cache_hits_and_misses(tmp_path) == (1, 0)  # loaded from it
    with open(package / "cpu" / "_common.py", "a") as f:
        f.write("\n# an edit to a helper the kernel inlines\n")
    assert cache_hits_and_misses(tmp_path) == (0, 1)  # compiled again, not the stale code
