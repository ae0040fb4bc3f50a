"""Train several configurations of one model side by side and compare loss against wall time.

Every configuration trains its own copy of the same starting model on the same batches with the same learning rate,
in LOCKSTEP: each step, every run takes one training step, in rotating order. Time is counted per run (its own
training steps, plus its calibration), so a busy, shared machine slows every run alike and the ratios hold (see
shared/measuring.md). Validation is not timed. ``accumulation`` micro-batches per optimizer step (a pattern each)
and ``lr_schedule="cosine"`` (:func:`lr_factor`) give the regime people fine-tune in, each run's schedule over its
own number of steps. Used by ``dropbp demo`` and by ``benchmarks/convergence.py``; the regime: docs/regime.md.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate, pairwise

import torch
from torch import nn

from dropbp import experimental
from dropbp.backends import Backend
from dropbp.controller import DropBPController
from dropbp.options import AUTO_WARMUP
from dropbp.policy.allocation import cut_cap, cut_rates
from dropbp.tools.arms import apply_arm as apply
from dropbp.tools.device_tools import tools_for
from dropbp.tools.frontier import equal_quality_speedup
from dropbp.tools.textdata import TokenData

__all__ = [
    "Run",
    "RunResult",
    "run_options",
    "compare",
    "lockstep_timed",
    "with_timed_tails",
    "loss_at_time",
    "summarise",
    "time_to_target",
    "equal_quality",
]


WARMUP_FRACTION = AUTO_WARMUP  # a run's drop-rate warm-up, as the Trainer integration's default
ANNEAL_FRACTION = 0.2
#: The learning rate's linear warm-up, as a share of each run's own optimizer steps (``lr_schedule="cosine"``).
LR_WARMUP_FRACTION = 0.1
LR_SCHEDULES = ("constant", "cosine")


def lr_factor(step: int, steps: int, schedule: str, warmup_fraction: float = LR_WARMUP_FRACTION) -> float:
    """The learning rate's multiplier at optimizer step ``step`` of a run of ``steps`` steps.

    ``"cosine"`` is ``transformers.get_cosine_schedule_with_warmup`` (half a cycle): a linear rise from 0
    over the first ``warmup_fraction`` of the steps, then a cosine decay to 0 at ``steps``.
    """
    if schedule == "constant":
        return 1.0
    warmup = round(warmup_fraction * steps)
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, steps - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def anneal_factor(step: int, total_steps: int, fraction: float) -> float:
    """The factor on every rate at ``step`` when the rates fall linearly to 0 over the last ``fraction``.

    Args:
        step: the optimizer step, counted from 0.
        total_steps: the run's length in steps.
        fraction: the share of the run, at its end, over which the rates fall.
    """
    return min(1.0, (total_steps - step) / (fraction * total_steps))


@dataclass(frozen=True)
class Run:
    """One configuration. ``drop_rate=None`` is the baseline: the model without the library."""

    name: str
    drop_rate: float | None = None
    calibrate: bool = False  # sensitivity-based rates at ``calibrate_at`` of training
    unbiased: bool = False  # scale kept branches' incoming gradient by 1 / (1 - rate)
    lr_compensation: bool = False  # branch parameters get lr / (1 - rate)
    dropped_grads: str = "skip"  # what the optimizer sees for dropped branches (dropbp.experimental.DroppedGradFill)
    # "warmup": rates rise from 0 over the first 20% of the baseline's steps (apply's warmup_steps);
    # "anneal": they fall to 0 over the last 20% of the run's steps.
    schedule: str | None = None
    lr: float | None = None  # overrides compare()'s lr (a learning-rate sweep of the baseline)
    # apply()'s pattern shape: "uniform" (the paper) or "cut" (apply's default); runs recorded before
    # the shape existed were uniform, hence this default
    pattern: str = "uniform"
    # Controls of the pattern study (rates set after apply, from the branches' FLOPs):
    # "cut-marginals": the cut shape's rates, drawn with the uniform shape (rate profile without nesting);
    # "frozen-bottom": the branches below the drop rate's FLOP fraction always dropped (partial fine-tuning);
    # "cut-capped": cuts whose rates are capped at (1 + p) / 2 (the bottom still trains sometimes; the
    # same as pattern="cut", whose default this became); "cut-uncapped": cuts with no cap (rates up to 1).
    rates: str | None = None
    # apply()'s drop_schedule and ramp over the run's own training forwards (its steps x accumulation),
    # given as total_steps; "constant" with schedule="warmup" keeps the mean rate at drop_rate too.
    drop_schedule: str | None = None
    ramp: float = 0.5
    # Overrides of compare()'s regime for this run (a control row of the old regime: 1 and "constant").
    accumulation: int | None = None
    lr_schedule: str | None = None
    steps: int | None = None  # overrides the run's number of optimizer steps
    max_patterns: int | None = None  # apply()'s pattern bound (a lazy-graph device's pool, on the CPU)
    stratified: bool = False  # apply()'s stratify= the run's micro-batches per optimizer step (stratified cuts)
    token_drop_rate: float | str = 0.0  # apply()'s token drops (with drop_rate=0.0: token drops alone)
    token_selection: str = "gradient"
    measure_noise_scale: bool = False  # apply()'s noise-scale reads: RunResult.noise_scale per optimizer step


@dataclass
class RunResult:
    run: Run
    step_seconds: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_seconds: list[float] = field(default_factory=list)  # training wall time when evaluated
    val_loss: list[float] = field(default_factory=list)
    calibration_seconds: float = 0.0
    rates: list[float] = field(default_factory=list)
    # per optimizer step, the mean fraction of branch FLOPs its micro-batches dropped (0 for full backprop)
    dropped_fractions: list[float] = field(default_factory=list)
    # per optimizer step, ctl.noise_scale() after it (tokens; None before one is measured) where the run measures it
    noise_scale: list[float | None] = field(default_factory=list)
    # per optimizer step with token drops, the share of its last micro-batch's token rows that the kept branches'
    # selections kept, over those branches (ctl.token_weights())
    kept_token_shares: list[float] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict) -> RunResult:
        """The inverse of :meth:`to_dict` (for re-summarising recorded runs)."""
        fields = (
            "step_seconds",
            "eval_steps",
            "eval_seconds",
            "val_loss",
            "calibration_seconds",
            "rates",
            "dropped_fractions",
            "noise_scale",
            "kept_token_shares",
        )
        return cls(Run(**data["config"]), **{k: data[k] for k in fields if k in data})

    def to_dict(self) -> dict:
        return {
            "name": self.run.name,
            "config": self.run.__dict__,
            "step_seconds": self.step_seconds,
            "median_step_seconds": statistics.median(self.step_seconds) if self.step_seconds else None,
            "eval_steps": self.eval_steps,
            "eval_seconds": self.eval_seconds,
            "val_loss": self.val_loss,
            "calibration_seconds": self.calibration_seconds,
            "rates": self.rates,
            "dropped_fractions": self.dropped_fractions,
            "noise_scale": self.noise_scale,
            "kept_token_shares": self.kept_token_shares,
        }


def control_rates(kind: str, flops: Sequence[float], drop_rate: float) -> list[float]:
    """The per-branch rates of a pattern-study control (see :class:`Run`), FLOP-weighted mean ``drop_rate``
    (the uniform shape refuses rate 1, so "cut-marginals" caps at 0.99 and may fall a little short)."""
    if kind == "cut-marginals":
        return [min(r, 0.99) for r in cut_rates(flops, drop_rate, max_rate=1.0)]
    if kind == "cut-capped":
        return cut_rates(flops, drop_rate, max_rate=cut_cap(drop_rate))
    if kind == "cut-uncapped":
        return cut_rates(flops, drop_rate, max_rate=1.0)
    if kind == "frozen-bottom":
        total, below, rates = sum(flops), 0.0, []
        for f in flops:
            rates.append(1.0 if below + f / 2 < drop_rate * total else 0.0)
            below += f
        rates[-1] = 0.0
        return rates
    raise ValueError(f"rates must be 'cut-marginals', 'cut-capped', 'cut-uncapped' or 'frozen-bottom', got {kind!r}")


_CUT_SHAPED_CONTROLS = ("frozen-bottom", "cut-capped", "cut-uncapped")


def run_options(run: Run, baseline_steps: int, own_steps: int, accumulation: int) -> dict:
    """``dropbp.apply``'s keyword options for a DropBP run (``drop_rate``, seed and backend aside).

    Without a time schedule, warm-up lasts a share of the baseline's optimizer steps (as in the runs
    recorded before time schedules); with one, of the run's own training forwards (its steps times
    ``accumulation``), which are also its ``total_steps``.
    """
    own = run.drop_schedule is not None
    forwards = own_steps * accumulation if own else baseline_steps
    return {
        "unbiased": run.unbiased,
        "dropped_grads": run.dropped_grads,
        "warmup_steps": round(WARMUP_FRACTION * forwards) if run.schedule == "warmup" else 0,
        "pattern": "cut" if run.rates in _CUT_SHAPED_CONTROLS else run.pattern,
        "total_steps": forwards if own else None,
        "drop_schedule": run.drop_schedule or "constant",
        "ramp": run.ramp,
        "max_patterns": run.max_patterns,
        "stratify": accumulation if run.stratified else 1,
        "token_drop_rate": run.token_drop_rate,
        "token_selection": run.token_selection,
        "measure_noise_scale": run.measure_noise_scale,
    }


class _Trainee:
    """A run's model copy, optimizer and (for DropBP runs) controller."""

    def __init__(
        self,
        run: Run,
        model: nn.Module,
        lr: float,
        backend: Backend,
        seed: int,
        seq_len: int,
        steps: int,
        regime: _Regime,
    ):
        if run.schedule not in (None, "warmup", "anneal"):
            raise ValueError(f"schedule must be 'warmup' or 'anneal', got {run.schedule!r}")
        self.run = run
        lr = run.lr if run.lr is not None else lr
        self.model = model
        self.backend = backend
        self.training_autocast = tools_for(backend).training_autocast
        self.accumulation = run.accumulation or regime.accumulation
        self.lr_schedule = run.lr_schedule or regime.lr_schedule
        self.ctl: DropBPController | None = None
        if run.drop_rate is not None:
            options = run_options(run, steps, regime.own_steps, self.accumulation)
            self.ctl = apply(model, run.drop_rate, seed=seed, seq_len=seq_len, backend=backend, **options)
            if run.rates is not None:
                self.ctl.set_rates(control_rates(run.rates, [b.flops for b in self.ctl.branches], run.drop_rate))
        if self.ctl is not None and run.lr_compensation:
            groups = experimental.param_groups(self.ctl, lr)
        else:
            groups = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(groups, lr=lr, weight_decay=regime.weight_decay)
        self.base_lrs = [g["lr"] for g in self.opt.param_groups]
        self.result = RunResult(run)
        self.elapsed = 0.0
        self.base_rates = self.ctl.rates if self.ctl is not None else []

    def train_step(self, ids: torch.Tensor, step: int, limit: int) -> None:
        """One optimizer step on ``ids``, split into ``accumulation`` micro-batches (a pattern each)."""
        self.backend.synchronize()
        start = time.perf_counter()
        if self.run.schedule == "anneal":
            factor = anneal_factor(step, limit, ANNEAL_FRACTION)
            self.ctl.set_rates([r * factor for r in self.base_rates])
        scale = lr_factor(step, limit, self.lr_schedule)
        for group, base in zip(self.opt.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * scale
        for micro in ids.chunk(self.accumulation):
            # Accelerators train in their autocast dtype; the CPU stays in float32 (bf16 is slower there).
            with self.training_autocast():
                loss = self.model(input_ids=micro, labels=micro).loss / self.accumulation
            if self.ctl is not None:
                self.ctl.backward(loss)
            else:
                loss.backward()
        if self.ctl is not None:
            self.ctl.optimizer_step(self.opt)
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.backend.synchronize()
        seconds = time.perf_counter() - start
        self.result.step_seconds.append(seconds)
        self.result.dropped_fractions.append(
            self.ctl.schedule.drop_stats()["dropped_flops_fraction"] if self.ctl is not None else 0.0
        )
        self.elapsed += seconds
        selections = (
            self.ctl.features["token_drops"].weights() if self.ctl is not None and self.run.token_drop_rate else {}
        )
        if selections:
            kept = torch.stack([(w > 0).float().mean() for w in selections.values()]).mean()  # one host read
            self.result.kept_token_shares.append(float(kept))
        if self.run.measure_noise_scale:
            measured = self.ctl.features["noise_scale"].estimate()
            self.result.noise_scale.append(None if measured is None else measured.tokens)

    def calibrate(self, ids: torch.Tensor) -> None:
        self.backend.synchronize()
        start = time.perf_counter()
        if self.run.schedule == "anneal":
            self.ctl.set_rates(self.base_rates)  # calibrate at the full drop rate
        self.ctl.calibrate(lambda: self.model(input_ids=ids, labels=ids).loss)
        self.base_rates = self.ctl.rates
        if self.run.lr_compensation:
            experimental.update_param_groups(self.ctl, self.opt)
        self.backend.synchronize()
        self.result.calibration_seconds = time.perf_counter() - start
        self.elapsed += self.result.calibration_seconds

    @torch.no_grad()
    def evaluate(self, step: int, batches: Sequence[torch.Tensor]) -> float:
        self.model.eval()
        losses = [float(self.model(input_ids=b, labels=b).loss) for b in batches]
        self.model.train()
        loss = sum(losses) / len(losses)
        self.result.eval_steps.append(step)
        self.result.eval_seconds.append(self.elapsed)
        self.result.val_loss.append(loss)
        return loss


@dataclass(frozen=True)
class _Regime:
    """How every run trains unless it overrides it: see :func:`compare`."""

    accumulation: int
    lr_schedule: str
    weight_decay: float
    own_steps: int  # the run's own number of optimizer steps


def compare(
    model: nn.Module,
    runs: Sequence[Run],
    data: TokenData,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    backend: Backend,
    eval_every: int,
    calibrate_at: float = 0.1,
    seed: int = 0,
    dropbp_steps: int | None = None,
    progress: Callable[[int, dict[str, float]], None] | None = None,
    accumulation: int = 1,
    lr_schedule: str = "constant",
    weight_decay: float = 0.0,
    on_evaluation: Callable[[list[RunResult]], None] | None = None,
) -> list[RunResult]:
    """Train a copy of ``model`` per run, in lockstep, and return their timings and curves.

    The baseline trains ``steps`` steps; DropBP runs train ``dropbp_steps`` (default: as many), so
    that a run which needs more, cheaper steps to reach the baseline's final loss can show it; a run's
    own ``Run.steps`` overrides either. Each optimizer step takes ``batch_size`` sequences, as
    ``accumulation`` micro-batches (a training forward, and a drop pattern, each); its learning rate
    follows ``lr_schedule`` over the run's own steps (:func:`lr_factor`); AdamW's ``weight_decay``.
    ``on_evaluation`` gets the results so far after every step that evaluated a run, so that a long
    comparison which is stopped keeps what it measured.
    """
    if not runs:
        raise ValueError("compare needs at least one run")
    if lr_schedule not in LR_SCHEDULES or any(r.lr_schedule not in (None, *LR_SCHEDULES) for r in runs):
        raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}")
    for size in [accumulation, *(r.accumulation for r in runs if r.accumulation is not None)]:
        if size < 1 or batch_size % size:
            raise ValueError(f"accumulation {size} must be at least 1 and divide batch_size {batch_size}")
    seq_len = data.train.shape[1]
    limit = {r.name: r.steps or (steps if r.drop_rate is None else (dropbp_steps or steps)) for r in runs}
    trainees = [
        _Trainee(
            r,
            copy.deepcopy(model).to(backend.device).train(),
            lr,
            backend,
            seed,
            seq_len,
            steps,
            _Regime(accumulation, lr_schedule, weight_decay, limit[r.name]),
        )
        for r in runs
    ]
    val = [b.to(backend.device) for b in data.val_batches(batch_size)]
    total = max(limit.values())
    calibration_step = int(calibrate_at * steps)
    latest: dict[str, float] = {}
    for t in trainees:
        latest[t.run.name] = t.evaluate(0, val)
    for step in range(total):
        ids = data.train_batch(step, batch_size, seed).to(backend.device)
        active = [t for t in trainees if step < limit[t.run.name]]
        shift = step % len(active)
        for t in active[shift:] + active[:shift]:
            if t.run.calibrate and step == calibration_step:
                t.calibrate(ids)
            t.train_step(ids, step, limit[t.run.name])
        evaluated = [t for t in active if (step + 1) % eval_every == 0 or step + 1 in (steps, limit[t.run.name])]
        for t in evaluated:
            latest[t.run.name] = t.evaluate(step + 1, val)
        if evaluated and on_evaluation is not None:
            on_evaluation([t.result for t in trainees])
        if progress is not None:
            progress(step + 1, latest)
    for t in trainees:
        t.result.rates = t.base_rates  # before any schedule scaled them
    return [t.result for t in trainees]


