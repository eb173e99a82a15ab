"""``loopwarden explain DECISION_OR_RUN_ID``: the story of a halt, for on-call.

From the alerts topic (every halt and operator decision the workers published; read from its start to
its end when the command starts, no consumer group), or with ``--telemetry FILE`` from a telemetry file
replayed through the core as ``loopwarden replay`` does (then every decision, warnings and alerts too,
and the calls themselves). The id is a decision id or a run id; every matching decision is told:

    halt recursion  run r-42  agent support-bot  2026-12-01T18:22:26.123Z
      why        search_docs with identical arguments returned the identical error result ... budget is 3
      failure    http_503: upstream unavailable
      streak     4 calls, budget 3, matched exact, within 60 s
      events     r-42-1, r-42-2, r-42-3, r-42-4
      arguments  identical after normalisation
      decision   20b4839c5fdab34e2c1d0e07f0d00e25 (trigger r-42-4, trace 91a3...)

With ``--telemetry`` each decision is followed by the calls of its streak (or, for rules without one, the
run's last calls up to the trigger) as the file has them, secrets masked as in the evidence. ``--json`` prints the matching decisions as
control v1 JSONL instead. Exit status 0 when something matched, 1 when nothing did.

Signatures: with ``LOOPWARDEN_WORKER_KEYS`` set, only alerts signed by those workers are told (the
others are counted); without it every alert is told, marked unverified.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, TextIO

import orjson

from ..bus.kafka import KafkaClientConfig
from ..bus.signing import WORKER_KEYS_VAR, KeyRing, SignatureRejected
from ..core import InvalidEvent, Policy
from ..core.argsdiff import UNAVAILABLE
from ..core.contract import parse_event
from ..core.secrets import masked_fields
from .replay import Engine, replay

DEFAULT_ALERTS_TOPIC = "agent.alerts"
#: Calls shown per decision from a telemetry file, at most.
CALLS_SHOWN = 10


def run_explain(ident: str, telemetry: str | None, policy: Policy, engine: Engine, as_json: bool,
                env: Mapping[str, str] | None = None, out: TextIO | None = None) -> int:
    """The CLI entry: the exit status."""
    env = os.environ if env is None else env
    out = out or sys.stdout
    if telemetry is not None:
        decisions, calls = _from_telemetry(telemetry, ident, policy, engine)
        source = telemetry
        note = ""
    else:
        keys = KeyRing.from_setting(env[WORKER_KEYS_VAR]) if env.get(WORKER_KEYS_VAR, "").strip() else None
        topic = env.get("LOOPWARDEN_ALERTS_TOPIC", DEFAULT_ALERTS_TOPIC)
        config = KafkaClientConfig.from_env(env)
        decisions, read, refused = asyncio.run(_from_alerts(config, topic, ident, keys))
        calls = {}
        source = f"the alerts topic {topic} ({read} messages read)"
        note = (f"{refused} matching alert(s) skipped: not signed by a key in {WORKER_KEYS_VAR}" if refused else
                "" if keys is not None else f"signatures not checked (set {WORKER_KEYS_VAR} to check them)")
    if not decisions:
        print(f"loopwarden explain: no decision or run {ident!r} in {source}", file=sys.stderr)
        if note:
            print(f"loopwarden explain: {note}", file=sys.stderr)
        return 1
    for decision in decisions:
        if as_json:
            out.write(orjson.dumps(decision).decode() + "\n")
        else:
            out.write(story(decision, calls.get(decision["run_id"], [])))
    if note:
        print(f"loopwarden explain: {note}", file=sys.stderr)
    return 0


def matches(decision: Mapping[str, Any], ident: str) -> bool:
    return decision.get("decision_id") == ident or decision.get("run_id") == ident


def story(decision: Mapping[str, Any], run_calls: list[dict[str, Any]]) -> str:
    """The decision told for a person: what, why, the failure, the streak, its events and arguments; then
    the calls of a telemetry file that the decision is about."""
    evidence: Mapping[str, Any] = decision.get("evidence") or {}
    head = [decision.get("action", "?"), decision.get("verdict", "?"), f" run {decision.get('run_id')}"]
    if decision.get("agent_id"):
        head.append(f" agent {decision['agent_id']}")
    if decision.get("tenant"):
        head.append(f" tenant {decision['tenant']}")
    if isinstance(decision.get("ts_ms"), int):
        head.append(f" {_time(decision['ts_ms'])}")
    lines = [" ".join(head[:2]) + "".join(head[2:])]

    def row(name: str, text: str) -> None:
        lines.append(f"  {name:<10} {text}")

    row("why", str(decision.get("reason", "")))
    failure = ": ".join(str(evidence[k]) for k in ("error_class", "error_head") if evidence.get(k))
    if failure:
        row("failure", failure)
    if "budget" in evidence and "first_event_id" in evidence:
        window = f", within {evidence['window_ms'] // 1000} s" if isinstance(evidence.get("window_ms"), int) else ""
        row("streak", f"{evidence.get('count')} calls, budget {evidence['budget']}, matched "
                      f"{evidence.get('match', 'exact')}{window}")
    ids = evidence.get("event_ids")
    if isinstance(ids, list) and ids:
        row("events", ", ".join(map(str, ids)))
    if "args_diff" in evidence:
        row("arguments", _arguments(evidence["args_diff"]))
    trigger = [f"trigger {decision.get('trigger_event_id')}"]
    if decision.get("trace_id"):
        trigger.append(f"trace {decision['trace_id']}")
    row("decision", f"{decision.get('decision_id')} ({', '.join(trigger)})")
    shown = _calls_of(decision, run_calls)
    if shown:
        lines.append("  calls")
        lines.extend(f"    {_call(call)}" for call in shown)
    return "\n".join(lines) + "\n\n"


def _arguments(diff: Any) -> str:
    if diff == UNAVAILABLE:
        return "unavailable (the runtime sent hashed arguments, or they were over 512 bytes)"
    if not diff:
        return "identical after normalisation"
    parts = []
    for path, (before, after) in (diff.get("changed") or {}).items():
        parts.append(f"{path}: {_json(before)} -> {_json(after)}")
    parts += [f"{path}: added {_json(value)}" for path, value in (diff.get("added") or {}).items()]
    parts += [f"{path}: removed (was {_json(value)})" for path, value in (diff.get("removed") or {}).items()]
    if diff.get("more"):
        parts.append(f"and {diff['more']} more")
    return "; ".join(parts) + " (first call of the streak -> this one)"


def _calls_of(decision: Mapping[str, Any], run_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls the decision is about: its streak's events, else the run's last calls to the trigger."""
    if not run_calls:
        return []
    ids = (decision.get("evidence") or {}).get("event_ids")
    if ids:
        wanted = set(ids)
        return [call for call in run_calls if str(call.get("event_id"))[:64] in wanted][-CALLS_SHOWN:]
    trigger = decision.get("trigger_event_id")
    upto = next((i for i, call in enumerate(run_calls) if call.get("event_id") == trigger), len(run_calls) - 1)
    return run_calls[max(0, upto + 1 - CALLS_SHOWN): upto + 1]


