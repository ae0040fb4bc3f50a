"""The per-step decision and the hooks that carry it to the model and its branches.

Once per training-mode forward of the model (a forward pre-hook, before any branch runs) the policy gives the step's
pattern, kept until the next one; eval and no-grad forwards draw nothing, and :meth:`StepHooks.force` sets a pattern
(calibration) without taking a step. A checkpointed region's recomputation obeys the pattern of the forward that ran it
(:meth:`StepHooks.in_force`). A dropped branch runs without autograd (:mod:`dropbp.execution.branch_forward`) and is not
recomputed (:mod:`dropbp.execution.recompute`); a kept one may get its incoming gradient scaled
(:mod:`dropbp.execution.branch_forward`). Every hook runs outside ``torch.compile`` graphs. Whatever else must follow
each step's pattern (dropped-gradient fill, DDP check, a framework's guard, the drop tally) is a :class:`StepListener`
its owner adds (:meth:`StepHooks.listen`), not a line here; what multiplies a kept branch's gradient (importance
weights) is a :class:`KeptGradient` a feature sets. Several forwards before one backward: docs/checkpointing.md.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dropbp.backends import Backend
from dropbp.checks import Once
from dropbp.execution.bound import MemoryBound
from dropbp.execution.branch_forward import attach_gradient_scaling, attach_no_grad_hooks
from dropbp.execution.compile_guards import outside_graphs
from dropbp.execution.discovery import BRANCH_ADVICE, Branch, ResidualProbe, holder
from dropbp.execution.distributed import check_running_ddp_checkpointing
from dropbp.execution.patching import ForwardPatch, HookSwitch
from dropbp.execution.recompute import RecomputeCache, forward_region, in_backward, recomputed_region
from dropbp.internals import at_backward_end
from dropbp.policy.drop_policy import DropPolicy

__all__ = ["KeptGradient", "StepHooks", "StepListener", "output_tensor"]


def output_tensor(output: object) -> torch.Tensor | None:
    """A model output's first tensor that needs a gradient (the loss where the model computes it, else logits)."""
    if torch.is_tensor(output):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, tuple | list) else ()
    return next((v for v in values if torch.is_tensor(v) and v.requires_grad), None)


class StepListener(Protocol):
    """A concern that follows each training step's pattern."""

    def on_training_forward(self, pattern: frozenset[int]) -> None:
        """Called at each training forward that draws a pattern (not at calibration's forced ones), with the
        indices of the branches it drops, before any branch runs; may raise to stop the step."""

    def on_remove(self) -> None:
        """Undo whatever this listener installed: DropBP is being removed from the model."""


class KeptGradient(Protocol):
    """An extension point: what a kept branch's own parameters' gradient is multiplied by (importance weights)."""

    def weights(self, drop_probabilities: tuple[float, ...]) -> tuple[float, ...]:
        """Per branch, the factor on its own parameters' gradient where it is kept, from how often each is dropped
        where the forward drew its pattern (:meth:`~dropbp.policy.drop_policy.DropPolicy.drop_probabilities`)."""


class _Listening:
    """The handle :meth:`StepHooks.listen` returns: ``remove()`` stops the calls (and calls ``on_remove``)."""

    def __init__(self, listeners: list[StepListener], listener: StepListener) -> None:
        self._listeners, self._listener = listeners, listener

    def remove(self) -> None:
        if self._listener in self._listeners:
            self._listeners.remove(self._listener)
            self._listener.on_remove()


#: A forward's decision: the dropped branches, and every branch's gradient weight where kept (empty: none).
Decision = tuple[frozenset[int], tuple[float, ...]]


