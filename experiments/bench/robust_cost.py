"""What the safety nets cost an honest peer: `python -m experiments.bench.robust_cost [--rounds 30]`

1. The divergence check (dpsgd.divergence: the step's loss and one norm of the parameters) against the training
   step it follows, on one peer: the MLP on digits and ResNet-20 on synthetic CIFAR-shaped data.
2. Each robust rule's combine (dpsgd.comm.robust) against the plain weighted sum, for a ResNet-20-sized vector
   and 2 received ones (a ring), and 8 (a mean over 9 peers).
Rounds alternate the two sides of each ratio, so a loaded machine slows both alike; medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dpsgd import divergence
from dpsgd.comm.robust import RULES, Rule


def _config(model: str, data: str) -> dict:
    import yaml

    from experiments.validate import CONF_DIR

    def load(group, name):
        return yaml.safe_load((CONF_DIR / group / f"{name}.yaml").read_text())

    return {
        "algorithm": load("algorithm", "dpsgd"),
        "topology": load("topology", "ring"),
        "model": load("model", model),
        "data": load("data", data),
        "backend": {"name": "local"},
        "network": load("network", "loopback"),
        "peers": 1,
        "seed": 0,
        "epochs": 1,
        "batch_size": 32,
        "device": "cpu",
        "comm": {"timeout_s": 60},
    }


def check_cost(model: str, data: str, rounds: int) -> dict:
    from dpsgd.build import build_peer
    from dpsgd.comm import LocalCommunicator, LocalWorld

    peer = build_peer(LocalCommunicator(LocalWorld(1), 0, 60.0), _config(model, data))
    params = list(peer.model.parameters())
    steps, checks = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        loss = peer.train_step()
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench.robust_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("divergence check per step (one peer, one thread):")
    for model, data in (("mlp", "digits"), ("resnet20", "synthetic_cifar")):
        r = check_cost(model, data, args.rounds)
        print(
            f"  {r['model']:<9} {r['parameters']:>8} parameters: step {r['step_ms']:.2f} ms, "
            f"check {r['check_ms']:.3f} ms ({r['ratio']:.2%} of the step)"
        )
    print("robust combine against the plain weighted sum (272474 float32 entries, ResNet-20's size):")
    for received in (2, 8):
        for r in combine_cost(received, args.rounds):
            print(f"  {r['rule']:<15} {r['received']} received: {r['ms']:.3f} ms ({r['x_none']:.2f}x none)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
