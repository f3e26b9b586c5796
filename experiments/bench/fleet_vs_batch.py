"""The fleet against the same arithmetic done as one model: `python -m experiments.bench fleet_vs_batch [--quick]`

n peers at batch b do the floating-point work of one model at batch n*b; what the fleet adds is n copies of
the weights (batched products, vmapped convolutions, n optimizer states) and the exchange. For the MLP, the
CNN, ResNet-20 and the transformer and n = 16, 64, ... 4096 (as memory and `--step-limit-s` allow), in one
run and alternately (fleet, reference, fleet, reference, ...; the best of each counts):
- fleet: `dpsgd.sim.Fleet`, D-PSGD (one_peer_exponential, momentum SGD), one training step of every peer
  (its batch drawn, forward, backward, the algorithm's step with its gossip);
- reference: one copy of the model at batch n*b (a batch drawn from the same data, forward, backward,
  torch.optim.SGD with the same momentum).
`ratio` is the fleet's samples per second over the reference's. `floor_ratio` is the fleet's over its
memory-traffic floor: the bytes it must move per step (below) over this machine's memory bandwidth,
measured in the same run (a large copy): a case near 1 is memory-bound, one far below it is inefficient.
Bytes a step must move: each peer's weights read in the forward pass and again in the backward pass,
its gradient written, then the update reads weights, gradient, momentum and its in-neighbours' weights and
writes weights and momentum; the activations saved for the backward pass (counted on the one model at
batch b) written once and read once; the batch read once.
On a CPU the clock is this thread's CPU time with one torch thread (other sessions' load does not count
against either side); on a GPU wall time between synchronizations. Each (model, n) also gets one
instrumented pass that splits both steps into batch draw, forward+backward and optimizer step (gossip
apart), from which a miss names its cause. Rows: `rows` of outputs/bench/fleet_vs_batch.json.
"""

from __future__ import annotations

import copy
import datetime
import os
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from dpsgd.sim import Fleet
from experiments.bench import cli, harness

MODELS = ("mlp", "cnn", "resnet20", "transformer")
BATCH = {"mlp": 16, "cnn": 8, "resnet20": 8, "transformer": 8}  # samples per peer per step
LADDER = [16, 64, 256, 1024, 4096]
QUICK = {"mlp": [64, 1024], "cnn": [64], "resnet20": [64], "transformer": [64]}
RATIO_TARGET, MLP_RATIO_TARGET, MLP_FLOOR_TARGET = 0.8, 0.5, 1 / 1.5  # the last: within 1.5x of the floor
TARGET_FROM = 64  # peers from which the targets apply
BATCHES_PER_SHARE = 2  # each peer's share holds this many batches (a reshuffle every other step)


def config(model: str, peers: int, batch: int, device: str) -> dict:
    """experiments.bench.fleet's config (D-PSGD, one_peer_exponential) with `model` on data it takes."""
    samples = int(BATCHES_PER_SHARE * peers * batch / 0.8) + peers  # the training split (80%)
    if model == "mlp":
        run = harness.fleet_overrides(peers, batch, "synthetic", num_samples=samples, num_features=64, num_classes=10)
    else:
        run = harness.fleet_overrides(peers, batch, "tiny_text" if model == "transformer" else "synthetic_cifar",
                                      num_samples=samples)  # fmt: skip
    return harness.run_config(*run, f"model={model}", f"device={device}")


class Clock:
    """Seconds of this thread's CPU time (a CPU device, one torch thread) or of wall time after the device
    has finished its queued work (a GPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.label = "wall time" if self.cuda or torch.get_num_threads() > 1 else "CPU time of one thread"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def bandwidth(device: torch.device, clock: Clock, mib: int = 256, reps: int = 5) -> float:
    """Bytes per second moved by a copy of `mib` MiB (read + write), best of `reps`."""
    a = torch.ones(mib * 2**18, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        b.copy_(a)
        best = min(best, clock() - t0)
    return 2 * a.numel() * a.element_size() / best


def saved_bytes(model: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the tensors the forward pass saves for the backward pass (parameters excluded), each storage once."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


class Reference:
    """One copy of the fleet's model at batch n*b, momentum SGD as the fleet's peers use, batches drawn
    at random from the fleet's data."""

    def __init__(self, fleet, lr: float, momentum: float):
        self.model = copy.deepcopy(fleet.model)
        self.loss_fn, self.n_b = fleet.loss_fn, fleet.n * fleet.batches.batch_size
        self.x, self.y = fleet.batches.x, fleet.batches.y
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=momentum)
        self.gen = torch.Generator().manual_seed(0)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randperm(len(self.x), generator=self.gen)[: self.n_b].to(self.x.device)
        return self.x[idx], self.y[idx]

    def gradients(self, x, y) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.loss_fn(self.model(x), y).backward()

    def train_step(self) -> None:
        self.gradients(*self.batch())
        self.opt.step()


