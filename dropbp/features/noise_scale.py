"""The noise scale feature (:class:`NoiseScale`): the run's gradient noise scale, and the rate of ``drop_rate="auto"``.

It reads each micro-batch's gradient from what gradient accumulation computes anyway, or, with one micro-batch a step,
chunks of that step's tokens at the output layer (:mod:`dropbp.features.gradient_noise`), and feeds the estimator of
:mod:`dropbp.policy.noise_scale`; ``estimate()``
gives ``B_simple`` in tokens. With ``drop_rate="auto"`` (which adds this feature where none is given) it owns that
``"auto"``: after each measured optimizer step it chooses the rate the noise scale forecasts best
(:func:`dropbp.policy.noise_scale.auto_drop_rate`) and asks the controller to resolve its options again.
:func:`noise_scale_forecast` says what a measured noise scale forecasts for each way to train.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from dropbp.checks import Once, check_fraction, check_int, check_number
from dropbp.features.base import Feature, register_feature
from dropbp.features.gradient_noise import MicroBatchGradients, WithinStep, check_reads
from dropbp.features.host import Host
from dropbp.policy.noise_scale import (
    AUTO_RATES,
    AUTO_REMEASURE_EVERY,
    DEFAULT_BRANCH_SHARE,
    ArmForecast,
    NoiseScaleEstimator,
    NoiseScaleReading,
    auto_drop_rate,
    forecast_arms,
)
from dropbp.policy.shapes import DropShape, get_shape

__all__ = ["NoiseScale", "noise_scale_arms", "noise_scale_forecast"]

#: The keys of the feature's state (the estimator's, :meth:`dropbp.policy.noise_scale.NoiseScaleEstimator.state_dict`).
STATE_KEYS = ("steps", "gradient", "trace", "tokens_per_step")


@register_feature
class NoiseScale(Feature):
    """Measure the gradient noise scale of this run from the micro-batch gradients gradient accumulation computes
    anyway (costs one copy of the trainable parameters' gradients and one host read per optimizer step); with one
    micro-batch a step (one long document), from 8 chunks of its tokens at the output layer's input, the last hidden
    layer's noise (:meth:`one_micro_batch` says where that cannot be read). Averaged across ranks under DDP, refused
    under FSDP and DeepSpeed. Logged by the Trainer callback as ``dropbp/noise_scale``; resumes with the controller's
    state."""

    key = "noise_scale"
    chooses_rate = True

    def __init__(self) -> None:
        super().__init__()
        self._estimator = NoiseScaleEstimator()
        self._chosen: tuple[tuple[int, str, int], float] | None = None  # rate()'s last answer, by what it read
        self._unread = 0  # optimizer steps closed since the last one read (their branches dropped)
        self._dropping = Once(
            "dropbp: the noise scale is not read from optimizer steps that drop a branch's backward: a dropped branch "
            "leaves every earlier layer's gradient short of its path, so no micro-batch's gradient is a sample of the "
            "full one. It is read from the steps that drop nothing (drop_rate='auto' runs one step in "
            f"{AUTO_REMEASURE_EVERY} at rate 0 for it) or, with one micro-batch a step, from within the step. "
            "Said once."
        )
        self._was_attached = False

    @classmethod
    def from_flat(cls, settings: dict[str, Any]) -> NoiseScale | None:
        return cls() if settings.pop("measure_noise_scale", False) else None

    def check(self, model: nn.Module, framework: bool) -> None:
        check_reads(model, framework)

    def attach(self, host: Host) -> None:
        super().attach(host)
        self._was_attached = True
        self._part = MicroBatchGradients(
            host.model,
            self._estimator,
            lambda: host.hooks.forced is None,
            on_step=self._follow,
            dropped=lambda: host.hooks.dropped,
        )
        self._part.install()

    def one_micro_batch(self) -> str | None:
        """None where a step of one micro-batch is read from within (the output layer's chunks), else why not."""
        if WithinStep.head(self.host.model) is None:
            return "the model has no output layer that get_output_embeddings() returns"
        return None

    def estimate(self) -> NoiseScaleReading | None:
        """The noise scale measured so far (``.tokens`` is ``B_simple``), or None before the first optimizer step has
        closed (a step closes when the next one's first forward finds the gradients
        cleared). Still readable once removed; a feature never attached (or loaded) has measured nothing: raises."""
        if not (self._part or self._estimator.steps or self._was_attached):
            raise RuntimeError(
                "this NoiseScale measures nothing until attached: dropbp.apply(model, rate, features=[noise]) or "
                "ctl.replace_options(features=[noise])"
            )
        return self._estimator.estimate()

    def choose_rate(self, shape: DropShape, flops: Sequence[float]) -> float:
        """``drop_rate="auto"`` resolved: the rate the noise scale measured so far forecasts best
        (:func:`dropbp.policy.noise_scale.auto_drop_rate`: 0 until measured) among those the drop ``shape`` reaches
        over branches of these costs (:meth:`~dropbp.policy.shapes.DropShape.reaches`); worked out once per measured
        step. 0 for one step after :data:`~dropbp.policy.noise_scale.AUTO_REMEASURE_EVERY` - 1 that could not be read
        (they dropped): a step that drops nothing is measured."""
        measured = self._estimator.estimate()
        if measured is None or self._unread >= AUTO_REMEASURE_EVERY - 1:
            return 0.0
        key = (measured.steps, shape.name, tuple(flops))
        if self._chosen is None or self._chosen[0] != key:
            rates = tuple(p for p in AUTO_RATES if shape.reaches(flops, p))
            self._chosen = key, auto_drop_rate(measured, rates=rates)
        return self._chosen[1]

    def _follow(self, outcome: str) -> None:
        """After each optimizer step (``outcome``: :class:`MicroBatchGradients`'s): under ``drop_rate="auto"``, where
        the noise scale now forecasts another rate, or a step must be measured, the controller resolves its options
        again (that rate from the next pattern on); at a given rate, a step left out for its drops is said once."""
        self._unread = 0 if outcome == "read" else self._unread + 1
        given = self.host.given()
        if not given.follows_noise_scale:
            if outcome == "dropped":
                self._dropping()
            return
        chosen = self.choose_rate(get_shape(given.pattern), [b.flops for b in self.host.branches])
        if chosen != self.host.in_force().drop_rate:
            self.host.resolve_again()

    def handles(self) -> list[RemovableHandle]:
        return [] if self._part is None else self._part.handles

    def modules(self) -> list[nn.Module]:
        return [] if self._part is None else self._part.modules

    def flush(self) -> None:
        """Close the optimizer step under way now (the run ended, or the caller knows a step just finished)."""
        if self._part is not None:
            self._part.flush()

    def state_dict(self) -> dict[str, Any]:
        return self._estimator.state_dict()

    def check_state(self, state: Any) -> None:
        if not isinstance(state, dict) or sorted(state) != sorted(STATE_KEYS):
            raise ValueError(f"state['noise_scale'] must be a dict of {', '.join(STATE_KEYS)}, got {state!r:.80}")
        check_int("state['noise_scale']['steps']", state["steps"], 0)
        for name in STATE_KEYS[1:]:
            check_number(f"state['noise_scale'][{name!r}]", state[name])

    def load_state_dict(self, state: Any) -> None:  # attached or not: the controller loads it before it resolves
        self._estimator.load_state_dict(state)
        self._chosen = None

    def logs(self) -> dict[str, float]:
        measured = self.estimate()
        return {} if measured is None else {"noise_scale": measured.tokens, "noise_ratio": measured.ratio}

    def __repr__(self) -> str:
        measured = self._estimator.estimate() if (self._part or self._estimator.steps or self._was_attached) else None
        return f"NoiseScale(estimate={measured})"


def noise_scale_arms(
    measured: NoiseScaleReading, drop_rate: float, branch_share: float = DEFAULT_BRANCH_SHARE
) -> list[ArmForecast]:
    """The arms :func:`noise_scale_forecast` forecasts: branch drops at ``drop_rate``, 0.5 and 0.75, then full
    backprop at half the batch. ``branch_share``: the branches' share of a step's time (default: the measured cost
    record's, :data:`dropbp.policy.noise_scale.DEFAULT_BRANCH_SHARE`; ``dropbp check`` measures the user's own)."""
    share = branch_share
    rates = tuple(dict.fromkeys(r for r in (check_fraction("drop_rate", drop_rate), 0.5, 0.75) if r > 0))
    return forecast_arms(measured.tokens, measured.tokens_per_step, share, rates)


def noise_scale_forecast(
    measured: NoiseScaleReading, drop_rate: float, branch_share: float = DEFAULT_BRANCH_SHARE
) -> str:
    """One message: the noise scale, the tokens per step and, per arm (:func:`noise_scale_arms`), the forecast step
    worth and speedup at equal quality."""
    arms = noise_scale_arms(measured, drop_rate, branch_share)
    best = max(arms, key=lambda a: a.speedup)
    listed = "; ".join(
        f"{a.name}: {a.speedup:.2f}x (a step worth {a.worth:.2f} of a full one at {a.step_cost:.2f} of its time)"
        for a in arms
    )
    regime = "mostly noise" if measured.ratio > 1 else "mostly signal"
    return (
        f"dropbp: gradient noise scale {measured.tokens:,.0f} tokens over {measured.steps} optimizer steps, at "
        f"{measured.tokens_per_step:,.0f} tokens per step (ratio {measured.ratio:.2f}: a step's gradient is "
        f"{regime}). Forecast speedup at equal quality against full backprop at this batch - {listed}. Best "
        f"forecast: {best.name}. A model of McCandlish et al. 2018 (docs/noise-scale.md), not a measurement."
    )
