"""NoLoCo, DeMo, SparseLoCo and DES-LOC step by step against independent numpy references written from the
papers' equations (the DCT from scipy, top-k by argsort), on a least-squares problem over 4 peers: on the
local backend, on the fleet's stacked tensors and on real mpi processes; the bytes each peer sends, counted as
encoded, against sizes worked out by hand; and the published values the chunked code relies on (the
orthonormal DCT-II of [1, 2, 3, 4], exact recovery of a block-sparse signal, SparseLoCo's index packing)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import scipy.fft
import torch
from peers import frontier_peer as fp

from dpsgd.backends import spawn
from dpsgd.comm import run_local
from dpsgd.optim.chunked import ChunkedTopK, dct_matrix

N = 4
SCRIPT = str(Path(__file__).parent / "peers" / "frontier_peer.py")
torch.set_num_threads(1)


# --- numpy references ------------------------------------------------------------------------------
def grads(A, b, x):
    return np.einsum("nrd,nr->nd", A, np.einsum("nrd,nd->nr", A, x) - b) / fp.ROWS


def divisor(n, target):
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def tensors(x):
    """One peer's flat x as the model's tensors."""
    out, at = [], 0
    for shape in fp.SHAPES:
        size = int(np.prod(shape))
        out.append(x[at : at + size].reshape(shape))
        at += size
    return out


def blocks(t, chunk, dct):
    """(blocks, entries) of tensor t: chunks of a vector, tiles of a matrix, each DCT-II'd (scipy) with dct."""
    if t.ndim == 1:
        c = divisor(t.size, chunk)
        b = t.reshape(-1, c)
        return scipy.fft.dct(b, norm="ortho", axis=1) if dct else b
    (r, k), c1, c2 = t.shape, divisor(t.shape[0], chunk), divisor(t.shape[1], chunk)
    tiles = t.reshape(r // c1, c1, k // c2, c2).transpose(0, 2, 1, 3)
    if dct:
        tiles = scipy.fft.dctn(tiles, norm="ortho", axes=(2, 3))
    return tiles.reshape(-1, c1 * c2)


def unblock(b, shape, chunk, dct):
    if len(shape) == 1:
        return (scipy.fft.idct(b, norm="ortho", axis=1) if dct else b).reshape(shape)
    (r, k), c1, c2 = shape, divisor(shape[0], chunk), divisor(shape[1], chunk)
    tiles = b.reshape(r // c1, k // c2, c1, c2)
    if dct:
        tiles = scipy.fft.idctn(tiles, norm="ortho", axes=(2, 3))
    return tiles.transpose(0, 2, 1, 3).reshape(shape)


def quantize(v, bits, sigmas):
    """SparseLoCo's statistical quantization, from its description: codes around the mean, centroids."""
    bins = 2**bits
    shift = v.mean()
    c = v - shift
    scale = sigmas * np.sqrt((c**2).sum() / (v.size - 1)) / bins
    scale = scale if scale != 0 else 1.0
    codes = np.clip(np.round(c / scale + bins // 2), 0, bins - 1)
    centroids = {k: c[codes == k].mean() for k in np.unique(codes)}
    return np.array([centroids[k] for k in codes]) + shift


def sparse(x, chunk, topk, dct, bits=None, sigmas=6.0):
    """What one peer sends of its flat x: per block the topk largest (quantized to bits), as a flat x."""
    out = []
    for t in tensors(x):
        b = blocks(t, chunk, dct)
        k = min(topk, b.shape[1])
        keep = np.zeros_like(b)
        rows = np.arange(b.shape[0])[:, None]
        idx = np.argsort(-np.abs(b), axis=1)[:, :k]
        values = b[rows, idx]
        if bits is not None:
            values = quantize(values.reshape(-1), bits, sigmas).reshape(values.shape)
        keep[rows, idx] = values
        out.append(unblock(keep, t.shape, chunk, dct).reshape(-1))
    return np.concatenate(out)


def senders_mean(xs, chunk, topk):
    """DeMo's combination of the peers' flat momenta xs (N, DIM) (bloc97/DeMo): each peer's topk DCT coefficients
    per block, each coefficient's mean over the peers that sent it (0 where none did), inverse DCT."""
    out = []
    for parts in zip(*(tensors(x) for x in xs)):
        coeffs = [blocks(t, chunk, dct=True) for t in parts]
        total, count = np.zeros_like(coeffs[0]), np.zeros_like(coeffs[0])
        rows = np.arange(coeffs[0].shape[0])[:, None]
        for b in coeffs:
            idx = np.argsort(-np.abs(b), axis=1)[:, : min(topk, b.shape[1])]
            total[rows, idx] += b[rows, idx]
            count[rows, idx] += 1
        mean = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
        out.append(unblock(mean, parts[0].shape, chunk, dct=True).reshape(-1))
    return np.concatenate(out)


def ref_noloco(A, b, x0, period, outer, gamma=None):
    alpha, beta = outer.keywords["lr"], outer.keywords["momentum"]
    gamma = alpha if gamma is None else gamma
    x = np.tile(x0, (N, 1))
    phi, delta, out = x.copy(), np.zeros_like(x), []
    for t in range(1, fp.STEPS + 1):
        x = x - fp.LR * grads(A, b, x)
        if t % period == 0:
            order = np.random.default_rng(t + 1).permutation(N)
            d = x - phi
            mean_d, mean_phi = np.zeros_like(d), np.zeros_like(d)
            for g in range(N // 2):
                pair = order[g :: N // 2]
                mean_d[pair], mean_phi[pair] = d[pair].mean(0), phi[pair].mean(0)
            delta = beta * delta + alpha * mean_d + gamma * (mean_phi - phi)
            phi = phi + delta
            x = phi.copy()
        out.append(x.copy())
    return np.array(out)


def ref_demo(A, b, x0, decay, topk, chunk, lrs=None, lr_in_momentum=True, aggregate="senders", weight_decay=0.0):
    """lrs: the base's lr at each step (default fp.LR throughout); DeMo's gamma is the step's lr
    (lr_in_momentum=False: left out of the momentum, a wrong rule, for the tests' contrast). aggregate "senders":
    bloc97/DeMo's per-coefficient mean over the peers that sent it; "mean": the all-peer mean of the q_i."""
    lrs = [fp.LR] * fp.STEPS if lrs is None else lrs
    x = np.tile(x0, (N, 1))
    m, out = np.zeros_like(x), []
    for t in range(fp.STEPS):
        m = decay * m + (lrs[t] if lr_in_momentum else 1.0) * grads(A, b, x)
        q = np.stack([sparse(m[i], chunk, topk, dct=True) for i in range(N)])
        combined = senders_mean(m, chunk, topk) if aggregate == "senders" else q.mean(0)
        m = m - q
        x = x * (1 - lrs[t] * weight_decay) - lrs[t] * np.sign(combined)
        out.append(x.copy())
    return np.array(out)


def ref_sparseloco(A, b, x0, period, decay, topk, chunk, bits, outer, momentum, starts=None):
    """starts: each peer's own start, (N, DIM) (broadcast_initial=False): the anchor starts as their mean."""
    x = np.tile(x0, (N, 1)) if starts is None else starts.copy()
    anchor, e, buf, out = x.mean(0), np.zeros_like(x), None, []
    for t in range(1, fp.STEPS + 1):
        g = grads(A, b, x)
        buf = g if buf is None else momentum * buf + g
        x = x - fp.LR * buf
        if t % period == 0:
            e = decay * e + (anchor - x)
            s = np.stack([sparse(e[i], chunk, topk, dct=False, bits=bits) for i in range(N)])
            e = e - s
            anchor = anchor - outer.keywords["lr"] * s.mean(0)
            x = np.tile(anchor, (N, 1))
        out.append(x.copy())
    return np.array(out)


def ref_desloc(A, b, x0, param_period, momentum_period, variance_period, b1=0.9, b2=0.999, eps=1e-8, guard=True):
    x = np.tile(x0, (N, 1))
    m, v, out = np.zeros_like(x), np.zeros_like(x), []
    for t in range(1, fp.STEPS + 1):
        g = grads(A, b, x)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        x = x - fp.LR * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        for period, state in ((param_period, x), (momentum_period, m), (variance_period, v)):
            if t % period == 0:
                state[:] = state.mean(0)
        if guard:
            m[v == 0] = 0.0  # a peer that never had a gradient for a weight keeps no first moment there
        out.append(x.copy())
    return np.array(out)


def desloc_on_half_seen(steps: int, guard: bool = True) -> np.ndarray:
    """2 peers, x in R^2; peer 1's loss ignores x[1] (its gradient there is always 0): the numpy trajectory."""
    x, m, v, out = np.zeros((2, 2)), np.zeros((2, 2)), np.zeros((2, 2)), []
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 0.01
    for t in range(1, steps + 1):
        g = 2 * (x - 1.0)
        g[1, 1] = 0.0
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        x = x - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        for period, state in ((2, x), (2, m), (4, v)):
            if t % period == 0:
                state[:] = state.mean(0)
        if guard:
            m[v == 0] = 0.0
        out.append(x.copy())
    return np.array(out)


def test_desloc_keeps_no_averaged_first_moment_where_a_peer_never_had_a_gradient():
    """Local Adam with u averaged every 2 steps and v every 4: peer 1 never sees a gradient for x[1], so its
    v there is 0 until step 4; the averaged u alone would step x[1] by lr u / eps (to 6e5 at step 3)."""
    from dpsgd.optim import DESLOC

    def peer(comm):
        x = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        opt = DESLOC(torch.optim.Adam([x], lr=0.01), comm=comm, param_period=2, momentum_period=2, variance_period=4)
        out = []
        for _ in range(8):
            opt.zero_grad()
            ((x[0] - 1) ** 2 + ((x[1] - 1) ** 2 if comm.rank == 0 else 0 * x[1])).backward()
            opt.step()
            out.append(x.detach().numpy().copy())
        return out

    got = np.stack([np.array(t) for t in run_local(2, peer, timeout_s=60)], axis=1)
    np.testing.assert_allclose(got, desloc_on_half_seen(8), rtol=0, atol=1e-12)
    assert np.abs(got).max() < 0.1
    assert np.abs(desloc_on_half_seen(8, guard=False)).max() > 1e3  # the paper's rule as written, here


def expected(case):
    name, kind, options = fp.CASES[case]
    A, b, x0 = fp.problem(N)
    if name == "noloco":
        return ref_noloco(A, b, x0, options["period"], options["outer"], options.get("gamma"))
    if name == "demo":  # the base's weight decay, which DeMo applies decoupled
        return ref_demo(A, b, x0, **options, weight_decay=fp.WEIGHT_DECAY if kind == "sgd_decay" else 0.0)
    if name == "sparseloco":
        return ref_sparseloco(A, b, x0, **options, momentum=0.9 if kind == "sgd_momentum" else 0.0)
    return ref_desloc(A, b, x0, **options)


# bytes one peer sends in the 12 steps, worked out by hand (float64 values; see each line)
BYTES = {
    # a pairwise exchange of [x_i - phi_i, phi_i] (2 x 60 entries x 8 bytes) at steps 3, 6, 9, 12 / every 2nd
    "noloco": 4 * 960,
    "noloco-gamma": 6 * 960,
    # the 8 x 6 matrix: 4 tiles of 4 x 3, 3 kept each: 12 indices of 4 bits (6 bytes) + 12 values (96);
    # the 12-vector: 3 chunks of 4, 3 kept each: 9 indices of 2 bits (3 bytes) + 9 values (72); to 3 peers
    "demo": 12 * 3 * (6 + 96 + 3 + 72),
    "demo-mean": 12 * 3 * (6 + 96 + 3 + 72),
    # as DeMo's, but 2-bit codes (3 and 3 bytes) and a table of shift + 4 centroids (40 bytes) per tensor
    "sparseloco": 4 * 3 * (6 + 3 + 40 + 3 + 3 + 40),
    # 2 kept per block: 8 indices (4 bytes) + 64, 6 indices (2 bytes) + 48; 6 outer steps
    "sparseloco-fp": 6 * 3 * (4 + 64 + 2 + 48),
    # exact ring all-reduces of 480 bytes, 2 (n - 1) / n x 480 = 720 each: x 6 times, u 4 times, v twice
    "desloc": (6 + 4 + 2) * 720,
}


def check(case, got: np.ndarray, sent):
    np.testing.assert_allclose(got, expected(case), rtol=0, atol=1e-9, err_msg=case)
    assert list(np.asarray(sent, dtype=float)) == [BYTES[case]] * N, case


def test_local_backend_matches_numpy():
    per_rank = run_local(N, fp.all_trajectories, timeout_s=60)
    for case in fp.CASES:
        got = np.stack([np.array(per_rank[r][case][0]) for r in range(N)], axis=1)
        check(case, got, [per_rank[r][case][1] for r in range(N)])


@pytest.mark.parametrize("case", list(fp.CASES))
def test_fleet_matches_numpy(case):
    got, sent = fp.fleet_trajectory(N, case)
    check(case, got, sent)


@pytest.mark.slow  # make soak: test_frontier_workloads runs the four on 4 mpi processes in make test
def test_mpi_processes_match_numpy(tmp_path):
    code = spawn("mpi", N, [SCRIPT, "mpi", str(tmp_path)], timeout_s=120)
    assert code == 0, f"mpi peers exited with {code}"
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)]
    for case in fp.CASES:
        got = np.stack([np.array(per_rank[r][case][0]) for r in range(N)], axis=1)
        check(case, got, [per_rank[r][case][1] for r in range(N)])


def test_peers_really_differ_where_the_rule_keeps_them_apart():
    """NoLoCo's pairs leave the peers apart (its equality with numpy is not that of identical peers)."""
    got = expected("noloco")
    assert np.abs(got[-1] - got[-1].mean(0)).max() > 1e-3


# --- published values --------------------------------------------------------------------------------
def test_dct_of_1_2_3_4_is_the_orthonormal_dct_ii():
    """DCT-II, norm="ortho", of [1, 2, 3, 4]: [5, -2.2304425, 0, -0.1585127] (scipy.fft.dct's documented
    transform), and the matrix's transpose is its inverse (the round trip)."""
    d = dct_matrix(4)
    coefficients = d @ torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    torch.testing.assert_close(coefficients, torch.tensor([5.0, -2.2304425, 0.0, -0.1585127], dtype=torch.float64))
    torch.testing.assert_close(d.T @ d, torch.eye(4, dtype=torch.float64))
    for n in (3, 8, 64):
        x = np.random.default_rng(n).normal(size=n)
        np.testing.assert_allclose((dct_matrix(n) @ torch.tensor(x)).numpy(), scipy.fft.dct(x, norm="ortho"))


def test_block_sparse_signal_is_recovered_exactly():
    """A tensor with at most topk nonzero DCT coefficients per block passes the chunked top-k unchanged."""
    code = ChunkedTopK([(16, 12)], chunk=4, topk=2, dct=True, bits=None, sigmas=0)
    coefficients = torch.zeros(12, 16, dtype=torch.float64)  # 4 x 3 tiles of 4 x 4
    rng = np.random.default_rng(0)
    for block in range(12):
        coefficients[block, rng.choice(16, 2, replace=False)] = torch.tensor(rng.normal(size=2))
    signal = code.blocks[0].decode(coefficients)
    (back,) = code.dense(code.encode([signal]))
    torch.testing.assert_close(back, signal)


def test_sparseloco_index_packing_at_the_papers_setting():
    """A 4096 x 4096 matrix in 64 x 64 tiles with 64 kept per tile (1.56% density), 2-bit values: each kept
    entry costs 12 index bits and 2 value bits (96 + 16 bytes per tile), plus one table of 5 float32 per
    tensor: 4096 tiles x 112 bytes + 20 = 458,772 bytes, 146x fewer than the 67,108,864 of float32."""
    code = ChunkedTopK([(4096, 4096)], chunk=64, topk=64, dct=False, bits=2, sigmas=6.0)
    assert code.index_bits(64 * 64) == 12
    assert code.nbytes(4) == 4096 * 112 + 20 == 458_772
    assert 4096 * 4096 * 4 // code.nbytes(4) == 146


@pytest.mark.parametrize("bits", [None, 2])
def test_a_block_kept_whole_sends_no_positions(bits):
    """topk >= a block's size keeps every entry, at positions 0 .. k-1 every peer knows: the message is the values
    alone (MuLoCo's dense 2-bit code: 2 bits an entry and a table of 5 float32 per tensor, 16x under float32; with
    positions it was 14 bits an entry, more than half of float32's 32)."""
    code = ChunkedTopK([(64, 64), (48,)], chunk=64, topk=4096, dct=False, bits=bits, sigmas=6.0)
    assert not any(code.sends_positions(i) for i in range(2))
    per_entry = 32 if bits is None else bits
    assert code.nbytes(4) == (4096 + 48) * per_entry // 8 + (0 if bits is None else 2 * 5 * 4)
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(64, 64, generator=gen), torch.randn(48, generator=gen)]
    message = code.encode(tensors)
    buf = code.pack(message)
    assert buf.numel() == code.nbytes(4)
    for sent, got in zip(message, code.unpack(buf, torch.float32)):
        assert torch.equal(sent.index, got.index) and torch.equal(sent.values, got.values)
    if bits is None:  # the values in place: the dense tensors themselves
        for x, back in zip(tensors, code.dense(code.unpack(buf, torch.float32))):
            assert torch.equal(x, back)


@pytest.mark.parametrize("bits", [None, 2])
def test_packed_message_is_nbytes_and_unpacks_to_itself(bits):
    code = ChunkedTopK([(8, 6), (12,), ()], chunk=4, topk=3, dct=bits is None, bits=bits, sigmas=6.0)
    gen = torch.Generator().manual_seed(0)
    message = code.encode(
        [torch.randn(8, 6, generator=gen), torch.randn(12, generator=gen), torch.randn((), generator=gen)]
    )
    buf = code.pack(message)
    assert buf.numel() == code.nbytes(4)
    for sent, got in zip(message, code.unpack(buf, torch.float32)):
        assert torch.equal(sent.index, got.index) and torch.equal(sent.values, got.values)


@pytest.mark.parametrize("case", list(fp.CASES))
def test_state_dict_resumes_bit_for_bit(case):
    """Stopped after 5 steps and rebuilt from state_dict(), each rule continues exactly as the run that went on."""
    import copy

    from dpsgd.optim import build
    from dpsgd.sim.fleet import FleetCommunicator

    name, kind, options = fp.CASES[case]
    A, b, x0 = (torch.tensor(v) for v in fp.problem(N))

    def step(params, opt):
        opt.zero_grad()
        x = torch.cat([p.reshape(N, -1) for p in params], 1)
        (0.5 / fp.ROWS * (torch.einsum("nrd,nd->nr", A, x) - b).pow(2).sum()).backward()
        opt.step()

    def fresh(values):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        opt = build(name, fp.base(kind, params), comm=FleetCommunicator(N), broadcast_initial=False, **options)
        return params, opt

    params, opt = fresh([p.detach() for p in fp._params(x0.numpy(), (N,))])
    for _ in range(5):
        step(params, opt)
    saved, values = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    for _ in range(7):
        step(params, opt)
    resumed, opt2 = fresh(values)
    opt2.load_state_dict(saved)
    for _ in range(7):
        step(resumed, opt2)
    for p, q in zip(params, resumed):
        assert torch.equal(p, q), case


# --- peers starting apart, a changing lr, DES-LOC's SGD momentum and compression ---------------------------
STARTS = fp.problem(N)[2] + np.random.default_rng(7).normal(size=(N, fp.DIM))  # peer i's own start (row i)
# a learning rate that changes at every step (a constant one hides a missing lr factor in DeMo's momentum: the
# sign of the mean is the same for every scale of the momenta)
LRS = fp.LR * np.array([0.1, 1.0, 0.3, 2.0, 0.5, 1.5, 0.2, 1.2, 0.7, 0.4, 1.8, 0.9])


def peer_trajectories(make, starts=None, lrs=None, seen=None) -> np.ndarray:
    """(steps, N, DIM): fp.STEPS steps of `make(params, comm)` on each peer's least-squares share, peer i from
    starts[i] (default: the common x0), the base's lr set to lrs[t] before step t; `seen(opt, comm, t)` after
    each step."""

    def peer(comm):
        A, b, x0 = fp.problem(comm.size)
        A_i, b_i = torch.tensor(A[comm.rank]), torch.tensor(b[comm.rank])
        params = fp._params(x0 if starts is None else starts[comm.rank], ())
        opt = make(params, comm)
        out = []
        for t in range(fp.STEPS):
            if lrs is not None:
                for group in opt.param_groups:
                    group["lr"] = float(lrs[t])
            opt.zero_grad()
            x = torch.cat([p.reshape(-1) for p in params])
            (0.5 / fp.ROWS * (A_i @ x - b_i).pow(2).sum()).backward()
            opt.step()
            if seen is not None:
                seen(opt, comm, t + 1)
            out.append(torch.cat([p.detach().reshape(-1) for p in params]).numpy().copy())
        return out

    return np.stack([np.array(t) for t in run_local(N, peer, timeout_s=60)], axis=1)


def test_sparseloco_peers_starting_apart_take_the_mean_of_their_starts_as_anchor():
    """broadcast_initial=False: each peer keeps its own start and the anchor starts as the peers' mean (the
    DiLoCo family's 'common model'), so the first outer step lands every peer on mean(x_0) - mean_j s_j."""
    from dpsgd.optim import SparseLoCo

    _, kind, options = fp.CASES["sparseloco"]
    got = peer_trajectories(
        lambda params, comm: SparseLoCo(fp.base(kind, params), comm=comm, broadcast_initial=False, **options), STARTS
    )
    A, b, x0 = fp.problem(N)
    want = ref_sparseloco(A, b, x0, **options, momentum=0.9, starts=STARTS)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9, err_msg="SparseLoCo from starts apart")
    assert np.abs(got[options["period"] - 2] - got[options["period"] - 2].mean(0)).max() > 0.5  # apart until then
    assert np.abs(got[-1] - got[-1][0]).max() == 0  # one model after each outer step


def test_demo_under_a_changing_learning_rate_matches_numpy():
    """DeMo's m_i <- beta m_i + gamma_t g_i and x_i <- x_i - gamma_t sign(Q) with gamma_t the lr of step t."""
    from dpsgd.optim import DeMo

    _, _, options = fp.CASES["demo"]
    got = peer_trajectories(lambda params, comm: DeMo(torch.optim.SGD(params, lr=fp.LR), comm=comm, **options), lrs=LRS)
    A, b, x0 = fp.problem(N)
    np.testing.assert_allclose(got, ref_demo(A, b, x0, **options, lrs=LRS), rtol=0, atol=1e-9, err_msg="DeMo")
    # not vacuous: left out of the momentum, a constant lr changes nothing (the sign does not see a scale), this
    # schedule does
    same = ref_demo(A, b, x0, **options, lr_in_momentum=False)
    np.testing.assert_allclose(same, ref_demo(A, b, x0, **options), rtol=0, atol=1e-12)
    assert np.abs(ref_demo(A, b, x0, **options, lrs=LRS, lr_in_momentum=False) - got).max() > 1e-3


def ref_desloc_sgd(A, b, x0, param_period, momentum_period, momentum=0.9):
    """Local SGD with momentum (torch's: buf = g at first, then mu buf + g; x -= lr buf), x averaged every
    param_period steps and the momentum buffer, the first moment, every momentum_period."""
    x, buf, out = np.tile(x0, (N, 1)), None, []
    for t in range(1, fp.STEPS + 1):
        g = grads(A, b, x)
        buf = g.copy() if buf is None else momentum * buf + g
        x = x - fp.LR * buf
        if t % param_period == 0:
            x[:] = x.mean(0)
        if t % momentum_period == 0:
            buf[:] = buf.mean(0)
        out.append(x.copy())
    return np.array(out)


def test_desloc_averages_sgds_momentum_buffer_as_its_first_moment():
    from dpsgd.optim import DESLOC

    periods = {"param_period": 4, "momentum_period": 3, "variance_period": 5}
    got = peer_trajectories(lambda params, comm: DESLOC(fp.base("sgd_momentum", params), comm=comm, **periods))
    A, b, x0 = fp.problem(N)
    want = ref_desloc_sgd(A, b, x0, 4, 3)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9, err_msg="DES-LOC over SGD with momentum")
    assert np.abs(want - ref_desloc_sgd(A, b, x0, 4, 10**6)).max() > 1e-3  # the buffer's averaging matters here


def test_desloc_averages_the_moments_exactly_under_compression():
    """compression=top_k: the parameters travel encoded, Adam's moments in an exact all-reduce. After each step
    at which a moment is due, every peer holds the numpy mean of the moments the peers' base steps left."""
    from dpsgd.comm import codecs
    from dpsgd.optim import DESLOC

    periods = {"param_period": 2, "momentum_period": 3, "variance_period": 4}
    before, after = {}, {}

    def make(params, comm):
        base = fp.base("adam", params)

        def keep(opt, args, kwargs):  # the moments as the base step left them, before DES-LOC's averaging
            t = int(opt.state[params[0]]["step"])
            before[comm.rank, t] = [(s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in map(opt.state.get, params)]

        base.register_step_post_hook(keep)
        return DESLOC(base, comm=codecs.wrap(comm, {"name": "top_k", "ratio": 0.25}), **periods)

    def seen(opt, comm, t):
        after[comm.rank, t] = [
            (s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in map(opt.state.get, opt.params())
        ]

    got = peer_trajectories(make, seen=seen)
    for t in range(1, fp.STEPS + 1):
        for which, period in ((0, periods["momentum_period"]), (1, periods["variance_period"])):
            for k in range(len(fp.SHAPES)):
                held = np.stack([before[r, t][k][which].numpy() for r in range(N)])
                for r in range(N):
                    want = held.mean(0) if t % period == 0 else held[r]
                    name = ("exp_avg", "exp_avg_sq")[which]
                    np.testing.assert_allclose(
                        after[r, t][k][which].numpy(), want, rtol=1e-12, atol=1e-15,
                        err_msg=f"step {t}, rank {r}, tensor {k}: {name}",
                    )  # fmt: skip
    # not vacuous: the parameters' average at step 2 was encoded (top-k keeps a quarter of the entries)
    assert (got[1] == 0).mean() >= 0.5 and (got[0] == 0).mean() == 0


def test_demo_combinations_differ_on_these_peers():
    """Not vacuous: on this problem the senders' mean (bloc97/DeMo's) and the all-peer mean step differently, so
    the two demo cases above tell the combinations apart."""
    A, b, x0 = fp.problem(N)
    _, _, options = fp.CASES["demo"]
    senders, mean = ref_demo(A, b, x0, **options), ref_demo(A, b, x0, **options, aggregate="mean")
    assert np.abs(senders - mean).max() > 1e-3
