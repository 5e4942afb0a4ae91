"""Checkpoints' former home: :mod:`hbkernels.sharding.checkpoint` (this import path
keeps working; atomic file writes are in :mod:`hbkernels._files`)."""
from ._files import fsync_dir, write_atomic, write_json_atomic  # noqa: F401 - re-exported
from .sharding.checkpoint import FORMAT, MANIFEST, VERSION, Checkpoint, read_manifest, save  # noqa: F401
from .sharding.collection import EmbeddingCollection


def load(path, comm=None, **overrides):
    """:meth:`EmbeddingCollection.load <hbkernels.EmbeddingCollection.load>`."""
    return EmbeddingCollection.load(path, comm, **overrides)
