"""Every collective of the MPI backend against NumPy references: uneven and zero
counts, a rank that sends nothing, every dtype, every reduce op, row shapes,
wire dtypes, CUDA-family arrays (Numba's simulator), results identical on
every rank. Prints ``OK rank r`` at the end."""
import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # Numba device arrays without a GPU

import time  # noqa: E402

import numpy as np  # noqa: E402

import hbkernels as hbk  # noqa: E402
from hbkernels.dist import _common, _wire  # noqa: E402
from harness import data, finish, log, rng_for  # noqa: E402

comm = hbk.dist.init()
R, W = comm.rank, comm.world_size
assert comm.backend == os.environ.get("HBK_EXPECT_BACKEND", "mpi"), comm
assert W == int(os.environ.get("PMI_SIZE", W)), (W, os.environ.get("PMI_SIZE"))
ALL = [d.name for d in _common.SUPPORTED_DTYPES]
FLOATS = ["float16", "float32", "float64"]


def same_on_every_rank(x):
    """Assert ``x`` has the same bits on every rank."""
    g = comm.allgather(np.ascontiguousarray(x))
    for r in range(W):
        assert np.array_equal(g[r].view(np.uint8), g[0].view(np.uint8)), f"rank {r} differs"


# -- alltoallv ------------------------------------------------------------------------------
def counts_of(case, r, pattern):
    if pattern == "random":
        c = rng_for("counts", case, r).integers(0, 6, size=W)
        c[rng_for("zeros", case, r).random(W) < 0.3] = 0
        return c
    if pattern == "silent1":   # rank 1 sends nothing at all
        return np.zeros(W, np.int64) if r == 1 else rng_for("c", case, r).integers(1, 4, size=W)
    if pattern == "zeros":
        return np.zeros(W, np.int64)
    if pattern == "big":       # 1 MiB to every peer (rendezvous protocol)
        return np.full(W, 4096)
    raise ValueError(pattern)


def check_alltoallv(case, dtype, row_shape, wire=None, pattern="random", counts_type=list):
    counts = [counts_of(case, r, pattern) for r in range(W)]
    sends = [data(("a2a", case, r), (int(counts[r].sum()),) + row_shape, dtype) for r in range(W)]
    my_counts = counts_type(counts[R]) if counts_type is list else counts[R].astype(counts_type)
    recv, recv_counts = comm.alltoallv(sends[R], my_counts, wire_dtype=wire)
    assert isinstance(recv, np.ndarray) and isinstance(recv_counts, np.ndarray)
    assert recv.dtype == np.dtype(dtype), (recv.dtype, dtype)
    assert recv_counts.dtype == np.int64
    assert recv_counts.tolist() == [int(counts[s][R]) for s in range(W)]
    blocks = []
    for s in range(W):
        start = int(counts[s][:R].sum())
        blocks.append(sends[s][start:start + int(counts[s][R])])
    expect = np.concatenate(blocks) if blocks else sends[R][:0]
    expect = _wire.round_trip(expect, _wire.effective(_wire.normalize(wire), dtype))
    assert recv.shape == expect.shape, (recv.shape, expect.shape)
    np.testing.assert_array_equal(recv, expect, err_msg=f"alltoallv case {case}")


case = 0
for dtype in ALL:
    case += 1
    check_alltoallv(case, dtype, (3,))
for row_shape in [(), (1,), (2, 3), (4, 1, 2), (0,)]:
    case += 1
    check_alltoallv(case, "float32", row_shape)
for pattern in ["silent1", "zeros", "big"]:
    case += 1
    check_alltoallv(case, "float32", (64,), pattern=pattern)
for ctype in [list, np.int32, np.uint64, np.int64]:
    case += 1
    check_alltoallv(case, "int64", (2,), counts_type=ctype)
for dtype in FLOATS:
    for wire in ["float16", "bfloat16"]:
        case += 1
        check_alltoallv(case, dtype, (5,), wire=wire)
        case += 1
        check_alltoallv(case, dtype, (5,), wire=wire, pattern="silent1")
