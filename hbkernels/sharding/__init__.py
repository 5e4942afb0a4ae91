"""Sharded embedding tables: who holds what, how ids and rows move, checkpoints.

* :mod:`~hbkernels.sharding.plan`: the planner (placement per table, cost model);
* :mod:`~hbkernels.sharding.layout`: shards, routes and fused arrays of a plan
  (:class:`~hbkernels.sharding.layout.Layout`), and the initial weights;
* :mod:`~hbkernels.sharding.kinds`: one module per placement kind behind one
  interface (layout, input distribution, whole-table gather);
* :mod:`~hbkernels.sharding.collection`: :class:`EmbeddingCollection` (forward,
  backward; the exchanges of the sharded and the replicated kinds, the flat path of a
  GPU, dynamic tables and whole tables in modules of their own);
* :mod:`~hbkernels.sharding.checkpoint`: the checkpoint format;
* :mod:`~hbkernels.sharding.kjt`: TorchRec ``KeyedJaggedTensor`` input.
"""
from .collection import EmbeddingCollection
from .layout import FusedGroup, Layout, Route, Shard, initial_weights, make_layout
from .plan import Placement, Plan, make_plan

__all__ = ["EmbeddingCollection", "FusedGroup", "Layout", "Placement", "Plan", "Route", "Shard",
           "initial_weights", "make_layout", "make_plan"]
