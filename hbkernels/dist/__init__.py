"""Collectives: alltoallv, allreduce, allgather(v), broadcast and barrier over
MPI (mpi4py), NCCL (CuPy), torch.distributed or a single process.

Launch N processes with ``mpiexec -n N python -m mpi4py your_script.py`` or
``torchrun --nproc-per-node N your_script.py`` and call :func:`init` once on
every rank::

    import hbkernels as hbk
    comm = hbk.dist.init()          # "auto": nccl | mpi | torch | local
    recv, recv_counts = comm.alltoallv(send, send_counts)

Every call is collective (all ranks call it, in the same order, with arrays of
the same dtype and row shape) and returns new arrays in the caller's array
family (NumPy in, NumPy out; CuPy in, CuPy out). A call that cannot complete
raises :class:`CommError` on every rank within the communicator's timeout
(``HBK_COMM_TIMEOUT`` seconds, default 300): it never hangs. Importing this
module imports neither mpi4py, CuPy nor torch; :func:`init` does, when it
needs them.

>>> import numpy as np, hbkernels as hbk
>>> comm = hbk.dist.init("local")
>>> comm.backend, comm.rank, comm.world_size
('local', 0, 1)
>>> comm.allreduce(np.array([1.0, 2.0])).tolist()
[1.0, 2.0]
"""
import os
import sys

from ._common import CommError
from ._communicator import Communicator

__all__ = ["CommError", "Communicator", "init", "launcher", "DEFAULT_TIMEOUT",
           "LAUNCHER_ENV_VARS", "MPI_LAUNCHER_ENV_VARS", "TORCH_LAUNCHER_ENV_VARS"]

DEFAULT_TIMEOUT = 300.0
TIMEOUT_ENV = "HBK_COMM_TIMEOUT"
BACKENDS = ("auto", "nccl", "mpi", "torch", "local")
#: environment variables that MPI launchers (mpiexec, mpirun, srun) set in the processes
#: they start, each holding the process's rank
MPI_LAUNCHER_ENV_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")
#: torch.distributed's ``env://`` variables, as torchrun sets them
TORCH_LAUNCHER_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                           "TORCHELASTIC_RUN_ID")
#: environment variables holding this process's rank under a launcher, MPI's first
LAUNCHER_ENV_VARS = MPI_LAUNCHER_ENV_VARS + ("RANK",)

def _env(name):
    return os.environ.get(name, "").strip()


def _under_mpi():
    """True when this process was started by an MPI launcher (or already runs MPI
    with more than one rank). Checks environment variables first, so that no
    mpi4py import happens outside ``mpiexec``."""
    if any(_env(v) for v in MPI_LAUNCHER_ENV_VARS):
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            return bool(mpi.Is_initialized()) and mpi.COMM_WORLD.Get_size() > 1
        except Exception:  # noqa: BLE001
            return False
    return False


def _under_torch():
    """True when torchrun (or another launcher setting torch.distributed's
    ``RANK``) started this process, or torch.distributed is already
    initialised; no torch import."""
    return bool(_env("TORCHELASTIC_RUN_ID") or _env("RANK")) or _torch_initialized()


def _torch_initialized():
    """True when torch.distributed's default group exists; no torch import."""
    td = sys.modules.get("torch.distributed")
    try:
        return td is not None and td.is_available() and td.is_initialized()
    except Exception:  # noqa: BLE001
        return False


def launcher():
    """Who started this process: ``"mpi"`` (an MPI launcher: ``PMI_RANK``,
    ``OMPI_COMM_WORLD_RANK``, ``PMIX_RANK`` or ``MPI_LOCALRANKID`` set, or MPI
    already running with more than one rank), ``"torch"`` (torchrun or another
    launcher of torch.distributed's ``env://`` kind: ``RANK`` or
    ``TORCHELASTIC_RUN_ID`` set; or torch.distributed already initialised), or
    ``None``. MPI's variables win when both kinds are set. Imports neither
    mpi4py nor torch.

    >>> import hbkernels as hbk
    >>> hbk.dist.launcher() is None   # a plain python process
    True
    """
    if _under_mpi():
        return "mpi"
    if _under_torch():
        return "torch"
    return None


