"""Bad input on some ranks (ValueError/TypeError there, CommError "rank r failed
its input checks" on the others) and disagreements across ranks (dtype, row
width, shape, reduce op, root, wire dtype, the call itself: the same CommError
on every rank). None of them may hang or wait for the timeout, and the
communicator stays usable after each. Prints ``OK rank r`` at the end."""
import zlib

import numpy as np

import hbkernels as hbk
from harness import Timer, finish, log

CommError = hbk.dist.CommError
comm = hbk.dist.init()
R, W = comm.rank, comm.world_size
assert comm.timeout >= 20, "run with HBK_COMM_TIMEOUT >= 20: a hang must not pass as a timeout"
FAST = 3.0  # seconds: far below the timeout, so nothing waited for it


def still_usable():
    assert comm.allreduce(np.array([1]))[0] == W
    recv, counts = comm.alltoallv(np.arange(W, dtype=np.float32), [1] * W)
    assert counts.tolist() == [1] * W and recv.tolist() == [float(R)] * W


def same_message_everywhere(msg):
    crc = np.array([zlib.crc32(msg.encode())], np.int64)
    g = comm.allgather(crc)
    assert (g == g[0]).all(), f"ranks raised different messages; mine: {msg}"


def expect_bad_input(name, fn, bad, local_exc=ValueError, local_match=""):
    """``fn(bad_here)`` is called on every rank; ranks in ``bad`` get bad input."""
    with Timer() as t:
        try:
            fn(R in bad)
        except CommError as e:
            assert R not in bad, f"{name}: rank {R} had bad input but got CommError: {e}"
            who = ", ".join(str(b) for b in sorted(bad))
            assert f"{who} failed" in str(e) and "input checks" in str(e), f"{name}: {e}"
        except (ValueError, TypeError) as e:
            assert R in bad, f"{name}: rank {R} had good input but got {type(e).__name__}: {e}"
            assert isinstance(e, local_exc) and local_match in str(e), f"{name}: {e!r}"
        else:
            raise AssertionError(f"{name}: rank {R} raised nothing")
    assert t.s < FAST, f"{name}: took {t.s:.1f} s"
    still_usable()
    log(comm, "ok", name)


def expect_mismatch(name, fn, match):
    with Timer() as t:
        try:
            fn()
        except CommError as e:
            assert match in str(e), f"{name}: {e}"
            same_message_everywhere(str(e))
        else:
            raise AssertionError(f"{name}: rank {R} raised nothing")
    assert t.s < FAST, f"{name}: took {t.s:.1f} s"
    still_usable()
    log(comm, "ok", name)


last = W - 1
rows = np.zeros((2 * W, 4), np.float32)
good = [2] * W

# -- bad input on one rank: ValueError there, CommError elsewhere --------------------------------------
expect_bad_input("counts sum", lambda b: comm.alltoallv(rows, [2] * (W - 1) + [1] if b else good),
                 {last}, local_match="sum to")
expect_bad_input("negative count", lambda b: comm.alltoallv(rows, [-1, 3] + [2] * (W - 2) if b else good),
                 {0}, local_match="negative")
expect_bad_input("count length", lambda b: comm.alltoallv(rows, good + [0] if b else good),
                 {1}, local_match="expected world_size")
strided = np.zeros((2 * W, 8), np.float32)[:, ::2]
expect_bad_input("non-contiguous", lambda b: comm.alltoallv(strided if b else rows, good),
                 {0}, local_match="C-contiguous")
expect_bad_input("dtype", lambda b: comm.allreduce(np.zeros(3, np.complex64 if b else np.float32)),
                 {1}, local_match="not supported")
expect_bad_input("wire", lambda b: comm.allgather(np.zeros(3), wire_dtype="int8" if b else None),
                 {0}, local_match="wire_dtype")
expect_bad_input("reduce op", lambda b: comm.allreduce(np.zeros(3), op="mean" if b else "sum"),
                 {last}, local_match="op must be")
expect_bad_input("root", lambda b: comm.broadcast(np.zeros(3), root=W if b else 0),
                 {0}, local_match="out of range")
expect_bad_input("not an array", lambda b: comm.allgatherv([1.0, 2.0] if b else np.zeros(2)),
                 {1}, local_exc=TypeError)
expect_bad_input("0-d rows", lambda b: comm.allgatherv(np.zeros(()) if b else np.zeros(2)),
                 {last}, local_match="at least one dimension")
if W >= 3:
    expect_bad_input("two bad ranks", lambda b: comm.alltoallv(rows, [9] * W if b else good),
                     {0, 2}, local_match="sum to")

# -- disagreements: the same CommError on every rank -----------------------------------------------------
expect_mismatch("alltoallv dtype",
                lambda: comm.alltoallv(rows.astype(np.float64) if R == 1 else rows, good),
                "dtypes differ across ranks: rank 1 sent float64, rank 0 float32")
expect_mismatch("alltoallv id dtype",
                lambda: comm.alltoallv(np.arange(2 * W, dtype=np.int32 if R == last else np.int64), good),
                f"rank {last} sent int32, rank 0 int64")
expect_mismatch("alltoallv row width",
                lambda: comm.alltoallv(np.zeros((2 * W, 5 if R == last else 4), np.float32), good),
                f"row shapes differ across ranks: rank {last} sent rows of shape (5,), rank 0 (4,)")
expect_mismatch("alltoallv row ndim",
                lambda: comm.alltoallv(np.zeros((2 * W, 2, 2) if R == 1 else (2 * W, 4), np.float32), good),
                "rank 1 sent rows of shape (2, 2), rank 0 (4,)")
expect_mismatch("allgatherv row width",
                lambda: comm.allgatherv(np.zeros((R, 3 if R == 1 else 2))),
                "rank 1 sent rows of shape (3,), rank 0 (2,)")
expect_mismatch("allreduce shape",
                lambda: comm.allreduce(np.zeros(4 if R == last else 3)),
                f"shapes differ across ranks: rank {last} passed (4,), rank 0 (3,)")
expect_mismatch("allgather shape",
                lambda: comm.allgather(np.zeros((2, 2) if R == 1 else (4,))),
                "rank 1 passed (2, 2), rank 0 (4,)")
expect_mismatch("broadcast dtype",
                lambda: comm.broadcast(np.zeros(3, np.int32 if R == 1 else np.int64)),
                "rank 1 sent int32, rank 0 int64")
expect_mismatch("reduce op",
                lambda: comm.allreduce(np.zeros(3), op="max" if R == 1 else "sum"),
                "reduce ops differ across ranks: rank 1 asked for max, rank 0 sum")
expect_mismatch("root",
                lambda: comm.broadcast(np.zeros(3), root=1 if R == last else 0),
                f"roots differ across ranks: rank {last} passed root=1, rank 0 root=0")
expect_mismatch("wire dtype",
                lambda: comm.allreduce(np.zeros(3), wire_dtype="bfloat16" if R == 1 else None),
                "wire dtypes differ across ranks: rank 1 uses bfloat16, rank 0 None")
expect_mismatch("different calls",
                lambda: comm.barrier() if R == 0 else comm.allreduce(np.zeros(3)),
                "collective calls differ across ranks: rank 1 called allreduce, rank 0 barrier")
expect_mismatch("alltoallv vs allgatherv",
                lambda: comm.alltoallv(rows, good) if R == last else comm.allgatherv(rows),
                f"rank {last} called alltoallv" if last != 0 else "called")

comm.barrier()
finish(comm)
