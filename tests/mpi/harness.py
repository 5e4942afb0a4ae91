"""Shared by the scripts that tests/test_dist_mpi.py runs under
``mpiexec -n N python -m mpi4py tests/mpi/<script>.py``.

Every rank builds every rank's input from ``(seed, case, rank)``, so each can
compute the NumPy reference of a collective by itself. A failed assertion
raises; ``python -m mpi4py`` then aborts the whole job (no hang), and the
test sees a non-zero exit status without the final ``OK rank r`` lines."""
import os
import sys
import time
import zlib

import numpy as np

SEED = int(os.environ.get("HBK_TEST_SEED", "12345"))


def rng_for(*key):
    return np.random.default_rng([SEED, *[zlib.crc32(str(k).encode()) for k in key]])


def data(key, shape, dtype):
    """Deterministic test data of one rank and case (no NaN, small magnitudes)."""
    rng = rng_for(*key)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.kind == "u":
        return np.asarray(rng.integers(0, 4, size=shape)).astype(dtype)
    if dtype.kind == "i":
        return np.asarray(rng.integers(-3, 4, size=shape)).astype(dtype)
    return np.asarray(rng.standard_normal(shape) * 4).astype(dtype)


def log(comm, *msg):
    if os.environ.get("HBK_TEST_VERBOSE"):
        print(f"[rank {comm.rank}]", *msg, flush=True)


def finish(comm, hard=False):
    """The line the pytest driver looks for; ``hard``: leave with ``os._exit``,
    skipping MPI_Finalize (tests/mpi/fault.py, whose victim rank is dead).

    The line also goes to a marker file in ``$HBK_TEST_OK_DIR`` (set by
    tests/mpirun.py): mpiexec's output forwarding can drop the last line of a
    rank that leaves with ``os._exit`` right after printing it. Scripts whose
    ranks are all alive end normally: when one rank leaves without
    MPI_Finalize, mpiexec kills the others (exit status 9) unless it runs with
    ``-disable-auto-cleanup``."""
    print(f"OK rank {comm.rank}", flush=True)
    sys.stdout.flush()
    ok_dir = os.environ.get("HBK_TEST_OK_DIR")
    if ok_dir:
        with open(os.path.join(ok_dir, f"rank-{comm.rank}"), "w") as f:
            f.write(f"OK rank {comm.rank}\n")
    if hard:
        os._exit(0)


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0
        return False
