"""Streaming DiLoCo: which fragment syncs at which step, its update against an independent numpy
reference on a small least-squares problem (4 peers, local backend), DiLoCo as its one-fragment case,
its peak traffic (one fragment per step), quantized messages, and its errors."""

from __future__ import annotations

import functools
import io

import numpy as np
import pytest
import torch

from dpsgd.comm import run_local
from dpsgd.comm.codecs import Int8, wrap
from dpsgd.optim import DiLoCo, StreamingDiLoCo

N = 4
SHAPES = [(3,), (2, 2), (5,), (1, 3)]  # four parameter tensors: 15 entries
STEPS = 17


def problem():
    rng = np.random.default_rng(0)
    dim = sum(int(np.prod(s)) for s in SHAPES)
    return rng.normal(size=(N, 6, dim)), rng.normal(size=(N, 6)), rng.normal(size=(N, dim))


def run_peers(make_optimizer, steps=STEPS):
    """Each peer's flat parameters after every step, and its bytes sent after every step."""
    A, b, x0 = problem()

    def peer(comm):
        flat = torch.tensor(x0[comm.rank])
        params, offset = [], 0
        for shape in SHAPES:
            k = int(np.prod(shape))
            params.append(torch.nn.Parameter(flat[offset : offset + k].view(shape).clone()))
            offset += k
        opt = make_optimizer(params, comm)
        a, y = torch.tensor(A[comm.rank]), torch.tensor(b[comm.rank])
        xs, sent = [], []
        for _ in range(steps):
            opt.zero_grad()
            x = torch.cat([p.reshape(-1) for p in params])
            (0.5 / a.shape[0] * ((a @ x - y) ** 2).sum()).backward()
            opt.step()
            xs.append(torch.cat([p.detach().reshape(-1) for p in params]).numpy().copy())
            sent.append(comm.stats.bytes_sent)
        return np.array(xs), np.array(sent)

    return run_local(N, peer)


def reference(period, fragments, delay, alpha, lr=0.1, outer_lr=0.7, beta=0.9, steps=STEPS, adam=None):
    """The module's equations in numpy: trajectory (steps, n, d); adam=(beta1, beta2): torch.optim.Adam as
    the outer optimizer instead of DiLoCo's Nesterov SGD, its state (t, m, v) per fragment."""
    A, b, x = problem()
    bounds = {1: [0, 15], 2: [0, 8, 15], 3: [0, 5, 10, 15], 4: [0, 4, 8, 12, 15]}[fragments]  # of 15 entries
    masks = [(np.arange(15) >= a) & (np.arange(15) < b) for a, b in zip(bounds[:-1], bounds[1:])]
    h = period // fragments
    anchor, u, sent_at, adam_state, out = x.mean(0), np.zeros(x.shape[1]), {}, {}, []
    for t in range(1, steps + 1):
        g = np.einsum("nmd,nm->nd", A, np.einsum("nmd,nd->nm", A, x) - b) / A.shape[1]
        x = x - lr * g
        for p, m in enumerate(masks):
            if t % period == ((p + 1) * h - delay) % period:
                sent_at[p] = (anchor - x).mean(0)  # the mean outer gradient, known `delay` steps later
            if t >= delay + 1 and (t - delay) % period == ((p + 1) * h - delay) % period:
                delta = sent_at.pop(p)
                if adam is None:
                    u[m] = beta * u[m] + delta[m]
                    anchor[m] = anchor[m] - outer_lr * (delta[m] + beta * u[m])
                else:
                    k, mean, var = adam_state.get(p, (0, 0.0, 0.0))
                    k, mean, var = (
                        k + 1,
                        adam[0] * mean + (1 - adam[0]) * delta[m],
                        adam[1] * var + (1 - adam[1]) * delta[m] ** 2,
                    )
                    step = outer_lr / (1 - adam[0] ** k) * mean / (np.sqrt(var) / np.sqrt(1 - adam[1] ** k) + 1e-8)
                    anchor[m], adam_state[p] = anchor[m] - step, (k, mean, var)
                x[:, m] = alpha * x[:, m] + (1 - alpha) * anchor[m]
        out.append(x.copy())
    return np.array(out)


