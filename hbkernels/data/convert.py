"""Converters of public CTR datasets from CSV/TSV text to Parquet.

Each reads its input in blocks (``pyarrow.csv.open_csv``) and writes row
groups as it goes, so memory is bounded by ``block_size`` + ``row_group_size``
rows, not by the file; ``.gz`` / ``.bz2`` inputs are decompressed on the fly.
Categorical strings become int64 ids by :func:`~hbkernels.data.hash_strings`
(``FNV-1a-64 & (2**63 - 1)``, then ``% num_buckets`` when given). An empty
field is null, in every column. Labels come first.

Criteo (Display Advertising: ``train.txt`` / ``day_N``, tab-separated without
header, or the comma-separated sample with a ``label,I1,...`` header; the
layout is detected from the first line):

============  =======  ===========================================
``label``     int32    click (0/1)
``I1..I13``   float32  integer counts as floats; empty -> null
``C1..C26``   int64    hash of the 8-hex-digit string; empty -> null
============  =======  ===========================================

Avazu (``train`` CSV with header ``id,click,hour,...``; ``id`` is dropped):

===============  =======  ===============================================
``click``        int32    label (0/1)
``hour``         int64    YYMMDDHH as in the file
``hour_of_day``  int32    HH, 0..23
``weekday``      int32    day of the week of 20YY-MM-DD, Monday = 0
every other      int64    hash of the field's text (``site_id``, ``C14``, ...)
===============  =======  ===============================================

MovieLens (the joined CSV of DeepCTR's sample, header
``user_id,movie_id,rating,timestamp,title,genres,gender,age,occupation,zip``):

=====================================  ===========  =========================
``rating``                             float32      label (1..5)
``user_id``, ``movie_id``              int64        as in the file
``timestamp``                          int64        seconds since 1970
``gender``, ``age``, ``occupation``,   int64        hash of the field's text
``zip``, ``title``
``genres``                             list<int64>  hash of each ``|``-separated
                                                    genre name
=====================================  ===========  =========================

>>> import os, tempfile
>>> from hbkernels.data import convert_movielens
>>> src = os.path.join(tempfile.mkdtemp(), "ratings.csv")
>>> with open(src, "w") as f:
...     _ = f.write("user_id,movie_id,rating,timestamp,title,genres,gender,age,occupation,zip\\n"
...                 '1,2,4,968035345,"Toy Story (1995)",Animation|Comedy,F,25,4,19119\\n')
>>> print(convert_movielens(src, src + ".parquet", num_buckets=1000))
wrote 1 rows in 1 row groups to ...ratings.csv.parquet
"""
import numpy as np

from ..errors import DataError
from ._io import ROW_GROUP_SIZE, RowGroupWriter, require_pyarrow
from .hashing import hash_strings

BLOCK_SIZE = 1 << 24
"""Bytes of text parsed at a time."""

CRITEO_DENSE = [f"I{i}" for i in range(1, 14)]
CRITEO_CATEGORICAL = [f"C{i}" for i in range(1, 27)]
CRITEO_COLUMNS = ["label", *CRITEO_DENSE, *CRITEO_CATEGORICAL]
MOVIELENS_HASHED = ["gender", "age", "occupation", "zip", "title"]
MOVIELENS_COLUMNS = ["rating", "user_id", "movie_id", "timestamp", *MOVIELENS_HASHED, "genres"]


def convert_criteo(src, dst, *, num_buckets=None, row_group_size=ROW_GROUP_SIZE,
                   block_size=BLOCK_SIZE):
    """Criteo text (tab-separated without header, or CSV with header) -> Parquet
    ``label, I1..I13, C1..C26`` (schema in :mod:`hbkernels.data.convert`).
    Returns a :class:`~hbkernels.data._io.WriteSummary`; a malformed line raises
    ValueError naming ``src`` and the row."""
    require_pyarrow()
    import pyarrow as pa

    first_line = _first_line(src)
    delimiter = "\t" if "\t" in first_line else ","
    has_header = first_line.split(delimiter)[0] == "label"
    if has_header:
        _check_header(src, first_line.split(delimiter), CRITEO_COLUMNS)
    column_types = {"label": pa.int32(), **{c: pa.float32() for c in CRITEO_DENSE},
                    **{c: pa.string() for c in CRITEO_CATEGORICAL}}
    schema = _schema([("label", pa.int32()), *[(c, pa.float32()) for c in CRITEO_DENSE],
                      *[(c, pa.int64()) for c in CRITEO_CATEGORICAL]], num_buckets)

    def to_columns(batch):
        return [batch["label"], *[batch[c] for c in CRITEO_DENSE],
                *[_hashed(batch[c], num_buckets) for c in CRITEO_CATEGORICAL]]

    return _convert(src, dst, schema, to_columns, column_types=column_types,
                    delimiter=delimiter, column_names=None if has_header else CRITEO_COLUMNS,
                    row_group_size=row_group_size, block_size=block_size)


