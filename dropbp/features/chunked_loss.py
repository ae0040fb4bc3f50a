"""The chunked loss feature (:class:`ChunkedLoss`): a memory-lean LM head and cross-entropy for Hugging Face causal
LMs called with ``labels``.

The head and the loss run over chunks of tokens inside one autograd function that keeps only the final hidden
states and the labels and recomputes each chunk's logits in backward, so the full logits and their gradient never
exist at once; the loss and every gradient are the plain path's. It is independent of dropping (usable at rate 0).
It patches the model instance's ``forward`` (the class, ``isinstance``, state-dict keys and ``save_pretrained`` are
unchanged); :meth:`ChunkedHead.remove` restores it, and copies and pickles of the model leave it out
(:mod:`dropbp.execution.patching`). Only training forwards (``model.training`` and grad mode on) with ``labels`` take
the chunked path, and they return ``logits=None``; evaluation keeps the plain path. Another library's forward already on
the instance (Accelerate's mixed-precision wrapper) stays underneath and runs the body; the head and loss then run in
the dtype autocast gave the head there, forward and backward alike. Why and what it saves: docs/memory.md, section 2.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.autograd.function import once_differentiable

from dropbp.execution.patching import ForwardPatch
from dropbp.features.base import Feature, register_feature
from dropbp.features.host import Host

__all__ = ["DEFAULT_CHUNK_BYTES", "ChunkedHead", "ChunkedLoss", "UnsupportedModel", "linear_cross_entropy"]

#: float32 logits per chunk: 64 MiB, i.e. 341 tokens at a 49k vocabulary, 512 at 32k.
DEFAULT_CHUNK_BYTES = 64 * 2**20

# Config attributes of architectures that transform the logits after the head (softcapping,
# scaling): their loss is not cross-entropy of ``lm_head(h)``, so chunking here would change it.
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": None, "logits_scaling": 1.0}


class UnsupportedModel(ValueError):
    """The chunked loss cannot reproduce this model's loss; the message says why and what to do."""


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum over tokens of cross-entropy(``hidden @ weight.T + bias``, labels), chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, labels, chunk: int, ignore_index: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[start : start + chunk], weight, bias).float()
            target = labels[start : start + chunk]
            total += F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_total: torch.Tensor):
        hidden, weight, bias, labels = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[start : start + ctx.chunk]
            target = labels[start : start + ctx.chunk]
            probs = torch.softmax(F.linear(h, weight, bias).float(), dim=-1)
            valid = target != ctx.ignore_index
            rows = valid.nonzero().squeeze(1)
            probs[rows, target[rows]] -= 1.0
            probs[~valid] = 0.0
            # the plain path's logits gradient, in their dtype; an ignored row's stays 0 whatever the scale (every
            # label ignored: the loss is 0 / 0 and the scale inf, and the plain path's gradients are 0, not NaN)
            grad_logits = torch.where(valid[:, None], probs * grad_total, 0.0).to(h.dtype)
            if need_h:
                grad_h[start : start + ctx.chunk] = grad_logits @ weight
            if need_w:
                grad_w += grad_logits.t().float() @ h.float()
            if need_b:
                grad_b += grad_logits.float().sum(0)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Hugging Face's causal-LM loss (``ForCausalLMLoss``) of ``head(hidden)``, computed in chunks.

    Labels are shifted as there (the last position predicts nothing) unless ``shift_labels`` is
    given; the mean is over non-ignored tokens, or the sum divided by ``num_items_in_batch`` (what
    the Trainer passes under gradient accumulation). ``dtype``: the head's matmul in that dtype (what autocast
    would run it in), its inputs cast differentiably as autocast casts them; autocast itself is off inside.
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat_labels = shift_labels.reshape(-1).to(hidden.device)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    if flat_hidden.shape[0] != flat_labels.shape[0]:
        raise ValueError(
            f"labels have {flat_labels.shape[0]} tokens but the model produced {flat_hidden.shape[0]} positions; "
            "pass labels of the input's shape (and no logits_to_keep)"
        )
    weight, bias = head.weight, head.bias
    if dtype is not None:
        flat_hidden, weight = flat_hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    with torch.autocast(flat_hidden.device.type, enabled=False):  # backward recomputes in the same dtype
        total = _LinearCrossEntropy.apply(flat_hidden, weight, bias, flat_labels, chunk_tokens, ignore_index)
    if num_items_in_batch is None:
        return total / (flat_labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _is_pretrained(module: nn.Module) -> bool:
    # duck-typed so the core needs no transformers import: PEFT wrappers are not PreTrainedModels
    return any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)


