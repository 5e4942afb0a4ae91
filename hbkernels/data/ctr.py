"""Click-through-rate batches for training: one label, dense features and
categorical id features per sample, from synthetic data made on the fly or
from Parquet.

A :class:`ClickBatch` holds ``label`` (float32 ``[n]``), ``dense`` (float32
``[n, K]``) and ``sparse`` (``{feature: ids}``: int64 ``[n]`` for one id per
sample, :class:`hbkernels.Ragged` for bags).

:class:`SyntheticClicks` draws global batch ``index`` of a stream from a seeded
generator (``(seed, stream, index)``), so any rank can cut its slice of the
same global batch and a run resumes at any step. Ids are bounded Zipf(alpha)
per table (:class:`hbkernels.data.synthetic.ZipfIds`); labels follow a planted
logistic model, so a model can learn them::

    logit = dense @ v + sum_t mean(h_t[ids of t]) - 1,    label ~ Bernoulli(sigmoid(logit))

with ``v ~ N(0, 0.25 / K)`` and ``h_t ~ N(0, 2 / T)`` per row, drawn from the seed.

:class:`ParquetClicks` reads a rank's batches of a Parquet data set through
:class:`hbkernels.data.ParquetDataset`: a label column, float columns as dense
features (nulls and NaN 0, then ``log1p(max(x, 0))`` as DLRM does for Criteo) and
integer, string or list columns as ids taken modulo ``num_rows`` (the hashing
trick: hashed Criteo ids are 63-bit), or as they are with ``num_rows=None`` (for
dynamic tables).

>>> from hbkernels.data.synthetic import SyntheticTable
>>> clicks = SyntheticClicks([SyntheticTable("user", 1000), SyntheticTable("hist", 500, 4, True)],
...                         num_dense=3, seed=0)
>>> batch = clicks.batch(index=0, size=8)
>>> batch.dense.shape, batch.sparse["user"].shape, batch.sparse["hist"].offsets.shape
((8, 3), (8,), (9,))
>>> half = batch.rows(4, 8)              # rank 1 of 2
>>> bool((half.label == batch.label[4:]).all()), len(half.sparse["hist"].offsets)
(True, 5)
"""
import math
from typing import NamedTuple

import numpy as np

from ..errors import DataError
from ..types import Ragged
from .synthetic import SyntheticTable, ZipfIds

TRAIN, EVAL = 0, 1
"""Streams of :meth:`SyntheticClicks.batch`: the training batches and the held-out set."""


class ClickBatch(NamedTuple):
    label: np.ndarray
    dense: np.ndarray
    sparse: dict

    def __len__(self):
        return int(self.label.shape[0])

    def rows(self, lo, hi):
        """Samples ``[lo, hi)`` (a rank's slice of a global batch)."""
        sparse = {}
        for name, ids in self.sparse.items():
            if isinstance(ids, Ragged):
                a, b = int(ids.offsets[lo]), int(ids.offsets[hi])
                sparse[name] = Ragged(ids.values[a:b], ids.offsets[lo:hi + 1] - a)
            else:
                sparse[name] = ids[lo:hi]
        return ClickBatch(self.label[lo:hi], self.dense[lo:hi], sparse)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class SyntheticClicks:
    """Global batches of synthetic clicks (law in the module docstring)."""

    def __init__(self, tables, num_dense=13, *, alpha=1.05, seed=0):
        self.tables = [t if isinstance(t, SyntheticTable) else SyntheticTable(*t) for t in tables]
        if not self.tables:
            raise ValueError("synthetic clicks need at least one table")
        self.num_dense = int(num_dense)
        self.seed = int(seed)
        rng = np.random.default_rng([self.seed, 0])
        self.samplers = [ZipfIds(t.num_rows, alpha, rng) for t in self.tables]
        scale = math.sqrt(2.0 / len(self.tables))
        self.row_effect = [(scale * rng.standard_normal(t.num_rows)).astype(np.float32)
                           for t in self.tables]
        for sampler, effect in zip(self.samplers, self.row_effect):
            sampler.set_effect(effect)
        self.dense_effect = rng.standard_normal(self.num_dense) * math.sqrt(0.25 / max(self.num_dense, 1))

    @property
    def features(self):
        return [t.name for t in self.tables]

    def batches(self, indices, size, stream=TRAIN, *, threads=0):
        """``batch(index, size, stream)`` for each of ``indices``, in order. With
        ``threads`` > 0 they are made on that many threads, up to ``2 * threads`` ahead of
        the one yielded: the same batches, bit for bit (each is a function of its index),
        made while the caller works on the last one (the id sampler and NumPy's random
        generators release the GIL). Closing the generator early cancels what is ahead."""
        if threads < 0:
            raise ValueError(f"threads must be >= 0, got {threads}")
        if threads == 0:
            for index in indices:
                yield self.batch(index, size, stream)
            return
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        todo, ahead = iter(indices), deque()
        with ThreadPoolExecutor(threads, thread_name_prefix="hbkernels-batches") as pool:
            try:
                while True:
                    while len(ahead) < 2 * threads:
                        index = next(todo, None)
                        if index is None:
                            break
                        ahead.append(pool.submit(self.batch, index, size, stream))
                    if not ahead:
                        return
                    yield ahead.popleft().result()
            finally:
                for future in ahead:
                    future.cancel()

    def batch(self, index, size, stream=TRAIN):
        """Global batch ``index`` of ``stream`` (``TRAIN`` or ``EVAL``), ``size`` samples."""
        rng = np.random.default_rng([self.seed, 1 + stream, index])
        dense = rng.standard_normal((size, self.num_dense)).astype(np.float32)
        logit = dense.astype(np.float64) @ self.dense_effect - 1.0
        sparse = {}
        for t, sampler in zip(self.tables, self.samplers):
            if t.hotness == 1 and not t.variable:
                ids, effects = sampler.rows(rng.random(size))
                logit += effects
                sparse[t.name] = ids
                continue
            lengths = (rng.integers(1, 2 * t.hotness, size) if t.variable
                       else np.full(size, t.hotness))
            offsets = np.zeros(size + 1, np.int64)
            np.cumsum(lengths, out=offsets[1:])
            values, effects = sampler.rows(rng.random(int(offsets[-1])))
            if size:
                logit += np.add.reduceat(effects, offsets[:-1]) / lengths
            sparse[t.name] = Ragged(values, offsets)
        label = (rng.random(size) < sigmoid(logit)).astype(np.float32)
        return ClickBatch(label, dense, sparse)


