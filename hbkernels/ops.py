"""Public forward ops: validate once, pick the backend by array family, run its kernel.

Every op takes NumPy arrays (Numba CPU kernels) or CUDA arrays (Numba CUDA
kernels) and returns results in the caller's family. The backend modules
``hbkernels.cpu.<op>`` and ``hbkernels.cuda.<op>`` share one signature per op.
Under ``bounds="unchecked"`` nothing is checked and, on the GPU, nothing is
synchronised: the caller guarantees valid ids and offsets.
"""
import sys

import numpy as np

from . import _validate as check
from ._dispatch import NUMPY, cupy_family_of, kernels, resolve
from ._modes import PartitionMode, codes
from .quantize import QuantizedTable
from .types import Partitioned, SparseGrad

_NO_ERROR = -1


def synchronize():
    """Wait for the work hbkernels queued on the current GPU, then raise the first error
    that its ops' input checks found and that was not raised yet (:class:`BoundsError`,
    or ``ValueError`` for offsets and non-finite gradients, naming the op). Each
    error is raised exactly once, here or by the next hbkernels call that waits for
    the device. A no-op on the CPU, where every op raises its own errors.

    >>> import hbkernels as hbk
    >>> hbk.synchronize()
    """
    device = sys.modules.get("hbkernels.cuda._device")  # loaded by any op on CUDA arrays
    if device is not None:
        device.synchronize()


def check_ragged(values, offsets, num_rows, *, bounds="raise"):
    """Check CSR input ``(values, offsets)`` of a table of ``num_rows`` rows as
    :func:`embedding_bag` does, without computing anything: a bad offset is a
    ``ValueError`` naming its first position; under ``bounds="raise"`` an id
    outside ``[0, num_rows)`` is a :class:`hbkernels.BoundsError` naming the first.
    On a GPU the check does not wait for the device: its error is raised by
    :func:`synchronize` or the next hbkernels call that waits (as every GPU op's).

    >>> import numpy as np, hbkernels as hbk
    >>> hbk.ops.check_ragged(np.array([0, 3]), np.array([0, 2]), 3)
    Traceback (most recent call last):
    ...
    hbkernels.errors.BoundsError: values[1] = 3 is out of range [0, 3)
    """
    family, a = resolve(values=values, offsets=offsets)
    values, offsets = a["values"], a["offsets"]
    check.ids("values", values, ndim=1)
    check.offsets(offsets)
    mode = check.choice("bounds", bounds, check.BOUNDS)
    bad_offset, bad_id = kernels(family, "ragged").check_ragged(family, values, offsets, num_rows, mode)
    check.raise_ragged(family, values, offsets, bad_offset, bad_id, num_rows)


def lookup(weights, ids, *, bounds="raise", output_dtype=None):
    """Gather rows: ``out[i...] = weights[ids[i...]]``, shape ``ids.shape + (D,)``.

    >>> import numpy as np, hbkernels as hbk
    >>> w = np.arange(6, dtype=np.float32).reshape(3, 2)
    >>> hbk.lookup(w, np.array([2, 0])).tolist()
    [[4.0, 5.0], [0.0, 1.0]]
    >>> hbk.lookup(w, np.array([1, 7]), bounds="zero").tolist()
    [[2.0, 3.0], [0.0, 0.0]]

    ``weights`` may be a :class:`hbkernels.QuantizedTable`: the rows dequantized, float32
    (``output_dtype="float16"``: rounded to float16).
    """
    if isinstance(weights, QuantizedTable):
        return _quantized_lookup(weights, ids, bounds, output_dtype)
    _no_output_dtype(output_dtype)
    family = _plain_inputs(weights, ids)
    if family is None:
        family, a = resolve(row_tables=("weights",), weights=weights, ids=ids)
        weights, ids = a["weights"], a["ids"]
        check.table("weights", weights)
        check.ids("ids", ids)
    mode = check.choice("bounds", bounds, check.BOUNDS)
    out, bad = kernels(family, "lookup").lookup(family, weights, ids, mode)
    if bad != _NO_ERROR:
        check.raise_bad_id(family, "ids", ids, bad, weights.shape[0])
    return out if ids.ndim == 1 else family.reshape(out, tuple(ids.shape) + (weights.shape[1],))


