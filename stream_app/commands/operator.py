"""``loopwarden halt|resume RUN_ID --reason TEXT [--wait]``: an operator's signed override of the detector.

The command goes to the telemetry topic, keyed by the run id, signed with the operator's Ed25519 key.
``--tree ROOT`` and ``--thread TENANT/THREAD`` halt or resume a sub-agent tree or a thread instead, and
``--tool TENANT/TOOL/UPSTREAM`` pauses (``halt``) or resumes a tool: the command goes to the facts topic
(``LOOPWARDEN_FACTS_TOPIC``), keyed ``tree/ROOT``, ``thread/TENANT/THREAD`` or ``tool/TENANT/TOOL/UPSTREAM``
like the facts of that key, so the keyed fold that owns it applies it in order
with them; its answer is a decision of that scope, and the scopes topic keeps the halt (a resume
tombstones it), so runtimes started later know.
Workers apply it only if the key is one of their ``LOOPWARDEN_OPERATOR_KEYS`` (anything else goes to the
dead-letter topic with the reason) and answer with a signed control message (verdict ``operator_halt``
or ``operator_resume``, evidence: who, why, command id, key id), published on the control topic for
runtimes and on the alerts topic as the audit record.

With ``--wait`` (the default at a terminal) the command watches, from before it sends, the control topic
for the workers' decision on this command and the dead-letter topic for its refusal, and says which
came: exit 0 applied, 3 refused (with the workers' reason: an untrusted key, a command too old), 4 not
confirmed within ``--timeout`` (no worker running, or one far behind). The decision is checked against
the workers' public keys (``LOOPWARDEN_WORKER_KEYS``) when they are given.
"""

from __future__ import annotations

import asyncio
import getpass
import os
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from ..bus.clock import wall_clock_ms
from ..bus.kafka import KafkaClientConfig
from ..bus.signing import WORKER_KEYS_VAR, KeyRing, SignatureRejected, Signer
from ..bus.wire import encode_operator, encode_scope_operator, header
from ..core import OperatorCommand
from ..core.fleet.scope import ScopeCommand, key_part

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer

DEFAULT_TELEMETRY_TOPIC = "agent.telemetry"
DEFAULT_CONTROL_TOPIC = "agent.control"
DEFAULT_DLQ_TOPIC = "agent.telemetry.dlq"
DEFAULT_FACTS_TOPIC = "loopwarden.facts"
#: Exit statuses of ``--wait``.
APPLIED, REFUSED, NOT_CONFIRMED = 0, 3, 4


@dataclass(frozen=True)
class Outcome:
    """What became of a command: ``status`` (an exit status) and a line for the operator."""

    status: int
    message: str


def build_command(action: str, run_id: str, reason: str, operator: str, now_ms: int) -> OperatorCommand:
    return OperatorCommand(run_id, action, f"op-{uuid.uuid4().hex}", operator, reason, now_ms)  # type: ignore[arg-type]


def parse_scope(scope: str, target: str) -> tuple[str, ...]:
    """The key of ``--tree ROOT``, ``--thread TENANT/THREAD`` or ``--tool TENANT/TOOL/UPSTREAM`` (the tenant
    before the first ``/``, empty for telemetry that names none: ``/THREAD``), every part but the last
    written as the scope key has it: a ``/`` in it as ``%2F``, a ``%`` as ``%25`` (tenant ``acme/eu``:
    ``--thread acme%2Feu/pr-7``); ValueError saying what is wrong."""
    if scope == "tree":
        if not target:
            raise ValueError("--tree: the root run id of the tree")
        return (target,)
    if scope == "tool":
        parts = target.split("/", 2)
        if len(parts) != 3 or not parts[1] or not parts[2]:
            raise ValueError(f"--tool {target!r}: expected TENANT/TOOL/UPSTREAM (`/TOOL/UPSTREAM` when the "
                             "telemetry names no tenant)")
        return (key_part(parts[0]), key_part(parts[1]), parts[2])
    tenant, slash, thread = target.partition("/")
    if not slash or not thread:
        raise ValueError(f"--thread {target!r}: expected TENANT/THREAD (`/THREAD` when the telemetry names no "
                         "tenant)")
    return (key_part(tenant), thread)


async def send_command(config: KafkaClientConfig, topic: str, command: OperatorCommand | ScopeCommand,
                       signer: Signer) -> None:
    """Send one signed command and wait until the broker has it (idempotent producer, acks=all). A
    scope command's key (``scope/key``) puts it on the partition of that key's facts (the default
    partitioner, as the workers' facts publisher)."""
    from aiokafka import AIOKafkaProducer

    key, value, headers = encode_operator(command) if isinstance(command, OperatorCommand) \
        else encode_scope_operator(command)
    producer = AIOKafkaProducer(**config.aiokafka_kwargs(), acks="all", enable_idempotence=True,
                                client_id="loopwarden-operator")
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=key, headers=[*headers, *signer.headers(value)])
    finally:
        await producer.stop()


async def send_and_wait(config: KafkaClientConfig, topics: Mapping[str, str], command: OperatorCommand | ScopeCommand,
                        signer: Signer, worker_keys: KeyRing | None, timeout_s: float) -> Outcome:
    """Send ``command`` (to ``topics["telemetry"]``, a scope command to ``topics["facts"]``), then watch
    ``topics["control"]`` and ``topics["dlq"]`` (read from their ends as they were before the send) for
    what the workers made of it."""
    watch = await _watcher(config, [topics["control"], topics["dlq"]])
    try:
        await send_command(config, topics["telemetry" if isinstance(command, OperatorCommand) else "facts"], command,
                           signer)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            batches = await watch.getmany(timeout_ms=int(min(left, 0.5) * 1000))
            for records in batches.values():
                for record in records:
                    outcome = _outcome_of(record, topics, command, worker_keys)
                    if outcome is not None:
                        return outcome
    finally:
        await watch.stop()
    return Outcome(NOT_CONFIRMED, f"no worker confirmed {command.command_id} within {timeout_s:g} s: is a worker "
                                  f"running on {topics['telemetry']}, and caught up?")


