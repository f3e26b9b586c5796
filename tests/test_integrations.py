"""The optimizers inside Lightning, Accelerate and the Transformers Trainer (dpsgd.integrations), on 2 gloo
processes under torchrun: the final parameters equal the library's own loop with the same seeds and data order
for allreduce, D-PSGD and DiLoCo (Lightning, Accelerate: with bf16 mixed precision, gradient accumulation, clipping
and a per-step LR schedule; the Trainer: a tiny GPT-2 from a config, its batches replayed); the bytes gloo
carried per step are the algorithm's alone (no DDP all-reduce: the torch profiler records every gloo operation);
a run resumed from the trainer's own checkpoint (ModelCheckpoint, save_state) equals the one never stopped; an
asynchronous algorithm is refused in one line. One launch serves every test (module fixtures).

To see the tests catch a bug, plant one: DPSGD_TEST_PLANT=ddp (each trainer wraps the model in DDP again) or
DPSGD_TEST_PLANT=no-peer-files (Lightning's and Accelerate's checkpoints hold rank 0's state alone) before pytest."""

from __future__ import annotations

import os

import pytest
from integration_runs import torchrun

pytestmark = pytest.mark.processes
TOLERANCE = 1e-6


ALGORITHMS = ["allreduce", "dpsgd", "diloco"]


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"{n}peers")
def trainer_runs(request, tmp_path_factory):
    pytest.importorskip("lightning", reason="the lightning extra: pip install -e '.[lightning]'")
    pytest.importorskip("accelerate", reason="the accelerate extra: pip install -e '.[accelerate]'")
    pytest.importorskip("transformers", reason="the transformers extra: pip install -e '.[transformers]'")
    plant = ("--plant", os.environ["DPSGD_TEST_PLANT"]) if os.environ.get("DPSGD_TEST_PLANT") else ()
    folder = tmp_path_factory.mktemp("trainers")
    return torchrun("trainers_peer.py", folder, peers=request.param, args=plant, timeout_s=500)


@pytest.fixture(scope="module")
def lightning_runs(trainer_runs):
    return [rank["lightning"] for rank in trainer_runs]


@pytest.fixture(scope="module")
def accelerate_runs(trainer_runs):
    return [rank["accelerate"] for rank in trainer_runs]


@pytest.fixture(scope="module")
def hf_runs(trainer_runs):
    return [rank["transformers"] for rank in trainer_runs]


def wire_bytes_per_exchange(algorithm: str, peers: int, model_bytes: int) -> int:
    """What CommStats counts for one exchange of a model: an all-reduce at the ring cost 2 (n-1)/n, or gossip on
    the ring: one model to each neighbour (one of them on 2 peers)."""
    if algorithm == "dpsgd":
        return model_bytes * (1 if peers == 2 else 2)
    return model_bytes * 2 * (peers - 1) // peers


def largest_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_lightning_equals_the_library_loop(lightning_runs, algorithm):
    for rank, run in enumerate(lightning_runs):
        got = run[algorithm]
        assert got["steps"] == 6  # 2 epochs of 6 batches, 2 accumulated a step
        assert largest_difference(got["lightning"], got["library"]) <= TOLERANCE, f"rank {rank}"


@pytest.mark.timeout(300)
def test_lightning_sends_the_gossip_alone(trainer_runs, lightning_runs):
    peers = trainer_runs[0]["peers"]
    for run in lightning_runs:
        traffic = run["dpsgd"]["traffic"]
        assert traffic["profiled_collectives"] == []  # no all-reduce of gradients (DDP's) or models
        assert traffic["counted_bytes"] > 0
        # per step, what gloo carried equals what the gossip counted: one float32 model to each neighbour
        per_step = wire_bytes_per_exchange("dpsgd", peers, 4 * len(run["dpsgd"]["lightning"]))
        assert traffic["profiled_bytes"] / traffic["steps"] == traffic["counted_bytes"] / traffic["steps"] == per_step


@pytest.mark.timeout(300)
def test_lightning_logs_consensus_distance_and_bytes_sent(lightning_runs):
    for run in lightning_runs:
        logged = run["diloco"]["logged"]  # [consensus distance, bytes sent] after each of the 6 steps
        assert len(logged) == 6
        distances = [row[0] for row in logged]
        # diloco averages every 2 steps: the peers agree after steps 2, 4, 6 and differ after the others
        assert all(d < 1e-12 for d in distances[1::2]) and all(d > 1e-8 for d in distances[0::2]), distances
        sent = [row[1] for row in logged]
        assert sent == sorted(sent) and sent[-1] == run["diloco"]["sent"]
        assert sent[0] == 0 and sent[1] > 0  # nothing sent before the first average


@pytest.mark.timeout(300)
def test_lightning_16_mixed_skips_one_peers_overflow_on_every_peer(lightning_runs):
    for run in lightning_runs:
        fp16 = run["fp16"]
        assert fp16["finite"] and fp16["step_count"] == fp16["global_step"] - 1  # the step with the inf: skipped
    assert len({run["fp16"]["scale"] for run in lightning_runs}) == 1  # every peer's scaler lowered its scale