class StepHooks:
    """Draws each training step's pattern and makes the branch modules obey it.

    Args:
        model: the model whose training forwards are the steps.
        branches: in branch order; each branch's parts (its module, then its tail: post-norms between its
            output and the residual add) run without autograd when the branch drops.
        policy: decides each step's pattern.

    Read as each training forward starts: the memory bound's count (the policy's ``most_kept``,
    :mod:`dropbp.execution.bound`) and :attr:`kept_gradient` (an extension point a feature sets).
    """

    def __init__(
        self,
        model: nn.Module,
        branches: Sequence[Branch],
        *,
        backend: Backend,
        policy: DropPolicy,
    ) -> None:
        parts = [b.parts for b in branches]
        self._model = model
        self._names = [b.name for b in branches]
        self._modules = [branch[0] for branch in parts]
        #: Per branch, one module holding every parameter of it (tail included).
        self.holders = [holder(branch) for branch in parts]
        self._policy = policy
        self._backend = backend
        #: What a kept branch's own parameters' gradient is multiplied by (None: nothing), read as a forward starts.
        self.kept_gradient: KeptGradient | None = None
        #: Whether kept branches are weighted in the forward under way (:attr:`kept_gradient` as it started).
        self.weighting = False

        #: Training forwards that drew a pattern so far (the step counter).
        self.step = 0
        #: The pattern in force: indices of the dropped branches.
        self.dropped: frozenset[int] = frozenset()
        #: Per branch, its gradient weight where kept in the forward in force (:attr:`kept_gradient`; empty: none),
        #: recorded with the pattern: a kept branch's weight is its forward's, whatever changes before its backward
        #: (a setter, a recomputation under re-entrant checkpointing).
        self.weights_in_force: tuple[float, ...] = ()
        #: The pattern of the most recent training-mode forward (calibration's forced ones excluded).
        self.last: frozenset[int] = frozenset()
        #: The pattern calibration forces, or None.
        self.forced: frozenset[int] | None = None
        #: The model's forward under way: None (none), False (eval or no-grad: drops nothing) or True (training).
        self._forward: bool | None = None
        self._unknown_region = Once(
            "dropbp: a re-entrant checkpointed region that no training forward of the model recorded is being "
            "recomputed (torch.utils.checkpoint(..., use_reentrant=True) around the whole model, whose forward then "
            "ran without a graph, or a region behind an output dropbp could not search): its branches get full "
            "backprop, nothing drops there. Use use_reentrant=False, or checkpoint inside the model "
            "(gradient_checkpointing_enable()). Said once."
        )
        self._outside = Once(
            "dropbp: a branch ran outside a forward of the model dropbp was applied to (a merged model from "
            "merge_and_unload(), or a submodule such as model.model called directly): nothing drops there. "
            "Call ctl.remove() when the model is done with DropBP, or dropbp.apply() to the model you now train."
        )
        #: Training forwards run with the branches' hooks out whose backward has not ended: their regions, recorded by
        #: no hook, drop nothing when recomputed, as they did.
        self._quiet = 0
        self._trainable_key: tuple[tuple[int, bool], ...] | None = None  # what _trainable was worked out for
        self._trainable: list[bool] | None = None
        #: Whatever must live as long as the model's hooks (the controller: the model keeps it, no registry does).
        self.owner: object | None = None
        self.bound = MemoryBound(model, self._names, self._modules, backend)
        self._listeners: list[StepListener] = []
        self._recompute = RecomputeCache(self._modules, backend)
        self._probe = ResidualProbe(self._names, self._modules)
        #: Per checkpointed region of a training forward (as checkpointing keeps it), that forward's pattern and
        #: rate factor.
        self._regions: weakref.WeakKeyDictionary[object, Decision] = weakref.WeakKeyDictionary()
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._on_model_forward),
            model.register_forward_hook(self._after_model_forward, always_call=True),
            *self._probe.handles,
        ]
        model_level = len(self._handles)
        for index, (module, *tail) in enumerate(parts):
            dropped, cache = self._dropped_test(index), self._recompute.branches[index]
            # the gradient entering the branch is the one at the residual add: the last part's output
            kept_scale = self._kept_scale(index)
            if not tail:  # one decision per call serves the no-grad switch and the scaling
                self._handles += attach_no_grad_hooks(module, dropped, cache, kept_scale, kept_scale)
                continue
            self._handles += attach_no_grad_hooks(module, dropped, cache, inputs_scale=kept_scale)
            for norm in tail:  # checkpointing recomputes a norm cheaply: no held output needed
                self._handles += attach_no_grad_hooks(norm, dropped)
            self._handles.append(attach_gradient_scaling(tail[-1], self._scale_for(index)))
        #: The branches' own hooks, taken out of their modules while a training forward can drop nothing and weighs
        #: nothing (every rate 0): the branches then run exactly as without dropbp, at no cost per call.
        self._branch_hooks = HookSwitch(self._handles[model_level:])
        guarded = self._guarded_forward()
        self._guard = ForwardPatch(model, guarded)
        # the model's own signature: the Trainer keeps the dataset columns that forward names
        functools.update_wrapper(guarded, self._guard.original(), updated=())
        self._guard.install()

    @property
    def handles(self) -> list[RemovableHandle]:
        """Every hook this object has on the model (copies of the model leave them out)."""
        return self._handles

    def listen(self, listener: StepListener) -> _Listening:
        """Call ``listener`` at every training forward from now on (in the order added) and when removed; the handle's
        ``remove()`` takes it off earlier."""
        self._listeners.append(listener)
        return _Listening(self._listeners, listener)

    def pattern(self, step: int) -> frozenset[int]:
        """The pattern the policy draws at ``step`` for this model."""
        return self._policy.draw(step, self._trainable_branches)

    def in_force(self) -> frozenset[int]:
        """The pattern a branch called now obeys (:meth:`decision_in_force`)."""
        return self.decision_in_force()[0]

    def decision_in_force(self) -> Decision:
        """The pattern a branch called now obeys and the rates of its forward: during a backward, those of
        the forward whose checkpointed region is being recomputed; inside a training forward of the model, that
        forward's, which a call inside a (non-re-entrant) checkpointed region records for that region (a
        re-entrant one's are recorded when the forward ends); elsewhere none."""
        decision = (self.dropped, self.weights_in_force)
        if in_backward():
            region = recomputed_region()
            if region is None:
                return decision
            if region not in self._regions:  # a region no training forward of the model recorded: drop nothing
                if not self._quiet:  # (a forward with the hooks out, which dropped nothing, records none: as meant)
                    self._unknown_region()  # a re-entrant region no training forward recorded: full backprop there
                return frozenset(), ()
            return self._regions[region]
        if not self._forward:
            if self._forward is None and torch.is_grad_enabled() and self._model.training:
                self._outside()  # a branch in training mode outside every forward of the model
            return frozenset(), ()
        if self._recompute.recording:
            region = forward_region()
            if region is not None:
                self._regions[region] = decision
        return decision


    def _dropped_test(self, index: int) -> Callable[[], bool]:
        decision = self.decision_in_force  # bound once: this runs at every branch call
        return lambda: index in decision()[0]

    def _guarded_forward(self) -> Callable[..., object]:
        """The model's forward, with dropbp's state put back if it is interrupted (``KeyboardInterrupt``,
        ``SystemExit``: torch runs no ``always_call`` hook after those)."""

        def forward(*args: object, **kwargs: object) -> object:
            grad = torch.is_grad_enabled()
            try:
                return self._guard.original()(*args, **kwargs)
            except BaseException:
                self._recover(grad)
                raise

        return forward

    @outside_graphs
    def _recover(self, grad: bool) -> None:
        torch.set_grad_enabled(grad)  # a dropped branch's hook may have switched it off
        self._forward = None
        self.bound.end()
        self._recompute.end_forward()

    def _kept_scale(self, index: int) -> Callable[[nn.Module], float]:
        """The gradient weight of branch ``index`` in a call where it is kept: its forward's (1 without one)."""

        def scale(module: nn.Module) -> float:
            if not self.weighting or self.forced is not None:
                return 1.0  # calibration measures the plain gradients
            weights = self.decision_in_force()[1]
            return weights[index] if weights else 1.0

        return scale

    def _scale_for(self, index: int) -> Callable[[nn.Module], float]:
        """:meth:`_kept_scale`, asking whether the branch is kept (for a tail's hook, after the branch ran)."""
        kept_scale = self._kept_scale(index)
        return lambda module: 1.0 if index in self.in_force() else kept_scale(module)  # dropped: no gradient

    def kept_step(self, index: int) -> int | None:
        """The step of the training forward (or its recomputation) in which branch ``index`` runs kept now; None
        where it is dropped, in calibration's forced forwards and outside a training forward of the model."""
        if self.forced is not None or not (self._forward or in_backward()) or index in self.in_force():
            return None
        return max(0, self.step - 1)  # the forward under way has counted its step

    @outside_graphs
    def _on_model_forward(self, model: nn.Module, args: tuple) -> None:
        if in_backward():
            return  # checkpointing recomputes the whole model: the step's decision stands
        self.weighting = self.kept_gradient is not None  # read once per forward, not at every branch call
        training = model.training and torch.is_grad_enabled()
        # nothing to drop or weigh, and no earlier forward's checkpointed region left to recompute (its dropped
        # branches must still run without autograd then): the branches run as without dropbp
        if training and self.forced is None and not self.weighting and self._policy.never_drops and not self._regions:
            self._branch_hooks.turn_off()
        else:
            self._branch_hooks.turn_on()
        if self.forced is not None:
            self.dropped = self.forced  # calibration passes: a given pattern, no step taken
            self._recompute.begin_forward()
            self._forward = True
            return
        self._forward = False  # until a pattern is drawn and accepted
        if not training:
            return  # eval or no-grad forwards drop nothing and leave the step's decision alone
        self.dropped = self.pattern(self.step)
        # read only where kept branches are weighted: the hot path stays as it was without
        if self.weighting:
            probabilities = self._policy.drop_probabilities(self.step, self._trainable_branches)
            self.weights_in_force = self.kept_gradient.weights(probabilities)
        else:
            self.weights_in_force = ()
        for listener in self._listeners:  # one may refuse the step (raise): before anything moves on
            listener.on_training_forward(self.dropped)
        self._recompute.begin_forward()
        keep = self._policy.most_kept()
        if keep is not None:
            self.bound.begin(self.dropped, keep)
        self.step += 1
        self.last = self.dropped
        self._forward = True

    @outside_graphs
    def _after_model_forward(self, model: nn.Module, args: tuple, output: object) -> None:
        if not in_backward():
            self._forward = None
            self.bound.end()
            quiet = output_tensor(output) if self._branch_hooks.off and model.training else None
            if quiet is not None:  # counted until its backward ends
                self._quiet += 1
                quiet.register_hook(lambda grad: at_backward_end(self._quiet_done))
        self._recompute.end_forward()
        if self._recompute.reentrant:
            check_running_ddp_checkpointing()
            for region in self._recompute.claim_reentrant_regions(output):
                self._regions[region] = (self.dropped, self.weights_in_force)
        if self.forced is None and model.training and torch.is_grad_enabled() and not in_backward():
            self._check_output_needs_a_gradient(output)

    def _quiet_done(self) -> None:
        self._quiet -= 1

    def _check_output_needs_a_gradient(self, output: object) -> None:
        """Stop at the forward, with what to do, when the step's output cannot be backpropagated.

        Dropped branches leave the residual stream to carry the gradient; a named "branch" that adds
        the residual itself (BERT's ``encoder.layer.N.attention``, a whole decoder layer) cuts it, and
        torch's later error ("element 0 of tensors does not require grad") says nothing of why.
        """
        loss = getattr(output, "loss", None)
        tensor = loss if isinstance(loss, torch.Tensor) else getattr(output, "logits", output)
        if not isinstance(tensor, torch.Tensor) or tensor.requires_grad or not tensor.is_floating_point():
            return
        if not self.dropped or not any(p.requires_grad for p in self._model.parameters()):
            return  # nothing dropped, or nothing to train: not a wrong branch
        dropped = [self._names[i] for i in sorted(self.dropped)]
        raise ValueError(
            f"dropbp: with the branches {dropped} dropped, the model's output needs no gradient, so "
            "backward would fail: dropping them cut every path from the trainable parameters to the output. "
            + BRANCH_ADVICE
        )

    def _trainable_branches(self) -> list[bool] | None:
        """Per branch, whether it holds a trainable parameter; ``None`` if something outside does.

        Worked out again whenever the model's parameters or their ``requires_grad`` change (FSDP2
        ``fully_shard`` after ``apply`` replaces them; a user may freeze or unfreeze between steps).
        """
        key = tuple((id(p), p.requires_grad) for p in self._model.parameters())
        if key != self._trainable_key:
            inside = {id(p) for m in self.holders for p in m.parameters()}
            if any(p.requires_grad and id(p) not in inside for p in self._model.parameters()):
                self._trainable = None  # e.g. embeddings or a head still receive a gradient
            else:
                self._trainable = [any(p.requires_grad for p in m.parameters()) for m in self.holders]
            self._trainable_key = key
        return None if self._trainable is None else list(self._trainable)

    @contextmanager
    def force(self, pattern: frozenset[int]) -> Iterator[None]:
        """Within the block, every forward drops exactly ``pattern`` and takes no step (calibration)."""
        previous = self.dropped
        self.forced = pattern
        try:
            yield
        finally:
            self.forced = None
            self.dropped = previous
            self._recompute.clear()  # outputs held under the forced pattern are not the step's

    def remove(self) -> None:
        """Remove every hook; the model is as before."""
        self._branch_hooks.turn_on()
        for h in self._handles:
            h.remove()
        self._handles = []
        self.bound.end()
        self._guard.remove()
        self._recompute.clear()
        while self._listeners:
            self._listeners.pop(0).on_remove()
        self.dropped = frozenset()
