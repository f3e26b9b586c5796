"""Compressed messages with error feedback: the mean and the gossip mix of a communicator, with every
message encoded by a quantizer of dpsgd.compress (fp16, bf16, int8 with one scale per bucket), for
any algorithm. The bytes counted are the encoded messages' own, as they go on the wire.

`Messages(comm, codec)` offers the operations an update rule is made of; `codec=None` is the exact
communicator. Each stream of messages (gradients, models, outer deltas: named by the caller) keeps
its own error memory, so what a quantizer drops now is sent later.

All-reduce mean of a flat vector v (d entries) over n peers, in two phases of n - 1 messages each,
every message a quantized chunk of ceil(d / n) entries (the bandwidth-optimal ring's bytes,
2 (n-1)/n of the encoded size):
  1. reduce-scatter: peer i adds its error e_i to v_i, splits u_i = v_i + e_i into n chunks and sends
     Q(chunk k) to peer k (its own chunk stays exact); e_i <- u_i - what was sent. Peer k averages
     its chunk over all peers: s_k = (u_k[k] + sum_{i != k} Q(u_i[k])) / n.
  2. all-gather: peer k sends Q(s_k + f_k) to every peer, f_k <- s_k + f_k - Q(s_k + f_k) (its own
     error memory for the chunks it owns); every peer, k included, takes the decoded chunks, so all
     peers hold the same mean.
  Summed over steps: sum_t result_t + mean_i e_i + f = sum_t mean_i v_i (what was not sent is
  exactly what the error memories hold).

Gossip mix (D-PSGD), x_i <- x_i + sum_j W[i,j] (q_j - q_i) with q_j = Q(x_j) the message peer j
sent: with a lossless Q it is sum_j W[i,j] x_j; with a doubly stochastic W it keeps the average model
exactly. What q_i leaves out, x_i - q_i, stays in peer i's own model and goes out with its next
message: the model itself is the error memory, so no stream state is kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dpsgd.compress import Compressor
from topologies import Topology

from .base import Communicator, flatten, unflatten
from .powersgd import PowerSGD


class Started:
    """A started compressed operation; `wait()` returns the tensors."""

    def __init__(self, finish):
        self._finish, self._result = finish, None

    def wait(self) -> list[torch.Tensor]:
        if self._result is None:
            self._result = self._finish()
        return self._result


class Messages:
    """A communicator's mean and mix with quantized, error-fed messages (codec None: exact)."""

    def __init__(self, comm: Communicator, codec: Compressor | None = None, error_feedback: bool = True):
        if codec is not None and comm.peer_shape:
            raise ValueError(
                "compressed messages run on real peers (backend local, mpi or torch); the fleet simulates "
                "exact messages only - use compression=none with backend=fleet"
            )
        self.comm, self.codec, self.error_feedback = comm, codec, bool(error_feedback)
        self.errors: dict[str, torch.Tensor] = {}  # per stream: computed but not sent yet

    def _error(self, stream: str, like: torch.Tensor) -> torch.Tensor:
        e = self.errors.get(stream)
        if e is None or e.shape != like.shape:
            e = self.errors[stream] = torch.zeros_like(like)
        return e

    def _keep(self, stream: str, error: torch.Tensor) -> None:
        if self.error_feedback:
            self.errors[stream] = error

    # --- all-reduce mean ----------------------------------------------------------------------
    def start_allreduce_mean(self, tensors: Sequence[torch.Tensor], stream: str = "allreduce") -> Started:
        """Start the mean; the reduce-scatter's messages leave now, the all-gather's at `wait()`."""
        if self.codec is None:
            return self.comm.start_allreduce_mean(tensors)  # type: ignore[return-value]
        comm, codec = self.comm, self.codec
        n, rank = comm.size, comm.rank
        v = flatten(tensors)
        if n == 1:
            return Started(lambda: unflatten(v, tensors))
        d = v.numel()
        size = math.ceil(d / n)
        u = torch.zeros(n * size, dtype=v.dtype, device=v.device)
        u[:d] = v
        u[:d] += self._error(stream, v)
        chunks = u.view(n, size)
        sent = chunks.clone()
        started = []
        for r in range(1, n):  # round r: to rank + r, from rank - r; every message has the same size
            to, frm = (rank + r) % n, (rank - r) % n
            msg = codec.encode(chunks[to], (rank, r))
            sent[to] = codec.decode(msg, size, v.dtype, (rank, r))
            started.append((frm, r, comm.start_neighbor_exchange(msg, [to], [frm])))
        self._keep(stream, (u - sent.view(-1))[:d])

        def finish():
            total = chunks[rank].clone()
            for frm, r, handle in started:
                (got,) = handle.wait()
                total += codec.decode(got, size, v.dtype, (frm, r))
            mine = total / n
            owned = mine + self._error(stream + ":owned", mine)
            msg = codec.encode(owned, (rank, n))
            others = [p for p in range(n) if p != rank]
            received = dict(zip(others, comm.neighbor_exchange(msg, others, others)))
            received[rank] = msg
            out = torch.cat([codec.decode(received[p], size, v.dtype, (p, n)) for p in range(n)])
            self._keep(stream + ":owned", owned - out[rank * size : (rank + 1) * size])
            return unflatten(out[:d], tensors)

        return Started(finish)

    def allreduce_mean(self, tensors: Sequence[torch.Tensor], stream: str = "allreduce") -> list[torch.Tensor]:
        return self.start_allreduce_mean(tensors, stream).wait()

    # --- gossip ---------------------------------------------------------------------------------
    def start_mix(self, tensors: Sequence[torch.Tensor], topology: Topology, step: int) -> Started:
        """Start x_i + sum_j W(step)[i, j] (q_j - q_i) (exactly sum_j W[i, j] x_j without a codec)."""
        if self.codec is None:
            return self.comm.start_mix(tensors, topology, step)  # type: ignore[return-value]
        codec, comm = self.codec, self.comm
        x = flatten(tensors)
        nb = topology.neighbors(comm.rank, step)
        msg = codec.encode(x, (comm.rank, step))
        recv_from = sorted(nb.recv)
        handle = comm.start_neighbor_exchange(msg, sorted(nb.send), recv_from)

        def finish():
            q = codec.decode(msg, x.numel(), x.dtype, (comm.rank, step))
            out = x.sub_(q).add_(q, alpha=nb.self_weight)
            for peer, buf in zip(recv_from, handle.wait()):  # rank order: the same sum on every backend
                out.add_(codec.decode(buf, x.numel(), x.dtype, (peer, step)), alpha=nb.recv[peer])
            return unflatten(out, tensors)

        return Started(finish)

    def mix(self, tensors: Sequence[torch.Tensor], topology: Topology, step: int) -> list[torch.Tensor]:
        return self.start_mix(tensors, topology, step).wait()

    # --- state ----------------------------------------------------------------------------------
    def state(self) -> dict:
        return {k: v.clone() for k, v in self.errors.items()}

    def load_state(self, state: dict | None) -> None:
        self.errors = {k: v.detach().clone() for k, v in (state or {}).items()}

    def __repr__(self) -> str:
        return f"Messages({self.codec!r}, error_feedback={self.error_feedback})"


