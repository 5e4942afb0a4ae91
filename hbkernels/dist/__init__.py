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

__all__ = ["CommError", "Communicator", "init", "launcher", "ranks_per_node", "DEFAULT_TIMEOUT",
           "LAUNCHER_ENV_VARS", "LOCAL_SIZE_ENV_VARS", "MPI_LAUNCHER_ENV_VARS", "MPI_SIZE_ENV_VARS", "SLURM_ENV_VARS",
           "TORCH_LAUNCHER_ENV_VARS"]

DEFAULT_TIMEOUT = 300.0
TIMEOUT_ENV = "HBK_COMM_TIMEOUT"
BACKENDS = ("auto", "nccl", "mpi", "torch", "local")
#: environment variables that MPI launchers (mpiexec, mpirun, srun) set in the processes
#: they start, each holding the process's rank
MPI_LAUNCHER_ENV_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")
#: environment variables in which MPI launchers state how many ranks they started
#: (``MPI_LOCALNRANKS``: on this node)
MPI_SIZE_ENV_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
#: srun's rank and its step's task count, set with or without an MPI plugin (not
#: ``SLURM_NTASKS``: a batch script, one process, has it too)
SLURM_ENV_VARS = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
#: torch.distributed's ``env://`` variables, as torchrun sets them
TORCH_LAUNCHER_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                           "MASTER_PORT", "TORCHELASTIC_RUN_ID")
#: environment variables in which launchers state the ranks of this process's node:
#: torchrun's, MPICH's (Hydra), Open MPI's
LOCAL_SIZE_ENV_VARS = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
#: environment variables holding this process's rank under a launcher, MPI's first
LAUNCHER_ENV_VARS = MPI_LAUNCHER_ENV_VARS + ("RANK",)

# the variables that say how many ranks a launch has: MPI's (srun's among them), torch's
_MPI_WORLD_VARS = MPI_LAUNCHER_ENV_VARS + MPI_SIZE_ENV_VARS + SLURM_ENV_VARS
_TORCH_WORLD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_RANK_VARS = MPI_LAUNCHER_ENV_VARS + ("SLURM_PROCID", "RANK", "LOCAL_RANK")
_SINGLE_PROCESS_HINT = "for one process alone, use hbk.dist.init('local')"


def _env(name):
    return os.environ.get(name, "").strip()


def _claimed(names):
    """``(ranks, shown)``: how many ranks the variables ``names`` say this launch has
    at least (a rank r says r + 1, a size itself; 1 when none says more), and those
    that are set, as ``"NAME=value, ..."``."""
    ranks, shown = 1, []
    for name in names:
        value = _env(name)
        if value:
            shown.append(f"{name}={value}")
            if value.isdigit():
                ranks = max(ranks, int(value) + (name in _RANK_VARS))
    return ranks, ", ".join(shown)


def _under_mpi():
    """True when this process was started by an MPI launcher (a rank variable of
    :data:`MPI_LAUNCHER_ENV_VARS` set, or one of :data:`MPI_SIZE_ENV_VARS` above 1)
    or already runs MPI with more than one rank. Checks environment variables
    first, so that no mpi4py import happens outside ``mpiexec``."""
    if any(_env(v) for v in MPI_LAUNCHER_ENV_VARS) or _claimed(MPI_SIZE_ENV_VARS)[0] > 1:
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            return bool(mpi.Is_initialized()) and mpi.COMM_WORLD.Get_size() > 1
        except Exception:  # noqa: BLE001
            return False
    return False


def _under_torch():
    """True when torchrun (or another launcher of torch.distributed's ``env://``
    kind) started this process: ``RANK`` or ``TORCHELASTIC_RUN_ID`` set, or
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` or ``LOCAL_RANK`` saying there are
    several ranks; or torch.distributed is already initialised. No torch import."""
    return bool(_env("TORCHELASTIC_RUN_ID") or _env("RANK")) or \
        _claimed(_TORCH_WORLD_VARS)[0] > 1 or _torch_initialized()


def _torch_initialized():
    """True when torch.distributed's default group exists; no torch import."""
    td = sys.modules.get("torch.distributed")
    try:
        return td is not None and td.is_available() and td.is_initialized()
    except Exception:  # noqa: BLE001
        return False


def launcher():
    """Who started this process, from its environment: ``"mpi"`` (an MPI launcher:
    ``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``, ``PMIX_RANK`` or ``MPI_LOCALRANKID``
    set, ``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE`` or ``MPI_LOCALNRANKS`` above 1,
    or MPI already running with more than one rank), ``"torch"`` (torchrun or
    another launcher of torch.distributed's ``env://`` kind: ``RANK`` or
    ``TORCHELASTIC_RUN_ID`` set, or ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` or
    ``LOCAL_RANK`` saying there are several ranks; or torch.distributed already
    initialised), ``"mpi"`` again for srun without either (``SLURM_STEP_NUM_TASKS`` above
    1 or ``SLURM_PROCID`` above 0), or ``None`` (one process, alone: none of
    these, or ``WORLD_SIZE=1``). MPI's variables win over torch's, and torch's
    over srun's. :func:`init` follows this answer, and raises where the ranks it
    names cannot be connected. Imports neither mpi4py nor torch.

    >>> import hbkernels as hbk
    >>> hbk.dist.launcher() is None   # a plain python process
    True
    """
    if _under_mpi():
        return "mpi"
    if _under_torch():
        return "torch"
    if _claimed(SLURM_ENV_VARS)[0] > 1:
        return "mpi"
    return None


