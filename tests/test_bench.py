"""Smoke tests of the benchmarks in experiments/bench: tiny sizes and few repetitions on 4 real
MPI ranks (gloo in the same processes). They check the JSON and the correctness checks the
benchmarks make (the toolkit's results equal raw MPI / torch.distributed; AllReduce, DDP and
large-batch SGD agree; LocalSGD and torch's post-local SGD agree), never timing ratios."""

from __future__ import annotations

import json

import pytest

from experiments.bench import allreduce_vs_ddp, comm_overhead, local_sgd_vs_torch, waiter_cost

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


def test_comm_overhead(tmp_path):
    out = tmp_path / "comm_overhead.json"
    assert (
        comm_overhead.main(
            [
                "--sizes-mb",
                "0.01",
                "0.05",
                "--reps",
                "2",
                "--warmup",
                "1",
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
    res = load(out, "comm_overhead")
    rows = res["rows"]
    assert {(r["backend"], r["op"], r["mb"]) for r in rows} == {
        (b, op, mb) for b in ("mpi", "torch") for op in comm_overhead.OPS for mb in (0.01, 0.05)
    }
    assert len(res["targets"]) == len(rows)
    for r in rows:
        assert r["toolkit_s"] > 0 and r["raw_s"] > 0 and r["floor_s"] > 0
        assert r["max_abs_diff_vs_raw"] <= 1e-6, r  # the toolkit computes what the raw code computes
        assert (r["raw_nonblocking_s"] is not None and r["raw_nonblocking_s"] > 0) == (r["backend"] == "mpi"), (
            r
        )  # the cause split exists for mpi only


def test_comm_overhead_miss_cause_splits_the_ratio():
    row = {"toolkit_s": 3.0e-3, "raw_s": 1.5e-3, "raw_nonblocking_s": 2.0e-3, "ratio": 2.0}
    cause = comm_overhead.miss_cause(row)
    # 2.0x = MPI's non-blocking path 1.33x x the toolkit's waiting 1.5x: the product is the ratio
    assert "non-blocking calls 1.33x" in cause and "wrapper 1.50x" in cause
    assert cause.endswith("the toolkit's sleeping waits")
    torch_row = {"toolkit_s": 3.0e-3, "raw_s": 1.5e-3, "raw_nonblocking_s": None, "ratio": 2.0}
    assert "1.50 ms a call" in comm_overhead.miss_cause(torch_row)


def test_allreduce_vs_ddp(tmp_path):
    out = tmp_path / "allreduce_vs_ddp.json"
    assert (
        allreduce_vs_ddp.main(
            [
                "--hidden",
                "16",
                "--batch",
                "4",
                "--reps",
                "2",
                "--warmup",
                "1",
                "--check-steps",
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
    res = load(out, "allreduce_vs_ddp")
    assert set(res["step_s"]) == set(allreduce_vs_ddp.VARIANTS)
    assert {t["name"] for t in res["targets"]} == {
        f"AllReduce{kind} ({b} backend) / DDP{versus}"
        for b in ("torch", "mpi")
        for kind, versus in ((" overlap", ""), ("", " one bucket"))
    }
    check = res["check"]
    assert check["moved"] > 1e-3  # the parameters did change, so agreeing means something
    for name in allreduce_vs_ddp.VARIANTS[1:]:
        assert check[f"{name}_vs_large_batch"] <= 1e-12, check  # float64
    assert check["allreduce_torch_vs_ddp"] <= 1e-12, check
    assert all(0 < res["in_opt_step_s"][v] < res["step_s"][v] * 1.5 for v in allreduce_vs_ddp.VARIANTS)


def test_allreduce_vs_ddp_miss_cause_splits_the_step():
    res = {
        "step_s": {"allreduce_torch_overlap": 0.012, "ddp": 0.010, "no_comm": 0.006},
        "in_opt_step_s": {"allreduce_torch_overlap": 0.004, "ddp": 0.001, "no_comm": 0.001},
    }
    cause = allreduce_vs_ddp.miss_cause(res, "allreduce_torch_overlap", "ddp")
    assert cause.startswith("+2.00 ms a step")
    assert "forward+backward 8.00 against 9.00 ms" in cause and "opt.step() 4.00 against 1.00 ms" in cause


def test_waiter_cost(tmp_path):
    out = tmp_path / "waiter_cost.json"
    args = ["--matmuls", "5", "--matrix", "64", "--rounds", "2", "--warmup", "1", "--timeout", "120"]
    assert waiter_cost.main([*args, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "waiter_cost" and len(res["computing"]) == 2  # 4 ranks: 2 compute, 2 wait
    assert set(res["ratios"]) == set(waiter_cost.MODES) and res["ratios"]["asleep"] == 1.0
    assert all(t > 0 for row in res["computing"] for t in row.values())
    assert len(res["waiting_cpu_fraction"]) == 2 and all(
        0 <= f <= 1.5 for row in res["waiting_cpu_fraction"] for f in row.values()
    )
    assert "MPICH's blocking wait 50.0%" in waiter_cost.miss_cause({"toolkit": 0.1, "asleep": 0.0, "mpi_blocking": 0.5})


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


def test_overlap(tmp_path):
    from experiments.bench import overlap

    out = tmp_path / "overlap.json"
    assert overlap.main(["--steps", "5", "--timeout", "240", "--out", str(out)]) == 0
    res = load(out, "overlap")
    assert res["hidden"]["model"]["hidden_by_waiting"] == 1.0  # exact on the emulated clock
    assert {(r["mode"], r["overlap"]) for r in res["rows"]} == {
        (m, o) for m in ("sleep", "model") for o in (False, True)
    }
