"""The training corpus: find files, tokenize them, split train/validation, draw batches.

Three kinds of input, all ending as one flat token stream per split:

* **text** (the default, and any file or directory given to ``--data``): each file's bytes are its
  tokens (byte-level, vocabulary 256) or, for a Hugging Face model that ships a tokenizer, that
  tokenizer's ids. Files are split into train and validation **by file**: a file goes to validation
  when ``crc32(relative path) mod 10_000 < val_fraction · 10_000``, so the split is the same on every
  machine and every run, and no file is cut in two.
* **the default corpus**: the ``*.py`` files of Python's standard library
  (``sysconfig.get_paths()["stdlib"]``), without ``site-packages``/``dist-packages`` and without the
  test suites (``test``, ``tests``, ``idle_test``) — about 12 MB on CPython 3.11.
* **a pre-tokenized ``.bin``** (nanoGPT's format: a flat array of little-endian ``uint16`` token ids,
  no header). A ``train.bin`` with a ``val.bin`` beside it uses that for validation; any other ``.bin``
  keeps its last ``val_fraction`` of tokens for validation. Token ids must be below the model's
  vocabulary size.

Batches are random windows of ``seq_len + 1`` tokens (nanoGPT's ``get_batch``), drawn without state:
micro-batch ``index`` of a run is drawn from ``numpy.random.default_rng([seed, index])`` as one global
batch of ``world_size · batch_size`` window offsets, and rank ``r`` takes rows
``[r · batch_size, (r + 1) · batch_size)``. So every rank draws a different micro-batch, the stream is
a pure function of (seed, world size, batch size, index), and the position to resume from is the
JSON-able :meth:`BatchSampler.state_dict` ``{"seed": ..., "index": ...}``.

Errors: :class:`chunkzero.errors.DataError`, naming the path or the numbers at fault.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from chunkzero.errors import DataError

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
"""Directory names never entered when collecting the default corpus (the standard library)."""

BINARY_SNIFF_BYTES = 8192
"""A file whose first this-many bytes contain a NUL byte is binary and is skipped in a directory."""

VAL_BUCKETS = 10_000

VAL_STREAM = 0x7A1D_A7E5
"""Second seed word of the (fixed) validation windows, so they never coincide with a training draw."""


# ----------------------------------------------------------------------------------------- tokenizers

class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, data: bytes) -> np.ndarray: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """Bytes are tokens: ``encode`` gives ``uint8[len(data)]``; vocabulary 256."""

    vocab_size = 256
    name = "bytes"

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer loaded offline from a model directory (text is decoded as UTF-8): its
    ``tokenizer.json`` through the ``tokenizers`` library (no framework import, so both engines read
    it), else ``transformers.AutoTokenizer`` (a slow tokenizer: ``vocab.json`` or ``tokenizer.model``)."""

    name = "huggingface"

    def __init__(self, model_dir: str | os.PathLike):
        path = Path(model_dir) / "tokenizer.json"
        if path.is_file():
            from tokenizers import Tokenizer

            self.fast = Tokenizer.from_file(str(path))
            self.vocab_size = self.fast.get_vocab_size(with_added_tokens=True)
        else:
            from transformers import AutoTokenizer

            self.fast = None
            self.tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            self.vocab_size = len(self.tok)
        self.dtype = np.uint16 if self.vocab_size <= 65536 else np.uint32

    def encode(self, data: bytes) -> np.ndarray:
        text = data.decode("utf-8", errors="replace")
        if self.fast is not None:
            ids = self.fast.encode(text, add_special_tokens=False).ids
        else:
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return np.asarray(ids, dtype=self.dtype)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        return self.fast.decode(ids) if self.fast is not None else self.tok.decode(ids)


class IdTokenizer:
    """For pre-tokenized ``.bin`` data without a tokenizer: ids are shown as numbers."""

    name = "ids"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, data: bytes) -> np.ndarray:  # pragma: no cover - .bin data is never encoded  # noqa: ARG002 - the tokenizer interface
        raise DataError("pre-tokenized data cannot encode text")

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


# ----------------------------------------------------------------------------------------- sources

