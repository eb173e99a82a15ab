"""The README against the code: the worker configuration table is the settings list itself, not a copy
that drifts, and the policy example loads as its comments say."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream_app.worker.settings import SETTINGS, SettingsError, WorkerSettings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


@pytest.mark.parametrize(("name", "var", "default", "doc"), SETTINGS)
def test_every_worker_setting_is_documented_with_its_default(name: str, var: str, default: str, doc: str) -> None:
    shown = f"`{default}`" if default else "(empty)"
    assert f"| `{var}` | {shown} | {doc} |" in README


def test_defaults_build_valid_settings() -> None:
    settings = WorkerSettings.from_env({"LOOPWARDEN_SIGNING_KEY": "/keys/worker.key"})
    assert settings.partitions == 8
    assert settings.event_source == "/loopwarden/loopwarden"
    assert settings.changelog_topic == "loopwarden-runs-changelog"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LOOPWARDEN_PARTITIONS": "eight"}, "LOOPWARDEN_PARTITIONS='eight': expected int"),
        ({"LOOPWARDEN_PARTITIONS": "0"}, "LOOPWARDEN_PARTITIONS must be >= 1"),
        ({"LOOPWARDEN_CREATE_TOPICS": "maybe"}, "LOOPWARDEN_CREATE_TOPICS='maybe': expected bool"),
        ({"LOOPWARDEN_HEARTBEAT_S": "5"}, "at most a third"),
        ({}, "LOOPWARDEN_SIGNING_KEY: required"),
        ({"LOOPWARDEN_ALLOW_UNSIGNED": "perhaps"}, "LOOPWARDEN_ALLOW_UNSIGNED='perhaps': expected bool"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        WorkerSettings.from_env(env)


def test_the_readme_policy_example_loads_as_it_says() -> None:
    """The policy YAML under "## Policy" is a valid policy, and its comments hold for the tools named."""
    import yaml

    from stream_app.core import Policy
    from tests.readme_examples import blocks

    [(_, text)] = [b for b in blocks("## Policy") if b[0] == "yaml"]
    policy = Policy.from_mapping(yaml.safe_load(text))
    assert policy.resolve(None, "search_docs").thresholds.volatile_prefixes == ("trace-",)
    assert policy.resolve(None, "run_tests").mask is None
    assert policy.resolve("coding-bot", "x").thresholds.iteration_ceiling == 500
    assert policy.resolve("coding-bot", "x").thresholds.max_cost_usd == 20.0
    assert policy.resolve(None, "browse_web").thresholds.max_calls == 40


def test_the_quickstarts_table_is_the_demos_own() -> None:
    """The table the quickstart shows has the demo's columns and its scenarios in its order (it said
    ``edit_cycle`` and lacked a column for months after the demo changed)."""
    from stream_app.devtools.demo import summary_table
    from stream_app.devtools.scenarios import DEMO_MIX

    block = README.split("```\nscenario ", 1)[1].split("```", 1)[0]
    rows = ("scenario " + block).splitlines()
    demo_header = summary_table([])[0].splitlines()[0]
    assert rows[0].split() == demo_header.split()
    scenarios = [row.split()[0] for row in rows[2:] if row.strip() and not row[0].isdigit() and "  " in row]
    assert scenarios == [name for name, _ in DEMO_MIX]
