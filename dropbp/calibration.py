"""Branch sensitivities (the DropBP paper's calibration), from ONE forward pass.

S_i = sum over trainable parameters P of (||g_P|| - ||g_P^(i)||)^2, where g is the gradient with nothing dropped
and g^(i) the gradient with only branch i dropped (``gradnorm=False``: the squared norm of the whole difference,
sum ||g_P - g_P^(i)||^2). :func:`one_pass` gets every ``g^(i) = g - c^(i)`` (``c^(i)``: the vector-Jacobian product
of branch i's output ``y_i`` with the gradient arriving there, a backward that covers only the graph upstream of
``y_i``) from one forward, one full backward and N partial backwards: no forward is repeated, the randomness
(dropout) is the same for every branch by construction, and ``.grad`` is never touched. The research code's N + 1
forward+backward passes are kept to check against (:func:`sensitivities_by_recomputing`). Derivation, timings:
docs/calibration.md.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch
from torch import nn

from dropbp.backends import Backend
from dropbp.checks import check_bool
from dropbp.execution.discovery import Branch
from dropbp.execution.frameworks import calibration_closure, calibration_method
from dropbp.execution.patching import map_output
from dropbp.policy.allocation import allocate_rates
from dropbp.policy.drop_policy import DropPolicy

__all__ = [
    "CALIBRATION_METHODS",
    "OnePassUnavailable",
    "average_across_ranks",
    "CalibrationJob",
    "sensitivities_by_recomputing",
    "measure",
    "one_pass",
]

log = logging.getLogger("dropbp")

Closure = Callable[[], torch.Tensor]
#: How :func:`calibrate` measures: ``"one-pass"`` (all sensitivities from a single forward), or inside
#: ``dropbp.experimental.exact_recompute()`` the research code's ``"exact-recompute"`` (N + 1 passes; the same
#: sensitivities, measured not better); a DeepSpeed ZeRO-3 engine needs the latter and gets it either way.
METHOD: ContextVar[str] = ContextVar("dropbp_calibration_method", default="one-pass")
ForcePattern = Callable[[frozenset[int]], object]  # context manager factory: drop exactly these
Boundary = Callable[[], None]  # the backend's graph break (lazy devices); called after each backward

CALIBRATION_METHODS = ("one-pass", "exact-recompute")


def _draw_seed() -> int:
    return int(torch.randint(0, 2**62, ()).item())


def _reseed(seed: int) -> None:
    """Seed torch (every device's generator) and Python's ``random``: dropout masks, and anything
    else random in the closure, come out the same in every pass that starts here."""
    torch.manual_seed(seed)
    random.seed(seed)


def _checked_loss(closure: Closure) -> torch.Tensor:
    loss = closure()
    if not torch.is_tensor(loss) or loss.numel() != 1:
        got = type(loss).__name__
        raise TypeError(f"the calibration closure must return a scalar loss tensor, got {got}")
    if not loss.requires_grad:
        raise ValueError("the calibration loss does not require grad: the model has no trainable parameters")
    return loss


class _Tap(torch.autograd.Function):
    """Identity that records the gradient arriving from OUTSIDE a branch: the adjoint ``d_i``.

    (The gradient w.r.t. the branch's own output tensor would also count uses inside the branch:
    attention returns its weights, from which its output was computed.) The output is a copy, so
    later in-place ops on it cannot reach back into the branch.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, slot: list) -> torch.Tensor:
        ctx.slot = slot
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.slot[0] = grad if ctx.slot[0] is None else ctx.slot[0] + grad
        return grad, None