def test_fragments_sync_at_staggered_steps():
    def peer(comm):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in [(5,), (2, 3), (1,)]]
        opt = StreamingDiLoCo(torch.optim.SGD(params, lr=0.1), comm=comm, period=12, fragments=3, delay=1)
        starts = {t: opt.starting(t) for t in range(1, 25) if opt.starting(t) is not None}
        ends = {t: opt.completing(t) for t in range(1, 25) if opt.completing(t) is not None}
        return starts, ends, [(opt.fragment(p).start, opt.fragment(p).stop) for p in range(3)]

    starts, ends, fragments = run_local(1, peer)[0]
    # one fragment every 12 / 3 = 4 steps: fragment p lands at 4 (p + 1) mod 12, starting 1 step earlier
    assert starts == {3: 0, 7: 1, 11: 2, 15: 0, 19: 1, 23: 2}
    assert ends == {4: 0, 8: 1, 12: 2, 16: 0, 20: 1, 24: 2}
    assert fragments == [(0, 4), (4, 8), (8, 12)]  # 12 entries in 3 equal ranges, across tensor boundaries


@pytest.mark.parametrize(
    ("period", "fragments", "delay", "alpha"), [(4, 2, 1, 0.5), (6, 3, 0, 0.0), (6, 2, 2, 0.3), (8, 4, 1, 0.5)]
)
def test_update_matches_the_numpy_reference(period, fragments, delay, alpha):
    def make(params, comm):
        return StreamingDiLoCo(
            torch.optim.SGD(params, lr=0.1),
            comm=comm,
            broadcast_initial=False,
            period=period,
            fragments=fragments,
            delay=delay,
            alpha=alpha,
        )

    got = np.stack([xs for xs, _ in run_peers(make)], axis=1)
    np.testing.assert_allclose(got, reference(period, fragments, delay, alpha), rtol=0, atol=1e-12)


def test_a_users_torch_optimizer_as_outer_matches_the_reference():
    """torch.optim.Adam as the outer optimizer: each fragment of the anchor has its own Adam state and step
    count, as with torchft's one outer optimizer per fragment."""
    outer = functools.partial(torch.optim.Adam, lr=0.05, betas=(0.8, 0.9))

    def make(params, comm):
        return StreamingDiLoCo(
            torch.optim.SGD(params, lr=0.1),
            comm=comm,
            broadcast_initial=False,
            period=6,
            fragments=3,
            alpha=0.3,
            outer=outer,
        )

    got = np.stack([xs for xs, _ in run_peers(make)], axis=1)
    want = reference(6, 3, 1, 0.3, outer_lr=0.05, adam=(0.8, 0.9))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert np.abs(want - reference(6, 3, 1, 0.3, outer_lr=0.05)).max() > 1e-3  # Nesterov SGD would not pass


@pytest.mark.parametrize("outer", [None, functools.partial(torch.optim.Adam, lr=0.05)], ids=["nesterov", "adam"])
def test_state_dict_round_trip_resumes_identically(outer):
    """17 steps in one go == 7 steps (a sync in flight), save, load into a fresh optimizer, 10 more."""
    options = dict(broadcast_initial=False, period=6, fragments=3, delay=1, alpha=0.3)
    if outer is not None:
        options["outer"] = outer
    A, b, x0 = problem()

    def peer(comm):
        def fresh():
            params = [torch.nn.Parameter(torch.tensor(x0[comm.rank]))]
            return params, StreamingDiLoCo(torch.optim.SGD(params, lr=0.1), comm=comm, **options)

        a, y = torch.tensor(A[comm.rank]), torch.tensor(b[comm.rank])

        def steps(params, opt, k):
            out = []
            for _ in range(k):
                opt.zero_grad()
                (0.5 / a.shape[0] * ((a @ params[0] - y) ** 2).sum()).backward()
                opt.step()
                out.append(params[0].detach().clone())
            return out

        straight = steps(*fresh(), 17)
        params, opt = fresh()
        first = steps(params, opt, 7)
        buf = io.BytesIO()
        torch.save({"opt": opt.state_dict(), "params": params[0].detach().clone()}, buf)
        steps(params, opt, 3)  # the old optimizer moves on: the saved state must not move with it
        buf.seek(0)
        saved = torch.load(buf)
        params2, opt2 = fresh()
        with torch.no_grad():
            params2[0].copy_(saved["params"])
        opt2.load_state_dict(saved["opt"])
        return torch.stack(straight), torch.stack(first + steps(params2, opt2, 10))

    for straight, resumed in run_local(N, peer):
        assert torch.equal(straight, resumed)  # the same floats, not merely close


