"""The :class:`Communicator` interface every backend of :mod:`hbkernels.dist` implements."""
from . import _common
from ._common import CommError


class Communicator:
    """A group of ``world_size`` processes; this process is ``rank``.

    ``backend`` is ``"local"``, ``"mpi"``, ``"nccl"`` or ``"torch"``; ``timeout`` (seconds)
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
            return (call.family.from_compute(out[0]),) + out[1:]
        return call.family.from_compute(out)

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
