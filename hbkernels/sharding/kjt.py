"""TorchRec ``KeyedJaggedTensor`` input, read without importing torch or TorchRec
(an object can only be a KJT when TorchRec is already loaded): the tensors cross
into NumPy or CuPy through DLPack, sharing their memory."""
import sys

import numpy as np

from .._machine import cupy
from ..types import Ragged


def is_keyed_jagged_tensor(x):
    """Whether ``x`` is a TorchRec ``KeyedJaggedTensor`` (never imports TorchRec: an
    object can only be one when TorchRec is already loaded)."""
    module = sys.modules.get("torchrec.sparse.jagged_tensor")
    return module is not None and isinstance(x, module.KeyedJaggedTensor)


def kjt_tensors(kjt):
    """``({key: (values, offsets)}, {key: weights} or None)`` tensors of ``kjt``:
    ``values``/``weights`` are slices of ``kjt.values()``/``kjt.weights()`` (views),
    ``offsets`` the key's ``B_k + 1`` bag offsets rebased to 0 (dtype of ``kjt.offsets()``)."""
    if not is_keyed_jagged_tensor(kjt):
        raise TypeError(f"expected a torchrec KeyedJaggedTensor, got {type(kjt).__name__}")
    keys = list(kjt.keys())
    values, offsets, weights = kjt.values(), kjt.offsets(), kjt.weights_or_none()
    strides = kjt.stride_per_key() if kjt.variable_stride_per_key() else [kjt.stride()] * len(keys)
    per_key = kjt.offset_per_key()
    features, psw, first = {}, ({} if weights is not None else None), 0
    for k, key in enumerate(keys):
        lo, hi, batch = int(per_key[k]), int(per_key[k + 1]), int(strides[k])
        bags = offsets[first:first + batch + 1]
        features[key] = (values[lo:hi], bags - lo if lo else bags)
        if weights is not None:
            psw[key] = weights[lo:hi]
        first += batch
    return features, psw


def kjt_weights(weights, per_sample_weights):
    """The per-sample weights of a call given a KJT: its own, or the caller's; not both."""
    if weights is None:
        return per_sample_weights
    if per_sample_weights:
        raise ValueError("the KeyedJaggedTensor has weights: per_sample_weights must be None")
    return weights


def dlpack_array(t):
    """A NumPy (CPU) or CuPy (CUDA) view of tensor ``t`` through DLPack (detached and
    made contiguous first where needed); ``None`` stays ``None``."""
    if t is None:
        return None
    if getattr(t, "requires_grad", False):
        t = t.detach()
    if hasattr(t, "is_contiguous") and not t.is_contiguous():
        t = t.contiguous()
    device_type, _ = t.__dlpack_device__()
    return np.from_dlpack(t) if int(device_type) == 1 else cupy().from_dlpack(t)  # 1: kDLCPU


def features_from_kjt(kjt, per_sample_weights=None, *, to_array=dlpack_array):
    """``({key: hbk.Ragged(values, offsets)}, {key: weights} or None)`` of ``kjt``, its
    tensors as ``to_array`` makes them arrays; the weights ``kjt.weights_or_none()``
    or else ``per_sample_weights`` (ValueError when both are given)."""
    tensors, weights = kjt_tensors(kjt)
    features = {key: Ragged(to_array(v), to_array(o)) for key, (v, o) in tensors.items()}
    psw = None if weights is None else {key: to_array(w) for key, w in weights.items()}
    return features, kjt_weights(psw, per_sample_weights)
