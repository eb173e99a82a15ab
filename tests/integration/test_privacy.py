"""Privacy of telemetry, end to end: an agent's secrets never reach the bus.

A real worker and a ``Guard.fleet`` agent whose tools carry a password, an API key, an e-mail body and a
customer's name in their arguments and results: a runaway that gets halted, a side-effecting duplicate
that gets suppressed, a plain search. Afterwards every record of every topic of that deployment
(telemetry, control, alerts, DLQ, the state changelog and whatever else the worker created under its app
id) is read from the beginning, and none may contain a secret in its key, value or headers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import ConsumerRecord, TopicPartition

from stream_app.client import Guard, KafkaClientConfig, RunHalted

from .tools import Counted
from .workers import Fleet, run

pytestmark = pytest.mark.integration

TIMEOUT_S = 60.0
PASSWORD = "Tr0ub4dor-privacy-pw-7731"
API_KEY = "sk-live-privacy-0c7f3e9a"
EMAIL_BODY = "Dear Mrs Quigglesworth your biopsy results are ready"
CUSTOMER = "Philippa Quigglesworth-Abernathy"
SECRETS = (PASSWORD, API_KEY, EMAIL_BODY, CUSTOMER)
#: A raw tool's argument that is not a secret: it must travel, which proves the scan sees raw values.
SUBJECT = "Order ORD-7731 shipped"
MAIL_ARGS = {"to": "desk@example.com", "subject": SUBJECT, "email_body": EMAIL_BODY, "smtp_password": PASSWORD}


async def _agent(fleet: Fleet) -> dict[str, Any]:
    """Three runs through the SDK: a runaway login (halted), a duplicated e-mail through a raw tool
    (suppressed), a customer search (hashed)."""
    login = Counted(PermissionError(f"login refused for {CUSTOMER}"))
    send = Counted({"message_id": "m-1", "echo": {"email_body": EMAIL_BODY}})
    search = Counted([{"name": CUSTOMER, "notes": EMAIL_BODY}])
    decisions: list[dict[str, Any]] = []
    config = KafkaClientConfig(fleet.bootstrap)
    async with Guard.fleet(config, fleet.telemetry_topic, fleet.control_topic,
                           trusted_keys=fleet.trusted_keys(), raw_tools={"send_email"}) as guard:
        guard.on_decision(decisions.append)
        async with asyncio.timeout(TIMEOUT_S):
            runaway = guard.run("run-login", agent_id="crm-agent")
            with pytest.raises(RunHalted) as halted:  # noqa: PT012 - a runaway calls until it is refused
                while True:
                    try:
                        await runaway.call("crm_login", login, {"username": CUSTOMER, "password": PASSWORD})
                    except PermissionError:
                        await asyncio.sleep(0.05)  # the model's turn

            mail = guard.run("run-mail", agent_id="crm-agent")
            receipts = [await mail.call("send_email", send, MAIL_ARGS, side_effect=True) for _ in range(3)]
            # The guard suppressed the repeats itself; the worker's copy of that decision arrives only if
            # it hashed the raw, redacted e-mail as the guard did.
            while guard.counters["confirmed"] < guard.counters["local"]:
                await asyncio.sleep(0.05)

            lookup = guard.run("run-search", agent_id="crm-agent")
            await lookup.call("search_customers", search, {"customer_name": CUSTOMER, "api_key": API_KEY})
    return {"halted": halted.value, "decisions": decisions, "receipts": receipts, "sent": send.calls,
            "counters": guard.counters}


async def _read_every_topic(bootstrap: str, prefix: str) -> dict[str, list[ConsumerRecord[bytes, bytes]]]:
    """Every record, from the beginning to the current end, of every topic whose name starts with
    ``prefix``."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        names = sorted(t for t in await admin.list_topics() if t.startswith(prefix))
        partitions = [TopicPartition(topic["topic"], partition["partition"])
                      for topic in await admin.describe_topics(names) for partition in topic["partitions"]]
    finally:
        await admin.close()
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        records: dict[str, list[ConsumerRecord[bytes, bytes]]] = {name: [] for name in names}
        behind = [tp for tp in partitions if ends[tp] > 0]
        async with asyncio.timeout(TIMEOUT_S):
            while behind:
                for batch in (await consumer.getmany(*behind, timeout_ms=200)).values():
                    for record in batch:
                        records[record.topic].append(record)
                behind = [tp for tp in behind if await consumer.position(tp) < ends[tp]]
    finally:
        await consumer.stop()
    return records


