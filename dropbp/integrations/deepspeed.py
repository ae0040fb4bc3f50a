"""DropBP under DeepSpeed ZeRO stages 1, 2 and 3: a dropped branch's parameters are treated as on one process.

:class:`ZeroGuard` starts at the first training forward that finds a ZeRO optimizer holding the parameters (``apply``
before or after ``deepspeed.initialize``, or under the Trainer). Stage 3: each accumulation window's flat gradient
buffer is zeroed at its first forward. Without a fill of dropped branches' gradients (the paper's): around the inner
optimizer's step, this rank's slices of the fp32 master weights and optimizer states of every parameter that got no
gradient in the window are saved and put back; ``DroppedGradFill("zero")`` lets the dropped branches' own parameters
step; ``"reuse"`` is refused. What ZeRO does without it, and the cost: docs/deepspeed.md. This module owns everything
DeepSpeed (the core reaches it through :mod:`dropbp.execution.frameworks`) and never imports ``deepspeed``.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from dropbp.internals import (
    backward_hooks,
    deepspeed_fp32_mapping,
    deepspeed_zero3_optimizer,
    deepspeed_zero_optimizer,
)

__all__ = [
    "DEEPSPEED",
    "DeepSpeed",
    "ZeroGuard",
    "calibration_closure",
    "check_config",
    "check_engine",
    "check_setup",
    "is_engine",
    "zero_stage",
]


def zero_stage(params: Iterable[nn.Parameter]) -> int | None:
    """3 for parameters a ZeRO-3 optimizer holds, 1 for stage 1 or 2 (one mechanism), None otherwise.

    Read from the attributes DeepSpeed's ZeRO optimizers set on the parameters they hold, so nothing
    is imported. (``deepspeed.zero.Init`` partitions parameters before any optimizer exists: None then.)"""
    for p in params:
        if deepspeed_zero3_optimizer(p) is not None:
            return 3
        if deepspeed_fp32_mapping(p) is not None:
            return 1
    return None


def is_engine(model: object) -> bool:
    """Whether ``model`` is a ``deepspeed.DeepSpeedEngine`` (False whenever deepspeed was never imported)."""
    ds = sys.modules.get("deepspeed")
    engine = getattr(ds, "DeepSpeedEngine", None)
    return engine is not None and isinstance(model, engine)


def check_setup(
    stage: int,
    fill: str | None,
    *,
    ignore_unused_parameters: bool = True,
    offload_optimizer: bool = False,
    accumulation: int = 1,
) -> None:
    """Raise ``ValueError`` for a DeepSpeed set-up DropBP cannot train with, saying what to change.

    Args:
        stage: the ZeRO stage (0: none).
        fill: how dropped branches' parameters get a gradient (a feature's ``dropped_fill``; None: none).
        ignore_unused_parameters: ``zero_optimization.ignore_unused_parameters``.
        offload_optimizer: whether ``zero_optimization.offload_optimizer`` moves the optimizer off the device.
        accumulation: ``gradient_accumulation_steps``.
    """
    if fill == "reuse":
        raise ValueError(
            "DroppedGradFill('reuse') cannot work under DeepSpeed: a stored gradient would have to enter ZeRO's "
            "gradient partitions before it computes the clipping norm; leave the fill out (dropped branches "
            "unchanged by the step) or use DroppedGradFill('zero') (weight decay and momentum still move them)"
        )
    if stage in (1, 2) and not ignore_unused_parameters:
        raise ValueError(
            "DropBP leaves the parameters of dropped branches without a gradient, which ZeRO stages 1 and 2 "
            "refuse with zero_optimization.ignore_unused_parameters=false: set it to true (the default)"
        )
    if stage and offload_optimizer and accumulation > 1:
        # Measured with deepspeed 0.19.8 (the test job, 2 micro-steps, AdamW): ZeRO 2 and 3 then leave
        # parameters up to 0.01 (ZeRO-2, first step) and 0.2 (ZeRO-3, 20 steps) away from one process's;
        # with no branch dropped they agree to 6e-6. A parameter used only in an earlier micro-step of
        # the window does not reach the offloaded optimizer with its gradient.
        raise ValueError(
            "DropBP cannot train under ZeRO with offload_optimizer and gradient_accumulation_steps="
            f"{accumulation}: DeepSpeed hands the offloaded optimizer the gradients of the parameters used in "
            "the last micro-step of each window, and DropBP drops different branches in each micro-step. "
            "Use gradient_accumulation_steps=1 (a larger micro-batch) or no offload_optimizer"
        )


def check_engine(engine: nn.Module, fill: str | None) -> None:
    """:func:`check_setup` for a ``DeepSpeedEngine`` given to ``dropbp.apply``."""
    check_setup(
        engine.zero_optimization_stage(),
        fill,
        ignore_unused_parameters=engine.zero_ignore_unused_parameters(),
        offload_optimizer=bool(engine.zero_offload_optimizer()),
        accumulation=engine.gradient_accumulation_steps(),
    )


def check_config(config: Mapping[str, Any], fill: str | None, accumulation: int) -> None:
    """:func:`check_setup` for a DeepSpeed configuration dict (the Hugging Face Trainer's ``deepspeed``),
    with the gradient accumulation the trainer runs (the config may say ``"auto"``)."""
    zero = config.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    check_setup(
        int(zero.get("stage", 0) or 0),
        fill,
        ignore_unused_parameters=zero.get("ignore_unused_parameters", True) is not False,
        offload_optimizer=offload not in (None, "none"),
        accumulation=accumulation,
    )


def calibration_method(params: Iterable[nn.Parameter], method: str) -> str:
    """``method``, or ``"exact-recompute"`` for parameters a ZeRO-3 optimizer holds.

    One-pass calibration runs several backward passes over one retained graph; ZeRO-3 releases a
    module's gathered parameters once its backward has run, so a later pass can find them partitioned
    (a size-mismatch RuntimeError; seen in the two-process Trainer test when the step before calibration
    had dropped branches). Each pass of exact-recompute is its own forward and backward, gathered as in
    training.
    """
    return "exact-recompute" if zero_stage(params) == 3 else method


def calibration_closure(closure: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``closure``, stopped with advice if its loss came out of a ``DeepSpeedEngine`` forward.

    Calibration runs several backward passes over one forward with ``torch.autograd.grad``; the
    engine hooks its outputs so that each of them would run its end-of-backward gradient reduction
    (ZeRO-2 fails with an IndexError in ``reduce_ipg_grads``, ZeRO-3 with a size mismatch). The model
    the engine wraps computes the same loss, and ZeRO-3 gathers its parameters for it as in training.
    """

    def checked() -> torch.Tensor:
        loss = closure()
        hooks = backward_hooks(loss)
        if any(getattr(h, "__module__", "").startswith("deepspeed") for h in hooks.values()):
            raise ValueError(
                "the calibration closure called the DeepSpeed engine, whose backward hooks would reduce "
                "gradients at every calibration pass: call the model it wraps instead, "
                "e.g. lambda: engine.module(**batch).loss (the Hugging Face Trainer's attach already does)"
            )
        return loss

    return checked


def _master_fragment(p: nn.Parameter) -> torch.Tensor | None:
    """This rank's slice of ``p``'s fp32 master weights: a view into a flat partition the optimizer steps.

    (Not ``deepspeed.utils.safe_get_local_fp32_param``: it moves the slice to the accelerator, a copy
    where the optimizer is offloaded to the CPU.)"""
    z3 = deepspeed_zero3_optimizer(p)
    if z3 is not None:
        position = z3.grad_position.get(z3.get_param_id(p))
        if position is None:
            return None  # not one of the optimizer's parameters
        group, offset, numel = position
        return z3.fp32_partitioned_groups_flat[group].narrow(0, offset, numel)
    mapping = deepspeed_fp32_mapping(p)
    return None if mapping is None else mapping.hp_fragment


def _slice_of(fragment: torch.Tensor, flat: torch.Tensor) -> slice | None:
    """Where ``fragment`` lies inside ``flat`` (both 1-D views of one storage), or None if it does not."""
    if fragment.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
        return None
    start = (fragment.data_ptr() - flat.data_ptr()) // flat.element_size()
    if start < 0 or start + fragment.numel() > flat.numel():
        return None
    return slice(start, start + fragment.numel())


def _check_internals(z3: object | None, params: Sequence[nn.Parameter]) -> None:
    """Raise ``RuntimeError`` if this DeepSpeed lacks what the guard reads (checked on 0.19.8)."""
    if z3 is not None:
        needed = (
            "micro_step_id",
            "grad_partitions_flat_buffer",
            "fp32_partitioned_groups_flat",
            "offload_optimizer",
            "gradient_accumulation_steps",
            "grad_position",
            "get_param_id",
            "optimizer",
        )
        missing = [a for a in needed if not hasattr(z3, a)]
    else:
        mapping = next((m for m in map(deepspeed_fp32_mapping, params) if m is not None), None)
        missing = [] if mapping is None or hasattr(mapping, "hp_fragment") else ["_hp_mapping.hp_fragment"]
    if missing:
        ds = sys.modules.get("deepspeed")
        raise RuntimeError(
            f"dropbp cannot guard this DeepSpeed ({getattr(ds, '__version__', '?')}) ZeRO optimizer: it has no "
            f"{missing}. dropbp is tested with deepspeed 0.19 (pip install 'dropbp[deepspeed]')"
        )


class ZeroGuard:
    """Makes a ZeRO optimizer leave alone what one process would leave alone, per the dropped branches' fill.

    A step listener (:class:`dropbp.execution.hooks.StepListener`), found by :meth:`DeepSpeed.step_listener`.

    On one process a parameter without a gradient (``.grad is None``) is skipped by the optimizer:
    without a fill every parameter that got no gradient in the window (a dropped branch's, and the
    norm feeding only that branch), under ``DroppedGradFill("zero")`` those outside the dropped branches (the
    branches' own get a zero gradient). The guard records which parameters got a gradient in the window
    (a post-accumulate-grad hook each) and keeps the others exactly as they were through the step.

    Args:
        stage: :func:`zero_stage` of the model's parameters (1 for stages 1 and 2, or 3).
        params: the model's trainable parameters.
        modules: per branch, in branch order, a module holding all its parameters (what a ``"zero"`` fill fills on
            one process).
        fill: how dropped branches' parameters get a gradient now: None or ``"zero"`` (``"reuse"`` is refused by
            :func:`check_setup`).
    """

    def __init__(
        self,
        stage: int,
        params: Sequence[nn.Parameter],
        modules: Sequence[nn.Module],
        fill: Callable[[], str | None],
    ) -> None:
        self._z3 = next((z for z in map(deepspeed_zero3_optimizer, params) if z is not None), None)
        _check_internals(self._z3, params)
        if self._z3 is None:
            check_setup(stage, fill())
        else:
            z3 = self._z3
            check_setup(3, fill(), offload_optimizer=z3.offload_optimizer, accumulation=z3.gradient_accumulation_steps)
        zero = self._z3 or next((z for z in map(deepspeed_zero_optimizer, params) if z is not None), None)
        #: The torch optimizer ZeRO steps on its flat partitions (None: not found; every optimizer is watched).
        self._inner = getattr(zero, "optimizer", None)
        self._params = list(params)
        self._modules = list(modules)
        self._fill = fill
        self._used: set[int] = set()  # ids of the parameters that got a gradient in the window
        self._dropped: set[int] = set()  # branches dropped in some micro-step of the window
        self._first = True  # no forward seen yet
        self._stepped = False  # the inner optimizer stepped since the last training forward
        self._saved: list[tuple[torch.Tensor, slice, torch.Tensor, dict[str, torch.Tensor]]] = []
        this = weakref.ref(self)

        def used(p: nn.Parameter) -> None:
            guard = this()
            if guard is not None:
                guard._used.add(id(p))

        def before(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            guard = this()
            if guard is not None:
                guard._save(optimizer)

        def after(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            guard = this()
            if guard is not None:
                guard._restore(optimizer)

        self._handles = [p.register_post_accumulate_grad_hook(used) for p in self._params]
        self._handles += [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]

    def on_training_forward(self, dropped: Iterable[int]) -> None:
        """Called at every training forward with the branches it drops; the first forward after an
        optimizer step starts a new gradient-accumulation window."""
        new_window = self._stepped or self._first
        if self._z3 is not None and self._z3.micro_step_id == 0:
            self._z3.grad_partitions_flat_buffer.zero_()  # no stale gradient from the previous window
            if self._z3.offload_optimizer:  # nor in the fp32 gradients ZeRO copies it into at the boundary
                for flat in self._z3.fp32_partitioned_groups_flat:
                    if flat.grad is not None:
                        flat.grad.zero_()
            new_window = True
        if new_window:
            self._used, self._dropped = set(), set()
            self._stepped = self._first = False
        self._dropped.update(dropped)

    def _left_alone(self) -> list[nn.Parameter]:
        """The parameters one process would not step: no gradient, and none filled in by a ``"zero"`` fill."""
        filled = set()
        if self._fill() == "zero":
            filled = {id(p) for i in self._dropped for p in self._modules[i].parameters()}
        return [p for p in self._params if id(p) not in self._used and id(p) not in filled]

    def _watches(self, optimizer: torch.optim.Optimizer) -> bool:
        return self._inner is None or optimizer is self._inner

    def _save(self, optimizer: torch.optim.Optimizer) -> None:
        self._saved = []
        if not self._watches(optimizer):
            return
        flats = [p for group in optimizer.param_groups for p in group["params"]]
        for p in self._left_alone():
            fragment = _master_fragment(p)
            if fragment is None or not fragment.numel():
                continue  # no slice of it on this rank
            for flat in flats:
                where = _slice_of(fragment, flat)
                if where is None:
                    continue
                state = {
                    k: v[where].clone()
                    for k, v in optimizer.state.get(flat, {}).items()
                    if torch.is_tensor(v) and v.shape == flat.shape
                }
                self._saved.append((flat, where, flat.detach()[where].clone(), state))
                break

    @torch.no_grad()
    def _restore(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._watches(optimizer):
            return
        self._stepped = True
        for flat, where, value, state in self._saved:
            flat[where] = value
            for k, v in optimizer.state.get(flat, {}).items():
                if torch.is_tensor(v) and v.shape == flat.shape:
                    if k in state:
                        v[where] = state[k]
                    else:  # created by this step: as if these slices had never been stepped
                        v[where] = 0
        self._saved = []

    def on_remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._saved = []
        self._used.clear()


class DeepSpeed:
    """DeepSpeed as the core meets it (:class:`dropbp.execution.frameworks.Framework`); every answer is "nothing here"
    while ``deepspeed`` was never imported, so nothing is imported and little is read."""

    def unwrap(self, model: nn.Module) -> nn.Module | None:
        """A ``DeepSpeedEngine``'s ``.module``."""
        return model.module if is_engine(model) else None

    def check_wrapper(self, wrapper: nn.Module, fill: str | None) -> None:
        check_engine(wrapper, fill)

    def step_listener(
        self, model: nn.Module, holders: Sequence[nn.Module], fill: Callable[[], str | None]
    ) -> ZeroGuard | None:
        """The :class:`ZeroGuard`, once a ZeRO optimizer holds ``model``'s parameters. ``deepspeed.initialize``
        may run before or after ``apply`` (the Hugging Face Trainer runs it in ``train()``), so the core asks
        at each training forward until one is found."""
        if "deepspeed" not in sys.modules:
            return None
        params = [p for p in model.parameters() if p.requires_grad]
        stage = zero_stage(params)
        return None if stage is None else ZeroGuard(stage, params, holders, fill)

    def calibration_closure(self, closure: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """A DeepSpeed engine cannot take calibration's passes: :func:`calibration_closure`."""
        return calibration_closure(closure) if "deepspeed" in sys.modules and callable(closure) else closure


    def calibration_method(self, params: Sequence[nn.Parameter], method: str) -> str:
        """Exact-recompute under ZeRO-3: :func:`calibration_method`."""
        return calibration_method(params, method) if "deepspeed" in sys.modules else method


#: The one instance the core consults (declared in pyproject.toml's ``dropbp.frameworks`` entry points).
DEEPSPEED = DeepSpeed()
