"""The prepared GPU check: `make gpu-check` on a machine with one GPU (docs/guide/clusters.md).

Parts, each on its own (one that fails or cannot run here is recorded with why, and the next runs), each with its
PASS, FAIL or SKIP line and its time on stdout and in the JSON:
1. gpu_tests: the `gpu`-marked tests (tests/test_gpu.py).
2. peers: 4 peers sharing the GPU (device_share=true) on ResNet-20 with CIFAR-shaped synthetic data, as
   in-process threads, torch/gloo processes and mpi processes (the last two through pinned host staging),
   D-PSGD (also with overlap) and all-reduce, each against the same run on the CPU: the summaries agree
   within float tolerance (TF32 off for these runs: NVIDIA_TF32_OVERRIDE=0). The six cases run at once.
3. adpsgd: AD-PSGD's peers on the GPU over torch/gloo, their averaging thread staging its messages.
4. nccl: a world of one over nccl (an all-reduce and a barrier), and the app's training loop on it.
5. fleet: the fleet's scaling table (experiments.bench.fleet_gpu): ResNet-20 peers per GPU, 64 to 2,048.
6. events: AD-PSGD's event simulator (dpsgd.sim.events) with its peers on the GPU against the CPU.
7. fleet_vs_batch: the fleet against one model at batch n*b (experiments.bench.fleet_vs_batch), 64 to 1,024 peers.
8. cifar10: the CIFAR-10 ResNet-20 recipe cut short (experiment=cifar10_resnet20_short: 16 peers on the fleet, 4
   epochs) end to end, on the files under CIFAR10_ROOT when it is set, else on synthetic files in CIFAR-10's binary
   layout (5,000 + 1,000 random images: the reader and the run, no accuracy to read); its time and accuracy.
9. the feature checks (experiments.bench.gpu_features), one part each: every algorithm (diloco also with
   outer_delay=1, without and with eager), every base optimizer (muon among them), every robust rule against a
   corrupt peer, fp16 and bf16 with clipping, accumulation and a schedule in the step, every sparse topology at
   8,192 peers on the wide fleet, and a tiny run of each trainer's integration (skipped, with the reason, where
   its extra is not installed).
One JSON (--out, default GPU_CHECK_OUT or outputs/gpu_check.json), rewritten after each part, and a table on stdout.
GPU_CHECK_DRY=1 runs the same script on CPU tensors, small (the CPU's peers stage with backend.staging=always,
the fleet's ladder is 4 and 8 peers; the feature checks at the same sizes as on the GPU): `make soak` runs it, and
`make test` checks that the feature checks cover every feature (tests/test_gpu_check_coverage.py).

Time on one H100, estimated from the sizes and the H200 runs of 2026-12-04 (parts 1-5: 204 s and 285 s), not
measured: gpu_tests 35 s, peers 65 (one wave of six runs where that run had two: 92-126 s), adpsgd 30, nccl 40,
fleet 35 (its budget 40 s; 4,096 peers needed 118 GiB), events 15, fleet_vs_batch 30 (budget 20 s), cifar10 30 (about
40 fleet steps of 16 ResNet-20 peers, and the app's start), the 45 fleet feature checks 40 (29 s on 2 CPU cores in
the dry run: imports and set-up, each run small), the 3 trainers 30 (processes of about 10 s; 22 s in the dry run):
about 320 s (5.3 minutes) with the trainers skipped, as the wheels of `make gpu-wheels` leave them (they hold no
trainer), and about 350 s (5.8 minutes) where their extras are installed. Each part's limit (PART_TIMEOUT_S)
bounds a machine where something hangs.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from experiments.bench import cli, gpu_features, harness
from experiments.bench.harness import ROOT, BenchError

DRY = os.environ.get("GPU_CHECK_DRY") == "1"
DEVICE = "cpu" if DRY else "cuda"
RUN_TIMEOUT_S = 150  # one app run; below the peers part's own limit
# the small run every comparison makes: 4 ResNet-20 peers, 16 steps of 8 CIFAR-shaped images each (the dry
# run on 2 CPU cores: 2 CNN peers, 16 steps)
RUN = ["data=synthetic_cifar", "epochs=1", "batch_size=8", "log_every=4", "optimizer.lr=0.02", "comm.timeout_s=120"]
RUN += (
    ["model=cnn", "peers=2", "data.num_samples=320"] if DRY else ["model=resnet20", "peers=4", "data.num_samples=640"]
)
TOLERANCE = {"train_loss": 1e-3, "test_loss": 1e-3, "consensus_distance": 1e-2}  # relative
ACCURACY_TOLERANCE = 1 / 128 + 1e-9  # one of the 128 test images classified differently (ResNet-20 runs)


def app(args: list[str], run_dir: Path) -> dict:
    """The app's run of `args` in `run_dir`: its summary, or BenchError with the error's last line."""
    env = {**os.environ, "NVIDIA_TF32_OVERRIDE": "0"}  # cuBLAS and cuDNN in full float32: comparable to the CPU
    return harness.run_app(args, run_dir, RUN_TIMEOUT_S, env=env)[0]


def differences(run: dict, reference: dict) -> dict:
    """Relative difference per compared key (accuracy: absolute)."""
    out = {k: abs(run[k] - reference[k]) / max(abs(reference[k]), 1e-12) for k in TOLERANCE}
    out["test_accuracy"] = abs(run["test_accuracy"] - reference["test_accuracy"])
    return out


def within(diff: dict) -> bool:
    return all(diff[k] <= tol for k, tol in TOLERANCE.items()) and diff["test_accuracy"] <= ACCURACY_TOLERANCE


def part_gpu_tests(work: Path) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider", "-rs"]
    env = {**os.environ, "NVIDIA_TF32_OVERRIDE": "0"}  # as for the app's runs: comparable to the CPU
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
    return {"passed": proc.returncode == 0, "summary": last[0], "output_tail": proc.stdout[-1500:]}


def part_peers(work: Path) -> dict:
    from dpsgd.comm import transport

    cases = [
        ("local", "dpsgd", []),
        ("torch", "dpsgd", ["backend.dist_backend=gloo"]),
        ("torch", "dpsgd", ["backend.dist_backend=gloo", "algorithm.overlap=true"]),
        ("torch", "allreduce", ["backend.dist_backend=gloo"]),
        ("mpi", "dpsgd", []),
        ("mpi", "allreduce", []),
    ]
    if DRY:  # on 2 CPU cores, one run: staged against direct (tests/test_placement.py runs both backends so)
        cases = [cases[2]]

    def one(i: int) -> dict:
        backend, algorithm, extra = cases[i]
        args = [f"backend={backend}", f"algorithm={algorithm}", *RUN, *extra]
        row: dict = {"backend": backend, "algorithm": algorithm, "options": extra}
        try:
            if DRY and transport.get(backend).host_staging:  # the CPU run through host buffers against the direct one
                device_run = app([*args, "device=cpu", "backend.staging=always"], work / f"peers{i}-device")
            else:
                device_run = app([*args, f"device={DEVICE}", "device_share=true"], work / f"peers{i}-device")
            reference = app([*args, "device=cpu"], work / f"peers{i}-cpu")
        except (BenchError, subprocess.TimeoutExpired) as exc:
            return {**row, "passed": False, "error": str(exc)}
        diff = differences(device_run, reference)
        return {
            **row,
            "passed": within(diff),
            "differences": diff,
            "device": {k: device_run[k] for k in (*TOLERANCE, "test_accuracy", "wall_time_s", "comm_overlap_s")},
            "cpu": {k: reference[k] for k in (*TOLERANCE, "test_accuracy", "wall_time_s", "comm_overlap_s")},
        }

    pool = ThreadPoolExecutor(1 if DRY else len(cases))  # one wave: each run is 4 processes; the GPU has room for all
    try:
        rows = list(pool.map(one, range(len(cases))))
    finally:  # past the part's limit: runs not started are dropped, those running end at RUN_TIMEOUT_S
        pool.shutdown(wait=False, cancel_futures=True)
    return {"passed": all(r["passed"] for r in rows), "runs": rows}


def part_adpsgd(work: Path) -> dict:
    args = ["backend=torch", "backend.dist_backend=gloo", "algorithm=adpsgd", "topology=ring", *RUN]
    device = ["device=cpu", "backend.staging=always"] if DRY else [f"device={DEVICE}", "device_share=true"]
    s = app([*args, *device], work / "adpsgd")
    return {"passed": s["steps"] > 0, "steps": s["steps"], "test_accuracy": s["test_accuracy"]}


NCCL_ONE = """
import os, torch
from dpsgd.comm import TorchCommunicator
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1")
comm = TorchCommunicator(timeout_s=60, dist_backend="nccl")
x = torch.arange(6.0, device="cuda")
comm._wait("allreduce", comm._allreduce_sum(x), [0])
assert torch.equal(x.cpu(), torch.arange(6.0)), x
comm.barrier()
print(comm.dist_backend, comm.staging)
comm.close()
"""


def part_nccl(work: Path) -> dict:
    if DRY or not torch.cuda.is_available():
        return {"skipped": "nccl needs a GPU"}
    from dpsgd.backends import free_port

    proc = subprocess.run(
        [sys.executable, "-c", NCCL_ONE.format(port=free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        return {"passed": False, "error": proc.stderr[-800:]}
    one = ["model=resnet20", "data=synthetic_cifar", "data.num_samples=640", "epochs=1", "batch_size=8", "peers=1"]
    s = app(["backend=torch", *one, f"device={DEVICE}"], work / "nccl")
    return {
        "passed": proc.stdout.split()[:2] == ["nccl", "None"],
        "printed": proc.stdout.strip(),
        "app_steps": s["steps"],
    }


def part_fleet(work: Path) -> dict:
    from experiments.bench import fleet_gpu

    if DRY:
        return {"passed": True, **fleet_gpu.scan("cpu", [4, 8], batch_size=2, steps=2, budget_s=20)}
    ladder = [64 * 2**k for k in range(6)]  # 64 ... 2048 (4096 took 118 GiB on the H200: more than an H100 holds)
    return {"passed": True, **fleet_gpu.scan(DEVICE, ladder, batch_size=8, steps=3, budget_s=40)}


def part_events(work: Path) -> dict:
    """AD-PSGD's event simulator with its peers on the device against the same simulation on the CPU: the
    same history (virtual times do not depend on the numbers) and parameters within float tolerance."""
    from dpsgd.sim import Simulation

    peers, samples = (4, 320) if DRY else (8, 640)
    run = [*harness.fleet_overrides(peers, 8, "synthetic_cifar", num_samples=samples), "algorithm=adpsgd"]
    run += ["topology=ring", "model=cnn", "model.width=16", "model.groups=2"]
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # full float32, as the CPU
    on_device = Simulation(harness.run_config(*run, f"device={DEVICE}")).run()
    on_cpu = Simulation(harness.run_config(*run, "device=cpu")).run()
    diff = float((on_device.live.cpu() - on_cpu.live).abs().max() / on_cpu.live.abs().max())
    same = on_device.log == on_cpu.log
    return {"passed": same and diff < 1e-4, "same_history": same, "max_relative_difference": diff,
            "steps": sum(on_device.steps), "device": str(on_device.device)}  # fmt: skip


def part_fleet_vs_batch(work: Path) -> dict:
    """experiments.bench.fleet_vs_batch on the device: the fleet against one model at batch n*b. No new
    measurement after 40 s; at the part's limit the rows measured so far are kept."""
    from experiments.bench import fleet_vs_batch

    out = work / "fleet_vs_batch.json"
    if DRY:
        argv = ["--models", "mlp", "cnn", "--peers", "4", "--steps", "1", "--repeats", "1", "--bandwidth-mib", "8"]
    else:
        ladder = ["64", "256", "1024"]
        argv = ["--device", DEVICE, "--peers", *ladder, "--steps", "2", "--repeats", "2", "--budget-s", "20"]
        argv += ["--memory-fraction", "0.8"]
    stopped = "the ladder's end or its budget"
    try:
        fleet_vs_batch.main([*argv, "--out", str(out)])
    except PartTimeout:
        stopped = f"the part's limit ({PART_TIMEOUT_S['fleet_vs_batch']} s)"
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    judged = [r for r in rows if r["target"] is not None]
    return {"passed": bool(rows), "rows": rows, "stopped": stopped,
            "targets_met": sum(r["target"]["holds"] for r in judged), "targets": len(judged)}  # fmt: skip


