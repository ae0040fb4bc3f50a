"""The options of ``dropbp.apply`` and of the Trainer integration, declared and validated once.

:class:`DropBPOptions` holds every keyword option of :func:`dropbp.apply` (the paper's DropBP and ``features``) and
nothing else; an older spelling is refused saying the way now (:func:`check_names`: 0.2's options that became features,
:data:`MOVED`; 0.3's experimental options, each now a feature whose class names it, ``Feature.replaces``; 0.3's
``seq_len`` and ``windows``, now internal, :data:`INTERNAL`). :class:`TrainerOptions` adds ``warmup``
and ``calibrate_at`` (fractions of the run) and leaves out ``warmup_steps`` and ``total_steps`` (the
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
from dropbp.checks import check_bool, check_choice, check_fraction, check_int, is_auto
from dropbp.features.base import Feature, feature_classes
from dropbp.policy.plugins import policy_plugins
from dropbp.policy.sampler import LARGEST_POOL
from dropbp.policy.shapes import get_shape, shape_names

__all__ = [
    "AUTO_WARMUP",
    "INTERNAL",
    "MOVED",
    "MOVED_MEMBERS",
    "DropBPOptions",
    "TrainerOptions",
    "check_names",
    "option_fields",
    "takes_options",
]

#: A Trainer run's warm-up by default (``warmup="auto"``), a fraction of its training steps.
AUTO_WARMUP = 0.2

#: 0.3's experimental options that are internal in 0.4, and what replaces each.
INTERNAL = {
    "seq_len": "it only weighed attention FLOPs by a typical length: dropbp.execution.discovery.flops_at_length(n) "
    "around apply does that",
    "windows": "the Trainer integration sets the run's optimizer-step windows: ctl.windows = (forwards per epoch, "
    "accumulation)",
}

#: 0.2's options that are features in 0.3, and how to ask for each.
MOVED = {
    "measure_noise_scale": "pass features=[dropbp.NoiseScale()] and read it with .estimate()",
    "chunked_loss": "pass features=[dropbp.ChunkedLoss()] (or ChunkedLoss(chunk_tokens=N))",
    "token_drop_rate": "pass features=[dropbp.experimental.TokenDrops(rate)] (not better: docs/token-drops.md)",
    "token_selection": "pass features=[dropbp.experimental.TokenDrops(rate, selection=...)]",
}

#: 0.2's controller members that went elsewhere, and the way now (``ctl.<name>`` read or set says it).
MOVED_MEMBERS = {
    "noise_scale": 'ctl.features["noise_scale"].estimate()',
    "measure_noise_scale": "ctl.replace_options(features=[dropbp.NoiseScale()])",
    "chunked_loss": 'ctl.features["chunked_loss"].chunk_tokens',
    "token_weights": 'ctl.features["token_drops"].weights()',
    "token_keep_shares": 'ctl.features["token_drops"].keep_shares()',
    "param_groups": "dropbp.experimental.param_groups(ctl, lr)",
    "update_param_groups": "dropbp.experimental.update_param_groups(ctl, optimizer)",
    "drop_rate_at": "ctl.schedule.drop_rate_at(step)",
    "mean_drop_rate": "ctl.schedule.mean_drop_rate(start, stop)",
    "longest_warmup": "ctl.schedule.longest_warmup(total_steps, up_to)",
    "pattern_plan": "ctl.schedule.patterns(optimizer_steps, micro_batches)",
    "max_kept_branches": "ctl.schedule.max_kept_branches",
    "drop_stats": "ctl.schedule.drop_stats()",
    "options_given": "ctl.options (those in force: ctl.schedule.options)",
}

# How error messages write an option's name: as it is for Python callers, "dropbp_{}" while the axolotl plugin checks
# its config keys, "state['{}']" while a checkpoint state's settings are checked (:func:`named_as`).
_NAMED: ContextVar[str] = ContextVar("dropbp_option_names", default="{}")


def _help(text: str, **more: Any) -> dict[str, Any]:
    return {"help": " ".join(text.split()), **more}


@dataclass(frozen=True)
class DropBPOptions:
    """The options of :func:`dropbp.apply`: the paper's DropBP, then ``features``; made, they are valid."""

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
            accumulation), counted like ``warmup_steps``. Given, the rates follow the run's time schedule (the
            warm-up, and a rise where a feature gives one) and are scaled so that the run's mean drop rate,
            warm-up included, is ``drop_rate`` (the compute it asks to save); without it, the rates stay as set
            after the warm-up.
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

    #: The value given to ``seed`` may be None (the Trainer integration: the run's own seed).
    _seed_may_be_none: ClassVar[bool] = False

    def __post_init__(self) -> None:
        key = _NAMED.get().format
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
        if self.max_patterns is not None and check_int(key("max_patterns"), self.max_patterns, 1) > LARGEST_POOL:
            raise ValueError(
                f"{key('max_patterns')}={self.max_patterns} is more than the {LARGEST_POOL} patterns a pool may hold "
                "(each is built and kept): a bound is for devices that compile a graph per pattern; "
                "max_patterns=None draws each step's pattern afresh, at no cost in memory"
            )
        if not (self.backend is None or isinstance(self.backend, (str, Backend))):
            raise TypeError(f"{key('backend')} must be a name, a Backend or None, got {type(self.backend).__name__}")
        check_int(key("warmup_steps"), self.warmup_steps, 0)
        check_choice(key("pattern"), self.pattern, shape_names())
        if not is_auto(self.memory_bound):
            check_bool(key("memory_bound"), self.memory_bound)
        if self.total_steps is not None:
            check_int(key("total_steps"), self.total_steps, 1)
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
        if self.follows_noise_scale and self.rate_chooser() is None:  # "auto" reads the measured noise scale
            self._set("features", (*self.features, next(c for c in feature_classes().values() if c.chooses_rate)()))
        policy_plugins(self.features)  # two rises or pattern draws are refused

    def _rate(self, name: str, meaning: str) -> None:
        """Check the rate ``name`` is in [0, 1) and store it as a float; the error says what it means."""
        try:
            self._set(name, check_fraction(_NAMED.get().format(name), getattr(self, name)))
        except (ValueError, TypeError) as error:  # a wrong value, or a string other than "auto"
            raise type(error)(f"{error}: {meaning}") from None

    def _set(self, name: str, value: Any) -> None:
        """Store a checked value in its normal form (a float for a number given as an int, a tuple of names)."""
        object.__setattr__(self, name, value)

    @classmethod
    def given(cls: type[_O], caller: str, **options: Any) -> _O:
        """The options ``caller`` was given as keywords; a name that is not an option is a TypeError saying which
        are, and an older spelling a TypeError saying the way now (:func:`check_names`)."""
        check_names(cls, caller, options)
        return cls(**options)

    @property
    def follows_noise_scale(self) -> bool:
        """``drop_rate="auto"``: the rate in force is the one the noise scale feature chooses
        (:func:`~dropbp.policy.drop_policy.in_force`)."""
        return is_auto(self.drop_rate)

    def on(self, backend: Backend) -> DropBPOptions:
        """These options on ``backend``: ``max_patterns=None`` is the device's default bound (a state saved on an
        unbounded device keeps this device's bound). The ``"auto"``s stay: the policy resolves them for the model's
        branches (:func:`dropbp.policy.drop_policy.in_force`), at every entry (``apply``, a setter, a loaded state, a
        measured step under ``"auto"``)."""
        bound = backend.default_max_patterns if self.max_patterns is None else self.max_patterns
        return dataclasses.replace(self, backend=backend, max_patterns=bound)

    def replaced(self, **change: Any) -> DropBPOptions:
        """``dataclasses.replace`` (the same checks), where the rate stays ``"auto"`` keeping the feature that chooses
        it (the noise scale measuring so far) if ``features`` leaves it out: a fresh one would start again from 0."""
        given, chooser = dataclasses.replace(self, **change), self.rate_chooser()
        if given.follows_noise_scale and chooser is not None and given.rate_chooser() is not chooser:
            if not any(f.chooses_rate for f in change.get("features", ())):
                given = dataclasses.replace(given, features=(*change["features"], chooser))
        return given

    def rate_chooser(self) -> Feature | None:
        """The feature that chooses ``drop_rate="auto"``'s rate (the noise scale: ``Feature.chooses_rate``), or
        None."""
        return policy_plugins(self.features).rate_choice

    def feature(self, key: str) -> Feature | None:
        """The feature of ``features`` with this key, or None."""
        return next((f for f in self.features if f.key == key), None)

    def apply_keywords(self, **overrides: Any) -> dict[str, Any]:
        """These options as :func:`dropbp.apply`'s keywords, with ``overrides`` (what a Trainer run decides)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(DropBPOptions)} | overrides


def moved(name: str) -> str | None:
    """Where an option of an earlier release went, as a sentence (None: ``name`` was no such option): 0.2's features
    (:data:`MOVED`), 0.3's experimental options (the registered feature that replaces each: ``Feature.replaces``) and
    0.3's internal ones (:data:`INTERNAL`)."""
    if name in MOVED:
        return f"(dropbp 0.3): it is a feature now, {MOVED[name]}"
    if name in INTERNAL:
        return f"(dropbp 0.4): {INTERNAL[name]}"
    for cls in feature_classes().values():
        if name in cls.replaces:
            return f"(dropbp 0.4): measured and not better, it is a feature now: {cls.replaces[name]}"
    return None


