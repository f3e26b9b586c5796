"""The contracts every distributed optimizer keeps (`DistributedOptimizer`, and `AsynchronousOptimizer` for
those with no global step). A rule talks to its peers only through the communicator's operations, so the one
statement of it runs on real peers and, on tensors with a leading peer axis, on the fleet (dpsgd.sim).
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from dpsgd.comm import Communicator, robust
from dpsgd.comm.codecs import Compressed
from topologies import Topology
from topologies.analysis import is_column_stochastic, is_doubly_stochastic

STATE_KEY = "dpsgd"  # where state_dict() keeps the algorithm's own state beside the base's
BUFFER_MODES = ("broadcast", "average", "local")  # what `buffers=` does with the module's buffers after each step


def _of_base(name: str, writable: bool = True) -> Any:
    """A property that reads (and writes) the attribute `name` of the wrapped optimizer, `self.base`."""

    def read(self):
        return getattr(self.base, name)

    def write(self, value) -> None:
        setattr(self.base, name, value)

    return property(read, write if writable else None, doc=f"The base optimizer's `{name}`.")


class DistributedOptimizer(torch.optim.Optimizer):
    """The contract every distributed optimizer keeps: it wraps a local torch optimizer and behaves like one.

    Constructed as `Algorithm(base, *, <its options>, topology=..., comm=..., broadcast_initial=True,
    module=None, buffers=None)`: `base` is any `torch.optim.Optimizer` (its `param_groups` and `state` are this
    optimizer's own, also after `load_state_dict` and `add_param_group`, so LR schedulers and gradient clipping
    act on what really steps); `topology` (`topologies.Topology`, n = `comm.size`) where the rule mixes; `comm`
    any `dpsgd.comm.Communicator`; `broadcast_initial=True` gives every peer rank 0's parameters at
    construction, as DDP does. `module` (the model, optional) makes its whole state come from rank 0 too
    (buffers, and parameters the base does not step, such as frozen layers), and `buffers` says what happens
    to its buffers after each step (see `BUFFER_MODES`): "broadcast" (rank 0's, as DDP's
    `broadcast_buffers`; the default), "average" (floating buffers averaged with the model's own exchange:
    mixed with W(k) by doubly stochastic gossip, else an exact mean, when the algorithm communicates) or
    "local" (each peer its own; the default of asynchronous optimizers, which have no global step). Both
    exchanges are counted in `comm.stats`.

    `step(closure=None)` is this class's, for every algorithm, in this order: torch's step pre-hooks; under
    `torch.amp.GradScaler` (`_step_supports_amp_scaling`: the scaler hands it `grad_scale` and `found_inf`)
    the gradients unscaled and the skip agreed with the peers (`agree_overflow`: one one-element all-reduce,
    not counted in `comm.stats`; every peer skips together, as DDP's ranks do, so no inf reaches a neighbour
    and the peers stay on one step; an asynchronous optimizer skips alone); the closure, if any; the
    algorithm's rule, `update()`, under `torch.no_grad()`; the module's buffers exchanged (`buffers=`);
    torch's step post-hooks. `state_dict()` holds the base's state and the algorithm's own
    (`algorithm_state()`), so a run resumes bit for bit.

    A subclass is its constructor and its rule:

    - `__init__(self, base, *, <its own options>, **common)` calling `super().__init__(base, **common)`
      (`common`: `topology`, `comm`, `broadcast_initial`, `module`, `buffers`; a rule that needs the topology
      may name it, `topology: Topology`, and hand it on), then checking its topology needs
      (`self.require_topology("doubly" | "column")`) and refusing a bad option in one line;
    - `update(self)`: the rule on the gradients in `.grad`, with `self.base.step()` and the communicator's
      operations (`self.comm.allreduce_mean`, `self.comm.mix(tensors, self.topology, self.step_count)`, ...),
      advancing `self.step_count`. It never defines `step()` (refused at construction: the skip and the
      buffers' exchange would be lost);
    - its own state in `algorithm_state()` / `load_algorithm_state()`, per-parameter state extended to a
      group added later in `param_group_added()`.

    What the experiments read of an algorithm is declared on its class (the fallbacks stand for a class that
    declares nothing): `label`, its name in captions and legends as papers write it (None: its config name);
    `knobs`, its own settings searched beside the learning rate when it is tuned, {config key: grid} (a
    dotted key reaches into an option, e.g. "outer.lr"; empty: the learning rate alone); `cost_form`, how
    the map's cost model (experiments.cost_model) prices its steps: "allreduce" (an all-reduce of the
    gradients every step), "periodic" (local steps and an all-reduce of the model every `period` steps, its
    constructor's default), "gossip" (one model to each neighbour of W(k) every step), "async" (AD-PSGD's
    pairwise averagings), or None (none of these: not on the map).
    """

    asynchronous: ClassVar[bool] = False  # True: no global step (see AsynchronousOptimizer)
    uses_topology: ClassVar[bool] = True  # False: `topology=` is accepted and ignored (reports collapse such runs)
    # True: its per-peer state has a rule for a world that re-forms with another peer count (dpsgd.elastic)
    elastic: ClassVar[bool] = False
    overlap: bool = False  # True: the training loop calls start_communication() before the forward pass
    _step_supports_amp_scaling: ClassVar[bool] = True  # GradScaler hands step() its scale and found_inf
    # what the experiments read (see above)
    label: ClassVar[str | None] = None
    knobs: ClassVar[Mapping[str, Sequence]] = {}
    cost_form: ClassVar[str | None] = None

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        topology: Topology | None = None,
        comm: Communicator,
        broadcast_initial: bool = True,
        module: torch.nn.Module | None = None,
        buffers: str | None = None,
    ):
        name = type(self).__name__
        if inspect.unwrap(type(self).step) is not inspect.unwrap(DistributedOptimizer.step):
            raise TypeError(
                f"{name} defines step(); write its rule as update(self) instead: DistributedOptimizer.step() "
                "calls it between GradScaler's agreed skip and the module's buffer exchange"
            )
        if not isinstance(base, torch.optim.Optimizer):
            raise TypeError(
                f"{name} wraps a local torch optimizer, e.g. {name}(torch.optim.SGD(model.parameters(), "
                f"lr=0.1), topology=..., comm=...); got {type(base).__name__}"
            )
        if comm is None:
            raise TypeError(f"{name} needs comm=dpsgd.comm.init(...)")
        if topology is not None and topology.n != comm.size:
            raise ValueError(
                f"{name}: the topology has {topology.n} peers but the communicator has {comm.size}; "
                f"build it with topologies.make(name, comm.size)"
            )
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"{name} module= takes the model (a torch.nn.Module), got {type(module).__name__}")
        if buffers is None:
            buffers = "local" if self.asynchronous else "broadcast"
        if buffers not in BUFFER_MODES:
            raise ValueError(f"{name} buffers must be one of {', '.join(BUFFER_MODES)}, got {buffers!r}")
        if self.asynchronous and buffers != "local":
            raise ValueError(
                f"{name} has no global step to exchange buffers at: buffers={buffers!r} needs a synchronous "
                "algorithm; use buffers='local'"
            )
        # No Optimizer.__init__: `param_groups`, `defaults` and `state` are properties reading the base's
        # (its load_state_dict replaces its group list), so LR schedulers and gradient clipping act on the
        # optimizer that really steps.
        self.base, self.comm, self.topology = base, comm, topology
        self.module, self.buffers = module, buffers
        self.broadcast_initial = bool(broadcast_initial)  # every peer started from rank 0's parameters
        self.step_count = 0  # global steps taken: selects the topology's matrix at each step
        self._agreed: bool | None = None  # this step's answer of agree_overflow, until the step ends
        for hooks in ("step", "state_dict", "load_state_dict"):  # the registries torch's Optimizer.__init__ makes
            setattr(self, f"_optimizer_{hooks}_pre_hooks", OrderedDict())
            setattr(self, f"_optimizer_{hooks}_post_hooks", OrderedDict())
        self._patch_step_function()  # torch's step pre/post hooks fire around our step()
        if broadcast_initial:
            comm.broadcast_(self.params() + self._module_state(), root=0)

    # --- the step: the same around every algorithm's rule ---------------------------------
    def step(self, closure=None):
        """One step (see the class): GradScaler's agreed skip, the closure, `update()`, the buffers' exchange.
        Returns the closure's loss (None without one, or when the step is skipped)."""
        try:
            if self._scaler_skips():
                return None
            loss = self._closure_loss(closure)
            with torch.no_grad():
                self.update()
            self._exchange_buffers()
            return loss
        finally:
            self._agreed = None  # the next step agrees anew

    def update(self) -> None:
        """The algorithm's rule, on the gradients in `.grad`: a subclass writes it (see the class)."""
        raise NotImplementedError(f"{type(self).__name__} must define update(self), its rule")

    # the base's own, read and written there (see __init__)
    state = _of_base("state", writable=False)
    param_groups = _of_base("param_groups")
    defaults = _of_base("defaults")

    def _module_state(self) -> list[torch.Tensor]:
        """The module's tensors beyond the stepped parameters: frozen (or otherwise unstepped) ones and buffers."""
        if self.module is None:
            return []
        seen = {id(p) for p in self.params()}
        out = []
        for t in [*self.module.parameters(), *self.module.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        return out

    def agree_overflow(self, found: bool) -> bool:
        """Whether any peer's gradients overflowed in this step (`found`: this peer's own), the step's one
        agreement of a GradScaler skip: one one-element all-reduce (`comm.any_peer`) on the communicator under
        its wrappers, not counted in `comm.stats`. None on a fleet (`comm.peer_shape`: its one scaler sees every
        peer's rows already), for an asynchronous optimizer (it skips its own step alone) or for one peer: there
        it is `found`. The first answer stands until the step ends (`step()` returns or skips), so the training
        loop may agree before `scaler.unscale_` and the optimizer's own check under `GradScaler.step` sends
        nothing more."""
        if self._agreed is None:
            if self.asynchronous or self.comm.size == 1 or self.comm.peer_shape:
                self._agreed = bool(found)
            else:  # a control message: the fleet, with the same numbers, sends none
                params = self.params()
                device = params[0].device if params else None
                self._agreed = _plain(self.comm).any_peer(bool(found), device)
        return self._agreed

    def _scaler_skips(self) -> bool:
        """Under `GradScaler.step` (which sets `found_inf` and `grad_scale` for the call): unscale the gradients
        and say whether this step is skipped, as agreed with the peers (`agree_overflow`): a peer stepping alone
        would leave the others waiting in their exchange, and a peer sending an inf would spoil its neighbours."""
        found_inf = self.__dict__.get("found_inf")
        if found_inf is None:
            return False
        self.check_grad_scaler()
        scale = self.__dict__.get("grad_scale")  # None: the user unscaled already (scaler.unscale_)
        if scale is not None:
            inv = scale.double().reciprocal().float()
            with torch.no_grad():
                for p in self.params():
                    if p.grad is not None:
                        p.grad.mul_(inv.to(p.grad.device))
        return self.agree_overflow(bool(found_inf.item() > 0))

    def check_grad_scaler(self) -> None:
        """Raise, saying what to change, if this optimizer cannot be stepped by a GradScaler as configured."""

    def buffers_due(self, step: int) -> bool:
        """Whether `buffers="average"` averages after global step `step` (1, 2, ...): when the model is
        exchanged; every step unless the algorithm says otherwise."""
        return True

    @torch.no_grad()
    def _exchange_buffers(self) -> None:
        if self.module is None or self.buffers == "local":
            return
        if self.buffers == "broadcast":  # rank 0's buffers: a sum to which only rank 0 contributes
            comm = _plain(self.comm)
            groups: dict[tuple, list[torch.Tensor]] = {}
            for b in self.module.buffers():
                groups.setdefault((b.dtype, b.device), []).append(b)
            for group in groups.values():
                sent = group if comm.rank == 0 else [torch.zeros_like(b) for b in group]
                for b, value in zip(group, comm.allreduce_sum(sent)):
                    b.copy_(value)
            return
        if not self.buffers_due(self.step_count):
            return
        comm = self.comm.exact  # the model's own exchange, uncompressed
        floating = [b for b in self.module.buffers() if b.is_floating_point()]  # counters stay local
        by_dtype: dict[tuple, list[torch.Tensor]] = {}
        for b in floating:
            by_dtype.setdefault((b.dtype, b.device), []).append(b)
        topology = self.topology if self.uses_topology and getattr(self, "_stochastic", None) == "doubly" else None
        for group in by_dtype.values():
            mean = comm.allreduce_mean(group) if topology is None else comm.mix(group, topology, self.step_count - 1)
            for b, value in zip(group, mean):
                b.copy_(value)

    def params(self) -> list[torch.Tensor]:
        """Every parameter of every group, in order (the tensors the rule updates)."""
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """The base's `add_param_group` (every peer calls it at the same step); the new parameters become rank
        0's on every peer, as at construction, and the algorithm extends its own state to them."""
        self.base.add_param_group(param_group)
        params = list(self.param_groups[-1]["params"])
        with torch.no_grad():
            self.comm.broadcast_(params, root=0)
        try:
            self.param_group_added(params)
        except BaseException:
            self.base.param_groups.pop()
            raise

    def param_group_added(self, params: list[torch.Tensor]) -> None:
        """Extend the algorithm's per-parameter state to a new group's `params`, or refuse saying why. Here:
        any group before the first step (state is made then); a subclass whose state grows overrides it."""
        if self.step_count > 0:
            raise ValueError(
                f"{type(self).__name__} keeps per-parameter state from its first step and cannot take a new "
                "parameter group now: add every group (with lr=0 to hold one back) before the first step"
            )

    def start_communication(self) -> None:
        """Start this step's exchange before the gradient is computed, where the algorithm can (`overlap`)."""

    def _closure_loss(self, closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def require_topology(self, stochastic: str | None = None, why: str = "") -> Topology:
        """The topology, or a one-line error saying how to give one; with `stochastic` ("doubly" or
        "column"), W(t) is checked for every t of one period (random schedules: `check_mixing(step)`)."""
        if self.topology is None:
            raise TypeError(f"{type(self).__name__} needs topology=topologies.make(NAME, comm.size)")
        if isinstance(self.comm, Compressed):  # gossip sends whole models: a codec of one message must encode them
            self.comm.elementwise(f"{type(self).__name__}'s gossip")
        if isinstance(self.comm, robust.Robust):  # the app's (its check builds one) and robust.wrap by hand
            robust.check_mixing(self.comm.rule, self.topology)
        self._stochastic, self._why = stochastic, why
        if stochastic is not None and self.topology.period is not None:
            for t in range(self.topology.period):
                self.check_mixing(t)
        return self.topology

    def check_mixing(self, step: int) -> None:
        """W(step) is the kind of stochastic the algorithm needs, or a one-line error saying what to use."""
        kind, topology = getattr(self, "_stochastic", None), self.topology
        if kind is None or topology is None or (topology.period is not None and step >= topology.period):
            return
        what, axis, line, advice = _ADVICE[kind]
        sparse_w = getattr(topology, "sparse_mixing_matrix", None)  # no (n, n) array for a large Topology
        w = sparse_w(step) if sparse_w is not None else topology.mixing_matrix(step)
        if not (is_doubly_stochastic if kind == "doubly" else is_column_stochastic)(w):
            sums = w.sum(axis=axis)
            i = int(abs(sums - 1).argmax())
            raise ValueError(
                f"{type(self).__name__} needs {what} mixing matrices{self._why}; topology "
                f"{topology.name!r} at step {step} has {line} {i} summing to {sums[i]:.6g} {advice}"
            )

    def own_tensors(self, saved: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """Saved per-parameter state, copied onto the parameters' devices and dtypes (load_state_dict)."""
        if saved is None:
            return None
        params = self.params()
        if len(saved) != len(params):
            raise ValueError(
                f"this state_dict holds {len(saved)} tensors per parameter list but the optimizer has "
                f"{len(params)} parameters: it was saved from a different model"
            )
        return [t.detach().clone().to(p.device, p.dtype) for t, p in zip(saved, params)]

    # --- state ----------------------------------------------------------------------------
    def algorithm_state(self) -> dict[str, Any]:
        """The algorithm's own state beyond the base optimizer's; subclasses extend it."""
        state: dict[str, Any] = {"step_count": self.step_count}
        if isinstance(self.comm, Compressed):  # its error memories: a resumed run continues bit for bit
            state["compression"] = self.comm.memory()
        return state

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        """Restore what `algorithm_state()` returned; subclasses extend it."""
        self.step_count = int(state["step_count"])
        if isinstance(self.comm, Compressed):
            self.comm.load_memory(state.get("compression"))

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state dict with the algorithm's own state under one more key."""
        sd = self.base.state_dict()
        sd[STATE_KEY] = self.algorithm_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a `state_dict()` of this algorithm (a plain torch optimizer's is refused, saying so)."""
        if STATE_KEY not in state_dict:
            raise ValueError(
                f"this state_dict has no '{STATE_KEY}' entry: it was saved from a plain torch optimizer, "
                f"not from {type(self).__name__}; load it into the base optimizer instead"
            )
        state_dict = dict(state_dict)
        self.load_algorithm_state(state_dict.pop(STATE_KEY))
        self.base.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base!r}, comm={self.comm!r})"


class PairwiseExchanges(Protocol):
    """One peer's side of an asynchronous algorithm's exchanges, in parts that its own threads call on real
    peers and the event simulator (dpsgd.sim.events) calls in virtual time: the asking side's `request` (after
    each step; locks x_i and returns (partner, message), None when nothing is due), the answering side's atomic
    `serve` (the reply, or None for a message that needs none) and the asker's `complete`; `tick` lets the
    answering side act on its own (a quorum's grace window: the time it next wants to act, None for never);
    `closing` is the message a finished peer sends each partner in virtual time (None: nothing it acts on)."""

    lock: Any  # held from request to complete: a step waits for it
    partners: frozenset[int]
    message_numel: int  # entries of a request (a closing DONE has as many)

    def request(self) -> tuple[int, torch.Tensor] | None: ...
    def serve(self, request: torch.Tensor) -> torch.Tensor | None: ...
    def complete(self, partner: int, reply: torch.Tensor) -> None: ...
    def tick(self) -> float | None: ...
    def closing(self) -> torch.Tensor | None: ...


@runtime_checkable
class AsynchronousOptimizer(Protocol):
    """What the training loop and the event simulator ask of an optimizer with no global step
    (`asynchronous = True`): each peer steps at its own pace until its budget is spent, then `finish()`
    ends its part so that collectives may run again. It checks its own topology needs in its constructor
    (a ValueError saying what to use). It describes its own measurements: `measurements()` are one
    peer's figures (JSON values, with at least `steps` and `samples`), and `summary(rows)`, from every
    peer's figures in rank order (each with the loop's `slowdown_s`), is summary.json's block `summary_key`.
    The event simulator (dpsgd.sim.events) runs it with `start(threads=False)` and performs its exchanges
    (`exchanges`: request, serve, complete, tick, closing) in virtual time (`comm.clock`). Optional: a class
    with `final_broadcast = True` ends with every peer on rank 0's model (the simulator calls rank 0's
    `conclude()` and the others' `adopt_final(x)`), and a `failures` schedule ([(peer, at_s, down_s)]) makes
    the simulator call that peer's `fail()` and, down_s later, `restart()`."""

    asynchronous: ClassVar[bool]
    summary_key: ClassVar[str]
    step_count: int
    budget: str  # what ends a peer's run: "steps", "samples" or "seconds"
    role: str  # "active" (starts exchanges), "passive" (serves them) or "alone"
    exchanges: PairwiseExchanges
    live: torch.Tensor  # x_i, flat
    staleness: int  # exchanges applied to x_i since the snapshot the next gradient is taken at
    wait_s: float  # time its steps waited for x_i (locked by an exchange in flight)

    set_budget: Callable[..., None]  # (steps=, samples=, seconds=, samples_per_step=): ADPSGD.set_budget

    def step(self, closure=None) -> Any: ...  # the simulator calls it too (DistributedOptimizer's, around update())
    def start(self, threads: bool = True) -> None: ...
    def should_stop(self) -> bool: ...
    def finish(self) -> None: ...
    def abort(self) -> None: ...
    def measurements(self) -> dict: ...
    def summary(self, rows: list[dict]) -> dict: ...
    def settle(self) -> None: ...  # before a checkpoint: no exchange of this peer in flight


_ADVICE = {
    "doubly": (
        "doubly stochastic",
        1,
        "row",
        "(a directed push-sum matrix?) - use an undirected topology, or SGP for directed ones",
    ),
    "column": ("column stochastic", 0, "column", "- use a directed (push-sum) or undirected topology"),
}


def _plain(comm: Communicator) -> Communicator:
    """The communicator under its wrappers (compression, robust aggregation: each keeps it as `inner`), for
    messages that are no model exchange: a skip flag, or rank 0's buffers (a robust rule or a codec would
    turn a sum with zeros into something else)."""
    while getattr(comm, "inner", None) is not None:
        comm = comm.inner  # type: ignore[attr-defined]
    return comm


@torch.no_grad()
def snapshot(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of `params` (a point to come back to, or to take a gradient at)."""
    return [p.detach().clone() for p in params]