def time_to_target(result: RunResult, target: float) -> float | None:
    """Training wall time at which validation loss first reaches ``target`` (linear between
    evaluations), or None if it never does."""
    points = list(zip(result.eval_seconds, result.val_loss, strict=True))
    if not points:
        return None
    if points[0][1] <= target:
        return points[0][0]
    for (t0, l0), (t1, l1) in pairwise(points):
        if l1 <= target:  # l0 > target >= l1
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def loss_at_time(result: RunResult, seconds: float) -> float | None:
    """Validation loss after ``seconds`` of training (linear between evaluations), or None if the run
    trained for less time than that."""
    points = list(zip(result.eval_seconds, result.val_loss, strict=True))
    for (t0, l0), (t1, l1) in pairwise(points):
        if t0 <= seconds <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (seconds - t0) / (t1 - t0)
    return None


def _loss_at_equal_time(result: RunResult, seconds: float) -> float | None:
    """:func:`loss_at_time`, or the run's final loss when it trained for less time than ``seconds``
    (a run whose own schedule ended earlier: its loss had less time, never more)."""
    if result.eval_seconds and result.eval_seconds[-1] < seconds:
        return result.val_loss[-1]
    return loss_at_time(result, seconds)


def _loss_at(result: RunResult, step: int) -> float | None:
    return dict(zip(result.eval_steps, result.val_loss, strict=True)).get(step)


