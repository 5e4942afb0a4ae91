"""The MPI backend (mpi4py, upper-case buffer calls).

Every collective is non-blocking (Iallgather, Ialltoallv, Iallreduce, Ibcast,
...) and polled with ``Test()`` until the call's deadline
(:func:`hbkernels.dist._common.wait_for`: busy for the first 50 ms, then
short naps each followed by a burst of polls, yielding the CPU now and then).
The communicator is a duplicate of ``COMM_WORLD`` (or of the communicator
given to ``init(group=...)``) with ``ERRORS_RETURN``, so MPI errors surface
as exceptions and become :class:`CommError`. On a timeout the pending request
and its buffers are kept alive forever (MPI may still write into them) and the
communicator is marked unusable.

Rows travel as one contiguous MPI datatype of the row's bytes, so counts and
displacements are in rows (no int32 byte-count overflow for large blocks).
CUDA arrays go to MPI directly when the library is CUDA-aware
(``MPI.Query_cuda_support()``, or ``HBK_MPI_CUDA_AWARE=1``), else through
pinned host buffers (``cupyx.empty_pinned``); Numba device arrays go through
the host.
"""
import os

import numpy as np
from mpi4py import MPI

from . import _common
from ._common import CommError
from ._communicator import Communicator

_MAX_CACHED_TYPES = 64

_REDUCE_OPS = (MPI.SUM, MPI.MAX, MPI.MIN, MPI.PROD)
_REDUCE_TYPES = {
    np.dtype(np.int8): MPI.INT8_T, np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.int16): MPI.INT16_T, np.dtype(np.uint16): MPI.UINT16_T,
    np.dtype(np.int32): MPI.INT32_T, np.dtype(np.uint32): MPI.UINT32_T,
    np.dtype(np.int64): MPI.INT64_T, np.dtype(np.uint64): MPI.UINT64_T,
    np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE,
}


def cuda_aware():
    """Whether CUDA device buffers may be handed to this MPI library."""
    env = os.environ.get("HBK_MPI_CUDA_AWARE", "").strip()
    if env in ("0", "1"):
        return env == "1"
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:  # noqa: BLE001 - not implemented by this MPI
            return False
    return False


