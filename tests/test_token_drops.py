"""Token drops (``dropbp.experimental.TokenDrops``): exact against a hand-written reference, unbiased, resumable, off
at 0.

The reference never imports dropbp's mechanism: for the weights a run recorded (the feature's ``weights()``), the plain
model's branch outputs ``y`` are replaced by ``y.detach() + (w * y - (w * y).detach())`` (same values; gradient ``w``
times the arriving one) with forward hooks, and every parameter's gradient must match.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import assert_same_grads, batch, loss_and_grads, tiny_model, weighted_outputs, with_lora
from dropbp.backends.base import LazyGraphBackend

import dropbp
from dropbp.experimental.token_rows import row_ops
from dropbp.experimental.token_selection import (
    AUTO_KEEP_SHARES,
    AUTO_VARIANCE_BUDGET,
    added_variance,
    auto_keep_share,
    inclusion_probabilities,
    keep_count,
    selection_weights,
    systematic_sample,
    token_shares,
)
from dropbp.tools.arms import apply_arm

MOE = {"qwen3_moe": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)}  # fmt: skip


def _model(arch: str, method: str, checkpointing: bool, layers: int = 3) -> torch.nn.Module:
    model = tiny_model(arch, layers=layers, **MOE.get(arch, {}))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return with_lora(model) if method == "lora" else model


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox", "qwen3_moe", "phi3"])
def test_gradients_equal_the_reference_for_the_recorded_selection(arch, method, checkpointing):
    model = _model(arch, method, checkpointing)
    ids = batch(1, size=2, length=12)
    ctl = dropbp.apply(model, 0.5, seed=4, features=[dropbp.experimental.TokenDrops(0.5)])
    for step in range(3):  # branch drops and token drops together, three patterns
        loss, got = loss_and_grads(model, ids)
        weights = ctl.features["token_drops"].weights()
        dropped = set(ctl.last_dropped)
        assert weights and not dropped & set(weights)  # dropped branches select nothing
        for w in weights.values():
            assert int((w > 0).sum()) == keep_count(24, 0.5)
        ctl.remove()
        handles = weighted_outputs(model, weights)
        from conftest import detach_outputs

        handles += detach_outputs(model, tuple(dropped))
        plain_loss, want = loss_and_grads(model, ids)
        for h in handles:
            h.remove()
        assert torch.equal(loss, plain_loss)
        assert_same_grads(got, want, atol=1e-5)
        ctl = dropbp.apply(model, 0.5, seed=4, features=[dropbp.experimental.TokenDrops(0.5)])
        ctl.load_state_dict(ctl.state_dict() | {"step": step + 1})


def test_the_row_local_linear_maps_run_on_the_kept_rows(monkeypatch):
    """The query, output and MLP projections' backward gathers the kept rows; keys and values keep all rows."""
    from dropbp.experimental import token_backward

    seen: list[int] = []
    real = torch.Tensor.index_select

    def counting(self, dim, index):
        if self.dim() == 2:  # rows of a gradient or an input (the selection itself reorders 1-d scores)
            seen.append(index.numel())
        return real(self, dim, index)

    model = tiny_model("llama", layers=2)
    ctl = dropbp.apply(model, 0.0, features=[dropbp.experimental.TokenDrops(0.75)])
    monkeypatch.setattr(torch.Tensor, "index_select", counting)
    ids = batch(0, size=2, length=16)
    model(input_ids=ids, labels=ids).loss.backward()
    monkeypatch.undo()
    kept = keep_count(32, 0.75)
    # per layer: q and o (attention) and gate, up, down (MLP): the gradient rows and the input rows of each
    assert seen == [kept] * (2 * 5 * 2)
    assert token_backward.RowDropEngine  # the module the gathering lives in
    assert set(ctl.features["token_drops"].weights()) == {b.name for b in ctl.branches}


