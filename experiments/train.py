"""One experiment: `python -m experiments.train [overrides]` (Hydra; `-m` sweeps).

Without a launcher, this process is the driver: it validates the config, writes it resolved to
the run folder, and starts the peers (threads for backend=local, `mpiexec -n peers` for mpi,
`peers` processes for torch). Under a user's mpiexec/srun or torchrun, every rank runs this app
and joins the launcher's world; the ranks agree on one output folder before Hydra starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from dpsgd.launch import launched_world, run_peers
from experiments.table import format_table
from experiments.validate import ConfigError, check_group_overrides, check_same_run, validate

RUN_FILES = ("metrics.jsonl", "checkpoints", "summary.json", "logs")  # a folder with any of these holds a run


def fail(message: str, run_dir: Path | None = None, code: int = 2):
    """One line on stderr. A run folder this invocation made and that holds nothing but Hydra's
    own files is removed, so nothing that looks like a result is left behind; a folder holding
    an earlier run's files (a resume) is never touched."""
    if run_dir is not None and run_dir.exists():
        ours = all(p.name == ".hydra" or p.suffix == ".log" for p in run_dir.iterdir())
        if ours:
            shutil.rmtree(run_dir, ignore_errors=True)
            with contextlib.suppress(OSError):  # the date folder Hydra made for it, if now empty
                run_dir.parent.rmdir()
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _world_rank(world: str) -> int:
    if world == "mpi":
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank()
    return int(os.environ["RANK"])


def agree_on_run_dir(world: str) -> None:
    """All ranks of a launched world must write to one folder: rank 0's timestamp is sent to all
    (as fixed-size bytes: nothing received is unpickled)."""
    if "DPSGD_RUN_DIR" in os.environ:
        return
    timeout_s = _startup_timeout(sys.argv[1:])
    stamp = time.strftime("outputs/%Y-%m-%d/%H-%M-%S").encode().ljust(64)
    if world == "mpi":
        from mpi4py import MPI

        from dpsgd.comm.base import PeerTimeoutError, poll_until

        buf = bytearray(stamp)
        request = MPI.COMM_WORLD.Ibcast(buf, root=0)
        try:
            poll_until(request.Test, time.monotonic() + timeout_s)
        except PeerTimeoutError:
            fail(f"rank {MPI.COMM_WORLD.Get_rank()}: start-up timed out after {timeout_s:g} s waiting for rank 0 "
                 f"to name the run folder; a peer did not start (raise comm.timeout_s if start-up is just slow)",
                 code=1)
        stamp = bytes(buf)
    else:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            if os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost"):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                                    timeout=timedelta(seconds=timeout_s))
        t = torch.frombuffer(bytearray(stamp), dtype=torch.uint8).clone()
        dist.broadcast(t, src=0)
        stamp = bytes(t.tolist())
    os.environ["DPSGD_RUN_DIR"] = stamp.decode().strip()


def _startup_timeout(argv: list[str]) -> float:
    """comm.timeout_s before Hydra has composed the config: the command line's, else the default."""
    from dpsgd.comm import DEFAULT_TIMEOUT_S

    for arg in argv:
        if arg.startswith("comm.timeout_s="):
            with contextlib.suppress(ValueError):
                value = float(arg.split("=", 1)[1])
                if value > 0:  # else the config check says what is wrong
                    return value
    return DEFAULT_TIMEOUT_S


def _fit_batch_size(cfg: dict) -> str | None:
    """Many peers on a small dataset: the batch becomes a peer's whole share (dpsgd.build.fit_batch_size).
    A config that cannot load its data is left for validate() to name."""
    from dpsgd.build import fit_batch_size

    try:
        return fit_batch_size(cfg)
    except Exception:  # noqa: BLE001 - reported by validate() in one line
        return None


