"""Shared by the writers of :mod:`hbkernels.data`: the pyarrow check, the
row-group writer and the summary it returns."""
import os
from typing import NamedTuple

from ..errors import DataError, MissingDependencyError

ROW_GROUP_SIZE = 1 << 18
"""Default rows per Parquet row group (about 80 MB of Criteo columns in memory)."""


def require_pyarrow():
    """``(pyarrow, pyarrow.compute, pyarrow.parquet)``, or
    :class:`hbkernels.errors.MissingDependencyError` naming the extra that installs them."""
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.parquet
    except ImportError as e:
        raise MissingDependencyError("hbkernels.data needs pyarrow: pip install 'hbkernels[data]'") from e
    return pyarrow, pyarrow.compute, pyarrow.parquet


class WriteSummary(NamedTuple):
    """What a converter or :func:`~hbkernels.data.write_synthetic` wrote."""

    path: str
    num_rows: int
    num_row_groups: int

    def __str__(self):
        return f"wrote {self.num_rows} rows in {self.num_row_groups} row groups to {self.path}"


class RowGroupWriter:
    """Writes record batches to Parquet in row groups of exactly ``row_group_size``
    rows (the last one may be shorter), holding at most one row group plus one
    batch in memory. The file appears at ``path`` only on a clean :meth:`close`
    (it is written under a temporary name and renamed); :meth:`abort` removes it.
    """

    def __init__(self, path, schema, row_group_size):
        import pyarrow.parquet as pq

        if int(row_group_size) < 1:
            raise ValueError(f"row_group_size must be >= 1, got {row_group_size}")
        self.path = os.fspath(path)
        self.row_group_size = int(row_group_size)
        self._partial_path = f"{self.path}.partial"
        self._writer = pq.ParquetWriter(self._partial_path, schema)
        self._schema = schema
        self._pending = []
        self._pending_rows = 0
        self.num_rows = 0
        self.num_row_groups = 0

    def write(self, batch):
        """Queue a record batch (of this writer's schema); full row groups go to disk."""
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        while self._pending_rows >= self.row_group_size:
            self._flush(self.row_group_size)

    def _flush(self, num_rows):
        import pyarrow as pa

        table = pa.Table.from_batches(self._pending, schema=self._schema)
        self._writer.write_table(table.slice(0, num_rows), row_group_size=num_rows)
        rest = table.slice(num_rows)
        self._pending = rest.to_batches()
        self._pending_rows = rest.num_rows
        self.num_rows += num_rows
        self.num_row_groups += 1

    def close(self):
        """Write the last short row group, finish the file and return a :class:`WriteSummary`."""
        if self._pending_rows:
            self._flush(self._pending_rows)
        self._writer.close()
        os.replace(self._partial_path, self.path)
        return WriteSummary(self.path, self.num_rows, self.num_row_groups)

    def abort(self):
        """Close and delete the partial file."""
        self._writer.close()
        os.remove(self._partial_path)


def parquet_files(paths):
    """The Parquet files of ``paths`` (files, or directories of ``*.parquet``), in order."""
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    else:
        try:
            paths = list(paths)
        except TypeError:
            raise TypeError(f"paths must be a Parquet file, a directory or a list of them, "
                            f"got {paths!r}") from None
    if not paths:
        raise ValueError("ParquetDataset needs at least one path")
    files = []
    for p in paths:
        p = os.fspath(p)
        if isinstance(p, bytes):
            p = os.fsdecode(p)
        if os.path.isdir(p):
            found = sorted(os.path.join(p, f) for f in os.listdir(p)
                           if f.endswith(".parquet") and os.path.isfile(os.path.join(p, f)))
            if not found:
                raise DataError(f"directory {p} holds no *.parquet files")
            files.extend(found)
        elif os.path.exists(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"Parquet file not found: {p}")
    return files


def open_parquet(pq, path):
    """``pq.ParquetFile(path)``, verifying the page checksums of files written with
    them; a file that is not Parquet is a DataError naming it."""
    try:
        return pq.ParquetFile(path, page_checksum_verification=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"Parquet file not found: {path}") from None
    except Exception as e:  # ArrowInvalid, OSError, ...: a file that is not Parquet
        raise DataError(f"cannot read Parquet file {path}: {e}") from e


def close_parquet(pf):
    """Close a ParquetFile (where this pyarrow can)."""
    close = getattr(pf, "close", None)
    if close is not None:
        close()


def read_row_group(pf, path, index, columns):
    """Row group ``index`` of open file ``pf``; a damaged page (a failed checksum, a bad
    encoding) or a file changed since it was opened is a DataError naming ``path``."""
    try:
        return pf.read_row_group(index, columns=columns)
    except Exception as e:  # ArrowInvalid, OSError, ...
        raise DataError(f"cannot read row group {index} of Parquet file {path}: {e}") from e
