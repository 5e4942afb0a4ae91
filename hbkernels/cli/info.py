"""``hbkernels info``: versions, devices, and which backends will run and why.

Versions come from the installed distributions' metadata (no heavy imports);
CuPy, NCCL and the MPI library are asked directly, since their versions are
what the collectives will use. ``--json`` prints the same as one JSON object.

>>> info = collect_info(probe_mpi=False)
>>> info["versions"]["hbkernels"] == __import__("hbkernels").__version__
True
>>> info["backends"]["numpy"]["available"]
True
"""
import importlib
import importlib.metadata as metadata
import json
import os
import platform
import sys

from .._machine import cpu_name

#: label -> distributions that provide it (the first one installed is reported)
DISTRIBUTIONS = {
    "numpy": ("numpy",),
    "numba": ("numba",),
    "numba-cuda": ("numba-cuda",),
    "cupy": ("cupy-cuda13x", "cupy-cuda12x", "cupy"),
    "mpi4py": ("mpi4py",),
    "torch": ("torch",),
    "jax": ("jax",),
    "jaxlib": ("jaxlib",),
    "tensorflow": ("tensorflow", "tensorflow-cpu"),
    "pyarrow": ("pyarrow",),
}


def distribution_version(names):
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def probe_cuda():
    """(devices, reason): the CUDA devices CuPy sees, or why there are none."""
    from .._dispatch import simulator_enabled

    if simulator_enabled():
        return [], "NUMBA_ENABLE_CUDASIM=1: CUDA kernels run in Numba's simulator on the CPU"
    try:
        cupy = importlib.import_module("cupy")
    except ImportError:
        return [], "CuPy is not installed (pip install 'hbkernels[cuda12]' or '[cuda13]')"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver, no device: say so
        return [], f"CuPy finds no CUDA device ({type(exc).__name__}: {exc})".splitlines()[0]
    devices = []
    for i in range(count):
        props = cupy.cuda.runtime.getDeviceProperties(i)
        name = props["name"]
        devices.append({
            "id": i,
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
            "compute_capability": f"{props['major']}.{props['minor']}",
        })
    return devices, None if devices else "CuPy finds no CUDA device"


def nccl_version():
    try:
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001 - CuPy without NCCL
        return None
    try:
        v = nccl.get_version()
    except Exception:  # noqa: BLE001
        return None
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"


def mpi_library():
    """The MPI library's own version line, or None without mpi4py (imports mpi4py.MPI)."""
    try:
        from mpi4py import MPI
    except Exception:  # noqa: BLE001 - no mpi4py or no MPI library
        return None
    return MPI.Get_library_version().strip().splitlines()[0]


def numba_runtime():
    """The CPU kernels' runtime: Numba's thread count, threading layer (chosen when
    the first parallel kernel runs) and kernel cache location."""
    from .. import threads
    from .._numba_cache import cache_info

    pool = threads.pools()["numba"]
    return {"threads": pool["threads"], "threading_layer": pool["layer"], "cache": cache_info()}


def thread_pools():
    """:func:`hbkernels.threads.pools`, with torch imported when it is installed (its
    pool is the other half of a training process)."""
    from .. import threads

    if distribution_version(DISTRIBUTIONS["torch"]):
        try:
            importlib.import_module("torch")
        except Exception:  # noqa: BLE001 - a broken torch: report Numba's pool alone
            pass
    return threads.pools()


def collect_info(probe_mpi=True):
    """Everything ``hbkernels info`` reports, as a dict."""
    import numba

    import hbkernels
    from ..dist import launcher

    versions = {"hbkernels": hbkernels.__version__, "python": platform.python_version()}
    versions.update({label: distribution_version(names) for label, names in DISTRIBUTIONS.items()})
    devices, cuda_reason = probe_cuda()
    versions["nccl"] = nccl_version() if devices else None
    versions["mpi library"] = mpi_library() if probe_mpi else None

    started_by = launcher()
    if started_by is None:
        dist_choice = "local: not started by a launcher (mpiexec -n N or torchrun --nproc-per-node N)"
    elif started_by == "torch":
        dist_choice = "torch: torch.distributed's ranks (gloo; NCCL for CUDA arrays)"
    elif devices:
        dist_choice = "nccl if every rank has a GPU of its own, else mpi (the ranks agree)"
    else:
        dist_choice = "mpi: no CUDA device here"
    simulator = bool(cuda_reason and cuda_reason.startswith("NUMBA_ENABLE_CUDASIM"))
    return {
        "versions": versions,
        "cpu": {"name": cpu_name(), "cores": os.cpu_count()},
        "cuda_devices": devices,
        "backends": {
            "numpy": {"available": True,
                      "why": f"NumPy arrays -> Numba CPU kernels on {numba.get_num_threads()} "
                             f"threads"},
            "cuda": {"available": bool(devices) or simulator,
                     "why": ("CuPy / CUDA arrays -> Numba CUDA kernels on "
                             + ", ".join(d["name"] for d in devices)) if devices else cuda_reason},
            "dist": {"available": True, "why": f"hbk.dist.init('auto') -> {dist_choice}"},
        },
        "numba": numba_runtime(),
        "threads": thread_pools(),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("HBK_")},
        "executable": sys.executable,
    }


def format_info(info):
    lines = ["versions:"]
    width = max(len(k) for k in info["versions"])
    for name, version in info["versions"].items():
        lines.append(f"  {name:<{width}}  {version or '-'}")
    cpu = info["cpu"]
    lines.append("devices:")
    lines.append(f"  cpu   {cpu['name']} ({cpu['cores']} cores)")
    for d in info["cuda_devices"]:
        lines.append(f"  cuda:{d['id']} {d['name']} ({d['memory_gib']} GiB, sm {d['compute_capability']})")
    if not info["cuda_devices"]:
        lines.append("  cuda  none")
    lines.append("backends:")
    for name, b in info["backends"].items():
        lines.append(f"  {name:<6} {'yes' if b['available'] else 'no ':<4} {b['why']}")
    rt = info["numba"]
    lines.append("numba:")
    cache = rt["cache"]
    lines.append(f"  kernel cache     {cache['location'] if cache['caching'] else 'off: ' + cache['location']}")
    pools = info["threads"]
    lines.append(f"thread pools ({pools['cores']} usable cores; hbkernels train --threads auto: "
                 f"one thread per free core in each):")
    lines.append(f"  numba  {pools['numba']['threads']} of {pools['numba']['max']} threads, "
                 f"threading layer {pools['numba']['layer']}")
    torch_pool = pools["torch"]
    lines.append(f"  torch  {torch_pool['threads']} threads (+{torch_pool['interop_threads']} "
                 f"inter-op), {torch_pool['parallel']}" if torch_pool else "  torch  not installed")
    lines += [f"  {k}={v}" for k, v in pools["environment"].items()]
    lines.append("environment (HBK_*):")
    lines += [f"  {k}={v}" for k, v in info["environment"].items()] or ["  none set"]
    return "\n".join(lines)


def run(args):
    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def add_command(subparsers):
    p = subparsers.add_parser("info", help="versions, devices, and which backends will be used")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)