class _BranchOutput:
    """A branch output tensor and the gradient that reached it from downstream."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.slot: list[torch.Tensor | None] = [None]

    def tapped(self) -> torch.Tensor:
        return _Tap.apply(self.tensor, self.slot)


class OnePassUnavailable(RuntimeError):
    """A branch ran without autograd during the calibration forward (re-entrant activation
    checkpointing runs layers under no_grad and rebuilds their graph only inside backward), so its
    output graph cannot be reused; the brute-force method still works."""


class _Capture:
    def __init__(self, num_branches: int) -> None:
        self.outputs: list[list[_BranchOutput]] = [[] for _ in range(num_branches)]
        self.ran_without_grad = False


def _tap_outputs(capture: _Capture, index: int, keep: bool):
    store = capture.outputs[index]

    def hook(module: nn.Module, args: tuple, output: object) -> object:
        if not torch.is_grad_enabled():
            capture.ran_without_grad = True
            return None
        if not keep:
            return None
        return map_output(output, tap)

    def tap(item: object) -> object:
        if not (torch.is_tensor(item) and item.requires_grad):
            return item
        store.append(_BranchOutput(item))
        return store[-1].tapped()

    return hook


def _norm(t: torch.Tensor) -> torch.Tensor:
    """L2 norm accumulated in at least float32 (bf16/fp16 gradients would lose the differences)."""
    return torch.linalg.vector_norm(t, dtype=torch.promote_types(t.dtype, torch.float32))


class _FullGradient:
    """The gradient with nothing dropped, with its per-parameter norms computed once."""

    def __init__(self, grads: Sequence[torch.Tensor | None]) -> None:
        self.grads = grads
        self.norms = [None if g is None else _norm(g) for g in grads]

    def sensitivity(self, change: Sequence[torch.Tensor | None], gradnorm: bool) -> float:
        """S for one branch, from the change ``c = g - g^(i)`` (None: the parameter is unaffected).

        Terms stay on the device and are summed once, so a GPU synchronises once per branch."""
        terms = []
        for g, g_norm, c in zip(self.grads, self.norms, change, strict=True):
            if c is None or g is None:
                continue
            # not in place: torch.autograd.grad may hand back one tensor for several parameters
            terms.append((g_norm - _norm(c - g)).square() if gradnorm else _norm(c).square())
        return float(torch.stack([t.double().cpu() for t in terms]).sum()) if terms else 0.0


@contextmanager
def _capture_outputs(modules: Sequence[nn.Module], keep: bool = True) -> Iterator[_Capture]:
    """Tap the branch outputs (``keep``) and note whether a branch ran without autograd."""
    capture = _Capture(len(modules))
    handles = [m.register_forward_hook(_tap_outputs(capture, i, keep)) for i, m in enumerate(modules)]
    try:
        yield capture
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _stashed_grads(params: Sequence[nn.Parameter]) -> Iterator[None]:
    """Set ``.grad`` aside for the duration and put it back exactly afterwards."""
    saved = [p.grad for p in params]
    try:
        yield
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g


def _gradient(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor] | None,
    params: Sequence[nn.Parameter],
    retain_graph: bool,
    boundary: Boundary,
    accumulate: bool = False,
) -> list[torch.Tensor | None]:
    """Parameter gradients of one backward pass.

    ``torch.autograd.grad`` by default: it never runs the parameters' gradient-accumulation hooks,
    through which DDP would count the parameters as used in its next step. Re-entrant activation
    checkpointing supports only ``.backward()``: with ``accumulate`` the gradients are read from
    ``.grad`` (inside ``_stashed_grads``).
    """
    if not accumulate:
        grads = torch.autograd.grad(outputs, params, grad_outputs, retain_graph=retain_graph, allow_unused=True)
        boundary()
        return list(grads)
    for p in params:
        p.grad = None
    torch.autograd.backward(outputs, grad_outputs, retain_graph=retain_graph)
    boundary()
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


class CalibrationJob(NamedTuple):
    """What a sensitivity measurement needs: the loss closure, the trainable parameters, the branch modules, how to
    force a pattern, the ``gradnorm`` variant and the device's step boundary after each backward."""

    closure: Closure
    params: Sequence[nn.Parameter]
    branch_modules: Sequence[nn.Module]
    force: ForcePattern
    gradnorm: bool
    boundary: Boundary


