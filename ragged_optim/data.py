"""Byte-level text that every machine has without a download: the Python standard library's own source.

The corpus is the ``.py`` files under ``sysconfig.get_paths()['stdlib']`` (site-packages excluded), read in a fixed
depth-first order (each folder's files sorted, then its subfolders sorted) and concatenated up to a byte cap; the
vocabulary is the 256 byte values, so no vocab file is needed. The last ``val_fraction`` of the bytes is the
validation split.

``get_batch`` is a pure function of (split, batch_size, seq_len, step, seed): it draws the *global* batch of
``batch_size`` windows for that step and returns rank ``rank``'s contiguous slice of ``batch_size // world_size``
rows. So the per-rank batches of W ranks, concatenated in rank order, are exactly the batch a one-process run uses
at the same step: the property that sharded == unsharded checks rely on.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache

import torch

VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 4_000_000
DEFAULT_VAL_FRACTION = 0.1
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_SPLIT_SALT = {"train": 0x5EED_7A1, "val": 0x5EED_7A2}


def stdlib_source_files(root: str | None = None) -> list[str]:
    """Paths of the standard library's ``.py`` files, in a deterministic (sorted, depth-first) order."""
    root = root or sysconfig.get_paths()["stdlib"]
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return out


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor  # uint8, 1-D
    n_files: int

    def split(self, name: str) -> torch.Tensor:
        if name not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {name!r}")
        return self.train if name == "train" else self.val


@lru_cache(maxsize=4)
def load_corpus(max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = DEFAULT_VAL_FRACTION) -> Corpus:
    """Read the stdlib sources up to ``max_bytes`` (cached per process; forked ranks inherit the cache)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    chunks: list[bytes] = []
    total = 0
    files = stdlib_source_files()
    n_files = 0
    for path in files:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        data = data + b"\n\n"
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        n_files += 1
        if total >= max_bytes:
            break
    blob = b"".join(chunks)
    if len(blob) < 10_000:
        raise RuntimeError(
            f"found only {len(blob)} bytes of Python source under {sysconfig.get_paths()['stdlib']!r}; "
            "the training corpus needs the standard library's .py files"
        )
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    n_val = int(len(data) * val_fraction)
    return Corpus(train=data[:-n_val].clone(), val=data[-n_val:].clone(), n_files=n_files)


def batch_offsets(n_tokens: int, batch_size: int, seq_len: int, step: int, seed: int, split: str) -> torch.Tensor:
    """Start offsets of the global batch's windows: a pure function of its arguments."""
    if n_tokens <= seq_len + 1:
        raise ValueError(f"split {split!r} has {n_tokens} bytes, too few for seq_len={seq_len}")
    gen = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + step * 7919 + _SPLIT_SALT[split]) % 2**63)
    return torch.randint(0, n_tokens - seq_len - 1, (batch_size,), generator=gen)


def get_batch(
    split: str,
    batch_size: int,
    seq_len: int,
    step: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    corpus: Corpus | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share of the global batch at ``step``: inputs and next-byte targets, int64 ``[b, seq_len]``
    with ``b = batch_size // world_size``. ``batch_size`` is the global batch size."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if batch_size % world_size:
        raise ValueError(
            f"global batch_size={batch_size} is not divisible by world_size={world_size}; "
            "pick a batch size that is a multiple of the number of ranks"
        )
    data = (corpus or load_corpus()).split(split)
    offsets = batch_offsets(len(data), batch_size, seq_len, step, seed, split)
    local = batch_size // world_size
    starts = offsets[rank * local : (rank + 1) * local]
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    windows = data[idx].long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