case += 1
check_alltoallv(case, "int32", (3,), wire="bfloat16")  # ints ignore the wire dtype

# wire dtypes across ranks: representable values arrive exactly, the others within half an ulp
for dtype in ["float32", "float64"]:
    for wire, rel in [("float16", 2.0**-11), ("bfloat16", 2.0**-8)]:
        case += 1

        def exact(s):  # 8 significant bits, exponents in [-10, 5]: fits both wires
            return (rng_for("m", case, s).integers(-255, 256, (W, 3))
                    * 2.0 ** rng_for("e", case, s).integers(-10, 6, (W, 3))).astype(dtype)

        recv, _ = comm.alltoallv(exact(R), [1] * W, wire_dtype=wire)
        np.testing.assert_array_equal(recv, np.stack([exact(s)[R] for s in range(W)]))
        noisy = [data(("noisy", case, s), (W, 50), dtype) for s in range(W)]
        recv, _ = comm.alltoallv(noisy[R], [1] * W, wire_dtype=wire)
        sent = np.stack([noisy[s][R] for s in range(W)]).astype(np.float64)
        assert recv.dtype == np.dtype(dtype)
        assert np.all(np.abs(recv.astype(np.float64) - sent) <= rel * np.abs(sent)), (wire, dtype)
log(comm, "alltoallv done")

# -- allreduce --------------------------------------------------------------------------------
TOL = {"float16": 2e-3, "float32": 1e-6, "float64": 1e-12}
for op in ["sum", "max", "min", "prod"]:
    for dtype in [d for d in ALL if d != "bool"]:
        for shape in [(), (7,), (3, 5), (0,), (2, 0)]:
            case += 1
            xs = [data(("red", case, r), shape, dtype) for r in range(W)]
            out = comm.allreduce(xs[R], op=op)
            assert out.dtype == np.dtype(dtype) and out.shape == shape
            if np.dtype(dtype).kind == "f":
                ref = xs[0].astype(np.float64)
                for r in range(1, W):
                    ref = {"sum": np.add, "max": np.maximum, "min": np.minimum,
                           "prod": np.multiply}[op](ref, xs[r].astype(np.float64))
                np.testing.assert_allclose(out.astype(np.float64), ref, rtol=TOL[dtype],
                                           atol=TOL[dtype], err_msg=f"{op} {dtype} {shape}")
            else:
                ref = xs[0].copy()
                with np.errstate(over="ignore"):
                    for r in range(1, W):
                        ref = {"sum": np.add, "max": np.maximum, "min": np.minimum,
                               "prod": np.multiply}[op](ref, xs[r]).astype(dtype)
                np.testing.assert_array_equal(out, ref, err_msg=f"{op} {dtype} {shape}")
            if dtype in FLOATS and op == "sum" and shape == (7,):
                same_on_every_rank(out)
# integer wrap-around is the dtype's, as in MPI
case += 1
out = comm.allreduce(np.array([100, -100], np.int8), op="sum")
assert out.tolist() == list(np.array([100 * W, -100 * W]).astype(np.int8)), out
# wire dtypes: decoded contributions reduced in rank order, the same on every rank
for op in ["sum", "max", "min", "prod"]:
    for dtype in FLOATS:
        for wire in ["float16", "bfloat16"]:
            case += 1
            xs = [data(("wred", case, r), (4, 3), dtype) for r in range(W)]
            out = comm.allreduce(xs[R], op=op, wire_dtype=wire)
            eff = _wire.effective(wire, dtype)
            blocks = np.stack([_wire.round_trip(x, eff) for x in xs])
            ref = _common.reduce_in_order(np, blocks, ["sum", "max", "min", "prod"].index(op), dtype)
            np.testing.assert_array_equal(out, ref)
            same_on_every_rank(out)
log(comm, "allreduce done")

