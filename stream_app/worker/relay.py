"""The relay of a foreign source (``stream_app.sources``): its records in, native telemetry out.

A source's records are keyed by something else than the run (OTLP's by trace id), but state is
partitioned by run id, so the relay does not fold them: it re-publishes each decoded event as telemetry
keyed by run id and lets a batch's offsets be committed only once the broker has acknowledged what it
published. The detection agent then sees them like any runtime's telemetry: same order, dedupe (event
ids are stable across redeliveries), recovery and decisions.

A record that does not decode at all goes to the DLQ. A record with some bad parts has its good ones
relayed and is then dead-lettered once, with the first reason (redriving it re-relays the good parts,
which the detector counts once by event id).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from faust.types import EventT, TopicT

from ..bus.wire import encode_telemetry
from ..core import InvalidEvent
from ..sources import Decoded
from .effects import DeadLetters


class SourceRelay:
    """Relays one source topic's records as telemetry (``decode``: the source's decoder)."""

    def __init__(self, telemetry: TopicT, decode: Callable[[bytes], Decoded], dead_letters: DeadLetters) -> None:
        self.telemetry = telemetry
        self.decode = decode
        self.dead_letters = dead_letters

    async def relay(self, batch: Sequence[EventT[Any]]) -> None:
        """Publish every event the batch decodes to and wait for the broker's acknowledgements (the
        agent marks the batch processed, so its offsets get committed, only after this returns)."""
        pending = []
        for event in batch:
            raw = event.value
            try:
                if not isinstance(raw, bytes | bytearray):
                    raise InvalidEvent("", "message has no value")
                decoded = self.decode(bytes(raw))
            except InvalidEvent as exc:
                await self.dead_letters.send(event, exc)
                continue
            for telemetry in decoded.events:
                key, value = encode_telemetry(telemetry)
                pending.append(await self.telemetry.send(key=key, value=value))
            if decoded.errors:
                first, part = decoded.errors[0], decoded.part
                more = f" (and {len(decoded.errors) - 1} more {part}s)" if len(decoded.errors) > 1 else ""
                await self.dead_letters.send(event, InvalidEvent(first.field, f"{part} rejected: {first.reason}{more}"))
        await asyncio.gather(*pending)
