"""The id -> slot index of a :class:`hbkernels.HashTable` on the GPU.

The same index as :mod:`hbkernels.cpu.hash_table` (linear probing from the top
bits of the id's Fibonacci hash, keys and slots interleaved, ``IndexKey`` markers,
two reserved entries), in ``xp`` arrays (:mod:`._device`), one thread per id:

* ``_find``: a probe reads positions ``h, h+1, ...`` up to the id or ``EMPTY``.
  At the load the front end keeps (live positions at most 1/2 of ``P``, live plus
  tombstoned at most 3/4) a probe for a live id reads at most 1.5 positions on
  average (Knuth), and a 32-byte sector holds two (key, slot) positions, so one
  sector serves most lookups.
* ``_insert``: a new id claims the first ``EMPTY`` or ``TOMBSTONE`` position of
  its probe with a 64-bit ``atomic.cas`` (the ids of one launch are distinct and
  absent, so a lost race only moves the claim on) and writes its slot's state.
* ``_erase``: a (distinct) id's position becomes ``TOMBSTONE``.
* ``_touch``: ``atomic.max`` on slot ``s``'s last use returns an older call to exactly
  one of the threads that use ``s`` in the call: that one adds 1 to its use count,
  which sits in the same sector.
"""
import numpy as np
from numba import cuda, int64, uint64

from .._modes import IndexKey
from . import _device
from ._launch import blocks_for, fib_hash, threads_per_block
from ._launcher import launch

xp = _device.xp


def as_xp(family, ids):
    """The caller's CUDA ``ids`` as an ``xp`` array (no copy)."""
    return _device.array(family.kernel_array(ids))


def to_family(family, a):
    return _device.to_family(family, a)


@cuda.jit(device=True, inline=True)
def _reserved(key):
    if key == IndexKey.EMPTY:
        return 0
    if key == IndexKey.TOMBSTONE:
        return 1
    return -1


@cuda.jit(device=True, inline=True)
def _home(key, shift):
    return int64(fib_hash(uint64(key)) >> uint64(shift))


@cuda.jit(device=True, inline=True)
def _position(index, key, shift):
    mask = (index.shape[0] >> 1) - 1
    h = _home(key, shift)
    while True:
        k = index[2 * h]
        if k == key:
            return h
        if k == IndexKey.EMPTY:
            return -1
        h = (h + 1) & mask


@cuda.jit
def _find(index, reserved, shift, ids, out):
    for i in range(cuda.grid(1), ids.shape[0], cuda.gridsize(1)):
        key = int64(ids[i])
        r = _reserved(key)
        if r >= 0:
            out[i] = reserved[r]
        else:
            p = _position(index, key, shift)
            out[i] = index[2 * p + 1] if p >= 0 else -1


@cuda.jit
def _insert(index, reserved, shift, ids, slots, slot_ids, uses, step, assign, reused):
    mask = (index.shape[0] >> 1) - 1
    for i in range(cuda.grid(1), ids.shape[0], cuda.gridsize(1)):
        key = int64(ids[i])
        s = slots[i]
        if assign:
            slot_ids[s] = key
            uses[2 * s] = step
            uses[2 * s + 1] = 1
        r = _reserved(key)
        if r >= 0:
            reserved[r] = s
            continue
        h = _home(key, shift)
        while True:
            cur = index[2 * h]
            if cur == IndexKey.EMPTY or cur == IndexKey.TOMBSTONE:
                if cuda.atomic.cas(index, 2 * h, cur, key) == cur:
                    index[2 * h + 1] = s
                    if cur == IndexKey.TOMBSTONE:
                        cuda.atomic.add(reused, 0, 1)
                    break
            else:
                h = (h + 1) & mask


@cuda.jit
def _erase(index, reserved, shift, ids, uses, out, erased):
    for i in range(cuda.grid(1), ids.shape[0], cuda.gridsize(1)):
        key = int64(ids[i])
        r = _reserved(key)
        s = -1
        if r >= 0:
            s = reserved[r]
            reserved[r] = -1
        else:
            p = _position(index, key, shift)
            if p >= 0:
                s = index[2 * p + 1]
                index[2 * p] = IndexKey.TOMBSTONE
                cuda.atomic.add(erased, 0, 1)
        out[i] = s
        if s >= 0:
            uses[2 * s] = -1
            uses[2 * s + 1] = 0


@cuda.jit
def _touch(found, uses, step):
    for i in range(cuda.grid(1), found.shape[0], cuda.gridsize(1)):
        s = found[i]
        if s >= 0 and cuda.atomic.max(uses, 2 * s, step) < step:
            uses[2 * s + 1] += 1


def _shift(index):
    return 64 - ((index.shape[0] >> 1).bit_length() - 1)


def _launch(family, kernel, n, *args):
    tpb = threads_per_block()
    launch(kernel, blocks_for(n, tpb), tpb, *args)


def find(family, index, reserved, ids):
    """The slot of each id of ``ids`` (1-D, int32 or int64), -1 where absent."""
    out = _device.scratch(ids.shape[0], np.int64)
    if ids.shape[0]:
        _launch(family, _find, ids.shape[0], index, reserved, _shift(index), ids, out)
    return out


def insert(family, index, reserved, ids, slots, slot_ids, uses, step, assign=True):
    """Index the distinct absent ``ids`` at ``slots``; with ``assign``, the slots become
    theirs, used once, at call ``step`` (without, the slot state is left as it is: a
    rebuilt index). Returns how many tombstoned positions they took (a host read)."""
    if not ids.shape[0]:
        return 0
    reused = _device.zeros(1, np.int64)
    _launch(family, _insert, ids.shape[0], index, reserved, _shift(index), ids, slots, slot_ids,
            uses, step, assign, reused)
    return int(_device.to_host(reused)[0])


def erase(family, index, reserved, ids, uses):
    """Remove the distinct ``ids``: ``(their former slots, -1 where absent; positions
    tombstoned)``; a freed slot's last use becomes -1 and its use count 0."""
    out = _device.scratch(ids.shape[0], np.int64)
    erased = _device.zeros(1, np.int64)
    if ids.shape[0]:
        _launch(family, _erase, ids.shape[0], index, reserved, _shift(index), ids, uses, out,
                erased)
    return out, int(_device.to_host(erased)[0])


def touch(family, found, uses, step):
    """Note call ``step``'s use of each slot in ``found`` (-1 skipped): its last use
    becomes ``step`` and, once per slot however often it occurs, its count grows by 1."""
    if found.shape[0]:
        _launch(family, _touch, found.shape[0], found, uses, step)


def clear(index):
    """Every position ``EMPTY`` (the slots are left as they are)."""
    index[0::2] = IndexKey.EMPTY
