"""The gradient reads the noise scale feature needs (:class:`dropbp.NoiseScale`; the numbers are
:mod:`dropbp.policy.noise_scale`'s).

No extra forward or backward: each micro-batch's gradient is the difference of the accumulated gradients (``.grad``
of the trainable parameters) after its backward and before its forward. At a training forward's start the gradients
are copied; when that forward's backward ends (a callback queued by a hook on the model's output, so it runs once, at
the end of the outermost backward, whatever checkpointing recomputes inside it) the squared norm of the difference and
of the accumulated sum are taken. An optimizer step's window closes at the next training forward that finds the
gradients cleared (``zero_grad``: set to None, or zeroed in place, which moves their version counters), or at the
backward's end of a micro-batch whose gradients were set to None after its forward (``forward -> zero_grad ->
backward``: that micro-batch begins the next step): its micro-batches go to the estimator together, as read at the
backward's end, before any gradient clipping. Several forwards before one backward are one micro-batch of all their
tokens. A step already under way when the reads are attached is left out. A step whose micro-batches dropped any
branch's backward is left out too (said once): a dropped branch leaves the gradient of every layer before it short of
that branch's path, so no micro-batch's gradient is a sample of the full one (read anyway, per branch where kept, it
was 0.59x-1.31x ``B_simple``); ``drop_rate="auto"`` measures one step in
:data:`~dropbp.policy.noise_scale.AUTO_REMEASURE_EVERY` at rate 0. Where the model returns its loss, the gradient
that reaches it (a loss scale, as ``GradScaler``'s, times any division by the accumulation) is read at the step's
first backward and divided out, so steps at different loss scales are averaged as the same gradients; a loss computed
outside the model cannot be seen: there the micro-batches are read as each one's mean loss over their count (what the
Trainer does), a loss scale that moves between steps left in (said once, in the ``dropbp`` log).
Eval, no-grad and recomputation forwards read nothing.

Costs: one copy of the trainable parameters' gradients (small for LoRA; a full copy for full fine-tuning), made at
each micro-batch's forward, and two norms at its backward's end (``benchmarks/noise_scale_cost.py`` measures it).
Tokens per micro-batch are read from the input's shape (``input_ids`` or ``inputs_embeds``; padding included), so
nothing waits on the device. With one micro-batch a step (one long document a step: no accumulation to read), the
step is read from within (:class:`WithinStep`): the gradient at the output layer's input, summed over contiguous
chunks of the step's tokens, is each chunk's exact gradient of a shift added there (the output layer and the loss act
on each token alone), so the chunks are the step's samples; drops change none of it. That reads the noise of the
model's last hidden layer, not of every parameter (a proxy: docs/noise-scale.md); a model whose output layer is not
reached through ``get_output_embeddings()`` reads nothing (the chunked loss keeps the head's forward: read alike).
Under DDP every rank reads its own micro-batches (before DDP writes the averaged gradient) and each step's terms are
averaged across the ranks; FSDP (sharded gradients) and DeepSpeed's engine are refused.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dropbp.checks import Once
from dropbp.execution.compile_guards import outside_graphs
from dropbp.execution.hooks import output_tensor
from dropbp.execution.recompute import in_backward
from dropbp.internals import at_backward_end, running_ddp, tensor_version
from dropbp.policy.noise_scale import NoiseScaleEstimator, NoiseScaleReading, window_terms

log = logging.getLogger("dropbp")

__all__ = ["CHUNKS", "MicroBatchGradients", "WithinStep", "check_reads", "chunk_terms", "measure_windows"]

#: Chunks a step of one micro-batch is read in (:class:`WithinStep`): its tokens' contiguous eighths.
CHUNKS = 8


def check_reads(model: nn.Module, framework: bool) -> None:
    """Refuse the reads where they would not see one micro-batch's gradient: FSDP (sharded gradients) and a
    framework's engine (``framework``: DeepSpeed partitions or reduces them itself). Under DDP each rank reads its
    own micro-batches (the reads run before DDP writes the averaged gradient) and the terms are averaged across the
    ranks when a step closes."""
    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    if framework or sharded:
        what = "FSDP shards" if sharded else "this framework's engine partitions or reduces"
        raise RuntimeError(
            f"the noise scale reads each micro-batch's gradient from .grad, which {what} between the reads. "
            "Measure the noise scale under DDP or in a one-process run (e.g. `dropbp check --model PATH`), or set "
            "leave dropbp.NoiseScale out"
        )


def measure_windows(model: nn.Module, windows: Iterable[Sequence[Mapping[str, object]]]) -> NoiseScaleReading | None:
    """The noise scale of ``windows`` of micro-batches (each the model's keyword inputs, labels included), read
    before training (the Trainer callback's start-of-training forecast): each micro-batch's loss is backpropagated on
    its own and its gradient read against its window's mean. No optimizer step; every trainable parameter's
    ``.grad`` is as it was found. The caller keeps DropBP out of these forwards (``ctl.forcing(())``). None where
    the model returns no loss or a window holds fewer than two micro-batches."""
    params = [p for p in model.parameters() if p.requires_grad]
    found = [p.grad for p in params]
    estimator = NoiseScaleEstimator()
    try:
        for window in windows:
            if len(window) < 2:
                return None
            micro: list[float] = []
            total: list[torch.Tensor] = []
            for inputs in window:
                for p in params:
                    p.grad = None
                loss = getattr(model(**inputs), "loss", None)
                if loss is None:
                    return None
                loss.backward()
                grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach() for p in params]
                micro.append(sum(float(g.double().pow(2).sum()) for g in grads))
                if total:
                    for t, g in zip(total, grads, strict=True):
                        t.add_(g)
                else:
                    total = [g.clone() for g in grads]
            batch = sum(float((t.double() / len(window)).pow(2).sum()) for t in total)
            estimator.update(micro, batch, _tokens((), dict(window[0])) or 1)
    finally:
        for p, grad in zip(params, found, strict=True):
            p.grad = grad
    return estimator.estimate()


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _tokens(args: tuple, kwargs: dict) -> int | None:
    """Tokens in a forward's input, from its shape (``input_ids``, ``inputs_embeds`` or the first tensor)."""
    for name in ("input_ids", "inputs_embeds"):
        if torch.is_tensor(kwargs.get(name)):
            x = kwargs[name]
            return x.numel() if name == "input_ids" else x.numel() // x.shape[-1]
    first = next((a for a in args if torch.is_tensor(a)), None)
    if first is None:
        return None
    return first.numel() if not first.is_floating_point() else first.numel() // first.shape[-1]


def chunk_terms(sums: torch.Tensor, counts: torch.Tensor) -> tuple[float, float] | None:
    """One step's ``(|G|^2, tr(Sigma))`` from its chunks: ``sums[k]``, chunk ``k``'s summed per-token gradient (of a
    loss that is one factor times the sum of the tokens' losses), ``counts[k]`` the tokens with a loss in it. Each
    chunk's mean gradient is ``sums[k] / counts[k]`` (the factor cancels in ``B_simple``); chunks with no token are
    left out. None with fewer than two chunks or a gradient that is not finite."""
    kept = counts > 0
    sums, counts = sums[kept].double(), counts[kept].double()
    if len(counts) < 2 or not bool(torch.isfinite(sums).all()):
        return None
    means = sums / counts[:, None]
    micro = means.square().sum(1).tolist()
    batch = float(means.mean(0).square().sum())
    return window_terms(micro, batch, counts.tolist())


class WithinStep:
    """Reads one micro-batch from within its backward: at the output layer's input (``get_output_embeddings()``'s
    forward input), the per-token gradient summed over ``chunks`` contiguous chunks of the micro-batch's tokens (batch
    and sequence flattened in order) and the tokens with a loss in each (those with a nonzero gradient row), one
    reading per backward through the head in :attr:`reads`."""

    def __init__(self, model: nn.Module, counts: Callable[[], bool], chunks: int = CHUNKS) -> None:
        self._model = model
        self._counts = counts
        self.chunks = chunks
        #: the readings since :meth:`forget` (one per backward through the head; two forwards of one loss: two)
        self.reads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._handle: RemovableHandle | None = None

    @staticmethod
    def head(model: nn.Module) -> nn.Module | None:
        """The output layer (a Hugging Face or PEFT model's ``get_output_embeddings()``), or None."""
        getter = getattr(model, "get_output_embeddings", None)
        try:
            head = getter() if callable(getter) else None
        except (AttributeError, NotImplementedError):
            return None
        return head if isinstance(head, nn.Module) else None

    def install(self) -> None:
        """Hook the output layer (none where the model has none: nothing is read within)."""
        head = self.head(self._model)
        if head is not None:
            self._handle = head.register_forward_pre_hook(self._capture)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @property
    def handles(self) -> list[RemovableHandle]:
        return [] if self._handle is None else [self._handle]

    @property
    def modules(self) -> list[nn.Module]:
        """The module it hooks (the output layer), while installed."""
        head = self.head(self._model) if self._handle is not None else None
        return [] if head is None else [head]

    def forget(self) -> None:
        self.reads = []

    @outside_graphs
    def _capture(self, module: nn.Module, args: tuple) -> None:
        hidden = args[0] if args and torch.is_tensor(args[0]) else None
        if hidden is None or not hidden.requires_grad or not self._counts():
            return
        chunks = self.chunks

        def read(grad: torch.Tensor) -> None:
            rows = grad.detach().reshape(-1, grad.shape[-1])
            bounds = torch.linspace(0, rows.shape[0], chunks + 1).round().long().tolist()
            spans = list(zip(bounds[:-1], bounds[1:], strict=True))
            sums = torch.stack([rows[a:b].sum(0, dtype=torch.float32) for a, b in spans])
            counts = torch.stack([(rows[a:b] != 0).any(1).sum() for a, b in spans])
            self.reads.append((sums, counts))

        hidden.register_hook(read)


class MicroBatchGradients:
    """Feeds ``estimator`` one optimizer step at a time from the gradients of ``model``'s trainable parameters.

    A step of several micro-batches is read only where none of them dropped a branch (the module docstring says why);
    ``on_step`` hears of every closed step, read or not.

    Args:
        model: the model whose training forwards delimit micro-batches.
        estimator: where each closed optimizer step goes.
        reads: ``reads()`` is False while a forward must not count (calibration's forced passes).
        on_step: called when an optimizer step closes, before the next step's first forward draws its pattern (the
            reads' forward pre-hook runs first), with ``"read"`` (it went to the estimator), ``"dropped"`` (its
            micro-batches dropped a branch) or ``"left out"`` (a gradient not finite, or too few tokens to read).
        dropped: the branches the running training forward drops (read when it ends).
    """

    def __init__(
        self,
        model: nn.Module,
        estimator: NoiseScaleEstimator,
        reads: Callable[[], bool],
        on_step: Callable[[str], None] = lambda outcome: None,
        dropped: Callable[[], frozenset[int]] = frozenset,
    ) -> None:
        self.estimator = estimator
        self._model = model
        self._reads = reads
        self._on_step = on_step
        self._dropped_now = dropped
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._snapshot: list[torch.Tensor | None] = []
        #: the gradient tensors the snapshot was copied from (weak): one gone by the backward's end means ``zero_grad``
        #: (set to None) ran between this forward and its backward, and the window ended there
        self._taken_from: list[weakref.ref | None] = []
        #: the window under way began in the middle of an optimizer step (attached then): left out when it closes
        self._partial = False
        self._began = False  # a counted forward has run since install
        self._synchronised = Once(
            "dropbp: the noise scale is not read under DDP that synchronises every micro-batch: DDP wrote the "
            "averaged gradient between two micro-batches of a step, so no micro-batch's own gradient can be told "
            "apart. Accumulate under ddp.no_sync() for every micro-batch but the last (the Trainer does). Said once."
        )
        #: the micro-batch whose backward has not ended: a forward before it joins it (a loss of several forwards)
        self._pending: int | None = None
        self._micro: list[torch.Tensor] = []  # per micro-batch, its gradient's squared norm (on the device)
        self._batch: torch.Tensor | None = None  # the window's accumulated gradient's squared norm so far
        self._tokens: list[int] = []
        self._dropped: list[bool] = []  # per micro-batch, whether its forward dropped a branch
        #: per micro-batch, the gradient that reached the model's loss (None: it returned none): the loss scale
        self._scales: list[torch.Tensor | None] = []
        self._scale_unseen_said = False
        self._current: int | None = None  # the index in _micro the running forward's backward fills
        self._versions: list[int | None] = []  # the gradients' version counters at the last read
        self._handles: list[RemovableHandle] = []
        #: a step of one micro-batch read from within (:class:`WithinStep`); its reading of the window's micro-batch
        self._within = WithinStep(model, self._counts)
        self._chunks: tuple[torch.Tensor, torch.Tensor] | None = None
        #: DDP synchronised a micro-batch: where its steps begin is unknown, so no window is read from within
        self._steps_unknown = False
        #: Optimizer steps left out: a non-finite gradient (fp16 overflow, skipped by GradScaler) or a dropped branch
        self.skipped = 0

    @property
    def handles(self) -> list[RemovableHandle]:
        return [*self._handles, *self._within.handles]

    @property
    def modules(self) -> list[nn.Module]:
        """The modules it hooks besides the model (copies leave the hooks out)."""
        return self._within.modules

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        if self._handles:
            return
        self._params = [p for p in self._model.parameters() if p.requires_grad]
        self._began = False  # attached anew: the step under way, if any, is not seen whole
        self._handles = [
            self._model.register_forward_pre_hook(self._begin, with_kwargs=True, prepend=True),
            self._model.register_forward_hook(self._end),
        ]
        self._within.install()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._within.remove()

    def _counts(self) -> bool:
        return self._model.training and torch.is_grad_enabled() and not in_backward() and self._reads()

    @outside_graphs
    def _begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._current = None
        if not self._counts():
            return
        if self._pending is not None:  # before the last forward's backward: one backward, so one micro-batch
            self._tokens[self._pending] += _tokens(args, kwargs) or 0
            self._current = self._pending
            return
        grads = [p.grad for p in self._params]
        if not self._began:  # the first counted forward: an optimizer step under way already has a gradient
            self._began, self._partial = True, any(g is not None and bool(g.any()) for g in grads)
        elif self._batch is None or self._cleared(grads):
            self._close()
        tokens = _tokens(args, kwargs)
        if tokens is None:
            return
        self._snapshot = [None if g is None else g.detach().clone() for g in grads]
        self._taken_from = [None if g is None else weakref.ref(g) for g in grads]
        self._within.forget()
        self._tokens.append(tokens)
        self._dropped.append(False)
        self._scales.append(None)
        self._micro.append(torch.zeros(()))  # filled when its backward ends
        self._current = self._pending = len(self._micro) - 1

    @outside_graphs
    def _end(self, module: nn.Module, args: tuple, output: object) -> None:
        index = self._current
        first = output_tensor(output) if index is not None else None
        if first is None:
            self._pending = None  # no backward to wait for
            return
        self._dropped[index] |= bool(self._dropped_now())  # several forwards: any of them

        def hook(grad: torch.Tensor) -> None:
            if grad.dim() == 0 and index < len(self._scales) and self._scales[index] is None:  # the loss's scale
                self._scales[index] = grad.detach().float()
            at_backward_end(lambda: self._read(index))

        first.register_hook(hook)

    def _cleared(self, grads: list[torch.Tensor | None]) -> bool:
        """Whether ``zero_grad`` ran since the last read: a gradient read then is now None (``set_to_none``) or was
        written in place (zeroed: its version counter moved; nothing else writes a gradient between a backward's
        end and the next forward but clipping, which comes before the optimizer step and its ``zero_grad``)."""
        if all(g is None for g in grads):
            return True
        for g, version in zip(grads, self._versions, strict=True):
            if version is not None and (g is None or tensor_version(g) != version):
                if g is not None and running_ddp() is not None and bool(g.any()):  # written, not zeroed: DDP's sync
                    self._synchronised()
                    self._steps_unknown = True  # its windows are micro-batches, not steps: none read from within
                return True
        return False

    def _read(self, index: int) -> None:
        """At the end of micro-batch ``index``'s backward: its gradient's squared norm and the window's so far."""
        self._pending = None
        if index >= len(self._micro):
            return  # the window closed in between (a backward after the next zero_grad)
        taken = self._taken_from
        if taken and any(ref is not None and p.grad is not ref() for p, ref in zip(self._params, taken, strict=True)):
            self._restart_at(index)  # zero_grad between this forward and its backward: a new window from here
            index = 0
        owns, totals = [], []  # summed on the gradients' device: read on the host once a window
        norm = torch.linalg.vector_norm
        for p, before in zip(self._params, self._snapshot, strict=True):
            if p.grad is None:
                continue
            g = p.grad.detach()
            device = owns[0].device if owns else g.device
            owns.append(norm(g if before is None else g - before, dtype=torch.float32).square().to(device))
            totals.append(norm(g, dtype=torch.float32).square().to(device))
        self._versions = [None if p.grad is None else tensor_version(p.grad) for p in self._params]
        self._chunks = self._within.reads[0] if index == 0 and len(self._within.reads) == 1 else None
        if owns:
            self._micro[index], self._batch = torch.stack(owns).sum(), torch.stack(totals).sum()

    def _restart_at(self, index: int) -> None:
        """Micro-batch ``index`` began a new optimizer step after its forward (``forward -> zero_grad -> backward``):
        the window before it closes without it, and it starts the next one, its own gradient the whole of it."""
        tokens, dropped, scale = self._tokens[index], self._dropped[index], self._scales[index]
        for held in (self._micro, self._tokens, self._dropped, self._scales):
            del held[index]
        self._close()
        self._micro, self._tokens, self._dropped, self._scales = [torch.zeros(())], [tokens], [dropped], [scale]
        self._snapshot, self._taken_from = [None] * len(self._params), [None] * len(self._params)
        self._current = 0

    def _close(self) -> None:
        """The window read so far is one optimizer step: to the estimator (two micro-batches or more that dropped no
        branch: their gradients; one: its chunks, read from within), its loss scale divided out."""
        micro, batch, tokens, dropped, partial = self._micro, self._batch, self._tokens, self._dropped, self._partial
        scale = self._scales[0] if self._scales else None
        chunks = None if self._steps_unknown else self._chunks  # (windows DDP ended are not steps: not read within)
        self._micro, self._batch, self._tokens, self._snapshot, self._versions = [], None, [], [], []
        self._dropped, self._taken_from, self._partial, self._pending, self._chunks = [], [], False, None, None
        self._scales = []
        if batch is None or partial or (len(micro) < 2 and chunks is None):  # (partial: begun before the reads)
            return
        if scale is None and not self._scale_unseen_said:
            self._scale_unseen_said = True
            log.info(
                "dropbp: the model returned no loss, so the noise scale cannot see a loss scale: it reads each "
                "micro-batch as its own mean loss over the accumulation, and a GradScaler whose scale moves between "
                "steps would be averaged at mixed scales. Pass labels to the model to have the scale divided out."
            )
        if len(micro) < 2:  # one micro-batch: its chunks (one host read), as gradients of the summed token losses
            sums, counts = chunks
            terms = chunk_terms(sums if scale is None else sums * (counts.sum() / scale.to(sums.device)), counts)
        elif any(dropped):
            terms = None
        else:  # each micro-batch's gradient as that of its own mean loss: unscaled, or (no loss seen) times 1/m
            m = len(micro)
            factor = m * m if scale is None else 1 / scale.to(batch.device).square()
            read = torch.stack([*(x.to(batch.device) for x in micro), batch / (m * m)]) * factor
            *squares, batch_square = read.tolist()  # one host read
            terms = window_terms(squares, batch_square, tokens)
        ranks = _world()
        if ranks > 1:  # every rank closes the same steps (the same forwards): the terms averaged across them
            import torch.distributed as dist

            both = torch.tensor(terms or [math.nan] * 2, dtype=torch.float64, device=batch.device)
            dist.all_reduce(both)  # a step one rank left out (its overflow, its drops): left out everywhere
            terms = tuple((both / ranks).tolist())
        if terms is None or not all(math.isfinite(x) for x in terms):  # dropped, or overflowed (GradScaler skips it)
            self.skipped += 1
            self._on_step("dropped" if any(dropped) else "left out")
            return
        gradient, trace = terms
        self.estimator.add(gradient, trace, sum(tokens) * ranks)
        self._on_step("read")

    def flush(self) -> None:
        """Close the window under way now (the run ended, or the caller knows a step just finished)."""
        self._close()