def _rows_seen(model: torch.nn.Module, suffixes: tuple[str, ...]) -> list[tuple[str, bool, int, torch.dtype]]:
    """Every call of the modules named ``...suffix`` from now on: (suffix, during a backward, rows, output dtype)."""
    seen = []

    def hook(suffix: str):
        def record(module, args, output):
            backward = torch._C._current_graph_task_id() != -1
            seen.append((suffix, backward, args[0].numel() // args[0].shape[-1], output.dtype))

        return record

    for name, module in model.named_modules():
        for suffix in suffixes:
            if name.endswith(suffix):
                module.register_forward_hook(hook(suffix))
    return seen


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_checkpointed_mlp_branch_is_recomputed_on_its_kept_rows_only(method):
    """Under non-re-entrant checkpointing an MLP branch's backward runs it again on its kept rows alone, and its
    full-row forward is not run a second time; the attention branch is recomputed on every row. Under bf16 autocast
    the rerun is in bf16, as the forward was."""
    model = _model("llama", method, checkpointing=True, layers=2)
    dropbp.apply(model, 0.0, features=[dropbp.experimental.TokenDrops(0.75)])
    seen = _rows_seen(model, ("self_attn.q_proj", "mlp.gate_proj"))
    ids = batch(0, size=2, length=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    kept = keep_count(32, 0.75)
    forward = [("self_attn.q_proj", False, 32), ("mlp.gate_proj", False, 32)] * 2
    backward = [("self_attn.q_proj", True, 32), ("mlp.gate_proj", True, kept)] * 2
    assert [call[:3] for call in seen] == forward + backward
    assert {call[3] for call in seen} == {torch.bfloat16}


@pytest.mark.parametrize(("dropout", "recomputed_rows"), [(0.1, 24), (0.0, keep_count(24, 0.5))])
def test_dropout_in_an_mlp_branch_keeps_its_recomputation_on_every_row(dropout, recomputed_rows):
    """A recomputation on fewer rows would draw other dropout masks than the forward's: with dropout active (GPT-2's
    ``resid_pdrop``) the checkpointed MLP branch is recomputed whole, as without token drops, and stays exact."""
    model = tiny_model("gpt2", layers=2, resid_pdrop=dropout)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.0, features=[dropbp.experimental.TokenDrops(0.5)])
    seen = _rows_seen(model, ("mlp.c_fc",))
    _matches_reference(model, ctl, reference, batch(0))
    assert [call[1:3] for call in seen] == [(False, 24)] * 2 + [(True, recomputed_rows)] * 2


def test_an_mlp_branch_whose_input_needs_no_gradient_is_recomputed_whole_and_stays_exact():
    """LoRA on the MLPs alone: the first layer's MLP input needs no gradient (nothing trainable below it), so that
    branch keeps the row-gathered backward (recomputed whole); the branches above it are recomputed on kept rows."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_model("llama", layers=2), config).train()
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.get_base_model().disable_input_require_grads()  # Hugging Face's hook (for re-entrant checkpointing) off
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.0, features=[dropbp.experimental.TokenDrops(0.5)])
    seen = _rows_seen(model, ("mlp.gate_proj",))
    _matches_reference(model, ctl, reference, batch(0))
    assert [call[1:3] for call in seen] == [(False, 24)] * 2 + [(True, keep_count(24, 0.5)), (True, 24)]


@pytest.mark.parametrize("arch", ["llama", "phi3", "gpt_neox"])
def test_importance_weights_and_kept_rows_recomputation_equal_the_reference(arch):
    """Branch drops with importance weights (``ImportanceWeights``), token drops and checkpointing together: each kept
    branch's parameters get ``1 / (1 - r)`` times the gradient of its recorded token weights."""
    from conftest import weight_branch_grads

    model = _model(arch, "lora", checkpointing=True)
    reference = copy.deepcopy(model)
    features = [dropbp.experimental.ImportanceWeights(), dropbp.experimental.TokenDrops(0.5)]
    ctl = dropbp.apply(model, 0.5, seed=3, features=features)
    patterns = set()
    for step in range(4):
        ids = batch(step)
        rates = {b.name: b.rate for b in ctl.branches}
        loss, got = loss_and_grads(model, ids)
        dropped = set(ctl.last_dropped)
        weights = {k: v for k, v in ctl.features["token_drops"].weights().items() if k not in dropped}
        from conftest import detach_outputs

        handles = [*weighted_outputs(reference, weights), *detach_outputs(reference, tuple(dropped))]
        plain_loss, want = loss_and_grads(reference, ids)
        for h in handles:
            h.remove()
        for name in weights:
            weight_branch_grads(want, name, 1 / (1 - rates[name]))
        assert torch.equal(loss, plain_loss)
        assert_same_grads(got, want, atol=1e-5)
        patterns.add(frozenset(dropped))
    assert len(patterns) > 1  # kept branches weighted differently from step to step


def test_rate_zero_is_the_model_without_the_library():
    model = tiny_model("llama")
    ids = batch(2)
    _, want = loss_and_grads(model, ids)
    drops = dropbp.experimental.TokenDrops(0.0)
    ctl = dropbp.apply(model, 0.0, features=[drops])
    _, got = loss_and_grads(model, ids)
    assert_same_grads(got, want, atol=0.0)
    assert ctl.features["token_drops"].weights() == {}
    ctl.features["token_drops"].rate = 0.5  # switched on later: from the next step
    loss_and_grads(model, ids)
    assert len(ctl.features["token_drops"].weights()) == len(ctl.branches)
    ctl.features["token_drops"].rate = 0.0  # and off again: exactly the plain model
    _, again = loss_and_grads(model, ids)
    assert_same_grads(again, want, atol=0.0)


def test_eval_and_no_grad_forwards_select_nothing():
    model = tiny_model("llama")
    ctl = dropbp.apply(model, 0.0, features=[dropbp.experimental.TokenDrops(0.5)])
    ids = batch(3)
    with torch.no_grad():
        model(input_ids=ids)
    model.eval()
    model(input_ids=ids, labels=ids).loss.backward()
    assert ctl.features["token_drops"].weights() == {} and ctl.step == 0
    model.train()
    with ctl.forcing(frozenset()):  # calibration's forced forwards measure plain gradients
        model(input_ids=ids, labels=ids).loss.backward()
    assert ctl.features["token_drops"].weights() == {}


@pytest.mark.parametrize(("drop_rate", "token_drop_rate"), [(0.5, 0.5), (0.0, "auto")], ids=["fixed", "auto"])
def test_a_resumed_run_repeats_the_selections(drop_rate, token_drop_rate):
    """The selections are a function of (seed, step) and the gradient; under "auto" also of the shares and readings,
    which the state holds."""
    ids = [batch(s, size=2, length=16) for s in range(6)]

    def run(model, ctl, steps):
        out = []
        for i in steps:
            loss_and_grads(model, ids[i])
            out.append({k: v.clone() for k, v in ctl.features["token_drops"].weights().items()})
        return out

    model = tiny_model("llama")
    ctl = apply_arm(model, drop_rate, token_drop_rate=token_drop_rate, seed=9)
    run(model, ctl, range(3))
    state = ctl.state_dict()
    assert ("token_drops" in state) == (token_drop_rate == "auto")
    straight = run(model, ctl, range(3, 6))
    ctl.remove()
    resumed = apply_arm(model, drop_rate, token_drop_rate=token_drop_rate, seed=0)
    resumed.load_state_dict(state)
    again = run(model, resumed, range(3, 6))
    for a, b in zip(straight, again, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("rule", ["gradient", "residual", "random"])
def test_the_weighted_selection_is_unbiased(rule):
    """Over many selections the weighted gradient's mean approaches full backprop's (within 4 standard errors per
    coordinate on average); without the weights it does not."""
    model = tiny_model("llama", layers=2)
    ids = batch(5, size=2, length=16)
    _, full = loss_and_grads(model, ids)
    ctl = apply_arm(model, 0.0, token_drop_rate=0.75, token_selection=rule)
    name = "model.layers.0.mlp.down_proj.weight"
    samples = []
    for seed in range(300):
        ctl.seed = seed
        _, got = loss_and_grads(model, ids)
        samples.append(got[name])
    stack = torch.stack(samples)
    mean, error = stack.mean(0), stack.std(0) / math.sqrt(len(samples))
    z = ((mean - full[name]).abs() / error.clamp_min(1e-12)).mean()
    assert z < 2.0  # unbiased: about 0.8 for a normal mean
    unweighted = (stack.mean(0) * (1 - 0.75)).sub(full[name]).abs().div(error.clamp_min(1e-12)).mean()
    assert unweighted > 4.0  # the same samples read without the 1/p weights: biased, and the test sees it


def test_the_weighted_selection_is_unbiased_for_lora_adapters():
    """LoRA's A and B (whose weight gradients come from the kept rows' inputs and gradients through the adapter):
    the mean over selections approaches full backprop's, as for full fine-tuning's weights."""
    model = _model("llama", "lora", checkpointing=False)
    ids = batch(5, size=2, length=16)
    _, full = loss_and_grads(model, ids)
    ctl = dropbp.apply(model, 0.0, features=[dropbp.experimental.TokenDrops(0.5)])
    names = [n for n in full if full[n] is not None and ".layers.0.self_attn.q_proj.lora_" in n]
    samples: dict[str, list] = {n: [] for n in names}
    for seed in range(200):
        ctl.seed = seed
        _, got = loss_and_grads(model, ids)
        for n in names:
            samples[n].append(got[n])
    assert len(names) == 2
    for n in names:
        stack = torch.stack(samples[n])
        error = stack.std(0) / math.sqrt(len(stack))
        assert ((stack.mean(0) - full[n]).abs() / error.clamp_min(1e-12)).mean() < 2.0, n


@pytest.mark.parametrize("rule", ["residual", "cumulative"])
def test_the_forward_and_cumulative_rules_match_the_reference_for_their_selection(rule):
    """The recorded weights of TokenDrop's two rules give the reference's gradients, as the default rule's do."""
    model = _model("llama", "lora", checkpointing=False)
    ids = batch(2, size=2, length=12)
    ctl = apply_arm(model, 0.0, token_drop_rate=0.5, token_selection=rule, seed=3)
    loss, got = loss_and_grads(model, ids)
    weights = ctl.features["token_drops"].weights()
    ctl.remove()
    handles = weighted_outputs(model, weights)
    plain_loss, want = loss_and_grads(model, ids)
    for h in handles:
        h.remove()
    assert torch.equal(loss, plain_loss)
    assert_same_grads(got, want, atol=1e-5)


def test_cumulative_selection_keeps_the_topmost_branchs_rows_in_every_branch_below():
    model = tiny_model("llama", layers=3)
    ids = batch(3, size=2, length=16)
    ctl = dropbp.apply(model, 0.0, seed=1, features=[dropbp.experimental.TokenDrops(0.75, "cumulative")])
    for _ in range(2):
        loss_and_grads(model, ids)
        weights = list(ctl.features["token_drops"].weights().values())
        assert len(weights) == 6 and all(torch.equal(w, weights[0]) for w in weights)
        assert int((weights[0] > 0).sum()) == keep_count(32, 0.75)
    first = weights[0]
    loss_and_grads(model, ids)  # the next forward draws anew
    assert not torch.equal(next(iter(ctl.features["token_drops"].weights().values())), first)


def test_the_residual_rule_keeps_rows_by_the_size_of_the_branch_output():
    """``"residual"``: probabilities from the forward's row norms; rows without gradient are never kept; unbiased."""
    gradient = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    residual = torch.tensor([8.0, 1.0, 9.0, 1.0, 1.0, 0.5])
    total, kept = torch.zeros(6), torch.zeros(6)
    g = torch.Generator().manual_seed(0)
    for _ in range(3000):
        order, offset = torch.randperm(6, generator=g), torch.rand(1, generator=g)
        w = selection_weights(gradient, 2, "residual", order, offset, residual)
        assert float(w[2]) == 0.0 and int((w > 0).sum()) == 2
        total, kept = total + w, kept + (w > 0).float()
    assert float(kept[0]) == 3000.0  # the largest update, capped at probability 1
    assert float(kept[5]) < float(kept[1])  # a smaller update is kept less often
    assert torch.allclose((total / 3000)[gradient > 0], torch.ones(5), atol=0.1)
    with pytest.raises(ValueError, match="row norms from the forward"):
        selection_weights(gradient, 2, "residual", torch.arange(6), torch.tensor([0.5]))


@pytest.mark.parametrize("zero", ["every row", "some rows"])
def test_the_residual_rule_can_keep_every_row_that_carries_gradient(zero):
    """A zero-initialised output projection gives every row a forward norm of 0 (or some rows): each row carrying
    gradient is still drawn with a positive probability and weighted by it, so the selection stays unbiased (a row
    never kept would never train)."""
    gradient = torch.tensor([1.0, 2.0, 0.0, 1.0, 3.0, 1.0])
    residual = torch.zeros(6) if zero == "every row" else torch.tensor([4.0, 0.0, 1.0, 2.0, 0.0, 1.0])
    total = torch.zeros(6)
    g = torch.Generator().manual_seed(0)
    for _ in range(4000):
        order, offset = torch.randperm(6, generator=g), torch.rand(1, generator=g)
        w = selection_weights(gradient, 2, "residual", order, offset, residual)
        assert float(w[2]) == 0.0 and int((w > 0).sum()) == 2
        total += w
    assert torch.allclose((total / 4000)[gradient > 0], torch.ones(5), atol=0.12)


@pytest.mark.parametrize("rows", [1024, 4096, 8192])
def test_a_selection_weights_no_more_rows_than_it_gathers_at_real_sizes(rows):
    """At 8 x 512 rows a float32 running sum of the probabilities could end a rounding error past the count, and a
    row's start recomputed as its end less its probability could count one point twice: keep + 1 rows weighted, keep
    gathered, the gradient off. Every draw weights at most ``keep`` rows, whatever the scores' spread."""
    g = torch.Generator().manual_seed(rows)
    for draw in range(100):
        norms = torch.rand(rows, generator=g) ** (1 + draw % 5) * 10.0 ** (draw % 3)
        keep = keep_count(rows, (0.3, 0.5, 0.75)[draw % 3])
        order, offset = torch.randperm(rows, generator=g), torch.rand(1, generator=g)
        w = selection_weights(norms, keep, "gradient", order, offset)
        assert keep - 1 <= int((w > 0).sum()) <= keep


def test_selection_weights_have_expectation_one_on_rows_that_carry_gradient():
    norms = torch.tensor([5.0, 0.0, 1.0, 1.0, 0.5, 3.0, 0.0, 2.0])
    total = torch.zeros(8)
    g = torch.Generator().manual_seed(0)
    draws = 4000
    for _ in range(draws):
        order, offset = torch.randperm(8, generator=g), torch.rand(1, generator=g)
        w = selection_weights(norms, 3, "gradient", order, offset)
        assert int((w > 0).sum()) == 3 and float(w[1]) == float(w[6]) == 0.0
        total += w
    mean = total / draws
    assert torch.allclose(mean[norms > 0], torch.ones(6), atol=0.08)


def test_inclusion_probabilities_sum_to_the_count_capped_at_one():
    p = inclusion_probabilities(torch.tensor([100.0, 1.0, 1.0, 1.0]), 2)
    assert torch.allclose(p, torch.tensor([1.0, 1 / 3, 1 / 3, 1 / 3]))
    p = inclusion_probabilities(torch.tensor([2.0, 0.0, 1.0, 0.0]), 3)  # fewer rows carry gradient than asked
    assert torch.equal(p, torch.tensor([1.0, 0.0, 1.0, 0.0]))
    p = inclusion_probabilities(torch.rand(50, generator=torch.Generator().manual_seed(1)), 20)
    assert math.isclose(float(p.sum()), 20.0, rel_tol=1e-5) and float(p.max()) <= 1.0
    mask = systematic_sample(p, torch.randperm(50), torch.tensor([0.3]), 20)
    assert int(mask.sum()) == 20


class _Lazy(LazyGraphBackend):
    """A lazy-graph device stand-in (its graph breaks do nothing): LazyGraphBackend's own answers."""

    name = "stand-in"
    device = torch.device("cpu")
    autocast_dtype = torch.float32
    unavailable_reason = classmethod(lambda cls: None)

    def mark_step(self) -> None: ...


def test_a_lazy_graph_device_gathers_fixed_row_counts():
    lazy = row_ops(_Lazy())
    counts = {lazy.kept_row_count(k, 512) for k in range(1, 513)}
    assert counts == {64 * i for i in range(1, 9)} and lazy.kept_row_count(65, 512) == 128
    assert row_ops(dropbp.backends.get("cpu")).kept_row_count(65, 512) == 65


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("rate", 1.0, "rate must be .* the share of token rows whose backward each kept"),
        ("rate", -0.1, "rate must be"),
        ("selection", "largest", "selection must be one of"),
        ("rate", "most", "rate must be .* or 'auto'"),
    ],
)
def test_bad_token_options_say_what_to_do(option, value, match):
    with pytest.raises((ValueError, TypeError), match=match):
        dropbp.experimental.TokenDrops(**{"rate": 0.5, option: value})
    drops = dropbp.experimental.TokenDrops(0.5)
    with pytest.raises((ValueError, TypeError), match=match):  # a refused setting changes nothing
        setattr(drops, option, value)
    assert (drops.rate, drops.selection) == (0.5, "gradient")
    with pytest.raises(TypeError, match=r"no longer takes token_drop_rate \(dropbp 0.3\).*TokenDrops"):
        dropbp.apply(tiny_model("llama"), 0.5, token_drop_rate=0.5)  # 0.2's spelling says where it went


def _matches_reference(model: torch.nn.Module, ctl, reference: torch.nn.Module, ids: torch.Tensor) -> None:
    """One step of ``model`` under ``ctl`` against ``reference`` (the same weights, no dropbp) with the step's
    dropped outputs detached and its recorded token weights applied."""
    from conftest import detach_outputs

    loss, got = loss_and_grads(model, ids)
    weights = {k: v for k, v in ctl.features["token_drops"].weights().items() if k not in ctl.last_dropped}
    handles = [*weighted_outputs(reference, weights), *detach_outputs(reference, ctl.last_dropped)]
    plain_loss, want = loss_and_grads(reference, ids)
    for h in handles:
        h.remove()
    torch.testing.assert_close(loss, plain_loss, atol=1e-5, rtol=0)
    assert_same_grads(got, want, atol=1e-5)


def test_token_drops_compose_with_the_memory_bound_and_the_chunked_loss():
    import copy

    model = tiny_model("llama", layers=4)
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.75, seed=2, features=[dropbp.experimental.TokenDrops(0.5), dropbp.ChunkedLoss(8)])
    assert ctl.memory_bound
    for step in range(4):
        ctl.features["token_drops"].weights().clear()
        _matches_reference(model, ctl, reference, batch(step, size=2, length=16))