def lookup_backward(grad_out, ids, *, num_rows, bounds="raise", deterministic=True):
    """Sparse gradient of :func:`lookup` w.r.t. the table, as
    :class:`hbkernels.SparseGrad` ``(ids, rows)``: ``rows[k] = Σ_{i: ids[i] = u_k}
    grad_out[i]`` over the distinct in-range ids ``u_k`` (order unspecified; ids dtype
    of ``ids``). ``grad_out`` has shape ``ids.shape + (D,)``; ``rows`` its dtype (fp16
    sums in fp32). ``bounds`` as in :func:`lookup` (``"zero"``: a bad id contributes
    nothing); ``deterministic`` as in :func:`embedding_bag_backward`. It is
    :func:`embedding_bag_backward` with one id per bag, summed.

    >>> import numpy as np, hbkernels as hbk
    >>> g = hbk.lookup_backward(np.ones((3, 2), np.float32), np.array([4, 1, 4]), num_rows=5)
    >>> sorted(zip(g.ids.tolist(), g.rows[:, 0].tolist()))
    [(1, 1.0), (4, 2.0)]
    """
    family, a = resolve(grad_out=grad_out, ids=ids)
    grad_out, ids = a["grad_out"], a["ids"]
    num_rows = check.count("num_rows", num_rows)
    check.ids("ids", ids)
    check.floating("grad_out", grad_out)
    shape = tuple(grad_out.shape)
    if len(shape) != ids.ndim + 1 or shape[:-1] != tuple(ids.shape):
        raise ValueError(f"grad_out must have shape ids.shape + (D,) = {tuple(ids.shape)} + (D,), "
                         f"got {shape}")
    mode = check.choice("bounds", bounds, check.BOUNDS)
    n = int(np.prod(ids.shape, dtype=np.int64))
    flat = family.reshape(ids, (-1,))
    grads = family.reshape(grad_out, (n, shape[-1]))
    check.grad_out(grads, n)
    offsets = family.from_numpy(np.arange(n + 1, dtype=np.int64))   # one id per bag
    rows_of, rows, _, bad_id = kernels(family, "embedding_bag_backward").embedding_bag_backward(
        family, grads, flat, offsets, num_rows, None, check.choice("combiner", "sum", check.COMBINERS),
        mode, bool(deterministic), False,
    )
    if bad_id != _NO_ERROR:
        check.raise_bad_id(family, "ids", ids, bad_id, num_rows)
    return SparseGrad(rows_of, rows)


def embedding_bag(
    weights, values, offsets, *, combiner="sum", per_sample_weights=None, bounds="raise",
    output_dtype=None,
):
    """Pooled lookup of CSR bags, shape ``[B, D]`` with ``B = len(offsets) - 1``.

    For bag ``b`` with ids ``i_j`` and weights ``w_j`` (1 without weights):
    ``sum = Σ w_j·W[i_j]``, ``mean = sum / Σ w_j``, ``sqrtn = sum / sqrt(Σ w_j²)``
    (TF's ``embedding_lookup_sparse``; a zero denominator gives zeros, so an
    empty bag gives zeros). fp16 and bf16 (``ml_dtypes.bfloat16``) tables
    accumulate in fp32 and return their own dtype.
    Under ``bounds="zero"`` a bad id adds nothing and is not counted.

    >>> import numpy as np, hbkernels as hbk
    >>> w = np.arange(8, dtype=np.float32).reshape(4, 2)
    >>> hbk.embedding_bag(w, np.array([0, 3, 1]), np.array([0, 2, 2, 3]),
    ...                   combiner="mean").tolist()
    [[3.0, 4.0], [0.0, 0.0], [2.0, 3.0]]

    ``weights`` may be a :class:`hbkernels.QuantizedTable` (:func:`hbkernels.quantize_rows`):
    the output is float32, the same call on ``weights.dequantize()`` up to float32 rounding;
    ``output_dtype="float16"`` rounds it to float16 (FBGEMM's ``output_dtype``).
    """
    if isinstance(weights, QuantizedTable):
        return _quantized_embedding_bag(weights, values, offsets, combiner, per_sample_weights,
                                        bounds, output_dtype)
    _no_output_dtype(output_dtype)
    family = _plain_inputs(weights, values, offsets) if per_sample_weights is None else None
    if family is not None and not _plain_bags(values, offsets):
        family = None
    psw = None
    if family is None:
        family, a = resolve(
            ("per_sample_weights",), row_tables=("weights",),
            weights=weights, values=values, offsets=offsets, per_sample_weights=per_sample_weights,
        )
        weights, values, offsets, psw = (
            a["weights"], a["values"], a["offsets"], a["per_sample_weights"]
        )
        check.table("weights", weights)
        _check_bags(values, offsets, psw)
    mode = check.choice("bounds", bounds, check.BOUNDS)
    comb = check.choice("combiner", combiner, check.COMBINERS)
    out, bad_offset, bad_id = kernels(family, "embedding_bag").embedding_bag(
        family, weights, values, offsets, psw, comb, mode
    )
    if bad_offset != _NO_ERROR or bad_id != _NO_ERROR:
        check.raise_ragged(family, values, offsets, bad_offset, bad_id, weights.shape[0])
    return out


