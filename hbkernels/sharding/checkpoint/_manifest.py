"""What a checkpoint's ``manifest.json`` may say, checked field by field.

A checkpoint only touches files it named itself inside its own directory: a save
directory ``save-<ns>-<8 hex>`` (:func:`is_save_dir`) holding ``.npy`` files whose
names are made of the characters :data:`FILE_NAME` allows (:func:`file_name`
generates them from the table's position, never from its name). Every field a
reader uses is checked here before a file is opened: types, ranges, the table
and optimizer slot each file belongs to, its rows and columns inside the table,
its shape from its rows and columns, its dtype, size and crc32 (and in an
incremental save of format 3 or later, whose arrays share one file per rank, its
``offset`` in that file), and the link to a parent (:func:`check_link`: from
format 4 it names the packs of a parent that is an incremental save). The
manifest carries the crc32 of its own canonical
JSON (:func:`seal`), written first (:func:`sealed_text`). Any violation is a
:class:`~hbkernels.CheckpointError` naming the manifest.
"""
import json
import math
import re
import zlib

import numpy as np

from ..._validate import SEED_RANGE
from ...errors import CheckpointError
from ...quantize import BITS, row_bytes

SAVE_DIR = re.compile(r"save-[0-9]{1,20}-[0-9a-f]{8}")
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,240}\.npy")
STATE_DTYPES = ("float32", "float64")
TABLE_DTYPES = ("float32", "float16")
QUANTIZED_ARRAYS = {"codes": False, "scale": True, "bias": True}  # array -> one value per row
PACKED_BITS = (2, 4)  # the bits whose codes a save packs several a byte ("bits" in its entry)
_ITEMSIZE = {name: np.dtype(name).itemsize for name in STATE_DTYPES + TABLE_DTYPES + ("uint8", "int64")}
_U32 = 1 << 32
_U63 = 1 << 63


def is_save_dir(name):
    """Whether ``name`` is a save directory's name as :func:`save_dir_name` makes them."""
    return SAVE_DIR.fullmatch(name) is not None


def save_dir_name(time_ns, tag):
    return f"save-{int(time_ns)}-{int(tag) & 0xFFFFFFFF:08x}"


def pack_name(rank):
    """The name of the one file rank ``rank`` writes in an incremental save (format 3):
    each array of its entries at the entry's ``offset``."""
    return f"r{int(rank)}.pack.npy"


def file_name(table_index, shard, array):
    """The name of one shard's ``array`` file (no table name in it, so no name can
    form a path)."""
    return f"t{table_index}.{shard.slice}.{shard.row_start}-{shard.row_step}.{array}.npy"


