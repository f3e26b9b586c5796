"""`python -m dpsgd.backends -n N [--backend mpi|torch] [--timeout-s S] [--log-dir DIR] SCRIPT [ARGS...]`: your own
script on N peers of one world on this machine, started as the app starts its peers (`dpsgd.backends.spawn`), so
nothing of the runtime has to be known by hand: for mpi MPICH's fork launcher (no TCP port) with UCX on shared memory
only (`UCX_TLS=self,sm`: a plain `mpiexec` leaves the ranks listening on every interface); for torch gloo on
loopback with a rendezvous file only this user can read; for both one OpenMP thread per peer, more peers than cores,
and glibc keeping freed large buffers for reuse (receiving into new 1 MiB buffers cost up to 2.5x an exchange
without it, docs/results/benchmarks.md). In the script, `dpsgd.comm.init(BACKEND)` joins the world.

Exits with the first failing peer's exit code (the others are stopped), 124 past --timeout-s, 128 + the signal
number when interrupted (SIGINT, SIGTERM: the peers are stopped too)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import Interrupted, get, spawn, stop_on_signals

LAUNCHED = ("mpi", "torch")  # the backends whose peers are processes (local runs threads: dpsgd.comm.run_local)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dpsgd.backends",
        description="Run your own script on N peers of one world on this machine (dpsgd.comm.init joins it).",
    )
    parser.add_argument("-n", "--peers", type=int, required=True, help="how many peer processes")
    parser.add_argument("--backend", choices=LAUNCHED, default="mpi", help="the world they form (default: mpi)")
    parser.add_argument("--timeout-s", type=float, default=None, help="stop every peer after this long (exit 124)")
    parser.add_argument("--log-dir", type=Path, default=None, help="each rank's stderr to LOG_DIR/rank{r}.log")
    parser.add_argument("script", help="the Python script each peer runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    if args.peers < 1:
        parser.error(f"-n takes at least 1 peer, got {args.peers}")
    if not Path(args.script).is_file():
        parser.error(f"no script {args.script!r} here; give the path of the Python file each peer runs")
    missing = get(args.backend).missing()
    if missing:
        parser.error(missing)
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        with stop_on_signals():
            return spawn(args.backend, args.peers, [args.script, *args.args], args.timeout_s, log_dir=args.log_dir)
    except Interrupted as stop:
        return 128 + stop.signum


if __name__ == "__main__":
    sys.exit(main())
