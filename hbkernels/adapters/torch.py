"""PyTorch front end: ``embedding_bag`` as a differentiable torch op,
:class:`EmbeddingBag` (``torch.nn.EmbeddingBag``'s constructor and call
conventions on that op), and :class:`EmbeddingCollectionModule`, an
``nn.Module`` over :class:`hbkernels.EmbeddingCollection` that takes a feature
dict or a TorchRec ``KeyedJaggedTensor`` (:func:`features_from_kjt`) and whose
``state_dict()`` holds the tables. TorchRec is never imported here: a
``KeyedJaggedTensor`` is recognised when TorchRec is already loaded.

Arrays cross without copies: CPU tensors as NumPy views (``tensor.numpy()``
in, ``torch.from_numpy`` out), CUDA tensors as CuPy views of the same device
memory (built from ``data_ptr()``, the information ``__cuda_array_interface__``
carries, without its synchronisation) with the result handed back through
DLPack. CUDA kernels launch on torch's *current* stream (wrapped in a
``cupy.cuda.ExternalStream`` made current around the call), so they are
ordered with the surrounding torch work and nothing synchronises the host
(except ``bounds="raise"``, which reads the kernel's error flag).

``embedding_bag`` is the custom op ``torch.ops.hbkernels.embedding_bag``
(``torch.library.custom_op`` with a fake implementation and a registered
autograd formula), so ``torch.compile(fullgraph=True)`` keeps it in the graph
as one opaque node: backends ``"eager"``, ``"aot_eager"`` and ``"inductor"``
give the same forward and gradients as eager mode (see :func:`embedding_bag`
for the one limit with ``sparse=True``). Its backward is the custom op
``torch.ops.hbkernels.embedding_bag_backward``: the kernel's
:class:`hbkernels.SparseGrad` scattered into a dense ``[num_rows, D]`` tensor
with one scatter (NumPy's on the CPU, ``index_copy_`` on the GPU); that of
``per_sample_weights`` is ``torch.ops.hbkernels.per_sample_weights_backward``.
``torch.func`` transforms (``grad``, ``vmap``) are not supported.

Performance: eager calls skip the custom-op dispatch (:data:`EAGER_FAST_PATH`).
Measured on a busy 2-core AMD EPYC VM (``bench/bench_adapters.py``, E=1000,
D=16, B=64, L=4, calls interleaved with the bare kernel's): about +6 µs per
forward without grad, +17 to +40 µs with the table requiring grad, and about
+150 µs per forward + backward (autograd engine, the Function and the dense
gradient). On the CPU, torch's OpenMP pool and Numba's (a second libgomp) both
spin on the same cores: on small machines ``torch.set_num_threads`` /
``NUMBA_NUM_THREADS`` well below the core count avoid oversubscription.

>>> import torch
>>> from hbkernels.adapters.torch import embedding_bag
>>> w = torch.arange(8, dtype=torch.float32).reshape(4, 2).requires_grad_()
>>> out = embedding_bag(w, torch.tensor([0, 3, 1]), torch.tensor([0, 2, 2, 3]), combiner="mean")
>>> out.tolist()
[[3.0, 4.0], [0.0, 0.0], [2.0, 3.0]]
>>> out.sum().backward()
>>> w.grad[:, 0].tolist()
[0.5, 1.0, 0.0, 0.5]
"""
import contextlib

import numpy as np
import torch

from .. import _simulator, ops as _ops
from .._dispatch import cupy_bfloat16
from .._machine import cupy as _cupy, simulator_enabled
from ..sharding import kjt as _kjt
from ..sharding.kjt import is_keyed_jagged_tensor, kjt_tensors, kjt_weights
from .._validate import BOUNDS, COMBINERS, is_bfloat16
from ..quantize import QuantizedTable, quantize_rows

__all__ = ["EmbeddingBag", "EmbeddingCollectionModule", "embedding_bag", "features_from_kjt",
           "is_keyed_jagged_tensor", "kernel_array", "from_kernel_array", "cuda_stream_of"]

_NAMESPACE = "hbkernels"
# torch dtypes with a NumPy twin (the kernels check which they accept and say so)
_TORCH_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
                 torch.int32: np.int32, torch.int64: np.int64, torch.int16: np.int16,
                 torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_,
                 torch.complex64: np.complex64, torch.complex128: np.complex128}


# -- argument checks --------------------------------------------------------------------------------
def _type_name(x):
    """``x``'s type as a message names it: ``numpy.ndarray``, ``list``."""
    cls = type(x)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__name__}"


def _require_tensor(name, t, *, optional=False):
    """TypeError unless argument ``name`` is a torch.Tensor (or None, when ``optional``)."""
    if not isinstance(t, torch.Tensor) and not (optional and t is None):
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if optional else ''}, "
                        f"got {_type_name(t)}")


