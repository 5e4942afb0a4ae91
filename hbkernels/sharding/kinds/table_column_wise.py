"""``table_column_wise``: column slices of the table on the ranks of one node, each slice
whole on its rank (the plan's ``columns`` cut the table, ``ranks`` name each slice's
holder): ``column_wise`` kept within a node."""
from .column_wise import ColumnWiseSharding


class TableColumnWiseSharding(ColumnWiseSharding):
    kind = "table_column_wise"
