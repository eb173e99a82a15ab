"""What both sides of the bus share: runtimes (``stream_app.client``) and workers (``stream_app.worker``).

- ``wire``: how telemetry, control and operator messages are encoded, and their headers;
- ``signing``: Ed25519 signatures on control messages and operator commands (needs ``cryptography``);
- ``kafka``: the Kafka connection settings every client is built from (aiokafka and faust imported
  only when asked for);
- ``clock``: the wall clock, read at the edges only;
- ``settings``: the reader of the ``(field, VAR, default, doc)`` tables processes are configured by;
- ``policy_file``: the detector policy as it lives in a YAML file (one file for runtimes and workers).

Nothing here imports ``stream_app.client`` or ``stream_app.worker``, and importing this package pulls
in no Kafka, Faust or cryptography module: an in-process guard needs only orjson and PyYAML.
"""
