"""Branch discovery: which modules of a model are DropBP branches, and what each costs.

A branch is the ``f`` in ``x = x + f(x)``: the module whose output is added to the residual stream,
the attention and the MLP of every decoder layer. Hugging Face models are recognised by
``config.model_type`` and the child names each architecture uses (:mod:`dropbp.architectures`); nothing in
``transformers`` is edited or replaced. Other models name their branches with ``branches=[...]``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from dropbp.architectures import (
    ATTENTION_HINTS,
    ATTENTION_NAMES,
    BERT_BRANCHES,
    LITGPT_BLOCK,
    LITGPT_POST_NORMS,
    MLP_NAMES,
    OLDER_MLP_NAMES,
    POST_NORMS,
    SUPPORTED_ARCHITECTURES,
)
from dropbp.checks import check_int

__all__ = [
    "Branch",
    "ResidualProbe",
    "branch_flops",
    "find_branches",
]

log = logging.getLogger("dropbp")

#: What a branch must be, and BERT's, for messages about a wrong choice of branches.
BRANCH_ADVICE = (
    "A branch must be the f in x = x + f(x), a module whose output is then added to the residual "
    "stream, not a module that adds the residual itself (a whole layer, or BERT's "
    "encoder.layer.N.attention). For post-norm encoders name the modules inside the residual add, e.g. "
    f"{BERT_BRANCHES}"
)


class Branch:
    """A read-only view of one droppable residual branch.

    ``name`` is the module's path in ``model.named_modules()``; ``kind`` is ``"attn"`` or ``"mlp"``;
    ``flops`` its forward cost per token (used only as ratios, for allocation); ``rate`` its drop
    probability when the view was taken; ``tail`` the modules that run on its output before the
    residual add (a post-norm decoder's norm), dropped with it, and ``parts`` the module and its tail.
    Views are read-only so that no assignment can leave the
    controller's patterns out of step with what a view shows: rates change through
    ``ctl.set_rates``.
    """

    __slots__ = ("name", "kind", "flops", "rate", "module", "tail")
    name: str
    kind: str
    flops: float
    rate: float
    module: nn.Module
    tail: tuple[nn.Module, ...]

    def __init__(
        self, name: str, kind: str, flops: float, rate: float, module: nn.Module, tail: tuple[nn.Module, ...] = ()
    ) -> None:
        for key, value in zip(self.__slots__, (name, kind, flops, rate, module, tuple(tail)), strict=True):
            object.__setattr__(self, key, value)

    def __setattr__(self, key: str, value: object) -> None:
        raise AttributeError(
            f"Branch.{key} is read-only: a Branch is a view of the controller's state; "
            "change drop rates with ctl.set_rates([...]) (or ctl.drop_rate = p for all branches)"
        )

    def with_rate(self, rate: float) -> Branch:
        """The same branch viewed at another drop rate."""
        return Branch(self.name, self.kind, self.flops, rate, self.module, self.tail)

    @property
    def parts(self) -> tuple[nn.Module, ...]:
        """The branch module, then its tail: the last part's output is what the residual add receives."""
        return (self.module, *self.tail)

    def __repr__(self) -> str:
        return f"Branch(name={self.name!r}, kind={self.kind!r}, flops={self.flops!r}, rate={self.rate!r})"


def check_trainable(model: nn.Module) -> None:
    """Refuse a model with nothing to train: DropBP drops parts of a backward, and there would be none.

    Without this, ``apply`` would succeed and every ``loss.backward()`` would raise torch's bare "element 0 of
    tensors does not require grad" (and ``ctl.backward`` return False), saying nothing of why.
    """
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"dropbp.apply: no parameter of this {type(model).__name__} requires a gradient, so there is no backward "
            "pass to drop: unfreeze some (e.g. model.requires_grad_(True)) or add LoRA adapters "
            "(peft.get_peft_model) before dropbp.apply"
        )


def holder(parts: Sequence[nn.Module]) -> nn.Module:
    """One module holding every parameter of a branch's parts, for parameter bookkeeping.

    A tail-less branch is its own module; otherwise an unregistered ``nn.ModuleList`` of the parts
    (it changes nothing in the model, and reads the parameters at use, so FSDP2 sharding shows).
    """
    return parts[0] if len(parts) == 1 else nn.ModuleList(parts)


def _model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def _attention_width(model: nn.Module) -> int | None:
    """``n_heads * head_dim`` from the model's config (Hugging Face or litgpt names): the width of the
    score/value products."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not heads or not hidden:
        return None
    head_dim = getattr(config, "head_dim", None) or getattr(config, "head_size", None) or hidden // heads
    return int(heads * head_dim)


def _is_adapter_path(path: str) -> bool:
    """PEFT adapter weights (LoRA and relatives) are not part of the branch's base cost."""
    return any(part.startswith(("lora_", "adapter", "ia3_", "vera_")) for part in path.split("."))