def _plain_bags(values, offsets):
    """Whether CSR bags pass :func:`_check_bags`'s shape checks (1-D values, 1-D offsets of
    at least one entry), for inputs :func:`_plain_inputs` took."""
    return values.ndim == 1 and offsets.ndim == 1 and offsets.shape[0] >= 1


def _check_bags(values, offsets, per_sample_weights):
    """The checks of CSR bags and their weights that need no pass over the data."""
    check.ids("values", values, ndim=1)
    check.offsets(offsets)
    check.per_sample_weights(per_sample_weights, values)


OUTPUT_DTYPES = {"float32": np.float32, "float16": np.float16}  # of a QuantizedTable's lookups


def _output_dtype(output_dtype):
    """The NumPy type of a QuantizedTable's ``output_dtype`` (None: float32), checked."""
    if output_dtype is None:
        return np.float32
    try:
        name = np.dtype(output_dtype).name
    except TypeError:
        name = output_dtype
    return check.choice("output_dtype", name, OUTPUT_DTYPES)


def _in_dtype(family, out, dtype):
    return out if dtype is np.float32 else family.from_compute(family.compute(out).astype(dtype))


def _no_output_dtype(output_dtype):
    if output_dtype is not None:
        raise ValueError("output_dtype applies to a QuantizedTable; a float table's output "
                         "has its own dtype")


def _quantized_inputs(q, **arrays):
    """The family and arrays of a call on the quantized table ``q``: the arrays in its
    family (else ``TypeError``), ready for the kernels."""
    family, a = resolve(("per_sample_weights",), table=q.rows, **arrays)
    return family, a


def _quantized_embedding_bag(q, values, offsets, combiner, per_sample_weights, bounds,
                             output_dtype):
    dtype = _output_dtype(output_dtype)
    family, a = _quantized_inputs(q, values=values, offsets=offsets,
                                  per_sample_weights=per_sample_weights)
    values, offsets, psw = a["values"], a["offsets"], a["per_sample_weights"]
    _check_bags(values, offsets, psw)
    mode = check.choice("bounds", bounds, check.BOUNDS)
    comb = check.choice("combiner", combiner, check.COMBINERS)
    out, bad_offset, bad_id = kernels(family, "quantized_bag").embedding_bag(
        family, q, values, offsets, psw, comb, mode)
    if bad_offset != _NO_ERROR or bad_id != _NO_ERROR:
        check.raise_ragged(family, values, offsets, bad_offset, bad_id, q.num_rows)
    return _in_dtype(family, out, dtype)


def _quantized_lookup(q, ids, bounds, output_dtype):
    dtype = _output_dtype(output_dtype)
    family, a = _quantized_inputs(q, ids=ids)
    ids = a["ids"]
    check.ids("ids", ids)
    mode = check.choice("bounds", bounds, check.BOUNDS)
    flat = family.reshape(ids, (-1,))
    one_each = family.from_compute(family.xp.arange(flat.shape[0] + 1, dtype=np.int64))
    out, _, bad = kernels(family, "quantized_bag").embedding_bag(
        family, q, flat, one_each, None, check.COMBINERS["sum"], mode, ids)
    if bad != _NO_ERROR:
        check.raise_bad_id(family, "ids", ids, bad, q.num_rows)
    return _in_dtype(family, family.reshape(out, tuple(ids.shape) + (q.dim,)), dtype)