def synthetic_cifar10(folder: Path, per_batch: int) -> Path:
    """Random images in CIFAR-10's binary layout (cifar-10-batches-bin: rows of a label byte and 3,072 pixel bytes),
    `per_batch` in each of the five training files and the test file."""
    import numpy as np

    rng = np.random.default_rng(0)
    (folder / "cifar-10-batches-bin").mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        rows = rng.integers(0, 256, (per_batch, 3073), dtype=np.uint8)
        rows[:, 0] = rng.integers(0, 10, per_batch)
        rows.tofile(folder / "cifar-10-batches-bin" / f"{name}.bin")
    return folder


def part_cifar10(work: Path) -> dict:
    root = os.environ.get("CIFAR10_ROOT")
    synthetic = not root
    if synthetic:
        root = str(synthetic_cifar10(work / "cifar10", 32 if DRY else 1000))
    args = ["experiment=cifar10_resnet20_short", f"data.root={root}", f"device={DEVICE}"]
    if DRY:  # 2 CPU cores: 2 CNN peers, one epoch
        args += ["peers=2", "epochs=1", "model=cnn"]
    start = time.monotonic()
    env = {**os.environ, "DPSGD_PROGRESS": "0"}
    summary, _ = harness.run_app(args, work / "cifar10_run", PART_TIMEOUT_S["cifar10"] - 10, env=env)
    return {"passed": True, "synthetic": synthetic, "root": root, "overrides": args,
            "test_accuracy": summary["test_accuracy"], "steps": summary["steps"],
            "run_seconds": round(time.monotonic() - start, 1)}  # fmt: skip


