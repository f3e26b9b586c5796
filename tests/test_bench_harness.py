"""The benchmarks' harness (experiments/bench/harness.py) and `make bench-quick`'s comparison
(experiments/bench/regression.py), in process: the registry against the modules, the one command line, the one
writer, targets, the config composition, and the PASS/MISS lines against recorded figures. The runs themselves:
tests/test_bench.py."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import numpy as np
import pytest

from experiments.bench import (
    allreduce_vs_ddp,
    cli,
    comm_overhead,
    fleet_vs_batch,
    harness,
    regression,
    step_work,
    waiter_cost,
)

BENCH_DIR = Path(harness.__file__).parent
NOT_BENCHMARKS = {
    "cli",
    "__init__",
    "__main__",
    "harness",
    "ranks",
    "steps",
    "regression",
    "gpu_features",
    "gpu_trainers",
}


def test_the_registry_names_every_benchmark_module_and_only_those():
    modules = {p.stem for p in BENCH_DIR.glob("*.py")} - NOT_BENCHMARKS
    assert set(harness.BY_NAME) == modules
    for bench in harness.BENCHES:
        mod = importlib.import_module(f"experiments.bench.{bench.name}")
        assert callable(mod.run) and callable(mod.main), bench.name  # main: python -m experiments.bench.NAME
        assert set(bench.shared) <= set(harness.SHARED), bench.name
        assert bench.in_make_bench == (not bench.needs), bench.name  # a benchmark left out says why
        harness.parser(bench, mod)  # its options and the shared ones do not clash


def test_list_names_each_benchmark_and_what_it_compares(capsys):
    assert cli.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [b.name for b in harness.BENCHES]
    assert "against raw mpi4py and torch.distributed" in lines[0]


def test_an_unknown_benchmark_or_option_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["nope"])
    assert str(exc.value).startswith("error: no benchmark 'nope'; the benchmarks: comm_overhead, ")
    with pytest.raises(SystemExit) as exc:
        harness.run_bench("comm_overhead", ["--nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unrecognized arguments: --nope" in err


def test_shared_options_defaults_and_quick():
    bench = harness.BY_NAME["comm_overhead"]
    args = harness.parse(bench, comm_overhead, [])
    assert (args.peers, args.reps, args.warmup, args.sizes_mb, args.quick) == (4, 30, 3, [1, 11, 44], False)
    assert args.out == Path("outputs/bench/comm_overhead.json") and args.timeout == 600
    quick = harness.parse(bench, comm_overhead, ["--quick"])
    assert quick.sizes_mb == [1, 11] and quick.quick and quick.argv == ["--quick"]
    mine = harness.parse(bench, comm_overhead, ["--quick", "--sizes-mb", "2", "--peers", "6"])
    assert (mine.sizes_mb, mine.peers) == ([2], 6)  # the command line's own options win over the quick form
    fleet = harness.parse(
        harness.BY_NAME["fleet"], importlib.import_module("experiments.bench.fleet"), ["--batch-size", "8"]
    )
    assert fleet.batch == 8  # --batch and --batch-size are one option
    assert harness.parse(harness.BY_NAME["step_time_vs_network"], importlib.import_module(
        "experiments.bench.step_time_vs_network"), ["--peers", "2", "3"]).peers == [2, 3]  # fmt: skip


def test_targets_at_most_at_least_and_causes():
    t = harness.Target("x / y", 1.3, 1.2, cause="the waits")
    assert not t.holds and t.wanted() == "<= 1.2x" and t.line().endswith("MISS\n  cause: the waits")
    assert t.as_dict()["cause"] == "the waits" and t.as_dict()["holds"] is False
    ok = harness.Target("x / y", 1.1, 1.2, cause="not shown")
    assert ok.holds and "cause" not in ok.line() and ok.as_dict()["cause"] is None
    floor = harness.Target("a / b", 0.7, 1.05, at_least=0.7)
    assert floor.holds and floor.wanted() == ">= 0.7x and <= 1.05x"
    either = harness.Target("mlp", 0.4, at_least=0.5, passed=True)  # held another way (near its floor)
    assert either.holds
    count = harness.Target("largest fleet", 2048.0, at_least=8192, unit="")
    assert not count.holds and count.figure().strip() == "2048" and count.wanted() == ">= 8192"


def test_the_stated_noise_is_a_paired_bootstrap_of_the_ratio_of_medians():
    rng = np.random.default_rng(3)
    theirs = list(1.0 + 0.1 * rng.random(41))
    exact = harness.ratio_interval([1.25 * t for t in theirs], theirs)  # every repetition exactly 1.25x
    assert exact == pytest.approx((1.25, 1.25), rel=1e-12)
    noisy = [t * (1.1 + 0.2 * (rng.random() - 0.5)) for t in theirs]  # about 1.1x, each repetition within +-10%
    low, high = harness.ratio_interval(noisy, theirs)
    ratio = np.median(noisy) / np.median(theirs)
    assert low < ratio < high and 0.95 < low < 1.1 < high < 1.25 and high - low < 0.2
    # an independent reference: the same resampling written out, draw by draw
    picks = np.random.default_rng(0).integers(0, 41, size=(2000, 41))
    a, b = np.asarray(noisy), np.asarray(theirs)
    ratios = sorted(float(np.median(a[k]) / np.median(b[k])) for k in picks)

    def at(ratios, share):  # the sorted draws, interpolated linearly between neighbours
        pos = share * (len(ratios) - 1)
        i = int(pos)
        return ratios[i] + (pos - i) * (ratios[i + 1] - ratios[i])

    assert (low, high) == pytest.approx((at(ratios, 0.025), at(ratios, 0.975)), abs=1e-12)
    # repetitions x peers: the mean over the peers of each one's median (waiter_cost's ratio), resampled by repetition
    two = np.stack([noisy, [1.3 * t for t in theirs]], axis=1), np.stack([theirs, theirs], axis=1)
    per_peer = sorted(float(np.median(two[0][k], axis=0).mean() / np.median(two[1][k], axis=0).mean()) for k in picks)
    assert harness.ratio_interval(*two) == pytest.approx((at(per_peer, 0.025), at(per_peer, 0.975)), abs=1e-12)
    with pytest.raises(ValueError, match="equally long lists of repetitions"):
        harness.ratio_interval([1.0, 2.0], [1.0])
    assert harness.ratio_interval([1.0], [2.0]) is None and harness.ratio_interval([[1.0, 2.0]], [[1.0, 1.0]]) is None


def test_a_miss_is_within_noise_only_where_the_interval_reaches_the_target():
    near = harness.Target("AllReduce / DDP", 1.014, 1.0, cause="+2 ms", interval=(0.98, 1.05))
    assert not near.holds and near.within_noise and near.verdict == "MISS within noise"
    assert "1.014x [0.980, 1.050]  (target <= 1x)  MISS within noise\n  cause: +2 ms" in near.line()
    assert near.as_dict()["within_noise"] is True and near.as_dict()["interval"] == (0.98, 1.05)
    far = harness.Target("mpi 1 MiB", 1.6, 1.2, interval=(1.45, 1.75))
    assert not far.within_noise and far.line().endswith("MISS")
    low = harness.Target("fleet / batch", 0.78, at_least=0.8, interval=(0.75, 0.79))
    assert not low.within_noise  # its interval stays below the floor
    assert harness.Target("fleet / batch", 0.78, at_least=0.8, interval=(0.75, 0.81)).within_noise
    held = harness.Target("x", 0.9, 1.0, interval=(0.8, 1.1))
    assert held.holds and not held.within_noise and held.verdict == "PASS"
    assert not harness.Target("x", 1.1, 1.0).within_noise  # no interval: no claim about noise


def test_the_writer_puts_every_result_in_one_shape(tmp_path):
    args = argparse.Namespace(bench="waiter_cost", argv=["--quick"], out=tmp_path / "w.json")
    harness.write(args, {"rows": [1, 2]}, [harness.Target("a / b", 0.9, 1.0)])
    out = json.loads((tmp_path / "w.json").read_text())
    assert {"benchmark", "date", "machine", "command", "targets", "rows"} <= set(out)
    assert out["command"] == "python -m experiments.bench waiter_cost --quick" and out["targets"][0]["holds"]


def test_run_config_composes_the_apps_config():
    cfg = harness.run_config(*harness.fleet_overrides(8, 4, "synthetic", num_samples=100), "model=cnn")
    assert (cfg.backend.name, cfg.peers, cfg.batch_size, cfg.model.name) == ("fleet", 8, 4, "cnn")
    assert cfg.data.num_samples == 100 and cfg.topology.name == "one_peer_exponential"
    assert cfg.algorithm.name == "dpsgd" and "hydra" not in cfg.as_dict()


def test_no_benchmark_composes_a_config_by_hand():
    """conf/ is read only through harness.run_config (one line to change when the config is typed)."""
    for path in BENCH_DIR.glob("*.py"):
        text = path.read_text()
        if path.name not in ("harness.py", "regression.py"):  # regression reads recorded.yaml, not conf/
            assert "initialize_config_dir" not in text and "yaml.safe_load" not in text, path.name
            assert '"conf"' not in text and "CONF_DIR" not in text, path.name


def test_raw_keeps_each_operations_contract():
    """comm_overhead's raw forms: with new tensors (raw, raw nb) each call of the default exchange receives into new
    buffers and the average and all-reduce write a new result, as the toolkit's operations return them; the out=
    exchange receives into the lent buffers in every form, and so does the average (as the toolkit's does); raw lent
    writes only into its preallocated buffers."""
    import torch

    import topologies

    new = {key: made_new for key, (_, made_new) in comm_overhead.RAW.items()}
    assert new == {
        ("mpi", "raw"): True,
        ("mpi", "raw_nb"): True,
        ("mpi", "raw_lent"): False,
        ("torch", "raw"): True,
        ("torch", "raw_lent"): False,
    }
    assert {(b, m) for b, impls in comm_overhead.IMPLS.items() for m in impls if m != "toolkit"} == set(new)
    x = torch.arange(4.0)
    into_seen = []

    def exchange(into):
        into_seen.append(into)
        into[0].copy_(x + 1)  # from the left neighbour (rank 3)
        into[1].copy_(x + 2)  # from the right (rank 1)
        return into

    def allreduce(out):
        return out.copy_(x)

    nb = topologies.make("ring", 4).neighbors(0)
    for new_tensors in (True, False):
        lent = (torch.zeros(4), torch.zeros(4), torch.zeros(4))  # out, from_left, from_right: nothing received yet
        ops = comm_overhead._raw_ops((exchange, allreduce), x, lent, 3, 1, nb, new_tensors)
        # the average first, from receive buffers not yet written: it must receive into the lent ones, in rank order
        mixed = ops["neighbor_average"]()
        assert all(a is b for a, b in zip(into_seen[-1], lent[1:])) and (mixed is lent[0]) != new_tensors
        assert torch.allclose(mixed, (x + (x + 2) + (x + 1)) / 3)  # weights 1/3; rank 1's message before rank 3's
        first, second = ops["neighbor_exchange"](), ops["neighbor_exchange"]()
        assert [t.tolist() for t in [*first, *second]] == [(x + 1).tolist(), (x + 2).tolist()] * 2
        memory = [{t.data_ptr() for t in ts} for ts in (first, second, lent)]
        if new_tensors:  # four new buffers, none of them lent
            assert len(memory[0] | memory[1]) == 4 and (memory[0] | memory[1]).isdisjoint(memory[2])
        else:
            assert all(a is b for a, b in zip([*first, *second], [*lent[1:], *lent[1:]]))
        assert all(a is b for a, b in zip(ops["neighbor_exchange_out"](), lent[1:]))  # lent in every form
        assert (ops["allreduce_mean"]() is lent[0]) != new_tensors


def test_the_miss_causes_split_what_they_measured():
    row = {"op": "neighbor_exchange", "toolkit_s": 3.0e-3, "raw_s": 1.5e-3, "raw_nonblocking_s": 2.4e-3,
           "raw_lent_s": 1.2e-3, "ratio": 2.0}  # fmt: skip
    cause = comm_overhead.miss_cause(row)
    # 2.0x = MPI's non-blocking path 1.6x x the toolkit's waits 1.25x: the product is the ratio; the contract's cost
    # (raw with new tensors against raw into preallocated buffers, 1.25x) named apart, not a factor
    assert cause.startswith("2.00x = ") and "non-blocking calls 1.60x" in cause and "wrapper 1.25x" in cause
    assert "the largest: MPI's non-blocking calls" in cause
    assert "not counted: raw / raw lent 1.25x, the price of new receive buffers (out= avoids it)" in cause
    row["raw_nonblocking_s"] = 1.6e-3  # 1.07x x 1.875x
    cause = comm_overhead.miss_cause(row)
    assert "non-blocking calls 1.07x" in cause and "wrapper 1.88x" in cause
    assert "the largest: the toolkit's waits and wrapper" in cause
    row["op"] = "neighbor_average"  # no form that writes into the caller's tensor: nothing avoids it
    assert comm_overhead.miss_cause(row).endswith("the price of a new result (the operation has no form that writes "
                                                   "into yours)")  # fmt: skip
    row["raw_lent_s"] = None  # the out= exchange: into lent buffers in every form, no contract to name
    assert "not counted" not in comm_overhead.miss_cause(row)
    torch_row = {"op": "allreduce_mean", "toolkit_s": 3.0e-3, "raw_s": 1.5e-3, "raw_nonblocking_s": None,
                 "raw_lent_s": 1.0e-3, "ratio": 2.0}  # fmt: skip
    cause = comm_overhead.miss_cause(torch_row)
    assert "1.50 ms a call" in cause and "raw / raw lent 1.50x, the price of a new result (the in-place sum" in cause
    torch_row["raw_lent_s"] = 2.0e-3  # raw with new tensors the faster: no price to name
    assert comm_overhead.miss_cause(torch_row).endswith("raw / raw lent 0.75x, no price for a new result in this run")
    res = {
        "step_s": {"allreduce_torch_overlap": 0.012, "ddp": 0.010, "no_comm": 0.006},
        "in_opt_step_s": {"allreduce_torch_overlap": 0.004, "ddp": 0.001, "no_comm": 0.001},
    }
    cause = allreduce_vs_ddp.miss_cause(res, "allreduce_torch_overlap", "ddp")
    assert cause.startswith("+2.00 ms a step")
    assert "forward+backward 8.00 against 9.00 ms" in cause and "opt.step() 4.00 against 1.00 ms" in cause
    assert "MPICH's blocking wait 50.0%" in waiter_cost.miss_cause({"toolkit": 0.1, "asleep": 0.0, "mpi_blocking": 0.5})


# --- make bench-quick's comparison --------------------------------------------------------------------


def target_names() -> set[tuple[str, str]]:
    """The names the benchmarks bench-quick runs give their targets in their quick forms, made by their own code."""
    names = {("comm_overhead", f"{b} {op} {mb:g} MiB") for b in ("mpi", "torch") for op in comm_overhead.OPS
             for mb in (1, 11)}  # fmt: skip
    s = dict.fromkeys(allreduce_vs_ddp.VARIANTS, 1.0)
    per_rep = dict.fromkeys(allreduce_vs_ddp.VARIANTS, [1.0, 1.0])
    targets, _ = allreduce_vs_ddp.summarize({"step_s": s, "in_opt_step_s": s, "step_s_per_rep": per_rep})
    names |= {("allreduce_vs_ddp", t.name) for t in targets if "overlap" in t.name}  # with overlap against DDP
    names.add(("waiter_cost", "computing rank, partner in the toolkit's wait / asleep"))
    names.add(("waiter_cost", "computing rank, partner in the toolkit's collective wait / asleep"))
    names |= {("step_work", f"step module, {variant} / by hand") for variant in step_work.OPTIONS}
    for model, ladder in fleet_vs_batch.QUICK.items():
        for n in ladder:
            row = {"model": model, "peers": n, "batch": fleet_vs_batch.BATCH[model], "device": "cpu", "ratio": 1.0,
                   "target": {"holds": True, "cause": None}}  # fmt: skip
            names.add(("fleet_vs_batch", fleet_vs_batch.as_target(row).name))
    return names


def test_every_recorded_figure_names_a_target_bench_quick_measures():
    recorded = regression.load_recorded()
    assert {(r.bench, r.target) for r in recorded} == target_names()
    assert {r.bench for r in recorded} == set(regression.RUNS)
    for r in recorded:
        assert r.low <= r.high and (harness.ROOT / r.page).exists() and r.where and r.date, r


def measured(name: str, ratio: float, limit=None, at_least=None, cause=None) -> dict:
    return harness.Target(name, ratio, limit, at_least=at_least, cause=cause).as_dict()


def test_pass_miss_against_the_target_beside_the_recorded_figure():
    rec = regression.Recorded("comm_overhead", "mpi allreduce_mean 1 MiB", 1.44, 1.83, "docs/results/benchmarks.md",
                              "row", "2026-12-04")  # fmt: skip
    up = regression.Recorded("fleet_vs_batch", "cnn 64 x 8 cpu: fleet / one model", 0.768, 0.768,
                             "docs/results/fleet_vs_batch.md", "quick", "2026-12-05")  # fmt: skip
    gone = regression.Recorded("waiter_cost", "w", 0.84, 1.06, "docs/results/benchmarks.md", "text", "2026-12-04")
    found = {
        ("comm_overhead", rec.target): measured(rec.target, 1.9, 1.2, cause="1.90x = MPI's ... the toolkit's waits"),
        ("fleet_vs_batch", up.target): measured(up.target, 0.85, at_least=0.8),
        ("comm_overhead", "not recorded"): measured("not recorded", 5.0, 1.2),
    }
    miss, passes, absent = regression.compare(found, [rec, up, gone])
    assert (miss.state, passes.state, absent.state) == ("MISS", "PASS", "----")
    assert miss.against_recorded() == "worse than recorded"  # at most: higher is worse
    assert passes.against_recorded() == "better than recorded"  # at least: higher is better
    line = miss.line()
    assert line.startswith("MISS   comm_overhead: mpi allreduce_mean 1 MiB") and "1.900x  target <= 1.2x" in line
    assert "recorded 1.44-1.83 (benchmarks.md, 2026-12-04): worse than recorded" in line
    assert line.endswith("\n      cause: 1.90x = MPI's ... the toolkit's waits")
    assert "cause" not in passes.line() and "target >= 0.8x" in passes.line()
    assert "not measured in this run; recorded 0.84-1.06" in absent.line()
    within = regression.compare({("comm_overhead", rec.target): measured(rec.target, 1.5, 1.2)}, [rec])[0]
    assert within.against_recorded() == "within recorded"
    text = regression.summary([miss, passes, absent], [])
    assert text.startswith("1 PASS, 0 MISS within noise (NOISE), 1 MISS, 1 not measured, 1 worse than recorded")
    assert "exit 0" in text
    noisy = harness.Target(rec.target, 1.25, 1.2, interval=(1.1, 1.4)).as_dict()
    noise = regression.compare({("comm_overhead", rec.target): json.loads(json.dumps(noisy))}, [rec])[0]
    assert noise.state == "NOISE" and "1.250x [1.100, 1.400]  target <= 1.2x" in noise.line()
    assert regression.summary([noise], []).startswith("0 PASS, 1 MISS within noise (NOISE), 0 MISS")
    assert "broken (exit 1): waiter_cost: ranks died" in regression.summary([], ["waiter_cost: ranks died"])


def test_make_bench_runs_each_benchmark_of_its_set_through_the_harness(monkeypatch, capsys):
    ran = []

    def fake_run(cmd, cwd=None):
        ran.append(cmd[3])
        return argparse.Namespace(returncode=1 if cmd[3] == "overlap" else 0)

    monkeypatch.setattr(harness.subprocess, "run", fake_run)
    assert cli.main(["--all", "--quick"]) == 1  # a broken benchmark: exit 1, the others still ran
    assert ran == [b.name for b in harness.BENCHES if b.in_make_bench]
    assert capsys.readouterr().out.strip().endswith("broken: overlap")


def test_step_work_times_the_step_module_against_torchs_idioms(tmp_path):
    """`step_work` at its smallest: each step option's ratio measured, and the two sides equal step for step (a
    schedule, clipping, precision or accumulation that differs from torch's idiom would fail the benchmark)."""
    out = tmp_path / "step_work.json"
    assert step_work.main(["--rounds", "2", "--steps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == list(step_work.OPTIONS)
    assert all(r["max_param_difference"] == 0 and r["ours_ms"] > 0 for r in result["rows"])
    assert len(result["targets"]) == len(step_work.OPTIONS)
    assert all(t["interval"][0] <= t["interval"][1] for t in result["targets"])  # two rounds: the run's noise


def test_step_work_notices_a_step_that_differs(monkeypatch):
    """A step module that forgot to clip, against torch's idiom that clips: the check sees the difference."""
    original = step_work.ours
    monkeypatch.setattr(step_work, "ours", lambda variant, total, comm: original("fp32", total, comm))
    assert step_work.same_steps("clip_grad_norm") > 0
