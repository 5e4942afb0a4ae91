"""Batches of ragged categorical data from Parquet files (pyarrow, imported on use)."""
import queue
import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from ..errors import DataError
from ..types import Ragged
from ._io import close_parquet, open_parquet, parquet_files, read_row_group, require_pyarrow

class _Column(NamedTuple):
    name: str
    is_list: bool
    leaf: str          # "int" | "float" | "bool" | "string"
    leaf_dtype: str    # numpy dtype name of the leaf values ("int64" for hashed strings)
    signature: str     # what must agree across files


class _Piece(NamedTuple):
    file: int          # index into ds.files
    row_group: int
    start: int         # first row, within the row group
    stop: int          # one past the last row, within the row group
    file_row: int      # row index within the file of the row group's first row


def _leaf_kind(pa, t):
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_boolean(t):
        return "bool", t
    if pa.types.is_integer(t):
        return "int", t
    if pa.types.is_floating(t):
        return "float", t
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string", t
    return None, t


def _describe_column(pa, name, t, path):
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
    leaf_t = t.value_type if is_list else t
    kind, leaf_t = _leaf_kind(pa, leaf_t)
    if kind is None:
        raise DataError(f"column {name!r} of {path} has type {t}, which ParquetDataset does not "
                         "read (expected integer, float, bool or string, or a list of integers, "
                         "floats or strings)")
    if is_list and kind == "bool":
        raise DataError(f"column {name!r} of {path} has type {t}: lists of bool are not supported")
    dtype = "int64" if kind == "string" else np.dtype(leaf_t.to_pandas_dtype()).name
    leaf = "string" if kind == "string" else dtype
    signature = f"list<{leaf}>" if is_list else leaf
    return _Column(name, is_list, kind, dtype, signature)


# -- row chunks: dict column -> 1-D ndarray or Ragged (int64 offsets from 0) --------

def _rows(chunk):
    for v in chunk.values():
        return v.batch_size if isinstance(v, Ragged) else v.shape[0]
    return 0


def _slice(chunk, a, b):
    out = {}
    for k, v in chunk.items():
        if isinstance(v, Ragged):
            offs = v.offsets[a:b + 1]
            s = int(offs[0])
            out[k] = Ragged(v.values[s:int(offs[-1])], offs - s if s else offs)
        else:
            out[k] = v[a:b]
    return out


def _concat(chunks):
    if len(chunks) == 1:
        return chunks[0]
    out = {}
    for k, first in chunks[0].items():
        if isinstance(first, Ragged):
            parts = [c[k] for c in chunks]
            values = np.concatenate([r.values for r in parts])
            offsets = np.empty(sum(r.batch_size for r in parts) + 1, np.int64)
            offsets[0] = 0
            pos, base = 1, 0
            for r in parts:
                n = r.batch_size
                np.add(r.offsets[1:], base, out=offsets[pos:pos + n])
                pos += n
                base += int(r.offsets[-1])
            out[k] = Ragged(values, offsets)
        else:
            out[k] = np.concatenate([c[k] for c in chunks])
    return out


def _take(chunk, idx):
    """Rows ``idx`` of ``chunk``: one vectorised gather per column."""
    out = {}
    for k, v in chunk.items():
        if isinstance(v, Ragged):
            offs = v.offsets
            starts = offs[idx]
            lengths = offs[idx + 1] - starts
            new = np.empty(idx.shape[0] + 1, np.int64)
            new[0] = 0
            np.cumsum(lengths, out=new[1:])
            gather = np.repeat(starts - new[:-1], lengths) + np.arange(new[-1], dtype=np.int64)
            out[k] = Ragged(v.values[gather], new)
        else:
            out[k] = v[idx]
    return out


def _readonly(chunk):
    """Marks every array read-only (zero-copy ones already are), so that every batch has the
    same array flags and a Numba kernel compiles once for them."""
    for v in chunk.values():
        for a in (v if isinstance(v, Ragged) else (v,)):
            if a.flags.writeable:
                a.flags.writeable = False
    return chunk


