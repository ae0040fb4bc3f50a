"""Token drops: a kept branch's backward on the token rows that carry its gradient (:class:`dropbp.experimental.
TokenDrops`, the feature).

What it computes. In a training forward, each kept branch's output passes through :class:`_SelectRows` (an identity).
In backward, the gradient ``g`` arriving there (one row per token) is replaced by ``w * g``: the selection rule
(:mod:`dropbp.experimental.token_selection`) keeps rows with probability ``p_t`` and ``w_t = 1 / p_t`` on the kept
rows, 0 elsewhere, so every gradient the branch produces (its parameters', and what it passes down through its
input) is an unbiased estimate of full backprop's. The residual stream is untouched. Exactly: every parameter's
gradient equals the unmodified model's in which each kept branch's output ``y`` is replaced by
``y.detach() + (w * y - (w * y).detach())`` (same values, gradient ``w * g``), for the weights recorded
(:attr:`RowDropEngine.last_weights`).

Why it is cheaper. Rows of ``w * g`` outside the kept set are zero, and stay zero through the branch's row-local
linear maps (every linear map of an MLP branch; an attention branch's query and output projections, named in
:data:`dropbp.architectures.ROW_LOCAL_ATTENTION_PROJECTIONS`, with LoRA's A and B inside them): their backward
(:class:`_RowGatheredLinear`) runs on the kept rows only - weight gradients from those rows, input gradients for them,
zeros elsewhere - so its cost scales with the kept share. Keys and values reach every later token, so their projections
keep full rows (a dropped token's key still gets gradient from the kept queries that read it). A linear map whose rows
are not the branch's (a mixture-of-experts expert) or whose backward cannot be gathered (a 4-bit layer) runs full
rows; the result is the same, only not cheaper. How many rows are gathered is the backend's part
(:mod:`dropbp.experimental.token_rows`: lazy-graph devices round up to a few fixed counts, so selections share
compiled graphs).

Under non-re-entrant activation checkpointing, a row-local branch as a whole (an MLP branch without tail, experts or
active dropout: :func:`dropbp.experimental.token_rows.recomputes_on_kept_rows`) runs without autograd in the forward,
and its backward (:class:`_KeptRowsBranch`) runs it again on the kept rows only: its recomputation, like its backward,
shrinks with the kept share. Its input is saved by :class:`_SavedInput` before it runs, so checkpointing's early stop
ends the region's recomputation there, without running the branch's full rows again.

The random order and offset of a selection come from a generator seeded by (seed, step, branch): a selection is a
function of them and the gradient, so a run resumed from ``ctl.state_dict()`` repeats it. Calibration's forced
forwards, eval and no-grad forwards select nothing.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dropbp.execution.compile_guards import outside_graphs
from dropbp.experimental.token_rows import GatheredRows, RowLocalLinear
from dropbp.experimental.token_selection import (
    AUTO_KEEP_SHARES,
    RankedScores,
    added_variance_at,
    auto_keep_share,
    keep_count,
    sampled_weights,
    selection_scores,
    token_shares,
)
from dropbp.internals import checkpoint_hook

__all__ = ["RowDropEngine", "RowSlot"]

#: ``token_drop_rate="auto"``: the weight of the readings so far against a new forward's (per branch, per share)
_SMOOTHING = 0.8


class RowSlot:
    """One kept branch call's selection: its key for the generator, filled in backward by the branch output's
    :class:`_SelectRows` (``weights`` per row, ``index`` the rows gathered), read by the branch's linear maps."""

    __slots__ = ("key", "rate", "rule", "place_rows", "rows", "residual_norms", "weights", "index", "saved_input")

    def __init__(
        self,
        key: tuple[int, int, int],
        rate: float | None,
        rule: str,
        place_rows: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    ) -> None:
        self.key, self.rule = key, rule
        self.rate = rate  # the share of rows dropped; None: token_drop_rate="auto", the branch's share in force
        #: the device's way to put gathered rows back in place (:mod:`dropbp.experimental.token_rows`)
        self.place_rows = place_rows
        self.rows: int | None = None  # rows of the branch output (set when the branch returns)
        self.residual_norms: torch.Tensor | None = None  # its row norms, for token_selection="residual"
        self.weights: torch.Tensor | None = None
        self.index: torch.Tensor | None = None
        #: a branch recomputed on its kept rows: the :class:`_SavedInput` node holding its input (which checkpointing
        #: recomputes when the branch's backward asks for it)
        self.saved_input: object | None = None


