"""``loopwarden halt|resume RUN_ID --reason TEXT``: an operator's signed override of the detector.

The command goes to the telemetry topic, keyed by the run id, signed with the operator's Ed25519 key.
Workers apply it only if the key is one of their ``LOOPWARDEN_OPERATOR_KEYS`` (anything else goes to the
dead-letter topic with the reason) and answer with a signed control message (verdict ``operator_halt``
or ``operator_resume``, evidence: who, why, command id, key id), published on the control topic for
runtimes and on the alerts topic as the audit record.
"""

from __future__ import annotations

import asyncio
import getpass
import os
import sys
import uuid
from collections.abc import Mapping

from ..bus.clock import wall_clock_ms
from ..bus.kafka import KafkaClientConfig, KafkaConfigError
from ..bus.signing import KeyFileError, Signer
from ..bus.wire import encode_operator
from ..core import OperatorCommand

DEFAULT_TELEMETRY_TOPIC = "agent.telemetry"


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


def run_operator_command(action: str, run_id: str, reason: str, operator: str | None, key_path: str | None,
                         env: Mapping[str, str] | None = None) -> int:
    """The CLI entry: returns the exit status (2 for a configuration error)."""
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
    try:
        signer = Signer.from_file(key_path)
        config = KafkaClientConfig.from_env(env)
    except (KeyFileError, KafkaConfigError) as exc:
        print(f"loopwarden {action}: {exc}", file=sys.stderr)
        return 2
    topic = env.get("LOOPWARDEN_TELEMETRY_TOPIC", DEFAULT_TELEMETRY_TOPIC)
    command = build_command(action, run_id, reason.strip(), operator, wall_clock_ms())
    asyncio.run(send_command(config, topic, command, signer))
    print(f"{action} of run {run_id} sent as {command.command_id} (operator {operator}, key {signer.key_id}); "
          "a worker that trusts the key publishes the decision", file=sys.stderr)
    return 0
