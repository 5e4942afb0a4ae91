"""Input checks shared by every op: done once, in the dispatch layer, so kernels stay lean."""
import operator

import numpy as np

from ._modes import Bounds, Combiner, codes
from .errors import BoundsError

ID_DTYPES = frozenset((np.dtype(np.int32), np.dtype(np.int64)))
TABLE_DTYPES = frozenset((np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)))
FLOAT_NAMES = "float16, bfloat16, float32 or float64"
COMBINERS = codes(Combiner)
BOUNDS = codes(Bounds)


def _dtype_name(a):
    return np.dtype(a.dtype).name


def ids(name, a, ndim=None):
    if a.dtype not in ID_DTYPES and np.dtype(a.dtype) not in ID_DTYPES:
        raise ValueError(f"{name} must hold int32 or int64 ids, got {_dtype_name(a)}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(a.shape)}")


def table(name, a):
    if a.ndim != 2:
        raise ValueError(f"{name} must be a 2-D table [num_rows, D], got shape {tuple(a.shape)}")
    if a.shape[1] < 1:
        raise ValueError(f"{name} must have D >= 1 columns, got shape {tuple(a.shape)}")
    floating(name, a)


def accumulator_dtype(dtype):
    """The dtype sums and optimizer state use: fp64 for fp64 tables, else fp32
    (fp16 and bf16 tables accumulate in fp32)."""
    try:
        return _ACCUMULATOR[dtype]
    except (KeyError, TypeError):
        pass
    found = np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)
    if isinstance(dtype, np.dtype):
        _ACCUMULATOR[dtype] = found
    return found


_ACCUMULATOR = {}  # dtype -> accumulator_dtype(dtype), for the dtypes seen


_BFLOAT16 = {}  # dtype -> whether it is bfloat16, for the dtypes seen


def is_bfloat16(dtype):
    """NumPy has no bfloat16: it comes from ml_dtypes (as JAX and TF use it), a
    2-byte dtype named ``bfloat16``; matched by name, so no import is needed."""
    try:
        return _BFLOAT16[dtype]
    except (KeyError, TypeError):
        pass
    try:
        found = np.dtype(dtype)
    except TypeError:
        return False
    answer = found.itemsize == 2 and found.name == "bfloat16"
    if isinstance(dtype, np.dtype):
        _BFLOAT16[dtype] = answer
    return answer


def _is_floating(a):
    return a.dtype in TABLE_DTYPES or is_bfloat16(a.dtype) or np.dtype(a.dtype) in TABLE_DTYPES


def floating(name, a):
    if not _is_floating(a):
        raise ValueError(f"{name} must be {FLOAT_NAMES}, got {_dtype_name(a)}")


SUM_INTS = (np.dtype(np.int32), np.dtype(np.int64))  # integer data the segment sums take


def summable(name, a):
    """Data a segment sum takes: floating (as :func:`floating`), or int32 or int64 (summed
    in their own dtype); else a ValueError saying so."""
    if not _is_floating(a) and np.dtype(a.dtype) not in SUM_INTS:
        raise ValueError(f"{name} must be {FLOAT_NAMES}, int32 or int64, got {_dtype_name(a)}")


def offsets(a):
    ids("offsets", a, ndim=1)
    if a.shape[0] < 1:
        raise ValueError("offsets must have B + 1 >= 1 entries (offsets[0] == 0), got an empty array")


def per_sample_weights(w, values):
    if w is None:
        return
    floating("per_sample_weights", w)
    if tuple(w.shape) != tuple(values.shape):
        raise ValueError(
            f"per_sample_weights must have the shape of values {tuple(values.shape)}, "
            f"got {tuple(w.shape)}"
        )


def grad_out(g, num_bags):
    floating("grad_out", g)
    if g.ndim != 2 or g.shape[0] != num_bags or g.shape[1] < 1:
        raise ValueError(
            f"grad_out must be [B, D] = [{num_bags}, D >= 1] (one row per bag), "
            f"got shape {tuple(g.shape)}"
        )


