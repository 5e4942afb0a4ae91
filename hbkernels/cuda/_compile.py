"""A kernel compiled for one signature, without a GPU: Numba and NVVM to PTX, then
a link for one architecture into a cubin (cuda.core's ``Linker``: nvJitLink where
installed, else the driver's linker).

* :func:`ptx`: the PTX of a ``cuda.jit`` kernel for argument types and a compute
  capability, with the kernel's own options (launch bounds, fastmath, lineinfo).
* :func:`link`: ``(cubin bytes, the linker's log)`` of that PTX.
* :func:`entry_name` / :func:`entry_params`: the kernel's mangled entry and the PTX
  types of its parameters, in order (``u64``, ``u32``, ``u8``, ``f32``, ...).
* :func:`check_entry`: those parameters against what :mod:`._launcher` packs for the
  argument types (:mod:`._abi`); a kernel whose entry differs is an error naming it and
  the first parameter that differs, at compile time, before any launch could read its
  arguments from the wrong places.

The launcher compiles through these on a GPU, and ``tests/compile_kernels.py``
through the same functions on a machine with none.
"""
import re

from ._abi import ptx_types

_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(([^)]*)\)")
_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)(?:\s+\.ptr(?:\s+\.\w+)*(?:\s+\.align\s+\d+)?)?"
                    r"\s+[\w$]+_param_(\d+)")


def ptx(dispatcher, argtypes, cc):
    """PTX text of ``dispatcher`` (a ``cuda.jit`` kernel) for ``argtypes`` (Numba types)
    on compute capability ``cc`` (e.g. ``(9, 0)``)."""
    from numba import cuda

    options = dispatcher.targetoptions
    text, _ = cuda.compile_ptx(dispatcher.py_func, tuple(argtypes), cc=cc,
                               fastmath=options.get("fastmath", False),
                               lineinfo=options.get("lineinfo", False),
                               launch_bounds=options.get("launch_bounds"))
    return text


def link(ptx_text, cc):
    """``(cubin, log)``: ``ptx_text`` linked for ``sm_<cc>`` (the log has ptxas's
    register and spill report)."""
    from cuda.core import Linker, LinkerOptions, ObjectCode

    linker = Linker(ObjectCode.from_ptx(ptx_text.encode(), name="kernel"),
                    options=LinkerOptions(arch=f"sm_{cc[0]}{cc[1]}", verbose=True))
    linked = linker.link("cubin")
    return bytes(linked.code), linker.get_info_log()


def _entry(ptx_text):
    found = _ENTRY.findall(ptx_text)
    if len(found) != 1:
        raise ValueError(f"expected one .entry in the kernel's PTX, found {len(found)}")
    return found[0]


def entry_name(ptx_text):
    """The mangled name of the one kernel entry in ``ptx_text``."""
    return _entry(ptx_text)[0]


def entry_params(ptx_text):
    """The PTX types of the entry's parameters, in order (``["u64", "u64", ..., "u8"]``)."""
    params = _PARAM.findall(_entry(ptx_text)[1])
    if [int(i) for _, i in params] != list(range(len(params))):
        raise ValueError("the kernel's PTX parameters are not numbered 0, 1, 2, ...")
    return [kind for kind, _ in params]


def check_entry(ptx_text, argtypes, kernel):
    """Raise ``TypeError`` naming ``kernel`` (its name, for the message) and the first
    parameter that differs where the entry of ``ptx_text`` does not take the parameters
    the launcher packs for ``argtypes`` (Numba types)."""
    expected, found = ptx_types(argtypes), entry_params(ptx_text)
    if found == expected:
        return
    first = next((i for i, (e, f) in enumerate(zip(expected, found)) if e != f),
                 min(len(expected), len(found)))
    said = lambda kinds: f".{kinds[first]}" if first < len(kinds) else "nothing"  # noqa: E731
    raise TypeError(f"kernel {kernel}: the launcher packs {len(expected)} parameters for "
                    f"{tuple(str(t) for t in argtypes)} but its PTX entry takes {len(found)}; "
                    f"parameter {first} is {said(expected)} in the launcher and {said(found)} "
                    f"in the PTX (a Numba ABI the launcher does not know)")
