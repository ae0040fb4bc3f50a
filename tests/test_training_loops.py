"""Random training loops, as real ones interleave them: 1 to 3 training forwards per backward, backward,
optimizer steps, eval, ``no_grad`` and ``generate`` calls, activation checkpointing on and off, the memory bound
on and off, forwards that continue a cached prefix, state dicts saved and loaded, deep copies, ``remove`` and
``apply`` again (tiny Llama and GPT-2 with its cache on, full and LoRA, with and without Accelerate's bf16 forward).
After every backward each gradient equals the hand-detached reference's for the patterns the forwards
drew; after ``remove`` no dropbp hook is left and the model trains exactly like an untouched one. The CPU and the
lazy-graph backend, and states saved on the other one; a branch with a parametrized layer (``weight_norm``).
(Trainer runs, drawn: tests/test_trainer_runs.py.)"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import accelerate_bf16_forward, assert_same_grads, batch, detach_outputs, tiny_model, with_lora

import dropbp

hypothesis = pytest.importorskip("hypothesis")
accelerate = pytest.importorskip("accelerate")
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}  # the reference needs no RNG


def _dropbp_leftovers(model: torch.nn.Module, wrapper: object = None) -> list[str]:
    """What dropbp could leave on a module: its hooks, its instance ``forward`` (``wrapper``, another library's
    forward on the model, stays), its ``__getstate__``."""
    found = []
    for name, m in model.named_modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            found += [f"{name}: hook {fn!r}" for fn in hooks.values() if fn.__module__.startswith("dropbp")]
        found += [f"{name}: {k}" for k in ("forward", "__getstate__") if k in vars(m) and vars(m)[k] is not wrapper]
    return found


def _loss(model: torch.nn.Module, ids: torch.Tensor, prefix: bool) -> torch.Tensor:
    """The language-model loss of ``ids``; with ``prefix``, of its last 4 tokens continuing the first 4 from a
    key/value cache built without a graph."""
    if not prefix:
        return model(input_ids=ids, labels=ids).loss
    with torch.no_grad():
        out = model(input_ids=ids[:, :4], use_cache=True)
    cache = out.cache if "cache" in out else out.past_key_values
    return model(input_ids=ids[:, 4:], cache=cache, labels=ids[:, 4:]).loss


def _grads(model: torch.nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


class TrainingLoop(RuleBasedStateMachine):
    @initialize(
        arch=st.sampled_from(["llama", "gpt2"]),
        lora=st.booleans(),
        pattern=st.sampled_from(["cut", "uniform"]),
        checkpointing=st.sampled_from([None, "reentrant", "non-reentrant"]),
        mixed_precision=st.booleans(),
        backend=st.sampled_from(["cpu", "lazy"]),
        parametrized=st.booleans(),
    )
    def build(
        self,
        arch: str,
        lora: bool,
        pattern: str,
        checkpointing: str | None,
        mixed_precision: bool,
        backend: str,
        parametrized: bool,
    ) -> None:
        model = tiny_model(arch, layers=2, **NO_DROPOUT.get(arch, {}))
        if parametrized:  # torch.nn.utils.parametrize on a branch's layer: its class deep-copies itself
            name = "model.layers.0.mlp.down_proj" if arch == "llama" else "transformer.h.0.mlp.c_proj"
            torch.nn.utils.parametrizations.weight_norm(model.get_submodule(name))
        self.model = with_lora(model) if lora else model
        self.parametrized = parametrized
        self.plain = copy.deepcopy(self.model)  # never under dropbp: the reference, kept at the same weights
        self.lora, self.pattern, self.backend = lora, pattern, backend
        self.ctl = dropbp.apply(self.model, 0.5, seed=7, pattern=pattern, backend=backend)
        self.wrapper, self.removed = None, False
        if mixed_precision:  # what Trainer(bf16=True) puts on the model: Accelerate's autocast forward, on top
            for m in (self.model, self.plain):
                accelerate_bf16_forward(m)
            self.wrapper = vars(self.model)["forward"]
        self.pending: list[tuple[torch.Tensor, tuple[str, ...], bool]] = []
        self.total = None
        self.data = 0
        self.checkpointing(checkpointing)

    def _ids(self) -> torch.Tensor:
        self.data += 1
        return batch(self.data, length=8)

    @precondition(lambda self: len(self.pending) < 3)
    @rule(prefix=st.booleans())
    def training_forward(self, prefix: bool = False) -> None:
        ids = self._ids()
        step = None if self.ctl is None else self.ctl.step
        prefix = prefix and self.mode is None  # checkpointed, Hugging Face layers set a given cache aside
        loss = _loss(self.model, ids, prefix)
        dropped = () if self.ctl is None else self.ctl.last_dropped
        if self.ctl is not None:
            assert self.ctl.step == step + 1 and dropped == self.ctl.dropped_at(step)
        self.pending.append((ids, dropped, prefix))
        self.total = loss if self.total is None else self.total + loss

    @precondition(lambda self: self.pending)
    @rule()
    def backward(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.total.backward()
        self.plain.zero_grad(set_to_none=True)
        reference = 0.0
        for ids, dropped, prefix in self.pending:
            handles = detach_outputs(self.plain, dropped)
            reference = reference + _loss(self.plain, ids, prefix)
            for h in handles:
                h.remove()
        reference.backward()
        # a parametrized weight is computed by another kernel without a graph (a dropped branch's): a few ulps
        torch.testing.assert_close(self.total.detach(), reference.detach(), atol=1e-6, rtol=4e-7 * self.parametrized)
        assert_same_grads(_grads(self.model), _grads(self.plain))
        self.pending, self.total = [], None

    @precondition(lambda self: not self.pending)
    @rule(forwards=st.integers(2, 3))
    def several_forwards_one_backward(self, forwards: int) -> None:
        for _ in range(forwards):
            self.training_forward()
        self.backward()

    @precondition(lambda self: not self.pending)
    @rule()
    def optimizer_step(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
        self.model.zero_grad(set_to_none=True)
        self.plain.load_state_dict(self.model.state_dict())

    @rule(mode=st.sampled_from(["eval", "no_grad", "generate"]))
    def forward_drawing_nothing(self, mode: str) -> None:
        step = None if self.ctl is None else self.ctl.step
        ids = self._ids()
        if mode == "eval":
            self.model.eval()
            with torch.no_grad():
                self.model(input_ids=ids)
            self.model.train()
        elif mode == "no_grad":
            with torch.no_grad():
                self.model(input_ids=ids, labels=ids)
        else:
            self.model.generate(input_ids=ids[:, :4], max_new_tokens=2, do_sample=False, pad_token_id=0)
            self.model.train()
        assert step is None or self.ctl.step == step

    @precondition(lambda self: not self.pending)
    @rule(mode=st.sampled_from([None, "reentrant", "non-reentrant"]))
    def checkpointing(self, mode: str | None) -> None:
        self.mode = mode
        if mode is None:
            self.model.gradient_checkpointing_disable()
            return
        kwargs = {"use_reentrant": mode == "reentrant"}
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if mode == "reentrant":
            self.model.enable_input_require_grads()  # reentrant checkpointing needs an input with grad

    @precondition(lambda self: self.ctl is not None)
    @rule(index=st.integers(0, 3), after_pre_hooks=st.booleans())
    def interrupted_forward(self, index: int, after_pre_hooks: bool) -> None:
        """Ctrl-C inside a branch (dropped or not): grad mode is as it was, and the steps after are exact."""
        module = self.ctl.branches[index].module

        def interrupt(*args):
            raise KeyboardInterrupt

        handle = (
            module.register_forward_pre_hook(interrupt)
            if after_pre_hooks
            else module.register_forward_hook(interrupt, prepend=True)
        )
        ids = self._ids()
        try:
            with pytest.raises(KeyboardInterrupt):
                self.model(input_ids=ids, labels=ids)
        finally:
            handle.remove()
        assert torch.is_grad_enabled()

    @precondition(lambda self: self.ctl is not None and not self.pending)
    @rule(index=st.integers(0, 3), training=st.booleans())
    def branch_mode(self, index: int, training: bool) -> None:
        """A branch module put in eval or train on its own: it drops as the step decides."""
        name = self.ctl.branches[index].name
        self.model.get_submodule(name).train(training)
        self.plain.get_submodule(name).train(training)

    @precondition(lambda self: self.ctl is not None and not self.pending)
    @rule(on=st.booleans())
    def memory_bound(self, on: bool) -> None:
        self.ctl.memory_bound = on

    @precondition(lambda self: not self.pending)
    @rule()
    def save_and_load(self) -> None:
        self.model.load_state_dict(copy.deepcopy(self.model.state_dict()))
        if self.ctl is not None:
            state = copy.deepcopy(self.ctl.state_dict())
            self.ctl.load_state_dict(state)
            assert self.ctl.state_dict() == state

    @rule()
    def deepcopy(self) -> None:
        with warnings.catch_warnings():  # Accelerate's forward over dropbp's is left out of the copy, said
            warnings.simplefilter("ignore")
            twin = copy.deepcopy(self.model)  # any time, also between a forward and its backward
        # once removed, Accelerate's forward is the model's own: a deep copy keeps it as it would any instance
        # attribute (as a copy without dropbp does), with dropbp applied again over it or not
        assert _dropbp_leftovers(twin, self.wrapper if self.removed else None) == []
        dropbp.apply(twin, 0.5, seed=1).remove()

    @precondition(lambda self: self.ctl is not None and not self.pending)
    @rule()
    def remove(self) -> None:
        self.ctl.remove()
        self.ctl, self.removed = None, True
        assert _dropbp_leftovers(self.model, self.wrapper) == []
        self.plain.load_state_dict(self.model.state_dict())
        ids = self._ids()
        for m in (self.model, self.plain):
            m.zero_grad(set_to_none=True)
            m(input_ids=ids, labels=ids).loss.backward()
        assert_same_grads(_grads(self.model), _grads(self.plain))  # checkpointing may sum in another order
        self.model.zero_grad(set_to_none=True)

    @precondition(lambda self: self.ctl is None and not self.pending)
    @rule(seed=st.integers(0, 3))
    def apply(self, seed: int) -> None:
        self.ctl = dropbp.apply(self.model, 0.5, seed=seed, pattern=self.pattern, backend=self.backend)

    @precondition(lambda self: self.ctl is not None and not self.pending)
    @rule(seed=st.integers(0, 3), stratify=st.booleans(), bound=st.sampled_from([None, 4]))
    def state_from_another_backend(self, seed: int, stratify: bool, bound: int | None) -> None:
        """A state saved on the other device (a Gaudi run resumed from a CPU checkpoint, or back): what this device
        cannot run (stratified cuts on the lazy one) is refused naming it, changing nothing; the rest loads, and
        the lazy device's bound holds."""
        other = "cpu" if self.backend == "lazy" else "lazy"
        stratified = other == "cpu" and stratify and self.pattern == "cut"
        options = {"features": [dropbp.experimental.StratifiedCuts(2)]} if stratified else {"max_patterns": bound}
        saver = dropbp.apply(copy.deepcopy(self.plain), 0.5, seed=seed, pattern=self.pattern, backend=other, **options)
        state = saver.state_dict()
        saver.remove()
        before = self.ctl.state_dict()
        if self.backend == "lazy" and "stratified_cuts" in state:
            with pytest.raises(ValueError, match=r"state was saved with StratifiedCuts .* pass it in features"):
                self.ctl.load_state_dict(state)
            assert self.ctl.state_dict() == before
            return
        self.ctl.load_state_dict(state)
        assert self.ctl.state_dict() == state | {"max_patterns": self.ctl.max_patterns}

    @invariant()
    def train_mode(self) -> None:
        assert self.model.training

    @invariant()
    def device_bound(self) -> None:
        """The lazy device draws from a pool of at most its 16 patterns, whatever set or loaded the settings."""
        if self.ctl is not None and self.backend == "lazy":
            assert self.ctl.max_patterns is not None and self.ctl.max_patterns <= 16


TrainingLoop.TestCase.settings = settings(
    max_examples=30, stateful_step_count=20, deadline=None, derandomize=True, print_blob=True
)
test_training_loops = TrainingLoop.TestCase
