"""The controller :func:`dropbp.apply` returns: the lifecycle of DropBP on one model (apply, remove, step, state).

It owns the wiring only: the options (validated once as given, on the backend at every change), the per-step decision
(:mod:`dropbp.execution.hooks`), the policy (:mod:`dropbp.policy.drop_policy`), the features (through
:mod:`dropbp.features.base`'s protocol), checkpoint state and the device's step boundaries; calibration is
:mod:`dropbp.calibration`'s, what a run will do ``ctl.schedule``'s (:mod:`dropbp.run_schedule`). Every setting validates
and takes effect from the next step; the :class:`~dropbp.execution.discovery.Branch` objects are read-only views.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from dropbp import calibration
from dropbp.backends import Backend
from dropbp.backends import get as get_backend
from dropbp.checks import check_int
from dropbp.execution.compile_guards import EnclosingCompileWarning
from dropbp.execution.discovery import Branch, check_trainable, find_branches, holder
from dropbp.execution.distributed import RunningDDPCheck, check_ddp
from dropbp.execution.frameworks import FrameworkWatch, check_wrapper, unwrap
from dropbp.execution.hooks import StepHooks
from dropbp.execution.patching import CleanCopies
from dropbp.features.attached import AttachedFeatures
from dropbp.features.base import Feature, dropped_fill
from dropbp.features.host import Host
from dropbp.options import DropBPOptions, check_names, moved_member, takes_options
from dropbp.policy.drop_policy import DropPolicy
from dropbp.policy.plan import DropTally
from dropbp.run_schedule import RunSchedule
from dropbp.state import STATE_VERSION, check_state, migrate, state_settings

__all__ = ["DropBPController", "controller_of"]

# Modules (models and branch modules) that already carry a controller: applying twice would stack
# hooks and make two policies fight over one model. Weak both ways: the model keeps its controller alive
# through its hooks (StepHooks.owner), and a model nobody holds is freed with its controller.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[DropBPController]] = weakref.WeakKeyDictionary()

#: Settings fixed at ``apply``.
_FIXED = frozenset({"backend", "branches"})


def controller_of(module: nn.Module) -> DropBPController | None:
    """The controller attached to ``module`` (a model given to :func:`dropbp.apply`, unwrapped, or one of its
    branch modules), or None: how tools that take "the model" find its branches and patterns."""
    ref = _ATTACHED.get(module)
    return None if ref is None else ref()


def _setting(name: str, doc: str) -> property:
    """A controller setting: a field of the options in force; setting it replaces the options as given (validated
    there, :meth:`DropBPController.replace_options`) and re-derives what depends on them, from the next step."""

    def get(self: DropBPController) -> Any:
        return getattr(self._policy.options, name)

    def set(self: DropBPController, value: Any) -> None:
        self.replace_options(**{name: value})

    return property(get, set, doc=f"{doc} Settable: validated, and effective from the next step.")


class DropBPController:
    """Drop policy attached to one model; made by :func:`dropbp.apply`, which documents the arguments.

    Args:
        model: the model (or its DDP / framework wrapper, unwrapped here once).
        drop_rate: and ``options``: :class:`dropbp.options.DropBPOptions`, validated here once, the backend resolved
            (:meth:`~dropbp.options.DropBPOptions.on`); the policy resolves the ``"auto"``s for the model's branches.
    """

    @takes_options(DropBPOptions)
    def __init__(self, model: nn.Module, drop_rate: float | str, **options: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        given = DropBPOptions.given("apply", drop_rate=drop_rate, **options)
        backend = given.backend if isinstance(given.backend, Backend) else get_backend(given.backend)
        on_device = given.on(backend)
        wrapper = model
        model, ddp = unwrap(model)
        check_ddp(ddp)
        check_trainable(model)
        #: Whether a framework's engine wraps the model (DeepSpeed): it holds the gradients, not ``.grad``.
        self._framework = ddp is None and wrapper is not model
        self._features = AttachedFeatures(model, self._framework)
        self._features.check_new(on_device.features)  # a refusal leaves the model as it was
        if self._framework:
            fill = dropped_fill(on_device.features)
            check_wrapper(wrapper, fill)
        found = find_branches(model, None if on_device.branches is None else list(on_device.branches))
        if any(controller_of(m) is not None for m in (model, *(b.module for b in found))):
            attached = "DropBP is already attached to this model (or to some of its branches)"
            raise RuntimeError(f"{attached}; call .remove() on the existing controller first")
        watch = FrameworkWatch(model, [holder(b.parts) for b in found], lambda: dropped_fill(self._given.features))
        #: The device backend whose step boundaries :meth:`backward` and :meth:`optimizer_step` place.
        self.backend, self._model, self._found = backend, model, found
        self._given = dataclasses.replace(given, backend=backend)
        flops = [b.flops for b in found]
        self._policy = policy = DropPolicy(flops, on_device)
        self._hooks = StepHooks(model, self._found, policy=policy, backend=backend)
        self._hooks.owner = self
        tally = DropTally(flops)
        for listener in (RunningDDPCheck(), watch, tally):  # the DDP check first: it may refuse the step
            self._hooks.listen(listener)
        compile_warning = EnclosingCompileWarning()
        self._compile_handles = compile_warning.attach(model, [b.name for b in self._found])
        parts = (p for b in found for p in b.parts)
        self._touched = [model, *parts, *compile_warning.layers, *self._hooks.bound.units]
        given_now, in_force = functools.partial(getattr, self, "_given"), functools.partial(getattr, policy, "options")
        self._host = Host(model, tuple(self._found), backend, self._hooks, given_now, in_force, self._resolve_again)
        self._copies: CleanCopies | None = None
        self._removed, self._undo = False, []  # _undo: see at_remove
        try:
            self._features.follow(on_device.features, self._host, self._clean_copies)
        except BaseException:  # a feature that failed to attach: the model as it was (follow removed the others)
            self.remove()
            raise
        self._clean_copies()
        #: What the policy will do over a run, and what it dropped (:class:`dropbp.run_schedule.RunSchedule`).
        self.schedule = RunSchedule(policy, flops, tally, self._hooks.pattern)
        for module in (model, *(b.module for b in found)):
            _ATTACHED[module] = weakref.ref(self)

    def _clean_copies(self) -> None:
        """Copies and pickles of the model leave out every hook and patch now on it (the features' included)."""
        if self._copies is not None:
            self._copies.remove()
        self._copies = CleanCopies([*self._touched, *self._features.modules()], self._our_handles)

    def _our_handles(self) -> list:
        return [*self._hooks.handles, *self._compile_handles, *self._features.handles()]

    @property
    def options(self) -> DropBPOptions:
        """The options as given (``"auto"`` and ``None`` kept as such); ``ctl.schedule.options`` are those in force."""
        return self._given

    @property
    def features(self) -> dict[str, Feature]:
        """The attached features by key (``ctl.features["noise_scale"].estimate()``)."""
        return self._features.by_key()

    def replace_options(self, **change: Any) -> None:
        """Change settings (fields of :attr:`options`, ``features`` included: those added are attached, those left
        out removed) together, from the next step; validated once (``dataclasses.replace``), all or nothing.
        ``backend`` and ``branches`` are fixed at ``apply``."""
        self._check_attached()
        fixed = sorted(set(change) & _FIXED)
        if fixed:
            raise ValueError(f"{', '.join(fixed)} cannot change after apply: remove() and apply again")
        reset_rates = not {"drop_rate", "pattern"}.isdisjoint(change)  # set, even to its value: as apply does
        check_names(DropBPOptions, "replace_options", change)  # older spellings say the way now
        self._use(self._given.replaced(**change), lambda resolved: self._policy.use(resolved, reset_rates))

    def _use(self, given: DropBPOptions, policy_takes: Callable[[DropBPOptions], None]) -> None:
        """Options as given from now on: on the backend (:meth:`~dropbp.options.DropBPOptions.on`), handed to the
        policy by ``policy_takes`` (which resolves the ``"auto"``s; all or nothing: it raises before anything changes;
        the hooks read it), then to the features."""
        self._features.check_new(given.features)
        before = (self._given, self._policy.state_dict(), self._policy.options)
        policy_takes(given.on(self.backend))
        self._given = given
        try:
            self._features.follow(given.features, self._host, self._clean_copies)
        except BaseException:  # a feature that failed to attach: all as before (follow put the features back)
            self._given, state, in_force = before
            self._policy.load_state_dict(state, in_force)
            raise

    def _resolve_again(self) -> None:
        """A feature's ``"auto"`` has a new value: the options as given, resolved again (the rates the shape's own)."""
        self._use(self._given, lambda resolved: self._policy.use(resolved, reset_rates=True))

    drop_rate = _setting("drop_rate", "The target (FLOP-weighted mean) drop rate (under 'auto', the rate in force). "
                         "Setting it resets the rates to the shape's for it; ``calibrate`` allocates towards it.")
    seed = _setting("seed", "The seed of every pattern.")
    pattern = _setting("pattern", 'The shape of the patterns, "uniform" or "cut"; setting it resets the rates.')
    max_patterns = _setting("max_patterns", "Bound on distinct patterns (``None``: the backend's default).")
    warmup_steps = _setting("warmup_steps", "Training forwards over which the rates rise linearly from 0.")
    total_steps = _setting("total_steps", "The run's length in training forwards (``None``: unknown).")
    memory_bound = _setting("memory_bound", "Whether the activation memory is bounded at every step.")

    @property
    def windows(self) -> tuple[int, int] | None:
        """The run's optimizer-step windows, ``(forwards per epoch, accumulation)``, or None (:mod:`.policy.windows`:
        each optimizer step starts a pool's cycle where epochs end short); the Trainer integration sets them from the
        run. Saved in ``state_dict``; settable, from the next pattern on."""
        return self._policy.windows

    @windows.setter
    def windows(self, windows: tuple[int, int] | None) -> None:
        self._check_attached()
        self._policy.set_windows(windows)

    @property
    def branches(self) -> list[Branch]:
        """Read-only views of the branches in forward order (``.name``, ``.kind``, ``.flops``, ``.rate``)."""
        return [b.with_rate(r) for b, r in zip(self._found, self._policy.rates, strict=True)]

    @property
    def rates(self) -> list[float]:
        """Per-branch drop rates in branch order (a copy; change them with :meth:`set_rates`)."""
        return self._policy.rates

    def set_rates(self, rates: Sequence[float]) -> None:
        """Set one drop rate per branch (branch order). Uniform shape: each in [0, 1), summing to at most
        N - 1. Cut shape: each in [0, 1], not rising with depth, the top one 0."""
        self._check_attached()
        self._policy.set_rates(rates)

    @property
    def model(self) -> nn.Module:
        """The module DropBP is attached to: the model given to :func:`dropbp.apply`, or the one its wrapper wraps."""
        return self._model

    @contextmanager
    def forcing(self, pattern: Collection[int]) -> Iterator[None]:
        """Within the block every forward drops exactly the branches ``pattern`` (indices in branch order) and takes no
        step: no pattern is drawn, the step counter stays (calibration; :mod:`dropbp.tools.memory` measures so)."""
        self._check_attached()
        indices = frozenset(pattern)
        if not all(isinstance(i, int) and 0 <= i < len(self._found) for i in indices):
            raise ValueError(f"pattern must hold branch indices in [0, {len(self._found)}), got {sorted(pattern)}")
        with self._hooks.force(indices):
            yield

    @property
    def forced(self) -> tuple[str, ...] | None:
        """Names of the branches a forced pattern (:meth:`forcing`, calibration) drops in the forwards running now."""
        forced = self._hooks.forced
        return None if forced is None else self._names(forced)

    @property
    def last_dropped(self) -> tuple[str, ...]:
        """Names of the branches dropped in the most recent training-mode forward."""
        return self._names(self._hooks.last)

    @property
    def step(self) -> int:
        """How many training-mode forwards have drawn a pattern so far."""
        return self._hooks.step

    def dropped_at(self, step: int) -> tuple[str, ...]:
        """Names of the branches that drop at ``step`` (a pure function of seed, step and rates)."""
        return self._names(self._hooks.pattern(check_int("step", step, 0)))

    def _names(self, indices: frozenset[int]) -> tuple[str, ...]:
        return tuple(self._found[i].name for i in sorted(indices))

    def calibrate(self, closure: Callable[[], torch.Tensor], **settings: Any) -> list[float]:
        """Measure each branch's sensitivity and set the rates by :func:`dropbp.allocate_rates`
        (:func:`dropbp.calibration.calibrate`, which documents ``gradnorm``, ``min_rate`` and ``max_rate``);
        ``pattern="uniform"`` only.

        Returns:
            The sensitivities, in branch order.
        """
        self._check_attached()
        parts = (self._model, self._found, self._policy, self._hooks.force, self.backend)
        return calibration.calibrate(*parts, closure, **settings)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue with the same patterns: rates, seed, step counter, bound, warm-up, time
        schedule, and each feature's state under its key."""
        names = [b.name for b in self._found]
        state = {"version": STATE_VERSION, "branches": names, **self._policy.state_dict(), "step": self._hooks.step}
        if self._given.follows_noise_scale:  # "auto": the rate in force follows the noise scale's state
            state["drop_rate"] = self._given.drop_rate
        return state | self._features.states()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (all or nothing); the branches must be the same as when it was saved."""
        self._check_attached()
        state = check_state(migrate(state, self.features), tuple(self.features), [b.name for b in self._found])
        with state_settings(state) as settings:  # each setting checked once, by the options, named as the state's
            given = dataclasses.replace(self._given, **settings)
        with self._features.loading(given.features, state):  # first: "auto" reads the noise scale's state
            self._use(given, lambda resolved: self._policy.load_state_dict(state, resolved))
        self._hooks.step = state["step"]

    def backward(self, loss: torch.Tensor) -> bool:
        """``loss.backward()`` then the backend's step boundary (a graph break on lazy devices), placed either way;
        False, without raising, where ``loss`` needs no gradient. For hand-written loops: trainers that place their own
        breaks (Hugging Face ``Trainer``, optimum-habana ``GaudiTrainer``) need neither this nor :meth:`optimizer_step`.
        """
        needs_grad = loss.requires_grad
        if needs_grad:
            loss.backward()
        self.backend.after_backward()
        return needs_grad

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` then the backend's step boundary; ``zero_grad`` stays with the caller."""
        optimizer.step()
        self.backend.after_optimizer_step()

    def remove(self) -> None:
        """Detach from the model: every hook and feature is removed and the model is exactly as before (a copy or
        pickle of it, taken at any time, already is); a Trainer callback leaves its trainer too."""
        if self._removed:
            return
        self._features.remove()  # first: attached last, a feature's patch sits over the hooks' own
        self._hooks.remove()
        for handle in self._compile_handles:
            handle.remove()
        if self._copies is not None:
            self._copies.remove()
        for module in (self._model, *(b.module for b in self._found)):
            if controller_of(module) is self:
                del _ATTACHED[module]
        self._removed = True
        while self._undo:
            self._undo.pop()()

    def at_remove(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` at :meth:`remove` (the last given first): what an integration hooked elsewhere (a callback)."""
        self._undo.append(undo)

    def __setattr__(self, name: str, value: Any) -> None:
        """Settings are properties; any other public name is refused (0.2's settings say where they went), not kept."""
        if name.startswith("_") or name in ("backend", "schedule") or hasattr(type(self), name):
            return object.__setattr__(self, name, value)
        where = moved_member(name)
        raise AttributeError(f"DropBPController has no setting {name!r}" + (f" {where}" if where else ""))

    def __getattr__(self, name: str) -> Any:  # only where no attribute is found: an earlier release's says the way
        where = "" if name.startswith("_") else f" {moved_member(name) or ''}".rstrip()
        raise AttributeError(f"'DropBPController' object has no attribute {name!r}{where}")

    def _check_attached(self) -> None:
        if self._removed:
            raise RuntimeError("this DropBP controller was removed; call dropbp.apply(model, ...) again")

    def __repr__(self) -> str:
        kinds = ", ".join(f"{sum(b.kind == k for b in self._found)} {k}" for k in ("attn", "mlp"))
        features = f", features={list(self.features)}" if self.features else ""
        settings = f"drop_rate={self.drop_rate}, seed={self.seed}, max_patterns={self.max_patterns}, step={self.step}"
        return f"DropBPController({len(self._found)} branches ({kinds}), {settings}{features})"