# The first step of every run allocates buffers and warms caches: it is not a typical step.
_TIMED_FROM = 1
# A baseline whose step times spread wider than this (10th to 90th percentile, relative to the
# median) ran on a machine too busy for its step times to be compared: every step does the same work.
UNRELIABLE_SPREAD = 0.5


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _timed(result: RunResult) -> list[float]:
    return result.step_seconds[_TIMED_FROM:] or result.step_seconds


def timing_verdict(baseline_seconds: Sequence[float]) -> dict:
    """Whether step times can be trusted, from the spread of the baseline's own step times.

    Full backprop does the same work every step, so on a quiet machine its step times agree
    closely; another process taking the cores shows up as outliers there. Returns the spread
    (10th-90th percentile over the median) and, when it exceeds :data:`UNRELIABLE_SPREAD`, a warning
    that says the speedups (and times to target) are not to be trusted. Used by ``dropbp demo`` and
    ``dropbp bench``.
    """
    times = sorted(baseline_seconds)
    if len(times) < 3:
        spread = 0.0
    else:
        low, high = times[round(0.1 * (len(times) - 1))], times[round(0.9 * (len(times) - 1))]
        spread = (high - low) / statistics.median(times)
    reliable = spread <= UNRELIABLE_SPREAD
    warning = None
    if not reliable:
        warning = (
            f"UNRELIABLE TIMING: full backprop's step times spread {spread:.0%} around their median "
            f"({min(times):.2f}-{max(times):.2f} s; the limit is {UNRELIABLE_SPREAD:.0%}): something else used "
            "this machine's cores. Step speedups and times to target are not to be trusted; run again on a "
            "quiet machine."
        )
    return {"baseline_spread": spread, "reliable": reliable, "warning": warning}


