"""Wire dtypes: what float data is cast to while it travels.

``float16`` is an ordinary cast (round to nearest even, overflow to inf).
``bfloat16`` travels as ``uint16`` bit patterns (the top half of a float32),
rounded to nearest even; NaN stays NaN (quiet, sign kept), +-inf stays inf,
values above the bfloat16 range round to inf. float64 data is first narrowed
to float32 with round-to-odd, so float64 -> bfloat16 is rounded once, exactly
as if done directly (no double rounding). Everything is vectorised and works
the same on NumPy and CuPy arrays (``xp``).

Integer and bool data ignore the wire dtype.
"""
import numpy as np

from .. import _bits

FLOAT16 = "float16"
BFLOAT16 = "bfloat16"
_ALIASES = {
    "float16": FLOAT16, "fp16": FLOAT16, "half": FLOAT16, "f2": FLOAT16, "e": FLOAT16,
    "bfloat16": BFLOAT16, "bf16": BFLOAT16,
}
CODES = {None: 0, FLOAT16: 1, BFLOAT16: 2}
NAMES = {v: k for k, v in CODES.items()}


def normalize(wire_dtype):
    """``None``, ``"float16"`` or ``"bfloat16"`` for a user's ``wire_dtype``; ValueError else."""
    if wire_dtype is None:
        return None
    name = None
    if isinstance(wire_dtype, str):
        name = _ALIASES.get(wire_dtype.strip().lower())
    else:
        try:
            name = _ALIASES.get(np.dtype(wire_dtype).name)  # np.float16, ml_dtypes.bfloat16
        except TypeError:
            name = None
    if name is None:
        raise ValueError(f"wire_dtype must be None, 'float16' or 'bfloat16', got {wire_dtype!r}")
    return name


def effective(wire, dtype):
    """The wire dtype that applies to ``dtype`` data: None for non-float data and
    for float16 data on a float16 wire (nothing to cast)."""
    dtype = np.dtype(dtype)
    if wire is None or dtype.kind != "f":
        return None
    if wire == FLOAT16 and dtype == np.float16:
        return None
    return wire


def wire_np_dtype(wire, dtype):
    """The NumPy dtype of the buffer that travels."""
    if wire is None:
        return np.dtype(dtype)
    return np.dtype(np.float16) if wire == FLOAT16 else np.dtype(np.uint16)


def encode(x, wire, xp=np):
    """``x`` as it travels (a new array unless ``wire`` is None)."""
    if wire is None:
        return x
    if wire == FLOAT16:
        return x.astype(np.float16)
    return to_bf16_bits(x, xp)


def decode(w, wire, dtype, xp=np):
    """Travelled data back in ``dtype`` (a new array unless ``wire`` is None)."""
    if wire is None:
        return w
    if wire == FLOAT16:
        return w.astype(dtype)
    f32 = from_bf16_bits(w, xp)
    return f32 if np.dtype(dtype) == np.float32 else f32.astype(dtype)


def round_trip(x, wire, xp=np):
    """``decode(encode(x))``: what a receiver gets."""
    if wire is None:
        return x.copy()
    return decode(encode(x, wire, xp), wire, x.dtype, xp)


def _f64_to_f32_round_odd(x, xp):
    """float64 -> float32 rounding to odd: exact values are kept, inexact ones are
    truncated toward zero and get their last mantissa bit set. A later
    round-to-nearest-even to fewer bits is then correctly rounded."""
    r = x.astype(np.float32)
    bits = r.view(np.uint32)
    back = r.astype(np.float64)
    inexact = (back != x) & xp.isfinite(x)
    away = xp.abs(back) > xp.abs(x)  # rounded up in magnitude (including overflow to inf)
    bits = bits - (inexact & away).astype(np.uint32)  # one step toward zero, never below 0
    bits = bits | inexact.astype(np.uint32)
    return bits.view(np.float32)


def _f64_to_bf16_bits(x, xp):
    """:func:`to_bf16_bits` of float64 data. Below float32's smallest normal (2**-126, where
    a GPU's float64 -> float32 conversion may flush to zero) the bfloat16 value is a
    multiple of 2**-133, rounded from float64 directly (exact scaling, ties to even)."""
    normal = _bits.bfloat16_bits(_f64_to_f32_round_odd(x, xp).view(np.uint32))
    magnitude = xp.abs(x)
    tiny = magnitude < 2.0 ** -126
    steps = xp.rint(xp.where(tiny, magnitude, 0.0) * 2.0 ** 133).astype(np.uint32)
    sign = xp.signbit(x).astype(np.uint32) << np.uint32(15)
    return xp.where(tiny, steps | sign, normal).astype(np.uint16)


def to_bf16_bits(x, xp=np):
    """bfloat16 bit patterns (uint16) of float data, rounded to nearest even."""
    x = xp.asarray(x)
    if x.dtype == np.float64:
        return _f64_to_bf16_bits(x, xp)
    if x.dtype == np.float32:
        f = x
    else:
        f = x.astype(np.float32)  # float16 is exact in float32
    return _bits.bfloat16_bits(xp.ascontiguousarray(f).view(np.uint32)).astype(np.uint16)


def from_bf16_bits(b, xp=np):
    """float32 values of bfloat16 bit patterns (exact)."""
    return (xp.asarray(b).astype(np.uint32) << np.uint32(16)).view(np.float32)
