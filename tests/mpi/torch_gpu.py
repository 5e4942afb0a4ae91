"""Under ``torchrun --nproc-per-node 2`` on a machine with two GPUs
(tests/test_dist_torch.py, ``gpu``): ``init()`` gives the torch backend with
this rank's GPU (``LOCAL_RANK``) and CuPy arrays travel over NCCL; every
collective returns CuPy arrays equal to the NumPy reference. Prints ``OK rank
r`` at the end."""
import os

import cupy as cp
import numpy as np

import hbkernels as hbk
from harness import data, finish

comm = hbk.dist.init()
R, W = comm.rank, comm.world_size
assert comm.backend == "torch" and f"cuda:{os.environ['LOCAL_RANK']}" in repr(comm), comm
assert cp.cuda.Device().id == int(os.environ["LOCAL_RANK"])

for dtype in ("float32", "int64", "float16"):
    xs = [data(("g", dtype, r), (3, 2), dtype) for r in range(W)]
    out = comm.allgather(cp.asarray(xs[R]))
    assert isinstance(out, cp.ndarray)
    np.testing.assert_array_equal(out.get(), np.stack(xs))
    red = comm.allreduce(cp.asarray(xs[R]), op="max")
    assert isinstance(red, cp.ndarray)
    np.testing.assert_array_equal(red.get(), np.max(np.stack(xs), axis=0))
    for root in range(W):
        np.testing.assert_array_equal(comm.broadcast(cp.asarray(xs[R]), root=root).get(), xs[root])
    vs = [data(("v", dtype, r), (r, 2), dtype) for r in range(W)]
    allv, counts = comm.allgatherv(cp.asarray(vs[R]))
    assert counts.tolist() == list(range(W))
    np.testing.assert_array_equal(allv.get(), np.concatenate(vs))
    cnt = [[(s + 2 * d) % 3 for d in range(W)] for s in range(W)]
    sends = [data(("a", dtype, s), (sum(cnt[s]), 2), dtype) for s in range(W)]
    recv, rc = comm.alltoallv(cp.asarray(sends[R]), cnt[R])
    assert isinstance(recv, cp.ndarray) and rc.tolist() == [cnt[s][R] for s in range(W)]
    np.testing.assert_array_equal(
        recv.get(), np.concatenate([sends[s][sum(cnt[s][:R]):sum(cnt[s][:R + 1])] for s in range(W)]))
# NumPy arrays still travel over gloo
assert comm.allreduce(np.array([1.0])).tolist() == [float(W)]
comm.barrier()
finish(comm)
