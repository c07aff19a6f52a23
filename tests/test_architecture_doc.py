"""docs/architecture.md stays true to the code: every path and module it names exists, every class it names is
defined, and its layers table is the one `tests/test_imports.py` enforces."""

import importlib
import re
from pathlib import Path

from tests.test_imports import LAYERS, _layer


ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
CODE = re.findall(r"`([^`\n]+)`", DOC)  # every inline code span
"""The doc's inline code spans: paths, module names, class and function names, config keys."""


def _source_tree(path: str) -> Path:
    """A path the doc names in the source tree (`flowrl/rewards/...` is `rewards/...` there)."""
    for prefix, folder in (("flowrl/rewards/", "rewards/"), ("flowrl/prompts/", "prompts/")):
        if path.startswith(prefix):
            return ROOT / folder / path.removeprefix(prefix)
    return ROOT / path


def test_every_path_the_doc_names_exists():
    paths = {
        c.split(":")[0] for c in CODE if re.fullmatch(r"(flowrl|rewards|prompts|tests|configs|docs)/[\w/.<>-]*", c)
    }
    paths |= set(re.findall(r"\]\(([\w/.-]+\.md)", DOC))  # links to other docs
    missing = []
    for path in sorted(paths):
        if "<" in path:  # a pattern such as docs/algorithms/<name>.md: its folder exists
            path = path.split("<")[0]
        where = _source_tree(path) if not path.endswith(".md") or "/" in path else ROOT / "docs" / path
        if not where.exists():
            missing.append(path)
    assert len(paths) > 20 and not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_module_the_doc_names_imports():
    modules = {c for c in CODE if re.fullmatch(r"flowrl(\.\w+)+", c) and c != "flowrl.__main__"}  # (runs the CLI)
    missing = []
    for name in sorted(modules):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:  # an attribute of a module (flowrl.sections's names, a function)
            module, _, attribute = name.rpartition(".")
            try:
                if not hasattr(importlib.import_module(module), attribute):
                    missing.append(name)
            except ModuleNotFoundError:
                missing.append(name)
    assert len(modules) > 10 and not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_class_the_doc_names_is_defined():
    sources = "\n".join(p.read_text() for folder in ("flowrl", "rewards") for p in (ROOT / folder).rglob("*.py"))
    defined = set(re.findall(r"^\s*class (\w+)", sources, flags=re.M))
    named = {c.split(".")[0] for c in CODE if re.fullmatch(r"[A-Z][a-z]+[A-Z]\w*(\.\w+)?", c)}  # CamelCase
    named |= {c for c in CODE if re.fullmatch(r"[A-Z][a-z]\w*(Config|Algorithm|Collector|Modality|Policy)", c)}
    missing = sorted(named - defined)
    assert len(named) > 10 and not missing, f"docs/architecture.md names classes that are not defined: {missing}"


def test_every_function_the_doc_calls_is_defined():
    sources = "\n".join(p.read_text() for folder in ("flowrl", "rewards") for p in (ROOT / folder).rglob("*.py"))
    defined = set(re.findall(r"^\s*def (\w+)", sources, flags=re.M))
    outline = "\n".join(re.findall(r"^```\n(.*?)^```", DOC, flags=re.S | re.M))  # the epoch's outline
    named = set(re.findall(r"\b([a-z_]\w*)\(", "\n".join(CODE) + outline))  # name(...) calls
    named |= {m.group(1) for c in CODE if (m := re.fullmatch(r"[A-Z]\w*\.([a-z_]\w*)", c))}  # Class.method
    missing = sorted(named - defined - {"for"})
    assert len(named) > 10 and not missing, f"docs/architecture.md calls functions that are not defined: {missing}"


def test_the_layers_table_is_the_one_the_import_test_enforces():
    table = re.search(r"^\| layer \| packages \| what it holds \|\n\| --- .*?\n((?:\|.*\n)+)", DOC, flags=re.M)
    assert table, "docs/architecture.md has no layers table"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.group(1).splitlines()]
    documented = [(layer, sorted(re.findall(r"`(flowrl[\w.]*)`", packages))) for layer, packages, _ in rows]
    enforced = [(layer, sorted(p for p in prefixes if p != "flowrl")) for layer, prefixes in LAYERS]
    assert documented == enforced


def test_an_unplaced_module_has_no_layer():
    """The layer test can fail: a module outside every listed package has none (the bare `flowrl` of the base layer
    is the package's own `__init__`, not a prefix of every module)."""
    assert _layer("flowrl.somewhere_new") is None and _layer("flowrl.somewhere_new.part") is None
    assert _layer("flowrl") == 0 and _layer("flowrl.config") == 0 and _layer("flowrl.run.driver") is not None
