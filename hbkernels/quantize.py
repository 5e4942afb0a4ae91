"""Row-wise quantized tables for inference: :func:`quantize_rows` and :class:`QuantizedTable`.

Row ``r`` of a table becomes ``bits``-bit codes (8, 4 or 2) with one float16 ``scale[r]``
and ``bias[r]``: element ``j`` dequantizes to ``scale[r] * code + bias[r]`` (computed in
float32). Codes are packed low bits first in each byte: with 4 bits element ``2k`` is the
low nibble of byte ``k``, with 2 bits element ``4k`` the lowest two bits; a row takes
``ceil(D * bits / 8)`` bytes, its last byte's unused bits zero. A table of ``E`` rows
takes ``E * (ceil(D * bits / 8) + 4)`` bytes.

Rounding: ``bias`` is the row's minimum rounded down to a float16 and ``scale`` the
step ``(max - bias) / (2^bits - 1)`` rounded up to a float16, so every code
``round((x - bias) / scale)`` (to nearest, ties to even) lies in ``[0, 2^bits - 1]``
and every element dequantizes within half a step (``scale / 2``) of the original,
plus float32 rounding. A row of one value gets ``scale = 0`` and that value (rounded
down to a float16) as its bias. FBGEMM's int-N TBE rounds scale and bias to nearest
instead; its codes of the same scale and bias are the same.
"""
from typing import Any, NamedTuple

import numpy as np

from . import _validate as check
from ._dispatch import resolve

BITS = (8, 4, 2)
CHUNK_ROWS = 1 << 16  # rows quantized at a time: a table larger than memory goes through
FLOAT16_MAX = float(np.finfo(np.float16).max)


def check_bits(bits):
    """``bits`` as an ``int``: a Python or NumPy integer 8, 4 or 2 (not a bool, not a
    float), else a ``ValueError`` naming what came."""
    if (isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer))
            or int(bits) not in BITS):
        raise ValueError(f"bits must be one of {BITS} (an integer), got {bits!r} "
                         f"({type(bits).__name__})")
    return int(bits)