class MpiCommunicator(Communicator):
    backend = "mpi"

    def __init__(self, timeout, base=None):
        super().__init__(timeout)
        base = MPI.COMM_WORLD if base is None else base
        self.rank = base.Get_rank()
        self.world_size = base.Get_size()
        self._orphans = []   # (request, buffers) of calls abandoned on a timeout
        self._types = {}
        deadline = _common.now() + self.timeout
        comm, req = base.Idup()
        self._comm = comm
        what = f"init (duplicating {'COMM_WORLD' if base is MPI.COMM_WORLD else 'the group'})"
        self._wait(req, what, deadline, keep=(comm,))
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.cuda_aware = cuda_aware()

    # -- waiting with a deadline ----------------------------------------------------
    def _wait(self, req, what, deadline, keep=()):
        try:
            if _common.wait_for(req.Test, deadline):
                return
        except MPI.Exception as e:
            self._fail(f"{what}: MPI error: {e.Get_error_string().strip()}", req, keep)
        self._fail(f"{what}: not complete after {self.timeout:g} s (HBK_COMM_TIMEOUT or "
                   "init(timeout=)): a peer died, hangs, or did not make the same call",
                   req, keep)

    def _fail(self, msg, req, keep):
        self._orphans.append((req, keep))  # MPI may still write into these: never free them
        self._broken = msg
        raise CommError(msg + "; this communicator is now unusable")

    # -- buffers: host, CUDA-aware device, or pinned staging ------------------------------
    def _mode(self, call):
        if call.xp is np:
            return "host"
        return "device" if self.cuda_aware else "staged"

    def _outbound(self, call, arr):
        """A buffer MPI can read holding ``arr`` (compute space)."""
        mode = self._mode(call)
        if mode == "host":
            return np.ascontiguousarray(arr)
        cp = call.xp
        arr = cp.ascontiguousarray(arr)
        if mode == "device":
            cp.cuda.get_current_stream().synchronize()
            return arr
        import cupyx

        buf = cupyx.empty_pinned(arr.shape, arr.dtype)
        arr.get(out=buf)  # blocking copy on the current stream
        return buf

    def _empty(self, call, shape, dtype):
        mode = self._mode(call)
        if mode == "host":
            return np.empty(shape, dtype)
        if mode == "device":
            return call.xp.empty(shape, dtype)
        import cupyx

        return cupyx.empty_pinned(shape, dtype)

    def _inbound(self, call, buf):
        """A received buffer back in compute space."""
        if self._mode(call) != "staged":
            return buf
        cp = call.xp
        out = cp.asarray(buf)
        cp.cuda.get_current_stream().synchronize()  # buf (pinned) may be reused once freed
        return out

    def _bytes_type(self, nbytes):
        t = self._types.get(nbytes)
        if t is None:
            if len(self._types) >= _MAX_CACHED_TYPES:
                for old in self._types.values():
                    old.Free()
                self._types.clear()
            t = MPI.BYTE.Create_contiguous(int(nbytes)).Commit()
            self._types[nbytes] = t
        return t

    # -- protocol -------------------------------------------------------------------------
    def _agree(self, op, call, error, deadline):
        m = _common.meta_vector(op, call, self._next_seq(), self.world_size,
                                bad=error is not None)
        out = np.empty((self.world_size, m.shape[0]), np.int64)
        req = self._comm.Iallgather([m, MPI.INT64_T], [out, MPI.INT64_T])
        self._wait(req, f"{op} (metadata exchange)", deadline, keep=(m, out))
        return out

    def _exchange_counts(self, counts, deadline):
        out = np.empty(self.world_size, np.int64)
        send = np.ascontiguousarray(counts, np.int64)
        req = self._comm.Ialltoall([send, MPI.INT64_T], [out, MPI.INT64_T])
        self._wait(req, "alltoallv (counts exchange)", deadline, keep=(send, out))
        return out

    # -- data calls (after agreement) -------------------------------------------------------
    def _alltoallv(self, call, metas, deadline):
        if self.world_size <= _common.INLINE_COUNTS_MAX_WORLD:
            recv_counts = metas[:, _common.HEADER + self.rank].copy()
        else:
            recv_counts = self._exchange_counts(call.counts, deadline)
        rc = recv_counts.tolist()
        shape = (sum(rc),) + call.row_shape
        row_bytes = call.row_bytes
        if row_bytes == 0:  # the same on every rank (row shapes agree): nothing to move
            return call.xp.empty(shape, call.dtype), recv_counts
        sbuf = self._outbound(call, call.encoded())
        rbuf = self._empty(call, shape, call.wire_dtype)
        rt = self._bytes_type(row_bytes)
        sc = call.counts.tolist()
        send_spec = (sc, _common.exclusive_cumsum(sc))
        recv_spec = (rc, _common.exclusive_cumsum(rc))
        req = self._comm.Ialltoallv([sbuf, send_spec, rt], [rbuf, recv_spec, rt])
        self._wait(req, "alltoallv", deadline, keep=(sbuf, rbuf, send_spec, recv_spec))
        return call.decoded(self._inbound(call, rbuf)), recv_counts

    def _allgatherv(self, call, metas, deadline):
        counts = metas[:, _common.M_ROWS].copy()
        shape = (int(counts.sum()),) + call.row_shape
        row_bytes = call.row_bytes
        if row_bytes == 0:
            return call.xp.empty(shape, call.dtype), counts
        sbuf = self._outbound(call, call.encoded())
        rbuf = self._empty(call, shape, call.wire_dtype)
        rt = self._bytes_type(row_bytes)
        displ = _common.exclusive_cumsum(counts)
        req = self._comm.Iallgatherv([sbuf, call.shape[0], rt], [rbuf, (counts, displ), rt])
        self._wait(req, "allgatherv", deadline, keep=(sbuf, rbuf, counts, displ))
        return call.decoded(self._inbound(call, rbuf)), counts

    def _gather_encoded(self, call, what, deadline):
        """[world, *shape] of every rank's encoded input, in compute space."""
        shape = (self.world_size,) + call.shape
        block = call.wire_dtype.itemsize * int(np.prod(call.shape, dtype=np.int64))
        if block == 0:
            return call.xp.empty(shape, call.wire_dtype)
        sbuf = self._outbound(call, call.encoded())
        rbuf = self._empty(call, shape, call.wire_dtype)
        bt = self._bytes_type(block)
        req = self._comm.Iallgather([sbuf, 1, bt], [rbuf, 1, bt])
        self._wait(req, what, deadline, keep=(sbuf, rbuf))
        return self._inbound(call, rbuf)

    def _allgather(self, call, metas, deadline):
        return call.decoded(self._gather_encoded(call, "allgather", deadline))

    def _allreduce(self, call, metas, deadline):
        mpitype = _REDUCE_TYPES.get(call.dtype)
        if call.wire is None and mpitype is not None:
            if call.x.size == 0:
                return call.xp.empty(call.shape, call.dtype)
            sbuf = self._outbound(call, call.x)
            rbuf = self._empty(call, call.shape, call.dtype)
            req = self._comm.Iallreduce([sbuf, mpitype], [rbuf, mpitype], _REDUCE_OPS[call.extra])
            self._wait(req, "allreduce", deadline, keep=(sbuf, rbuf))
            return self._inbound(call, rbuf)
        # float16 data or a wire dtype: gather the encoded inputs, decode, reduce in rank order
        blocks = call.decoded(self._gather_encoded(call, "allreduce", deadline))
        return _common.reduce_in_order(call.xp, blocks, call.extra, call.dtype)

    def _broadcast(self, call, metas, deadline):
        root = call.extra
        nbytes = call.wire_dtype.itemsize * int(np.prod(call.shape, dtype=np.int64))
        if self.rank == root:
            enc = call.encoded()
            if nbytes:
                sbuf = self._outbound(call, enc)
                bt = self._bytes_type(nbytes)
                req = self._comm.Ibcast([sbuf, 1, bt], root=root)
                self._wait(req, "broadcast", deadline, keep=(sbuf,))
            return call.x.copy() if call.wire is None else call.decoded(enc)
        if not nbytes:
            return call.xp.empty(call.shape, call.dtype)
        rbuf = self._empty(call, call.shape, call.wire_dtype)
        bt = self._bytes_type(nbytes)
        req = self._comm.Ibcast([rbuf, 1, bt], root=root)
        self._wait(req, "broadcast", deadline, keep=(rbuf,))
        return call.decoded(self._inbound(call, rbuf))

    # -- helpers for the NCCL bootstrap -----------------------------------------------------
    def _bcast_bytes(self, payload, root, what):
        """``payload`` (bytes, on ``root``) on every rank, with the timeout."""
        deadline = _common.now() + self.timeout
        n = np.array([len(payload) if self.rank == root else 0], np.int64)
        req = self._comm.Ibcast([n, MPI.INT64_T], root=root)
        self._wait(req, what, deadline, keep=(n,))
        buf = (np.frombuffer(payload, np.uint8).copy() if self.rank == root
               else np.empty(int(n[0]), np.uint8))
        if buf.size:
            req = self._comm.Ibcast([buf, MPI.BYTE], root=root)
            self._wait(req, what, deadline, keep=(buf,))
        return buf.tobytes()