def ranks_per_node():
    """The ranks of this process's node as its launcher states them (the first of
    :data:`LOCAL_SIZE_ENV_VARS` set to a positive integer), else None.

    >>> import hbkernels as hbk
    >>> hbk.dist.ranks_per_node() is None   # a plain python process
    True
    """
    for name in LOCAL_SIZE_ENV_VARS:
        value = _env(name)
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def _torch_env_world():
    """``WORLD_SIZE`` of torch.distributed's environment (1 when unset), after
    checking that every rank this process's environment says exists (torch's,
    an MPI launcher's or srun's variables) can be connected through it."""
    names = {v: _env(v) for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    shown = ", ".join([f"{k}={v or '<unset>'}" for k, v in names.items()] +
                      [f"{k}={_env(k)}" for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE") if _env(k)])
    for key in _TORCH_WORLD_VARS + ("MASTER_PORT",):
        if _env(key) and not _env(key).isdigit():
            raise RuntimeError(f"torchrun launch: {key}={_env(key)!r} is not a number ({shown})")
    world = int(names["WORLD_SIZE"] or 1)
    claimed = _claimed(_TORCH_WORLD_VARS)[0]
    missing = [k for k, v in names.items() if not v]
    if missing and claimed > 1:
        raise RuntimeError(
            f"torchrun launch: the ranks cannot be connected: {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} unset ({shown}); launch with torchrun, "
            "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
    if claimed > world:
        beyond = [f"{k}={_env(k)}" for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
                  if _claimed((k,))[0] > world]
        raise RuntimeError(
            f"torchrun launch: {', '.join(beyond)} {'does' if len(beyond) == 1 else 'do'} not "
            f"fit in WORLD_SIZE={world} ranks ({shown}): RANK and LOCAL_RANK must be below "
            "WORLD_SIZE, LOCAL_WORLD_SIZE at most WORLD_SIZE")
    mpi_world, mpi_shown = _claimed(_MPI_WORLD_VARS)
    if world == 1 and mpi_world > 1:
        raise RuntimeError(
            f"backend 'torch': the launcher started {mpi_world} ranks ({mpi_shown}) but "
            f"torch.distributed's environment says this process is alone ({shown}), so the "
            "ranks cannot be connected: use backend 'auto' or 'mpi' under mpiexec or srun, "
            "launch with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT on "
            f"every rank; {_SINGLE_PROCESS_HINT}")
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


def _check_mpi_world(backend):
    """RuntimeError when MPI's ``COMM_WORLD`` holds this process alone while the
    launcher's variables (MPI's, srun's) say it started several ranks."""
    from mpi4py import MPI

    launched, shown = _claimed(_MPI_WORLD_VARS)
    if launched > 1 and MPI.COMM_WORLD.Get_size() == 1:
        library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
        raise RuntimeError(
            f"backend {backend!r}: the launcher started {launched} ranks ({shown}) but MPI "
            f"(mpi4py over {library}) sees this process alone, so the ranks cannot be "
            "connected: launch with the mpiexec of the MPI library mpi4py was built with (or "
            "srun with that library's PMI plugin, --mpi=pmix or pmi2), or with torchrun; "
            f"{_SINGLE_PROCESS_HINT}")


def _open_mpi(backend, timeout, group=None):
    from ._mpi import MpiCommunicator

    if group is None:
        _check_mpi_world(backend)
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

    - under an MPI launcher or srun (:func:`launcher` says ``"mpi"``):
      ``"nccl"`` when CuPy works and every rank has a GPU of its own, else
      ``"mpi"`` (agreed by all ranks);
    - under torchrun (:func:`launcher` says ``"torch"``: ``RANK`` or
      ``TORCHELASTIC_RUN_ID`` set, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` or
      ``LOCAL_RANK`` saying there are several ranks) or with torch.distributed
      initialised: ``"torch"``;
    - else (:func:`launcher` says ``None``: no launcher's variables, or
      ``WORLD_SIZE=1``) ``"local"``.

    A launch whose ranks cannot be connected is an error, never N copies of a
    one-rank job. ``RuntimeError``, naming the variables and what to change:
    torch's variables saying several ranks (``WORLD_SIZE`` or
    ``LOCAL_WORLD_SIZE`` > 1, ``RANK`` or ``LOCAL_RANK`` > 0) with ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` or ``MASTER_PORT`` unset, or more ranks
    than ``WORLD_SIZE``; an MPI launcher's or srun's variables
    (``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE``, ``SLURM_STEP_NUM_TASKS``, a rank > 0, ...)
    saying several ranks while MPI's ``COMM_WORLD`` holds this process alone
    (an ``mpiexec`` of another MPI library than mpi4py's, srun without an MPI
    plugin), or while torch's variables say one rank (``"torch"`` under
    ``mpiexec``: torch.distributed is made from torch's variables only);
    ``"mpi"`` and ``"nccl"`` under torchrun without ``mpiexec``; any backend
    but ``"local"`` under torchrun without PyTorch. A rendezvous that fails or
    does not complete within the timeout raises :class:`CommError`.
    ``"local"`` ignores the launchers' variables.

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
    started_by = launcher() if backend == "auto" else None
    if backend == "local" or (backend == "auto" and started_by is None):
        from ._local import LocalCommunicator

        return LocalCommunicator(timeout)
    if backend == "torch" or started_by == "torch":
        if not _torch_initialized():  # the group will be made from the environment
            _torch_env_world()
        _import_torch(f"backend {backend!r} under torchrun" if backend == "auto"
                      else "backend 'torch'")
        from . import _torch

        return _torch.open_world(timeout)
    try:
        import mpi4py  # noqa: F401
    except ImportError as e:
        shown = _claimed(_MPI_WORLD_VARS)[1]
        raise RuntimeError(
            f"backend {backend!r} {f'under an MPI launcher ({shown}) ' if shown else ''}"
            "needs mpi4py: pip install 'hbkernels[mpi]'") from e
    return _open_mpi(backend, timeout)