def test_4bit_layers_run_full_rows_said_once_and_lora_stays_exact(monkeypatch):
    import copy

    bnb = pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes", exc_type=ImportError)
    from dropbp.tools.qlora import quantize_4bit

    if hasattr(bnb.nn.modules, "has_avx512bf16"):
        monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)
    model = with_lora(quantize_4bit(tiny_model("llama", layers=2), torch.float32))
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"token drops run the backward of \d+ linear map\(s\) on full rows") as seen:
        ctl = dropbp.apply(model, 0.0, features=[dropbp.experimental.TokenDrops(0.5)])
    assert len([w for w in seen if "full rows" in str(w.message)]) == 1
    for step in range(2):
        _matches_reference(model, ctl, reference, batch(step))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["gathered", "kept-rows"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_grad_mode_is_restored_when_a_gathered_linear_map_raises(monkeypatch, error, checkpointing):
    """A row-gathered linear map (or, checkpointed, the MLP branch recomputed on its kept rows) computes its output
    without autograd; an exception in it (Ctrl-C included) leaves grad mode as it was, and the next step is exact."""
    model = _model("llama", "full", checkpointing, layers=2)
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.0, features=[dropbp.experimental.TokenDrops(0.5)])
    down = model.model.layers[1].mlp.down_proj

    def broken(x):
        raise error("stop")

    monkeypatch.setattr(down, "forward", broken)
    with pytest.raises(error):
        model(input_ids=batch(0), labels=batch(0))
    assert torch.is_grad_enabled()
    monkeypatch.undo()
    _matches_reference(model, ctl, reference, batch(1))


