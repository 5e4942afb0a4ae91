"""The anchors as benchmark peers: FBGEMM's table-batched embedding (TBE) on the CPU.

TBE is ``fbgemm_gpu``'s ``SplitTableBatchedEmbeddingBagsCodegen`` with one
table on the host (``EmbeddingLocation.HOST``, ``ComputeDevice.CPU``), as
TorchRec builds it for a CPU table. Install recipe (the CPU build of FBGEMM,
which torchrec's own dependency replaces with a CUDA build)::

    pip install torchrec==1.8.0 torch==2.13.0
    pip uninstall -y fbgemm_gpu && pip install --no-deps --force-reinstall fbgemm-gpu-cpu==1.8.0

The rules that TBE runs on the CPU are ``EXACT_SGD``, ``EXACT_ADAGRAD`` and
``EXACT_ROWWISE_ADAGRAD`` (its CPU build refuses Adam); :data:`TBE_RULES`
names hbkernels' optimizer for each, with the same hyper-parameters.
"""
import warnings

from .common import optional_module

# hbkernels optimizer class name -> TBE's EmbOptimType member
TBE_RULES = {"SGD": "EXACT_SGD", "Adagrad": "EXACT_ADAGRAD", "RowWiseAdagrad": "EXACT_ROWWISE_ADAGRAD"}


def _fbgemm(kind):
    """``(torch, fbgemm_gpu's split_table_batched_embeddings_ops_<kind>, ..._common,
    split_embedding_configs)`` when they import (and ``HBK_BENCH_NO`` does not name
    fbgemm_gpu), else None."""
    torch = optional_module("torch")
    if torch is None or optional_module("fbgemm_gpu") is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modules = [optional_module(f"fbgemm_gpu.{name}") for name in (
            f"split_table_batched_embeddings_ops_{kind}",
            "split_table_batched_embeddings_ops_common", "split_embedding_configs")]
    return None if None in modules else (torch, *modules)


def fbgemm_tbe():
    """``(torch, the TBE class, EmbeddingLocation, ComputeDevice, PoolingMode, EmbOptimType)``
    when FBGEMM's TBE imports (and is not disabled by ``HBK_BENCH_NO=fbgemm_gpu``), else None."""
    found = _fbgemm("training")
    if found is None:
        return None
    torch, training, common, configs = found
    return (torch, training.SplitTableBatchedEmbeddingBagsCodegen, common.EmbeddingLocation,
            training.ComputeDevice, common.PoolingMode, configs.EmbOptimType)


def tbe_table(weights, *, combiner="sum", rule="EXACT_SGD", lr=0.01, eps=1e-8):
    """A one-table TBE on the CPU holding a copy of ``weights`` (float32 ``[E, D]``),
    pooling by ``combiner`` and training with the ``rule`` (an ``EmbOptimType``
    name). None when TBE is not installed."""
    found = fbgemm_tbe()
    if found is None:
        return None
    torch, TBE, Location, Compute, Pooling, Optim = found
    num_rows, dim = weights.shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tbe = TBE([(num_rows, dim, Location.HOST, Compute.CPU)],
                  optimizer=getattr(Optim, rule), learning_rate=lr, eps=eps,
                  pooling_mode=getattr(Pooling, combiner.upper()))
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(torch.from_numpy(weights))
    return tbe


def tbe_weights(tbe):
    """TBE's table as a NumPy view (float32 ``[E, D]``)."""
    return tbe.split_embedding_weights()[0].detach().numpy()


SPARSE_TYPES = {8: "INT8", 4: "INT4", 2: "INT2"}  # bits -> FBGEMM's SparseType member


def fbgemm_intn():
    """``(torch, IntNBitTableBatchedEmbeddingBagsCodegen, EmbeddingLocation, PoolingMode,
    SparseType)`` when FBGEMM's int-N inference TBE imports, else None."""
    found = _fbgemm("inference")
    if found is None:
        return None
    torch, inference, common, configs = found
    return (torch, inference.IntNBitTableBatchedEmbeddingBagsCodegen, common.EmbeddingLocation,
            common.PoolingMode, configs.SparseType)


def tbe_quantized_table(q, *, combiner="sum"):
    """A one-table int-N TBE on the CPU (float32 output) holding the codes, scales and
    biases of ``q`` (a NumPy :class:`hbkernels.QuantizedTable`): FBGEMM's layout is the
    same (codes low bits first; float16 scale, then bias, per row). None when FBGEMM's
    int-N TBE is not installed."""
    import numpy as np

    found = fbgemm_intn()
    if found is None:
        return None
    torch, TBE, Location, Pooling, Sparse = found
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tbe = TBE(embedding_specs=[("table", q.num_rows, q.dim, getattr(Sparse, SPARSE_TYPES[q.bits]),
                                    Location.HOST)],
                  device="cpu", pooling_mode=getattr(Pooling, combiner.upper()),
                  output_dtype=Sparse.FP32)
        tbe.fill_random_weights()  # allocates the table
    codes, scale_bias = tbe.split_embedding_weights()[0]
    with torch.no_grad():
        codes.copy_(torch.from_numpy(q.codes))
        scale_bias.copy_(torch.from_numpy(np.stack([q.scale, q.bias], axis=1).view(np.uint8)))
    return tbe
