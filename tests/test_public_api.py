"""The public names of ``forge_ml`` (its ``__all__``) each carry a docstring with an example,
as ``help(forge_ml.X)`` shows it; the examples themselves run as doctests."""
import inspect

import pytest

import forge_ml as fm


@pytest.mark.parametrize("name", [n for n in fm.__all__ if n != "__version__"])
def test_every_public_name_has_a_docstring_with_an_example(name):
    obj = getattr(fm, name)
    doc = inspect.getdoc(obj)
    assert doc, f"forge_ml.{name} has no docstring"
    assert ">>>" in doc, f"forge_ml.{name}'s docstring has no example"


def test_dtype_attributes_are_the_documented_ones():
    doc = inspect.getdoc(fm.float32)
    for word in ("name", "itemsize", "is_float"):
        assert f"``{word}``" in doc and hasattr(fm.float32, word)
