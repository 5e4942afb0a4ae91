"""The runnable examples in the public docstrings run and print what they show."""
import doctest

import pytest

import hbkernels
import hbkernels.cli.info
import hbkernels.cli.progress
import hbkernels.data.convert
import hbkernels.data.ctr
import hbkernels.data.hashing
import hbkernels.data.parquet
import hbkernels.data.synthetic
import hbkernels.dist
import hbkernels.hash_table
import hbkernels.memory
import hbkernels.metrics
import hbkernels.ops
import hbkernels.optim
import hbkernels.reference
import hbkernels.sharding._whole
import hbkernels.sharding.collection
import hbkernels.sharding.layout
import hbkernels.sharding.plan
import hbkernels.types

MODULES = [hbkernels, hbkernels.ops, hbkernels.hash_table, hbkernels.reference, hbkernels.optim, hbkernels.types, hbkernels.dist,
           hbkernels.sharding.plan, hbkernels.sharding.layout, hbkernels.sharding.collection,
           hbkernels.sharding._whole,
           hbkernels.memory, hbkernels.data.parquet,
           hbkernels.data.hashing, hbkernels.data.convert, hbkernels.data.synthetic,
           hbkernels.data.ctr, hbkernels.metrics, hbkernels.cli.info, hbkernels.cli.progress]


def test_dlrm_docstring_example():
    pytest.importorskip("torch")
    import hbkernels.models.dlrm

    result = doctest.testmod(hbkernels.models.dlrm, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("module", MODULES,
                         ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module.__name__} has no examples"
    assert result.failed == 0
