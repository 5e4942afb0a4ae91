"""Benchmarks of the hbkernels ops against their peers (NumPy, PyTorch, CuPy, JAX).

One script per op (``hbkernels/bench/bench_<op>.py``), each with a ``main(argv)``;
``hbkernels/bench/run_all.py`` runs them all (``hbkernels bench`` is the command line
of ``run_all``)::

    python3 -m hbkernels.bench.run_all --device cpu      # or --device cuda
    python3 -m hbkernels.bench.bench_embedding_bag --device cuda --smoke

Rows go to one CSV (default ``bench/results/<device-slug>.csv`` under the current
directory) with the
columns of :data:`hbkernels.bench.common.COLUMNS`.
"""

import os

# torch and Numba each bring an OpenMP pool; by default idle threads of one spin
# for a while after every parallel region and steal the cores of the other, so
# whichever provider runs second in a process looks slower. Passive waiting
# (set before either pool starts) keeps the side-by-side timings fair.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
