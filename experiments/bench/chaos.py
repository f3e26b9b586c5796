"""Chaos run (issue 18): an elastic run on torchrun's elastic launch loses peers at seeded random steps and
gets some back, and must end as the undisturbed run of the same seed does.

Each peer is one torchrun agent (a "node", `--nproc-per-node 1`) of one c10d rendezvous on 127.0.0.1, whose
store this script holds (`is_host=false` in every agent), so any node can be lost, as on a cluster where
the store lives on a stable host. A peer is killed as a node dies: SIGKILL to its agent and its worker at
once. A peer is added by starting one more agent. For each algorithm it runs the undisturbed run, then the
chaos run, and checks: the run finishes with no manual step, test accuracy within `--tolerance` of the
undisturbed run, one membership record per change in metrics.jsonl, every complete checkpoint intact, and
no process left. Prints a table (also in outputs/bench/chaos/chaos.json, the runs and agents' logs beside it):

    python -m experiments.bench chaos            # 8 peers, D-PSGD and LocalSGD, 3 killed, 2 added
    python -m experiments.bench chaos --quick    # 4 peers, D-PSGD, 1 killed, 1 added
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dpsgd import checkpoint, elastic
from dpsgd.backends import free_port
from experiments.bench import cli, harness
from experiments.bench.harness import ROOT, records

POLL_S = 0.1


def app_args(algorithm: str, run_dir: Path, epochs: int, seed: int, step_delay_s: float) -> list[str]:
    """The experiment every agent runs: digits, MLP, ring, checkpoints every 5 steps. A step is made to
    last `step_delay_s` (peer 0 sleeps that long before each: faults.delay_peer), so that the run lasts
    long enough for its losses and additions to fall mid-training."""
    return [
        "backend=torch",
        f"algorithm={algorithm}",
        "topology=ring",
        "elastic=true",
        f"hydra.run.dir={run_dir}",
        f"seed={seed}",
        f"epochs={epochs}",
        "batch_size=16",
        "log_every=2",
        "checkpoint.every=5",
        "comm.timeout_s=6",  # how long survivors wait for a lost peer before their world re-forms
        "faults.delay_peer=0",
        f"faults.delay_s={step_delay_s}",
        "faults.at_step=1",
    ]


class Agent:
    """One torchrun agent with one worker: a node of the elastic world."""

    def __init__(self, name: str, endpoint: str, nnodes: str, restarts: int, args: list[str], log: Path):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            "--nproc-per-node=1",
            f"--max-restarts={restarts}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={name}",
            # the store is this script's; a round waits 1 s for more nodes, not 30; a node silent 3 s is gone, not 15
            "--rdzv-conf=is_host=false,last_call_timeout=1,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3",
            "--monitor-interval=0.2",
            "-m",
            "experiments.train",
            *args,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
        self.log = log
        self.started = time.time()
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=True)

    def workers(self) -> list[int]:
        return children(self.proc.pid)

    def kill(self) -> float:
        """SIGKILL to the agent and its worker together (a node lost); returns when."""
        pids = [self.proc.pid, *self.workers()]
        when = time.time()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        return when


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (what a run could leave behind)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(cmdline.parent.name))
    return [p for p in found if p != os.getpid()]


@dataclass
class Outcome:
    algorithm: str
    chaos: bool
    finished: bool
    accuracy: float | None
    wall_s: float
    events: list[dict] = field(default_factory=list)  # {kind, step, at, peers_after, recovered_s}
    memberships: list[dict] = field(default_factory=list)
    torn: list[str] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    codes: list[int | None] = field(default_factory=list)


def plan(peers: int, kill: int, add: int, total_steps: int, rng: random.Random) -> list[tuple[int, str]]:
    """(step, 'kill' or 'add') at seeded random steps between 15% and 75% of the run; an addition only
    once a peer is missing."""
    while True:
        kinds = ["kill"] * kill + ["add"] * add
        rng.shuffle(kinds)
        size, ok = peers, True
        for k in kinds:
            size += 1 if k == "add" else -1
            ok = ok and size <= peers
        if ok:
            break
    lo, hi = int(0.15 * total_steps), int(0.75 * total_steps)
    steps = sorted(rng.sample(range(lo, hi), len(kinds)))
    return list(zip(steps, kinds))


def run_once(
    algorithm: str,
    peers: int,
    events: list[tuple[int, str]],
    out: Path,
    args: argparse.Namespace,
    rng: random.Random,
) -> Outcome:
    """One run of `peers` agents; `events` (step, kind) applied in order, each once the world has re-formed
    after the previous one."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    run_dir = out / f"{algorithm}_{'chaos' if events else 'undisturbed'}"
    logs = out / f"{run_dir.name}_agents"
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    store = TCPStore(
        "127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    lowest = peers - sum(k == "kill" for _, k in events)
    nnodes = f"{lowest}:{peers}"
    cmd = app_args(algorithm, run_dir, args.epochs, args.seed, args.step_delay_s)
    agents = [
        Agent(run_dir.name, f"127.0.0.1:{port}", nnodes, args.max_restarts, cmd, logs / f"agent{i}.log")
        for i in range(peers)
    ]
    live = list(agents)
    start = time.time()
    done: list[dict] = []
    pending = list(events)
    deadline = start + args.timeout
    try:
        while any(a.proc.poll() is None for a in live) and time.time() < deadline:
            time.sleep(POLL_S)
            recs = records(run_dir)
            changes = [r for r in recs if r.get("event") == elastic.EVENT]
            for event in done:  # a change has recovered once the world it formed has logged a step
                if event["recovered_s"] is None and len(changes) >= event["changes_before"] + 1:
                    change = changes[event["changes_before"]]
                    if any(r.get("event") is None and r["step"] > change["step"] for r in recs[recs.index(change) :]):
                        event["recovered_s"] = change["unix_time"] - event["at"]
                        event["resumed_from"] = change["step"]
            if not pending or any(e["recovered_s"] is None for e in done):
                continue
            progress = max((r["step"] for r in recs if r.get("event") is None), default=0)
            step, kind = pending[0]
            if progress < step:
                continue
            pending.pop(0)
            if kind == "kill":
                victim = rng.choice(live)
                live.remove(victim)
                at = victim.kill()
            else:
                name = f"agent{len(agents)}.log"
                agents.append(Agent(run_dir.name, f"127.0.0.1:{port}", nnodes, args.max_restarts, cmd, logs / name))
                live.append(agents[-1])
                at = agents[-1].started
            done.append(
                {"kind": kind, "step": progress, "at": at, "peers_after": len(live), "changes_before": len(changes)}
                | {"recovered_s": None}
            )
    finally:  # past the deadline, or this script failed: stop what is left (the run then counts as not finished)
        for a in live:
            if a.proc.poll() is None:
                a.kill()
    wall = time.time() - start
    del store
    time.sleep(0.5)
    summary = run_dir / "summary.json"
    finished = summary.exists() and all(a.proc.returncode == 0 for a in live)
    torn = []
    for folder in sorted((run_dir / "checkpoints").glob("step_*")):
        why = checkpoint.torn(folder) if (folder / "COMPLETE").exists() else None
        if why:
            torn.append(f"{folder.name}: {why}")
    return Outcome(
        algorithm=algorithm,
        chaos=bool(events),
        finished=finished,
        accuracy=json.loads(summary.read_text())["test_accuracy"] if summary.exists() else None,
        wall_s=wall,
        events=[{k: v for k, v in e.items() if k != "changes_before"} for e in done],
        memberships=[r for r in records(run_dir) if r.get("event") == elastic.EVENT],
        torn=torn,
        left=processes_mentioning(str(run_dir)),
        codes=[a.proc.returncode for a in live],
    )


def total_steps(args: argparse.Namespace) -> int:
    from dpsgd.build import plan

    run = harness.run_config(f"peers={args.peers}", "batch_size=16", f"epochs={args.epochs}", f"seed={args.seed}")
    return plan(run).total_steps


def problems(undisturbed: Outcome, chaos: Outcome, expected_changes: int, tolerance: float) -> list[str]:
    """What the chaos run got wrong (empty: every property holds)."""
    found = []
    for o in (undisturbed, chaos):
        if not o.finished:
            found.append(f"{o.algorithm} {'chaos' if o.chaos else 'undisturbed'} run did not finish (codes {o.codes})")
        if o.torn:
            found.append(f"{o.algorithm}: torn checkpoints {o.torn}")
        if o.left:
            found.append(f"{o.algorithm}: processes left {o.left}")
    if undisturbed.accuracy is not None and chaos.accuracy is not None:
        if abs(chaos.accuracy - undisturbed.accuracy) > tolerance:
            found.append(
                f"{chaos.algorithm}: accuracy {chaos.accuracy:.4f} vs undisturbed {undisturbed.accuracy:.4f}"
                f" (more than {tolerance} apart)"
            )
    changes = [(m["old_peers"], m["new_peers"]) for m in chaos.memberships if m["old_peers"] != m["new_peers"]]
    wanted = [(e["peers_after"] + (1 if e["kind"] == "kill" else -1), e["peers_after"]) for e in chaos.events]
    if len(chaos.events) != expected_changes or changes != wanted:
        found.append(f"{chaos.algorithm}: membership records {changes}, expected {wanted} ({expected_changes} events)")
    if any(e["recovered_s"] is None for e in chaos.events):
        found.append(f"{chaos.algorithm}: an event never recovered: {chaos.events}")
    return found


def table(pairs: list[tuple[Outcome, Outcome]]) -> str:
    lines = [
        "algorithm  undisturbed acc  chaos acc  diff (points)  membership changes (step: old->new)"
        "                 recovery s (per change)  wall s undisturbed / chaos"
    ]
    for u, c in pairs:
        changes = ", ".join(f"{m['step']}: {m['old_peers']}->{m['new_peers']}" for m in c.memberships)
        rec = ", ".join(
            f"{e['kind']} {e['recovered_s']:.1f}" if e["recovered_s"] is not None else "-" for e in c.events
        )
        ua = f"{u.accuracy:.4f}" if u.accuracy is not None else "-"
        ca = f"{c.accuracy:.4f}" if c.accuracy is not None else "-"
        diff = f"{100 * (c.accuracy - u.accuracy):+.2f}" if u.accuracy is not None and c.accuracy is not None else "-"
        lines.append(
            f"{c.algorithm:<10} {ua:>15}  {ca:>9}  {diff:>13}  {changes:<55}  {rec:<24}  "
            f"{u.wall_s:.0f} / {c.wall_s:.0f}"
        )
    return "\n".join(lines)


def options(p) -> None:
    p.add_argument("--kill", type=int, default=3)
    p.add_argument("--add", type=int, default=2)
    p.add_argument("--algorithms", default="dpsgd,local_sgd")
    p.add_argument("--step-delay-s", type=float, default=0.1)
    p.add_argument("--max-restarts", type=int, default=10)
    p.add_argument("--tolerance", type=float, default=0.01, help="accuracy, as a fraction (0.01: 1 point)")


def run(args) -> harness.Result:
    out = Path(args.out).parent / time.strftime("%Y-%m-%d_%H-%M-%S")
    rng = random.Random(args.seed)
    events = plan(args.peers, args.kill, args.add, total_steps(args), rng)
    print(f"plan (seed {args.seed}): " + ", ".join(f"{k} at step {s}" for s, k in events), flush=True)
    pairs, found = [], []
    for algorithm in args.algorithms.split(","):
        undisturbed = run_once(algorithm, args.peers, [], out, args, random.Random(args.seed))
        chaos = run_once(algorithm, args.peers, events, out, args, random.Random(args.seed))
        pairs.append((undisturbed, chaos))
        found += problems(undisturbed, chaos, len(events), args.tolerance)
    print(table(pairs), flush=True)
    print(f"runs and agent logs: {out}", flush=True)
    return harness.Result({"plan": events, "runs": [o.__dict__ for pair in pairs for o in pair]}, problems=found)


main = cli.entry("chaos")

if __name__ == "__main__":
    raise SystemExit(main())
