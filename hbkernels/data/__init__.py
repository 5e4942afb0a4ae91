"""Data: Parquet loading of ragged categorical data, converters of public CTR
datasets to Parquet, and synthetic data (pyarrow, imported on first use).

* :class:`ParquetDataset` iterates batches (scalar columns as 1-D arrays, list
  columns as :class:`hbkernels.Ragged`), split across ranks by row range.
* :func:`hash_strings`: the stable string -> int64 id hash of categorical columns.
* :func:`convert_criteo`, :func:`convert_avazu`, :func:`convert_movielens`:
  text files to Parquet (also ``python -m hbkernels.data convert ...``).
* :func:`write_synthetic`: Zipf-distributed multi-table data as Parquet.
* :class:`SyntheticClicks`, :class:`ParquetClicks`: CTR training batches
  (:class:`ClickBatch`: label, dense, sparse), made on the fly or read from
  Parquet (:mod:`hbkernels.data.ctr`; what ``hbkernels train`` reads).
"""
from .ctr import ClickBatch, ParquetClicks, SyntheticClicks
from .convert import convert_avazu, convert_criteo, convert_movielens
from .hashing import hash_strings
from .parquet import ParquetDataset
from .synthetic import write_synthetic

__all__ = ["ClickBatch", "ParquetClicks", "ParquetDataset", "SyntheticClicks", "convert_avazu", "convert_criteo", "convert_movielens",
           "hash_strings", "write_synthetic"]
