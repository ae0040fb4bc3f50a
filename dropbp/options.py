"""The options of ``dropbp.apply`` and of the Trainer integration, declared and validated once.

:class:`DropBPOptions` holds every keyword option of :func:`dropbp.apply` (the paper's DropBP and ``features``), then
the :data:`EXPERIMENTAL` ones that only ``dropbp.experimental.apply`` takes; :data:`MOVED` says where 0.2's
options went. :class:`TrainerOptions` adds ``warmup``
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, get_type_hints

from dropbp.architectures import BERT_BRANCHES
from dropbp.backends import Backend
from dropbp.checks import check_bool, check_choice, check_fraction, check_int, check_ramp
from dropbp.execution.dropped_grads import DEFAULT_DROPPED_GRADS, DROPPED_GRADS
from dropbp.features.base import Feature
from dropbp.features.noise_scale import NoiseScale
from dropbp.policy.schedule import DEFAULT_RAMP, DROP_SCHEDULES
from dropbp.policy.shapes import CutShape, get_shape, shape_names

#: ``memory_bound="auto"`` turns the bound on from this drop rate (or with a feature that buys memory).
AUTO_BOUND_RATE = 0.75

__all__ = [
    "AUTO",
    "AUTO_BOUND_RATE",
    "AUTO_WARMUP",
    "EXPERIMENTAL",
    "MOVED",
    "DropBPOptions",
    "TrainerOptions",
    "check_names",
    "is_auto",
    "option_fields",
    "takes_options",
]

#: ``drop_rate="auto"``: the rate chosen each optimizer step from the measured gradient noise scale.
AUTO = "auto"

#: A Trainer run's warm-up by default (``warmup="auto"``), a fraction of its training steps.
AUTO_WARMUP = 0.2

#: The options measured and not better, out of ``apply``'s signature (``dropbp.experimental.apply`` takes them),
#: each with the record that says so.
EXPERIMENTAL = {
    "unbiased": "benchmarks/results/convergence_levers_lora_pydoc.md",
    "dropped_grads": "benchmarks/results/convergence_levers_lora_pydoc.md",
    "drop_schedule": "benchmarks/results/convergence_time-schedules_lora_pydoc_accumulate.md",
    "ramp": "benchmarks/results/convergence_time-schedules_lora_pydoc_accumulate.md",
    "stratify": "docs/where-it-pays.md, 'Stratified cuts'",
    "seq_len": "it only weighs attention FLOPs by a typical length",
    "windows": "the Trainer integration sets it from the run",
}

#: 0.2's options that are features in 0.3, and how to ask for each.
MOVED = {
    "measure_noise_scale": "pass features=[dropbp.NoiseScale()] and read it with .estimate()",
    "chunked_loss": "pass features=[dropbp.ChunkedLoss()] (or ChunkedLoss(chunk_tokens=N))",
    "token_drop_rate": "pass features=[dropbp.experimental.TokenDrops(rate)] (not better: docs/token-drops.md)",
    "token_selection": "pass features=[dropbp.experimental.TokenDrops(rate, selection=...)]",
}

# What goes before every option's name in error messages: "" for Python callers, "dropbp_" while the
# axolotl plugin checks its config keys (:func:`named_as`).
_PREFIX: ContextVar[str] = ContextVar("dropbp_option_prefix", default="")


def is_auto(value: object) -> bool:
    """Whether an option that takes ``"auto"`` was given it (each option resolves its own ``"auto"`` in one property:
    :attr:`DropBPOptions.follows_noise_scale`, :meth:`DropBPOptions.resolved`, :attr:`TrainerOptions.calibration_point`,
    :attr:`TrainerOptions.warmup_fraction`)."""
    return isinstance(value, str) and value == AUTO


def _help(text: str, **more: Any) -> dict[str, Any]:
    return {"help": " ".join(text.split()), **more}


@dataclass(frozen=True)
class DropBPOptions:
    """The options of :func:`dropbp.apply` (the paper's DropBP, then ``features``) and, after them, the experimental
    ones (:data:`EXPERIMENTAL`: ``dropbp.experimental.apply`` takes them); made, they are valid."""

    drop_rate: float | str = field(
        metadata=_help(
            """The FLOP-weighted mean drop probability of the branches, in [0, 1): with the cut shape, spread
            over the depth; with the uniform shape, every branch's (``calibrate`` or ``set_rates`` can make
            them differ); ``ctl.drop_rate``. ``"auto"``: each optimizer step's rate chosen from the gradient
            noise scale measured so far (the :class:`dropbp.NoiseScale` feature, added if not given: 0 until one
            is measured, and wherever dropping is forecast to lose; needs gradient accumulation of at least 2); it
            replaces the warm-up and time schedule; ``ctl.drop_rate`` then reads the rate in force."""
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
    backend: str | Backend | None = field(
        default=None,
        metadata=_help(
            """A backend name or instance (default :func:`dropbp.backends.get`: ``DROPBP_BACKEND``, else
            detected); ``ctl.backend``, whose step boundaries :meth:`DropBPController.backward` and
            :meth:`DropBPController.optimizer_step` place."""
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
    max_patterns: int | None = field(
        default=None,
        metadata=_help(
            """Bound on distinct patterns (for compiled graphs); ``None``: the backend's default (a bound on
            lazily compiled devices)."""
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
    memory_bound: bool | str = field(
        default="auto",
        metadata=_help(
            """Bound the activation memory at every step (:mod:`dropbp.execution.bound`): a step that keeps more
            branches
            than the uniform shape keeps at most at ``drop_rate`` (``N - floor(drop_rate x N)``) runs the layers
            of its lowest kept branches checkpointed, so the activations stored for backward are bounded in every
            step, with exact gradients (docs/memory.md: what it does to the measured peak).
            ``"auto"``: on where memory is what the settings buy (a feature that buys memory,
            :class:`dropbp.ChunkedLoss`, or ``drop_rate`` of 0.75 and above), off otherwise; ``ctl.memory_bound``,
            settable (True or False)."""
        ),
    )
    features: Sequence[Feature] = field(
        default=(),
        metadata=_help(
            """Capabilities beyond the paper's DropBP, each one object that owns its options, state and log
            (:mod:`dropbp.features`): :class:`dropbp.NoiseScale` (the gradient noise scale, and what
            ``drop_rate="auto"`` reads), :class:`dropbp.ChunkedLoss` (the LM head and loss in chunks) and, measured
            and not better, :class:`dropbp.experimental.TokenDrops`; ``ctl.features`` by key. One object per
            model."""
        ),
    )

    # -- experimental: measured and not better (EXPERIMENTAL), out of apply's signature ------------------------
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
    seq_len: int = field(
        default=512, metadata=_help("The typical sequence length, used only to weigh attention FLOPs.")
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

    #: The value given to ``seed`` may be None (the Trainer integration: the run's own seed).
    _seed_may_be_none: ClassVar[bool] = False

    def __post_init__(self) -> None:
        key = _PREFIX.get().__add__
        if not is_auto(self.drop_rate):
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
        check_choice(key("pattern"), self.pattern, shape_names())
        if not is_auto(self.memory_bound):
            check_bool(key("memory_bound"), self.memory_bound)
        if self.total_steps is not None:
            check_int(key("total_steps"), self.total_steps, 1)
        check_choice(key("drop_schedule"), self.drop_schedule, DROP_SCHEDULES)
        self._set("ramp", check_ramp(key("ramp"), self.ramp))
        check_int(key("stratify"), self.stratify, 1)
        if self.windows is not None:
            self._set("windows", _windows(key("windows"), self.windows))
        features = self.features
        if not isinstance(features, (list, tuple)) or not all(isinstance(f, Feature) for f in features):
            raise TypeError(
                f"{key('features')} must be a list of dropbp features (dropbp.NoiseScale(), dropbp.ChunkedLoss(), "
                f"dropbp.experimental.TokenDrops(...)), got {features!r:.80}"
            )
        keys = [f.key for f in features]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{key('features')} holds two features of one kind ({sorted(keys)}): give each once")
        self._set("features", tuple(features))
        if self.follows_noise_scale and self.feature(NoiseScale.key) is None:  # "auto" reads the measured noise scale
            self._set("features", (*self.features, NoiseScale()))
        if self.stratify > 1 and (not isinstance(get_shape(self.pattern), CutShape) or self.max_patterns is not None):
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
    def given(cls: type[_O], caller: str, experimental: bool = False, **options: Any) -> _O:
        """The options ``caller`` was given as keywords; a name that is not an option is a TypeError saying which
        are, and one that moved (0.2's spelling) a TypeError saying where it went. ``experimental``: the caller
        takes :data:`EXPERIMENTAL` (``dropbp.experimental.apply``)."""
        check_names(cls, caller, options, experimental)
        return cls(**options)

    @property
    def follows_noise_scale(self) -> bool:
        """``drop_rate="auto"``: the rate in force is the one the noise scale feature chooses (:meth:`resolved`)."""
        return is_auto(self.drop_rate)

    def resolved(self, backend: Backend, flops: Sequence[float]) -> DropBPOptions:
        """These options on ``backend``, for a model whose branches cost ``flops``, with one meaning each:
        ``max_patterns=None`` is the backend's default bound, ``memory_bound="auto"`` is on or off for this drop rate
        and these features, and ``drop_rate="auto"`` is the rate the noise scale feature now chooses
        (:meth:`dropbp.NoiseScale.rate`), with no warm-up or time schedule. Every entry (``apply``, a setter, a
        loaded state, a measured step under ``"auto"``) resolves the options as given, so no setter or state can lift
        a device's bound, and ``"auto"`` follows a later drop rate."""
        if self.follows_noise_scale:
            rate = self.feature(NoiseScale.key).rate(get_shape(self.pattern), flops)
            auto = {"drop_rate": rate, "warmup_steps": 0, "drop_schedule": "constant", "total_steps": None}
            return dataclasses.replace(self, **auto).resolved(backend, flops)
        bound = backend.default_max_patterns if self.max_patterns is None else self.max_patterns
        if self.stratify > 1 and self.max_patterns is None and bound is not None:
            raise ValueError(
                f"stratify={self.stratify} cannot run on the {backend.name!r} backend: it compiles a graph per drop "
                f"pattern, so a run draws from a pool of at most {bound} patterns (its default max_patterns), whose "
                "cycle is already stratified; leave stratify=1 there"
            )
        memory_bound = self.memory_bound
        if is_auto(memory_bound):
            memory_bound = any(f.bounds_memory for f in self.features) or self.drop_rate >= AUTO_BOUND_RATE
        return dataclasses.replace(self, backend=backend, max_patterns=bound, memory_bound=bool(memory_bound))

    def feature(self, key: str) -> Feature | None:
        """The feature of ``features`` with this key, or None."""
        return next((f for f in self.features if f.key == key), None)

    def for_apply(self, **overrides: Any) -> DropBPOptions:
        """These options as :func:`dropbp.apply`'s (the experimental ones included), with ``overrides`` (what a
        Trainer run decides)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(DropBPOptions)}
        return DropBPOptions(**{**own, **overrides})


def check_names(cls: type[DropBPOptions], caller: str, names: Iterable[str], experimental: bool = False) -> None:
    """Raise a TypeError for a name of ``names`` that ``caller`` does not take: one that is not an option (saying which
    are), one that moved (0.2's spelling: saying where it went), an experimental one where ``experimental`` is False
    (:data:`EXPERIMENTAL`) or one a Trainer run decides."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        if name in MOVED:
            raise TypeError(f"{caller}() no longer takes {name} (dropbp 0.3): it is a feature now, {MOVED[name]}")
        if name in EXPERIMENTAL and not experimental:
            raise TypeError(
                f"{caller}() no longer takes {name} (dropbp 0.3): measured and not better ({EXPERIMENTAL[name]}), it "
                f"moved to dropbp.experimental.apply(model, drop_rate, {name}=...)"
            )
        if name not in fields:
            known = ", ".join(f.name for f in option_fields(cls))
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}; its options are {known}")
        if not fields[name].init:
            raise TypeError(f"{caller}() does not take {name}: {fields[name].metadata['trainer']}")


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
        if self.calibrate_at is not None and not is_auto(self.calibrate_at):
            point = check_fraction(
                key("calibrate_at"), self.calibrate_at, what="a fraction of the training steps (or None)"
            )
            if not get_shape(self.pattern).calibrates:
                calibrate_at, pattern = key("calibrate_at"), key("pattern")
                takes = [name for name in shape_names() if get_shape(name).calibrates]
                raise ValueError(
                    f"{calibrate_at}={point} needs {pattern}={' or '.join(map(repr, takes))} (a shape calibration "
                    f"allocates for): {pattern}={self.pattern!r} cannot realise calibrated rates (a cut's must fall "
                    f"with depth); pass {pattern}={takes[0]!r} to calibrate, or {calibrate_at}=None"
                )
            self._set("calibrate_at", point)
        if not is_auto(self.warmup):
            fraction = check_fraction(key("warmup"), self.warmup, what='a fraction of the training steps (or "auto")')
            self._set("warmup", fraction)

    @property
    def calibration_point(self) -> float | None:
        """``calibrate_at`` with ``"auto"`` resolved: the fraction of the run at which to calibrate, or None."""
        if is_auto(self.calibrate_at):
            return 0.1 if get_shape(self.pattern).calibrates else None
        return self.calibrate_at  # type: ignore[return-value]

    @property
    def warmup_fraction(self) -> float | None:
        """``warmup`` as a fraction of the training steps; None for ``"auto"`` (:data:`AUTO_WARMUP`, which the
        Trainer integration shortens where the drop rate cannot keep its mean)."""
        return None if is_auto(self.warmup) else self.warmup  # type: ignore[return-value]


def option_fields(cls: type[DropBPOptions], experimental: bool = False) -> list[dataclasses.Field]:
    """The fields of ``cls`` that its callers pass (not those a Trainer run decides), in declaration order: the
    product's, or with ``experimental`` only :data:`EXPERIMENTAL`'s."""
    return [f for f in dataclasses.fields(cls) if f.init and (f.name in EXPERIMENTAL) == experimental]


@contextmanager
def named_as(prefix: str) -> Iterator[None]:
    """Error messages of the options made inside name every option ``prefix + name`` (axolotl's keys)."""
    token = _PREFIX.set(prefix)
    try:
        yield
    finally:
        _PREFIX.reset(token)


_F = TypeVar("_F", bound=Callable[..., Any])


def takes_options(cls: type[DropBPOptions], experimental: bool = False) -> Callable[[_F], _F]:
    """Give a function that takes ``**options`` the signature and docstring of every option of ``cls``.

    Its own parameters (``model, drop_rate`` of ``apply``) come first, as written; each other option
    becomes a keyword-only parameter with its default and type, documented from its help, so
    ``help(dropbp.apply)`` lists every option and a new field needs no edit here. ``experimental``: then the
    :data:`EXPERIMENTAL` options too (``dropbp.experimental.apply``).
    """
    hints = get_type_hints(cls)
    fields = option_fields(cls) + (option_fields(cls, experimental=True) if experimental else [])

    def decorate(function: _F) -> _F:
        signature = inspect.signature(function)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        named = {p.name for p in own}
        extra = [
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
            for f in fields
            if f.name not in named
        ]
        function.__signature__ = signature.replace(parameters=[*own, *extra])  # type: ignore[attr-defined]
        lines = [f"\n    Options (:class:`dropbp.options.{cls.__name__}`; keywords, except where named above):"]
        for f in fields:
            text = textwrap.fill(
                f"{f.name}: {f.metadata['help']}", 104, subsequent_indent="    ", break_on_hyphens=False
            )
            lines.append(textwrap.indent(text, "        "))
        function.__doc__ = (function.__doc__ or "").rstrip() + "\n" + "\n".join(lines) + "\n"
        return function

    return decorate
