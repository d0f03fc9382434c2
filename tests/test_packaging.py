"""The layout contract: three folders installed as `wavecore.*`, one-way dependencies."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {
    "engine": "wavecore.engine",
    "channels": "wavecore.channels",
    "statemachines": "wavecore.statemachines",
}


def _declared_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(config["tool"]["setuptools"]["packages"])


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