# -- token_drop_rate="auto" ----------------------------------------------------------------------------------------


def _probabilities_by_bisection(scores: list[float], keep: int) -> list[float]:
    """The reference's ``p_t = min(1, c * s_t)`` with ``sum p = keep``: ``c`` found by bisection (where fewer rows
    than ``keep`` have a score, each of them 1)."""
    if sum(s > 0 for s in scores) <= keep:
        return [1.0 if s > 0 else 0.0 for s in scores]
    low, high = 0.0, 1e12
    for _ in range(200):
        c = (low + high) / 2
        low, high = (c, high) if sum(min(1.0, c * s) for s in scores) < keep else (low, c)
    return [min(1.0, high * s) for s in scores]


def _reference_added_variance(norms: list[float], keep: int) -> float:
    p = _probabilities_by_bisection(norms, keep)
    return sum((1 / pt - 1) * n * n for pt, n in zip(p, norms, strict=True) if n > 0) / sum(n * n for n in norms)


def test_added_variance_is_the_hand_computed_one():
    norms = torch.rand(40, generator=torch.Generator().manual_seed(3)).pow(3) * 5
    norms[[4, 17]] = 0.0  # rows carrying no gradient add nothing
    keeps = (5, 10, 20, 30, 38, 40)
    got = added_variance(norms, norms, keeps)
    want = [_reference_added_variance(norms.tolist(), k) for k in keeps]
    assert torch.allclose(got, torch.tensor(want), rtol=1e-4, atol=1e-6), (got, want)
    assert float(got[-2]) == float(got[-1]) == 0.0  # keeping every row that carries gradient adds nothing


