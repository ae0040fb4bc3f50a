"""The gradient noise scale (the ``dropbp.NoiseScale`` feature, ``.estimate()``): the estimator against an analytic
value, the library's reads against the same estimator fed gradients computed apart, and what it refuses."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import batch, tiny_model

import dropbp
from dropbp.policy.noise_scale import NoiseScaleEstimator, step_worth, window_terms


def test_the_estimator_finds_a_linear_regressions_analytic_noise_scale():
    """Least squares with x ~ N(0, I_D), y = x.w* + e (e ~ N(0, s^2)), at w: a sample's gradient (x.d - e) x with
    d = w - w* has mean d and covariance |d|^2 I + d d^T + s^2 I, so B_simple = (|d|^2 (D + 1) + s^2 D) / |d|^2."""
    g = torch.Generator().manual_seed(0)
    dims, noise, micro, m = 8, 0.5, 16, 4
    d = torch.randn(dims, generator=g, dtype=torch.float64) * 0.3
    truth = (d.pow(2).sum() * (dims + 1) + noise**2 * dims) / d.pow(2).sum()
    estimator = NoiseScaleEstimator(smoothing=0.999)
    for _ in range(3000):
        x = torch.randn(m, micro, dims, generator=g, dtype=torch.float64)
        e = torch.randn(m, micro, generator=g, dtype=torch.float64) * noise
        per_sample = ((x @ d) - e).unsqueeze(-1) * x
        micro_means = per_sample.mean(1)
        estimator.update(micro_means.pow(2).sum(1).tolist(), float(micro_means.mean(0).pow(2).sum()), micro)
    got = estimator.estimate()
    assert got is not None and got.steps == 3000 and got.tokens_per_step == micro * m
    assert abs(got.tokens / float(truth) - 1) < 0.10


def _train(
    model, ctl, steps: int, m: int, seed: int = 0, set_to_none: bool = True, evaluate: bool = False, late: bool = False
):
    """``steps`` optimizer steps of ``m`` micro-batches (each loss divided by ``m``, as Trainer does); returns the
    reference's estimator, fed each step's micro-batch gradients computed apart (``torch.autograd.grad`` on a clean
    copy of the model, no accumulation). ``late``: each step's ``zero_grad`` after its first forward, before that
    forward's backward (``forward -> zero_grad -> backward``)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reference = NoiseScaleEstimator()
    for step in range(steps):
        ids = [batch(seed * 1000 + step * m + k, size=2, length=12) for k in range(m)]
        plain = copy.deepcopy(model)
        if plain.is_gradient_checkpointing:
            plain.gradient_checkpointing_disable()  # .grad refuses re-entrant checkpoints; the same gradients
        params = [p for p in plain.parameters() if p.requires_grad]
        micro = [torch.autograd.grad(plain(input_ids=x, labels=x).loss / m, params) for x in ids]
        total = [sum(parts) for parts in zip(*micro, strict=True)]
        squares = [sum(float(t.double().pow(2).sum()) for t in grads) * m * m for grads in micro]
        if m > 1:
            reference.update(squares, sum(float(t.double().pow(2).sum()) for t in total), ids[0].numel())
        if not late:
            optimizer.zero_grad(set_to_none=set_to_none)
        for k, x in enumerate(ids):
            loss = model(input_ids=x, labels=x).loss / m
            if late and k == 0:
                optimizer.zero_grad(set_to_none=set_to_none)
            loss.backward()
            if evaluate and k == 0:
                model.eval()
                with torch.no_grad():
                    model(input_ids=x)
                model.train()
        optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    model(input_ids=ids[0], labels=ids[0])  # the next step's first forward closes the last one
    return reference


