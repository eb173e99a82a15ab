"""Ed25519 signatures on control messages: what a runtime's listener accepts and refuses."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import orjson
import pytest
from aiokafka.structs import ConsumerRecord

from stream_app.bus.clock import wall_clock_ms
from stream_app.bus.kafka import KafkaClientConfig, KafkaConfigError
from stream_app.bus.signing import KeyFileError, KeyRing, SignatureRejected, Signer, generate
from stream_app.client.listener import ControlBoard, HaltListener


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("keys")
    for name in ("worker", "next", "attacker"):
        generate(folder, name)
    return folder


def _halt(run_id: str = "run-1", decision_id: str = "d-1", ts_ms: int | None = None) -> bytes:
    return orjson.dumps({"run_id": run_id, "action": "halt", "verdict": "recursion", "decision_id": decision_id,
                         "trigger_event_id": "e-4", "ts_ms": wall_clock_ms() if ts_ms is None else ts_ms,
                         "reason": "test", "evidence": {}})


def _record(value: bytes, headers: list[tuple[str, bytes]]) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord("agent.control", 0, 7, 0, 0, b"run-1", value, None, 5, len(value), tuple(headers))


def _listener(ring: KeyRing | None, **kwargs: object) -> HaltListener:
    return HaltListener(KafkaClientConfig("127.0.0.1:1"), trusted_keys=ring, board=ControlBoard(watch_all=True),
                        allow_unsigned=ring is None, **kwargs)  # type: ignore[arg-type]


def test_generated_keys_sign_and_verify(keys: Path) -> None:
    signer = Signer.from_file(keys / "worker.key")
    ring = KeyRing.from_paths([keys / "worker.pub"])
    value = _halt()
    assert ring.verify(value, signer.headers(value)) == signer.key_id
    assert signer.key_id.startswith("ed25519:") and len(signer.key_id) == 24
    assert (os.stat(keys / "worker.key").st_mode & 0o777) == 0o600


def test_signatures_are_those_of_any_ed25519_implementation(keys: Path) -> None:
    """libsodium signs and checks here; workers and runtimes of releases that signed with ``cryptography``
    (OpenSSL) interoperate both ways during a rolling upgrade: Ed25519 signatures are deterministic."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    openssl_key = load_pem_private_key((keys / "worker.key").read_bytes(), password=None)
    assert isinstance(openssl_key, Ed25519PrivateKey)
    signer, ring = Signer.from_file(keys / "worker.key"), KeyRing.from_paths([keys / "worker.pub"])
    value = _halt()
    signature = base64.urlsafe_b64encode(openssl_key.sign(value)).rstrip(b"=")
    assert signer.headers(value) == [("lw_key_id", signer.key_id.encode()), ("lw_signature", signature)]
    assert ring.verify(value, [("lw_key_id", signer.key_id.encode()), ("lw_signature", signature)]) == signer.key_id
    openssl_key.public_key().verify(base64.urlsafe_b64decode(signature + b"=="), value)  # raises if not


@pytest.mark.parametrize("signature", [b"", b"AAAA", b"not base64 at all!", b"A" * 200])
def test_a_malformed_signature_is_a_bad_signature(keys: Path, signature: bytes) -> None:
    ring = KeyRing.from_paths([keys / "worker.pub"])
    key = Signer.from_file(keys / "worker.key").key_id.encode()
    with pytest.raises(SignatureRejected) as refused:
        ring.verify(_halt(), [("lw_key_id", key), ("lw_signature", signature)])
    assert refused.value.reason == "bad_signature"


def test_a_valid_halt_is_applied(keys: Path) -> None:
    listener = _listener(KeyRing.from_paths([keys / "worker.pub"]))
    value = _halt()
    assert listener.receive(_record(value, Signer.from_file(keys / "worker.key").headers(value))) == "applied"
    assert listener.board.halt_decision("run-1") is not None


@pytest.mark.parametrize("attack", ["unsigned", "other key", "other key, trusted key id", "tampered"])
def test_forged_and_tampered_halts_are_refused_and_counted(keys: Path, attack: str) -> None:
    listener = _listener(KeyRing.from_paths([keys / "worker.pub"]))
    value = _halt()
    worker, attacker = Signer.from_file(keys / "worker.key"), Signer.from_file(keys / "attacker.key")
    if attack == "unsigned":
        record, reason = _record(value, []), "unsigned"
    elif attack == "other key":
        record, reason = _record(value, attacker.headers(value)), "unknown_key"
    elif attack == "other key, trusted key id":
        headers = [("lw_key_id", worker.key_id.encode()), attacker.headers(value)[1]]
        record, reason = _record(value, headers), "bad_signature"
    else:
        signed = worker.headers(value)
        record, reason = _record(value.replace(b"run-1", b"run-2"), signed), "bad_signature"
    assert listener.receive(record) == reason
    assert listener.board.counters[reason] == 1
    assert listener.board.counters["applied"] == 0
    assert listener.board.halt_decision("run-1") is None and listener.board.halt_decision("run-2") is None


class _CountingRing(KeyRing):
    """A key ring that counts the signatures it checks."""

    checked = 0

    def verify(self, value: bytes, headers: object) -> str:
        self.checked += 1
        return super().verify(value, headers)


