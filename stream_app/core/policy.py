"""Detector policy: the thresholds, with per-agent and per-tool overrides.

A policy document (YAML in a ConfigMap, or a dict) has three sections, each holding the same settings::

    defaults: {retry_budget: 3, iteration_ceiling: 50, ...}
    agents:   {"coding-*": {iteration_ceiling: 500}}
    tools:    {run_python: {collapse_whitespace: false}, send_email: {side_effect: true}}

A call's settings are ``defaults``, then the first matching agent entry, then the first matching tool
entry (exact names win over glob patterns). Unknown or mistyped settings are rejected with their path,
because a silently ignored typo in a kill switch's policy is a production incident.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass, fields, replace
from fnmatch import fnmatchcase
from typing import Any

from . import volatile
from .contract import TOOL_CLASSES
from .errors import PolicyError
from .normalize import DEFAULT_IGNORED_FIELDS, FieldFilter, canonical_json
from .volatile import VolatileMask, check_tokens


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Every threshold of the detector; the defaults are the documented behaviour."""

    #: Failing identical repetitions allowed when the event declares no ``retry_budget``.
    retry_budget: int = 3
    #: Streaks count only calls within this much event time...
    window_ms: int = 600_000
    #: ...and only this many of the most recent calls.
    window_calls: int = 50
    #: A run is halted on the call after this many calls.
    iteration_ceiling: int = 50
    #: Identical successful calls in a row (polling) before an advisory alert; 0 disables it.
    poll_alert_after: int = 20
    #: Occurrences of a 2- or 3-call cycle that halt the run.
    cycle_occurrences: int = 4
    #: A side-effecting call repeated within this window of its first occurrence is a duplicate.
    side_effect_window_ms: int = 60_000
    #: The occurrence of a side-effecting duplicate that opens the circuit (halts); earlier ones suppress.
    circuit_open_at: int = 4
    #: Treat every call of this agent/tool as side-effecting even if the event does not say so.
    side_effect: bool = False
    #: Collapse whitespace in string values before hashing (switch off for code, diffs, poems).
    collapse_whitespace: bool = True
    #: Extra field-name patterns to drop before hashing, added to the built-in list.
    ignore_fields: tuple[str, ...] = ()
    #: Built-in field-name patterns to keep for this tool (where e.g. ``ts`` carries meaning).
    keep_fields: tuple[str, ...] = ()
    #: The tool's arguments must be normalised here. When they cannot be (only a hash was sent, or they
    #: have no canonical form) the call is compared by tool name alone: the detector fails closed.
    strict_args: bool = False
    #: Event ids remembered per run to drop redelivered events.
    dedupe_window: int = 32
    #: A run with no event for this much event time is forgotten.
    run_ttl_ms: int = 3_600_000
    #: Shadow mode (rolling the detector out): decide as usual, but publish what would be a halt or a
    #: suppress as an ``alert`` (evidence ``shadow: true``, ``would``: the action); the run goes on.
    shadow: bool = False
    #: The SDK sends the start of a failing call's error message (``error_head``, secrets masked) so
    #: halts can quote it; off by default, since results are hashed for privacy.
    send_error_head: bool = False
    #: Fingerprint failing results with their volatile tokens (ids, times, durations...) masked, so that
    #: streaks match failures that differ only in them (``core/volatile.py`` has the table).
    mask_volatile: bool = True
    #: Extra prefixes whose following id is volatile (``trace-``), added to ``req_`` and ``id=``.
    volatile_prefixes: tuple[str, ...] = ()
    #: Extra words whose following number is volatile (``worker``), added to pid, tid, attempt, retry.
    volatile_keywords: tuple[str, ...] = ()
    #: What the tool's calls do when the event does not say: read, write, poll, spawn, handoff, other.
    tool_class: str = "other"
    #: The successful read returning the same result to the same call this many times with no successful
    #: write or plan step between halts (``no_progress``); 0 disables.
    no_progress_at: int = 4
    #: A write's after-state revisiting an earlier state of its target this many times halts
    #: (``oscillation``); 0 disables.
    oscillation_revisits: int = 3
    #: Run budgets (``defaults`` and ``agents`` only; 0: none): the call whose cost (summed as integer
    #: micro-USD) or tokens take the run strictly past them halts (``budget_exceeded``); that call ran.
    max_cost_usd: float = 0.0
    max_tokens: int = 0
    #: Calls of the tool per run (0: none): the (max_calls + 1)th halts (``budget_exceeded``, calls).
    max_calls: int = 0
    #: Model calls in a row with no tool call between (context compaction spirals): the 25th halts
    #: (``no_progress``, evidence.rule ``model_calls``); 0 disables.
    max_model_calls_without_tool: int = 25
    #: Agents handing a run back and forth (handoff-class calls A->B, B->A, ...) this many round trips with
    #: no successful call of another class between halt it (``handoff_loop``) at the handoff completing
    #: them; 0 disables.
    handoff_round_trips: int = 3
    #: Warn before a halt (action ``advise``, the rule's verdict, a reason written for the model): at the
    #: last identical failure the retry budget allows, one cycle short, one read and one revisit short,
    #: and at the first call reaching 80% of a budget. Halt points do not move.
    advise: bool = True

    def __post_init__(self) -> None:
        for name in ("retry_budget", "window_calls", "iteration_ceiling", "poll_alert_after", "no_progress_at",
                     "oscillation_revisits", "max_tokens", "max_calls", "max_model_calls_without_tool",
                     "handoff_round_trips"):
            _check_int(name, getattr(self, name), 0)
        for name in ("window_ms", "side_effect_window_ms", "run_ttl_ms"):
            _check_int(name, getattr(self, name), 1)
        _check_int("cycle_occurrences", self.cycle_occurrences, 2)
        _check_int("circuit_open_at", self.circuit_open_at, 2)
        _check_int("dedupe_window", self.dedupe_window, 1)
        if type(self.max_cost_usd) is not float or not 0 <= self.max_cost_usd < 1e12:
            raise PolicyError(f"max_cost_usd: must be a number of USD >= 0, got {self.max_cost_usd!r}")
        if self.tool_class not in TOOL_CLASSES:
            raise PolicyError(f"tool_class: must be one of {', '.join(TOOL_CLASSES)}, got {self.tool_class!r}")
        check_tokens("volatile_prefixes", self.volatile_prefixes)
        check_tokens("volatile_keywords", self.volatile_keywords)


