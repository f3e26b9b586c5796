"""Measurements shared by every algorithm: evaluation of the averaged and the local models,
consensus distance (1/n) sum_i ||x_i - x_bar||^2, traffic, and where the workload allows, the
perplexity of a language model and the distances to a known optimum. Their own communication runs
`uncounted`, so the reported bytes are the algorithm's alone. What a record evaluates is an `Evaluation`: the
test split or a seeded subset of it, every peer's own model or a seeded sample of the peers (`eval.samples`,
`eval.peers`), or nothing (a record between evaluations: its test figures are None)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch
from torch import nn
from torch.func import functional_call, vmap

from dpsgd.comm import Communicator
from dpsgd.comm.base import flatten


@dataclass(frozen=True)
class Evaluation:
    """What a record evaluates: the test samples it scores the averaged model (and the peers' own) on, and the peers
    whose own model it scores (None: every peer)."""

    x: torch.Tensor
    y: torch.Tensor
    peers: frozenset[int] | None = None

    @classmethod
    def sampled(
        cls, x: torch.Tensor, y: torch.Tensor, n: int, samples: int | None, peers: int | None, seed: int
    ) -> Evaluation:
        """`samples` of the test split's samples and `peers` of the n peers, drawn once from `seed` (the same at
        every record, so a run's curve is one subset's); None: all of them."""
        generator = torch.Generator().manual_seed(seed)
        if samples is not None and samples < len(x):
            chosen = torch.randperm(len(x), generator=generator)[:samples].sort().values.to(x.device)
            x, y = x[chosen], y[chosen]
        own = (
            None if peers is None or peers >= n else frozenset(torch.randperm(n, generator=generator)[:peers].tolist())
        )
        return cls(x, y, own)

    def scores(self, rank: int) -> bool:
        """Whether peer `rank`'s own model is scored."""
        return self.peers is None or rank in self.peers


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
    model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, batch_size: int = 256
) -> tuple[float, float, int]:
    """(sum of losses, number correct, count) of `model` with `params` on (x, y), in eval mode (BatchNorm: its
    running statistics, left as they are); for sequences, count is in tokens."""
    loss, correct, training = 0.0, 0.0, model.training
    model.eval()
    try:
        for i in range(0, len(x), batch_size):
            part_loss, part_correct = score(model, params, x[i : i + batch_size], y[i : i + batch_size])
            loss, correct = loss + part_loss.item(), correct + part_correct.item()
    finally:
        model.train(training)
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
    """For token sequences (a language model's targets): the perplexity, exp of the mean per-token cross-entropy
    of the averaged model, and that cross-entropy in bits (the datasets here are character level: bits per
    character, the figure character-level language modelling reports). Nothing for other targets."""
    if y.is_floating_point() or y.dim() < 2:
        return {}
    return {
        "test_perplexity": math.exp(min(test_loss, 700.0)),  # capped: a diverged run stays a finite number
        "test_bits_per_character": test_loss / math.log(2),
    }


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


class _WorkloadKeys(TypedDict, total=False):
    test_perplexity: float  # a language model's (token sequences) only
    test_bits_per_character: float  # likewise: the test loss in bits (log2 of the perplexity)
    optimum_distance: float | None  # where the data's minimizer x* is known (optimum_distances)
    peer_optimum_distance: float | None


class Record(_WorkloadKeys):
    """One record of metrics.jsonl, the same keys for every kind of run (real peers, the fleet, the event
    simulator), None where a run cannot know a value, and the keys of its workload (_WorkloadKeys); the run's
    last record heads summary.json. A new key is one line here and its figure in `measure` (per peer, a
    column of COLUMNS in `peer_row` and `measure_stacked`): this file only."""

    step: int
    epoch: float
    samples: int
    wall_time_s: float
    emulated_time_s: float | None  # the latest peer's emulated (or the simulator's virtual) clock
    test_loss: float | None  # of the averaged model
    test_accuracy: float | None
    peer_test_accuracy_mean: float | None  # of each peer's own model
    peer_test_accuracy_min: float | None
    peer_test_accuracy_max: float | None
    peer_test_loss_mean: float | None
    consensus_distance: float | None  # (1/n) sum_i |x_i - x_bar|^2
    train_loss: float | None
    mb_sent_per_peer: float | None
    mb_received_per_peer: float | None
    comm_time_s: float | None  # blocked in communication, mean over peers
    comm_overlap_s: float | None  # non-blocking exchanges behind computation, mean over peers
    emulated_wait_s: float | None  # emulated time spent waiting for modelled messages, mean over peers
    peak_mb_sent_per_step: float | None  # the busiest peer's busiest step (None: no global step)
    lr: float | None  # the learning rate of the last step (its first parameter group's; schedule=)
    scope: str  # "all peers", or "rank 0": an asynchronous run's own view while its peers train


