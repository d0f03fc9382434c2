"""A rule guarded by the explorer: the real machines pass a configuration, and the
broken variant that drops the rule is caught, by one of the rules expected, with its
trace. The real machines' search is the expensive half and several rules are guarded
on the same configuration, so it runs once per configuration and depth per session."""

from __future__ import annotations

from functools import cache

from wavecore.statemachines.harness.explore import ExploreConfig, ExploreResult, explore


@cache
def explored(config: ExploreConfig, depth: int) -> ExploreResult:
    return explore(config, depth)


def assert_guarded(config: ExploreConfig, variant: str, rules: set[str], depth: int) -> None:
    real = explored(config, depth)
    assert real.violation is None, real.violation.report() if real.violation else ""
    broken = explore(config.broken(variant), depth)
    assert broken.violation is not None, f"{variant} was not caught"
    assert broken.violation.rule in rules, broken.violation.report()
    assert broken.violation.trace, "a violation must come with its trace"