def row_bytes(dim, bits):
    """Bytes of one row's codes: ``ceil(dim * bits / 8)``."""
    return -(-int(dim) * int(bits) // 8)


class QuantizedTable:
    """A row-wise quantized table (:func:`quantize_rows`), held as one uint8 array
    ``rows`` ``[num_rows, ceil(dim * bits / 8) + 4]``: each row's codes, then its float16
    scale and bias as 2 bytes each (little-endian), so that a lookup reads one run of
    memory per id. ``codes`` (uint8 ``[num_rows, ceil(dim * bits / 8)]``) is a view of
    it; ``scale`` and ``bias`` (float16 ``[num_rows]``) are read out of it (copies). The
    arrays are in the family of the table it came from (NumPy, or CuPy on a GPU).
    ``hbk.embedding_bag`` and ``hbk.lookup`` take it wherever they take a table and
    return float32; backward ops and optimizers refuse it (inference only).
    ``QuantizedTable(codes, scale, bias, bits, dim)`` packs separate arrays (a copy).

    >>> import numpy as np, hbkernels as hbk
    >>> q = hbk.quantize_rows(np.array([[0.0, 1.0, 3.0]], np.float32), bits=2)
    >>> q.codes.tolist(), q.scale.tolist(), q.bias.tolist(), q.nbytes
    ([[52]], [1.0], [0.0], 5)
    >>> q.dequantize().tolist()
    [[0.0, 1.0, 3.0]]
    """

    def __init__(self, codes, scale, bias, bits, dim):
        bits = check_bits(bits)
        dim = check.count("dim", dim, minimum=1)
        family, a = resolve(codes=codes, scale=scale, bias=bias)
        codes, scale, bias = a["codes"], a["scale"], a["bias"]
        width = row_bytes(dim, bits)
        n = codes.shape[0] if codes.ndim == 2 else -1
        if codes.ndim != 2 or np.dtype(codes.dtype) != np.uint8 or codes.shape[1] != width:
            raise ValueError(f"codes must be uint8 [num_rows, {width}] for dim={dim}, "
                             f"bits={bits}, got {np.dtype(codes.dtype)} {tuple(codes.shape)}")
        for name, v in (("scale", scale), ("bias", bias)):
            if np.dtype(v.dtype) != np.float16 or tuple(v.shape) != (n,):
                raise ValueError(f"{name} must be float16 [{n}], got {np.dtype(v.dtype)} "
                                 f"{tuple(v.shape)}")
        xp = family.xp
        rows = xp.empty((n, width + 4), np.uint8)
        rows[:, :width] = family.compute(codes)
        for k, v in enumerate((scale, bias)):
            rows[:, width + 2 * k:width + 2 * k + 2] = family.compute(v).view(np.uint8).reshape(n, 2)
        self._hold(family.from_compute(rows), bits, dim, family)

    @classmethod
    def from_rows(cls, rows, bits, dim):
        """The table whose packed rows are ``rows`` (uint8 ``[E, row_bytes + 4]``, no copy)."""
        q = cls.__new__(cls)
        family, a = resolve(rows=rows)
        if (a["rows"].ndim != 2 or np.dtype(a["rows"].dtype) != np.uint8
                or a["rows"].shape[1] != row_bytes(dim, bits) + 4):
            raise ValueError(f"rows must be uint8 [num_rows, {row_bytes(dim, bits) + 4}]")
        q._hold(a["rows"], bits, dim, family)
        return q

    @classmethod
    def from_values(cls, rows, bits):
        """The table of :class:`QuantizedRows` ``rows`` (codes one per byte), packed."""
        family, a = resolve(codes=rows.codes)
        return cls(pack(family.xp, family.compute(a["codes"]), bits), rows.scale, rows.bias,
                   bits, rows.codes.shape[1])

    def values(self, rows=None):
        """:class:`QuantizedRows` of the table (or of ``rows``: a slice or an index array),
        codes unpacked, in the table's family."""
        sel = slice(None) if rows is None else rows
        packed = self.family.compute(self.rows[sel])
        xp = self.family.xp
        halves = xp.ascontiguousarray(packed[:, self.width:]).view(np.float16)
        codes = xp.ascontiguousarray(unpack(xp, packed[:, :self.width], self.bits, self.dim))
        put = self.family.from_compute
        return QuantizedRows(put(codes), put(halves[:, 0].copy()), put(halves[:, 1].copy()))

    def _hold(self, rows, bits, dim, family):
        self.rows, self.bits, self.dim, self.family = rows, int(bits), int(dim), family
        self.width = row_bytes(dim, bits)

    @property
    def num_rows(self):
        return int(self.rows.shape[0])

    @property
    def nbytes(self):
        """Bytes held: ``num_rows * (row_bytes + 4)``."""
        return int(self.rows.nbytes)

    @property
    def codes(self):
        return self.rows[:, :self.width]

    def _half(self, k):
        xp = self.family.xp
        pair = xp.ascontiguousarray(self.family.compute(self.rows[:, self.width + 2 * k:
                                                                  self.width + 2 * k + 2]))
        return self.family.from_compute(pair.view(np.float16).reshape(-1))

    @property
    def scale(self):
        return self._half(0)

    @property
    def bias(self):
        return self._half(1)

    def dequantize(self, rows=None):
        """The float32 table ``[num_rows, dim]`` (or of the rows ``rows``, a slice or an
        index array), in the table's family."""
        q = self.values(rows)
        codes, scale, bias = (self.family.compute(a).astype(np.float32) for a in q)
        return self.family.from_compute(codes * scale[:, None] + bias[:, None])

    def __repr__(self):
        return (f"QuantizedTable(num_rows={self.num_rows}, dim={self.dim}, bits={self.bits}, "
                f"nbytes={self.nbytes}, device={self.family.device!r})")


def unpack(xp, codes, bits, dim):
    """The codes ``[n, row_bytes]`` (uint8) as one uint8 per element, ``[n, dim]``."""
    if bits == 8:
        return codes[:, :dim]
    per_byte, mask = 8 // bits, (1 << bits) - 1
    parts = [(codes >> np.uint8(bits * k)) & np.uint8(mask) for k in range(per_byte)]
    return xp.stack(parts, axis=2).reshape(codes.shape[0], -1)[:, :dim]


def pack(xp, values, bits):
    """``values`` ``[n, dim]`` (integers in ``[0, 2^bits)``) packed, ``[n, row_bytes]`` uint8."""
    values = values.astype(np.uint8)
    if bits == 8:
        return values
    per_byte = 8 // bits
    n, dim = values.shape
    width = row_bytes(dim, bits)
    padded = xp.zeros((n, width * per_byte), np.uint8)
    padded[:, :dim] = values
    padded = padded.reshape(n, width, per_byte)
    out = padded[:, :, 0].copy()
    for k in range(1, per_byte):
        out |= padded[:, :, k] << np.uint8(bits * k)
    return out


def _float16_toward(xp, x, direction):
    """float32 ``x`` (finite, within float16's range) rounded to the float16 at or
    below it (``direction < 0``) or at or above it (``direction > 0``): the nearest
    float16, moved one step the other way where it lies on the wrong side of ``x``."""
    h = x.astype(np.float16)
    wrong = (h.astype(np.float32) > x) if direction < 0 else (h.astype(np.float32) < x)
    bits = h.view(np.uint16).astype(np.int32)
    negative = bits >= 0x8000  # sign and magnitude: +1 on the bits moves away from zero
    zero = (bits & 0x7FFF) == 0
    if direction < 0:  # down: more negative, or less positive; from +-0 to -(least subnormal)
        moved = xp.where(zero, 0x8001, xp.where(negative, bits + 1, bits - 1))
    else:  # up: less negative, or more positive; from +-0 to +(least subnormal)
        moved = xp.where(zero, 0x0001, xp.where(negative, bits - 1, bits + 1))
    return xp.where(wrong, moved, bits).astype(np.uint16).view(np.float16)


class QuantizedRows(NamedTuple):
    """Rows as codes (uint8 ``[n, D]``, one element per byte, unpacked), float16
    ``scale`` and ``bias`` (``[n]``): what :func:`quantize_values` gives and
    :meth:`QuantizedTable.from_values` packs."""

    codes: Any
    scale: Any
    bias: Any


def row_range(xp, x, first_row=0, row_step=1):
    """``(lo, hi)`` (float32): each row's minimum and maximum of the float32 or float64
    rows ``x`` (float64 ones as they are: their values may pass float32's range);
    ValueError naming the first row (row ``k`` of ``x`` is table row
    ``first_row + row_step * k``) that holds NaN or Inf or passes float16's range."""
    finite = xp.isfinite(x).all(axis=1)
    lo, hi = x.min(axis=1), x.max(axis=1)
    fits = finite & (lo >= -FLOAT16_MAX) & (hi <= FLOAT16_MAX)
    if not bool(fits.all()):
        r = int(xp.argmin(fits))
        what = ("holds NaN or Inf" if not bool(finite[r]) else
                f"spans [{float(lo[r])}, {float(hi[r])}], beyond float16's range")
        raise ValueError(f"row {first_row + row_step * r} of the table {what}: its scale and bias "
                         f"are float16")
    return lo.astype(np.float32, copy=False), hi.astype(np.float32, copy=False)


def quantize_values(xp, x, bits, lo, hi):
    """:class:`QuantizedRows` of the float32 rows ``x`` given each row's range
    ``[lo, hi]`` (from :func:`row_range`; a whole row's range when ``x`` holds some
    of its columns, so that every column slice of a row shares its scale and bias)."""
    levels = (1 << bits) - 1
    bias = _float16_toward(xp, lo, -1)  # within float16's range: the step fits it too
    scale = _float16_toward(xp, (hi - bias.astype(np.float32)) / np.float32(levels), +1)
    s = scale.astype(np.float32)
    safe = xp.where(s > 0, s, np.float32(1))
    q = xp.rint((x - bias.astype(np.float32)[:, None]) / safe[:, None])
    return QuantizedRows(xp.clip(q, 0, levels).astype(np.uint8), scale, bias)


def quantize_rows(table, bits=8, *, chunk_rows=CHUNK_ROWS):
    """The row-wise ``bits``-bit quantization of ``table`` (``[E, D]`` fp16, bf16, fp32 or
    fp64; NumPy, including a memory-mapped file, or CuPy), as a :class:`QuantizedTable`
    in the table's family. Rows go ``chunk_rows`` at a time, so the float32 copy in
    flight stays small. A row holding NaN or Inf, or whose values or step exceed
    float16's range, is a ``ValueError`` naming the row.

    >>> import numpy as np, hbkernels as hbk
    >>> w = np.random.default_rng(0).standard_normal((1000, 16)).astype(np.float32)
    >>> q = hbk.quantize_rows(w, bits=4)
    >>> q.codes.shape, q.nbytes
    ((1000, 8), 12000)
    >>> bool(np.all(np.abs(q.dequantize() - w) <= q.scale.astype(np.float32)[:, None] / 2 + 1e-5))
    True
    """
    bits = check_bits(bits)
    chunk_rows = check.count("chunk_rows", chunk_rows, minimum=1)
    family, a = resolve(row_tables=("table",), table=table)
    table = a["table"]
    check.table("table", table)
    xp = family.xp
    num_rows, dim = int(table.shape[0]), int(table.shape[1])
    width = row_bytes(dim, bits)
    rows = xp.empty((num_rows, width + 4), np.uint8)
    for r0 in range(0, num_rows, chunk_rows):
        r1 = min(num_rows, r0 + chunk_rows)
        x = family.compute(table[r0:r1])
        if np.dtype(x.dtype) != np.float64:  # float64 is checked as it is, then made float32
            x = x.astype(np.float32)
        lo, hi = row_range(xp, x, r0)
        q = quantize_values(xp, x.astype(np.float32, copy=False), bits, lo, hi)
        rows[r0:r1, :width] = pack(xp, q.codes, bits)
        rows[r0:r1, width:] = xp.stack([q.scale, q.bias], axis=1).view(np.uint8)
    return QuantizedTable.from_rows(family.from_compute(rows), bits, dim)
