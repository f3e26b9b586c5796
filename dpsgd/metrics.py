"""Measurements shared by every algorithm: evaluation of the averaged and the local models,
consensus distance (1/n) sum_i ||x_i - x_bar||^2, traffic, and where the workload allows, the
perplexity of a language model and the distances to a known optimum. Their own communication runs
`uncounted`, so the reported bytes are the algorithm's alone."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call

from dpsgd.comm import Communicator
from dpsgd.comm.base import flatten

SNAPSHOT_KEYS = (
    "test_loss",
    "test_accuracy",
    "peer_test_accuracy_mean",
    "peer_test_accuracy_min",
    "peer_test_accuracy_max",
    "peer_test_loss_mean",
    "consensus_distance",
    "train_loss",
)


def loss_function(y: torch.Tensor):
    """Cross-entropy for class labels (per token for sequences), mean squared error for real targets."""
    if y.is_floating_point():
        return lambda out, target, reduction="mean": nn.functional.mse_loss(
            out.squeeze(-1), target, reduction=reduction
        )
    return lambda out, target, reduction="mean": nn.functional.cross_entropy(
        out.reshape(-1, out.shape[-1]), target.reshape(-1), reduction=reduction
    )


def score(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
    """(sum of losses, number correct) of `model` with `params` on one batch; for regression "correct"
    counts predictions within 0.1 of the target. Pure tensors: the fleet vmaps it over its peers."""
    out = functional_call(model, params, (x,))
    hit = (out.squeeze(-1) - y).abs() < 0.1 if y.is_floating_point() else out.argmax(-1) == y
    return loss_function(y)(out, y, reduction="sum"), hit.sum()


@torch.no_grad()
def evaluate(
    model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> tuple[float, float, int]:
    """(sum of losses, number correct, count) of `model` with `params` on (x, y); for sequences, count is
    in tokens."""
    loss, correct = 0.0, 0.0
    for i in range(0, len(x), batch_size):
        part_loss, part_correct = score(model, params, x[i : i + batch_size], y[i : i + batch_size])
        loss, correct = loss + part_loss.item(), correct + part_correct.item()
    return loss, correct, y.numel()


@torch.no_grad()
def gather_scalars(comm: Communicator, values: list[float]) -> torch.Tensor:
    """Every peer's `values` as a (size, len(values)) tensor, on every peer."""
    slots = torch.zeros(comm.size, len(values), dtype=torch.float64)
    slots[comm.rank] = torch.tensor(values, dtype=torch.float64)
    with comm.uncounted():
        return comm.allreduce_mean([slots])[0] * comm.size


def gather_objects(comm: Communicator, value) -> list:
    """Every peer's `value` (anything JSON writes exactly: numbers, strings, lists, dicts), rank order, on every
    peer: its JSON text gathered as byte values."""
    text = json.dumps(value).encode()
    lengths = [round(float(v)) for v in gather_scalars(comm, [float(len(text))])[:, 0]]
    table = gather_scalars(comm, [float(b) for b in text] + [0.0] * (max(lengths) - len(text)))
    return [json.loads(bytes(round(float(v)) for v in table[r, : lengths[r]])) for r in range(comm.size)]


def language_metrics(test_loss: float, y: torch.Tensor) -> dict:
    """For token sequences (a language model's targets): the perplexity, exp of the mean per-token
    cross-entropy of the averaged model. Nothing for other targets."""
    if y.is_floating_point() or y.dim() < 2:
        return {}
    return {"test_perplexity": math.exp(min(test_loss, 700.0))}  # capped: a diverged run stays a finite number


def optimum_distances(
    average: Sequence[torch.Tensor], peer_sq_distances: torch.Tensor | None, optimum: torch.Tensor | None
) -> dict:
    """Where the data's minimizer x* is known (dpsgd.data.Split.optimum): `optimum_distance`, |x_bar - x*| of the
    averaged model's parameters `average` (flattened), and `peer_optimum_distance`, sqrt(mean_i |x_i - x*|^2) from
    each peer's own squared distance. None for a model whose parameters are not x*'s (not model=linear); nothing,
    and no work, without x*."""
    if optimum is None:
        return {}
    avg = flatten(average).cpu()
    if avg.numel() != optimum.numel() or peer_sq_distances is None:
        return {"optimum_distance": None, "peer_optimum_distance": None}
    return {
        "optimum_distance": float((avg.double() - optimum.double()).norm()),
        "peer_optimum_distance": float(peer_sq_distances.double().mean().sqrt()),
    }


