"""`python -m experiments.bench`: the benchmarks' one command line (experiments.bench.cli)."""

from experiments.bench.cli import main

raise SystemExit(main())