def moved_member(name: str) -> str | None:
    """Where a controller member of an earlier release went (:data:`MOVED_MEMBERS`), or an option (:func:`moved`),
    as a sentence; None: ``name`` was neither."""
    if name in MOVED_MEMBERS:
        return f"(dropbp 0.3): {MOVED_MEMBERS[name]}"
    return moved(name)


def check_names(cls: type[DropBPOptions], caller: str, names: Iterable[str]) -> None:
    """Raise a TypeError for a name of ``names`` that ``caller`` does not take: one that is not an option (saying which
    are), an older release's (saying the way now: :func:`moved`) or one a Trainer run decides."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        where = moved(name)
        if where is not None:
            raise TypeError(f"{caller}() no longer takes {name} {where}")
        if name not in fields:
            known = ", ".join(f.name for f in option_fields(cls))
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}; its options are {known}")
        if not fields[name].init:
            raise TypeError(f"{caller}() does not take {name}: {fields[name].metadata['trainer']}")


_O = TypeVar("_O", bound=DropBPOptions)


@dataclass(frozen=True)
class TrainerOptions(DropBPOptions):
    """The options of a Trainer run (``attach``, ``DropBPCallback``, the axolotl keys): ``apply``'s, less
    ``warmup_steps`` and ``total_steps`` (the run decides them), plus ``warmup`` and ``calibrate_at``."""

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
    warmup: float | str = field(
        default="auto",
        metadata=_help(
            """Fraction of the training steps over which the rates rise from 0 (``apply``'s ``warmup_steps``);
            0 to drop from the first step. Knowing the run's length, the drop rate also gets its time schedule:
            the run's mean drop rate, warm-up included, is ``drop_rate``, so what the
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
        key = _NAMED.get().format
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


def option_fields(cls: type[DropBPOptions]) -> list[dataclasses.Field]:
    """The fields of ``cls`` that its callers pass (not those a Trainer run decides), in declaration order."""
    return [f for f in dataclasses.fields(cls) if f.init]


@contextmanager
def named_as(form: str) -> Iterator[None]:
    """Error messages of the options made inside name every option ``form.format(name)`` (``"dropbp_{}"``: axolotl's
    keys; ``"state[{!r}]"``: a checkpoint state's fields)."""
    token = _NAMED.set(form)
    try:
        yield
    finally:
        _NAMED.reset(token)


_F = TypeVar("_F", bound=Callable[..., Any])


def takes_options(cls: type[DropBPOptions]) -> Callable[[_F], _F]:
    """Give a function that takes ``**options`` the signature and docstring of every option of ``cls``.

    Its own parameters (``model, drop_rate`` of ``apply``) come first, as written; each other option
    becomes a keyword-only parameter with its default and type, documented from its help, so
    ``help(dropbp.apply)`` lists every option and a new field needs no edit here.
    """
    hints = get_type_hints(cls)
    fields = option_fields(cls)

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
