"""The records of incremental saves (formats 4 and 5), and chains of them read through
these records alone.

Each rank of an incremental save writes one *pack*: a ``.npy`` of bytes, each array at
an offset from the pack's start that is a multiple of :data:`ALIGN`. Its first array is
the pack's *head*: :data:`HEAD` (the magic, how many arrays follow, the crc32 of their
:func:`layout`, the bytes of the link), the number of rows of each array (int64),
then, in rank 0's pack, the save's link to its parent (what the manifest's ``parent``
says, :func:`~._manifest.check_link`, in binary: :data:`LINK`, a :data:`PACK` for each
of the parent's packs, the parent's save directory, the path to the parent). Each
array's place follows from its rows and the layout, so the head is all a reader needs
besides the layout.

In format 4 a pack is a file of its own, ``r<rank>.pack.npy`` of the save directory.
In format 5 it is the bytes ``[offset, offset + bytes)`` of that file: where the
parent's pack of the same rank ended its file, the save appends its pack to that
file, at the next multiple of :data:`ALIGN`, under a second name (a hard link,
:func:`~hbkernels._files.append_linked`), so a chain of saves makes one file per rank
(a *log*), each save's name for it holding its own pack and every pack before it.

The manifest of a save names its parent's packs (file, bytes, crc32, and from format
5 offset) where the parent is an incremental save of format 4 or later, so a load
opens such a parent through its packs alone, and the parent's head names the packs of
its own parent: :func:`walk` follows a chain from one checked manifest, each pack
checked against the bytes and crc32 its child names, the rows of every save checked
against the layout of the newest save's checked manifest. A pack is taken from the
file its child's pack came from where the bytes at its offset there hold what the
link names (a log: one file read for the whole chain), else from its own file.
:class:`Run` holds what it read and gathers an array of every save of the run at once.
"""
import json
import os
import struct
import zlib

import numpy as np

from ..._files import read_regular
from ...errors import CheckpointError
from . import _manifest

ALIGN = 64  # byte alignment of each array in a pack
HEAD = struct.Struct("<8sIII4x")  # magic, arrays, crc32 of their layout, bytes of the link
LINK = struct.Struct("<IIHH")  # the parent manifest's crc32, its packs, bytes of its save
#                                directory's name and of the path to it
PACK = struct.Struct("<IIQQ")  # one of the parent's packs: its rank, crc32, bytes, offset
PACKS = {b"hbkpack4": struct.Struct("<IIQ"), b"hbkpack5": PACK}  # magic -> its PACK
VERSIONS = {b"hbkpack4": 4, b"hbkpack5": 5}  # magic -> the checkpoint format of its save
MAGIC = b"hbkpack5"
_NPY = struct.Struct("<8sH")  # a .npy file's magic and version 1.0, then its header's bytes
_NPY_MAGIC = b"\x93NUMPY\x01\x00"


def layout(entries):
    """The crc32 of what the manifest ``entries`` of one pack hold, less their rows:
    table, array, slice, rows of the shard, columns, dtype and dimensions, in order."""
    keys = [[e["table"], e["array"], e["slice"], e["row_start"], e["row_step"], e["c0"],
             e["c1"], e["dtype"], len(e["shape"])] for e in entries]
    return zlib.crc32(json.dumps(keys).encode())


def _link(link):
    """``(path, crc32, save directory, ((rank, crc32, bytes, offset) of each pack),
    ranks)`` of a manifest's checked ``link`` (no directory, no packs: a parent that has
    none; offset None: a pack of format 4, a whole file)."""
    named = [(_manifest.PACK_FILE.fullmatch(p[0]), p[1], p[2], p[3] if len(p) > 3 else None)
             for p in link.get("packs") or []]
    packs = tuple((int(m[2]), crc, size, offset) for m, size, crc, offset in named)
    return (link["path"], link["crc32"], named[0][0][1] if named else "", packs,
            tuple(p[0] for p in packs))


def head(entries, link):
    """The head of a pack holding the arrays of manifest ``entries`` (their
    ``num_rows`` set), with ``link`` (a manifest's link, or None but in rank 0's pack)."""
    text = b""
    if link is not None:
        path, crc, directory, packs, _ = _link(link)
        path, directory = path.encode(), directory.encode()
        text = (LINK.pack(crc, len(packs), len(directory), len(path))
                + b"".join(PACK.pack(rank, c, size, offset or 0) for rank, c, size, offset in packs)
                + directory + path)
    rows = np.array([e["num_rows"] for e in entries], np.int64)
    return np.frombuffer(HEAD.pack(MAGIC, len(entries), layout(entries), len(text))
                         + rows.tobytes() + text, np.uint8)