def test_random_rows_add_the_inverse_kept_share_less_one():
    norms = torch.rand(64, generator=torch.Generator().manual_seed(4)) + 0.1
    got = added_variance(norms, torch.ones(64), (16, 32, 48))
    assert torch.allclose(got, torch.tensor([64 / 16 - 1, 64 / 32 - 1, 64 / 48 - 1]))


def test_auto_keeps_the_fewest_rows_within_the_budget():
    readings = [3.0, 1.0, 0.5, 0.2, AUTO_VARIANCE_BUDGET, 0.05, 0.01, 0.0]
    assert auto_keep_share(readings) == AUTO_KEEP_SHARES[4]
    assert auto_keep_share([9.0] * 7 + [0.0]) == 1.0


def _branch_output_gradients(model: torch.nn.Module, names: list[str], ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each named branch's output gradient rows in a plain step (no dropbp), by tensor hooks."""
    grads, handles = {}, []
    modules = dict(model.named_modules())
    for name in names:

        def keep(module, args, output, name=name):
            y = output[0] if isinstance(output, tuple) else output
            y.register_hook(lambda g: grads.__setitem__(name, g.reshape(-1, g.shape[-1]).detach().clone()))

        handles.append(modules[name].register_forward_hook(keep))
    loss_and_grads(model, ids)
    for h in handles:
        h.remove()
    return grads


def test_auto_keeps_every_row_until_measured_then_the_fewest_its_readings_allow():
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    first, second = batch(1, size=2, length=16), batch(2, size=2, length=16)
    ctl = dropbp.apply(model, 0.0, seed=2, features=[dropbp.experimental.TokenDrops("auto")])
    _, got = loss_and_grads(model, first)
    weights = ctl.features["token_drops"].weights()
    rows = _branch_output_gradients(reference, list(weights), first)
    for name, w in weights.items():  # every row that carries gradient (not a sequence's last), weight 1
        assert torch.equal(w, (rows[name].norm(dim=1) > 0).float()), name
    _, want = loss_and_grads(reference, first)
    assert_same_grads(got, want, atol=1e-6)  # so the step is full backprop's
    loss_and_grads(model, second)
    for name, w in ctl.features["token_drops"].weights().items():
        norms = rows[name].float().norm(dim=1).tolist()
        readings = [_reference_added_variance(norms, keep_count(32, 1 - share)) for share in AUTO_KEEP_SHARES]
        share = next(s for s, r in zip(AUTO_KEEP_SHARES, readings, strict=True) if r <= AUTO_VARIANCE_BUDGET)
        assert int((w > 0).sum()) == keep_count(32, 1 - share), name


def test_leaving_auto_forgets_its_readings():
    """A fixed rate set after "auto" reads nothing more; back on "auto", every row is kept again until measured."""
    model = tiny_model("llama")
    ctl = dropbp.apply(model, 0.0, seed=2, features=[dropbp.experimental.TokenDrops("auto")])
    for step in range(3):
        loss_and_grads(model, batch(step, size=2, length=16))
    assert min(ctl.features["token_drops"].keep_shares().values()) < 1.0
    ctl.features["token_drops"].rate = 0.5
    loss_and_grads(model, batch(3, size=2, length=16))
    assert set(ctl.features["token_drops"].keep_shares().values()) == {0.5}
    ctl.features["token_drops"].rate = "auto"
    assert ctl.features["token_drops"].rate == "auto"  # given: in force from the next training forward
    assert set(ctl.features["token_drops"].keep_shares().values()) == {0.5}
    ids = batch(4, size=2, length=16)
    loss_and_grads(model, ids)
    assert set(ctl.features["token_drops"].keep_shares().values()) == {1.0}
    for name, w in (
        ctl.features["token_drops"].weights().items()
    ):  # every row but each sequence's last (no gradient), weight 1
        assert torch.equal(w, (w > 0).float()) and int((w > 0).sum()) == 30, name


@pytest.mark.parametrize("method", ["full", "lora"])
def test_auto_gradients_equal_the_reference_for_the_recorded_selection(method):
    model = _model("llama", method, checkpointing=False)
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.5, seed=6, features=[dropbp.experimental.TokenDrops("auto")])
    for step in range(4):
        ids = batch(step, size=2, length=12)
        _, got = loss_and_grads(model, ids)
        from conftest import detach_outputs

        handles = weighted_outputs(reference, ctl.features["token_drops"].weights()) + detach_outputs(
            reference, tuple(ctl.last_dropped)
        )
        _, want = loss_and_grads(reference, ids)
        for h in handles:
            h.remove()
        assert_same_grads(got, want, atol=1e-5)
    assert any(
        int((w > 0).sum()) < 24 for w in ctl.features["token_drops"].weights().values()
    )  # rows were dropped by then


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t["shares"].__setitem__(0, 0.3), r"token_drops'\]\['shares'\]\[0\] must be one of"),
        (lambda t: t["readings"].__setitem__(1, [0.1]), r"must hold 8 numbers"),
        (lambda t: t["shares"].pop(), r"has 5 entries, the state 6 branches"),
    ],
)
def test_a_bad_auto_state_is_refused_naming_the_field(edit, match):
    model = tiny_model("llama")
    ctl = dropbp.apply(model, 0.0, features=[dropbp.experimental.TokenDrops("auto")])
    loss_and_grads(model, batch(0))
    state = ctl.state_dict()
    before = copy.deepcopy(state)
    edit(state["token_drops"])
    with pytest.raises(ValueError, match=match):
        ctl.load_state_dict(state)
    assert ctl.state_dict() == before  # nothing loaded


