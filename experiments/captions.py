"""What a report says in words: what was run, what ± means, which clock a time is on, and legends.

Everything here is read from the files a run writes (its config.yaml and summary.json) and from what the
library declares (an algorithm's `label`, `uses_topology` and `asynchronous`, a backend's `real_peers`), never
from comparisons with a particular name: a new algorithm or backend gets sensible words without an edit here.
"""

from __future__ import annotations

import textwrap

from experiments import intervals

# How a swept key's value reads in a legend ("{}" is the value); other keys read "LAST_PART VALUE".
KEY_WORDS = {
    "peers": "{} peers",
    "compression": "{} compression",
    "network": "{} network",
    "backend": "{} backend",
    "data": "{}",
    "model": "{}",
    "epochs": "{} epochs",
    "batch_size": "batch {}",
}
# summary.json's names for what a config holds, for runs written without their config.yaml
SUMMARY_NAMES = {
    "algorithm.name": "algorithm",
    "topology.name": "topology",
    "data.name": "dataset",
    "data.partition": "partition",
    "model.name": "model",
    "backend.name": "backend",
}


def setting(run: dict, key: str):
    """A run's setting `key` (a flat config key such as 'optimizer.lr'), from its config, else its summary."""
    if key in run["config"]:
        return run["config"][key]
    return run["summary"].get(SUMMARY_NAMES.get(key, key))


def algorithm_class(run: dict):
    """The run's optimizer class: the one its config's `_target_` names, else the one registered under its name
    (dpsgd.optim.ALGORITHMS); None for one the library does not know (or that does not import here)."""
    import pkgutil

    target = setting(run, "algorithm._target_")
    if target:
        try:
            return pkgutil.resolve_name(str(target))
        except (ImportError, AttributeError, ValueError):
            return None
    return registered(setting(run, "algorithm.name"))


def registered(name):
    """The optimizer class registered as `name` (dpsgd.optim.ALGORITHMS), or None."""
    from dpsgd.optim import ALGORITHMS

    return ALGORITHMS.get(str(name))


def uses_topology(run: dict) -> bool:
    """Whether the run's algorithm reads its topology (an optimizer's declared `uses_topology`; unknown: yes)."""
    return getattr(algorithm_class(run), "uses_topology", True)


def is_topology_key(key: str) -> bool:
    return key == "topology" or key.startswith("topology.")


def ignored(run: dict, keys: list[str]) -> list[str]:
    """The keys among `keys` that the run's algorithm does not read (today: the topology of all-reduce and the
    local SGD family, which average exactly)."""
    return [] if uses_topology(run) else [k for k in keys if is_topology_key(k)]


def algorithm_words(name) -> str:
    """The algorithm as papers write it: its class's declared `label` ('D-PSGD'), else its config name."""
    return getattr(registered(name), "label", None) or str(name)


def words(key: str, value) -> str:
    """One swept value as a legend reads it: 'D-PSGD', 'one peer exponential', '16 peers', 'period 8'."""
    if key in ("algorithm", "algorithm.name"):
        return algorithm_words(value)
    if key in ("topology", "topology.name"):
        return str(value).replace("_", " ")
    if key in KEY_WORDS:
        return KEY_WORDS[key].format(str(value).replace("_", " "))
    name = key.split(".")[-1].replace("_", " ")
    if isinstance(value, bool) or str(value).lower() in ("true", "false"):
        return f"{name} {'on' if str(value).lower() == 'true' else 'off'}"
    return f"{name} {value}"


def legend(run: dict, values: dict) -> str:
    """A configuration's name in words from its swept `values` ({key: value}): the algorithm first, then the
    topology (left out where the algorithm reads none), then the rest: 'D-PSGD, ring', 'all-reduce'."""
    skip = set(ignored(run, list(values)))
    order = sorted(values, key=lambda k: (k not in ("algorithm", "algorithm.name"), not is_topology_key(k), k))
    return ", ".join(words(k, values[k]) for k in order if k not in skip and values[k] is not None)


def _simulated(run: dict) -> bool:
    """Whether the run's peers were simulated in one process (its backend declares no real peers)."""
    from dpsgd import backends

    name = str(setting(run, "backend.name"))
    return name in backends.names() and not backends.get(name).real_peers


def _asynchronous(run: dict) -> bool:
    return bool(getattr(algorithm_class(run), "asynchronous", False))


def _common(runs: list[dict], key: str):
    """The setting when every run has the same one, else None."""
    values = {repr(setting(r, key)) for r in runs}
    return setting(runs[0], key) if len(values) == 1 else None


