"""Saving a collection (:func:`save`, collective): every rank's shards as ``.npy`` files
(a full save) or as one pack per rank chained to the previous save (an incremental
save: the rows changed since, and what changed in each dynamic table's index), then
rank 0's manifest, then the removal of what earlier and crashed saves left."""
import json
import os
import shutil
import stat
import time
import uuid

import numpy as np

from ..._dispatch import classify, host
from ..._files import fsync_dir, truncate_to
from ..._version import __version__
from ...errors import CheckpointError
from ..layout import shard_rows
from . import _manifest, _packs
from ._format import FORMAT, MANIFEST, VERSION, Gathered, save_array, save_pack, write_manifest


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
            out["weights"] = Gathered(fused.weights, at)
            out.update({slot: Gathered(fused.state[slot], at) for slot, _ in coll.optimizer.slots})
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
    """Write ``coll`` to directory ``path`` (collective; see
    :mod:`hbkernels.sharding.checkpoint`); with ``parent`` (``(path, link)`` of the
    previous save: what this function returned as its link) only the rows marked in
    ``changed`` (fused group -> bool per row), and of each dynamic table what changed
    since ``since[table]`` (what the previous save returned), chained to it.
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
                part = part if isinstance(part, Gathered) else host(part)
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
            placed, size, whole, start, written = save_pack(os.path.join(path, rel),
                                                             [head] + parts, log)
            grown = (log[0], log[1], written) if start else None  # appended to the parent's file
            for f, (offset, crc, nbytes) in zip(files, placed[1:]):
                f.update(offset=offset, crc32=crc, bytes=nbytes)
            pack = [rel, size, whole, start]
        else:
            for f, part in zip(files, parts):
                crc, size = save_array(os.path.join(path, f["file"]), part)
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
            write_manifest(path, text)
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
