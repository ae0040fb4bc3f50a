"""The gradient noise scale and what it forecasts for dropped backward work: numbers only.

The simple noise scale (McCandlish et al. 2018, "An empirical model of large-batch training") is
``B_simple = tr(Sigma) / |G|^2``: the per-token gradient covariance's trace over the true gradient's squared norm, in
tokens. It is estimated from one optimizer step's ``m`` micro-batch gradients ``G_b,i`` (``b`` tokens each) and their
mean ``G_B`` (``B = m b`` tokens), both unbiased:

    |G|^2     ~ (B |G_B|^2 - b mean_i |G_b,i|^2) / (B - b)
    tr(Sigma) ~ (mean_i |G_b,i|^2 - |G_B|^2) / (1/b - 1/B)

Each is averaged over steps (exponentially, :class:`NoiseScaleEstimator`) before dividing: one step's ``|G|^2`` is
noisy and may be negative. A uniform factor on every gradient (a loss divided by the accumulation or not) cancels.

What it forecasts (:func:`step_worth`): a step that keeps a random share ``q`` of its gradient samples has an effective
batch ``q B`` and, with ``r = B_simple / B``, is worth ``(1 + r) / (1 + r / q)`` of a full step (the expected loss
decrease of an SGD step at its best learning rate, by the same paper's model). A branch dropped at rate ``p`` keeps
``q = 1 - p`` of the samples in its parameters' gradients; full backprop at half the batch keeps ``q = 1/2`` at half
the cost. The speedup at equal quality is the worth over the step's cost relative to a full step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "AUTO_MIN_STEPS",
    "AUTO_RATES",
    "AUTO_REMEASURE_EVERY",
    "ArmForecast",
    "DEFAULT_BRANCH_SHARE",
    "NoiseScaleReading",
    "NoiseScaleEstimator",
    "auto_drop_rate",
    "forecast_arms",
    "step_worth",
    "window_terms",
]

#: Optimizer steps measured before ``drop_rate="auto"`` drops anything (one step's estimate is too noisy to act on).
AUTO_MIN_STEPS = 4
#: ``drop_rate="auto"`` runs one optimizer step in this many at rate 0 while it drops: a step that drops a branch's
#: backward cannot be read (:mod:`dropbp.features.gradient_noise`), and the noise scale grows as a fine-tune goes on.
AUTO_REMEASURE_EVERY = 8
#: The rates ``drop_rate="auto"`` chooses from (few, so that a lazy-graph device meets few patterns).
AUTO_RATES = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75)
#: The branches' share of a step's time ``drop_rate="auto"`` assumes: the map's cost record's (SmolLM2-135M full
#: fine-tuning on the CPU; the shipped map carries it, and a test holds the two equal).
DEFAULT_BRANCH_SHARE = 0.534


@dataclass(frozen=True)
class NoiseScaleReading:
    """One reading of the gradient noise scale (what ``dropbp.NoiseScale().estimate()`` returns; the feature is the
    measuring, this the measured).

    Attributes:
        tokens: ``B_simple`` in tokens (``inf`` where the true gradient's estimate is not yet positive).
        gradient_sq_norm: the smoothed estimate of ``|G|^2``.
        trace: the smoothed estimate of ``tr(Sigma)`` (per token).
        tokens_per_step: the tokens of the last measured optimizer step (``B``).
        steps: how many optimizer steps were measured.
    """

    tokens: float
    gradient_sq_norm: float
    trace: float
    tokens_per_step: float
    steps: int

    @property
    def ratio(self) -> float:
        """``r = B_simple / B``: above 1, a step's gradient is mostly noise."""
        return self.tokens / self.tokens_per_step


def window_terms(
    micro_sq_norms: Sequence[float], batch_sq_norm: float, micro_tokens: float | Sequence[float]
) -> tuple[float, float]:
    """One optimizer step's unbiased ``(|G|^2, tr(Sigma))`` from its micro-batches' squared gradient norms (each the
    gradient of its own mean loss), the squared norm of their mean and the tokens of a micro-batch: one number for
    all, or one per micro-batch (the module docstring's formulas, with ``1/b`` the mean of the micro-batches' ``1/b_i``
    where they differ: ``E|G_i|^2 = |G|^2 + tr/b_i`` and ``E|mean G_i|^2 = |G|^2 + mean(tr/b_i)/m``).

    Raises:
        ValueError: with fewer than two micro-batches (one gives no spread) or no tokens.
    """
    m = len(micro_sq_norms)
    if m < 2:
        raise ValueError(f"the noise scale needs at least 2 micro-batches per optimizer step, got {m}")
    sizes = [float(micro_tokens)] * m if isinstance(micro_tokens, int | float) else [float(t) for t in micro_tokens]
    if len(sizes) != m or min(sizes) <= 0:
        raise ValueError(f"micro-batches must hold tokens, one count for all or one each, got {micro_tokens}")
    inverse = sum(1.0 / b for b in sizes) / m  # 1/b for equal micro-batches
    mean_small = sum(micro_sq_norms) / m
    trace = (mean_small - batch_sq_norm) / (inverse * (1.0 - 1.0 / m))
    gradient = batch_sq_norm - trace * inverse / m
    return gradient, trace


class NoiseScaleEstimator:
    """Each term averaged exponentially over optimizer steps (``smoothing``: the weight of the past), then divided.

    The average is bias-corrected (as Adam's moments are), so the first steps are not pulled toward 0.
    """

    def __init__(self, smoothing: float = 0.9) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.smoothing = smoothing
        self.steps = 0
        self._gradient = 0.0
        self._trace = 0.0
        self._tokens_per_step = 0.0

    def update(self, micro_sq_norms: Sequence[float], batch_sq_norm: float, micro_tokens: float) -> None:
        """Add one optimizer step (see :func:`window_terms`)."""
        gradient, trace = window_terms(micro_sq_norms, batch_sq_norm, micro_tokens)
        self.add(gradient, trace, micro_tokens * len(micro_sq_norms))

    def add(self, gradient: float, trace: float, tokens_per_step: float) -> None:
        """Add one optimizer step's terms (:func:`window_terms`'s; averaged over ranks where several read)."""
        keep = self.smoothing
        self._gradient = keep * self._gradient + (1 - keep) * gradient
        self._trace = keep * self._trace + (1 - keep) * trace
        self._tokens_per_step = float(tokens_per_step)
        self.steps += 1

    def estimate(self) -> NoiseScaleReading | None:
        """The current estimate, or None before the first measured step."""
        if not self.steps:
            return None
        correction = 1.0 - self.smoothing**self.steps
        gradient, trace = self._gradient / correction, self._trace / correction
        tokens = trace / gradient if gradient > 0 else math.inf
        return NoiseScaleReading(tokens, gradient, trace, self._tokens_per_step, self.steps)

    def state_dict(self) -> dict[str, float]:
        gradient, trace, tokens_per_step = self._gradient, self._trace, self._tokens_per_step
        return {"steps": self.steps, "gradient": gradient, "trace": trace, "tokens_per_step": tokens_per_step}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.steps = int(state["steps"])
        self._gradient, self._trace = float(state["gradient"]), float(state["trace"])
        self._tokens_per_step = float(state["tokens_per_step"])


def step_worth(kept_share: float, noise_ratio: float) -> float:
    """The worth of a step whose gradient keeps a random ``kept_share`` of its samples, in full steps, at
    ``noise_ratio = B_simple / B``: ``(1 + r) / (1 + r / q)`` (the module docstring)."""
    if not 0.0 < kept_share <= 1.0:
        raise ValueError(f"kept_share must be in (0, 1], got {kept_share}")
    if noise_ratio < 0:
        raise ValueError(f"noise_ratio must be >= 0, got {noise_ratio}")
    if math.isinf(noise_ratio):
        return kept_share
    return (1.0 + noise_ratio) / (1.0 + noise_ratio / kept_share)


@dataclass(frozen=True)
class ArmForecast:
    """What the noise scale forecasts for one way to train: a step's cost and worth, relative to a full step."""

    name: str
    step_cost: float
    worth: float

    @property
    def speedup(self) -> float:
        """The speedup at equal quality against full backprop at the run's batch: worth per cost."""
        return self.worth / self.step_cost


def forecast_arms(
    noise_tokens: float, tokens_per_step: float, branch_share: float, drop_rates: Sequence[float] = (0.5, 0.75)
) -> list[ArmForecast]:
    """Branch drops at each of ``drop_rates`` and full backprop at half the batch, at ``noise_tokens`` (``B_simple``)
    and ``tokens_per_step``.

    ``branch_share`` is the share of a full step's time the dropped branches' backward takes (a step dropping a
    share ``p`` of them costs ``1 - p * branch_share``; ``dropbp bench`` measures it per device and model); full
    backprop at half the batch costs half a step. Token drops are not forecast here: their worth depends on the
    concentration of the row gradient norms too.
    """
    if not 0.0 < branch_share < 1.0:
        raise ValueError(f"branch_share must be in (0, 1), got {branch_share}")
    if tokens_per_step <= 0:
        raise ValueError(f"tokens_per_step must be positive, got {tokens_per_step}")
    ratio = noise_tokens / tokens_per_step
    arms = [
        ArmForecast(f"branch drops at {p:g}", 1.0 - p * branch_share, step_worth(1.0 - p, ratio)) for p in drop_rates
    ]
    return [*arms, ArmForecast("full backprop at half the batch", 0.5, step_worth(0.5, ratio))]


def auto_drop_rate(
    measured: NoiseScaleReading | None, branch_share: float = DEFAULT_BRANCH_SHARE, rates: Sequence[float] = AUTO_RATES
) -> float:
    """``drop_rate="auto"``: the rate of ``rates`` whose forecast worth per unit of time, ``step_worth(1 - p, r) /
    (1 - p * branch_share)``, is highest (the lowest such rate on a tie); 0 before anything is measured. A drop pays
    by this model only while ``r < branch_share * (1 - p) / (1 - branch_share)``: while a step's tokens are well
    above the noise scale, so early in a fine-tune, whose noise scale grows. 0 until :data:`AUTO_MIN_STEPS` steps
    are measured."""
    if measured is None or measured.steps < AUTO_MIN_STEPS:
        return 0.0

    def value(p: float) -> float:
        return step_worth(1.0 - p, measured.ratio) / (1.0 - p * branch_share)

    return max(sorted(rates), key=lambda p: (round(value(p), 12), -p))
