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

from faust.types import TopicT

from ..bus.wire import encode_telemetry
from ..core import InvalidEvent
from ..sources import Decoded
from .delivery import Record
from .effects import DeadLetters


class SourceRelay:
    """Relays one source topic's records as telemetry (``decode``: the source's decoder)."""

    def __init__(self, telemetry: TopicT, decode: Callable[[bytes], Decoded], dead_letters: DeadLetters) -> None:
        self.telemetry = telemetry
        self.decode = decode
        self.dead_letters = dead_letters

    async def relay(self, batch: Sequence[Record]) -> None:
        """Publish every event the batch decodes to and wait for the broker's acknowledgements (the
        batch is acknowledged, so its offsets get committed, only after this returns)."""
        pending = []
        for record in batch:
            raw = record.value
            try:
                if raw is None:
                    raise InvalidEvent("", "message has no value")
                decoded = self.decode(raw)
            except InvalidEvent as exc:
                await self.dead_letters.send(record, exc)
                continue
            for telemetry in decoded.events:
                key, value = encode_telemetry(telemetry)
                pending.append(await self.telemetry.send(key=key, value=value))
            if decoded.errors:
                first, part = decoded.errors[0], decoded.part
                more = f" (and {len(decoded.errors) - 1} more {part}s)" if len(decoded.errors) > 1 else ""
                await self.dead_letters.send(record, InvalidEvent(first.field, f"{part} rejected: {first.reason}{more}"))
        await asyncio.gather(*pending)
