"""experiments.map: the winner, margin and interval test of a cell; the cells, picture and words of a map from given
steps to target (no runs); a target reached from above (perplexity) or below (accuracy); the language-model preset;
and, in `make soak`, the quick map of the default workload end to end with its checks."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from experiments import map as gossip_map
from experiments.cost_model import Algorithm, Network, clock_after


def test_the_default_comparison_is_the_six_runs_it_always_was():
    """From the algorithms' declarations: the same labels, overrides and cost forms (the soak's quick map too)."""
    assert (
        gossip_map.ALGORITHMS
        == gossip_map.chosen(None)
        == (
            Algorithm("allreduce", ("algorithm=allreduce",), "allreduce"),
            Algorithm("dpsgd ring", ("algorithm=dpsgd", "topology=ring"), "gossip", topology="ring"),
            Algorithm(
                "dpsgd one-peer",
                ("algorithm=dpsgd", "topology=one_peer_exponential"),
                "gossip",
                topology="one_peer_exponential",
            ),
            Algorithm("adpsgd", ("algorithm=adpsgd", "topology=ring"), "async"),
            Algorithm("local_sgd H=4", ("algorithm=local_sgd", "algorithm.period=4"), "periodic", period=4),
            Algorithm("diloco H=8", ("algorithm=diloco", "algorithm.period=8"), "periodic", period=8),
        )
    )


def test_delayed_and_eager_diloco_stand_beside_diloco_priced_with_the_exchange_behind_the_next_round():
    """`--algorithms diloco,diloco_delayed,diloco_eager`: DiLoCo's period, outer_delay=1 (and eager), the periodic form
    with `delayed`; eager sends the same exchange, so it costs what delayed costs (tests/test_delayed_outer.py checks
    the form against the emulator, a straggler included). With a straggler 4x slower and a link whose all-reduce
    outlasts the fast peers' round but not the straggler's, the delayed forms hide it where DiLoCo pays it."""
    diloco, delayed, eager = gossip_map.chosen("diloco,diloco_delayed,diloco_eager")
    assert delayed == Algorithm(
        "diloco_delayed H=8",
        ("algorithm=diloco", "algorithm.period=8", "algorithm.outer_delay=1"),
        "periodic",
        period=8,
        delayed=True,
    )
    assert eager.overrides == (*delayed.overrides, "algorithm.eager=true") and eager.delayed and eager.period == 8
    assert {"diloco_delayed", "diloco_eager"} <= set(gossip_map.eligible())
    net = Network(latency_s=0.01, bandwidth_bytes_per_s=1.25e7, slowdown=4.0)
    nbytes, compute_s, steps = 4e5, 0.01, 80  # all-reduce of 4 peers: 0.06 + 1.5 x 0.032 = 0.108 s; a round 0.32 s
    times = {a.label: clock_after(a, steps, 4, nbytes, compute_s, net) for a in (diloco, delayed, eager)}
    assert times["diloco H=8"] == pytest.approx(10 * (0.32 + 0.108))
    assert times["diloco_delayed H=8"] == times["diloco_eager H=8"] == pytest.approx(10 * 0.32)


@pytest.mark.parametrize("n", [4, 8])
def test_every_run_the_map_can_make_passes_the_apps_checks(n):
    """An algorithm the map accepts (its class declares a cost form) runs where the map puts it: the app's
    pre-start check (the optimizer built on its topology, with its config) passes for every variant."""
    from omegaconf import OmegaConf

    from experiments.validate import validate

    for algorithm in gossip_map.variants(gossip_map.eligible()):
        cfg = OmegaConf.to_container(gossip_map.compose([*algorithm.overrides, "backend=fleet", f"peers={n}"]))
        validate(cfg)


def test_an_algorithm_the_map_cannot_price_is_refused_in_one_line_before_anything_else(tmp_path):
    with pytest.raises(SystemExit) as refused:
        gossip_map.main(["default", "--quick", "--algorithms", "dpsgd,demo", "--out", str(tmp_path / "out")])
    message = str(refused.value)
    assert message.startswith("error: --algorithms demo: the map prices only an algorithm whose class declares")
    assert "\n" not in message and message.endswith("eligible: " + ", ".join(gossip_map.eligible()))
    assert {"dpsgd", "sgp", "bmuf", "adpsgd"} <= set(gossip_map.eligible()) and "demo" not in gossip_map.eligible()
    assert not (tmp_path / "out").exists()


def test_decide_names_the_winner_its_margin_and_whether_the_intervals_part():
    d = gossip_map.decide({"a": [1.0, 1.1, 0.9], "b": [2.0, 2.1, 1.9], "c": [math.inf, 1.0, 1.0]})
    assert (d["winner"], d["runner_up"]) == ("a", "b")
    assert d["margin"] == pytest.approx(2.0) and d["apart"] is True
    close = gossip_map.decide({"a": [1.0, 1.5, 0.5], "b": [1.1, 1.6, 0.6]})
    assert close["winner"] == "a" and close["apart"] is False  # the seeds' spread swallows a 10% margin
    one_seed = gossip_map.decide({"a": [1.0], "b": [3.0]})
    assert one_seed["margin"] == pytest.approx(3.0) and one_seed["apart"] is None
    nobody = gossip_map.decide({"a": [math.inf], "b": [math.inf]})
    assert nobody["winner"] is None


def _steps(n_values, per_algorithm):
    return {
        a.label: {str(n): {"steps": per_algorithm[a.label], "samples": None} for n in n_values}
        for a in gossip_map.ALGORITHMS
    }


def test_cells_pick_allreduce_on_fast_links_and_local_sgd_on_slow_ones(tmp_path):
    same = {a.label: [100, 110] for a in gossip_map.ALGORITHMS}
    axes = {"bandwidth_bytes_per_s": [1e6, 1e10], "latency_s": [1e-5], "peers_per_host": [1], "slowdown": [1.0]}
    nbytes, compute = 4e6, 0.01
    found = gossip_map.cells(_steps([8], same), axes, [8], nbytes, compute)
    assert len(found) == 2
    slow, fast = sorted(found, key=lambda c: c["bandwidth_bytes_per_s"])
    # equal steps: the least communication wins where links are slow (an all-reduce every 8 steps)...
    assert slow["winner"] == "diloco H=8" and slow["runner_up"] == "local_sgd H=4"
    assert slow["margin"] == pytest.approx(slow["times"]["local_sgd H=4"] / slow["times"]["diloco H=8"])
    net = Network(1e-5, 1e6)
    algorithm = next(a for a in gossip_map.ALGORITHMS if a.label == "diloco H=8")
    want = clock_after(algorithm, 100, 8, nbytes, compute, net) + clock_after(algorithm, 110, 8, nbytes, compute, net)
    assert slow["times"]["diloco H=8"] == pytest.approx(want / 2)
    # ... and on a 100 Gb/s link nothing but the steps' compute is left: a tie the intervals cannot part
    assert fast["apart"] is False and fast["margin"] == pytest.approx(1.0, abs=0.01)
    gossip_map.plot(found, axes, [8], tmp_path / "map.png")
    assert (tmp_path / "map.png").stat().st_size > 10_000
    assert gossip_map.check_cells(found, 8, 3) == [slow]  # the checks go where links, not this machine, set the pace
    assert gossip_map.check_cells(found, 8, 3, max_bandwidth=1e10) == [slow, fast]
    assert gossip_map.check_cells(found, 8, 3, max_bandwidth=1e10, min_latency=1e-4) == []
    words = gossip_map.regions(found, axes)
    assert words[0].startswith("- 8 peers, 1 per host, no straggler: ") and "**diloco H=8**" in words[0]


def test_fewer_steps_beat_cheaper_steps_where_compute_dominates():
    per = {a.label: [200] for a in gossip_map.ALGORITHMS}
    per["allreduce"] = [100]
    axes = {"bandwidth_bytes_per_s": [1.25e10], "latency_s": [1e-5], "peers_per_host": [1], "slowdown": [1.0]}
    (cell,) = gossip_map.cells(_steps([8], per), axes, [8], 1e5, 0.05)
    assert cell["winner"] == "allreduce" and cell["margin"] > 1.9


def test_a_perplexity_target_is_reached_from_above_and_an_accuracy_from_below(tmp_path):
    records = [
        {"step": 5, "samples": 40, "test_perplexity": 12.0, "test_accuracy": 0.2, "emulated_time_s": 1.0},
        {"step": 10, "samples": 80, "test_perplexity": 9.0, "scope": "rank 0", "test_accuracy": 0.9},  # its own model
        {"step": 15, "samples": 120, "test_perplexity": 9.6, "test_accuracy": 0.31, "emulated_time_s": 3.0},
        {"step": 20, "samples": 160, "test_perplexity": 9.4, "test_accuracy": 0.29, "emulated_time_s": 4.0},
        {"step": 25, "samples": 200, "test_perplexity": 9.8, "test_accuracy": 0.33, "emulated_time_s": 5.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # lower is better: the first record at or under 9.5 (not 9.6 on the way down, nor rank 0's own model's 9.0)
    assert gossip_map.first_reached(tmp_path, "test_perplexity", 9.5) == {
        "steps": 20,
        "samples": 160,
        "emulated_s": 4.0,
    }
    assert gossip_map.first_reached(tmp_path, "test_accuracy", 0.3) == {"steps": 15, "samples": 120, "emulated_s": 3.0}
    assert gossip_map.first_reached(tmp_path, "test_perplexity", 9.0)["steps"] is None
    assert gossip_map.meets(9.5, "test_perplexity", 9.5) and not gossip_map.meets(9.5, "test_accuracy", 9.6)
    assert not gossip_map.meets(float("nan"), "test_loss", 1.0) and not gossip_map.meets(None, "test_accuracy", 0.0)


def test_an_unknown_workload_is_named_before_anything_else(tmp_path, capsys):
    with pytest.raises(SystemExit, match="unknown workload 'nosuch'; expected default or a preset"):
        gossip_map.main(["nosuch", "--quick", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_the_language_model_preset_composes_for_every_algorithm_with_one_inner_optimizer():
    workload = gossip_map.workload_overrides("text_lm_peers")
    assert gossip_map.pinned(workload) == []  # its sweep is only of what the map sweeps
    metric, target = gossip_map.TARGETS["text_lm_peers"]
    assert metric in gossip_map.MINIMISED and target > 1
    cfg = gossip_map.compose([*workload, "algorithm=dpsgd", "topology=one_peer_exponential", "peers=16"])
    assert (cfg.data.name, cfg.model.name, cfg.backend.name, cfg.peers) == ("text_corpus", "transformer", "fleet", 16)
    assert (cfg.algorithm.name, cfg.optimizer.name, cfg.optimizer.lr) == ("dpsgd", "adamw", 0.003)
    with pytest.raises(SystemExit, match="unknown workload 'text_lm'"):
        gossip_map.workload_overrides("text_lm")
    with pytest.raises(SystemExit, match=r"--check-algorithms \['adpsgd'\]: expected labels among"):
        gossip_map.main(["text_lm_peers", "--check-algorithms", "adpsgd", "dpsgd ring"])  # AD-PSGD is not checked


def test_the_fashion_mnist_preset_maps_on_iid_shares_with_its_cnn():
    workload = gossip_map.workload_overrides("fashion_mnist_peers")
    assert gossip_map.pinned(workload) == ["data.partition=iid"]  # the map's own sweep keeps the preset's first shares
    assert gossip_map.TARGETS["fashion_mnist_peers"] == ("test_accuracy", 0.85)
    cfg = gossip_map.compose([*workload, "algorithm=diloco", "peers=16"])
    assert (cfg.data.name, cfg.model.name, cfg.model.pool, list(cfg.model.hidden)) == ("fashion_mnist", "cnn", 7, [128])


def _touching(spread: float, a: float = 1.0) -> tuple[list[float], float]:
    """Winner times [a - spread, a + spread] and the runner-up's centre b at which the two 95% Student-t intervals
    touch: b - h and a + h the same float, h each one's half width (equal spreads, exact deviations). h is the
    map's own (experiments.intervals) to the last bit, so that the touch is exact; it is scipy's to 1e-12."""
    from scipy import stats

    from experiments import intervals

    winner = [a - spread, a + spread]
    lo, hi = stats.t.interval(0.95, df=1, loc=a, scale=stats.sem(winner))
    h = intervals.half_width(winner)
    assert h == pytest.approx(hi - a, rel=1e-12) and h == intervals.half_width([7 - spread, 7 + spread])
    b = (a + h) + h
    for _ in range(64):  # the float b whose lower end b - h is the winner's upper end exactly
        if b - h == a + h:
            break
        b = float(np.nextafter(b, np.inf if b - h < a + h else -np.inf))
    assert b - h == a + h and (b - spread) + spread == b and (b + spread) - spread == b
    return winner, b


def test_apart_at_and_on_either_side_of_the_boundary_where_the_intervals_touch():
    """Two seeds each, equal spreads: the winner's and the runner-up's 95% Student-t intervals (scipy.stats.t with
    n - 1 = 1 degree of freedom: t = 12.706) are apart when the winner's upper end is below the runner-up's lower end,
    not when they touch, and the decision turns within one part in 1e9 of the gap on either side."""
    from scipy import stats

    spread = 0.25
    winner, b = _touching(spread)
    _, hi_w = stats.t.interval(0.95, df=1, loc=np.mean(winner), scale=stats.sem(winner))
    for offset, apart in ((0.0, False), (-1e-9, False), (1e-9, True)):
        centre = b + offset * (b - 1.0)
        runner = [centre - spread, centre + spread]
        lo_r, _ = stats.t.interval(0.95, df=1, loc=np.mean(runner), scale=stats.sem(runner))
        assert (hi_w < lo_r) == apart or offset == 0.0  # scipy's own ends, off the touching point
        d = gossip_map.decide({"runner": runner, "winner": winner})
        assert (d["winner"], d["runner_up"]) == ("winner", "runner")
        assert d["apart"] is apart, f"gap {offset:+g} of the touching point: apart={d['apart']}, expected {apart}"
    # three seeds (2 degrees of freedom, t = 4.303): the boundary from scipy's intervals, decided on either side
    winner = [0.5, 1.0, 1.5]
    _, hi_w = stats.t.interval(0.95, df=2, loc=1.0, scale=stats.sem(winner))
    boundary = hi_w + (hi_w - 1.0)  # the runner-up's centre where its lower end meets hi_w (the same spread)
    assert boundary == pytest.approx(1.0 + 2 * stats.t.ppf(0.975, 2) * 0.5 / math.sqrt(3), rel=1e-12)
    for offset, apart in ((-1e-9, False), (1e-9, True)):
        centre = boundary * (1 + offset)
        d = gossip_map.decide({"winner": winner, "runner": [centre - 0.5, centre, centre + 0.5]})
        assert d["apart"] is apart, f"3 seeds, {offset:+g} of the boundary: apart={d['apart']}, expected {apart}"


def test_epochs_for_gives_the_fewest_epochs_whose_steps_reach_min_steps():
    """Against the run's own plan (dpsgd.build.plan: total_steps of a run of E epochs): the smallest E, at least the
    workload's (or the given) epochs, whose run takes min_steps steps; checked at, below and above whole epochs."""
    from runs import experiment, load

    from dpsgd import build
    from dpsgd.config import parse

    cfg = experiment(load("algorithm", "dpsgd"))
    run = parse(cfg)
    train_size = len(build.load_data(run.data, run.seed, run.peers).x_train)

    def reference(n: int, min_steps: int, floor: int) -> int:
        return next(e for e in range(floor, 10_000) if build.plan(run.replace(epochs=e), n).total_steps >= min_steps)

    for n in (4, 8):
        per_epoch = build.plan(run.replace(epochs=1), n).total_steps
        assert per_epoch > 5
        for min_steps in (
            1,
            per_epoch - 1,
            per_epoch,
            per_epoch + 1,
            3 * per_epoch,
            3 * per_epoch + 1,
            7 * per_epoch - 1,
        ):
            for epochs in (None, 2):
                floor = epochs or cfg["epochs"]
                got = gossip_map.epochs_for(cfg, n, train_size, min_steps, epochs)
                assert got == reference(n, min_steps, floor), f"n={n}, min_steps={min_steps}, epochs={epochs}"


@pytest.mark.slow  # make soak: 5.1 min on 2 cores, 2026-12-05 (fleet sweeps, then 6 real mpi runs)
@pytest.mark.processes
@pytest.mark.timeout(900)
def test_quick_map_of_the_default_workload(tmp_path):
    started = time.perf_counter()
    assert gossip_map.main(["default", "--quick", "--out", str(tmp_path)]) == 0
    assert time.perf_counter() - started < 600
    result = json.loads((tmp_path / "map.json").read_text())
    assert (tmp_path / "map.png").exists() and "Where each algorithm wins" in (tmp_path / "map.md").read_text()
    assert len(result["cells"]) == 2 * 3 * 3 * 2 * 2
    assert all({"winner", "margin", "times", "latency_s", "bandwidth_bytes_per_s"} <= set(c) for c in result["cells"])
    assert len({c["cell"] for c in result["checks"]}) >= 3
    for check in result["checks"]:
        assert check["measured_s"] is not None, check
        assert check["predicted_s"] / check["measured_s"] == pytest.approx(1.0, abs=0.15), check
