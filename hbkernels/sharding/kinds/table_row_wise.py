"""``table_row_wise``: the table on the ranks of one node (the plan's ``ranks``), row-wise
among them: its rank j holds rows ``j, j + G', ...`` of the G' ranks. A ``grid`` of one
column slice."""
from .grid import GridSharding


class TableRowWiseSharding(GridSharding):
    kind = "table_row_wise"
