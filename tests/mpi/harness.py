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


def wait_for_all(seconds):
    """A barrier of every rank outside hbk (whose communicator may hold abandoned
    requests), polled so that it fails after ``seconds`` instead of hanging."""
    from mpi4py import MPI

    req = MPI.COMM_WORLD.Ibarrier()
    deadline = time.monotonic() + seconds
    while not req.Test():
        assert time.monotonic() < deadline, "final barrier"
        time.sleep(0.01)


def finish(comm, hard=False, seconds=60):
    """The line the pytest driver looks for; ``hard``: skip MPI_Finalize.

    The line also goes to a marker file in ``$HBK_TEST_OK_DIR`` (set by
    tests/mpirun.py): mpiexec's output forwarding can drop the last line of a
    rank that leaves with ``os._exit`` right after printing it. A ``hard`` exit
    first waits (``seconds`` at most) until every rank has written its line:
    mpiexec ends the whole job when one rank leaves without MPI_Finalize, and
    could otherwise kill a slower rank before it writes. (A script with a dead
    rank, as tests/mpi/fault.py, passes ``seconds=0``.)"""
    print(f"OK rank {comm.rank}", flush=True)
    sys.stdout.flush()
    ok_dir = os.environ.get("HBK_TEST_OK_DIR")
    if ok_dir:
        with open(os.path.join(ok_dir, f"rank-{comm.rank}"), "w") as f:
            f.write(f"OK rank {comm.rank}\n")
    if hard:
        if seconds > 0:
            wait_for_all(seconds)
        os._exit(0)


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0
        return False
