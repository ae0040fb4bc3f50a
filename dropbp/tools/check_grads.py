"""The correctness part of ``dropbp check``: the library's contract, verified on the user's device.

Each check holds the library against the model *without* it, on the same model object: the
reference for a drop pattern is the unmodified model with the dropped branches' outputs detached by
hand (the definition of DropBP), and for token drops the same model with each branch output's gradient rows weighted by
the selection the run recorded, so no copy of the model is needed. Gradient presence must match
exactly (a dropped branch's parameters get none); values within a stated relative tolerance, because
accelerators sum in nondeterministic order (fp32) and autocast rounds to bf16.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from dropbp.backends import Backend
from dropbp.internals import module_hooks
from dropbp.tools.arms import apply_arm as apply
from dropbp.tools.check_report import FAIL, PASS, SKIP, Outcome

__all__ = ["TOLERANCE", "Probe", "correctness_checks", "graph_saved_bytes"]

#: Largest allowed ``max|got - reference| / max|reference|`` per gradient tensor, by precision: fp32
#: leaves only summation order (atomics on GPUs); bf16 autocast rounds every product to 8 bits.
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


@dataclass
class Probe:
    """What every correctness check runs on: the model, device, one batch, the precision."""

    model: nn.Module
    backend: Backend
    ids: torch.Tensor
    precision: str = "fp32"  # "fp32" or "bf16" (autocast)

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.precision]

    def autocast(self) -> AbstractContextManager:
        return self.backend.autocast() if self.precision == "bf16" else nullcontext()

    def loss(self) -> torch.Tensor:
        """One forward with fixed randomness (dropout draws alike in the run and its reference)."""
        torch.manual_seed(1234)
        with self.autocast():
            return self.model(input_ids=self.ids, labels=self.ids).loss

    def grads(self) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        """Loss and every trainable parameter's gradient after one forward and backward."""
        self.model.zero_grad(set_to_none=True)
        loss = self.loss()
        loss.backward()
        self.backend.after_backward()  # a lazy device runs the step here, as in training
        grads = {
            n: None if p.grad is None else p.grad.detach().clone()
            for n, p in self.model.named_parameters()
            if p.requires_grad
        }
        self.model.zero_grad(set_to_none=True)
        return loss.detach().float(), grads


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.detach().abs().max().float().item()
    err = (got.detach().float() - want.detach().float()).abs().max().item()
    return err / scale if scale > 0 else err


