"""Input checks that the GPU finishes after an op has returned.

An op that otherwise need not wait for the device (``embedding_bag``, ``lookup``,
``segment_sum``, ``segment_reduce``, ``per_sample_weights_backward``, the fused
optimizer step) takes its error slots from the device's *ledger* instead of reading
them back: ``with checks(count, op, report) as slots:`` hands out ``count`` int64 slots
(``NO_ERROR_SLOT`` while clean; the kernels ``atomic.min`` first bad positions into
them) for the launches inside the block, and notes the call with
``report(positions)``, which raises for the positions found (-1: none). No flush runs
between the slots' handing out and the end of the block (the launches are queued by
then), in any thread.

:func:`flush` reads every noted slot in one copy, resets them, and raises the first
error found; the others found by the same read follow, one per later flush, so each
is raised exactly once and none is lost. A flush happens where hbkernels waits for
the device anyway: ``hbk.synchronize()`` (:func:`._device.synchronize`), any read-back
of an op (:func:`._device.to_host`), a CUDA family's ``sync`` and ``to_numpy``; and before a
call whose slots would not fit (:data:`CAPACITY` slots, :data:`MAX_PENDING` calls,
or more than :data:`MAX_HELD_BYTES` of input arrays kept for the messages), which is
then the one call that waits.

:func:`capture` notes the calls of a step captured into a CUDA graph apart: their slots
stay theirs (never handed out again), and :meth:`Captured.replayed` notes them again
after each replay of the graph.
"""
import contextlib
import threading

import numpy as np

from .._machine import simulator_enabled
from . import _device
from ._launch import NO_ERROR_SLOT, error_positions

CAPACITY = 1024  # slots per device
MAX_PENDING = 64  # calls noted between two flushes
MAX_HELD_BYTES = 1 << 28  # input arrays kept for the error messages

_LOCK = threading.RLock()
_LEDGERS = {}  # device id -> _Ledger
_FOUND = []  # errors read by a flush and not yet raised, oldest first
_FLUSHING = [False]
_OPEN = [0]  # checks blocks open (in the thread holding the lock): their slots are in use


class _Ledger:
    def __init__(self):
        self.array = _device.full(CAPACITY, NO_ERROR_SLOT, np.int64)
        _device.wait(_stream())  # filled before a kernel on any stream can write into it
        self.pinned = 0  # slots [0, pinned) belong to captured calls (capture)
        self.used = 0
        self.held = 0
        self.capturing = False
        self.views = {}  # (first, count) -> the slots' view of the array
        self.calls = []  # (op, first slot, count, report, stream or None)


_SIMULATOR = simulator_enabled()  # fixed for the process once numba.cuda is imported


def _stream():
    return None if _SIMULATOR else _device.current_stream()


def checks(count, op, report, holds=(), when=True):
    """A context holding ``count`` error slots (an int64 device array, clean) for one
    call of ``op``, for the kernel launches inside it (None when not ``when``: nothing
    is checked); ``report(positions)`` (a list of ``count`` first bad positions, -1 where
    none; called only when one is not -1) raises the call's error. ``holds``: the
    arrays ``report`` reads, kept alive until the flush."""
    if not when:
        return _UNCHECKED
    return _Checked(count, op, report, holds)


class _Checked:
    """The context of :func:`checks`: the lock is held from the slots' handing out to the
    end of the block (no flush, from any thread, before the block's launches are queued)."""

    __slots__ = ("count", "op", "report", "holds")

    def __init__(self, count, op, report, holds):
        self.count, self.op, self.report, self.holds = count, op, report, holds

    def __enter__(self):
        _LOCK.acquire()
        try:
            held = 0
            for a in self.holds:
                if a is not None:
                    held += a.nbytes
            count = self.count
            ledger = _LEDGERS.get(_device.device_id())
            if ledger is None or (ledger.used + count > CAPACITY or len(ledger.calls) >= MAX_PENDING
                                  or (ledger.calls and ledger.held + held > MAX_HELD_BYTES)):
                ledger = _room(count, self.op, ledger)
            first = ledger.used
            ledger.used = first + count
            ledger.held += held
            ledger.calls.append((self.op, first, count, self.report, _stream()))
            view = ledger.views.get((first, count))
            if view is None:  # a slice of the ledger, made once: slicing a CUDA array costs the host
                view = ledger.views[(first, count)] = ledger.array[first:first + count]
        except BaseException:
            _LOCK.release()
            raise
        _OPEN[0] += 1
        return view

    def __exit__(self, *exc):
        _OPEN[0] -= 1
        _LOCK.release()
        return False


_UNCHECKED = contextlib.nullcontext()  # nothing checked: no slots


