"""TensorFlow front end: ``embedding_bag`` as a differentiable TF op
(``tf.custom_gradient``) and :class:`EmbeddingBag`, a Keras 3 layer over it.

Gradients
    The gradient w.r.t. the table is a ``tf.IndexedSlices(values=rows,
    indices=ids, dense_shape=[num_rows, D])`` built from the kernel's
    :class:`hbkernels.SparseGrad`: one row per *distinct* id looked up (the
    kernel has already summed duplicates), exactly the type TF's own
    ``tf.gather`` / ``tf.nn.embedding_lookup_sparse`` give. ``GradientTape``
    hands it to the optimizer unchanged, so TF/Keras optimizers apply sparse
    (``scatter``) updates and untouched rows get a zero gradient without a
    dense ``[num_rows, D]`` tensor ever being made. The gradient w.r.t.
    ``per_sample_weights`` (dense, shape of ``values``) is
    :func:`hbkernels.per_sample_weights_backward`, computed only when they are
    watched (zero where a bag's denominator is zero). The op is
    differentiable once (no gradient of the gradient).

Eager mode
    Tensors cross to the kernels through DLPack without copies: a CPU tensor
    (a variable's value included) becomes a read-only NumPy view (a bfloat16
    tensor: a view of its bits, ``tf.bitcast`` to uint16, as
    ``ml_dtypes.bfloat16``; on a GPU a CuPy view, CuPy >= 14), the kernels
    run, and the result comes back as a TF tensor over the NumPy buffer (over
    a 64-byte-aligned copy of it when it is not aligned, as TF requires). A
    GPU tensor becomes a CuPy view (``tf.experimental.dlpack.to_dlpack`` ->
    ``cupy.from_dlpack``) and runs the CUDA kernels; ``values``, ``offsets``
    and ``per_sample_weights`` are first moved to the table's device, as TF's
    own ops do (int32 ids are widened to int64 there, since TF keeps int32
    "GPU" tensors in host memory; the gradient's ids are then int64). TF
    exposes no handle on its CUDA stream, so the GPU path synchronises TF's
    devices before the kernel and the device after it (``hbk.synchronize()``,
    which raises the kernels' checks at the call): correct, but every call is a
    host sync. Errors are hbkernels' own
    (:class:`hbkernels.BoundsError`, ``ValueError``).

Graph mode (``tf.function``, ``Model.fit``)
    The kernels run in a host callback, ``tf.numpy_function`` pinned to the
    CPU, with static output shapes set (``[B, D]`` where ``B = len(offsets)
    - 1`` is known at trace time). Its inputs arrive as NumPy views of TF's
    buffers (no copy on the CPU), its output is copied once into a TF tensor.
    Consequences: the graph holds a Python callback, so it needs this Python
    process (no SavedModel / TF Serving / TFLite export of the op), cannot be
    XLA-compiled (``jit_compile=True`` fails; :class:`EmbeddingBag` sets
    ``supports_jit = False`` so ``Model.fit`` does not ask for XLA), and
    holds the GIL while the callback's Python runs (the Numba kernels
    themselves run in parallel). On a GPU machine a table on the GPU is
    copied to the host on *every* call in graph mode: keep the table on the
    CPU there (``with tf.device("/CPU:0")`` around the variable or layer
    creation: the lookup then runs on the CPU kernels and only the ``[B, D]``
    result moves to the GPU), or run eagerly to use the CUDA kernels. Kernel
    errors surface as ``tf.errors.InvalidArgumentError`` with hbkernels'
    message in it (``BoundsError: values[3] = 9 is out of range [0, 8)``).

>>> import tensorflow as tf
>>> from hbkernels.adapters.tf import embedding_bag
>>> w = tf.Variable(tf.reshape(tf.range(8, dtype=tf.float32), (4, 2)))
>>> with tf.GradientTape() as tape:
...     out = embedding_bag(w, tf.constant([0, 3, 1]), tf.constant([0, 2, 2, 3]),
...                         combiner="mean")
...     loss = tf.reduce_sum(out)
>>> out.numpy().tolist()
[[3.0, 4.0], [0.0, 0.0], [2.0, 3.0]]
>>> g = tape.gradient(loss, w)
>>> type(g).__name__, sorted(zip(g.indices.numpy().tolist(), g.values[:, 0].numpy().tolist()))
('IndexedSlices', [(0, 0.5), (1, 1.0), (3, 0.5)])
"""
import functools

