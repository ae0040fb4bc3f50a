"""The options of ``dropbp.apply`` and of the Trainer integration, declared and validated once.

:class:`DropBPOptions` holds every keyword option of :func:`dropbp.apply`; :class:`TrainerOptions` adds ``warmup``
and ``calibrate_at`` (fractions of the run) and leaves out ``warmup_steps``, ``total_steps`` and ``windows`` (the
callback of :mod:`dropbp.integrations.hf` derives them from the run). :func:`takes_options` makes each field's default
and help the keyword parameters of ``apply``, ``attach`` and ``DropBPCallback``; the axolotl ``dropbp_*`` keys come
from the same fields (:mod:`dropbp.integrations.axolotl`). Adding an option is one field here (default, help, check
in ``__post_init__``), then wired where it acts (the policy, the controller). An object is valid once made (frozen):
the parts built from it check only what needs the model (a uniform rate against the branch count, a schedule's peak).
A later change (``ctl.seed = ...``, ``ctl.replace_options(...)``) uses ``dataclasses.replace``: the same checks.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, get_type_hints

from dropbp.architectures import BERT_BRANCHES
from dropbp.backends import Backend
from dropbp.checks import check_bool, check_choice, check_fraction, check_int, check_ramp
from dropbp.execution.dropped_grads import DEFAULT_DROPPED_GRADS, DROPPED_GRADS
from dropbp.policy.sampler import SAMPLERS
from dropbp.policy.schedule import DEFAULT_RAMP, DROP_SCHEDULES
from dropbp.policy.token_selection import TOKEN_SELECTIONS

#: ``memory_bound="auto"`` turns the bound on from this drop rate (or with ``chunked_loss``).
AUTO_BOUND_RATE = 0.75

__all__ = [
    "AUTO",
    "AUTO_BOUND_RATE",
    "AUTO_WARMUP",
    "DropBPOptions",
    "TrainerOptions",
    "option_fields",
    "takes_options",
]

#: ``drop_rate="auto"``: the rate chosen each optimizer step from the measured gradient noise scale.
AUTO = "auto"

#: A Trainer run's warm-up by default (``warmup="auto"``), a fraction of its training steps.
AUTO_WARMUP = 0.2

# What goes before every option's name in error messages: "" for Python callers, "dropbp_" while the
# axolotl plugin checks its config keys (:func:`named_as`).
_PREFIX: ContextVar[str] = ContextVar("dropbp_option_prefix", default="")


def _help(text: str, **more: Any) -> dict[str, Any]:
    return {"help": " ".join(text.split()), **more}


@dataclass(frozen=True)
class DropBPOptions:
    """The keyword options of :func:`dropbp.apply`; made, they are valid (see the module's docstring)."""

    drop_rate: float | str = field(
        metadata=_help(
            """The FLOP-weighted mean drop probability of the branches, in [0, 1): with the cut shape, spread
            over the depth; with the uniform shape, every branch's (``calibrate`` or ``set_rates`` can make
            them differ); ``ctl.drop_rate``. ``"auto"``: each optimizer step's rate chosen from the gradient
            noise scale measured so far (:func:`dropbp.policy.noise_scale.auto_drop_rate`: 0 until one is
            measured, and wherever dropping is forecast to lose); it measures the noise scale (needs gradient
            accumulation of at least 2) and replaces the warm-up and time schedule; ``ctl.drop_rate`` then reads
            the rate in force."""
        )
    )
    seed: int = field(
        default=0,
        metadata=_help("Fixes the patterns: they are a function of (seed, step), identical on every process."),
    )
    branches: Sequence[str] | None = field(
        default=None,
        metadata=_help(
            """Module names (as in ``model.named_modules()``) of the branches, in forward order, for a model
            that is not a recognised architecture: each module's output must be what is then added to the
            residual stream, not a module that adds the residual itself (a whole layer; BERT's
            ``encoder.layer.N.attention``, which ends in ``LayerNorm(x + ...)``). For BERT: """
            + BERT_BRANCHES
            + """.
            A whole layer, or a module holding one or another named branch, is refused; a choice that cuts
            every trainable parameter off the output is stopped at that forward with this advice."""
        ),
    )
    max_patterns: int | None = field(
        default=None,
        metadata=_help(
            """Bound on distinct patterns (for compiled graphs); ``None``: the backend's default (a bound on
            lazily compiled devices)."""
        ),
    )
    seq_len: int = field(
        default=512, metadata=_help("The typical sequence length, used only to weigh attention FLOPs.")
    )
    backend: str | Backend | None = field(
        default=None,
        metadata=_help(
            """A backend name or instance (default :func:`dropbp.backends.get`: ``DROPBP_BACKEND``, else
            detected); ``ctl.backend``, whose step boundaries :meth:`DropBPController.backward` and
            :meth:`DropBPController.optimizer_step` place."""
        ),
    )
    unbiased: bool = field(
        default=False,
        metadata=_help(
            """Importance weights: a kept branch's own parameters get their gradient times ``1 / (1 - rate)``
            for its rate in force at that forward (the residual stream is left alone), so with cut patterns
            every branch's expected gradient is exactly full backprop's (:mod:`dropbp.execution.branch_forward`);
            ``ctl.unbiased``, settable."""
        ),
    )
    dropped_grads: str = field(
        default=DEFAULT_DROPPED_GRADS,
        metadata=_help(
            """What the optimizer sees for a dropped branch's parameters: ``"skip"`` (no gradient, so no
            update: the paper), ``"zero"`` (a zero gradient: momentum optimizers keep moving them) or
            ``"reuse"`` (their last computed gradient); see :mod:`dropbp.execution.dropped_grads`. The fill runs in an
            optimizer pre-step hook, after a Trainer's gradient clipping."""
        ),
    )
    warmup_steps: int = field(
        default=0,
        metadata=_help(
            """Training forwards over which every rate rises linearly from 0: the first steps, where a
            fine-tune learns fastest, run (nearly) full backprop; ``ctl.warmup_steps``, saved in
            ``state_dict``.""",
            trainer="the run decides it: pass warmup= (a fraction of the training steps)",
        ),
    )
    pattern: str = field(
        default="cut",
        metadata=_help(
            """The shape of the drop patterns. ``"cut"`` (the default): each step draws a depth and drops every
            branch below it, so a kept branch's gradient misses no path through a dropped branch above it;
            the rates fall with depth (:func:`dropbp.policy.allocation.cut_rates`, capped at ``(1 + drop_rate) / 2``
            so the bottom still trains), their FLOP-weighted mean is ``drop_rate``, and the top branch is
            always kept (how it compares with the paper's patterns: ``docs/patterns.md``). The number
            dropped varies from step to step, down to none (``memory_bound`` bounds what a step stores).
            ``"uniform"``: the paper's, every branch dropped at its own rate
            wherever it sits, the same number in every step (steady memory: use it to train longer
            sequences), and the only shape ``calibrate`` can allocate for. ``ctl.pattern``, settable."""
        ),
    )
    chunked_loss: bool | int = field(
        default=False,
        metadata=_help(
            """For a Hugging Face causal LM called with ``labels`` in training, compute the LM head and
            cross-entropy in chunks recomputed in backward (:mod:`dropbp.chunked_loss`): same loss and
            gradients, but the full logits and their gradient never exist at once, so they no longer cap
            the memory dropping saves. ``True``: chunks of 64 MiB of float32 logits; an int: tokens per
            chunk. Such forwards return ``logits=None``. Works at any rate, 0 included; ``ctl.remove()``
            restores the model's forward."""
        ),
    )
    memory_bound: bool | str = field(
        default="auto",
        metadata=_help(
            """Bound the activation memory at every step (:mod:`dropbp.execution.bound`): a step that keeps more
            branches
            than the uniform shape keeps at most at ``drop_rate`` (``N - floor(drop_rate x N)``) runs the layers
            of its lowest kept branches checkpointed, so the activations stored for backward are bounded in every
            step, with exact gradients (docs/memory.md: what it does to the measured peak).
            ``"auto"``: on where memory is what the settings buy (``chunked_loss``, or ``drop_rate`` of 0.75 and
            above), off otherwise; ``ctl.memory_bound``, settable (True or False)."""
        ),
    )
    total_steps: int | None = field(
        default=None,
        metadata=_help(
            """The run's length in training forwards (micro-batches: optimizer steps times gradient
            accumulation), counted like ``warmup_steps``. Given, the rates follow ``drop_schedule`` over the
            run and are scaled so that the run's mean drop rate, warm-up included, is ``drop_rate`` (the
            compute it asks to save); without it, the rates stay as set after the warm-up.
            ``ctl.total_steps``, saved in ``state_dict``.""",
            trainer="the run decides it: max_steps x gradient_accumulation_steps, when training begins",
        ),
    )
    drop_schedule: str = field(
        default="constant",
        metadata=_help(
            """How the rates move over a run of known length (:mod:`dropbp.policy.schedule`): ``"constant"`` (only
            the warm-up), or rising from 0 over the first ``ramp`` of the run, ``"linear"``, ``"cosine"`` or
            ``"step"``, then held at the peak that keeps the mean: with the cut shape, a randomised
            progressive freezing from the bottom. A peak the pattern shape cannot take (a rate above 1) is
            refused. ``ctl.drop_schedule``."""
        ),
    )
    ramp: float = field(
        default=DEFAULT_RAMP,
        metadata=_help("The share of the run, in (0, 1], over which a rising ``drop_schedule`` rises; ``ctl.ramp``."),
    )
    stratify: int = field(
        default=1,
        metadata=_help(
            """Stratified cuts over each group of this many consecutive training forwards (set it to the
            gradient accumulation steps): the group's cut depths are one draw in each of ``stratify`` equal
            slices of [0, 1), in a random order, with a fresh offset every group, so every branch keeps its
            exact rate and a branch whose rate is at most ``1 - 1 / stratify`` is kept in at least one
            micro-batch of every optimizer step. 1: an independent draw per forward. Cut patterns only, not
            with a pattern pool (``max_patterns``, whose cycle is already stratified)."""
        ),
    )

    windows: tuple[int, int] | None = field(
        default=None,
        metadata=_help(
            """The run's optimizer-step windows, ``(training forwards per epoch, gradient accumulation steps)``,
            for epochs whose length is not a multiple of the accumulation (each ends with a short window): given,
            ``stratify`` groups and a pattern pool's cycle (``max_patterns``) start at every optimizer step, and a
            short window's stratified group has as many slices as it has forwards (:mod:`dropbp.policy.windows`).
            ``None``: windows of ``stratify`` forwards, the pool cycled by forward. ``ctl.windows``, saved in
            ``state_dict``.""",
            trainer="the run decides it: the dataloader's length and gradient_accumulation_steps",
        ),
    )

    token_drop_rate: float | str = field(
        default=0.0,
        metadata=_help(
            """The share of token rows whose backward each kept branch skips, in [0, 1): the gradient arriving at
            a kept branch's output keeps ``ceil((1 - rate) * rows)`` rows, drawn by ``token_selection`` and weighted
            by their inverse probability (an unbiased estimate of the branch's backward), and the branch's
            row-local linear maps run their backward on those rows only (:mod:`dropbp.execution.token_backward`).
            Composes with ``drop_rate``; 0: off, nothing changes. ``"auto"``: each branch's share chosen after
            every training forward from its measured gradient rows, the fewest rows whose added variance stays
            within a tenth of the rows' own (:mod:`dropbp.policy.token_selection`; every row until measured);
            ``ctl.token_drop_rate``, settable."""
        ),
    )
    token_selection: str = field(
        default="gradient",
        metadata=_help(
            """How token drops choose the rows: ``"gradient"`` (importance sampling: probability proportional to
            each row's gradient norm at the branch output, capped at 1), ``"residual"`` (proportional to the norm of
            the row the branch adds in the forward, TokenDrop's importance), ``"random"`` (the same probability for
            every row that carries gradient) or ``"cumulative"`` (the topmost kept branch's ``"gradient"`` rows and
            weights, kept by every branch below: TokenDrop's cumulative selection; biased, a measured control); see
            :mod:`dropbp.policy.token_selection`; ``ctl.token_selection``, settable."""
        ),
    )

    measure_noise_scale: bool = field(
        default=False,
        metadata=_help(
            """Measure the gradient noise scale of this run (``ctl.noise_scale()``, in tokens; logged by the Trainer
            callback as ``dropbp/noise_scale``) from the micro-batch gradients gradient accumulation computes anyway
            (:mod:`dropbp.execution.gradient_noise`): needs at least 2 micro-batches per optimizer step, costs one
            copy of the trainable parameters' gradients; averaged across ranks under DDP, refused under FSDP and
            DeepSpeed; ``ctl.measure_noise_scale``, settable."""
        ),
    )

    #: The value given to ``seed`` may be None (the Trainer integration: the run's own seed).
    _seed_may_be_none: ClassVar[bool] = False

    def __post_init__(self) -> None:
        key = _PREFIX.get().__add__
        if self.drop_rate != AUTO:
            self._rate(
                "drop_rate",
                "it is the fraction of the residual branches' backward passes skipped per step; set it to e.g. 0.5 "
                "(the paper uses 0.5 to 0.875), or 'auto' (chosen each step from the measured gradient noise scale)",
            )
        if self.seed is not None or not self._seed_may_be_none:
            check_int(key("seed"), self.seed, 0)
        if self.branches is not None:
            if not isinstance(self.branches, (list, tuple)):
                raise TypeError(f"{key('branches')} must be a list of module names, got {type(self.branches).__name__}")
            self._set("branches", tuple(self.branches))
        if self.max_patterns is not None:
            check_int(key("max_patterns"), self.max_patterns, 1)
        check_int(key("seq_len"), self.seq_len, 1)
        if not (self.backend is None or isinstance(self.backend, (str, Backend))):
            raise TypeError(f"{key('backend')} must be a name, a Backend or None, got {type(self.backend).__name__}")
        check_bool(key("unbiased"), self.unbiased)
        check_choice(key("dropped_grads"), self.dropped_grads, DROPPED_GRADS)
        check_int(key("warmup_steps"), self.warmup_steps, 0)
        check_choice(key("pattern"), self.pattern, tuple(SAMPLERS))
        chunked = self.chunked_loss
        if not (isinstance(chunked, bool) or (isinstance(chunked, int) and chunked >= 1)):
            raise ValueError(
                f"{key('chunked_loss')} must be False, True or a positive int (tokens per chunk), got {chunked!r}"
            )
        if self.memory_bound != "auto":
            check_bool(key("memory_bound"), self.memory_bound)
        if self.total_steps is not None:
            check_int(key("total_steps"), self.total_steps, 1)
        check_choice(key("drop_schedule"), self.drop_schedule, DROP_SCHEDULES)
        self._set("ramp", check_ramp(key("ramp"), self.ramp))
        check_int(key("stratify"), self.stratify, 1)
        if self.windows is not None:
            self._set("windows", _windows(key("windows"), self.windows))
        if self.token_drop_rate != AUTO:
            self._rate(
                "token_drop_rate",
                "it is the share of token rows whose backward each kept branch skips; set it to e.g. 0.5, 0 for none, "
                "or 'auto' (each branch's share chosen from its measured gradient rows)",
            )
        check_choice(key("token_selection"), self.token_selection, TOKEN_SELECTIONS)
        check_bool(key("measure_noise_scale"), self.measure_noise_scale)
        if self.stratify > 1 and (self.pattern != "cut" or self.max_patterns is not None):
            raise ValueError(
                f"{key('stratify')}={self.stratify} stratifies cut patterns drawn afresh each step: it needs "
                f"pattern='cut' (got {self.pattern!r}) and max_patterns=None (got {self.max_patterns!r}; a pattern "
                "pool's cycle is already stratified). Set stratify=1 or change those."
            )

    def _rate(self, name: str, meaning: str) -> None:
        """Check the rate ``name`` is in [0, 1) and store it as a float; the error says what it means."""
        try:
            self._set(name, check_fraction(_PREFIX.get() + name, getattr(self, name)))
        except (ValueError, TypeError) as error:  # a wrong value, or a string other than "auto"
            raise type(error)(f"{error}: {meaning}") from None

    def _set(self, name: str, value: Any) -> None:
        """Store a checked value in its normal form (a float for a number given as an int, a tuple of names)."""
        object.__setattr__(self, name, value)

    @classmethod
    def given(cls: type[_O], caller: str, **options: Any) -> _O:
        """The options ``caller`` was given as keywords; a name that is not an option is a TypeError saying
        which are."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        for name in options:
            if name not in names:
                known = ", ".join(f.name for f in option_fields(cls))
                raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}; its options are {known}")
            if not names[name].init:
                raise TypeError(f"{caller}() does not take {name}: {names[name].metadata['trainer']}")
        return cls(**options)

    @property
    def bounded(self) -> bool:
        """``memory_bound`` with ``"auto"`` resolved."""
        if self.memory_bound == "auto":
            return self.chunked_loss is not False or self.drop_rate >= AUTO_BOUND_RATE
        return bool(self.memory_bound)

    def resolved(self, backend: Backend, auto_rate: float = 0.0) -> DropBPOptions:
        """These options on ``backend`` with one meaning each: ``max_patterns=None`` is the backend's default bound,
        ``memory_bound="auto"`` is on or off for this drop rate, and ``drop_rate="auto"`` is ``auto_rate`` (the
        rate the noise scale chose) with the noise scale measured and no warm-up or time schedule. Every entry
        (``apply``, a setter, a loaded state) resolves the options as given, so no setter or state can lift a
        device's bound, and ``"auto"`` follows a later drop rate."""
        if self.drop_rate == AUTO:
            auto = {"drop_rate": auto_rate, "measure_noise_scale": True, "warmup_steps": 0}
            auto |= {"drop_schedule": "constant", "total_steps": None}
            return dataclasses.replace(self, **auto).resolved(backend)
        bound = backend.default_max_patterns if self.max_patterns is None else self.max_patterns
        if self.stratify > 1 and self.max_patterns is None and bound is not None:
            raise ValueError(
                f"stratify={self.stratify} cannot run on the {backend.name!r} backend: it compiles a graph per drop "
                f"pattern, so a run draws from a pool of at most {bound} patterns (its default max_patterns), whose "
                "cycle is already stratified; leave stratify=1 there"
            )
        return dataclasses.replace(self, backend=backend, max_patterns=bound, memory_bound=self.bounded)

    def for_apply(self, **overrides: Any) -> DropBPOptions:
        """These options as :func:`dropbp.apply`'s, with ``overrides`` (what a Trainer run decides)."""
        own = {f.name: getattr(self, f.name) for f in option_fields(DropBPOptions)}
        return DropBPOptions(**{**own, **overrides})


def _windows(name: str, value: object) -> tuple[int, int]:
    """``value`` as a ``(forwards per epoch, accumulation)`` pair of positive ints, or a TypeError naming it."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TypeError(
            f"{name} must be (training forwards per epoch, gradient accumulation steps), or None, got {value!r:.80}"
        )
    return check_int(f"{name}[0]", value[0], 1), check_int(f"{name}[1]", value[1], 1)


_O = TypeVar("_O", bound=DropBPOptions)


@dataclass(frozen=True)
class TrainerOptions(DropBPOptions):
    """The options of a Trainer run (``attach``, ``DropBPCallback``, the axolotl keys): ``apply``'s, less
    ``warmup_steps``, ``total_steps`` and ``windows`` (the run decides them), plus ``warmup`` and ``calibrate_at``."""

    drop_rate: float | str = field(default=0.5, metadata=DropBPOptions.__dataclass_fields__["drop_rate"].metadata)
    seed: int | None = field(
        default=None, metadata=_help("Fixes the patterns (as ``apply``'s); ``None``: the run's ``args.seed``.")
    )
    warmup_steps: int = field(
        default=0, init=False, metadata=DropBPOptions.__dataclass_fields__["warmup_steps"].metadata
    )
    total_steps: int | None = field(
        default=None, init=False, metadata=DropBPOptions.__dataclass_fields__["total_steps"].metadata
    )
    windows: tuple[int, int] | None = field(
        default=None, init=False, metadata=DropBPOptions.__dataclass_fields__["windows"].metadata
    )
    warmup: float | str = field(
        default="auto",
        metadata=_help(
            """Fraction of the training steps over which the rates rise from 0 (``apply``'s ``warmup_steps``);
            0 to drop from the first step. Knowing the run's length, the drop rate also gets its time schedule
            (``drop_schedule``): the run's mean drop rate, warm-up included, is ``drop_rate``, so what the
            warm-up leaves undropped is dropped later. ``"auto"``: 0.2 (``AUTO_WARMUP``, the best setting
            measured, docs/regime.md), shortened, with a warning, to the longest warm-up that keeps the
            mean where a high drop rate cannot (with the cut shape about 0.86 and above: the top branch is
            always kept). A number is taken as given, and refused when the rate cannot keep its mean."""
        ),
    )
    calibrate_at: float | str | None = field(
        default="auto",
        metadata=_help(
            """Fraction of the training steps at which sensitivities are measured and the rates allocated,
            uniform patterns only; ``"auto"``: 0.1 with ``pattern="uniform"`` (the paper), ``None`` (keep the
            shape's own rates) with ``"cut"``."""
        ),
    )

    _seed_may_be_none: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        key = _PREFIX.get().__add__
        if self.calibrate_at not in (None, "auto"):
            point = check_fraction(
                key("calibrate_at"), self.calibrate_at, what="a fraction of the training steps (or None)"
            )
            if self.pattern != "uniform":
                calibrate_at, pattern = key("calibrate_at"), key("pattern")
                raise ValueError(
                    f"{calibrate_at}={point} needs {pattern}='uniform': calibrated rates do not fall with depth, "
                    f"so {pattern}={self.pattern!r} cannot realise them; pass {pattern}='uniform' to calibrate, "
                    f"or {calibrate_at}=None"
                )
            self._set("calibrate_at", point)
        if self.warmup != "auto":
            fraction = check_fraction(key("warmup"), self.warmup, what='a fraction of the training steps (or "auto")')
            self._set("warmup", fraction)

    @property
    def calibration_point(self) -> float | None:
        """``calibrate_at`` with ``"auto"`` resolved: the fraction of the run at which to calibrate, or None."""
        if self.calibrate_at == "auto":
            return 0.1 if self.pattern == "uniform" else None
        return self.calibrate_at  # type: ignore[return-value]


def option_fields(cls: type[DropBPOptions]) -> list[dataclasses.Field]:
    """The fields of ``cls`` that its callers pass (not those a Trainer run decides), in declaration order."""
    return [f for f in dataclasses.fields(cls) if f.init]


@contextmanager
def named_as(prefix: str) -> Iterator[None]:
    """Error messages of the options made inside name every option ``prefix + name`` (axolotl's keys)."""
    token = _PREFIX.set(prefix)
    try:
        yield
    finally:
        _PREFIX.reset(token)


_F = TypeVar("_F", bound=Callable[..., Any])


def takes_options(cls: type[DropBPOptions]) -> Callable[[_F], _F]:
    """Give a function that takes ``**options`` the signature and docstring of every option of ``cls``.

    Its own parameters (``model, drop_rate`` of ``apply``) come first, as written; each other option
    becomes a keyword-only parameter with its default and type, documented from its help, so
    ``help(dropbp.apply)`` lists every option and a new field needs no edit here.
    """
    hints = get_type_hints(cls)

    def decorate(function: _F) -> _F:
        signature = inspect.signature(function)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        named = {p.name for p in own}
        extra = [
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
            for f in option_fields(cls)
            if f.name not in named
        ]
        function.__signature__ = signature.replace(parameters=[*own, *extra])  # type: ignore[attr-defined]
        lines = [f"\n    Options (:class:`dropbp.options.{cls.__name__}`; keywords, except where named above):"]
        for f in option_fields(cls):
            text = textwrap.fill(
                f"{f.name}: {f.metadata['help']}", 104, subsequent_indent="    ", break_on_hyphens=False
            )
            lines.append(textwrap.indent(text, "        "))
        function.__doc__ = (function.__doc__ or "").rstrip() + "\n" + "\n".join(lines) + "\n"
        return function

    return decorate