def timing_check(results: list[RunResult]) -> dict:
    """:func:`timing_verdict` of a comparison's baseline (``results[0]``), its first step left out."""
    return timing_verdict(_timed(results[0]))


#: The share of the baseline's steps, at their end, whose step times stand for a longer run's tail.
TAIL_WINDOW = 0.2


def steady_from(run: Run, baseline_steps: int, own_steps: int) -> int | None:
    """The first optimizer step from which ``run``'s drop rates stop moving, or None if they move until its end
    (an anneal). A warm-up ends within its share of the run (of the baseline's forwards without a time schedule,
    which are at most as many optimizer steps); a time schedule's rise within its ``ramp`` of the run's own."""
    if run.drop_rate is None:
        return 0
    if run.schedule == "anneal":
        return None
    moving = WARMUP_FRACTION if run.schedule == "warmup" else 0.0
    if run.drop_schedule not in (None, "constant"):
        moving = max(moving, run.ramp)
    return math.ceil(moving * (own_steps if run.drop_schedule is not None else baseline_steps))


def lockstep_timed(result: RunResult, baseline_steps: int) -> RunResult:
    """``result`` with each step past the baseline's last timed as the run's own steps were in lockstep.

    Lockstep cancels the machine's load only while the runs take turns: a run given more steps than the
    baseline trains its tail alone, while other processes on a shared machine may start or stop, so its
    measured tail can be faster or slower than its lockstep steps for reasons of its own. Each tail step is
    given the median of the run's step times over the last :data:`TAIL_WINDOW` of the shared steps, and its
    evaluation times move with them. That holds when its rates no longer move there (a warm-up or a rise that
    ended before the window, :func:`steady_from`); otherwise, and for runs no longer than the baseline, the
    result is returned as measured."""
    steps = len(result.step_seconds)
    start = max(_TIMED_FROM, baseline_steps - max(1, round(TAIL_WINDOW * baseline_steps)))
    steady = steady_from(result.run, baseline_steps, steps)
    if steps <= baseline_steps or steady is None or steady > start:
        return result
    typical = statistics.median(result.step_seconds[start:baseline_steps])
    seconds = result.step_seconds[:baseline_steps] + [typical] * (steps - baseline_steps)
    shift = [0.0, *(m - t for m, t in zip(accumulate(result.step_seconds), accumulate(seconds), strict=True))]
    eval_seconds = [at - shift[step] for step, at in zip(result.eval_steps, result.eval_seconds, strict=True)]
    return replace(result, step_seconds=seconds, eval_seconds=eval_seconds)