COMPRESSIONS = ("none", "powersgd", "int8", "fp16", "bf16")


def _spec(compression: str | dict | None) -> tuple[str, dict]:
    spec = {"name": compression} if compression is None or isinstance(compression, str) else dict(compression)
    name = spec.pop("name", None) or "none"
    if name not in COMPRESSIONS:
        raise ValueError(f"unknown compression {name!r}; valid: {', '.join(COMPRESSIONS)}")
    return name, {k: v for k, v in spec.items() if v is not None}


def quantized(comm: Communicator, compression: str | dict | None, who: str) -> Messages:
    """The messages a config's `compression` names for an algorithm that mixes or averages models:
    none, int8, fp16 or bf16 (a name, or a dict with `name` and `error_feedback`)."""
    from dpsgd.compress import make as make_codec

    name, options = _spec(compression)
    if name == "powersgd":
        raise ValueError(
            f"{who} takes compression none, int8, fp16 or bf16, not powersgd: PowerSGD compresses "
            "all-reduced gradients (use algorithm=allreduce compression=powersgd)"
        )
    unknown = set(options) - {"error_feedback"}
    if unknown:
        raise ValueError(f"compression={name} takes only error_feedback, got {sorted(unknown)}")
    codec = None if name == "none" else make_codec(name)
    return Messages(comm, codec, error_feedback=options.get("error_feedback", True))


def make(comm: Communicator, compression: str | dict | None, who: str = "AllReduce") -> Messages | PowerSGD:
    """Gradient messages: `quantized`'s, or PowerSGD's (name powersgd; options rank, start_iter,
    min_compression_rate, error_feedback, warm_start, orthogonalization_epsilon, seed)."""
    name, options = _spec(compression)
    if name == "powersgd":
        return PowerSGD(comm, **options)
    return quantized(comm, compression, who)
