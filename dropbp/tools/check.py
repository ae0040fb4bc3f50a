"""``dropbp check``: proves dropbp on the user's own device and model, in a minute or two.

It runs, on their device: the environment report (:mod:`.check_env`), the lazy-graph checks where the backend
compiles graphs per pattern (:mod:`.check_graphs`), the correctness contract (:mod:`.check_grads`), and what DropBP
buys there (``dropbp bench``'s interleaved measurement, :func:`dropbp.tools.bench.measure_model`). ``run_check`` is
the notebook entry point; the command writes ``check.json`` and ``check.md`` to attach to an issue. Every place whose
result depends on the pattern shape names it (``pattern="uniform"`` where one shape is enough, both shapes for the
gradient check and the speed figures), so a change of ``dropbp.apply``'s default shape changes no check.
What it reports and why users run it: the README ("Verify on your hardware").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dropbp import apply
from dropbp.backends import Backend
from dropbp.backends import get as get_backend
from dropbp.imports import require
from dropbp.tools.bench import PRESETS, Point, build_model, measure_model
from dropbp.tools.check_env import environment
from dropbp.tools.check_grads import Probe, correctness_checks, graph_saved_bytes
from dropbp.tools.check_graphs import graph_checks
from dropbp.tools.check_noise import branch_share, check_stream, noise_section, read_text_file, token_stream
from dropbp.tools.check_report import FAIL, CheckResult, Outcome, render, write
from dropbp.tools.device_tools import tools_for
from dropbp.tools.pretrained import DEFAULT_MODEL, checkpointing_on, dtype_keyword, load_causal_lm, not_a_model_folder
from dropbp.tools.qlora import count_4bit_layers, quantize_4bit, with_lora

__all__ = ["CheckResult", "CheckSettings", "CheckSetupError", "render", "run_check", "write"]

METHODS = ("full", "lora", "qlora")
DTYPES = ("fp32", "bf16")
#: The drop rates whose speed and memory are measured (0: the library's own overhead).
SPEED_RATES = (0.0, 0.5, 0.875)
#: Both pattern shapes, named (``dropbp.apply``'s default shape may change): the paper's uniform
#: patterns, and cuts below a random depth.
SPEED_PATTERNS = ("uniform", "cut")
#: Training forwards whose saved bytes are averaged per configuration.
SAVED_STEPS = 4


class CheckSetupError(RuntimeError):
    """The check could not start (bad settings, a model that cannot be loaded): one line, exit code 2."""


@dataclass(frozen=True)
class CheckSettings:
    """How big the measured steps are. ``quick()`` keeps the CPU check well under a minute."""

    preset: str = "tiny"  # the default model: a random Llama of this bench preset (nothing downloaded)
    seq_len: int = 128
    batch_size: int = 2
    rounds: int = 5
    warmup: int = 2

    @classmethod
    def quick(cls) -> CheckSettings:
        return cls(seq_len=64, rounds=3, warmup=1)


def _load(
    model: str | None, method: str, backend: Backend, settings: CheckSettings, checkpointing: bool = False
) -> tuple[nn.Module, str, object | None]:
    """The model to check, on the device, in float32 weights, in training mode (with Hugging Face's non-re-entrant
    activation checkpointing where ``checkpointing``, as ``gradient_checkpointing=True`` trains it); its name; its
    tokenizer, or None where it has none (the random default, or a folder without one)."""
    tokenizer = None
    if model is None:
        net = build_model(settings.preset, "full", settings.seq_len, torch.float32, torch.device("cpu"))
        name = f"random Llama ({settings.preset} preset: {PRESETS[settings.preset]['num_hidden_layers']} layers)"
    elif model == DEFAULT_MODEL:
        net, tokenizer = load_causal_lm(model)  # the bundled SmolLM2 (converted once, then cached)
        name = model
    elif ("/" in model or model.startswith(".")) and not Path(model).exists() and model.count("/") != 1:
        raise CheckSetupError(f"the model folder {model} does not exist; pass a local model folder or a model id")
    elif (problem := not_a_model_folder(model)) is not None:
        raise CheckSetupError(f"cannot load the model: {problem}")
    else:
        transformers = require("transformers", "dropbp check --model")
        try:  # the model alone: the check feeds random token ids and needs no tokenizer
            net = transformers.AutoModelForCausalLM.from_pretrained(
                model, **{dtype_keyword(transformers.__version__): torch.float32}
            )
        except Exception as exc:  # any failure to load (a truncated safetensors file: SafetensorError) is set-up's
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CheckSetupError(
                f"cannot load the model {model!r} ({type(exc).__name__}: {first}); check that its files are complete "
                "(a download or copy cut short leaves a truncated weights file)"
            ) from None
        name = model
        tokenizer = _tokenizer(transformers, model)
    if method == "qlora":  # nf4 4-bit base weights, quantised on the device they will train on
        net = quantize_4bit(net, torch.float32, backend.device)
    if method in ("lora", "qlora"):
        require("peft", f"dropbp check --method {method}")
        # init_lora_weights=False: non-zero adapters, so every adapter gets a gradient worth comparing
        net = with_lora(net, init_lora_weights=False)
    if checkpointing:
        if not getattr(net, "supports_gradient_checkpointing", False):
            raise CheckSetupError(f"{name} does not support Hugging Face activation checkpointing")
        checkpointing_on(net)
    net, _ = backend.prepare(net)
    return net.train(), name, tokenizer


#: Files one of which a local model folder holds where it ships its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _tokenizer(transformers: object, model: str) -> object | None:
    """The model's own tokenizer for the noise scale's text, or None (its bytes then stand in for tokens): a local
    folder must ship one (transformers would otherwise make a tokenizer from the config alone that knows no text)."""
    folder = Path(model)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError):
        return None


def _model_facts(
    model: nn.Module, name: str, method: str, dtype: str, backend: Backend, checkpointing: bool = False
) -> dict:
    probe = apply(model, 0.0, pattern="uniform", backend=backend)
    branches = len(probe.branches)
    probe.remove()
    four_bit = {"four_bit_layers": count_4bit_layers(model)} if method == "qlora" else {}
    return {
        **four_bit,
        "name": name,
        "method": method,
        "dtype": dtype if dtype == "fp32" else f"{dtype} (autocast {str(backend.autocast_dtype).split('.')[1]})",
        "branches": branches,
        "activation_checkpointing": checkpointing,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def _speed(probe: Probe, settings: CheckSettings, method: str, branches: int) -> dict:
    """``dropbp bench``'s figures for this model, plus the bytes autograd saves per step at each rate."""
    backend = probe.backend
    rates = [r for r in SPEED_RATES if branches * r <= branches - 1]  # never every branch dropped
    point = Point("check", method, settings.seq_len, settings.batch_size)
    result = measure_model(
        probe.model,
        point,
        rates,
        backend,
        settings.rounds,
        settings.warmup,
        patterns=SPEED_PATTERNS,
        autocast=probe.autocast,
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, probe.model.config.vocab_size, (settings.batch_size, settings.seq_len), generator=g)
    big = Probe(probe.model, backend, ids.to(backend.device), probe.precision)
    result["baseline"]["saved_bytes"] = graph_saved_bytes(big.model, big.loss)
    for row in result["rows"]:  # a mean over steps: a cut's depth, hence its saving, changes every step
        ctl = apply(big.model, row["drop_rate"], seed=0, pattern=row["pattern"], backend=backend)
        saved = [graph_saved_bytes(big.model, big.loss) for _ in range(SAVED_STEPS)]
        row["saved_bytes"] = round(sum(saved) / SAVED_STEPS)
        ctl.remove()
    backend.graph_break()
    memory = (
        "peak allocated memory from the device allocator"
        if backend.has_allocator_stats
        else "no allocator peak on this device"
    )
    result["note"] = (
        "patterns uniform (every branch at the rate) and cut (every branch below a random depth; the rate is "
        f"the FLOP-weighted mean), batch {settings.batch_size} x {settings.seq_len} tokens, "
        f"{settings.rounds} interleaved rounds after {settings.warmup} warm-up; speedup: median of per-round "
        "ratios to the model without the library; at expected FLOPs dropped: the rounds' mean step corrected "
        "for the patterns they drew; ideal: F + B0 + O0 + (1-p)(B - B0 + O - O0) "
        f"(efficiency = ideal / measured); {memory}; saved for backward: bytes autograd keeps per step "
        f"(mean of {SAVED_STEPS} steps)"
        + "".join(f"; {c} refused: {why}" for c, why in result.get("refused", {}).items())
    )
    return result


