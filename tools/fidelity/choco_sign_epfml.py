"""epfml/ChocoSGD's Choco-SGD with its sign compressor (dl_code/pcode/optim/parallel_choco.py: ParallelCHOCO and
CHOCOSignCompressor, the code of the paper's deep-learning experiments; the convex code has no sign compressor):
every peer's model after every step.

Usage: python tools/fidelity/choco_sign_epfml.py CHOCO_CHECKOUT SIGNSGD_CHECKOUT BIT2BYTE_DIR
tests/fixtures/choco_sign_epfml.npz
(CHOCO_CHECKOUT: a clone of https://github.com/epfml/ChocoSGD; SIGNSGD_CHECKOUT: a clone of
https://github.com/PermiJW/signSGD-with-Majority-Vote, whose main/bit2byte-extension (a torch CppExtension: it runs
on a CPU) the code imports to pack signs; BIT2BYTE_DIR: where that extension was built with `python setup.py
build_ext --inplace`. Needs numpy, scipy and networkx for the code's topology module.)

Stubbed, none of it the rule: the distribution. ParallelCHOCO runs its gossip in a separate process over an MPI
process group, which the torch wheel here lacks; this harness runs the n peers in one process and calls, for each
peer and in the order of ParallelCHOCO.step and the body of its _sync_thread_func, the code's own functions
(its parameter groups as create_optimizer.define_optimizer builds them, one parameter each):
optim.utils.apply_gradient (the local SGD step), optim.utils.recover_params, optim.utils.update_params_from_neighbor
(x += gamma (memory - x_hat), the consensus step), TensorBuffer.unpack, then CHOCOCompressor(comm_op="sign").compress
for every peer, and its uncompress for every peer with the messages of all (its `sync` is the communication: in
its place each receiver gets its own copy of every sender's packed signs and norms, as MPI would deliver them;
the aggregator's complete_wait is a no-op). The copies start at zero, as _init_neighbor_hat_params sets them.
torch.cuda.current_stream (called in the compressor's constructor) returns None on this machine without a GPU.
Inputs: float32 parameters (a case's shapes), flat x0 = default_rng(0).normal(size=108); at step t peer i's loss is
0.5 ||x - c[t, i]||^2, c = default_rng(1).normal(size=(12, 4, 108)) * (1 + i) cast to float32; plain SGD lr 0.05,
consensus_stepsize 0.3, 4 peers on the code's RingGraph mixing matrix (1/3 each), 12 steps. Cases: "one_tensor"
(one parameter of 108 entries) and "two_tensors" (W (8, 12) and b (12,): the code scales each tensor's signs by its
own L1 norm over its size). Per case: every peer's parameters (flat) after every step (steps, peers, 108)."""

from __future__ import annotations

import sys
from collections import defaultdict
from copy import deepcopy

import common
import numpy as np

N, STEPS, LR, GAMMA, NUMEL = 4, 12, 0.05, 0.3, 108
CASES = {"one_tensor": ((108,),), "two_tensors": ((8, 12), (12,))}


def inputs():
    x0 = np.random.default_rng(0).normal(size=NUMEL).astype(np.float32)
    c = np.random.default_rng(1).normal(size=(STEPS, N, NUMEL))
    return x0, (c * (1 + np.arange(N))[None, :, None]).astype(np.float32)


class NoWait:
    def complete_wait(self, reqs):
        pass