def fleet_phases(fleet, clock: Clock, steps: int) -> dict:
    """Seconds per step of the fleet's batch draw, forward+backward, gossip (one product with W(k) timed apart)
    and the rest of the algorithm's step."""
    out = dict.fromkeys(("batch", "forward_backward", "gossip", "optimizer"), 0.0)
    for _ in range(steps):
        t0 = clock()
        x, y = fleet.batches.next()
        t1 = clock()
        fleet.gradients(x, y)
        t2 = clock()
        fleet.algorithm.step()
        t3 = clock()
        with torch.no_grad():  # the step's gossip again, alone
            fleet.comm.mix(fleet.params, fleet.topology, fleet.algorithm.step_count)
        gossip = clock() - t3
        for k, v in (
            ("batch", t1 - t0),
            ("forward_backward", t2 - t1),
            ("gossip", gossip),
            ("optimizer", t3 - t2 - gossip),
        ):
            out[k] += v / steps
    return out


def reference_phases(ref: Reference, clock: Clock, steps: int) -> dict:
    out = dict.fromkeys(("batch", "forward_backward", "optimizer"), 0.0)
    for _ in range(steps):
        t0 = clock()
        x, y = ref.batch()
        t1 = clock()
        ref.gradients(x, y)
        t2 = clock()
        ref.opt.step()
        t3 = clock()
        for k, v in (("batch", t1 - t0), ("forward_backward", t2 - t1), ("optimizer", t3 - t2)):
            out[k] += v / steps
    return out


def floor_bytes(fleet, activations_per_peer: int) -> dict:
    """Bytes one fleet step must move (the module's docstring), per part."""
    n = fleet.n
    weights = sum(p[0].numel() * p.element_size() for p in fleet.params)
    states = sum(  # optimizer state per peer (momentum buffers), counted from the optimizer itself
        t[0].numel() * t.element_size()
        for s in fleet.algorithm.base.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0 and t.shape[0] == n
    )
    w = fleet.topology.sparse_mixing_matrix(0)  # no (n, n) array for thousands of peers
    in_neighbours = float((w.nnz - np.count_nonzero(w.diagonal())) / n)
    x = fleet.batches.x
    batch = fleet.batches.batch_size * x[0].numel() * x.element_size()
    per_peer = {
        "weights": weights * (2 + 1 + 1 + in_neighbours + 1),  # fwd, bwd, update own + neighbours' reads, write
        "gradients": 2 * weights,  # written by backward, read by the update
        "optimizer_state": 2 * states,  # read and written by the update
        "activations": 2 * activations_per_peer,  # saved in the forward pass, read in the backward
        "batch": batch,
    }
    return {k: v * n for k, v in per_peer.items()}


def memory_estimate(model: str, peers: int, batch: int, params_per_peer: int, act_per_sample: float) -> float:
    """Bytes a fleet of `peers` needs, roughly: weights, gradients, momentum, the gossip's copies, vmap's
    temporaries (8 copies of the weights), activations and their gradients (3x the saved ones), the data."""
    sample = {"mlp": 64 * 4, "transformer": 32 * 8, "cnn": 3 * 32 * 32 * 4, "resnet20": 3 * 32 * 32 * 4}[model]
    data = (BATCHES_PER_SHARE * batch / 0.8 + 1) * sample
    return peers * (8 * 4 * params_per_peer + 3 * act_per_sample * batch + data)


