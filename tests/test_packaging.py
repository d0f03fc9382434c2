"""The layout contract: three folders installed as `wavecore.*`, one-way dependencies."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
# Folder -> installed package name, from pyproject's package-dir (the one source of truth).
FOLDERS: dict[str, str] = {folder: dotted for dotted, folder in _SETUPTOOLS["package-dir"].items()}


def _declared_packages() -> set[str]:
    return set(_SETUPTOOLS["packages"])


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_every_package_folder_is_declared() -> None:
    found = set()
    for folder, dotted in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((dotted, *relative)))
    assert found == _declared_packages()


def test_every_file_the_code_reads_is_package_data() -> None:
    """Non-Python files inside a package (the kernels' C and C++ sources) install with it."""
    declared = _SETUPTOOLS.get("package-data", {})
    for folder, dotted in FOLDERS.items():
        for path in [*(ROOT / folder).rglob("*.c"), *(ROOT / folder).rglob("*.cpp")]:
            package = ".".join((dotted, *path.parent.relative_to(ROOT / folder).parts))
            patterns = declared.get(package, [])
            assert any(path.match(pattern) for pattern in patterns), (
                f"{path.relative_to(ROOT)} is not in pyproject's package-data for {package}"
            )


def test_statemachines_are_pure() -> None:
    forbidden = {"anyio", "trio", "asyncio", "pynng", "cbor2", "torch", "numpy", "wavecore"}
    for path in (ROOT / "statemachines").rglob("*.py"):
        for name in _imports(path):
            top = name.split(".")[0]
            if name.startswith("wavecore.statemachines"):
                continue
            assert top not in forbidden, f"{path.relative_to(ROOT)} imports {name}"
        assert "await " not in path.read_text(), f"{path.relative_to(ROOT)} awaits"


def test_channels_do_not_import_the_engine() -> None:
    for path in (ROOT / "channels").rglob("*.py"):
        for name in _imports(path):
            assert not name.startswith("wavecore.engine"), (
                f"{path.relative_to(ROOT)} imports {name}"
            )


def _module_files(folders: Mapping[Path, str]) -> dict[str, Path]:
    """Every module's dotted name -> its file; a package is named by its `__init__.py`."""
    modules: dict[str, Path] = {}
    for folder, dotted in folders.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((dotted, *parts))] = path
    return modules


def _imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """The known modules that `module` imports anywhere in its file.

    `ast.walk` reaches imports inside functions and `if TYPE_CHECKING:` blocks too: a lazy
    import only hides a cycle until the day someone hoists it. Only the module a statement
    names is an edge, not the parent packages Python imports on the way (every package
    `__init__` that re-exports its submodules would otherwise be a cycle).
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                # `from . import x` is relative to `package`; each further dot goes one up.
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in known else base)
    return (targets & known) - {module}


def _import_graph(folders: Mapping[Path, str]) -> dict[str, set[str]]:
    """Module -> the modules it imports, over every module under `folders`."""
    files = _module_files(folders)
    known = set(files)
    return {module: _imported_modules(module, path, known) for module, path in files.items()}


def _find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import cycle as `[a, b, ..., a]`, or None when the graph is acyclic.

    An iterative depth-first search in sorted order, so the same graph always reports the
    same cycle: a back edge to a module still on the path closes the cycle.
    """
    finished: set[str] = set()
    for start in sorted(graph):
        if start in finished:
            continue
        path = [start]
        pending = [iter(sorted(graph[start]))]
        while pending:
            target = next(pending[-1], None)
            if target is None:
                finished.add(path.pop())
                pending.pop()
            elif target in path:
                return [*path[path.index(target) :], target]
            elif target not in finished:
                path.append(target)
                pending.append(iter(sorted(graph.get(target, ()))))
    return None


def test_find_cycle_on_hand_built_graphs() -> None:
    acyclic = {"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"a"}}
    assert _find_cycle(acyclic) is None
    cyclic = {**acyclic, "c": {"e"}, "e": {"b"}}
    assert _find_cycle(cyclic) == ["b", "c", "e", "b"]


def test_import_graph_of_synthetic_modules(tmp_path: Path) -> None:
    """Relative, absolute, lazy and TYPE_CHECKING imports are all edges."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\n",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from ..c import C\n",
        "c.py": "import os\nfrom wavecore.pkg import a\nfrom wavecore.pkg.sub import thing\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    graph = _import_graph({package: "wavecore.pkg"})
    assert graph == {
        "wavecore.pkg": {"wavecore.pkg.a"},
        "wavecore.pkg.a": {"wavecore.pkg.sub.b"},
        "wavecore.pkg.sub": set(),
        "wavecore.pkg.sub.b": {"wavecore.pkg.c"},
        "wavecore.pkg.c": {"wavecore.pkg.a", "wavecore.pkg.sub"},
    }
    assert _find_cycle(graph) == [
        "wavecore.pkg.a",
        "wavecore.pkg.sub.b",
        "wavecore.pkg.c",
        "wavecore.pkg.a",
    ]


def test_no_import_cycles() -> None:
    graph = _import_graph({ROOT / folder: dotted for folder, dotted in FOLDERS.items()})
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


# Inside `engine`, what each part may not import: the front end knows no core, no fleet
# and no model; the core knows no fleet and, of the front end, only the core-client
# interface it implements; the parts below the rank know nothing above them; nothing
# but the command line opens engines through `api`.
_ABOVE_THE_RANK = ("frontend", "core", "dp", "cli", "api")
ENGINE_RULES: dict[str, tuple[str, ...]] = {
    "frontend": ("core", "dp", "model", "cli", "api"),
    "core": ("dp", "cli", "api", "frontend.engine", "frontend.input_processor"),
    "dp": ("cli", "api", "frontend.engine"),
    "scheduler": _ABOVE_THE_RANK,
    "executors": _ABOVE_THE_RANK,
    "sampling": _ABOVE_THE_RANK,
    "model": _ABOVE_THE_RANK,
    # The shared vocabulary: configuration, errors, requests, messages, the interface.
    "interface": _ABOVE_THE_RANK,
    "messages": _ABOVE_THE_RANK,
    "request": _ABOVE_THE_RANK,
    "config": _ABOVE_THE_RANK,
    "errors": _ABOVE_THE_RANK,
}


def _inside(module: str, part: str) -> bool:
    name = f"wavecore.engine.{part}"
    return module == name or module.startswith(name + ".")


def test_engine_dependencies_point_one_way() -> None:
    graph = _import_graph({ROOT / "engine": "wavecore.engine"})
    assert set(ENGINE_RULES) <= {module.split(".")[2] for module in graph if module.count(".") >= 2}
    broken = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        for part, forbidden in ENGINE_RULES.items()
        if _inside(module, part)
        for target in targets
        if any(_inside(target, no) for no in forbidden)
    ]
    assert not broken, "\n".join(broken)
