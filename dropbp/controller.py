"""``dropbp.apply`` and the controller it returns: the public face of the core.

The controller decides the drop pattern once per training-mode forward of the model it was applied
to (a forward pre-hook on that model, before any branch runs) and keeps it until the next one, so
activation-checkpointing recomputation during backward sees the same decision. Each branch module
consults that decision when it is called; a dropped one inside a checkpointed region is not run again
by the recomputation (:mod:`dropbp.recompute`). All these hooks run outside ``torch.compile`` graphs
(:mod:`dropbp.compile`); a DDP wrapper is checked and unwrapped (:mod:`dropbp.distributed`).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from . import sensitivity
from .adapters import Branch, find_branches
from .allocation import allocate_rates
from .backends import Backend
from .backends import get as get_backend
from .compile import outside_graphs
from .distributed import check_ddp, check_running_ddp, check_running_ddp_checkpointing, unwrap
from .dropped_grads import DEFAULT_DROPPED_GRADS, DROPPED_GRADS, DroppedGrads
from .execution import attach_no_grad_hooks
from .recompute import RecomputeCache, in_backward
from .sampler import PatternSampler, check_rates, max_total_rate
from .scaling import attach_gradient_scaling

__all__ = ["DropBPController", "apply"]

log = logging.getLogger("dropbp")

# Modules (models and branch modules) that already carry a controller: applying twice would stack
# hooks and make two samplers fight over one model.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, DropBPController] = weakref.WeakKeyDictionary()

_STATE_VERSION = 1
_BOUNDED_WARMUP_LEVELS = 4


def _check_drop_rate(drop_rate: object) -> float:
    if isinstance(drop_rate, bool) or not isinstance(drop_rate, (int, float)):
        raise TypeError(f"drop_rate must be a number in [0, 1), got {type(drop_rate).__name__}")
    value = float(drop_rate)
    if not (0.0 <= value < 1.0):  # also rejects NaN
        raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate!r}")
    return value


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


class DropBPController:
    """Drop policy attached to one model. Create it with :func:`dropbp.apply`."""

    def __init__(
        self,
        model: nn.Module,
        branches: list[Branch],
        drop_rate: float,
        seed: int,
        max_patterns: int | None,
        backend: Backend,
        unbiased: bool = False,
        dropped_grads: str = "skip",
        warmup_steps: int = 0,
    ) -> None:
        self._model = model
        self._branches = branches
        #: The device backend whose step boundaries :meth:`backward` and :meth:`optimizer_step` place.
        self.backend = backend
        self.drop_rate = drop_rate
        self.seed = seed
        self.max_patterns = max_patterns
        #: Scale the gradient entering each kept branch by 1 / (1 - rate) (see dropbp/scaling.py).
        self.unbiased = unbiased
        #: Training forwards over which every rate rises linearly from 0 to its value.
        self.warmup_steps = warmup_steps
        self._warmup_samplers: dict[float, PatternSampler] = {}
        self._step = 0
        self._dropped: frozenset[int] = frozenset()
        self._forced: frozenset[int] | None = None
        self._last_dropped: tuple[str, ...] = ()
        self._branch_params = [list(b.module.parameters()) for b in branches]
        self._tally = [0, 0, 0.0]  # forwards, branches dropped, branch FLOPs dropped (since last read)
        self._sampler = PatternSampler([drop_rate] * len(branches), seed, max_patterns)
        for b in branches:
            b.rate = drop_rate
        self._recompute = RecomputeCache([b.module for b in branches])
        self._fill = DroppedGrads(dropped_grads, [b.module for b in branches])
        self._handles = [
            model.register_forward_pre_hook(self._on_model_forward),
            model.register_forward_hook(self._after_model_forward, always_call=True),
        ]
        for index, branch in enumerate(branches):
            cache = self._recompute.branches[index]
            self._handles += attach_no_grad_hooks(branch.module, self._dropped_test(index), cache)
            self._handles.append(attach_gradient_scaling(branch.module, self._scale_for(index)))
        for module in (model, *(b.module for b in branches)):
            _ATTACHED[module] = self
        self._removed = False

    # -- the per-step decision -------------------------------------------------------------------
    def _dropped_test(self, index: int):
        return lambda: index in self._dropped

    def _scale_for(self, index: int):
        def scale(module: nn.Module) -> float:
            if not self.unbiased or self._forced is not None or not module.training:
                return 1.0  # calibration measures the plain gradients
            if index in self._dropped:
                return 1.0
            return 1.0 / (1.0 - self._branches[index].rate)

        return scale

    @outside_graphs
    def _on_model_forward(self, model: nn.Module, args: tuple) -> None:
        if in_backward():
            return  # checkpointing recomputes the whole model: the step's decision stands
        if self._forced is not None:
            self._dropped = self._forced  # calibration passes: a given pattern, no step taken
            self._recompute.begin_forward()
            return
        if not (model.training and torch.is_grad_enabled()):
            return  # eval or no-grad forwards drop nothing and leave the step's decision alone
        self._dropped = self._pattern(self._step)
        if self._dropped:
            check_running_ddp()  # a DDP wrapper added after apply() must cope with unused parameters
        self._recompute.begin_forward()
        self._fill.note_dropped(self._dropped)
        self._step += 1
        self._last_dropped = tuple(self._branches[i].name for i in sorted(self._dropped))
        self._tally[0] += 1
        self._tally[1] += len(self._dropped)
        self._tally[2] += sum(self._branches[i].flops for i in self._dropped)

    @outside_graphs
    def _after_model_forward(self, model: nn.Module, args: tuple, output: object) -> None:
        self._recompute.end_forward()
        if self._recompute.reentrant:
            check_running_ddp_checkpointing()

    def _pattern(self, step: int) -> frozenset[int]:
        return self._keep_a_trainable_branch(self._sampler_at(step).pattern(step))

    def _sampler_at(self, step: int) -> PatternSampler:
        """The sampler for ``step``: during warm-up, one for the rates scaled by the warm-up factor.
        With bounded patterns the factor moves in quarters, so warm-up adds at most three pools."""
        if step >= self.warmup_steps:
            return self._sampler
        levels = self.warmup_steps if self.max_patterns is None else _BOUNDED_WARMUP_LEVELS
        factor = math.floor(levels * step / self.warmup_steps) / levels
        sampler = self._warmup_samplers.get(factor)
        if sampler is None:
            sampler = PatternSampler([r * factor for r in self.rates], self.seed, self.max_patterns)
            self._warmup_samplers[factor] = sampler
        return sampler

    def _keep_a_trainable_branch(self, pattern: frozenset[int]) -> frozenset[int]:
        """Never drop every branch that holds trainable parameters when nothing else is trainable
        (LoRA on attention only, say): the loss would have no gradient and ``backward()`` would raise.
        In such a step the trainable branch with the lowest rate (then the first) is kept; this is
        rare (every trainable branch drawn at once) and stays a pure function of (seed, step)."""
        if not pattern:
            return pattern

        # Parameters are read at use: FSDP2 ``fully_shard`` after ``apply`` replaces them.
        def trainable(i: int) -> bool:
            return any(p.requires_grad for p in self._branches[i].module.parameters())

        if any(trainable(i) for i in range(len(self._branches)) if i not in pattern):
            return pattern
        dropped = [i for i in pattern if trainable(i)]
        if not dropped:
            return pattern
        inside = {id(p) for b in self._branches for p in b.module.parameters()}
        if any(p.requires_grad and id(p) not in inside for p in self._model.parameters()):
            return pattern  # e.g. embeddings or a head still receive a gradient
        return pattern - {min(dropped, key=lambda i: (self._branches[i].rate, i))}

    @contextmanager
    def _force(self, pattern: frozenset[int]) -> Iterator[None]:
        previous = self._dropped
        self._forced = pattern
        try:
            yield
        finally:
            self._forced = None
            self._dropped = previous
            self._recompute.clear()  # outputs held under the forced pattern are not the step's

    # -- public contract -------------------------------------------------------------------------
    @property
    def branches(self) -> list[Branch]:
        """The branches in forward order (``.name``, ``.kind``, ``.flops``, ``.rate``)."""
        return list(self._branches)

    @property
    def rates(self) -> list[float]:
        return [b.rate for b in self._branches]

    def set_rates(self, rates: Sequence[float]) -> None:
        """Set one drop rate per branch (branch order); each in [0, 1), summing to at most N - 1."""
        self._check_attached()
        values = check_rates(rates, len(self._branches))
        for b, r in zip(self._branches, values, strict=True):
            b.rate = r
        self._sampler = PatternSampler(values, self.seed, self.max_patterns)
        self._warmup_samplers = {}

    @property
    def dropped_grads(self) -> str:
        """What the optimizer sees for dropped branches: "skip", "zero" or "reuse" (see apply)."""
        return self._fill.mode

    @property
    def last_dropped(self) -> tuple[str, ...]:
        """Names of the branches dropped in the most recent training-mode forward."""
        return self._last_dropped

    @property
    def step(self) -> int:
        """How many training-mode forwards have drawn a pattern so far."""
        return self._step

    def dropped_at(self, step: int) -> tuple[str, ...]:
        """Names of the branches that drop at ``step`` (a pure function of seed, step and rates)."""
        _check_int("step", step, 0)
        return tuple(self._branches[i].name for i in sorted(self._pattern(step)))

    def calibrate(
        self,
        closure: Callable[[], torch.Tensor],
        *,
        gradnorm: bool = True,
        method: str = "one-pass",
        min_rate: float = 0.0,
        max_rate: float = 0.9,
    ) -> list[float]:
        """Measure each branch's sensitivity and set the rates by :func:`dropbp.allocate_rates`.

        ``closure()`` runs a forward on one fixed batch and returns the scalar loss (no backward).
        Returns the sensitivities in branch order. ``method="one-pass"`` (default) gets them from a
        single forward; ``"exact-recompute"`` is the research code's N + 1 passes, reseeded alike
        (used instead, with a logged warning, under re-entrant activation checkpointing, which
        rebuilds layer graphs only inside backward).
        Nothing drops during calibration and the step counter does not move. The model's ``.grad``
        are left exactly as they were (gradients are computed with ``torch.autograd.grad``) and its
        train/eval modes are restored. With ``torch.distributed`` initialised, the sensitivities
        are averaged over ranks, so every rank ends with identical rates.
        """
        self._check_attached()
        if not callable(closure):
            raise TypeError(f"closure must be callable and return the loss, got {type(closure).__name__}")
        if method not in sensitivity.CALIBRATION_METHODS:
            raise ValueError(f"method must be one of {sensitivity.CALIBRATION_METHODS}, got {method!r}")
        params = [p for p in self._model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("calibrate: the model has no trainable parameters (requires_grad=True)")
        boundary = self.backend.graph_break  # lazy devices: one graph per pass, not one for all
        modes = {m: m.training for m in self._model.modules()}
        self._model.train()
        try:
            sens = None
            if method == "one-pass":
                modules = [b.module for b in self._branches]
                try:
                    sens = sensitivity.one_pass(closure, params, modules, self._force, gradnorm, boundary)
                except sensitivity.OnePassUnavailable as why:
                    log.warning("dropbp: calibrate falls back to exact-recompute (N + 1 passes): %s", why)
            if sens is None:
                modules = [b.module for b in self._branches]
                sens = sensitivity.exact_recompute(closure, params, modules, self._force, gradnorm, boundary)
        finally:
            for module, training in modes.items():
                module.training = training
        sens = sensitivity.average_across_ranks(sens, params[0].device)
        flops = [b.flops for b in self._branches]
        rates = allocate_rates(sens, flops, self.drop_rate, min_rate=min_rate, max_rate=max_rate)
        self.set_rates(self._keep_one_branch_per_step(rates, min_rate))
        return sens

    def drop_stats(self, reset: bool = True) -> dict[str, float]:
        """What was dropped over the training forwards since the last reset: their number, the mean
        number of branches dropped per forward, and the mean fraction of branch FLOPs dropped."""
        forwards, dropped, flops = self._tally
        total_flops = sum(b.flops for b in self._branches)
        stats = {
            "forwards": float(forwards),
            "dropped_branches": dropped / forwards if forwards else 0.0,
            "dropped_flops_fraction": flops / (forwards * total_flops) if forwards else 0.0,
        }
        if reset:
            self._tally = [0, 0, 0.0]
        return stats

    def param_groups(self, lr: float, **options: Any) -> list[dict[str, Any]]:
        """Optimizer parameter groups with learning-rate compensation for rarely updated branches.

        A branch dropped with rate ``r`` updates its parameters in only ``1 - r`` of the steps, so its
        trainable parameters get ``lr / (1 - r)``; every other trainable parameter gets ``lr``.
        ``options`` (weight_decay, betas, ...) go into every group. After the rates change
        (``calibrate``, ``set_rates``) call :meth:`update_param_groups` on the optimizer.
        """
        seen: set[int] = set()
        groups = []
        for index, params in enumerate(self._branch_params):
            own = [p for p in params if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in own)
            if own:
                factor = 1.0 / (1.0 - self._branches[index].rate)
                groups.append(
                    {
                        "params": own,
                        "lr": lr * factor,
                        "dropbp_branch": index,
                        "dropbp_factor": factor,
                        **options,
                    }
                )
        rest = [p for p in self._model.parameters() if p.requires_grad and id(p) not in seen]
        if rest:
            groups.insert(0, {"params": rest, "lr": lr, "dropbp_branch": None, **options})
        return groups

    def _keep_one_branch_per_step(self, rates: list[float], min_rate: float, step: float = 0.1) -> list[float]:
        """With few branches a FLOP-weighted allocation can give rates summing to more than N - 1
        (cheap branches at 0.9); then some steps would drop every branch. Lower the highest rates a
        step at a time until the sum fits, and say what drop rate that leaves."""
        limit = max_total_rate(len(rates))
        if sum(rates) <= limit + 1e-9:
            return rates
        rates = list(rates)
        while sum(rates) > limit + 1e-9:
            i = max(range(len(rates)), key=lambda j: (rates[j], j))
            rates[i] = max(min_rate, round(rates[i] - step, 12))
        flops = [b.flops for b in self._branches]
        achieved = sum(r * f for r, f in zip(rates, flops, strict=True)) / sum(flops)
        log.warning(
            "dropbp: with %d branches the allocated rates would drop every branch in some steps; the highest "
            "were lowered, giving a FLOP-weighted drop rate of %.3f instead of %.3f",
            len(rates),
            achieved,
            self.drop_rate,
        )
        return rates

    def update_param_groups(
        self, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    ) -> None:
        """Rescale the learning rates of groups from :meth:`param_groups` to the current rates: each
        group's ``lr`` and ``initial_lr``, and, given the learning-rate scheduler, its ``base_lrs``
        (schedulers recompute ``lr`` from those at every step)."""
        for position, group in enumerate(optimizer.param_groups):
            index = group.get("dropbp_branch")
            if index is None:
                continue
            factor = 1.0 / (1.0 - self._branches[index].rate)
            ratio = factor / group["dropbp_factor"]
            group["lr"] *= ratio
            if "initial_lr" in group:
                group["initial_lr"] *= ratio
            if scheduler is not None:
                scheduler.base_lrs[position] *= ratio
            group["dropbp_factor"] = factor

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue with the same patterns: rates, seed, step counter."""
        return {
            "version": _STATE_VERSION,
            "branches": [b.name for b in self._branches],
            "rates": self.rates,
            "drop_rate": self.drop_rate,
            "seed": self.seed,
            "step": self._step,
            "max_patterns": self.max_patterns,
            "warmup_steps": self.warmup_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the branches must be the same as when it was saved."""
        self._check_attached()
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        missing = {"version", "branches", "rates", "drop_rate", "seed", "step", "max_patterns"} - set(state)
        if missing:
            raise ValueError(f"state is missing keys {sorted(missing)}; pass the dict from state_dict()")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"state version {state['version']} is not supported (expected {_STATE_VERSION})")
        names = [b.name for b in self._branches]
        if list(state["branches"]) != names:
            raise ValueError(
                "state was saved for different branches: "
                f"saved {len(state['branches'])} starting {list(state['branches'])[:2]}, "
                f"this model has {len(names)} starting {names[:2]}"
            )
        self.drop_rate = _check_drop_rate(state["drop_rate"])
        self.seed = _check_int("seed", state["seed"], 0)
        mp = state["max_patterns"]
        self.max_patterns = None if mp is None else _check_int("max_patterns", mp, 1)
        self.warmup_steps = _check_int("warmup_steps", state.get("warmup_steps", 0), 0)  # absent in older states
        self.set_rates(state["rates"])
        self._step = _check_int("step", state["step"], 0)

    def backward(self, loss: torch.Tensor) -> bool:
        """``loss.backward()`` then the backend's step boundary (a graph break on lazy devices).

        Returns False, without raising, when ``loss`` needs no gradient (no trainable parameter took
        part in the forward, e.g. a frozen model or a loss made under ``torch.no_grad``), where
        ``loss.backward()`` would raise. The boundary is placed either way, so a lazy device still
        runs the forward it recorded. For hand-written loops: trainers that already place their own
        breaks (Hugging Face ``Trainer``, optimum-habana ``GaudiTrainer``) need neither this nor
        :meth:`optimizer_step`, and the controller never places a break by itself, so none is doubled.
        """
        needs_grad = loss.requires_grad
        if needs_grad:
            loss.backward()
        self.backend.after_backward()
        return needs_grad

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` then the backend's step boundary; ``zero_grad`` stays with the caller.

        (Named so because :attr:`step` is the step counter.)
        """
        optimizer.step()
        self.backend.after_optimizer_step()

    def remove(self) -> None:
        """Detach from the model: every hook is removed and the model is exactly as before."""
        if self._removed:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        for module in (self._model, *(b.module for b in self._branches)):
            if _ATTACHED.get(module) is self:
                del _ATTACHED[module]
        self._recompute.clear()
        self._fill.remove()
        self._dropped = frozenset()
        self._removed = True

    def _check_attached(self) -> None:
        if self._removed:
            raise RuntimeError("this DropBP controller was removed; call dropbp.apply(model, ...) again")

    def __repr__(self) -> str:
        kinds = {k: sum(b.kind == k for b in self._branches) for k in ("attn", "mlp")}
        return (
            f"DropBPController({len(self._branches)} branches ({kinds['attn']} attn, {kinds['mlp']} mlp), "
            f"drop_rate={self.drop_rate}, seed={self.seed}, max_patterns={self.max_patterns}, "
            f"step={self._step})"
        )


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
) -> DropBPController:
    """Attach DropBP to ``model``: each training step drops the backward of random residual branches.

    ``drop_rate`` is every branch's initial drop probability (``calibrate`` or ``set_rates`` can
    make them differ). ``seed`` fixes the patterns: they are a function of (seed, step), identical on
    every process. ``branches`` names the branch modules of a model that is not a recognised Hugging
    Face architecture. ``max_patterns`` bounds how many distinct patterns ever occur (for compiled
    graphs); left ``None``, the backend's default applies (a bound on lazily compiled devices).
    ``seq_len`` is the typical sequence length, used only to weigh attention FLOPs. ``backend`` is a
    backend name or instance (default :func:`dropbp.backends.get`: ``DROPBP_BACKEND``, else detected);
    it is ``ctl.backend``, whose step boundaries :meth:`DropBPController.backward` and
    :meth:`DropBPController.optimizer_step` place. ``unbiased=True`` multiplies the gradient entering
    each kept branch by ``1 / (1 - rate)`` (forward unchanged), so every parameter's expected gradient
    is the full-backprop gradient; it is also ``ctl.unbiased``, settable at any time.
    ``dropped_grads`` is what the optimizer sees for a dropped branch's parameters: ``"skip"`` (no
    gradient, so no update: the paper), ``"zero"`` (a zero gradient: momentum optimizers keep moving
    them) or ``"reuse"`` (their last computed gradient); see :mod:`dropbp.dropped_grads`.
    ``warmup_steps`` (training forwards) raises every rate linearly from 0: the first steps, where
    a fine-tune learns fastest, run (nearly) full backprop. It is ``ctl.warmup_steps``, and saved in
    ``state_dict``.

    ``model`` may be wrapped in ``DistributedDataParallel`` (which must have
    ``find_unused_parameters=True``): the branches are found in its ``.module`` and named as there.
    Wrapping after ``apply`` works the same; so does FSDP2 ``fully_shard`` before or after.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model, ddp = unwrap(model)
    if ddp is not None:
        check_ddp(ddp)
    p = _check_drop_rate(drop_rate)
    seed = _check_int("seed", seed, 0)
    if max_patterns is not None:
        max_patterns = _check_int("max_patterns", max_patterns, 1)
    seq_len = _check_int("seq_len", seq_len, 1)
    if backend is None or isinstance(backend, str):
        backend = get_backend(backend)
    elif not isinstance(backend, Backend):
        raise TypeError(f"backend must be a name, a Backend or None, got {type(backend).__name__}")
    if max_patterns is None:
        max_patterns = backend.default_max_patterns
    if branches is not None and not isinstance(branches, (list, tuple)):
        raise TypeError(f"branches must be a list of module names, got {type(branches).__name__}")
    found = find_branches(model, None if branches is None else list(branches), seq_len)
    taken = [m for m in (model, *(b.module for b in found)) if m in _ATTACHED]
    if taken:
        raise RuntimeError(
            "DropBP is already attached to this model (or to some of its branches); "
            "call .remove() on the existing controller first"
        )
    n = len(found)
    if p * n > max_total_rate(n) + 1e-9:
        largest = math.floor(max_total_rate(n) / n * 1000) / 1000
        raise ValueError(
            f"drop_rate={drop_rate} with {n} branches would drop every branch in some steps, leaving "
            f"nothing to train; with {n} branches drop_rate must be at most {largest}"
        )
    if not isinstance(unbiased, bool):
        raise TypeError(f"unbiased must be True or False, got {type(unbiased).__name__}")
    if dropped_grads not in DROPPED_GRADS:
        raise ValueError(f"dropped_grads must be one of {DROPPED_GRADS}, got {dropped_grads!r}")
    warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
    return DropBPController(model, found, p, seed, max_patterns, backend, unbiased, dropped_grads, warmup_steps)
