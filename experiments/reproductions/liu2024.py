"""Liu et al. 2024 (asynchronous Local-SGD): with workers of unequal speed, asynchronous Local-SGD with delayed
Nesterov and dynamic local updates reaches synchronous DiLoCo's quality in less time, where the naive asynchronous
form (Nesterov on every arrival, every worker H steps) does not; and a quorum merge (Decoupled DiLoCo, 2026) carries
on through failed and restarted workers, keeping its goodput, against synchronous DiLoCo stalled by each failure."""

from __future__ import annotations

from pathlib import Path

from experiments.cost_model import Algorithm, Network, clock_after
from experiments.reproduce import Configuration, Finding, find, plot_curves
from experiments.targets import LIU2024_TOLERANCE

PAPER = "Liu et al. 2024, Asynchronous Local-SGD Training for Language Modeling (with Decoupled DiLoCo's quorum merge)"
CLAIM = (
    "Naive asynchronous Local-SGD takes more updates than synchronous Local-SGD to converge because momentum on stale "
    "outer gradients accelerates wrongly; delayed Nesterov (the momentum updated every N arrivals) with dynamic local "
    "updates (each worker's steps by its speed) matches synchronous DiLoCo's quality and beats it in wall-clock time "
    "under heterogeneous workers. A quorum merge weighted by samples keeps training through failed workers."
)
PEERS, PERIOD, COMPUTE_S, SCALE, STRAGGLER = 8, 8, 0.01, 4.0, 1
WORKLOAD = [
    "backend=fleet",
    f"peers={PEERS}",
    "topology=complete",
    "batch_size=32",
    "log_every=2",
    "on_divergence=mark",  # the naive form diverges: its run is kept and marked, not stopped
]
# synchronous DiLoCo trains 10 epochs; the asynchronous runs 20 (twice the samples, still in less emulated time than
# the synchronous 10): the claim is the time to synchronous DiLoCo's final accuracy, read from each run's records
SYNC_EPOCHS, ASYNC_EPOCHS = 10, 20
# the event simulator's compute model; the fleet's synchronous steps have no clock (the app refuses a network for
# them): synchronous DiLoCo's time comes from the cost model on the same compute (sync_time)
STRAGGLING = [
    f"network.slow_peers=[{STRAGGLER}]",
    f"network.compute_scale={SCALE}",
    f"network.compute_time={COMPUTE_S}",
]
# two peers fail: [peer, at (virtual s), down for (s)], each restarting from the global model
FAILURES = [[2, 0.1, 0.15], [6, 0.2, 0.1]]
QUORUM, GRACE_S = 4, 0.05  # half the workers, waiting up to 5 fast steps for more
SWEEPS = {
    "sync": [*WORKLOAD, f"epochs={SYNC_EPOCHS}", "algorithm=diloco", f"++algorithm.period={PERIOD}"],
    "async": [
        *WORKLOAD,
        *STRAGGLING,
        f"epochs={ASYNC_EPOCHS}",
        "algorithm=async_local_sgd",
        f"++algorithm.period={PERIOD}",  # ++: the sweep is composed with the default algorithm first
        "++algorithm.outer_lr=0.7",  # DiLoCo's outer step, as the paper (the yaml's default is gentler)
        "++algorithm.outer_momentum=0.9",
        "++algorithm.delayed_nesterov=true,false",
        "++algorithm.dylu=true,false",
    ],
    "failures": [
        *WORKLOAD,
        *STRAGGLING,
        f"epochs={ASYNC_EPOCHS}",
        "algorithm=async_local_sgd",
        f"++algorithm.period={PERIOD}",
        "++algorithm.outer_lr=0.7",  # DiLoCo's outer step, as the paper (the yaml's default is gentler)
        "++algorithm.outer_momentum=0.9",
        f"++algorithm.quorum={QUORUM}",
        f"++algorithm.grace_s={GRACE_S}",
        "++algorithm.failures=" + str(FAILURES).replace(" ", ""),
    ],
}
RUNS = {"sync": 1, "async": 4, "failures": 1}


def sync_time(steps: int) -> float:
    """Synchronous DiLoCo's emulated seconds for `steps` (the cost model, checked against the emulator's clock in
    tests/test_map.py): each round waits for the straggler's H steps; links are free here."""
    return clock_after(
        Algorithm("DiLoCo", (), "periodic", period=PERIOD), steps, PEERS, 0, COMPUTE_S, Network(0, None, slowdown=SCALE)
    )


