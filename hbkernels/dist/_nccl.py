"""The NCCL backend (CuPy's ``cupy.cuda.nccl``), one GPU per rank.

Bootstrap: an :class:`~hbkernels.dist._mpi.MpiCommunicator` (the control
channel, over ``COMM_WORLD`` or the communicator given to ``init(group=...)``)
picks this rank's GPU by node-local rank (its ``Split_type(COMM_TYPE_SHARED)``),
refuses two ranks on one GPU (node-local rank >= visible devices, or two
ranks seeing the same PCI bus id), broadcasts rank 0's NCCL unique id and
every rank builds its ``NcclCommunicator``. The chosen GPU is made current.

Every call first agrees on metadata over MPI (as the MPI backend does: a
mismatch or a rank's bad input raises on every rank before any NCCL call),
then enqueues the NCCL work on the caller's current CuPy stream and waits for
an event recorded after it, polling with the same deadline; on a timeout or
an NCCL async error the NCCL communicator is aborted (``ncclCommAbort``) and
this communicator becomes unusable. ``alltoallv``/``allgatherv`` are grouped
``send``/``recv`` per peer (``groupStart``/``groupEnd``), the block to self a
device copy. ``allreduce`` reduces natively (int16/uint16 through int32,
float16 and bfloat16 wires in that precision). NumPy arrays given to an NCCL
communicator travel over the MPI control channel.

NCCL calls have deadlines too: the communicator is blocking, and NCCL
connects peers inside ``ncclCommInitRank`` and lazily inside the first
enqueues, so a dead or absent peer can block those calls forever. A daemon
worker thread per communicator makes all its NCCL calls (group state is per
thread; the worker's current device is this rank's GPU) while the caller
waits with the call's deadline. Past it the caller aborts the NCCL
communicator (``ncclCommAbort`` asks a blocked call to return; the abort runs
in a thread of its own, waited for at most 2 s, ``_ABORT_WAIT_S``, as it can
block too), marks this communicator unusable and raises :class:`CommError`. A
stuck ``ncclCommInitRank`` has no handle to abort: ``init`` raises
:class:`CommError` and leaves the thread behind.

Why a thread and not a non-blocking communicator: in CuPy 13 and 14
(``cupy_backends/cuda/libs/nccl.pyx``) ``NcclCommunicator.__init__``,
``groupStart``, ``groupEnd``, ``send``, ``recv``, ``allGather``,
``allReduce``, ``broadcast`` and ``abort`` call NCCL inside ``with nogil:``,
so a thread blocked there does not hold the GIL; but ``ncclConfig_t.blocking``
is out of reach (CuPy 13's constructor takes no config, CuPy 14's
``NcclConfig`` sets ``splitShare`` only) and ``check_status`` raises on
``ncclInProgress``.
"""
import queue
import threading
import time
import weakref

import numpy as np

from . import _common, _wire
from ._common import CommError
from ._communicator import Communicator
from .. import _dispatch
from .._machine import cupy as _cupy

_SPIN_S = 0.05
_NAP_MAX_S = 1e-3
_ASYNC_CHECK_S = 0.01
_ABORT_WAIT_S = 2.0  # an ncclCommAbort still running after this is left to its thread

# ncclDataType_t / ncclRedOp_t values of nccl.h, for CuPy builds that lack a constant
_NCCL_TYPE_VALUES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
                     "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
_NCCL_OP_VALUES = {"sum": 0, "prod": 1, "max": 2, "min": 3}
_UPCAST = {np.dtype(np.int16): np.dtype(np.int32), np.dtype(np.uint16): np.dtype(np.uint32),
           np.dtype(np.bool_): np.dtype(np.uint8)}


def _nccl():
    from cupy.cuda import nccl

    return nccl


def _nccl_type(nccl, name):
    return getattr(nccl, "NCCL_" + name.upper(), _NCCL_TYPE_VALUES[name])


def _nccl_op(nccl, name):
    return getattr(nccl, "NCCL_" + name.upper(), _NCCL_OP_VALUES[name])


