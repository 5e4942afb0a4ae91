"""Checkpoints of an :class:`~hbkernels.EmbeddingCollection`: ``.npy`` arrays plus a
JSON manifest, no pickle, written atomically, loadable at any world size.

This module knows the layout (:class:`~hbkernels.sharding.layout.Shard`) and the
optimizers, never the collection's class: :func:`save` reads a collection through
its public attributes, and :class:`Checkpoint` hands
:meth:`EmbeddingCollection.load <hbkernels.EmbeddingCollection.load>` the tables,
the constructor arguments (the optimizer rebuilt through its constructor), the
saved weights of any shard and the saved optimizer state.

Layout of a checkpoint directory::

    manifest.json              # crc32 first, then format, tables, optimizer, plan, files
    save-<ns>-<8 hex>/t<table index>.<slice>.<row_start>-<row_step>.<array>.npy
    save-<ns>-<8 hex>/r<rank>.pack.npy         # an incremental save: one pack per rank

Each ``.npy`` holds one shard of one array (``weights`` or an optimizer slot):
rows ``row_start + row_step * k`` (``k < num_rows``), columns ``[c0, c1)`` of
the table. An incremental save writes each rank's arrays as one pack instead
(:func:`_save_pack`: a ``.npy`` of bytes, each array at the ``offset`` its file
entry names, with its own crc32, after a head: :mod:`._packs`), appended to the
parent's file of that rank where the parent's pack ends it (the file then has a
name in each save of the chain: a hard link), and its link to its parent names the
parent's packs where the parent is an incremental save too, so a load reads the
newest save's manifest and the packs of the incremental saves below it, from the
newest save's files where they are there (:class:`_PackSave`). A replicated table
is written once, by rank 0. File names never contain a table's name, so no name can form a path.
A table in files (``storage="mmap"``) is saved sparse, never as a copy of its files: the rows its
files hold (rows ever touched), named in a ``rows`` file beside them; its other
rows are remade on load by :func:`~hbkernels.sharding.initial_weights` of the
seed. An incremental save holds the rows changed since its parent, the same way.
A quantized table (``quantize`` in the manifest: table -> bits) is saved as its
``codes`` (uint8 as the table holds them: at 4 and 2 bits packed two and four a byte,
each row of a slice rounded up to whole bytes, the file's ``bits`` saying so; a load
unpacks them for any column slice) and its rows' ``scale`` and ``bias`` (float16), never
as weights: ``E·(ceil(D·bits/8) + 4)`` bytes of a table of E rows, plus each file's
``.npy`` header. Saves of one code per byte and float32 scales and biases (before this
layout) still load.

Saving (collective): every rank writes its shards into a fresh save directory
(each new file through a temp name, fsync, rename; a pack appended to its
parent's file past the parent's pack, fsync, then its own name renamed into
place), the ranks agree, then rank 0 writes ``manifest.json`` the same way and
the ranks agree again; only then does rank 0 remove what earlier or crashed saves
left: save directories named as above holding only such files, and temporary
manifests (a user's other files and directories are never touched). A failure
anywhere, a full disk included, is a :class:`CheckpointError` on every rank, the
new save directory is removed, the parent's files are cut back to where they
were, and the previous manifest and the bytes it names stay intact (a kill can
leave bytes past the parent's pack in its file: the next save then starts a file
of its own).

Loading trusts nothing in the directory: each manifest read is checked field by field
(:mod:`._manifest`: its own crc32, on its text as written
(:func:`~._manifest.sealed_text`) or else on its parsed content; every file
inside the save directory under a name hbkernels generates, rows and columns
inside the table, shape, dtype and size consistent, the optimizer rebuilt
through its constructor, the tables through :func:`~hbkernels.types.table_spec`);
files are opened only as regular files (never through a symbolic link, never a
device), their size and crc32 checked before use (small files read whole, large
ones memory-mapped), and every element of every shard must come from a file;
a save read through its files alone has each file's bytes and crc32 checked
against what its child names and its head against the layout of the newest
manifest (:func:`._packs.walk`). Anything else is a :class:`CheckpointError`
naming the file.
"""
import functools
import inspect
import io
import json
import math
import os
import shutil
import stat
import time
import uuid
import zlib

import numpy as np

from .. import optim as _optim
from .._dispatch import classify, host
from .._files import (READ_WHOLE, append_linked, fsync_dir, open_regular, read_regular, read_upto,
                      truncate_to, write_atomic)
from .._sorted import distinct, find_sorted
from .._version import __version__
from ..errors import CheckpointError
from ..quantize import QuantizedRows, unpack
from ..types import TableSpec, table_spec
from . import _manifest, _packs
from .kinds.row_wise import dynamic_owner
from .layout import initial_rows, shard_rows

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


