"""Bit arithmetic shared by both backends and the host: Fibonacci hashing,
MurmurHash3's ``fmix32``, ``splitmix64`` and float32 -> bfloat16 rounding.

Each is written once, as plain Python on NumPy's unsigned integer types with
operators only (no branches, no calls): :mod:`hbkernels.cpu._common` compiles
them with ``numba.njit``, :mod:`hbkernels.cuda._launch` with
``cuda.jit(device=True)``, and the host applies them to whole NumPy or CuPy
arrays (an array in gives an array out). Every constant is unsigned, so Numba
and NumPy keep the arithmetic unsigned; only the 64-bit hashes wrap (the bf16
rounding never overflows 32 bits, so NumPy scalars raise no overflow warning).
:func:`seed_key` alone is for the host, on Python ints.
"""
import numpy as np

_M32 = np.uint64(0xFFFFFFFF)
_S13, _S16, _S27, _S30, _S31 = (np.uint64(s) for s in (13, 16, 27, 30, 31))
_U16, _U31 = np.uint32(16), np.uint32(31)


def fib_hash(x):
    """``x * 2^64/φ`` modulo 2^64 (``x`` uint64): its top bits spread keys evenly over a
    power-of-two table (Fibonacci hashing); take them with ``>> (64 - bits)``."""
    return x * np.uint64(0x9E3779B97F4A7C15)


def fmix32(x):
    """MurmurHash3's 32-bit finaliser of the low 32 bits of ``x`` (uint64; the result
    is < 2**32; no product overflows 64 bits)."""
    x = x & _M32
    x = x ^ (x >> _S16)
    x = (x * np.uint64(0x85EBCA6B)) & _M32
    x = x ^ (x >> _S13)
    x = (x * np.uint64(0xC2B2AE35)) & _M32
    return x ^ (x >> _S16)


def splitmix64(x):
    """splitmix64's output function of state ``x`` (uint64, wrapping): the state is
    advanced by the golden-ratio increment, then mixed."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _S30)) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _S27)) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> _S31)


def seed_key(seed, x):
    """A 64-bit key (a Python int) of the integer ``seed`` (``[-2**63, 2**64)``) and the
    non-negative int ``x`` (a table's crc32, a step): ``k = splitmix64((seed mod 2**32)
    << 32 ^ x)`` (mod 2**64), and where ``seed >> 32`` is not 0 (an arithmetic shift: in
    ``[-2**31, 2**32)``) also ``k = splitmix64(k ^ (seed >> 32 mod 2**64))``, so every bit
    of the seed, its sign included, counts."""
    mask = (1 << 64) - 1
    with np.errstate(over="ignore"):
        key = int(splitmix64(np.uint64((((seed & 0xFFFFFFFF) << 32) ^ x) & mask)))
        if seed >> 32:
            key = int(splitmix64(np.uint64(key ^ ((seed >> 32) & mask))))
    return key


def bfloat16_bits(bits):
    """The bfloat16 bit pattern (low 16 bits of the unsigned result) of the float32
    whose bit pattern is ``bits`` (uint32): rounded to nearest even; a NaN becomes
    the quiet NaN ``0x7FC0`` with its sign, as ml_dtypes makes it."""
    magnitude = bits & np.uint32(0x7FFFFFFF)
    sign = (bits >> _U16) & np.uint32(0x8000)
    lsb = (magnitude >> _U16) & np.uint32(1)
    rounded = ((magnitude + np.uint32(0x7FFF) + lsb) >> _U16) | sign
    quiet = sign | np.uint32(0x7FC0)
    # 1 for a NaN (a magnitude above +inf's 0x7F800000 carries into bit 31), else 0
    nan = (magnitude + np.uint32(0x007FFFFF)) >> _U31
    return rounded ^ ((rounded ^ quiet) * nan)
