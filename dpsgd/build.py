"""A run's plan and one peer's parts, built from a resolved experiment config (a plain dict): the plan
(`plan`: data split, each peer's share, steps per epoch, the budget of steps and samples), then batches,
model, topology, base and distributed optimizer, loss, straggler emulation.

Real peers, the fleet, the event simulator, elastic runs and the config validator build through here, so
a config means the same thing everywhere. A model, algorithm or topology config may name its own class or
function with Hydra's `_target_` (e.g. `model._target_=mypkg.MyNet`): it is imported and called with
the config's other keys (a model with no positional arguments; a distributed optimizer with the base
optimizer, `topology=` and `comm=`; a topology with the number of peers).
"""

from __future__ import annotations

import functools
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

import topologies
from dpsgd import data, faults, metrics, models, placement, supervisor
from dpsgd.comm import codecs, corrupt, netem, robust
from dpsgd.optim import DistributedOptimizer, build_base
from dpsgd.schedule import Schedule
from dpsgd.seeds import batch_seed
from dpsgd.stepping import StepOptions, Stepper

BASE_KEYS = ("name", "optimizer", "lr", "momentum", "weight_decay", "nesterov", "_target_")


def import_target(target: str, what: str):
    """The class a `_target_` names ('package.module.Class'), or a one-line error."""
    try:
        if "." not in str(target):
            raise ValueError("no module named")
        return pkgutil.resolve_name(str(target))
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(
            f"{what}._target_={target!r} cannot be imported ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0]}); give 'package.module.Class' importable here"
        ) from None