import numpy as np
import tensorflow as tf

try:  # the check custom_gradient itself makes; private, hence optional
    from tensorflow.python.eager import record as _record
except ImportError:  # pragma: no cover
    _record = None

try:  # Keras 3 (ships with TF >= 2.16)
    import keras
except ImportError:  # pragma: no cover - TF always brings Keras 3 since 2.16
    keras = None

from .. import ops as _ops
from .._dispatch import cupy_bfloat16
from .._machine import cupy as _cupy
from .._validate import BOUNDS, COMBINERS, FLOAT_NAMES, is_bfloat16
from ..quantize import QuantizedTable

__all__ = ["embedding_bag", "EmbeddingBag", "kernel_array", "from_kernel_array"]

_ID_DTYPES = (tf.int32, tf.int64)
_TABLE_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_KDLCPU, _KDLCUDA = 1, 2
_TF_ALIGN = 64  # EIGEN_MAX_ALIGN_BYTES on AVX-512 builds (32 on AVX2): the stricter


# -- zero-copy crossings (eager) ------------------------------------------------------------------
class _Capsule:
    """A legacy DLPack capsule dressed as a ``__dlpack__`` producer (for
    ``np.from_dlpack`` / ``cupy.from_dlpack``, whatever TF version made it)."""

    def __init__(self, capsule, device):
        self._capsule, self._device = capsule, device

    def __dlpack__(self, *args, **kwargs):
        return self._capsule

    def __dlpack_device__(self):
        return self._device


def _on_gpu(t):
    return "GPU" in (t.device or "").upper()


def _gpu_index(t):
    return tf.DeviceSpec.from_string(t.device).device_index or 0


def kernel_array(t):
    """The array the kernels take for eager tensor ``t``, sharing its memory: a
    read-only NumPy view of a CPU tensor, a CuPy view of a GPU tensor (``None``
    stays ``None``). The caller must keep ``t`` alive while the view is used."""
    if t is None:
        return None
    if t.dtype == tf.bfloat16:  # NumPy takes no bf16 over DLPack: the bits cross instead
        bits = kernel_array(tf.bitcast(t, tf.uint16))  # bitcast shares the buffer
        if not isinstance(bits, np.ndarray):
            return cupy_bfloat16(bits)
        return bits.view(tf.bfloat16.as_numpy_dtype)
    if hasattr(t, "__dlpack_device__"):  # TF >= 2.18 says where the buffer really is
        kind, index = t.__dlpack_device__()
        device = (int(kind), int(index))
    else:
        device = (_KDLCUDA, _gpu_index(t)) if _on_gpu(t) else (_KDLCPU, 0)
    capsule = _Capsule(tf.experimental.dlpack.to_dlpack(t), device)
    if device[0] == _KDLCUDA:
        return _cupy().from_dlpack(capsule)
    return np.from_dlpack(capsule)


def from_kernel_array(a):
    """A TF tensor over a kernel result (NumPy or CuPy), without a copy when the
    buffer is aligned as TF requires (``_TF_ALIGN`` bytes: TF's DLPack import
    does not check, and its kernels abort on a misaligned buffer), else over an
    aligned copy (NumPy's small allocations are only 16-byte aligned)."""
    if is_bfloat16(a.dtype):
        return tf.bitcast(from_kernel_array(a.view(np.uint16)), tf.bfloat16)
    if isinstance(a, np.ndarray):
        if a.size == 0:
            return tf.convert_to_tensor(a)
        if not a.flags.c_contiguous or a.ctypes.data % _TF_ALIGN:
            buf = np.empty(a.nbytes + _TF_ALIGN, np.uint8)
            start = -buf.ctypes.data % _TF_ALIGN
            aligned = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
            aligned[...] = a
            a = aligned
        return tf.experimental.dlpack.from_dlpack(a.__dlpack__())
    if a.size == 0 or not a.flags.c_contiguous or a.data.ptr % _TF_ALIGN:
        b = _cupy().empty(a.shape, a.dtype)  # pool allocations are aligned
        b[...] = a
        a = b
    return tf.experimental.dlpack.from_dlpack(a.toDlpack())


