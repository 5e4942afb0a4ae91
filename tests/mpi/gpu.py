"""CUDA arrays across ranks (needs CuPy and a GPU; run by the ``gpu``-marked
tests of tests/test_dist_mpi.py).

``gpu.py mpi``: the MPI backend with CuPy arrays (pinned-host staging, or
direct with a CUDA-aware MPI). ``gpu.py nccl``: the NCCL backend (one GPU per
rank). Results must be CuPy arrays (Numba device arrays stay Numba) equal to
the NumPy references; work is issued on a non-default CuPy stream too.
Prints ``OK rank r`` at the end."""
import sys

import cupy
import numpy as np

import hbkernels as hbk
from hbkernels.dist import _common, _wire
from harness import data, finish

backend = sys.argv[1] if len(sys.argv) > 1 else "mpi"
comm = hbk.dist.init(backend)
R, W = comm.rank, comm.world_size
assert comm.backend == backend, comm
if backend == "nccl":
    assert cupy.cuda.Device().id == comm.device_id
    assert hbk.dist.init().backend == "nccl"  # "auto" picks NCCL with a GPU per rank
# NCCL reduces a wire dtype in that precision; MPI decodes and reduces exactly in rank order
EXACT_WIRE_REDUCE = backend != "nccl"
ALL = [d.name for d in _common.SUPPORTED_DTYPES]
OPS = ["sum", "max", "min", "prod"]


def host(x):
    assert isinstance(x, cupy.ndarray), type(x)
    return cupy.asnumpy(x)


def run_all(tag):
    case = 0
    # alltoallv: uneven counts, zeros, a rank that sends nothing
    for dtype in ALL:
        for wire in [None, "float16", "bfloat16"]:
            case += 1
            counts = [np.zeros(W, np.int64) if r == 1 else
                      np.random.default_rng([case, r]).integers(0, 5, W) for r in range(W)]
            sends = [data((tag, "a2a", case, r), (int(counts[r].sum()), 3), dtype) for r in range(W)]
            recv, rc = comm.alltoallv(cupy.asarray(sends[R]), counts[R], wire_dtype=wire)
            blocks = [sends[s][int(counts[s][:R].sum()):int(counts[s][:R + 1].sum())] for s in range(W)]
            expect = _wire.round_trip(np.concatenate(blocks), _wire.effective(_wire.normalize(wire), dtype))
            np.testing.assert_array_equal(host(recv), expect)
            assert rc.tolist() == [int(counts[s][R]) for s in range(W)]
    # allreduce: every op and dtype (int16/uint16 go through int32 on NCCL)
    for op in OPS:
        for dtype in [d for d in ALL if d != "bool"]:
            for shape in [(), (7,), (0,)]:
                case += 1
                xs = [data((tag, "red", case, r), shape, dtype) for r in range(W)]
                out = host(comm.allreduce(cupy.asarray(xs[R]), op=op))
                fn = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
                if np.dtype(dtype).kind == "f":
                    ref = xs[0].astype(np.float64)
                    for r in range(1, W):
                        ref = fn(ref, xs[r].astype(np.float64))
                    tol = 2e-3 if dtype == "float16" else 1e-5
                    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol)
                else:
                    ref = xs[0]
                    with np.errstate(over="ignore"):
                        for r in range(1, W):
                            ref = fn(ref, xs[r]).astype(dtype)
                    np.testing.assert_array_equal(out, ref)
        for wire in ["float16", "bfloat16"]:
            case += 1
            xs = [data((tag, "wred", case, r), (5, 3), "float32") for r in range(W)]
            out = host(comm.allreduce(cupy.asarray(xs[R]), op=op, wire_dtype=wire))
            blocks = np.stack([_wire.round_trip(x, wire) for x in xs])
            ref = _common.reduce_in_order(np, blocks, OPS.index(op), np.float32)
            if EXACT_WIRE_REDUCE:
                np.testing.assert_array_equal(out, ref)
            else:
                np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)
    # allgather, allgatherv (rank 0 has no rows), broadcast from every root
    for dtype in ALL:
        case += 1
        xs = [data((tag, "ag", case, r), (2, 3), dtype) for r in range(W)]
        np.testing.assert_array_equal(host(comm.allgather(cupy.asarray(xs[R]))), np.stack(xs))
        xs = [data((tag, "agv", case, r), (r, 3), dtype) for r in range(W)]
        out, counts = comm.allgatherv(cupy.asarray(xs[R]))
        np.testing.assert_array_equal(host(out), np.concatenate(xs))
        assert counts.tolist() == list(range(W))
        for root in range(W):
            x = data((tag, "bc", case, R), (4,), dtype)
            out = comm.broadcast(cupy.asarray(x), root=root)
            np.testing.assert_array_equal(host(out), data((tag, "bc", case, root), (4,), dtype))
    comm.barrier()


run_all("default-stream")
with cupy.cuda.Stream(non_blocking=True):
    run_all("own-stream")

# Numba device arrays stay Numba device arrays
from numba import cuda  # noqa: E402

x = data(("numba", R), (2 * W, 4), "float32")
out, _ = comm.alltoallv(cuda.to_device(x), [2] * W)
assert type(out).__module__.startswith("numba"), type(out)
expect = np.concatenate([data(("numba", s), (2 * W, 4), "float32")[2 * R:2 * R + 2] for s in range(W)])
np.testing.assert_array_equal(out.copy_to_host(), expect)

# a mismatch is still caught before any transfer
try:
    comm.alltoallv(cupy.zeros((2 * W, 5 if R == 1 else 4), cupy.float32), [2] * W)
except hbk.dist.CommError as e:
    assert "row shapes differ" in str(e), e
else:
    raise AssertionError("row width mismatch went through")
assert float(host(comm.allreduce(cupy.ones(1)))[0]) == W

finish(comm)
