"""QLoRA: a Llama with bitsandbytes nf4 4-bit linear layers and PEFT LoRA. A dropped step's gradients
are exactly those of the unmodified 4-bit model with the dropped branch outputs detached, as for the
Hugging Face models in test_gradients.py; and ``dropbp bench --methods qlora`` builds and runs it.

Every 4-bit model here is built as on a CPU with AVX512-BF16 (bitsandbytes' check of the CPU's flags
answers yes), whatever this machine's CPU: there an eval forward would repack the 4-bit weights for
inference and break training, which dropbp's QLoRA models must survive.

Skipped, with the reason, where bitsandbytes is not installed (``pip install 'dropbp[qlora]'``)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import assert_same_grads, batch, detach_outputs, loss_and_grads, tiny_model, with_lora

import dropbp

bnb = pytest.importorskip(
    "bitsandbytes", reason="QLoRA needs bitsandbytes: pip install 'dropbp[qlora]'", exc_type=ImportError
)

from dropbp.tools.qlora import count_4bit_layers, four_bit_layers, keep_4bit_trainable, quantize_4bit  # noqa: E402


def as_on_avx512bf16(patch: pytest.MonkeyPatch) -> None:
    """4-bit layers built from now on take this CPU for one with AVX512-BF16 (recent bitsandbytes reads the
    flag once, in ``Linear4bit.__init__``; older releases have no such check and nothing to patch)."""
    if hasattr(bnb.nn.modules, "has_avx512bf16"):
        patch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)


@pytest.fixture(scope="module")
def qlora_model():
    """A 3-layer random Llama with nf4 4-bit linear layers and LoRA (non-zero B) on every one."""
    with pytest.MonkeyPatch.context() as patch:
        as_on_avx512bf16(patch)
        model = quantize_4bit(tiny_model("llama", layers=3), torch.float32)
    assert count_4bit_layers(model) == 3 * 7  # q k v o, gate up down per layer; the LM head stays
    return with_lora(model)


@pytest.mark.parametrize("pattern", ["cut", "uniform"])
def test_4bit_lora_gradients_equal_detached_reference(qlora_model, pattern):
    model = copy.deepcopy(qlora_model)
    reference = copy.deepcopy(qlora_model)
    ctl = dropbp.apply(model, 0.5, seed=3, pattern=pattern)
    modules = dict(model.named_modules())
    seen = set()
    for step in range(6):
        ids = batch(step)
        loss, grads = loss_and_grads(model, ids)
        dropped = ctl.last_dropped
        assert dropped == ctl.dropped_at(step)
        seen.add(len(dropped))
        handles = detach_outputs(reference, dropped)
        ref_loss, ref_grads = loss_and_grads(reference, ids)
        for h in handles:
            h.remove()
        assert torch.equal(loss, ref_loss)
        assert_same_grads(grads, ref_grads, atol=0)
        for name in dropped:  # a dropped branch's adapters get no gradient; the 4-bit weights never do
            for pname, _ in modules[name].named_parameters():
                assert grads[f"{name}.{pname}"] is None, f"{name}.{pname}"
        assert all(grads[n] is None for n, p in model.named_parameters() if isinstance(p, bnb.nn.Params4bit))
    assert max(seen) > 0 and min(seen) < len(ctl.branches)


def test_4bit_lora_drop_rate_zero_changes_nothing(qlora_model):
    model = copy.deepcopy(qlora_model)
    ctl = dropbp.apply(model, 0.0, pattern="uniform")
    ids = batch()
    loss, grads = loss_and_grads(model, ids)
    ref_loss, ref_grads = loss_and_grads(qlora_model, ids)
    assert ctl.last_dropped == ()
    assert torch.equal(loss, ref_loss)
    assert_same_grads(grads, ref_grads, atol=0)
    assert all(g is not None for n, g in grads.items() if "lora_" in n)


def test_bench_qlora_model_is_4bit_with_only_lora_trainable():
    from dropbp.tools.bench import build_model

    lora = build_model("tiny", "lora", 16, torch.float32, torch.device("cpu"))
    qlora = build_model("tiny", "qlora", 16, torch.float32, torch.device("cpu"))
    layers = lora.config.num_hidden_layers
    assert count_4bit_layers(lora) == 0 and count_4bit_layers(qlora) == 7 * layers
    trainable = {n for n, p in qlora.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert trainable == {n for n, p in lora.named_parameters() if p.requires_grad}  # the same adapters
    assert qlora.training


def test_bench_runs_qlora_and_writes_results(tmp_path, capsys):
    from dropbp.tools import cli

    argv = ["bench", "--presets", "tiny", "--methods", "lora", "qlora", "--rates", "0.5", "--seq-lens", "16"]
    argv += ["--batch-sizes", "1", "--rounds", "1", "--warmup", "0", "--patterns", "uniform", "cut"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench.json").read_text())
    assert [p["method"] for p in results["points"]] == ["lora", "qlora"]
    lora, qlora = results["points"]
    assert qlora["trainable_parameters"] == lora["trainable_parameters"]
    assert qlora["parameters"] == lora["parameters"]  # a 4-bit weight counted by its shape
    assert lora["four_bit_layers"] == 0 and lora["baseline"]["dequantize_s"] is None
    assert qlora["four_bit_layers"] == 7 * 4 and qlora["baseline"]["dequantize_s"] > 0  # tiny: 4 layers
    for row in qlora["rows"]:
        assert row["efficiency"] > 0 and row["ideal_step_s"] > 0
    out = capsys.readouterr().out
    assert "| tiny | qlora | 16 | 1 | baseline |" in out and "(28 4-bit layers)" in out


def test_lockstep_comparison_trains_4bit_copies_alike(qlora_model):
    """The convergence benchmark's engine on a 4-bit model: every run trains its own copy from the
    same start; full backprop twice gives the same curve, and DropBP at rate 0 the same again."""
    from dropbp import backends
    from dropbp.tools.compare import Run, compare
    from dropbp.tools.textdata import TokenData

    g = torch.Generator().manual_seed(0)
    data = TokenData(torch.randint(3, 96, (16, 12), generator=g), torch.randint(3, 96, (4, 12), generator=g))
    runs = [Run("full backprop"), Run("again"), Run("rate 0", 0.0), Run("DropBP 0.5", 0.5, pattern="cut")]
    cpu = backends.get("cpu")
    results = compare(qlora_model, runs, data, steps=3, lr=1e-2, batch_size=4, backend=cpu, eval_every=1)
    base, again, rate0, dropbp_run = (r.val_loss for r in results)
    assert base == again == rate0 and base[-1] != base[0]  # the adapters trained
    assert dropbp_run[0] == base[0] and len(dropbp_run) == len(base)


def test_convergence_qlora_takes_loras_learning_rate_without_its_own_sweep(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "convergence.py"
    spec = importlib.util.spec_from_file_location("convergence_bench", path)
    convergence = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convergence)
    runs = [{"val_loss": [3.0, 2.0], "config": {"lr": 1e-3}}, {"val_loss": [3.0, 2.5], "config": {"lr": 1e-4}}]
    sweep = {"runs": runs}
    (tmp_path / "convergence_lr_lora_pydoc.json").write_text(json.dumps(sweep))
    assert convergence.swept_lr(tmp_path, "qlora") == 1e-3
    sweep["runs"][0]["val_loss"][-1] = 2.9  # a sweep of its own wins
    (tmp_path / "convergence_lr_qlora_pydoc.json").write_text(json.dumps(sweep))
    assert convergence.swept_lr(tmp_path, "qlora") == 1e-4


def test_an_evaluation_leaves_4bit_layers_trainable(qlora_model, monkeypatch):
    """bitsandbytes repacks a 4-bit weight for CPU inference, in place, at an eval forward without gradients when
    the layer's ``support_avx512bf16_for_cpu`` is set; training forwards then fail. The QLoRA models dropbp builds
    have it off, so an evaluation changes nothing and training goes on with the same gradients."""
    if not hasattr(bnb.nn.modules, "_convert_weight_packed_for_cpu"):
        pytest.skip(f"bitsandbytes {bnb.__version__} has no CPU inference repack")
    calls = []

    def repack(*args, **kwargs):  # the repack bitsandbytes would run; raising keeps its kernels out of the test
        calls.append(args)
        raise RuntimeError("repacked for inference")

    monkeypatch.setattr(bnb.nn.modules, "_convert_weight_packed_for_cpu", repack)
    model, reference = copy.deepcopy(qlora_model), copy.deepcopy(qlora_model)
    ids = batch()
    ref_loss, ref_grads = loss_and_grads(reference, ids)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    assert calls == []
    model.train()
    loss, grads = loss_and_grads(model, ids)
    assert torch.equal(loss, ref_loss)
    assert_same_grads(grads, ref_grads, atol=0)

    layers = four_bit_layers(model)  # the switch the fix relies on: with it on, bitsandbytes repacks
    for layer in layers:
        layer.support_avx512bf16_for_cpu = True
    model.eval()
    with torch.no_grad(), pytest.raises(RuntimeError, match="repacked for inference"):
        model(input_ids=ids)
    keep_4bit_trainable(model)
    with torch.no_grad():
        model(input_ids=ids)
    assert len(calls) == 1
