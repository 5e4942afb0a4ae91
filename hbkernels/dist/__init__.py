"""Collectives: alltoallv, allreduce, allgather(v), broadcast and barrier over
MPI (mpi4py), NCCL (CuPy) or a single process.

Launch N processes with ``mpiexec -n N python -m mpi4py your_script.py`` and
call :func:`init` once on every rank::

    import hbkernels as hbk
    comm = hbk.dist.init()          # "auto": nccl | mpi | local
    recv, recv_counts = comm.alltoallv(send, send_counts)

Every call is collective (all ranks call it, in the same order, with arrays of
the same dtype and row shape) and returns new arrays in the caller's array
family (NumPy in, NumPy out; CuPy in, CuPy out). A call that cannot complete
raises :class:`CommError` on every rank within the communicator's timeout
(``HBK_COMM_TIMEOUT`` seconds, default 300): it never hangs. Importing this
module imports neither mpi4py nor CuPy; :func:`init` does, when it needs them.

>>> import numpy as np, hbkernels as hbk
>>> comm = hbk.dist.init("local")
>>> comm.backend, comm.rank, comm.world_size
('local', 0, 1)
>>> comm.allreduce(np.array([1.0, 2.0])).tolist()
[1.0, 2.0]
"""
import os
import sys

from . import _common
from ._common import CommError

__all__ = ["CommError", "Communicator", "init", "DEFAULT_TIMEOUT", "LAUNCHER_ENV_VARS"]

DEFAULT_TIMEOUT = 300.0
TIMEOUT_ENV = "HBK_COMM_TIMEOUT"
BACKENDS = ("auto", "nccl", "mpi", "local")
#: environment variables that MPI launchers set in the processes they start
LAUNCHER_ENV_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


class Communicator:
    """A group of ``world_size`` processes; this process is ``rank``.

    ``backend`` is ``"local"``, ``"mpi"`` or ``"nccl"``; ``timeout`` (seconds)
    bounds every call. Make one with :func:`init`.

    Data calls take ``wire_dtype=None | "float16" | "bfloat16"`` (or the NumPy
    / ml_dtypes dtype): float data is cast to it before sending and back to
    its own dtype after receiving (bfloat16 rounds to nearest even); integer
    and bool data ignore it. Every rank must pass the same ``wire_dtype``.

    Before moving data, the ranks exchange one small metadata record (call,
    dtype, shape, wire dtype, op/root, counts). A call whose inputs disagree
    across ranks raises :class:`CommError` on every rank, naming what differs,
    and nothing is exchanged (the communicator stays usable). Bad input on
    one rank raises ``ValueError`` there and :class:`CommError` ("rank r
    failed its input checks") on the others. A timeout or a transport error
    makes the communicator unusable: later calls raise :class:`CommError` at
    once; end the process (``os._exit``, or ``MPI.COMM_WORLD.Abort()``).
    """

    backend = "local"
    rank = 0
    world_size = 1

    def __init__(self, timeout):
        self.timeout = float(timeout)
        self._seq = 0
        self._broken = None

    def __repr__(self):
        return (f"<hbk.dist {self.backend} communicator: rank {self.rank} of {self.world_size}, "
                f"timeout {self.timeout:g} s>")

    # -- public calls -----------------------------------------------------------------
    def alltoallv(self, send, send_counts, *, wire_dtype=None):
        """Each rank sends block ``s`` of ``send`` to rank ``s``.

        ``send`` has ``sum(send_counts)`` rows (first axis; any row shape);
        ``send_counts[s]`` rows, consecutive, go to rank ``s``.
        Returns ``(recv, recv_counts)``: ``recv`` holds the blocks from ranks
        0..N-1 concatenated, ``recv_counts[s]`` (host int64 array) rows from
        rank ``s``. Zero counts, and ranks that send nothing, are fine.

        >>> import numpy as np, hbkernels as hbk
        >>> comm = hbk.dist.init("local")
        >>> recv, counts = comm.alltoallv(np.arange(6.0).reshape(3, 2), [3])
        >>> recv.shape, counts.tolist()
        ((3, 2), [3])
        """
        return self._call("alltoallv", send, send_counts=send_counts, wire_dtype=wire_dtype)

    def allreduce(self, x, op="sum", *, wire_dtype=None):
        """Elementwise ``op`` (``"sum"``, ``"max"``, ``"min"``, ``"prod"``) of
        ``x`` over all ranks, as a new array of ``x``'s shape and dtype on every
        rank. Integers wrap on overflow; bool arrays are refused.

        >>> import numpy as np, hbkernels as hbk
        >>> hbk.dist.init("local").allreduce(np.array([3, -1]), op="max").tolist()
        [3, -1]
        """
        return self._call("allreduce", x, reduce_op=op, wire_dtype=wire_dtype)

    def allgather(self, x, *, wire_dtype=None):
        """Every rank's ``x`` (same shape everywhere), stacked in rank order:
        shape ``(world_size, *x.shape)``.

        >>> import numpy as np, hbkernels as hbk
        >>> hbk.dist.init("local").allgather(np.array([1, 2])).shape
        (1, 2)
        """
        return self._call("allgather", x, wire_dtype=wire_dtype)

    def allgatherv(self, x, *, wire_dtype=None):
        """Every rank's rows (any number, same row shape), concatenated in rank
        order. Returns ``(x_all, counts)`` with ``counts[r]`` (host int64 array)
        the rows of rank ``r``.

        >>> import numpy as np, hbkernels as hbk
        >>> x_all, counts = hbk.dist.init("local").allgatherv(np.ones((2, 3)))
        >>> x_all.shape, counts.tolist()
        ((2, 3), [2])
        """
        return self._call("allgatherv", x, wire_dtype=wire_dtype)

    def broadcast(self, x, root=0, *, wire_dtype=None):
        """Rank ``root``'s ``x``, as a new array on every rank. Every rank
        passes an array of the same shape and dtype (the non-roots' values are
        ignored: it is the receive template). With a ``wire_dtype`` the root
        gets the same rounded values as everyone else.

        >>> import numpy as np, hbkernels as hbk
        >>> hbk.dist.init("local").broadcast(np.array([7, 8]), root=0).tolist()
        [7, 8]
        """
        return self._call("broadcast", x, root=root, wire_dtype=wire_dtype)

    def barrier(self):
        """Return once every rank has called ``barrier`` (bounded by the timeout).

        >>> import hbkernels as hbk
        >>> hbk.dist.init("local").barrier()
        """
        self._check_usable("barrier")
        deadline = _common.now() + self.timeout
        metas = self._agree("barrier", None, None, deadline)
        _common.check_agreement("barrier", metas)

    def fail_collectively(self, op, error):
        """Raise ``error`` here and :class:`CommError` on the peers, which are
        inside collective ``op``: for a caller whose input failed its checks
        before the call, so that no peer waits for it until the timeout."""
        self._check_usable(op)
        metas = self._agree(op, None, error, _common.now() + self.timeout)
        _common.check_agreement(op, metas, error)

    # -- the protocol every backend shares ------------------------------------------------
    def _call(self, op, x, *, send_counts=None, wire_dtype=None, reduce_op=None, root=None):
        self._check_usable(op)
        deadline = _common.now() + self.timeout
        call, error = None, None
        try:
            call = _common.prepare(op, self.world_size, x, send_counts=send_counts,
                                   wire_dtype=wire_dtype, reduce_op=reduce_op, root=root)
            self._local_checks(call)
        except Exception as e:  # noqa: BLE001 - re-raised after the peers learnt of it
            error = e
        metas = self._agree(op, call, error, deadline)
        _common.check_agreement(op, metas, error)
        with _common.device_of(call):
            out = getattr(self, "_" + op)(call, metas, deadline)
        if isinstance(out, tuple):
            return (_common.to_family(call.family, out[0]),) + out[1:]
        return _common.to_family(call.family, out)

    def _local_checks(self, call):
        """Backend-specific input checks (raise ValueError), before the exchange."""

    def _check_usable(self, op):
        if self._broken is not None:
            raise CommError(f"{op}: this communicator is unusable after an earlier failure "
                            f"({self._broken})")

    def _next_seq(self):
        self._seq += 1
        return self._seq

    def _agree(self, op, call, error, deadline):
        """[world, L] int64 metadata of every rank (backends exchange it)."""
        raise NotImplementedError