@pytest.mark.parametrize(
    "variant",
    [{}, {"set_to_none": False}, {"evaluate": True}, {"checkpointing": True}],
    ids=["plain", "zeros", "eval-between", "reentrant-ckpt"],
)
def test_noise_scale_equals_the_estimator_fed_gradients_computed_apart(variant):
    model = tiny_model("llama", layers=2)
    if variant.pop("checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    ctl = dropbp.apply(model, 0.0, features=[dropbp.NoiseScale()])
    reference = _train(model, ctl, steps=3, m=3, **variant)
    got, want = ctl.features["noise_scale"].estimate(), reference.estimate()
    assert got.steps == want.steps == 3 and got.tokens_per_step == want.tokens_per_step == 72
    assert math.isclose(got.gradient_sq_norm, want.gradient_sq_norm, rel_tol=1e-4)
    assert math.isclose(got.trace, want.trace, rel_tol=1e-4)
    assert math.isclose(got.tokens, want.tokens, rel_tol=1e-3)


def test_nothing_is_measured_where_a_step_cannot_be_read_or_when_off():
    model = tiny_model("llama", layers=2)
    model.train()
    model.get_output_embeddings = lambda: None  # a model whose output layer cannot be found
    ctl = dropbp.apply(model, 0.5)
    noise = dropbp.NoiseScale()
    assert "noise_scale" not in ctl.features
    with pytest.raises(RuntimeError, match="measures nothing until attached"):
        noise.estimate()
    ctl.replace_options(features=[noise])
    _train(model, ctl, steps=2, m=1)
    assert noise.estimate() is None  # one micro-batch per step, and no output layer to read it from within
    assert "no output layer that get_output_embeddings() returns" in noise.one_micro_batch()
    ctl.replace_options(features=[])  # off: its reads leave the model
    assert not noise.attached and noise.handles() == [] and noise.estimate() is None
    with pytest.raises(TypeError, match=r"no longer takes measure_noise_scale.*dropbp.NoiseScale\(\)"):
        dropbp.apply(tiny_model("llama", layers=2), 0.5, measure_noise_scale=True)


def test_the_reads_leave_the_gradients_and_the_model_as_they_were():
    model = tiny_model("llama", layers=2)
    model.train()
    twin = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.0, features=[dropbp.NoiseScale()])
    ids = batch(3, size=2, length=12)
    for x in (ids, ids):
        model(input_ids=x, labels=x).loss.backward()
        twin(input_ids=x, labels=x).loss.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    ctl.remove()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_window_terms_and_step_worth():
    with pytest.raises(ValueError, match="at least 2 micro-batches"):
        window_terms([1.0], 1.0, 8)
    # two micro-batches whose gradients are equal: no noise, |G|^2 is theirs
    gradient, trace = window_terms([4.0, 4.0], 4.0, 8)
    assert gradient == pytest.approx(4.0) and trace == pytest.approx(0.0)
    assert step_worth(1.0, 3.0) == 1.0
    assert step_worth(0.5, 1.0) == pytest.approx(2 / 3)  # r = 1: half the samples are worth 2/3 of a step
    assert step_worth(0.5, 0.0) == 1.0 and step_worth(0.5, math.inf) == 0.5
    with pytest.raises(ValueError, match="kept_share"):
        step_worth(0.0, 1.0)


def test_the_forecast_per_arm_follows_the_noise_scale():
    """At a noise scale equal to the batch (r = 1): half the samples are worth 2/3 of a step; branch drops at 0.5
    cost 1 - 0.5 * share, full backprop at half the batch 0.5. Far below the noise scale (r -> 0) every arm's step
    is worth a full one."""
    from dropbp.features.noise_scale import noise_scale_forecast
    from dropbp.policy.noise_scale import NoiseScaleReading, forecast_arms

    branch, half = forecast_arms(1024, 1024, 0.5, (0.5,))
    assert (branch.worth, branch.step_cost) == (pytest.approx(2 / 3), 0.75)
    assert branch.speedup == pytest.approx((2 / 3) / 0.75) and half.speedup == pytest.approx(4 / 3)
    quiet = forecast_arms(1, 10**9, 0.5, (0.5, 0.75))
    assert [round(a.speedup, 3) for a in quiet] == [round(1 / 0.75, 3), round(1 / 0.625, 3), 2.0]
    with pytest.raises(ValueError, match="branch_share"):
        forecast_arms(1, 1, 1.5)
    message = noise_scale_forecast(NoiseScaleReading(2048.0, 1.0, 2048.0, 1024.0, 6), 0.5, branch_share=0.5)
    assert "noise scale 2,048 tokens over 6 optimizer steps, at 1,024 tokens per step (ratio 2.00" in message
    assert "branch drops at 0.5: 0.80x" in message  # (1 + 2) / (1 + 4) = 0.6 at 0.75 of the time
    assert "Best forecast: full backprop at half the batch" in message


