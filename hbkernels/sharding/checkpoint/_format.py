"""The on-disk format of a checkpoint: its constants, the writing of ``.npy`` files, of
an incremental save's packs (each array under its own crc32) and of the manifest, the
reading of a manifest (:func:`read_manifest`, checked by :mod:`._manifest`) and of the
arrays a save's files hold (:class:`Reader`)."""
import functools
import io
import json
import math
import os
import zlib

import numpy as np

from ..._files import READ_WHOLE, append_linked, open_regular, read_regular, read_upto, write_atomic
from ..._sorted import find_sorted
from ...errors import CheckpointError
from ...quantize import unpack
from . import _manifest, _packs

FORMAT = "hbkernels-embedding-collection"
VERSION = 5  # 2: an incremental save lists a dynamic table's changes, not all its ids;
#             3: an incremental save writes one file per rank (``offset`` in its entries);
#             4: each such file begins with a head (:mod:`._packs`), and a link to an
#                incremental save of format 4 names its files;
#             5: a rank's file of an incremental save is its parent's with its pack
#                appended where it can be (a hard link), and a link names packs' offsets
READABLE_VERSIONS = (1, 2, 3, 4, 5)
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 28
MAX_CHAIN = 200  # incremental saves one load follows back to a full save (save keeps below)
CHAIN_SAVE_BYTES = 1 << 17  # the least an incremental save counts toward a chain's limit:
#                             more than opening one save of a chain costs a load, counted
#                             in bytes of a full save
PACK_ALIGN = _packs.ALIGN  # byte alignment of each array in an incremental save's file
CHUNK_ROWS = 1 << 16  # rows of a table's files in memory at a time, saving or loading


class _CrcWriter:
    """A write-only file object that keeps the crc32 of what went through it."""

    def __init__(self, f):
        self.f, self.crc, self.size = f, 0, 0

    def write(self, data):
        view = memoryview(data)
        view = view.cast("B") if view.nbytes else memoryview(b"")
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self.f.write(view)


class Gathered:
    """Rows ``at`` of a host array (a table's files), saved a chunk at a time: a
    table larger than RAM may hold more rows than fit in memory at once."""

    def __init__(self, array, at):
        self.array, self.at = array, at
        self.shape = (at.shape[0],) + tuple(array.shape[1:])
        self.dtype = np.dtype(array.dtype)

    def chunks(self):
        for s in range(0, self.at.shape[0], CHUNK_ROWS):
            yield np.ascontiguousarray(self.array[self.at[s:s + CHUNK_ROWS]])


def _chunks(array):
    """The elements of ``array`` (a host array or a :class:`Gathered`) in C order, as
    contiguous arrays: a :class:`Gathered` a chunk of rows at a time."""
    return array.chunks() if isinstance(array, Gathered) else [np.ascontiguousarray(array)]


