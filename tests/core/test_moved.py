"""Old module paths of the flat layout (jaxformer.core.moved): each fails in one line naming
its new home, and that home imports."""

import importlib

import pytest

from jaxformer.core.moved import MOVED


def test_an_old_path_names_its_new_home_and_the_new_one_imports():
    """Every old path, none of which is a module or package of today (jaxformer.moe was a
    module and is now the wing)."""
    for name in sorted(MOVED):
        with pytest.raises(ModuleNotFoundError) as e:
            importlib.import_module(name)
        assert str(e.value).count("\n") == 0 and MOVED[name] in str(e.value)
    for new in MOVED.values():
        importlib.import_module(new)


def test_a_module_that_never_was_is_a_plain_error():
    with pytest.raises(ModuleNotFoundError) as e:
        importlib.import_module("jaxformer.no_such_module")
    assert "is now" not in str(e.value)
