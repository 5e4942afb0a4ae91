"""hbkernels: framework-agnostic embedding kernels for recommender systems.

NumPy arrays run on the CPU (Numba), CUDA arrays (CuPy, Numba, anything with
``__cuda_array_interface__`` or a CUDA ``__dlpack__``) run on the GPU (Numba
CUDA); results come back in the caller's array family.

>>> import numpy as np, hbkernels as hbk
>>> hbk.embedding_bag(np.eye(3, dtype=np.float32), np.array([0, 2]), np.array([0, 2])).tolist()
[[1.0, 0.0, 1.0]]
"""
from . import data, dist, optim, reference, threads
from .sharding import EmbeddingCollection
from .errors import BoundsError, CapacityError, CheckpointError
from .hash_table import HashTable
from .memory import aligned_empty, aligned_full
from .quantize import QuantizedTable, quantize_rows
from .ops import (
    embedding_bag, embedding_bag_backward, lookup, lookup_backward, partition,
    per_sample_weights_backward, segment_reduce, segment_sum, synchronize, unique,
)
from .types import JaggedRows, Partitioned, Ragged, SparseGrad, TableSpec
from ._version import __version__

__all__ = [
    "BoundsError",
    "CapacityError",
    "CheckpointError",
    "EmbeddingCollection",
    "HashTable",
    "JaggedRows",
    "Partitioned",
    "QuantizedTable",
    "Ragged",
    "SparseGrad",
    "TableSpec",
    "aligned_empty",
    "aligned_full",
    "data",
    "dist",
    "embedding_bag",
    "embedding_bag_backward",
    "lookup",
    "lookup_backward",
    "optim",
    "partition",
    "per_sample_weights_backward",
    "quantize_rows",
    "reference",
    "segment_reduce",
    "segment_sum",
    "synchronize",
    "threads",
    "unique",
]
