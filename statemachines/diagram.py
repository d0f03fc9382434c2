"""Mermaid state diagrams generated from the transition tables.

``python -m wavecore.statemachines.diagram`` prints one diagram per machine; the
package README embeds exactly this output (a test compares them), so the documented
transitions cannot drift from the code.
"""

from __future__ import annotations

from collections import defaultdict

from .coordinator import CoordinatorMachine
from .rank import RankMachine
from .scaling import ScalingMachine
from .table import TableMachine

MACHINES: tuple[type[TableMachine[object]], ...] = (RankMachine, CoordinatorMachine, ScalingMachine)  # type: ignore[assignment]


def mermaid(machine: type[TableMachine[object]]) -> str:
    """One ``stateDiagram-v2`` block: an edge per (phase, target), labelled by events."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for (phase, event), transition in machine.TRANSITIONS.items():
        for target in transition.targets:
            edges[phase.name, target.name].append(event.__name__)
    lines = [f"### {machine.__name__}", "", "```mermaid", "stateDiagram-v2"]
    for (source, target), events in edges.items():
        lines.append(f"    {source} --> {target}: {', '.join(sorted(events))}")
    lines.append("```")
    return "\n".join(lines)


def render() -> str:
    return "\n\n".join(mermaid(machine) for machine in MACHINES) + "\n"


if __name__ == "__main__":
    print(render(), end="")
