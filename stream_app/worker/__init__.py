"""The fleet worker: the detector core on faust-streaming, with per-run state in a RocksDB table.

Needs the ``worker`` extra (faust-streaming, rocksdict, prometheus-client); nothing in the client side
imports this package.
"""