def _data(run: dict) -> str:
    partition = setting(run, "data.partition")
    detail = {"dirichlet": f"Dirichlet alpha {setting(run, 'data.alpha')}", "shards": "by class shards"}
    text = f"{setting(run, 'data.name')}"
    if partition is not None:
        text += f" ({detail.get(partition, str(partition))} split)"
    return text


def _options(run: dict, group: str, skip: tuple[str, ...] = ("name",)) -> str:
    prefix = group + "."
    items = [
        (k[len(prefix) :], v) for k, v in run["config"].items() if k.startswith(prefix) and k[len(prefix) :] not in skip
    ]
    return ", ".join(f"{k} {v}" for k, v in items if v is not None)  # config names: outer_momentum, not outer


def what_was_run(runs: list[dict], swept: list[str], copies: int = 0) -> str:
    """One paragraph: the data, model, peers, budget, backend, network and compression the runs share, what was
    swept, the inner optimizer every algorithm stepped (or, where the runs differ in it, that they do: a comparison
    of algorithms that is also one of optimizers), and each algorithm's options. `copies`: runs left out as the same
    run as one of `runs`."""
    facts = []
    for key, say in (
        ("data.name", lambda r: _data(r)),
        ("model.name", lambda r: f"model {setting(r, 'model.name')}" + _paren(_options(r, "model"))),
        ("peers", lambda r: f"{setting(r, 'peers')} peers"),
        ("epochs", lambda r: f"{_count(setting(r, 'epochs'), 'epoch')} of batch {setting(r, 'batch_size')} per peer"),
        ("backend.name", lambda r: f"backend {setting(r, 'backend.name')}"),
        ("network.name", lambda r: f"network {setting(r, 'network.name')}"),
        ("compression.name", lambda r: f"compression {setting(r, 'compression.name')}"),
    ):
        texts = {say(r) for r in runs if setting(r, key) is not None}
        if len(texts) == 1:
            facts.append(texts.pop())
    text = f"{len(runs)} run{'s' if len(runs) != 1 else ''}"
    text += (f" ({copies} more left out as copies, see the note)" if copies else "") + ": " + ", ".join(facts)
    if [k for k in swept if k != "seed"]:
        text += f"; swept: {', '.join(k for k in swept if k != 'seed')}"
    text += ". " + seeds_sentence(runs)
    inner = {words for r in runs if (words := optimizer_words(r))}
    if len(inner) == 1:
        text += f" Inner optimizer of every run: {inner.pop()}."
    elif inner:
        text += f" The runs differ in their inner optimizer ({'; '.join(sorted(inner))}): they compare optimizers too."
    by_algorithm: dict[str, set[str]] = {}
    for run in runs:
        skip = ("name", "_target_", *(k.split(".", 1)[1] for k in swept if "." in k))
        options = _options(run, "algorithm", skip=skip)
        by_algorithm.setdefault(algorithm_words(setting(run, "algorithm.name")), set()).add(options)
    parts = [f"{name}: {'; or '.join(sorted(o))}" for name, o in by_algorithm.items() if any(o)]
    if parts:
        text += " Algorithm options: " + ". ".join(parts) + "."
    return text


def optimizer_words(run: dict) -> str:
    """'sgd (lr 0.1, momentum 0.9, ...)': the base optimizer a run stepped (empty for a run written without it)."""
    name = setting(run, "optimizer.name")
    return f"{name} ({_options(run, 'optimizer')})" if name is not None else ""


def _count(n, thing: str) -> str:
    return f"{n} {thing}{'' if str(n) == '1' else 's'}"


def _paren(text: str) -> str:
    return f" ({text})" if text else ""


def seeds_sentence(runs: list[dict]) -> str:
    seeds = sorted({s for r in runs if (s := setting(r, "seed")) is not None})
    if len(seeds) <= 1:
        return f"One seed ({seeds[0] if seeds else 'unknown'}) per configuration."
    return f"Seeds {', '.join(map(str, seeds))}."


def target_sentence(target: str, runs: list[dict]) -> str:
    """What the to-target columns are: the target, which seeds their means are over, the clock, the resolution."""
    every = sorted({int(e) for r in runs if (e := setting(r, "eval_every") or setting(r, "log_every")) is not None})
    resolution = f"every {', '.join(map(str, every))} steps" if every else "its records"
    return (
        f"To the target {target}: reached counts the seeds whose run reached it; steps, time and MB to it are means "
        f"over those seeds only (± their 95% interval), from each run's first record at the target, so resolved to "
        f"the runs' evaluations ({resolution}); time is on the run's clock (emulated where its network is, else the "
        "wall clock); a configuration no seed of which reached it shows -."
    )


def interval_sentence(seed_counts: list[int]) -> str:
    return intervals.describe(seed_counts)


