"""The runnable examples in the public docstrings run and print what they show."""
import doctest

import pytest

import hbkernels
import hbkernels.data.convert
import hbkernels.data.hashing
import hbkernels.data.parquet
import hbkernels.data.synthetic
import hbkernels.dist
import hbkernels.embedding_collection
import hbkernels.ops
import hbkernels.optim
import hbkernels.plan
import hbkernels.types

MODULES = [hbkernels, hbkernels.ops, hbkernels.optim, hbkernels.types, hbkernels.dist,
           hbkernels.plan, hbkernels.embedding_collection, hbkernels.data.parquet,
           hbkernels.data.hashing, hbkernels.data.convert, hbkernels.data.synthetic]


@pytest.mark.parametrize("module", MODULES,
                         ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module.__name__} has no examples"
    assert result.failed == 0
