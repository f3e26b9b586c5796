"""The benchmarks' one command line: `python -m experiments.bench --list | NAME [options] | --all | --regression`,
and `python -m experiments.bench.NAME` (each benchmark's `main = cli.entry(NAME)`). Above the harness, the rank
workers (experiments.bench.ranks) and the regression check (experiments.bench.regression), which it dispatches to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from experiments.bench import ranks, regression
from experiments.bench.harness import BENCHES, BenchError, execute, listing, lookup, module, parse


def keep_freed_memory() -> None:
    """Run this command again with glibc keeping freed large buffers for reuse, as the toolkit's spawned peers do
    (dpsgd.backends.peer_env): otherwise a step's large tensors page-fault in afresh (the MLP fleet of 1,024 peers
    ran 6% faster with it). glibc reads these variables when the process starts, hence the new process."""
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        from dpsgd.backends import peer_env

        env = {**os.environ, **{k: v for k, v in peer_env().items() if k.startswith("MALLOC_")}}
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def run_all(argv: list[str]) -> int:
    """`make bench`: every benchmark of it in a process of its own, one after the other; exit 1 if any broke."""
    broken = []
    for b in (b for b in BENCHES if b.in_make_bench):
        print(f"== {b.name}", flush=True)
        if subprocess.run([sys.executable, "-m", "experiments.bench", b.name, *argv], cwd=os.getcwd()).returncode:
            broken.append(b.name)
    print(f"\n{len([b for b in BENCHES if b.in_make_bench]) - len(broken)} benchmarks ran" +
          (f"; broken: {', '.join(broken)}" if broken else ""))  # fmt: skip
    return 1 if broken else 0


USAGE = """usage: python -m experiments.bench --list | NAME [--quick] [options] | --all [--quick] | --regression [--dry]
  --list          a line per benchmark: its name and what it compares
  NAME            one benchmark (NAME --help: its options)
  --all           every benchmark of `make bench`, one after the other
  --regression    `make bench-quick`: the figures of experiments/bench/recorded.yaml measured again (PASS/MISS/NOISE)"""


def main(argv: list[str] | None = None, name: str | None = None) -> int:
    """The command line (`argv`, default this process's own; `name`: the benchmark's, for
    `python -m experiments.bench.NAME`)."""
    own = argv is None  # this process's command line: it may start itself again (keep_freed_memory)
    argv = [*([name] if name else []), *(sys.argv[1:] if argv is None else argv)]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--list":
        print(listing())
        return 0
    if argv[0] == "--all":
        return run_all(argv[1:])
    if argv[0] == "--regression":
        if own and not {"-h", "--help"} & set(argv):
            keep_freed_memory()  # for fleet_vs_batch
        return regression.main(argv[1:])
    bench = lookup(argv[0])
    if argv[1:2] == ["--worker"]:  # one of the ranks a driver spawned (experiments.bench.ranks)
        module(bench).worker(ranks.worker_args(Path(argv[2])))
        return 0
    if own and bench.keep_freed_memory and "-h" not in argv and "--help" not in argv:
        keep_freed_memory()
    mod = module(bench)
    args = parse(bench, mod, argv[1:])
    try:
        execute(bench, args)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def entry(name: str):
    """A benchmark module's `main(argv)`: `python -m experiments.bench.NAME ARGS` is `python -m experiments.bench NAME
    ARGS`."""

    def main_of(argv: list[str] | None = None) -> int:
        return main(argv, name)

    return main_of
