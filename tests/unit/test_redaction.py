"""Redaction in the SDK: secrets are removed by field name before anything is hashed or sent.

Hashing alone is not enough for a password or an API key: a raw tool would send it as is, and a
low-entropy secret can be recovered from its hash by trying candidates. So named secret fields are
removed from arguments, results and attrs, at any depth, for hashed and raw tools alike, and a raw
event must still hash, at the worker, exactly as the client hashed it.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stream_app.bus.wire import encode_telemetry
from stream_app.client import FinishedCall, TelemetryBuilder
from stream_app.client.publisher import DEFAULT_REDACTED_FIELDS
from stream_app.core import Detector, FieldFilter, RunTable, decode_event, semantic_hash

PASSWORD = "hunter2-correct-horse"
SECRETS = FieldFilter(DEFAULT_REDACTED_FIELDS)


def _call(tool: str, args: Any, result: Any = "ok", *, ts_ms: int = 1_764_000_000_000, **extra: Any) -> FinishedCall:
    return FinishedCall("run-r", tool, args, "error", result, ts_ms, 1.0, **extra)


def _wire(event: dict[str, Any]) -> dict[str, Any]:
    """The event as the worker decodes it off the bus."""
    return orjson.loads(encode_telemetry(event)[1])


def _keys(value: Any) -> list[str]:
    """Every object key in a JSON value, at any depth."""
    if isinstance(value, dict):
        return [k for key, item in value.items() for k in (key, *_keys(item))]
    if isinstance(value, list):
        return [k for item in value for k in _keys(item)]
    return []


@pytest.mark.parametrize(
    "name",
    [
        "password", "Password", "DB_PASSWORD", "newPassword", "passphrase",  # passwords
        "token", "access_token", "accessToken", "refresh-token", "id_token", "github_access_token",  # tokens
        "api_key", "apiKey", "APIKey", "X-API-Key", "openai_api_key",  # API keys
        "Authorization", "Proxy-Authorization", "cookie", "Set-Cookie",  # HTTP credentials
        "client_secret", "clientSecret", "aws_secret_access_key", "private_key", "sshPrivateKey",  # keys
        "credentials",  # a whole credentials object
        "email_body", "emailBody", "E-Mail Body", "html_body", "body_text",  # e-mail bodies
    ],
)
def test_secret_names_are_redacted_however_they_are_spelled(name: str) -> None:
    """Names fold like the normaliser's (case, camelCase, dashes, spaces), so every spelling of a secret
    field is removed from a raw tool's arguments and result."""
    builder = TelemetryBuilder(raw_tools={"login"})
    event = builder.build(_call("login", {name: PASSWORD, "user": "ana"}, {name: PASSWORD, "ok": False}))
    assert (event["args"], event["result"]) == ({"user": "ana"}, {"ok": False})


@pytest.mark.parametrize(
    "name",
    [
        "max_tokens", "maxTokens", "tokens", "token_count", "tokenizer",  # model parameters and usage
        "page_token", "nextPageToken",  # pagination cursors: distinct pages must stay distinct calls
        "body", "subject", "email", "to",  # a bare body may be a document; see DEFAULT_REDACTED_FIELDS
        "primary_key", "public_key", "sort_key", "key",  # keys that are not secrets
        "password_policy", "secretary", "cookie_policy", "auth_method",  # secret-ish words, not secrets
    ],
)
def test_innocent_names_are_kept(name: str) -> None:
    """Only whole names and suffixes match, never substrings: model and paging parameters travel."""
    builder = TelemetryBuilder(raw_tools={"t"})
    assert builder.build(_call("t", {name: 7}))["args"] == {name: 7}


def test_secrets_are_removed_at_any_depth_from_args_result_and_attrs() -> None:
    """Secrets nested in objects inside lists are removed from everything the event carries; the
    caller's values are left untouched (they are the agent's, not ours)."""
    args = {"q": "report", "auth": {"headers": [{"Authorization": f"Bearer {PASSWORD}", "accept": "json"}]}}
    result = [{"rows": 3, "session": {"refresh_token": PASSWORD}}]
    attrs = {"suppressed": True, "upstream": {"api_key": PASSWORD}}
    event = TelemetryBuilder(raw_tools={"t"}).build(_call("t", args, result, attrs=attrs))

    assert event["args"] == {"q": "report", "auth": {"headers": [{"accept": "json"}]}}
    assert event["result"] == [{"rows": 3, "session": {}}]
    assert event["attrs"] == {"suppressed": True, "upstream": {}}
    assert PASSWORD.encode() not in encode_telemetry(event)[1]
    assert args["auth"]["headers"][0]["Authorization"] == f"Bearer {PASSWORD}"
    assert attrs["upstream"] == {"api_key": PASSWORD}


def test_attrs_left_empty_by_redaction_are_not_sent() -> None:
    """attrs that held only secrets disappear rather than travel as an empty object."""
    event = TelemetryBuilder().build(_call("t", {}, attrs={"cookie": PASSWORD}))
    assert "attrs" not in event