def clocks(runs: list[dict], columns: set[str]) -> list[str]:
    """A sentence for each clock among `columns` (metric keys shown): which clock, what it includes."""
    lines = []
    if "wall_time_s" in columns:
        wall = (
            "Wall time: seconds on this machine's wall clock from the training loop's first step to its last, "
            "evaluations included; start-up (processes, imports, data loading, model building) is not included"
        )
        if any(_simulated(r) for r in runs):
            backend = ", ".join(sorted({str(setting(r, "backend.name")) for r in runs if _simulated(r)}))
            wall += (
                f". Backend {backend} simulates every peer in one process: its wall time is the simulator's, "
                "for all peers together, not what a real peer would take"
            )
        if any(_asynchronous(r) and not _simulated(r) for r in runs):
            wall += ". An asynchronous run's wall time lasts until its last peer stopped"
        sleeping = sorted({str(setting(r, "network.name")) for r in runs if _emulates(r) and _sleeps(r)})
        if sleeping:
            wall += f". Network {', '.join(sleeping)} in sleep mode: peers really waited out the emulated delays"
        lines.append(wall + ".")
    if "emulated_time_s" in columns:
        if any(_simulated(r) and _asynchronous(r) for r in runs):
            lines.append(
                "Emulated time of an asynchronous run on a simulated backend: the event simulator's virtual clock "
                f"(dpsgd.sim.events): each step's compute time drawn from {_compute(runs)}, messages at the "
                "network's latency and bandwidth; nothing of it is measured on this machine."
            )
        networks = sorted({_network(r) for r in runs if _emulates(r) and not (_simulated(r) and _asynchronous(r))})
        if networks:
            lines.append(
                "Emulated time: the emulated network's clock (dpsgd.netem; the latest peer's): each step's "
                "compute as measured (or network.compute_time where set) plus messages at alpha + bytes / beta of "
                f"{'; '.join(networks)}."
            )
    return lines


def _compute(runs: list[dict]) -> str:
    """The event simulator's compute times, as its runs' configs set them."""
    texts = {
        f"a {setting(r, 'backend.compute_distribution')} distribution of mean {setting(r, 'backend.compute_mean_s')} s"
        if not setting(r, "network.compute_time")
        else f"network.compute_time {setting(r, 'network.compute_time')} s"
        for r in runs
        if _simulated(r) and _asynchronous(r)
    }
    return " or ".join(sorted(texts)) + " per step (x network.compute_scale on network.slow_peers)"


def _emulates(run: dict) -> bool:
    return any(
        setting(run, f"network.{k}") not in (None, 0, 0.0, [], "[]")  # flat configs hold lists as text
        for k in ("latency_s", "bandwidth_bytes_per_s", "jitter_s", "compute_time", "slow_peers")
    )


def _sleeps(run: dict) -> bool:
    return setting(run, "network.mode") == "sleep"


def _network(run: dict) -> str:
    return (
        f"network {setting(run, 'network.name')} (latency {setting(run, 'network.latency_s')} s, bandwidth "
        f"{setting(run, 'network.bandwidth_bytes_per_s')} bytes/s, {setting(run, 'network.mode')} mode)"
    )


def clock_label(runs: list[dict], key: str) -> str:
    """An x axis' label naming its clock."""
    if key == "wall_time_s":
        return "simulator's wall time (s)" if all(_simulated(r) for r in runs) else "wall time (s)"
    if all(_simulated(r) and _asynchronous(r) for r in runs):
        return "simulated time (s, event simulator)"
    return "emulated time (s, dpsgd.netem)"


def settings(run: dict) -> dict:
    """The run's config keys that say what was run beyond its summary (algorithm options, budget, network,
    compression): columns of the report's CSV."""
    keys = ("epochs", "batch_size", "network.name", "compression.name")
    return {k: v for k, v in run["config"].items() if k.startswith(("algorithm.", "optimizer.")) or k in keys}


def figure_caption(
    runs: list[dict],
    swept: list[str],
    seed_counts: list[int],
    clock: str | None,
    bounds: str,
    copies: int = 0,
    marks: tuple[str, str] = ("line", "band"),
) -> str:
    """The caption under a figure: what was run, what its `marks` (a mean's and an interval's: line and band,
    point and bar) are, and the x axis' clock."""
    seeds, (mean, interval) = max(seed_counts), marks
    lines = (
        f"{mean.capitalize()}s: the mean over {seeds} seeds; {interval}s: the {intervals.CONFIDENCE:.0%} Student-t "
        f"interval, {bounds}."
        if seeds > 1
        else f"One seed per {mean}: no interval."
    )
    return " ".join(p for p in (what_was_run(runs, swept, copies), lines, clock) if p)


def wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width))