@dataclass(frozen=True)
class TextFile:
    """One text file of the corpus: ``rel`` (the path the split hashes) and ``path`` (where it is)."""

    rel: str
    path: Path
    size_bytes: int


def default_data_paths() -> list[Path]:
    """The default corpus root: the standard library directory of the running Python."""
    return [Path(sysconfig.get_paths()["stdlib"])]


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(BINARY_SNIFF_BYTES)


def find_text_files(paths: list[str | os.PathLike] | None) -> list[TextFile]:
    """The text files named by ``paths`` (files, or directories searched recursively), sorted.

    ``paths=None`` means the default corpus (the standard library's ``*.py`` files). In a directory,
    hidden entries and binary files (a NUL byte in the first 8 KiB) are skipped; a binary file named
    directly is an error.

    Raises:
        DataError: a path does not exist, is not a file or directory, is a binary file, a directory
            holds no text file, or a file is named more than once (twice on the command line, or in a
            directory named too).
    """
    if paths is None:
        (root,) = default_data_paths()
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
            for name in sorted(filenames):
                if name.endswith(".py"):
                    p = Path(dirpath, name)
                    files.append(TextFile(p.relative_to(root).as_posix(), p, p.stat().st_size))
        if not files:
            raise DataError(f"no *.py files in the standard library directory {root}")
        return sorted(files, key=lambda f: f.rel)

    files: list[TextFile] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise DataError(f"--data path does not exist: {raw}")
        if p.is_file():
            if _is_binary(p):
                raise DataError(f"--data file is binary (a NUL byte in its first {BINARY_SNIFF_BYTES} bytes), "
                                f"not text: {raw} (token files must end in .bin)")
            files.append(TextFile(p.name, p, p.stat().st_size))
        elif p.is_dir():
            found = []
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in sorted(filenames):
                    f = Path(dirpath, name)
                    if name.startswith(".") or not f.is_file() or _is_binary(f):
                        continue
                    found.append(TextFile(f"{p.name}/{f.relative_to(p).as_posix()}", f, f.stat().st_size))
            if not found:
                raise DataError(f"--data directory holds no text files: {raw}")
            files.extend(found)
        else:
            raise DataError(f"--data path is neither a file nor a directory: {raw}")
    first_named: dict[Path, TextFile] = {}
    for f in files:
        first = first_named.setdefault(f.path.resolve(), f)
        if first is not f:
            raise DataError(f"--data names the file {first.path} more than once (as {first.rel} and {f.rel}), so "
                            "it would be trained on twice: name each file once")
    return files


def is_val_file(rel: str, val_fraction: float) -> bool:
    """Whether the file at relative path ``rel`` belongs to the validation split (stable crc32 hash)."""
    return zlib.crc32(rel.encode("utf-8")) % VAL_BUCKETS < round(val_fraction * VAL_BUCKETS)


# ----------------------------------------------------------------------------------------- corpus