def test_a_lazy_graph_device_gives_every_branch_one_share():
    in_force = [1.0, 0.5, 0.5, 1.0]
    chosen = {1: 0.25, 2: 0.75}  # branches 0 and 3 not read yet
    assert row_ops(_Lazy()).compiles_graphs and not row_ops(dropbp.backends.get("cpu")).compiles_graphs
    assert token_shares(in_force, chosen, one_share=True) == [0.75] * 4  # the policy decides
    assert token_shares(in_force, {}, one_share=True) == in_force
    assert token_shares(in_force, chosen, one_share=False) == [1.0, 0.25, 0.75, 1.0]


# -- on a GPU ------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("token_drop_rate", [0.5, "auto"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_cuda_gradients_equal_the_reference_for_the_recorded_selection(method, checkpointing, token_drop_rate):
    """The CUDA backend's gathered backward (fp32) against the reference, branch drops 0.5 beside it."""
    from conftest import detach_outputs

    model = _model("llama", method, checkpointing).cuda()
    reference = copy.deepcopy(model)
    ctl = apply_arm(model, 0.5, token_drop_rate=token_drop_rate, seed=6, backend="cuda")
    for step in range(4):
        ids = batch(step, size=2, length=12).cuda()
        _, got = loss_and_grads(model, ids)
        weights = ctl.features["token_drops"].weights()
        assert all(w.device.type == "cuda" for w in weights.values())
        handles = weighted_outputs(reference, weights) + detach_outputs(reference, tuple(ctl.last_dropped))
        _, want = loss_and_grads(reference, ids)
        for h in handles:
            h.remove()
        assert_same_grads(got, want, atol=2e-5)
    assert any(
        int((w > 0).sum()) < 24 for w in ctl.features["token_drops"].weights().values()
    )  # rows were dropped by then


