"""The torch.distributed backend: the collectives over a ``torch.distributed``
process group (gloo for NumPy arrays; NCCL for CUDA arrays where every rank
has a GPU of its own).

Groups. :func:`open_world` joins the default group when torch.distributed is
already initialised, else makes it with ``init_process_group("gloo",
init_method="env://", timeout=<the communicator's timeout>)`` from the
variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``); with no launcher it makes a world of one over an in-process
``HashStore``. On the world it made, the ranks then agree (one allreduce, one
allgather of GPU UUIDs) whether each has a GPU of its own (``LOCAL_RANK`` <
visible GPUs, or one visible GPU per rank, no GPU shared by two ranks); if
so, that GPU is made current (in torch, and in CuPy when installed) and a
second group, ``new_group(backend="nccl")``, carries CUDA arrays (NCCL
connects lazily, on the first CUDA call); later communicators over that
world share it. :func:`join` uses a given group, which must have a CPU
backend (``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ...): the metadata always
travel as CPU tensors; when its CUDA backend is NCCL it also carries CUDA
arrays, on the GPU current at ``join``. CUDA arrays with no NCCL group travel
through host memory.

Arrays become tensors without copies: NumPy through ``torch.from_numpy``,
CuPy through DLPack (``torch.from_dlpack``, which orders torch's stream after
CuPy's current one). Rows travel as bytes (uint8 tensors): ``alltoallv`` is
``all_to_all_single`` with byte split sizes, ``allgatherv`` an ``all_gather``
of blocks padded to the largest row count, ``allgather`` and ``broadcast``
move the encoded bytes. ``allreduce`` reduces natively for int8, uint8,
int32, int64, float32 and float64 without a wire dtype; other dtypes and wire
dtypes gather the encoded inputs and reduce them in rank order, as the MPI
backend does.

Every call is issued with ``async_op=True`` and its ``Work`` polled
(``is_completed``, :func:`hbkernels.dist._common.wait_for`) until the call's
deadline: a peer that died (gloo reports the closed connection at once) or
hangs raises :class:`CommError` within the timeout. The communicator is then
unusable, and the abandoned call's buffers are kept alive (the group may still
write into them).
"""
import atexit
import datetime
import os

import numpy as np
import torch
import torch.distributed as tdist

from . import _common
from ._common import CommError
from ._communicator import Communicator

_NATIVE_REDUCE = {np.dtype(n): getattr(torch, n)
                  for n in ("int8", "uint8", "int32", "int64", "float32", "float64")}
_REDUCE_OPS = ("SUM", "MAX", "MIN", "PRODUCT")  # in _common.REDUCE_OPS order
_UUID_BYTES = 64
# the default group open_world made, and the NCCL group (or None) and GPU it chose for it
_OWN_WORLD = {"pg": None, "cuda_pg": None, "device_id": None}


def _line(exc):
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def device_backends(pg):
    """``{"cpu": name, "cuda": name}`` of process group ``pg`` (the device types it
    has a backend for), from ``torch.distributed.get_backend``."""
    name = str(tdist.get_backend(pg)).lower()
    if ":" in name:  # "cpu:gloo,cuda:nccl"
        return dict(part.strip().split(":", 1) for part in name.split(",") if ":" in part)
    if name == "nccl":
        return {"cuda": name}
    return {"cpu": name, "cuda": name}


def _env_text():
    return ", ".join(f"{v}={os.environ.get(v, '<unset>')}"
                     for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _init_default_group(timeout):
    world = int(os.environ.get("WORLD_SIZE", "").strip() or 1)
    addr = os.environ.get("MASTER_ADDR", "").strip() and os.environ.get("MASTER_PORT", "").strip()
    span = datetime.timedelta(seconds=timeout)
    try:
        if world == 1 and not addr:
            tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1,
                                     timeout=span)
        else:
            tdist.init_process_group("gloo", init_method="env://", timeout=span)
    except Exception as e:  # noqa: BLE001 - DistNetworkError, DistStoreError, RuntimeError
        raise CommError(f"torch.distributed could not connect the ranks of this launch "
                        f"(torchrun or its env:// variables: {_env_text()}) within "
                        f"{timeout:g} s: {_line(e)}") from e