def _under_launcher():
    """True when a launcher started this process (:func:`launcher` is not None)."""
    return launcher() is not None


def _torch_env_world():
    """``WORLD_SIZE`` of torch.distributed's environment (1 when unset), after
    checking that ranks it says exist can be connected."""
    names = {v: _env(v) for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    shown = ", ".join(f"{k}={v or '<unset>'}" for k, v in names.items())
    for key in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        if names[key] and not names[key].isdigit():
            raise RuntimeError(f"torchrun launch: {key}={names[key]!r} is not a number ({shown})")
    world = int(names["WORLD_SIZE"] or 1)
    missing = [k for k, v in names.items() if not v]
    if missing and (world > 1 or int(names["RANK"] or 0) > 0):
        raise RuntimeError(
            f"torchrun launch: the ranks cannot be connected: {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} unset ({shown}); launch with torchrun, "
            "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
    if names["RANK"] and int(names["RANK"]) >= world:
        raise RuntimeError(f"torchrun launch: RANK={names['RANK']} is not below "
                           f"WORLD_SIZE={world} ({shown})")
    return world


def _import_torch(why):
    try:
        import torch.distributed  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"{why} needs PyTorch (torch.distributed): pip install torch, "
                           "or launch with mpiexec") from e


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


def _group_kind(group):
    """``"mpi"`` for an mpi4py communicator, ``"torch"`` for a torch.distributed
    process group; TypeError else."""
    module = type(group).__module__ or ""
    if module.startswith("mpi4py"):
        from mpi4py import MPI

        if isinstance(group, MPI.Comm):
            return "mpi"
    tdist = sys.modules.get("torch.distributed")
    if module.startswith("torch") or tdist is not None:
        import torch.distributed as tdist

        if isinstance(group, tdist.ProcessGroup):
            return "torch"
        if type(group) is type(tdist.GroupMember.NON_GROUP_MEMBER) and \
                group == tdist.GroupMember.NON_GROUP_MEMBER:  # new_group() on a non-member
            return "torch"
    raise TypeError("group must be an mpi4py communicator (mpi4py.MPI.Comm) or a "
                    f"torch.distributed ProcessGroup, got {type(group).__name__}")


def _join(backend, group, timeout):
    kind = _group_kind(group)
    allowed = {"mpi": ("auto", "mpi", "nccl"), "torch": ("auto", "torch")}[kind]
    if backend not in allowed:
        what = "an mpi4py communicator" if kind == "mpi" else "a torch.distributed process group"
        raise ValueError(f"backend {backend!r} cannot use {what} as its group "
                         f"(use one of {', '.join(allowed)})")
    if kind == "torch":
        from . import _torch

        return _torch.join(group, timeout)
    from mpi4py import MPI

    if group == MPI.COMM_NULL:
        raise ValueError("group: MPI.COMM_NULL (this process is not a member of the communicator)")
    if not isinstance(group, MPI.Intracomm):
        raise ValueError("group: an MPI intercommunicator cannot be used; pass an intracommunicator")
    return _open_mpi(backend, timeout, group)


def _open_mpi(backend, timeout, group=None):
    from ._mpi import MpiCommunicator

    ctl = MpiCommunicator(timeout, group)
    alone = group is None and ctl.world_size == 1
    torch_world = _torch_env_world() if alone and _under_torch() else 1
    if torch_world > 1:  # torchrun's ranks, each in an MPI world of its own
        raise RuntimeError(
            f"backend {backend!r}: torchrun started WORLD_SIZE={torch_world} ranks but MPI "
            "sees this process alone (no mpiexec): use backend='torch' or 'auto' under torchrun")
    if backend == "mpi":
        return ctl
    from ._nccl import NcclCommunicator, plan_devices

    device, reason = plan_devices(ctl, required=backend == "nccl")
    if device is None:
        return ctl  # auto, and some rank cannot use NCCL
    return NcclCommunicator(timeout, ctl, device)


def init(backend="auto", *, timeout=None, group=None):
    """A communicator over every process of this job, or of ``group`` (collective:
    every rank of it calls ``init``).

    ``backend``: ``"local"`` (this process alone, no MPI import), ``"mpi"``
    (mpi4py; NumPy arrays, and CUDA arrays directly when the MPI library is
    CUDA-aware, else staged through pinned host memory), ``"nccl"`` (CuPy's
    NCCL for CUDA arrays, one GPU per rank picked by node-local rank, NumPy
    arrays over MPI; the NCCL unique id travels over mpi4py), ``"torch"``
    (torch.distributed: gloo for NumPy arrays, NCCL for CUDA arrays when every
    rank has a GPU of its own, picked by ``LOCAL_RANK``, else through the host;
    joins the default process group if torch.distributed is initialised, else
    makes it from torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``; a world of one with no launcher) or ``"auto"``:

    - under an MPI launcher (``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``,
      ``PMIX_RANK`` or ``MPI_LOCALRANKID`` set): ``"nccl"`` when CuPy works
      and every rank has a GPU of its own, else ``"mpi"`` (agreed by all ranks);
    - under torchrun (``RANK`` or ``TORCHELASTIC_RUN_ID`` set) or with
      torch.distributed initialised: ``"torch"``;
    - else ``"local"``.

    A launch whose ranks cannot be connected is an error, never N copies of a
    one-rank job: ``WORLD_SIZE`` > 1 (or ``RANK`` > 0) with ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` or ``MASTER_PORT`` unset raises
    ``RuntimeError`` naming them; a rendezvous that fails or does not complete
    within the timeout raises :class:`CommError`; ``"mpi"`` and ``"nccl"``
    under torchrun without ``mpiexec``, and any backend but ``"local"`` under
    torchrun without PyTorch, raise ``RuntimeError``.

    ``group``: an existing ``mpi4py.MPI.Comm`` (intracommunicator; backends
    ``"auto"``, ``"mpi"``, ``"nccl"``: used instead of ``COMM_WORLD``, and only
    its ranks call ``init``) or ``torch.distributed`` process group (a
    ``new_group``, or ``torch.distributed.group.WORLD``; backends ``"auto"``,
    ``"torch"``; it needs a CPU backend such as gloo, and carries CUDA arrays
    itself when its CUDA backend is NCCL, on the GPU current now). No new
    process group is initialised; ranks are the group's.
    ``timeout``: seconds a call may take before :class:`CommError`
    (default: ``HBK_COMM_TIMEOUT`` or 300).

    >>> import hbkernels as hbk
    >>> hbk.dist.init().backend   # outside mpiexec and torchrun
    'local'
    """
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    backend = backend.lower()
    timeout = _resolve_timeout(timeout)
    if group is not None:
        if backend == "local":
            raise ValueError("backend 'local' takes no group (it is this process alone)")
        return _join(backend, group, timeout)
    if backend == "local" or (backend == "auto" and not _under_launcher()):
        from ._local import LocalCommunicator

        return LocalCommunicator(timeout)
    if backend == "torch" or (backend == "auto" and not _under_mpi()):
        if not _torch_initialized():  # the group will be made from the environment
            _torch_env_world()
        _import_torch(f"backend {backend!r} under torchrun" if backend == "auto"
                      else "backend 'torch'")
        from . import _torch

        return _torch.open_world(timeout)
    try:
        import mpi4py  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            f"backend {backend!r} under an MPI launcher needs mpi4py: "
            "pip install 'hbkernels[mpi]'") from e
    return _open_mpi(backend, timeout)