def _local_gpu_plan(ctl):
    """(device id or None, reason) for this rank, looking at its node only."""
    from mpi4py import MPI

    reason, dev, bus, cp = None, None, "", None
    try:
        cp = _cupy()
        _nccl()
        ndev = int(cp.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001 - no CuPy, no NCCL, no driver
        reason, ndev = f"CuPy/NCCL not usable ({type(e).__name__}: {e})", 0
    node = ctl._comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        lrank, lsize = node.Get_rank(), node.Get_size()
        if reason is None:
            if ndev == 0:
                reason = "no GPU visible"
            elif ndev >= lsize:
                dev = lrank
            elif ndev == 1:
                dev = 0  # one visible GPU per rank (CUDA_VISIBLE_DEVICES): checked below
            else:
                reason = f"{lsize} ranks on this node but only {ndev} GPUs visible"
        if dev is not None:
            try:
                bus = str(cp.cuda.Device(dev).pci_bus_id)
            except Exception as e:  # noqa: BLE001
                reason, dev = f"cannot query GPU {dev} ({e})", None
        buses = node.allgather(bus if dev is not None else "")
    finally:
        node.Free()
    if dev is not None:
        shared = [r for r, b in enumerate(buses) if b == bus and r != lrank]
        if shared:
            reason = (f"node-local ranks {min(lrank, shared[0])} and {max(lrank, shared[0])} "
                      f"would share GPU {bus}")
            dev = None
    return dev, reason


def plan_devices(ctl, required):
    """This rank's GPU for NCCL, agreed by all ranks: ``(device, None)`` when
    every rank has a GPU of its own, else ``(None, reason)`` (``required``:
    raise RuntimeError on every rank instead)."""
    dev, reason = _local_gpu_plan(ctl)
    ok = ctl.allreduce(np.array([0 if dev is None else 1], np.int32), op="min")
    if int(ok[0]) == 1:
        return dev, None
    if not required:
        return None, reason
    text = (reason or "").encode()[:240].ljust(240)
    reasons = ctl.allgather(np.frombuffer(text, np.uint8).copy())
    for r in range(ctl.world_size):
        msg = reasons[r].tobytes().decode(errors="replace").strip()
        if msg:
            raise RuntimeError(f"backend 'nccl' needs one GPU per rank: rank {r}: {msg} "
                               "(launch one rank per GPU, or use backend='mpi')")
    raise RuntimeError("backend 'nccl' is not usable on some rank")


class _Overdue(Exception):
    """A job of a :class:`_Worker` did not finish by its deadline."""


class _Job:
    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn):
        self.fn, self.done, self.result, self.error = fn, threading.Event(), None, None


def _serve(jobs):
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            job.result = job.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            job.error = e
        job.fn = None
        job.done.set()
        del job  # holds nothing of the caller's while idle


class _Worker:
    """A daemon thread running callables one at a time for a caller that
    waits for each with a deadline. The thread ends on :meth:`close` (or when
    this object is collected) once its current job returns; a job that never
    returns keeps it forever, which a daemon thread may."""

    def __init__(self, name):
        jobs = queue.SimpleQueue()
        self._jobs = jobs
        threading.Thread(target=_serve, args=(jobs,), name=name, daemon=True).start()
        self.close = weakref.finalize(self, jobs.put, None)

    def run(self, fn, deadline):
        """``fn()``'s result, or what it raised; :class:`_Overdue` once the
        clock passes ``deadline`` (``fn`` goes on running in the thread)."""
        job = _Job(fn)
        self._jobs.put(job)
        if not job.done.wait(max(deadline - _common.now(), 0.0)):
            raise _Overdue
        if job.error is not None:
            raise job.error
        return job.result


def _late(what, timeout):
    return (f"{what}: not complete after {timeout:g} s (HBK_COMM_TIMEOUT or init(timeout=)): "
            "a peer died, hangs, or did not make the same call")