def _rebatch(chunks, batch_size):
    """Re-cuts a stream of row chunks into batches of exactly ``batch_size`` rows (the
    last possibly fewer); a batch inside one chunk is a zero-copy slice of it."""
    pending, have = [], 0
    for chunk in chunks:
        n = _rows(chunk)
        if n == 0:
            continue
        pending.append(chunk)
        have += n
        while have >= batch_size:
            parts, need = [], batch_size
            while need:
                c = pending[0]
                m = _rows(c)
                if m <= need:
                    parts.append(pending.pop(0))
                    need -= m
                else:
                    parts.append(_slice(c, 0, need))
                    pending[0] = _slice(c, need, m)
                    need = 0
            have -= batch_size
            yield _concat(parts)
    if have:
        yield _concat(pending)


def _shuffled_batches(chunks, batch_size, window, rng):
    """Windowed shuffle: fill a window of ``window`` rows (the leftover of the last one
    first), permute it with one ``take``, emit its full batches, carry the rest over."""
    pending, have = [], 0
    for chunk in chunks:
        n, pos = _rows(chunk), 0
        while pos < n:
            m = min(n - pos, window - have)
            pending.append(chunk if (pos == 0 and m == n) else _slice(chunk, pos, pos + m))
            have += m
            pos += m
            if have == window:
                win = _take(_concat(pending), rng.permutation(have))
                full = have - have % batch_size
                for a in range(0, full, batch_size):
                    yield _slice(win, a, a + batch_size)
                pending = [_slice(win, full, have)] if full < have else []
                have -= full
    if have:
        win = _take(_concat(pending), rng.permutation(have))
        for a in range(0, have, batch_size):
            yield _slice(win, a, min(a + batch_size, have))


_STOP = object()


def _prefetched(source, depth, name):
    """Runs the generator ``source`` in a daemon thread feeding a queue of ``depth`` items.
    Exceptions re-raise in the consumer; closing the consumer (a ``break`` out of the
    loop) stops and joins the thread."""
    q = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item):
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for item in source:
                if not put((True, item)):
                    return
            put((True, _STOP))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put((False, e))
        finally:
            source.close()

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    try:
        while True:
            ok, item = q.get()
            if not ok:
                raise item
            if item is _STOP:
                return
            yield item
    finally:
        stop.set()
        try:
            while True:
                q.get_nowait()
        except queue.Empty:
            pass
        thread.join(timeout=30)