def test_the_automatic_rate_drops_only_where_the_forecast_says_it_pays():
    """``auto_drop_rate``: nothing before a few steps are measured; the largest rate with no noise (every step worth
    a full one, so only the cost counts); none far above it; and it never rises as the noise scale grows."""
    from dropbp.policy.noise_scale import AUTO_RATES, NoiseScaleReading, auto_drop_rate

    def at(ratio: float) -> float:
        return auto_drop_rate(NoiseScaleReading(ratio * 1024, 1.0, 1.0, 1024.0, 8), branch_share=0.5)

    assert auto_drop_rate(None) == 0.0 and at(0.0) == max(AUTO_RATES) and at(5.0) == 0.0
    assert auto_drop_rate(NoiseScaleReading(0.0, 1.0, 1.0, 1024.0, 3)) == 0.0  # too few steps measured to act on
    chosen = [at(r) for r in (0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6)]
    assert chosen == sorted(chosen, reverse=True) and 0.0 < chosen[2] < max(AUTO_RATES)
    # by hand at r = 0.1, share 0.5: (1 - p) * 1.1 / ((1.1 - p) * (1 - p / 2)) is 1.222 at p = 0.5, 1.263 at
    # 0.625 and 1.257 at 0.75
    assert chosen[2] == 0.625


def test_the_shipped_map_and_the_automatic_rate_assume_one_branch_share():
    from dropbp.experimental.where_it_pays import measured_map
    from dropbp.policy.noise_scale import DEFAULT_BRANCH_SHARE

    assert measured_map()["branch_share"] == DEFAULT_BRANCH_SHARE


