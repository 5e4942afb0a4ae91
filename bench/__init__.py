"""Benchmarks of the hbkernels ops against their peers (NumPy, PyTorch, CuPy, JAX).

One script per op (``bench/bench_<op>.py``), each with a ``main(argv)``;
``bench/run_all.py`` runs them all. Run from the repository root::

    PYTHONPATH=. python3 bench/run_all.py --device cpu      # or --device cuda
    PYTHONPATH=. python3 bench/bench_embedding_bag.py --device cuda --smoke

Rows go to one CSV (default ``bench/results/<device-slug>.csv``) with the
columns of :data:`bench.common.COLUMNS`.
"""

import os

# torch and Numba each bring an OpenMP pool; by default idle threads of one spin
# for a while after every parallel region and steal the cores of the other, so
# whichever provider runs second in a process looks slower. Passive waiting
# (set before either pool starts) keeps the side-by-side timings fair.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