PARTS = {
    "gpu_tests": part_gpu_tests,
    "peers": part_peers,
    "adpsgd": part_adpsgd,
    "nccl": part_nccl,
    "fleet": part_fleet,
    "events": part_events,
    "fleet_vs_batch": part_fleet_vs_batch,
    "cifar10": part_cifar10,
}
# each part's own limit (s): a hang is recorded as that part's failure and the next part runs. The sum is a
# bound for a machine where everything hangs, well above what a healthy run takes (the estimate above)
PART_TIMEOUT_S = {
    "gpu_tests": 120,
    "peers": 180,
    "adpsgd": 90,
    "nccl": 90,
    "fleet": 90,
    "events": 60,
    "fleet_vs_batch": 60,
    "cifar10": 240,
}


def feature_part(name: str):
    """The part that runs gpu_features.CHECKS[name] on the device."""

    def part(work: Path) -> dict:
        return gpu_features.run_check(gpu_features.CHECKS[name], DEVICE, work / name.replace(":", "-"))

    return part


PARTS.update({name: feature_part(name) for name in gpu_features.CHECKS})
PART_TIMEOUT_S.update({name: gpu_features.timeout_s(name) for name in gpu_features.CHECKS})


class PartTimeout(Exception):
    pass


def _timed_out(signum, frame):
    # raised in the main thread wherever it waits; subprocess.run kills its child on the way out
    raise PartTimeout()


