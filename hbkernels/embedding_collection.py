"""The sharded collection's former home: :mod:`hbkernels.sharding` (this import path
keeps working)."""
from .sharding.collection import EmbeddingCollection  # noqa: F401 - re-exported
from .sharding.layout import FusedGroup, Layout, Route, Shard, initial_weights  # noqa: F401