def _expert_share(model: nn.Module) -> float:
    """The fraction of an MoE layer's experts that each token runs through (top-k over the number of
    experts, from a Hugging Face or litgpt config); 1.0 for dense models."""
    config = getattr(model, "config", None)
    top_k = next((v for k in ("num_experts_per_tok", "n_expert_per_token") if (v := getattr(config, k, None))), None)
    count = next((v for k in ("num_experts", "num_local_experts", "n_expert") if (v := getattr(config, k, None))), None)
    return top_k / count if isinstance(top_k, int) and isinstance(count, int) and count >= top_k > 0 else 1.0


def branch_flops(
    module: nn.Module, kind: str, seq_len: int, attention_width: int | None, expert_share: float = 1.0
) -> float:
    """Forward FLOPs per token of a branch, from its module shapes (projections plus attention scores).

    Every projection costs ``2 * in * out``; adapter (LoRA) weights are left out so the figures are
    the same with and without PEFT. Attention adds ``4 * seq_len * width`` for the scores and the
    weighted values. An MoE layer's experts (linears under an ``experts`` child, or fused 3-D expert
    weights) count ``expert_share`` of their weights: a token runs through only its top-k experts.
    """
    weights = 0.0
    for path, sub in module.named_modules():
        if _is_adapter_path(path):
            continue
        share = expert_share if "experts" in path.split(".") else 1.0
        weights += share * sum(p.numel() for p in sub.parameters(recurse=False) if p.dim() == 3)  # fused experts
        if next(sub.children(), None) is not None:
            continue
        if isinstance(getattr(sub, "in_features", None), int) and isinstance(getattr(sub, "out_features", None), int):
            weights += share * sub.in_features * sub.out_features
        elif type(sub).__name__ == "Conv1D" and getattr(sub, "weight", None) is not None:
            weights += sub.weight.numel()  # GPT-2's transposed linear
    flops = 2.0 * weights
    if kind == "attn" and attention_width:
        flops += 4.0 * seq_len * attention_width
    if flops <= 0:
        flops = float(sum(p.numel() for p in module.parameters())) or 1.0
    return flops


def _branch_kind(name: str, module: nn.Module) -> str:
    """A named branch's kind: "attn" where its class says attention (``BertSelfAttention``), else where a part of its
    path does (``...attention.self``: the leaf alone, ``self``, says nothing); "mlp" otherwise. The kind decides which
    of its linear maps token drops may run on kept rows: an attention branch's keys and values never are."""
    classes = [c.__name__.lower() for c in type(module).__mro__]
    if any(h in c for c in classes for h in ATTENTION_HINTS):
        return "attn"
    return "attn" if any(h in part.lower() for part in name.split(".") for h in ATTENTION_HINTS) else "mlp"


Found = tuple[str, str, tuple[str, ...]]  # (branch name, kind, names of its tail modules)


def _named_branches(
    model: nn.Module,
    attn: tuple[str, ...],
    mlp: tuple[str, ...],
    tails: tuple[str, str] | None = None,
    layer_test: Callable[[nn.Module], bool] | None = None,
) -> list[Found]:
    """The attention and MLP children of every module that has both (and passes ``layer_test``), in
    order, each with its post-norm child from ``tails`` where the layer has one holding parameters (a
    parameterless one changes nothing: backward is linear, so it needs no gradient of its own)."""
    found = []
    for name, module in model.named_modules():
        if layer_test is not None and not layer_test(module):
            continue
        children = dict(module.named_children())
        a = next((c for c in attn if c in children), None)
        m = next((c for c in mlp if c in children), None)
        if a is None or m is None:
            continue
        prefix = f"{name}." if name else ""
        after = [_tail(children, tails[i] if tails else None, prefix) for i in (0, 1)]
        found += [(prefix + a, "attn", after[0]), (prefix + m, "mlp", after[1])]
    return found


def _tail(children: dict[str, nn.Module], child: str | None, prefix: str) -> tuple[str, ...]:
    """``(prefix + child,)`` if the layer has that child and it holds parameters, else ``()``."""
    has_params = child in children and next(children[child].parameters(), None) is not None
    return (prefix + child,) if has_params else ()


def _is_litgpt_block(module: nn.Module) -> bool:
    """litgpt's ``Block`` or a subclass (``litgpt.lora.Block``, ``litgpt.adapter.Block``), by class."""
    return any(c.__name__ == "Block" and c.__module__.split(".")[0] == "litgpt" for c in type(module).__mro__)