def run(args) -> harness.Result:
    result: dict = {
        "date": datetime.date.today().isoformat(),
        "dry_run": DRY,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "parts": {},
    }
    os.environ.setdefault("DPSGD_PROGRESS", "off")  # the runs in this process: one line per part, no progress
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name, part in PARTS.items():
            start = time.monotonic()
            signal.signal(signal.SIGALRM, _timed_out)
            signal.alarm(PART_TIMEOUT_S[name])
            try:
                outcome = part(Path(tmp))
            except PartTimeout:
                outcome = {"passed": False, "error": f"did not finish within its {PART_TIMEOUT_S[name]} s"}
            except Exception as exc:  # noqa: BLE001 - recorded; the next part runs
                outcome = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
            finally:
                signal.alarm(0)
            outcome["seconds"] = round(time.monotonic() - start, 1)
            result["parts"][name] = outcome
            print(line(name, outcome), flush=True)
            harness.write(args, result)
    print(table(result))
    failed = [f"part {n} failed: {p.get('error', '')}" for n, p in result["parts"].items() if not p.get("passed", True)]
    return harness.Result(result, problems=failed)


def verdict(part: dict) -> str:
    return "SKIP" if "skipped" in part else ("PASS" if part.get("passed") else "FAIL")


def line(name: str, part: dict) -> str:
    """A part's line: its name, PASS, FAIL or SKIP, its time, and why (a skip's reason, a failure's error)."""
    why = part.get("skipped") or part.get("error") or part.get("summary") or ""
    return f"{name:38s} {verdict(part)} {part['seconds']:6.1f} s  {why}".rstrip()


def table(result: dict) -> str:
    lines = [f"GPU check{' (dry run, CPU)' if result['dry_run'] else ''}: {result['gpu']}, torch {result['torch']}"]
    for name, p in result["parts"].items():
        lines.append(line(name, p))
        for r in p.get("runs", []):
            d = r.get("differences")
            shown = ", ".join(f"{k} {v:.1e}" for k, v in d.items()) if d else r.get("error", "")
            lines.append(f"    {r['backend']:6s} {r['algorithm']:9s} {' '.join(r['options']):45s} {shown}")
        for r in p.get("rows", []):
            if "ratio" in r:  # fleet_vs_batch
                lines.append(
                    f"    {r['model']:11s} {r['peers']:5d} peers  ratio {r['ratio']:.3f}  floor {r['floor_ratio']:.3f}"
                )
                continue
            rate, peer_rate = r["steps_per_s"], r["peer_steps_per_s"]
            lines.append(f"    {r['peers']:5d} peers  {rate:8.2f} steps/s  {peer_rate:10.1f} peer-steps/s")
        if "largest_n_at_1_step_per_s" in p:
            lines.append(f"    largest n at >= 1 step/s: {p['largest_n_at_1_step_per_s']} ({p['stopped']})")
    return "\n".join(lines)


main = cli.entry("gpu_check")

if __name__ == "__main__":
    raise SystemExit(main())