class _Attention(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        scores = q @ k.transpose(-1, -2) / math.sqrt(x.shape[-1])
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        return self.o_proj(scores.masked_fill(causal, float("-inf")).softmax(-1) @ v)


class _MLP(torch.nn.Module):
    """An MLP branch written as users write them: ``"tuple"`` returns ``(output, None)``; ``"aux"`` returns
    ``(output, an auxiliary float tensor)`` the layer adds too (a router's or a gate's side output); ``"inplace"``
    applies ``ReLU(inplace=True)`` to its first linear map's output."""

    def __init__(self, width: int, kind: str) -> None:
        super().__init__()
        self.kind, self.up, self.down = kind, torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)
        self.act = torch.nn.ReLU(inplace=kind == "inplace")

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.up(x)
        y = self.down(self.act(hidden))
        if self.kind == "aux":
            return y, 0.1 * hidden.mean(-1, keepdim=True)
        return (y, None) if self.kind == "tuple" else y


class _Layer(torch.nn.Module):
    def __init__(self, width: int, kind: str, inplace_add: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn, self.mlp, self.inplace_add = _Attention(width), _MLP(width, kind), inplace_add

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        out = self.mlp(self.norm2(x))
        out, aux = out if isinstance(out, tuple) else (out, None)
        if aux is not None:
            x = x + aux
        if self.inplace_add:  # Falcon's ``mlp_output += attention_output``: the branch output modified in place
            out += x
            return out
        return x + out


class _Custom(torch.nn.Module):
    """A small causal LM of _Layer, each layer under non-re-entrant activation checkpointing when asked."""

    def __init__(self, kind: str, inplace_add: bool, checkpointing: bool, width: int = 16, vocab: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)
        self.layers = torch.nn.ModuleList(_Layer(width, kind, inplace_add) for _ in range(2))
        self.checkpointing = checkpointing

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        from types import SimpleNamespace

        from torch.utils.checkpoint import checkpoint

        x = self.embed(input_ids)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointing else layer(x)
        logits = self.head(x)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
@pytest.mark.parametrize(("kind", "inplace_add"), [("tuple", False), ("inplace", False), ("plain", True)])
def test_branches_written_as_users_write_them_train_exactly_under_token_drops(kind, inplace_add, checkpointing):
    """An MLP branch returning a tuple (checkpointed: it is recomputed on its kept rows, and every parameter still gets
    its gradient), ``ReLU(inplace=True)`` after a row-gathered linear map, and the branch output modified in place
    after it (Falcon's add): each trains with token drops as without, equal to the reference."""
    model = _Custom(kind, inplace_add, checkpointing)
    reference = copy.deepcopy(model)
    names = [f"layers.{i}.{part}" for i in range(2) for part in ("attn", "mlp")]
    ctl = dropbp.apply(model, 0.0, branches=names, features=[dropbp.experimental.TokenDrops(0.5)])
    for step in range(3):
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))
        _matches_reference(model, ctl, reference, ids)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and bool(g.abs().sum() > 0) for n, g in grads.items() if "mlp" in n)


