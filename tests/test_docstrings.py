"""The runnable examples in the public docstrings run and print what they show."""
import doctest

import pytest

import hbkernels
import hbkernels.ops
import hbkernels.optim
import hbkernels.types


@pytest.mark.parametrize("module", [hbkernels, hbkernels.ops, hbkernels.optim, hbkernels.types],
                         ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module.__name__} has no examples"
    assert result.failed == 0