def test_drop_rate_auto_follows_the_noise_scale_and_resumes(monkeypatch):
    """``drop_rate="auto"`` measures the noise scale, drops nothing before a step is measured, then takes the rate
    ``auto_drop_rate`` gives from the next pattern on; the steps that drop are not read, so after
    ``AUTO_REMEASURE_EVERY - 1`` of them one step runs at rate 0 and is measured; a state saved mid-run resumes the
    estimate and the rate."""
    import warnings

    import dropbp.features.noise_scale
    from dropbp.policy.noise_scale import AUTO_REMEASURE_EVERY

    chosen = []

    def pick(measured, rates):
        chosen.append(measured.steps)
        return 0.5 if measured.steps < 2 else 0.25

    monkeypatch.setattr(dropbp.features.noise_scale, "auto_drop_rate", lambda measured, rates: pick(measured, rates))
    model = tiny_model("llama", layers=4)
    model.train()
    rising = dropbp.experimental.RisingSchedule("linear")
    ctl = dropbp.apply(model, "auto", warmup_steps=5, features=[rising], total_steps=40)
    noise = ctl.features["noise_scale"]
    assert ctl.drop_rate == 0.0 and ctl.schedule.options.warmup_steps == 0
    assert rising not in ctl.schedule.options.features  # "auto" replaces the warm-up and the rise
    _train(model, ctl, steps=1, m=2)
    assert ctl.drop_rate == 0.5 and chosen == [1]
    seen = []  # what each training forward dropped
    handle = model.register_forward_hook(lambda *args: seen.append(ctl.last_dropped) if model.training else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # under "auto" the steps left out are its own doing: nothing said
        _train(model, ctl, steps=AUTO_REMEASURE_EVERY - 1, m=2, seed=1)
    assert any(seen[:-1])
    assert noise.estimate().steps == 1 and ctl.drop_rate == 0.0  # none of the dropping steps read: measure one
    seen.clear()
    _train(model, ctl, steps=1, m=2, seed=2)
    handle.remove()
    assert not any(seen[:-1])  # the measuring step dropped nothing (the last forward opens the next step)
    assert noise.estimate().steps == 2 and ctl.drop_rate == 0.25 and chosen == [1, 2]
    state = ctl.state_dict()
    assert state["drop_rate"] == "auto" and state["noise_scale"]["steps"] == 2
    ctl.remove()
    resumed = dropbp.apply(model, 0.5, features=[dropbp.experimental.RisingSchedule("linear")])  # given as saved
    resumed.load_state_dict(state)
    assert resumed.drop_rate == 0.25 and resumed.features["noise_scale"].estimate().steps == 2
    with pytest.raises(ValueError, match="'auto' but the state has no 'noise_scale'"):
        resumed.load_state_dict({k: v for k, v in state.items() if k != "noise_scale"})


def test_the_start_reading_equals_the_formulas_on_gradients_computed_apart():
    """``measure_windows`` (the Trainer's reading before the first step): windows of two micro-batches, each loss
    backpropagated on its own; against each micro-batch's gradient from ``torch.autograd.grad`` and the unbiased
    formulas averaged as the estimator does (weights 0.9 ** age, bias-corrected); ``.grad`` left as found."""
    from dropbp.features.gradient_noise import measure_windows

    model = tiny_model("llama", layers=2)
    params = [p for p in model.parameters() if p.requires_grad]
    marker = [torch.full_like(p, 0.5) for p in params]
    for p, m in zip(params, marker, strict=True):
        p.grad = m.clone()
    windows = [[{"input_ids": batch(2 * w + k, size=1, length=8), "labels": batch(2 * w + k, size=1, length=8)}
                for k in range(2)] for w in range(3)]  # fmt: skip
    got = measure_windows(model, windows)
    assert all(torch.equal(p.grad, m) for p, m in zip(params, marker, strict=True))
    terms = []
    for window in windows:
        grads = [torch.autograd.grad(model(**x).loss, params) for x in window]
        small = [sum(float(g.double().pow(2).sum()) for g in gs) for gs in grads]
        mean = sum(float(((a.double() + b.double()) / 2).pow(2).sum()) for a, b in zip(*grads, strict=True))
        b, big = 8.0, 16.0
        terms.append(((big * mean - b * sum(small) / 2) / (big - b), (sum(small) / 2 - mean) / (1 / b - 1 / big)))
    weights = [0.9 ** (len(terms) - 1 - i) for i in range(len(terms))]
    gradient = sum(w * g for w, (g, _) in zip(weights, terms, strict=True)) / sum(weights)
    trace = sum(w * t for w, (_, t) in zip(weights, terms, strict=True)) / sum(weights)
    assert got.steps == 3 and got.tokens_per_step == 16
    assert got.gradient_sq_norm == pytest.approx(gradient, rel=1e-6)
    assert got.trace == pytest.approx(trace, rel=1e-6)


def _terms_by_hand(squares: list[float], batch: float, sizes: list[float]) -> tuple[float, float]:
    """One window's (|G|^2, tr) written out: E|G_i|^2 = |G|^2 + tr/b_i, E|mean G_i|^2 = |G|^2 + mean(tr/b_i)/k."""
    k = len(squares)
    h = sum(1 / b for b in sizes) / k
    trace = (sum(squares) / k - batch) / (h - h / k)
    return batch - trace * h / k, trace


@pytest.mark.parametrize("pattern", ["cut", "uniform"])
def test_steps_that_drop_a_branch_are_not_read_and_it_is_said(pattern):
    """Issue 71, class C: LoRA, drop rate 0.5, 4 micro-batches a step. A dropped branch leaves every earlier layer's
    gradient short of its path, so a dropping step's micro-batches are not samples of full backprop's gradient (read
    per branch where kept they gave 1.13x-1.31x ``B_simple``, and 0.59x with LoRA and the cut): such steps are left
    out and that is said once; the steps that drop nothing are read, equal to the estimator fed full backprop's
    micro-batch gradients computed apart for those steps."""
    from conftest import with_lora

    model = with_lora(tiny_model("llama", layers=3)).train()
    ctl = dropbp.apply(model, 0.5, seed=2, pattern=pattern, warmup_steps=0, features=[dropbp.NoiseScale()])
    noise = ctl.features["noise_scale"]
    ctl.drop_rate = 0.0  # steps that drop nothing: read, as full backprop's
    reference = _train(model, ctl, steps=3, m=4)
    got, want = noise.estimate(), reference.estimate()
    assert got.steps == want.steps == 3
    assert math.isclose(got.gradient_sq_norm, want.gradient_sq_norm, rel_tol=1e-4)
    assert math.isclose(got.trace, want.trace, rel_tol=1e-4)
    ctl.drop_rate = 0.5
    seen = []  # what each training forward dropped
    model.register_forward_hook(lambda *args: seen.append(ctl.last_dropped))
    with pytest.warns(UserWarning, match="not read from optimizer steps that drop a branch's backward") as said:
        _train(model, ctl, steps=3, m=4, seed=1)
    assert len([w for w in said if "not read from optimizer steps" in str(w.message)]) == 1 and any(seen)
    assert noise.estimate() == got  # none of the dropping steps read


@pytest.mark.parametrize("returns_loss", [True, False])
def test_a_loss_scale_that_moves_between_steps_is_divided_out(returns_loss, caplog):
    """Issue 71, class C: ``GradScaler`` whose scale grows and halves between steps (set by ``update(new_scale)``):
    the reads take scaled gradients, and averaged steps of different scales (60.9 against 51.4 by hand). The
    gradient that reaches the model's loss is the scale: divided out, the reading equals the estimator fed the
    unscaled micro-batch gradients computed apart. A loss computed outside the model (logits returned): the scale
    cannot be seen, so a steady scale reads the same and only a moving one would be off: said once (the "dropbp"
    log)."""
    import logging

    caplog.set_level(logging.INFO, logger="dropbp")
    model = tiny_model("llama", layers=2).train()
    ctl = dropbp.apply(model, 0.0, features=[dropbp.NoiseScale()])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reference, m = NoiseScaleEstimator(), 3
    scales = [2.0**10, 2.0**4, 2.0**12, 2.0**6] if returns_loss else [2.0**8] * 4
    scaler = torch.amp.GradScaler("cpu", init_scale=scales[0])

    def loss_of(net, x):
        if returns_loss:
            return net(input_ids=x, labels=x).loss
        logits = net(input_ids=x).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))

    for step, scale in enumerate(scales):
        ids = [batch(500 + step * m + k, size=2, length=12) for k in range(m)]
        plain = copy.deepcopy(model)
        params = [p for p in plain.parameters() if p.requires_grad]
        micro = [torch.autograd.grad(loss_of(plain, x) / m, params) for x in ids]
        total = [sum(parts) for parts in zip(*micro, strict=True)]
        squares = [sum(float(t.double().pow(2).sum()) for t in grads) * m * m for grads in micro]
        reference.update(squares, sum(float(t.double().pow(2).sum()) for t in total), ids[0].numel())
        optimizer.zero_grad(set_to_none=True)
        for x in ids:
            scaler.scale(loss_of(model, x) / m).backward()
        scaler.step(optimizer)
        assert scaler.get_scale() == scale
        scaler.update(scales[(step + 1) % len(scales)])  # the next step's scale
    optimizer.zero_grad(set_to_none=True)
    ctl.features["noise_scale"].flush()
    got, want = ctl.features["noise_scale"].estimate(), reference.estimate()
    assert got.steps == want.steps == 4
    # the ratio of the terms (a random model's |G|^2 estimate may fall below 0, which estimate() reads as inf)
    assert got.trace / got.gradient_sq_norm == pytest.approx(want.trace / want.gradient_sq_norm, rel=1e-4)
    if returns_loss:  # the terms themselves: unscaled
        assert math.isclose(got.gradient_sq_norm, want.gradient_sq_norm, rel_tol=1e-4)
        assert math.isclose(got.trace, want.trace, rel_tol=1e-4)
    unseen = [r for r in caplog.records if "cannot see a loss scale" in r.getMessage()]
    assert len(unseen) == (0 if returns_loss else 1)  # said once, where the model returns no loss