@pytest.mark.timeout(300)
def test_lightning_resume_from_its_checkpoint_equals_the_run_never_stopped(lightning_runs):
    for rank, run in enumerate(lightning_runs):
        assert run["resumed"]["from"].startswith("epoch=0-step=3")  # mid-period: DiLoCo's peers differ there
        assert largest_difference(run["resumed"]["lightning"], run["diloco"]["lightning"]) <= TOLERANCE, f"rank {rank}"


@pytest.mark.timeout(300)
def test_lightning_refuses_an_asynchronous_algorithm_in_one_line(lightning_runs):
    message = lightning_runs[0]["adpsgd_refusal"]
    assert "\n" not in message and "adpsgd is asynchronous" in message and "use a synchronous algorithm" in message


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_accelerate_equals_the_library_loop(accelerate_runs, algorithm):
    for rank, run in enumerate(accelerate_runs):
        assert run[algorithm]["traffic"]["steps"] == 6
        assert largest_difference(run[algorithm]["accelerate"], run[algorithm]["library"]) <= TOLERANCE, f"rank {rank}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_accelerate_sends_the_algorithm_alone(trainer_runs, accelerate_runs, algorithm):
    model_bytes = 4 * len(accelerate_runs[0][algorithm]["accelerate"])
    per_exchange = wire_bytes_per_exchange(algorithm, trainer_runs[0]["peers"], model_bytes)
    exchanges = {"allreduce": 6, "dpsgd": 6, "diloco": 3}[algorithm]  # diloco: one model average every 2 steps
    for run in accelerate_runs:
        traffic = run[algorithm]["traffic"]
        assert "gloo:broadcast" not in traffic["profiled_collectives"]  # DDP's buffer broadcast before each forward
        assert traffic["profiled_bytes"] == traffic["counted_bytes"] == exchanges * per_exchange


@pytest.mark.timeout(300)
def test_accelerate_resume_from_save_state_equals_the_run_never_stopped(accelerate_runs):
    for rank, run in enumerate(accelerate_runs):
        assert run["stopped"] == {"stopped": 3}  # mid-period: DiLoCo's peers differ there
        assert largest_difference(run["resumed"], run["diloco"]["accelerate"]) <= TOLERANCE, f"rank {rank}"


@pytest.mark.timeout(300)
def test_accelerate_refuses_an_asynchronous_algorithm_in_one_line(accelerate_runs):
    message = accelerate_runs[0]["adpsgd_refusal"]
    assert "\n" not in message and "adpsgd is asynchronous" in message and "Accelerate" in message


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_hf_trainer_steps_the_algorithm_with_the_library_loops_numbers(hf_runs, algorithm):
    for rank, run in enumerate(hf_runs):
        got = run[algorithm]
        assert got["model_class"] == "GPT2LMHeadModel"  # not DistributedDataParallel
        assert got["step_count"] == got["global_step"] == 4
        # the batches the Trainer drew, replayed through the library's loop from the same start
        assert largest_difference(got["trainer"], got["library"]) <= TOLERANCE, f"rank {rank}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_hf_trainer_sends_the_algorithm_alone(trainer_runs, hf_runs, algorithm):
    exchanges = {"allreduce": 4, "dpsgd": 4, "diloco": 2}[algorithm]  # diloco: one model average every 2 steps
    for run in hf_runs:
        got = run[algorithm]
        assert "gloo:broadcast" not in got["profiled_collectives"]  # DDP's buffer broadcast before each forward
        per_exchange = wire_bytes_per_exchange(algorithm, trainer_runs[0]["peers"], 4 * len(got["trainer"]))
        assert got["profiled_bytes"] == got["counted_bytes"] == exchanges * per_exchange


@pytest.mark.timeout(300)
def test_hf_trainer_refuses_an_asynchronous_algorithm_in_one_line(hf_runs):
    message = hf_runs[0]["adpsgd_refusal"]
    assert "\n" not in message and "adpsgd is asynchronous" in message and "Trainer" in message


SOAK_LAUNCHES = 50


@pytest.mark.slow
@pytest.mark.timeout(SOAK_LAUNCHES * 120)
def test_torchrun_launches_of_a_10m_parameter_model_end_cleanly(tmp_path):
    """Every rank of every launch exits 0: none aborts in gloo's teardown (issue 38 measured -6 exits in a
    library-loop run that destroys the default group at exit; Lightning leaves it to the interpreter)."""
    pytest.importorskip("lightning", reason="the lightning extra: pip install -e '.[lightning]'")
    for launch in range(SOAK_LAUNCHES):
        folder = tmp_path / str(launch)
        folder.mkdir()
        ranks = torchrun("big_lightning_peer.py", folder, peers=4, timeout_s=300)  # raises on any non-zero exit
        assert all(rank["parameters"] > 10_000_000 for rank in ranks), f"launch {launch}"