def test_one_fragment_without_delay_is_diloco_and_fragments_cut_the_peak():
    def streaming(fragments):
        return lambda params, comm: StreamingDiLoCo(
            torch.optim.SGD(params, lr=0.1), comm=comm, period=4, fragments=fragments, delay=0, alpha=0.0
        )

    diloco = run_peers(lambda params, comm: DiLoCo(torch.optim.SGD(params, lr=0.1), comm=comm, period=4))
    one = run_peers(streaming(1))
    for (x_d, sent_d), (x_s, sent_s) in zip(diloco, one):
        np.testing.assert_allclose(x_s, x_d, rtol=0, atol=1e-12)  # DiLoCo averages x, we average anchor - x
        np.testing.assert_array_equal(sent_s, sent_d)
    four = run_peers(streaming(4))  # fragments of 4, 4, 4 and 3 entries, one every step
    ring = 2 * (N - 1) / N * 8  # bytes sent per float64 entry all-reduced
    per_step = np.diff(four[0][1])
    assert per_step.max() == 4 * ring and np.diff(one[0][1]).max() == 15 * ring
    assert four[0][1][-1] - four[0][1][0] == one[0][1][-1] - one[0][1][0]  # the same total over 4 periods


def test_int8_messages_are_a_quarter_of_the_bytes_and_close():
    def make(compression):
        return lambda params, comm: StreamingDiLoCo(
            torch.optim.SGD(params, lr=0.1), comm=wrap(comm, compression), period=4, fragments=2, delay=1
        )

    exact, int8 = run_peers(make("none"), steps=16), run_peers(make("int8"), steps=16)
    scale = np.abs(exact[0][0]).max()
    for (xs, _), (xs_exact, _) in zip(int8, exact):
        np.testing.assert_allclose(xs, xs_exact, rtol=0, atol=0.01 * scale)
    # 16 steps, period 4: fragment 0 (8 entries) syncs at 1-2, 5-6, 9-10, 13-14; fragment 1 (7) at 3-4, ..., 15-16
    want = sum(4 * 2 * (N - 1) * Int8().nbytes(-(-size // N), torch.float64) for size in (8, 7))
    assert int8[0][1][-1] == want  # no first anchor to send: the peers start from rank 0's model


def test_options_that_cannot_work_are_refused():
    def peer(comm):
        params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
        with pytest.raises(ValueError, match="delay 2 must be < period / fragments = 2"):
            StreamingDiLoCo(torch.optim.SGD(params, lr=0.1), comm=comm, period=6, fragments=3, delay=2)
        with pytest.raises(ValueError, match="multiple of fragments"):
            StreamingDiLoCo(torch.optim.SGD(params, lr=0.1), comm=comm, period=7, fragments=3, delay=0)
        with pytest.raises(ValueError, match="fragments=8 but the model has 6 parameters"):
            StreamingDiLoCo(torch.optim.SGD(params, lr=0.1), comm=comm, period=8, fragments=8, delay=0)
        with pytest.raises(ValueError, match="needs an outer optimizer"):
            StreamingDiLoCo(torch.optim.SGD(params, lr=0.1), comm=comm, outer=None)
        with pytest.raises(ValueError, match="cannot build its outer optimizer: Invalid learning rate"):
            StreamingDiLoCo(
                torch.optim.SGD(params, lr=0.1), comm=comm, outer=functools.partial(torch.optim.Adam, lr=-1)
            )

    run_local(1, peer)
