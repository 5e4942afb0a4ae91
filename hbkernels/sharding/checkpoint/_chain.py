"""A checkpoint opened (:class:`Checkpoint`): its manifest read and checked, the saves it
chains to opened, through their manifests or, below the newest save, through their
packs alone (:class:`_PackSave`), and the rows of the saved arrays read through the
chain, each from the newest save that wrote it."""
import functools
import os
import stat

import numpy as np

from ..._sorted import distinct, find_sorted
from ...errors import CheckpointError
from ...types import TableSpec, table_spec
from . import _manifest, _packs
from ._format import MANIFEST, MAX_CHAIN, Reader, read_manifest_sealed
from ._restore import Restore, optimizer_from_json


class Checkpoint(Restore):
    """Checkpoint ``path``, opened: its manifest read and checked; arrays are read
    (and their crc32 checked) only as shards ask for them."""

    def __init__(self, path, depth=0, child=None):
        self.path = os.fspath(path)
        self.manifest, sealed = read_manifest_sealed(path)
        where = os.path.join(self.path, MANIFEST)

        def slots(optimizer):  # a parent's optimizer is its child's, as a rule: made once
            self._slots = (child._slots if child is not None and optimizer == child.manifest["optimizer"]
                           else dict(optimizer_from_json(optimizer, where).slots))
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
        self._reader = Reader(path, self.manifest)
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
                                             self._reader.contents)
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

    def sparse(self, table):
        """Table ``table`` was saved sparse (a table in files: rows named in ``rows``)."""
        return self.spec(table).storage == "mmap"

    def spec(self, table):
        """The saved :class:`~hbkernels.TableSpec` of ``table``."""
        return next(t for t in self.tables if t.name == table)

    def fill(self, table, array, rows, c0, c1, out):
        """Rows ``rows`` of a static table's ``array`` as of this save: the full save's,
        then each incremental save's changed rows over them, oldest first (a sparse
        save's rows over what ``out`` holds)."""
        if self.parent is None:
            if self.sparse(table):
                self._reader.changed_rows(table, array, rows, c0, c1, out)
            else:
                self._reader.rows(table, array, rows, c0, c1, out)
            return
        self.parent.fill(table, array, rows, c0, c1, out)
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

    def dynamic_rows(self, table, arrays, ids):
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

    def saved_rows(self, table):
        """The rows of sparse table ``table`` some save of the chain holds, ascending."""
        rows = [np.asarray(self._reader.all_rows(table, "rows"))] if self._reader.has(table, "rows") else []
        if self.parent is not None:
            rows.append(self.parent.saved_rows(table))
        return distinct(np.concatenate(rows)) if rows else np.zeros(0, np.int64)

    def _lists_every_id(self):
        """This save lists a dynamic table's every live and pending id: a full save, or
        an incremental one of format version 1."""
        return self.parent is None or self.version < 2

    def dynamic_index(self, name, kind):
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
        return Reader(self.path, {"files": entries}, contents)

    def saved(self):
        return {(e["table"], e["array"]) for e in self.run.entries} | self.run.below.saved()


def _is_full(save):
    """``save`` is a full save (its chain starts there)."""
    return save.parent is None


def _newest_entries(keys, position):
    """``(entries, keys ascending)``: for each distinct key of ``keys`` the index of its
    newest entry, the one of least ``position`` (of one position the keys are distinct)."""
    order = np.lexsort((position, keys))  # by key, the newest first
    keys = keys[order]
    first = np.ones(order.shape[0], bool)
    first[1:] = keys[1:] != keys[:-1]
    return order[first], keys[first]
