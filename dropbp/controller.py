"""The controller :func:`dropbp.apply` returns: a thin facade over the core's parts.

It owns nothing but the wiring: the per-step decision and its hooks (:mod:`dropbp.execution.hooks`), the
policy whose settings it exposes (:mod:`dropbp.policy.drop_policy`), calibration (:mod:`dropbp.calibration`,
:mod:`dropbp.policy.allocation`), learning-rate compensation (:mod:`dropbp.policy.lr_compensation`), checkpoint state,
and the device's step boundaries (the backend's). Every setting validates and takes effect from the
next step; the :class:`~dropbp.execution.discovery.Branch` objects it hands out are read-only views.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from dropbp import calibration
from dropbp.backends import Backend
from dropbp.checks import check_bool, check_choice, check_int
from dropbp.chunked_loss import ChunkedLoss
from dropbp.execution.compile_guards import EnclosingCompileWarning
from dropbp.execution.discovery import Branch, recomputes_on_kept_rows, row_local_linears
from dropbp.execution.distributed import RunningDDPCheck, check_ddp
from dropbp.execution.dropped_grads import DroppedGrads
from dropbp.execution.frameworks import FrameworkWatch, calibration_closure, calibration_method, check_wrapper, unwrap
from dropbp.execution.gradient_noise import MicroBatchGradients, check_reads
from dropbp.execution.hooks import ExecutionSettings, StepHooks
from dropbp.execution.patching import CleanCopies
from dropbp.execution.token_backward import TokenDrops
from dropbp.options import AUTO, DropBPOptions
from dropbp.policy import lr_compensation
from dropbp.policy.allocation import allocate_rates
from dropbp.policy.drop_policy import DropPolicy
from dropbp.policy.noise_scale import AUTO_RATES, NoiseScale, NoiseScaleEstimator, auto_drop_rate
from dropbp.policy.plan import DropTally, PatternPlan, plan_patterns
from dropbp.state import POLICY_STATE, STATE_VERSION, check_state

__all__ = ["DropBPController", "controller_of"]

# Modules (models and branch modules) that already carry a controller: applying twice would stack
# hooks and make two policies fight over one model. Weak both ways: the model keeps its controller alive
# through its hooks (StepHooks.owner), and a model nobody holds is freed with its controller.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[DropBPController]] = weakref.WeakKeyDictionary()


def controller_of(module: nn.Module) -> DropBPController | None:
    """The controller attached to ``module`` (a model given to :func:`dropbp.apply`, unwrapped, or one of its
    branch modules), or None: how tools that take "the model" find its branches and patterns."""
    ref = _ATTACHED.get(module)
    return None if ref is None else ref()


def _setting(name: str, doc: str) -> property:
    """A controller setting: a field of the options in force (:attr:`DropBPController.options`); setting it replaces
    the options (validated there) and re-derives what depends on them, from the next step."""

    def get(self: DropBPController) -> Any:
        return getattr(self._policy.options, name)

    def set(self: DropBPController, value: Any) -> None:
        self.replace_options(**{name: value})

    return property(get, set, doc=f"{doc} Settable: validated, and effective from the next step.")


class DropBPController:
    """Drop policy attached to one model; made by :func:`dropbp.apply`, which documents the arguments.

    It owns the options: as given (``given``, default the policy's), and resolved on its backend
    (:meth:`~dropbp.options.DropBPOptions.resolved`, :attr:`options`) at every change, which the policy and the
    hooks (:class:`~dropbp.execution.hooks.ExecutionSettings`) then read.
    """

    def __init__(
        self,
        model: nn.Module,
        branches: Sequence[Branch],
        policy: DropPolicy,
        backend: Backend,
        given: DropBPOptions | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        wrapper = model
        model, ddp = unwrap(model)
        if ddp is not None:
            check_ddp(ddp)
        if not branches or not all(isinstance(b, Branch) for b in branches):
            raise TypeError(
                "branches must be a non-empty list of dropbp.Branch (from dropbp.execution.discovery.find_branches)"
            )
        if not isinstance(policy, DropPolicy) or policy.num_branches != len(branches):
            raise TypeError(f"policy must be a DropPolicy for {len(branches)} branches")
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a Backend, got {type(backend).__name__}")
        if any(controller_of(m) is not None for m in (model, *(b.module for b in branches))):
            raise RuntimeError(
                "DropBP is already attached to this model (or to some of its branches); "
                "call .remove() on the existing controller first"
            )
        self._policy = policy
        options = policy.options
        self._given = options if given is None else given
        #: Whether a framework's engine wraps the model (DeepSpeed): it holds the gradients, not ``.grad``.
        self._framework = ddp is None and wrapper is not model
        if self._framework:  # a framework's wrapper (a DeepSpeedEngine)
            check_wrapper(wrapper, options.dropped_grads)
        #: The device backend whose step boundaries :meth:`backward` and :meth:`optimizer_step` place.
        self.backend = backend
        self._model = model
        self._found = list(branches)
        self._modules = [b.module for b in branches]
        self._flops = [b.flops for b in branches]
        # first: a model it cannot handle leaves no hooks
        chunked = options.chunked_loss
        self._chunked = None if chunked is False else ChunkedLoss(model, None if chunked is True else chunked)
        self._hooks = StepHooks(
            model, self._found, policy=policy, backend=backend, settings=ExecutionSettings.of(options)
        )
        self._hooks.owner = self
        self._fill = DroppedGrads(options.dropped_grads, self._hooks.holders)
        self._tally = DropTally(self._flops)
        self._hooks.listen(RunningDDPCheck())  # first: it may refuse the step before anything notes it
        self._hooks.listen(self._fill)
        self._hooks.listen(FrameworkWatch(model, self._hooks.holders, options.dropped_grads))
        self._hooks.listen(self._tally)
        found = [row_local_linears(b) for b in self._found]
        self._full_rows = [name for _, names in found for name in names]
        parts = [b.parts for b in self._found]
        on_kept_rows = [recomputes_on_kept_rows(b) for b in self._found]
        linears = [linears for linears, _ in found]
        self._tokens = TokenDrops(parts, linears, backend, self._hooks.token_slot, on_kept_rows)
        self._hooks.listen(self._tokens)
        self._auto_rate = 0.0  # drop_rate="auto": the rate the measured noise scale chose
        self._noise = MicroBatchGradients(
            model, NoiseScaleEstimator(), lambda: self._hooks.forced is None, on_step=self._follow_noise_scale
        )
        self._sync_readers(options)
        compile_warning = EnclosingCompileWarning()
        self._compile_handles = compile_warning.attach(model, [b.name for b in self._found])
        touched = [
            model,
            *(p for b in branches for p in b.parts),
            *compile_warning.layers,
            *self._hooks.bound.units,
            *([self._chunked.lm] if self._chunked else []),
            *(linear.module for linears, _ in found for linear in linears),
        ]
        # copies and pickles come out clean
        handles = lambda: [  # noqa: E731
            *self._hooks.handles, *self._compile_handles, *self._tokens.handles, *self._noise.handles
        ]
        self._copies = CleanCopies(touched, handles)
        for module in (model, *self._modules):
            _ATTACHED[module] = weakref.ref(self)
        self._removed = False
        self._undo: list[Callable[[], None]] = []  # see at_remove

    @property
    def options_given(self) -> DropBPOptions:
        """The options as given (``max_patterns=None``, ``memory_bound="auto"``, ``drop_rate="auto"`` kept as such);
        :attr:`options` are these resolved on the backend."""
        return self._given

    @property
    def options(self) -> DropBPOptions:
        """The options in force: as given, resolved on the backend (``max_patterns``, ``memory_bound``)."""
        return self._policy.options

    def replace_options(self, **change: Any) -> None:
        """Change settings (fields of :attr:`options`) together, from the next step: the options are replaced
        (``dataclasses.replace``: validated once, there) and what depends on them is derived again; all or
        nothing. ``backend``, ``branches``, ``seq_len``, ``dropped_grads`` and ``chunked_loss`` are fixed at
        ``apply``."""
        self.check_attached()
        fixed = sorted(set(change) & {"backend", "branches", "seq_len", "dropped_grads", "chunked_loss"})
        if fixed:
            raise ValueError(f"{', '.join(fixed)} cannot change after apply: remove() and apply again")
        reset_rates = not {"drop_rate", "pattern"}.isdisjoint(change)  # set, even to its value: as apply does
        self._use(dataclasses.replace(self._given, **change), lambda resolved: self._policy.use(resolved, reset_rates))

    def longest_warmup(self, total_steps: int, up_to: int) -> int:
        """The longest warm-up, at most ``up_to`` training forwards, whose time schedule over a run of
        ``total_steps`` forwards the rates can take while keeping the run's mean (a longer warm-up asks a higher
        peak later); 0 where none can (a rising ``drop_schedule`` may ask too high a peak by itself: setting it
        says so). A pure function of the settings: nothing changes."""
        check_int("total_steps", total_steps, 1)
        return self._policy.longest_warmup(total_steps, check_int("up_to", up_to, 0))

    def _use(self, given: DropBPOptions, policy_takes: Callable[[DropBPOptions], None]) -> None:
        """Options as given from now on: resolved on the backend (a state saved on an unbounded device keeps this
        device's bound), handed to the policy by ``policy_takes`` (all or nothing: it raises before anything
        changes), then to the hooks and token drops."""
        resolved = given.resolved(self.backend, self._auto_rate)
        policy_takes(resolved)
        self._given = given
        self._hooks.settings = ExecutionSettings.of(resolved)
        self._sync_readers(resolved)

    def _sync_readers(self, options: DropBPOptions) -> None:
        """What the options switch on beyond the hooks. Token drops' hooks go on the first time ``token_drop_rate``
        is above 0 (and stay: at 0 they select nothing, so the model computes exactly what it did without them);
        a rate other than "auto" forgets the automatic shares' readings; the noise scale's reads are on while
        ``measure_noise_scale`` is."""
        if (options.token_drop_rate == AUTO or options.token_drop_rate > 0.0) and not self._tokens.installed:
            self._tokens.install()
            self._tokens.warn_full_rows(self._full_rows)
        if options.token_drop_rate != AUTO:
            self._tokens.clear_auto()
        if options.measure_noise_scale and not self._noise.installed:
            check_reads(self._model, self._framework)
            self._noise.install()
        elif not options.measure_noise_scale and self._noise.installed:
            self._noise.remove()

    def _follow_noise_scale(self) -> None:
        """``drop_rate="auto"``: after each measured optimizer step, the rate the noise scale now forecasts best,
        from the next pattern on (the rates the shape's own for it)."""
        if self._given.drop_rate != AUTO:
            return
        rate = auto_drop_rate(self._noise.estimator.estimate(), rates=self._auto_rates())
        if rate != self._auto_rate:
            self._auto_rate = rate
            self._use(self._given, lambda resolved: self._policy.use(resolved, reset_rates=True))

    def _auto_rates(self) -> tuple[float, ...]:
        """The automatic rates this model's shape can take (the uniform shape never drops every branch)."""
        n = len(self._found)
        return tuple(p for p in AUTO_RATES if self._given.pattern != "uniform" or p * n <= n - 1)

    def noise_scale(self) -> NoiseScale | None:
        """The gradient noise scale measured so far (:class:`dropbp.policy.noise_scale.NoiseScale`: ``.tokens`` is
        ``B_simple``), or None before the first optimizer step with at least 2 micro-batches has closed (a step
        closes when the next one's first forward finds the gradients cleared).

        Raises:
            RuntimeError: where it is not measured (``measure_noise_scale=False``).
        """
        if not self._noise.installed:
            raise RuntimeError(
                "the noise scale is not measured: pass measure_noise_scale=True to dropbp.apply (or DropBPCallback), "
                "or set ctl.measure_noise_scale = True, and train with gradient accumulation of at least 2"
            )
        return self._noise.estimator.estimate()

    def token_weights(self) -> dict[str, torch.Tensor]:
        """Per branch name, the weights of its most recent token selection (one per token row of its output:
        ``1 / p`` where kept, 0 where its backward was skipped), for branches that made one."""
        weights = self._tokens.last_weights
        return {b.name: w for b, w in zip(self._found, weights, strict=True) if w is not None}

    def token_keep_shares(self) -> dict[str, float]:
        """Per branch name, the share of its token rows a kept branch's backward keeps now: ``1 - token_drop_rate``,
        or under ``token_drop_rate="auto"`` the share its readings chose (1 until it has one)."""
        rate = self._given.token_drop_rate
        shares = self._tokens.auto_shares if rate == AUTO else [1.0 - rate] * len(self._found)
        return {b.name: share for b, share in zip(self._found, shares, strict=True)}

    measure_noise_scale = _setting("measure_noise_scale", "Whether the gradient noise scale is measured.")
    token_drop_rate = _setting(
        "token_drop_rate", "The share of token rows whose backward each kept branch skips (token drops)."
    )
    token_selection = _setting(
        "token_selection", "How token drops choose rows: 'gradient', 'residual', 'random' or 'cumulative'."
    )

    memory_bound = _setting(
        "memory_bound", "Whether the activation memory is bounded at every step (:mod:`dropbp.execution.bound`)."
    )

    @property
    def max_kept_branches(self) -> int:
        """The most branches that store activations in one step: with the bound, what the uniform shape keeps
        at most at ``drop_rate``; without it, every branch (a step may drop none)."""
        return self._hooks.kept_bound() or len(self._found)

    def _names(self, indices: frozenset[int]) -> tuple[str, ...]:
        return tuple(self._found[i].name for i in sorted(indices))

    # -- settings: each validates and takes effect from the next step ----------------------------
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
        self.check_attached()
        self._policy.set_rates(rates)

    drop_rate = _setting(
        "drop_rate",
        "The target (FLOP-weighted mean) drop rate. Setting it resets the rates to the pattern shape's for it, "
        "as ``apply`` does (calibrate again for allocated rates); ``calibrate`` allocates towards it.",
    )
    seed = _setting("seed", "The seed of every pattern.")
    max_patterns = _setting("max_patterns", "Bound on distinct patterns (``None``: unbounded).")
    warmup_steps = _setting("warmup_steps", "Training forwards over which the rates rise linearly from 0.")
    total_steps = _setting(
        "total_steps",
        "The run's length in training forwards (``None``: unknown); known, the rates follow ``drop_schedule`` "
        "with the run's mean drop rate equal to ``drop_rate``.",
    )
    windows = _setting(
        "windows",
        "The run's optimizer-step windows, (training forwards per epoch, accumulation), or None: stratified groups "
        "and a pattern pool start at every optimizer step even where an epoch ends with a short window.",
    )
    drop_schedule = _setting(
        "drop_schedule", 'How the rates move over a run of known length: "constant", "linear", "cosine" or "step".'
    )
    ramp = _setting("ramp", "The share of the run over which a rising drop schedule rises, in (0, 1].")
    pattern = _setting(
        "pattern", 'The shape of the patterns, "uniform" or "cut"; setting it resets the rates to its own.'
    )

    stratify = _setting("stratify", "Forwards per group of stratified cuts (1: an independent draw per forward).")
    unbiased = _setting(
        "unbiased",
        "Weight each kept branch's own parameter gradients by ``1 / (1 - rate in force)`` "
        "(:mod:`dropbp.execution.branch_forward`).",
    )

    @property
    def chunked_loss(self) -> int | None:
        """Tokens per chunk of the memory-lean head and loss (:mod:`dropbp.chunked_loss`); None when off."""
        return None if self._chunked is None else self._chunked.chunk_tokens

    @property
    def dropped_grads(self) -> str:
        """What the optimizer sees for dropped branches: "skip", "zero" or "reuse" (see apply)."""
        return self._fill.mode

    # -- what happened ---------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The module DropBP is attached to: the model given to :func:`dropbp.apply`, or the one its DDP or
        DeepSpeed wrapper wraps."""
        return self._model

    @contextmanager
    def forcing(self, pattern: Collection[int]) -> Iterator[None]:
        """Within the block every forward drops exactly the branches ``pattern`` (indices in branch order)
        and takes no step: no pattern is drawn, the step counter stays (what calibration does;
        :mod:`dropbp.tools.memory` measures with it)."""
        self.check_attached()
        indices = frozenset(pattern)
        if not all(isinstance(i, int) and 0 <= i < len(self._found) for i in indices):
            raise ValueError(f"pattern must hold branch indices in [0, {len(self._found)}), got {sorted(pattern)}")
        with self._hooks.force(indices):
            yield

    @property
    def forced(self) -> tuple[str, ...] | None:
        """Names of the branches a forced pattern (:meth:`forcing`, calibration) drops in the forwards running
        now; None outside such a block, where forwards draw the step's pattern."""
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

    def drop_rate_at(self, step: int) -> float:
        """The expected FLOP-weighted drop rate at training forward ``step``: the rates under the warm-up
        and time schedule of that step. Over a run of ``total_steps`` forwards its mean is ``drop_rate``."""
        return self._rate_under(self._policy.factor(check_int("step", step, 0)))

    def mean_drop_rate(self, start: int, stop: int) -> float:
        """The mean of :meth:`drop_rate_at` over the training forwards ``start`` to ``stop - 1``."""
        check_int("start", start, 0)
        if check_int("stop", stop, start + 1) <= start:
            raise ValueError(f"stop must be above start, got start={start}, stop={stop}")
        factors = Counter(self._policy.factor(step) for step in range(start, stop))
        return sum(n * self._rate_under(factor) for factor, n in factors.items()) / (stop - start)

    def pattern_plan(self, optimizer_steps: int | None = None, micro_batches: int = 1) -> PatternPlan:
        """The distinct patterns, step sequences and (on a lazy-graph device) training graphs of a run of
        ``optimizer_steps`` steps of ``micro_batches`` training forwards each, from forward 0
        (:mod:`dropbp.policy.plan`). ``optimizer_steps`` defaults to the run's length when ``total_steps`` is set."""
        check_int("micro_batches", micro_batches, 1)
        if optimizer_steps is None:
            total = self._policy.total_steps
            if total is None:
                raise ValueError(
                    "pattern_plan needs optimizer_steps: this controller has no total_steps (the run's length in "
                    "training forwards), so it cannot tell how long the run is"
                )
            optimizer_steps = -(-total // micro_batches)
        check_int("optimizer_steps", optimizer_steps, 1)
        return plan_patterns(self._hooks.pattern, optimizer_steps, micro_batches)

    def _rate_under(self, factor: float) -> float:
        rates = self._policy.rates
        dropped = sum(f * min(1.0, r * factor) for f, r in zip(self._flops, rates, strict=True))
        return dropped / sum(self._flops)

    def drop_stats(self, reset: bool = True) -> dict[str, float]:
        """What was dropped over the training forwards since the last reset: their number, the mean
        number of branches dropped per forward, and the mean fraction of branch FLOPs dropped."""
        stats = self._tally.summary()
        if reset:
            self._tally.reset()
        return stats

    # -- calibration and optimizer ---------------------------------------------------------------
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

        Nothing drops during calibration, the step counter does not move, ``.grad`` and train/eval
        modes are left as they were, and with ``torch.distributed`` initialised every rank ends with
        identical rates (the sensitivities are averaged). Where the allocation would drop every
        branch in some steps (few branches), the highest rates are lowered into the bound. Only for
        ``pattern="uniform"``: allocated rates do not fall with depth, so no cut realises them.

        Args:
            closure: runs a forward on one fixed batch and returns the scalar loss (no backward).
            gradnorm: compare gradient norms (the paper) rather than whole gradients.
            method: ``"one-pass"`` (default: all sensitivities from a single forward) or
                ``"exact-recompute"`` (the research code's N + 1 passes, reseeded alike).
            min_rate: the allocation's lowest rate.
            max_rate: the allocation's highest rate.

        Returns:
            The sensitivities, in branch order.
        """
        self.check_attached()
        if not callable(closure):
            raise TypeError(f"closure must be callable and return the loss, got {type(closure).__name__}")
        check_choice("method", method, calibration.CALIBRATION_METHODS)
        check_bool("gradnorm", gradnorm)
        if self.pattern != "uniform":
            raise ValueError(
                f"calibrate allocates rates by each branch's sensitivity, which pattern={self.pattern!r} cannot "
                "realise (a cut's rates must fall with depth); set ctl.pattern = 'uniform' (the paper's patterns) "
                "before calibrating, or keep the cut's rates"
            )
        closure = calibration_closure(closure)  # e.g. a DeepSpeed engine cannot take calibration passes
        method = calibration_method(self._model.parameters(), method)  # e.g. ZeRO-3: exact-recompute
        sens = calibration.measure(
            self._model,
            [b.parts[-1] for b in self._found],  # what the residual add receives: the tail's last part
            closure,
            self._hooks.force,
            gradnorm=gradnorm,
            method=method,
            backend=self.backend,
        )
        # Under a time schedule the rates are allocated for its peak, where they must stay within the rule,
        # and scaled back by the policy: the run's mean is then still the drop rate.
        target = min(self.drop_rate * self._policy.peak, max_rate)
        rates = allocate_rates(sens, self._flops, target, min_rate=min_rate, max_rate=max_rate)
        self._policy.set_allocated_rates(rates, min_rate)
        return sens

    def param_groups(self, lr: float, **options: Any) -> list[dict[str, Any]]:
        """Optimizer parameter groups with learning-rate compensation (:mod:`dropbp.policy.lr_compensation`): a
        branch dropped with rate ``r`` gets ``lr / (1 - r)``. After the rates change (``calibrate``,
        ``set_rates``) call :meth:`update_param_groups` on the optimizer."""
        return lr_compensation.param_groups(self._model, self._hooks.holders, self.rates, lr, **options)

    def update_param_groups(
        self, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    ) -> None:
        """Rescale the groups from :meth:`param_groups` (and the scheduler's ``base_lrs``) to the current rates."""
        lr_compensation.update_param_groups(optimizer, self.rates, scheduler)

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue with the same patterns: rates, seed, step counter, bound, warm-up,
        time schedule."""
        names = [b.name for b in self._found]
        state = {"version": STATE_VERSION, "branches": names, **self._policy.state_dict(), "step": self._hooks.step}
        if self._given.drop_rate == AUTO:  # the rate in force follows the noise scale, which resumes with it
            state |= {"drop_rate": AUTO, "noise_scale": self._noise.estimator.state_dict()}
        if self._given.token_drop_rate == AUTO:  # each branch's share follows its readings, which resume with it
            state |= {"token_shares": self._tokens.auto_state()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the branches must be the same as when it was saved."""
        self.check_attached()
        check_state(state)
        names = [b.name for b in self._found]
        if list(state["branches"]) != names:
            raise ValueError(
                "state was saved for different branches: "
                f"saved {len(state['branches'])} starting {list(state['branches'])[:2]}, "
                f"this model has {len(names)} starting {names[:2]}"
            )
        windows = state.get("windows")
        given = dataclasses.replace(
            self._given,
            **{name: state[name] for name in POLICY_STATE},
            windows=None if windows is None else tuple(windows),
        )
        estimator = NoiseScaleEstimator()
        if "noise_scale" in state:
            estimator.load_state_dict(state["noise_scale"])
        previous = self._auto_rate
        if given.drop_rate == AUTO:
            self._auto_rate = auto_drop_rate(estimator.estimate(), rates=self._auto_rates())
        try:
            self._use(given, lambda resolved: self._policy.load_state_dict(state, resolved))
        except Exception:
            self._auto_rate = previous
            raise
        if "noise_scale" in state:
            self._noise.estimator.load_state_dict(state["noise_scale"])
        if "token_shares" in state:
            self._tokens.load_auto_state(state["token_shares"])
        self._hooks.step = state["step"]

    # -- the device's step boundaries ------------------------------------------------------------
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
        """Detach from the model: every hook is removed and the model is exactly as before; a Trainer callback
        of :mod:`dropbp.integrations.hf` leaves its trainer too.

        (A deep copy or pickle of the model, taken at any time, is already clean: the model as it was
        before ``apply``, with no controller; ``dropbp.apply`` attaches to it independently.)"""
        if self._removed:
            return
        self._hooks.remove()
        self._noise.remove()
        for handle in self._compile_handles:
            handle.remove()
        if self._chunked is not None:
            self._chunked.remove()
        self._copies.remove()
        for module in (self._model, *self._modules):
            if controller_of(module) is self:
                del _ATTACHED[module]
        self._removed = True
        while self._undo:
            self._undo.pop()()

    def at_remove(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` when :meth:`remove` runs (the last given first): for integrations that hooked this
        controller into something else (a Trainer's callback), so that removing the controller removes them too."""
        self._undo.append(undo)

    def check_attached(self) -> None:
        """Raise ``RuntimeError``, saying what to do, if this controller was removed (:meth:`remove`)."""
        if self._removed:
            raise RuntimeError("this DropBP controller was removed; call dropbp.apply(model, ...) again")

    def __repr__(self) -> str:
        kinds = {k: sum(b.kind == k for b in self._found) for k in ("attn", "mlp")}
        return (
            f"DropBPController({len(self._found)} branches ({kinds['attn']} attn, {kinds['mlp']} mlp), "
            f"drop_rate={self.drop_rate}, seed={self.seed}, max_patterns={self.max_patterns}, "
            f"step={self._hooks.step})"
        )