@functools.lru_cache(maxsize=256)
def _npy_header(dtype, shape):
    """The ``.npy`` header (format 1.0, C order, no pickle) a save writes before the
    elements of an array of ``dtype`` and ``shape``: what ``np.save`` writes for it."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {
        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
        "shape": tuple(shape)})
    return buf.getvalue()


def save_array(path, array):
    """``array`` as a ``.npy`` file (:func:`_npy_header`, then its elements in C order)
    written atomically, a :class:`Gathered` a chunk at a time; returns (crc32, bytes)."""
    def write(f):
        w = _CrcWriter(f)
        w.write(_npy_header(array.dtype, array.shape))
        for chunk in _chunks(array):
            w.write(chunk)
        return w.crc, w.size
    return write_atomic(path, write)


def save_pack(path, arrays, log=None):
    """``arrays`` (host arrays or :class:`Gathered`) as one pack: a ``.npy`` header of a
    uint8 array holding them all, then each in C order at an offset from the pack's
    start that is a multiple of :data:`PACK_ALIGN` (zeros between). The pack is a new
    file ``path`` written atomically, or, with ``log`` (``(file, bytes)``: the file of
    the parent's pack and where that pack ends), appended to that file under the name
    ``path`` where it can be (:func:`~hbkernels._files.append_linked`). Returns
    ``([(offset, crc32, bytes)] of each array, from the file's start; the pack's bytes,
    its crc32 and offset; the bytes the file grew by)``."""
    sizes = [math.prod(a.shape) * a.dtype.itemsize for a in arrays]

    def layout(start):
        offsets, at = [], start
        for size in sizes:
            offsets.append(at)
            at = -(-(at + size) // PACK_ALIGN) * PACK_ALIGN
        return offsets, offsets[-1] + sizes[-1]

    header, fit = b"", _npy_header("uint8", (0,))
    while len(fit) != len(header):  # its length (a multiple of 64) may grow with the total
        header = fit
        offsets, end = layout(len(header))
        fit = _npy_header("uint8", (end - len(header),))
    header = fit

    def write(f):
        whole = _CrcWriter(f)
        placed, at = [], whole.write(header)
        for array, offset in zip(arrays, offsets):
            at += whole.write(bytes(offset - at))
            w = _CrcWriter(whole)
            for chunk in _chunks(array):
                w.write(chunk)
            placed.append((offset, w.crc, w.size))
            at += w.size
        return placed, at, whole.crc

    appended = None if log is None else append_linked(log[0], path, log[1], PACK_ALIGN, write)
    if appended is None:
        placed, size, crc = write_atomic(path, write)
        return placed, size, crc, 0, size
    (placed, size, crc), start = appended
    return ([(offset + start, c, n) for offset, c, n in placed], size, crc, start,
            start + size - log[1])


def write_manifest(path, text):
    """Manifest ``text`` into checkpoint directory ``path``, atomically."""
    write_atomic(os.path.join(path, MANIFEST), lambda f: f.write(text))


def read_manifest(path):
    """The manifest of checkpoint ``path`` (dict), checked (see :mod:`._manifest`)."""
    return read_manifest_sealed(path)[0]


def read_manifest_sealed(path):
    """``(manifest, whether its text is sealed: _manifest.is_sealed_text)`` of
    checkpoint ``path``."""
    name = os.path.join(os.fspath(path), MANIFEST)
    try:
        fd, size = open_regular(name)
    except FileNotFoundError:
        raise CheckpointError(f"{name}: no checkpoint manifest here") from None
    except OSError as e:
        raise CheckpointError(f"{name}: unreadable manifest ({e.strerror or e})") from None
    try:
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{name}: larger than {MAX_MANIFEST_BYTES} bytes, not a manifest")
        text = read_upto(fd, size)
        manifest = json.loads(text.decode())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{name}: unreadable manifest ({e})") from None
    finally:
        os.close(fd)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{name}: not a {FORMAT} manifest")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{name}: format version {manifest.get('version')!r}, "
                              f"this hbkernels reads {READABLE_VERSIONS}")
    return manifest, _manifest.is_sealed_text(text, manifest)


def _entry_key(entry):
    """What identifies the array of file entry ``entry`` (entries of one incremental save
    share a file; arrays of no bytes may share an offset)."""
    return entry["file"], entry.get("offset"), entry["dtype"], tuple(entry["shape"])


def _columns(entry, data, k, lo, hi):
    """Table columns ``[lo, hi)`` of rows ``k`` of the array ``data`` of file ``entry``:
    codes packed several a byte (its ``bits``) unpacked first."""
    if "bits" not in entry:
        return data[k, lo - entry["c0"]:hi - entry["c0"]]
    codes = unpack(np, np.asarray(data[k]), entry["bits"], entry["c1"] - entry["c0"])
    return codes[:, lo - entry["c0"]:hi - entry["c0"]]


class Reader:
    """Rows of the saved arrays, from the shard files (checked once, memory-mapped)."""

    def __init__(self, path, manifest, contents=None):
        self.path = os.fspath(path)
        self.files = {}
        for f in manifest["files"]:
            self.files.setdefault((f["table"], f["array"]), []).append(f)
        self._open = {}  # _entry_key -> array; ("sorted",) + _entry_key -> _sorted
        self._files = dict(contents or {})  # file -> contents (those read already)

    def contents(self, file):
        """A read-only memoryview of the save's file ``file`` (a regular file): read
        once when small, memory-mapped when large."""
        if file not in self._files:
            name = os.path.join(self.path, file)
            try:
                self._files[file] = read_regular(name)
            except OSError as e:
                raise CheckpointError(f"{name}: cannot read checkpoint file ({e.strerror or e})") from None
        return self._files[file]

    def _array(self, entry):
        """The array of file entry ``entry`` (read-only), its bytes and crc32 checked:
        a ``.npy`` file, or bytes ``[offset, offset + bytes)`` of an incremental save's
        file where the entry has an ``offset``."""
        key = _entry_key(entry)
        if key in self._open:
            return self._open[key]
        data = self.contents(entry["file"])
        packed = "offset" in entry
        lo = entry["offset"] if packed else 0
        hi = lo + entry["bytes"]
        crc = zlib.crc32(data[lo:hi])
        if (len(data) < hi if packed else len(data) != hi) or crc != entry["crc32"]:
            what = f"bytes [{lo}, {hi}) of {len(data)}" if packed else f"{len(data)} bytes"
            raise CheckpointError(f"{os.path.join(self.path, entry['file'])}: checkpoint file is "
                                  f"corrupt ({what}, crc32 {crc:08x}; the manifest says "
                                  f"{entry['bytes']} bytes, {entry['crc32']:08x})")
        shape, dtype = tuple(entry["shape"]), entry["dtype"]
        header = b"" if packed else _npy_header(dtype, shape)
        if data[:len(header)] == header:  # as a save writes it
            self._open[key] = np.frombuffer(data[lo + len(header):hi], dtype).reshape(shape)
            return self._open[key]
        name = os.path.join(self.path, entry["file"])
        try:
            if len(data) <= READ_WHOLE:  # another writer's .npy header
                arr = np.load(io.BytesIO(data), allow_pickle=False)
                arr.flags.writeable = False
            else:
                arr = np.load(name, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise CheckpointError(f"{name}: not a valid .npy file ({e})") from None
        if arr.shape != shape or arr.dtype.name != dtype:
            raise CheckpointError(f"{name}: holds {arr.shape} {arr.dtype.name}, the manifest says "
                                  f"{shape} {dtype}")
        self._open[key] = arr
        return arr

    def changed_rows(self, table, array, rows, c0, c1, out):
        """Overwrite the rows of ``out`` that this incremental save wrote: its files of
        ``array``, each beside the ``rows`` file of its shard naming their table rows."""
        named = {(e["slice"], e["row_start"]): e for e in self.files.get((table, "rows"), [])}
        for entry in self.files.get((table, array), []):
            lo, hi = max(c0, entry["c0"]), min(c1, entry["c1"])
            per_row = len(entry["shape"]) == 1
            if (not per_row and lo >= hi) or not entry["num_rows"]:
                continue
            which = named.get((entry["slice"], entry["row_start"]))
            if which is None:
                raise CheckpointError(f"{os.path.join(self.path, entry['file'])}: no rows file "
                                      f"names its rows")
            saved, order = self._sorted(which)
            at, hit = find_sorted(saved, rows)
            if not hit.any():
                continue
            data = self._array(entry)
            k = order[at[hit]]
            if per_row:
                out[hit] = data[k]
            else:
                out[np.flatnonzero(hit), lo - c0:hi - c0] = _columns(entry, data, k, lo, hi)

    def _sorted(self, entry):
        """``(rows ascending, their order)`` of a ``rows`` file (computed once)."""
        key = ("sorted",) + _entry_key(entry)
        if key not in self._open:
            saved = np.asarray(self._array(entry))
            order = np.argsort(saved)
            self._open[key] = (saved[order], order)
        return self._open[key]

    def all_rows(self, table, array):
        """Every saved row of a dynamic table's ``array``, its files in the order of the
        ranks that wrote them (so the arrays of one table line up)."""
        entries = sorted(self.files.get((table, array), []), key=lambda e: e["row_start"])
        if not entries:
            raise CheckpointError(f"{os.path.join(self.path, MANIFEST)}: no saved {array} of "
                                  f"table {table!r}")
        if len(entries) == 1:
            return self._array(entries[0])
        return np.concatenate([self._array(e) for e in entries])

    def has(self, table, array):
        """Whether this save has files of ``array`` of ``table``."""
        return (table, array) in self.files

    def rows(self, table, array, rows, c0, c1, out):
        """Fill ``out`` ([len(rows), c1 - c0], or [len(rows)] per-row) with saved rows;
        every element must come from a file."""
        filled = np.zeros(out.shape, bool)
        for entry in self.files.get((table, array), []):
            lo, hi = max(c0, entry["c0"]), min(c1, entry["c1"])
            per_row = len(entry["shape"]) == 1
            if not per_row and lo >= hi:
                continue
            k, rem = np.divmod(rows - entry["row_start"], entry["row_step"])
            hit = (rem == 0) & (k >= 0) & (k < entry["num_rows"])
            if not hit.any():
                continue
            data = self._array(entry)
            if per_row:
                out[hit] = data[k[hit]]
                filled[hit] = True
            else:
                at = np.flatnonzero(hit)
                out[at, lo - c0:hi - c0] = _columns(entry, data, k[hit], lo, hi)
                filled[at, lo - c0:hi - c0] = True
        if not filled.all():
            where = np.argwhere(~filled)[0]
            column = f", column {c0 + int(where[1])}" if len(where) > 1 else ""
            raise CheckpointError(f"{os.path.join(self.path, MANIFEST)}: no saved {array} for row "
                                  f"{int(rows[where[0]])}{column} of table {table!r}")
