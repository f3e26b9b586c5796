"""epfml/ChocoSGD's Choco-SGD (convex_code/logistic.py, LogisticDecentralizedSGD with method "choco": the code of the
paper's convex experiments) on fixed data with each of its compressors: every machine's model after every step.

Usage: python tools/fidelity/choco_epfml.py CHOCO_CHECKOUT tests/fixtures/choco_epfml.npz
(CHOCO_CHECKOUT: a clone of https://github.com/epfml/ChocoSGD; needs numpy, scipy and networkx.)

Stubbed: nothing of the rule. Parameters get name="choco" (its __str__ fails on an unnamed run: sparse_str reads an
undefined `quantization`; its experiment scripts name every run). The initial model is given (x, x_estimate and
x_hat set before fit() as fit() sets them, x0 in place of its normal(0, 0.01) draw), and the harness records,
without changing them, the random draws fit() makes through numpy.random: each machine's sample (choice over its
indices), random-k's positions (choice without replacement) and QSGD's uniforms (rand); update_estimate is wrapped
to read self.x after every step.
Inputs: A = default_rng(0).normal(size=(40, 30)), y = sign(default_rng(1).normal(size=40)) (+-1), 4 machines on the
code's ring (1/3 each), its naive split (machine m: samples 10m .. 10m + 9), 1 epoch (10 steps), constant lr 0.5,
no regularizer, consensus_lr 0.3, x0 = default_rng(2).normal(size=30) * 0.1 on every machine, numpy.random.seed(5)
before fit (random_seed 5). Per case (one compressor): x after every step (steps, machines, features), the
sampled rows (steps, machines), and the compressor's draws (random: positions (steps, machines, k); qsgd: uniforms
(steps, machines, features))."""

from __future__ import annotations

import sys

import common
import numpy as np

N, D, SAMPLES, LR, GAMMA, SEED = 4, 30, 40, 0.5, 0.3, 5
CASES = {  # name -> the code's quantization option and its parameter
    "top": {"quantization": "top", "coordinates_to_keep": 5},
    "random_biased": {"quantization": "random-biased", "coordinates_to_keep": 5},
    "qsgd_biased": {"quantization": "qsgd-biased", "num_levels": 4},
    "qsgd_unbiased": {"quantization": "qsgd-unbiased", "num_levels": 4},
}


def inputs():
    A = np.random.default_rng(0).normal(size=(SAMPLES, D))
    y = np.sign(np.random.default_rng(1).normal(size=SAMPLES))
    x0 = np.random.default_rng(2).normal(size=D) * 0.1
    return A, y, x0


def run(checkout: str, options: dict):
    sys.path.insert(0, f"{checkout}/convex_code")
    from logistic import LogisticDecentralizedSGD
    from parameters import Parameters

    A, y, x0 = inputs()
    draws = {"sample": [], "positions": [], "uniforms": []}
    choice, rand = np.random.choice, np.random.rand

    def recording_choice(a, *args, **kwargs):
        out = choice(a, *args, **kwargs)
        draws["positions" if args or kwargs else "sample"].append(np.array(out))
        return out

    def recording_rand(*shape):
        out = rand(*shape)
        draws["uniforms"].append(out.copy())
        return out

    xs = []

    class Recorded(LogisticDecentralizedSGD):
        def update_estimate(self, t):
            super().update_estimate(t)
            xs.append(self.x.T.copy())  # (machines, features)

    params = Parameters(
        num_epoch=1, lr_type="constant", initial_lr=LR, consensus_lr=GAMMA, n_cores=N, topology="ring",
        method="choco", distribute_data=True, split_data_strategy="naive", random_seed=SEED, name="choco",
        split_data_random_seed=SEED, **options,
    )  # fmt: skip
    model = Recorded(params)
    model.x = np.tile(x0, (N, 1)).T
    model.x_estimate = model.x.copy()
    model.x_hat = model.x.copy()
    np.random.choice, np.random.rand = recording_choice, recording_rand
    try:
        model.fit(A, y)
    finally:
        np.random.choice, np.random.rand = choice, rand
    steps = len(xs)
    out = {"x": np.array(xs), "sample": np.array(draws["sample"]).reshape(steps, N)}
    if draws["positions"]:
        out["positions"] = np.array(draws["positions"]).reshape(steps, N, -1)
    if draws["uniforms"]:
        out["uniforms"] = np.array(draws["uniforms"]).reshape(steps, N, D)
    return out


if __name__ == "__main__":
    checkout, out = sys.argv[1], sys.argv[2]
    arrays = {}
    for case, options in CASES.items():
        for key, value in run(checkout, options).items():
            arrays[f"{case}_{key}"] = value
    meta = {
        "repo": "https://github.com/epfml/ChocoSGD",
        "file": "convex_code/logistic.py (LogisticDecentralizedSGD, method 'choco')",
        "commit": common.commit(checkout),
        "inputs": __doc__.split("Inputs: ")[1].strip(),
        "lr": LR,
        "consensus_lr": GAMMA,
        "cases": CASES,
        "stubbed": __doc__.split("Stubbed: ")[1].split("\nInputs")[0].strip(),
    }
    common.write(out, meta, arrays)