@pytest.mark.parametrize("sizes", [(16, 112, 16, 112), (32, 32, 32, 32), (8, 24, 40, 56)])
def test_window_terms_are_unbiased_for_micro_batches_of_unequal_sizes(sizes):
    """Gaussian per-token gradients (mean G, covariance s^2 I in D dims: tr = D s^2); each micro-batch's gradient the
    mean of its own tokens, the accumulated one their mean: the terms average to |G|^2 and tr over many windows (equal
    sizes gave these within 3%; 16 / 112 / 16 / 112 read 2.5x ``B_simple`` before)."""
    g = torch.Generator().manual_seed(1)
    dims, s = 6, 0.8
    mean = torch.randn(dims, generator=g, dtype=torch.float64)
    gradient = trace = 0.0
    windows = 4000
    for _ in range(windows):
        micro = [mean + torch.randn(b, dims, generator=g, dtype=torch.float64).mul(s).mean(0) for b in sizes]
        squares = [float(x.pow(2).sum()) for x in micro]
        batch_sq = float(torch.stack(micro).mean(0).pow(2).sum())
        terms = window_terms(squares, batch_sq, list(sizes))
        gradient, trace = gradient + terms[0] / windows, trace + terms[1] / windows
    assert abs(gradient / float(mean.pow(2).sum()) - 1) < 0.05
    assert abs(trace / (dims * s * s) - 1) < 0.05
    assert window_terms([1.0, 3.0], 1.5, 10) == window_terms([1.0, 3.0], 1.5, [10, 10])