#: Settings added after digests were first published: in a digest only when set to other than the default,
#: so a policy that does not use them keeps its digest (and runtimes of the release before count as alike).
_SINCE_DIGEST = frozenset(("handoff_round_trips",))

#: Runs a tree fold tracks at most (``max_tree_runs`` must be below it).
MAX_TREE_RUNS_TRACKED = 10_000


@dataclass(frozen=True, slots=True)
class FleetThresholds:
    """The rules across runs (``core/fleet``): the policy's ``fleet`` section, one for the whole fleet."""

    #: A run deeper than this in its sub-agent tree halts the tree (``tree_depth``); 0 for a root.
    max_tree_depth: int = 5
    #: The spawn of the same task (child agent and ``task_hash``) this many times in one tree halts it
    #: (``tree_recursion``: self-delegation chains and duplicate siblings alike); 0 disables.
    tree_task_repeats: int = 3
    #: Runs in one tree: one more halts it (``tree_fanout``), more than half raises an alert.
    max_tree_runs: int = 100
    #: The tree's summed ``cost_usd`` (integer micro-USD): the call taking it strictly past halts the
    #: tree (``tree_budget``); 0: none.
    max_tree_cost_usd: float = 0.0
    #: A tree with no event for this much event time is forgotten.
    tree_ttl_ms: int = 3_600_000
    #: A run of this generation on its thread (each run caused by the one before it on the same
    #: thread; a user's run is generation 0) halts the thread (``self_trigger``); 0 disables.
    self_trigger_generation: int = 3
    #: This many consecutive scheduled runs of a thread failing with the same error class halt the
    #: thread (``schedule_failing``); 0 disables.
    schedule_failing_runs: int = 3
    #: More runs than this in one hour on a thread, none of them triggered by a user, raise an alert
    #: (``thread_rate``).
    max_thread_runs_per_hour: int = 6
    #: A thread with no event for this much event time is forgotten (a week: daily schedules).
    thread_ttl_ms: int = 604_800_000
    #: Transient failures of a tool from this many distinct runs in one minute, and at least half of its
    #: calls, pause the tool fleet-wide (``tool_storm``); 0 disables.
    storm_min_runs: int = 10
    #: A storm's pause when no call asked for a ``retry_after_ms``, and the longest one asked for is
    #: capped at (a pause doubled again is capped too).
    storm_wait_ms: int = 60_000
    storm_max_wait_ms: int = 600_000
    #: A tool key with no event for this much event time is forgotten.
    tool_ttl_ms: int = 86_400_000
    #: Publish what would be a halt across runs as an ``alert`` (``would: halt``).
    shadow: bool = False

    def __post_init__(self) -> None:
        for name in ("max_tree_depth", "tree_task_repeats"):
            _check_int(name, getattr(self, name), 0)
        _check_int("max_tree_runs", self.max_tree_runs, 1)
        _check_int("tree_ttl_ms", self.tree_ttl_ms, 1)
        for name in ("self_trigger_generation", "max_thread_runs_per_hour"):
            _check_int(name, getattr(self, name), 0)
        _check_int("thread_ttl_ms", self.thread_ttl_ms, 1)
        _check_int("schedule_failing_runs", self.schedule_failing_runs, 0)
        _check_int("storm_min_runs", self.storm_min_runs, 0)
        for name in ("storm_wait_ms", "storm_max_wait_ms", "tool_ttl_ms"):
            _check_int(name, getattr(self, name), 1)
        if self.storm_wait_ms > self.storm_max_wait_ms:
            raise PolicyError(f"storm_wait_ms: must be at most storm_max_wait_ms ({self.storm_max_wait_ms}), got "
                              f"{self.storm_wait_ms}")
        if self.schedule_failing_runs == 1:
            raise PolicyError("schedule_failing_runs: must be 0 (off) or >= 2, got 1 (one failure would halt)")
        if self.max_tree_runs >= MAX_TREE_RUNS_TRACKED:
            raise PolicyError(f"max_tree_runs: must be below {MAX_TREE_RUNS_TRACKED}, got {self.max_tree_runs!r}")
        if self.tree_task_repeats == 1:
            raise PolicyError("tree_task_repeats: must be 0 (off) or >= 2, got 1 (every spawn would halt)")
        if type(self.max_tree_cost_usd) is not float or not 0 <= self.max_tree_cost_usd < 1e12:
            raise PolicyError(f"max_tree_cost_usd: must be a number of USD >= 0, got {self.max_tree_cost_usd!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise PolicyError(f"{name}: must be an integer >= {minimum}, got {value!r}")


_SETTING_TYPES: dict[str, type] = {f.name: type(getattr(Thresholds(), f.name)) for f in fields(Thresholds)}


@dataclass(frozen=True, slots=True)
class CallPolicy:
    """The settings resolved for one (agent, tool) pair, with the field filter built once."""

    thresholds: Thresholds
    fields: FieldFilter
    #: 4 stable bytes naming the tool inside the detector's digests (crc32 of the name).
    tool_digest: bytes
    #: Masks a failing result's volatile tokens for its fingerprint; None when ``mask_volatile`` is off.
    mask: VolatileMask | None = None


class Policy:
    """Resolves the settings of a call; resolutions are cached per (agent, tool)."""

    _CACHE_LIMIT = 10_000

    def __init__(
        self,
        defaults: Thresholds | None = None,
        agents: dict[str, dict[str, Any]] | None = None,
        tools: dict[str, dict[str, Any]] | None = None,
        fleet: FleetThresholds | None = None,
    ) -> None:
        self.defaults = defaults or Thresholds()
        self.fleet = fleet or FleetThresholds()
        self._agents = list((agents or {}).items())
        self._tools = list((tools or {}).items())
        self._cache: dict[tuple[str | None, str], CallPolicy] = {}
        self.digest = self._digest()

    def _digest(self) -> str:
        """SHA-256 (hex) of the policy's canonical JSON: every default, then the agent and tool entries in
        their matching order. Two processes with the same digest decide alike."""
        document = {
            "version": 1,
            "defaults": {f.name: getattr(self.defaults, f.name) for f in fields(Thresholds)
                         if f.name not in _SINCE_DIGEST or getattr(self.defaults, f.name) != f.default},
            "agents": [[pattern, overrides] for pattern, overrides in self._agents],
            "tools": [[pattern, overrides] for pattern, overrides in self._tools],
        }
        if self.fleet != FleetThresholds():  # a policy without a fleet section keeps its digest
            document["fleet"] = {f.name: getattr(self.fleet, f.name) for f in fields(FleetThresholds)}
        return hashlib.sha256(canonical_json(document)).hexdigest()

    @classmethod
    def from_mapping(cls, document: Any) -> Policy:
        """Build a policy from a parsed document (YAML/JSON); raise PolicyError naming the bad path."""
        if document is None:
            return cls()
        if not isinstance(document, dict):
            raise PolicyError("policy: must be a mapping with defaults, agents and tools")
        unknown = set(document) - {"version", "defaults", "agents", "tools", "fleet"}
        if unknown:
            raise PolicyError(f"policy: unknown section(s) {sorted(unknown)}; expected defaults, agents, tools, fleet")
        if document.get("version", 1) != 1:
            raise PolicyError(f"version: unsupported policy version {document['version']!r}; expected 1")
        defaults = replace(Thresholds(), **_overrides("defaults", document.get("defaults") or {}))
        sections = {}
        for section in ("agents", "tools"):
            entries = document.get(section) or {}
            if not isinstance(entries, dict):
                raise PolicyError(f"{section}: must be a mapping of name (or glob) to settings")
            sections[section] = {
                str(name): _overrides(f"{section}.{name}", value or {}) for name, value in entries.items()
            }
        return cls(defaults, sections["agents"], sections["tools"], _fleet(document.get("fleet") or {}))

    def resolve(self, agent_id: str | None, tool: str) -> CallPolicy:
        key = (agent_id, tool)
        hit = self._cache.get(key)
        if hit is None:
            thresholds = self.defaults
            agent_overrides = _match(self._agents, agent_id) if agent_id is not None else None
            if agent_overrides:
                thresholds = replace(thresholds, **agent_overrides)
            tool_overrides = _match(self._tools, tool)
            if tool_overrides:
                thresholds = replace(thresholds, **tool_overrides)
            filter_ = FieldFilter(DEFAULT_IGNORED_FIELDS + thresholds.ignore_fields, thresholds.keep_fields)
            hit = CallPolicy(thresholds, filter_, zlib.crc32(tool.encode()).to_bytes(4, "big"),
                             _mask(thresholds) if thresholds.mask_volatile else None)
            if len(self._cache) >= self._CACHE_LIMIT:
                self._cache.clear()
            self._cache[key] = hit
        return hit


_MASKS: dict[tuple[tuple[str, ...], tuple[str, ...]], VolatileMask] = {}


def _mask(thresholds: Thresholds) -> VolatileMask:
    """The mask of these prefixes and keywords, compiled once per process for every policy."""
    key = (thresholds.volatile_prefixes, thresholds.volatile_keywords)
    mask = _MASKS.get(key)
    if mask is None:
        if len(_MASKS) >= 256:
            _MASKS.clear()
        mask = _MASKS[key] = VolatileMask(volatile.pattern(*key))
    return mask


def _match(entries: list[tuple[str, dict[str, Any]]], name: str) -> dict[str, Any] | None:
    for pattern, overrides in entries:
        if pattern == name:
            return overrides
    for pattern, overrides in entries:
        if fnmatchcase(name, pattern):
            return overrides
    return None


#: Settings of the whole run: refused under ``tools`` (a run has one budget, not one per tool).
RUN_SETTINGS = frozenset(("max_cost_usd", "max_tokens"))


def _overrides(path: str, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise PolicyError(f"{path}: must be a mapping of settings")
    out: dict[str, Any] = {}
    for name, value in raw.items():
        expected = _SETTING_TYPES.get(name)
        if expected is None:
            raise PolicyError(f"{path}.{name}: unknown setting; known: {', '.join(sorted(_SETTING_TYPES))}")
        if name in RUN_SETTINGS and path.startswith("tools."):
            raise PolicyError(f"{path}.{name}: a run budget, set in defaults or agents, not per tool")
        out[name] = _typed(f"{path}.{name}", value, expected)
    try:
        replace(Thresholds(), **out)
    except PolicyError as exc:
        raise PolicyError(f"{path}.{exc}") from exc
    return out


_FLEET_TYPES: dict[str, type] = {f.name: type(getattr(FleetThresholds(), f.name)) for f in fields(FleetThresholds)}


def _typed(path: str, value: Any, expected: type) -> Any:
    """``value`` as a setting of type ``expected`` (an integer where a float goes, a list of strings
    where a tuple goes); PolicyError naming ``path`` otherwise."""
    if expected is float and type(value) is int:
        if not -1e12 < value < 1e12:
            raise PolicyError(f"{path}: must be a number below 1e12, got {value!r}")
        return float(value)
    if expected is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise PolicyError(f"{path}: must be a list of strings")
        return tuple(value)
    if type(value) is not expected:
        raise PolicyError(f"{path}: must be {expected.__name__}, got {value!r}")
    return value


def _fleet(raw: Any) -> FleetThresholds:
    if not isinstance(raw, dict):
        raise PolicyError("fleet: must be a mapping of settings")
    out: dict[str, Any] = {}
    for name, value in raw.items():
        expected = _FLEET_TYPES.get(name)
        if expected is None:
            raise PolicyError(f"fleet.{name}: unknown setting; known: {', '.join(sorted(_FLEET_TYPES))}")
        out[name] = _typed(f"fleet.{name}", value, expected)
    try:
        return FleetThresholds(**out)
    except PolicyError as exc:
        raise PolicyError(f"fleet.{exc}") from exc