class _Gathered:
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
    """The elements of ``array`` (a host array or a :class:`_Gathered`) in C order, as
    contiguous arrays: a :class:`_Gathered` a chunk of rows at a time."""
    return array.chunks() if isinstance(array, _Gathered) else [np.ascontiguousarray(array)]


@functools.lru_cache(maxsize=256)
def _npy_header(dtype, shape):
    """The ``.npy`` header (format 1.0, C order, no pickle) a save writes before the
    elements of an array of ``dtype`` and ``shape``: what ``np.save`` writes for it."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {
        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
        "shape": tuple(shape)})
    return buf.getvalue()


def _save_array(path, array):
    """``array`` as a ``.npy`` file (:func:`_npy_header`, then its elements in C order)
    written atomically, a :class:`_Gathered` a chunk at a time; returns (crc32, bytes)."""
    def write(f):
        w = _CrcWriter(f)
        w.write(_npy_header(array.dtype, array.shape))
        for chunk in _chunks(array):
            w.write(chunk)
        return w.crc, w.size
    return write_atomic(path, write)


def _save_pack(path, arrays, log=None):
    """``arrays`` (host arrays or :class:`_Gathered`) as one pack: a ``.npy`` header of a
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


def _write_manifest(path, text):
    """Manifest ``text`` into checkpoint directory ``path``, atomically."""
    write_atomic(os.path.join(path, MANIFEST), lambda f: f.write(text))


def _bytes_json(comm, obj):
    """Every rank's ``obj`` (JSON-able), in rank order."""
    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    if comm.world_size == 1:
        return [obj]
    blob, counts = comm.allgatherv(raw)
    blob, out, start = np.asarray(blob), [], 0
    for c in np.asarray(counts).tolist():
        out.append(json.loads(blob[start:start + c].tobytes().decode()))
        start += c
    return out


def _optimizer_json(opt):
    return {"type": type(opt).__name__,
            "options": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(opt).items()}}


@functools.lru_cache(maxsize=None)
def _constructor_options(cls):
    """The keyword arguments ``cls(...)`` takes (its own and, through ``**options``,
    those of the classes above it)."""
    names = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        names |= {p.name for p in params if p.name != "self" and p.kind != p.VAR_KEYWORD}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return frozenset(names)


def _optimizer_from_json(d, where):
    """The optimizer of manifest entry ``d``, made by its constructor (so its checks run);
    saved attributes the constructor does not take are derived ones and are dropped."""
    cls = getattr(_optim, str(d.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, _optim.SparseOptimizer)):
        raise CheckpointError(f"{where}: unknown optimizer {d.get('type')!r} in the manifest")
    accepted = _constructor_options(cls)
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in d["options"].items() if k in accepted}
    try:
        return cls(**options)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: bad {cls.__name__} options in the manifest ({e})") from None


def _changed_arrays(coll, shard, changed, since=None):
    """The rows of ``shard`` changed since the last save (``changed`` None: those a
    table in files holds): ``rows`` (table rows; a dynamic table's live ids), then
    their rows of the weights and of each optimizer slot; a dynamic table also writes
    what changed in its index since ``since[table]`` (:func:`_dynamic_changes`)."""
    fused = coll.arrays[shard.group]
    family = classify(fused.weights)[0]
    if not shard.group.dynamic:
        if changed is None:
            held = coll.tiers[shard.group].store.touched_rows()
            local = held[(held >= shard.base) & (held < shard.base + shard.num_rows)] - shard.base
        else:
            local = np.flatnonzero(host(changed[shard.group][shard.base:shard.base + shard.num_rows]))
        out = {"rows": shard_rows(shard)[local]}
        at = family.put(local + shard.base)
        if shard.group.storage == "mmap":  # rows of files: gathered as they are written
            out["weights"] = _Gathered(fused.weights, at)
            out.update({slot: _Gathered(fused.state[slot], at) for slot, _ in coll.optimizer.slots})
            return out
    else:
        table = coll.hash_tables[shard.table]
        out = _dynamic_changes(table, since[shard.table])
        rows = np.flatnonzero(host(changed[shard.group][shard.base:shard.base + table.capacity]))
        out["rows"], slots = table.live_at(rows)
        at = family.put(slots + shard.base)
    out["weights"] = fused.weights[at]
    out.update({slot: fused.state[slot][at] for slot, _ in coll.optimizer.slots})
    return out