def with_timed_tails(results: Sequence[RunResult]) -> list[RunResult]:
    """Every run of a comparison (``results[0]`` is the baseline) with its tail timed by :func:`lockstep_timed`."""
    base = results[0]
    return [base, *(lockstep_timed(r, len(base.step_seconds)) for r in results[1:])]


def summarise(results: list[RunResult], steps: int) -> list[dict]:
    """Per run: median step time, step speedup, validation loss at the baseline's last step
    (``steps``) and at the baseline's training time, and the time to reach the baseline's final loss
    as a ratio to the time the baseline itself first reached it (``results[0]`` is the baseline).

    Step times leave out each run's first step (warm-up). The step speedup is the median over the
    steps both ran of the baseline's step time over the run's: the runs take turns within each step
    (lockstep), so a slow spell of the machine hits both sides of most ratios, and the median of
    ratios, unlike the ratio of medians, cancels it (as ``dropbp bench`` does). A run's steps past the
    baseline's are timed as its last lockstep steps (:func:`lockstep_timed`; ``tail_timed`` counts them).
    """
    base = results[0]
    timed = with_timed_tails(results)
    target = base.val_loss[-1]
    base_reached = time_to_target(base, target)  # may come before its last step if the curve dips
    rows = []
    for measured, r in zip(results, timed, strict=True):
        pairs = list(zip(base.step_seconds, r.step_seconds, strict=False))[_TIMED_FROM:]
        reached = time_to_target(r, target)
        rows.append(
            {
                "run": r.run.name,
                "step_s": _median(_timed(r)),
                "step_speedup": _median([b / x for b, x in pairs]) if pairs else float("nan"),
                "val_loss_at_equal_steps": _loss_at(r, steps),
                "val_loss_at_equal_time": _loss_at_equal_time(r, base.eval_seconds[-1]),
                # equal time read the other way: full backprop's loss when this run's training ended
                "baseline_val_loss_at_run_end": loss_at_time(base, r.eval_seconds[-1]),
                "final_val_loss": r.val_loss[-1],
                "steps": len(r.step_seconds),
                "train_s": sum(r.step_seconds) + r.calibration_seconds,
                "time_to_target_s": reached,
                "time_to_target_speedup": None if not reached else base_reached / reached,  # 0: started below
                "tail_timed": 0 if r is measured else len(r.step_seconds) - len(base.step_seconds),
            }
        )
    return rows


def equal_quality(results: Sequence[RunResult]) -> list[dict]:
    """Per DropBP run, its speedup at equal quality (:mod:`dropbp.tools.frontier`) against the frontier of the
    full-backprop runs among ``results`` (complete runs at 2 or more budgets, ``results[0]`` one of them), each run
    read at its own end, tails timed as in :func:`with_timed_tails`."""
    timed = with_timed_tails(results)
    baseline = [(r.eval_seconds[-1], r.val_loss[-1]) for r in timed if r.run.drop_rate is None]
    rows = []
    for r in timed:
        if r.run.drop_rate is None:
            continue
        reading = equal_quality_speedup(baseline, r.eval_seconds[-1], r.val_loss[-1])
        rows.append(
            {
                "run": r.run.name,
                "steps": len(r.step_seconds),
                "train_s": r.eval_seconds[-1],
                "final_val_loss": r.val_loss[-1],
                "speedup": reading.value,
                "bound": reading.bound,
            }
        )
    return rows