def _plain_inputs(weights, *ids):
    """The family of a table and id arrays when :func:`resolve` would hand them over as
    they are and they pass :func:`check.table` and :func:`check.ids`, else None: NumPy
    arrays (not subclasses; the table's rows contiguous) or CuPy arrays of one device
    (the table C-contiguous), a 2-D table with D >= 1 of a native fp16/fp32/fp64 dtype,
    C-contiguous native int32/int64 ids. Such a call skips those steps, which cost more
    than the kernel for small batches; any other input (bf16, strided ids, a bad dtype)
    takes the general path, which copies, converts or explains."""
    t = type(weights)
    for a in ids:
        if type(a) is not t:
            return None
    if t is np.ndarray:
        family = NUMPY if weights.ndim == 2 and weights.strides[1] == weights.itemsize else None
    else:
        family = cupy_family_of(weights, *ids)
        if family is not None and not weights.flags.c_contiguous:
            return None
    if family is None or not (weights.ndim == 2 and weights.shape[1] >= 1
                              and weights.dtype in check.TABLE_DTYPES):
        return None
    for a in ids:
        if a.dtype not in check.ID_DTYPES or not a.flags.c_contiguous:
            return None
    return family


def segment_reduce(data, offsets, *, combiner="sum"):
    """CSR segment reduction of rows of ``data`` ``[N, ...]``: segment ``b`` reduces
    ``data[offsets[b]:offsets[b + 1]]`` with the combiners of :func:`embedding_bag`
    (``mean`` divides by the length, ``sqrtn`` by its square root; empty gives zeros).
    int32 and int64 data take ``combiner="sum"`` only, summed in their own dtype.

    >>> import numpy as np, hbkernels as hbk
    >>> hbk.segment_reduce(np.array([1., 2., 3.]), np.array([0, 2, 3])).tolist()
    [3.0, 3.0]
    """
    family, a = resolve(row_tables=("data",), data=data, offsets=offsets)
    data, offsets = a["data"], a["offsets"]
    if data.ndim < 1:
        raise ValueError("data must have at least one dimension [N, ...]")
    check.summable("data", data)
    check.offsets(offsets)
    comb = check.choice("combiner", combiner, check.COMBINERS)
    if np.dtype(data.dtype) in check.SUM_INTS and combiner != "sum":
        raise ValueError(f"combiner={combiner!r} of {np.dtype(data.dtype).name} data: a mean or "
                         f"a root is no integer; take combiner='sum', or float data")
    rest = tuple(data.shape[1:])
    width = int(np.prod(rest)) if rest else 1
    rows = family.reshape(data, (data.shape[0], width))
    out, bad_offset = kernels(family, "segment_reduce").segment_reduce(family, rows, offsets, comb)
    if bad_offset != _NO_ERROR:
        check.raise_bad_offsets(family, offsets, data.shape[0], bad_offset, "data.shape[0]")
    return family.reshape(out, (offsets.shape[0] - 1,) + rest)


def segment_sum(data, segment_ids, num_segments, *, bounds="raise"):
    """Unsorted segment sum (as ``jax.ops.segment_sum``), shape ``[num_segments, ...]``:
    ``out[s] = Σ data[i] over i with segment_ids[i] == s``. Under ``bounds="zero"``
    rows with a segment id outside ``[0, num_segments)`` are dropped. Floating data sums
    as the ops of :func:`embedding_bag` do; int32 and int64 data in their own dtype
    (wrapping on overflow, as NumPy's ``np.add.at``).

    >>> import numpy as np, hbkernels as hbk
    >>> hbk.segment_sum(np.array([1., 2., 4.]), np.array([1, 0, 1]), 3).tolist()
    [2.0, 5.0, 0.0]
    """
    family, a = resolve(row_tables=("data",), data=data, segment_ids=segment_ids)
    data, segment_ids = a["data"], a["segment_ids"]
    if data.ndim < 1:
        raise ValueError("data must have at least one dimension [N, ...]")
    check.summable("data", data)
    check.ids("segment_ids", segment_ids, ndim=1)
    if segment_ids.shape[0] != data.shape[0]:
        raise ValueError(
            f"segment_ids must have one entry per row of data ({data.shape[0]}), "
            f"got {segment_ids.shape[0]}"
        )
    num_segments = check.count("num_segments", num_segments)
    mode = check.choice("bounds", bounds, check.BOUNDS)
    rest = tuple(data.shape[1:])
    width = int(np.prod(rest)) if rest else 1
    rows = family.reshape(data, (data.shape[0], width))
    out, bad = kernels(family, "segment_sum").segment_sum(
        family, rows, segment_ids, num_segments, mode
    )
    if bad != _NO_ERROR:
        check.raise_bad_id(family, "segment_ids", segment_ids, bad, num_segments)
    return family.reshape(out, (num_segments,) + rest)


