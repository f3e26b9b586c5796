"""Compression: what a message becomes on the wire (the codecs), and `Compressed`, the communicator
wrapper that sends every mean and mix of an algorithm through a codec. `compression=` in configs names
one of `CODECS`; `wrap(comm, spec)` puts it on any communicator, the fleet's included.

How it works: docs/guide/internals.md#codecs.
"""

from __future__ import annotations

import inspect
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np
import torch

from topologies import Neighbors, Topology

from .base import Communicator, Handle, Wrapped, unflatten

Key = tuple[int, ...]  # (sender rank, then what tells its messages apart: a step, a call, a round)


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integer codes < 2**width, `width` bits each (least significant first), as bytes."""
    shifts = torch.arange(width, device=codes.device, dtype=torch.int64)
    bits = ((codes.to(torch.int64).unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    bits = torch.nn.functional.pad(bits, (0, (-bits.numel()) % 8))  # whole bytes
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int64)).to(torch.uint8)
    return (bits.view(-1, 8) * weights).sum(1, dtype=torch.int64).to(torch.uint8)


def unpack_bits(buf: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """The `count` codes of `width` bits that `pack_bits` packed into `buf` (int64)."""
    shifts = torch.arange(8, device=buf.device, dtype=torch.int64)
    bits = ((buf.to(torch.int64).unsqueeze(1) >> shifts) & 1).reshape(-1)[: count * width].view(count, width)
    return (bits << torch.arange(width, device=buf.device, dtype=torch.int64)).sum(1)


def _bytes_of(values: torch.Tensor) -> torch.Tensor:
    return values.detach().contiguous().reshape(-1).view(torch.uint8)


def _values(buf: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
    # clone: a slice of a byte buffer need not be aligned for a wider dtype
    return buf.clone().view(dtype)[:count] if count else torch.empty(0, dtype=dtype, device=buf.device)


def _generator(seed: int, key: Key, device: torch.device) -> torch.Generator:
    state = np.random.SeedSequence([int(seed), *map(int, key)]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(state) & ((1 << 63) - 1))


def _check_ratio(name: str, ratio) -> float:
    if ratio is None or isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"{name}: ratio is the fraction of entries sent and must be in (0, 1], got {ratio!r}")
    return float(ratio)


class Codec(ABC):
    """encode: flat tensor -> uint8 buffer of nbytes(numel, dtype) bytes; decode: the inverse."""

    name = "?"
    options: tuple[str, ...] = ()  # the attributes __repr__ shows

    @abstractmethod
    def nbytes(self, numel: int, dtype: torch.dtype) -> int: ...

    @abstractmethod
    def encode(self, v: torch.Tensor, key: Key = (0, 0)) -> torch.Tensor: ...

    @abstractmethod
    def decode(self, buf: torch.Tensor, numel: int, dtype: torch.dtype, key: Key = (0, 0)) -> torch.Tensor: ...

    def compress(self, v: torch.Tensor, key: Key = (0, 0)) -> torch.Tensor:
        """decode(encode(v)): what the receivers will see."""
        return self.decode(self.encode(v, key), v.numel(), v.dtype, key)

    def _check(self, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> None:
        want = self.nbytes(numel, dtype)
        if buf.dtype != torch.uint8 or buf.numel() != want:
            raise ValueError(
                f"{self.name}: expected a uint8 buffer of {want} bytes for {numel} entries, "
                f"got {buf.numel()} elements of {buf.dtype}"
            )

    def __repr__(self) -> str:
        values = {k: getattr(self, k) for k in self.options}
        args = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
        return f"{type(self).__name__}({args})"


class _Sparse(Codec):
    options: tuple[str, ...] = ("ratio",)

    def __init__(self, ratio: float):
        self.ratio = _check_ratio(self.name, ratio)

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel - 1e-9)))


def _index_dtype(numel: int) -> torch.dtype:
    for dtype in (torch.uint8, torch.uint16, torch.int32):
        if numel - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


class TopK(_Sparse):
    name = "top_k"

    def _index_bytes(self, numel: int) -> tuple[str, int]:
        as_list = self.k(numel) * _index_dtype(numel).itemsize
        as_bitmap = math.ceil(numel / 8)
        return ("list", as_list) if as_list <= as_bitmap else ("bitmap", as_bitmap)

    def nbytes(self, numel, dtype):
        return self.k(numel) * dtype.itemsize + self._index_bytes(numel)[1]

    def encode(self, v, key=(0, 0)):
        v = v.detach().reshape(-1)
        idx = torch.topk(v.abs(), self.k(v.numel()), sorted=False).indices.sort().values
        if self._index_bytes(v.numel())[0] == "list":
            index_bytes = _bytes_of(idx.to(_index_dtype(v.numel())))
        else:
            mask = torch.zeros(v.numel(), dtype=torch.uint8, device=v.device).index_fill_(0, idx, 1)
            index_bytes = pack_bits(mask, 1)
        return torch.cat([_bytes_of(v[idx]), index_bytes])

    def decode(self, buf, numel, dtype, key=(0, 0)):
        self._check(buf, numel, dtype)
        k = self.k(numel)
        split = k * dtype.itemsize
        if self._index_bytes(numel)[0] == "list":
            idx = buf[split:].clone().view(_index_dtype(numel)).to(torch.int64)
        else:
            idx = torch.nonzero(unpack_bits(buf[split:], numel, 1)).reshape(-1)
        out = torch.zeros(numel, dtype=dtype, device=buf.device)
        out[idx] = _values(buf[:split], k, dtype)
        return out


class RandomK(_Sparse):
    name = "random_k"
    options = ("ratio", "seed")

    def __init__(self, ratio: float, seed: int = 0):
        super().__init__(ratio)
        self.seed = int(seed)

    def indices(self, numel: int, key: Key, device) -> torch.Tensor:
        gen = _generator(self.seed, key, torch.device("cpu"))
        return torch.randperm(numel, generator=gen)[: self.k(numel)].sort().values.to(device)

    def nbytes(self, numel, dtype):
        return self.k(numel) * dtype.itemsize

    def encode(self, v, key=(0, 0)):
        v = v.detach().reshape(-1)
        return _bytes_of(v[self.indices(v.numel(), key, v.device)])

    def decode(self, buf, numel, dtype, key=(0, 0)):
        self._check(buf, numel, dtype)
        out = torch.zeros(numel, dtype=dtype, device=buf.device)
        out[self.indices(numel, key, buf.device)] = _values(buf, self.k(numel), dtype)
        return out


class ScaledSign(Codec):
    name = "sign"

    def nbytes(self, numel, dtype):
        return dtype.itemsize + math.ceil(numel / 8)

    def encode(self, v, key=(0, 0)):
        v = v.detach().reshape(-1)
        scale = v.abs().sum().reshape(1) / max(1, v.numel())
        return torch.cat([_bytes_of(scale), pack_bits((v < 0).to(torch.uint8), 1)])

    def decode(self, buf, numel, dtype, key=(0, 0)):
        self._check(buf, numel, dtype)
        size = dtype.itemsize
        scale = _values(buf[:size], 1, dtype)
        negative = unpack_bits(buf[size:], numel, 1).to(dtype)
        return (1 - 2 * negative) * scale


class QSGD(Codec):
    name = "qsgd"
    options = ("levels", "seed", "rescale")

    def __init__(self, levels: int = 16, seed: int = 0, rescale: bool = False):
        if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
            raise ValueError(
                f"qsgd: levels (s, the number of quantization levels) must be an integer >= 1, got {levels!r}"
            )
        self.levels, self.seed, self.rescale = levels, int(seed), bool(rescale)
        self.width = math.ceil(math.log2(2 * levels + 1))  # codes level * sign + s in [0, 2 s]

    def tau(self, numel: int) -> float:
        s = self.levels
        return 1.0 + min(numel / s**2, math.sqrt(numel) / s) if self.rescale else 1.0

    def nbytes(self, numel, dtype):
        return dtype.itemsize + math.ceil(numel * self.width / 8)

    def uniforms(self, numel: int, key: Key, dtype: torch.dtype, device) -> torch.Tensor:
        """The uniform draws that round each entry up or down, from (seed, key)."""
        return torch.rand(numel, generator=_generator(self.seed, key, torch.device("cpu")), dtype=dtype).to(device)

    def encode(self, v, key=(0, 0)):
        v = v.detach().reshape(-1)
        s = self.levels
        norm = v.norm().reshape(1)
        scaled = v.abs() / norm * s if norm.item() > 0 else torch.zeros_like(v)
        low = scaled.floor()
        u = self.uniforms(v.numel(), key, v.dtype, v.device)
        level = (low + (u < scaled - low).to(v.dtype)).clamp_(0, s).to(torch.int64)
        codes = torch.where(v < 0, -level, level) + s
        return torch.cat([_bytes_of(norm), pack_bits(codes, self.width)])

    def decode(self, buf, numel, dtype, key=(0, 0)):
        self._check(buf, numel, dtype)
        size = dtype.itemsize
        norm = _values(buf[:size], 1, dtype)
        signed_level = (unpack_bits(buf[size:], numel, self.width) - self.levels).to(dtype)
        return signed_level * (norm / (self.levels * self.tau(numel)))


class Cast(Codec):
    """The values in a 16-bit float type (float16 or bfloat16)."""

    options = ("dtype",)
    _NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

    def __init__(self, dtype: torch.dtype = torch.float16):
        if dtype not in self._NAMES:
            raise ValueError(f"Cast sends float16 or bfloat16 values, got {dtype}")
        self.dtype, self.name = dtype, self._NAMES[dtype]

    def nbytes(self, numel, dtype):
        return numel * self.dtype.itemsize

    def encode(self, v, key=(0, 0)):
        return _bytes_of(v.detach().reshape(-1).to(self.dtype))

    def decode(self, buf, numel, dtype, key=(0, 0)):
        self._check(buf, numel, dtype)
        return _values(buf, numel, self.dtype).to(dtype)


class Int8(Codec):
    """One scale max|v| / 127 per message and a signed byte per entry."""

    name = "int8"

    def nbytes(self, numel, dtype):
        return dtype.itemsize + numel

    def encode(self, v, key=(0, 0)):
        v = v.detach().reshape(-1)
        scale = (v.abs().max() if v.numel() else v.new_zeros(())).reshape(1) / 127
        codes = torch.round(v / scale).clamp_(-127, 127) if scale.item() > 0 else torch.zeros_like(v)
        return torch.cat([_bytes_of(scale), _bytes_of(codes.to(torch.int8))])

    def decode(self, buf, numel, dtype, key=(0, 0)):
        self._check(buf, numel, dtype)
        size = dtype.itemsize
        scale = _values(buf[:size], 1, dtype)
        return buf[size:].view(torch.int8).to(dtype) * scale


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """The columns of `matrix` (..., m, k) orthonormalised, as the DDP hook's `_orthogonalize`: Gram-Schmidt
    (each column divided by its norm plus `epsilon`) for k <= 2, else the Q of torch.linalg.qr."""
    if matrix.shape[-1] > 2:
        return torch.linalg.qr(matrix).Q
    out = matrix.clone()
    for i in range(out.shape[-1]):
        col = out[..., i : i + 1]
        col /= torch.norm(col, dim=-2, keepdim=True) + epsilon
        if i + 1 < out.shape[-1]:
            rest = out[..., i + 1 :]
            rest -= torch.sum(col * rest, dim=-2, keepdim=True) * col
    return out


class PowerSGD:
    """PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019): an all-reduce mean compressed to rank r, with
    error feedback and warm start, the rule of torch's DDP hook (ddp_comm_hooks.powerSGD_hook) for one
    bucket holding every tensor of the call. Call t = 0, 1, ... of one stream:
    - t < start_iter: the exact mean.
    - otherwise, with v the tensors as one flat vector and e the stream's error memory (0 at first):
      v <- v + e; each tensor is a matrix M of shape (shape[0], numel / shape[0]), n x m, of rank
      k = min(n, m, r), compressed when (n + m) k * min_compression_rate < n m; the others are averaged
      exactly in one all-reduce. For the compressed ones Q (m x k) is, at the first call or every call
      without warm start, drawn from a normal distribution (one seed per draw from numpy's
      RandomState(seed), every peer the same), else the previous call's Q; then
          Q <- orth(Q);  P <- M Q;  P <- sum_i P_i;  P <- orth(P);  Q <- M^T P;  Q <- (sum_i Q_i) / n
          M <- P Q^T
      with `orthogonalize`; with error feedback e <- v - the result. Draws follow the tensors grouped
      by shape (first-seen shape first), as the hook's do.
    Traffic: the all-reduces of the P's, the Q's and the exact tensors. On a fleet (a leading peer axis)
    the same products run batched over the peers."""

    name = "powersgd"
    options = ("rank", "start_iter", "error_feedback", "warm_start")  # the attributes __repr__ shows
    __repr__ = Codec.__repr__

    def __init__(
        self,
        rank: int = 1,
        start_iter: int = 10,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        seed: int = 0,
    ):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank (of the low-rank approximation) must be an integer >= 1, got {rank!r}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(
                f"PowerSGD start_iter (exact all-reduce steps first) must be an integer >= 0, got {start_iter!r}"
            )
        self.rank, self.start_iter, self.min_compression_rate = rank, start_iter, float(min_compression_rate)
        self.error_feedback, self.warm_start = bool(error_feedback), bool(warm_start)
        self.epsilon, self.seed = float(orthogonalization_epsilon), int(seed)

    def _draw_seed(self, memory: dict) -> int:
        """The next seed of the stream's RandomState(seed), which a checkpoint keeps as a count of draws."""
        if "rng" not in memory:
            memory["rng"] = np.random.RandomState(self.seed)
            for _ in range(memory.get("draws", 0)):
                memory["rng"].randint(1_000_000_000)
        memory["draws"] = memory.get("draws", 0) + 1
        return int(memory["rng"].randint(1_000_000_000))

    def mean(self, comm: Communicator, tensors: Sequence[torch.Tensor], memory: dict) -> list[torch.Tensor]:
        """The compressed mean of `tensors` over `comm`'s peers; `memory` is the stream's (updated)."""
        memory["iter"] = memory.get("iter", 0) + 1
        if memory["iter"] <= self.start_iter:
            return comm.allreduce_mean(tensors)
        lead = comm.peer_shape
        v = comm.flatten(tensors)
        error = memory.get("error")
        if self.error_feedback and error is not None and error.shape == v.shape:
            v = v + error
        out = comm.unflatten(v, tensors)
        by_shape: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}
        exact = []
        for i, t in enumerate(out):
            m = t.reshape(*lead, t.shape[len(lead)], -1) if t.dim() > len(lead) else t.reshape(*lead, 1, 1)
            rows, cols = m.shape[-2:]
            if (rows + cols) * min(rows, cols, self.rank) * self.min_compression_rate < rows * cols:
                by_shape.setdefault((rows, cols), []).append((i, m))
            else:
                exact.append(i)
        matrices = [im for group in by_shape.values() for im in group]
        ks = [min(*m.shape[-2:], self.rank) for _, m in matrices]
        q_memory = memory.get("q_memory")
        q_size = sum(m.shape[-1] * k for (_, m), k in zip(matrices, ks))
        fresh = not self.warm_start or q_memory is None or q_memory.shape[-1] != q_size
        gen = torch.Generator().manual_seed(self._draw_seed(memory)) if fresh and matrices else None
        qs, offset = [], 0
        for (_, m), k in zip(matrices, ks):
            cols = m.shape[-1]
            if gen is not None:
                q = torch.randn(cols, k, generator=gen, dtype=v.dtype).to(v.device).expand(*lead, cols, k)
            else:
                assert q_memory is not None
                q = q_memory[..., offset : offset + cols * k].reshape(*lead, cols, k)
            offset += cols * k
            qs.append(orthogonalize(q, self.epsilon))
        if exact:
            for i, mean in zip(exact, comm.allreduce_mean([out[i] for i in exact])):
                out[i] = mean
        if matrices:
            ps = [
                orthogonalize(p, self.epsilon) for p in comm.allreduce_sum([m @ q for (_, m), q in zip(matrices, qs)])
            ]
            sums = comm.allreduce_sum([m.transpose(-2, -1) @ p for (_, m), p in zip(matrices, ps)])
            qs = [q / comm.size for q in sums]
            for (i, _), p, q in zip(matrices, ps, qs):
                out[i] = (p @ q.transpose(-2, -1)).reshape(out[i].shape)
            memory["q_memory"] = torch.cat([q.reshape(*lead, -1) for q in qs], -1)
        if self.error_feedback:
            memory["error"] = v - comm.flatten(out)
        return out