class ParquetDataset:
    """Batches of a Parquet data set, split across ranks by row range.

    Iterating yields one dict per batch: scalar columns (integer, float, bool)
    as 1-D NumPy arrays, ``list<int>`` / ``list<float>`` columns (also
    ``large_list``) as :class:`hbkernels.Ragged` (``offsets`` int64 from 0),
    taken from the Arrow buffers without per-row Python. String columns (and the
    elements of ``list<string>`` columns) come as int64 ids of
    :func:`hbkernels.data.hash_strings`, modulo ``num_buckets`` (an int for all
    string columns or a dict per column). Arrays may share memory with Arrow
    buffers, so every array is read-only.

    ``paths`` is a file, a directory (its ``*.parquet`` files, sorted) or a list
    of them; rows are numbered over the files in that order. Construction reads
    only the Parquet footers (``ds.files``, ``ds.columns``, ``ds.total_rows``,
    ``ds.rows_per_rank``, ``ds.num_rows`` of this rank). Each ``iter()`` is one
    epoch (``ds.epoch`` is the next one; ``set_epoch`` sets it).

    * **Ranks**: with ``T`` rows in all, rank ``r`` of ``world_size`` ``W`` reads
      rows ``[r*T//W, (r+1)*T//W)``, so every row is read exactly once per epoch
      and ranks' row counts differ by at most one. Only the row groups that
      overlap that range are read, one at a time.
    * **Batches** are re-cut across row-group and file boundaries: each has
      exactly ``batch_size`` rows except possibly the last of the rank; none is
      empty and there are no padding rows. ``drop_remainder=True`` drops the
      last partial batch. ``ds.num_batches`` (also ``len(ds)``) is this rank's
      count per epoch, ``ds.batches_per_rank`` every rank's, both from metadata
      alone (the same on every rank, no communication). These may differ by one
      between ranks; with ``equal_batches=True`` a rank with fewer batches
      than the most yields *empty* batches (0 rows: length-0 arrays, ``Ragged``
      with ``offsets == [0]``) at the end, so that all ranks take the same number
      of steps -- the one exception to "none is empty", for jobs whose every
      step is collective (:class:`hbkernels.EmbeddingCollection` accepts empty
      local batches).
    * **Shuffle**: ``shuffle_buffer=S`` rows (0: off) shuffles the order of the
      rank's row groups, then rows within windows of ``max(S, batch_size)``
      rows (the previous window's leftover carried over); a permutation of the
      rank's rows that depends only on ``(seed, epoch, rank)``. Without it a
      rank sees its rows in file order.
    * **Nulls** raise :class:`hbkernels.errors.DataError` (a ``ValueError``) naming
      the column, file and row (within the file) unless ``fill_null={column: value}``
      gives a value (in the column's own type; a string for string columns): null scalars and null list
      elements become ``value``, null lists become empty lists.
    * ``prefetch`` batches are prepared by a background thread (0: none); its
      errors re-raise in the loop, and leaving the loop early stops it.
    * ``device="cuda"`` yields CuPy arrays, copied through pinned host memory.

    >>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
    >>> from hbkernels.data import ParquetDataset
    >>> tmp = tempfile.TemporaryDirectory()
    >>> path = os.path.join(tmp.name, "part-0.parquet")
    >>> pq.write_table(pa.table({"label": [1.0, 0.0, 1.0], "ids": [[3, 1], [], [4]]}), path)
    >>> ds = ParquetDataset(path, batch_size=2)
    >>> for batch in ds:
    ...     print(batch["label"].tolist(), batch["ids"].values.tolist(), batch["ids"].offsets.tolist())
    [1.0, 0.0] [3, 1] [0, 2, 2]
    [1.0] [4] [0, 1]
    >>> ParquetDataset(path, batch_size=2, rank=1, world_size=2).batches_per_rank
    (1, 1)
    >>> tmp.cleanup()
    """

    def __init__(self, paths, batch_size, *, columns=None, rank=0, world_size=1, shuffle_buffer=0,
                 seed=0, drop_remainder=False, fill_null=None, num_buckets=None,
                 equal_batches=False, prefetch=2, device="cpu"):
        pa, _, pq = require_pyarrow()
        if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if int(world_size) != world_size or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if int(rank) != rank or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
        if int(shuffle_buffer) != shuffle_buffer or shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be an integer >= 0, got {shuffle_buffer!r}")
        if int(prefetch) != prefetch or prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0, got {prefetch!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.batch_size = int(batch_size)
        self.rank, self.world_size = int(rank), int(world_size)
        self.shuffle_buffer = int(shuffle_buffer)
        self.seed = int(seed)
        self.drop_remainder = bool(drop_remainder)
        self.equal_batches = bool(equal_batches)
        self.prefetch = int(prefetch)
        self.device = device
        self.epoch = 0

        self.files = tuple(parquet_files(paths))
        schemas, row_groups = [], []
        for path in self.files:
            pf = open_parquet(pq, path)
            try:
                md = pf.metadata
                schemas.append(pf.schema_arrow)
                row_groups.append([md.row_group(i).num_rows for i in range(md.num_row_groups)])
            except Exception as e:
                raise DataError(f"cannot read Parquet metadata of {path}: {e}") from e
            finally:
                close_parquet(pf)

        if columns is None:
            columns = list(schemas[0].names)
        elif isinstance(columns, str):
            columns = [columns]
        columns = list(columns)
        if not columns or len(set(columns)) != len(columns):
            raise ValueError(f"columns must be distinct names, at least one, got {columns!r}")
        self._columns = []
        for name in columns:
            first = None
            for path, schema in zip(self.files, schemas):
                idx = schema.get_field_index(name)
                if idx < 0:
                    raise DataError(f"column {name!r} is not in {path} "
                                     f"(it has {', '.join(schema.names) or 'no columns'})")
                col = _describe_column(pa, name, schema.field(idx).type, path)
                if first is None:
                    first = (col, path)
                elif col.signature != first[0].signature:
                    raise DataError(f"files have different schemas: column {name!r} is "
                                     f"{first[0].signature} in {first[1]} but {col.signature} in {path}")
            self._columns.append(first[0])
        self.columns = tuple(c.name for c in self._columns)

        by_name = {c.name: c for c in self._columns}
        strings = [c.name for c in self._columns if c.leaf == "string"]
        if isinstance(num_buckets, dict):
            for k in num_buckets:
                if k not in by_name or by_name[k].leaf != "string":
                    raise ValueError(f"num_buckets names {k!r}, which is not a string column "
                                     f"(string columns: {strings})")
            self._buckets = {k: num_buckets.get(k) for k in strings}
        else:
            self._buckets = {k: num_buckets for k in strings}
        for k, nb in self._buckets.items():
            if nb is not None and (isinstance(nb, bool) or int(nb) != nb or nb < 1):
                raise ValueError(f"num_buckets for {k!r} must be an integer >= 1, got {nb!r}")

        self._fill = {}
        for k, value in (fill_null or {}).items():
            if k not in by_name:
                raise ValueError(f"fill_null names {k!r}, which is not a requested column {self.columns}")
            col = by_name[k]
            if col.leaf == "string":
                if not isinstance(value, str):
                    raise ValueError(f"fill_null for string column {k!r} must be a str, got {value!r}")
                self._fill[k] = pa.scalar(value, pa.string())
            else:
                try:
                    self._fill[k] = pa.scalar(value).cast(pa.from_numpy_dtype(np.dtype(col.leaf_dtype)))
                except Exception as e:
                    raise ValueError(f"fill_null value {value!r} does not fit column {k!r} "
                                     f"({col.leaf_dtype}): {e}") from e

        # the global row range of every row group, and this rank's pieces of them
        self._row_groups = row_groups
        self.total_rows = sum(sum(g) for g in row_groups)
        T, W = self.total_rows, self.world_size
        bounds = [r * T // W for r in range(W + 1)]
        self.rows_per_rank = tuple(bounds[r + 1] - bounds[r] for r in range(W))
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        self.num_rows = hi - lo
        pieces, g = [], 0
        for f, groups in enumerate(row_groups):
            file_row = 0
            for i, n in enumerate(groups):
                a, b = max(lo, g), min(hi, g + n)
                if a < b:
                    pieces.append(_Piece(f, i, a - g, b - g, file_row))
                g += n
                file_row += n
        self._pieces = tuple(pieces)

        B = self.batch_size
        counts = [n // B if self.drop_remainder else -(-n // B) for n in self.rows_per_rank]
        if self.equal_batches:
            counts = [max(counts)] * W
        self.batches_per_rank = tuple(counts)
        self.num_batches = counts[self.rank]

    def __len__(self):
        return self.num_batches

    def __repr__(self):
        return (f"ParquetDataset({len(self.files)} files, {self.total_rows} rows, "
                f"columns={list(self.columns)}, "
                f"batch_size={self.batch_size}, rank={self.rank}/{self.world_size}, "
                f"num_batches={self.num_batches})")

    def set_epoch(self, epoch):
        """Sets the epoch the next ``iter()`` runs (it advances by one per ``iter()``)."""
        self.epoch = int(epoch)

    def __iter__(self):
        epoch = self.epoch
        self.epoch += 1
        source = self._batches(epoch)
        if self.prefetch == 0:
            return source
        return _prefetched(source, self.prefetch, f"hbk-parquet-prefetch-r{self.rank}-e{epoch}")

    # -- the pipeline -------------------------------------------------------

    def _batches(self, epoch):
        pieces = self._pieces
        rng = None
        if self.shuffle_buffer:
            rng = np.random.default_rng([self.seed, epoch, self.rank])
            pieces = [pieces[i] for i in rng.permutation(len(pieces))]
        chunks = self._read(pieces)
        try:
            if rng is None:
                batches = _rebatch(chunks, self.batch_size)
            else:
                batches = _shuffled_batches(chunks, self.batch_size,
                                            max(self.shuffle_buffer, self.batch_size), rng)
            to_device = self._cuda_copier() if self.device == "cuda" else None
            n = 0
            for batch in batches:
                if self.drop_remainder and _rows(batch) < self.batch_size:
                    break
                n += 1
                batch = _readonly(batch)
                yield to_device(batch) if to_device else batch
            while n < self.num_batches:  # equal_batches: empty batches up to the most of any rank
                n += 1
                batch = self._empty()
                yield to_device(batch) if to_device else batch
        finally:
            chunks.close()

    def _read(self, pieces):
        """One converted chunk per piece, reading one row group at a time."""
        _, _, pq = require_pyarrow()
        names = list(self.columns)
        handles = OrderedDict()  # a few open files, for shuffled piece orders
        try:
            for p in pieces:
                path = self.files[p.file]
                pf = handles.pop(p.file, None)
                if pf is None:
                    pf = open_parquet(pq, path)
                handles[p.file] = pf
                while len(handles) > 8:
                    close_parquet(handles.popitem(last=False)[1])
                table = read_row_group(pf, path, p.row_group, names)
                expected = self._row_groups[p.file][p.row_group]
                if table.num_rows != expected:
                    raise DataError(f"{path} changed since the dataset was built: row group "
                                     f"{p.row_group} has {table.num_rows} rows, expected {expected}")
                if p.start or p.stop != expected:
                    table = table.slice(p.start, p.stop - p.start)
                yield {c.name: self._convert(c, table.column(c.name), path, p.file_row + p.start)
                       for c in self._columns}
                del table
        finally:
            for pf in handles.values():
                close_parquet(pf)

    def _empty(self):
        out = {}
        for c in self._columns:
            values = np.empty(0, np.dtype(c.leaf_dtype))
            values.flags.writeable = False
            if c.is_list:
                offsets = np.zeros(1, np.int64)
                offsets.flags.writeable = False
                out[c.name] = Ragged(values, offsets)
            else:
                out[c.name] = values
        return out

    def _null_error(self, col, path, row):
        return DataError(f"column {col.name!r} has a null at row {row} of {path}; "
                         f"pass fill_null={{{col.name!r}: value}} to replace nulls")

    def _leaf(self, col, arr, path, row_of):
        """NumPy values of a flat Arrow array (``row_of(i)``: the file row of element i)."""
        pa, pc, _ = require_pyarrow()
        if pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        if arr.null_count:
            fill = self._fill.get(col.name)
            if fill is None:
                first = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
                raise self._null_error(col, path, row_of(first))
            arr = pc.fill_null(arr, fill)
        if col.leaf == "string":
            from .hashing import hash_strings

            return np.asarray(hash_strings(arr, self._buckets[col.name]), dtype=np.int64)
        out = arr.to_numpy(zero_copy_only=False)
        return out if out.dtype == col.leaf_dtype else out.astype(col.leaf_dtype)

    def _convert(self, col, chunked, path, first_row):
        arr = chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)
        if not col.is_list:
            return self._leaf(col, arr, path, lambda i: first_row + i)
        offs = np.asarray(arr.offsets)  # zero-copy view of this (possibly sliced) array's offsets
        if arr.null_count:
            if col.name not in self._fill:
                first = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
                raise self._null_error(col, path, first_row + first)
            lengths = np.diff(offs).astype(np.int64)
            lengths[arr.is_null().to_numpy(zero_copy_only=False)] = 0
            offsets = np.empty(len(arr) + 1, np.int64)
            offsets[0] = 0
            np.cumsum(lengths, out=offsets[1:])
            flat = arr.flatten()  # skips the values behind null lists, honours the slice
        else:
            start, stop = int(offs[0]), int(offs[-1])
            flat = arr.values.slice(start, stop - start)
            if offs.dtype == np.int64 and start == 0:
                offsets = offs
            else:
                offsets = offs.astype(np.int64)
                if start:
                    offsets -= start
        values = self._leaf(col, flat, path,
                            lambda i: first_row + int(np.searchsorted(offsets, i, side="right")) - 1)
        return Ragged(values, offsets)

    def _cuda_copier(self):
        import cupy
        import cupyx

        state = {}

        def h2d(a, stream):
            a = np.ascontiguousarray(a)
            pinned = cupyx.empty_pinned(a.shape, a.dtype)
            pinned[...] = a
            out = cupy.empty(a.shape, a.dtype)
            if a.size:
                out.set(pinned, stream=stream)
            return out, pinned

        def copy(batch):
            if "stream" not in state:  # created in the thread that copies
                state["stream"] = cupy.cuda.Stream(non_blocking=True)
            stream = state["stream"]
            out, keep = {}, []
            for k, v in batch.items():
                if isinstance(v, Ragged):
                    (values, p1), (offsets, p2) = h2d(v.values, stream), h2d(v.offsets, stream)
                    out[k] = Ragged(values, offsets)
                    keep += [p1, p2]
                else:
                    out[k], p = h2d(v, stream)
                    keep.append(p)
            stream.synchronize()  # the pinned buffers may go once the copies are done
            return out

        return copy