def test_an_overflowed_step_is_left_out_and_the_state_still_loads():
    """fp16 steps GradScaler skips leave inf / NaN gradients: such a step never enters the running average (it would
    stay in it for good, and "auto" with it), and the run's own state loads back."""
    model = tiny_model("llama", layers=2)
    ctl = dropbp.apply(model, 0.0, features=[dropbp.NoiseScale()])
    noise = ctl.features["noise_scale"]
    _train(model, ctl, steps=2, m=2)
    before = noise.estimate()
    model.zero_grad(set_to_none=True)
    for k in range(2):  # a loss scale past fp16's range: the step's gradients are inf
        x = batch(90 + k, size=2, length=12)
        (model(input_ids=x, labels=x).loss * 1e30 * 1e30).backward()
    noise.flush()
    after = noise.estimate()
    assert after.steps == before.steps and after.tokens == before.tokens
    assert all(math.isfinite(v) for v in (after.gradient_sq_norm, after.trace))
    ctl.load_state_dict(ctl.state_dict())


@pytest.mark.parametrize("m", [1, 3])
def test_zero_grad_between_a_forward_and_its_backward_starts_the_step_there(m):
    """Issue 71, class C: ``forward -> zero_grad -> backward -> step`` (the order some loops use): each step's window
    begins at the micro-batch whose backward follows the ``zero_grad``. One micro-batch a step: each step its own
    window, read from within (the window never closed before: it grew without end and one made-up step of every
    micro-batch was read); three equal the estimator fed gradients computed apart."""
    model = tiny_model("llama", layers=2).train()
    ctl = dropbp.apply(model, 0.0, features=[dropbp.NoiseScale()])
    reference = _train(model, ctl, steps=4, m=m, late=True)
    noise = ctl.features["noise_scale"]
    noise.flush()
    got, want = noise.estimate(), reference.estimate()
    if m == 1:
        assert want is None and got.steps == 4 and got.tokens_per_step == 24  # 2 x 12 tokens a step, none made up
        return
    assert got.steps == want.steps == 4
    assert math.isclose(got.tokens, want.tokens, rel_tol=1e-3)


def test_a_noise_scale_attached_in_the_middle_of_a_step_leaves_that_step_out():
    """Issue 71, class C: attached after a step's first micro-batches, the reads see only the rest of that step: it is
    left out, not counted as a step of fewer micro-batches (18.7 against 49.1)."""
    model = tiny_model("llama", layers=2).train()
    ctl = dropbp.apply(model, 0.0)
    ids = batch(999, size=2, length=12)
    (model(input_ids=ids, labels=ids).loss / 3).backward()  # the first micro-batch of a step, before the reads
    noise = dropbp.NoiseScale()
    ctl.replace_options(features=[noise])
    for k in range(2):  # the step's other two
        x = batch(998 - k, size=2, length=12)
        (model(input_ids=x, labels=x).loss / 3).backward()
    torch.optim.SGD(model.parameters(), lr=0.05).step()
    reference = _train(model, ctl, steps=3, m=3, seed=1)  # three whole steps, zero_grad first
    got, want = noise.estimate(), reference.estimate()
    assert got.steps == want.steps == 3  # the partial step left out
    assert math.isclose(got.tokens, want.tokens, rel_tol=1e-3)


def test_two_forwards_before_one_backward_are_one_micro_batch():
    """Issue 71, class C: a loss of two forwards (a multi-task or contrastive loss) backpropagated once is one
    micro-batch of both forwards' tokens (read as two, each the whole gradient, and a quarter of the tokens lost: 532
    against 31.5); equal to the estimator fed each micro-batch's gradient computed apart."""
    model = tiny_model("llama", layers=2).train()
    ctl = dropbp.apply(model, 0.0, features=[dropbp.NoiseScale()])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reference, m = NoiseScaleEstimator(), 3
    for step in range(3):
        pairs = [(batch(100 * step + 2 * k), batch(100 * step + 2 * k + 1)) for k in range(m)]
        plain = copy.deepcopy(model)
        params = [p for p in plain.parameters() if p.requires_grad]

        def loss(net, pair):
            return sum(net(input_ids=x, labels=x).loss for x in pair) / (2 * m)

        micro = [torch.autograd.grad(loss(plain, pair), params) for pair in pairs]
        total = [sum(parts) for parts in zip(*micro, strict=True)]
        squares = [sum(float(t.double().pow(2).sum()) for t in grads) * m * m for grads in micro]
        reference.update(squares, sum(float(t.double().pow(2).sum()) for t in total), 2 * pairs[0][0].numel())
        optimizer.zero_grad(set_to_none=True)
        for pair in pairs:
            loss(model, pair).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    ctl.features["noise_scale"].flush()
    got, want = ctl.features["noise_scale"].estimate(), reference.estimate()
    assert got.steps == want.steps == 3 and got.tokens_per_step == want.tokens_per_step == 3 * 2 * 24
    assert math.isclose(got.tokens, want.tokens, rel_tol=1e-3)


