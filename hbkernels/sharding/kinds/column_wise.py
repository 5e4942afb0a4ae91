"""``column_wise``: column slices of the table on different ranks, each slice whole
on its rank (the plan's ``columns`` cut the table, ``ranks`` name each slice's holder)."""
from .table_wise import OwnedSharding


class ColumnWiseSharding(OwnedSharding):
    kind = "column_wise"

    def owner_index(self, slice_index):
        return slice_index
