"""Datasets, partitions and models: shapes, seeds, skew, and file formats read from disk."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from dpsgd import data, models
from dpsgd.config import parse


def test_iid_partition_is_equal_disjoint_and_seeded():
    labels = np.arange(1000) % 10
    shares = data.partition(labels, 7, seed=3)
    assert {len(s) for s in shares} == {1000 // 7}
    assert len(np.unique(np.concatenate(shares))) == 7 * (1000 // 7)
    assert all((a == b).all() for a, b in zip(shares, data.partition(labels, 7, seed=3)))


def skew(shares, labels):
    """Mean over peers of the largest class fraction of the peer's share."""
    return np.mean([np.bincount(labels[s], minlength=10).max() / len(s) for s in shares])


def test_dirichlet_skew_follows_alpha():
    labels = np.random.default_rng(0).integers(0, 10, 5000)
    low = data.partition(labels, 8, 0, "dirichlet", alpha=0.1, min_size=16)
    high = data.partition(labels, 8, 0, "dirichlet", alpha=10.0, min_size=16)
    assert skew(low, labels) > 0.4 > 0.2 > skew(high, labels)
    assert min(len(s) for s in low) >= 16
    assert len(np.unique(np.concatenate(low))) == sum(len(s) for s in low)  # disjoint


def test_shards_give_each_peer_few_classes():
    labels = np.repeat(np.arange(10), 100)
    shares = data.partition(labels, 5, 0, "shards", shards_per_peer=2)
    assert all(len(np.unique(labels[s])) <= 2 for s in shares)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(scheme="nope"), "valid partitions: iid, dirichlet, shards"),
        (dict(scheme="dirichlet", alpha=0), "alpha must be > 0"),
        (dict(min_size=500), "cannot give 4 peers 500 each"),
    ],
)
def test_partition_errors(kwargs, words):
    with pytest.raises(ValueError, match=words):
        data.partition(np.arange(1000) % 10, 4, 0, **kwargs)


def test_bundled_and_generated_datasets():
    digits = data.load("digits")
    assert digits.input_shape == (1, 8, 8) and len(digits.x_test) == 360 and digits.num_classes == 10
    mnist = data.load("mnist_small")
    assert mnist.input_shape == (1, 28, 28) and len(mnist.x_train) + len(mnist.x_test) == 5000
    syn = data.load("synthetic", num_samples=500, num_features=12, num_classes=3, seed=1)
    assert syn.input_shape == (12,) and syn.num_classes == 3 and len(syn.x_test) == 100
    assert torch.equal(
        syn.x_train, data.load("synthetic", num_samples=500, num_features=12, num_classes=3, seed=1).x_train
    )
    reg = data.load("synthetic_regression", num_samples=300, num_features=5)
    assert reg.task == "regression" and reg.y_train.dtype == torch.float32


def _idx(path, array):
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_mnist_idx_files_are_read(tmp_path):
    rng = np.random.default_rng(0)
    _idx(tmp_path / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (20, 28, 28)))
    _idx(tmp_path / "train-labels-idx1-ubyte.gz", np.arange(20) % 10)
    _idx(tmp_path / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (6, 28, 28)))
    _idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.arange(6))
    split = data.load("mnist", root=str(tmp_path))
    assert split.input_shape == (1, 28, 28) and len(split.x_test) == 6 and split.y_train[:3].tolist() == [0, 1, 2]
    assert 0 <= split.x_train.min() and split.x_train.max() <= 1


def test_cifar_binary_files_are_read(tmp_path):
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        rec = rng.integers(0, 256, (4, 3073)).astype(np.uint8)
        rec[:, 0] = np.arange(4)
        rec.tofile(folder / name)
    split = data.load("cifar10", root=str(tmp_path))
    assert split.input_shape == (3, 32, 32) and len(split.x_train) == 20 and split.y_test.tolist() == [0, 1, 2, 3]


def test_cifar_python_files_are_read(tmp_path):
    """The python version (cifar-10-python.tar.gz unpacked: pickled dicts of uint8 rows, channel-major)."""
    import pickle

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batches[name] = {b"data": rng.integers(0, 256, (3, 3072)).astype(np.uint8), b"labels": [7, 8, 9]}
        (folder / name).write_bytes(pickle.dumps(batches[name]))
    split = data.load("cifar10", root=str(tmp_path))
    assert split.input_shape == (3, 32, 32) and len(split.x_train) == 15 and split.y_test.tolist() == [7, 8, 9]
    row = batches["data_batch_1"][b"data"][1]  # 1024 red, then green, then blue values, each row by row
    assert split.x_train[1, 2, 5, 7].item() == pytest.approx(row[2 * 1024 + 5 * 32 + 7] / 255)


def test_missing_files_say_where_and_what(tmp_path):
    with pytest.raises(data.DataNotFoundError, match="train-images-idx3-ubyte not found under .*nothing is downloaded"):
        data.load("mnist", root=str(tmp_path))
    with pytest.raises(data.DataNotFoundError, match="set data.root"):
        data.load("cifar10")
    with pytest.raises(data.DataNotFoundError, match="is not a folder; make it and put CIFAR-10's cifar-10-batches"):
        data.load("cifar10", root=str(tmp_path / "absent"))


@pytest.mark.parametrize(
    "name, shape",
    [("linear", (1, 8, 8)), ("mlp", (12,)), ("cnn", (1, 28, 28)), ("cnn", (3, 32, 32)), ("resnet20", (3, 32, 32))],
)
def test_models_build_the_same_from_a_seed(name, shape):
    a, b = models.build(name, shape, 10, seed=5), models.build(name, shape, 10, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert a(torch.randn(2, *shape)).shape == (2, 10)


def test_resnet20_size_and_image_check():
    n = sum(p.numel() for p in models.build("resnet20", (3, 32, 32), 10, 0).parameters())
    assert 0.26e6 < n < 0.28e6
    with pytest.raises(ValueError, match="needs images"):
        models.build("cnn", (64,), 10, 0)


def test_tiny_text_and_transformer_learn_next_characters():
    from dpsgd.comm import run_local
    from dpsgd.training import train

    text = data.load("tiny_text", num_samples=200, seq_len=16)
    assert text.x_train.dtype == torch.long and text.input_shape == (16,)
    assert torch.equal(text.x_train[0, 1:], text.y_train[0, :-1])  # targets are the inputs shifted by one
    model = models.build("transformer", (16,), text.num_classes, seed=0)
    assert model(text.x_train[:3]).shape == (3, 16, text.num_classes)
    cfg = {
        "seed": 0,
        "epochs": 3,
        "batch_size": 16,
        "log_every": 100,
        "algorithm": {"name": "dpsgd"},
        "optimizer": {"name": "adam", "lr": 0.003},
        "topology": {"name": "ring"},
        "model": {"name": "transformer", "dim": 32, "layers": 1, "heads": 2},
        "data": {"name": "tiny_text", "num_samples": 400, "seq_len": 16},
    }
    summary = run_local(2, train, parse(cfg))[0]
    # far above guessing among ~30 characters: the model learned the grammar's words
    assert summary["test_accuracy"] > 0.35, summary
