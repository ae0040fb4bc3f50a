"""The architecture tables: which modules of each model family are DropBP branches, and which of a branch's linear
maps mix token rows. Data only; :mod:`dropbp.execution.discovery` applies them to a model (and :mod:`dropbp.options`
names BERT's branches in its help). Adding an architecture is a line here (README.md, "Models").
"""

from __future__ import annotations

__all__ = [
    "ATTENTION_HINTS",
    "ATTENTION_NAMES",
    "BERT_BRANCHES",
    "EXPERTS",
    "LITGPT_BLOCK",
    "LITGPT_POST_NORMS",
    "MLP_NAMES",
    "OLDER_MLP_NAMES",
    "POST_NORMS",
    "ROW_LOCAL_ATTENTION_PROJECTIONS",
    "SUPPORTED_ARCHITECTURES",
]

# model_type -> (attention child, MLP child) of each decoder layer. Parallel-residual models
# (gpt_neox, phi-style) need nothing special: each branch reads the layer input and is dropped alone.
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("self_attn", "mlp"),
    "mistral": ("self_attn", "mlp"),
    "mixtral": ("self_attn", "mlp"),
    "qwen2": ("self_attn", "mlp"),
    "qwen3": ("self_attn", "mlp"),
    "qwen3_moe": ("self_attn", "mlp"),
    "gemma": ("self_attn", "mlp"),
    "gemma2": ("self_attn", "mlp"),
    "phi3": ("self_attn", "mlp"),
    "olmo": ("self_attn", "mlp"),
    "olmo2": ("self_attn", "mlp"),
    "granite": ("self_attn", "mlp"),
    "gpt2": ("attn", "mlp"),
    "gpt_neox": ("attention", "mlp"),
}

# model_type -> MLP child names of older transformers releases (before 5.0), tried after the table's.
OLDER_MLP_NAMES: dict[str, tuple[str, ...]] = {"mixtral": ("block_sparse_moe",)}

# model_type -> (the norm after the attention, the norm after the MLP) of post-norm decoders, which
# normalise a branch's output before adding it to the residual: ``x = x + norm(f(x))``. Such a norm is
# part of the branch (the branch is everything between the residual read and the residual add), so a
# dropped branch's post-norm gets no gradient either.
POST_NORMS: dict[str, tuple[str, str]] = {
    "gemma2": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm"),
}

# litgpt's ``Block`` (and its LoRA/adapter subclasses): attention and MLP children, and the optional
# post-attention / post-MLP norms of newer configs (``nn.Identity`` otherwise). Recognised by class,
# so litgpt is never imported here.
LITGPT_BLOCK = ("attn", "mlp")
LITGPT_POST_NORMS = ("post_attention_norm", "post_mlp_norm")

#: The branches of a post-norm encoder such as BERT, named in advice (its ``attention`` adds the residual itself).
BERT_BRANCHES = "'bert.encoder.layer.N.attention.self' and 'bert.encoder.layer.N.intermediate' for every N"
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe")
ATTENTION_HINTS = ("attn", "attention")

#: The linear maps of an attention branch whose output row ``t`` reaches the branch's output only at row ``t``: the
#: query and output projections, by child name. Under token drops their backward runs on the kept rows only. Keys and
#: values (``k_proj``, ``v_proj``, fused ``qkv_proj``, GPT-2's ``c_attn``, GPT-NeoX's ``query_key_value``) reach
#: every later token, so they keep full rows; a name not listed here keeps full rows too (exact, not cheaper). Every
#: linear map of an MLP branch is row-local.
ROW_LOCAL_ATTENTION_PROJECTIONS = ("q_proj", "o_proj", "query", "dense", "out_proj", "c_proj", "wo")

#: The child of a mixture-of-experts MLP that holds its experts: their rows are the tokens routed to each, not the
#: branch's rows, so token drops leave them on full rows.
EXPERTS = "experts"
