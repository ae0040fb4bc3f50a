"""``dropbp check``'s noise-scale section: the gradient noise scale of the user's own model on their own text, and
what it forecasts for their tokens per step.

A few optimizer steps' worth of accumulated micro-batches (backward only: no optimizer step, the model's weights are
not changed) with ``measure_noise_scale=True`` (:mod:`dropbp.features.gradient_noise`), at the model's weights as
loaded: the noise scale at the start of fine-tuning, which grows as a run learns (docs/noise-scale.md). The forecast
(:func:`dropbp.features.noise_scale.noise_scale_forecast`) uses the branches' share of a step measured by the
check's own speed section where it ran, else the map's.
"""

from __future__ import annotations

import dataclasses
import pydoc_data.topics
from pathlib import Path

import torch
from torch import nn

from dropbp.backends import Backend
from dropbp.experimental.where_it_pays import measured_map
from dropbp.features.noise_scale import noise_scale_arms, noise_scale_forecast
from dropbp.tools.arms import apply_arm as apply

__all__ = [
    "NOISE_MICRO_BATCHES",
    "NOISE_STEPS",
    "branch_share",
    "check_stream",
    "noise_section",
    "read_text_file",
    "token_stream",
]

#: Optimizer steps measured, and micro-batches (1 sequence each) per step.
NOISE_STEPS = 8
NOISE_MICRO_BATCHES = 4


#: File signatures of common compressed or binary formats a user may pass as --data, and what to do with each.
_BINARY = {b"\x1f\x8b": "a gzip file: decompress it first (gunzip)", b"PK\x03\x04": "a zip archive: extract the "
           "text first", b"BZh": "a bzip2 file: decompress it first (bunzip2)", b"\xfd7zXZ": "an xz file: decompress "
           "it first (unxz)", b"PAR1": "a Parquet file: write its text column to a .txt file first"}  # fmt: skip


def read_text_file(text_file: str | Path) -> str:
    """The text of ``text_file``, which must be a UTF-8 text file.

    Raises:
        ValueError: it does not exist, is a folder, is a compressed or binary file (named, with what to do), or is
            not UTF-8 text; one line each."""
    path = Path(text_file)
    if path.is_dir():
        raise ValueError(f"the data file {path} is a folder; pass a UTF-8 text file")
    if not path.is_file():
        raise ValueError(f"the data file {path} does not exist; pass a UTF-8 text file")
    raw = path.read_bytes()
    kind = next((what for magic, what in _BINARY.items() if raw.startswith(magic)), None)
    if kind is not None:
        raise ValueError(f"the data file {path} is {kind}; pass a UTF-8 text file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"the data file {path} is not UTF-8 text (byte {err.start}); pass a UTF-8 text file") from None
    if "\x00" in text:
        raise ValueError(f"the data file {path} holds NUL bytes, as binary files do; pass a UTF-8 text file")
    return text


def token_stream(text_file: str | Path | None, tokenizer: object | None, vocab_size: int) -> torch.Tensor:
    """The text's token ids, one long row: ``text_file`` (default: Python's help topics, which ship with Python),
    tokenised by ``tokenizer`` where the model has one, else its UTF-8 bytes folded into the vocabulary."""
    if text_file is None:
        text = "\n\n".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))
    else:
        text = read_text_file(text_file)
    if tokenizer is not None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = [b % vocab_size for b in text.encode()]
    return torch.tensor(ids, dtype=torch.long)


def branch_share(speed: dict | None) -> float | None:
    """The share of a step's forward and backward time the branches' backward takes, from the check's speed figures
    (``(B - B0) / (F + B)``), or None where they are missing or out of range."""
    if not speed or "baseline" not in speed or "all_dropped" not in speed:
        return None
    base = speed["baseline"]
    forward, backward = base.get("forward_s"), base.get("backward_s")
    dropped = speed["all_dropped"].get("backward_s")
    if None in (forward, backward, dropped) or forward + backward <= 0:
        return None
    share = (backward - dropped) / (forward + backward)
    return share if 0.0 < share < 1.0 else None


def check_stream(stream: torch.Tensor, seq_len: int) -> int:
    """The tokens the measurement reads; ValueError, saying what to do, where ``stream`` holds fewer."""
    needed = (NOISE_STEPS * NOISE_MICRO_BATCHES + 1) * seq_len
    if stream.numel() < needed:
        raise ValueError(
            f"the noise scale needs at least {needed} tokens of text ({NOISE_STEPS} steps of {NOISE_MICRO_BATCHES} "
            f"x {seq_len}); the data holds {stream.numel()}: pass a longer file or a shorter --seq-len"
        )
    return needed


def noise_section(
    model: nn.Module,
    backend: Backend,
    stream: torch.Tensor,
    seq_len: int,
    tokens_per_step: int | None,
    share: float | None,
    drop_rate: float = 0.5,
) -> dict:
    """Measure the noise scale on ``stream`` (windows of ``seq_len`` tokens) and forecast each arm at
    ``tokens_per_step`` (default: the measurement's own). Gradients are left cleared; the weights unchanged.

    Raises:
        ValueError: where ``stream`` holds too few tokens for the measurement.
    """
    needed = check_stream(stream, seq_len)
    windows = stream[:needed].view(-1, seq_len).to(backend.device)
    params = [p for p in model.parameters() if p.requires_grad]
    ctl = apply(model, 0.0, backend=backend, measure_noise_scale=True)
    try:
        for step in range(NOISE_STEPS + 1):  # the last forward closes the last step
            for p in params:
                p.grad = None
            for k in range(NOISE_MICRO_BATCHES if step < NOISE_STEPS else 1):
                ids = windows[step * NOISE_MICRO_BATCHES + k].unsqueeze(0)
                loss = model(input_ids=ids, labels=ids).loss / NOISE_MICRO_BATCHES
                if step < NOISE_STEPS:
                    loss.backward()
        measured = ctl.features["noise_scale"].estimate()
    finally:
        ctl.remove()
        for p in params:
            p.grad = None
    if measured is None:  # cannot happen with >= 2 micro-batches per step; said rather than assumed
        raise RuntimeError("the noise scale was not measured")
    asked = tokens_per_step or round(measured.tokens_per_step)
    at_yours = dataclasses.replace(measured, tokens_per_step=float(asked))
    source = "this check's speed measurement"
    if share is None:
        shipped = measured_map()
        share, source = shipped["branch_share"], f"the map's cost record ({shipped['branch_share_source']})"
    arms = noise_scale_arms(at_yours, drop_rate, share)
    return {
        "noise_scale_tokens": measured.tokens,
        "gradient_sq_norm": measured.gradient_sq_norm,
        "trace": measured.trace,
        "measured_steps": measured.steps,
        "measured_tokens_per_step": measured.tokens_per_step,
        "tokens_per_step": asked,
        "branch_share": share,
        "branch_share_from": source,
        "forecast": [dataclasses.asdict(a) | {"speedup": a.speedup} for a in arms],
        "message": noise_scale_forecast(at_yours, drop_rate, share),
    }