def sync_under_failures(steps: int) -> tuple[float, int]:
    """Synchronous DiLoCo with FAILURES: every peer waits while one is down, and the round in progress is redone by
    every peer (its all-reduce needs every outer gradient): (emulated seconds, steps lost)."""
    round_s = PERIOD * COMPUTE_S * SCALE
    clock, lost = sync_time(steps), 0
    for _, at, down in FAILURES:
        done = int((at % round_s) / (COMPUTE_S * SCALE))  # steps every peer had taken in that round
        clock += down + done * COMPUTE_S * SCALE
        lost += done * PEERS
    return clock, lost


def time_to(runs: list[dict], target: float) -> float | None:
    """Mean over seeds of the first emulated time at which a record's test accuracy reaches `target` (None if a seed
    never does)."""
    times = []
    for run in runs:
        hit = next((m for m in run["metrics"] if (m.get("test_accuracy") or 0) >= target), None)
        if hit is None or hit.get("emulated_time_s") is None:
            return None
        times.append(float(hit["emulated_time_s"]))
    return sum(times) / len(times)


def sync_time_to(runs: list[dict], target: float) -> float | None:
    """Synchronous DiLoCo's emulated seconds to `target`: the cost model's time to the first record's step that
    reaches it (its fleet records carry no clock), mean over seeds (None if a seed never does)."""
    times = []
    for run in runs:
        hit = next((m for m in run["metrics"] if (m.get("test_accuracy") or 0) >= target), None)
        if hit is None:
            return None
        times.append(sync_time(int(hit["step"])))
    return sum(times) / len(times)


def block(c: Configuration, key: str) -> float:
    """The mean over seeds of summary.json's async_local_sgd[key]."""
    values = [float(r["summary"]["async_local_sgd"][key]) for r in c.runs]
    return sum(values) / len(values)