def measure(
    model: str, n: int, device: torch.device, clock: Clock, bw: float, steps: int, reps: int, vmap: bool = True
) -> dict:
    """One (model, n): the fleet and its reference built, warmed up, timed alternately (with `vmap`, also the wide
    layout's fleet under vmap); phases; floor."""
    b = BATCH[model]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fleet = Fleet(config(model, n, b, str(device)))
        for _ in range(max(1, fleet.topology.period or 0)):  # warm-up: every mixing matrix of the period made
            fleet.step()  # (and vmap's warnings, e.g. a batching rule it lacks)
    fallbacks = sorted({str(w.message).split("batching rule for ")[1].split(".")[0] for w in caught
                        if "batching rule for" in str(w.message)})  # fmt: skip
    opt_cfg = fleet.config.optimizer.options
    ref = Reference(fleet, float(opt_cfg["lr"]), float(opt_cfg.get("momentum", 0.0)))
    ref.train_step()
    x, y = ref.batch()
    act = saved_bytes(copy.deepcopy(fleet.model), fleet.loss_fn, x[:b].clone(), y[:b].clone())
    wide = fleet._wide
    sides = {"fleet": fleet.step, "reference": ref.train_step}
    if wide is not None and vmap:  # the same fleet under vmap too: what the wide layout gains, measured alongside

        def vmapped():
            fleet._wide = None
            try:
                fleet.step()
            finally:
                fleet._wide = wide

        sides["fleet_vmap"] = vmapped
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(reps):  # alternated; the best of each
        for side, step in sides.items():
            t0 = clock()
            for _ in range(steps):
                step()
            best[side] = min(best[side], (clock() - t0) / steps)
    fleet_s, ref_s = best["fleet"], best["reference"]
    phases = {"fleet": fleet_phases(fleet, clock, steps), "reference": reference_phases(ref, clock, steps)}
    traffic = floor_bytes(fleet, act)
    floor_s = sum(traffic.values()) / bw
    samples = n * b
    row = {
        "model": model,
        "peers": n,
        "batch": b,
        "device": device.type,
        "ratio": ref_s / fleet_s,
        "floor_ratio": floor_s / fleet_s,
        "fleet_samples_per_s": samples / fleet_s,
        "reference_samples_per_s": samples / ref_s,
        "floor_samples_per_s": samples / floor_s,
        "fleet_s_per_step": fleet_s,
        "reference_s_per_step": ref_s,
        "floor_s_per_step": floor_s,
        "floor_bytes": traffic,
        "phases_s": phases,
        "vmap_fallbacks": fallbacks,
        "layout": "vmap" if wide is None else "wide",
        "vmap_ratio": ref_s / best["fleet_vmap"] if "fleet_vmap" in best else None,  # the fleet under vmap instead
        "params_per_peer": sum(p[0].numel() for p in fleet.params),
        "saved_activation_bytes_per_sample": act / b,
    }
    row["target"] = target(row)
    return row


def target(row: dict) -> dict | None:
    """The issue's target for this row (None below TARGET_FROM peers): its limit, whether it holds, and for
    a miss its measured cause."""
    if row["peers"] < TARGET_FROM:
        return None
    if row["model"] == "mlp":
        holds = row["ratio"] >= MLP_RATIO_TARGET or row["floor_ratio"] >= MLP_FLOOR_TARGET
        wanted = f"ratio >= {MLP_RATIO_TARGET:g} or floor_ratio >= {MLP_FLOOR_TARGET:.2f}"
    else:
        holds = row["ratio"] >= RATIO_TARGET
        wanted = f"ratio >= {RATIO_TARGET:g}"
    return {"wanted": wanted, "holds": holds, "cause": None if holds else cause(row)}


def cause(row: dict) -> str:
    """The phase in which the fleet spends the most time beyond the reference, with the measured figures."""
    f, r = row["phases_s"]["fleet"], row["phases_s"]["reference"]
    total = sum(f.values())
    excess = {
        "forward+backward": f["forward_backward"] - r["forward_backward"],
        "optimizer and gossip": f["optimizer"] + f["gossip"] - r["optimizer"],
        "batch draw": f["batch"] - r["batch"],
    }
    worst = max(excess, key=lambda k: excess[k])
    if worst == "forward+backward":
        why = (
            f"forward+backward {f['forward_backward'] * 1e3:.1f} ms vs the one model's "
            f"{r['forward_backward'] * 1e3:.1f} ms ({f['forward_backward'] / total:.0%} of the fleet's step): "
            + (
                "n models' grouped convolutions (the wide layout)"
                if row["layout"] == "wide"
                else "n models' small products under vmap"
            )
        )
        if row["vmap_fallbacks"]:
            why += f"; vmap has no batching rule for {', '.join(row['vmap_fallbacks'])} (a per-peer loop)"
    elif worst == "optimizer and gossip":
        why = (
            f"the algorithm's step {(f['optimizer'] + f['gossip']) * 1e3:.1f} ms (gossip {f['gossip'] * 1e3:.1f} ms, "
            f"optimizer {f['optimizer'] * 1e3:.1f} ms; {(f['optimizer'] + f['gossip']) / total:.0%} of the fleet's "
            f"step) vs the one model's SGD step {r['optimizer'] * 1e3:.2f} ms: n copies of weights and momentum"
        )
    else:
        why = (
            f"the batch draw {f['batch'] * 1e3:.1f} ms vs the one model's {r['batch'] * 1e3:.1f} ms "
            f"({f['batch'] / total:.0%} of the fleet's step): n per-peer reshuffles"
        )
    return why + f"; at {row['floor_ratio']:.2f} of its memory-traffic floor"


def as_target(row: dict) -> harness.Target:
    """The row's target for the harness: fleet / one model at least its limit (the MLP: or near its floor)."""
    name = f"{row['model']} {row['peers']} x {row['batch']} {row['device']}: fleet / one model"
    if row["model"] == "mlp":
        name += f" (or floor_ratio >= {MLP_FLOOR_TARGET:.2f})"
    at_least = MLP_RATIO_TARGET if row["model"] == "mlp" else RATIO_TARGET
    t = row["target"]
    return harness.Target(name, row["ratio"], at_least=at_least, passed=t["holds"], cause=t["cause"])