def run(cfg: dict, run_dir: Path, world: str | None) -> dict | None:
    """Run the experiment; return the summary where this process has it (driver or rank 0)."""
    import torch

    torch.set_num_threads(1)
    if world is not None:
        from experiments.peer import init_comm, run_peer

        comm = init_comm(cfg)
        if comm.rank == 0:
            OmegaConf.save(OmegaConf.create(cfg), run_dir / "config.yaml")
        summary = run_peer(comm, cfg, run_dir)
        comm.close()
        return summary if comm.rank == 0 else None
    OmegaConf.save(OmegaConf.create(cfg), run_dir / "config.yaml")
    backend = cfg["backend"]["name"]
    if backend == "fleet":  # every peer simulated in this process (dpsgd.sim), on every core
        from dpsgd.sim.run import train_fleet

        torch.set_num_threads(os.cpu_count() or 1)
        return train_fleet(cfg, run_dir)
    logs = run_dir / "logs"
    if backend == "local":
        from dpsgd.comm import run_local

        start = time.monotonic()
        try:
            return run_local(cfg["peers"], _local_peer, cfg, run_dir, timeout_s=float(cfg["comm"]["timeout_s"]))[0]
        except PeerError as exc:  # the first peer that failed; the others were released at once
            logs.mkdir(exist_ok=True)
            (logs / "traceback.log").write_text("".join(traceback.format_exception(exc.__cause__ or exc)))
            fail(f"{exc}; all peers stopped after {time.monotonic() - start:.1f} s (traceback: "
                 f"{logs / 'traceback.log'})", code=1)
    progress = {"DPSGD_PROGRESS": "1" if sys.stdout.isatty() else "0"}  # the peers' stdout is a pipe
    outcome = run_peers(backend, cfg["peers"], ["-m", "experiments.peer", str(run_dir)], logs, env=progress)
    if outcome.code != 0:
        fail(f"{outcome.failure}; all peers stopped after {outcome.seconds:.1f} s (logs: {logs})", code=1)
    return json.loads((run_dir / "summary.json").read_text())


class PeerError(RuntimeError):
    """A peer of the local backend failed; the message is its one line (rank, error type, message)."""


def _local_peer(comm, cfg: dict, run_dir: Path) -> dict:
    from dpsgd.training import train
    from experiments.peer import error_line

    try:
        return train(comm, cfg, run_dir)
    except Exception as exc:  # noqa: BLE001 - one line for the user, the traceback to the logs
        raise PeerError(error_line(comm.rank, exc)) from exc


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    world = launched_world()
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        world_size = None
        if world is not None:
            if resolved["backend"]["name"] != world:
                raise ConfigError(f"started by a {world} launcher but backend={resolved['backend']['name']}; "
                                  f"pass backend={world}")
            world_size = int(os.environ.get("WORLD_SIZE") or os.environ.get("PMI_SIZE")
                             or os.environ.get("OMPI_COMM_WORLD_SIZE") or 0) or None
        note = _fit_batch_size(resolved)
        if note and (world is None or _world_rank(world) == 0):
            print(f"note: {note}", file=sys.stderr, flush=True)
        validate(resolved, world_size, launched=world is not None)
        # the run folder: judged by the driver, or by rank 0 alone (another rank could look after rank
        # 0 has begun writing; if rank 0 refuses, the launcher stops the others)
        if world is None or _world_rank(world) == 0:
            if not resolved.get("resume") and any((run_dir / f).exists() for f in RUN_FILES):
                raise ConfigError(f"{run_dir} already holds a run; pass resume=true to continue it, or choose a "
                                  f"new hydra.run.dir")
            if resolved.get("resume") and (run_dir / "config.yaml").exists():
                check_same_run(OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")), resolved, run_dir)
    except ConfigError as exc:
        fail(str(exc), run_dir)
    summary = run(resolved, run_dir, world)
    if summary is None:
        return None
    print(format_table([summary]), flush=True)
    print(f"outputs: {run_dir}", flush=True)
    return summary["test_accuracy"]


def main() -> None:
    argv = sys.argv[1:]
    try:
        check_group_overrides(argv)
    except ConfigError as exc:
        fail(str(exc))
    world = launched_world()
    if world is not None:
        if "-m" in argv or "--multirun" in argv:
            fail(f"a sweep (-m) cannot run inside a {world} launcher; run the sweep without it "
                 f"and the app starts the peers of each run itself")
        agree_on_run_dir(world)
        rank = _world_rank(world)
        # one .hydra/ folder (rank 0's) and one log file per rank
        sys.argv += [f"hydra.job.name=train_rank{rank}"] + (["hydra.output_subdir=null"] if rank else [])
    hydra_main()
    if world == "torch":
        # results written, group down: skip the interpreter's teardown, where gloo's threads can abort
        # the process ("terminate called without an active exception"), as in experiments.peer
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