def _uid_to_bytes(uid):
    if isinstance(uid, (bytes, bytearray)):
        return b"B" + bytes(uid)
    return b"T" + np.asarray(uid, np.int64).tobytes()


def _uid_from_bytes(raw):
    kind, body = raw[:1], raw[1:]
    if kind == b"B":
        return bytes(body)
    return tuple(int(v) for v in np.frombuffer(body, np.int64))


class NcclCommunicator(Communicator):
    backend = "nccl"

    def __init__(self, timeout, ctl, device):
        super().__init__(timeout)
        self._ctl = ctl
        self.rank, self.world_size = ctl.rank, ctl.world_size
        self.device_id = int(device)
        cp, nccl = _cupy(), _nccl()
        self._cp, self._nccl = cp, nccl
        self._orphans = []
        payload = _uid_to_bytes(nccl.get_unique_id()) if self.rank == 0 else b""
        uid = _uid_from_bytes(ctl._bcast_bytes(payload, 0, "init (NCCL unique id)"))
        cp.cuda.Device(self.device_id).use()
        self._worker = _Worker(f"hbk-nccl-rank{self.rank}")

        def create():
            cp.cuda.Device(self.device_id).use()  # the worker's device, for every NCCL call
            return nccl.NcclCommunicator(self.world_size, uid, self.rank)

        what = "init (ncclCommInitRank)"
        try:
            self._comm = self._worker.run(create, _common.now() + self.timeout)
        except _Overdue:
            self._broken = _late(what, self.timeout)
            self._worker.close()
            raise CommError(self._broken + "; its thread is left behind and this communicator "
                            "is unusable") from None
        except Exception as e:  # noqa: BLE001 - NcclError, CUDA errors
            self._broken = f"{what}: NCCL error: {e}"
            self._worker.close()
            raise CommError(self._broken) from e
        try:
            self._bf16 = int(nccl.get_version()) >= 21000  # ncclBfloat16 since NCCL 2.10
        except Exception:  # noqa: BLE001
            self._bf16 = False
        self._u8 = _nccl_type(nccl, "uint8")

    def __repr__(self):
        return super().__repr__()[:-1] + f", cuda:{self.device_id}>"

    # -- protocol: metadata over MPI ------------------------------------------------------
    def _check_usable(self, op):
        super()._check_usable(op)
        if self._ctl._broken is not None:
            self._broken = self._ctl._broken
            super()._check_usable(op)

    def _local_checks(self, call):
        if call.family.is_cuda and call.family.device_id != self.device_id:
            raise ValueError(f"{call.op}: the array is on cuda:{call.family.device_id} but this "
                             f"rank's NCCL GPU is cuda:{self.device_id}")

    def _agree(self, op, call, error, deadline):
        try:
            return self._ctl._agree(op, call, error, deadline)
        finally:
            self._seq = self._ctl._seq

    def _call(self, op, x, **kw):
        # Numba device arrays ride as zero-copy CuPy views and come back as Numba arrays
        if x is not None and not isinstance(x, np.ndarray):
            try:
                family, _ = _dispatch.classify(x)
            except TypeError:
                family = None
            if family is not None and family.is_cuda and family.name == "numba":
                from numba import cuda

                out = super()._call(op, self._cp.asarray(x), **kw)
                if isinstance(out, tuple):
                    return (cuda.as_cuda_array(out[0]),) + out[1:]
                return cuda.as_cuda_array(out)
        return super()._call(op, x, **kw)

    def _on_host(self, call):
        return not (call.family is not None and call.family.is_cuda)

    # -- enqueue + wait with a deadline ---------------------------------------------------
    def _run(self, what, deadline, enqueue, keep):
        """``enqueue(stream_ptr)`` (the NCCL calls) in the worker, for the caller's
        current stream, bounded by ``deadline``; then wait for that work to finish."""
        cp = self._cp
        with cp.cuda.Device(self.device_id):
            stream = cp.cuda.get_current_stream()
            ptr = stream.ptr
            try:
                self._worker.run(lambda: enqueue(ptr), deadline)
            except _Overdue:
                self._fail(_late(what, self.timeout), keep)
            except Exception as e:  # noqa: BLE001 - NcclError, CUDA errors
                self._fail(f"{what}: NCCL error: {e}", keep)
            done = cp.cuda.Event(block=False, disable_timing=True)
            done.record(stream)
        self._wait_event(done, what, deadline, keep)

    def _wait_event(self, event, what, deadline, keep):
        clock = time.perf_counter
        spin_end = min(clock() + _SPIN_S, deadline)
        next_check = clock() + _ASYNC_CHECK_S
        nap = 2e-5
        while True:
            if event.done:
                return
            t = clock()
            if t >= next_check:
                next_check = t + _ASYNC_CHECK_S
                try:
                    self._comm.check_async_error()
                except Exception as e:  # noqa: BLE001
                    self._fail(f"{what}: NCCL async error: {e}", keep)
            if t >= deadline:
                break
            if t >= spin_end:
                time.sleep(min(nap, max(deadline - t, 0)))
                nap = min(2 * nap, _NAP_MAX_S)
        self._fail(_late(what, self.timeout), keep)

    def _fail(self, msg, keep):
        self._orphans.append(keep)  # NCCL may still read and write these: never free them
        self._broken = msg
        self._worker.close()
        aborter = _Worker(f"hbk-nccl-abort-rank{self.rank}")
        try:
            aborter.run(self._comm.abort, _common.now() + _ABORT_WAIT_S)
            state = "was aborted"
        except _Overdue:
            state = f"is being aborted (ncclCommAbort still running after {_ABORT_WAIT_S:g} s)"
        except Exception:  # noqa: BLE001
            state = "could not be aborted"
        finally:
            aborter.close()
        raise CommError(f"{msg}; the NCCL communicator {state}; this communicator is unusable")

    # -- data calls ---------------------------------------------------------------------------
    def _alltoallv(self, call, metas, deadline):
        if self._on_host(call):
            return self._ctl._alltoallv(call, metas, deadline)
        cp, nccl, comm = self._cp, self._nccl, self._comm
        if self.world_size <= _common.INLINE_COUNTS_MAX_WORLD:
            recv_counts = metas[:, _common.HEADER + self.rank].copy()
        else:
            recv_counts = self._ctl._exchange_counts(call.counts, deadline)
        send_counts = call.counts
        shape = (int(recv_counts.sum()),) + call.row_shape
        rb = call.row_bytes
        if rb == 0:
            return cp.empty(shape, call.dtype), recv_counts
        enc = cp.ascontiguousarray(call.encoded())
        recv = cp.empty(shape, call.wire_dtype)
        sdispl = _common.exclusive_cumsum(send_counts)
        rdispl = _common.exclusive_cumsum(recv_counts)
        me, u8 = self.rank, self._u8

        def enqueue(stream):
            nccl.groupStart()
            try:
                for p in range(self.world_size):
                    if p == me:
                        continue
                    if send_counts[p]:
                        comm.send(enc.data.ptr + int(sdispl[p]) * rb, int(send_counts[p]) * rb,
                                  u8, p, stream)
                    if recv_counts[p]:
                        comm.recv(recv.data.ptr + int(rdispl[p]) * rb, int(recv_counts[p]) * rb,
                                  u8, p, stream)
            finally:
                nccl.groupEnd()

        n = int(send_counts[me])
        if n:  # on the caller's stream, before the NCCL work
            recv[int(rdispl[me]):int(rdispl[me]) + n] = enc[int(sdispl[me]):int(sdispl[me]) + n]
        self._run("alltoallv", deadline, enqueue, keep=(enc, recv))
        return call.decoded(recv), recv_counts

    def _allgatherv(self, call, metas, deadline):
        if self._on_host(call):
            return self._ctl._allgatherv(call, metas, deadline)
        cp, nccl, comm = self._cp, self._nccl, self._comm
        counts = metas[:, _common.M_ROWS].copy()
        shape = (int(counts.sum()),) + call.row_shape
        rb = call.row_bytes
        if rb == 0:
            return cp.empty(shape, call.dtype), counts
        enc = cp.ascontiguousarray(call.encoded())
        out = cp.empty(shape, call.wire_dtype)
        displ = _common.exclusive_cumsum(counts)
        me, u8, mine = self.rank, self._u8, int(counts[self.rank])

        def enqueue(stream):
            nccl.groupStart()
            try:
                for p in range(self.world_size):
                    if p == me:
                        continue
                    if mine:
                        comm.send(enc.data.ptr, mine * rb, u8, p, stream)
                    if counts[p]:
                        comm.recv(out.data.ptr + int(displ[p]) * rb, int(counts[p]) * rb,
                                  u8, p, stream)
            finally:
                nccl.groupEnd()

        if mine:  # on the caller's stream, before the NCCL work
            out[int(displ[me]):int(displ[me]) + mine] = enc
        self._run("allgatherv", deadline, enqueue, keep=(enc, out))
        return call.decoded(out), counts

    def _gather_encoded(self, call, what, deadline):
        cp = self._cp
        out = cp.empty((self.world_size,) + call.shape, call.wire_dtype)
        nbytes = call.wire_dtype.itemsize * int(np.prod(call.shape, dtype=np.int64))
        if nbytes == 0:
            return out
        enc = cp.ascontiguousarray(call.encoded())
        self._run(what, deadline,
                  lambda s: self._comm.allGather(enc.data.ptr, out.data.ptr, nbytes, self._u8, s),
                  keep=(enc, out))
        return out

    def _allgather(self, call, metas, deadline):
        if self._on_host(call):
            return self._ctl._allgather(call, metas, deadline)
        return call.decoded(self._gather_encoded(call, "allgather", deadline))

    def _allreduce(self, call, metas, deadline):
        if self._on_host(call):
            return self._ctl._allreduce(call, metas, deadline)
        cp, nccl = self._cp, self._nccl
        if call.x.size == 0:
            return cp.empty(call.shape, call.dtype)
        op = _nccl_op(nccl, _common.REDUCE_OPS[call.extra])
        if call.wire is None:
            arr = cp.ascontiguousarray(call.x)
            wide = _UPCAST.get(call.dtype)
            if wide is not None:
                arr = arr.astype(wide)
            ntype = _nccl_type(nccl, arr.dtype.name)
        elif call.wire == _wire.FLOAT16 or self._bf16:
            arr = cp.ascontiguousarray(call.encoded())
            ntype = _nccl_type(nccl, "float16" if call.wire == _wire.FLOAT16 else "bfloat16")
        else:  # no ncclBfloat16 in this NCCL: gather the bf16 bits, reduce after decoding
            blocks = call.decoded(self._gather_encoded(call, "allreduce", deadline))
            return _common.reduce_in_order(cp, blocks, call.extra, call.dtype)
        out = cp.empty_like(arr)
        self._run("allreduce", deadline,
                  lambda s: self._comm.allReduce(arr.data.ptr, out.data.ptr, arr.size, ntype, op, s),
                  keep=(arr, out))
        if call.wire is not None:
            return call.decoded(out)
        return out if out.dtype == call.dtype else out.astype(call.dtype)

    def _broadcast(self, call, metas, deadline):
        if self._on_host(call):
            return self._ctl._broadcast(call, metas, deadline)
        cp = self._cp
        root = call.extra
        out = cp.empty(call.shape, call.wire_dtype)
        nbytes = call.wire_dtype.itemsize * int(np.prod(call.shape, dtype=np.int64))
        if nbytes == 0:
            return cp.empty(call.shape, call.dtype)
        src = cp.ascontiguousarray(call.encoded()) if self.rank == root else out
        self._run("broadcast", deadline,
                  lambda s: self._comm.broadcast(src.data.ptr, out.data.ptr, nbytes, self._u8,
                                                 root, s),
                  keep=(src, out))
        return call.decoded(out)
