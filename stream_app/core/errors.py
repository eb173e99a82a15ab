"""The root of every error loopwarden raises, and the core's own errors.

Every error the package raises on purpose is a ``LoopwardenError``; where callers caught a builtin
before, the builtin stays a base (``(also ValueError)``). Classification lives in class attributes and
fields, never in message text (``InvalidEvent.field or InvalidEvent.kind`` is a dead letter's reason).
The whole tree, by the module that defines each::

    LoopwardenError
    ├── InvalidEvent             core.errors     a telemetry event breaks the v1 contract (names the field)
    │   ├── NotJSON              core.errors       its bytes are not JSON at all (kind "json")
    │   └── FoldFailed           worker.batch      the worker failed on it: a bug (kind "internal"), dead-lettered
    ├── NormalisationError       core.errors     a value has no canonical form
    ├── PolicyError              core.errors     a policy document is malformed (names the setting's path)
    ├── StoredRecordError        core.stored     a stored run record cannot be decoded (also RuntimeError)
    │   └── StateVersionError    core.stored       its format version is not one this release knows
    ├── KafkaConfigError         bus.kafka       Kafka settings that cannot work together (also ValueError)
    ├── KafkaUnreachable         bus.kafka       no broker reached, or it refused the login (also ConnectionError)
    ├── SettingsError            bus.settings    an environment variable's value (also ValueError)
    │   └── NotifySettingsError  commands.notify
    ├── KeyFileError             bus.signing     a key file that cannot be used (also ValueError)
    ├── SignatureRejected        bus.signing     a signature that does not verify (``reason``)
    ├── RunHalted                client.errors   the run was halted: stop calling tools (carries the decision)
    │   ├── TreeHalted           client.errors   the run's sub-agent tree was halted (no child starts in it)
    │   ├── ThreadHalted         client.errors   the thread was halted (no new run starts on it)
    │   ├── AgentRunHalted       integrations.openai_agents  (also the SDK's AgentsException)
    │   └── GuardrailHalted      integrations.openai_agents  (also its ToolInputGuardrailTripwireTriggered)
    ├── ToolPaused               client.errors   a paused tool (a storm, or the run's transient streak): retry later
    │   └── AgentToolPaused      integrations.openai_agents  (also the SDK's AgentsException)
    ├── DuplicateSuppressed      client.errors   a duplicate side effect refused where no earlier result
    │   └── DuplicateSuppressed  integrations.openai_agents  (also AgentsException)
    ├── InvalidCall              client.errors   an argument the contract would refuse (also ValueError)
    │   └── InvalidArgumentType  client.errors     (also TypeError)
    ├── UsageError               client.errors   the SDK used where it cannot work (also RuntimeError)
    ├── TopicMismatch            worker.main     a topic with the wrong partition count (also RuntimeError)
    ├── UntestedFramework        worker.versions faust, mode or aiokafka at an untested version (also RuntimeError)
    ├── ProducerFailed           worker.delivery a producer the worker publishes through failed for good (also RuntimeError)
    ├── PublishFailed            worker.delivery a processed batch's decision or fact never acknowledged (also RuntimeError)
    ├── BatchFailing             worker.delivery an input batch failed 5 times in a row: the worker stops (also RuntimeError)
    ├── EngineUnavailable        commands.replay the native engine asked for, not installed (also RuntimeError)
    ├── BadAlert                 commands.notify a message on the alerts topic that is no decision (also ValueError)
    ├── WebhookError             commands.notify a webhook post that did not succeed
    └── WorkerStartError         devtools.harness a worker process that exited or never got ready (also RuntimeError)

Errors a person must fix say what to do ("Operator action: ...").
"""

from __future__ import annotations

from typing import ClassVar


class LoopwardenError(Exception):
    """Root of every error loopwarden raises on purpose."""


class InvalidEvent(LoopwardenError):
    """A telemetry event that cannot be processed; ``field`` names the offending field ('' = whole event).

    ``field or kind`` classifies it (the worker's dead-letter reason and metric label): a field name, or
    for a whole event ``payload`` (not an event) or ``json`` (not JSON at all, ``NotJSON``).
    """

    kind: ClassVar[str] = "payload"

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}" if field else reason)


class NotJSON(InvalidEvent):
    """The bytes are not JSON (invalid UTF-8, NaN, nesting too deep...)."""

    kind: ClassVar[str] = "json"

    def __init__(self, reason: str) -> None:
        super().__init__("", f"not JSON: {reason}")

    @classmethod
    def at(cls, problem: str, position: int, raw: bytes | None = None) -> NotJSON:
        """From a JSON parser's complaint and the 0-based byte offset it points at: said as a position in
        the message or line, not in the parser's own "line 1 column 5 (char 4)". Given the ``raw`` bytes,
        text that is not UTF-8 is said as such at its first bad byte (orjson checks the encoding first
        and points at byte 0, saying "surrogates not allowed" of any bad byte)."""
        if raw is not None and "UTF-8" in problem:
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as bad:
                return cls(f"invalid UTF-8 ({bad.reason}) at byte {bad.start + 1}")
        return cls(f"{problem} at byte {position + 1}")


class NormalisationError(LoopwardenError):
    """A value has no canonical JSON form (non-finite float, unsupported type, nesting too deep)."""


class PolicyError(LoopwardenError):
    """A policy document is malformed. Operator action: fix the setting named in the message."""
