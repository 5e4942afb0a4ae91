"""hbk.TableSpec's checks (hbkernels.types.table_spec): every integer field is an integer
(a Python or NumPy one, not a bool or a float, even a whole one), every number a finite
number, and each error names the table, the field and what came."""
import re

import numpy as np
import pytest

import hbkernels as hbk
from hbkernels.types import table_spec

STATIC = dict(num_rows=10, dim=2)
DYNAMIC = dict(num_rows=None, dim=2, capacity=8)


@pytest.mark.parametrize("field, base, message", [
    ("num_rows", STATIC, "num_rows must be an integer >= 1 (or None: a dynamic table)"),
    ("dim", STATIC, "dim must be an integer >= 1"),
    ("capacity", DYNAMIC, "a dynamic table (num_rows=None) needs a capacity, an integer >= 1"),
    ("admit_count", DYNAMIC, "admit_count must be an integer >= 1"),
    ("cache_rows", dict(STATIC, storage="host"), "cache_rows must be an integer >= 1 (or None: no "
                                                 "cache)"),
])
@pytest.mark.parametrize("value", [10.0, np.float64(4), True])
def test_integer_fields_refuse_floats_and_bools(field, base, message, value):
    spec = hbk.TableSpec("a", **dict(base, **{field: value}))
    with pytest.raises(ValueError, match=re.escape(f"table 'a': {message}, got {value!r}")):
        table_spec(spec)
    whole = table_spec(spec._replace(**{field: np.int64(3)}))  # NumPy integers pass, as ints
    assert type(getattr(whole, field)) is int and getattr(whole, field) == 3


@pytest.mark.parametrize("field, value", [("hotness", "often"), ("hotness", float("inf")),
                                          ("init_scale", "small"), ("init_scale", float("inf")),
                                          ("dtype", "nonsense")])
def test_other_fields_say_what_came(field, value):
    """No raw TypeError or float() message: a ValueError naming the table and the field."""
    spec = hbk.TableSpec("a", **dict(STATIC, **{field: value}))
    expected = (f"dtype must be float32 or float16, got {value!r}" if field == "dtype" else
                f"{field} must be a finite number > 0, got {value!r}")
    with pytest.raises(ValueError, match=re.escape(f"table 'a': {expected}")):
        table_spec(spec)