def save(coll, path, parent=None, changed=None, since=None):
    """Write ``coll`` to directory ``path`` (collective; see the module doc); with
    ``parent`` (``(path, link)`` of the previous save: what this function returned as its
    link) only the rows marked in ``changed`` (fused group -> bool per row), and of each
    dynamic table what changed since ``since[table]`` (what the previous save returned),
    chained to it.
    Returns ``(its link: {"crc32": the manifest's crc32 on rank 0, None elsewhere, and
    of an incremental save "packs": [file, bytes, crc32, offset] of each rank's pack};
    the bytes the files written took, on every rank; {dynamic table: HashTable.mark()}
    of this rank's hash tables as saved)``."""
    comm, me = coll.comm, coll.comm.rank
    path = os.fspath(path)
    save_id = np.array([time.time_ns(), int(uuid.uuid4().int & 0x7FFFFFFF)], np.int64)
    if comm.world_size > 1:
        save_id = comm.broadcast(save_id, root=0)
    save_dir = _manifest.save_dir_name(save_id[0], save_id[1])
    index = {name: k for k, name in enumerate(coll.tables)}
    error = None
    files, parts, written, pack, grown = [], [], 0, None, None
    steps = {s.table: int(coll.arrays[s.group].state["step"][0]) for s in coll.local_shards()}
    kept, marks = {}, {}  # dynamic table -> HashTable.state() (full saves only), .mark()
    link = None if parent is None else dict(
        {"path": os.path.relpath(parent[0], os.path.abspath(path)), "crc32": parent[1]["crc32"]},
        **({"packs": parent[1]["packs"]} if parent[1].get("packs") else {}))
    try:
        if parent is None:  # every live id, sorted
            kept = {name: table.state() for name, table in coll.hash_tables.items()}
        marks = {name: table.mark() for name, table in coll.hash_tables.items()}
        os.makedirs(os.path.join(path, save_dir), exist_ok=True)
        for shard in coll.local_shards():
            if coll.plan[shard.table].kind == "data_parallel" and me != 0:
                continue  # replicas are identical: rank 0 writes the table
            arrays = (_changed_arrays(coll, shard, changed, since)
                      if parent is not None else
                      _dynamic_arrays(coll, shard, kept[shard.table]) if shard.group.dynamic else
                      _changed_arrays(coll, shard, None) if shard.group.storage == "mmap"
                      else coll.shard_arrays(shard))
            for name, part in arrays.items():
                part = part if isinstance(part, _Gathered) else host(part)
                rel = f"{save_dir}/{_manifest.file_name(index[shard.table], shard, name)}"
                files.append({"file": rel, "table": shard.table, "array": name,
                              "slice": shard.slice, "row_start": shard.row_start,
                              "row_step": shard.row_step, "num_rows": int(part.shape[0]),
                              "c0": shard.c0, "c1": shard.c1, "dtype": part.dtype.name,
                              "shape": list(part.shape)})
                if name == "codes" and shard.group.bits in _manifest.PACKED_BITS:
                    files[-1]["bits"] = shard.group.bits  # packed as the table holds them
                parts.append(part)
        if parent is not None and (files or me == 0):  # one pack per rank, rank 0's linked
            rel = f"{save_dir}/{_manifest.pack_name(me)}"
            for f in files:
                f["file"] = rel
            head = _packs.head(files, link if me == 0 else None)
            log = _log(parent, me)
            placed, size, whole, start, written = _save_pack(os.path.join(path, rel),
                                                             [head] + parts, log)
            grown = (log[0], log[1], written) if start else None  # appended to the parent's file
            for f, (offset, crc, nbytes) in zip(files, placed[1:]):
                f.update(offset=offset, crc32=crc, bytes=nbytes)
            pack = [rel, size, whole, start]
        else:
            for f, part in zip(files, parts):
                crc, size = _save_array(os.path.join(path, f["file"]), part)
                f.update(crc32=crc, bytes=size)
                written += size
        fsync_dir(os.path.join(path, save_dir))
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = f"rank {me}: {type(e).__name__}: {e}"
    everyone = _bytes_json(comm, {"error": error, "files": files, "steps": steps,
                                  "written": written, "pack": pack})
    errors = [r["error"] for r in everyone if r["error"]]
    if not errors and me == 0:
        steps = {t: s for r in everyone for t, s in r["steps"].items()}
        manifest = {
            "format": FORMAT, "version": VERSION, "hbkernels": __version__, "save": save_dir,
            "world_size": comm.world_size, "seed": coll.seed, "dedup": coll.dedup,
            "wire_dtype": coll.wire_dtype,
            "plan_request": coll.plan_request, "plan": coll.plan.to_json(),
            "batch_size_hint": coll.batch_size_hint,
            "optimizer": _optimizer_json(coll.optimizer),
            "tables": [dict(spec._asdict(), features=list(spec.features), step=steps[name])
                       for name, spec in coll.tables.items()],
            "files": [f for r in everyone for f in r["files"]],
        }
        if coll.quantize:
            manifest["quantize"] = coll.quantize
        if parent is not None:  # where the parent is, from here, and what it must hash to
            manifest["parent"] = link
        try:
            text, crc = _manifest.sealed_text(json.loads(json.dumps(manifest, default=float)))
            _write_manifest(path, text)
            fsync_dir(path)
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            errors.append(f"rank 0 writing {MANIFEST}: {type(e).__name__}: {e}")
    if comm.world_size > 1:
        errors = [e for r in _bytes_json(comm, {"errors": errors if me == 0 else []})
                  for e in r["errors"]]
    if errors:
        if grown is not None:  # the parent's file as it was
            truncate_to(*grown)
        if me == 0:
            shutil.rmtree(os.path.join(path, save_dir), ignore_errors=True)
        before = ("the previous checkpoint is kept" if os.path.exists(os.path.join(path, MANIFEST))
                  else "nothing was saved")
        raise CheckpointError(f"saving {path} failed, {before}: " + "; ".join(errors))
    if me == 0:
        _remove_old_saves(path, save_dir)
    if comm.world_size > 1:
        comm.barrier()
    written = sum(r["written"] for r in everyone)
    mine = {"crc32": crc if me == 0 else None}
    if parent is not None:
        mine["packs"] = [r["pack"] for r in everyone if r["pack"] is not None]
    return mine, written, marks


