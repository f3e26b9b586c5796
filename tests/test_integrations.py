"""The optimizers inside Lightning (dpsgd.integrations.lightning), on 2 gloo processes under torchrun: the final
parameters equal the library's own loop with the same seeds and data order for allreduce, D-PSGD and DiLoCo
(bf16-mixed, gradient accumulation, clipping and a per-step LR schedule on); the bytes gloo carried per step are
the gossip's alone (no DDP all-reduce); a fit resumed from its ModelCheckpoint equals the one never stopped; an
asynchronous algorithm is refused in one line. One launch serves every test (a module fixture)."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning", reason="the lightning extra: pip install -e '.[lightning]'")

from integration_runs import torchrun  # noqa: E402

pytestmark = pytest.mark.processes
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    return torchrun("lightning_peer.py", tmp_path_factory.mktemp("lightning"))


def largest_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ["allreduce", "dpsgd", "diloco"])
def test_lightning_equals_the_library_loop(lightning_runs, algorithm):
    for rank, run in enumerate(lightning_runs):
        got = run[algorithm]
        assert got["steps"] == 6  # 2 epochs of 6 batches, 2 accumulated a step
        assert largest_difference(got["lightning"], got["library"]) <= TOLERANCE, f"rank {rank}"


@pytest.mark.timeout(300)
def test_lightning_sends_the_gossip_alone(lightning_runs):
    for run in lightning_runs:
        traffic = run["dpsgd"]["traffic"]
        assert traffic["profiled_collectives"] == []  # no all-reduce of gradients (DDP's) or models
        assert traffic["counted_bytes"] > 0
        # per step, what gloo carried equals what the gossip counted: on 2 peers one float32 model to the neighbour
        model_bytes = 4 * len(run["dpsgd"]["lightning"])
        assert (
            traffic["profiled_bytes"] / traffic["steps"] == traffic["counted_bytes"] / traffic["steps"] == model_bytes
        )


@pytest.mark.timeout(300)
def test_lightning_resume_from_its_checkpoint_equals_the_run_never_stopped(lightning_runs):
    for rank, run in enumerate(lightning_runs):
        assert run["resumed"]["from"].startswith("epoch=0-step=3")  # mid-period: DiLoCo's peers differ there
        assert largest_difference(run["resumed"]["lightning"], run["diloco"]["lightning"]) <= TOLERANCE, f"rank {rank}"


@pytest.mark.timeout(300)
def test_lightning_refuses_an_asynchronous_algorithm_in_one_line(lightning_runs):
    message = lightning_runs[0]["adpsgd_refusal"]
    assert "\n" not in message and "adpsgd is asynchronous" in message and "use a synchronous algorithm" in message
