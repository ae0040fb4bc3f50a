"""dropbp.apply on every supported architecture: branch discovery, FLOPs, invisibility to the model's
own contracts (state dict, isinstance, PEFT, save_pretrained), state round trips, bad input."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from conftest import TINY_CONFIGS, batch, loss_and_grads, tiny_model, with_lora

import dropbp
from dropbp.execution.discovery import TYPICAL_SEQ_LEN, flops_at_length
from dropbp.options import DropBPOptions
from dropbp.policy.allocation import cut_rates
from dropbp.policy.drop_policy import DropPolicy

EXPECTED_BRANCHES = {
    "llama": ("model.layers.{}.self_attn", "model.layers.{}.mlp"),
    "mistral": ("model.layers.{}.self_attn", "model.layers.{}.mlp"),
    "qwen2": ("model.layers.{}.self_attn", "model.layers.{}.mlp"),
    "qwen3": ("model.layers.{}.self_attn", "model.layers.{}.mlp"),
    "gemma": ("model.layers.{}.self_attn", "model.layers.{}.mlp"),
    "phi3": ("model.layers.{}.self_attn", "model.layers.{}.mlp"),
    "gpt2": ("transformer.h.{}.attn", "transformer.h.{}.mlp"),
    "gpt_neox": ("gpt_neox.layers.{}.attention", "gpt_neox.layers.{}.mlp"),
}


def _expected(arch: str, layers: int, prefix: str = "") -> list[str]:
    attn, mlp = EXPECTED_BRANCHES[arch]
    return [prefix + t.format(i) for i in range(layers) for t in (attn, mlp)]


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_finds_attention_and_mlp_of_every_layer(arch):
    model = tiny_model(arch, layers=3)
    ctl = dropbp.apply(model, 0.5)
    assert [b.name for b in ctl.branches] == _expected(arch, 3)
    assert [b.kind for b in ctl.branches] == ["attn", "mlp"] * 3
    flops = [b.flops for b in ctl.branches]
    assert all(f > 0 for f in flops)
    # the default shape: cuts, with rates falling with depth to 0 at the top, FLOP-weighted mean 0.5
    assert ctl.pattern == "cut" and ctl.rates == cut_rates(flops, 0.5) and ctl.rates[-1] == 0.0
    assert sum(r * f for r, f in zip(ctl.rates, flops, strict=True)) / sum(flops) == pytest.approx(0.5)
    seen = set()
    for step in range(12):
        loss_and_grads(model, batch(step))  # a training step runs
        seen.add(ctl.last_dropped)
        assert list(ctl.last_dropped) == [b.name for b in ctl.branches[: len(ctl.last_dropped)]]
    assert len(seen) > 2


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_finds_branches_under_peft_lora(arch):
    model = with_lora(tiny_model(arch, layers=2))
    ctl = dropbp.apply(model, 0.5, pattern="uniform")
    assert [b.name for b in ctl.branches] == _expected(arch, 2, prefix="base_model.model.")
    plain = dropbp.apply(tiny_model(arch, layers=2), 0.5, pattern="uniform")
    assert [b.flops for b in ctl.branches] == [b.flops for b in plain.branches]  # adapters not counted


def test_flops_follow_mission_formulas():
    model = tiny_model("llama", layers=1)  # h=32, 4 q heads, 2 kv heads, d=8, I=64
    with flops_at_length(100):
        ctl = dropbp.apply(model, 0.5, pattern="uniform")
        gpt2 = dropbp.apply(tiny_model("gpt2", layers=1), 0.5, pattern="uniform")
    h, nq, nkv, d, inter, s = 32, 4, 2, 8, 64, 100
    attn = 2 * (h * (nq + 2 * nkv) * d + nq * d * h) + 4 * s * nq * d
    assert [b.flops for b in ctl.branches] == [attn, 2 * 3 * h * inter]
    assert [b.flops for b in gpt2.branches] == [2 * (32 * 96 + 32 * 32) + 4 * 100 * 32, 2 * 2 * 32 * 128]
    default = dropbp.apply(tiny_model("llama", layers=1), 0.5, pattern="uniform")  # outside: a typical length
    assert default.branches[0].flops == attn - 4 * s * nq * d + 4 * TYPICAL_SEQ_LEN * nq * d
    with pytest.raises(ValueError, match="seq_len must be an int >= 1"), flops_at_length(0):
        pass


@pytest.mark.parametrize("method", ["full", "lora"])
def test_model_contracts_unchanged(method, tmp_path):
    base = tiny_model("llama", layers=2)
    model = with_lora(base) if method == "lora" else base
    keys = list(model.state_dict())
    classes = {n: type(m) for n, m in model.named_modules()}
    model.save_pretrained(tmp_path / "before")
    ctl = dropbp.apply(model, 0.5, pattern="uniform")
    loss_and_grads(model, batch())
    assert list(model.state_dict()) == keys
    assert {n: type(m) for n, m in model.named_modules()} == classes
    if method == "lora":
        assert (
            model.peft_config["default"].target_modules
            == with_lora(tiny_model("llama", 2)).peft_config["default"].target_modules
        )
    model.save_pretrained(tmp_path / "after")
    before = sorted(p.relative_to(tmp_path / "before") for p in (tmp_path / "before").rglob("*"))
    after = sorted(p.relative_to(tmp_path / "after") for p in (tmp_path / "after").rglob("*"))
    assert before == after
    for rel in before:
        a, b = tmp_path / "before" / rel, tmp_path / "after" / rel
        if a.is_file():
            assert a.read_bytes() == b.read_bytes(), rel
    ctl.remove()


def test_state_dict_round_trip_continues_the_same_patterns():
    model = tiny_model("llama", layers=4)
    ctl = dropbp.apply(model, 0.5, seed=9, pattern="uniform")
    ctl.set_rates([0.1, 0.7, 0.2, 0.6, 0.3, 0.5, 0.4, 0.8])
    for step in range(3):
        loss_and_grads(model, batch(step))
    state = copy.deepcopy(ctl.state_dict())
    continued = []
    for step in range(3, 8):
        loss_and_grads(model, batch(step))
        continued.append(ctl.last_dropped)

    fresh = tiny_model("llama", layers=4)
    resumed = dropbp.apply(fresh, 0.5, seed=0, pattern="uniform")
    resumed.load_state_dict(state)
    assert resumed.rates == ctl.rates and resumed.seed == 9 and resumed.step == 3
    again = []
    for step in range(3, 8):
        loss_and_grads(fresh, batch(step))
        again.append(resumed.last_dropped)
    assert again == continued


def test_cut_state_round_trip_and_resume_continue_the_same_patterns():
    model = tiny_model("llama", layers=4)
    ctl = dropbp.apply(model, 0.5, seed=9, warmup_steps=4)
    for step in range(3):
        loss_and_grads(model, batch(step))
    state = copy.deepcopy(ctl.state_dict())
    assert state["pattern"] == "cut"
    continued = []
    for step in range(3, 10):
        loss_and_grads(model, batch(step))
        continued.append(ctl.last_dropped)
    assert len(set(continued)) > 1

    fresh = tiny_model("llama", layers=4)
    resumed = dropbp.apply(fresh, 0.25, seed=0, pattern="uniform")
    resumed.load_state_dict(state)
    assert (resumed.pattern, resumed.rates, resumed.seed, resumed.step) == ("cut", ctl.rates, 9, 3)
    again = []
    for step in range(3, 10):
        loss_and_grads(fresh, batch(step))
        again.append(resumed.last_dropped)
    assert again == continued


def test_calibration_is_for_the_uniform_shape_only():
    model = tiny_model("llama", layers=3)
    ids = batch()
    ctl = dropbp.apply(model, 0.5)
    before = ctl.rates
    with pytest.raises(ValueError, match=r"pattern='cut' cannot realise.*ctl.pattern = 'uniform'"):
        ctl.calibrate(lambda: model(input_ids=ids, labels=ids).loss)
    assert ctl.rates == before
    ctl.pattern = "uniform"
    assert ctl.rates == [0.5] * 6
    ctl.calibrate(lambda: model(input_ids=ids, labels=ids).loss)
    assert ctl.rates != [0.5] * 6


def test_a_cut_the_model_is_too_small_for_says_what_to_do():
    # two equal branches: a cut keeps the top one, so at most half the FLOPs (0.375 under the cap) drop
    with pytest.raises(ValueError, match=r"cannot be reached by cuts.*at most 0.3750.*pattern='uniform'"):
        DropPolicy([1.0, 1.0], DropBPOptions(0.5))
    assert DropPolicy([1.0, 1.0], DropBPOptions(0.5, pattern="uniform")).rates == [0.5, 0.5]


def test_two_controllers_with_one_seed_agree_every_step():
    a = dropbp.apply(tiny_model("gpt2"), 0.5, seed=4, pattern="uniform")
    b = dropbp.apply(tiny_model("gpt2"), 0.5, seed=4, pattern="uniform")
    assert [a.dropped_at(s) for s in range(30)] == [b.dropped_at(s) for s in range(30)]


def test_no_grad_training_forward_does_not_draw():
    model = tiny_model("llama")
    ctl = dropbp.apply(model, 0.5, pattern="uniform")
    with torch.no_grad():
        model(input_ids=batch())
    assert ctl.step == 0


def test_max_patterns_bounds_patterns_through_apply():
    model = tiny_model("llama", layers=4)
    ctl = dropbp.apply(model, 0.5, max_patterns=3, pattern="uniform")
    seen = set()
    for step in range(12):
        loss_and_grads(model, batch(step))
        seen.add(ctl.last_dropped)
    assert 1 <= len(seen) <= 3


def test_unknown_architecture_with_branch_like_children_warns(caplog):
    model = tiny_model("llama", layers=2)
    model.config.model_type = "my_llama_fork"
    with caplog.at_level(logging.WARNING, logger="dropbp"):
        ctl = dropbp.apply(model, 0.5, pattern="uniform")
    assert len(ctl.branches) == 4
    assert "not among the tested architectures" in caplog.text


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rate, error, match",
    [
        (1.0, ValueError, r"drop_rate must be in \[0, 1\), got 1.0"),
        (-0.5, ValueError, r"drop_rate must be in \[0, 1\)"),
        (math.nan, ValueError, r"drop_rate must be in \[0, 1\), got nan"),
        ("0.5", TypeError, "drop_rate must be a number"),
        (True, TypeError, "drop_rate must be a number"),
        (None, TypeError, "drop_rate must be a number"),
    ],
)
def test_bad_drop_rate(rate, error, match):
    with pytest.raises(error, match=match):
        dropbp.apply(tiny_model("llama"), rate, pattern="uniform")


def test_rate_that_would_drop_everything_is_refused():
    with pytest.raises(ValueError, match="drop every branch.*at most 0.75"):
        dropbp.apply(tiny_model("llama", layers=2), 0.875, pattern="uniform")


def test_non_module_is_refused():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        dropbp.apply({}, 0.5, pattern="uniform")


def test_model_without_branches_explains_branches_argument():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(ValueError, match=r"looked for.*self_attn.*mlp.*branches=\["):
        dropbp.apply(model, 0.5, pattern="uniform")


@pytest.mark.parametrize(
    "branches, error, match",
    [
        (["model.layers.0.nope"], ValueError, r"does not have: \['model.layers.0.nope'\]"),
        ([], ValueError, "branches is empty"),
        ("model.layers.0.mlp", TypeError, "branches must be a list"),
        ([3], TypeError, "module names"),
        (["model.layers.0.mlp", "model.layers.0.mlp"], ValueError, "more than once"),
        (
            ["model.layers.0", "model.layers.1"],
            ValueError,
            r"'model.layers.0', which is a whole residual layer \('model.layers.0', a LlamaDecoderLayer\) that adds "
            r"the residual itself.*\['model.layers.0.self_attn', 'model.layers.0.mlp'\].*Which modules are branches",
        ),
        (["model.layers"], ValueError, r"'model.layers', which holds a whole residual layer \('model.layers.0'"),
        (["model.layers.0.mlp", "model.layers.0.mlp.down_proj"], ValueError, "inside it: branches must not nest"),
    ],
)
def test_bad_branch_names(branches, error, match):
    with pytest.raises(error, match=match):
        dropbp.apply(tiny_model("llama"), 0.5, branches=branches, pattern="uniform")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"seed": -1}, ValueError, "seed must be an int >= 0"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
        ({"max_patterns": 0}, ValueError, "max_patterns must be an int >= 1"),
        ({"seq_len": 64}, TypeError, r"seq_len \(dropbp 0.4\): .*flops_at_length"),
    ],
)
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        dropbp.apply(tiny_model("llama"), 0.5, **kwargs, pattern="uniform")


def test_a_model_with_nothing_to_train_is_refused_with_what_to_do():
    model = tiny_model("llama").requires_grad_(False)
    with pytest.raises(ValueError, match=r"no parameter of this LlamaForCausalLM requires a gradient.*add LoRA"):
        dropbp.apply(model, 0.5)
    model.model.layers[0].mlp.down_proj.weight.requires_grad_(True)  # one trainable tensor is enough
    dropbp.apply(model, 0.5)
    ids = batch()
    model(input_ids=ids, labels=ids).loss.backward()  # its branch is never dropped: the only trainable one
    assert model.model.layers[0].mlp.down_proj.weight.grad is not None


def test_bad_rates_and_state():
    ctl = dropbp.apply(tiny_model("llama", layers=2), 0.5, pattern="uniform")
    with pytest.raises(ValueError, match="expected 4, got 3"):
        ctl.set_rates([0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=r"rates\[0\] must be in \[0, 1\)"):
        ctl.set_rates([1.2, 0.2, 0.3, 0.1])
    other = dropbp.apply(tiny_model("llama", layers=3), 0.5, pattern="uniform").state_dict()
    with pytest.raises(ValueError, match="saved for different branches"):
        ctl.load_state_dict(other)
    with pytest.raises(ValueError, match="missing keys"):
        ctl.load_state_dict({"rates": [0.1] * 4})


def test_applying_twice_is_refused_and_removed_controller_is_inert():
    model = tiny_model("llama")
    ctl = dropbp.apply(model, 0.5, pattern="uniform")
    with pytest.raises(RuntimeError, match="already attached"):
        dropbp.apply(model, 0.5, pattern="uniform")
    ctl.remove()
    ctl.remove()  # idempotent
    with pytest.raises(RuntimeError, match="was removed"):
        ctl.set_rates([0.1] * 6)


def test_never_drops_every_trainable_branch():
    peft = pytest.importorskip("peft")
    base = tiny_model("llama", layers=2)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).train()
    ctl = dropbp.apply(model, 0.5, seed=1, pattern="uniform")
    attention = {b.name for b in ctl.branches if b.kind == "attn"}
    # the same settings' patterns without the guard (no trainable-branch test given)
    raw = DropPolicy([b.flops for b in ctl.branches], ctl.options)
    raw_all_attention = 0
    for step in range(200):
        if attention <= {ctl.branches[i].name for i in raw.draw(step)}:
            raw_all_attention += 1
        ids = batch(step % 5)
        loss = model(input_ids=ids, labels=ids).loss
        assert loss.requires_grad, f"step {step}: every trainable branch dropped"
        assert not attention <= set(ctl.last_dropped)
        model.zero_grad()
    assert raw_all_attention > 10  # the guard was needed, not just lucky


def test_param_groups_compensate_learning_rates():
    model = tiny_model("llama", layers=2)
    ctl = dropbp.apply(model, 0.5, pattern="uniform")
    groups = dropbp.experimental.param_groups(ctl, 1e-3, weight_decay=0.0)
    assert groups[0]["dropbp_branch"] is None and groups[0]["lr"] == 1e-3
    assert [g["dropbp_branch"] for g in groups[1:]] == [0, 1, 2, 3]
    assert all(g["lr"] == pytest.approx(2e-3) and g["weight_decay"] == 0.0 for g in groups[1:])
    covered = [id(p) for g in groups for p in g["params"]]
    assert sorted(covered) == sorted(id(p) for p in model.parameters()) and len(set(covered)) == len(covered)
    opt = torch.optim.AdamW(groups)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    ctl.set_rates([0.0, 0.75, 0.5, 0.25])
    dropbp.experimental.update_param_groups(ctl, opt, sched)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4, 5e-4, 2e-3, 1e-3, 2e-3 / 3])
    sched.step()  # schedulers recompute from the rescaled base_lrs
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4, 5e-4, 2e-3, 1e-3, 2e-3 / 3])