def _eager_call(fn, tensors, device_of):
    """Run ``fn(*arrays)`` on kernel views of eager ``tensors`` (moved to
    ``device_of``'s device first); returns whatever ``fn`` returns."""
    if any(t is not None and t.device != device_of.device for t in tensors):
        with tf.device(device_of.device):  # ids follow the table, as in TF's own ops
            tensors = [None if t is None else tf.identity(t) for t in tensors]
    if not _on_gpu(device_of):
        return fn(*[kernel_array(t) for t in tensors])
    with tf.device(device_of.device):  # TF keeps int32 "GPU" tensors in host memory
        tensors = [tf.cast(t, tf.int64) if t is not None and t.dtype == tf.int32 else t
                   for t in tensors]
    tf.test.experimental.sync_devices()  # TF's stream is not ours to order on
    result = fn(*[kernel_array(t) for t in tensors])
    _ops.synchronize()  # the kernels' checks too: their errors are raised here
    return result


# -- the op ---------------------------------------------------------------------------------------
def _check(combiner, bounds, w, values, offsets, psw):
    if combiner not in COMBINERS:
        raise ValueError(f"combiner must be one of {sorted(COMBINERS)}, got {combiner!r}")
    if bounds not in BOUNDS:
        raise ValueError(f"bounds must be one of {sorted(BOUNDS)}, got {bounds!r}")
    if w is None:  # a QuantizedTable: checked by the kernels' front
        pass
    elif w.dtype not in _TABLE_DTYPES:
        raise ValueError(f"weight must be {FLOAT_NAMES}, got {w.dtype.name}")
    elif w.shape.rank is not None and w.shape.rank != 2:
        raise ValueError(f"weight must be a 2-D table [num_rows, D], got shape {w.shape}")
    elif w.shape.rank == 2 and w.shape[1] is None:
        raise ValueError("weight must have a static D (its second dimension)")
    for name, t in (("values", values), ("offsets", offsets)):
        if t.dtype not in _ID_DTYPES:
            raise ValueError(f"{name} must hold int32 or int64, got {t.dtype.name}")
        if t.shape.rank is not None and t.shape.rank != 1:
            raise ValueError(f"{name} must be 1-D, got shape {t.shape}")
    if psw is not None and psw.dtype not in _TABLE_DTYPES:
        raise ValueError(f"per_sample_weights must be {FLOAT_NAMES}, got {psw.dtype.name}")


def _watched(t):
    """Whether a tape records ``t``, i.e. a gradient of it could be asked for
    (always True in a graph, where unused gradients are pruned)."""
    if not tf.executing_eagerly() or _record is None:
        return True
    return bool(_record.should_record_backprop([t]))


def _dense_shape(w):
    if w.shape.is_fully_defined():  # a constant: no op to run eagerly
        return tf.constant(w.shape.as_list(), tf.int64)
    return tf.shape(w, out_type=tf.int64)


def _as_tf_error(fn, *args):
    """Call ``fn`` in a host callback: ``numpy_function`` turns a ``ValueError`` into
    ``tf.errors.InvalidArgumentError`` (what TF's own gathers raise for bad ids)
    but any other exception, ``IndexError`` included, into ``UnknownError``."""
    try:
        return fn(*args)
    except IndexError as error:  # hbk.BoundsError
        raise ValueError(f"{type(error).__name__}: {error}") from error