#: The sequence length attention's FLOPs are weighed at (:func:`branch_flops`): a typical fine-tuning length.
TYPICAL_SEQ_LEN = 512
_SEQ_LEN: ContextVar[int] = ContextVar("dropbp_flops_seq_len", default=TYPICAL_SEQ_LEN)


@contextmanager
def flops_at_length(seq_len: int) -> Iterator[None]:
    """Within the block, ``apply`` weighs attention's FLOPs at ``seq_len`` tokens instead of
    :data:`TYPICAL_SEQ_LEN` (the measurement tools: their own sequence length; 0.3's ``seq_len`` option)."""
    token = _SEQ_LEN.set(check_int("seq_len", seq_len, 1))
    try:
        yield
    finally:
        _SEQ_LEN.reset(token)


def find_branches(model: nn.Module, names: list[str] | None) -> list[Branch]:
    """The model's branches in forward order, either named by the caller or found by architecture; their FLOPs weigh
    attention at :data:`TYPICAL_SEQ_LEN` tokens (:func:`flops_at_length` inside)."""
    seq_len = _SEQ_LEN.get()
    modules = dict(model.named_modules())
    if names is not None:
        found = [(name, kind, ()) for name, kind in _explicit(names, modules)]
    else:
        found = _detect(model)
    for name, _, _ in found:
        _check_takes_no_residual(name, modules[name])
    width, share = _attention_width(model), _expert_share(model)
    return [
        Branch(
            name,
            kind,
            branch_flops(modules[name], kind, seq_len, width, share),
            0.0,
            modules[name],
            tuple(modules[t] for t in tail),
        )
        for name, kind, tail in found
    ]


def _explicit(names: list[str], modules: dict[str, nn.Module]) -> list[tuple[str, str]]:
    if isinstance(names, (str, bytes)) or not all(isinstance(n, str) for n in names):
        raise TypeError("branches must be a list of module names (str), as in model.named_modules()")
    if not names:
        raise ValueError("branches is empty: name at least one module, as in model.named_modules()")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"branches names a module more than once: {duplicates}")
    unknown = [n for n in names if n not in modules or n == ""]
    if unknown:
        raise ValueError(
            f"branches names modules that the model does not have: {unknown}; "
            f"use names from model.named_modules(), e.g. {[n for n in modules if n][:4]}"
        )
    _check_not_whole_layers(names, modules)
    order = {n: i for i, n in enumerate(modules)}
    return [(n, _branch_kind(n, modules[n])) for n in sorted(names, key=order.__getitem__)]


def _is_whole_layer(module: nn.Module) -> bool:
    """A residual layer (it adds the residual itself): a Hugging Face layer (``GradientCheckpointingLayer``, the
    base of every transformers 5 decoder and encoder layer), a litgpt ``Block``, or a module with both an
    attention child and an MLP child by the names dropbp recognises (BERT's ``intermediate`` included)."""
    if _is_litgpt_block(module) or any(
        c.__name__ == "GradientCheckpointingLayer" and c.__module__.startswith("transformers.")
        for c in type(module).__mro__
    ):
        return True
    children = {name for name, _ in module.named_children()}
    return bool(children & set(ATTENTION_NAMES)) and bool(children & {*MLP_NAMES, "intermediate"})


def _check_not_whole_layers(names: list[str], modules: dict[str, nn.Module]) -> None:
    """Refuse named "branches" that hold a whole residual layer, or another named branch.

    Dropped, a module that adds the residual itself detaches the residual stream below it: every layer
    under it loses its gradient, silently (the forward's own check catches only the case where nothing
    trainable is left at all).
    """
    for name in names:
        prefix = f"{name}."
        inner = next((n for n in names if n.startswith(prefix)), None)
        if inner is not None:
            raise ValueError(
                f"branches names {name!r} and {inner!r}, which is inside it: branches must not nest. Name only the "
                "innermost modules whose output is added to the residual stream"
            )
        layer = next(
            ((sub_name, sub) for sub_name, sub in modules[name].named_modules() if _is_whole_layer(sub)), None
        )
        if layer is None:
            continue
        path = name if not layer[0] else f"{name}.{layer[0]}"
        inside = _named_branches(layer[1], ATTENTION_NAMES, MLP_NAMES)
        example = (
            f"{[f'{path}.{n}' for n, _, _ in inside]}"
            if inside
            else f"for a post-norm encoder like BERT, {BERT_BRANCHES}"
        )
        raise ValueError(
            f"branches names {name!r}, which {'is' if path == name else 'holds'} a whole residual layer "
            f"({path!r}, a {type(layer[1]).__name__}) that adds the residual itself: dropped, it would cut the "
            "residual stream and every layer below it would lose its gradient. A branch is the f in x = x + f(x), "
            f"a module whose output is then added to the residual stream: name the modules inside the add, e.g. "
            f"{example} (README: 'Which modules are branches')"
        )