@dataclass
class Corpus:
    """Train and validation token streams (1-D integer arrays) and where they came from.

    ``train`` and ``val`` are ``uint8`` (bytes), ``uint16`` (nanoGPT ``.bin`` / small vocabularies)
    or ``uint32``; each holds at least ``seq_len + 1`` tokens.
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer: Tokenizer
    description: str
    n_files: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "source": self.description,
            "files": self.n_files,
            "tokenizer": getattr(self.tokenizer, "name", type(self.tokenizer).__name__),
            "vocab_size": self.vocab_size,
            "train_tokens": int(self.train.size),
            "val_tokens": int(self.val.size),
            "notes": list(self.notes),
        }


def _split_by_position(tokens: np.ndarray, val_fraction: float, window: int, notes: list[str],
                       why: str) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(window, int(tokens.size * val_fraction))
    if tokens.size - n_val >= window:
        notes.append(f"{why}: validation is the last {n_val} tokens")
        return tokens[:-n_val], tokens[-n_val:]
    notes.append(f"{why} and the corpus is too small to split: validation uses the training text")
    return tokens, tokens


def _read_bin(path: Path) -> np.ndarray:
    size = path.stat().st_size
    if size % 2:
        raise DataError(f"{path}: a .bin token file must hold uint16 tokens (an even byte count), it has {size} bytes")
    if size == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype=np.uint16, mode="r")


def _check_ids(tokens: np.ndarray, vocab_size: int, path: Path) -> None:
    step = 1 << 24
    for start in range(0, tokens.size, step):
        top = int(tokens[start:start + step].max())
        if top >= vocab_size:
            raise DataError(f"{path}: token id {top} is not below the model's vocabulary size {vocab_size}")


def load_corpus(paths: list[str | os.PathLike] | None, *, seq_len: int, tokenizer: Tokenizer | None = None,
                vocab_size: int = 256, val_fraction: float = 0.05) -> Corpus:
    """Load and split the corpus named by ``paths`` (``None``: the standard library).

    Args:
        paths: ``--data`` arguments: text files and directories, or one ``.bin`` token file.
        seq_len: tokens per training sequence; both splits must hold ``seq_len + 1`` tokens.
        tokenizer: text → ids (default :class:`ByteTokenizer`).
        vocab_size: the model's vocabulary size (``.bin`` ids are checked against it).
        val_fraction: fraction of files (text) or of tokens (``.bin``) held out for validation.

    Raises:
        DataError: a missing path, an empty directory, a corpus shorter than one sequence, a ``.bin``
            mixed with text or holding ids the model cannot embed.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    window = seq_len + 1
    notes: list[str] = []
    bins = [Path(p) for p in (paths or []) if str(p).endswith(".bin")]
    if bins:
        if len(bins) != len(paths):
            raise DataError("--data: a pre-tokenized .bin file cannot be mixed with other inputs")
        if len(bins) > 1:
            raise DataError(f"--data: give one .bin file (the training split), got {len(bins)}")
        (path,) = bins
        if not path.is_file():
            raise DataError(f"--data path does not exist: {path}" if not path.exists()
                            else f"--data path is not a file: {path}")
        tokens = _read_bin(path)
        if tokens.size < window:
            raise DataError(f"corpus {path} has {tokens.size} tokens, shorter than one sequence "
                            f"(--seq-len {seq_len} + 1 = {window} tokens)")
        _check_ids(tokens, vocab_size, path)
        val_path = path.with_name("val.bin")
        if path.name == "train.bin" and val_path.is_file():
            val = _read_bin(val_path)
            _check_ids(val, vocab_size, val_path)
            train = tokens
            if val.size < window:
                train, val = _split_by_position(tokens, val_fraction, window, notes,
                                                f"{val_path} is shorter than one sequence")
            else:
                notes.append(f"validation from {val_path}")
        else:
            train, val = _split_by_position(tokens, val_fraction, window, notes, "one .bin file")
        tok = (
            tokenizer if tokenizer is not None and not isinstance(tokenizer, ByteTokenizer) else IdTokenizer(vocab_size)
        )
        return Corpus(train, val, vocab_size, tok, str(path), 1, notes)

    tok = tokenizer or ByteTokenizer()
    files = find_text_files(paths)
    description = f"{default_data_paths()[0]} (*.py)" if paths is None else ", ".join(str(p) for p in paths)
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for f in files:
        try:
            data = f.path.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read {f.path}: {e.strerror or e}") from None
        if data:
            parts[is_val_file(f.rel, val_fraction)].append(tok.encode(data))
    dtype = np.uint8 if isinstance(tok, ByteTokenizer) else getattr(tok, "dtype", np.uint16)
    cat = lambda xs: np.concatenate(xs).astype(dtype, copy=False) if xs else np.zeros(0, dtype=dtype)  # noqa: E731
    train, val = cat(parts[False]), cat(parts[True])
    total = train.size + val.size
    if total < window:
        raise DataError(f"corpus {description} has {total} tokens, shorter than one sequence "
                        f"(--seq-len {seq_len} + 1 = {window} tokens)")
    if train.size < window or val.size < window:
        # Too few files for a split by file: fall back to the last tokens of the whole stream.
        everything = cat([a for a in (*parts[False], *parts[True])])
        train, val = _split_by_position(everything, val_fraction, window, notes,
                                        "too few files to split by file")
    else:
        note = f"split by file: {len(parts[True])} of {len(parts[False]) + len(parts[True])} files in validation"
        share = val.size / total
        if share > 2 * val_fraction:  # a few files: the hash buckets are coarse
            note += (f", {share:.0%} of the tokens against --val-fraction {val_fraction:g} (with few files the split "
                     "by their paths' hashes is coarse: give more files, or one file to split it by position)")
        notes.append(note)
    return Corpus(train, val, tok.vocab_size, tok, description, len(files), notes)


