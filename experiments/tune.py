"""Fair tuning: `python -m experiments.tune [--algorithms A,B,...] [options] [overrides]`.

A comparison can be won by tuning alone, so every algorithm gets the same search before it is compared:
1. search: per algorithm, its learning rate on a log grid around the rate its config holds (and the knobs its
   class declares, `knobs`: e.g. LocalSGD's period, DiLoCo's outer lr, Choco's gamma), each setting trained on
   the training split less a held-out validation split (`data.validation_fraction`, evaluated in the test
   split's place, so the test split is never read); through Hydra's Optuna sweeper (hydra-optuna-sweeper, grid or
   TPE sampler) where it is installed, else Hydra's basic sweeper over the same grid; `--schedules
   constant,cosine` searches the learning-rate schedule too;
2. select: the setting with the best validation accuracy (ties: the lower validation loss);
3. final: the chosen setting on the whole training split over `--seeds` seeds, evaluated on the test split,
   whose seed (`data.split_seed`) is the search's: the validation split lies inside its training split.
Writes OUT/search/ALGORITHM/ (the trials), OUT/final/ALGORITHM/ (the seeds), OUT/tuned.json and OUT/tuned.md (the
chosen values and the final table: mean +- 95% interval over the seeds), and the report's plots in OUT.
Overrides (`backend=fleet peers=16 data=mnist_small ...`) apply to every run. The same command again reads the
sweeps that are complete instead of running them (an interrupted tuning goes on where it stopped).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from experiments.overrides import check as check_overrides
from experiments.sweeps import finished, run_sweep
from experiments.validate import ConfigError, group_options

LR_FACTORS = [0.1, 0.3, 1.0, 3.0, 10.0]  # times the config's lr: a log grid of two decades around it


def optuna_available() -> bool:
    try:
        import hydra_plugins.hydra_optuna_sweeper  # noqa: F401
    except ImportError:
        return False
    return True


def default_lr(algorithm: str, overrides: list[str]) -> float:
    """The learning rate the algorithm's config (with the user's overrides) holds: the grid's centre."""
    from experiments.validate import compose

    return float(compose([*overrides, f"algorithm={algorithm}"]).optimizer.lr)


def knobs(algorithm: str) -> dict[str, list]:
    """The algorithm's own settings searched beside its learning rate, {config key under algorithm.: grid}: what
    its class declares (`knobs`, dpsgd.optim.ALGORITHMS); none for a class that declares none (the lr alone)."""
    from dpsgd.optim import ALGORITHMS

    return {name: list(grid) for name, grid in getattr(ALGORITHMS.get(algorithm), "knobs", {}).items()}


def search_space(
    algorithm: str, lrs: list[float], knob_values: list | None, schedules: list[str] | None = None
) -> dict[str, list]:
    """The settings searched: the learning rate, the algorithm's own knobs (`knob_values` in place of the grid of
    an algorithm's one knob), and with `schedules` the learning-rate schedule (conf/schedule/: the rate is then the
    schedule's peak)."""
    space: dict[str, list] = {"optimizer.lr": lrs}
    own = knobs(algorithm)
    for name, values in own.items():
        space[f"algorithm.{name}"] = knob_values if knob_values and len(own) == 1 else values
    if schedules:
        space["schedule"] = list(schedules)
    return space


def sweep_args(space: dict[str, list], sampler: str, trials: int | None) -> list[str]:
    """Hydra overrides that sweep `space`: the Optuna sweeper where installed, else the basic sweeper's lists."""
    lists = {k: ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in vs) for k, vs in space.items()}
    if sampler == "basic":
        return [f"{k}={v}" for k, v in lists.items()]
    grid = math.prod(len(v) for v in space.values())
    args = ["hydra/sweeper=optuna", f"hydra/sweeper/sampler={sampler}", "hydra.sweeper.direction=maximize"]
    args.append(f"hydra.sweeper.n_trials={grid if sampler == 'grid' else trials or grid}")
    for key, text in lists.items():
        if sampler == "tpe" and key == "optimizer.lr":  # TPE samples the whole log range, not only the grid
            args.append(f"{key}=tag(log, interval({min(space[key]):g}, {max(space[key]):g}))")
        else:
            args.append(f"{key}=choice({text})")
    return args


