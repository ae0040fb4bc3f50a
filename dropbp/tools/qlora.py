"""QLoRA for the tools: a causal LM's linear layers as bitsandbytes nf4 4-bit weights, then PEFT LoRA.

:func:`quantize_4bit` does what the research code's ``--quantize bnb.nf4`` does, the Hugging Face way: the model is
saved to a temporary folder and loaded back with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``
(no double quantisation; the training dtype as compute dtype), which turns every ``nn.Linear`` of the decoder layers
into ``bnb.nn.Linear4bit`` (the LM head stays); nothing is downloaded. LoRA then goes on the same targets as the
``lora`` method (:func:`with_lora`); ``peft.prepare_model_for_kbit_training`` is not called. On a CPU with AVX512-BF16,
recent bitsandbytes repacks a ``Linear4bit`` weight in place into an inference-only layout at its first eval-mode
forward whose input needs no gradient, which breaks training after it; :func:`quantize_4bit` turns that repack off
(:func:`keep_4bit_trainable`). Why, and the versions: docs/qlora.md.
"""

from __future__ import annotations

import tempfile
import warnings

import torch
from torch import nn

from dropbp.imports import is_available, require
from dropbp.internals import attention_implementation

__all__ = [
    "LORA_TARGETS",
    "count_4bit_layers",
    "dequantize_all",
    "four_bit_layers",
    "keep_4bit_trainable",
    "quantize_4bit",
    "with_lora",
]

#: The LoRA targets of the ``lora`` and ``qlora`` methods (every linear layer but the LM head).
LORA_TARGETS = "all-linear"


def quantize_4bit(model: nn.Module, compute_dtype: torch.dtype, device: torch.device | str = "cpu") -> nn.Module:
    """The same Hugging Face causal LM with nf4 4-bit linear layers (see the module docstring).

    Raises:
        MissingDependency: bitsandbytes (or transformers) is not installed; the message says how.
    """
    require("bitsandbytes", "QLoRA (4-bit nf4 base weights)")
    transformers = require("transformers", "QLoRA (4-bit nf4 base weights)")
    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=False,
        bnb_4bit_compute_dtype=compute_dtype,
    )
    device = torch.device(device)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # a temporary folder's saving and loading: no news
    try:
        with tempfile.TemporaryDirectory(prefix="dropbp-qlora-") as folder:
            model.save_pretrained(folder)
            quantised = transformers.AutoModelForCausalLM.from_pretrained(
                folder,
                quantization_config=config,
                dtype=compute_dtype,
                device_map={"": str(device)},  # quantised where it will train
                attn_implementation=attention_implementation(model.config),
            )
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    keep_4bit_trainable(quantised)
    return quantised


def keep_4bit_trainable(model: nn.Module) -> None:
    """Keep every 4-bit layer of ``model`` trainable across eval-mode forwards on an AVX512-BF16 CPU.

    bitsandbytes decides the in-place inference repack (see the module docstring) by each layer's
    ``support_avx512bf16_for_cpu``, set at construction from the CPU's flags; this sets it to False,
    so an eval forward computes as a training forward does (dequantise and multiply) and leaves the
    weight as it was. Nothing changes on GPUs or on CPUs without AVX512-BF16. Call it after loading a
    4-bit model yourself (:func:`quantize_4bit` does), before the first evaluation.
    """
    layers = four_bit_layers(model)
    if not layers:
        return
    import bitsandbytes as bnb

    if all(hasattr(layer, "support_avx512bf16_for_cpu") for layer in layers):
        for layer in layers:
            layer.support_avx512bf16_for_cpu = False
    elif hasattr(bnb.functional, "has_avx512bf16"):  # the repack exists, but no longer behind this switch
        warnings.warn(
            f"dropbp: bitsandbytes {bnb.__version__} no longer decides its CPU inference repack of 4-bit weights "
            "by Linear4bit.support_avx512bf16_for_cpu (tested: 0.46.1 to 0.50.2), so dropbp cannot turn it off: "
            "on a CPU with AVX512-BF16 an eval forward may make later training forwards fail. Install "
            "'bitsandbytes<=0.50.2', or evaluate in train mode under torch.no_grad()",
            RuntimeWarning,
            stacklevel=2,
        )


def with_lora(model: nn.Module, r: int = 8, alpha: int = 16, **kwargs) -> nn.Module:
    """PEFT LoRA on :data:`LORA_TARGETS` (base weights frozen): the ``lora`` and ``qlora`` methods."""
    peft = require("peft", "LoRA")
    return peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=LORA_TARGETS, **kwargs))


def four_bit_layers(model: nn.Module) -> list[nn.Module]:
    """The ``bitsandbytes.nn.Linear4bit`` layers of ``model`` (none without bitsandbytes)."""
    if not is_available("bitsandbytes"):
        return []
    try:
        import bitsandbytes as bnb
    except ImportError:  # installed but unusable here: then no model holds its layers either
        return []
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def count_4bit_layers(model: nn.Module) -> int:
    """How many ``bitsandbytes.nn.Linear4bit`` layers ``model`` holds (0 without bitsandbytes)."""
    return len(four_bit_layers(model))


@torch.no_grad()
def dequantize_all(layers: list[nn.Module]) -> None:
    """Dequantise every layer's weight once, as its forward does (and its backward again where the
    layer's input needs a gradient): the bench's measure of what 4-bit weights add to a step."""
    import bitsandbytes.functional as bnbf

    for layer in layers:
        bnbf.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