# ----------------------------------------------------------------------------------------- batches

class BatchSampler:
    """Random windows ``(x, y)``, numpy ``int64[batch_size, seq_len]``, ``y`` shifted by one token (each
    engine moves them into its framework: ``torch.from_numpy``, ``jax.device_put``).

    Stateless apart from ``index`` (micro-batches drawn so far, the same on every rank): micro-batch
    ``i`` is a function of ``(seed, i)`` only — see the module docstring — so a run resumes exactly
    from :meth:`state_dict`.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, rank: int, world_size: int,
                 seed: int, index: int = 0):
        if tokens.size < seq_len + 1:
            raise DataError(f"{tokens.size} tokens are shorter than one sequence of {seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.index = index

    def offsets(self, index: int) -> np.ndarray:
        """This rank's window starts (``int64[batch_size]``) of micro-batch ``index``."""
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, self.tokens.size - self.seq_len, size=self.world_size * self.batch_size)
        return starts[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]

    def arrays_at(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The windows at ``offsets`` as contiguous numpy ``(x, y)``, ``int64[len(offsets), seq_len]``."""
        rows = np.stack([np.asarray(self.tokens[o:o + self.seq_len + 1], dtype=np.int64) for o in offsets])
        return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """The next micro-batch ``(x, y)`` on this rank (:meth:`arrays_at`); advances :attr:`index`."""
        batch = self.arrays_at(self.offsets(self.index))
        self.index += 1
        return batch

    def state_dict(self) -> dict:
        """JSON-able data position: ``{"seed": int, "index": int}`` (micro-batches already drawn)."""
        return {"seed": self.seed, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`.

        Raises:
            DataError: the position was saved with a different seed or is malformed.
        """
        try:
            seed, index = int(state["seed"]), int(state["index"])
        except (KeyError, TypeError, ValueError):
            raise DataError(f"malformed data position {state!r}; expected {{'seed': int, 'index': int}}") from None
        if seed != self.seed:
            raise DataError(f"data position was saved with seed {seed}, this run uses seed {self.seed}")
        if index < 0:
            raise DataError(f"data position index must be >= 0, got {index}")
        self.index = index


def val_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, rank: int, world_size: int, seed: int,
                n_sequences: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """This rank's share of the run's fixed validation set, the same at every evaluation: ``(x, y, w)``
    micro-batches, ``x`` and ``y`` ``int64[b, seq_len]``, ``w`` ``float32[b]`` (1 for a row of the set, 0 for
    a padding row whose loss must not count).

    The set is ``n_sequences`` windows drawn from ``default_rng([seed, VAL_STREAM])``, whatever the world
    size (the run fixes it at its first session: :func:`chunkzero.resume_check.validation_sequences`, so
    validation losses compare across a resume at another world size). Global row ``g``
    goes to rank ``g mod world_size``; every rank gets ``ceil(set / world_size)`` rows, the last ranks'
    extra ones padding (weight 0), in micro-batches of at most ``batch_size`` rows, the same shapes on every
    rank (their forwards are collective)."""
    total = n_sequences
    starts = np.random.default_rng([seed, VAL_STREAM]).integers(0, tokens.size - seq_len, size=total)
    per_rank = -(-total // world_size)
    rows = np.arange(per_rank) * world_size + rank  # this rank's global rows
    weights = (rows < total).astype(np.float32)
    sampler = BatchSampler(tokens, seq_len=seq_len, batch_size=batch_size, rank=rank, world_size=world_size,
                           seed=seed)
    x, y = (np.ascontiguousarray(a) for a in sampler.arrays_at(starts[rows % total]))
    return [(x[i:i + batch_size], y[i:i + batch_size], weights[i:i + batch_size])
            for i in range(0, per_rank, batch_size)]