# -- zero-copy crossings ----------------------------------------------------------------------------
def kernel_array(t):
    """The array the kernels take for tensor ``t``, sharing its memory: a NumPy view
    of a CPU tensor, a CuPy view of a CUDA tensor (``None`` stays ``None``). A
    non-contiguous tensor is made contiguous first (that one copies)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {_type_name(t)}")
    bf16 = t.dtype == torch.bfloat16
    if t.dtype not in _TORCH_DTYPES and not bf16:
        raise ValueError(f"hbkernels takes float16/bfloat16/float32/float64 tables and "
                         f"int32/int64 ids, got a {t.dtype} tensor on {t.device}")
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if bf16 and t.is_cpu:  # NumPy knows bfloat16 through ml_dtypes only: cross as its bits
        return t.view(torch.int16).numpy().view(_numpy_bfloat16())
    if t.is_cpu:
        return t.numpy()
    if t.is_cuda:
        cupy = _cupy()
        dtype = np.dtype(np.int16 if bf16 else _TORCH_DTYPES[t.dtype])
        nbytes = t.numel() * dtype.itemsize
        # what __cuda_array_interface__ describes, minus its stream synchronisation: the
        # kernels run on torch's current stream (see cuda_stream_of), ordered after t's writers
        mem = cupy.cuda.UnownedMemory(t.data_ptr(), nbytes, t, t.device.index)
        a = cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(mem, 0))
        return cupy_bfloat16(a) if bf16 else a
    raise TypeError(f"hbkernels runs on CPU and CUDA tensors, got one on {t.device}")


def _simulated_array(t):
    """:func:`kernel_array` of the CPU tensor ``t`` as a simulated CUDA array (a view)."""
    a = kernel_array(t)
    return None if a is None else _simulator.device(a)


def from_kernel_array(a):
    """A tensor sharing the memory of a kernel result (NumPy or CuPy)."""
    if not (isinstance(a, np.ndarray) or hasattr(a, "__dlpack__")):
        raise TypeError(f"expected a NumPy or CuPy array (a kernel's result), got {_type_name(a)}")
    if is_bfloat16(a.dtype):  # the bits cross (NumPy has no bf16 DLPack, old CuPy none)
        return from_kernel_array(a.view(np.int16)).view(torch.bfloat16)
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a)
    return torch.from_dlpack(a)


def _numpy_bfloat16():
    try:
        import ml_dtypes
    except ImportError as error:
        raise ValueError("bfloat16 tensors need ml_dtypes (pip install ml-dtypes), NumPy's "
                         "bfloat16") from error
    return np.dtype(ml_dtypes.bfloat16)


@contextlib.contextmanager
def cuda_stream_of(*tensors):
    """Make torch's current CUDA stream CuPy's current stream for the block (when any
    tensor is on a GPU), so the hbkernels CUDA kernels launch on it."""
    device = next((t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda), None)
    if device is None:
        yield
        return
    cupy = _cupy()
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream, device.index):
        yield


# -- implementations (shared by the custom ops and the eager fast path) ------------------------------
def _on_stream(t, fn, *args):
    """``fn(*args)``, on torch's current stream when ``t`` is a CUDA tensor."""
    if not t.is_cuda:  # the CPU path skips the context manager (a few µs a call)
        return fn(*args)
    with cuda_stream_of(t):
        return fn(*args)


def _forward_kernel(weight, values, offsets, combiner, per_sample_weights, bounds):
    table = weight if isinstance(weight, QuantizedTable) else kernel_array(weight)
    out = _ops.embedding_bag(table, kernel_array(values), kernel_array(offsets),
                             combiner=combiner, per_sample_weights=kernel_array(per_sample_weights),
                             bounds=bounds)
    return from_kernel_array(out)


def _forward_impl(weight, values, offsets, combiner, per_sample_weights, bounds):
    return _on_stream(weight, _forward_kernel, weight, values, offsets, combiner,
                      per_sample_weights, bounds)


def _sparse_grad_kernel(grad, values, offsets, num_rows, combiner, per_sample_weights, bounds):
    sg = _ops.embedding_bag_backward(
        kernel_array(grad), kernel_array(values), kernel_array(offsets), num_rows=num_rows,
        combiner=combiner, per_sample_weights=kernel_array(per_sample_weights), bounds=bounds)
    return from_kernel_array(sg.ids).to(torch.int64), from_kernel_array(sg.rows)


def _sparse_grad_impl(grad, values, offsets, num_rows, combiner, per_sample_weights, bounds):
    """The kernel's ``SparseGrad`` as tensors ``(ids int64 [U], rows [U, D])``."""
    return _on_stream(grad, _sparse_grad_kernel, grad, values, offsets, num_rows, combiner,
                      per_sample_weights, bounds)