def _kind(pa, t):
    """'dense', 'sparse' or None for one Arrow column type (dictionary-encoded: its values')."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        v = t.value_type
        return "sparse" if pa.types.is_integer(v) or pa.types.is_string(v) or pa.types.is_large_string(v) else None
    if pa.types.is_floating(t):
        return "dense"
    if pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t):
        return "sparse"
    return None


class ParquetClicks:
    """A rank's :class:`ClickBatch` es of Parquet files (see the module docstring).

    ``dense`` / ``sparse``: column names, or None for every float column /
    every integer, string or list column other than ``label``. A named column
    that does not exist, or has no usable type, raises ``ValueError`` listing
    the columns there are. Each ``iter()`` is one epoch of ``len(self)``
    batches (the same on every rank: ranks short of batches get empty ones).
    """

    def __init__(self, paths, batch_size, *, num_rows, label="label", dense=None, sparse=None,
                 rank=0, world_size=1, shuffle_buffer=0, seed=0):
        from ._io import close_parquet, open_parquet, parquet_files, require_pyarrow
        from .parquet import ParquetDataset

        pa, _, pq = require_pyarrow()
        first = parquet_files(paths)[0]
        handle = open_parquet(pq, first)
        schema = handle.schema_arrow   # the dataset checks that the other files agree
        close_parquet(handle)
        kinds = {f.name: _kind(pa, f.type) for f in schema}
        listing = ", ".join(f"{f.name} ({f.type})" for f in schema)
        if label not in kinds:
            raise DataError(f"no label column {label!r} in {first}; columns: {listing}")
        self.label = label
        self.dense = self._columns(dense, "dense", kinds, listing)
        self.sparse = self._columns(sparse, "sparse", kinds, listing)
        if not self.sparse:
            raise DataError(f"no categorical (integer, string or list) columns in "
                             f"{first}; columns: {listing}")
        self.num_rows = None if num_rows is None else int(num_rows)
        strings = {c for c in self.sparse if "string" in str(schema.field(c).type)}
        fill = {c: 0.0 for c in self.dense}
        fill.update({c: ("" if c in strings else 0) for c in self.sparse})
        self.dataset = ParquetDataset(
            paths, batch_size, columns=[label, *self.dense, *self.sparse], rank=rank,
            world_size=world_size, shuffle_buffer=shuffle_buffer, seed=seed, fill_null=fill,
            num_buckets=self.num_rows if strings else None, equal_batches=True)

    def _columns(self, names, kind, kinds, listing):
        if names is None:
            return [c for c, k in kinds.items() if k == kind and c != self.label]
        for c in names:
            if c not in kinds:
                raise DataError(f"no column {c!r}; columns: {listing}")
            if kinds[c] != kind:
                raise DataError(f"column {c!r} cannot be a {kind} feature; columns: {listing}")
        return list(names)

    def _bucket(self, ids):
        """``ids % num_rows`` as int64, exact for unsigned ids too; the ids themselves
        as int64 (unsigned ones wrapped) with ``num_rows=None``."""
        if self.num_rows is None:
            return ids.astype(np.int64) if ids.dtype.kind != "u" else ids.astype(np.uint64).view(np.int64)
        if ids.dtype.kind == "u":
            return (ids.astype(np.uint64) % np.uint64(self.num_rows)).astype(np.int64)
        return ids.astype(np.int64) % self.num_rows

    @property
    def features(self):
        return list(self.sparse)

    def __len__(self):
        return len(self.dataset)

    def set_epoch(self, epoch):
        self.dataset.set_epoch(epoch)

    def __iter__(self):
        for b in self.dataset:
            n = len(b[self.label])
            dense = np.empty((n, len(self.dense)), np.float32)
            for j, c in enumerate(self.dense):   # NaN counts as missing, like a null
                dense[:, j] = np.log1p(np.maximum(np.nan_to_num(b[c], nan=0.0), 0))
            sparse = {}
            for c in self.sparse:
                ids = b[c]
                if isinstance(ids, Ragged):
                    sparse[c] = Ragged(self._bucket(ids.values), ids.offsets.copy())
                else:
                    sparse[c] = self._bucket(ids)
            yield ClickBatch(np.array(b[self.label], np.float32), dense, sparse)