def _read_link(raw, at, size, pack, where):
    """The link (as :func:`_link` gives it) of ``size`` bytes at ``at`` of a head's
    bytes ``raw``, its parent's packs each a ``pack`` (:data:`PACKS`), checked (the file
    ``where()`` names)."""
    try:
        crc, n, dir_bytes, path_bytes = LINK.unpack_from(raw, at)
        at += LINK.size
        packs = tuple(pack.iter_unpack(raw[at:at + n * pack.size]))
        if pack is not PACK:
            packs = tuple(p + (None,) for p in packs)
        at += n * pack.size
        directory = str(raw[at:at + dir_bytes], "ascii")
        path = str(raw[at + dir_bytes:at + dir_bytes + path_bytes], "utf-8")
    except (struct.error, ValueError) as e:  # UnicodeDecodeError included
        raise CheckpointError(f"{where()}: unreadable link in its head ({e})") from None
    ranks = tuple([p[0] for p in packs])
    if (LINK.size + n * pack.size + dir_bytes + path_bytes != size or not path or "\0" in path
            or (n and not _manifest.is_save_dir(directory))
            or (n > 1 and list(ranks) != sorted(set(ranks)))):
        raise CheckpointError(f"{where()}: unreadable link in its head (its parent {path!r}, "
                              f"directory {directory!r}, ranks {ranks})")
    return path, crc, directory, packs, ranks


