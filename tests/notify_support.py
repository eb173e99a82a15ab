"""What the notifier's tests share: a webhook on loopback that fails on cue, and alerts as the worker
publishes them (real control decisions: the detector over a simulated fleet, CloudEvents binary mode)."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer

from stream_app.bus.signing import Signer, ensure_pairs
from stream_app.bus.wire import encode_control
from stream_app.commands.notify import NotifySettings
from stream_app.core import Decision, Detector, RunTable, decode_event
from stream_app.devtools.fleet_sim import simulate_fleet

SOURCE = "/loopwarden/test"


@dataclass
class Received:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class Webhook:
    """Answers each POST with the next status of ``script`` (then 200); records every request."""

    script: list[int] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    fail_all: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""

    def answer(self, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str]]:
        with self.lock:
            status = 503 if self.fail_all else (self.script.pop(0) if self.script else 200)
            self.received.append(Received(status, headers, body))
        return status, ({"Retry-After": "0"} if status == 429 else {})

    @property
    def delivered(self) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.status < 300]

    @property
    def failed(self) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.status >= 300]


# --------------------------------------------------------------------------------------------------
# Alerts as the worker publishes them


def halts(runs: int = 40, seed: int = 3) -> list[Decision]:
    """Real halt decisions: the detector over a simulated fleet."""
    _, stream = simulate_fleet(runs, seed=seed)
    table = RunTable(Detector())
    return [d for raw in stream for d in table.observe(decode_event(raw)).decisions if d.action == "halt"]


Record = tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]


#: The workers' key pair of these tests (the notifier trusts worker.pub), and a stranger's.
KEYS = ensure_pairs(Path(tempfile.mkdtemp(prefix="notify-keys-")), "worker", "stranger")
WORKER_KEYS = str(KEYS / "worker.pub")


def signed(record: Record, name: str = "worker") -> Record:
    """``record`` with the signature headers of key pair ``name``, as a worker signs what it publishes."""
    key, value, headers = record
    return key, value, [*headers, *Signer.from_file(KEYS / f"{name}.key").headers(value or b"")]


def as_records(decisions: list[Decision]) -> list[Record]:
    return [signed(encode_control(d, SOURCE)) for d in decisions]


BAD_RECORDS: list[tuple[Record, str]] = [
    (signed((b"run-x", b"{not json", [])), "json"),                                   # not JSON
    (signed((b"run-x", b"[1, 2]", [])), "payload"),                                   # JSON, not an object
    (signed((b"run-x", orjson.dumps({"decision_id": "d" * 32, "action": "halt"}), [])), "run_id"),  # fields missing
    (signed((b"run-x", None, [])), "no_value"),                                       # a tombstone
]


async def publish(bootstrap: str, topic: str, records: list[Record]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for key, value, headers in records:
            await producer.send_and_wait(topic, key=key, value=value, headers=headers)
    finally:
        await producer.stop()


def settings_for(bootstrap: str, topic: str, url: str, **extra: str) -> NotifySettings:
    return NotifySettings.from_env({
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "LOOPWARDEN_ALERTS_TOPIC": topic,
        "LOOPWARDEN_NOTIFY_URL": url,
        "LOOPWARDEN_NOTIFY_GROUP": f"notify-{uuid.uuid4().hex[:8]}",
        "LOOPWARDEN_NOTIFY_START": "earliest",
        "LOOPWARDEN_NOTIFY_BACKOFF_S": "0.05",
        "LOOPWARDEN_NOTIFY_BACKOFF_MAX_S": "0.5",
        "LOOPWARDEN_WORKER_KEYS": WORKER_KEYS,
        **extra,
    })


async def until(condition: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@contextmanager
def serving(hook: Webhook) -> Iterator[Webhook]:
    """``hook`` answering on a loopback port (its ``url``) until the block ends."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status, extra = hook.answer({k.lower(): v for k, v in self.headers.items()}, body)
            self.send_response(status)
            for name, value in extra.items():
                self.send_header(name, value)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    hook.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/T000/secret"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hook
    finally:
        server.shutdown()
        server.server_close()


