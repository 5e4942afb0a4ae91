"""A rank dies around NCCL; the survivor raises CommError within
HBK_COMM_TIMEOUT (5 s) plus the bounded abort (needs CuPy and GPUs; run by
the ``gpu``-marked tests of tests/test_dist_nccl_deadline.py on 2 ranks).

``nccl_fault.py init``: rank 1 takes the NCCL unique id and exits instead of
calling ncclCommInitRank; rank 0 raises CommError from its NCCL init. Only
rank 0 touches a GPU: one GPU is enough.
``nccl_fault.py connect``: both ranks build the NCCL communicator (one GPU
each); rank 1 exits inside the first CUDA alltoallv, after the metadata
exchange, before NCCL ever connected the two ranks.
``nccl_fault.py transfer``: the same, after a first alltoallv connected them.

Run under ``mpiexec -disable-auto-cleanup`` so that the launcher does not kill
the survivor when the victim exits. The survivor prints ``rank 0: CommError
after ...`` and ``OK rank 0``, and leaves with ``os._exit(0)``.
"""
import os
import sys

import cupy

import hbkernels as hbk
from hbkernels.dist import _nccl
from hbkernels.dist._mpi import MpiCommunicator
from harness import Timer, finish

mode = sys.argv[1] if len(sys.argv) > 1 else "init"
assert mode in ("init", "connect", "transfer"), mode
TIMEOUT = float(os.environ["HBK_COMM_TIMEOUT"])
VICTIM = 1


def die(*args, **kwargs):
    print(f"DYING rank {VICTIM}", flush=True)
    os._exit(3)


def expect_comm_error(rank, what, fn):
    with Timer() as t:
        try:
            fn()
        except hbk.dist.CommError as e:
            err = str(e)
        else:
            raise AssertionError(f"rank {rank}: {what} completed although rank {VICTIM} is dead")
    print(f"rank {rank}: CommError after {t.s:.2f} s: {err}", flush=True)
    assert t.s <= TIMEOUT + _nccl._ABORT_WAIT_S + 1.0, f"CommError after {t.s:.2f} s"
    assert err.startswith(what), err


if mode == "init":
    ctl = MpiCommunicator(TIMEOUT)
    assert ctl.world_size == 2, ctl
    if ctl.rank == VICTIM:
        from cupy.cuda import nccl

        nccl.NcclCommunicator = die  # called by NcclCommunicator.__init__ after the id broadcast
    device = ctl.rank % cupy.cuda.runtime.getDeviceCount()
    expect_comm_error(ctl.rank, "init (ncclCommInitRank)",
                      lambda: _nccl.NcclCommunicator(TIMEOUT, ctl, device))
    finish(ctl, hard=True)  # a rank is dead: MPI_Finalize would wait for it

comm = hbk.dist.init("nccl")
R, W = comm.rank, comm.world_size
assert comm.backend == "nccl" and W == 2 and comm.timeout == TIMEOUT, comm
x = cupy.ones((2 * W, 4), cupy.float32)
if mode == "transfer":
    recv, _ = comm.alltoallv(x, [2] * W)  # NCCL connects the two ranks here
    assert float(recv.sum()) == recv.size
if R == VICTIM:
    comm._alltoallv = die  # after the metadata exchange, before any NCCL call
expect_comm_error(R, "alltoallv", lambda: comm.alltoallv(x, [2] * W))

# the communicator is now unusable: later calls fail at once
with Timer() as t:
    try:
        comm.allreduce(cupy.ones(1))
    except hbk.dist.CommError as e:
        assert "unusable" in str(e), e
    else:
        raise AssertionError("a broken communicator accepted a call")
assert t.s < 0.5, t.s

finish(comm, hard=True)