def one_pass(job: CalibrationJob) -> list[float]:
    """Sensitivities of every branch from one forward (see the module docstring)."""
    closure, params, branch_modules, force, gradnorm, boundary = job
    _reseed(_draw_seed())  # the same randomness as the first pass of sensitivities_by_recomputing
    # The pattern stays forced through the backward passes too: activation checkpointing re-runs
    # branch forwards there, and they must see the same (empty) pattern as the forward did.
    with _stashed_grads(params), force(frozenset()):
        with _capture_outputs(branch_modules) as capture:
            loss = _checked_loss(closure)
        if capture.ran_without_grad:
            raise OnePassUnavailable(
                "a branch ran under no_grad in the calibration forward: a no-grad forward inside the loss (such as "
                "DPO's reference pass with the adapters off) or re-entrant activation checkpointing"
            )
        full = _FullGradient(_gradient([loss], None, params, retain_graph=True, boundary=boundary))
        result = []
        for outs in capture.outputs:
            reached = [o for o in outs if o.slot[0] is not None]
            if not reached:
                result.append(0.0)  # the branch's output does not reach the loss
                continue
            tensors, incoming = [o.tensor for o in reached], [o.slot[0] for o in reached]
            change = _gradient(tensors, incoming, params, retain_graph=True, boundary=boundary)
            result.append(full.sensitivity(change, gradnorm))
    return result


def sensitivities_by_recomputing(job: CalibrationJob) -> list[float]:
    """The research code's method: N + 1 forward/backward passes, reseeded identically each time."""
    closure, params, branch_modules, force, gradnorm, boundary = job
    seed = _draw_seed()

    def gradient(pattern: frozenset[int]) -> list[torch.Tensor | None]:
        _reseed(seed)
        with force(pattern):  # forward and backward: checkpointing recomputes under the pattern
            with _capture_outputs(branch_modules, keep=False) as capture:
                loss = _checked_loss(closure)
            return _gradient([loss], None, params, False, boundary, accumulate=capture.ran_without_grad)

    with _stashed_grads(params):
        full = _FullGradient(gradient(frozenset()))
        result = []
        for i in range(len(branch_modules)):
            dropped = gradient(frozenset({i}))
            change = [
                None if g is None else (g.clone() if d is None else g - d)
                for g, d in zip(full.grads, dropped, strict=True)
            ]
            result.append(full.sensitivity(change, gradnorm))
    return result


