"""The repository's helper scripts, a package so that tests, benchmarks and ``python -m`` import them by name."""
