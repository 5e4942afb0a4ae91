"""The thread pools of a process that runs hbkernels: Numba's (the CPU kernels)
and torch's (a model's dense layers), sized as one.

The two pools are separate OpenMP runtimes. Each runs its parallel regions
with as many threads as it was given, and a region ends only when its
slowest thread does: when other processes hold some of the cores, a pool
sized to all of them waits, on every region, for a thread the kernel has
descheduled, and its idle threads spin on cores the other pool (or the
other process) needs. The rule here is **one thread per free core, in both
pools**: the cores this process may run on (its affinity mask, shared
between the ranks of a node) less the CPU time that other processes used
over the last interval, rounded, at least 1.

* :func:`set_num_threads` sizes both pools at once (torch's only when torch
  is already imported: this module never imports it);
* :class:`Governor` re-sizes them from the load it measures (Linux
  ``/proc``; elsewhere it keeps the size it was given), at most once per
  ``interval`` seconds; ``hbkernels train`` runs one (``--threads auto``);
* :func:`pools` reports both pools and the environment that shapes them
  (``hbkernels info`` prints it).

Numba's pool is started by :func:`start_numba_pool` (on the first CPU op)
with ``GOMP_SPINCOUNT`` = :data:`NUMBA_SPIN_COUNT` in its OpenMP runtime
alone, unless the user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``: its
workers then wait a few microseconds for the next kernel before they sleep,
where a sleeping worker takes tens of microseconds to wake, on every kernel
(a one-id-per-bag ``embedding_bag`` of 16384 bags ran 3x faster). torch's
runtime keeps its own policy. With pools no larger than the free cores, a
spinning thread takes no core that another thread needs.
"""
import os
import sys
import time

import numba

#: environment variables that shape the pools, reported by :func:`pools`
ENVIRONMENT = ("NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER", "OMP_NUM_THREADS",
               "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


NUMBA_SPIN_COUNT = "3000"
_started = []


def start_numba_pool():
    """Start Numba's thread pool (once) with :data:`NUMBA_SPIN_COUNT` in the
    environment its OpenMP runtime reads when it loads (see above); the
    environment is restored right after."""
    if _started:
        return
    _started.append(True)
    spin = not any(k in os.environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))
    if spin:
        os.environ["GOMP_SPINCOUNT"] = NUMBA_SPIN_COUNT
    try:
        numba.set_num_threads(numba.get_num_threads())  # launches the pool
    finally:
        if spin:
            del os.environ["GOMP_SPINCOUNT"]


def usable_cores():
    """The number of cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _torch():
    """torch when it is already imported, else None (sizing it must not import it)."""
    return sys.modules.get("torch")


def set_num_threads(n):
    """Run Numba's parallel kernels and torch's ops (when torch is imported) on ``n``
    threads each; Numba's pool is capped at ``NUMBA_NUM_THREADS``, the size it
    was started with. Returns the size of Numba's pool."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of threads must be a positive int, got {n!r}")
    numba_threads = min(n, numba.config.NUMBA_NUM_THREADS)
    start_numba_pool()
    numba.set_num_threads(numba_threads)
    torch = _torch()
    if torch is not None:
        torch.set_num_threads(n)
    return numba_threads


def pools():
    """A dict describing both pools: ``cores`` (:func:`usable_cores`), ``numba``
    (``threads`` now, ``max``, ``layer``: the threading layer in use, or the one
    configured while no parallel kernel has run), ``torch`` (``threads``,
    ``interop_threads``, ``parallel``: its build's parallel backend; None when
    torch is not imported) and ``environment`` (the set variables of
    :data:`ENVIRONMENT`)."""
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel region has run yet
        layer = f"{numba.config.THREADING_LAYER} (not started)"
    torch = _torch()
    torch_pool = None
    if torch is not None:
        config = torch.__config__.parallel_info()
        backend = next((line.split(":", 1)[1].strip() for line in config.splitlines()
                        if line.startswith("ATen parallel backend")), "unknown")
        torch_pool = {"threads": torch.get_num_threads(),
                      "interop_threads": torch.get_num_interop_threads(), "parallel": backend}
    return {
        "cores": usable_cores(),
        "numba": {"threads": numba.get_num_threads(), "max": numba.config.NUMBA_NUM_THREADS,
                  "layer": layer},
        "torch": torch_pool,
        "environment": {k: os.environ[k] for k in ENVIRONMENT if k in os.environ},
    }


class CpuLoad:
    """CPU time used by other processes, from ``/proc/stat`` (all cores, busy =
    every state but idle and iowait; steal included) less this process's own
    (``/proc/self/stat``), between successive calls of :meth:`others`."""

    def __init__(self):
        self._last = self._read()

    @staticmethod
    def _read():
        """``(busy ticks of all cores, all ticks, this process's ticks, cores)`` or None."""
        try:
            with open("/proc/stat") as f:
                lines = f.read().splitlines()
            with open("/proc/self/stat") as f:
                own = f.read()
        except OSError:
            return None
        fields = [int(v) for v in lines[0].split()[1:]]
        cores = sum(1 for line in lines[1:] if line.startswith("cpu"))
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        # utime and stime: fields 14 and 15, counted after the ")" that ends the command name
        after = own.rsplit(")", 1)[1].split()
        return sum(fields[:8]) - idle, sum(fields[:8]), int(after[11]) + int(after[12]), cores

    def others(self):
        """Cores' worth of CPU time that other processes used since the previous call
        (or since construction), or None where ``/proc`` cannot tell."""
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None:
            return None
        busy, total, own = (now[i] - last[i] for i in range(3))
        if total <= 0:
            return None
        per_core = total / max(now[3], 1)
        return max(0.0, (busy - own) / per_core)


def pool_limit():
    """The most threads the pools may get: the usable cores, and no more than the
    user asked for with ``NUMBA_NUM_THREADS`` or (for an imported torch)
    ``OMP_NUM_THREADS`` / ``torch.set_num_threads``."""
    limit = min(usable_cores(), numba.config.NUMBA_NUM_THREADS)
    torch = _torch()
    if torch is not None:
        limit = min(limit, torch.get_num_threads())
    return max(1, limit)


def rank_share(world_size):
    """The pool size of one of ``world_size`` ranks that share this node's cores: its
    share of the usable cores, at most :func:`pool_limit`, at least 1."""
    return max(1, min(pool_limit(), usable_cores() // max(1, int(world_size))))


class Governor:
    """Keeps both pools at the free cores, at most ``limit`` (default:
    :func:`pool_limit`), re-measured when :meth:`tick` finds ``interval`` seconds
    passed."""

    def __init__(self, limit=None, *, interval=1.0):
        self.limit = max(1, int(limit or pool_limit()))
        self.interval = float(interval)
        self.load = CpuLoad()
        self.threads = set_num_threads(self.limit)
        self._since = time.monotonic()
        self.changes = 0

    def free_cores(self):
        """The pool size for the load measured since the last call (``limit`` when
        the load cannot be measured)."""
        others = self.load.others()
        if others is None:
            return self.limit
        return max(1, min(self.limit, int(usable_cores() - others + 0.5)))

    def tick(self):
        """Call once per step: re-sizes the pools when an interval has passed.
        Returns the pool size."""
        now = time.monotonic()
        if now - self._since >= self.interval:
            self._since = now
            threads = self.free_cores()
            if threads != self.threads:
                self.threads = set_num_threads(threads)
                self.changes += 1
        return self.threads