def line(row: dict) -> str:
    t = row["target"]
    head = (
        f"{row['model']:11s} {row['peers']:5d} x {row['batch']:<2d} {row['device']:4s} "
        f"ratio {row['ratio']:6.3f}  floor_ratio {row['floor_ratio']:6.3f}  "
        f"fleet {row['fleet_samples_per_s']:9.0f}  one model {row['reference_samples_per_s']:9.0f} samples/s"
    )
    if row["vmap_ratio"] is not None:
        head += f"  (wide layout; under vmap: ratio {row['vmap_ratio']:.3f})"
    if t is None:
        return head + "  (no target below 64 peers)"
    return head + f"  {'PASS' if t['holds'] else 'MISS'} ({t['wanted']})"


def available_bytes() -> float:
    try:
        for text in Path("/proc/meminfo").read_text().splitlines():
            if text.startswith("MemAvailable:"):
                return float(text.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def options(p) -> None:
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--peers", nargs="+", type=int, help="the ladder (default 16 64 256 1024 4096; --quick: a few)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the clock is this thread's CPU time)")
    p.add_argument("--step-limit-s", type=float, default=None, help="a model's ladder stops after a slower step")
    p.add_argument("--budget-s", type=float, help="no new measurement once this many seconds have passed")
    p.add_argument("--memory-fraction", type=float, default=0.4, help="of the memory available at the start")
    p.add_argument("--bandwidth-mib", type=int, default=256, help="size of the copy that measures the bandwidth")
    p.add_argument(
        "--without-vmap", action="store_true", help="no run of the wide layout's fleet under vmap (shown only)"
    )


def run(args) -> harness.Result:
    """--quick: the sizes of QUICK, 2 steps and 2 repeats unless given, a ladder stopped after a 3 s step."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    given = set(args.argv)
    steps = 2 if args.quick and "--steps" not in given else args.steps
    reps = 2 if args.quick and "--repeats" not in given else args.repeats
    step_limit = args.step_limit_s or (3.0 if args.quick else 10.0)
    if device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory * args.memory_fraction
    else:
        budget = available_bytes() * args.memory_fraction
    clock = Clock(device)
    bw = bandwidth(device, clock, args.bandwidth_mib)
    load = os.getloadavg()
    print(f"fleet vs one model at batch n*b on {device} ({clock.label}); memory bandwidth {bw / 1e9:.1f} GB/s; "
          f"load {load[0]:.2f}")  # fmt: skip
    rows: list[dict] = []
    started = datetime.datetime.now(datetime.timezone.utc)
    begun = time.monotonic()
    for model in args.models:
        ladder = args.peers or (QUICK[model] if args.quick else LADDER)
        for n in ladder:
            if args.budget_s is not None and time.monotonic() - begun > args.budget_s:
                print(f"{model:11s} {n:5d}: skipped, the {args.budget_s:g} s budget is spent")
                break
            probe = rows[-1] if rows and rows[-1]["model"] == model else None
            if probe is not None:
                need = memory_estimate(model, n, BATCH[model], probe["params_per_peer"],
                                       probe["saved_activation_bytes_per_sample"])  # fmt: skip
                if need > budget:
                    print(f"{model:11s} {n:5d}: skipped, about {need / 2**30:.1f} GiB > {budget / 2**30:.1f} GiB")
                    break
                if probe["fleet_s_per_step"] > step_limit:
                    print(
                        f"{model:11s} {n:5d}: skipped, {probe['peers']} peers took "
                        f"{probe['fleet_s_per_step']:.1f} s/step"
                    )
                    break
            try:
                row = measure(model, n, device, clock, bw, steps, reps, vmap=not args.without_vmap)
            except torch.cuda.OutOfMemoryError:
                print(f"{model:11s} {n:5d}: out of device memory")
                torch.cuda.empty_cache()
                break
            row.update(clock=clock.label, bandwidth_bytes_per_s=bw, threads=args.threads,
                       date=started.isoformat(timespec="seconds"))  # fmt: skip
            rows.append(row)
            print(line(row), flush=True)
            harness.write(args, {"rows": rows}, targets(rows))  # the rows so far, should the run be stopped
    after = os.getloadavg()
    for row in rows:
        row["load_avg_1m"] = [load[0], after[0]]
    print(f"load {load[0]:.2f} -> {after[0]:.2f}")
    return harness.Result({"rows": rows}, targets(rows))


def targets(rows: list[dict]) -> list[harness.Target]:
    return [as_target(r) for r in rows if r["target"] is not None]


main = cli.entry("fleet_vs_batch")

if __name__ == "__main__":
    raise SystemExit(main())