# --- one vocabulary: the names configs and Choco use ---------------------------------------------------
OPTIONS: dict[str, tuple[str, ...]] = {
    "top_k": ("ratio",),
    "random_k": ("ratio", "seed"),
    "sign": (),
    "qsgd": ("levels", "seed", "rescale"),
    "fp16": (),
    "bf16": (),
    "int8": (),
    "powersgd": tuple(inspect.signature(PowerSGD).parameters),  # every argument of its constructor
}
CODECS = tuple(OPTIONS)


def make(name: str, **options) -> Codec | PowerSGD:
    """The codec `name` (one of CODECS) with its options (None: the default)."""
    if name not in OPTIONS:
        raise ValueError(f"unknown codec {name!r}; valid: {', '.join(CODECS)}")
    options = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(options) - set(OPTIONS[name]))
    if unknown:
        takes = ", ".join(OPTIONS[name]) or "no options"
        raise ValueError(f"codec {name} takes {takes}; got {', '.join(unknown)}")
    if name in ("fp16", "bf16"):
        return Cast(torch.float16 if name == "fp16" else torch.bfloat16)
    if name in ("top_k", "random_k"):
        options.setdefault("ratio", None)  # missing: the codec's own check says what a ratio is
    classes = {"top_k": TopK, "random_k": RandomK, "sign": ScaledSign, "qsgd": QSGD, "int8": Int8, "powersgd": PowerSGD}
    return classes[name](**options)


