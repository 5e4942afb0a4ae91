"""Benchmarks of the hbkernels ops against their peers (NumPy, PyTorch, CuPy, JAX).

One script per op (``bench/bench_<op>.py``), each with a ``main(argv)``;
``bench/run_all.py`` runs them all. Run from the repository root::

    PYTHONPATH=. python3 bench/run_all.py --device cpu      # or --device cuda
    PYTHONPATH=. python3 bench/bench_embedding_bag.py --device cuda --smoke

Rows go to one CSV (default ``bench/results/<device-slug>.csv``) with the
columns of :data:`bench.common.COLUMNS`.
"""
