"""Numba's kernel ABI: the parameters a ``cuda.jit`` kernel's entry takes for its argument
types, in order, each as a ``struct`` code and a PTX type. An array is flattened to
``meminfo, parent, nitems, itemsize, data, shape..., strides...`` (``5 + 2·ndim``
parameters); a scalar is one parameter of its own type.

:mod:`._launcher` packs every launch's arguments by :func:`parameters`, and
:func:`._compile.check_entry` holds each compiled kernel's PTX entry to the same list.
"""
from numba import types

# struct code and PTX parameter type of each scalar Numba type
_CODES = {types.int64: ("q", "u64"), types.uint64: ("Q", "u64"), types.int32: ("i", "u32"),
          types.uint32: ("I", "u32"), types.int16: ("h", "u16"), types.uint16: ("H", "u16"),
          types.int8: ("b", "u8"), types.uint8: ("B", "u8"), types.boolean: ("?", "u8"),
          types.float16: ("e", "u16"), types.float32: ("f", "f32"), types.float64: ("d", "f64")}
_ARRAY_HEAD = (("Q", "u64"), ("Q", "u64"), ("q", "u64"), ("q", "u64"), ("Q", "u64"))


def parameters(argtypes):
    """``[(struct code, PTX type), ...]``: the kernel parameters of ``argtypes`` (Numba
    types) in Numba's ABI (an array flattened to ``5 + 2·ndim`` of them)."""
    out = []
    for ty in argtypes:
        if isinstance(ty, types.Array):
            out += _ARRAY_HEAD + (("q", "u64"),) * (2 * ty.ndim)
        elif ty in _CODES:
            out.append(_CODES[ty])
        else:
            raise TypeError(f"no launch ABI for a kernel argument of type {ty}")
    return out


def ptx_types(argtypes):
    """The PTX types of :func:`parameters`, in order (``["u64", ..., "u32", "f32"]``)."""
    return [kind for _, kind in parameters(argtypes)]
