"""Datasets for `netgain train`, with batches that are a pure function of (seed, step, rank).

Making every batch a function of those three numbers (no iterator state) is what lets a run
stopped at step k and resumed in fresh processes see exactly the data a straight run sees.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VALIDATION_EVERY_NTH_FILE = 10  # every 10th file (sorted order) is held out for validation


def batch_rng(seed: int, step: int, rank: int) -> np.random.Generator:
    """The random generator for one rank's batch at one step; independent of any history."""
    return np.random.default_rng([seed, step, rank])


def shard(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """The [start, stop) slice of n items that belongs to `rank`: each rank its own data."""
    return n * rank // world_size, n * (rank + 1) // world_size


def stdlib_source_files() -> list[Path]:
    """The Python standard library's own .py files, sorted (site-packages excluded: it varies)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)


def text_files(path: str | Path, flag: str = "--data") -> list[Path]:
    """A text file, or every regular file under a folder in sorted order; a ValueError names ``flag``."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        if files:
            return files
        raise ValueError(f"{flag}: folder {path} holds no files")
    raise ValueError(f"{flag}: {path} is neither a file nor a folder")


@dataclass
class ByteCorpus:
    """Text as a byte stream (vocabulary 256, no tokenizer), split into train and validation."""

    train: torch.Tensor  # uint8
    validation: torch.Tensor  # uint8

    @classmethod
    def from_files(cls, files: list[Path]) -> "ByteCorpus":
        """Split by file when there are enough files (no file leaks into both), else by the tail 10%."""
        if len(files) >= VALIDATION_EVERY_NTH_FILE:
            held_out = set(range(VALIDATION_EVERY_NTH_FILE - 1, len(files), VALIDATION_EVERY_NTH_FILE))
            train = b"".join(f.read_bytes() for i, f in enumerate(files) if i not in held_out)
            validation = b"".join(files[i].read_bytes() for i in sorted(held_out))
        else:
            text = b"".join(f.read_bytes() for f in files)
            cut = len(text) - len(text) // VALIDATION_EVERY_NTH_FILE
            train, validation = text[:cut], text[cut:]
        return cls(_bytes_tensor(train), _bytes_tensor(validation))

    def require_sequences(self, world_size: int, seq_len: int, what: str) -> None:
        """Every rank's shard of the train text and the validation text hold one sequence at least."""
        if not len(self.train) + len(self.validation):
            raise ValueError(f"{what} holds no text (0 bytes)")
        start, stop = shard(len(self.train), 0, world_size)
        _require_length(stop - start, seq_len, f"{what}: a rank's shard of the training text ({world_size} ranks)")
        _require_length(len(self.validation), seq_len, f"{what}: the validation text")

    def train_batch(self, seed: int, step: int, rank: int, world_size: int, batch_size: int,
                    seq_len: int) -> torch.Tensor:
        """`batch_size` random windows of `seq_len` bytes from this rank's shard of the train stream."""
        start, stop = shard(len(self.train), rank, world_size)
        _require_length(stop - start, seq_len, "this rank's shard of the training text")
        offsets = batch_rng(seed, step, rank).integers(start, stop - seq_len + 1, size=batch_size)
        return _windows(self.train, offsets, seq_len)

    def validation_batches(self, count: int, batch_size: int, seq_len: int) -> list[torch.Tensor]:
        """A fixed set of `count` batches spread evenly over the validation stream."""
        _require_length(len(self.validation), seq_len, "the validation text")
        offsets = np.linspace(0, len(self.validation) - seq_len, count * batch_size).astype(np.int64)
        return [_windows(self.validation, chunk, seq_len) for chunk in np.split(offsets, count)]


@dataclass
class Digits:
    """scikit-learn's bundled 8x8 digits, standardised with the training split's statistics."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @classmethod
    def load(cls, test_fraction: float = 0.25) -> "Digits":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        order = np.random.default_rng(0).permutation(len(y))
        n_test = int(len(y) * test_fraction)
        test, train = order[:n_test], order[n_test:]
        mean, std = x[train].mean(0), x[train].std(0) + 1e-6
        x = ((x - mean) / std).astype(np.float32)
        as_tensors = (torch.from_numpy(x[train]), torch.from_numpy(y[train]),
                      torch.from_numpy(x[test]), torch.from_numpy(y[test]))
        return cls(*as_tensors)

    def train_batch(self, seed: int, step: int, rank: int, world_size: int,
                    batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch_size` examples drawn from this rank's shard of the training split."""
        start, stop = shard(len(self.train_y), rank, world_size)
        index = torch.from_numpy(batch_rng(seed, step, rank).integers(start, stop, size=batch_size))
        return self.train_x[index], self.train_y[index]


def _bytes_tensor(data: bytes) -> torch.Tensor:
    if not data:  # frombuffer rejects an empty buffer
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _require_length(length: int, seq_len: int, what: str) -> None:
    if length < seq_len:
        raise ValueError(f"{what} has {length} bytes, fewer than one sequence of {seq_len}; "
                         "give --data more text, fewer workers or a shorter --seq-len")


def _windows(stream: torch.Tensor, offsets: np.ndarray, seq_len: int) -> torch.Tensor:
    index = torch.from_numpy(np.asarray(offsets, dtype=np.int64))[:, None] + torch.arange(seq_len)
    return stream[index].long()
