"""Shared by every backend: the error, dtype tables, input checks (local, before
anything is sent), the metadata vector every rank contributes before a data
call, and the agreement check that turns a disagreement into the same
:class:`CommError` on every rank."""
import contextlib
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .. import _dispatch, _machine
from . import _wire


class CommError(RuntimeError):
    """A collective could not complete: a peer died or hangs, ranks disagree on
    sizes, dtypes or the call itself, a peer failed its input checks, or the
    call ran past the communicator's timeout (``HBK_COMM_TIMEOUT``)."""


CommError.__module__ = "hbkernels.dist"

SUPPORTED_DTYPES = tuple(np.dtype(d) for d in (
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
    np.int64, np.uint64, np.float16, np.float32, np.float64,
))
DTYPE_CODE = {d: i + 1 for i, d in enumerate(SUPPORTED_DTYPES)}
CODE_DTYPE = {i: d for d, i in DTYPE_CODE.items()}
REDUCE_OPS = ("sum", "max", "min", "prod")
OPS = ("alltoallv", "allreduce", "allgather", "allgatherv", "broadcast", "barrier")
OP_CODE = {name: i + 1 for i, name in enumerate(OPS)}
MAX_NDIM = 8
INLINE_COUNTS_MAX_WORLD = 64  # alltoallv counts ride in the metadata up to this world size

# metadata vector: 8 fields, MAX_NDIM dims (the shape; the row shape for alltoallv and
# allgatherv), the row count (alltoallv, allgatherv), then (small worlds) the send counts.
# Everything before M_ROWS must be equal on every rank.
MAGIC = 0x4842_4B44  # "HBKD"
M_MAGIC, M_SEQ, M_OP, M_BAD, M_DTYPE, M_WIRE, M_EXTRA, M_NDIM = range(8)
M_SHAPE = 8
M_ROWS = M_SHAPE + MAX_NDIM
HEADER = M_ROWS + 1
ROWS_OPS = ("alltoallv", "allgatherv")


def dtype_name(code):
    d = CODE_DTYPE.get(int(code))
    return d.name if d is not None else f"<dtype code {int(code)}>"


def now():
    return time.perf_counter()


SPIN_S = 0.05      # busy-poll this long first
NAP_MAX_S = 1e-3   # then nap at most this long ...
BURST_S = 2e-4     # ... and poll this long after each nap
_YIELD_EVERY = 31  # polls between two yields (mask): rare enough not to slow big transfers
_yield = getattr(os, "sched_yield", lambda: None)


def wait_for(test, deadline):
    """Poll ``test()`` until it returns true (then True) or the clock passes
    ``deadline`` (then False); what ``test`` raises propagates.

    Busy for the first ``SPIN_S`` (what MPICH's blocking waits do anyway),
    then naps of at most ``NAP_MAX_S`` each followed by a burst of polls, so a
    late peer costs little CPU and a long transfer still progresses. Polling
    yields the CPU (``sched_yield``) every 32nd test (every test after a nap),
    so ranks oversubscribing the cores do not starve the peer they wait for."""
    clock = time.perf_counter
    if test():
        return True
    spin_end = min(clock() + SPIN_S, deadline)
    polls = 0
    while clock() < spin_end:
        if test():
            return True
        polls += 1
        if not polls & _YIELD_EVERY:
            _yield()  # lets an oversubscribed peer run
    nap = 2e-5
    while True:
        t = clock()
        if t >= deadline:
            return False
        time.sleep(min(nap, deadline - t))
        nap = min(2 * nap, NAP_MAX_S)
        burst_end = clock() + BURST_S
        while True:
            if test():
                return True
            if clock() >= burst_end:
                break
            _yield()


# -- array families -------------------------------------------------------------
def device_of(call):
    """A context making a CuPy input's GPU current (CuPy kernels run on the current one)."""
    if call.family.is_cuda and call.family.name == "cupy":
        return _machine.cupy().cuda.Device(call.family.device_id)
    return contextlib.nullcontext()