def _detect(model: nn.Module) -> list[Found]:
    model_type = _model_type(model)
    if model_type in SUPPORTED_ARCHITECTURES:
        attn, mlp = SUPPORTED_ARCHITECTURES[model_type]
        older = OLDER_MLP_NAMES.get(model_type, ())
        found = _named_branches(model, (attn,), (mlp, *older), POST_NORMS.get(model_type))
    elif any(_is_litgpt_block(m) for m in model.modules()):
        found = _named_branches(model, LITGPT_BLOCK[:1], LITGPT_BLOCK[1:], LITGPT_POST_NORMS, _is_litgpt_block)
    else:
        found = _named_branches(model, ATTENTION_NAMES, MLP_NAMES)
        if found:
            log.warning(
                "dropbp: model_type %r is not among the tested architectures (%s); using the %d "
                "attention/MLP branches found by child name. Pass branches=[...] to choose them.",
                model_type,
                ", ".join(sorted(SUPPORTED_ARCHITECTURES)),
                len(found),
            )
    if not found:
        raise ValueError(
            f"dropbp found no residual layers in this {type(model).__name__} (model_type "
            f"{model_type!r}): it looked for modules with an attention child named one of "
            f"{list(ATTENTION_NAMES)} and an MLP child named one of {list(MLP_NAMES)}. "
            "Pass the residual branches yourself: dropbp.apply(model, p, branches=[...]) with the names (from "
            "model.named_modules()) of the modules whose output is added to the residual stream, the f in "
            f"x = x + f(x), not modules that add the residual themselves; for a BERT-style encoder: {BERT_BRANCHES}"
        )
    return found


#: Autograd nodes of an addition: a branch whose output comes out of one of these, with one of the branch's own
#: inputs feeding it directly, added the residual itself.
_ADD_NODES = ("AddBackward0", "AddBackward1")


def _adds_an_input(output: torch.Tensor, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether ``output`` is one of ``inputs`` plus something: the sums it comes out of (a chain of additions)
    take one of those input tensors directly."""
    nodes = {t.grad_fn for t in inputs if t.grad_fn is not None}
    leaves = {id(t) for t in inputs if t.grad_fn is None}
    pending, seen = [output.grad_fn], 0
    while pending and seen < 8:
        node, seen = pending.pop(), seen + 1
        if node is None or node.name() not in _ADD_NODES:
            continue
        for parent, _ in node.next_functions:
            if parent in nodes or id(getattr(parent, "variable", None)) in leaves:
                return True
            pending.append(parent)
    return False


def _adds_the_residual(name: str, module: nn.Module) -> ValueError:
    return ValueError(
        f"dropbp: branch {name!r} ({type(module).__name__}) adds the residual itself: its output is one of its "
        "inputs plus what it computes, so dropping it would cut the residual stream and every layer below "
        "it would get no gradient. A branch is the f in x = x + f(x), a module whose output is added to the "
        "residual outside it. Pass branches=[...] naming such modules (for this architecture, the "
        "projections inside it whose sum with the residual happens in the layer), or train it without "
        "dropbp (README: 'Which modules are branches')"
    )


def _check_takes_no_residual(name: str, module: nn.Module) -> None:
    """Refuse, before any step, a branch whose ``forward`` takes the residual as an argument (BLOOM's attention and
    MLP, MPT's MLP: ``forward(hidden_states, residual, ...)``): it adds it itself. Branches that add an input
    without naming it so are found at their first call with a graph (:class:`ResidualProbe`)."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return
    if "residual" in parameters:
        raise _adds_the_residual(name, module)


class ResidualProbe:
    """Checks, on each branch's first call that builds a graph, that the branch does not add the residual itself.

    A branch must be the ``f`` in ``x = x + f(x)``. Some architectures pass the residual into the module and add it
    there (BLOOM's attention and MLP, MPT's MLP): dropped, such a branch cuts the residual stream and every layer
    below it gets no gradient, silently. Found, the first training forward raises ``ValueError`` naming the branch and
    what to do. The hooks go once every branch has been checked.
    """

    def __init__(self, names: Sequence[str], modules: Sequence[nn.Module]) -> None:
        self._pending = {id(module): name for name, module in zip(names, modules, strict=True)}
        self.handles = [m.register_forward_hook(self._check, with_kwargs=True) for m in modules]

    def _check(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        out = output[0] if isinstance(output, tuple) and output else output
        if not isinstance(out, torch.Tensor) or out.grad_fn is None:
            return  # no graph (a dropped call, eval): nothing to see yet
        name = self._pending.get(id(module))
        if name is None:
            return
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not _adds_an_input(out, inputs):
            del self._pending[id(module)]
            if not self._pending:
                self.remove()
            return
        raise _adds_the_residual(name, module)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