def _hand_chunk_noise_scale(model, ids: torch.Tensor, chunks: int) -> float:
    """B_simple of one sequence's step by hand: a zero shift added at the output layer's input, each chunk's own loss
    (its positions' next-token cross-entropy, mean) backpropagated apart, and McCandlish's estimator over the chunks'
    mean gradients (unequal chunks: 1/b the mean of their 1/b_k)."""
    reference = copy.deepcopy(model)
    head = reference.get_output_embeddings()
    shift = torch.nn.Parameter(torch.zeros(head.in_features, dtype=torch.float64))
    handle = head.register_forward_pre_hook(lambda module, args: (args[0] + shift.to(args[0].dtype),))
    positions = ids.shape[1]
    bounds = [round(i * positions / chunks) for i in range(chunks + 1)]
    means, sizes = [], []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        labels = torch.full_like(ids, -100)
        last = min(b, positions - 1)  # position t predicts token t + 1: the last position has no loss
        labels[:, a + 1 : last + 1] = ids[:, a + 1 : last + 1]
        if last <= a:
            continue
        shift.grad = None
        reference(input_ids=ids, labels=labels).loss.backward()
        means.append(shift.grad.clone())
        sizes.append(last - a)
    handle.remove()
    m = len(means)
    inverse = sum(1.0 / n for n in sizes) / m
    small = sum(float(g.pow(2).sum()) for g in means) / m
    big = float(torch.stack(means).mean(0).pow(2).sum())
    trace = (small - big) / (inverse * (1 - 1 / m))
    gradient = big - trace * inverse / m
    return trace / gradient  # unclamped: a random model's |G|^2 estimate may be negative


@pytest.mark.parametrize(("rate", "chunked"), [(0.0, False), (0.5, False), (0.5, True)])
def test_one_micro_batch_a_step_is_read_from_within_exactly(rate, chunked):
    """One long sequence a step (no accumulation): B_simple from 8 chunks of its tokens at the output layer, equal to
    the chunks' own losses backpropagated apart; whatever the step drops (the head's input gradient is the loss's),
    with the chunked loss too."""
    from dropbp.features.gradient_noise import CHUNKS

    model = tiny_model("llama", layers=2).train()
    ids = torch.randint(0, model.config.vocab_size, (1, 61), generator=torch.Generator().manual_seed(3))
    want = _hand_chunk_noise_scale(model, ids, CHUNKS)
    noise = dropbp.NoiseScale()
    ctl = dropbp.apply(model, rate, features=[noise, *([dropbp.ChunkedLoss()] if chunked else [])], seed=1)
    assert noise.one_micro_batch() is None
    model(input_ids=ids, labels=ids).loss.backward()
    noise.flush()
    got = noise.estimate()
    assert got is not None and got.steps == 1 and got.tokens_per_step == 61
    # the ratio of the two terms (a random model's |G|^2 estimate may fall below 0, which estimate() reads as inf)
    assert got.trace / got.gradient_sq_norm == pytest.approx(want, rel=1e-4)
    ctl.remove()


def test_drop_rate_auto_follows_a_noise_scale_read_from_within_the_step():
    """``drop_rate="auto"`` with one micro-batch a step: each closed step is measured, and the rate in force is the
    one the reading chooses (it stayed at full backprop for the whole run before)."""
    model = tiny_model("llama", layers=4).train()
    ctl = dropbp.apply(model, "auto")
    noise = ctl.features["noise_scale"]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(4):
        ids = batch(seed=step, size=1, length=48)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    noise.flush()
    assert noise.estimate().steps == 4
    chosen = noise.choose_rate(dropbp.policy.shapes.get_shape(ctl.pattern), [b.flops for b in ctl.branches])
    assert ctl.drop_rate == chosen