def test_a_checkpointed_branch_returning_an_auxiliary_tensor_trains_as_without_checkpointing():
    """Issue 71, class G: an MLP branch that returns an auxiliary float tensor beside its output (a gate's or router's
    side output the layer uses) cannot be recomputed on the kept rows of its one output; under non-re-entrant
    checkpointing it runs again with autograd on every row, its output's rows selected: the same gradients as without
    checkpointing, step by step (it was refused)."""
    plain, checkpointed = _Custom("aux", False, checkpointing=False), _Custom("aux", False, checkpointing=True)
    names = [f"layers.{i}.{part}" for i in range(2) for part in ("attn", "mlp")]
    controllers = [
        dropbp.apply(m, 0.0, seed=4, branches=names, features=[dropbp.experimental.TokenDrops(0.5)])
        for m in (plain, checkpointed)
    ]
    for step in range(3):
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))
        (loss, want), (ck_loss, got) = (loss_and_grads(m, ids) for m in (plain, checkpointed))
        torch.testing.assert_close(ck_loss, loss, atol=1e-6, rtol=0)
        assert_same_grads(got, want, atol=1e-6)
    assert all(c.features["token_drops"].weights() for c in controllers)  # rows were selected


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
def test_falcon_whose_layer_adds_in_place_to_the_mlp_output_trains_exactly(checkpointing):
    """Falcon (a recognised architecture) adds the attention output to the MLP's output in place: with token drops it
    trains, equal to the reference, as with branch drops alone."""
    model = tiny_model("falcon", layers=2, hidden_size=32, num_attention_heads=4)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="full rows"):  # Falcon's own linear class: its backward is not gathered
        ctl = dropbp.apply(model, 0.0, features=[dropbp.experimental.TokenDrops(0.5)])
        for step in range(2):
            _matches_reference(model, ctl, reference, batch(step))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("change", [("rate", 0.0), ("rate", "auto"), ("rate", 0.75), ("selection", "random")])
def test_settings_changed_between_a_forward_and_its_backward_take_effect_at_the_next_step(reentrant, change):
    """A backward under way (and checkpointing's recomputation in it) keeps its forward's settings: no CheckpointError,
    the gradients of the forward's own selection; the change is in force from the next training forward."""
    model = _model("llama", "full", checkpointing=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.0, seed=1, features=[dropbp.experimental.TokenDrops(0.5)])
    tokens = ctl.features["token_drops"]
    ids = batch(0, size=2, length=12)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    loss = model(input_ids=ids, labels=ids).loss
    setattr(tokens, *change)  # between the forward and its backward
    loss.backward()
    got = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    weights = tokens.weights()
    assert weights and all(int((w > 0).sum()) == keep_count(24, 0.5) for w in weights.values())
    handles = weighted_outputs(reference, weights)
    _, want = loss_and_grads(reference, ids)
    for h in handles:
        h.remove()
    assert_same_grads(got, want, atol=1e-5)
    assert getattr(tokens, change[0]) == change[1]
    loss_and_grads(model, batch(1, size=2, length=12))  # the next step: the change in force
    if change == ("rate", 0.75):
        assert all(int((w > 0).sum()) == keep_count(24, 0.75) for w in tokens.weights().values())
    if change == ("rate", "auto"):
        assert set(tokens.keep_shares().values()) == {1.0}


def test_the_noise_scale_beside_token_drops_is_said_to_count_their_variance():
    features = [dropbp.NoiseScale(), dropbp.experimental.TokenDrops(0.5)]
    with pytest.warns(UserWarning, match=r"counts their row sampling's variance as data noise.*TokenDrops\(0.0\)"):
        dropbp.apply(tiny_model("llama", layers=2), 0.5, features=features)
