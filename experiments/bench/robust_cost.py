"""What the safety nets cost an honest peer: `python -m experiments.bench robust_cost [--rounds 30]`

1. The divergence check (dpsgd.divergence: the step's loss and one norm of the parameters) against the training
   step it follows, on one peer: the MLP on digits and ResNet-20 on synthetic CIFAR-shaped data.
2. Each robust rule's combine (dpsgd.comm.robust) against the plain weighted sum, for a ResNet-20-sized vector
   and 2 received ones (a ring), and 8 (a mean over 9 peers).
Rounds alternate the two sides of each ratio, so a loaded machine slows both alike; medians are reported.
"""

from __future__ import annotations

import statistics
import time

import torch

from dpsgd import divergence
from dpsgd.comm.robust import RULES, Rule
from experiments.bench import cli, harness


def check_cost(model: str, data: str, rounds: int) -> dict:
    from dpsgd.build import build_peer
    from dpsgd.comm import LocalCommunicator, LocalWorld

    cfg = harness.run_config("backend=local", "peers=1", "algorithm=dpsgd", "topology=ring", f"model={model}",
                             f"data={data}", "batch_size=32", "epochs=1", "comm.timeout_s=60")  # fmt: skip
    peer = build_peer(LocalCommunicator(LocalWorld(1), 0, 60.0), cfg)
    params = list(peer.model.parameters())
    steps, checks = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        loss = float(peer.step())
        between = time.perf_counter()
        divergence.problem(loss, float(divergence.norms(params)))
        checks.append(time.perf_counter() - between)
        steps.append(between - started)
    step, check = statistics.median(steps), statistics.median(checks)
    size = sum(p.numel() for p in params)
    return {"model": model, "parameters": size, "step_ms": step * 1e3, "check_ms": check * 1e3, "ratio": check / step}


def combine_cost(received: int, rounds: int, size: int = 272_474) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    own = torch.randn(size, generator=g)
    others = [own + 0.01 * torch.randn(size, generator=g) for _ in range(received)]
    weights = [1.0 / (received + 1)] * received
    times: dict[str, list[float]] = {name: [] for name in RULES}
    for _ in range(rounds):
        for name in RULES:
            started = time.perf_counter()
            Rule(name).combine(own.clone(), others, weights, 1.0 / (received + 1))
            times[name].append(time.perf_counter() - started)
    base = statistics.median(times["none"])
    return [
        {"rule": n, "received": received, "ms": statistics.median(t) * 1e3, "x_none": statistics.median(t) / base}
        for n, t in times.items()
    ]


def run(args) -> harness.Result:
    torch.set_num_threads(1)
    print("divergence check per step (one peer, one thread):")
    checks = [
        check_cost(model, data, args.rounds) for model, data in (("mlp", "digits"), ("resnet20", "synthetic_cifar"))
    ]
    for r in checks:
        print(
            f"  {r['model']:<9} {r['parameters']:>8} parameters: step {r['step_ms']:.2f} ms, "
            f"check {r['check_ms']:.3f} ms ({r['ratio']:.2%} of the step)"
        )
    print("robust combine against the plain weighted sum (272474 float32 entries, ResNet-20's size):")
    combines = [r for received in (2, 8) for r in combine_cost(received, args.rounds)]
    for r in combines:
        print(f"  {r['rule']:<15} {r['received']} received: {r['ms']:.3f} ms ({r['x_none']:.2f}x none)")
    return harness.Result({"divergence_check": checks, "combine": combines})


main = cli.entry("robust_cost")

if __name__ == "__main__":
    raise SystemExit(main())