def _forward(w, values, offsets, psw, combiner, bounds):
    num_bags = offsets.shape[0] - 1 if offsets.shape[0] is not None else None

    def run(w_, v_, o_, p_=None):
        return _ops.embedding_bag(w_, v_, o_, combiner=combiner, per_sample_weights=p_,
                                  bounds=bounds)

    args = [w, values, offsets] + ([] if psw is None else [psw])
    if tf.executing_eagerly():
        return from_kernel_array(_eager_call(run, args, w))

    def host(*arrays):
        for a in arrays:
            a.setflags(write=False)  # TF's buffers: read, never written
        return _as_tf_error(run, *arrays)

    with tf.device("/CPU:0"):
        out = tf.numpy_function(host, args, Tout=w.dtype, stateful=True, name="hbk_embedding_bag")
    out.set_shape([num_bags, w.shape[1]])
    return out


def _quantized_forward(q, values, offsets, psw, combiner, bounds):
    """The forward on :class:`hbkernels.QuantizedTable` ``q``: eagerly on its device
    (the ids moved there), in a graph in the host callback (NumPy rows only)."""
    num_bags = offsets.shape[0] - 1 if offsets.shape[0] is not None else None

    def run(v_, o_, p_=None):
        return _ops.embedding_bag(q, v_, o_, combiner=combiner, per_sample_weights=p_,
                                  bounds=bounds)

    args = [values, offsets] + ([] if psw is None else [psw])
    on_gpu = q.family.device == "cuda"
    if tf.executing_eagerly():
        with tf.device(f"/GPU:{q.rows.device.id}" if on_gpu else "/CPU:0"):
            anchor = tf.zeros(0)  # where the kernels run: the table's device
        return from_kernel_array(_eager_call(run, args, anchor))
    if on_gpu:
        raise TypeError("in a graph (tf.function) the kernels run in a host callback: use a "
                        "QuantizedTable of NumPy rows there, or call eagerly")

    def host(*arrays):
        return _as_tf_error(run, *arrays)

    with tf.device("/CPU:0"):
        out = tf.numpy_function(host, args, Tout=tf.float32, stateful=True,
                                name="hbk_quantized_embedding_bag")
    out.set_shape([num_bags, q.dim])
    return out


def _backward(dy, w, values, offsets, psw, combiner, bounds):
    """(ids, rows) of the sparse table gradient, as TF tensors."""

    def run(n, g, v_, o_, p_=None):
        grad = _ops.embedding_bag_backward(g, v_, o_, num_rows=int(n), combiner=combiner,
                                           per_sample_weights=p_, bounds=bounds)
        return grad.ids, grad.rows

    args = [dy, values, offsets] + ([] if psw is None else [psw])
    if tf.executing_eagerly():
        num_rows = w.shape[0]  # eager shapes are known
        ids, rows = _eager_call(lambda *a: run(num_rows, *a), args, w)
        return from_kernel_array(ids), from_kernel_array(rows)

    def host(n, g, v_, o_, p_=None):
        ids, rows = _as_tf_error(run, n, g, v_, o_, p_)
        return np.asarray(ids, values.dtype.as_numpy_dtype), np.asarray(rows, g.dtype)

    with tf.device("/CPU:0"):
        num_rows_t = tf.shape(w, out_type=tf.int64)[0]
        ids, rows = tf.numpy_function(host, [num_rows_t] + args, Tout=[values.dtype, dy.dtype],
                                      stateful=True, name="hbk_embedding_bag_backward")
    ids.set_shape([None])
    rows.set_shape([None, w.shape[1]])
    return ids, rows


def _psw_grad(dy, w, values, offsets, psw, combiner, bounds):
    """d loss / d per_sample_weights (:func:`hbkernels.per_sample_weights_backward`)."""

    def run(g, w_, v_, o_, p_):
        return _ops.per_sample_weights_backward(g, w_, v_, o_, p_, combiner=combiner,
                                                bounds=bounds)

    args = [dy, w, values, offsets, psw]
    if tf.executing_eagerly():
        return from_kernel_array(_eager_call(run, args, w))

    def host(*arrays):
        return _as_tf_error(run, *arrays)

    with tf.device("/CPU:0"):
        grad = tf.numpy_function(host, args, Tout=psw.dtype, stateful=True,
                                 name="hbk_per_sample_weights_backward")
    grad.set_shape(psw.shape)
    return grad