def trials(sweep_dir: Path) -> list[dict]:
    """Each finished run under `sweep_dir`: its resolved config and its summary."""
    out = []
    for summary in sorted(sweep_dir.rglob("summary.json")):
        config = OmegaConf.to_container(OmegaConf.load(summary.parent / "config.yaml"))
        out.append({"config": config, "summary": json.loads(summary.read_text()), "dir": summary.parent})
    return out


def select(found: list[dict], keys: list[str]) -> dict:
    """The setting with the best mean validation accuracy over its search seeds (ties: lower validation loss)."""
    settings: dict[tuple, list[dict]] = {}
    for t in found:
        if t["summary"].get("evaluated_on") != "validation":
            raise RuntimeError(f"{t['dir']} was evaluated on the {t['summary'].get('evaluated_on')} split")
        settings.setdefault(tuple(_get(t["config"], k) for k in keys), []).append(t["summary"])

    def score(runs: list[dict]) -> tuple[float, float]:
        if any(r.get("status", "ok") != "ok" for r in runs):  # a failed trial (diverged, not learning): never chosen
            return -math.inf, -math.inf
        accuracy = [r["test_accuracy"] for r in runs if r.get("test_accuracy") is not None]
        acc = sum(accuracy) / len(accuracy) if accuracy else -math.inf
        loss = sum(r["test_loss"] for r in runs) / len(runs)
        return (acc if math.isfinite(acc) else -math.inf), (-loss if math.isfinite(loss) else -math.inf)

    best = max(settings, key=lambda s: score(settings[s]))
    acc, neg_loss = score(settings[best])
    return {
        "chosen": dict(zip(keys, best)),
        "validation_accuracy": acc,
        "validation_loss": -neg_loss,
        "trials": len(found),
        "failed": sum(t["summary"].get("status", "ok") != "ok" for t in found),  # diverged or not learning (mark)
    }


