"""The gradient reads the noise scale feature needs (:class:`dropbp.NoiseScale`; the numbers are
:mod:`dropbp.policy.noise_scale`'s).

No extra forward or backward: each micro-batch's gradient is the difference of the accumulated gradients (``.grad``
of the trainable parameters) after its backward and before its forward. At a training forward's start the gradients
are copied; when that forward's backward ends (a callback queued by a hook on the model's output, so it runs once, at
the end of the outermost backward, whatever checkpointing recomputes inside it) the squared norm of the difference and
of the accumulated sum are taken. An optimizer step's window closes at the next training forward that finds the
gradients cleared (``zero_grad``: set to None, or zeroed in place, which moves their version counters): its
micro-batches go to the estimator together, as read at the backward's end, before any gradient clipping. Eval,
no-grad and recomputation forwards read nothing.

Costs: one copy of the trainable parameters' gradients (small for LoRA; a full copy for full fine-tuning), made at
each micro-batch's forward, and two norms at its backward's end (``benchmarks/noise_scale_cost.py`` measures it).
Tokens per micro-batch are read from the input's shape (``input_ids`` or ``inputs_embeds``; padding included), so
nothing waits on the device. Needs at least two micro-batches per optimizer step (gradient accumulation): with one,
nothing is measured. Under DDP every rank reads its own micro-batches (before DDP writes the averaged gradient) and
each step's terms are averaged across the ranks; FSDP (sharded gradients) and DeepSpeed's engine are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dropbp.execution.compile_guards import outside_graphs
from dropbp.execution.recompute import in_backward
from dropbp.internals import at_backward_end, tensor_version
from dropbp.policy.noise_scale import NoiseScale, NoiseScaleEstimator, window_terms

__all__ = ["MicroBatchGradients", "check_reads", "measure_windows"]


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


def measure_windows(model: nn.Module, windows: Iterable[Sequence[Mapping[str, object]]]) -> NoiseScale | None:
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


def _first_tensor(output: object) -> torch.Tensor | None:
    """The model output's first tensor that needs a gradient (the loss where the model computes it, else logits)."""
    if torch.is_tensor(output):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, tuple | list) else ()
    return next((v for v in values if torch.is_tensor(v) and v.requires_grad), None)


class MicroBatchGradients:
    """Feeds ``estimator`` one optimizer step at a time from the gradients of ``model``'s trainable parameters.

    Args:
        model: the model whose training forwards delimit micro-batches.
        estimator: where each closed optimizer step goes.
        reads: ``reads()`` is False while a forward must not count (calibration's forced passes).
        on_step: called when an optimizer step has gone to the estimator, before the next step's first forward
            draws its pattern (the reads' forward pre-hook runs first).
    """

    def __init__(
        self,
        model: nn.Module,
        estimator: NoiseScaleEstimator,
        reads: Callable[[], bool],
        on_step: Callable[[], None] = lambda: None,
    ) -> None:
        self.estimator = estimator
        self._model = model
        self._reads = reads
        self._on_step = on_step
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._snapshot: list[torch.Tensor | None] = []
        self._micro: list[torch.Tensor] = []  # squared norms of the window's micro-batch gradients
        self._batch: torch.Tensor | None = None  # squared norm of the window's accumulated gradient so far
        self._tokens: list[int] = []
        self._current: int | None = None  # the index in _micro the running forward's backward fills
        self._versions: list[int | None] = []  # the gradients' version counters at the last read
        self._handles: list[RemovableHandle] = []

    @property
    def handles(self) -> list[RemovableHandle]:
        return self._handles

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        if self._handles:
            return
        self._params = [p for p in self._model.parameters() if p.requires_grad]
        self._handles = [
            self._model.register_forward_pre_hook(self._begin, with_kwargs=True, prepend=True),
            self._model.register_forward_hook(self._end),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _counts(self) -> bool:
        return self._model.training and torch.is_grad_enabled() and not in_backward() and self._reads()

    @outside_graphs
    def _begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._current = None
        if not self._counts():
            return
        grads = [p.grad for p in self._params]
        if self._batch is None or self._cleared(grads):
            self._close()
        tokens = _tokens(args, kwargs)
        if tokens is None:
            return
        self._snapshot = [None if g is None else g.detach().clone() for g in grads]
        self._tokens.append(tokens)
        self._micro.append(torch.zeros(()))  # filled when its backward ends
        self._current = len(self._micro) - 1

    @outside_graphs
    def _end(self, module: nn.Module, args: tuple, output: object) -> None:
        index = self._current
        first = _first_tensor(output) if index is not None else None
        if first is None:
            return

        def hook(grad: torch.Tensor) -> None:
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
                return True
        return False

    def _read(self, index: int) -> None:
        """At the end of micro-batch ``index``'s backward: its gradient's squared norm and the window's so far."""
        if index >= len(self._micro):
            return  # the window closed in between (a backward after the next zero_grad)
        micro = batch = None  # summed on the gradients' device: read on the host once per window
        norm = torch.linalg.vector_norm
        for p, before in zip(self._params, self._snapshot, strict=True):
            if p.grad is None:
                continue
            g = p.grad.detach()
            own = norm(g if before is None else g - before, dtype=torch.float32).square()
            total = norm(g, dtype=torch.float32).square()
            if micro is None:
                micro, batch = own, total
            else:
                micro, batch = micro + own.to(micro.device), batch + total.to(micro.device)
        self._versions = [None if p.grad is None else tensor_version(p.grad) for p in self._params]
        if micro is not None:
            self._micro[index], self._batch = micro, batch

    def _close(self) -> None:
        """The window read so far is one optimizer step: to the estimator (with at least two micro-batches)."""
        micro, batch, tokens = self._micro, self._batch, self._tokens
        self._micro, self._batch, self._tokens, self._snapshot, self._versions = [], None, [], [], []
        if batch is None or len(micro) < 2:
            return
        m = len(micro)
        scale = float(m * m)  # micro-batch gradients as means over their own tokens, the sum as the window's mean
        *squares, batch_square = torch.stack([*(x.to(batch.device) for x in micro), batch]).tolist()  # one host read
        gradient, trace = window_terms([x * scale for x in squares], batch_square, sum(tokens) / m)
        ranks = _world()
        if ranks > 1:  # every rank closes the same steps (the same forwards): the terms averaged across them
            import torch.distributed as dist

            terms = torch.tensor([gradient, trace], dtype=torch.float64, device=batch.device)
            dist.all_reduce(terms)
            gradient, trace = (terms / ranks).tolist()
        self.estimator.add(gradient, trace, sum(tokens) * ranks)
        self._on_step()

    def flush(self) -> None:
        """Close the window under way now (the run ended, or the caller knows a step just finished)."""
        self._close()