def _align(n):
    return -(-n // ALIGN) * ALIGN


def _row_bytes(entry):
    """Bytes of one row of the array of manifest ``entry``."""
    cols = 1 if len(entry["shape"]) == 1 else entry["c1"] - entry["c0"]
    return cols * np.dtype(entry["dtype"]).itemsize


def _read(name, child):
    """The bytes of the file ``name`` holding a pack ``child`` names: a regular file,
    read whole or memory-mapped (:func:`~hbkernels._files.read_regular`)."""
    try:
        return read_regular(name)
    except FileNotFoundError:
        raise CheckpointError(f"{name}: missing; the save {child} chains to was overwritten "
                              f"or removed") from None
    except OSError as e:
        raise CheckpointError(f"{name}: cannot read checkpoint file ({e.strerror or e})") from None


def _pack(data, size, crc, offset):
    """Bytes ``[offset, offset + size)`` of a file's bytes ``data`` where they have crc32
    ``crc`` (offset None: ``data`` whole, of ``size`` bytes), else None."""
    if offset is None:
        return data if len(data) == size and zlib.crc32(data) == crc else None
    if data is None or len(data) < offset + size:
        return None
    data = data[offset:offset + size]
    return data if zlib.crc32(data) == crc else None


class Run:
    """Incremental saves of format 4 or later, newest first, read through their packs by
    :func:`walk`: ``dirs`` (each save's directory), ``names`` (its packs' names, from
    that directory: :meth:`names`), ``rows`` ([saves, arrays of the layout]),
    ``offsets`` (where each array is in its pack) and ``version`` (the oldest format of
    its saves). ``entries`` is the layout: the newest manifest's entries, each with
    ``pack`` (the index of its file among a save's packs, of ranks ``ranks``) and
    ``limit`` (the most rows it may hold). Its opener sets ``below``, the save its
    oldest chains to."""

    def __init__(self, entries, ranks):
        self.entries, self.ranks = entries, ranks
        mine = [[e for e in entries if e["pack"] == k] for k in range(len(ranks))]
        self._heads = [(len(m), layout(m)) for m in mine]  # what each pack's head says
        self._rows_of = [struct.Struct(f"<{len(m)}q") for m in mine]  # its rows, in the head
        first = np.cumsum([0] + [len(m) for m in mine])
        self._order = np.array([first[e["pack"]] + mine[e["pack"]].index(e) for e in entries],
                               np.int64)  # each entry's place in a save's heads, one after another
        self._pack = np.array([e["pack"] for e in entries], np.int64)
        self._cols = [np.flatnonzero(self._pack == k) for k in range(len(ranks))]
        self._row_bytes = np.array([_row_bytes(e) for e in entries], np.int64)
        self._limit = np.array([e["limit"] for e in entries], np.int64)
        self._groups = _same_rows(entries)
        self._tails = [f"/r{rank}.pack.npy" for rank in ranks]
        self.dirs, self._save_dirs = [], []
        self.packs = [[] for _ in ranks]  # of each rank, its pack of each save (a memoryview)
        self._rows, self._ends = [], []
        self.version = max(VERSIONS.values())  # the oldest format of its saves

    def __len__(self):
        return len(self.dirs)

    def names(self, s):
        """The names of save ``s``'s packs' files, from its directory."""
        return [self._save_dirs[s] + tail for tail in self._tails]

    def add(self, directory, save_dir, data):
        """Add the save in ``directory`` whose packs (of files in its save directory
        ``save_dir``) hold ``data``. Returns its link (as :func:`_link` gives it), or None
        where a pack's head is not of the newest save's layout (then the run ends above
        it)."""
        rows, ends, link = [], [], None
        for k, raw in enumerate(data):
            magic, at = _NPY.unpack_from(raw) if len(raw) >= _NPY.size else (None, 0)
            at += _NPY.size
            if magic != _NPY_MAGIC or at % ALIGN or at + HEAD.size > len(raw):
                raise CheckpointError(f"{directory}/{save_dir}{self._tails[k]}: not a pack (a "
                                      f".npy of format 1.0 with a head)")
            magic, n, crc, text = HEAD.unpack_from(raw, at)
            if magic not in PACKS or (n, crc) != self._heads[k]:
                return None
            end = at + HEAD.size + 8 * n
            if end + text > len(raw) or (text and k) or not (text or k):
                raise CheckpointError(f"{directory}/{save_dir}{self._tails[k]}: its head runs "
                                      f"past the pack, or its link is missing or not in rank "
                                      f"0's pack")
            rows += self._rows_of[k].unpack_from(raw, at + HEAD.size)
            ends.append(end + text)
            if text:
                link = _read_link(raw, end, text, PACKS[magic],
                                  lambda: f"{directory}/{save_dir}{self._tails[0]}")
            self.packs[k].append(raw)
        self.version = min(self.version, VERSIONS[magic])
        self.dirs.append(directory)
        self._save_dirs.append(save_dir)
        self._rows.append(rows)
        self._ends.append(ends)
        return link

    def close(self):
        """Check every save's rows against the layout (bounds, the same rows in the
        arrays of one kind of row, the packs' sizes) and place its arrays."""
        self.rows = np.array(self._rows, np.int64).reshape(len(self), -1)[:, self._order]
        sizes = self.rows * self._row_bytes
        bad = ((self.rows < 0) | (self.rows > self._limit)).any(axis=1)
        for group in self._groups:
            bad |= (self.rows[:, group] != self.rows[:, group[:1]]).any(axis=1)
        lengths = np.array([[len(raw) for raw in pack] for pack in self.packs], np.int64).T
        ends = np.array(self._ends, np.int64)
        self.offsets = np.zeros_like(sizes)
        for k, cols in enumerate(self._cols):
            end = ends[:, k]  # of the head
            if cols.size:  # each array at the first multiple of ALIGN after the one before
                step = np.cumsum(_align(sizes[:, cols]), axis=1)
                self.offsets[:, cols] = _align(end)[:, None] + step - _align(sizes[:, cols])
                end = self.offsets[:, cols[-1]] + sizes[:, cols[-1]]
            bad |= end != lengths[:, k]
        if bad.any():
            s = int(np.argmax(bad))
            raise CheckpointError(f"{self.dirs[s]}: its packs do not hold the rows their heads "
                                  f"name ({self.rows[s].tolist()})")
        del self._rows, self._ends

    def arrays(self, table, array):
        """``(values, rows)``: ``array`` of ``table`` of every save of the run, newest
        first (within a save, its packs in rank order), and how many rows of it each
        save holds; None where the layout has no such array."""
        cols = sorted((j for j, e in enumerate(self.entries)
                       if e["table"] == table and e["array"] == array),
                      key=lambda j: self.entries[j]["row_start"])
        if not cols:
            return None
        first = self.entries[cols[0]]
        dtype, size = np.dtype(first["dtype"]), _row_bytes(first)
        rows = self.rows[:, cols]
        ats, ends = self.offsets[:, cols], self.offsets[:, cols] + rows * size
        files = (self.packs[first["pack"]] if len(cols) == 1 else
                 [self.packs[self.entries[j]["pack"]][s] for s in range(len(self)) for j in cols])
        values = np.frombuffer(b"".join([f[a:b] for f, a, b in zip(files, ats.ravel().tolist(),
                                                                    ends.ravel().tolist())]), dtype)
        shape = (-1,) if len(first["shape"]) == 1 else (-1, size // dtype.itemsize)
        return values.reshape(shape), rows.sum(axis=1)

    def save(self, s):
        """``(entries, {file: bytes})`` of save ``s`` of the run: the manifest entries
        its packs hold (their ``crc32`` computed here: the packs were checked whole)
        and the bytes of each pack."""
        names = self.names(s)
        contents = {name: pack[s] for name, pack in zip(names, self.packs)}
        entries = []
        for j, e in enumerate(self.entries):
            n, f = int(self.rows[s, j]), names[e["pack"]]
            offset, size = int(self.offsets[s, j]), n * _row_bytes(e)
            entry = {key: v for key, v in e.items() if key not in ("pack", "limit")}
            entries.append(dict(entry, file=f, num_rows=n, offset=offset, bytes=size,
                                shape=[n] if len(e["shape"]) == 1 else [n, e["c1"] - e["c0"]],
                                crc32=zlib.crc32(contents[f][offset:offset + size])))
        return entries, contents


def walk(path, link, entries, limits, depth, max_depth, contents):
    """Follow ``link`` (the checked link of the save in directory ``path``, whose
    checked manifest ``entries`` give the layout; ``limits``: table -> the most rows
    an array of it may hold; ``contents(file)``: the bytes of that save's ``file``)
    through the incremental saves of format 4 or later it chains to, as long as their
    packs hold that layout. Returns ``(run or None, directory, link, depth)``: where the
    run ends, the directory of its oldest save (else ``path``) and that save's link
    (``{"path", "crc32"}``), and ``depth`` plus the saves of the run."""
    path_to, crc, directory, packs, ranks = _link(link)
    mine = [_manifest.PACK_FILE.fullmatch(e["file"]) for e in entries]
    mine = [int(m[2]) if m else -1 for m in mine]  # the rank of each entry's pack
    if not ranks or any(r not in ranks for r in mine):
        return None, path, link, depth
    files = {r: contents(e["file"]) for e, r in zip(entries, mine)}
    files = [files.get(rank) for rank in ranks]  # the bytes of the file each rank's pack came from
    run = Run([dict(e, pack=ranks.index(r), limit=limits[e["table"]])
               for e, r in zip(entries, mine)], ranks)
    child, path = os.path.join(path, "manifest.json"), os.path.normpath(path)
    below_ranks = ranks
    while below_ranks == ranks:
        if depth >= max_depth:
            raise CheckpointError(f"{child}: a chain of more than {max_depth} incremental saves")
        at = _resolve(path, path_to)
        data = []
        for k, (rank, crc_p, size, offset) in enumerate(packs):
            pack = None if offset is None else _pack(files[k], size, crc_p, offset)
            if pack is None:
                name = f"{at}/{directory}/r{rank}.pack.npy"
                files[k] = _read(name, child)
                pack = _pack(files[k], size, crc_p, offset)
                if pack is None:
                    where = "" if offset is None else f" at offset {offset}"
                    raise CheckpointError(f"{name}: checkpoint file is corrupt ({len(files[k])} "
                                          f"bytes; {child} names {size} bytes{where} of crc32 "
                                          f"{crc_p:08x})")
            data.append(pack)
        below = run.add(at, directory, data)
        if below is None:
            break
        path, depth, child = at, depth + 1, f"{at}/{directory}/r{ranks[0]}.pack.npy"
        path_to, crc, directory, packs, below_ranks = below
    if not len(run):
        return None, path, link, depth
    run.close()
    return run, path, {"path": path_to, "crc32": crc}, depth


def _resolve(path, to):
    """``os.path.normpath(os.path.join(path, to))`` of a normalized ``path``; at once
    where ``to`` is ``../<name>`` (a link between two checkpoints of one directory) and
    paths are separated by ``/``."""
    head, sep, tail = path.rpartition("/")
    name = to[3:]
    if (os.sep == "/" and to[:3] == "../" and "/" not in name and name not in ("", ".", "..")
            and tail not in ("", ".", "..")):
        return head + sep + name
    return os.path.normpath(os.path.join(path, to))


def _same_rows(entries):
    """Groups of columns of the layout ``entries`` (of an incremental save) that must hold
    the same rows: of one table and shard, those of one :func:`~._manifest.row_kind`."""
    groups = {}
    for j, e in enumerate(entries):
        kind = _manifest.row_kind(e["array"], True)
        groups.setdefault((e["table"], e["slice"], e["row_start"], kind), []).append(j)
    return [g for g in groups.values() if len(g) > 1]