def compare(got: tuple, want: tuple, tolerance: float) -> tuple[bool, str, dict]:
    """Loss and gradients against the reference: (ok, the one-line reason, figures)."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    presence = [n for n in ref_grads if (grads[n] is None) != (ref_grads[n] is None)]
    if presence:
        n = presence[0]
        has = "has" if grads[n] is not None else "has no"
        return False, f"{len(presence)} gradients differ in presence, e.g. {n} {has} gradient, the reference not", {}
    errors = {n: _relative(grads[n], ref_grads[n]) for n in ref_grads if ref_grads[n] is not None}
    loss_err = _relative(loss, ref_loss)
    worst = max(errors, key=errors.get) if errors else None
    figures = {
        "gradients": len(errors),
        "without_gradient": len(ref_grads) - len(errors),
        "max_relative_error": max(errors.values(), default=0.0),
        "loss_relative_error": loss_err,
        "tolerance": tolerance,
    }
    if loss_err > tolerance:
        return False, f"loss differs: relative error {loss_err:.2e} > {tolerance:g}", figures
    if worst is not None and errors[worst] > tolerance:
        return False, f"{worst}: relative error {errors[worst]:.2e} > {tolerance:g}", figures
    detail = (
        f"{figures['gradients']} gradients (+{figures['without_gradient']} absent in both), "
        f"max relative error {figures['max_relative_error']:.1e} <= {tolerance:g}"
    )
    return True, detail, figures


@contextmanager
def _output_hooks(model: nn.Module, hooks: dict[str, Callable[[nn.Module, tuple, object], object]]) -> Iterator[None]:
    """The named modules' outputs rewritten by their forward hooks for the duration (a reference's mechanism)."""
    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_hook(hook) for name, hook in hooks.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def detached(model: nn.Module, names: Sequence[str]) -> AbstractContextManager:
    """The hand-written reference: the outputs of the named modules detached after they run."""

    def detach(module: nn.Module, args: tuple, output: object) -> object:
        if isinstance(output, tuple):
            return tuple(o.detach() if torch.is_tensor(o) else o for o in output)
        return output.detach()

    return _output_hooks(model, dict.fromkeys(names, detach))


def _first_dropping_step(ctl, limit: int = 64) -> int:
    """The first step whose pattern drops something (a cut pattern may drop nothing at some steps)."""
    return next((s for s in range(limit) if ctl.dropped_at(s)), 0)


def _residual_inputs(model: nn.Module, branches: Sequence, dropped: Sequence[str]) -> list[str]:
    """The modules whose outputs the dropped branches add to the residual stream: each branch's last
    part (a post-norm decoder's norm after the branch, else the branch itself)."""
    names = {module: name for name, module in model.named_modules()}
    last = {b.name: b.parts[-1] for b in branches}
    return [names[last[d]] for d in dropped]


def check_gradients(probe: Probe, pattern: str) -> Outcome:
    """For a fixed ``pattern``-shaped drop pattern, every gradient equals the detached reference's."""
    name = f"gradients-equal-reference-{pattern}" + ("-bf16" if probe.precision == "bf16" else "")
    ctl = apply(probe.model, 0.5, seed=0, pattern=pattern, backend=probe.backend)
    try:
        ctl.load_state_dict({**ctl.state_dict(), "step": _first_dropping_step(ctl)})
        got = probe.grads()
        dropped = ctl.last_dropped
        added = _residual_inputs(probe.model, ctl.branches, dropped)
    finally:
        ctl.remove()
    with detached(probe.model, added):
        want = probe.grads()
    ok, detail, figures = compare(got, want, probe.tolerance)
    figures["dropped"] = list(dropped)
    where = f"{len(dropped)}/{len(ctl.branches)} branches dropped ({pattern}, "
    where += "bf16 autocast" if probe.precision == "bf16" else "fp32"
    return Outcome(name, PASS if ok else FAIL, f"{where}): {detail}", figures)


def weighted(model: nn.Module, weights: dict[str, torch.Tensor]) -> AbstractContextManager:
    """The hand-written reference of token drops: each named module's output keeps its values, and its gradient is
    multiplied row by row (one row per token) by ``weights``."""

    def weigh_by(rows: torch.Tensor) -> Callable[[nn.Module, tuple, object], object]:
        def weigh(module: nn.Module, args: tuple, output: object) -> object:
            y = output[0] if isinstance(output, tuple) else output
            w = rows.to(y.dtype).view(*y.shape[:-1], 1)
            y = y.detach() + (w * y - (w * y).detach())
            return (y, *output[1:]) if isinstance(output, tuple) else y

        return weigh

    return _output_hooks(model, {name: weigh_by(rows) for name, rows in weights.items()})


def check_token_gradients(probe: Probe) -> Outcome:
    """Token drops at 0.5: every gradient equals the reference that weights each branch output's gradient rows by the
    selection the run recorded (0 on the rows whose backward was skipped)."""
    ctl = apply(probe.model, 0.0, token_drop_rate=0.5, seed=0, backend=probe.backend)
    try:
        got = probe.grads()
        recorded = ctl.features["token_drops"].weights()
        names = {module: name for name, module in probe.model.named_modules()}
        last = {b.name: names[b.parts[-1]] for b in ctl.branches}  # what the residual add receives
    finally:
        ctl.remove()
    if not recorded:
        return Outcome("gradients-equal-reference-tokens", FAIL, "no branch selected token rows", {})
    with weighted(probe.model, {last[name]: w for name, w in recorded.items()}):
        want = probe.grads()
    ok, detail, figures = compare(got, want, probe.tolerance)
    kept = float(torch.cat([(w > 0).flatten() for w in recorded.values()]).float().mean())  # one host read
    figures["kept_row_share"] = kept
    where = f"token drops 0.5 in {len(recorded)} branches, {kept:.0%} of the rows kept, fp32"
    return Outcome("gradients-equal-reference-tokens", PASS if ok else FAIL, f"{where}: {detail}", figures)


def check_rate_zero(probe: Probe, plain: tuple) -> Outcome:
    """At drop rate 0 the library changes nothing: loss and gradients are the plain model's."""
    ctl = apply(probe.model, 0.0, pattern="uniform", backend=probe.backend)
    try:
        got = probe.grads()
        dropped = ctl.last_dropped
    finally:
        ctl.remove()
    ok, detail, figures = compare(got, plain, probe.tolerance)
    if dropped:
        ok, detail = False, f"rate 0 dropped {list(dropped)}"
    return Outcome("rate-0-equals-no-library", PASS if ok else FAIL, detail, figures)


def check_eval(probe: Probe) -> Outcome:
    """An eval-mode forward drops nothing and takes no step, even at a high rate."""
    probe.model.eval()
    try:
        plain = probe.grads()
        ctl = apply(probe.model, 0.5, pattern="uniform", backend=probe.backend)
        try:
            got = probe.grads()
            step, dropped = ctl.step, ctl.last_dropped
        finally:
            ctl.remove()
    finally:
        probe.model.train()
    ok, detail, figures = compare(got, plain, probe.tolerance)
    if dropped or step:
        ok, detail = False, f"eval forward dropped {list(dropped)} and took {step} steps"
    return Outcome("eval-drops-nothing", PASS if ok else FAIL, detail, figures)


def _hooks(model: nn.Module) -> dict[str, tuple]:
    """Every module's hooks, class and instance overrides: what ``remove()`` must restore."""
    return {
        n: (type(m), *module_hooks(m), tuple(sorted(set(vars(m)) - {"training"}))) for n, m in model.named_modules()
    }


def check_remove(probe: Probe, plain: tuple) -> Outcome:
    """After a training step and ``remove()``, the model has its hooks, weights and gradients as before."""
    hooks = _hooks(probe.model)
    weights = {k: v.detach().clone() for k, v in probe.model.state_dict().items()}
    ctl = apply(probe.model, 0.5, pattern="uniform", backend=probe.backend)
    probe.grads()
    ctl.remove()
    after = probe.model.state_dict()
    changed = [n for n, h in _hooks(probe.model).items() if hooks.get(n) != h] + [
        k for k in weights if k not in after or not torch.equal(after[k], weights[k])
    ]
    if changed or set(after) != set(weights):
        return Outcome("remove-restores-model", FAIL, f"not restored: {sorted(changed)[:3]}")
    ok, detail, figures = compare(probe.grads(), plain, probe.tolerance)
    return Outcome("remove-restores-model", PASS if ok else FAIL, "hooks and weights restored; " + detail, figures)


def check_state_round_trip(probe: Probe, steps: int = 8) -> Outcome:
    """``state_dict`` saved (``torch.save``) and loaded into a fresh controller continues the same patterns."""
    ctl = apply(probe.model, 0.5, seed=7, pattern="uniform", backend=probe.backend)
    try:
        for _ in range(3):
            probe.loss()  # training forwards draw patterns and advance the step
        probe.backend.graph_break()
        buffer = io.BytesIO()
        torch.save(ctl.state_dict(), buffer)
        expected = [ctl.dropped_at(s) for s in range(ctl.step, ctl.step + steps)]
    finally:
        ctl.remove()
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = apply(probe.model, 0.25, seed=99, pattern="uniform", backend=probe.backend)
    try:
        fresh.load_state_dict(state)
        got = [fresh.dropped_at(s) for s in range(fresh.step, fresh.step + steps)]
        probe.loss()
        probe.backend.graph_break()
        live = fresh.last_dropped
    finally:
        fresh.remove()
    if fresh.step != state["step"] + 1 or got != expected or live != expected[0]:
        return Outcome("state-round-trip", FAIL, f"patterns after loading differ: {got[:2]} vs {expected[:2]}")
    return Outcome("state-round-trip", PASS, f"step {state['step']} and the next {steps} patterns restored")


def graph_saved_bytes(model: nn.Module, loss: Callable[[], torch.Tensor]) -> int:
    """Bytes autograd saves for backward in one training forward (each storage counted once): the
    activation memory a dropped branch gives back, measurable on every device."""
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[(t.device.type, storage.data_ptr())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss()
    return sum(seen.values())


def check_no_graph(probe: Probe) -> Outcome:
    """Dropped branches run without autograd: they save nothing for backward and return no graph. Skipped under
    activation checkpointing, where no layer saves inside its region in the forward (its recomputation does, and a
    dropped branch skips it: tests/test_checkpointing.py)."""
    if any(getattr(m, "gradient_checkpointing", False) is True for m in probe.model.modules()):
        return Outcome(
            "dropped-branches-build-no-graph",
            SKIP,
            "activation checkpointing on: layers save nothing inside their regions in the forward, so there is "
            "nothing to tell dropped from kept here (the gradient checks above cover the checkpointed step)",
        )
    ctl = apply(probe.model, 0.5, seed=0, pattern="uniform", backend=probe.backend)
    names = [b.name for b in ctl.branches]
    modules = dict(probe.model.named_modules())
    inside: list[str] = []
    saved = dict.fromkeys(names, 0)
    grad_out: dict[str, bool] = {}
    handles = []
    for n in names:
        handles.append(modules[n].register_forward_pre_hook(lambda m, a, n=n: inside.append(n)))

        def after(m: nn.Module, a: tuple, out: object, n: str = n) -> None:
            inside.pop()
            grad_out[n] = (out[0] if isinstance(out, tuple) else out).requires_grad

        handles.append(modules[n].register_forward_hook(after))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside:
            saved[inside[-1]] += 1
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            probe.loss()
        probe.backend.graph_break()
        dropped = set(ctl.last_dropped)
    finally:
        for h in handles:
            h.remove()
        ctl.remove()
    leaks = [n for n in dropped if saved[n] or grad_out.get(n)]
    starved = [n for n in names if n not in dropped and not saved[n]]
    figures = {"dropped": sorted(dropped), "saved_tensors": saved}
    if leaks:
        return Outcome("dropped-branches-build-no-graph", FAIL, f"{leaks[0]} was dropped but saved tensors", figures)
    if starved:  # the hooks saw nothing: the check itself would prove nothing
        return Outcome("dropped-branches-build-no-graph", FAIL, f"kept branch {starved[0]} saved nothing", figures)
    detail = f"{len(dropped)} dropped branches saved 0 tensors; {len(names) - len(dropped)} kept ones saved some"
    return Outcome("dropped-branches-build-no-graph", PASS, detail, figures)


def correctness_checks(probe: Probe) -> list[Outcome]:
    """Every correctness check on ``probe``; an exception inside one is that check's FAIL, not the end."""
    outcomes = []

    def run(name: str, check: Callable[[], Outcome]) -> None:
        try:
            outcomes.append(check())
        except Exception as exc:  # a device error is a finding to report, with the check's name
            outcomes.append(Outcome(name, FAIL, f"raised {type(exc).__name__}: {str(exc).strip()[:200]}"))

    fp32 = Probe(probe.model, probe.backend, probe.ids, "fp32")
    plain = fp32.grads()
    run("gradients-equal-reference-uniform", lambda: check_gradients(fp32, "uniform"))
    run("gradients-equal-reference-cut", lambda: check_gradients(fp32, "cut"))
    if probe.precision == "bf16":
        run("gradients-equal-reference-uniform-bf16", lambda: check_gradients(probe, "uniform"))
    run("gradients-equal-reference-tokens", lambda: check_token_gradients(fp32))
    run("dropped-branches-build-no-graph", lambda: check_no_graph(fp32))
    run("rate-0-equals-no-library", lambda: check_rate_zero(fp32, plain))
    run("eval-drops-nothing", lambda: check_eval(fp32))
    run("remove-restores-model", lambda: check_remove(fp32, plain))
    run("state-round-trip", lambda: check_state_round_trip(fp32))
    return outcomes