def run_check(
    backend: str | Backend | None = None,
    model: str | None = None,
    method: str = "full",
    dtype: str | None = None,
    out: str | Path | None = None,
    quick: bool = False,
    settings: CheckSettings | None = None,
    progress: Callable[[str], None] | None = None,
    data: str | Path | None = None,
    tokens_per_step: int | None = None,
    gradient_checkpointing: bool = False,
) -> CheckResult:
    """Run every check on this device and return what was found (``result.passed``, ``result.checks``).

    Args:
        backend: a backend name or instance; default ``$DROPBP_BACKEND``, else detection.
        model: a local path or model id of a causal LM (``"SmolLM2-135M-Instruct"``: the bundled
            one); default a small random Llama, so nothing is downloaded.
        method: ``"full"`` fine-tuning, ``"lora"`` (PEFT LoRA on every linear layer) or ``"qlora"``
            (the same LoRA on nf4 4-bit base weights: bitsandbytes, :mod:`dropbp.tools.qlora`).
        dtype: ``"fp32"`` or ``"bf16"`` (autocast; the gradients are also checked in fp32); default
            the backend's training dtype (fp32 on the CPU, bf16 on accelerators).
        out: a folder to write ``check.json`` and ``check.md`` to; nothing is written without it.
        quick: shorter speed measurement (:meth:`CheckSettings.quick`).
        settings: step sizes and rounds (overrides ``quick``).
        progress: called with a line as each section starts (the command prints them to stderr).
        data: a UTF-8 text file for the gradient noise scale (default: Python's help topics).
        tokens_per_step: the tokens of one optimizer step of the user's run, for the noise scale's forecast
            (default: the measurement's own, :data:`dropbp.tools.check_noise.NOISE_MICRO_BATCHES` x ``seq_len``).
        gradient_checkpointing: every section with Hugging Face's activation checkpointing on (non-re-entrant, as
            the Trainer's ``gradient_checkpointing=True``): exactness, step times and memory as such a run has them.

    Raises:
        CheckSetupError, dropbp.backends.BackendUnavailable, dropbp.imports.MissingDependency: the
        check cannot start; each message is one line that says what to do.
    """
    started = time.perf_counter()
    say = progress or (lambda line: None)
    if method not in METHODS:
        raise CheckSetupError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    resolved = backend if isinstance(backend, Backend) else get_backend(backend)
    if dtype is None:
        dtype = "fp32" if tools_for(resolved).training_dtype == torch.float32 else "bf16"
    if dtype not in DTYPES:
        raise CheckSetupError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    settings = settings or (CheckSettings.quick() if quick else CheckSettings())
    require("transformers", "dropbp check")
    if data is not None:  # before the model loads: a bad file is said at once
        try:
            read_text_file(data)
        except ValueError as exc:
            raise CheckSetupError(str(exc)) from None
    # before any output: a setup error is one line
    net, name, tokenizer = _load(model, method, resolved, settings, gradient_checkpointing)
    if getattr(getattr(net, "config", None), "vocab_size", None) is None:
        raise CheckSetupError(f"{name} is not a causal LM with config.vocab_size; dropbp check feeds it token ids")
    if tokens_per_step is not None and (not isinstance(tokens_per_step, int) or tokens_per_step < 1):
        raise CheckSetupError(f"tokens_per_step must be a positive int, got {tokens_per_step!r}")
    try:
        stream = token_stream(data, tokenizer, net.config.vocab_size)
        check_stream(stream, settings.seq_len)
    except ValueError as exc:
        raise CheckSetupError(str(exc)) from None
    try:
        facts = _model_facts(net, name, method, dtype, resolved, gradient_checkpointing)
    except ValueError as exc:  # e.g. an architecture whose branches dropbp does not recognise
        raise CheckSetupError(f"dropbp cannot attach to {name}: {str(exc).strip().splitlines()[0]}") from None
    say(f"environment and model ({resolved.name}, {name})")
    env = environment(resolved, backend)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, net.config.vocab_size, (2, min(32, settings.seq_len)), generator=g).to(resolved.device)
    probe = Probe(net, resolved, ids, dtype)
    say("lazy-graph checks")
    checks = graph_checks(probe)
    say("correctness checks")
    checks += correctness_checks(probe)
    say("speed and memory")
    speed = None
    try:
        speed = _speed(probe, settings, method, facts["branches"])
    except Exception as exc:  # e.g. out of memory: reported as a finding, with what was asked
        checks.append(Outcome("speed-measurement", FAIL, f"raised {type(exc).__name__}: {str(exc).strip()[:200]}"))
    say("gradient noise scale")
    noise = None
    try:
        noise = noise_section(net, resolved, stream, settings.seq_len, tokens_per_step, branch_share(speed))
    except Exception as exc:  # e.g. out of memory: reported as a finding, as the speed measurement's
        checks.append(Outcome("noise-scale", FAIL, f"raised {type(exc).__name__}: {str(exc).strip()[:200]}"))
    result = CheckResult(env, facts, checks, speed, time.perf_counter() - started, noise)
    if out is not None:
        write(result, Path(out))
    return result
