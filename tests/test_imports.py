"""Imports point down only: core <- policies/models <- modalities <- run <- trainers <- commands
(docs/architecture.md).

Every `import` in the package, at module level or inside a function, is read from the source; a module may import
its own layer or a lower one. A new module outside the layers below fails here until it is placed in one.
"""

import ast
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    ("base", ["flowrl", "flowrl.registry", "flowrl.runtime", "flowrl.config", "flowrl.tracking", "flowrl.threads",
              "flowrl.checkpoint", "flowrl.cache", "flowrl.video", "flowrl._moved"]),
    ("core", ["flowrl.core"]),
    ("policies and models", ["flowrl.policies", "flowrl.models", "flowrl.sections", "flowrl.objective_sections",
                             "flowrl.async_sections"]),
    ("modalities", ["flowrl.image", "flowrl.control", "flowrl.llm", "flowrl.digits", "flowrl.rewards",
                    "flowrl.prompts"]),
    ("run", ["flowrl.run"]),
    ("trainers", ["flowrl.trainers"]),
    ("commands", ["flowrl.cli", "flowrl.cli_parser", "flowrl.commands", "flowrl.__main__", "flowrl.sample",
                  "flowrl.export", "flowrl.ablate", "flowrl.score", "flowrl.plan"]),
]  # fmt: skip
"""Each layer's modules (a package stands for all of its modules), lowest first."""


def _layer(module: str) -> int | None:
    """The layer of `module`: the longest prefix listed in `LAYERS`."""
    best, found = -1, None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            # the bare `flowrl` is the package's __init__ only: as a prefix it would place every module
            if (module == prefix or (prefix != "flowrl" and module.startswith(prefix + "."))) and len(prefix) > best:
                best, found = len(prefix), rank
    return found


def _modules():
    """`(module name, path)` of every module of the package (`rewards/` and `prompts/` are `flowrl.rewards` and
    `flowrl.prompts`)."""
    roots = {"flowrl": ROOT / "flowrl", "flowrl.rewards": ROOT / "rewards", "flowrl.prompts": ROOT / "prompts"}
    for package, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join([package, *parts]), path


def _imports(module: str, path: Path):
    """`(line, imported module)` of every flowrl import in the file (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                names = [f"{base}.{node.module}" if node.module else base]
            else:
                names = [node.module]
        else:
            continue
        for name in names:
            if name == "flowrl" or name.startswith("flowrl."):
                yield node.lineno, name


def test_every_module_has_a_layer():
    missing = [module for module, _ in _modules() if _layer(module) is None]
    assert not missing, f"place these modules in a layer of tests/test_imports.py: {missing}"


def test_imports_point_down_only():
    upward = []
    for module, path in _modules():
        own = _layer(module)
        for line, name in _imports(module, path):
            target = _layer(name)
            if target is not None and target > own:
                upward.append(
                    f"{path.relative_to(ROOT)}:{line} ({LAYERS[own][0]}) imports {name} ({LAYERS[target][0]})"
                )
    assert not upward, "upward imports:\n" + "\n".join(upward)


def _package(module: str) -> str:
    """The part of flowrl `module` belongs to: its top-level package or module (`flowrl.policies`, `flowrl.cli`)."""
    return ".".join(module.split(".")[:2])


def _package_graph() -> dict[str, dict[str, list[str]]]:
    """Package -> the packages it imports -> where (`path:line`), over every import (module-level or in a function)."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path in _modules():
        for line, name in _imports(module, path):
            source, target = _package(module), _package(name)
            if name != "flowrl" and source != target:
                graph.setdefault(source, {}).setdefault(target, []).append(f"{path.relative_to(ROOT)}:{line}")
    return graph


def _cycles(graph) -> list[set[str]]:
    """The groups of nodes of `graph` that import each other, directly or through others (strongly connected groups
    of two or more), in order of their first node."""

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for target in graph.get(todo.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return seen

    reachable = {node: reach(node) for node in graph}
    groups = []
    for node in sorted(graph):
        group = {node} | {other for other in reachable[node] if node in reachable.get(other, ())}
        if len(group) > 1 and group not in groups:
            groups.append(group)
    return groups


CYCLES_LEFT = []
"""Package cycles still to cut (#46); the last one (the arithmetic reward imported `flowrl.llm.arith`, the text
modality the rewards) went when the answer parser moved to `rewards/text.py`."""


def test_no_import_cycle_between_packages():
    """No two packages import each other, directly or through others: the policies <-> models circle is gone (the
    family registry is beside its families, in `flowrl.models.families`; `flowrl.policies.build` builds a policy)."""
    graph = _package_graph()
    found = _cycles(graph)

    def where(group):
        pairs = [(a, b) for a in sorted(group) for b in sorted(group) if b in graph.get(a, {})]
        return "; ".join(f"{a} -> {b}: {', '.join(graph[a][b])}" for a, b in pairs)

    new = [group for group in found if group not in CYCLES_LEFT]
    assert not new, "packages that import each other:\n" + "\n".join(where(group) for group in new)
    gone = [group for group in CYCLES_LEFT if group not in found]
    assert not gone, f"cycles cut (remove them from CYCLES_LEFT): {gone}"
    assert not any({"flowrl.policies", "flowrl.models"} <= group for group in found)


def test_the_cycle_check_can_fail():
    """A circle through three packages is found, and a package that only imports into it is not part of it."""
    graph = {"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}
    assert _cycles(graph) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b": []}, "b": {}}) == []


def test_the_core_imports_torch_and_nothing_of_flowrl_above_it():
    for module, path in _modules():
        if _layer(module) == 1:
            for line, name in _imports(module, path):
                assert _layer(name) in (0, 1), f"{path}:{line} imports {name}"


ALGORITHMS = ("flowrl.trainers.image", "flowrl.trainers.control", "flowrl.trainers.text")
"""The folders of algorithms: one trainer per module, none importing another (shared pieces: trainers.shared)."""


def _in(module: str, packages) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def test_no_algorithm_imports_another():
    """An algorithm builds on `flowrl.trainers.shared` and the layers below, never on another algorithm."""
    found = []
    for module, path in _modules():
        if _in(module, ALGORITHMS):
            found += [
                f"{path.relative_to(ROOT)}:{line} imports {name}"
                for line, name in _imports(module, path)
                if _in(name, ALGORITHMS)
            ]
    assert not found, "algorithms import algorithms (what they share goes to trainers/shared/):\n" + "\n".join(found)


def test_the_algorithm_check_can_fail(tmp_path):
    path = tmp_path / "loop.py"
    path.write_text("from flowrl.trainers.image.flow_grpo import FlowGRPO\n")
    ((_, name),) = list(_imports("flowrl.trainers.image.loop", path))
    assert _in(name, ALGORITHMS) and _in("flowrl.trainers.image.loop", ALGORITHMS)


@pytest.mark.parametrize("bad", ["flowrl.run.driver", "flowrl.cli"])
def test_the_check_can_fail(bad, tmp_path):
    """An upward import written into a core module is caught (the test is not vacuous)."""
    path = tmp_path / "objectives.py"
    path.write_text(f"def f():\n    import {bad}\n")
    ((_, name),) = list(_imports("flowrl.core.objectives", path))
    assert _layer(name) > _layer("flowrl.core.objectives")


def test_the_package_list_names_every_package():
    """pyproject's `packages` (a non-editable install ships only those) lists every package of the source."""
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", text, flags=re.S | re.M).group(1)))
    found = {module for module, path in _modules() if path.name == "__init__.py"}
    assert found == listed, f"missing: {sorted(found - listed)}; stale: {sorted(listed - found)}"