def convert_avazu(src, dst, *, num_buckets=None, row_group_size=ROW_GROUP_SIZE,
                  block_size=BLOCK_SIZE):
    """Avazu CSV (header ``id,click,hour,...``) -> Parquet ``click, hour,
    hour_of_day, weekday`` and every other column but ``id`` hashed (schema in
    :mod:`hbkernels.data.convert`). Returns a :class:`~hbkernels.data._io.WriteSummary`."""
    require_pyarrow()
    import pyarrow as pa
    import pyarrow.compute as pc

    header = _first_line(src).split(",")
    _check_header(src, header, ["click", "hour"])
    categorical = [c for c in header if c not in ("id", "click", "hour")]
    column_types = {"click": pa.int32(), "hour": pa.int64(),
                    **{c: pa.string() for c in categorical}}
    schema = _schema([("click", pa.int32()), ("hour", pa.int64()), ("hour_of_day", pa.int32()),
                      ("weekday", pa.int32()), *[(c, pa.int64()) for c in categorical]],
                     num_buckets)

    def to_columns(batch):
        time = pc.strptime(pc.cast(batch["hour"], pa.string()), format="%y%m%d%H", unit="s")
        return [batch["click"], batch["hour"], pc.cast(pc.hour(time), pa.int32()),
                pc.cast(pc.day_of_week(time), pa.int32()),
                *[_hashed(batch[c], num_buckets) for c in categorical]]

    return _convert(src, dst, schema, to_columns, column_types=column_types, delimiter=",",
                    column_names=None, row_group_size=row_group_size, block_size=block_size)


def convert_movielens(src, dst, *, num_buckets=None, row_group_size=ROW_GROUP_SIZE,
                      block_size=BLOCK_SIZE):
    """MovieLens joined CSV (header ``user_id,movie_id,rating,...,genres,...``)
    -> Parquet with ``rating`` as label and ``genres`` as ``list<int64>``
    (schema in :mod:`hbkernels.data.convert`). Returns a
    :class:`~hbkernels.data._io.WriteSummary`."""
    require_pyarrow()
    import pyarrow as pa
    import pyarrow.compute as pc

    _check_header(src, _first_line(src).split(","), MOVIELENS_COLUMNS)
    column_types = {"rating": pa.float32(), "user_id": pa.int64(), "movie_id": pa.int64(),
                    "timestamp": pa.int64(), "genres": pa.string(),
                    **{c: pa.string() for c in MOVIELENS_HASHED}}
    schema = _schema([("rating", pa.float32()), ("user_id", pa.int64()),
                      ("movie_id", pa.int64()), ("timestamp", pa.int64()),
                      *[(c, pa.int64()) for c in MOVIELENS_HASHED],
                      ("genres", pa.list_(pa.int64()))], num_buckets)

    def to_columns(batch):
        genre_names = pc.split_pattern(batch["genres"], "|")
        genres = pa.ListArray.from_arrays(
            genre_names.offsets, _hashed(genre_names.values, num_buckets),
            mask=genre_names.is_null() if genre_names.null_count else None)
        return [batch["rating"], batch["user_id"], batch["movie_id"], batch["timestamp"],
                *[_hashed(batch[c], num_buckets) for c in MOVIELENS_HASHED], genres]

    return _convert(src, dst, schema, to_columns, column_types=column_types, delimiter=",",
                    column_names=None, row_group_size=row_group_size, block_size=block_size)


def _first_line(src):
    """The first line of a (possibly compressed) text file, without its newline."""
    import pyarrow as pa

    with pa.input_stream(src, compression="detect") as f:
        head = f.read(1 << 16)
    return head.split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8", errors="replace")


def _check_header(src, header, required):
    missing = [c for c in required if c not in header]
    if missing:
        raise DataError(f"{src}: the header {','.join(header)!r} lacks the columns "
                         f"{', '.join(missing)}")


def _schema(fields, num_buckets):
    """The output schema; its metadata records how ids were hashed."""
    import pyarrow as pa

    return pa.schema(fields, metadata={"hbkernels.id_hash": "fnv1a64 & (2**63 - 1)",
                                       "hbkernels.num_buckets": str(num_buckets)})


def _hashed(strings, num_buckets):
    """int64 ids of a string Array, null where the string is null."""
    import pyarrow as pa

    ids = hash_strings(strings, num_buckets, null_id=0)
    is_null = np.asarray(strings.is_null()) if strings.null_count else None
    return pa.array(ids, pa.int64(), mask=is_null)


def _convert(src, dst, schema, to_columns, *, column_types, delimiter, column_names,
             row_group_size, block_size):
    """Stream ``src`` through ``to_columns`` (record batch -> arrays of ``schema``)
    into ``dst``; ``column_names=None`` reads them from the header."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    read_options = pacsv.ReadOptions(block_size=int(block_size), column_names=column_names)
    parse_options = pacsv.ParseOptions(delimiter=delimiter)
    convert_options = pacsv.ConvertOptions(column_types=column_types,
                                           include_columns=list(column_types),
                                           strings_can_be_null=True)
    writer = RowGroupWriter(dst, schema, row_group_size)
    try:
        with pacsv.open_csv(src, read_options, parse_options, convert_options) as reader:
            for batch in reader:
                writer.write(pa.RecordBatch.from_arrays(to_columns(batch), schema=schema))
    except pa.ArrowException as e:
        writer.abort()
        raise DataError(f"{src}: {e}") from e
    except BaseException:
        writer.abort()
        raise
    return writer.close()
