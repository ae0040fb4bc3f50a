"""Tiny random-weight Hugging Face models (nothing is downloaded) and gradient helpers."""

from __future__ import annotations

import copy
import importlib
import json
import logging
import os
import subprocess
import sys
import traceback
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    "mistral": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    "qwen2": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    "gemma": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    "phi3": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2),
    "gpt2": dict(n_embd=32, n_head=4, n_positions=64),
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, use_parallel_residual=True),
}


def tiny_model(model_type: str, layers: int = 3, seed: int = 0, **overrides) -> nn.Module:
    """A randomly initialised causal LM of ``model_type`` with ``layers`` decoder layers."""
    kwargs = {**_COMMON, **TINY_CONFIGS.get(model_type, {}), **overrides}
    kwargs["n_layer" if model_type == "gpt2" else "num_hidden_layers"] = layers
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.train()


def with_lora(model: nn.Module) -> nn.Module:
    """Wrap in PEFT LoRA on every linear layer, with non-zero B so every adapter gets a gradient."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(1)
    return peft.get_peft_model(model, config).train()


def import_or_reason(name: str, why: str) -> tuple[ModuleType | None, str]:
    """Module ``name``, or None and the reason its tests skip: the import error, then ``why`` (for a framework
    tested in an environment of its own, which script runs them there)."""
    try:
        return importlib.import_module(name), ""
    except ImportError as err:  # not installed, or installed but unable to import here
        return None, f"{name} is not importable ({err}); {why}"


def assert_framework_run(run: subprocess.CompletedProcess, checkpoint: Path) -> None:
    """A framework's own 20-step run of :func:`save_tiny_llama`'s model (seed 7, a log every 5 steps, uniform
    patterns calibrated once) ended well: DropBP's state beside ``checkpoint``, one calibration and the drop
    figures of 4 logging steps in its ``log_history``."""
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    state = json.loads((checkpoint / "dropbp_state.json").read_text())
    assert state["calibrated"] and state["controller"]["seed"] == 7 and state["controller"]["step"] == 20
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    assert len([h for h in history if "dropbp/rate_mean" in h]) == 1
    drops = [h for h in history if "dropbp/dropped_branches" in h]
    assert len(drops) == 4 and all(0 < h["dropbp/dropped_branches"] < 8 for h in drops)


def save_tiny_llama(folder) -> None:
    """A tiny random Llama (4 layers) and a word-level tokenizer over its vocabulary (``w0`` .. ``w95``), saved in
    ``folder`` as a local model a framework loads by path (nothing downloaded)."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w3"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tiny_model("llama", layers=4).save_pretrained(folder)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="w0", bos_token="w1", eos_token="w2", unk_token="w3"
    ).save_pretrained(folder)


def word_rows(rows: int = 64, words: int = 30) -> list[str]:
    """Texts of the saved tokenizer's words, one per row, for a local dataset."""
    return [" ".join(f"w{3 + (7 * i + 5 * j) % (VOCAB - 3)}" for j in range(words)) for i in range(rows)]


def batch(seed: int = 0, size: int = 2, length: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (size, length), generator=g)


def loss_and_grads(model: nn.Module, ids: torch.Tensor, rng_seed: int = 123) -> tuple[torch.Tensor, dict]:
    """One forward/backward with fixed randomness; returns the loss and {name: grad or None}."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(rng_seed)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def weighted_outputs(model: nn.Module, weights: dict[str, torch.Tensor]) -> list:
    """The token-drop reference: each named module's output (its first tensor, for a tuple) with its gradient multiplied
    row by row by ``weights[name]`` (the same values forward); returns the hooks' handles. It never imports dropbp."""

    def hook(w: torch.Tensor):
        def weighted(module, args, output):
            y = output[0] if isinstance(output, tuple) else output
            scale = w.to(y.dtype).view(*y.shape[:-1], 1)
            y = y.detach() + (scale * y - (scale * y).detach())
            return (y, *output[1:]) if isinstance(output, tuple) else y

        return weighted

    modules = dict(model.named_modules())
    return [modules[name].register_forward_hook(hook(w)) for name, w in weights.items()]