def _is_c_contiguous(x):
    flags = getattr(x, "flags", None)
    if flags is not None:
        try:
            return bool(flags["C_CONTIGUOUS"])
        except (KeyError, TypeError):
            return bool(getattr(flags, "c_contiguous"))
    is_c = getattr(x, "is_c_contiguous", None)  # Numba device arrays
    return bool(is_c()) if callable(is_c) else True


# -- one call, checked locally ------------------------------------------------------
@dataclass
class Call:
    """A data call after the local checks: what this rank will send."""

    op: str
    family: Any = None
    xp: Any = None
    x: Any = None                    # input, in compute space (xp)
    dtype: Optional[np.dtype] = None
    wire: Optional[str] = None       # effective wire dtype (None for ints / no cast)
    shape: tuple = ()
    counts: Optional[np.ndarray] = None   # alltoallv send counts (int64, host)
    extra: int = 0                   # reduce op index or broadcast root

    @property
    def wire_dtype(self):
        return _wire.wire_np_dtype(self.wire, self.dtype)

    @property
    def row_shape(self):
        return tuple(self.shape[1:])

    @property
    def row_bytes(self):
        return self.wire_dtype.itemsize * math.prod(self.shape[1:])

    def encoded(self):
        """The input as it travels (C-contiguous, wire dtype)."""
        return _wire.encode(self.x, self.wire, self.xp)

    def decoded(self, arr):
        return _wire.decode(arr, self.wire, self.dtype, self.xp)


def check_array(op, x, *, rows, name="x"):
    """Classify and check one input array; returns a partly filled :class:`Call`."""
    if type(x) is np.ndarray:  # the hot path: skip the family dispatch
        dtype = x.dtype
        if dtype in DTYPE_CODE and x.flags.c_contiguous and 0 < x.ndim <= MAX_NDIM:
            return Call(op=op, family=_dispatch.NUMPY, xp=np, x=x, dtype=dtype, shape=x.shape)
        family = _dispatch.NUMPY
    else:
        family, arrays = _dispatch.resolve(**{name: x})
        x = arrays[name]
    dtype = np.dtype(x.dtype)
    if dtype not in DTYPE_CODE:
        supported = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise ValueError(f"{op}: dtype {dtype} is not supported (supported: {supported})")
    shape = tuple(int(s) for s in x.shape)
    if rows and len(shape) < 1:
        raise ValueError(f"{op}: {name} must have at least one dimension (rows), got a 0-d array")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"{op}: {name} has {len(shape)} dimensions, at most {MAX_NDIM} are supported")
    if not _is_c_contiguous(x):
        raise ValueError(f"{op}: {name} must be C-contiguous (np.ascontiguousarray / "
                         "cupy.ascontiguousarray it first)")
    return Call(op=op, family=family, xp=family.xp, x=family.compute(x), dtype=dtype, shape=shape)


