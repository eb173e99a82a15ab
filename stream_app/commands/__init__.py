"""The ``loopwarden`` subcommands other than the worker: what on-call people and operators run.

- ``replay``: the detector over a telemetry JSONL file, no Kafka (both engines);
- ``notify``: halts on the alerts topic, posted to a webhook;
- ``operator``: ``loopwarden halt|resume``, an operator's signed override of the detector.
"""