# -- allgather / allgatherv ---------------------------------------------------------------------
for dtype in ALL:
    for shape in [(), (4,), (2, 3), (0, 3)]:
        case += 1
        xs = [data(("ag", case, r), shape, dtype) for r in range(W)]
        out = comm.allgather(xs[R])
        assert out.shape == (W,) + shape and out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out, np.stack(xs))
    for row_shape in [(), (3,), (0,)]:
        case += 1
        xs = [data(("agv", case, r), (r,) + row_shape, dtype) for r in range(W)]  # rank 0: no rows
        out, counts = comm.allgatherv(xs[R])
        assert counts.tolist() == list(range(W)) and counts.dtype == np.int64
        np.testing.assert_array_equal(out, np.concatenate(xs))
for dtype in FLOATS:
    for wire in ["float16", "bfloat16"]:
        case += 1
        xs = [data(("agw", case, r), (3, 2), dtype) for r in range(W)]
        eff = _wire.effective(wire, dtype)
        out = comm.allgather(xs[R], wire_dtype=wire)
        np.testing.assert_array_equal(out, np.stack([_wire.round_trip(x, eff) for x in xs]))
        xs = [data(("agvw", case, r), (r + 1, 2), dtype) for r in range(W)]
        out, counts = comm.allgatherv(xs[R], wire_dtype=wire)
        np.testing.assert_array_equal(out, np.concatenate([_wire.round_trip(x, eff) for x in xs]))
log(comm, "allgather(v) done")

# -- broadcast ------------------------------------------------------------------------------------
for root in range(W):
    for dtype in ALL:
        for shape in [(), (5,), (2, 3), (0,)]:
            case += 1
            x = data(("bc", case, R), shape, dtype)  # every rank's values differ; the root's win
            out = comm.broadcast(x, root=root)
            np.testing.assert_array_equal(out, data(("bc", case, root), shape, dtype))
            assert out.dtype == np.dtype(dtype) and out.shape == shape
            if R == root and x.size:
                assert not np.shares_memory(out, x)
    for wire in ["float16", "bfloat16"]:
        case += 1
        x = data(("bcw", case, R), (6,), "float32")
        out = comm.broadcast(x, root=root, wire_dtype=wire)
        np.testing.assert_array_equal(out, _wire.round_trip(data(("bcw", case, root), (6,), "float32"), wire))
        same_on_every_rank(out)
log(comm, "broadcast done")

# -- barrier: nobody leaves before the last rank arrives --------------------------------------------
for _ in range(3):
    comm.barrier()
late = W - 1
if R == late:
    time.sleep(0.3)
t0 = time.perf_counter()
comm.barrier()
if R != late:
    assert time.perf_counter() - t0 > 0.2, "barrier returned before the late rank arrived"

# -- CUDA-family arrays (Numba device arrays; the simulator here) come back in their family --------
from numba import cuda  # noqa: E402

x = data(("cuda", R), (2 * W, 3), "float32")
d = cuda.to_device(x)
recv, counts = comm.alltoallv(d, [2] * W)
assert type(recv).__module__.startswith("numba"), type(recv)
expect = np.concatenate([data(("cuda", s), (2 * W, 3), "float32")[2 * R:2 * R + 2] for s in range(W)])
np.testing.assert_array_equal(recv.copy_to_host(), expect)
for out in (comm.allreduce(d, op="max"), comm.allgather(d), comm.allgatherv(d)[0],
            comm.broadcast(d, root=0), comm.alltoallv(d, [2] * W, wire_dtype="bfloat16")[0]):
    assert type(out).__module__.startswith("numba"), type(out)
ref = np.maximum.reduce([data(("cuda", s), (2 * W, 3), "float32") for s in range(W)])
np.testing.assert_array_equal(comm.allreduce(d, op="max").copy_to_host(), ref)

# -- "local" under mpiexec is this process alone -------------------------------------------------------
solo = hbk.dist.init("local")
assert (solo.backend, solo.rank, solo.world_size) == ("local", 0, 1)
assert solo.allreduce(np.array([R]))[0] == R

comm.barrier()
log(comm, f"{case} cases")
finish(comm)
