"""The exhaustive explorer at dp 2 and 3, and its command line."""

from __future__ import annotations

import pytest

from wavecore.statemachines.harness.explore import default_configs, explore
from wavecore.statemachines.sim import main


@pytest.mark.parametrize("dp_size", [2, 3])
def test_every_interleaving_of_the_small_configurations_holds(dp_size: int) -> None:
    for name, config in default_configs(dp_size):
        if name == "request-and-pause" or name.startswith("scale"):
            continue  # the command-line test below and test_regressions cover these
        result = explore(config, 40)
        assert result.violation is None, result.violation.report() if result.violation else ""
        assert result.states > 50, f"{name} explored suspiciously little"


def test_command_line_reports_no_violation_and_exit_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--dp", "2", "--depth", "40"]) == 0
    assert "no violation" in capsys.readouterr().out


def test_command_line_shows_the_trace_of_a_broken_rule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dp", "2", "--depth", "30", "--break", "no_self_wake"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION" in out
    assert "client submits request 0" in out