def unique(ids, *, return_inverse=False, return_counts=False, sorted=False):
    """Distinct ids by hashing (not sorting): ``uniq[inverse] == ids``.

    Returns ``uniq`` alone, or a tuple ``(uniq[, inverse][, counts])`` as
    ``np.unique``. ``uniq`` keeps the ids' dtype; ``inverse`` (int64) has the
    ids' shape; ``counts`` (int64) counts each distinct id. Order is
    unspecified unless ``sorted=True`` (the CPU gives first-occurrence order).

    >>> import numpy as np, hbkernels as hbk
    >>> u, inv, cnt = hbk.unique(np.array([7, 3, 7, 9]), return_inverse=True,
    ...                          return_counts=True, sorted=True)
    >>> u.tolist(), inv.tolist(), cnt.tolist()
    ([3, 7, 9], [1, 0, 1, 2], [1, 2, 1])
    """
    family, a = resolve(ids=ids)
    ids = a["ids"]
    check.ids("ids", ids)
    flat = family.reshape(ids, (-1,))
    uniq, inverse, counts = kernels(family, "unique").unique(
        family, flat, bool(return_inverse), bool(return_counts), bool(sorted)
    )
    result = [uniq]
    if return_inverse:
        result.append(family.reshape(inverse, tuple(ids.shape)))
    if return_counts:
        result.append(counts)
    return result[0] if len(result) == 1 else tuple(result)


PARTITION_MODES = codes(PartitionMode)


def partition(ids, num_shards, *, mode="mod", num_rows=None):
    """Group 1-D ``ids`` by owning shard, stably: returns
    :class:`hbkernels.Partitioned` ``(ids, counts, order)`` with
    ``ids == input[order]`` and shard ``s``'s ``counts[s]`` ids contiguous.

    ``mode="mod"``: shard ``id % num_shards`` (local row ``id // num_shards``).
    ``mode="div"``: rows in contiguous blocks of ``ceil(num_rows / num_shards)``
    (local row ``id % block``); needs ``num_rows``. Negative ids, and ids
    ``>= num_rows`` when it is given, raise :class:`hbkernels.BoundsError`.

    >>> import numpy as np, hbkernels as hbk
    >>> p = hbk.partition(np.array([5, 2, 4, 7]), 2)
    >>> p.ids.tolist(), p.counts.tolist(), p.order.tolist()
    ([2, 4, 5, 7], [2, 2], [1, 2, 0, 3])
    """
    family, a = resolve(ids=ids)
    ids = a["ids"]
    check.ids("ids", ids, ndim=1)
    num_shards = check.count("num_shards", num_shards, minimum=1)
    code = check.choice("mode", mode, PARTITION_MODES)
    if num_rows is not None:
        num_rows = check.count("num_rows", num_rows)
    elif mode == "div":
        raise ValueError('mode="div" needs num_rows to size the row blocks')
    parted, counts, order, bad = kernels(family, "partition").partition(
        family, ids, num_shards, code, num_rows
    )
    if bad != _NO_ERROR:
        check.raise_bad_id(family, "ids", ids, bad, num_rows)
    return Partitioned(parted, counts, order)


