"""What the optimizer sees for a branch whose backward was dropped (0.3's ``dropped_grads``).

Without a fill (the paper's, the core's): no gradient; ``.grad`` stays ``None`` and PyTorch's optimizers skip them.
:class:`DroppedGradFill` gives them one, measured and not better (benchmarks/results/convergence_levers_lora_pydoc.md):
- ``"zero"``: a zero gradient, so a momentum optimizer still steps them along their momentum.
- ``"reuse"``: their most recent computed gradient (a stale gradient); the store starts empty after a resume, and
  until a branch has been kept once it is skipped.
The fill runs in a global optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``), so
any training loop works; only parameters the stepping optimizer holds, of branches dropped since the previous step,
with ``.grad is None``, are filled. A feature that follows the steps (a step listener) and plugs into the dropped
branches' gradients (``dropped_fill``, which a framework's guard reads: :mod:`dropbp.integrations.deepspeed`). Costs,
and what each mode did to convergence: docs/history.md ("The levers").
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dropbp.checks import check_choice
from dropbp.features.base import Feature, register_feature
from dropbp.features.host import Host

__all__ = ["FILLS", "DroppedGradFill", "DroppedGrads"]

#: What a fill gives a dropped branch's parameters.
FILLS = ("zero", "reuse")


@register_feature
class DroppedGradFill(Feature):
    """Give dropped branches' parameters a gradient before each optimizer step: ``"zero"`` or ``"reuse"`` (their last
    computed one); see the module. Under DeepSpeed only ``"zero"`` (``"reuse"`` is refused).

    Args:
        mode: one of :data:`FILLS`.
    """

    key = "dropped_grad_fill"
    replaces = {
        "dropped_grads": "features=[dropbp.experimental.DroppedGradFill('zero')] (or 'reuse'; was dropped_grads='zero' "
        "/ 'reuse'; 'skip' is the core's, leave the feature out)"
    }

    def __init__(self, mode: str = "zero") -> None:
        super().__init__()
        self.mode = check_choice("mode", mode, FILLS)

    @classmethod
    def from_flat(cls, settings: dict[str, Any]) -> DroppedGradFill | None:
        mode = settings.pop("dropped_grads", "skip")
        return None if mode == "skip" else cls(mode)

    @property
    def dropped_fill(self) -> str:
        """The extension point a framework's guard reads: how dropped branches' parameters get a gradient."""
        return self.mode

    def check(self, model: nn.Module, framework: bool) -> None:
        if framework and self.mode == "reuse":
            raise ValueError(
                "DroppedGradFill('reuse') cannot work under DeepSpeed: a stored gradient would have to enter ZeRO's "
                "gradient partitions before it computes the clipping norm; leave the fill out (dropped branches "
                "unchanged by the step) or use DroppedGradFill('zero') (weight decay and momentum still move them)"
            )

    def attach(self, host: Host) -> None:
        super().attach(host)
        self._part = host.hooks.listen(DroppedGrads(self.mode, host.hooks.holders))

    def config(self) -> dict[str, Any]:
        return {"mode": self.mode}

    def __repr__(self) -> str:
        return f"DroppedGradFill({self.mode!r})"


class DroppedGrads:
    """Fills dropped branches' gradients before each optimizer step, per ``mode`` (one of :data:`FILLS`).

    A step listener (:class:`dropbp.execution.hooks.StepListener`): :class:`DroppedGradFill` adds it."""

    def __init__(self, mode: str, modules: list[nn.Module]) -> None:
        self.mode = mode
        self._modules = modules
        self._pending: set[int] = set()  # branches dropped in some forward since the last step
        self._stepped = False  # an optimizer stepped since the last forward
        self._stored: dict[tuple[int, str], torch.Tensor] = {}  # "reuse": last computed gradients
        this = weakref.ref(self)

        def hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            fill = this()
            if fill is not None:
                fill.before_step(optimizer)

        self._handle = register_optimizer_step_pre_hook(hook)

    def on_training_forward(self, pattern: Iterable[int]) -> None:
        """Record the branches a training forward dropped (called once per forward). The record
        covers every forward since the last optimizer step (gradient accumulation), and stays until
        the next forward, so several optimizers stepping in turn all see it."""
        if self._stepped:
            self._pending, self._stepped = set(), False
        self._pending.update(pattern)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._stepped = True
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for index, module in enumerate(self._modules):
            for name, p in self._trainable(module, held):
                if p.grad is not None:
                    if self.mode == "reuse":
                        self._stored[index, name] = p.grad.detach().clone()
                elif index in self._pending:
                    p.grad = self._substitute(index, name, p)

    def _substitute(self, index: int, name: str, p: nn.Parameter) -> torch.Tensor | None:
        if self.mode == "zero":
            return torch.zeros_like(p)
        stored = self._stored.get((index, name))
        return None if stored is None else stored.clone()  # a copy: zero_grad may zero it in place

    @staticmethod
    def _trainable(module: nn.Module, held: set[int]) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad and id(p) in held]

    def on_remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._stored.clear()
        self._pending.clear()