async def _watcher(config: KafkaClientConfig, topics: list[str]) -> AIOKafkaConsumer:
    """A consumer of every partition of ``topics``, positioned at their current ends (no group)."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition

    consumer = AIOKafkaConsumer(**config.aiokafka_kwargs(), group_id=None, enable_auto_commit=False,
                                client_id="loopwarden-operator")
    await consumer.start()
    try:
        partitions = []
        for topic in topics:
            await consumer.end_offsets([TopicPartition(topic, 0)])  # makes the client learn the topic
            partitions += [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(partitions)
        ends = await consumer.end_offsets(partitions)
        for tp, end in ends.items():
            consumer.seek(tp, end)
    except BaseException:
        await consumer.stop()
        raise
    return consumer


def _outcome_of(record: Any, topics: Mapping[str, str], command: OperatorCommand | ScopeCommand,
                worker_keys: KeyRing | None) -> Outcome | None:
    """The outcome ``record`` reports for ``command``, or None if it is about something else."""
    value = record.value or b""
    if record.topic == topics["dlq"]:
        try:
            refused = orjson.loads(value)
        except orjson.JSONDecodeError:
            return None
        if type(refused) is not dict or refused.get("command_id") != command.command_id:
            return None
        reason = (header(record.headers, "error") or b"no reason given").decode(errors="replace")
        return Outcome(REFUSED, f"refused by the workers: {reason}")
    try:
        decision = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    if type(decision) is not dict or (decision.get("evidence") or {}).get("command_id") != command.command_id:
        return None
    checked = "unverified: set LOOPWARDEN_WORKER_KEYS to check the workers' signature"
    if worker_keys is not None:
        try:
            checked = f"signed by worker key {worker_keys.verify(value, record.headers)}"
        except SignatureRejected as exc:
            return Outcome(REFUSED, f"a decision on this command came with a signature that does not verify "
                                    f"({exc.reason}): not from a trusted worker")
    return Outcome(APPLIED, f"applied: {decision.get('verdict')} decision {decision.get('decision_id')} ({checked})")


def run_operator_command(action: str, run_id: str, reason: str, operator: str | None, key_path: str | None,
                         env: Mapping[str, str] | None = None, *, wait: bool = False, timeout_s: float = 10.0,
                         scope: str = "run") -> int:
    """The CLI entry: returns the exit status (2 for a configuration error; with ``wait``, 0 applied, 3
    refused, 4 not confirmed). ``scope`` ``tree`` or ``thread``: ``run_id`` is the scope's key (``ROOT``,
    ``TENANT/THREAD``)."""
    env = os.environ if env is None else env
    try:
        scope_key = parse_scope(scope, run_id) if scope != "run" else ()
    except ValueError as exc:
        print(f"loopwarden {action}: {exc}", file=sys.stderr)
        return 2
    key_path = key_path or env.get("LOOPWARDEN_OPERATOR_KEY")
    operator = operator or env.get("LOOPWARDEN_OPERATOR") or getpass.getuser()
    if not key_path:
        print(f"loopwarden {action}: --key (or LOOPWARDEN_OPERATOR_KEY): the operator's Ed25519 private key is "
              "required; `loopwarden keys generate --name NAME` makes one", file=sys.stderr)
        return 2
    if not reason.strip():
        print(f"loopwarden {action}: --reason must say why (it is recorded on the alerts topic)", file=sys.stderr)
        return 2
    signer = Signer.from_file(key_path)
    config = KafkaClientConfig.from_env(env)
    worker_keys = KeyRing.from_setting(env[WORKER_KEYS_VAR]) if env.get(WORKER_KEYS_VAR, "").strip() else None
    topics = {"telemetry": env.get("LOOPWARDEN_TELEMETRY_TOPIC", DEFAULT_TELEMETRY_TOPIC),
              "control": env.get("LOOPWARDEN_CONTROL_TOPIC", DEFAULT_CONTROL_TOPIC),
              "dlq": env.get("LOOPWARDEN_DLQ_TOPIC", DEFAULT_DLQ_TOPIC),
              "facts": env.get("LOOPWARDEN_FACTS_TOPIC", DEFAULT_FACTS_TOPIC)}
    command: OperatorCommand | ScopeCommand
    if scope == "run":
        command = build_command(action, run_id, reason.strip(), operator, wall_clock_ms())
        what = f"run {run_id}"
    else:
        scope_action = "pause" if scope == "tool" and action == "halt" else action  # a tool is paused, not halted
        command = ScopeCommand(scope, scope_key, scope_action, f"op-{uuid.uuid4().hex}", operator, reason.strip(),
                               wall_clock_ms())
        what = f"{ {'tree': 'sub-agent tree', 'thread': 'thread', 'tool': 'tool'}[scope]} {run_id}"
    asyncio.run(config.check_connection())
    sent = f"{action} of {what} sent as {command.command_id} (operator {operator}, key {signer.key_id})"
    if not wait:
        asyncio.run(send_command(config, topics["telemetry" if scope == "run" else "facts"], command, signer))
        print(f"{sent}; a worker that trusts the key publishes the decision", file=sys.stderr)
        return 0
    outcome = asyncio.run(send_and_wait(config, topics, command, signer, worker_keys, timeout_s))
    print(f"{sent}; {outcome.message}", file=sys.stderr if outcome.status else sys.stdout)
    return outcome.status