def _dense_grad_kernel(grad, values, offsets, num_rows, combiner, per_sample_weights, bounds):
    sg = _ops.embedding_bag_backward(
        kernel_array(grad), kernel_array(values), kernel_array(offsets), num_rows=num_rows,
        combiner=combiner, per_sample_weights=kernel_array(per_sample_weights), bounds=bounds)
    if isinstance(sg.rows, np.ndarray):  # NumPy's zeros and scatter: the cheapest on the CPU
        dense = np.zeros((num_rows, sg.rows.shape[1]), sg.rows.dtype)
        dense[sg.ids] = sg.rows
        return from_kernel_array(dense)
    ids, rows = from_kernel_array(sg.ids).to(torch.int64), from_kernel_array(sg.rows)
    dense = torch.zeros((num_rows, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    return dense.index_copy_(0, ids, rows)


def _dense_grad_impl(grad, values, offsets, num_rows, combiner, per_sample_weights, bounds):
    """Dense ``[num_rows, D]`` gradient: the kernel's ``SparseGrad`` rows scattered into
    zeros with one scatter (distinct ids: no accumulation needed)."""
    return _on_stream(grad, _dense_grad_kernel, grad, values, offsets, num_rows, combiner,
                      per_sample_weights, bounds)


def _psw_grad_kernel(grad, weight, values, offsets, per_sample_weights, combiner, bounds):
    out = _ops.per_sample_weights_backward(
        kernel_array(grad), kernel_array(weight), kernel_array(values), kernel_array(offsets),
        kernel_array(per_sample_weights), combiner=combiner, bounds=bounds)
    return from_kernel_array(out)


def _psw_grad_impl(grad, weight, values, offsets, per_sample_weights, combiner, bounds):
    """d loss / d per_sample_weights (:func:`hbkernels.per_sample_weights_backward`)."""
    return _on_stream(grad, _psw_grad_kernel, grad, weight, values, offsets, per_sample_weights,
                      combiner, bounds)


# -- the custom ops (what torch.compile / export / opcheck see) ------------------------------------
@torch.library.custom_op(f"{_NAMESPACE}::embedding_bag", mutates_args=())
def _embedding_bag_op(weight: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                      combiner: str, per_sample_weights: torch.Tensor | None, bounds: str,
                      sparse: bool) -> torch.Tensor:
    """``hbk.embedding_bag`` on the tensors' memory; ``sparse`` only picks the gradient layout."""
    return _forward_impl(weight, values, offsets, combiner, per_sample_weights, bounds)


@_embedding_bag_op.register_fake
def _(weight, values, offsets, combiner, per_sample_weights, bounds, sparse):
    torch._check(weight.dim() == 2, lambda: "weight must be a 2-D table [num_rows, D]")
    torch._check(offsets.dim() == 1 and offsets.shape[0] >= 1,
                 lambda: "offsets must be 1-D with B + 1 >= 1 entries")
    return weight.new_empty((offsets.shape[0] - 1, weight.shape[1]))


@torch.library.custom_op(f"{_NAMESPACE}::embedding_bag_backward", mutates_args=())
def _embedding_bag_backward_op(grad: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                               num_rows: int, combiner: str,
                               per_sample_weights: torch.Tensor | None, bounds: str) -> torch.Tensor:
    """Dense ``[num_rows, D]`` gradient of the table (see ``_dense_grad_impl``)."""
    return _dense_grad_impl(grad, values, offsets, num_rows, combiner, per_sample_weights, bounds)


@_embedding_bag_backward_op.register_fake
def _(grad, values, offsets, num_rows, combiner, per_sample_weights, bounds):
    return grad.new_empty((num_rows, grad.shape[1]))


@torch.library.custom_op(f"{_NAMESPACE}::embedding_bag_backward_sparse", mutates_args=())
def _embedding_bag_backward_sparse_op(
        grad: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, num_rows: int,
        combiner: str, per_sample_weights: torch.Tensor | None,
        bounds: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``SparseGrad`` as ``(ids int64 [U], rows [U, D])``, distinct ids."""
    return _sparse_grad_impl(grad, values, offsets, num_rows, combiner, per_sample_weights, bounds)


@_embedding_bag_backward_sparse_op.register_fake
def _(grad, values, offsets, num_rows, combiner, per_sample_weights, bounds):
    n = torch.library.get_ctx().new_dynamic_size()
    return values.new_empty((n,), dtype=torch.int64), grad.new_empty((n, grad.shape[1]))


@torch.library.custom_op(f"{_NAMESPACE}::per_sample_weights_backward", mutates_args=())
def _psw_grad_op(grad: torch.Tensor, weight: torch.Tensor, values: torch.Tensor,
                 offsets: torch.Tensor, per_sample_weights: torch.Tensor, combiner: str,
                 bounds: str) -> torch.Tensor:
    """Gradient w.r.t. ``per_sample_weights`` (see ``_psw_grad_impl``)."""
    return _psw_grad_impl(grad, weight, values, offsets, per_sample_weights, combiner, bounds)


@_psw_grad_op.register_fake
def _(grad, weight, values, offsets, per_sample_weights, combiner, bounds):
    return per_sample_weights.new_empty(per_sample_weights.shape)


# -- autograd ----------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    weight, values, offsets, combiner, psw, bounds, sparse = inputs
    ctx.combiner, ctx.bounds, ctx.sparse = combiner, bounds, sparse
    ctx.num_rows = weight.shape[0]
    ctx.dim = weight.shape[1]
    psw_grad = psw is not None and psw.requires_grad
    ctx.psw_grad = psw_grad
    ctx.save_for_backward(values, offsets, psw, weight if psw_grad else None)


def _backward_with(ctx, grad, dense_grad, sparse_grad, psw_grad):
    values, offsets, psw, weight = ctx.saved_tensors
    grad_weight = grad_psw = None
    if ctx.needs_input_grad[0]:
        detached = None if psw is None else psw.detach()
        args = (grad, values, offsets, ctx.num_rows, ctx.combiner, detached, ctx.bounds)
        if ctx.sparse:
            ids, rows = sparse_grad(*args)
            grad_weight = torch.sparse_coo_tensor(ids.unsqueeze(0), rows, (ctx.num_rows, ctx.dim),
                                                  check_invariants=False)
        else:
            grad_weight = dense_grad(*args)
    if ctx.psw_grad and ctx.needs_input_grad[4]:
        grad_psw = psw_grad(grad, weight, values, offsets, psw.detach(), ctx.combiner, ctx.bounds)
    return grad_weight, None, None, None, grad_psw, None, None


def _backward(ctx, grad):  # the custom op's: traceable, through the backward custom ops
    return _backward_with(ctx, grad, torch.ops.hbkernels.embedding_bag_backward,
                          torch.ops.hbkernels.embedding_bag_backward_sparse,
                          torch.ops.hbkernels.per_sample_weights_backward)


torch.library.register_autograd(f"{_NAMESPACE}::embedding_bag", _backward,
                                setup_context=_setup_context)


class _EagerEmbeddingBag(torch.autograd.Function):
    """The same op, forward and backward, for eager calls without the custom-op
    dispatch (which costs tens of µs a call): same implementations, same formulas.
    (Old-style ``forward(ctx, ...)``: the new style binds arguments with ``inspect``
    on every call.)"""

    @staticmethod
    def forward(ctx, weight, values, offsets, combiner, per_sample_weights, bounds, sparse):
        out = _forward_impl(weight, values, offsets, combiner, per_sample_weights, bounds)
        _setup_context(ctx, (weight, values, offsets, combiner, per_sample_weights, bounds, sparse),
                       out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return _backward_with(ctx, grad.contiguous(), _dense_grad_impl, _sparse_grad_impl,
                              _psw_grad_impl)


#: Eager calls of :func:`embedding_bag` skip the custom-op dispatch (set False to route
#: them through ``torch.ops.hbkernels.embedding_bag``, as traced code always is).
EAGER_FAST_PATH = True


def embedding_bag(weight, values, offsets, *, combiner="sum", per_sample_weights=None,
                  sparse=False, bounds="raise"):
    """Pooled lookup of CSR bags (:func:`hbkernels.embedding_bag`) as a torch op,
    ``[B, D]`` with ``B = len(offsets) - 1``, differentiable w.r.t. ``weight``.

    ``weight``: ``[num_rows, D]`` float16/32/64 tensor (CPU or CUDA, its memory
    is used in place). ``values``/``offsets``: int32 or int64 CSR (``offsets``
    has ``B + 1`` entries, like ``nn.EmbeddingBag(include_last_offset=True)``),
    not differentiable. ``combiner``: ``"sum"``, ``"mean"`` or ``"sqrtn"``
    (TF semantics: ``Σw·e / sqrt(Σw²)``); ``per_sample_weights`` may be used with
    every combiner (torch allows them only with sum) and is differentiable for
    all three (by :func:`hbkernels.per_sample_weights_backward`, the custom op
    ``torch.ops.hbkernels.per_sample_weights_backward``). ``bounds`` as in
    :func:`hbkernels.embedding_bag`.

    Gradient of ``weight``: dense ``[num_rows, D]`` (default), or with
    ``sparse=True`` a ``torch.sparse_coo_tensor`` (not coalesced) whose indices
    are the distinct ids of the batch, as ``nn.EmbeddingBag(sparse=True)`` gives
    for ``torch.optim.SparseAdam``/``SGD``. Double backward and ``torch.func``
    transforms are not supported.

    Under ``torch.compile`` (and ``torch.export``, ``opcheck``) the call is the custom
    op ``torch.ops.hbkernels.embedding_bag``, opaque to the compiler, whose backward is
    the custom op ``hbkernels::embedding_bag_backward`` (dense) or
    ``hbkernels::embedding_bag_backward_sparse`` (data-dependent size ``u0``). With
    torch 2.13, ``fullgraph=True`` works with the backends ``"eager"``,
    ``"aot_eager"`` and ``"inductor"``, dense and sparse, with one limit of torch's:
    under AOTAutograd (``aot_eager``, ``inductor``) a table looked up more than once
    with ``sparse=True`` in one graph fails in backward, because adding its two
    sparse COO gradients in the traced graph hits an internal assert of fake
    tensors (``aten.add.Tensor`` on sparse: "dispatch_on_subclass called with NO
    overloaded args"); use dense gradients there, or one lookup per table. Eager calls take
    :data:`EAGER_FAST_PATH`: the same implementation through a plain
    ``torch.autograd.Function`` (or no autograd at all when nothing requires grad),
    because the custom-op dispatch adds tens of µs a call.

    ``weight`` may be a :class:`hbkernels.QuantizedTable` (NumPy rows for CPU tensors,
    CuPy rows for CUDA ones): float32 out, no gradient (inference).

    Errors are those of :func:`hbkernels.embedding_bag` (``hbk.BoundsError``,
    ``ValueError``); an argument that is not a torch tensor (a NumPy array, a list) and
    mixing CPU and CUDA tensors are a ``TypeError``.
    """
    if combiner not in COMBINERS:
        raise ValueError(f"combiner must be one of {sorted(COMBINERS)}, got {combiner!r}")
    if bounds not in BOUNDS:
        raise ValueError(f"bounds must be one of {sorted(BOUNDS)}, got {bounds!r}")
    if not isinstance(weight, (torch.Tensor, QuantizedTable)):
        raise TypeError(f"weight must be a torch.Tensor or an hbk.QuantizedTable, got "
                        f"{_type_name(weight)}")
    _require_tensor("values", values)
    _require_tensor("offsets", offsets)
    _require_tensor("per_sample_weights", per_sample_weights, optional=True)
    if isinstance(weight, QuantizedTable):
        return _on_stream(values, _forward_kernel, weight, values, offsets, combiner,
                          per_sample_weights, bounds)
    sparse = bool(sparse)
    if EAGER_FAST_PATH and not torch.compiler.is_compiling():
        if not (torch.is_grad_enabled() and (weight.requires_grad or (
                per_sample_weights is not None and per_sample_weights.requires_grad))):
            return _forward_impl(weight, values, offsets, combiner, per_sample_weights, bounds)
        return _EagerEmbeddingBag.apply(weight, values, offsets, combiner, per_sample_weights,
                                        bounds, sparse)
    return torch.ops.hbkernels.embedding_bag(weight, values, offsets, combiner,
                                             per_sample_weights, bounds, sparse)


# -- nn.EmbeddingBag ----------------------------------------------------------------------------------
_MODES = ("sum", "mean")  # torch's modes that the hbkernels kernels compute


class EmbeddingBag(torch.nn.Module):
    """``torch.nn.EmbeddingBag`` (same constructor, attributes, ``forward`` and
    ``from_pretrained``) computed by :func:`embedding_bag`.

    ``weight``: ``nn.Parameter`` ``[num_embeddings, embedding_dim]``, initialised
    from ``N(0, 1)`` with the ``padding_idx`` row zeroed (``_weight``, when given,
    is used as it is, memory included). ``forward(input, offsets=None,
    per_sample_weights=None)``: a 1-D ``input`` of ids with ``offsets`` of the bag
    starts (``B`` entries, ``offsets[0] == 0``), or of ``B + 1`` entries with
    ``include_last_offset=True`` (ids after ``offsets[-1]`` are ignored, as torch
    does; reading ``offsets[-1]`` synchronises a CUDA device); or a 2-D
    ``input [B, L]`` of fixed-size bags with ``offsets=None``. Ids and offsets are
    int32 or int64 (they may differ). Returns ``[B, embedding_dim]``.

    ``mode``: ``"sum"`` or ``"mean"`` (an empty bag gives zeros); ``"max"`` raises
    ``NotImplementedError`` (the kernels pool by sums). ``per_sample_weights``
    (the shape of ``input``) only with ``"sum"``, else ``NotImplementedError`` as
    torch; they are differentiable. ``padding_idx``: ids equal to it are left out
    of their bag (a ``"mean"`` divides by the count of the others) and the
    gradient of its row is zero; a negative value counts from the end. ``sparse=True``: the
    gradient of ``weight`` is a ``torch.sparse_coo_tensor`` (not coalesced).
    ``max_norm`` and ``scale_grad_by_freq=True`` raise ``NotImplementedError``.
    An id outside ``[0, num_embeddings)`` raises :class:`hbkernels.BoundsError`
    (an ``IndexError``); other bad input a ``ValueError`` or ``TypeError``.

    >>> import torch
    >>> from hbkernels.adapters.torch import EmbeddingBag
    >>> bag = EmbeddingBag(4, 2, mode="mean", padding_idx=0,
    ...                    _weight=torch.arange(8.0).reshape(4, 2))
    >>> bag(torch.tensor([1, 0, 3, 2]), torch.tensor([0, 3])).tolist()
    [[4.0, 5.0], [4.0, 5.0]]
    """

    def __init__(self, num_embeddings, embedding_dim, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False, mode="mean", sparse=False, _weight=None,
                 include_last_offset=False, padding_idx=None, device=None, dtype=None):
        super().__init__()
        if max_norm is not None:
            raise NotImplementedError("hbkernels EmbeddingBag does not renormalise rows: max_norm "
                                      "must be None")
        if scale_grad_by_freq:
            raise NotImplementedError("hbkernels EmbeddingBag does not scale gradients by id "
                                      "frequency: scale_grad_by_freq must be False")
        if mode == "max":
            raise NotImplementedError(f"hbkernels EmbeddingBag supports the modes {list(_MODES)}, "
                                      f"not 'max'")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {list(_MODES)}, got {mode!r}")
        num_embeddings, embedding_dim = int(num_embeddings), int(embedding_dim)
        if num_embeddings < 0 or embedding_dim < 1:
            raise ValueError(f"need num_embeddings >= 0 and embedding_dim >= 1, got "
                             f"{num_embeddings} and {embedding_dim}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx must be within [-{num_embeddings}, {num_embeddings}), "
                                 f"got {padding_idx}")
            padding_idx = int(padding_idx) % num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.max_norm, self.norm_type, self.scale_grad_by_freq = max_norm, norm_type, False
        self.mode, self.sparse = mode, bool(sparse)
        self.include_last_offset, self.padding_idx = bool(include_last_offset), padding_idx
        if _weight is None:
            self.weight = torch.nn.Parameter(
                torch.empty((num_embeddings, embedding_dim), device=device, dtype=dtype))
            self.reset_parameters()
        else:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError(f"_weight must be [num_embeddings, embedding_dim] = "
                                 f"[{num_embeddings}, {embedding_dim}], got {list(_weight.shape)}")
            self.weight = torch.nn.Parameter(_weight)

    def reset_parameters(self):
        """Fill ``weight`` from ``N(0, 1)`` and zero the ``padding_idx`` row."""
        torch.nn.init.normal_(self.weight)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].fill_(0)

    def forward(self, input, offsets=None, per_sample_weights=None):  # noqa: A002 - torch's name
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a tensor of ids, got {_type_name(input)}")
        _require_tensor("offsets", offsets, optional=True)
        _require_tensor("per_sample_weights", per_sample_weights, optional=True)
        if per_sample_weights is not None and self.mode != "sum":
            raise NotImplementedError(
                f"per_sample_weights are only supported with mode='sum' (as torch), got "
                f"mode={self.mode!r}")
        if per_sample_weights is not None and per_sample_weights.shape != input.shape:
            raise ValueError(f"per_sample_weights must have the shape of input "
                             f"{tuple(input.shape)}, got {tuple(per_sample_weights.shape)}")
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError("a 2-D input is a batch of fixed-size bags: offsets must be None")
            batch, length = input.shape
            values = input.reshape(-1)
            offsets = torch.arange(batch + 1, device=input.device, dtype=torch.int64) * length
            psw = None if per_sample_weights is None else per_sample_weights.reshape(-1)
        elif input.dim() == 1:
            if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1:
                raise ValueError(f"a 1-D input needs 1-D offsets, got "
                                 f"{type(offsets).__name__ if offsets is None else tuple(offsets.shape)}")
            values, psw = input, per_sample_weights
            if self.include_last_offset:
                if offsets.shape[0] < 1:
                    raise ValueError("include_last_offset=True needs offsets of B + 1 >= 1 entries")
                end = int(offsets[-1])
                if 0 <= end < values.shape[0]:  # torch ignores the ids after the last offset
                    values = values[:end]
                    psw = None if psw is None else psw[:end]
            elif offsets.shape[0] == 0:  # no bags
                values = values[:0]
                psw = None if psw is None else psw[:0]
                offsets = offsets.new_zeros(1)
            else:
                offsets = torch.cat([offsets, offsets.new_full((1,), values.shape[0])])
        else:
            raise ValueError(f"input must be 1-D (with offsets) or 2-D [B, L], got shape "
                             f"{tuple(input.shape)}")
        weight = self.weight
        if weight is None:  # quantized (from_quantized): the table over the rows buffer
            weight = QuantizedTable.from_rows(kernel_array(self.rows), self.bits,
                                              self.embedding_dim)
        if self.padding_idx is not None:  # weight 0: out of the sums, the means and the gradient
            keep = (values != self.padding_idx).to(torch.float32 if self.weight is None
                                                   else self.weight.dtype)
            psw = keep if psw is None else psw * keep
        return embedding_bag(weight, values, offsets, combiner=self.mode,
                             per_sample_weights=psw, sparse=self.sparse, bounds="raise")

    def quantized(self, bits=8):
        """An inference copy of this bag: its ``weight`` row-wise quantized to ``bits``
        (:func:`hbkernels.quantize_rows`; :meth:`from_quantized`)."""
        table = quantize_rows(kernel_array(self.weight.detach()), bits=bits)
        return type(self).from_quantized(table, mode=self.mode, padding_idx=self.padding_idx,
                                         include_last_offset=self.include_last_offset)

    @classmethod
    def from_quantized(cls, table, mode="mean", include_last_offset=False, padding_idx=None):
        """An inference ``EmbeddingBag`` over :class:`hbkernels.QuantizedTable` ``table``:
        ``weight`` is None, the packed rows are the uint8 buffer ``rows`` (moved by
        ``.to()``, kept by ``state_dict``), ``bits`` its width; ``forward`` as usual
        returns float32 with no gradient (call it under ``torch.no_grad()``)."""
        if not isinstance(table, QuantizedTable):
            raise TypeError(f"table must be a hbk.QuantizedTable, got {type(table).__name__}")
        bag = cls(table.num_rows, table.dim, mode=mode, include_last_offset=include_last_offset,
                  padding_idx=padding_idx, _weight=torch.empty((table.num_rows, table.dim),
                                                               device="meta"))
        bag.weight = None
        bag.bits = table.bits
        bag.register_buffer("rows", from_kernel_array(table.rows))
        return bag

    @classmethod
    def from_pretrained(cls, embeddings, freeze=True, max_norm=None, norm_type=2.0,
                        scale_grad_by_freq=False, mode="mean", sparse=False,
                        include_last_offset=False, padding_idx=None):
        """An ``EmbeddingBag`` whose ``weight`` is ``embeddings`` (2-D, its memory
        shared), frozen (``requires_grad=False``) unless ``freeze=False``."""
        _require_tensor("embeddings", embeddings)
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be a 2-D tensor [num_embeddings, embedding_dim], got "
                             f"{getattr(embeddings, 'shape', type(embeddings).__name__)}")
        rows, cols = embeddings.shape
        bag = cls(rows, cols, _weight=embeddings, max_norm=max_norm, norm_type=norm_type,
                  scale_grad_by_freq=scale_grad_by_freq, mode=mode, sparse=sparse,
                  include_last_offset=include_last_offset, padding_idx=padding_idx)
        bag.weight.requires_grad = not freeze
        return bag

    def extra_repr(self):
        s = f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}"
        if self.weight is None:
            s += f", bits={self.bits}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.sparse:
            s += ", sparse=True"
        if self.include_last_offset:
            s += ", include_last_offset=True"
        return s


# -- TorchRec KeyedJaggedTensor ------------------------------------------------------------------------
def features_from_kjt(kjt, per_sample_weights=None):
    """The features of TorchRec ``KeyedJaggedTensor`` ``kjt`` as the kernels take them:
    ``({key: hbk.Ragged(values, offsets)}, {key: weights} or None)`` of NumPy (CPU)
    or CuPy (CUDA) arrays, the weights ``kjt.weights_or_none()`` or else
    ``per_sample_weights`` (ValueError when both are given).
    Each key has its own ``B_k = kjt.stride()`` bags (``stride_per_key()`` for a
    variable-stride KJT); ids and weights share the KJT's memory (slices of
    ``kjt.values()``), offsets are rebased to start at 0 (int32 or int64, as the
    KJT's). A key without ids gives ``B_k`` empty bags."""
    return _kjt.features_from_kjt(kjt, per_sample_weights, to_array=kernel_array)


# -- EmbeddingCollection as an nn.Module ------------------------------------------------------------
def _rows(out):
    """A feature's output rows: the pooled ``[B, dim]``, or a sequence table's ``[N, dim]``
    (its offsets are the input's)."""
    from ..types import JaggedRows

    return out.values if isinstance(out, JaggedRows) else out


class _CollectionStep(torch.autograd.Function):
    """One forward of the collection; its backward hands the output gradients to
    ``collection.backward`` (which updates the owned rows in place) and returns no
    gradient. ``anchor`` is a leaf that requires grad, so autograd calls backward."""

    @staticmethod
    def forward(ctx, anchor, module, names, features, per_sample_weights):
        coll = module.collection
        module._generation += 1
        ctx.module, ctx.names, ctx.generation = module, names, module._generation
        out = coll.forward(features, per_sample_weights=per_sample_weights, insert=module.training)
        return tuple(from_kernel_array(_rows(out[f])) for f in names)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        module = ctx.module
        if ctx.generation != module._generation:
            raise RuntimeError(
                "EmbeddingCollectionModule: this backward belongs to an older forward; the "
                "collection keeps one step's context, so run backward before the next forward")
        if module._backward_done == ctx.generation:
            raise RuntimeError("EmbeddingCollectionModule: backward ran twice for one forward "
                               "(retain_graph); the collection's update is applied once per forward")
        module._backward_done = ctx.generation
        with cuda_stream_of(*grads):
            module.collection.backward({f: module._array(g) for f, g in zip(ctx.names, grads)})
        return None, None, None, None, None


def _write_shard_rows(block, shard, whole):
    """Write ``shard``'s rows (and columns, for 2-D arrays) of the whole-table tensor
    ``whole`` into ``block``, the shard's rows of this rank's array (NumPy or CuPy)."""
    rows = whole.detach()[shard.row_start:shard.row_start + shard.row_step * shard.num_rows:
                          shard.row_step]
    if rows.dim() == 2:
        rows = rows[:, shard.c0:shard.c1]
    device = "cpu" if isinstance(block, np.ndarray) else f"cuda:{block.device.id}"
    block[...] = kernel_array(rows.to(device=device, dtype=_torch_dtype(block.dtype)))


def _torch_dtype(dtype):
    """The torch dtype of NumPy dtype ``dtype``."""
    return next(t for t, n in _TORCH_DTYPES.items() if np.dtype(n) == np.dtype(dtype))


DYNAMIC_ITEMS = ("ids", "last", "count")  # a dynamic table's state_dict entries beside its rows
# and, with admission, those of its ids waiting to be admitted
PENDING_ITEMS = ("pending_ids", "pending_last", "pending_count")


def _saved_length(ids):
    """How many ids a state_dict's 1-D id tensor holds; -1 (matching no shape) for
    anything else."""
    return int(ids.shape[0]) if isinstance(ids, torch.Tensor) and ids.ndim == 1 else -1


class EmbeddingCollectionModule(torch.nn.Module):
    """``nn.Module`` over an :class:`hbkernels.EmbeddingCollection` (DLRM's sparse
    part): ``forward(features)`` returns ``{feature: [B, dim]}`` pooled tensors
    (``[N, dim]``, the row of every id, for a sequence table: its offsets are the
    input's) that require grad; ``loss.backward()`` passes their gradients to
    ``collection.backward``, which applies the collection's own sparse optimizer
    (``hbk.optim``) to the rows this rank owns, in place. No gradient reaches
    torch: the tables are not ``nn.Parameter`` s (``parameters()`` is empty), and
    the dense part of the model keeps its torch optimizer.

    ``features[f]``: ``(values, offsets)`` tensors (CSR, ``offsets`` of length
    ``B + 1``), an ``hbk.Ragged`` of tensors, or a 1-D id tensor (one id per
    sample); ``per_sample_weights``: optional ``{feature: weights}``. Tensors are
    on the collection's device (CPU tensors for ``device="cpu"``, CUDA tensors
    on a GPU collection) and cross without copies. ``features`` may instead be a
    TorchRec ``KeyedJaggedTensor`` (keys are features, split as
    :func:`features_from_kjt` does); its weights, when it has some, are the
    per-sample weights (then ``per_sample_weights`` must be ``None``). In
    ``eval()`` mode dynamic tables (``TableSpec(num_rows=None)``) only look ids up:
    nothing is admitted or counted as a use (``forward(..., insert=False)``).

    ``state_dict()`` holds every table gathered whole (collective: every rank
    calls it): ``tables.<name>.weight`` ``[num_rows, dim]`` (a dynamic table: the rows
    of its live ids, ascending, with ``tables.<name>.ids``, ``.last`` and ``.count``,
    their scores, and with ``admit_count > 1`` ``.pending_ids``, ``.pending_last`` and
    ``.pending_count``: the ids waiting for admission, ascending, and their sightings),
    ``tables.<name>.optimizer.<slot>`` for each slot of the collection's
    optimizer (``[num_rows, dim]``, or ``[num_rows]`` for a per-row slot) and
    ``tables.<name>.optimizer.step`` (int64 scalar), so
    ``torch.save(model.state_dict())`` keeps them. ``load_state_dict`` writes
    them into this rank's shards (any plan and world size, no communication);
    tables sharing a fused array share one step counter, set to the largest
    loaded step. With ``strict=True`` missing and unexpected table keys are
    reported as torch reports parameters; a key of the wrong shape is a "size
    mismatch" error and then no table is written.

    Over a quantized collection (:meth:`hbkernels.EmbeddingCollection.quantized`,
    for inference: forward under ``torch.no_grad()`` or ``eval()``) the pooled
    tensors of its quantized tables are float32, a backward raises ``TypeError``,
    ``state_dict()`` holds those tables dequantized (and no optimizer slots of them),
    and ``load_state_dict`` raises ``TypeError``.

    Rules of the collection's one-step context: every ``forward`` (in grad mode)
    is followed by **at most one** backward before the next ``forward``; a
    backward of an older forward, or a second backward of the same forward
    (``retain_graph=True``), raises ``RuntimeError``. A forward without a
    backward (evaluation) is fine. Under several ranks, forward and backward are
    collective: every rank runs them in the same order, and the gradients of all
    ranks are *summed* (torch DDP averages the dense part: scale the loss, or
    the collection's learning rate, to match). ``forward`` is excluded from
    ``torch.compile`` (``torch.compiler.disable``): a compiled model breaks the
    graph around it. ``collection.save`` writes a sharded checkpoint without
    gathering; :meth:`full_weights` reads one table as a tensor.
    """

    def __init__(self, collection):
        super().__init__()
        from ..sharding.collection import EmbeddingCollection

        if not isinstance(collection, EmbeddingCollection):
            raise TypeError(f"collection must be a hbk.EmbeddingCollection, got {type(collection).__name__}")
        self.collection = collection
        self._generation = 0
        self._backward_done = 0
        # under Numba's CUDA simulator a collection on "cuda" takes CPU tensors as its CUDA
        # arrays (SimArray views, no copy): there is no CUDA tensor to give it
        simulated = collection.device == "cuda" and simulator_enabled()
        self._array = _simulated_array if simulated else kernel_array
        device = "cuda" if collection.device == "cuda" and not simulated else "cpu"
        self._anchor = torch.zeros((), device=device, requires_grad=True)

    @torch.compiler.disable
    def forward(self, features, per_sample_weights=None):
        from ..types import Ragged

        if is_keyed_jagged_tensor(features):
            features, weights = kjt_tensors(features)
            per_sample_weights = kjt_weights(weights, per_sample_weights)
        if not isinstance(features, dict):
            raise TypeError(f"features must be a dict name -> (values, offsets) or ids, or a "
                            f"torchrec KeyedJaggedTensor, got {type(features).__name__}")
        if per_sample_weights is not None and not isinstance(per_sample_weights, dict):
            raise TypeError(f"per_sample_weights must be a dict name -> weights or None, got "
                            f"{_type_name(per_sample_weights)}")
        names = list(features)
        arrays, tensors = {}, []
        for f in names:
            x = features[f]
            if isinstance(x, (tuple, list, Ragged)):
                if len(x) != 2:
                    raise ValueError(f"feature {f!r}: expected (values, offsets), got {len(x)} items")
                _require_tensor(f"feature {f!r} values", x[0])
                _require_tensor(f"feature {f!r} offsets", x[1])
                arrays[f] = Ragged(self._array(x[0]), self._array(x[1]))
                tensors += list(x)
            else:
                _require_tensor(f"feature {f!r} ids", x)
                arrays[f] = self._array(x)
                tensors.append(x)
        psws = None
        if per_sample_weights:
            for f, w in per_sample_weights.items():
                _require_tensor(f"per_sample_weights[{f!r}]", w)
            psws = {f: self._array(w) for f, w in per_sample_weights.items()}
            tensors += list(per_sample_weights.values())
        with cuda_stream_of(*tensors):
            if torch.is_grad_enabled():
                outs = _CollectionStep.apply(self._anchor, self, names, arrays, psws)
            else:  # evaluation: no backward will come
                out = self.collection.forward(arrays, per_sample_weights=psws, insert=self.training)
                outs = tuple(from_kernel_array(_rows(out[f])) for f in names)
        return dict(zip(names, outs))

    def full_weights(self, name):
        """Table ``name`` gathered whole as a tensor (a copy; collective)."""
        return from_kernel_array(self.collection.full_weights(name))

    # -- state_dict: the tables, gathered --------------------------------------------------------
    def _table_keys(self):
        """``{state_dict key (without prefix): (table, item)}``, item ``"weight"``, an
        optimizer slot or ``"step"``, in the collection's table order."""
        keys = {}
        for name, spec in self.collection.tables.items():
            if spec.dynamic:
                items = DYNAMIC_ITEMS + (PENDING_ITEMS if spec.admit_count > 1 else ())
                keys.update({f"tables.{name}.{item}": (name, item) for item in items})
            keys[f"tables.{name}.weight"] = (name, "weight")
            for slot, _ in self._slots(name):
                keys[f"tables.{name}.optimizer.{slot}"] = (name, slot)
            keys[f"tables.{name}.optimizer.step"] = (name, "step")
        return keys

    def _slots(self, name):
        """The optimizer slots table ``name`` keeps (none when it is quantized)."""
        return () if name in self.collection.quantize else self.collection.optimizer.slots

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        coll = self.collection
        for name, spec in coll.tables.items():  # collective: every rank gathers every table
            weights = coll.full_weights(name)
            if spec.dynamic:  # rows of the live ids, ascending, and their scores
                scores = dict(zip(DYNAMIC_ITEMS, coll.dynamic_scores(name)))
                pending = coll.dynamic_pending(name)
                if pending is not None:
                    scores.update(zip(PENDING_ITEMS, pending))
                for item, value in scores.items():
                    destination[f"{prefix}tables.{name}.{item}"] = torch.from_numpy(value)
                weights = weights[1]
            destination[f"{prefix}tables.{name}.weight"] = from_kernel_array(weights)
            state = coll.full_state(name)
            for slot, _ in self._slots(name):
                destination[f"{prefix}tables.{name}.optimizer.{slot}"] = from_kernel_array(state[slot])
            destination[f"{prefix}tables.{name}.optimizer.step"] = torch.tensor(state["step"],
                                                                               dtype=torch.int64)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        ours = f"{prefix}tables."
        if self.collection.quantize:
            raise TypeError(f"tables {sorted(self.collection.quantize)} are quantized (an "
                            f"inference collection): load the float state into a float collection, "
                            f"then call its .quantized(bits)")
        super()._load_from_state_dict(
            {k: v for k, v in state_dict.items() if not k.startswith(ours)}, prefix,
            local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        coll = self.collection
        expected = {prefix + k: item for k, item in self._table_keys().items()}
        unexpected_keys += [k for k in state_dict if k.startswith(ours) and k not in expected]
        found, errors = {}, []  # table -> {item: tensor}
        for key, (name, item) in expected.items():
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            rows = coll.tables[name].num_rows
            if coll.tables[name].dynamic:  # as many rows as the saved table had live ids
                rows = _saved_length(state_dict.get(f"{ours}{name}.ids"))
            if item == "step":
                shape = ()
            elif item in DYNAMIC_ITEMS:
                shape = (rows,)
            elif item in PENDING_ITEMS:  # as many as the saved table had ids waiting
                shape = (_saved_length(state_dict.get(f"{ours}{name}.pending_ids")),)
            elif item == "weight" or not dict(coll.optimizer.slots)[item]:
                shape = (rows, coll.tables[name].dim)
            else:  # one state value per row
                shape = (rows,)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                errors.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(getattr(value, 'shape', ()))} from checkpoint, the shape "
                                  f"in current model is {shape}.")
                continue
            found.setdefault(name, {})[item] = value
        if errors:  # nothing of the tables is written
            error_msgs += errors
            return
        steps = {}  # fused array -> step of its loaded tables
        for name, items in found.items():
            if coll.tables[name].dynamic:
                if any(k not in items for k in DYNAMIC_ITEMS + ("weight", "step")):
                    continue
                host = {k: v.detach().cpu().numpy() for k, v in items.items() if k != "step"}
                pending = (tuple(host[k] for k in PENDING_ITEMS)
                           if all(k in host for k in PENDING_ITEMS) else None)
                coll.restore_dynamic(name, host["ids"], host["last"], host["count"],
                                     {("weights" if k == "weight" else k): v for k, v in host.items()
                                      if k not in DYNAMIC_ITEMS + PENDING_ITEMS}, pending)
                group = next(s.group for s in coll.local_shards() if s.table == name)
                steps[group] = max(steps.get(group, 0), int(items["step"]))
                continue
            for shard in coll.local_shards():
                if shard.table != name:
                    continue
                arrays = coll.shard_arrays(shard)
                for item, value in items.items():
                    if item == "step":
                        steps[shard.group] = max(steps.get(shard.group, 0), int(value))
                        continue
                    _write_shard_rows(arrays["weights" if item == "weight" else item], shard, value)
        for group, step in steps.items():
            coll.arrays[group].state["step"][0] = step
        if found:
            coll.rows_written_elsewhere()

    def extra_repr(self):
        return f"tables={sorted(self.collection.tables)}, device={self.collection.device}"
