"""Launch helpers shared by the CUDA kernels: grid sizes, fills and error slots.

Kernels report the first bad position of an input by ``cuda.atomic.min`` into
an int64 *error slot* that starts at ``NO_ERROR_SLOT``; the launcher reads the
slots back once (one small device-to-host copy) unless ``bounds="unchecked"``.
Under the simulator (``NUMBA_ENABLE_CUDASIM=1``) grids are kept tiny: every
simulated thread is a Python thread.
"""
import numpy as np
from numba import cuda

from .._dispatch import simulator_enabled

NO_ERROR_SLOT = np.iinfo(np.int64).max
_SIM_MAX_BLOCKS = 2
_MAX_BLOCKS = 65535 * 16


def threads_per_block(preferred=256):
    return 32 if simulator_enabled() else preferred


def blocks_for(work_items, threads, max_blocks=_MAX_BLOCKS):
    """Blocks to cover ``work_items`` (kernels use grid-stride loops past the cap)."""
    cap = _SIM_MAX_BLOCKS if simulator_enabled() else max_blocks
    return max(1, min(cap, (int(work_items) + threads - 1) // threads))


@cuda.jit
def _fill_kernel(flat, value):
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, flat.shape[0], step):
        flat[i] = value


def fill(a, value, stream=0):
    """Set every element of a contiguous device array to ``value``."""
    flat = a.reshape(a.size) if a.ndim != 1 else a
    if flat.shape[0] == 0:
        return
    tpb = threads_per_block()
    _fill_kernel[blocks_for(flat.shape[0], tpb), tpb, stream](flat, value)


def error_slots(count, stream=0):
    slots = cuda.device_array(count, np.int64, stream=stream)
    fill(slots, NO_ERROR_SLOT, stream)
    return slots


def read_error_slots(slots, stream=0):
    """Host list of first bad positions, -1 where none."""
    host = slots.copy_to_host(stream=stream)
    if stream != 0:
        stream.synchronize()
    return [-1 if v == NO_ERROR_SLOT else int(v) for v in host]
