"""The benchmark's py-spy summary (bench/profile.py): which stage a sample's stack is counted in."""

from __future__ import annotations

from pathlib import Path

from bench import profile


def _frame(name: str, path: str = "site-packages/faust/transport/consumer.py") -> str:
    return f"{name} ({path}:1)"


def test_the_records_the_batch_path_reads_through_fausts_drain_loop_are_not_its_per_message_path(
        tmp_path: Path) -> None:
    """faust's drain loop calls BatchConsumer.getmany: what getmany does (aiokafka decoding the fetched
    records) is batch delivery; only the drain loop's own work (the changelog's messages) is the
    per-message path. Counted in both before, it put aiokafka's record decoding under faust's path."""
    drain = _frame("Consumer._drain_messages")
    raw = tmp_path / "raw.txt"
    raw.write_text("\n".join([
        ";".join([drain, _frame("BatchConsumer.getmany"), _frame("Fetcher.fetched_records"),
                  _frame("PartitionRecords._consumer_record", "site-packages/aiokafka/consumer/fetcher.py")]) + " 3",
        ";".join([drain, _frame("Consumer._to_message")]) + " 1",
    ]) + "\n")
    stages = profile.summarise(raw, events=4)["stages"]
    assert stages["batch delivery (BatchConsumer.getmany, sink, sequencer)"] == 0.75
    assert stages["  records read from fetch responses (aiokafka's Fetcher.fetched_records)"] == 0.75
    assert stages["faust per-message path (conductor, streams)"] == 0.25