def analyze(configs: dict[str, list[Configuration]], out: Path) -> Finding:
    (sync,) = configs["sync"]
    asyncs = configs["async"]
    dn_dylu = find(asyncs, algorithm__delayed_nesterov="True", algorithm__dylu="True")
    dn = find(asyncs, algorithm__delayed_nesterov="True", algorithm__dylu="False")
    dylu = find(asyncs, algorithm__delayed_nesterov="False", algorithm__dylu="True")
    naive = find(asyncs, algorithm__delayed_nesterov="False", algorithm__dylu="False")
    (quorum,) = configs["failures"]  # the swept values read back as text: "True", "False"
    seeds = int(sync.summary["seeds"])
    steps = round(sync.mean("steps"))
    sync_s = sync_time(steps)
    target = sync.mean("test_accuracy") - LIU2024_TOLERANCE
    rows = []
    for name, c in (
        ("async, delayed Nesterov + DyLU", dn_dylu),
        ("async, delayed Nesterov", dn),
        ("async, DyLU (Nesterov every arrival)", dylu),
        ("async, naive (Nesterov every arrival, H each)", naive),
    ):
        reach = time_to(c.runs, target)
        rows.append(
            f"| {name} | {c.text('test_accuracy', 3)} | {c.mean('emulated_time_s'):.3f} | "
            f"{'never' if reach is None else f'{reach:.3f}'} | {block(c, 'staleness_mean'):.2f} |"
        )
    sync_reach_s = sync_time_to(sync.runs, target)
    failed_s, failed_lost = sync_under_failures(steps)
    table = "\n".join(
        [
            "| | paper (paraphrased) |",
            "|---|---|",
            "| naive asynchronous Local-SGD | worse than synchronous per update (momentum on stale outer gradients) |",
            "| delayed Nesterov + dynamic local updates | matches synchronous Local-SGD per update, faster in time |",
            "| quorum merge under failures (Decoupled DiLoCo) | no global downtime, high goodput |",
            "",
            f"Ours: {PEERS} peers on digits (MLP), the event simulator, peer {STRAGGLER} {SCALE:g}x slower "
            f"({COMPUTE_S * 1000:.0f} ms a step, {SCALE * COMPUTE_S * 1000:.0f} ms for it), H = {PERIOD}, inner SGD "
            f"with momentum, outer lr 0.7 and momentum 0.9, {seeds} seed(s); synchronous DiLoCo {SYNC_EPOCHS} "
            f"epochs, the asynchronous runs {ASYNC_EPOCHS} (twice the samples). Synchronous DiLoCo's accuracy is "
            "the fleet's; its time is the emulator's cost model for its "
            f"rounds (every round waits for the straggler): {sync_s:.3f} s for its {SYNC_EPOCHS} epochs. Target: "
            f"synchronous DiLoCo's final accuracy less {LIU2024_TOLERANCE} = {target:.3f}; the time to it is the first "
            "record (every 2 steps of peer 0) at or above it, mean over the seeds (never: some seed never got there).",
            "",
            "| method | final test accuracy | emulated s (end) | emulated s to target | mean staleness (updates) |",
            "|---|---|---|---|---|",
            f"| synchronous DiLoCo | {sync.text('test_accuracy', 3)} | {sync_s:.3f} | "
            f"{'never' if sync_reach_s is None else f'{sync_reach_s:.3f}'} | 0 |",
            *rows,
            "",
            f"Failures: peers {', '.join(str(p) for p, _, _ in FAILURES)} fail at "
            f"{', '.join(f'{a:g}' for _, a, _ in FAILURES)} s for {', '.join(f'{d:g}' for _, _, d in FAILURES)} s and "
            f"restart from the global model; the quorum merge takes {QUORUM} of {PEERS} pushes within a {GRACE_S} s "
            "grace window, weighted by samples. Synchronous DiLoCo under the same failures (closed form: every peer "
            "waits out each failure and redoes the round in progress) keeps its accuracy but not its time.",
            "",
            "| method | final test accuracy | emulated s | useful steps | lost steps | goodput (useful steps/s) |",
            "|---|---|---|---|---|---|",
            f"| async quorum merge, failures, {ASYNC_EPOCHS} epochs | {quorum.text('test_accuracy', 3)} | "
            f"{quorum.mean('emulated_time_s'):.3f} | {block(quorum, 'useful_steps'):.0f} | "
            f"{block(quorum, 'lost_steps'):.0f} | {block(quorum, 'goodput_steps_per_s'):.0f} |",
            f"| synchronous DiLoCo, failures | {sync.text('test_accuracy', 3)} | {failed_s:.3f} | "
            f"{steps * PEERS} | {failed_lost} | {steps * PEERS / failed_s:.0f} |",
        ]
    )
    reach = time_to(dn_dylu.runs, target)
    faster = reach is not None and sync_reach_s is not None and reach < sync_reach_s
    naive_reach = time_to(naive.runs, target)
    naive_worse = naive_reach is None or reach is not None and naive_reach > reach
    quorum_reach = time_to(quorum.runs, target)
    sync_goodput = steps * PEERS / failed_s
    quorum_ok = quorum_reach is not None and block(quorum, "goodput_steps_per_s") > sync_goodput
    parts = [faster, naive_worse, quorum_ok]
    holds = True if all(parts) else False if not any(parts) else None

    def when(t: float | None) -> str:
        return "never (in some seed)" if t is None else f"at {t:.3f} emulated s"

    verdict = (
        ("holds" if holds else "does not hold" if holds is False else "partly holds")
        + f": with peer {STRAGGLER} {SCALE:g}x slower, delayed Nesterov + DyLU reaches synchronous DiLoCo's final "
        + f"accuracy less {LIU2024_TOLERANCE} ({target:.3f}) {when(reach)}, against synchronous DiLoCo's "
        + f"{when(sync_reach_s)} ({'faster' if faster else 'not faster'}); it ends its twice-the-samples run at "
        + f"{dn_dylu.mean('test_accuracy'):.3f} in {dn_dylu.mean('emulated_time_s'):.3f} s (synchronous DiLoCo "
        + f"{sync.mean('test_accuracy'):.3f} in {sync_s:.3f} s). The naive asynchronous form reaches it "
        + f"{when(naive_reach)} and ends at {naive.mean('test_accuracy'):.3f}. The quorum merge under "
        + f"{len(FAILURES)} failures reaches it {when(quorum_reach)}, with goodput "
        + f"{block(quorum, 'goodput_steps_per_s'):.0f} useful steps/s against synchronous DiLoCo's {sync_goodput:.0f} "
        + "under the same failures."
    )
    plot = plot_curves(  # synchronous DiLoCo's fleet records carry no clock: its times are in the table
        [dn_dylu, dn, dylu, naive, quorum],
        "emulated_time_s",
        [("test_accuracy", "test accuracy")],
        out / "accuracy.png",
        f"Test accuracy against emulated time, {PEERS} peers, one {SCALE:g}x slower",
        label=lambda c: {
            id(dn_dylu): "async DN + DyLU",
            id(dn): "async DN",
            id(dylu): "async DyLU",
            id(naive): "async naive",
            id(quorum): "async quorum merge, 2 failures",
        }[id(c)],
    )
    return Finding(table, verdict, holds, [plot])