def average_across_ranks(values: list[float], device: torch.device, backend: Backend) -> list[float]:
    """The mean over ``torch.distributed`` ranks, identical on every rank (rank 0's copy is
    broadcast, so no rank can differ by a rounding); unchanged without an initialised group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    dist = torch.distributed
    where = backend.collective_device(device)
    t = torch.tensor(values, dtype=torch.float64, device=where)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    dist.broadcast(t, src=0)
    return t.tolist()


def measure(
    model: nn.Module,
    branch_modules: Sequence[nn.Module],
    closure: Closure,
    force: ForcePattern,
    *,
    gradnorm: bool,
    method: str,
    backend: Backend,
) -> list[float]:
    """Every branch's sensitivity on ``closure``'s batch, the same on every rank.

    The model runs in training mode (its modules' modes are restored after), ``.grad`` is left as it
    was, and ``method="one-pass"`` falls back to ``"exact-recompute"`` (with a logged warning) where a
    branch ran without autograd (re-entrant activation checkpointing rebuilds layer graphs only inside
    backward).

    Args:
        model: the model whose trainable parameters the sensitivities are measured on.
        branch_modules: the branch modules, in branch order.
        closure: runs a forward on one fixed batch and returns the scalar loss (no backward).
        force: context-manager factory that makes exactly the given branches drop.
        gradnorm: compare gradient norms (the paper) rather than whole gradients.
        method: ``"one-pass"`` or ``"exact-recompute"`` (the research code's N + 1 passes).
        backend: the device backend: its graph break follows each backward (lazy devices: one graph per pass),
            and it says where the ranks' average is taken.

    ``closure`` and ``method`` are checked by the entry point, :meth:`dropbp.DropBPController.calibrate`.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("calibrate: the model has no trainable parameters (requires_grad=True)")
    job = CalibrationJob(closure, params, branch_modules, force, gradnorm, backend.graph_break)
    modes = {m: m.training for m in model.modules()}
    model.train()
    try:
        sens = None
        if method == "one-pass":
            try:
                sens = one_pass(job)
            except OnePassUnavailable as why:
                log.warning("dropbp: calibrate falls back to exact-recompute (N + 1 passes): %s", why)
        if sens is None:
            sens = sensitivities_by_recomputing(job)
    finally:
        for module, training in modes.items():
            module.training = training
    return average_across_ranks(sens, params[0].device, backend)


def calibrate(
    model: nn.Module,
    branches: Sequence[Branch],
    policy: DropPolicy,
    force: ForcePattern,
    backend: Backend,
    closure: Closure,
    *,
    gradnorm: bool = True,
    min_rate: float = 0.0,
    max_rate: float = 0.9,
    **unknown: Any,
) -> list[float]:
    """``ctl.calibrate``: measure each branch's sensitivity and set ``policy``'s rates by :func:`dropbp.allocate_rates`.

    Nothing drops during calibration, the step counter does not move, ``.grad`` and train/eval modes are left as they
    were, and with ``torch.distributed`` initialised every rank ends with identical rates (the sensitivities are
    averaged). Where the allocation would drop every branch in some steps (few branches), the highest rates are
    lowered into the bound. Only for a shape that calibrates (``pattern="uniform"``): allocated rates do not fall
    with depth, so no cut realises them. Under a time schedule the rates are allocated for its peak and scaled back by
    the policy.

    Args:
        closure: runs a forward on one fixed batch and returns the scalar loss (no backward).
        gradnorm: compare gradient norms (the paper) rather than whole gradients.
        min_rate: the allocation's lowest rate.
        max_rate: the allocation's highest rate.
        unknown: refused (0.2's ``method=`` naming the way now).

    Returns:
        The sensitivities, in branch order.
    """
    if "method" in unknown:
        raise TypeError(
            "calibrate() no longer takes method (dropbp 0.3): the research code's N + 1 passes run inside "
            "dropbp.experimental.exact_recompute(): with it, ctl.calibrate(closure)"
        )
    if unknown:
        raise TypeError(f"calibrate() got unexpected keyword arguments {sorted(unknown)}: it takes gradnorm, "
                        "min_rate and max_rate")
    if not callable(closure):
        raise TypeError(f"closure must be callable and return the loss, got {type(closure).__name__}")
    method = METHOD.get()  # "one-pass"; the research code's N + 1 passes inside dropbp.experimental.exact_recompute()
    check_bool("gradnorm", gradnorm)
    if not policy.shape.calibrates:
        raise ValueError(
            f"calibrate allocates rates by each branch's sensitivity, which pattern={policy.shape.name!r} cannot "
            "realise (a cut's rates must fall with depth); set ctl.pattern = 'uniform' (the paper's patterns) "
            "before calibrating, or keep the shape's own rates"
        )
    closure = calibration_closure(closure)  # e.g. a DeepSpeed engine cannot take calibration passes
    method = calibration_method(model.parameters(), method)  # e.g. ZeRO-3: exact-recompute
    tails = [b.parts[-1] for b in branches]  # what the residual add receives: the tail's last part
    sens = measure(model, tails, closure, force, gradnorm=gradnorm, method=method, backend=backend)
    target = min(policy.options.drop_rate * policy.peak, max_rate)
    rates = allocate_rates(sens, [b.flops for b in branches], target, min_rate=min_rate, max_rate=max_rate)
    policy.set_allocated_rates(rates, min_rate)
    return sens