def wrap(comm: Communicator, compression: str | dict | Codec | PowerSGD | None) -> Communicator:
    """`comm` wearing the compression a config names: a name of CODECS, or a dict with `name`, the codec's
    options and `error_feedback` (default true; PowerSGD's is its own option); none or None: `comm`."""
    if isinstance(compression, (Codec, PowerSGD)):
        return Compressed(comm, compression)
    spec = {"name": compression} if compression is None or isinstance(compression, str) else dict(compression)
    name = spec.pop("name", None) or "none"
    if name == "none":
        return comm
    error_feedback = spec.pop("error_feedback", True) if name != "powersgd" else True
    return Compressed(comm, make(name, **spec), error_feedback=bool(error_feedback))


# --- the wrapper ----------------------------------------------------------------------------------
class Compressed(Wrapped):
    """`comm` whose means and mixes travel encoded by `codec` (see the module); all else is `comm`'s."""

    codec: Codec | PowerSGD

    def __init__(self, comm: Communicator, codec: Codec | PowerSGD, error_feedback: bool = True):
        if isinstance(comm, Compressed):
            raise ValueError(f"this communicator is compressed already ({comm.codec!r}); wrap the exact one")
        super().__init__(comm)
        self.codec, self.error_feedback = codec, bool(error_feedback)
        self.streams: dict[str, dict] = {}  # per stream of means: its error memories (`calls`: random codecs' keys)

    @property
    def exact(self) -> Communicator:
        return self.inner

    def elementwise(self, what: str) -> Codec:
        if isinstance(self.codec, PowerSGD):
            raise ValueError(
                f"compression=powersgd compresses all-reduce means (rank-r factors of each matrix), not {what}: "
                "use compression=int8, fp16, bf16, top_k, random_k, sign or qsgd, or an algorithm that averages"
            )
        return self.codec

    # --- means --------------------------------------------------------------------------------
    def start_allreduce_mean(self, tensors: Sequence[torch.Tensor], stream: str = "") -> Handle:
        """The mean of `tensors`, encoded; `stream` names the series whose error memories it uses."""
        memory = self.streams.setdefault(stream or f"shapes {[tuple(t.shape) for t in tensors]}", {})
        if isinstance(self.codec, PowerSGD):
            return self._done("allreduce_mean", self.codec.mean(self.inner, tensors, memory))
        if self.size == 1:
            return self._done("allreduce_mean", list(tensors))
        return self._mean(tensors, memory)

    def _keep(self, memory: dict, name: str, error: torch.Tensor) -> None:
        if self.error_feedback:
            memory[name] = error

    @staticmethod
    def _memory(memory: dict, name: str, like: torch.Tensor) -> torch.Tensor:
        e = memory.get(name)
        return e if e is not None and e.shape == like.shape else torch.zeros_like(like)

    def _mean(self, tensors: Sequence[torch.Tensor], memory: dict) -> Handle:
        """The encoded mean for the peers this process holds (one real peer, or every peer of a fleet): the
        reduce-scatter's messages leave now, the all-gather's at `wait()`."""
        started, codec, inner, n, call = time.perf_counter(), self.codec, self.inner, self.size, self._call()
        assert isinstance(codec, Codec)
        held = list(range(n)) if self.peer_shape else [self.rank]
        v = inner.flatten(tensors).reshape(len(held), -1)
        d, dtype = v.shape[1], v.dtype
        size = math.ceil(d / n)
        u = torch.zeros(len(held), n * size, dtype=dtype, device=v.device)
        u[:, :d] = v + self._memory(memory, "sent", v)
        chunks = u.view(len(held), n, size)  # [held sender, chunk]
        sent, arrived = chunks.clone(), {}
        for a, i in enumerate(held):
            for r in range(1, n):  # round r: to i + r, from i - r; every message has the same size
                msg = codec.encode(chunks[a, (i + r) % n], (i, call, r))
                sent[a, (i + r) % n] = codec.decode(msg, size, dtype, (i, call, r))
                if not self.peer_shape:
                    arrived[r] = inner.start_neighbor_exchange(msg, [(i + r) % n], [(i - r) % n])
        self._keep(memory, "sent", (u - sent.view(len(held), -1))[:, :d])

        def received(k: int, r: int) -> torch.Tensor:  # chunk k from peer k - r, decoded
            if self.peer_shape:
                return sent[(k - r) % n, k]
            return codec.decode(arrived[r].wait()[0], size, dtype, ((k - r) % n, call, r))

        def finish():
            owned = torch.stack(
                [sum((received(k, r) for r in range(1, n)), chunks[a, k]) / n for a, k in enumerate(held)]
            )
            owned += self._memory(memory, "owned", owned)
            msgs = {k: codec.encode(owned[a], (k, call, n)) for a, k in enumerate(held)}
            if not self.peer_shape:
                others = [p for p in range(n) if p != self.rank]
                msgs.update(zip(others, inner.neighbor_exchange(msgs[self.rank], others, others)))
            out = torch.cat([codec.decode(msgs[p], size, dtype, (p, call, n)) for p in range(n)])
            self._keep(memory, "owned", owned - out.view(n, size)[held])
            if not self.peer_shape:
                return unflatten(out[:d], tensors)
            per_peer = torch.full((n,), 2.0 * (n - 1) * codec.nbytes(size, dtype), dtype=torch.float64)
            self._count_fleet(per_peer, per_peer, started)
            return inner.unflatten(out[:d].expand(n, d).contiguous(), tensors)

        return self._done("allreduce_mean", finish() if self.peer_shape else finish)  # a fleet: all done now

    # --- mixes ----------------------------------------------------------------------------------
    def _start_encoded_mix(self, x: torch.Tensor, weights: Callable[[int], Neighbors], tag: int, what: str):
        """Start sending q_i = Q(x_i) (key (i, tag)) to weights(i).send; the returned function gives
        (q, sum_j w_ij q_j, self included). On a fleet every peer's messages are encoded and summed now."""
        codec = self.elementwise(what)
        if not self.peer_shape:
            nb, key = weights(self.rank), (self.rank, tag)
            msg, recv_from = codec.encode(x, key), sorted(nb.recv)
            handle = self.inner.start_neighbor_exchange(msg, sorted(nb.send), recv_from)

            def finish():
                q = codec.decode(msg, x.numel(), x.dtype, key)
                mixed = q * nb.self_weight
                for peer, buf in zip(recv_from, handle.wait()):  # rank order: the same sum on every backend
                    mixed.add_(codec.decode(buf, x.numel(), x.dtype, (peer, tag)), alpha=nb.recv[peer])
                return q, mixed

            return finish
        started, n = time.perf_counter(), x.shape[0]
        q = torch.stack([codec.compress(x[i], (i, tag)) for i in range(n)])
        mixed = torch.empty_like(q)
        counts = torch.zeros(2, n, dtype=torch.float64)
        for i in range(n):
            nb = weights(i)
            mixed[i] = q[i] * nb.self_weight
            for j in sorted(nb.recv):
                mixed[i].add_(q[j], alpha=nb.recv[j])
            counts[0, i], counts[1, i] = len(nb.send), len(nb.recv)
        sent, received = counts * codec.nbytes(x.shape[1], x.dtype)
        self._count_fleet(sent, received, started)
        return lambda: (q, mixed)

    def _start_weighted_mix(
        self, tensors: Sequence[torch.Tensor], weights: Callable[[int], Neighbors], kind: str = "mix"
    ) -> Handle:
        """x_i + sum_j w_ij (q_j - q_i), self weight included (see the module)."""
        x = self.flatten(tensors)
        finish = self._start_encoded_mix(x, weights, self._call(), "a mix")

        def result():
            q, mixed = finish()
            return self.unflatten(x - q + mixed, tensors)

        return self._done("neighbor_average", result)

    def gossip(self, x: torch.Tensor, topology: Topology, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Choco's exchange: send Q(x) to this peer's out-neighbours of W(step); return (Q(x), sum_j W[i,j]
        Q(x_j)), self included, decoded (on a fleet, with the peer axis). Keys (sender, step)."""
        return self._start_encoded_mix(x, lambda i: topology.neighbors(i, step), step, "Choco's gossip")()

    # --- state: saved with the optimizer (dpsgd.optim's state_dict) -----------------------------------
    def memory(self) -> dict:
        """The streams' error memories and the count of calls (random codecs' keys)."""

        def saved(stream: dict) -> dict:
            return {k: v.clone() if torch.is_tensor(v) else v for k, v in stream.items() if k != "rng"}

        return {"calls": self.calls, "streams": {name: saved(s) for name, s in self.streams.items()}}

    def load_memory(self, state: dict | None) -> None:
        state = state or {}
        self.calls = int(state.get("calls", 0))
        self.streams = {
            name: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in stream.items()}
            for name, stream in (state.get("streams") or {}).items()
        }

    def __repr__(self) -> str:
        return f"Compressed({self.inner!r}, {self.codec!r}, error_feedback={self.error_feedback})"