@pytest.fixture(scope="module")
def privacy_run(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The agent run against one worker; then, with the worker stopped (its changelog flushed),
    everything its deployment has on the broker."""
    fleet = Fleet(kafka_bootstrap, tmp_path_factory.mktemp("privacy"), partitions=2)
    worker = fleet.start_worker()
    try:
        outcome = run(_agent(fleet))
    finally:
        fleet.stop()
    outcome["topics"] = run(_read_every_topic(kafka_bootstrap, fleet.name))
    outcome["fleet"] = fleet
    outcome["log"] = worker.log_tail()
    return outcome


def test_the_scenario_ran_halt_suppress_and_state_included(privacy_run: dict[str, Any]) -> None:
    """The scan below is not vacuous: the runaway was halted, the duplicate e-mail suppressed (the raw,
    redacted e-mail hashed at the worker as the guard hashed it, or the worker would not have confirmed
    the guard's suppression), and the deployment's topics, the state changelog among them, hold records."""
    fleet: Fleet = privacy_run["fleet"]
    assert privacy_run["halted"].verdict == "recursion", privacy_run["log"]
    assert privacy_run["sent"] == 1 and privacy_run["receipts"] == [privacy_run["receipts"][0]] * 3
    # a warning and a halt, two suppressions (the second and third send): each made here and confirmed by
    # the worker
    assert privacy_run["counters"]["confirmed"] == privacy_run["counters"]["local"] == 4
    assert {(d["run_id"], d["action"]) for d in privacy_run["decisions"]} == {
        ("run-login", "advise"), ("run-login", "halt"), ("run-mail", "suppress")}
    topics = privacy_run["topics"]
    expected = {fleet.telemetry_topic, fleet.control_topic, fleet.alerts_topic, fleet.dlq_topic,
                f"{fleet.name}-runs-changelog"}
    assert expected <= set(topics)
    assert all(topics[name] for name in expected - {fleet.dlq_topic}), {t: len(r) for t, r in topics.items()}


def test_no_secret_appears_in_any_record_on_any_topic(privacy_run: dict[str, Any]) -> None:
    """No password, API key, e-mail body or customer name in any key, value, header name or header value
    of any record the deployment wrote, hashed tool or raw."""
    leaks = [
        (topic, record.partition, record.offset, secret)
        for topic, records in privacy_run["topics"].items()
        for record in records
        for part in (record.key or b"", record.value or b"", *(
            name.encode() + b"=" + (value or b"") for name, value in record.headers))
        for secret in SECRETS
        if secret.encode() in part
    ]
    assert leaks == []


def test_raw_tool_sends_its_arguments_without_the_redacted_fields(privacy_run: dict[str, Any]) -> None:
    """send_email is opted in to raw arguments: its recipient and subject travel as they are, its
    e-mail body and SMTP password do not, in any of its three events (the suppressed one included)."""
    fleet: Fleet = privacy_run["fleet"]
    events = [orjson.loads(r.value) for r in privacy_run["topics"][fleet.telemetry_topic]]
    mails = sorted((e for e in events if e["tool"] == "send_email"), key=lambda e: e["seq"])
    assert [(e["args"], e["result"], e.get("attrs")) for e in mails] == [
        ({"to": "desk@example.com", "subject": SUBJECT}, {"message_id": "m-1", "echo": {}}, None),
        ({"to": "desk@example.com", "subject": SUBJECT}, {"message_id": "m-1", "echo": {}}, {"suppressed": True}),
        ({"to": "desk@example.com", "subject": SUBJECT}, {"message_id": "m-1", "echo": {}}, {"suppressed": True}),
    ]
    hashed = [e for e in events if e["tool"] != "send_email"]
    assert {e["tool"] for e in hashed} == {"crm_login", "search_customers"}
    assert all({"args_hash", "result_hash"} <= e.keys() and not {"args", "result"} & e.keys() for e in hashed)