def detach_outputs(model: nn.Module, names: tuple[str, ...]) -> list:
    """The hand-written reference: detach the output of each named module after it runs."""

    def detach(module, args, output):
        if isinstance(output, tuple):
            return tuple(o.detach() if torch.is_tensor(o) else o for o in output)
        return output.detach()

    modules = dict(model.named_modules())
    return [modules[n].register_forward_hook(detach) for n in names]


def weight_branch_grads(grads: dict, branch: str, weight: float, parts: tuple[str, ...] = ()) -> None:
    """Multiply, in place, the gradient of every parameter inside ``branch`` (and the modules ``parts``, a
    post-norm tail) by ``weight``: the hand-written importance weights of a kept branch."""
    for name in grads:
        if grads[name] is not None and any(name.startswith(f"{m}.") for m in (branch, *parts)):
            grads[name] = grads[name] * weight


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def summed_loss_and_grads(model: nn.Module, inputs: list, *, ctl=None, patterns=None, loss=lm_loss, rng_seed=123):
    """Several forwards, then one backward of their summed loss (DPO, contrastive, multi-task losses).

    Under DropBP pass its ``ctl``: each forward's ``ctl.last_dropped`` is returned too. For the
    hand-written reference pass ``patterns``: forward ``i`` detaches the outputs of the modules named in
    ``patterns[i]`` (:func:`detach_outputs`). Returns the summed loss, {name: grad or None}, the patterns.
    """
    model.zero_grad(set_to_none=True)
    torch.manual_seed(rng_seed)
    total, seen = 0.0, []
    for i, x in enumerate(inputs):
        handles = [] if patterns is None else detach_outputs(model, patterns[i])
        total = total + loss(model, x)
        for h in handles:
            h.remove()
        if ctl is not None:
            seen.append(ctl.last_dropped)
    total.backward()
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    return total.detach(), grads, seen


def assert_same_grads(got: dict, want: dict, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for name in want:
        g, w = got[name], want[name]
        assert (g is None) == (w is None), f"{name}: gradient presence differs ({g is None} vs {w is None})"
        if w is not None:
            torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def count_forwards(monkeypatch, modules: dict[str, nn.Module]) -> Counter:
    """Count the runs of each module's own ``forward`` (its class method), by module name: a branch recomputed
    by checkpointing runs twice."""
    counts: Counter = Counter()
    names = {id(m): n for n, m in modules.items()}
    for cls in {type(m) for m in modules.values()}:

        def counted(self, *args, _real=cls.forward, **kwargs):
            counts[names.get(id(self))] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "forward", counted)
    return counts


@pytest.fixture
def clone():
    return copy.deepcopy


def _rank_entry(target, rank: int, *args) -> None:
    """Run one rank, then leave with ``os._exit``: exit code 0 when ``target`` returned, 1 (traceback printed) when
    it raised. The interpreter-exit teardown is skipped because gloo aborted a finished rank there (SIGABRT,
    "terminate called without an active exception") in clean-clone CI runs, after its results were written."""
    code = 1
    try:
        target(rank, *args)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def ranks_done() -> None:
    """The last line of a rank's work, before its ``finally`` tears the process group down: every rank waits here
    for the others, so none destroys its gloo group while a peer still talks to it (destroy_process_group then
    hangs now and then, pytorch/pytorch#75097; a rank of these tests did once in a clean-clone CI run)."""
    torch.distributed.barrier()


def run_ranks(target, *args, world: int, timeout: float, tries: int = 2) -> None:
    """Run ``target(rank, *args)`` in ``world`` spawned processes; fail on a non-zero exit or a hang.

    A group in which a rank was killed by a signal (a native abort inside torch's gloo: "malloc(): unaligned tcache
    chunk detected" during a collective, once in a clean-clone CI run, the other rank then failing on the reset
    connection) runs once more; a rank that raises (exit 1) or hangs fails at once."""
    codes = _run_group(target, args, world, timeout)
    if any(code < 0 for code in codes) and tries > 1:
        print(f"run_ranks: a rank was killed by a signal (exit codes {codes}); running the group once more")
        run_ranks(target, *args, world=world, timeout=timeout, tries=tries - 1)
        return
    assert all(code == 0 for code in codes), codes