def embedding_bag(weight, values, offsets=None, *, combiner="sum", per_sample_weights=None,
                  bounds="raise", name=None):
    """Pooled lookup of CSR bags, ``[B, D]`` with ``B = offsets.shape[0] - 1``, as
    :func:`hbkernels.embedding_bag`, differentiable in TF w.r.t. ``weight``
    (gradient: ``tf.IndexedSlices``) and ``per_sample_weights`` (dense).

    ``weight``: ``[num_rows, D]`` float16/32/64 ``tf.Variable`` (or Keras
    variable) or tensor. ``values`` ``[N]`` and ``offsets`` ``[B + 1]``: int32
    or int64 tensors (or anything ``tf.convert_to_tensor`` takes); or pass a
    ragged-rank-1 ``tf.RaggedTensor`` as ``values`` and no ``offsets`` (its
    ``row_splits`` are the offsets). ``combiner``: ``"sum"``, ``"mean"``,
    ``"sqrtn"`` (TF's ``embedding_lookup_sparse`` semantics, with
    ``per_sample_weights`` as its ``sp_weights``), an empty bag gives zeros
    (where ``embedding_lookup_sparse`` drops trailing empty rows from its
    output). ``bounds``: as in :func:`hbkernels.embedding_bag`.
    Works eagerly (zero-copy DLPack views, CPU or GPU) and in ``tf.function``
    (a CPU host callback); see the module docstring.

    ``weight`` may be a :class:`hbkernels.QuantizedTable` (inference): the kernels read
    its rows where they are (NumPy: the CPU, and the only kind a ``tf.function`` takes;
    CuPy: its GPU, eagerly), the output is float32 and has no gradient.
    """
    if isinstance(values, tf.RaggedTensor):
        if offsets is not None:
            raise ValueError("pass either a tf.RaggedTensor as values or values and offsets")
        if values.ragged_rank != 1:
            raise ValueError(f"values must be a ragged-rank-1 RaggedTensor [B, (n)], "
                             f"got ragged_rank {values.ragged_rank}")
        values, offsets = values.values, values.row_splits
    if offsets is None:
        raise ValueError("offsets is required (B + 1 CSR offsets) unless values is a "
                         "tf.RaggedTensor")
    with tf.name_scope(name or "hbk_embedding_bag"):
        quantized = isinstance(weight, QuantizedTable)
        w = None if quantized else tf.convert_to_tensor(weight)  # a variable read: watched here
        values = tf.convert_to_tensor(values)
        offsets = tf.convert_to_tensor(offsets)
        psw = None if per_sample_weights is None else tf.convert_to_tensor(per_sample_weights)
        _check(combiner, bounds, w, values, offsets, psw)
        if quantized:
            return _quantized_forward(weight, values, offsets, psw, combiner, bounds)
        if not _watched(w) and (psw is None or not _watched(psw)):
            return _forward(w, values, offsets, psw, combiner, bounds)  # eager, no tape
        if psw is None:
            return _differentiable_op(combiner, bounds, False)(w, values, offsets)
        return _differentiable_op(combiner, bounds, _watched(psw))(w, values, offsets, psw)


@functools.lru_cache(maxsize=None)
def _differentiable_op(combiner, bounds, psw_differentiable):
    """The ``tf.custom_gradient`` op ``(w, values, offsets[, psw]) -> out`` (made once
    per configuration: decorating costs as much as a small lookup)."""

    @tf.custom_gradient
    def op(w, values, offsets, *psw):
        psw = psw[0] if psw else None
        out = _forward(w, values, offsets, psw, combiner, bounds)

        def grad(dy):
            dy = tf.convert_to_tensor(dy)
            ids, rows = _backward(dy, w, values, offsets, psw, combiner, bounds)
            dw = tf.IndexedSlices(rows, ids, _dense_shape(w))
            if psw is None:
                return dw, None, None
            dp = (_psw_grad(dy, w, values, offsets, psw, combiner, bounds)
                  if psw_differentiable else None)
            return dw, None, None, dp

        return out, grad

    return op


