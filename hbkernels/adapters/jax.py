"""JAX front end: :func:`embedding_bag` as a differentiable JAX function.

>>> import jax, jax.numpy as jnp
>>> from hbkernels.adapters import jax as hbj
>>> w = jnp.arange(8, dtype=jnp.float32).reshape(4, 2)
>>> v, o = jnp.array([0, 3, 1]), jnp.array([0, 2, 2, 3])
>>> hbj.embedding_bag(w, v, o, combiner="mean").tolist()
[[3.0, 4.0], [0.0, 0.0], [2.0, 3.0]]
>>> jax.grad(lambda w: hbj.embedding_bag(w, v, o).sum())(w).tolist()
[[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]

Semantics are those of :func:`hbkernels.embedding_bag` (``bounds="raise"``):
``[B, D]`` with ``B = offsets.shape[0] - 1``, in ``weight``'s dtype (float16,
float32, float64; float64 and int64 need ``jax.enable_x64``, otherwise JAX
hands us float32 / int32 arrays). Works eagerly and under ``jax.jit``,
``jax.grad``, ``jax.value_and_grad`` and ``jax.vmap`` (``vmap_method=
"sequential"``: one kernel call per batch element).

Gradients (``jax.custom_vjp``, ``combiner`` static):

* ``weight``: a dense ``[num_rows, D]`` cotangent (JAX has no row-sparse
  cotangent type) built from the kernel's :class:`hbkernels.SparseGrad`:
  zeros, then ``dense[ids] = rows`` (``ids`` are distinct).
* ``values``, ``offsets``: integer inputs, zero cotangents of dtype
  ``jax.dtypes.float0``.
* ``per_sample_weights``: :func:`hbkernels.per_sample_weights_backward`
  (the exact gradient, zero where a bag's denominator is zero), through the
  same callback path as the other kernels.

Execution paths (chosen per lowering platform with ``jax.lax.platform_dependent``;
:func:`paths` says which ones this installation takes):

* **CPU** - ``jax.experimental.buffer_callback`` (JAX >= 0.7): the callback
  gets XLA's host buffers; ``np.asarray`` views them without a copy, the Numba
  CPU kernel runs on the views and its result is copied into XLA's output
  buffer (``[B, D]`` forward, ``[num_rows, D]`` backward). On older JAX:
  ``jax.pure_callback`` (same zero-copy inputs; JAX copies the returned array
  into its output), with several times the per-call overhead (~200 µs vs
  ~25 µs over the bare kernel on a small forward on this project's CPU runner).
* **CUDA** (``buffer_callback`` and CuPy installed) - the same callback gets
  XLA's device buffers; their ``__cuda_array_interface__`` (version 2, no
  stream field, so no implicit sync) is viewed by CuPy without a copy, and the
  Numba CUDA kernels run on XLA's own stream (``ctx.stream`` made CuPy's
  current stream). The kernel's result is copied device-to-device into XLA's
  output buffer on that stream; the table is never copied. The kernels' checks
  are read back inside the callback, which waits for XLA's stream once per call. Not compatible with command buffers / CUDA
  graphs (``command_buffer_compatible=False``).
* **CUDA fallback** (JAX without ``buffer_callback``, or no CuPy):
  ``jax.pure_callback``, i.e. through host memory: per forward call XLA copies
  ``weight`` (the whole table), ``values``, ``offsets`` and
  ``per_sample_weights`` device-to-host, the CPU kernel runs, and ``[B, D]``
  goes back host-to-device; the backward copies ``g``, ``values``,
  ``offsets`` (and weights, and for their gradient the table) to the host and
  the dense ``[num_rows, D]`` cotangent back. Correct, but far from zero-copy.

Errors: shape, dtype and ``combiner`` problems are found while tracing and
raise ``ValueError`` at the call. Data errors (an id outside
``[0, num_rows)``, malformed offsets) are only seen by the kernel inside the
callback; JAX turns the kernel's :class:`hbkernels.BoundsError` /
``ValueError`` into ``jax.errors.JaxRuntimeError`` (a ``RuntimeError``) whose
message carries the original traceback text, e.g. ``"BoundsError: values[3] =
9 is out of range [0, 4)"``. It is raised at the call, or at the latest when
the result is used or ``block_until_ready()``-ed (JAX dispatches
asynchronously); the pure_callback path also logs ``"jax.pure_callback
failed"``. With ``B == 0`` the output is empty and XLA skips the callback, so
nothing is checked.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate as check
from .. import ops
from .._machine import cupy as _cupy, has_cupy as _has_cupy
from ..quantize import QuantizedTable

try:  # JAX >= 0.7
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # pragma: no cover - older JAX: host fallback everywhere
    _buffer_callback = None

__all__ = ["embedding_bag", "paths"]

#: CPU path where JAX has ``buffer_callback``: ``"buffer_callback"`` (default)
#: or ``"pure_callback"`` (the fallback of older JAX; the tests switch to it to
#: exercise it). Read at trace time.
_CPU_PATH = "buffer_callback"

_DLPACK_CPU = 1


def embedding_bag(weight, values, offsets, *, combiner="sum", per_sample_weights=None):
    """Pooled lookup of CSR bags, ``[B, D]`` with ``B = offsets.shape[0] - 1``,
    differentiable w.r.t. ``weight`` and ``per_sample_weights`` (see the module
    docstring for paths, gradients and errors).

    ``weight`` ``[num_rows, D]`` float; ``values`` ``[N]`` and ``offsets``
    ``[B + 1]`` int32/int64; ``per_sample_weights`` ``[N]`` float or None;
    ``combiner`` one of ``"sum"``, ``"mean"``, ``"sqrtn"`` (static).

    ``weight`` may be a :class:`hbkernels.QuantizedTable` (inference): the kernels read
    its rows where they are (NumPy for the CPU paths, CuPy on XLA's GPU; held by the
    function, never copied into JAX), the output is float32 and nothing is
    differentiable (``jax.grad`` through it raises).
    """
    values, offsets = jnp.asarray(values), jnp.asarray(offsets)
    psw = None if per_sample_weights is None else jnp.asarray(per_sample_weights)
    quantized = isinstance(weight, QuantizedTable)
    if not quantized:
        weight = jnp.asarray(weight)
        check.table("weight", weight)
    check.ids("values", values, ndim=1)
    check.offsets(offsets)
    check.per_sample_weights(psw, values)
    check.choice("combiner", combiner, check.COMBINERS)
    if quantized:
        out_type = jax.ShapeDtypeStruct((offsets.shape[0] - 1, weight.dim), jnp.float32)
        return _call(functools.partial(_quantized_pool_into, combiner, weight), out_type, values,
                     offsets, psw)
    return _bag(combiner, weight, values, offsets, psw)


def paths():
    """The callback each lowering platform takes here, e.g.
    ``{"cpu": "buffer_callback", "cuda": "pure_callback"}`` (CUDA: zero-copy on
    XLA's stream with ``"buffer_callback"``, through host memory otherwise)."""
    if _buffer_callback is None:
        return {"cpu": "pure_callback", "cuda": "pure_callback"}
    return {"cpu": _CPU_PATH, "cuda": "buffer_callback" if _has_cupy() else "pure_callback"}


# -- autodiff ------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _bag(combiner, weight, values, offsets, psw):
    return _forward(combiner, weight, values, offsets, psw)


def _bag_fwd(combiner, weight, values, offsets, psw):
    out = _forward(combiner, weight, values, offsets, psw)
    # weight is kept for its shape (and, with weights, for their gradient)
    return out, (weight, values, offsets, psw)


def _bag_bwd(combiner, residuals, g):
    weight, values, offsets, psw = residuals
    d_weight = _backward(combiner, weight.shape[0], g, values, offsets, psw)
    d_psw = None if psw is None else _weights_grad(combiner, g, weight, values, offsets, psw)
    return (
        d_weight,
        np.zeros(values.shape, jax.dtypes.float0),
        np.zeros(offsets.shape, jax.dtypes.float0),
        d_psw,
    )


_bag.defvjp(_bag_fwd, _bag_bwd)


# -- kernel calls (NumPy or CuPy arrays in, NumPy or CuPy arrays out) ----------

def _into(out, result):
    """``result`` written into XLA's buffer ``out``, or returned as is where there is none."""
    if out is None:
        return result
    out[...] = result
    return out


def _pool_into(combiner, out, weight, values, offsets, psw=None):
    return _into(out, ops.embedding_bag(weight, values, offsets, combiner=combiner,
                                        per_sample_weights=psw))


def _quantized_pool_into(combiner, table, out, values, offsets, psw=None):
    return _pool_into(combiner, out, table, values, offsets, psw)


def _grad_into(combiner, num_rows, out, g, values, offsets, psw=None):
    sg = ops.embedding_bag_backward(
        g, values, offsets, num_rows=num_rows, combiner=combiner, per_sample_weights=psw
    )
    if out is None:
        out = np.zeros((num_rows, g.shape[1]), g.dtype)
    else:
        out.fill(0)
    out[sg.ids] = sg.rows  # distinct ids: a plain scatter
    return out


def _weights_grad_into(combiner, out, g, weight, values, offsets, psw):
    return _into(out, ops.per_sample_weights_backward(g, weight, values, offsets, psw,
                                                      combiner=combiner))


def _forward(combiner, weight, values, offsets, psw):
    out_type = jax.ShapeDtypeStruct((offsets.shape[0] - 1, weight.shape[1]), weight.dtype)
    return _call(functools.partial(_pool_into, combiner), out_type, weight, values, offsets, psw)


def _backward(combiner, num_rows, g, values, offsets, psw):
    out_type = jax.ShapeDtypeStruct((num_rows, g.shape[1]), g.dtype)
    kernel_into = functools.partial(_grad_into, combiner, num_rows)
    return _call(kernel_into, out_type, g, values, offsets, psw)


def _weights_grad(combiner, g, weight, values, offsets, psw):
    out_type = jax.ShapeDtypeStruct(psw.shape, psw.dtype)
    return _call(functools.partial(_weights_grad_into, combiner), out_type, g, weight, values,
                 offsets, psw)


# -- the two callback paths ---------------------------------------------------

def _call(kernel_into, out_type, *args):
    """``kernel_into(out, *arrays)`` staged out through the path of the lowering
    platform (:func:`paths`); ``out`` is None on the pure_callback path (return
    a new array)."""
    args = tuple(a for a in args if a is not None)  # per_sample_weights is optional
    host = functools.partial(_host_call, kernel_into, out_type)
    if _buffer_callback is None:
        return host(*args)
    buffered = functools.partial(_buffer_call, kernel_into, out_type)
    cpu = buffered if _CPU_PATH == "buffer_callback" else host
    cuda = buffered if _has_cupy() else host
    if cpu is cuda:
        return cpu(*args)
    return jax.lax.platform_dependent(*args, cpu=cpu, cuda=cuda, default=host)


def _host_call(kernel_into, out_type, *args):
    def callback(*arrays):
        return kernel_into(None, *(np.asarray(a) for a in arrays))

    return jax.pure_callback(callback, out_type, *args, vmap_method="sequential")


def _buffer_call(kernel_into, out_type, *args):
    def callback(ctx, out, *buffers):
        device_type, device_id = out.__dlpack_device__()
        if device_type == _DLPACK_CPU:
            kernel_into(np.asarray(out), *(np.asarray(b) for b in buffers))
            return
        from ..cuda import _pending

        cp = _cupy()
        with cp.cuda.Device(device_id), cp.cuda.ExternalStream(ctx.stream, device_id):
            kernel_into(cp.asarray(out), *(cp.asarray(b) for b in buffers))
            _pending.check_now()  # the kernels' checks, raised inside the callback

    return _buffer_callback(callback, out_type, vmap_method="sequential")(*args)


