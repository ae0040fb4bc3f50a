"""Real text that ships with Python, as token batches: no dataset download.

Two documentation corpora: Python's help topics and the standard library's docstrings.

``pydoc_data.topics`` is the text of Python's interactive help (~0.5 MB of documentation prose and
code). Topics are split, not tokens: every tenth topic (in sorted order) is held out for
validation, so validation text is never seen in training.
"""

from __future__ import annotations

import ast
import pydoc_data.topics
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CORPORA", "TokenData", "pydoc_topics", "stdlib_docstrings"]


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
    return _token_data(tokenizer, train_text, val_text, seq_len, max_val_windows)


def _token_data(tokenizer: object, train_text: str, val_text: str, seq_len: int, max_val_windows: int) -> TokenData:
    train = _windows(tokenizer(train_text)["input_ids"], seq_len)
    val = _windows(tokenizer(val_text)["input_ids"], seq_len)[:max_val_windows]
    if len(train) == 0 or len(val) == 0:
        raise ValueError(f"seq_len={seq_len} is longer than the text; use a shorter sequence")
    return TokenData(train, val)


def _docstrings(path: Path) -> str:
    """A module's docstrings (module, classes, functions) in source order, without importing it."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, _DOCUMENTED))]
    return "\n\n".join(doc for n in nodes if (doc := ast.get_docstring(n)))


_DOCUMENTED = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_SKIPPED = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__", "turtledemo"}


def stdlib_docstrings(
    tokenizer: object, seq_len: int, max_val_windows: int = 32, max_chars: int = 1_500_000
) -> TokenData:
    """The docstrings of Python's standard library source files, a second documentation corpus.

    Read from the interpreter's own ``Lib`` directory with :mod:`ast` (nothing is imported); tests,
    IDLE and lib2to3 are skipped. Modules are taken in sorted path order until ``max_chars``; every
    tenth module is validation text.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not _SKIPPED.intersection(p.relative_to(root).parts))
    train_parts: list[str] = []
    val_parts: list[str] = []
    size = 0
    for i, path in enumerate(files):
        text = _docstrings(path)
        if not text:
            continue
        (val_parts if i % 10 == 0 else train_parts).append(text)
        size += len(text)
        if size >= max_chars:
            break
    return _token_data(tokenizer, "\n\n".join(train_parts), "\n\n".join(val_parts), seq_len, max_val_windows)


#: Corpus name -> loader(tokenizer, seq_len, max_val_windows).
CORPORA = {"pydoc": pydoc_topics, "stdlib-docstrings": stdlib_docstrings}
