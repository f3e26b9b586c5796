"""The app's training options (dpsgd.schedule, dpsgd.stepping): learning-rate schedules against torch's own
schedulers, `lr` in every record, a resume mid-schedule (fp16 scaler, clipping, micro-batches included) that
ends with the uninterrupted numbers, an fp16 overflow on one peer skipped by all, and the same numbers for
`precision=bf16 clip_grad_norm=1.0 accumulate=2` on the local backend, the fleet and mpi."""

from __future__ import annotations

import copy
import json
import math
import shutil

import numpy as np
import pytest
import runs
import torch

from dpsgd import training
from dpsgd.build import build_peer
from dpsgd.comm import run_local
from dpsgd.config import parse
from dpsgd.schedule import Schedule
from dpsgd.sim import Fleet
from dpsgd.stepping import StepOptions, Stepper

torch.set_num_threads(1)
OPTIONS = {"precision": "bf16", "clip_grad_norm": 1.0, "accumulate": 2}


def rates(scheduler_cls, steps: int, **kw) -> list[float]:
    """torch's scheduler's rate at each of `steps` steps (an optimizer at lr 1)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched, out = scheduler_cls(opt, **kw), []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_schedules_equal_torchs_schedulers():
    total = 40
    cosine = Schedule("cosine", total, warmup_steps=0)
    expected = rates(torch.optim.lr_scheduler.CosineAnnealingLR, total, T_max=total)
    np.testing.assert_allclose([cosine.factor(k) for k in range(1, total + 1)], expected, rtol=1e-12, atol=1e-15)
    step = Schedule("step", total, milestones=[0.5, 0.75], gamma=0.1)
    expected = rates(torch.optim.lr_scheduler.MultiStepLR, total, milestones=[20, 30], gamma=0.1)
    np.testing.assert_allclose([step.factor(k) for k in range(1, total + 1)], expected, rtol=1e-12)
    # linear warm-up (k / w for steps 1..w), then the cosine over the remaining steps from its top
    warm = Schedule("cosine", total, warmup_steps=10, final=0.1)
    assert [warm.factor(k) for k in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])
    assert warm.factor(11) == pytest.approx(1.0)
    assert warm.factor(total) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 29 / 30)))
    assert warm.factor(25) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 14 / 30)))
    assert Schedule("constant", total).factor(7) == 1.0


@pytest.mark.parametrize(
    "cfg, words",
    [
        ({"name": "linear"}, "valid schedules: constant, step, cosine"),
        ({"name": "step", "milestones": [30]}, "fractions of the run"),
        ({"name": "cosine", "warmup_steps": -1}, "warmup_steps"),
        ({"name": "constant", "gamma": 0.5}, "schedule=constant takes no option 'gamma'; its options: warmup_steps"),
    ],
)
def test_bad_schedules_say_what_is_expected(cfg, words):
    with pytest.raises(ValueError, match=words):
        Schedule.of(cfg.pop("name"), cfg, 10)


@pytest.mark.parametrize(
    "options, words",
    [
        ({"precision": "fp8"}, "valid precisions: fp32, bf16, fp16"),
        ({"clip_grad_norm": 0}, "clip_grad_norm must be a number > 0"),
        ({"accumulate": 3, "batch_size": 16}, "batch_size divisible by 3"),
        ({"accumulate": 0}, "accumulate must be a whole number >= 1"),
    ],
)
def test_bad_step_options_say_what_is_expected(options, words):
    batch_size = options.pop("batch_size", 32)
    with pytest.raises(ValueError, match=words):
        StepOptions(**options).check_batch(batch_size)


def config(algorithm: str = "dpsgd", **top) -> dict:
    cfg = runs.experiment(runs.algorithm(algorithm))
    cfg.update({"schedule": runs.load("schedule", "constant"), **top})
    return cfg


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_mid_schedule_gives_the_uninterrupted_numbers(tmp_path):
    """Cosine with warm-up, fp16 (its scaler's state), clipping and micro-batches: a run restarted from its
    checkpoint at step 20 of 44 writes the records of the run that was never stopped."""
    cfg = config(
        schedule={"name": "cosine", "warmup_steps": 10, "final": 0.0},
        epochs=2,
        log_every=4,
        precision="fp16",
        clip_grad_norm=1.0,
        accumulate=2,
        checkpoint={"every": 20},
    )
    full = tmp_path / "full"
    full.mkdir()
    run_local(4, lambda comm: training.train(comm, parse(cfg), full), timeout_s=120)
    lrs = [r["lr"] for r in records(full)]
    total = records(full)[-1]["step"]
    schedule = Schedule("cosine", total, warmup_steps=10, final=0.0)
    expected = [cfg["optimizer"]["lr"] * schedule.factor(r["step"]) for r in records(full)]
    assert lrs == pytest.approx(expected) and lrs[0] < lrs[2] and lrs[-1] < 0.01 * max(lrs)  # warm-up, then decay
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoints" / "step_00000020", resumed / "checkpoints" / "step_00000020")
    kept = [line for line in (full / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 20]
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    run_local(4, lambda comm: training.train(comm, parse({**cfg, "resume": True}), resumed), timeout_s=120)
    runs.assert_same_numbers(full, resumed)


def test_fp16_overflow_on_one_peer_is_skipped_by_every_peer():
    """Peer 2's loss overflows at step 3: every peer skips that step (no exchange waits, no inf travels),
    every scaler backs off alike, and training goes on with finite parameters."""
    cfg = config(precision="fp16")

    def peer(comm):
        p = build_peer(comm, parse(cfg))
        losses, seen = p.step.losses, []
        p.step.losses = lambda x, y: losses(x, y) * (float("inf") if comm.rank == 2 and len(seen) == 3 else 1.0)
        for step in range(1, 7):
            before = [t.detach().clone() for t in p.model.parameters()]
            seen.append(step)
            p.step(step)
            if step == 3:
                skipped = all(torch.equal(a, b) for a, b in zip(before, p.model.parameters()))
        flat = torch.cat([t.detach().reshape(-1) for t in p.model.parameters()])
        return skipped, p.stepper.skipped, p.stepper.scaler.get_scale(), flat

    out = run_local(4, peer, timeout_s=60)
    assert [o[0] for o in out] == [True] * 4  # nobody stepped at step 3
    assert {o[1] for o in out} == {1} and len({o[2] for o in out}) == 1
    flats = torch.stack([o[3] for o in out])
    assert torch.isfinite(flats).all() and (flats - flats.mean(0)).abs().max() > 0  # gossip went on


def local_parameters(cfg: dict, steps: int) -> torch.Tensor:
    def peer(comm):
        p = build_peer(comm, parse(cfg))
        for step in range(1, steps + 1):
            p.step(step)
        return torch.cat([t.detach().reshape(-1) for t in p.model.parameters()])

    return torch.stack(run_local(cfg["peers"], peer, timeout_s=60))


@pytest.mark.parametrize("algorithm", ["dpsgd", "allreduce"])
def test_options_on_the_fleet_equal_the_local_backend(algorithm):
    """bf16 keeps 8 bits: the fleet's batched products round differently from each peer's own, so the two agree
    to bf16's resolution, not bit for bit (in fp32 the same options agree to 1e-7). Measured after 20 steps
    (parameters up to 0.32): at most 1.5e-3 apart, while the options move the parameters by 0.33."""
    cfg = config(
        algorithm, schedule={"name": "cosine", "warmup_steps": 10, "final": 0.0}, **{**OPTIONS, "clip_grad_norm": 0.1}
    )
    fleet = Fleet(parse({**cfg, "backend": {"name": "fleet"}}))
    for step in range(1, 21):
        fleet.step(step)
    expected = local_parameters(cfg, 20)
    torch.testing.assert_close(fleet.flat(), expected, rtol=0, atol=5e-3)
    plain = local_parameters(config(algorithm, schedule=cfg["schedule"]), 20)
    assert (plain - expected).abs().max() > 5e-2  # the options changed the run: the equality is not a trivial one


def test_accumulated_micro_batches_give_the_whole_batchs_step():
    """accumulate=2 in fp32: the two micro-batches' gradients add up to the whole minibatch's."""
    one, two = local_parameters(config(), 10), local_parameters(config(accumulate=2), 10)
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # soak: make test keeps the options' numbers in process
@pytest.mark.processes
def test_options_run_in_the_app_with_the_same_numbers_on_local_mpi_and_the_fleet(app, tmp_path):
    args = ["peers=2", "epochs=1", "log_every=5", "schedule=cosine", "schedule.warmup_steps=10"]
    args += [f"{k}={v}" for k, v in OPTIONS.items()]
    done = {}
    for backend in ("local", "mpi", "fleet"):
        proc = app([f"backend={backend}", *args], tmp_path / backend)
        assert proc.returncode == 0, proc.stderr
        done[backend] = runs.summary(tmp_path / backend)
        assert all(r["lr"] is not None for r in records(tmp_path / backend))
    # mpi runs each peer's code as the local backend does: the same numbers; the fleet to bf16's resolution (its
    # batched products round differently: the parameters' agreement is the in-process test above)
    for key in ("train_loss", "test_loss", "test_accuracy", "consensus_distance", "mb_sent_per_peer", "lr"):
        assert done["mpi"][key] == pytest.approx(done["local"][key], rel=1e-6, abs=1e-9), key
    for key in ("train_loss", "test_loss", "test_accuracy", "mb_sent_per_peer", "lr"):
        tol = 1e-6 if key in ("mb_sent_per_peer", "lr") else 2e-2
        assert done["fleet"][key] == pytest.approx(done["local"][key], rel=tol, abs=1e-6), key


def test_the_event_simulator_refuses_options_it_does_not_take_and_records_its_rate(hydra_config, tmp_path):
    from dpsgd.sim.run import train_fleet

    train_fleet(parse(hydra_config("backend=fleet", "algorithm=adpsgd", "epochs=1", "log_every=5")), tmp_path)
    assert {r["lr"] for r in records(tmp_path)} == {0.1}  # the configured rate, constant
    from experiments.validate import ConfigError, validate

    validate(hydra_config("backend=fleet", "algorithm=adpsgd"))
    with pytest.raises(ConfigError, match="schedule, precision: the event simulator"):
        validate(hydra_config("backend=fleet", "algorithm=adpsgd", "precision=bf16", "schedule=cosine"))


def test_fp16_clipping_acts_on_unscaled_gradients_as_torchs_amp_recipe():
    """precision=fp16 with clip_grad_norm on a plain torch model, against torch's documented AMP recipe
    (scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_; scaler.step(opt); scaler.update()):
    the same parameters after each step. Clipping the scaled gradients (before unscale_) would shrink every
    clipped update by the scale, 65,536."""
    clip, steps = 0.05, 4
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = copy.deepcopy(ref)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 6, generator=generator), torch.randn(16, 3, generator=generator)) for _ in range(steps)]

    def loss_of(net, x, y):
        with torch.autocast("cpu", dtype=torch.float16):
            out = net(x)
        assert out.dtype == torch.float16  # fp16 autocast runs on CPU: the scaler has something to do
        return torch.nn.functional.mse_loss(out.float(), y)

    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    options = StepOptions(precision="fp16", clip_grad_norm=clip)
    stepper = Stepper(options, torch.optim.SGD(model.parameters(), lr=0.1), Schedule("constant", steps), "cpu")
    assert stepper.scaler is not None and stepper.scaler.get_scale() == scaler.get_scale() == 65536.0
    for step, (x, y) in enumerate(batches, 1):
        before = [p.detach().clone() for p in ref.parameters()]
        ref_opt.zero_grad()
        scaler.scale(loss_of(ref, x, y)).backward()
        scaler.unscale_(ref_opt)
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        scaler.step(ref_opt)
        scaler.update()
        assert norm > 4 * clip  # the clipping acts at every step
        moved = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(ref.parameters(), before)]).norm()
        assert moved == pytest.approx(0.1 * clip, rel=1e-3)  # lr times the clipped norm: a real step

        stepper.begin(step)
        stepper.optimizer.zero_grad()
        with options.autocast("cpu"):
            out = model(x)
        stepper.backward(torch.nn.functional.mse_loss(out.float(), y))
        stepper.step()
        for name, (a, b) in enumerate(zip(model.parameters(), ref.parameters())):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, s=step, n=name: f"step {s}, tensor {n}: {m}")
    assert stepper.skipped == 0 and stepper.scaler.get_scale() == scaler.get_scale()


def test_the_overflow_check_sees_any_non_finite_entry():
    """fp16's overflow check (one fused pass per device and dtype): an inf or a nan in any tensor of any dtype."""
    from dpsgd.stepping import all_finite

    tensors = [torch.randn(7), torch.randn(3, 3).half(), torch.randn(4, dtype=torch.bfloat16)]
    assert all_finite(tensors) and all_finite([])
    for t in tensors:
        for bad in (float("inf"), float("-inf"), float("nan")):
            kept = t.reshape(-1)[-1].item()
            t.reshape(-1)[-1] = bad
            assert not all_finite(tensors), (t.dtype, bad)
            t.reshape(-1)[-1] = kept
    assert all_finite(tensors)