def _run_group(target, args: tuple, world: int, timeout: float) -> list[int]:
    """One group of spawned ranks; their exit codes (a hang fails here)."""
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_entry, args=(target, rank, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    hung = [p.is_alive() for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not any(hung), f"ranks {hung} did not finish within {timeout} s (a hang)"
    return [p.exitcode for p in procs]


def accelerate_bf16_forward(model: nn.Module) -> nn.Module:
    """What ``Accelerator(mixed_precision="bf16").prepare_model`` does to ``model.forward`` on the CPU (accelerator.py,
    native AMP), with Accelerate's own ``convert_outputs_to_fp32``, without its process-wide ``AcceleratorState``
    (a singleton other tests' Trainers set to another precision)."""
    from types import MethodType

    from accelerate.utils import convert_outputs_to_fp32

    autocast = torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    if hasattr(model.forward, "__func__"):
        model.forward = MethodType(autocast(model.forward.__func__), model)
        model.forward = MethodType(convert_outputs_to_fp32(model.forward.__func__), model)
    else:
        model.forward = convert_outputs_to_fp32(autocast(model.forward))
    return model


def attach_experimental(trainer, **options):
    """``dropbp.attach`` with 0.3's flat experimental settings (``stratify=...``, as the results tables name them)
    made into their features (:func:`dropbp.tools.arms.arm_features`): applied at once and registered on ``trainer``."""
    from dropbp.integrations.hf import callback_for
    from dropbp.options import TrainerOptions
    from dropbp.tools.arms import arm_features

    rest, features = arm_features(options)
    callback = callback_for(trainer, TrainerOptions.given("attach", **rest, features=features))
    trainer.add_callback(callback)
    return callback


# -- the fast tier ---------------------------------------------------------------------------------------------------
#: Modules that start processes, trainers or engines (minutes each): in the fast tier only through :data:`FAST_TOO`.
SLOW_MODULES = frozenset(
    {
        "test_deepspeed",  # its fixture trains every ZeRO stage in worker processes first (over 2 minutes)
        "test_distributed",
        "test_lazy_engine",
        "test_hf_integration",
        "test_trainer_runs",
        "test_cli",
        "test_check",
        "test_examples",
        "test_docs_site",
    }
)
#: Tests of the quick modules that run long or start a process and check no gradient (test ids, a prefix each).
SLOW_TOO = (
    "test_hpu_standin.py::test_lazy_mode_200_steps",
    "test_compile.py::test_compiling_around_the_branches_says_once",
    "test_architecture.py::test_importing_dropbp_imports",
    "test_membench.py::test_a_real_probe_in_a_fresh_process",
    "test_backends.py::test_example_",
    "test_backends.py::test_device_libraries_are_not_imported",
    "test_training_loops.py",
    "test_bound.py::test_saved_activations_never_exceed_the_bound_over_200_steps",
)
#: The slow modules' exactness on one architecture, in the fast tier all the same (test ids, a prefix each).
FAST_TOO = (
    "test_distributed.py::test_two_ranks_train_as_one[ddp-cut]",
    "test_lazy_engine.py::test_gradients_on_the_engine_equal_the_reference",
    "test_hf_integration.py::test_callback_at_construction_trains_as_attach[cut]",
)
#: The one architecture of the fast tier; a test parametrised by another model type is left to the full suite.
FAST_ARCHITECTURE = "llama"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the fast tier (``pytest -m fast``, CONTRIBUTING.md): every test of the quick modules but :data:`SLOW_TOO`,
    on Llama only where a test is parametrised by architecture, and :data:`FAST_TOO` of the slow ones."""
    from dropbp import SUPPORTED_ARCHITECTURES

    for item in items:
        node = item.nodeid.removeprefix("tests/")
        if item.module.__name__ in SLOW_MODULES or node.startswith(SLOW_TOO):
            fast = node.startswith(FAST_TOO)
        else:
            params = getattr(item, "callspec", None)
            values = params.params.values() if params is not None else ()
            others = [v for v in values if isinstance(v, str) and v in SUPPORTED_ARCHITECTURES]
            fast = all(v == FAST_ARCHITECTURE for v in others)
        if fast:
            item.add_marker(pytest.mark.fast)
