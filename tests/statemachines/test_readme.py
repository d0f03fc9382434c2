"""The package README's diagrams are exactly what the generator draws from the tables."""

from __future__ import annotations

from pathlib import Path

import wavecore.statemachines as package
from wavecore.statemachines.diagram import render

README = Path(package.__file__).resolve().parent / "README.md"
BEGIN, END = "<!-- diagrams:begin -->\n", "<!-- diagrams:end -->"


def test_readme_diagrams_match_the_transition_tables() -> None:
    text = README.read_text()
    embedded = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    assert embedded == render(), "regenerate with: python -m wavecore.statemachines.diagram"
