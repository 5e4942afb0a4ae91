"""The NCCL backend's deadlines on the NCCL calls themselves.

On this CPU-only machine: fake ``cupy`` / ``cupy.cuda.nccl`` objects (host
memory standing in for the GPU, a simulated peer of rank 0 in a world of 2)
and a fake MPI control channel, injected through the modules' ``cupy()`` / ``_cupy()``
/ ``_nccl()`` helpers of :mod:`hbkernels.dist._nccl`. A fake NCCL call that
blocks waits on a gate (releasing the GIL, as CuPy's calls do) that the test
opens when it ends, so no thread outlives the test. Every test carries a
``pytest.mark.timeout``: without the deadlines they hang, and fail.

On a machine with GPUs (``gpu`` mark): 2 ranks under ``mpiexec`` run
tests/mpi/nccl_fault.py, where one rank dies before NCCL init or before a
collective; the survivor must raise CommError within HBK_COMM_TIMEOUT.
"""
import ctypes
import gc
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from mpirun import HAVE_MPI4PY, MPIEXEC, _env, _gpu_count, _hydra, mpirun

import hbkernels as hbk
from hbkernels import _dispatch, _machine
from hbkernels.dist import _common, _nccl

TIMEOUT = 0.5
LATE = 5.0  # a CommError must come well before this (seconds)
PEER_BYTE = 0x5A  # what the simulated peer sends


# -- fakes --------------------------------------------------------------------------------
class FakeDeviceArray:
    """A CuPy array stand-in (classified as CuPy by its module) over host memory."""

    __module__ = "cupy"
    device = SimpleNamespace(id=0)

    def __init__(self, a):
        self.a = a

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    size = property(lambda self: self.a.size)
    flags = property(lambda self: self.a.flags)
    data = property(lambda self: SimpleNamespace(ptr=self.a.ctypes.data))

    def __getitem__(self, key):
        return FakeDeviceArray(self.a[key])

    def __setitem__(self, key, value):
        self.a[key] = value.a if isinstance(value, FakeDeviceArray) else value

    def astype(self, dtype):
        return FakeDeviceArray(self.a.astype(dtype))


class FakeCuda:
    """``cupy.cuda``: a per-thread current device, streams, events."""

    def __init__(self):
        self.local = threading.local()
        self.event_done = True
        self.stream = SimpleNamespace(ptr=1234)

    def current(self):
        return getattr(self.local, "device", None)

    def Device(self, i):  # noqa: N802 - CuPy's name
        cuda = self

        class Device:
            def use(self):
                cuda.local.device = i

            def __enter__(self):
                self.saved = cuda.current()
                cuda.local.device = i
                return self

            def __exit__(self, *exc):
                cuda.local.device = self.saved
                return False

        return Device()

    def get_current_stream(self):
        return self.stream

    def Event(self, block=False, disable_timing=True):  # noqa: N802
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, cuda):
        self._cuda = cuda

    def record(self, stream):
        pass

    @property
    def done(self):
        return self._cuda.event_done


class FakeCupy:
    def __init__(self):
        self.cuda = FakeCuda()

    def empty(self, shape, dtype):
        return FakeDeviceArray(np.empty(shape, dtype))

    def empty_like(self, x):
        return FakeDeviceArray(np.empty_like(x.a))

    def ascontiguousarray(self, x):
        return x