def _canonical(manifest):
    body = {k: v for k, v in manifest.items() if k != "crc32"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(manifest):
    """``manifest`` (JSON-able: as parsed back from its text) with its crc32 added."""
    return dict(manifest, crc32=zlib.crc32(_canonical(manifest)))


_SEALED_TEXT = re.compile(rb'\{"crc32":(0|[1-9][0-9]{0,9}),')


def sealed_text(manifest):
    """``(text, crc32)``: ``manifest`` (JSON-able: as parsed back from its text, with at
    least one field) as a save writes it, its ``crc32`` (that of :func:`seal`) the first
    field and the rest its canonical JSON, so a reader checks the crc32 on the text as
    read (:func:`is_sealed_text`)."""
    body = _canonical(manifest)
    crc = zlib.crc32(body)
    return b'{"crc32":%d,' % crc + body[1:], crc


def is_sealed_text(text, manifest):
    """Whether ``text``, whose JSON is ``manifest``, is as :func:`sealed_text` wrote it and
    holds the crc32 of its content: then :func:`check` need not rebuild the canonical JSON
    (any other text, a hand-written or older manifest, is checked on its parsed content)."""
    m = _SEALED_TEXT.match(text)
    return (m is not None and int(m[1]) == manifest.get("crc32")
            and zlib.crc32(memoryview(text)[m.end():], zlib.crc32(b"{")) == manifest["crc32"])


def _fail(where, message):
    raise CheckpointError(f"{where}: {message}")


def _int(where, d, key, lo=None, hi=None):
    v = d.get(key) if type(d) is dict else None
    if type(v) is not int or (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f" in [{lo}, {hi}]" if hi is not None else (f" >= {lo}" if lo is not None else "")
        _fail(where, f"{key} must be an integer{bounds}, got {v!r}")
    return v


def _field(where, d, key, types):
    if not isinstance(d, dict) or key not in d:
        _fail(where, f"the manifest lacks {key!r}")
    if not isinstance(d[key], types):
        _fail(where, f"{key} has the wrong type ({type(d[key]).__name__})")
    return d[key]


def check(manifest, where, slots, sealed=False):
    """Check the manifest ``manifest`` (parsed JSON) of checkpoint file ``where`` (its
    crc32 already checked on its text where ``sealed``: :func:`is_sealed_text`);
    ``slots(optimizer entry)`` gives ``{slot name: per_row}`` of the saved optimizer.
    Returns ``{table name: table entry}``."""
    if "crc32" in manifest and not sealed:
        if _int(where, manifest, "crc32", 0, _U32 - 1) != zlib.crc32(_canonical(manifest)):
            _fail(where, "the manifest's crc32 does not match its content (edited or corrupt)")
    save = _field(where, manifest, "save", str)
    if not is_save_dir(save):
        _fail(where, f"save directory {save!r} is not one hbkernels names")
    _int(where, manifest, "world_size", 1)
    _int(where, manifest, "seed", SEED_RANGE[0], SEED_RANGE[1] - 1)
    _field(where, manifest, "dedup", bool)
    _field(where, manifest, "wire_dtype", (str, type(None)))
    _field(where, manifest, "batch_size_hint", (int, type(None)))
    _field(where, manifest, "plan_request", (str, dict, type(None)))
    optimizer = _field(where, manifest, "optimizer", dict)
    _field(where, optimizer, "type", str)
    _field(where, optimizer, "options", dict)
    tables = {}
    for t in _field(where, manifest, "tables", list):
        name = _field(where, t, "name", str)
        if name in tables:
            _fail(where, f"table {name!r} is listed twice")
        if t.get("num_rows") is None:  # a dynamic table: its ids are saved with its rows
            _int(where, t, "capacity", 1)
        else:
            _int(where, t, "num_rows", 1)
        _int(where, t, "dim", 1)
        _int(where, t, "step", 0)
        if t.get("dtype") not in TABLE_DTYPES:
            _fail(where, f"table {name!r}: dtype must be one of {TABLE_DTYPES}, got {t.get('dtype')!r}")
        tables[name] = t
    quantize = manifest.get("quantize", {})
    if not isinstance(quantize, dict):
        _fail(where, f"quantize has the wrong type ({type(quantize).__name__})")
    for name, bits in quantize.items():
        if name not in tables or tables[name].get("num_rows") is None \
                or tables[name].get("storage") != "device" or tables[name].get("dtype") != "float32":
            _fail(where, f"quantize names {name!r}, not a static float32 table in memory")
        if type(bits) is not int or bits not in BITS:
            _fail(where, f"table {name!r}: quantized to {bits!r} bits, expected one of {BITS}")
    if quantize and manifest.get("parent") is not None:
        _fail(where, "an incremental save of quantized tables (they never change)")
    arrays = dict(slots(optimizer), weights=False)
    parent = manifest.get("parent")
    if parent is not None:  # an incremental save: changed rows, named in "rows" files
        check_link(where, parent, manifest.get("version", 1))
        arrays["rows"] = True
    packed = parent is not None and manifest.get("version", 1) >= 3
    kinds = {name: _table_arrays(t, QUANTIZED_ARRAYS if name in quantize else arrays,
                                 parent is not None) for name, t in tables.items()}
    for f in _field(where, manifest, "files", list):
        _check_file(where, f, save, tables, kinds, packed, quantize)
    for name, t in tables.items():
        if t.get("num_rows") is None:
            _check_dynamic(where, name, [f for f in manifest["files"] if f["table"] == name],
                           parent is not None, manifest.get("version", 1) >= 2,
                           t.get("admit_count", 1) != 1)
    return tables


PACK_FILE = re.compile(r"(save-[0-9]{1,20}-[0-9a-f]{8})/r(0|[1-9][0-9]{0,8})\.pack\.npy")


def check_link(where, link, version):
    """An incremental save's link (in a manifest of format ``version``) to its parent: the
    parent's ``path`` (from this save's directory; not empty, no NUL), the ``crc32`` of
    its manifest and, where the parent is an incremental save of format 4 or later, its
    ``packs``: ``[file, bytes, crc32]`` of each of its files (a save of format 4) or
    ``[file, bytes, crc32, offset]`` of each of its packs (format 5 or later: bytes
    ``[offset, offset + bytes)`` of the file), all in one save directory. Returns
    ``link``."""
    path = _field(where, link, "path", str)
    if not path or "\0" in path:
        _fail(where, f"parent path {path!r} is empty or holds a NUL")
    _int(where, link, "crc32", 0, _U32 - 1)
    packs = link.get("packs")
    if packs is None:
        return link
    dirs = set()
    if type(packs) is not list or not packs:
        _fail(where, f"parent packs must be a list of [file, bytes, crc32(, offset)], got {packs!r}")
    if {len(p) if type(p) is list else 0 for p in packs} != {3 if version < 5 else 4}:
        _fail(where, f"parent packs {packs!r} are not all [file, bytes, crc32"
                     f"{'' if version < 5 else ', offset'}] (format {version})")
    for pack in packs:
        m = PACK_FILE.fullmatch(pack[0]) if type(pack) is list and len(pack) in (3, 4) \
            and type(pack[0]) is str else None
        if m is None or any(type(v) is not int or not 0 <= v < (_U32 if k == 1 else _U63)
                            for k, v in enumerate(pack[1:])):
            _fail(where, f"parent pack {pack!r} is not [r<rank>.pack.npy of a save directory, "
                         f"bytes, crc32(, offset)]")
        dirs.add(m[1])
    if len(dirs) != 1 or len({p[0] for p in packs}) != len(packs):
        _fail(where, f"parent packs {[p[0] for p in packs]} are not distinct files of one save "
                     f"directory")
    return link


DYNAMIC_ARRAYS = {name: True for name in ("ids", "last", "count", "pending_ids", "pending_last",
                                           "pending_count", "evicted", "pending_removed")}
# (one value per row; an incremental save's evicted and pending_removed: ids gone since)


def row_kind(array, incremental):
    """The kind of row ``array`` of a save (``incremental`` or not) holds; the arrays of
    one kind of one shard hold the same rows: ``"live"`` (a dynamic table's live or
    used ids and their scores), ``"pending"`` (its pending ids), ``"changed"`` (in an
    incremental save, the rows it wrote: ``rows``, weights, optimizer state), or, for
    ``evicted`` and ``pending_removed`` (ids gone), the array's own name."""
    if array in ("evicted", "pending_removed"):
        return array
    if array.startswith("pending_"):
        return "pending"
    return "changed" if incremental and array not in DYNAMIC_ARRAYS else "live"


def _check_dynamic(where, name, files, incremental, changes, pending):
    """A dynamic table's files: for each rank that wrote some, ``ids``, ``weights``,
    ``last`` and ``count``, and with ``pending`` ids (``admit_count`` > 1) the
    ``pending_`` ones; in an incremental save that lists ``changes`` (format 2) also
    ``evicted`` (and ``pending_removed``), which no other save has; the arrays of one
    kind of row with the same number of rows (live or used ids; pending ids; in an
    incremental save, the changed ids of ``rows``)."""
    by_rank = {}
    for f in files:
        by_rank.setdefault(f["row_start"], {})[f["array"]] = f["num_rows"]
    delta = incremental and changes
    for rank, arrays in by_rank.items():
        needed = {"ids", "weights", "last", "count"}
        if pending:
            needed |= {"pending_ids", "pending_last", "pending_count"}
        if delta:
            needed |= {"evicted"} | ({"pending_removed"} if pending else set())
        stray = sorted({"evicted", "pending_removed"} & set(arrays)) if not delta else []
        if stray:
            _fail(where, f"table {name!r}: rank {rank}'s files hold {stray}, which only an "
                         f"incremental save of format 2 or later has")
        missing = sorted(needed - set(arrays))
        if missing:
            _fail(where, f"table {name!r}: rank {rank}'s files lack {missing}")
        for part in ("live", "pending", "changed"):
            rows = {a: n for a, n in arrays.items() if row_kind(a, incremental) == part}
            if len(set(rows.values())) > 1:
                _fail(where, f"table {name!r}: rank {rank}'s files hold different numbers of "
                             f"rows {rows}")


def _table_arrays(table, arrays, incremental):
    """``(arrays, incremental)`` of manifest table entry ``table``, whose saves hold
    ``arrays`` (name -> one value per row) and, ``incremental``, changed rows only: a
    dynamic table has its index's arrays too; a table in files is saved sparse, the
    rows it holds named in ``rows``."""
    if table.get("num_rows") is None:
        return dict(arrays, **DYNAMIC_ARRAYS), incremental
    if table.get("storage") == "mmap":
        return dict(arrays, rows=True), True
    return arrays, incremental


def _check_file(where, f, save, tables, kinds, packed, quantize):
    rel = _field(where, f, "file", str)
    parts = rel.split("/")
    if len(parts) != 2 or parts[0] != save or not FILE_NAME.fullmatch(parts[1]):
        _fail(where, f"file {rel!r} is not a file of save directory {save!r}")
    table = tables.get(_field(where, f, "table", str))
    if table is None:
        _fail(where, f"file {rel!r} belongs to no table of the manifest ({f['table']!r})")
    dynamic = table.get("num_rows") is None
    arrays, incremental = kinds[f["table"]]
    array = _field(where, f, "array", str)
    if array not in arrays:
        _fail(where, f"file {rel!r}: no array {array!r} in a table (expected one of "
                     f"{sorted(arrays)})")
    _int(where, f, "slice", 0)
    if dynamic:  # rows are ids, saved by rank row_start of row_step ranks
        step = _int(where, f, "row_step", 1)
        _int(where, f, "row_start", 0, step - 1)
        rows = _int(where, f, "num_rows", 0, table["capacity"])
    else:  # an incremental save names its rows in a "rows" file
        start = _int(where, f, "row_start", 0, table["num_rows"] - 1)
        step = _int(where, f, "row_step", 1, table["num_rows"])
        rows = _int(where, f, "num_rows", 0, table["num_rows"] if incremental else None)
        if rows and not incremental and start + step * (rows - 1) >= table["num_rows"]:
            _fail(where, f"file {rel!r}: rows {start} + {step} * k for k < {rows} run past the "
                         f"table's {table['num_rows']} rows")
    c0 = _int(where, f, "c0", 0, table["dim"] - 1)
    c1 = _int(where, f, "c1", c0 + 1, table["dim"])
    dtype = _field(where, f, "dtype", str)
    quantized = f["table"] in quantize
    allowed = ((table["dtype"],) if array == "weights" else ("uint8",) if array == "codes" else
               ("int64",) if array in DYNAMIC_ARRAYS or array == "rows" else
               ("float16",) + STATE_DTYPES if quantized else STATE_DTYPES)
    if dtype not in allowed:
        _fail(where, f"file {rel!r}: dtype {dtype!r}, expected one of {allowed}")
    width = c1 - c0
    if "bits" in f:  # codes packed several a byte, each row's rounded up to whole bytes
        bits = quantize.get(f["table"])
        if array != "codes" or bits not in PACKED_BITS or f["bits"] != bits or type(f["bits"]) is not int:
            _fail(where, f"file {rel!r}: bits {f['bits']!r}, only the codes of a table quantized "
                         f"to {PACKED_BITS} bits are packed, at the table's bits ({bits!r})")
        width = row_bytes(width, bits)
    expected = [rows] if arrays[array] else [rows, width]
    if f.get("shape") != expected:
        _fail(where, f"file {rel!r}: shape {f.get('shape')!r}, its rows and columns make "
                     f"{expected}")
    payload = math.prod(expected) * _ITEMSIZE[dtype]
    if packed:  # its bytes inside the save's one file per rank
        _int(where, f, "offset", 0)
        _int(where, f, "bytes", payload, payload)
    elif "offset" in f:
        _fail(where, f"file {rel!r}: an offset, which only an incremental save of format 3 has")
    else:  # a .npy file of its own
        header_max = 1 << 16
        _int(where, f, "bytes", payload, payload + header_max)
    _int(where, f, "crc32", 0, _U32 - 1)