def _log(parent, rank):
    """``(file, bytes)``: the file of rank ``rank``'s pack of save ``parent`` (``(path,
    link)``) and where that pack ends, where the parent is an incremental save of format
    5 with such a pack; else None."""
    for name, size, _, *offset in parent[1].get("packs") or []:
        if offset and int(_manifest.PACK_FILE.fullmatch(name)[2]) == rank:
            return os.path.join(parent[0], name), offset[0] + size
    return None


def _dynamic_arrays(coll, shard, kept):
    """A dynamic table's shard by id: its live ``ids`` (ascending), their rows of the
    weights and of each optimizer slot, and their eviction scores ``last`` and ``count``."""
    fused = coll.arrays[shard.group]
    at = classify(fused.weights)[0].put(kept["slots"] + shard.base)
    out = {"ids": kept["ids"], "weights": fused.weights[at]}
    out.update({slot: fused.state[slot][at] for slot, _ in coll.optimizer.slots})
    out.update(last=kept["last"], count=kept["count"])
    if kept["pending"] is not None:
        out.update({f"pending_{k}": kept["pending"][k] for k in ("ids", "last", "count")})
    return out


def _newest_entries(keys, position):
    """``(entries, keys ascending)``: for each distinct key of ``keys`` the index of its
    newest entry, the one of least ``position`` (of one position the keys are distinct)."""
    order = np.lexsort((position, keys))  # by key, the newest first
    keys = keys[order]
    first = np.ones(order.shape[0], bool)
    first[1:] = keys[1:] != keys[:-1]
    return order[first], keys[first]


def _dynamic_changes(table, mark):
    """The index changes of dynamic table ``table`` (its ``HashTable``) since ``mark``
    (its :meth:`~hbkernels.HashTable.mark`): the ``ids`` used since (every admission is
    a use) with their ``last`` and ``count``, the ids ``evicted`` (live at the mark, not
    now), and the same of the pending ids (``pending_ids``, ``_last``, ``_count`` seen
    since; ``pending_removed``)."""
    changes = table.changes(mark)
    out = {k: changes[k] for k in ("ids", "last", "count", "evicted")}
    pending = changes["pending"]
    if pending is not None:
        out.update({f"pending_{k}": pending[k] for k in ("ids", "last", "count")})
        out["pending_removed"] = pending["evicted"]
    return out


def _remove_old_saves(path, keep):
    """Remove what earlier and crashed saves left in ``path``: save directories named as
    hbkernels names them and holding only files it names, and temporary manifests.
    Anything else (a user's ``save-notes/``, a symlink) is left alone."""
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        if entry.startswith(MANIFEST + ".tmp-") and _is_plain_file(full):
            os.remove(full)
        elif entry != keep and _manifest.is_save_dir(entry) and _holds_only_saved_files(full):
            shutil.rmtree(full, ignore_errors=True)


def _is_plain_file(name):
    try:
        return stat.S_ISREG(os.lstat(name).st_mode)
    except OSError:
        return False


def _holds_only_saved_files(directory):
    try:
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            return False
        names = os.listdir(directory)
    except OSError:
        return False
    return all(_is_plain_file(os.path.join(directory, n)) and
               (_manifest.FILE_NAME.fullmatch(n) or ".npy.tmp-" in n) for n in names)


