"""``loopwarden halt|resume RUN_ID --reason TEXT [--wait]``: an operator's signed override of the detector.

The command goes to the telemetry topic, keyed by the run id, signed with the operator's Ed25519 key.
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
from ..bus.wire import encode_operator, header
from ..core import OperatorCommand

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer

DEFAULT_TELEMETRY_TOPIC = "agent.telemetry"
DEFAULT_CONTROL_TOPIC = "agent.control"
DEFAULT_DLQ_TOPIC = "agent.telemetry.dlq"
#: Exit statuses of ``--wait``.
APPLIED, REFUSED, NOT_CONFIRMED = 0, 3, 4


@dataclass(frozen=True)
class Outcome:
    """What became of a command: ``status`` (an exit status) and a line for the operator."""

    status: int
    message: str


def build_command(action: str, run_id: str, reason: str, operator: str, now_ms: int) -> OperatorCommand:
    return OperatorCommand(run_id, action, f"op-{uuid.uuid4().hex}", operator, reason, now_ms)  # type: ignore[arg-type]


async def send_command(config: KafkaClientConfig, topic: str, command: OperatorCommand, signer: Signer) -> None:
    """Send one signed command and wait until the broker has it (idempotent producer, acks=all)."""
    from aiokafka import AIOKafkaProducer

    key, value, headers = encode_operator(command)
    producer = AIOKafkaProducer(**config.aiokafka_kwargs(), acks="all", enable_idempotence=True,
                                client_id="loopwarden-operator")
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=key, headers=[*headers, *signer.headers(value)])
    finally:
        await producer.stop()


async def send_and_wait(config: KafkaClientConfig, topics: Mapping[str, str], command: OperatorCommand,
                        signer: Signer, worker_keys: KeyRing | None, timeout_s: float) -> Outcome:
    """Send ``command``, then watch ``topics["control"]`` and ``topics["dlq"]`` (read from their ends
    as they were before the send) for what the workers made of it."""
    watch = await _watcher(config, [topics["control"], topics["dlq"]])
    try:
        await send_command(config, topics["telemetry"], command, signer)
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


def _outcome_of(record: Any, topics: Mapping[str, str], command: OperatorCommand,
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
                         env: Mapping[str, str] | None = None, *, wait: bool = False, timeout_s: float = 10.0) -> int:
    """The CLI entry: returns the exit status (2 for a configuration error; with ``wait``, 0 applied, 3
    refused, 4 not confirmed)."""
    env = os.environ if env is None else env
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
              "dlq": env.get("LOOPWARDEN_DLQ_TOPIC", DEFAULT_DLQ_TOPIC)}
    command = build_command(action, run_id, reason.strip(), operator, wall_clock_ms())
    asyncio.run(config.check_connection())
    sent = f"{action} of run {run_id} sent as {command.command_id} (operator {operator}, key {signer.key_id})"
    if not wait:
        asyncio.run(send_command(config, topics["telemetry"], command, signer))
        print(f"{sent}; a worker that trusts the key publishes the decision", file=sys.stderr)
        return 0
    outcome = asyncio.run(send_and_wait(config, topics, command, signer, worker_keys, timeout_s))
    print(f"{sent}; {outcome.message}", file=sys.stderr if outcome.status else sys.stdout)
    return outcome.status
