"""Checkpoints of an :class:`~hbkernels.EmbeddingCollection`: ``.npy`` arrays plus a
JSON manifest, no pickle, written atomically, loadable at any world size.

This package knows the layout (:class:`~hbkernels.sharding.layout.Shard`) and the
optimizers, never the collection's class: :func:`save` reads a collection through
its public attributes, and :class:`Checkpoint` hands
:meth:`EmbeddingCollection.load <hbkernels.EmbeddingCollection.load>` the tables,
the constructor arguments (the optimizer rebuilt through its constructor), the
saved weights of any shard and the saved optimizer state.

Its modules: :mod:`._format` (the constants; ``.npy`` files, packs and manifests
written; a manifest and a save's files read), :mod:`._manifest` (a manifest's checks,
the names of its files), :mod:`._packs` (an incremental save's packs and their heads),
:mod:`._save` (:func:`save`), :mod:`._chain` (:class:`Checkpoint`: a save and the saves
it chains to, their rows read through the chain) and :mod:`._restore` (what a load asks
of a checkpoint).

Layout of a checkpoint directory::

    manifest.json              # crc32 first, then format, tables, optimizer, plan, files
    save-<ns>-<8 hex>/t<table index>.<slice>.<row_start>-<row_step>.<array>.npy
    save-<ns>-<8 hex>/r<rank>.pack.npy         # an incremental save: one pack per rank

Each ``.npy`` holds one shard of one array (``weights`` or an optimizer slot):
rows ``row_start + row_step * k`` (``k < num_rows``), columns ``[c0, c1)`` of
the table. An incremental save writes each rank's arrays as one pack instead
(:func:`~._format.save_pack`: a ``.npy`` of bytes, each array at the ``offset`` its
file entry names, with its own crc32, after a head: :mod:`._packs`), appended to the
parent's file of that rank where the parent's pack ends it (the file then has a
name in each save of the chain: a hard link), and its link to its parent names the
parent's packs where the parent is an incremental save too, so a load reads the
newest save's manifest and the packs of the incremental saves below it, from the
newest save's files where they are there (:class:`~._chain._PackSave`). A replicated
table is written once, by rank 0. File names never contain a table's name, so no name
can form a path.
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
from ._chain import Checkpoint
from ._format import (CHAIN_SAVE_BYTES, CHUNK_ROWS, FORMAT, MANIFEST, MAX_CHAIN, MAX_MANIFEST_BYTES,
                      PACK_ALIGN, READABLE_VERSIONS, VERSION, read_manifest)
from ._save import save

__all__ = ["CHAIN_SAVE_BYTES", "CHUNK_ROWS", "FORMAT", "MANIFEST", "MAX_CHAIN", "MAX_MANIFEST_BYTES",
           "PACK_ALIGN", "READABLE_VERSIONS", "VERSION", "Checkpoint", "read_manifest", "save"]
