"""Whether a topology suits an algorithm: one-line errors that say what is wrong and what to use."""

from __future__ import annotations

from topologies.analysis import is_column_stochastic, is_doubly_stochastic


def check_topology(topology, comm, algorithm: str) -> None:
    if topology is None:
        raise TypeError(f"{algorithm} needs topology=topologies.make(NAME, comm.size)")
    if topology.n != comm.size:
        raise ValueError(
            f"{algorithm}: the topology has {topology.n} peers but the communicator has {comm.size}; "
            f"build it with topologies.make(name, comm.size)"
        )


_ADVICE = {
    "doubly": ("doubly stochastic", 1, "row", "(a directed push-sum matrix?) - use an undirected topology, "
               "or SGP for directed ones"),
    "column": ("column stochastic", 0, "column", "- use a directed (push-sum) or undirected topology"),
}


def check_stochastic(topology, algorithm: str, kind: str, step: int | None = None, why: str = "") -> None:
    """Raise a one-line ValueError unless W(t) is `kind` ("doubly" or "column") stochastic for every
    t of one period, or at `step` (random schedules are checked as they are used)."""
    if step is None:
        period = getattr(topology, "period", 1)
        if period is None:
            return
        steps = range(period)
    else:
        steps = [step]
    what, axis, line, advice = _ADVICE[kind]
    test = is_doubly_stochastic if kind == "doubly" else is_column_stochastic
    for t in steps:
        w = topology.mixing_matrix(t)
        if not test(w):
            sums = w.sum(axis=axis)
            i = int(abs(sums - 1).argmax())
            raise ValueError(
                f"{algorithm} needs {what} mixing matrices{why}; topology {getattr(topology, 'name', '?')!r} "
                f"at step {t} has {line} {i} summing to {sums[i]:.6g} {advice}"
            )
