"""One module per reproduced claim, run by `python -m experiments.reproduce NAME`.

A module defines PAPER (authors, year, title), CLAIM (the claim, paraphrased), SWEEPS (sweep name -> overrides of
`experiments.train -m`, without seeds), RUNS (sweep name -> its runs per seed) and
`analyze(configs: dict[str, list[Configuration]], out: Path) -> Finding`, which reads the measured numbers,
draws its plots into `out` and computes the verdict.
"""