def record(**values) -> dict:
    """A `Record` of `values`: every required key (None where not given), then the workload's keys given."""
    unknown = set(values) - set(Record.__annotations__)
    if unknown:
        raise KeyError(f"{sorted(unknown)} are not keys of dpsgd.metrics.Record; add them there")
    required = [k for k in Record.__annotations__ if k in Record.__required_keys__]
    return {
        **{k: values.get(k) for k in required},
        **{k: values[k] for k in Record.__annotations__ if k in values and k not in required},
    }


# every peer's figures behind a record, one column each (real peers gather their rows, the fleet stacks them)
COLUMNS = (
    "own_loss own_accuracy avg_loss avg_correct avg_count sq_consensus train_loss sq_optimum "
    "bytes_sent bytes_received comm_time_s overlap_s clock_s emulated_wait_s peak_step_bytes"
).split()


@torch.no_grad()
def peer_row(
    comm: Communicator, model: nn.Module, evaluation: Evaluation | None, train_loss: float, optimum
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One real peer's figures (COLUMNS) and the averaged model (collectives, uncounted): the averaged model is
    scored on this peer's slice of the evaluation's samples, its own model on all of them (where the evaluation
    scores it: NaN where not, nothing without an evaluation)."""
    net = comm.network
    clock_s = net.clock.elapsed() if net is not None and net.active else 0.0  # before the evaluation's collectives
    names = [n for n, _ in model.named_parameters()]
    local = [p.detach() for p in model.parameters()]
    with comm.uncounted():
        avg = comm.allreduce_mean(local)
    avg_loss, avg_correct, count = 0.0, 0.0, 0
    own_loss, own_correct, own_count = math.nan, math.nan, 1
    if evaluation is not None:
        x, y = evaluation.x, evaluation.y
        lo, hi = comm.rank * len(x) // comm.size, (comm.rank + 1) * len(x) // comm.size
        avg_loss, avg_correct, count = evaluate(model, dict(zip(names, avg)), x[lo:hi], y[lo:hi])
        if evaluation.scores(comm.rank):
            own_loss, own_correct, own_count = evaluate(model, dict(zip(names, local)), x, y)
    sq_optimum = squared_optimum_distances(local, optimum)
    s = comm.stats
    row = {
        "own_loss": own_loss / own_count,
        "own_accuracy": own_correct / own_count,
        "avg_loss": avg_loss,
        "avg_correct": avg_correct,
        "avg_count": count,
        "sq_consensus": sum(float((x.double() - a.double()).pow(2).sum()) for x, a in zip(local, avg)),
        "train_loss": train_loss,
        "sq_optimum": float(sq_optimum[0]) if sq_optimum is not None else 0.0,
        "bytes_sent": s.bytes_sent,
        "bytes_received": s.bytes_received,
        "comm_time_s": s.comm_time_s,
        "overlap_s": s.overlap_s,
        "clock_s": clock_s,
        "emulated_wait_s": s.emulated_wait_s,
        "peak_step_bytes": s.peak_step_bytes,
    }
    return row, avg


@torch.no_grad()
def measure_stacked(
    model,
    names,
    params: list[torch.Tensor],
    evaluation: Evaluation | None,
    train_loss: float,
    optimum,
    traffic: dict,
    emulated: bool,
) -> dict:
    """`measure` of n peers whose parameters carry a leading peer axis (the fleet, the event simulator), from their
    COLUMNS; `traffic`: each traffic column ((n,) or a number for every peer)."""
    n = params[0].shape[0]
    avg = [p.mean(0) for p in params]
    avg_loss, avg_correct, count = 0.0, 0.0, 0
    own_loss = torch.full((n,), math.nan, dtype=torch.float64)
    own_correct, own_count = own_loss.clone(), 1
    if evaluation is not None:
        avg_loss, avg_correct, count = evaluate(model, dict(zip(names, avg)), evaluation.x, evaluation.y)
        scored = sorted(evaluation.peers) if evaluation.peers is not None else list(range(n))
        at = torch.tensor(scored)
        chosen = [p[at.to(p.device)] for p in params]
        loss, correct, own_count = evaluate_peers(model, names, chosen, evaluation.x, evaluation.y)
        own_loss[at], own_correct[at] = loss, correct
    sq_optimum = squared_optimum_distances(params, optimum, peer_axis=True)
    first = torch.zeros(n, dtype=torch.float64)
    first[0] = 1.0  # the averaged model is scored once: its sums in row 0
    columns = {
        "own_loss": own_loss / own_count,
        "own_accuracy": own_correct / own_count,
        "avg_loss": first * avg_loss,
        "avg_correct": first * avg_correct,
        "avg_count": first * count,
        "sq_consensus": torch.stack(
            [((p.double() - a.double()) ** 2).reshape(n, -1).sum(1) for p, a in zip(params, avg)]
        ).sum(0),
        "train_loss": torch.full((n,), float(train_loss), dtype=torch.float64),
        "sq_optimum": sq_optimum if sq_optimum is not None else torch.zeros(n, dtype=torch.float64),
    }
    for k in COLUMNS[8:]:
        columns[k] = torch.as_tensor(traffic.get(k, 0.0), dtype=torch.float64).expand(n)
    return measure(columns, avg, evaluation, optimum, emulated)


def measure(
    c: dict[str, torch.Tensor], average: Sequence[torch.Tensor], evaluation: Evaluation | None, optimum, emulated: bool
) -> dict:
    """The measured keys of a record from every peer's figures `c` (COLUMNS) and the averaged model: its test
    metrics (None without an evaluation), each scored peer's own (the peers not scored are NaN in `c`), consensus
    distance, mean train loss, traffic, and where the workload allows, its perplexity and the distances to the
    optimum."""
    tested: dict = dict.fromkeys(
        ("test_loss", "test_accuracy", "peer_test_accuracy_mean", "peer_test_accuracy_min", "peer_test_accuracy_max")
    )
    tested["peer_test_loss_mean"] = None
    if evaluation is not None:
        count = float(c["avg_count"].sum())
        own = ~torch.isnan(c["own_accuracy"])
        accuracy, own_loss = c["own_accuracy"][own], c["own_loss"][own]
        scored = bool(own.any())  # eval.peers=0: no peer's own model
        tested = {
            "test_loss": float(c["avg_loss"].sum()) / count,
            "test_accuracy": float(c["avg_correct"].sum()) / count,
            "peer_test_accuracy_mean": float(accuracy.mean()) if scored else None,
            "peer_test_accuracy_min": float(accuracy.min()) if scored else None,
            "peer_test_accuracy_max": float(accuracy.max()) if scored else None,
            "peer_test_loss_mean": float(own_loss.mean()) if scored else None,
            **language_metrics(float(c["avg_loss"].sum()) / count, evaluation.y),
        }
    return {
        **tested,
        "consensus_distance": float(c["sq_consensus"].mean()),
        "train_loss": float(c["train_loss"].mean()),
        **optimum_distances(average, c["sq_optimum"], optimum),
        "emulated_time_s": float(c["clock_s"].max()) if emulated else None,
        "emulated_wait_s": float(c["emulated_wait_s"].mean()) if emulated else None,
        "mb_sent_per_peer": float(c["bytes_sent"].mean()) / 1e6,
        "mb_received_per_peer": float(c["bytes_received"].mean()) / 1e6,
        "comm_time_s": float(c["comm_time_s"].mean()),
        "comm_overlap_s": float(c["overlap_s"].mean()),
        "peak_mb_sent_per_step": float(c["peak_step_bytes"].max()) / 1e6,
    }


def measure_peers(comm: Communicator, model, evaluation: Evaluation | None, train_loss: float, optimum=None) -> dict:
    """`measure` on real peers: every peer's row gathered (collectives: every peer calls it)."""
    row, avg = peer_row(comm, model, evaluation, train_loss, optimum)
    table = gather_scalars(comm, [float(row[k]) for k in COLUMNS])
    emulated = comm.network is not None and comm.network.active
    return measure({k: table[:, i] for i, k in enumerate(COLUMNS)}, avg, evaluation, optimum, emulated)


PEER_CHUNK = 64  # peers evaluated in one vectorized call
# up to this many peers, one model at a time: vmap over convolutions is slow on a CPU (8 peers of the Fashion-MNIST
# CNN on 2000 test images, one thread: 10.3 s vectorized, 2.6 s one at a time, 2026-12-06, load 4); many small
# models (the fleet of 1,024 MLPs) keep the vectorized call
LOOPED_PEERS = 16


@torch.no_grad()
def evaluate_peers(
    model, names: list[str], params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, batch_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(n,) sums of losses, (n,) numbers correct and the count, of every peer's own model on (x, y) (a leading
    peer axis on `params`), as `evaluate` scores one model."""
    n = params[0].shape[0]
    loss = torch.zeros(n, dtype=torch.float64)
    correct = torch.zeros(n, dtype=torch.float64)
    if n <= LOOPED_PEERS:  # the same scores as the vectorized call below, one peer at a time
        for k in range(n):
            own = {name: p[k] for name, p in zip(names, params)}
            for i in range(0, len(x), batch_size):
                part_loss, c = score(model, own, x[i : i + batch_size], y[i : i + batch_size])
                loss[k] += part_loss.double().cpu()
                correct[k] += c.double().cpu()
        return loss, correct, y.numel()
    batched = vmap(lambda ps, xb, yb: score(model, dict(zip(names, ps)), xb, yb), in_dims=(0, None, None))
    for a in range(0, n, PEER_CHUNK):
        chunk = tuple(p[a : a + PEER_CHUNK] for p in params)
        for i in range(0, len(x), batch_size):
            part_loss, c = batched(chunk, x[i : i + batch_size], y[i : i + batch_size])
            loss[a : a + PEER_CHUNK] += part_loss.double().cpu()
            correct[a : a + PEER_CHUNK] += c.double().cpu()
    return loss, correct, y.numel()