# -- Keras 3 layer --------------------------------------------------------------------------------
if keras is not None:

    @keras.saving.register_keras_serializable(package="hbkernels")
    class EmbeddingBag(keras.layers.Layer):
        """Keras 3 layer: a ``[num_rows, dim]`` table pooled per CSR bag with
        :func:`embedding_bag` (TensorFlow backend).

        ``layer(values, offsets)`` or ``layer(values, offsets, per_sample_weights)``
        (or ``layer(ragged)`` with a ``tf.RaggedTensor``) gives ``[B, dim]``. The
        table is created in :meth:`build` (float32 unless the dtype policy says
        otherwise, initialised like ``keras.layers.Embedding``); the output is cast
        to the layer's compute dtype. Its gradient is a ``tf.IndexedSlices``, so
        Keras optimizers update only the rows looked up (SGD exactly; stateful
        optimizers as their sparse rules say). ``supports_jit = False``: the op is
        a host callback inside ``tf.function`` (see the module docstring).

        >>> import numpy as np
        >>> layer = EmbeddingBag(10, 4, combiner="mean")
        >>> layer(np.array([1, 2, 9]), np.array([0, 2, 3])).shape
        TensorShape([2, 4])
        """

        def __init__(self, num_rows, dim, combiner="sum", *, embeddings_initializer="uniform",
                     embeddings_regularizer=None, embeddings_constraint=None, bounds="raise",
                     **kwargs):
            super().__init__(**kwargs)
            if combiner not in COMBINERS:
                raise ValueError(f"combiner must be one of {sorted(COMBINERS)}, got {combiner!r}")
            if bounds not in BOUNDS:
                raise ValueError(f"bounds must be one of {sorted(BOUNDS)}, got {bounds!r}")
            if int(num_rows) < 1 or int(dim) < 1:
                raise ValueError(f"num_rows and dim must be >= 1, got {num_rows} and {dim}")
            self.num_rows, self.dim = int(num_rows), int(dim)
            self.combiner, self.bounds = combiner, bounds
            self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
            self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
            self.embeddings_constraint = keras.constraints.get(embeddings_constraint)
            self.supports_jit = False
            self.autocast = False  # the table stays in its own dtype; the output is cast

        def build(self, input_shape=None):
            self.embeddings = self.add_weight(
                shape=(self.num_rows, self.dim), initializer=self.embeddings_initializer,
                regularizer=self.embeddings_regularizer, constraint=self.embeddings_constraint,
                name="embeddings", trainable=True)
            self.built = True

        def call(self, values, offsets=None, per_sample_weights=None):
            out = embedding_bag(self.embeddings.value, values, offsets, combiner=self.combiner,
                                per_sample_weights=per_sample_weights, bounds=self.bounds)
            if out.dtype != self.compute_dtype:
                out = tf.cast(out, self.compute_dtype)
            return out

        def compute_output_shape(self, values_shape, offsets_shape=None,
                                 per_sample_weights_shape=None):
            if offsets_shape is None:  # a ragged [B, (n)] input
                return (values_shape[0], self.dim)
            bags = None if offsets_shape[0] is None else offsets_shape[0] - 1
            return (bags, self.dim)

        def get_config(self):
            config = super().get_config()
            config.update(
                num_rows=self.num_rows, dim=self.dim, combiner=self.combiner, bounds=self.bounds,
                embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer),
                embeddings_regularizer=keras.regularizers.serialize(self.embeddings_regularizer),
                embeddings_constraint=keras.constraints.serialize(self.embeddings_constraint))
            return config