def bag_gradient(w, g, bag_values, bag_offsets, psw):
    """The inputs of a gradient of ``embedding_bag``: a table ``w``, CSR bags, optional
    per-sample weights and one row ``g`` of the table's D per bag."""
    table("weights", w)
    ids("values", bag_values, ndim=1)
    offsets(bag_offsets)
    per_sample_weights(psw, bag_values)
    grad_out(g, bag_offsets.shape[0] - 1)
    if g.shape[1] != w.shape[1]:
        raise ValueError(f"grad_out has D = {g.shape[1]} columns but the table has {w.shape[1]}")


def choice(name, value, allowed):
    try:
        known = value in allowed
    except TypeError:  # unhashable, e.g. a list
        known = False
    if not known:
        raise ValueError(f"{name} must be one of {sorted(allowed)}, got {value!r}")
    return allowed[value]


INT64_MAX = int(np.iinfo(np.int64).max)


def count(name, value, minimum=0):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > INT64_MAX:
        raise ValueError(f"{name} must be <= 2**63 - 1, got {value}")
    return int(value)


SEED_RANGE = (-(1 << 63), 1 << 64)  # the seeds hbkernels takes, [lo, hi): int64 or uint64


def seed(value):
    """``value`` as a Python int: an integer (``int`` or a NumPy integer, not a ``bool``)
    in :data:`SEED_RANGE`, else a ``ValueError`` saying so."""
    try:
        v = operator.index(value)
    except TypeError:
        v = None
    if v is None or isinstance(value, (bool, np.bool_)):
        raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {value!r} "
                         f"({type(value).__name__})")
    if not SEED_RANGE[0] <= v < SEED_RANGE[1]:
        raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {v}")
    return int(v)


def _read(family, a, start, stop):
    return family.to_numpy(a[start:stop]).astype(np.int64).tolist()


def raise_bad_offsets(family, offsets_arr, n_values, k, length="len(values)"):
    """Explain why ``offsets`` breaks CSR at its first bad position ``k``; ``length``
    names the ``n_values`` that the last offset must equal (``"data.shape[0]"`` for
    :func:`hbkernels.segment_reduce`, whose rows are ``data``'s)."""
    b = offsets_arr.shape[0] - 1
    if k == 0:
        (v,) = _read(family, offsets_arr, 0, 1)
        expected = "0" if v != 0 else f"{length} = {n_values}"  # B == 0: offsets[0] is the last
        problem = f"offsets[0] = {v}, expected {expected}"
    else:
        prev, v = _read(family, offsets_arr, k - 1, k + 1)
        if v < prev:
            problem = f"offsets[{k}] = {v} < offsets[{k - 1}] = {prev} (offsets must not decrease)"
        else:
            problem = f"offsets[{b}] = {v}, expected {length} = {n_values}"
    raise ValueError(f"malformed offsets: {problem}")


def raise_ragged(family, values, offsets, bad_offset, bad_id, num_rows, length="len(values)"):
    """Raise for the first bad offset or id a backend's check found (-1: none); ``length``
    names what the last offset must be (:func:`raise_bad_offsets`)."""
    if bad_offset != -1:
        raise_bad_offsets(family, offsets, values.shape[0], bad_offset, length)
    if bad_id != -1:
        raise_bad_id(family, "values", values, bad_id, num_rows)


def raise_feature(family, feature, values, offsets, bad_offset, bad_id, num_rows,
                  length="len(values)"):
    """:func:`raise_ragged` for the CSR input of feature ``feature``, its name in the error."""
    try:
        raise_ragged(family, values, offsets, bad_offset, bad_id, num_rows, length)
    except BoundsError as e:
        raise BoundsError(f"feature {feature!r}: values", e.position, e.value, e.limit) from None
    except ValueError as e:
        raise ValueError(f"feature {feature!r}: {e}") from None


def raise_nonfinite(name, row):
    """Raise for the first row of ``name`` holding NaN or Inf (-1: none)."""
    if row != -1:
        raise ValueError(
            f"{name} has NaN or Inf in row {row}; nothing was updated "
            f"(nonfinite='skip' leaves such rows untouched instead)"
        )


def raise_bad_id(family, what, arr, pos, limit):
    """Raise the :class:`BoundsError` of the id at flat (C-order) position ``pos`` of the
    ids ``arr`` (any shape: an N-D one is named by its index, ``ids[1, 0]``)."""
    (v,) = _read(family, arr.reshape(-1), pos, pos + 1)
    raise BoundsError(what, pos, v, limit, tuple(arr.shape))