def _under_launcher():
    """True when this process was started by an MPI launcher (or already runs MPI
    with more than one rank). Checks environment variables first, so that no
    mpi4py import happens outside ``mpiexec``."""
    if any(os.environ.get(v) not in (None, "") for v in LAUNCHER_ENV_VARS):
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            return bool(mpi.Is_initialized()) and mpi.COMM_WORLD.Get_size() > 1
        except Exception:  # noqa: BLE001
            return False
    return False


def _resolve_timeout(timeout):
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "")
        try:
            timeout = float(raw) if raw.strip() else DEFAULT_TIMEOUT
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    timeout = float(timeout)
    if not timeout > 0 or timeout != timeout:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
    return timeout


def init(backend="auto", *, timeout=None):
    """A communicator over every process of this job (collective under MPI: every
    rank calls it).

    ``backend``: ``"local"`` (this process alone, no MPI import), ``"mpi"``
    (mpi4py; NumPy arrays, and CUDA arrays directly when the MPI library is
    CUDA-aware, else staged through pinned host memory), ``"nccl"`` (CuPy's
    NCCL for CUDA arrays, one GPU per rank picked by node-local rank, NumPy
    arrays over MPI; the NCCL unique id travels over mpi4py) or ``"auto"``:
    ``"local"`` outside an MPI launcher (``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``,
    ``PMIX_RANK`` or ``MPI_LOCALRANKID`` unset), else ``"nccl"`` when CuPy works
    and every rank has a GPU of its own, else ``"mpi"`` (agreed by all ranks).
    ``timeout``: seconds a call may take before :class:`CommError`
    (default: ``HBK_COMM_TIMEOUT`` or 300).

    >>> import hbkernels as hbk
    >>> hbk.dist.init().backend   # outside mpiexec
    'local'
    """
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    backend = backend.lower()
    timeout = _resolve_timeout(timeout)
    if backend == "local" or (backend == "auto" and not _under_launcher()):
        from ._local import LocalCommunicator

        return LocalCommunicator(timeout)
    try:
        import mpi4py  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            f"backend {backend!r} under an MPI launcher needs mpi4py: "
            "pip install 'hbkernels[mpi]'") from e
    from ._mpi import MpiCommunicator

    if backend == "mpi":
        return MpiCommunicator(timeout)
    ctl = MpiCommunicator(timeout)
    from ._nccl import NcclCommunicator, plan_devices

    device, reason = plan_devices(ctl, required=backend == "nccl")
    if device is None:
        return ctl  # auto, and some rank cannot use NCCL
    return NcclCommunicator(timeout, ctl, device)