def _get(config: dict, dotted: str):
    """The value at `dotted`; for a config group (`schedule`), the name of the option chosen."""
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node["name"] if isinstance(node, dict) and "name" in node else node


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.tune", description=__doc__.split("\n")[0], epilog="Other arguments: overrides."
    )
    parser.add_argument("--algorithms", default="allreduce,dpsgd,local_sgd", help="comma-separated (conf/algorithm/)")
    parser.add_argument("--lr-factors", default=",".join(f"{f:g}" for f in LR_FACTORS), help="x the config's lr")
    parser.add_argument(
        "--knob-values", default=None, help="replace the grid of the algorithm's own knob (its class's `knobs`)"
    )
    parser.add_argument(
        "--schedules", default=None, help="comma-separated (conf/schedule/): searched too (default: the config's)"
    )
    parser.add_argument("--seeds", type=int, default=3, help="final runs of the chosen setting: seeds 0 .. N-1")
    parser.add_argument("--search-seeds", type=int, default=1, help="seeds per setting in the search")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the test and validation splits")
    parser.add_argument("--validation-fraction", type=float, default=0.2, help="of the training split")
    parser.add_argument("--sampler", choices=("grid", "tpe", "basic"), default=None, help="default: grid with Optuna")
    parser.add_argument("--trials", type=int, default=None, help="tpe: trials per algorithm (default: the grid's)")
    parser.add_argument("--out", type=Path, default=None, help="default multirun/tune/DATE_TIME")
    args, overrides = parser.parse_known_args(argv)
    if any(o.startswith("-") for o in overrides):
        parser.error(f"unknown option(s): {' '.join(o for o in overrides if o.startswith('-'))}")
    if args.seeds < 1 or args.search_seeds < 1 or not 0 < args.validation_fraction < 1:
        parser.error("--seeds and --search-seeds must be >= 1, --validation-fraction in (0, 1)")
    sampler = args.sampler or ("grid" if optuna_available() else "basic")
    if sampler != "basic" and args.search_seeds > 1:
        parser.error("--search-seeds > 1 needs --sampler basic (an Optuna trial is one run)")
    if sampler != "basic" and not optuna_available():
        parser.error(f"--sampler {sampler} needs hydra-optuna-sweeper: pip install 'dpsgd[tune]' (or --sampler basic)")
    _check_names(parser, args)
    if args.knob_values:
        several = [f"{a} ({', '.join(k)})" for a in args.algorithms.split(",") if len(k := knobs(a)) > 1]
        if several:
            parser.error(
                f"--knob-values replaces the grid of an algorithm's one knob, but {'; '.join(several)} has several: "
                "tune it without --knob-values"
            )
    try:  # the app's one-line check of every override (unknown keys, unreadable values), before any run starts
        overrides = check_overrides(overrides)
    except ConfigError as exc:
        parser.error(str(exc))
    factors = [float(f) for f in args.lr_factors.split(",")]
    knob_values = [_number(v) for v in args.knob_values.split(",")] if args.knob_values else None
    out = args.out or Path("multirun/tune") / time.strftime("%Y-%m-%d_%H-%M-%S")
    # a trial that diverges is marked and counted as failed, not the end of its sweep
    common = [*overrides, f"data.split_seed={args.split_seed}", "on_divergence=mark"]
    search_seeds = f"seed=range({args.search_seeds})" if args.search_seeds > 1 else f"seed={args.split_seed}"

    tuned = {"sampler": sampler, "validation_fraction": args.validation_fraction, "overrides": overrides}
    tuned["algorithms"] = {}
    for algorithm in args.algorithms.split(","):
        centre = default_lr(algorithm, overrides)
        lrs = [float(f"{centre * f:.6g}") for f in factors]
        space = search_space(algorithm, lrs, knob_values, args.schedules.split(",") if args.schedules else None)
        search = out / "search" / algorithm
        if not finished(search, math.prod(len(v) for v in space.values()) * args.search_seeds):
            run_sweep(
                [f"algorithm={algorithm}", *common, f"data.validation_fraction={args.validation_fraction}"]
                + [search_seeds, *sweep_args(space, sampler, args.trials)],
                search,
            )
        choice = select(trials(search), list(space))
        tuned["algorithms"][algorithm] = choice
        chosen = " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in choice["chosen"].items())
        print(
            f"{algorithm}: {choice['trials']} trials ({choice['failed']} diverged: failed), chosen {chosen} "
            f"(validation accuracy {choice['validation_accuracy']:.4f})",
            flush=True,
        )
        if not finished(out / "final" / algorithm, args.seeds):
            run_sweep(
                [f"algorithm={algorithm}", *common, f"seed=range({args.seeds})"]
                + [f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in choice["chosen"].items()],
                out / "final" / algorithm,
            )
    (out / "tuned.json").write_text(json.dumps(tuned, indent=2) + "\n")
    from experiments import report

    code = report.main([str(out / "final"), "--out", str(out)])
    (out / "tuned.md").write_text(chosen_table(tuned) + "\n" + (out / "report.md").read_text())
    print(f"wrote {out / 'tuned.md'}, {out / 'tuned.json'}")
    return code


def _check_names(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--algorithms and --schedules name options of their config groups (a typo was a Hydra traceback)."""
    for group, given in (("algorithm", args.algorithms), ("schedule", args.schedules)):
        valid = group_options(group)
        unknown = [name for name in (given or "").split(",") if name and name not in valid]
        if unknown:
            parser.error(f"unknown {group} {', '.join(unknown)}; valid {group} options: {', '.join(valid)}")


def chosen_table(tuned: dict) -> str:
    """Markdown: per algorithm, the chosen values and their validation score."""
    lines = ["| algorithm | chosen | validation accuracy | trials |", "|---|---|---|---|"]
    for name, c in tuned["algorithms"].items():
        chosen = ", ".join(
            f"{k.removeprefix('algorithm.')} {v:g}" if isinstance(v, float) else f"{k.removeprefix('algorithm.')} {v}"
            for k, v in c["chosen"].items()
        )
        lines.append(f"| {name} | {chosen} | {c['validation_accuracy']:.4f} | {c['trials']} |")
    return "\n".join(lines) + "\n"


def _number(text: str):
    return int(text) if text.lstrip("-").isdigit() else float(text)


if __name__ == "__main__":
    sys.exit(main())
