"""Real text that ships with Python, as token batches: no dataset download.

``pydoc_data.topics`` is the text of Python's interactive help (~0.5 MB of documentation prose and
code). Topics are split, not tokens: every tenth topic (in sorted order) is held out for
validation, so validation text is never seen in training.
"""

from __future__ import annotations

import pydoc_data.topics
from dataclasses import dataclass

import torch

__all__ = ["TokenData", "pydoc_topics"]


@dataclass
class TokenData:
    """Fixed-length training and validation windows of token ids."""

    train: torch.Tensor  # (n_train, seq_len)
    val: torch.Tensor  # (n_val, seq_len)

    def train_batch(self, step: int, batch_size: int, seed: int) -> torch.Tensor:
        """The batch for ``step``: a pure function of (seed, step), the same for every run."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return self.train[torch.randint(0, len(self.train), (batch_size,), generator=g)]

    def val_batches(self, batch_size: int) -> list[torch.Tensor]:
        return list(self.val.split(batch_size))


def _windows(ids: list[int], seq_len: int) -> torch.Tensor:
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def pydoc_topics(tokenizer: object, seq_len: int, max_val_windows: int = 32) -> TokenData:
    """Python's help topics tokenised with ``tokenizer``; every tenth topic is validation text."""
    topics = pydoc_data.topics.topics
    names = sorted(topics)
    train_text = "\n\n".join(topics[n] for i, n in enumerate(names) if i % 10 != 0)
    val_text = "\n\n".join(topics[n] for i, n in enumerate(names) if i % 10 == 0)
    train = _windows(tokenizer(train_text)["input_ids"], seq_len)
    val = _windows(tokenizer(val_text)["input_ids"], seq_len)[:max_val_windows]
    if len(train) == 0 or len(val) == 0:
        raise ValueError(f"seq_len={seq_len} is longer than the text; use a shorter sequence")
    return TokenData(train, val)