def test_hashed_tools_hash_the_redacted_value() -> None:
    """A hashed tool's hashes are those of the value without its secrets, so the hash holds nothing to
    guess a password from, and calls differing only in a secret are the same call."""
    builder = TelemetryBuilder()
    event = builder.build(_call("login", {"user": "ana", "password": PASSWORD}, {"token": PASSWORD, "ok": 0}))
    assert event["args_hash"] == semantic_hash({"user": "ana"})
    assert event["result_hash"] == semantic_hash({"ok": 0})
    assert builder.args_hash(None, "login", {"user": "ana", "password": "other"}) == event["args_hash"]


def test_redacted_raw_event_hashes_at_the_worker_as_the_client_hashes_it() -> None:
    """A raw tool's events, folded by the detector as the worker folds them, give the argument and result
    hashes the client computes; interleaved with the same calls sent as hashes they form one streak
    of identical failures, halted on the 4th with verified arguments."""
    args = {"user": "ana", "credentials": {"password": PASSWORD}, "opts": [{"apiKey": PASSWORD}]}
    result = {"error": "locked", "cookie": PASSWORD}
    raw, hashed = TelemetryBuilder(raw_tools={"login"}), TelemetryBuilder()
    table = RunTable(Detector())
    decisions = []
    for n, builder in enumerate((raw, hashed, raw, hashed)):
        event = _wire(builder.build(_call("login", args, result, ts_ms=1_764_000_000_000 + n)))
        decisions.extend(d for d in table.observe(decode_event(event)).decisions if d.action != "advise")

    assert [(d.action, d.verdict) for d in decisions] == [("halt", "recursion")]
    evidence = decisions[0].evidence
    assert evidence["args_verified"] is True
    assert evidence["args_hash"] == hashed.args_hash(None, "login", args) == raw.args_hash(None, "login", args)
    assert evidence["result_hash"] == semantic_hash({"error": "locked"})


def test_redaction_list_is_the_callers_choice() -> None:
    """``redact`` replaces the default list: a tool whose e-mail body is plain ``body`` can add it, and
    an empty list switches redaction off."""
    call = _call("send_email", {"to": "ana@example.com", "body": "Dear Ana", "password": PASSWORD})
    with_body = TelemetryBuilder(raw_tools={"send_email"}, redact=(*DEFAULT_REDACTED_FIELDS, "body"))
    assert with_body.build(call)["args"] == {"to": "ana@example.com"}
    off = TelemetryBuilder(raw_tools={"send_email"}, redact=())
    assert off.build(call)["args"] == call.args


def test_one_string_is_refused_as_a_redaction_list() -> None:
    """redact="password" would silently redact single letters; it is refused."""
    with pytest.raises(TypeError, match="list of field-name patterns"):
        TelemetryBuilder(redact="password")


def test_redactions_are_logged_at_debug_by_name_never_by_value(caplog: pytest.LogCaptureFixture) -> None:
    """An operator can see that redaction happens and to which fields, at debug level only."""
    with caplog.at_level(logging.DEBUG, logger="stream_app.client.publisher"):
        TelemetryBuilder().build(_call("login", {"password": PASSWORD, "pwd": "/tmp"}, {"Set-Cookie": PASSWORD}))
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (logging.DEBUG, "redacted 1 field(s) from the args of tool login: password") in messages
    assert (logging.DEBUG, "redacted 1 field(s) from the result of tool login: Set-Cookie") in messages
    assert all(PASSWORD not in message and level == logging.DEBUG for level, message in messages)


# --------------------------------------------------------------------------------------------------
# Properties

secret_names = st.sampled_from(
    ["password", "DB_PASSWORD", "accessToken", "refresh-token", "api_key", "X-API-Key", "Authorization",
     "cookie", "client_secret", "privateKey", "credentials", "emailBody"]
)
innocent_names = st.text(max_size=8).filter(lambda name: not SECRETS.is_ignored(name))
scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=12) | st.floats(
    allow_nan=False, allow_infinity=False
)


def _json(names: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=4) | st.dictionaries(names, children, max_size=4),
        max_leaves=20,
    )


mixed_objects = st.dictionaries(secret_names | innocent_names, _json(secret_names | innocent_names), max_size=6)
innocent_objects = st.dictionaries(innocent_names, _json(innocent_names), max_size=6)


@given(mixed_objects, _json(secret_names | innocent_names), st.booleans())
def test_no_redacted_name_reaches_the_wire_at_any_depth(args: dict[str, Any], result: Any, raw: bool) -> None:
    """Invariant: no object key of the encoded event, at any depth, is a redacted name, whether the tool
    is raw or hashed and whether the secret sits in the arguments, the result or attrs."""
    builder = TelemetryBuilder(raw_tools={"t"} if raw else ())
    event = _wire(builder.build(_call("t", args, result, attrs=args)))
    assert [key for key in _keys(event) if SECRETS.is_ignored(key)] == []


@given(innocent_objects, _json(innocent_names))
def test_hashes_are_unchanged_without_redactable_names(args: dict[str, Any], result: Any) -> None:
    """Invariant: for values with no redactable name, the hashes are the core's semantic hashes, exactly
    as without redaction, so existing runtimes and stored hashes keep comparing equal."""
    event = TelemetryBuilder().build(_call("t", args, result))
    unredacted = TelemetryBuilder(redact=()).build(_call("t", args, result))
    assert event["args_hash"] == unredacted["args_hash"] == semantic_hash(args)
    assert event["result_hash"] == unredacted["result_hash"] == semantic_hash(result)
