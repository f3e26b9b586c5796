"""`python -m experiments.bench`: the benchmarks' one command line (experiments.bench.harness)."""

from experiments.bench.harness import main

raise SystemExit(main())