def open_world(timeout):
    """A communicator over the default group of torch.distributed (made here from
    torchrun's environment when it does not exist yet)."""
    if not tdist.is_available():
        raise RuntimeError("backend 'torch' needs torch.distributed, which this PyTorch build lacks")
    if tdist.is_initialized():
        return join(tdist.group.WORLD, timeout)
    _init_default_group(timeout)
    atexit.register(_destroy_own_world)
    comm = TorchCommunicator(timeout, tdist.group.WORLD)
    comm._plan_gpus()
    _OWN_WORLD.update(pg=tdist.group.WORLD, cuda_pg=comm._cuda_pg, device_id=comm.device_id)
    return comm


def _destroy_own_world():
    """At exit, end the default group made here (gloo's threads otherwise meet the
    interpreter's teardown and abort the process now and then)."""
    if _OWN_WORLD["pg"] is not None and tdist.is_initialized() and \
            tdist.group.WORLD is _OWN_WORLD["pg"]:
        try:
            tdist.destroy_process_group()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
        _OWN_WORLD.update(pg=None, cuda_pg=None, device_id=None)


def join(pg, timeout):
    """A communicator over the existing process group ``pg`` (no new group is made)."""
    if not tdist.is_available() or not tdist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call "
                         "torch.distributed.init_process_group first, or pass no group)")
    if not isinstance(pg, tdist.ProcessGroup) or tdist.get_rank(pg) < 0:  # NON_GROUP_MEMBER
        raise ValueError("group: this process is not a member of the given process group")
    kinds = device_backends(pg)
    if "cpu" not in kinds:
        raise ValueError(f"group: the process group has no CPU backend ({tdist.get_backend(pg)!r}); "
                         "hbk.dist needs one for its metadata: create it with backend='gloo' or "
                         "'cpu:gloo,cuda:nccl'")
    comm = TorchCommunicator(timeout, pg)
    if pg is _OWN_WORLD["pg"]:  # the world open_world made: its NCCL group too
        comm._cuda_pg, comm.device_id = _OWN_WORLD["cuda_pg"], _OWN_WORLD["device_id"]
    elif kinds.get("cuda") == "nccl" and torch.cuda.is_available():
        comm._cuda_pg = pg
        comm.device_id = torch.cuda.current_device()
    return comm


def _local_gpu():
    """(device id or None, reason) for this rank, from its own view."""
    try:
        if not torch.cuda.is_available():
            return None, "no GPU visible to PyTorch"
        ndev = torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001 - broken driver
        return None, f"CUDA not usable ({_line(e)})"
    lrank = int(os.environ.get("LOCAL_RANK", "").strip() or 0)
    lsize = int(os.environ.get("LOCAL_WORLD_SIZE", "").strip() or 1)
    if ndev >= lsize and lrank < ndev:
        return lrank, None
    if ndev == 1:
        return 0, None  # one visible GPU per rank (CUDA_VISIBLE_DEVICES): UUIDs checked by the caller
    return None, f"{lsize} ranks on this node but only {ndev} GPUs visible"