def run(shapes):
    import torch

    torch.cuda.current_stream = lambda *args, **kwargs: None
    import pcode.optim.utils as utils
    from pcode.optim.parallel_choco import CHOCOCompressor
    from pcode.utils.tensor_buffer import TensorBuffer
    from pcode.utils.topology import RingGraph

    matrix = RingGraph.__new__(RingGraph)._compute_mixing_matrix_and_rho(N)[0].toarray()
    x0, c = inputs()
    peers = []
    for r in range(N):
        at, groups = 0, []
        for k, shape in enumerate(shapes):
            size = int(np.prod(shape))
            p = torch.nn.Parameter(torch.from_numpy(x0[at : at + size].reshape(shape).copy()))
            groups.append(
                {"params": [p], "name": f"p{k}", "param_size": p.size(), "nelement": p.nelement(), "lr": LR,
                 "momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False}
            )  # fmt: skip
            at += size
        names = list(enumerate(g["name"] for g in groups))
        flat = TensorBuffer([g["params"][0].data for g in groups], use_cuda=False)
        flat.buffer = torch.zeros_like(flat.buffer)
        hats = {r: deepcopy(flat), "memory": deepcopy(flat)}  # _init_neighbor_hat_params
        compressor = CHOCOCompressor(
            aggregator=NoWait(), comm_op="sign", comm_device="cpu", compress_ratio=None, quantize_level=None,
            is_biased=None, backend="mpi", use_ipc=False,
        )  # fmt: skip
        neighbors = {j: float(w) for j, w in enumerate(matrix[r])}  # RingGraph.get_neighborhood
        peers.append({"groups": groups, "names": names, "state": defaultdict(dict), "hats": hats,
                      "compressor": compressor, "neighbors": neighbors})  # fmt: skip
    out = []
    for t in range(STEPS):
        buffers = []
        for r, peer in enumerate(peers):
            at = 0
            for g in peer["groups"]:
                p = g["params"][0]
                target = torch.from_numpy(c[t, r, at : at + p.numel()].reshape(p.shape).copy())
                p.grad = (p.data - target).clone()
                at += p.numel()
            utils.apply_gradient(peer["groups"], peer["state"], apply_grad_to_model=True)
            params, flat, flat_hat = utils.recover_params(
                param_groups=peer["groups"], param_names=peer["names"], rank=r, neighbor_hat_params=peer["hats"],
                get_hat_params=True,
            )  # fmt: skip
            utils.update_params_from_neighbor(
                neighbor_hat_params=peer["hats"], flatten_params=flat, consensus_stepsize=GAMMA, self_rank=r
            )
            flat.unpack(params)
            buffer = {"original_shapes": None, "flatten_params": flat, "flatten_hat_params": flat_hat}
            peer["compressor"].compress(buffer)
            buffers.append(buffer)
        sent = [(b["flatten_norms"].buffer.clone(), b["signs"].clone()) for b in buffers]
        for peer, buffer in zip(peers, buffers):
            buffer["sync_reqs_1"] = buffer["sync_reqs_2"] = None
            buffer["synced_flatten_norms"] = {j: norms.clone() for j, (norms, _) in enumerate(sent)}
            buffer["synced_signs"] = {j: signs.clone() for j, (_, signs) in enumerate(sent)}
            peer["compressor"].uncompress(buffer, peer["hats"], peer["neighbors"])
        out.append(
            np.stack(
                [np.concatenate([g["params"][0].detach().numpy().reshape(-1) for g in p["groups"]]) for p in peers]
            )
        )
    return np.array(out)


if __name__ == "__main__":
    checkout, signsgd, bit2byte, out = sys.argv[1:5]
    sys.path[:0] = [f"{checkout}/dl_code", bit2byte]
    arrays = {f"{name}_x": run(shapes) for name, shapes in CASES.items()}
    meta = {
        "repo": "https://github.com/epfml/ChocoSGD",
        "file": "dl_code/pcode/optim/parallel_choco.py (ParallelCHOCO, CHOCOSignCompressor), dl_code/pcode/optim/"
        "utils.py, dl_code/pcode/utils/sparsification.py (SignCompressor, with the bit2byte extension)",
        "commit": common.commit(checkout),
        "bit2byte": "https://github.com/PermiJW/signSGD-with-Majority-Vote main/bit2byte-extension, commit "
        + common.commit(signsgd),
        "inputs": __doc__.split("Inputs: ")[1].strip(),
        "lr": LR,
        "consensus_stepsize": GAMMA,
        "peers": N,
        "shapes": {name: [list(s) for s in shapes] for name, shapes in CASES.items()},
        "stubbed": __doc__.split("Stubbed, ")[1].split("\nInputs")[0].strip(),
    }
    common.write(out, meta, arrays)
