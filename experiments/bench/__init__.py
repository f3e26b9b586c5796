"""Benchmarks: one command each (`python -m experiments.bench.NAME`), each measuring a ratio side by
side in one run, printing a table and writing JSON."""
