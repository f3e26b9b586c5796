"""A run's parts from its typed config (dpsgd.config.RunConfig): the plan (`plan`: data split, each peer's share,
steps per epoch, the budget of steps and samples), then one peer's parts (`build_peer`): batches, model, topology,
base and distributed optimizer, loss, network emulation, faults and its step (dpsgd.stepping.TrainStep).
Construction only: nothing here runs while a run trains.

Real peers, the fleet, the event simulator, elastic runs and the app's checks build through here, so a config
means the same thing everywhere. A model, algorithm, optimizer or topology config may name its own class or
function with Hydra's `_target_` (e.g. `model._target_=mypkg.MyNet`): it is imported and called with the
config's other keys (a model with no positional arguments; a distributed optimizer with the base optimizer,
`topology=` and `comm=`; a base optimizer with the parameters; a topology with the number of peers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

import topologies
from dpsgd import data, faults, metrics, models, placement, supervisor
from dpsgd.comm import codecs, corrupt, netem, robust
from dpsgd.config import Choice, DataConfig, RunConfig
from dpsgd.optim import ALGORITHMS, BASE_OPTIMIZERS, DistributedOptimizer, MuonAdamW, build_base, hidden_matrices
from dpsgd.options import check_options, factories, import_target, refuse_unknown
from dpsgd.schedule import Schedule
from dpsgd.seeds import batch_seed
from dpsgd.stepping import StepOptions, Stepper, TrainStep

# what the app hands every distributed optimizer itself: never an option of its config
SET_HERE = ("base", "topology", "comm", "module", "buffers")
_DATA_OPTIONS = (
    "root",
    "num_samples",
    "num_features",
    "num_classes",
    "seq_len",
    "samples_per_peer",
    "heterogeneity",
    "test_samples",
)


def build_topology(topology: Choice, n: int) -> topologies.Topology:
    """The config's topology for n peers: a built-in name, or a `_target_` function (n, **options) -> Topology."""
    options = {k: v for k, v in topology.options.items() if v is not None}
    if topology.target:
        return import_target(topology.target, "topology")(n, **options)
    return topologies.make(topology.name, n, **options)


def load_data(section: DataConfig, seed: int, peers: int) -> data.Split:
    """The config's dataset with its held-out split (seeded by `data.split_seed`, else the run's `seed`)."""
    options = {k: getattr(section, k) for k in _DATA_OPTIONS if getattr(section, k) is not None}
    if section.name == "heterogeneous_regression":
        if section.partition != "blocks":  # another partition mixes the peers' problems: x* is no longer known
            raise ValueError(
                "data=heterogeneous_regression gives peer i the i-th block, its own problem: it needs "
                f"data.partition=blocks, got {section.partition!r}"
            )
        options["peers"] = peers  # one problem per peer of the run
    if section.image_shape is not None:
        options["image_shape"] = tuple(int(s) for s in section.image_shape)  # hashable: data.load caches
    if section.validation_fraction:
        options["validation_fraction"] = float(section.validation_fraction)
    return data.load(section.name, section.test_fraction, section.seed_of_split(seed), **options)


def fitted_batch_size(run: RunConfig) -> tuple[int, str | None]:
    """Many peers on a small dataset: with the iid partition, a `batch_size` larger than a peer's share (e.g.
    digits' 1437 training samples over 256 peers: 5 each) becomes the share, so every peer takes one step per
    epoch on all its samples. Returns the batch size to use and a note saying so (None if unchanged)."""
    if run.data.partition != "iid":
        return run.batch_size, None
    samples = len(load_data(run.data, run.seed, run.peers).x_train)
    share = samples // run.peers
    if share < 1 or run.batch_size <= share:
        return run.batch_size, None  # fits, or no data for every peer at all: the partition says so
    note = (
        f"batch_size {run.batch_size} is more than each peer's share of {run.data.name} "
        f"({samples} training samples / {run.peers} peers = {share}); using batch_size={share}"
    )
    return share, note


def build_model(model: Choice, split: data.Split, seed: int, dataset: str) -> torch.nn.Module:
    """The config's model, the same initial parameters on every peer (one seed); one with no parameter is refused."""
    options = {k: v for k, v in model.options.items() if v is not None}
    if model.target:
        cls = import_target(model.target, "model")
        check_options(f"model._target_={model.target}", cls, options, key="model")
        with models.seeded(seed):
            built = cls(**options)
    else:
        if not split.x_train.is_floating_point() and model.name not in models.LANGUAGE_MODELS:  # token ids (text)
            raise ValueError(
                f"model {model.name} takes real-valued features, but data {dataset} gives token ids (text); "
                f"use model=transformer, model=char_gpt or model=char_gpt_small"
            )
        if (
            model.name in models.OPTIONS
        ):  # models.build takes every model's options: one another model reads goes unused
            refuse_unknown(f"model {model.name}", options, models.OPTIONS[model.name])
        built = models.build(model.name, split.input_shape, split.num_classes or 1, seed, **options)
    if not any(True for _ in built.parameters()):
        raise ValueError(f"the model {model.target or model.name!r} has no parameters to train")
    return built


