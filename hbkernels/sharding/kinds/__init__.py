"""The placement kinds, one module each, behind :class:`~.base.EmbeddingSharding`.

A new placement is a new module here and one entry in :data:`SHARDINGS` (and its
name in :data:`hbkernels.types.PLACEMENTS`, with a cost in the planner). A sharded kind's
ids and rows go by :mod:`hbkernels.sharding._alltoall`, a replicated kind's gradients by
:mod:`hbkernels.sharding._replicas`."""
from ...types import PLACEMENTS
from .base import EmbeddingSharding
from .column_wise import ColumnWiseSharding
from .data_parallel import DataParallelSharding
from .grid import GridSharding
from .row_wise import RowWiseSharding
from .table_column_wise import TableColumnWiseSharding
from .table_row_wise import TableRowWiseSharding
from .table_wise import TableWiseSharding

#: placement kind -> its sharding
SHARDINGS = {s.kind: s for s in (DataParallelSharding(), RowWiseSharding(), TableWiseSharding(),
                                  ColumnWiseSharding(), TableRowWiseSharding(),
                                  TableColumnWiseSharding(), GridSharding())}
assert tuple(SHARDINGS) == PLACEMENTS, "every placement has one sharding module"

__all__ = ["SHARDINGS", "EmbeddingSharding"]