class TorchCommunicator(Communicator):
    backend = "torch"

    def __init__(self, timeout, pg):
        super().__init__(timeout)
        self._pg = pg
        self._cuda_pg = None      # a group carrying CUDA tensors (NCCL), or None: staged
        self.device_id = None
        self.rank = tdist.get_rank(pg)
        self.world_size = tdist.get_world_size(pg)
        self._orphans = []

    def __repr__(self):
        if self.device_id is None:
            return super().__repr__()
        return super().__repr__()[:-1] + f", cuda:{self.device_id}>"

    def _plan_gpus(self):
        """NCCL for CUDA arrays when every rank has a GPU of its own (a collective)."""
        dev, _ = _local_gpu()
        uuid = b""
        if dev is not None:
            try:
                uuid = str(torch.cuda.get_device_properties(dev).uuid).encode()[:_UUID_BYTES]
            except Exception:  # noqa: BLE001
                dev = None
        ok = self.allreduce(np.array([0 if dev is None else 1], np.int32), op="min")
        if int(ok[0]) != 1:
            return
        uuids = self.allgather(np.frombuffer(uuid.ljust(_UUID_BYTES), np.uint8).copy())
        if len({u.tobytes() for u in uuids}) != self.world_size:
            return  # two ranks would share a GPU: CUDA arrays travel through the host
        torch.cuda.set_device(dev)
        try:
            import cupy
        except ImportError:
            pass
        else:
            cupy.cuda.Device(dev).use()
        self._cuda_pg = tdist.new_group(backend="nccl",
                                        timeout=datetime.timedelta(seconds=self.timeout))
        self.device_id = dev

    def _local_checks(self, call):
        if (call.xp is not np and self._cuda_pg is not None
                and call.family.device_id != self.device_id):
            raise ValueError(f"{call.op}: the array is on cuda:{call.family.device_id} but this "
                             f"rank's GPU is cuda:{self.device_id}")

    # -- issuing and waiting with a deadline --------------------------------------------------
    def _run(self, what, deadline, issue, keep):
        """``issue()`` (a torch.distributed call with ``async_op=True``), then
        wait for its Work until ``deadline``."""
        try:
            work = issue()
            if _common.wait_for(work.is_completed, deadline):
                work.wait()  # raises what the group reported
                return
        except Exception as e:  # noqa: BLE001 - RuntimeError, DistError
            self._fail(f"{what}: torch.distributed error: {_line(e)}", keep)
        self._fail(f"{what}: not complete after {self.timeout:g} s (HBK_COMM_TIMEOUT or "
                   "init(timeout=)): a peer died, hangs, or did not make the same call", keep)

    def _fail(self, msg, keep):
        self._orphans.append(keep)  # the group may still write into these: never free them
        self._broken = msg
        raise CommError(msg + "; this communicator is now unusable")

    # -- buffers: host, CUDA (NCCL), or CUDA staged through the host ---------------------------
    def _mode(self, call):
        if call.xp is np:
            return "host"
        return "device" if self._cuda_pg is not None else "staged"

    def _group(self, call):
        return self._cuda_pg if self._mode(call) == "device" else self._pg

    def _outbound(self, call, arr, fresh=False):
        """A C-contiguous array of ``arr`` (compute space) the group can read
        (``fresh``: a new one it may write)."""
        mode = self._mode(call)
        if mode == "staged":
            return np.ascontiguousarray(call.xp.asnumpy(arr))
        if fresh:
            return call.xp.array(arr, copy=True, order="C")
        arr = call.xp.ascontiguousarray(arr)
        if mode == "host" and not arr.flags.writeable:  # torch.from_numpy wants writable memory
            arr = arr.copy()
        return arr

    def _empty(self, call, shape, dtype):
        return (call.xp if self._mode(call) == "device" else np).empty(shape, dtype)

    def _inbound(self, call, buf):
        return call.xp.asarray(buf) if self._mode(call) == "staged" else buf

    @staticmethod
    def _tensor(arr):
        if isinstance(arr, np.ndarray):
            return torch.from_numpy(arr)
        return torch.from_dlpack(arr)

    def _bytes(self, arr):
        """A 1-D uint8 tensor over ``arr``'s memory."""
        return self._tensor(arr.reshape(-1).view(np.uint8))

    # -- protocol -------------------------------------------------------------------------------
    def _agree(self, op, call, error, deadline):
        m = _common.meta_vector(op, call, self._next_seq(), self.world_size, bad=error is not None)
        out = np.empty((self.world_size, m.shape[0]), np.int64)
        mt, outs = torch.from_numpy(m), list(torch.from_numpy(out).unbind(0))
        self._run(f"{op} (metadata exchange)", deadline,
                  lambda: tdist.all_gather(outs, mt, group=self._pg, async_op=True),
                  keep=(m, out, mt, outs))
        return out

    def _exchange_counts(self, counts, deadline):
        send = np.ascontiguousarray(counts, np.int64)
        out = np.empty(self.world_size, np.int64)
        st, rt = torch.from_numpy(send), torch.from_numpy(out)
        self._run("alltoallv (counts exchange)", deadline,
                  lambda: tdist.all_to_all_single(rt, st, group=self._pg, async_op=True),
                  keep=(send, out, st, rt))
        return out

    # -- data calls (after agreement) ---------------------------------------------------------
    def _alltoallv(self, call, metas, deadline):
        if self.world_size <= _common.INLINE_COUNTS_MAX_WORLD:
            recv_counts = metas[:, _common.HEADER + self.rank].copy()
        else:
            recv_counts = self._exchange_counts(call.counts, deadline)
        shape = (int(recv_counts.sum()),) + call.row_shape
        rb = call.row_bytes
        if rb == 0:  # the same on every rank (row shapes agree): nothing to move
            return call.xp.empty(shape, call.dtype), recv_counts
        sbuf = self._outbound(call, call.encoded())
        rbuf = self._empty(call, shape, call.wire_dtype)
        st, rt = self._bytes(sbuf), self._bytes(rbuf)
        ss = [c * rb for c in call.counts.tolist()]
        rs = [c * rb for c in recv_counts.tolist()]
        group = self._group(call)
        self._run("alltoallv", deadline,
                  lambda: tdist.all_to_all_single(rt, st, rs, ss, group=group, async_op=True),
                  keep=(sbuf, rbuf, st, rt))
        return call.decoded(self._inbound(call, rbuf)), recv_counts

    def _allgatherv(self, call, metas, deadline):
        counts = metas[:, _common.M_ROWS].copy()
        shape = (int(counts.sum()),) + call.row_shape
        rb = call.row_bytes
        most = int(counts.max())
        if rb == 0 or most == 0:
            return call.xp.empty(shape, call.dtype), counts
        sbuf = self._outbound(call, call.encoded())
        mine = call.shape[0] * rb
        if mine != most * rb:  # every block travels padded to the largest
            padded = self._empty(call, (most * rb,), np.uint8)
            padded[:mine] = sbuf.reshape(-1).view(np.uint8)
            sbuf = padded
        rbuf = self._empty(call, (self.world_size, most * rb), np.uint8)
        st, outs = self._bytes(sbuf), list(self._bytes(rbuf).view(self.world_size, -1).unbind(0))
        group = self._group(call)
        self._run("allgatherv", deadline,
                  lambda: tdist.all_gather(outs, st, group=group, async_op=True),
                  keep=(sbuf, rbuf, st, outs))
        if int(counts.min()) != most:
            xp = call.xp if self._mode(call) == "device" else np
            rbuf = xp.concatenate([rbuf[r, :int(c) * rb] for r, c in enumerate(counts.tolist())])
        flat = rbuf.reshape(-1).view(call.wire_dtype).reshape(shape)
        return call.decoded(self._inbound(call, flat)), counts

    def _gather_encoded(self, call, what, deadline):
        """[world, *shape] of every rank's encoded input, in compute space."""
        shape = (self.world_size,) + call.shape
        nbytes = call.wire_dtype.itemsize * int(np.prod(call.shape, dtype=np.int64))
        if nbytes == 0:
            return call.xp.empty(shape, call.wire_dtype)
        sbuf = self._outbound(call, call.encoded())
        rbuf = self._empty(call, shape, call.wire_dtype)
        st, outs = self._bytes(sbuf), list(self._bytes(rbuf).view(self.world_size, -1).unbind(0))
        group = self._group(call)
        self._run(what, deadline, lambda: tdist.all_gather(outs, st, group=group, async_op=True),
                  keep=(sbuf, rbuf, st, outs))
        return self._inbound(call, rbuf)

    def _allgather(self, call, metas, deadline):
        return call.decoded(self._gather_encoded(call, "allgather", deadline))

    def _allreduce(self, call, metas, deadline):
        if call.wire is None and call.dtype in _NATIVE_REDUCE:
            if call.x.size == 0:
                return call.xp.empty(call.shape, call.dtype)
            buf = self._outbound(call, call.x, fresh=True)  # reduced in place
            t = self._tensor(buf)
            op = getattr(tdist.ReduceOp, _REDUCE_OPS[call.extra])
            group = self._group(call)
            self._run("allreduce", deadline,
                      lambda: tdist.all_reduce(t, op=op, group=group, async_op=True),
                      keep=(buf, t))
            return self._inbound(call, buf)
        # int16, unsigned wider than a byte, float16 data or a wire dtype: gather the
        # encoded inputs, decode, reduce in rank order
        blocks = call.decoded(self._gather_encoded(call, "allreduce", deadline))
        return _common.reduce_in_order(call.xp, blocks, call.extra, call.dtype)

    def _broadcast(self, call, metas, deadline):
        root = call.extra
        nbytes = call.wire_dtype.itemsize * int(np.prod(call.shape, dtype=np.int64))
        group = self._group(call)
        src = root if group is tdist.group.WORLD else tdist.get_global_rank(group, root)
        if self.rank == root:
            enc = call.encoded()
            if nbytes:
                sbuf = self._outbound(call, enc)
                t = self._bytes(sbuf)
                self._run("broadcast", deadline,
                          lambda: tdist.broadcast(t, src, group=group, async_op=True),
                          keep=(sbuf, t))
            return call.x.copy() if call.wire is None else call.decoded(enc)
        if not nbytes:
            return call.xp.empty(call.shape, call.dtype)
        rbuf = self._empty(call, call.shape, call.wire_dtype)
        t = self._bytes(rbuf)
        self._run("broadcast", deadline,
                  lambda: tdist.broadcast(t, src, group=group, async_op=True),
                  keep=(rbuf, t))
        return call.decoded(self._inbound(call, rbuf))