def squared_optimum_distances(
    params: Sequence[torch.Tensor], optimum: torch.Tensor | None, peer_axis: bool = False
) -> torch.Tensor | None:
    """|x_i - x*|^2 in float64, one per model: `params` is one model's parameters, or with `peer_axis` every peer's
    (a leading peer axis, as the fleet stacks them). None, and no work, without x*, or for a model whose parameters
    are not x*'s."""
    if optimum is None:
        return None
    rows = torch.cat([p.detach().reshape(p.shape[0] if peer_axis else 1, -1) for p in params], 1).cpu()
    if rows.shape[1] != optimum.numel():
        return None
    return (rows.double() - optimum.double()).pow(2).sum(1)


@torch.no_grad()
def own_optimum_distances(model: nn.Module, optimum: torch.Tensor | None) -> dict:
    """`optimum_distances` of one peer's own model (an asynchronous run's records while its peers train)."""
    own = [p.detach() for p in model.parameters()]
    return optimum_distances(own, squared_optimum_distances(own, optimum), optimum)


@torch.no_grad()
def snapshot_metrics(
    comm: Communicator,
    model: nn.Module,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    train_loss: float,
    optimum: torch.Tensor | None = None,
) -> dict:
    """Test metrics of the averaged model and of each peer's own, consensus distance, mean train loss;
    with `optimum`, the distances to it (`optimum_distances`); for a language model, its perplexity."""
    names = [n for n, _ in model.named_parameters()]
    local = [p.detach() for p in model.parameters()]
    with comm.uncounted():
        avg = comm.allreduce_mean(local)
    sq_dist = sum(float((x.double() - a.double()).pow(2).sum()) for x, a in zip(local, avg))
    sq_optimum = squared_optimum_distances(local, optimum)

    # the averaged model: each peer scores its slice of the test set, and the counts are summed
    lo, hi = comm.rank * len(x_test) // comm.size, (comm.rank + 1) * len(x_test) // comm.size
    avg_loss, avg_correct, count = evaluate(model, dict(zip(names, avg)), x_test[lo:hi], y_test[lo:hi])
    own_loss, own_correct, own_count = evaluate(model, dict(zip(names, local)), x_test, y_test)
    table = gather_scalars(
        comm,
        [avg_loss, avg_correct, count, own_correct / own_count, own_loss / own_count, sq_dist, train_loss]
        + [float(sq_optimum[0]) if sq_optimum is not None else 0.0],
    )
    total = table.sum(0)
    peer_acc = table[:, 3]
    test_loss = float(total[0] / total[2])
    return {
        "test_loss": test_loss,
        "test_accuracy": float(total[1] / total[2]),
        "peer_test_accuracy_mean": float(peer_acc.mean()),
        "peer_test_accuracy_min": float(peer_acc.min()),
        "peer_test_accuracy_max": float(peer_acc.max()),
        "peer_test_loss_mean": float(table[:, 4].mean()),
        "consensus_distance": float(table[:, 5].mean()),
        "train_loss": float(table[:, 6].mean()),
        **language_metrics(test_loss, y_test),
        **optimum_distances(avg, table[:, 7] if sq_optimum is not None else None, optimum),
    }


def traffic(comm: Communicator) -> dict:
    """Mean over peers of the algorithm's bytes sent (and the most one peer sent in one step), time
    blocked in communication, and time its non-blocking exchanges ran behind computation (e.g. D-PSGD
    with overlap); with an emulated network (dpsgd.netem), the emulated time (the latest peer's clock)
    and the emulated time spent waiting."""
    s, net = comm.stats, comm.network
    clock = net.clock if net is not None and net.active else None
    emulating = clock is not None
    table = gather_scalars(
        comm,
        [
            s.bytes_sent,
            s.bytes_received,
            s.comm_time_s,
            s.overlap_s,
            clock.elapsed() if clock is not None else 0.0,
            s.emulated_wait_s,
            s.peak_step_bytes,
        ],
    )
    return {
        "emulated_time_s": float(table[:, 4].max()) if emulating else None,
        "emulated_wait_s": float(table[:, 5].mean()) if emulating else None,
        "mb_sent_per_peer": float(table[:, 0].mean()) / 1e6,
        "mb_received_per_peer": float(table[:, 1].mean()) / 1e6,
        "comm_time_s": float(table[:, 2].mean()),
        "comm_overlap_s": float(table[:, 3].mean()),
        "peak_mb_sent_per_step": float(table[:, 6].max()) / 1e6,  # the busiest peer's busiest step
    }