def _call(call: Mapping[str, Any]) -> str:
    parts = [str(call.get("event_id")), _time(call["ts_ms"]) if isinstance(call.get("ts_ms"), int) else "?",
             str(call.get("tool")), str(call.get("outcome", call.get("kind", "")))]
    if call.get("error_class") or call.get("error_head"):
        parts.append(": ".join(str(call[k]) for k in ("error_class", "error_head") if call.get(k)))
    if "args" in call:
        parts.append(f"args {_json(masked_fields(call['args']), 80)}")
    elif call.get("args_hash"):
        parts.append(f"args_hash {str(call['args_hash'])[:12]}")
    return "  ".join(parts)


def _json(value: Any, limit: int = 64) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _time(ts_ms: int) -> str:
    try:
        return datetime.fromtimestamp(ts_ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    except (OverflowError, OSError, ValueError):
        return f"ts_ms {ts_ms}"


def _from_telemetry(path: str, ident: str, policy: Policy,
                    engine: Engine) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """The matching decisions of replaying ``path``, and the calls of their runs (the events the replay
    accepted); the lines it refused are reported on stderr (``line N: reason``), as ``loopwarden replay``
    reports them, and are never shown as calls."""
    with open(path, "rb") as source:
        lines = source.readlines()
    decided, report = io.BytesIO(), io.StringIO()
    replay(lines, policy, decided, report, engine=engine)
    for problem in report.getvalue().splitlines():
        if problem.startswith("line "):  # the replay's summary and warnings are not part of the story
            print(f"loopwarden explain: {path}: {problem}", file=sys.stderr)
    decisions = [d for d in map(orjson.loads, decided.getvalue().splitlines()) if matches(d, ident)]
    runs = {d["run_id"] for d in decisions}
    calls: dict[str, list[dict[str, Any]]] = {run: [] for run in runs}
    for line in lines:
        try:
            event = parse_event(line)  # what the replay refused is no call
        except InvalidEvent:
            continue
        if event.run_id in calls:
            calls[event.run_id].append(orjson.loads(line))
    return decisions, calls


async def _from_alerts(config: KafkaClientConfig, topic: str, ident: str,
                       keys: KeyRing | None) -> tuple[list[dict[str, Any]], int, int]:
    """The matching decisions on ``topic`` from its start to its end now; messages read; matching
    alerts refused for their signature."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition

    await config.check_connection()
    consumer = AIOKafkaConsumer(**config.aiokafka_kwargs(), group_id=None, enable_auto_commit=False,
                                client_id="loopwarden-explain", auto_offset_reset="earliest")
    await consumer.start()
    found: list[dict[str, Any]] = []
    read = refused = 0
    try:
        await consumer.end_offsets([TopicPartition(topic, 0)])  # makes the client learn the topic
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not partitions:
            return [], 0, 0
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        left = {tp for tp, end in ends.items() if end > 0}
        while left:
            batches = await consumer.getmany(*left, timeout_ms=1000)
            for tp, records in batches.items():
                for record in records:
                    read += 1
                    decision = _decision(record.value)
                    if decision is not None and matches(decision, ident):
                        if keys is not None and not _signed(keys, record):
                            refused += 1
                        else:
                            found.append(decision)
                if records and records[-1].offset + 1 >= ends[tp]:
                    left.discard(tp)
            for tp in list(left):
                if await consumer.position(tp) >= ends[tp]:
                    left.discard(tp)
    finally:
        await consumer.stop()
    found.sort(key=lambda d: (d.get("ts_ms", 0), d.get("decision_id", "")))
    return _unique(found), read, refused


def _decision(value: bytes | None) -> dict[str, Any] | None:
    try:
        decision = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        return None
    return decision if isinstance(decision, dict) else None


def _signed(keys: KeyRing, record: Any) -> bool:
    try:
        keys.verify(record.value or b"", record.headers)
    except SignatureRejected:
        return False
    return True


def _unique(decisions: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each decision once (at-least-once publishing may have written one twice)."""
    seen: set[Any] = set()
    kept = []
    for decision in decisions:
        if decision.get("decision_id") not in seen:
            seen.add(decision.get("decision_id"))
            kept.append(decision)
    return kept
