"""Decoders of foreign input into telemetry v1, one module per source.

A source module offers ``decoder(...)``, configured from its worker settings, which turns one record of
its topic into ``Decoded``: telemetry v1 objects (keyed by run id, event ids stable across
redeliveries) and the reasons its bad parts were refused. The worker's relay
(``stream_app.worker.relay``) re-publishes the events as native telemetry keyed by run id, so every
source goes through the same detector fold, dedupe and recovery as a runtime's own telemetry.

- ``otlp``: OpenTelemetry ``execute_tool`` spans from the Collector's ``kafka`` exporter
  (``LOOPWARDEN_OTLP_TOPIC``; needs ``opentelemetry-proto``).

Adding a source: a module here with ``decoder``, a ``LOOPWARDEN_<SOURCE>_TOPIC`` row in
``worker.settings.SETTINGS`` (and its options), and its relay wired in ``worker.app.create_app``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..core import InvalidEvent

__all__ = ["Decoded"]


class Decoded(NamedTuple):
    """What one source record holds: telemetry v1 objects, and why its bad parts were refused."""

    events: list[dict[str, Any]]
    errors: list[InvalidEvent]
    #: What the source calls one part of a record, for dead-letter reasons ("tool span").
    part: str = "part"
