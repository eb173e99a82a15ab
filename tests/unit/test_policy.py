"""Policy documents: overrides resolve in order, and mistakes are named, not ignored."""

from __future__ import annotations

import pytest

from stream_app.core import Policy, PolicyError


def test_tool_overrides_agent_overrides_defaults() -> None:
    policy = Policy.from_mapping({
        "defaults": {"retry_budget": 2},
        "agents": {"billing-*": {"retry_budget": 4, "iteration_ceiling": 80}},
        "tools": {"charge": {"retry_budget": 0}},
    })
    assert policy.resolve(None, "search").thresholds.retry_budget == 2
    assert policy.resolve("billing-1", "search").thresholds.retry_budget == 4
    assert policy.resolve("billing-1", "charge").thresholds.retry_budget == 0
    assert policy.resolve("billing-1", "charge").thresholds.iteration_ceiling == 80


def test_exact_names_win_over_globs() -> None:
    policy = Policy.from_mapping({"tools": {"*": {"retry_budget": 1}, "search": {"retry_budget": 9}}})
    assert policy.resolve(None, "search").thresholds.retry_budget == 9
    assert policy.resolve(None, "other").thresholds.retry_budget == 1


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"defaults": {"retry_budgt": 3}}, "defaults.retry_budgt: unknown setting"),
        ({"tools": {"x": {"retry_budget": "3"}}}, "tools.x.retry_budget: must be int"),
        ({"agents": {"a": {"iteration_ceiling": -1}}}, "agents.a.iteration_ceiling: must be an integer >= 0"),
        ({"tools": {"x": {"ignore_fields": "ts"}}}, "tools.x.ignore_fields: must be a list"),
        ({"rules": {}}, "unknown section"),
        ({"version": 2}, "unsupported policy version"),
        ([1, 2], "must be a mapping"),
    ],
)
def test_mistakes_are_named(document, message) -> None:
    with pytest.raises(PolicyError, match=message):
        Policy.from_mapping(document)