def algorithm_class(algorithm: Choice) -> type[DistributedOptimizer]:
    """The algorithm class a config names (its `_target_` or a registered name)."""
    if algorithm.target:
        return import_target(algorithm.target, "algorithm")
    if algorithm.name not in ALGORITHMS:
        raise ValueError(
            f"unknown algorithm {algorithm.name!r}; valid algorithms: {', '.join(ALGORITHMS)} "
            f"(or set algorithm._target_ to your own class)"
        )
    return ALGORITHMS[algorithm.name]


def base_optimizer(
    optimizer: Choice, params, model: torch.nn.Module | None = None, peer_dims: int = 0
) -> torch.optim.Optimizer:
    """The base optimizer the `optimizer=` config names (a key of BASE_OPTIMIZERS, or a torch optimizer class its
    `_target_` names) with the options its class takes (lr, momentum, betas, weight_decay, ...). `optimizer=muon`
    (MuonAdamW) splits `params` by `model`'s layers (optim.muon.hidden_matrices: `params` in model.parameters()
    order, on a fleet stacked with `peer_dims` leading peer axes)."""
    options = dict(optimizer.options)
    cls = import_target(optimizer.target, "optimizer") if optimizer.target else BASE_OPTIMIZERS.get(optimizer.name)
    if cls is None:
        raise ValueError(f"unknown optimizer {optimizer.name!r}; valid optimizers: {', '.join(BASE_OPTIMIZERS)}")
    set_here = ("params", "hidden", "peer_dims") if cls is MuonAdamW else ("params",)
    check_options(f"optimizer {optimizer.name} ({cls.__name__})", cls, options, set_here=set_here, key="optimizer")
    if cls is MuonAdamW:
        if model is None:
            raise ValueError("optimizer=muon needs the model to tell its hidden matrices from its output layer")
        options.update(hidden=hidden_matrices(model), peer_dims=peer_dims)
    lr = options.get("lr")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0):
        raise ValueError(f"optimizer.lr must be a number > 0, got {lr!r}")
    if optimizer.target:
        return cls(params, **options)
    return build_base(params, optimizer.name, **options)


def build_optimizer(
    run: RunConfig,
    params,
    topology,
    comm,
    module: torch.nn.Module | None = None,
    model: torch.nn.Module | None = None,
) -> DistributedOptimizer:
    """The run's distributed optimizer (`algorithm=`, a registered name or a `_target_` class) stepping its base
    optimizer (`optimizer=`) over `params`, talking through `comm` wearing the run's `compression` (codecs.wrap) and
    robust rule with its corrupt peers (robust.wrap): real peers and the fleet alike. `module`: a real peer's
    model, whose buffers the run's `buffers` (broadcast, average, local) governs; `model` (the fleet's or the event
    simulator's one model, its parameters in `params`' order): what optimizer=muon splits by where `module` is none."""
    options = dict(run.algorithm.options)
    if module is not None:
        options.update(module=module, buffers=run.buffers)
    comm = codecs.wrap(comm, run.compression.as_dict())  # every algorithm's means and mixes, encoded
    f = run.faults  # checked before any peer starts (dpsgd.faults.FaultPlan)
    corrupted = corrupt.from_faults(
        faults.FaultPlan(**dataclasses.asdict(f)).corrupt_peers, f.corrupt_mode, f.corrupt_scale, comm.size, run.seed
    )
    comm = robust.wrap(comm, run.robust.as_dict(), corrupted)  # corrupt senders, robust receivers (off by default)
    algorithm = algorithm_class(run.algorithm)
    what = f"algorithm {run.algorithm.name} ({algorithm.__name__})"
    check_options(what, algorithm, options, set_here=SET_HERE, key="algorithm")
    base = base_optimizer(run.optimizer, params, module or model, len(comm.peer_shape))
    return algorithm(base, topology=topology, comm=comm, **factories(options))


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
    augment: str = "none"  # data.augment: the batches' random crops and flips

    def batches(self, rank: int, device: torch.device | str = "cpu") -> data.Batches:
        """Peer `rank`'s minibatches of its share on `device`, in the order that peer draws them (every kind of
        run of the config draws the same)."""
        share = self.shares[rank]
        x, y = self.split.x_train[share].to(device), self.split.y_train[share].to(device)
        return data.Batches(x, y, self.batch_size, seed=batch_seed(self.seed, rank), augment=self.augment)

    def epoch(self, samples: float) -> float:
        """The epochs `samples` training samples (by all peers together) make."""
        return samples / self.samples_per_epoch

    def class_histograms(self) -> list:
        """Each peer's number of training samples per class."""
        return [data.class_histogram(self.split.y_train[s], self.split.num_classes) for s in self.shares]


