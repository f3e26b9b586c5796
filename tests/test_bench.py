"""Smoke tests of the benchmarks in experiments/bench: tiny sizes and few repetitions on 4 real
MPI ranks (gloo in the same processes), through the harness. They check the JSON and the correctness checks
the benchmarks make (the toolkit's results equal raw MPI / torch.distributed; AllReduce, DDP and
large-batch SGD agree; LocalSGD and torch's post-local SGD agree), never timing ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.bench import allreduce_vs_ddp, comm_overhead, local_sgd_vs_torch, regression, waiter_cost

pytestmark = pytest.mark.processes  # every benchmark spawns its ranks under mpiexec
COMMON_KEYS = {"benchmark", "date", "machine", "command", "targets", "floor"}


def load(path, benchmark):
    res = json.loads(path.read_text())
    assert COMMON_KEYS <= set(res), sorted(res)
    assert res["benchmark"] == benchmark and res["machine"]["cores"] >= 1
    assert res["floor"]["bytes_per_s"] > 0
    for t in res["targets"]:
        assert {"name", "ratio", "limit", "holds"} <= set(t) and t["ratio"] > 0
    return res


@pytest.mark.slow  # soak: every regression figure measured (test_bench_harness keeps the harness in make test)
def test_bench_quick_dry_run(tmp_path, capsys):
    """`make bench-quick ARGS=--dry`: comm_overhead (1 and 11 MiB), allreduce_vs_ddp, waiter_cost and fleet_vs_batch
    at tiny sizes through the harness, each result checked (the toolkit computes what raw MPI / torch.distributed
    compute; AllReduce, DDP and large-batch SGD agree), then every figure they measured set beside its recorded one:
    the recorded targets' names are the benchmarks' own."""
    assert regression.main(["--dry", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    co = load(tmp_path / "comm_overhead.json", "comm_overhead")
    assert {(r["backend"], r["op"], r["mb"]) for r in co["rows"]} == {
        (b, op, mb) for b in ("mpi", "torch") for op in comm_overhead.OPS for mb in (1, 11)
    }
    assert len(co["targets"]) == len(co["rows"]) and co["problems"] == []
    for r in co["rows"]:
        assert r["toolkit_s"] > 0 and r["raw_s"] > 0 and r["floor_s"] > 0
        assert r["max_abs_diff_vs_raw"] <= 1e-5, r  # the toolkit computes what the raw code computes
        assert r["contract_broken_by"] == [], r  # new tensors where due, the same buffers where due
        assert (r["raw_nonblocking_s"] is not None and r["raw_nonblocking_s"] > 0) == (r["backend"] == "mpi"), r
        new_tensors = r["op"] != "neighbor_exchange_out"  # (out=: into lent buffers in every form, raw's own)
        assert (r["raw_lent_s"] is not None and r["raw_lent_s"] > 0) == new_tensors, r
    for t in co["targets"]:  # a miss names its cause, a pass none; each states the run's noise
        assert (t["cause"] is None) == t["holds"], t
        assert t["interval"][0] <= t["interval"][1], t
    ar = load(tmp_path / "allreduce_vs_ddp.json", "allreduce_vs_ddp")
    assert set(ar["step_s"]) == set(allreduce_vs_ddp.VARIANTS)
    assert {t["name"] for t in ar["targets"]} == {
        f"AllReduce{kind} ({b} backend) / DDP{versus}"
        for b in ("torch", "mpi")
        for kind, versus in ((" overlap", ""), ("", " one bucket"))
    }
    check = ar["check"]
    assert check["moved"] > 1e-3  # the parameters did change, so agreeing means something
    for name in allreduce_vs_ddp.VARIANTS[1:]:
        assert check[f"{name}_vs_large_batch"] <= 1e-12, check  # float64
    assert check["allreduce_torch_vs_ddp"] <= 1e-12, check
    assert all(len(ar["step_s_per_rep"][v]) == ar["reps"] for v in allreduce_vs_ddp.VARIANTS)
    assert all(t["interval"][0] <= t["interval"][1] for t in ar["targets"])
    assert all(0 < ar["in_opt_step_s"][v] < ar["step_s"][v] * 1.5 for v in allreduce_vs_ddp.VARIANTS)
    wc = json.loads((tmp_path / "waiter_cost.json").read_text())
    assert wc["benchmark"] == "waiter_cost" and len(wc["computing"]) == 2  # 4 ranks: 2 compute, 2 wait
    assert set(wc["ratios"]) == set(waiter_cost.MODES) and wc["ratios"]["asleep"] == 1.0
    assert all(t > 0 for row in wc["computing"] for t in row.values())
    assert len(wc["waiting_cpu_fraction"]) == 2
    assert [len(r["asleep"]) for r in wc["computing_per_round"]] == [2, 2]  # --rounds 2, each computing rank
    assert all(t["interval"][0] <= t["interval"][1] for t in wc["targets"])
    assert all(0 <= f <= 1.5 for row in wc["waiting_cpu_fraction"] for f in row.values())
    fb = json.loads((tmp_path / "fleet_vs_batch.json").read_text())
    assert [(r["model"], r["peers"]) for r in fb["rows"]] == [("mlp", 64)] and len(fb["targets"]) == 1
    report = json.loads((tmp_path / "bench_quick.json").read_text())
    measured = [v for v in report["verdicts"] if v["measured"] is not None]
    # every target --dry measures has its recorded figure: 16 cells, 2 overlap ratios, the waiter's 2, the step
    # module's 7, the MLP at 64; each printed beside it
    assert len(measured) == 28 and report["broken"] == [], report["broken"]
    assert all(v["state"] in ("PASS", "MISS", "NOISE") and v["against_recorded"] for v in measured)
    assert "PASS, " in printed
    for r in regression.load_recorded():
        assert f"{r.target} " in printed and f"recorded {r.figure()} ({Path(r.page).name}, {r.date})" in printed, r


@pytest.mark.slow  # soak: a benchmark's dry run
def test_local_sgd_vs_torch(tmp_path):
    out = tmp_path / "local_sgd_vs_torch.json"
    assert (
        local_sgd_vs_torch.main(
            [
                "--hidden",
                "16",
                "--batch",
                "4",
                "--period",
                "3",
                "--warmup-steps",
                "3",
                "--skip",
                "1",
                "--windows",
                "3",
                "--floor-reps",
                "2",
                "--timeout",
                "120",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = load(out, "local_sgd_vs_torch")
    assert set(res["step_s"]) == {"warmup", "local"}
    check = res["check"]  # the timed run, float32
    assert check["moved"] > 1e-3
    assert check["dpsgd_torch_vs_torch"] <= 1e-6 and check["dpsgd_mpi_vs_torch"] <= 1e-6, check
    assert check["dpsgd_torch_between_peers"] == 0.0  # the run ends with an averaging
    check64 = res["check_float64"]
    assert check64["moved"] > 1e-3 and check64["warmup_steps"] == 3
    assert check64["dpsgd_torch_vs_torch"] <= 1e-12 and check64["dpsgd_mpi_vs_torch"] <= 1e-12, check64
    params = next(t for t in res["targets"] if t["name"].startswith("parameters"))
    assert params["holds"]
    timed = [t for t in res["targets"] if t["name"].startswith("LocalSGD")]
    assert len(timed) == 2 and all(t["interval"][0] <= t["interval"][1] for t in timed)


@pytest.mark.slow  # soak: a benchmark's dry run
def test_step_time_vs_network(tmp_path):
    """Two real mpi ranks, the small model, the WAN preset: every emulated step time equals the closed
    form for the synchronous algorithms (the emulated clock is exact in model mode)."""
    from experiments.bench import step_time_vs_network

    out = tmp_path / "step_time_vs_network.json"
    assert (
        step_time_vs_network.main(
            ["--peers", "2", "--sizes", "0.27M", "--networks", "wan", "--timeout", "240", "--out", str(out)]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["benchmark"] == "step_time_vs_network" and out.with_suffix(".png").exists()
    rows = res["rows"]
    assert {r["algorithm"] for r in rows} == {name for name, *_ in step_time_vs_network.ALGORITHMS}
    for r in rows:
        assert r["floor_s_per_step"] > 0 and r["mb_sent_per_peer_per_step"] > 0
        if r["algorithm"] != "adpsgd":
            assert abs(r["vs_closed_form"] - 1) < 1e-9, r


@pytest.mark.slow  # soak: a benchmark's dry run
def test_overlap(tmp_path):
    from experiments.bench import overlap

    out = tmp_path / "overlap.json"
    assert overlap.main(["--steps", "5", "--timeout", "240", "--out", str(out)]) == 0
    res = load(out, "overlap")
    assert res["hidden"]["model"]["hidden_by_waiting"] == 1.0  # exact on the emulated clock
    assert {(r["mode"], r["overlap"]) for r in res["rows"]} == {
        (m, o) for m in ("sleep", "model") for o in (False, True)
    }