def _guarding(keys: Path) -> tuple[HaltListener, _CountingRing, Signer, Signer]:
    """A listener as a fleet guard has one (it watches its own runs only), its ring, the worker's and an
    attacker's signer."""
    ring = _CountingRing.from_paths([keys / "worker.pub"])
    assert isinstance(ring, _CountingRing)
    listener = HaltListener(KafkaClientConfig("127.0.0.1:1"), trusted_keys=ring, board=ControlBoard())
    return listener, ring, Signer.from_file(keys / "worker.key"), Signer.from_file(keys / "attacker.key")


def test_other_processes_decisions_are_parked_unchecked_and_checked_when_their_run_is_watched(keys: Path) -> None:
    """Decisions about runs this process does not watch cost no signature check; a run watched later
    gets its parked halt, checked then."""
    listener, ring, worker, _ = _guarding(keys)
    for n in range(20):
        value = _halt(run_id=f"other-{n}", decision_id=f"d-{n}")
        assert listener.receive(_record(value, worker.headers(value))) == "ignored"
    assert ring.checked == 0
    listener.board.watch("run-1")
    value = _halt(run_id="run-1", decision_id="d-mine")
    assert listener.receive(_record(value, worker.headers(value))) == "applied"
    assert ring.checked == 1
    listener.board.watch("other-3")
    assert ring.checked == 2
    assert listener.board.halt_decision("other-3") is not None
    assert listener.board.halt_decision("other-4") is None
    assert listener.board.counters["applied"] == 2


@pytest.mark.parametrize("attack", ["unsigned", "other key", "tampered"])
def test_a_forged_decision_parked_unchecked_is_refused_when_its_run_is_watched(keys: Path, attack: str) -> None:
    """A forged halt for a run not watched yet is parked, and refused and counted when the run is watched;
    its decision id is not taken from the genuine halt that comes after it."""
    listener, _, worker, attacker = _guarding(keys)
    value = _halt(decision_id="d-real")
    if attack == "unsigned":
        record, reason = _record(value, []), "unsigned"
    elif attack == "other key":
        record, reason = _record(value, attacker.headers(value)), "unknown_key"
    else:
        genuine = _halt(run_id="run-9", decision_id="d-real")
        record, reason = _record(value, worker.headers(genuine)), "bad_signature"
    assert listener.receive(record) == "ignored"
    assert listener.board.counters[reason] == 0
    listener.board.watch("run-1")
    assert listener.board.counters[reason] == 1
    assert listener.board.halt_decision("run-1") is None
    assert listener.receive(_record(value, worker.headers(value))) == "applied"
    assert listener.board.halt_decision("run-1") is not None


def test_a_stale_decision_about_another_run_is_dropped_unchecked(keys: Path) -> None:
    listener, ring, worker, _ = _guarding(keys)
    old = _halt(run_id="other", ts_ms=wall_clock_ms() - 3_600_000)
    assert listener.receive(_record(old, worker.headers(old))) == "expired"
    listener.board.watch("other")
    assert ring.checked == 0 and listener.board.halt_decision("other") is None


def test_replays_are_refused_when_old_or_already_applied(keys: Path) -> None:
    signer = Signer.from_file(keys / "worker.key")
    listener = _listener(KeyRing.from_paths([keys / "worker.pub"]), max_age_ms=60_000)
    old = _halt(decision_id="d-old", ts_ms=wall_clock_ms() - 120_000)
    assert listener.receive(_record(old, signer.headers(old))) == "expired"
    fresh = _halt(decision_id="d-new")
    assert listener.receive(_record(fresh, signer.headers(fresh))) == "applied"
    assert listener.receive(_record(fresh, signer.headers(fresh))) == "duplicate"
    assert (listener.board.counters["expired"], listener.board.counters["duplicate"]) == (1, 1)


def test_rotation_trusts_both_keys_during_the_roll_over(keys: Path) -> None:
    rolling = _listener(KeyRing.from_paths([keys / "worker.pub", keys / "next.pub"]))
    after = _listener(KeyRing.from_paths([keys / "next.pub"]))
    for n, name in enumerate(("worker", "next")):
        value = _halt(run_id=f"run-{n}", decision_id=f"d-{n}")
        headers = Signer.from_file(keys / f"{name}.key").headers(value)
        assert rolling.receive(_record(value, headers)) == "applied"
        assert after.receive(_record(value, headers)) == ("unknown_key" if name == "worker" else "applied")


def test_a_directory_of_public_keys_is_a_key_ring(keys: Path) -> None:
    ring = KeyRing.from_setting(f" {keys} ")
    assert len(ring.key_ids) == 3


def test_a_listener_without_keys_is_refused_unless_unsigned_is_allowed() -> None:
    with pytest.raises(KafkaConfigError, match="trusted_keys"):
        HaltListener(KafkaClientConfig("127.0.0.1:1"))
    listener = _listener(None)
    assert listener.receive(_record(_halt(), [])) == "applied"


@pytest.mark.parametrize("content", [b"", b"not a key", b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"])
def test_bad_key_files_name_the_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.pub"
    path.write_bytes(content)
    with pytest.raises(KeyFileError, match=r"bad\.pub"):
        KeyRing.from_paths([path])
    with pytest.raises(KeyFileError, match=r"bad\.pub"):
        Signer.from_file(path)


def test_generate_refuses_to_overwrite(keys: Path) -> None:
    with pytest.raises(KeyFileError, match="exists"):
        generate(keys, "worker")


def test_rejection_carries_its_reason(keys: Path) -> None:
    with pytest.raises(SignatureRejected) as caught:
        KeyRing.from_paths([keys / "worker.pub"]).verify(b"{}", [])
    assert caught.value.reason == "unsigned"
