"""Simulated fleets and real worker processes, for ``loopwarden demo``, the tests and the benchmarks.

- ``scenarios``: the catalogue of simulated run kinds (what each does, the halt it must get);
- ``fleet_sim``: deterministic telemetry of a mixed fleet (``loopwarden simulate``, replay, golden files);
- ``harness``: isolated worker deployments (topics, ports, keys, readiness, stop and kill);
- ``demo``: ``loopwarden demo`` (``make run``), a simulated fleet guarded through the SDK.

Shipped in the wheel because the demo is; aiokafka and the worker stack are imported only when used.
"""
