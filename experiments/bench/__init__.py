"""Benchmarks: each measures a ratio side by side in one run, prints a table with its targets' PASS/MISS and writes
JSON. One harness runs them all (experiments.bench.harness): `python -m experiments.bench --list`, `python -m
experiments.bench NAME`, `make bench`, `make bench-quick`."""
