"""Backend selection under mpiexec, without a GPU: "auto" gives "mpi" when CuPy
is missing, "nccl" is refused on every rank with a clear error, and the GPU
plan (one GPU per rank by node-local rank, no two ranks on one GPU) is
checked against a fake CuPy that reports chosen device counts and PCI bus
ids. Prints ``OK rank r`` at the end."""
import importlib.util
import sys
import types

import numpy as np

import hbkernels as hbk
from hbkernels.dist import _nccl
from harness import finish

comm = hbk.dist.init()
R, W = comm.rank, comm.world_size
HAVE_CUPY = importlib.util.find_spec("cupy") is not None

if not HAVE_CUPY:
    assert comm.backend == "mpi", comm
    try:
        hbk.dist.init("nccl")
    except RuntimeError as e:
        assert "backend 'nccl' needs one GPU per rank: rank 0: CuPy/NCCL not usable" in str(e), e
    else:
        raise AssertionError("init('nccl') worked without CuPy")
    mpi = hbk.dist.init("mpi")
    assert (mpi.backend, mpi.rank, mpi.world_size) == ("mpi", R, W)


def fake_cupy(ndev, bus_of):
    """Install a fake ``cupy`` whose runtime reports ``ndev`` GPUs and whose
    ``Device(d).pci_bus_id`` is ``bus_of(d)``."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")

    class Device:
        def __init__(self, d):
            assert 0 <= d < ndev, d
            self.pci_bus_id = bus_of(d)

    cuda.runtime = types.SimpleNamespace(getDeviceCount=lambda: ndev)
    cuda.Device = Device
    cuda.nccl = nccl
    cupy.cuda = cuda
    sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl})


def plan(ndev, bus_of, required=False):
    saved = {k: sys.modules.get(k) for k in ("cupy", "cupy.cuda", "cupy.cuda.nccl")}
    fake_cupy(ndev, bus_of)
    try:
        return _nccl.plan_devices(comm, required)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def refused(ndev, bus_of, match):
    try:
        plan(ndev, bus_of, required=True)
    except RuntimeError as e:
        assert match in str(e), str(e)
    else:
        raise AssertionError("plan_devices accepted a bad GPU layout")


# one GPU per rank on this node: rank r takes GPU r
assert plan(W, lambda d: f"0000:{d:02x}:00.0") == (R, None)
# one visible GPU per rank (CUDA_VISIBLE_DEVICES), distinct physical GPUs: fine
assert plan(1, lambda d: f"0000:{R:02x}:00.0") == (0, None)
# one GPU shared by every rank: refused ("auto" falls back to MPI)
dev, reason = plan(1, lambda d: "0000:3b:00.0")
assert dev is None and "would share GPU 0000:3b:00.0" in reason, reason
refused(1, lambda d: "0000:3b:00.0", "rank 0: node-local ranks 0 and 1 would share GPU 0000:3b:00.0")
# more ranks than GPUs
if W >= 3:
    dev, reason = plan(W - 1, lambda d: f"0000:{d:02x}:00.0")
    assert dev is None and f"{W} ranks on this node but only {W - 1} GPUs visible" in reason
# one rank without a GPU: nobody uses NCCL, and "nccl" names that rank
no_gpu = W - 1
dev, reason = plan(0 if R == no_gpu else W, lambda d: f"0000:{d:02x}:00.0")
assert dev is None, dev
refused(0 if R == no_gpu else W, lambda d: f"0000:{d:02x}:00.0", f"rank {no_gpu}: no GPU visible")

assert comm.allreduce(np.array([1]))[0] == W  # the control channel still works
finish(comm)