def plan(run: RunConfig, peers: int | None = None) -> Plan:
    """The plan of `run` in a world of `peers` (default: the configured peers)."""
    n = run.peers if peers is None else int(peers)
    split, bs = load_data(run.data, run.seed, n), run.batch_size
    planned = run.peers if run.elastic else n
    samples_per_epoch = max(1, len(split.x_train) // (planned * bs)) * planned * bs
    d = run.data
    return Plan(
        split=split,
        shares=data.partition(
            split.y_train.numpy(),
            n,
            run.seed,
            d.partition,
            alpha=d.alpha,
            shards_per_peer=d.shards_per_peer,
            min_size=bs,
        ),
        peers=n,
        batch_size=bs,
        steps_per_epoch=max(1, len(split.x_train) // (n * bs)),
        total_steps=-(-run.epochs * samples_per_epoch // (n * bs)),  # ceil
        samples_per_epoch=samples_per_epoch,
        total_samples=run.epochs * samples_per_epoch,
        seed=run.seed,
        augment=d.augment,
    )


def step_options(run: RunConfig) -> StepOptions:
    """The run's precision, clipping and micro-batches, checked against its batch size."""
    options = StepOptions(run.precision, run.clip_grad_norm, run.accumulate)
    options.check_batch(run.batch_size)
    return options


def schedule(run: RunConfig, total_steps: int) -> Schedule:
    return Schedule.of(run.schedule.name, run.schedule.options, total_steps)


@dataclass
class Peer:
    """Everything one peer trains with; `step(k)` takes its step k (dpsgd.stepping.TrainStep)."""

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
    stepper: Stepper  # precision, micro-batches, clipping and the schedule's rate
    step: TrainStep


def build_peer(comm, run: RunConfig) -> Peer:
    """Peer `comm.rank`'s parts for `run`, in a world of `comm.size` peers."""
    network = netem.NetworkEmulator.from_config(run.network, comm.rank, comm.size, run.seed)
    comm.attach_network(network)  # before the optimizer: some exchange at construction
    device = placement.place(run, comm.rank, comm.size, in_process=comm.in_process)
    parts = plan(run, comm.size)
    split = parts.split
    model = build_model(run.model, split, run.seed, run.data.name).to(device)
    topology = build_topology(run.topology, comm.size)
    optimizer = build_optimizer(run, model.parameters(), topology, comm, module=model)
    stepper = Stepper(step_options(run), optimizer, schedule(run, parts.total_steps), device)
    batches = parts.batches(comm.rank, device)
    loss_fn = metrics.loss_function(split.y_train)
    injector = faults.FaultInjector.from_config(run.faults, comm, run.seed)
    rank = comm.rank
    return Peer(
        plan=parts,
        batches=batches,
        x_test=split.x_test.to(device),
        y_test=split.y_test.to(device),
        model=model,
        topology=topology,
        optimizer=optimizer,
        loss_fn=loss_fn,
        network=network,
        faults=injector,
        seed=run.seed,
        stepper=stepper,
        step=TrainStep(
            stepper,
            batches,
            lambda x, y: loss_fn(model(x), y),
            device,
            before=(lambda step: supervisor.report_step(rank, step), injector.before_step),
            compute=network,
        ),
    )


def check_build(run: RunConfig, peers: int, processes: bool = False, simulated: bool = False) -> None:
    """What building the run's peers would refuse, found before any starts: peer 0 of a world of `peers` built as
    a real peer builds itself (the plan: data, partition, budget; the model; the algorithm with its options on this
    topology), alone (it must not wait for the others' parameters) and on the CPU (the driver keeps off the GPUs its
    peers will use); with `processes`, the GPU peer 0 would take is checked too. `simulated`: the event simulator's
    peer, whose communicator keeps a virtual clock (what an optimizer's simulator-only options look for)."""
    from dpsgd.comm import LocalCommunicator, LocalWorld
    from dpsgd.config import FaultsConfig

    if processes:
        nccl = placement.uses_nccl(run.backend, run.device)
        placement.peer_device(run.device, 0, peers, nccl=nccl, share=run.device_share)
    else:  # peers in one process share its device
        placement.single_device(run.device)
    a = run.algorithm
    alone = run.replace(
        faults=FaultsConfig(),
        device="cpu",
        algorithm=Choice(a.name, a.target, {**a.options, "broadcast_initial": False}),
    )
    comm = LocalCommunicator(LocalWorld(peers), 0, run.comm.timeout_s)
    if simulated:
        comm.clock = lambda: 0.0  # type: ignore[attr-defined]
    build_peer(comm, alone)