class _SelectRows(torch.autograd.Function):
    """Identity forward; in backward, draws the branch's selection from the gradient that arrives and returns it
    weighted (see the module docstring)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, slot: RowSlot, select: Callable[[torch.Tensor, RowSlot], None]) -> torch.Tensor:
        ctx.slot, ctx.select = slot, select
        # a copy, not a view: code after the branch may modify its output in place (Falcon's ``mlp_output +=
        # attention_output``), which autograd refuses on a custom Function's view
        return y.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        rows = grad.reshape(-1, grad.shape[-1])
        ctx.select(rows, ctx.slot)
        return (rows * _as(ctx.slot.weights, rows.dtype)[:, None]).view_as(grad), None, None


class _RowGatheredLinear(torch.autograd.Function):
    """A linear map's output (computed by the module) whose backward runs on the rows its branch kept.

    ``output = x @ weight.T + bias`` (``transposed``: ``x @ weight + bias``, transformers' ``Conv1D``). In backward,
    with ``K`` the slot's gathered rows: ``dx[K] = g[K] @ W``, zeros elsewhere; ``dW = g[K].T @ x[K]``;
    ``db = g[K].sum(0)``; in the gradient's dtype (bf16 under autocast), as autocast's own backward computes them.
    Without a selection (the output's gradient came another way) or with rows that are not the branch's: full rows.
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        computed: list[torch.Tensor],
        slot: RowSlot,
        transposed: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.slot, ctx.transposed = slot, transposed
        ctx.bias_dtype = None if bias is None else bias.dtype
        # the module's output, computed without autograd, handed over in a list: not an input of this Function, so
        # it is returned as this node's own output, not a view (a view of a custom Function's input cannot be
        # modified in place: ``ReLU(inplace=True)`` after the linear map); detached, because a linear map's output
        # on 3-D input is itself a view of its 2-D product, which autograd would count as one
        return computed.pop().detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dtype = grad.dtype
        g = grad.reshape(-1, grad.shape[-1])
        inputs = x.reshape(-1, x.shape[-1])
        index = ctx.slot.index if ctx.slot.rows == g.shape[0] else None
        kept = g if index is None else g.index_select(0, index)
        matrix = weight.t() if ctx.transposed else weight  # (out, in)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            part = torch.mm(kept, _as(matrix, dtype))
            if index is not None:
                part = ctx.slot.place_rows(part, index, g.shape[0])
            grad_x = _as(part, x.dtype).view_as(x)
        if ctx.needs_input_grad[1]:
            rows = inputs if index is None else inputs.index_select(0, index)
            grad = torch.mm(kept.t(), _as(rows, dtype))  # (out, in)
            grad_w = _as(grad.t() if ctx.transposed else grad, weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = _as(kept.sum(0), ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None


class _SavedInput(torch.autograd.Function):
    """Identity on the input of a branch recomputed on its kept rows; it saves that input for
    :class:`_KeptRowsBranch`'s backward, where checkpointing recomputes it (and, with early stopping, nothing after
    it: the branch's own forward is not run again)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _KeptRowsBranch(torch.autograd.Function):
    """The output of a branch computed without autograd, whose backward recomputes the branch on its kept rows only.

    In backward, the selection is drawn from the gradient ``g`` that arrives (as :class:`_SelectRows` draws it); the
    branch's input rows ``K`` that were kept are taken from the saved input and run through ``module.forward`` again
    with autograd (under the forward's autocast), and ``w[K] * g[K]`` is propagated back through them: the input's
    gradient on ``K`` (zeros elsewhere, placed by the backend) and the parameters' gradients. For a row-local branch
    these are exactly the gradients of :class:`_SelectRows`' ``w * g`` through the whole branch.
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        computed: list[torch.Tensor],
        module: nn.Module,
        slot: RowSlot,
        select: Callable[[torch.Tensor, RowSlot], None],
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.module, ctx.slot, ctx.select, ctx.params = module, slot, select, params
        device = x.device.type  # autocast's state, where autocast exists for the device (not on the lazy engine)
        ctx.autocast = None
        if torch.amp.is_autocast_available(device):
            enabled, dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
            ctx.autocast = {"device_type": device, "enabled": enabled, "dtype": dtype}
        return computed.pop().detach()  # not a view: it may be modified in place (_RowGatheredLinear)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        slot = ctx.slot
        rows = grad.reshape(-1, grad.shape[-1])
        ctx.select(rows, slot)
        (x,) = slot.saved_input.saved_tensors  # under checkpointing: recomputed here
        inputs, weights, index = x.detach().reshape(-1, x.shape[-1]), _as(slot.weights, rows.dtype), slot.index
        if index is not None:
            inputs, rows, weights = (t.index_select(0, index) for t in (inputs, rows, weights))
        kept = inputs.unsqueeze(0).requires_grad_(ctx.needs_input_grad[0])
        params = [p for p, needed in zip(ctx.params, ctx.needs_input_grad[5:], strict=True) if needed]
        replay = contextlib.nullcontext() if ctx.autocast is None else torch.autocast(**ctx.autocast)
        with torch.enable_grad(), replay:
            output = ctx.module.forward(kept)
        output = output[0] if isinstance(output, tuple) else output  # the branch's output tensor (its first)
        wanted = [kept, *params] if ctx.needs_input_grad[0] else params
        gradient = _as(rows * weights[:, None], output.dtype).view_as(output)
        found = list(torch.autograd.grad(output, wanted, gradient, allow_unused=True))
        grad_x = None
        if ctx.needs_input_grad[0]:
            part = found.pop(0)[0]
            grad_x = (part if index is None else slot.place_rows(part, index, x.numel() // x.shape[-1])).view_as(x)
        grads = iter(found)
        return grad_x, None, None, None, None, *(next(grads) if needed else None for needed in ctx.needs_input_grad[5:])


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``, with no operation dispatched where it already is (the host's work per map counts where
    it bounds a step: docs/token-drops.md)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


class RowDropEngine:
    """Token drops on the branches of one model, installed while ``token_drop_rate > 0`` (see the module docstring).

    Args: parts: per branch, its module then its tail (the last part's output is what the residual add receives).
        linears: per branch, its row-local linear maps (:func:`dropbp.experimental.token_rows.row_local_linears`).
        rows: the device's row operations (:func:`dropbp.experimental.token_rows.row_ops`): how many rows it gathers.
        call: per branch, ``call(index)`` gives ``(seed, step, settings)`` for a call of it now, or None where it
            selects nothing (dropped, calibration, eval or no grad).
        on_kept_rows: per branch, whether a checkpointed region recomputes it on its kept rows alone
            (:func:`dropbp.experimental.token_rows.recomputes_on_kept_rows`; at call time also: no active dropout).
    """

    def __init__(
        self,
        parts: Sequence[Sequence[nn.Module]],
        linears: Sequence[Sequence[RowLocalLinear]],
        rows: GatheredRows,
        call: Callable[[int], RowSlot | None],
        on_kept_rows: Sequence[bool],
    ) -> None:
        self._parts = [list(p) for p in parts]
        self._linears = [list(found) for found in linears]
        self._dropouts: list[list[nn.Dropout] | None] = [  # None: not recomputed on kept rows
            [m for m in p[0].modules() if isinstance(m, nn.Dropout)] if whole else None
            for p, whole in zip(self._parts, on_kept_rows, strict=True)
        ]
        self._rows = rows
        self._call = call
        self._slots: list[RowSlot | None] = [None] * len(self._parts)
        self._handles: list[RemovableHandle] = []
        self._warned_full_rows = False
        #: token_selection="cumulative": (seed, step) of the forward whose topmost kept branch drew, its weights, rows
        self._cumulative: tuple[tuple[int, int], torch.Tensor, torch.Tensor] | None = None
        #: Per branch, the weights of its most recent selection (``1 / p`` on kept rows, 0 elsewhere), or None.
        self.last_weights: list[torch.Tensor | None] = [None] * len(self._parts)
        #: token_drop_rate="auto": per branch, the share of rows kept now, and the smoothed added variance per share
        #: of AUTO_KEEP_SHARES (on the device; read on the host once per training forward, to choose the share)
        self.auto_shares: list[float] = [1.0] * len(self._parts)
        self._readings: list[torch.Tensor | None] = [None] * len(self._parts)
        #: called at every training forward's start, before anything else here (the feature's settings come into force)
        self.before_forward: Callable[[], None] = lambda: None

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    @property
    def handles(self) -> list[RemovableHandle]:
        return self._handles

    def install(self) -> None:
        """Put the hooks on (once)."""
        if self._handles:
            return
        for index, parts in enumerate(self._parts):
            self._handles.append(parts[0].register_forward_pre_hook(self._begin(index), with_kwargs=True))
            self._handles.append(parts[-1].register_forward_hook(self._end(index)))
            if self._dropouts[index] is not None:  # before the branch's gradient scaling wraps the output
                end = self._end_on_kept_rows(index)
                self._handles.append(parts[-1].register_forward_hook(end, prepend=True, always_call=True))
            for linear in self._linears[index]:
                self._handles += self._gathered(linear.module, index, linear.transposed)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._slots = [None] * len(self._parts)

    def _begin(self, index: int) -> Callable[..., tuple[tuple, dict] | None]:
        @outside_graphs
        def begin(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            slot = self._call(index) if torch.is_grad_enabled() and module.training else None
            self._slots[index] = None
            if slot is not None and self._on_kept_rows(index, args, kwargs):
                # saved for the backward; in a recomputation, checkpointing's early stop may end the region here
                entry = _SavedInput.apply(args[0])
                slot.saved_input = entry.grad_fn
                torch.set_grad_enabled(False)  # the branch runs without autograd; its backward recomputes
                self._slots[index] = slot
                return (entry,), kwargs
            self._slots[index] = slot
            return None

        return begin

    def _on_kept_rows(self, index: int, args: tuple, kwargs: dict) -> bool:
        """Whether this call of branch ``index`` is recomputed on its kept rows: a row-local branch called on one
        tensor that needs a gradient (the saved input lives in the autograd graph), inside a non-re-entrant
        checkpointed region (its forward or its recomputation, alike), with no dropout active in it (a recomputation
        on fewer rows would draw other masks)."""
        dropouts = self._dropouts[index]
        if dropouts is None or kwargs or len(args) != 1 or not torch.is_tensor(args[0]) or not args[0].requires_grad:
            return False
        return checkpoint_hook() is not None and not any(d.training and d.p > 0 for d in dropouts)

    def _end_on_kept_rows(self, index: int) -> Callable[..., object]:
        @outside_graphs
        def end(module: nn.Module, args: tuple, output: object) -> object:
            slot = self._slots[index]
            if slot is None or slot.saved_input is None:
                return None
            self._slots[index] = None
            torch.set_grad_enabled(True)
            if output is None:  # the call raised (always_call)
                return None
            first, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, None)
            carried = [r for r in rest or () if torch.is_tensor(r) and r.is_floating_point()]
            if not torch.is_tensor(first) or carried:  # not one output tensor to recompute on its kept rows alone:
                slot.saved_input = None  # the branch runs again with autograd, as when not checkpointed (its linear
                self._slots[index] = slot  # maps gathering their rows for this slot)
                try:
                    again = module.forward(*args)
                finally:
                    self._slots[index] = None
                return self._select(index, slot, again)
            slot.rows = first.numel() // first.shape[-1]
            self._note_residual(slot, first)
            branch = self._parts[index][0]
            params = [p for p in branch.parameters() if p.requires_grad]
            kept = _KeptRowsBranch.apply(args[0], [first], branch, slot, self._selector(index), *params)
            return kept if rest is None else (kept, *rest)

        return end

    @staticmethod
    def _note_residual(slot: RowSlot, output: torch.Tensor) -> None:
        """token_selection="residual": the branch output's row norms, its scores."""
        if slot.rule == "residual":
            slot.residual_norms = output.detach().reshape(slot.rows, -1).float().norm(dim=1)

    def _end(self, index: int) -> Callable[..., object]:
        @outside_graphs
        def end(module: nn.Module, args: tuple, output: object) -> object:
            slot, self._slots[index] = self._slots[index], None
            if slot is None or not torch.is_grad_enabled():
                return None
            return self._select(index, slot, output)

        return end

    def _select(self, index: int, slot: RowSlot, output: object) -> object:
        """``output`` of branch ``index`` with its output tensor's backward on the selected rows (:class:`_SelectRows`),
        or as it is where that tensor needs no gradient."""
        first = output[0] if isinstance(output, tuple) else output
        if not (torch.is_tensor(first) and first.requires_grad):
            return output
        slot.rows = first.numel() // first.shape[-1]
        self._note_residual(slot, first)
        selected = _SelectRows.apply(first, slot, self._selector(index))
        return (selected, *output[1:]) if isinstance(output, tuple) else selected

    def _gathered(self, linear: nn.Module, index: int, transposed: bool) -> list[RemovableHandle]:
        """Hooks that make ``linear``'s output, in a call of branch ``index`` that selects rows, one whose backward
        is :class:`_RowGatheredLinear`'s: the module computes its output without autograd (no graph to throw away),
        then the output is wrapped. Grad mode is put back after the call even if it raises (``always_call``); a
        ``KeyboardInterrupt`` is the model's guarded forward's to undo (:mod:`dropbp.execution.hooks`)."""
        calls: list[RowSlot | None] = []  # per call under way: the slot it gathers for, or None

        @outside_graphs
        def before(module: nn.Module, args: tuple) -> None:
            slot = self._slots[index]
            x = args[0] if args else None
            wanted = (torch.is_tensor(x) and (x.requires_grad or module.weight.requires_grad)) or False
            gathers = slot is not None and torch.is_grad_enabled() and wanted
            if gathers:
                torch.set_grad_enabled(False)
            calls.append(slot if gathers else None)

        @outside_graphs
        def after(module: nn.Module, args: tuple, output: object) -> object:
            slot = calls.pop()
            if slot is None:
                return None
            torch.set_grad_enabled(True)
            if not torch.is_tensor(output):  # the call raised (always_call), or an output that is not one tensor
                return None
            return _RowGatheredLinear.apply(args[0], module.weight, module.bias, [output], slot, transposed)

        return [linear.register_forward_pre_hook(before), linear.register_forward_hook(after, always_call=True)]

    def _selector(self, index: int) -> Callable[[torch.Tensor, RowSlot], None]:
        def select(rows: torch.Tensor, slot: RowSlot) -> None:
            count = rows.shape[0]
            shared = self._cumulative
            if slot.rule == "cumulative" and shared is not None and shared[0] == slot.key[:2]:
                slot.weights, slot.index = shared[1], shared[2]
                self.last_weights[index] = shared[1]
                return
            rate = 1.0 - self.auto_shares[index] if slot.rate is None else slot.rate
            keep = keep_count(count, rate)
            generator = torch.Generator().manual_seed(hash(slot.key) & (2**63 - 1))
            order = torch.randperm(count, generator=generator).to(rows.device, non_blocking=True)
            offset = torch.rand(1, generator=generator).to(rows.device, non_blocking=True)
            norms = rows.float().pow(2).sum(1).sqrt()
            ranked = RankedScores(selection_scores(norms, slot.rule, slot.residual_norms))
            if slot.rate is None:  # "auto": every share's probabilities at once; the share in force is among them
                keeps = tuple(keep_count(count, 1.0 - share) for share in AUTO_KEEP_SHARES)
                table = ranked.probabilities(keeps)
                self._fold_reading(index, added_variance_at(norms, table))
                probabilities = table[keeps.index(keep)] if keep in keeps else ranked.probabilities((keep,))[0]
            else:
                probabilities = ranked.probabilities((keep,))[0]
            weights = sampled_weights(probabilities, order, offset, keep)
            gathered = self._rows.kept_row_count(keep, count)
            slot.weights = weights
            everything = gathered >= count  # every row (a share of 1): the linear maps' own full-row backward
            slot.index = None if everything else torch.topk(weights, gathered, sorted=False).indices.sort().values
            self.last_weights[index] = weights.detach()
            if slot.rule == "cumulative":  # the branches below, in this forward's backward, keep these rows
                self._cumulative = (slot.key[:2], slot.weights, slot.index)

        return select

    def _fold_reading(self, index: int, reading: torch.Tensor) -> None:
        """token_drop_rate="auto": fold this selection's added variance at every share into the branch's readings
        (device operations only: nothing is read on the host in backward)."""
        reading = reading.detach()
        previous = self._readings[index]
        if previous is not None:
            reading = _SMOOTHING * previous.to(reading.device) + (1 - _SMOOTHING) * reading
        self._readings[index] = reading

    def clear_auto(self) -> None:
        """Forget the readings and shares of ``token_drop_rate="auto"`` (the rate left it): nothing more is read on
        the host, and a return to "auto" starts again from every row kept."""
        self._readings = [None] * len(self._parts)
        self.auto_shares = [1.0] * len(self._parts)

    def on_training_forward(self, pattern: frozenset[int]) -> None:
        """token_drop_rate="auto": each branch's share from its readings so far (one host read for all branches, at
        the forward's start); otherwise nothing: each kept branch call asks for its selection when it runs."""
        self.before_forward()
        read = [index for index, reading in enumerate(self._readings) if reading is not None]
        if not read:
            return
        device = self._readings[read[0]].device
        readings = torch.stack([self._readings[index].to(device) for index in read]).tolist()
        chosen = {index: auto_keep_share(values) for index, values in zip(read, readings, strict=True)}
        self.auto_shares = token_shares(self.auto_shares, chosen, one_share=self._rows.compiles_graphs)

    def auto_state(self) -> dict[str, list]:
        """token_drop_rate="auto"'s state: each branch's share in force and readings (None before its first)."""
        readings = [None if r is None else r.tolist() for r in self._readings]
        return {"shares": list(self.auto_shares), "readings": readings}

    def load_auto_state(self, state: dict[str, list]) -> None:
        """Restore :meth:`auto_state` output (the same branches)."""
        if len(state["shares"]) != len(self._parts) or len(state["readings"]) != len(self._parts):
            count = len(state["shares"])
            raise ValueError(f"token drops' automatic state has {count} branches, not {len(self._parts)}")
        self.auto_shares = [float(share) for share in state["shares"]]
        self._readings = [None if r is None else torch.tensor(r, dtype=torch.float32) for r in state["readings"]]

    def on_remove(self) -> None:
        self.remove()

    def warn_full_rows(self, names: Sequence[str]) -> None:
        """Once: the linear maps named run full rows under token drops (their backward cannot be gathered)."""
        if self._warned_full_rows or not names:
            return
        self._warned_full_rows = True
        warnings.warn(
            f"dropbp: token drops run the backward of {len(names)} linear map(s) on full rows, e.g. {names[0]!r} "
            "(a layer whose backward dropbp cannot gather: a 4-bit or otherwise replaced linear layer): their "
            "gradients are the same, only not cheaper. Said once.",
            stacklevel=2,
        )
