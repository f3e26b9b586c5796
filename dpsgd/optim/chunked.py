"""Chunked top-k messages, the wire format of DeMo and SparseLoCo: each tensor is cut into blocks (a 1-D tensor into
chunks of c entries, a matrix into c1 x c2 tiles, c the largest divisor of the dimension <= the target chunk, as
DeMo's reference does), optionally turned into orthonormal DCT-II coefficients per block, and only the k entries of
largest magnitude of each block are kept. A peer's message holds their positions in the block (ceil(log2(block
size)) bits each; none where k keeps a whole block) and their values: 32-bit floats, or b-bit codes with a shift and
a table of 2^b centroids per tensor (SparseLoCo's statistical quantization). Every peer's message reaches every
other one (an all-gather: n - 1 messages sent and received per peer), and each peer combines them in rank order: the
mean over all peers, or each entry's mean over the peers that sent it (the reference codes'), optionally after
clipping each peer's values to the median norm (templar's). Tensors may carry leading peer axes (a fleet's): every
peer's message is computed at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dpsgd.comm import Communicator
from dpsgd.comm.base import PerPeerCounts
from dpsgd.comm.codecs import Compressed, pack_bits, unpack_bits


def block_size(n: int, target: int) -> int:
    """The largest divisor of n that is <= target (DeMo's choice of chunk per dimension)."""
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def dct_matrix(n: int, dtype=torch.float64) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (D @ x are the coefficients of x; D.T inverts it)."""
    j = torch.arange(n, dtype=torch.float64)
    d = torch.cos(math.pi * (2 * j[None, :] + 1) * j[:, None] / (2 * n)) * math.sqrt(2 / n)
    d[0] /= math.sqrt(2)
    return d.to(dtype)


class Blocks:
    """One tensor of `shape` as blocks (..., blocks, block numel), DCT coefficients when `dct`; a tensor of
    more than 2 dimensions is the matrix (shape[0], rest)."""

    def __init__(self, shape: Sequence[int], target: int, dct: bool):
        self.shape = tuple(shape)
        numel = math.prod(self.shape)
        dims = [numel] if len(self.shape) <= 1 else [self.shape[0], numel // max(1, self.shape[0])]
        self.dims = dims
        self.sizes = [block_size(d, target) for d in dims]
        self.count = math.prod(d // c for d, c in zip(dims, self.sizes))  # blocks
        self.numel = math.prod(self.sizes)  # entries per block
        self.bases = [dct_matrix(c) for c in self.sizes] if dct else None

    def _basis(self, i: int, like: torch.Tensor) -> torch.Tensor:
        assert self.bases is not None
        if self.bases[i].dtype != like.dtype or self.bases[i].device != like.device:
            self.bases[i] = self.bases[i].to(like.device, like.dtype)
        return self.bases[i]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[: x.dim() - len(self.shape)]
        if len(self.dims) == 1:
            (c,) = self.sizes
            b = x.reshape(*lead, self.dims[0] // c, c)
            return b @ self._basis(0, b).T if self.bases else b
        (r, k), (c1, c2) = self.dims, self.sizes
        b = x.reshape(*lead, r // c1, c1, k // c2, c2).transpose(-3, -2)  # (..., tiles down, across, c1, c2)
        if self.bases:
            b = self._basis(0, b) @ b @ self._basis(1, b).T
        return b.reshape(*lead, self.count, self.numel)

    def decode(self, b: torch.Tensor) -> torch.Tensor:
        lead = b.shape[:-2]
        if len(self.dims) == 1:
            (c,) = self.sizes
            x = b @ self._basis(0, b) if self.bases else b
            return x.reshape(*lead, *self.shape)
        (r, k), (c1, c2) = self.dims, self.sizes
        t = b.reshape(*lead, r // c1, k // c2, c1, c2)
        if self.bases:
            t = self._basis(0, t).T @ t @ self._basis(1, t)
        return t.transpose(-3, -2).reshape(*lead, *self.shape)


@dataclass
class Part:
    """One tensor's share of a message: `index` (..., blocks, k) positions in the block, `values` as the
    receivers decode them; with quantization the `codes` and `table` (shift, then the 2^b centroids)."""

    index: torch.Tensor
    values: torch.Tensor
    codes: torch.Tensor | None = None
    table: torch.Tensor | None = None


def quantize(v: torch.Tensor, bits: int, sigmas: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SparseLoCo's statistical quantization of the values v (..., m), per leading index: shift = mean(v),
    codes = clamp(round((v - shift) / s + 2^b / 2), 0, 2^b - 1) with s = sigmas * std(v) / 2^b (1 if 0),
    decoded as shift + the mean of the centred values sharing the code. Returns (codes, table, decoded)."""
    bins = 1 << bits
    shift = v.mean(-1, keepdim=True)
    centred = v - shift
    m = v.shape[-1]
    std = centred.norm(dim=-1, keepdim=True) / math.sqrt(max(1, m - 1))
    scale = sigmas * std / bins
    scale = torch.where((scale == 0) | ~torch.isfinite(scale), torch.ones_like(scale), scale)
    codes = (centred / scale + bins // 2).round().clamp(0, bins - 1).to(torch.int64)
    sums = torch.zeros(*v.shape[:-1], bins, dtype=v.dtype, device=v.device).scatter_add_(-1, codes, centred)
    counts = torch.zeros_like(sums).scatter_add_(-1, codes, torch.ones_like(centred))
    centroids = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    table = torch.cat([shift, centroids], -1)
    return codes, table, dequantize(codes, table)


def dequantize(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[..., 1:].gather(-1, codes) + table[..., :1]


class ChunkedTopK:
    """The message of a list of tensors (their shapes without peer axes): per block the `topk` entries of
    largest magnitude (of the DCT coefficients with `dct`), values as floats or `bits`-bit codes."""

    def __init__(
        self, shapes: Sequence[Sequence[int]], chunk: int, topk: int, dct: bool, bits: int | None, sigmas: float
    ):
        for name, value in (("chunk", chunk), ("topk", topk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"chunked top-k: {name} must be an integer >= 1, got {value!r}")
        if bits is not None and bits not in (1, 2, 4, 8):
            raise ValueError(f"chunked top-k: bits (per quantized value) must be 1, 2, 4 or 8, or null, got {bits!r}")
        self.blocks = [Blocks(s, chunk, dct) for s in shapes]
        self.ks = [min(topk, b.numel) for b in self.blocks]
        self.bits, self.sigmas = bits, float(sigmas)

    # --- sizes ------------------------------------------------------------------------------------
    @staticmethod
    def index_bits(block_numel: int) -> int:
        return max(1, math.ceil(math.log2(block_numel)))

    def sends_positions(self, i: int) -> bool:
        """False where k keeps every entry of tensor i's blocks: the positions are then 0 .. k-1, known to all."""
        return self.ks[i] < self.blocks[i].numel

    def part_nbytes(self, i: int, itemsize: int = 4) -> int:
        b, k = self.blocks[i], self.ks[i]
        entries = b.count * k
        index = math.ceil(entries * self.index_bits(b.numel) / 8) if self.sends_positions(i) else 0
        if self.bits is None:
            return index + entries * itemsize
        return index + math.ceil(entries * self.bits / 8) + (1 + (1 << self.bits)) * itemsize

    def nbytes(self, itemsize: int = 4) -> int:
        """Bytes of one peer's message (the same for every peer and step)."""
        return sum(self.part_nbytes(i, itemsize) for i in range(len(self.blocks)))

    # --- encode and decode ------------------------------------------------------------------------
    def encode(self, tensors: Sequence[torch.Tensor]) -> list[Part]:
        parts = []
        for blocks, k, x in zip(self.blocks, self.ks, tensors):
            b = blocks.encode(x)
            index = torch.topk(b.abs(), k, dim=-1, sorted=False).indices.sort(-1).values
            values = b.gather(-1, index)
            if self.bits is None:
                parts.append(Part(index, values))
                continue
            flat = values.reshape(*values.shape[:-2], -1)
            codes, table, decoded = quantize(flat, self.bits, self.sigmas)
            parts.append(Part(index, decoded.reshape(values.shape), codes, table))
        return parts

    def dense(self, parts: Sequence[Part]) -> list[torch.Tensor]:
        """The tensors a message stands for (zeros off the kept entries, inverse DCT with `dct`)."""
        out = []
        for blocks, part in zip(self.blocks, parts):
            b = torch.zeros(*part.index.shape[:-1], blocks.numel, dtype=part.values.dtype, device=part.values.device)
            out.append(blocks.decode(b.scatter_(-1, part.index, part.values)))
        return out

    def mean(self, messages: Sequence[list[Part]], senders: bool = False, clip: bool = False) -> list[torch.Tensor]:
        """The peers' messages combined entry by entry, summed in rank order and decoded once (the DCT is linear).

        senders=False: (1/n) sum_j of the n messages (an entry no peer sent counts as 0 for all of them).
        senders=True: each entry's mean over the peers that sent it, 0 where none did (bloc97/DeMo's and templar's
        `scatter_reduce(..., reduce="mean", include_self=False)` over the gathered messages).
        clip=True: first each peer's values of a tensor are scaled by min(1, med / (||v_j|| + 1e-8)), med the
        median over peers of ||v_j|| (the lower middle one for an even count, as torch.median; templar's
        `batch_decompress(clip_norm=True)`)."""
        out = []
        for i, blocks in enumerate(self.blocks):
            first = messages[0][i]
            total = torch.zeros(*first.index.shape[:-1], blocks.numel, dtype=first.values.dtype)
            total = total.to(first.values.device)
            count = torch.zeros_like(total) if senders else None
            values = [msg[i].values for msg in messages]
            if clip:
                norms = torch.stack([v.norm() for v in values])
                med = norms.median()
                values = [v * torch.clamp(med / (norm + 1e-8), max=1) for v, norm in zip(values, norms)]
            for msg, v in zip(messages, values):
                total += torch.zeros_like(total).scatter_(-1, msg[i].index, v)
                if count is not None:
                    count += torch.zeros_like(total).scatter_(-1, msg[i].index, torch.ones_like(v))
            combined = total / len(messages) if count is None else torch.where(count > 0, total / count.clamp(min=1), 0)
            out.append(blocks.decode(combined))
        return out

    # --- the wire ---------------------------------------------------------------------------------
    def pack(self, parts: Sequence[Part]) -> torch.Tensor:
        """One peer's message as bytes (exactly nbytes())."""
        out = []
        for i, (blocks, part) in enumerate(zip(self.blocks, parts)):
            if self.sends_positions(i):
                out.append(pack_bits(part.index.reshape(-1), self.index_bits(blocks.numel)))
            if part.codes is None:
                out.append(part.values.detach().contiguous().reshape(-1).view(torch.uint8))
            else:
                assert part.table is not None
                out.append(pack_bits(part.codes.reshape(-1), self.bits))  # type: ignore[arg-type]
                out.append(part.table.detach().contiguous().reshape(-1).view(torch.uint8))
        return torch.cat(out)

    def unpack(self, buf: torch.Tensor, dtype: torch.dtype) -> list[Part]:
        parts, at = [], 0
        size = dtype.itemsize
        for i, (blocks, k) in enumerate(zip(self.blocks, self.ks)):
            entries = blocks.count * k
            if self.sends_positions(i):
                width = math.ceil(entries * self.index_bits(blocks.numel) / 8)
                index = unpack_bits(buf[at : at + width], entries, self.index_bits(blocks.numel)).view(blocks.count, k)
                at += width
            else:
                index = torch.arange(k, device=buf.device).expand(blocks.count, k).contiguous()
            if self.bits is None:
                values = buf[at : at + entries * size].clone().view(dtype).view(blocks.count, k)
                at += entries * size
                parts.append(Part(index, values))
                continue
            width = math.ceil(entries * self.bits / 8)
            codes = unpack_bits(buf[at : at + width], entries, self.bits)
            at += width
            table = buf[at : at + (1 + (1 << self.bits)) * size].clone().view(dtype)
            at += table.numel() * size
            parts.append(Part(index, dequantize(codes, table).view(blocks.count, k), codes, table))
        if at != buf.numel():
            raise ValueError(f"a chunked top-k message of {buf.numel()} bytes, expected {at}: peers disagree on it")
        return parts


def refuse_compression(comm: Communicator, who: str) -> None:
    if isinstance(comm, Compressed):
        raise ValueError(
            f"{who} encodes its own messages (chunked top-k); run it without compression= (compression=none)"
        )


def all_gather(comm: Communicator, code: ChunkedTopK, message: list[Part]) -> list[list[Part]]:
    """Every peer's message, in rank order, each peer's sent to every other one (the bytes of `code.pack`).
    On a fleet (a leading peer axis) the messages are all here: peer j's is row j, and its bytes are counted
    per peer as a real peer's."""
    n = comm.size
    if comm.peer_shape:
        per_peer = torch.full((n,), float((n - 1) * code.nbytes(message[0].values.element_size())), dtype=torch.float64)
        if isinstance(comm, PerPeerCounts):
            comm.count_per_peer(per_peer, per_peer)
        return [[_row(part, j) for part in message] for j in range(n)]
    if n == 1:
        return [message]
    others = [r for r in range(n) if r != comm.rank]
    received = comm.neighbor_exchange(code.pack(message), others, others)
    dtype = message[0].values.dtype
    by_rank = dict(zip(others, (code.unpack(buf, dtype) for buf in received)))
    return [message if r == comm.rank else by_rank[r] for r in range(n)]


def gathered_mean(
    comm: Communicator, code: ChunkedTopK, message: list[Part], senders: bool = False, clip: bool = False
) -> list[torch.Tensor]:
    """Every peer's message combined (`ChunkedTopK.mean`), shaped like the encoded tensors (peer axes included)."""
    mean = code.mean(all_gather(comm, code, message), senders=senders, clip=clip)
    return [m.expand(*comm.peer_shape, *m.shape).contiguous() if comm.peer_shape else m for m in mean]


def _row(part: Part, j: int) -> Part:
    return Part(
        part.index[j],
        part.values[j],
        None if part.codes is None else part.codes[j],
        None if part.table is None else part.table[j],
    )
