"""Benchmarks of the hbkernels ops against their peers (NumPy, PyTorch, CuPy, JAX).

One script per op (``hbkernels/bench/bench_<op>.py``), each with a ``main(argv)``;
``hbkernels/bench/run_all.py`` runs them all (``hbkernels bench`` is the command line
of ``run_all``)::

    python3 -m hbkernels.bench.run_all --device cpu      # or --device cuda
    python3 -m hbkernels.bench.bench_embedding_bag --device cuda --smoke

Rows go to one CSV (default ``bench/results/<device-slug>.csv`` under the current
directory) with the columns of :data:`hbkernels.bench.common.COLUMNS`.
"""