def check_options(what: str, fn: Callable, options: Mapping, *, set_here: tuple[str, ...] = ()) -> None:
    """A config's keys that `fn` does not take, refused by name with the ones it does (where a TypeError said
    only "__init__() got an unexpected keyword argument"). `set_here`: arguments the app passes itself, not
    listed; a `fn` that hands unnamed keywords on (`**options`) refuses them itself."""
    import inspect

    parameters = dict(inspect.signature(fn).parameters)
    # a class whose constructor hands `**options` to its parent's (every optimizer's `**common`, QGM's to DPSGD's):
    # the parents' keywords too, listed first (the common ones, then the algorithm's own)
    for parent in inspect.getmro(fn)[1:] if inspect.isclass(fn) else ():
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            break
        own = {k: p for k, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        parameters = {**inspect.signature(parent).parameters, **own}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    accepted = [k for k, p in parameters.items() if p.kind is not inspect.Parameter.POSITIONAL_ONLY]
    refuse_unknown(what, options, accepted, listed=[k for k in parameters if k not in set_here])


def refuse_unknown(what: str, options: Mapping, accepted, listed=None) -> None:
    """Refuse by name the keys of `options` not among `accepted`, saying the options (`listed`, or `accepted`)."""
    unknown = [k for k in options if k not in accepted]
    if unknown:
        takes = ", ".join(accepted if listed is None else listed) or "none"
        raise ValueError(f"{what} takes no option {', '.join(map(repr, unknown))}; its options: {takes}")


def factories(options: dict) -> dict:
    """The algorithm's options with each `_target_` dict (e.g. `outer: {_target_: torch.optim.SGD, lr: 0.7}`)
    made the factory it names: the class with the dict's other keys bound (functools.partial)."""
    made = {}
    for key, value in options.items():
        if isinstance(value, Mapping) and "_target_" in value:
            rest = {k: v for k, v in value.items() if k != "_target_"}
            value = functools.partial(import_target(value["_target_"], f"algorithm.{key}"), **rest)
        made[key] = value
    return made


def build_topology(cfg: dict, n: int) -> topologies.Topology:
    """The config's topology for n peers: a built-in name, or a `_target_` function (n, **options) -> Topology."""
    t = cfg["topology"]
    options = {k: v for k, v in t.items() if k not in ("name", "_target_") and v is not None}
    if t.get("_target_"):
        return import_target(t["_target_"], "topology")(n, **options)
    return topologies.make(t["name"], n, **options)


def load_data(cfg: dict) -> data.Split:
    d = cfg["data"]
    keys = ("root", "num_samples", "num_features", "num_classes", "seq_len", "samples_per_peer", "heterogeneity")
    options = {k: d[k] for k in keys if d.get(k) is not None}
    if d["name"] == "heterogeneous_regression":
        if d.get("partition") != "blocks":  # another partition mixes the peers' problems: x* is no longer known
            raise ValueError(
                "data=heterogeneous_regression gives peer i the i-th block, its own problem: it needs "
                f"data.partition=blocks, got {d.get('partition')!r}"
            )
        options["peers"] = int(cfg["peers"])  # one problem per peer of the run
    if d.get("image_shape") is not None:
        options["image_shape"] = tuple(int(s) for s in d["image_shape"])  # hashable: data.load caches
    if d.get("validation_fraction"):
        options["validation_fraction"] = float(d["validation_fraction"])
    return data.load(d["name"], d.get("test_fraction", 0.2), split_seed(cfg), **options)


def split_seed(cfg: dict) -> int:
    """The seed of the test (and validation) split: `data.split_seed`, else the run's seed."""
    fixed = cfg["data"].get("split_seed")
    return int(cfg["seed"]) if fixed is None else int(fixed)


def fit_batch_size(cfg: dict) -> str | None:
    """Many peers on a small dataset: with the iid partition, a `batch_size` larger than a peer's share
    (e.g. digits' 1437 training samples over 256 peers: 5 each) becomes the share, so every peer takes one
    step per epoch on all its samples. Changes `cfg` and returns a note saying so (None if unchanged)."""
    if cfg["data"].get("partition", "iid") != "iid" or int(cfg["peers"]) < 1:
        return None
    samples = len(load_data(cfg).x_train)
    share = samples // int(cfg["peers"])
    if share < 1 or int(cfg["batch_size"]) <= share:
        return None  # fits, or no data for every peer at all: the partition says so
    note = (
        f"batch_size {cfg['batch_size']} is more than each peer's share of {cfg['data']['name']} "
        f"({samples} training samples / {cfg['peers']} peers = {share}); using batch_size={share}"
    )
    cfg["batch_size"] = share
    return note


def partition(cfg: dict, split: data.Split, peers: int) -> list:
    d = cfg["data"]
    return data.partition(
        split.y_train.numpy(),
        peers,
        int(cfg["seed"]),
        d.get("partition", "iid"),
        alpha=float(d.get("alpha", 0.5)),
        shards_per_peer=int(d.get("shards_per_peer", 2)),
        min_size=int(cfg["batch_size"]),
    )


def build_model(cfg: dict, split: data.Split) -> torch.nn.Module:
    """The config's model, the same initial parameters on every peer (one seed); one with no parameter is refused."""
    options = {k: v for k, v in cfg["model"].items() if k not in ("name", "_target_") and v is not None}
    seed = int(cfg["seed"])
    target = cfg["model"].get("_target_")
    if target:
        cls = import_target(target, "model")
        check_options(f"model._target_={target}", cls, options)
        with models.seeded(seed):
            model = cls(**options)
    else:
        name = cfg["model"]["name"]
        if not split.x_train.is_floating_point() and name != "transformer":  # a text dataset's token ids
            raise ValueError(
                f"model {name} takes real-valued features, but data {cfg['data']['name']} gives token ids (text); "
                f"use model=transformer"
            )
        if name in models.OPTIONS:  # models.build takes every model's options: one another model reads would go unused
            refuse_unknown(f"model {name}", options, models.OPTIONS[name])
        model = models.build(name, split.input_shape, split.num_classes or 1, seed, **options)
    if not any(True for _ in model.parameters()):
        raise ValueError(f"the model {target or cfg['model']['name']!r} has no parameters to train")
    return model


def check_algorithm(cfg: dict):
    """The algorithm class a config names (its `_target_` or a registered name)."""
    from dpsgd.optim import ALGORITHMS

    algo = cfg["algorithm"]
    if algo.get("_target_"):
        return import_target(algo["_target_"], "algorithm")
    if algo.get("name") not in ALGORITHMS:
        raise ValueError(
            f"unknown algorithm {algo.get('name')!r}; valid algorithms: {', '.join(ALGORITHMS)} "
            f"(or set algorithm._target_ to your own class)"
        )
    return ALGORITHMS[algo["name"]]


def base_optimizer(cfg: dict, params) -> torch.optim.Optimizer:
    """The local optimizer the algorithm config names (its `optimizer`, `lr`, `momentum`, ...)."""
    algo = cfg["algorithm"]
    return build_base(
        params,
        name=algo.get("optimizer", "sgd"),
        lr=float(algo["lr"]),
        momentum=float(algo.get("momentum", 0.0)),
        weight_decay=float(algo.get("weight_decay", 0.0)),
        nesterov=bool(algo.get("nesterov", False)),
    )


def build_optimizer(cfg: dict, params, topology, comm, module: torch.nn.Module | None = None) -> DistributedOptimizer:
    """The config's distributed optimizer (a registered name or a `_target_` class) over `params`, talking
    through `comm` wearing the config's `compression` (dpsgd.comm.codecs.wrap): real peers and the fleet alike.
    `module`: a real peer's model, whose buffers the config's `buffers` (broadcast, average, local) governs."""
    options = {k: v for k, v in cfg["algorithm"].items() if k not in BASE_KEYS}
    if module is not None:
        options.update(module=module, buffers=cfg.get("buffers"))
    comm = codecs.wrap(comm, cfg.get("compression"))  # every algorithm's means and mixes, encoded
    corrupted = corrupt.from_faults(cfg.get("faults"), comm.size, int(cfg.get("seed", 0)))
    comm = robust.wrap(comm, cfg.get("robust"), corrupted)  # corrupt senders, robust receivers (both: off by default)
    algorithm = check_algorithm(cfg)
    set_here = ("base", "topology", "comm", "module", "buffers")
    check_options(
        f"algorithm {cfg['algorithm'].get('name')} ({algorithm.__name__})", algorithm, options, set_here=set_here
    )
    return algorithm(base_optimizer(cfg, params), topology=topology, comm=comm, **factories(options))


@dataclass(frozen=True)
class Plan:
    """What every kind of run of a config trains on: the data split, each peer's share of the training set,
    and the budget. Every peer takes `steps_per_epoch` steps of `batch_size` per epoch; the budget is `epochs`
    passes of the configured `peers` (an elastic world of another size spends the same samples)."""

    split: data.Split
    shares: list  # each peer's training sample indices
    peers: int  # the world's size
    batch_size: int
    steps_per_epoch: int
    total_steps: int
    samples_per_epoch: int
    total_samples: int
    seed: int

    def batches(self, rank: int, device: torch.device | str = "cpu") -> data.Batches:
        """Peer `rank`'s minibatches of its share on `device`, in the order that peer draws them (every kind of
        run of the config draws the same)."""
        share = self.shares[rank]
        x, y = self.split.x_train[share].to(device), self.split.y_train[share].to(device)
        return data.Batches(x, y, self.batch_size, seed=batch_seed(self.seed, rank))

    def epoch(self, samples: float) -> float:
        """The epochs `samples` training samples (by all peers together) make."""
        return samples / self.samples_per_epoch

    def class_histograms(self) -> list:
        """Each peer's number of training samples per class."""
        return [data.class_histogram(self.split.y_train[s], self.split.num_classes) for s in self.shares]


def plan(cfg: dict, peers: int | None = None) -> Plan:
    """The plan of the run `cfg` in a world of `peers` (default: the configured peers)."""
    n = int(cfg["peers"]) if peers is None else int(peers)
    split, bs = load_data(cfg), int(cfg["batch_size"])
    planned = int(cfg["peers"]) if cfg.get("elastic") else n
    samples_per_epoch = max(1, len(split.x_train) // (planned * bs)) * planned * bs
    return Plan(
        split=split,
        shares=partition(cfg, split, n),
        peers=n,
        batch_size=bs,
        steps_per_epoch=max(1, len(split.x_train) // (n * bs)),
        total_steps=-(-int(cfg["epochs"]) * samples_per_epoch // (n * bs)),  # ceil
        samples_per_epoch=samples_per_epoch,
        total_samples=int(cfg["epochs"]) * samples_per_epoch,
        seed=int(cfg["seed"]),
    )


@dataclass
class Peer:
    """Everything one peer trains with."""

    plan: Plan
    batches: data.Batches
    x_test: torch.Tensor
    y_test: torch.Tensor
    model: torch.nn.Module
    topology: topologies.Topology
    optimizer: DistributedOptimizer
    loss_fn: Callable[..., torch.Tensor]
    network: netem.NetworkEmulator  # attached to the communicator: link costs, clock, compute slowdown
    faults: faults.FaultInjector
    seed: int
    stepper: Stepper  # precision, micro-batches, clipping and the schedule's rate (dpsgd.stepping)

    def before_step(self, step: int) -> None:
        """Step `step` begins: tell the driver that started this process (if one did), then inject
        the configured fault, if any; the schedule sets the step's learning rate."""
        supervisor.report_step(self.faults.comm.rank, step)
        self.faults.before_step(step)
        self.stepper.begin(step)

    def train_step(self) -> float:
        """One minibatch: forward (in the config's precision) and backward of each micro-batch (under the
        compute emulation), the optimizer's step; returns the minibatch loss."""
        x, y = self.batches.next()
        if self.optimizer.overlap:
            self.optimizer.start_communication()  # x^k travels while the gradient is computed
        self.network.start_compute()
        self.optimizer.zero_grad()
        stepper, total = self.stepper, 0.0
        for xm, ym in stepper.options.split(x, y):
            with stepper.options.autocast(x.device):
                loss = self.loss_fn(self.model(xm), ym)
            stepper.backward(loss)
            total += loss.item()
        self.network.finish_compute()
        stepper.step()
        return total / stepper.options.accumulate


def describe(cfg: dict, topology, comm) -> dict:
    """What the run was: the first keys of every summary.json."""
    return {
        "algorithm": cfg["algorithm"]["name"],
        "topology": cfg["topology"]["name"],
        "peers": comm.size,
        "backend": comm.backend,
        "dataset": cfg["data"]["name"],
        "partition": cfg["data"].get("partition", "iid"),
        "model": cfg["model"]["name"],
        "seed": int(cfg["seed"]),
        "evaluated_on": "validation" if cfg["data"].get("validation_fraction") else "test",
        "spectral_gap": float(topologies.analysis.spectral_gap(topology)),
    }


def build_peer(comm, cfg: dict) -> Peer:
    seed = int(cfg["seed"])
    network = netem.NetworkEmulator.from_config(cfg.get("network"), comm.rank, comm.size, seed)
    comm.attach_network(network)  # before the optimizer: some exchange at construction
    device = placement.place(cfg, comm.rank, comm.size, in_process=comm.in_process)
    run = plan(cfg, comm.size)
    split = run.split
    model = build_model(cfg, split).to(device)
    topology = build_topology(cfg, comm.size)
    optimizer = build_optimizer(cfg, model.parameters(), topology, comm, module=model)
    synchronous = not getattr(optimizer, "asynchronous", False)  # peers in lockstep can agree on a skip
    return Peer(
        plan=run,
        batches=run.batches(comm.rank, device),
        x_test=split.x_test.to(device),
        y_test=split.y_test.to(device),
        model=model,
        topology=topology,
        optimizer=optimizer,
        loss_fn=metrics.loss_function(split.y_train),
        network=network,
        faults=faults.FaultInjector.from_config(cfg, comm),
        seed=seed,
        stepper=Stepper(
            StepOptions.from_config(cfg),
            optimizer,
            Schedule(cfg.get("schedule"), run.total_steps),
            device,
            agree=(lambda flag: comm.any_peer(flag, device)) if synchronous else None,
        ),
    )
