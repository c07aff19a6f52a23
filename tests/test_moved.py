"""Old module paths (`flowrl._moved.MOVED`) import as their new modules, with a DeprecationWarning."""

import importlib
import importlib.machinery
import sys
import warnings

import pytest

import flowrl
from flowrl import _moved


@pytest.fixture
def example_rows(monkeypatch):
    """Two rows of an example move: a module and a package (removed again, with what importing them left)."""
    monkeypatch.setitem(_moved.MOVED, "flowrl._example_old_config", "flowrl.config")
    monkeypatch.setitem(_moved.MOVED, "flowrl._example_old_core", "flowrl.core")
    yield
    for name in [n for n in sys.modules if n.startswith("flowrl._example_old_")]:
        del sys.modules[name]
    for attr in ("_example_old_config", "_example_old_core"):
        if hasattr(flowrl, attr):
            delattr(flowrl, attr)


def test_an_old_path_warns_and_is_the_new_module(example_rows):
    new = importlib.import_module("flowrl.config")
    with pytest.warns(DeprecationWarning, match=r"flowrl\._example_old_config moved to flowrl\.config"):
        import flowrl._example_old_config as old
    assert old is new
    assert new.__spec__.name == "flowrl.config" and new.__name__ == "flowrl.config"  # the new module is untouched
    from flowrl._example_old_config import from_dict  # a second import: the same module, from sys.modules

    assert from_dict is new.from_dict


def test_a_submodule_of_an_old_package_path_is_the_new_submodule(example_rows):
    with pytest.warns(DeprecationWarning, match=r"_example_old_core moved to flowrl\.core:"):
        importlib.import_module("flowrl._example_old_core")
    with pytest.warns(DeprecationWarning, match=r"_example_old_core\.terms moved to flowrl\.core\.terms"):
        old = importlib.import_module("flowrl._example_old_core.terms")
    assert old is importlib.import_module("flowrl.core.terms")


def test_a_path_that_did_not_move_is_not_found_by_the_table():
    assert _moved.new_path("flowrl.config") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("flowrl._no_such_module")


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_every_row_moved(old):
    """Each row's old path is no module of its own any more, and imports as its new module."""
    parent, _, leaf = old.rpartition(".")
    package = importlib.import_module(_moved.new_path(parent) or parent)
    assert importlib.machinery.PathFinder.find_spec(leaf, package.__path__) is None, f"{old} still exists"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert importlib.import_module(old) is importlib.import_module(_moved.MOVED[old])