def check_counts(op, counts, world_size, rows):
    """``send_counts`` as a host int64 array, or ValueError."""
    if counts is None:
        raise ValueError(f"{op}: send_counts is required")
    if (type(counts) is list or (type(counts) is np.ndarray and counts.ndim == 1
                                 and counts.dtype.kind == "i")) and len(counts) == world_size:
        values = counts if type(counts) is list else counts.tolist()  # the hot path
        if all(type(v) is int and v >= 0 for v in values) and sum(values) == rows:
            return np.array(values, np.int64)
    mod = type(counts).__module__ or ""
    if mod.startswith("cupy"):
        counts = counts.get()
    elif hasattr(counts, "copy_to_host"):
        counts = counts.copy_to_host()
    arr = np.asarray(counts)
    if arr.ndim != 1:
        raise ValueError(f"{op}: send_counts must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            pass  # integral floats are accepted
        else:
            raise ValueError(f"{op}: send_counts must be integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{op}: send_counts too large")
    arr = arr.astype(np.int64)
    if arr.shape[0] != world_size:
        raise ValueError(f"{op}: send_counts has {arr.shape[0]} entries, "
                         f"expected world_size = {world_size}")
    neg = np.flatnonzero(arr < 0)
    if neg.size:
        raise ValueError(f"{op}: send_counts[{neg[0]}] = {arr[neg[0]]} is negative")
    total = int(arr.sum())
    if total != rows:
        raise ValueError(f"{op}: send_counts sum to {total} but send has {rows} rows")
    return arr


def check_reduce_op(op):
    if not isinstance(op, str) or op.lower() not in REDUCE_OPS:
        raise ValueError(f"allreduce: op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")
    return REDUCE_OPS.index(op.lower())


def check_root(root, world_size):
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise ValueError(f"broadcast: root must be an int, got {root!r}")
    if not 0 <= int(root) < world_size:
        raise ValueError(f"broadcast: root {int(root)} is out of range [0, {world_size})")
    return int(root)


def prepare(op, world_size, x=None, *, send_counts=None, wire_dtype=None, reduce_op=None,
            root=None):
    """All local checks of one data call; raises ValueError / TypeError."""
    wire = _wire.normalize(wire_dtype)
    call = check_array(op, x, rows=op in ROWS_OPS,
                       name="send" if op == "alltoallv" else "x")
    call.wire = _wire.effective(wire, call.dtype)
    if op == "alltoallv":
        call.counts = check_counts(op, send_counts, world_size, call.shape[0])
    elif op == "allreduce":
        call.extra = check_reduce_op(reduce_op)
        if call.dtype == np.bool_:
            raise ValueError("allreduce: bool arrays cannot be reduced; cast them to an integer dtype")
    elif op == "broadcast":
        call.extra = check_root(root, world_size)
    return call


# -- metadata agreement ---------------------------------------------------------------
def meta_length(world_size):
    return HEADER + (world_size if world_size <= INLINE_COUNTS_MAX_WORLD else 0)


def meta_vector(op, call, seq, world_size, bad=False):
    """This rank's int64 metadata for one call (``bad``: it failed its input checks)."""
    m = [MAGIC, seq, OP_CODE[op], 1 if bad else 0, 0, 0, 0, 0] + [0] * (MAX_NDIM + 1)
    if not bad and call is not None and op != "barrier":
        shape = call.shape
        m[M_DTYPE] = DTYPE_CODE[call.dtype]
        m[M_WIRE] = _wire.CODES[call.wire]
        m[M_EXTRA] = call.extra
        m[M_NDIM] = len(shape)
        if op in ROWS_OPS:
            m[M_SHAPE:M_SHAPE + len(shape) - 1] = shape[1:]
            m[M_ROWS] = shape[0]
        else:
            m[M_SHAPE:M_SHAPE + len(shape)] = shape
    del m[HEADER:]  # slice assignments above never change the length; keep it exact
    if world_size <= INLINE_COUNTS_MAX_WORLD:
        if op == "alltoallv" and not bad and call is not None:
            m.extend(call.counts.tolist())
        else:
            m.extend([0] * world_size)
    return np.array(m, np.int64)


def _first_diff(values):
    """First rank whose value differs from rank 0's, or None."""
    for r in range(1, len(values)):
        if values[r] != values[0]:
            return r
    return None


def _shape_of(row, rows_only):
    nd = int(row[M_NDIM]) - (1 if rows_only else 0)
    return tuple(int(v) for v in row[M_SHAPE:M_SHAPE + max(nd, 0)])


def check_agreement(op, metas, my_error=None):
    """Raise the same CommError on every rank when the gathered metadata
    ``metas`` ([world, L] int64) disagree; the rank that failed its own checks
    re-raises its local error (``my_error``) instead."""
    if my_error is not None:
        raise my_error
    world = metas.shape[0]
    head = metas[:, :M_ROWS].tobytes()  # the hot path: every rank's fields are equal
    if head == head[:len(head) // world] * world and not metas[0, M_BAD]:
        return
    bad_magic = [r for r in range(world) if metas[r, M_MAGIC] != MAGIC]
    if bad_magic:
        raise CommError(f"{op}: rank {bad_magic[0]} sent something that is not hbk.dist metadata "
                        "(ranks are out of step)")
    ops = [int(v) for v in metas[:, M_OP]]
    r = _first_diff(ops)
    if r is not None:
        raise CommError(f"collective calls differ across ranks: rank {r} called {OPS[ops[r] - 1]}, "
                        f"rank 0 {OPS[ops[0] - 1]}")
    seqs = [int(v) for v in metas[:, M_SEQ]]
    r = _first_diff(seqs)
    if r is not None:
        raise CommError(f"{op}: ranks are out of step: rank {r} is at call #{seqs[r]}, "
                        f"rank 0 at #{seqs[0]}")
    bad = [r for r in range(world) if metas[r, M_BAD]]
    if bad:
        who = ", ".join(str(b) for b in bad)
        raise CommError(f"{op}: rank{'s' if len(bad) > 1 else ''} {who} failed "
                        f"{'their' if len(bad) > 1 else 'its'} input checks; nothing was exchanged")
    if op == "barrier":
        return
    dts = [int(v) for v in metas[:, M_DTYPE]]
    r = _first_diff(dts)
    if r is not None:
        raise CommError(f"{op}: dtypes differ across ranks: rank {r} sent {dtype_name(dts[r])}, "
                        f"rank 0 {dtype_name(dts[0])}")
    wires = [int(v) for v in metas[:, M_WIRE]]
    r = _first_diff(wires)
    if r is not None:
        raise CommError(f"{op}: wire dtypes differ across ranks: rank {r} uses "
                        f"{_wire.NAMES.get(wires[r])}, rank 0 {_wire.NAMES.get(wires[0])}")
    extras = [int(v) for v in metas[:, M_EXTRA]]
    r = _first_diff(extras)
    if r is not None:
        if op == "allreduce":
            raise CommError(f"allreduce: reduce ops differ across ranks: rank {r} asked for "
                            f"{REDUCE_OPS[extras[r]]}, rank 0 {REDUCE_OPS[extras[0]]}")
        raise CommError(f"broadcast: roots differ across ranks: rank {r} passed root={extras[r]}, "
                        f"rank 0 root={extras[0]}")
    rows_only = op in ROWS_OPS
    shapes = [_shape_of(metas[r], rows_only) for r in range(world)]
    r = _first_diff(shapes)
    if r is not None:
        if rows_only:
            raise CommError(f"{op}: row shapes differ across ranks: rank {r} sent rows of shape "
                            f"{shapes[r]}, rank 0 {shapes[0]}")
        raise CommError(f"{op}: shapes differ across ranks: rank {r} passed {shapes[r]}, "
                        f"rank 0 {shapes[0]}")


def exclusive_cumsum(counts):
    """[0, c0, c0 + c1, ...] as a list of ints (what mpi4py takes fastest)."""
    out, total = [], 0
    for c in counts.tolist() if isinstance(counts, np.ndarray) else counts:
        out.append(total)
        total += int(c)
    return out


def reduce_in_order(xp, blocks, op_index, dtype):
    """Reduce ``blocks`` ([world, ...], decoded) in rank order; float16 accumulates
    in float32. The same bits on every rank."""
    acc_dtype = np.float32 if np.dtype(dtype) == np.float16 else np.dtype(dtype)
    shape = blocks.shape[1:]
    flat = blocks.reshape(blocks.shape[0], -1)  # 2-D, so 0-d inputs stay arrays
    acc = flat[0].astype(acc_dtype, copy=True)
    fn = (xp.add, xp.maximum, xp.minimum, xp.multiply)[op_index]
    for r in range(1, flat.shape[0]):
        fn(acc, flat[r].astype(acc_dtype, copy=False), out=acc)
    acc = acc.reshape(shape)
    return acc if acc.dtype == np.dtype(dtype) else acc.astype(dtype)
