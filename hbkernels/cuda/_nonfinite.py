"""The finiteness check of a gradient: the first row of a 2-D array holding NaN or Inf,
``atomic.min``-ed into an error slot.

:func:`nonfinite_scan` is the check as a device function: the grid's threads stride over
the array's elements, four a grid apart loaded before the first test, so a kernel with
work of its own (the backward's per-bag pass) checks the gradient in the same launch;
its grid should cover :func:`scan_blocks` blocks. :func:`nonfinite_kernel` is the check
alone, :func:`record_nonfinite` its launch.
"""
import functools
import math

from numba import cuda

from ._launch import blocks_for, dtype_key, inline_device, kernel_factory, load_as_float, threads_per_block
from ._launcher import launch


@functools.lru_cache(maxsize=None)
def nonfinite_scan(dtype):
    """Device function ``scan(a, slots, slot)``: ``slots[slot]`` lowered to the first row
    of the 2-D ``dtype`` array ``a`` (:func:`dtype_key`) holding NaN or Inf, by every
    thread of the grid."""
    load = load_as_float(dtype)

    @inline_device
    def element(a, i, m):
        r = i // m
        return load(a[r, i - r * m])

    @inline_device
    def check(i, size, m, v, slots, slot):
        if i < size and not math.isfinite(v):
            cuda.atomic.min(slots, slot, i // m)

    @inline_device
    def scan(a, slots, slot):
        m = a.shape[1]
        size = a.shape[0] * m
        step = cuda.gridsize(1)
        for i in range(cuda.grid(1), size, 4 * step):
            i1 = i + step
            i2 = i1 + step
            i3 = i2 + step
            v0 = element(a, i, m)
            v1 = element(a, i1 if i1 < size else i, m)
            v2 = element(a, i2 if i2 < size else i, m)
            v3 = element(a, i3 if i3 < size else i, m)
            check(i, size, m, v0, slots, slot)
            check(i1, size, m, v1, slots, slot)
            check(i2, size, m, v2, slots, slot)
            check(i3, size, m, v3, slots, slot)

    return scan


def scan_blocks(a, tpb):
    """Blocks of ``tpb`` threads a grid scanning the 2-D ``a`` takes (0 when empty)."""
    size = a.shape[0] * a.shape[1]
    return blocks_for(-(-size // 4), tpb) if size else 0


@kernel_factory
def nonfinite_kernel(dtype):
    """The kernel recording in ``slots[slot]`` the first row of a ``dtype`` array
    holding NaN or Inf."""
    scan = nonfinite_scan(dtype)

    @cuda.jit(cache=False)
    def nonfinite_kernel(a, slots, slot):
        scan(a, slots, slot)

    return nonfinite_kernel


def record_nonfinite(family, a, slots, slot):
    """Queue the check of the 2-D ``a`` into ``slots[slot]`` (nothing for an empty ``a``)."""
    tpb = threads_per_block()
    blocks = scan_blocks(a, tpb)
    if blocks:
        launch(nonfinite_kernel(dtype_key(a.dtype)), blocks, tpb, family.kernel_array(a), slots, slot)
