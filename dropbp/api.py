"""``dropbp.apply``: the public entry point, which turns names and numbers into the controller's parts.

It resolves the backend, finds the branches (:mod:`dropbp.discovery`), builds the drop policy
(:mod:`dropbp.policy`, which validates every rate setting) and hands them to
:class:`~dropbp.controller.DropBPController`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .backends import Backend
from .backends import get as get_backend
from .checks import check_int
from .controller import DropBPController
from .discovery import find_branches
from .dropped_grads import DEFAULT_DROPPED_GRADS
from .frameworks import unwrap
from .policy import DEFAULT_RAMP, DropPolicy

__all__ = ["apply"]


def apply(
    model: nn.Module,
    drop_rate: float,
    *,
    seed: int = 0,
    branches: Sequence[str] | None = None,
    max_patterns: int | None = None,
    seq_len: int = 512,
    backend: str | Backend | None = None,
    unbiased: bool = False,
    dropped_grads: str = DEFAULT_DROPPED_GRADS,
    warmup_steps: int = 0,
    pattern: str = "cut",
    chunked_loss: bool | int = False,
    total_steps: int | None = None,
    drop_schedule: str = "constant",
    ramp: float = DEFAULT_RAMP,
) -> DropBPController:
    """Attach DropBP to ``model``: each training step drops the backward of random residual branches.

    A branch is the ``f`` in a residual update ``x = x + f(x)``: the attention and the MLP of every
    layer. Recognised Hugging Face architectures (``dropbp.SUPPORTED_ARCHITECTURES``) are found by
    their child names; other models name their branch modules with ``branches=``.

    Args:
        model: a Hugging Face, PEFT or custom ``nn.Module``, possibly wrapped in
            ``DistributedDataParallel`` (which must have ``find_unused_parameters=True``): the
            branches are then found in its ``.module`` and named as there. Wrapping after ``apply``
            works the same; so does FSDP2 ``fully_shard`` before or after, and a DeepSpeed engine
            (``deepspeed.initialize`` before or after; :mod:`dropbp.integrations.deepspeed`).
        drop_rate: the FLOP-weighted mean drop probability of the branches, in [0, 1): with the cut
            shape, spread over the depth; with the uniform shape, every branch's (``calibrate`` or
            ``set_rates`` can make them differ); ``ctl.drop_rate``.
        seed: fixes the patterns: they are a function of (seed, step), identical on every process.
        branches: module names (as in ``model.named_modules()``) of the branches, in forward order,
            for a model that is not a recognised architecture: each module's output must be what is
            then added to the residual stream, not a module that adds the residual itself (a whole
            layer; BERT's ``encoder.layer.N.attention``, which ends in ``LayerNorm(x + ...)``). For
            BERT: ``[f"bert.encoder.layer.{i}.{m}" for i in range(n) for m in ("attention.self",
            "intermediate")]``. A whole layer, or a module holding one or another named branch, is
            refused here; a choice that cuts every trainable parameter off the output is stopped at that
            forward with this advice.
        max_patterns: bound on distinct patterns (for compiled graphs); ``None``: the backend's
            default (a bound on lazily compiled devices).
        seq_len: the typical sequence length, used only to weigh attention FLOPs.
        backend: a backend name or instance (default :func:`dropbp.backends.get`:
            ``DROPBP_BACKEND``, else detected); ``ctl.backend``, whose step boundaries
            :meth:`DropBPController.backward` and :meth:`DropBPController.optimizer_step` place.
        unbiased: multiply the gradient entering each kept branch by ``1 / (1 - rate)`` (forward
            unchanged), so every parameter's expected gradient is the full-backprop gradient;
            ``ctl.unbiased``, settable at any time.
        dropped_grads: what the optimizer sees for a dropped branch's parameters: ``"skip"`` (no
            gradient, so no update: the paper), ``"zero"`` (a zero gradient: momentum optimizers
            keep moving them) or ``"reuse"`` (their last computed gradient); see
            :mod:`dropbp.dropped_grads`.
        warmup_steps: training forwards over which every rate rises linearly from 0: the first
            steps, where a fine-tune learns fastest, run (nearly) full backprop; ``ctl.warmup_steps``,
            saved in ``state_dict``.
        pattern: the shape of the drop patterns. ``"cut"`` (the default): each step draws a depth and
            drops every branch below it, so a kept branch's gradient misses no path through a dropped
            branch above it; the rates fall with depth (:func:`dropbp.allocation.cut_rates`, capped at
            ``(1 + drop_rate) / 2`` so the bottom still trains), their FLOP-weighted mean is
            ``drop_rate``, and the top branch is always kept. It reached a given loss sooner than the
            paper's patterns in every setting measured (``docs/patterns.md``). The number dropped
            varies from step to step, down to none, so it does not lower the peak memory.
            ``"uniform"``: the paper's, every branch dropped at its own rate wherever it sits, the same
            number in every step (steady memory: use it to train longer sequences), and the only shape
            ``calibrate`` can allocate for. ``ctl.pattern``, settable.
        chunked_loss: for a Hugging Face causal LM called with ``labels`` in training, compute the
            LM head and cross-entropy in chunks recomputed in backward (:mod:`dropbp.chunked_loss`):
            same loss and gradients, but the full logits and their gradient never exist at once, so
            they no longer cap the memory dropping saves. ``True``: chunks of 64 MiB of float32
            logits; an int: tokens per chunk. Such forwards return ``logits=None``. Works at any
            rate, 0 included; ``ctl.remove()`` restores the model's forward.
        total_steps: the run's length in training forwards (micro-batches: optimizer steps times
            gradient accumulation), counted like ``warmup_steps``; ``attach`` passes it itself. Given,
            the rates follow ``drop_schedule`` over the run and are scaled so that the run's mean drop
            rate, warm-up included, is ``drop_rate`` (the compute it asks to save); without it, the
            rates stay as set after the warm-up. ``ctl.total_steps``, saved in ``state_dict``.
        drop_schedule: how the rates move over a run of known length (:mod:`dropbp.schedule`):
            ``"constant"`` (only the warm-up), or rising from 0 over the first ``ramp`` of the run,
            ``"linear"``, ``"cosine"`` or ``"step"``, then held at the peak that keeps the mean: with the
            cut shape, a randomised progressive freezing from the bottom. A peak the pattern shape cannot
            take (a rate above 1) is refused. ``ctl.drop_schedule``.
        ramp: the share of the run, in (0, 1], over which a rising ``drop_schedule`` rises; ``ctl.ramp``.

    Returns:
        The :class:`DropBPController`; ``ctl.remove()`` restores the model exactly.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inner, _ = unwrap(model)
    _check_trainable(inner)
    if backend is None or isinstance(backend, str):
        backend = get_backend(backend)
    elif not isinstance(backend, Backend):
        raise TypeError(f"backend must be a name, a Backend or None, got {type(backend).__name__}")
    if branches is not None and not isinstance(branches, (list, tuple)):
        raise TypeError(f"branches must be a list of module names, got {type(branches).__name__}")
    found = find_branches(inner, None if branches is None else list(branches), check_int("seq_len", seq_len, 1))
    bound = backend.default_max_patterns if max_patterns is None else max_patterns
    policy = DropPolicy(
        [b.flops for b in found], drop_rate, seed, bound, warmup_steps, pattern, total_steps, drop_schedule, ramp
    )
    return DropBPController(
        model, found, policy, backend, unbiased=unbiased, dropped_grads=dropped_grads, chunked_loss=chunked_loss
    )


def _check_trainable(model: nn.Module) -> None:
    """Refuse a model with nothing to train: DropBP drops parts of a backward, and there would be none.

    Without this, ``apply`` would succeed and every ``loss.backward()`` would raise torch's bare "element 0 of
    tensors does not require grad" (and :meth:`DropBPController.backward` return False), saying nothing of why.
    """
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"dropbp.apply: no parameter of this {type(model).__name__} requires a gradient, so there is no backward "
            "pass to drop: unfreeze some (e.g. model.requires_grad_(True)) or add LoRA adapters "
            "(peft.get_peft_model) before dropbp.apply"
        )
