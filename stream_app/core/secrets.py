"""Secrets, by field name and inside free text: the one owner of what the SDK strips before anything
leaves a runtime (``client/publisher.py``) and of what evidence never quotes (``core/argsdiff.py``).
"""

from __future__ import annotations

import re
from typing import Final

from .normalize import FieldFilter

#: Field names removed from arguments, results and attrs before hashing or sending, matched after folding
#: like the normaliser's (``apiKey``, ``X-API-Key`` and ``api_key`` end alike; globs by fnmatch). Whole
#: names and ``*_suffix`` forms only, never substrings: ``max_tokens``, ``page_token``, ``primary_key``
#: and ``body`` are kept. Two calls that differ only in a redacted field hash the same, so a bare
#: ``body`` is not here: different e-mails to one recipient would look like one duplicated side effect.
DEFAULT_REDACTED_FIELDS: Final[tuple[str, ...]] = (
    "password", "*_password", "passwd", "passphrase", "*_passphrase",
    "secret", "*_secret", "secret_key", "*_secret_key", "secret_access_key", "*_secret_access_key",
    "token", "access_token", "*_access_token", "refresh_token", "*_refresh_token", "id_token",
    "auth_token", "*_auth_token", "bearer_token", "session_token", "api_token", "csrf_token", "xsrf_token",
    "api_key", "apikey", "*_api_key", "private_key", "*_private_key", "credentials",
    "authorization", "proxy_authorization", "cookie", "cookies", "set_cookie",
    "email_body", "e_mail_body", "mail_body", "html_body", "text_body", "body_html", "body_text",
    "body_plain",
)

_NAMES: Final = FieldFilter(DEFAULT_REDACTED_FIELDS)


#: Secrets inside free text: a value after a secret's name (``token=...``, ``password: ...``), a bearer
#: token, credentials in a URL. An error message is text, not fields, so names cannot be matched.
_SECRET_IN_TEXT: Final = (
    re.compile(r"(?i)\b((?:[a-z]+[_-])?(?:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|"
               r"authorization|cookie|session))(\s*[:=]\s*)(\"[^\"]*\"|'[^']*'|[^\s,;&]+)"),
    re.compile(r"(?i)\b(bearer|basic)(\s+)([a-z0-9._~+/=-]{8,})"),
    re.compile(r"(?i)(://)([^/\s:@]+:[^/\s@]+)(@)"),
)


def mask_secrets_in_text(text: str) -> str:
    """``text`` with the secrets it carries after a secret's name, as a bearer token or in a URL masked."""
    masked = _SECRET_IN_TEXT[2].sub(r"\1***\3", text)
    masked = _SECRET_IN_TEXT[1].sub(r"\1\2***", masked)
    return _SECRET_IN_TEXT[0].sub(r"\1\2***", masked)


#: Nesting ``masked_fields`` shows; a container deeper is shown as ``"..."`` (arguments as telemetry carries
#: them may nest as deep as JSON parsers allow, deeper than Python's stack).
SHOWN_DEPTH = 32


def masked_fields(value: object, names: FieldFilter | None = None, depth: int = 0) -> object:
    """A copy of a JSON value with the value of every field named like a secret (``names``, default
    ``DEFAULT_REDACTED_FIELDS``) shown as ``***``, at any depth: for showing arguments to a person.
    Containers nested ``SHOWN_DEPTH`` levels deep are shown as ``"..."``."""
    names = names or _NAMES
    if isinstance(value, dict | list) and depth >= SHOWN_DEPTH:
        return "..."
    if isinstance(value, dict):
        return {k: "***" if names.is_ignored(str(k)) else masked_fields(v, names, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [masked_fields(item, names, depth + 1) for item in value]
    return mask_secrets_in_text(value) if isinstance(value, str) else value