def embedding_bag_backward(
    grad_out, values, offsets, *, num_rows, combiner="sum", per_sample_weights=None,
    bounds="raise", deterministic=True, padded=False,
):
    """Sparse gradient of :func:`embedding_bag` w.r.t. the table, as
    :class:`hbkernels.SparseGrad` ``(ids, rows)``.

    With bag scale ``c_b`` (1 for sum, ``1/Σw`` for mean, ``1/sqrt(Σw²)`` for
    sqrtn, 0 where the denominator is 0): ``rows[k] = Σ_{j: values[j] = ids[k]}
    c_{b(j)}·w_j·grad_out[b(j)]``. ``ids`` are exactly the distinct in-range ids
    looked up (order unspecified; ids dtype of ``values``), ``rows`` has the dtype
    of ``grad_out`` (fp16 sums in fp32). Under ``bounds="zero"`` bad ids are
    absent: no row, no share of a denominator. On the GPU ``deterministic=True``
    (default) sums each row in input order (same bits every run);
    ``deterministic=False`` uses atomics (faster, order varies). The CPU is
    always deterministic. ``padded=True`` gives ``len(values)`` entries, the distinct
    ids first (with id -1 for out-of-range ids under ``bounds="zero"`` on the GPU),
    then id -1 with zero rows: on the GPU its size needs no read-back, so with
    ``bounds="unchecked"`` the call never waits for the device.

    >>> import numpy as np, hbkernels as hbk
    >>> g = hbk.embedding_bag_backward(np.ones((2, 1), np.float32), np.array([4, 1, 4]),
    ...                                np.array([0, 2, 3]), num_rows=5, combiner="mean")
    >>> sorted(zip(g.ids.tolist(), g.rows[:, 0].tolist()))
    [(1, 0.5), (4, 1.5)]
    """
    family, psw = None, None
    if per_sample_weights is None:  # CuPy inputs as they are, where resolve would take them
        family = _plain_inputs(grad_out, values, offsets)
        if family is not None and not (_plain_bags(values, offsets)
                                       and grad_out.shape[0] == offsets.shape[0] - 1):
            family = None
    general = family is None or family is NUMPY  # (NumPy's gradient rows made C-contiguous)
    if general:
        family, a = resolve(
            ("per_sample_weights",), grad_out=grad_out, values=values, offsets=offsets,
            per_sample_weights=per_sample_weights,
        )
        grad_out, values, offsets, psw = (
            a["grad_out"], a["values"], a["offsets"], a["per_sample_weights"]
        )
    num_rows = check.count("num_rows", num_rows)
    if general:
        _check_bags(values, offsets, psw)
        check.grad_out(grad_out, offsets.shape[0] - 1)
    mode = check.choice("bounds", bounds, check.BOUNDS)
    comb = check.choice("combiner", combiner, check.COMBINERS)
    ids, rows, bad_offset, bad_id = kernels(family, "embedding_bag_backward").embedding_bag_backward(
        family, grad_out, values, offsets, num_rows, psw, comb, mode, bool(deterministic),
        bool(padded),
    )
    check.raise_ragged(family, values, offsets, bad_offset, bad_id, num_rows)
    return SparseGrad(ids, rows)


def per_sample_weights_backward(
    grad_out, weights, values, offsets, per_sample_weights, *, combiner="sum", bounds="raise",
):
    """Gradient of :func:`embedding_bag` w.r.t. ``per_sample_weights``, ``[N]`` in
    their dtype (what every front end's autograd calls).

    For position ``j`` in bag ``b``, with ``dot_j = grad_out[b] · weights[values[j]]``
    and ``S_b = Σ_k w_k·dot_k`` over the bag: sum gives ``dot_j``; mean
    (``c = 1/Σw``) ``c·(dot_j - c·S_b)``; sqrtn (``c = 1/sqrt(Σw²)``)
    ``c·dot_j - c³·w_j·S_b``; ``c = 0`` where the denominator is 0, as the
    forward's zeros there. An id outside ``[0, num_rows)`` (``bounds="zero"``,
    or ``"unchecked"``, where it is still never read) gets 0 and counts in no
    denominator. Sums are in float64 on the CPU, in the accumulator dtype on
    the GPU (fp64 if any input is fp64, else fp32). ``bounds`` checks as
    :func:`embedding_bag` does.

    >>> import numpy as np, hbkernels as hbk
    >>> w = np.arange(6, dtype=np.float32).reshape(3, 2)
    >>> hbk.per_sample_weights_backward(
    ...     np.ones((1, 2), np.float32), w, np.array([0, 2]), np.array([0, 2]),
    ...     np.ones(2, np.float32)).tolist()
    [1.0, 9.0]
    """
    family, a = resolve(row_tables=("weights",), grad_out=grad_out, weights=weights,
                        values=values, offsets=offsets, per_sample_weights=per_sample_weights)
    grad_out, weights, values, offsets, psw = (
        a["grad_out"], a["weights"], a["values"], a["offsets"], a["per_sample_weights"]
    )
    check.bag_gradient(weights, grad_out, values, offsets, psw)
    mode = check.choice("bounds", bounds, check.BOUNDS)
    comb = check.choice("combiner", combiner, check.COMBINERS)
    bad_offset, bad_id = kernels(family, "ragged").check_ragged(
        family, values, offsets, weights.shape[0], mode)
    check.raise_ragged(family, values, offsets, bad_offset, bad_id, weights.shape[0])
    return kernels(family, "per_sample_weights_backward").per_sample_weights_backward(
        family, grad_out, weights, values, offsets, psw, comb)