def _room(count, op, ledger):
    """The current device's ledger with room for ``count`` more slots and one more call
    (made on first use, else flushed; the caller holds :data:`_LOCK`)."""
    if ledger is None:
        ledger = _LEDGERS[_device.device_id()] = _Ledger()
        return ledger
    if ledger.capturing:  # a flush waits: not allowed while a CUDA graph is being captured
        raise RuntimeError(f"{op}: too many checked calls in one captured step (at most "
                           f"{MAX_PENDING} calls and {CAPACITY} error slots)")
    flush(wait=True)
    if ledger.used + count > CAPACITY:  # not flushed: inside another checks block
        raise RuntimeError(f"{op}: no error slots left for a check nested in another")
    return ledger


def check_now():
    """Read the pending checks now, waiting for the current stream (and any other a
    pending call ran on), not the whole device, and raise the first error; nothing to
    read and no wait when none is pending."""
    with _LOCK:
        if _FOUND or any(ledger.calls for ledger in _LEDGERS.values()):
            flush(wait=True)


def pending():
    """How many calls' checks wait for a flush, on every device."""
    return sum(len(ledger.calls) for ledger in _LEDGERS.values())


def flush(wait=False):
    """Read the current device's noted slots (waiting for its current stream, and
    for any other stream a noted call ran on), reset them, and raise the oldest error
    found and not yet raised. ``wait``: this is a wait of its own (counted in
    :data:`._device.HOST_SYNCS`); otherwise the caller has just waited."""
    with _LOCK:
        if _FLUSHING[0] or _OPEN[0]:
            return  # a report reading back, or a read back inside an op's checks block
        ledger = _LEDGERS.get(_device.device_id())
        if ledger is not None and ledger.calls:
            _FLUSHING[0] = True
            try:
                _read(ledger, wait)
            finally:
                _FLUSHING[0] = False
        if _FOUND:
            raise _FOUND.pop(0)


def after_wait():
    """:func:`flush` when there is anything to read or raise (the caller has just waited
    for the device): what :func:`._device.to_host` and the CUDA families' reads call."""
    if _FOUND:
        flush()
        return
    for ledger in _LEDGERS.values():
        if ledger.calls:
            flush()
            return


_device.AFTER_WAIT.append(after_wait)


def _read(ledger, wait):
    calls, used = ledger.calls, ledger.used
    current = _stream()
    others = {s.ptr: s for *_, s in calls if s is not None and s.ptr != current.ptr}
    for stream in others.values():
        _device.wait(stream)
    values = _device.read(ledger.array[:used], count=wait)
    ledger.array[:used] = NO_ERROR_SLOT
    _device.wait(current)  # reset before a later kernel, on any stream, writes into it
    ledger.calls, ledger.used, ledger.held = [], ledger.pinned, 0
    if (values == NO_ERROR_SLOT).all():
        return
    for op, first, count, report, _ in calls:
        positions = error_positions(values[first:first + count])
        if any(p != -1 for p in positions):
            try:
                report(positions)
            except Exception as error:  # noqa: BLE001 - every check's error is raised later
                if error.args and isinstance(error.args[0], str):
                    error.args = (f"{op}: {error.args[0]}",) + error.args[1:]
                _FOUND.append(error)


class Captured:
    """The checked calls of a step captured into a CUDA graph (:func:`capture`), on the
    slots kept for them."""

    __slots__ = ("device", "calls")

    def __init__(self, device):
        self.device, self.calls = device, []

    def replayed(self):
        """Note the captured calls again, right after a replay of the graph is queued
        (before any wait): the next flush reads what the replay found. Replays between
        two flushes share one note (a slot keeps the first bad position of any)."""
        with _LOCK:
            ledger = _LEDGERS[self.device]
            if self.calls and not any(call is self.calls[0] for call in ledger.calls):
                ledger.calls.extend(self.calls)


@contextlib.contextmanager
def capture():
    """The context of a step being captured into a CUDA graph: the pending checks are
    read first (this waits; enter it before the capture begins); the checked calls
    inside take slots that are never handed out again, and at the end they are not
    noted but held by the :class:`Captured` it gives, for its ``replayed()``. A call
    that would need a flush inside raises ``RuntimeError``."""
    device = _device.device_id()
    with _LOCK:
        ledger = _LEDGERS.get(device)
        if ledger is None:
            ledger = _LEDGERS[device] = _Ledger()
        flush(wait=True)
        if ledger.capturing:
            raise RuntimeError("a step is being captured already")
        ledger.capturing = True
    captured = Captured(device)
    try:
        yield captured
    finally:
        with _LOCK:
            ledger.capturing = False
            captured.calls = ledger.calls
            ledger.calls = []
            ledger.pinned = ledger.used