def read_manifest(path):
    """The manifest of checkpoint ``path`` (dict), checked (see :mod:`._manifest`)."""
    return _read_manifest(path)[0]


def _read_manifest(path):
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


class _Reader:
    """Rows of the saved arrays, from the shard files (checked once, memory-mapped)."""

    def __init__(self, path, manifest, contents=None):
        self.path = os.fspath(path)
        self.files = {}
        for f in manifest["files"]:
            self.files.setdefault((f["table"], f["array"]), []).append(f)
        self._open = {}  # _entry_key -> array; ("sorted",) + _entry_key -> _sorted
        self._files = dict(contents or {})  # file -> _contents (those read already)

    def _contents(self, file):
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
        data = self._contents(entry["file"])
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


class Checkpoint:
    """Checkpoint ``path``, opened: its manifest read and checked; arrays are read
    (and their crc32 checked) only as shards ask for them."""

    def __init__(self, path, depth=0, child=None):
        self.path = os.fspath(path)
        self.manifest, sealed = _read_manifest(path)
        where = os.path.join(self.path, MANIFEST)

        def slots(optimizer):  # a parent's optimizer is its child's, as a rule: made once
            self._slots = (child._slots if child is not None and optimizer == child.manifest["optimizer"]
                           else dict(_optimizer_from_json(optimizer, where).slots))
            return self._slots

        entries = _manifest.check(self.manifest, where, slots, sealed)
        save = os.path.join(self.path, self.manifest["save"])
        try:
            is_dir = stat.S_ISDIR(os.lstat(save).st_mode)
        except OSError as e:
            raise CheckpointError(f"{save}: cannot read the save directory ({e.strerror or e})") from None
        if not is_dir:
            raise CheckpointError(f"{save}: not a directory (a symbolic link?); a checkpoint "
                                  f"reads only its own files")
        self._reader = _Reader(path, self.manifest)
        self._chain_parts = {}  # chain(last) -> its _parts
        self._specs = {}  # table -> (its manifest entry less its step, its TableSpec)
        for name, t in entries.items():
            entry = {k: v for k, v in t.items() if k != "step"}
            known = child._specs.get(name) if child is not None else None
            if known is None or known[0] != entry:
                try:
                    known = entry, table_spec(TableSpec(**entry))
                except (TypeError, ValueError) as e:
                    raise CheckpointError(f"{where}: table {name!r}: {e}") from None
            self._specs[name] = known
        self.tables = [spec for _, spec in self._specs.values()]
        self.steps = {name: t["step"] for name, t in entries.items()}
        self.version = self.manifest["version"]
        self.parent = self._open_parent(where, depth)

    def _open_parent(self, where, depth):
        """The checkpoint an incremental save chains to, checked to be the one it was
        chained to (its manifest's crc32), or None for a full save; the incremental
        saves of format 4 or later below it that hold its layout are opened through
        their packs alone (:func:`_packs.walk`, from this save's files where they are
        there: :class:`_PackSave`), the first save below them through its manifest."""
        link = self.manifest.get("parent")
        if link is None:
            return None
        limits = {spec.name: spec.capacity if spec.num_rows is None else spec.num_rows
                  for _, spec in self._specs.values()}
        packed = [f for f in self.manifest["files"] if "offset" in f] if self.version >= 4 else []
        run, path, link, depth = _packs.walk(self.path, link, packed, limits, depth, MAX_CHAIN,
                                             self._reader._contents)
        version = self.version if run is None else run.version
        if run is not None:
            where = os.path.join(path, run.names(len(run) - 1)[0])
        if depth >= MAX_CHAIN:
            raise CheckpointError(f"{where}: a chain of more than {MAX_CHAIN} incremental saves")
        parent = Checkpoint(os.path.normpath(os.path.join(path, link["path"])), depth + 1, self)
        if parent.version > version:
            raise CheckpointError(f"{where}: format version {version} chained to a save of "
                                  f"version {parent.version}")
        if parent.manifest.get("crc32") != link["crc32"]:
            raise CheckpointError(
                f"{os.path.join(parent.path, MANIFEST)}: not the save {where} was chained to "
                f"(crc32 {parent.manifest.get('crc32')!r}, the link says {link['crc32']}); "
                f"it was overwritten or edited")
        if run is None:
            return parent
        run.below = parent
        return _PackSave(run, 0, self.tables, self._specs, self._slots)

    def saved(self):
        """``{(table, array)}`` saved anywhere in the chain."""
        mine = {(f["table"], f["array"]) for f in self.manifest["files"]}
        return mine | (self.parent.saved() if self.parent is not None else set())

    def _sparse(self, table):
        """Table ``table`` was saved sparse (a table in files: rows named in ``rows``)."""
        return self.spec(table).storage == "mmap"

    def spec(self, table):
        """The saved :class:`~hbkernels.TableSpec` of ``table``."""
        return next(t for t in self.tables if t.name == table)

    def _fill(self, table, array, rows, c0, c1, out):
        """Rows ``rows`` of a static table's ``array`` as of this save: the full save's,
        then each incremental save's changed rows over them, oldest first (a sparse
        save's rows over what ``out`` holds)."""
        if self.parent is None:
            if self._sparse(table):
                self._reader.changed_rows(table, array, rows, c0, c1, out)
            else:
                self._reader.rows(table, array, rows, c0, c1, out)
            return
        self.parent._fill(table, array, rows, c0, c1, out)
        self._reader.changed_rows(table, array, rows, c0, c1, out)

    def _parts(self, last):
        """The saves of ``chain(last)`` in parts (computed once): ``(first, arrays, path,
        full)`` of each save opened through its manifest and of each run of
        :class:`_PackSave`: ``first`` is the index in the chain of its first save,
        ``arrays(table, array)`` gives ``(values, rows of each save)`` (None where the
        part has no such array), ``path`` is the directory of its oldest save and
        ``full`` whether that is a full save. (No part refers to a save, so a save
        holding its parts holds no cycle.)"""
        if last in self._chain_parts:
            return self._chain_parts[last]
        parts, save, k = [], self, 0
        while True:
            if isinstance(save, _PackSave):  # the rest of its run (no save of it is last)
                run = save.run
                parts.append((k, run.arrays, run.dirs[-1], False))
                k += len(run) - save.index
                save = run.below
                continue

            def arrays(table, array, reader=save._reader):
                if not reader.has(table, array):
                    return None
                values = reader.all_rows(table, array)
                return values, np.array([values.shape[0]])

            parts.append((k, arrays, save.path, save.parent is None))
            if last(save):
                break
            save, k = save.parent, k + 1
        self._chain_parts[last] = parts
        return parts

    def chain(self, last=None):
        """This save and its parents, newest first, to the first ``save`` where
        ``last(save)`` holds (default: the full save the chain starts from)."""
        saves, last = [self], last or _is_full
        while not last(saves[-1]):
            saves.append(saves[-1].parent)
        return saves

    def _dynamic(self, table, arrays, ids):
        """``{array: its rows for live ids}`` of a dynamic table's ``arrays`` as of this
        save: each id's from the newest save of the chain that wrote its row (one sort
        over the rows every save of the chain wrote, however long the chain)."""
        parts = self._parts(_is_full)
        keys, position, sizes = [], [], []
        for first, part, _, full in parts:
            values, rows = part(table, "ids" if full else "rows")
            keys.append(values)
            position.append(np.repeat(np.arange(first, first + rows.shape[0]), rows))
            sizes.append(values.shape[0])
        newest, keys = _newest_entries(np.concatenate(keys), np.concatenate(position))
        at, here = find_sorted(keys, ids)
        if not here.all():
            raise CheckpointError(f"{os.path.join(parts[-1][2], MANIFEST)}: no saved "
                                  f"{arrays[0]} for id {int(ids[~here][0])} of table {table!r}")
        at = newest[at]  # into the parts' rows, one after another: the full save's last
        start = sum(sizes[:-1])  # of the full save's rows
        older = at - start
        newer = np.flatnonzero(older < 0)  # ids whose row an incremental save wrote
        out = {}
        for array in arrays:
            data = parts[-1][1](table, array)[0]
            out[array] = (data[np.maximum(older, 0)] if data.shape[0] else
                          np.empty((at.shape[0],) + data.shape[1:], data.dtype))
            if newer.size:
                data = np.concatenate([part(table, array)[0] for _, part, _, _ in parts[:-1]])
                out[array][newer] = data[at[newer]]
        return out

    def constructor_args(self, **overrides):
        """The saved constructor arguments of the collection (``plan``,
        ``batch_size_hint``, ``wire_dtype``, ``seed``, ``dedup``, ``optimizer``, and
        ``quantize`` of a quantized collection),
        with ``overrides`` replacing them."""
        m = self.manifest
        kwargs = {"plan": m["plan_request"], "batch_size_hint": m["batch_size_hint"],
                  "wire_dtype": m["wire_dtype"], "seed": m["seed"], "dedup": m["dedup"]}
        if m.get("quantize"):
            kwargs["quantize"] = m["quantize"]
        if "optimizer" not in overrides:
            kwargs["optimizer"] = _optimizer_from_json(m["optimizer"], os.path.join(self.path, MANIFEST))
        kwargs.update(overrides)
        return kwargs

    def initial_weights(self, shard, rows):
        """The saved weights of rows ``rows`` of ``shard`` (its columns); a sparse
        table's rows it did not save are remade from the seed; a quantized table's
        :class:`~hbkernels.quantize.QuantizedRows`."""
        if shard.table in self.manifest.get("quantize", {}):
            codes = np.empty((rows.shape[0], shard.c1 - shard.c0), np.uint8)
            self._fill(shard.table, "codes", rows, shard.c0, shard.c1, codes)
            scale, bias = (np.empty(rows.shape[0], np.float32) for _ in range(2))
            self._fill(shard.table, "scale", rows, shard.c0, shard.c1, scale)
            self._fill(shard.table, "bias", rows, shard.c0, shard.c1, bias)
            self._check_quantized(shard.table, rows, codes, scale, bias)
            return QuantizedRows(codes, scale.astype(np.float16), bias.astype(np.float16))
        if self._sparse(shard.table):
            out = initial_rows(self.spec(shard.table), self.manifest["seed"], rows, shard.c0, shard.c1)
        else:
            out = np.empty((rows.shape[0], shard.c1 - shard.c0), shard.group.dtype)
        self._fill(shard.table, "weights", rows, shard.c0, shard.c1, out)
        return out

    def _check_quantized(self, table, rows, codes, scale, bias):
        """A CheckpointError unless the saved codes fit the table's bits and its scales
        and biases are finite float16 values (scale >= 0), as a save writes them."""
        levels = (1 << self.manifest["quantize"][table]) - 1
        with np.errstate(over="ignore", invalid="ignore"):
            bad = (codes > levels).any(axis=1) | ~(scale >= 0)
            for v in (scale, bias):  # finite float16 values
                bad |= ~np.isfinite(v) | (v.astype(np.float16).astype(np.float32) != v)
        if bad.any():
            raise CheckpointError(f"{os.path.join(self.path, MANIFEST)}: table {table!r}, row "
                                  f"{int(rows[np.argmax(bad)])}: codes beyond "
                                  f"{self.manifest['quantize'][table]} bits, or a scale or bias "
                                  f"that is not a float16 (scale >= 0)")

    def saved_rows(self, table):
        """The rows of sparse table ``table`` some save of the chain holds, ascending."""
        rows = [np.asarray(self._reader.all_rows(table, "rows"))] if self._reader.has(table, "rows") else []
        if self.parent is not None:
            rows.append(self.parent.saved_rows(table))
        return distinct(np.concatenate(rows)) if rows else np.zeros(0, np.int64)

    def restore_state(self, coll):
        """Write the saved optimizer state of every shard ``coll``'s rank holds into its
        state arrays (slots the checkpoint has for the table; others keep their
        initial values), and each fused array's step; a dynamic table's ids go to
        the ranks that own them now, with their rows, state and scores."""
        saved = self.saved()
        for group, fused in coll.arrays.items():
            shards = coll.local_shards(group)
            fused.state["step"][0] = max([self.steps[s.table] for s in shards] or [0])
            if group.bits:  # codes, scales and biases only (initial_weights)
                continue
            if group.dynamic:
                for shard in shards:
                    self._restore_dynamic(coll, shard.table, saved)
                continue
            if group.storage == "mmap":
                for shard in shards:
                    self._restore_files(coll, shard, saved)
                continue
            for slot, _ in coll.optimizer.slots:
                state = host(fused.state[slot]).copy()
                for shard in shards:
                    if (shard.table, slot) in saved:
                        self._fill(shard.table, slot, shard_rows(shard), shard.c0, shard.c1,
                                   state[shard.base:shard.base + shard.num_rows])
                target = fused.state[slot]
                target[...] = classify(target)[0].put(state)

    def _restore_files(self, coll, shard, saved):
        """Write the saved rows of sparse ``shard`` (weights and state) into its store;
        its other rows are made as they are touched."""
        every = self.saved_rows(shard.table)
        k, rem = np.divmod(every - shard.row_start, shard.row_step)
        every = every[(rem == 0) & (k >= 0) & (k < shard.num_rows)]
        store = coll.tiers[shard.group].store
        for s in range(0, every.shape[0], CHUNK_ROWS):  # a chunk of rows in memory at a time
            rows = every[s:s + CHUNK_ROWS]
            state = {}
            for slot, per_row in coll.optimizer.slots:
                shape = (rows.shape[0],) if per_row else (rows.shape[0], shard.c1 - shard.c0)
                state[slot] = np.empty(shape, np.float32)
                state[slot][...] = store.fresh[slot]
                if (shard.table, slot) in saved:
                    self._fill(shard.table, slot, rows, shard.c0, shard.c1, state[slot])
            local = (rows - shard.row_start) // shard.row_step
            store.write(local + shard.base, self.initial_weights(shard, rows), state)

    def _restore_dynamic(self, coll, name, saved):
        """Dynamic table ``name``'s ids, scores, pending ids, rows and state as of this
        save, the ids this rank owns now handed to
        :meth:`EmbeddingCollection.restore_dynamic`."""
        ids, last, count = self._dynamic_index(name, "")
        mine = dynamic_owner(np, ids, coll.comm.world_size) == coll.comm.rank
        arrays = ["weights"] + [slot for slot, _ in coll.optimizer.slots if (name, slot) in saved]
        rows = self._dynamic(name, arrays, ids[mine])  # only the rows it keeps
        pending = self._dynamic_index(name, "pending_") if (name, "pending_ids") in saved else None
        clock = int(last.max()) if last.shape[0] else 0  # every rank's ids: one clock for all shares
        coll.restore_dynamic(name, ids[mine], last[mine], count[mine], rows, pending, clock)

    def _lists_every_id(self):
        """This save lists a dynamic table's every live and pending id: a full save, or
        an incremental one of format version 1."""
        return self.parent is None or self.version < 2

    def _dynamic_index(self, name, kind):
        """``(ids ascending, last, count)`` of dynamic table ``name``'s live ids (``kind``
        ``""``) or pending ids (``"pending_"``) as of this save: those of the newest save
        of the chain that lists every id, then each later save's changes (an id's newest
        entry wins: used, with its scores, or ``evicted`` / ``pending_removed``)."""
        parts = self._parts(Checkpoint._lists_every_id)
        gone = "evicted" if kind == "" else "pending_removed"
        ids, last, count, alive, position = [], [], [], [], []  # newest save first
        for k, (first, arrays, path, _) in enumerate(parts):  # position: 2 x its save (+1 if gone)
            listed = [arrays(name, f"{kind}{a}") for a in ("ids", "last", "count")]
            dropped = arrays(name, gone) if k < len(parts) - 1 else None
            if listed[0] is not None:
                ids.append(listed[0][0])
                last.append(listed[1][0])
                count.append(listed[2][0])
                alive.append(np.ones(ids[-1].shape[0], bool))
                position.append(np.repeat(2 * np.arange(first, first + listed[0][1].shape[0]),
                                          listed[0][1]))
            if dropped is not None:
                ids.append(dropped[0])
                last.append(np.zeros_like(dropped[0]))
                count.append(np.zeros_like(dropped[0]))
                alive.append(np.zeros(dropped[0].shape[0], bool))
                position.append(np.repeat(2 * np.arange(first, first + dropped[1].shape[0]) + 1,
                                          dropped[1]))
        every = ids[-1] if listed[0] is not None else np.zeros(0, np.int64)
        if distinct(every).shape[0] != every.shape[0]:  # the save listing every id
            raise CheckpointError(f"{os.path.join(path, MANIFEST)}: table {name!r} has an "
                                  f"id saved twice")
        if not ids:
            return tuple(np.zeros(0, np.int64) for _ in range(3))
        newest, _ = _newest_entries(np.concatenate(ids), np.concatenate(position))
        newest = newest[np.concatenate(alive)[newest]]
        return tuple(np.concatenate(a)[newest] for a in (ids, last, count))


class _PackSave(Checkpoint):
    """Save ``s`` of :class:`_packs.Run` ``run``: an incremental save of format 4 or
    later opened through its packs alone, below the save whose manifest was read, whose
    ``tables`` (``specs``, optimizer ``slots``) and layout it holds. Its parent is made
    when asked for."""

    def __init__(self, run, s, tables, specs, slots):  # no manifest to read: see the class
        self.run, self.index, self.path, self.version = run, s, run.dirs[s], run.version
        self.tables, self._specs, self._slots = tables, specs, slots
        self._chain_parts = {}

    @functools.cached_property
    def parent(self):
        s = self.index + 1
        return (self.run.below if s == len(self.run) else
                _PackSave(self.run, s, self.tables, self._specs, self._slots))

    @functools.cached_property
    def _reader(self):
        entries, contents = self.run.save(self.index)
        return _Reader(self.path, {"files": entries}, contents)

    def saved(self):
        return {(e["table"], e["array"]) for e in self.run.entries} | self.run.below.saved()


def _is_full(save):
    """``save`` is a full save (its chain starts there)."""
    return save.parent is None