def _find_causal_lm(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if _is_pretrained(module) and "labels" in inspect.signature(type(module).forward).parameters:
            head = module.get_output_embeddings()
            if head is not None:
                return module
    raise UnsupportedModel(
        f"the chunked loss needs a Hugging Face causal LM (a PreTrainedModel with an output embedding and a "
        f"`labels` argument) inside the model; none found in {type(model).__name__}. "
        "Leave dropbp.ChunkedLoss out for this model"
    )


def _check_head(lm: nn.Module) -> nn.Linear:
    head = lm.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise UnsupportedModel(
            f"the chunked loss computes the head as a plain nn.Linear, but {type(lm).__name__}'s output layer is a "
            f"{type(head).__name__} (an adapter on the LM head?); leave the head out of the adapter's "
            "target_modules or leave dropbp.ChunkedLoss out"
        )
    config = getattr(lm, "config", None)
    for name, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(config, name, neutral)
        if value != neutral:
            raise UnsupportedModel(
                f"{type(lm).__name__} transforms its logits ({name}={value}), so its loss is not cross-entropy of "
                "the head's output; leave dropbp.ChunkedLoss out for this model"
            )
    return head


def _head_returns_input(head: nn.Module, autocast_dtype: list[torch.dtype | None]) -> ForwardPatch:
    """The model's own forward then hands back the hidden states where it would compute the logits, appending to
    ``autocast_dtype`` the dtype autocast would have run the head in there (None: autocast off)."""

    def hidden_states(x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        autocast_dtype.append(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)
        return x

    return ForwardPatch(head, hidden_states)


def _is_chunked(forward: Any) -> bool:
    """Whether ``forward``, or a forward it wraps, is a :class:`ChunkedLoss` patch."""
    seen = 0
    while forward is not None and seen < 100:
        if getattr(forward, "dropbp_chunked_loss", False):
            return True
        forward, seen = getattr(forward, "__wrapped__", None), seen + 1
    return False


class ChunkedHead:
    """The chunked head and loss patched onto the causal LM inside ``model``; ``remove()`` undoes it.

    Args:
        model: a Hugging Face causal LM, possibly inside a PEFT wrapper or DDP.
        chunk_tokens: tokens per chunk; None: as many as fit :data:`DEFAULT_CHUNK_BYTES` of float32 logits.
    """

    def __init__(self, model: nn.Module, chunk_tokens: int | None = None) -> None:
        self.lm = _find_causal_lm(model)
        head = _check_head(self.lm)
        if chunk_tokens is None:
            chunk_tokens = max(1, DEFAULT_CHUNK_BYTES // (4 * head.weight.shape[0]))
        _check_chunk_tokens(chunk_tokens)
        if _is_chunked(vars(self.lm).get("forward")):
            raise RuntimeError(
                f"the chunked loss is already on this {type(self.lm).__name__} (applied twice); remove the first "
                "(its controller's remove()) before applying it again"
            )
        self.chunk_tokens = chunk_tokens
        self._labels_at = list(inspect.signature(type(self.lm).forward).parameters).index("labels") - 1  # no self
        self._plain = self.lm.forward

        @functools.wraps(self._plain)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._forward(*args, **kwargs)

        forward.dropbp_chunked_loss = True  # type: ignore[attr-defined]
        self._patch = ForwardPatch(self.lm, forward).install()

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        positional = len(args) > self._labels_at
        labels = args[self._labels_at] if positional else kwargs.get("labels")
        if labels is None or not (self.lm.training and torch.is_grad_enabled()):
            return self._plain(*args, **kwargs)
        if positional:
            args = (*args[: self._labels_at], None, *args[self._labels_at + 1 :])
        else:
            kwargs["labels"] = None
        head = _check_head(self.lm)
        autocast_dtype: list[torch.dtype | None] = []
        with _head_returns_input(head, autocast_dtype):
            out = self._plain(*args, **kwargs)  # no labels: no loss; "logits" are the hidden states
        if isinstance(out, tuple) and kwargs.get(
            "output_router_logits", getattr(self.lm.config, "output_router_logits", False)
        ):
            raise UnsupportedModel(
                "chunked_loss cannot find the router's auxiliary loss in a tuple output (return_dict=False with "
                "output_router_logits); call the model with return_dict=True or leave dropbp.ChunkedLoss out"
            )
        hidden = out[0] if isinstance(out, tuple) else out.logits
        loss = linear_cross_entropy(
            hidden,
            head,
            labels,
            chunk_tokens=self.chunk_tokens,
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            shift_labels=kwargs.get("shift_labels"),
            ignore_index=kwargs.get("ignore_index", -100),  # as the plain path's loss takes it from the forward
            dtype=autocast_dtype[-1] if autocast_dtype else None,
        )
        if isinstance(out, tuple):
            return (loss, *out[1:])
        loss = loss + self._auxiliary_loss(out, loss)
        fields = {k: v for k, v in out.items() if k != "logits"}
        return type(out)(**fields, loss=loss)  # logits=None: they were never computed whole

    def _auxiliary_loss(self, out: Any, loss: torch.Tensor) -> torch.Tensor | float:
        """What the model adds to its loss beside cross-entropy when given labels: a mixture of experts' router
        load-balancing loss (``aux_loss``, returned with ``output_router_logits``) times ``router_aux_loss_coef``."""
        aux = out.get("aux_loss")
        if aux is None:
            return 0.0
        coef = getattr(self.lm, "router_aux_loss_coef", None)
        if coef is None:
            raise UnsupportedModel(
                f"{type(self.lm).__name__} returns a router auxiliary loss (aux_loss) but no router_aux_loss_coef "
                "to weigh it by, so the chunked loss cannot add it as the model would; leave dropbp.ChunkedLoss out"
            )
        return coef * aux.to(loss.device)

    def remove(self) -> None:
        """Restore the model's own forward."""
        self._patch.remove()


def _check_chunk_tokens(chunk_tokens: object) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int (tokens per chunk) or None, got {chunk_tokens!r}")


@register_feature
class ChunkedLoss(Feature):
    """The feature: for a Hugging Face causal LM called with ``labels`` in training, the LM head and cross-entropy in
    chunks recomputed in backward (:class:`ChunkedHead`): same loss and gradients, but the full logits and their
    gradient never exist at once, so they no longer cap the memory dropping saves. Such forwards return
    ``logits=None``. Works at any drop rate, 0 included; turns ``memory_bound="auto"`` on.

    Args:
        chunk_tokens: tokens per chunk; None: as many as fit 64 MiB of float32 logits.
    """

    key = "chunked_loss"
    bounds_memory = True

    def __init__(self, chunk_tokens: int | None = None) -> None:
        super().__init__()
        if chunk_tokens is not None:
            _check_chunk_tokens(chunk_tokens)
        self._asked = chunk_tokens

    @classmethod
    def from_config(cls, value: object) -> ChunkedLoss | None:
        """As :meth:`Feature.from_config`, and a number is the tokens per chunk (``dropbp_chunked_loss: 256``)."""
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(value)
        return super().from_config(value)  # type: ignore[return-value]

    @classmethod
    def from_flat(cls, settings: dict[str, Any]) -> ChunkedLoss | None:
        return cls.from_config(settings.pop("chunked_loss", False))

    def config(self) -> dict[str, Any]:
        return {"chunk_tokens": self._asked}

    def check(self, model: nn.Module, framework: bool) -> None:
        _check_head(_find_causal_lm(model))

    def attach(self, host: Host) -> None:
        super().attach(host)
        self._part = ChunkedHead(host.model, self._asked)

    @property
    def chunk_tokens(self) -> int | None:
        """Tokens per chunk in force (None until attached, where ``chunk_tokens=None`` asks for the default)."""
        return self._asked if self._part is None else self._part.chunk_tokens

    def modules(self) -> list[nn.Module]:
        return [] if self._part is None else [self._part.lm]

    def __repr__(self) -> str:
        return f"ChunkedLoss(chunk_tokens={self.chunk_tokens})"
