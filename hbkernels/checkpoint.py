"""Checkpoints of an :class:`~hbkernels.EmbeddingCollection`: ``.npy`` arrays plus a
JSON manifest, no pickle, written atomically, loadable at any world size.

Layout of a checkpoint directory::

    manifest.json              # format, tables, optimizer, plan, files (+ crc32 each)
    <save id>/<table>.<slice>.<rows>.<array>.npy

Each ``.npy`` holds one shard of one array (``weights`` or an optimizer slot):
rows ``row_start + row_step * k`` (``k < num_rows``), columns ``[c0, c1)`` of
the table. A replicated table is written once, by rank 0.

Saving (collective): every rank writes its shards into a fresh ``<save id>``
directory (each file through a temp name, fsync, rename), the ranks agree,
then rank 0 writes ``manifest.json`` the same way and only then removes older
save directories. A crash at any point leaves the previous manifest, and the
files it names, intact. Loading reads, on every rank, only the rows its new
shards need (memory-mapped), after checking the crc32 of each file it opens:
a missing, truncated or corrupt file raises :class:`CheckpointError` naming it.
"""
import json
import os
import shutil
import time
import uuid
import zlib

import numpy as np

from . import __version__ as _version
from . import optim as _optim
from .errors import CheckpointError
from .types import TableSpec

FORMAT = "hbkernels-embedding-collection"
VERSION = 1
MANIFEST = "manifest.json"
_CHUNK = 1 << 22


class _CrcWriter:
    """A write-only file object that keeps the crc32 of what went through it."""

    def __init__(self, f):
        self.f, self.crc, self.size = f, 0, 0

    def write(self, data):
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self.f.write(view)


def fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path, write):
    """``write(fileobj)`` into ``path`` via a temp file, fsync and rename."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            out = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return out


def write_json_atomic(path, obj):
    """``obj`` as indented JSON (non-JSON numbers such as NumPy floats as float) in
    ``path``, atomically (:func:`write_atomic`)."""
    text = (json.dumps(obj, indent=1, default=float) + "\n").encode()
    write_atomic(path, lambda f: f.write(text))


def _save_array(path, array):
    """``np.save`` (no pickle) atomically; returns (crc32, bytes)."""
    def write(f):
        w = _CrcWriter(f)
        np.save(w, np.ascontiguousarray(array), allow_pickle=False)
        return w.crc, w.size
    return write_atomic(path, write)


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


def _optimizer_from_json(d):
    cls = getattr(_optim, d["type"], None)
    if not (isinstance(cls, type) and issubclass(cls, _optim.SparseOptimizer)):
        raise CheckpointError(f"unknown optimizer {d['type']!r} in the manifest")
    opt = cls.__new__(cls)
    opt.__dict__.update({k: tuple(v) if isinstance(v, list) else v for k, v in d["options"].items()})
    return opt


def save(coll, path):
    """Write ``coll`` to directory ``path`` (collective; see the module doc)."""
    comm, me = coll.comm, coll.comm.rank
    path = os.fspath(path)
    save_id = np.array([time.time_ns(), int(uuid.uuid4().int & 0x7FFFFFFF)], np.int64)
    if comm.world_size > 1:
        save_id = comm.broadcast(save_id, root=0)
    save_dir = f"save-{int(save_id[0])}-{int(save_id[1]):08x}"
    error = None
    files = []
    steps = {s.table: int(coll.groups[s.group]["state"]["step"][0]) for s in coll.local_shards()}
    try:
        os.makedirs(os.path.join(path, save_dir), exist_ok=True)
        for shard in coll.local_shards():
            if coll.plan[shard.table].kind == "data_parallel" and me != 0:
                continue  # replicas are identical: rank 0 writes the table
            fused = coll.groups[shard.group]
            arrays = {"weights": fused["weights"]}
            arrays.update({slot: fused["state"][slot] for slot, _ in coll.optimizer.slots})
            for name, array in arrays.items():
                part = array[shard.base:shard.base + shard.num_rows]
                part = part if isinstance(part, np.ndarray) else part.get()
                rel = (f"{save_dir}/{shard.table}.{shard.slice}.{shard.row_start}-{shard.row_step}"
                       f".{name}.npy")
                crc, size = _save_array(os.path.join(path, rel), part)
                files.append({"file": rel, "table": shard.table, "array": name,
                              "slice": shard.slice, "row_start": shard.row_start,
                              "row_step": shard.row_step, "num_rows": shard.num_rows,
                              "c0": shard.c0, "c1": shard.c1, "dtype": part.dtype.name,
                              "shape": list(part.shape), "crc32": crc, "bytes": size})
        fsync_dir(os.path.join(path, save_dir))
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = f"rank {me}: {type(e).__name__}: {e}"
    everyone = _bytes_json(comm, {"error": error, "files": files, "steps": steps})
    errors = [r["error"] for r in everyone if r["error"]]
    if errors:
        if me == 0:
            shutil.rmtree(os.path.join(path, save_dir), ignore_errors=True)
        raise CheckpointError(f"saving {path} failed, the previous checkpoint is kept: "
                              + "; ".join(errors))
    if me == 0:
        steps = {t: s for r in everyone for t, s in r["steps"].items()}
        manifest = {
            "format": FORMAT, "version": VERSION, "hbkernels": _version, "save": save_dir,
            "world_size": comm.world_size, "seed": coll.seed, "dedup": coll.dedup,
            "wire_dtype": coll.wire_dtype,
            "plan_request": coll.plan_request, "plan": coll.plan.to_json(),
            "batch_size_hint": coll.batch_size_hint,
            "optimizer": _optimizer_json(coll.optimizer),
            "tables": [dict(spec._asdict(), features=list(spec.features), step=steps[name])
                       for name, spec in coll.tables.items()],
            "files": [f for r in everyone for f in r["files"]],
        }
        write_json_atomic(os.path.join(path, MANIFEST), manifest)
        fsync_dir(path)
        for entry in os.listdir(path):  # older saves and leftovers of crashed ones
            if entry.startswith("save-") and entry != save_dir:
                shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
    if comm.world_size > 1:
        comm.barrier()


def read_manifest(path):
    """The manifest of checkpoint ``path`` (dict), checked."""
    name = os.path.join(os.fspath(path), MANIFEST)
    try:
        with open(name, "rb") as f:
            manifest = json.loads(f.read().decode())
    except FileNotFoundError:
        raise CheckpointError(f"{name}: no checkpoint manifest here") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{name}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{name}: not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{name}: format version {manifest.get('version')!r}, "
                              f"this hbkernels reads {VERSION}")
    return manifest


class _Reader:
    """Rows of the saved arrays, from the shard files (checked once, memory-mapped)."""

    def __init__(self, path, manifest):
        self.path = os.fspath(path)
        self.files = {}
        for f in manifest["files"]:
            self.files.setdefault((f["table"], f["array"]), []).append(f)
        self._open = {}

    def _array(self, entry):
        name = os.path.join(self.path, entry["file"])
        if name in self._open:
            return self._open[name]
        crc = 0
        try:
            with open(name, "rb") as f:
                size = 0
                while chunk := f.read(_CHUNK):
                    crc = zlib.crc32(chunk, crc)
                    size += len(chunk)
        except OSError as e:
            raise CheckpointError(f"{name}: cannot read checkpoint file ({e.strerror or e})") from None
        if size != entry["bytes"] or crc != entry["crc32"]:
            raise CheckpointError(f"{name}: checkpoint file is corrupt (crc32 {crc:08x}, {size} bytes; "
                                  f"the manifest says {entry['crc32']:08x}, {entry['bytes']} bytes)")
        try:
            arr = np.load(name, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise CheckpointError(f"{name}: not a valid .npy file ({e})") from None
        if list(arr.shape) != entry["shape"] or arr.dtype.name != entry["dtype"]:
            raise CheckpointError(f"{name}: holds {arr.shape} {arr.dtype.name}, the manifest says "
                                  f"{tuple(entry['shape'])} {entry['dtype']}")
        self._open[name] = arr
        return arr

    def rows(self, table, array, rows, c0, c1, out):
        """Fill ``out`` ([len(rows), c1 - c0], or [len(rows)] per-row) with saved rows."""
        filled = np.zeros(rows.shape[0], bool)
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
            else:
                out[np.flatnonzero(hit), lo - c0:hi - c0] = data[k[hit], lo - entry["c0"]:hi - entry["c0"]]
            filled |= hit
        if not filled.all():
            missing = int(rows[np.flatnonzero(~filled)[0]])
            raise CheckpointError(f"{self.path}: no saved {array} for row {missing} of table {table!r}")


def load(path, comm=None, **overrides):
    """An :class:`~hbkernels.EmbeddingCollection` from checkpoint ``path``, sharded
    for ``comm`` (any world size). ``overrides``: constructor arguments to change
    (``plan``, ``optimizer``, ``batch_size_hint``, ``wire_dtype``, ``device``, ...);
    by default the saved ones (the plan request is planned again for this world)."""
    from .embedding_collection import EmbeddingCollection

    manifest = read_manifest(path)
    reader = _Reader(path, manifest)
    tables = [TableSpec(**{k: v for k, v in t.items() if k != "step"}) for t in manifest["tables"]]
    steps = {t["name"]: int(t["step"]) for t in manifest["tables"]}
    kwargs = {"plan": manifest["plan_request"], "batch_size_hint": manifest["batch_size_hint"],
              "wire_dtype": manifest["wire_dtype"], "seed": manifest["seed"],
              "dedup": manifest["dedup"], "optimizer": _optimizer_from_json(manifest["optimizer"])}
    kwargs.update(overrides)

    def initial(shard, rows):
        out = np.empty((rows.shape[0], shard.c1 - shard.c0), shard.group[1])
        reader.rows(shard.table, "weights", rows, shard.c0, shard.c1, out)
        return out

    coll = EmbeddingCollection(tables, comm=comm, _initial=initial, **kwargs)
    for group, fused in coll.groups.items():
        space = coll._space(group[2])
        for slot, per_row in coll.optimizer.slots:
            saved = [f for f in manifest["files"] if f["array"] == slot]
            state = space.host(fused["state"][slot]).copy()
            for shard in coll.local_shards(group):
                rows = shard.row_start + shard.row_step * np.arange(shard.num_rows, dtype=np.int64)
                if any(f["table"] == shard.table for f in saved):
                    reader.rows(shard.table, slot, rows, shard.c0, shard.c1,
                                state[shard.base:shard.base + shard.num_rows])
            fused["state"][slot][...] = space.put(state)
        fused["state"]["step"][0] = max([steps[s.table] for s in coll.local_shards(group)] or [0])
    return coll