class FakeNccl:
    """``cupy.cuda.nccl`` for rank 0 of 2. ``block``: names of the calls that
    wait on ``gate`` (``"init"``, ``"groupEnd"``, ``"allGather"``,
    ``"allReduce"``, ``"broadcast"``, ``"abort"``); ``calls``: (name, thread,
    current device) of every NCCL call."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.block = set()
        self.gate = threading.Event()
        self.calls = []
        self.sent = []
        self.aborted = threading.Event()
        self.comm = None

    def _enter(self, name):
        self.calls.append((name, threading.get_ident(), self.cuda.current()))
        if name in self.block:
            self.gate.wait()

    def get_unique_id(self):
        return bytes(range(128))

    def get_version(self):
        return 22005

    def groupStart(self):  # noqa: N802
        self._enter("groupStart")

    def groupEnd(self):  # noqa: N802
        self._enter("groupEnd")

    def NcclCommunicator(self, world, uid, rank):  # noqa: N802
        assert (world, uid, rank) == (2, bytes(range(128)), 0)
        self._enter("init")
        self.comm = FakeNcclComm(self)
        return self.comm


class FakeNcclComm:
    def __init__(self, nccl):
        self.nccl = nccl

    def send(self, ptr, nbytes, dtype, peer, stream):
        self.nccl._enter("send")
        self.nccl.sent.append((peer, ctypes.string_at(ptr, nbytes)))

    def recv(self, ptr, nbytes, dtype, peer, stream):
        self.nccl._enter("recv")
        ctypes.memset(ptr, PEER_BYTE, nbytes)

    def allGather(self, src, dst, nbytes, dtype, stream):  # noqa: N802
        self.nccl._enter("allGather")
        ctypes.memmove(dst, src, nbytes)
        ctypes.memset(dst + nbytes, PEER_BYTE, nbytes)

    def allReduce(self, src, dst, count, dtype, op, stream):  # noqa: N802
        self.nccl._enter("allReduce")  # the peer contributes the identity (zeros, for sum)
        ctypes.memmove(dst, src, count * {2: 4, 4: 8, 7: 4, 8: 8}[dtype])

    def broadcast(self, src, dst, nbytes, dtype, root, stream):
        self.nccl._enter("broadcast")
        ctypes.memmove(dst, src, nbytes)

    def check_async_error(self):
        pass

    def abort(self):
        self.nccl.aborted.set()
        self.nccl._enter("abort")


class FakeControl:
    """The MPI control channel of rank 0 of 2, whose peer makes the same calls."""

    rank, world_size = 0, 2
    _broken = None
    _seq = 0

    def _bcast_bytes(self, payload, root, what):
        return payload

    def _agree(self, op, call, error, deadline):
        self._seq += 1
        m = _common.meta_vector(op, call, self._seq, self.world_size, bad=error is not None)
        return np.stack([m, m])


@pytest.fixture
def fake(monkeypatch):
    cp = FakeCupy()
    nccl = FakeNccl(cp.cuda)
    monkeypatch.setattr(_nccl, "_cupy", lambda: cp)
    monkeypatch.setattr(_nccl, "_nccl", lambda: nccl)
    monkeypatch.setattr(_dispatch, "cupy", lambda: cp)
    monkeypatch.setattr(_machine, "cupy", lambda: cp)
    yield SimpleNamespace(cp=cp, nccl=nccl)
    nccl.gate.set()  # lets the blocked fake calls return: their threads end


def communicator():
    return _nccl.NcclCommunicator(TIMEOUT, FakeControl(), 0)


def device(a):
    return FakeDeviceArray(np.ascontiguousarray(a))


CALLS = {  # op -> (NCCL call that blocks, how to make the op)
    "alltoallv": ("groupEnd", lambda c: c.alltoallv(device(np.ones((4, 3), np.float32)), [2, 2])),
    "allgatherv": ("groupEnd", lambda c: c.allgatherv(device(np.ones((3, 2), np.int64)))),
    "allgather": ("allGather", lambda c: c.allgather(device(np.ones(5, np.float32)))),
    "allreduce": ("allReduce", lambda c: c.allreduce(device(np.ones(5, np.float32)))),
    "broadcast": ("broadcast", lambda c: c.broadcast(device(np.ones(5, np.float32)))),
}


def raises_comm_error(fn):
    """(CommError message, seconds taken)."""
    t0 = time.perf_counter()
    with pytest.raises(hbk.dist.CommError) as info:
        fn()
    return str(info.value), time.perf_counter() - t0


# -- the deadlines ------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_init_that_never_returns_raises_comm_error_within_the_timeout(fake):
    fake.nccl.block.add("init")
    msg, seconds = raises_comm_error(communicator)
    assert TIMEOUT * 0.9 <= seconds < LATE, seconds
    assert msg.startswith("init (ncclCommInitRank): not complete after 0.5 s"), msg
    assert "unusable" in msg, msg
    [(name, thread, dev)] = fake.nccl.calls
    assert name == "init" and thread != threading.get_ident() and dev == 0


@pytest.mark.timeout(10)
def test_init_nccl_error_is_a_comm_error(fake):
    def refuse(world, uid, rank):
        raise RuntimeError("NCCL_ERROR_INVALID_USAGE: duplicate GPU")

    fake.nccl.NcclCommunicator = refuse
    msg, seconds = raises_comm_error(communicator)
    assert msg == "init (ncclCommInitRank): NCCL error: NCCL_ERROR_INVALID_USAGE: duplicate GPU"
    assert seconds < LATE


@pytest.mark.timeout(10)
@pytest.mark.parametrize("op", list(CALLS))
def test_enqueue_that_never_returns_aborts_and_leaves_the_communicator_unusable(fake, op):
    blocking, call = CALLS[op]
    comm = communicator()
    fake.nccl.block.add(blocking)
    msg, seconds = raises_comm_error(lambda: call(comm))
    assert TIMEOUT * 0.9 <= seconds < LATE, seconds
    assert msg.startswith(f"{op}: not complete after 0.5 s"), msg
    assert "the NCCL communicator was aborted; this communicator is unusable" in msg, msg
    assert fake.nccl.aborted.is_set()
    # the next call fails at once, NumPy (MPI channel) or CUDA alike
    for again in (lambda: comm.allreduce(np.ones(2)), lambda: call(comm)):
        msg, seconds = raises_comm_error(again)
        assert "unusable after an earlier failure" in msg and seconds < 0.1, (msg, seconds)


@pytest.mark.timeout(10)
def test_an_abort_that_never_returns_does_not_hold_the_caller(fake, monkeypatch):
    monkeypatch.setattr(_nccl, "_ABORT_WAIT_S", 0.2)
    comm = communicator()
    fake.nccl.block.update({"groupEnd", "abort"})
    msg, seconds = raises_comm_error(lambda: CALLS["alltoallv"][1](comm))
    assert TIMEOUT + 0.2 * 0.9 <= seconds < LATE, seconds
    assert "ncclCommAbort still running after 0.2 s" in msg, msg
    assert fake.nccl.aborted.is_set()


@pytest.mark.timeout(10)
def test_work_that_never_finishes_on_the_gpu_aborts(fake):
    comm = communicator()
    fake.cp.cuda.event_done = False  # the kernels wait for a peer forever
    msg, seconds = raises_comm_error(lambda: CALLS["allreduce"][1](comm))
    assert TIMEOUT * 0.9 <= seconds < LATE, seconds
    assert msg.startswith("allreduce: not complete after 0.5 s"), msg
    assert fake.nccl.aborted.is_set()


@pytest.mark.timeout(10)
def test_nccl_error_in_an_enqueue_aborts(fake):
    comm = communicator()

    def fail(*args):
        raise RuntimeError("NCCL_ERROR_REMOTE_ERROR: remote process exited")

    fake.nccl.comm.allGather = fail
    msg, _ = raises_comm_error(lambda: CALLS["allgather"][1](comm))
    assert msg.startswith("allgather: NCCL error: NCCL_ERROR_REMOTE_ERROR"), msg
    assert fake.nccl.aborted.is_set()


# -- calls that complete ------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_calls_that_complete_return_their_data(fake):
    comm = communicator()
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    recv, counts = comm.alltoallv(device(x), [1, 3])
    assert counts.tolist() == [1, 1]  # the peer sends its block for rank 0: 1 row
    assert recv.a[0].tolist() == x[0].tolist()  # the block to self
    assert recv.a[1:].view(np.uint8).tolist() == [[PEER_BYTE] * 12]
    assert fake.nccl.sent == [(1, x[1:].tobytes())]
    out, counts = comm.allgatherv(device(x[:2]))
    assert counts.tolist() == [2, 2] and out.a[:2].tolist() == x[:2].tolist()
    assert (out.a[2:].view(np.uint8) == PEER_BYTE).all()
    assert comm.allreduce(device(x)).a.tolist() == x.tolist()
    assert comm.broadcast(device(x[0])).a.tolist() == x[0].tolist()
    gathered = comm.allgather(device(x[0]))
    assert gathered.a[0].tolist() == x[0].tolist()
    # NCCL calls happen in one thread (group state is per thread), not the caller's, on its GPU
    threads = {thread for _, thread, _ in fake.nccl.calls}
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert {dev for _, _, dev in fake.nccl.calls} == {0}
    assert fake.cp.cuda.current() == 0  # the caller's GPU is made current too
    assert not fake.nccl.aborted.is_set()


@pytest.mark.timeout(10)
def test_a_late_enqueue_within_the_timeout_is_waited_for(fake):
    comm = communicator()
    fake.nccl.block.add("groupEnd")
    threading.Timer(TIMEOUT / 2, fake.nccl.gate.set).start()
    recv, _ = CALLS["alltoallv"][1](comm)
    assert recv.shape == (4, 3) and not fake.nccl.aborted.is_set()


def test_the_worker_thread_ends_with_its_communicator(fake):
    comm = communicator()
    [thread] = [t for t in threading.enumerate() if t.name == "hbk-nccl-rank0"]
    del comm
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


# -- real GPUs: a rank dies --------------------------------------------------------------------
needs_fault_launcher = pytest.mark.skipif(
    not (MPIEXEC and HAVE_MPI4PY and _hydra()),
    reason="drives MPICH's hydra (-disable-auto-cleanup) with mpi4py")


def _run_fault(mode):
    rc, out, seconds = mpirun(2, "nccl_fault.py", mode, launcher=["-disable-auto-cleanup"],
                              env=_env(HBK_COMM_TIMEOUT=5, NUMBA_ENABLE_CUDASIM=0), timeout=120)
    assert "DYING rank 1" in out, out
    assert "OK rank 1" not in out, out
    assert "OK rank 0" in out and "rank 0: CommError after" in out, out
    assert rc != 0, out  # the victim's exit status
    assert seconds < 90, seconds


@pytest.mark.gpu
@needs_fault_launcher
def test_nccl_init_without_its_peer_raises_comm_error():
    """Rank 1 takes the NCCL unique id and dies instead of ncclCommInitRank;
    only rank 0 touches a GPU, so one GPU is enough."""
    if _gpu_count() < 1:
        pytest.skip("needs CuPy and a GPU")
    _run_fault("init")


@pytest.mark.gpu
@needs_fault_launcher
@pytest.mark.parametrize("mode", ["connect", "transfer"])
def test_nccl_peer_dying_before_a_collective_raises_comm_error(mode):
    """Rank 1 dies after the metadata exchange of an alltoallv: before NCCL
    ever connected the two ranks (``connect``), or after a first alltoallv did
    (``transfer``)."""
    if _gpu_count() < 2:
        pytest.skip("the NCCL backend needs one GPU per rank: 2 GPUs")
    _run_fault(mode)
