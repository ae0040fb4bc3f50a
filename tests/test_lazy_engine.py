"""Gaudi's lazy mode (a ``LazyGraphBackend``) on PyTorch's own lazy-tensor engine (``torch._lazy``, TorchScript
backend, CPU).

Graphs here are real: the engine records ops until ``mark_step``, then compiles the graph or fetches it from its
cache (:mod:`dropbp.backends.lazy`). The backend shares the lazy-graph code with the HPU backend; only ``mark_step``
and the device are the engine's. The engine's cache lives as long as the process, so each test trains a model with a
vocabulary size of its own: every graph holds the embedding's shape, so no graph of another test is met. The optimizer
is SGD with momentum (one update graph per step, as Habana's FusedAdamW; torch's AdamW reads its step counter with
``.item()``, which would cut the update graph apart).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch
import torch._lazy
import transformers
from conftest import (
    VOCAB,
    assert_same_grads,
    batch,
    count_forwards,
    detach_outputs,
    loss_and_grads,
    tiny_model,
    weighted_outputs,
    with_lora,
)
from dropbp.backends.lazy import LazyEngineBackend, compiled_graphs, graph_runs, start

import dropbp
from dropbp.experimental.token_selection import AUTO_KEEP_SHARES
from dropbp.tools.arms import apply_arm

_vocab_sizes = itertools.count(VOCAB)


@pytest.fixture(autouse=True)
def engine_started() -> None:
    """The engine runs before any tensor moves to its device, whichever test of this file runs first."""
    start()


def own_model(layers: int = 4) -> torch.nn.Module:
    """A tiny Llama whose graphs no other test of this process compiles (a vocabulary size of its own)."""
    return tiny_model("llama", layers=layers, vocab_size=next(_vocab_sizes))


class Breaks:
    """The backend's graph breaks, each with the graphs compiled at it and the graphs run before it (a value read
    inside a step runs the pending graph early)."""

    def __init__(self, backend: LazyEngineBackend) -> None:
        self.events: list[tuple[str, int, int]] = []  # (label, compiled at the break, run early before it)
        self.label = ""
        graph_break = backend.graph_break
        self._runs = graph_runs()

        def counted() -> None:
            early = graph_runs() - self._runs
            before = compiled_graphs()
            graph_break()
            self.events.append((self.label, compiled_graphs() - before, early))
            self._runs = graph_runs()

        backend.graph_break = counted


def early_runs_of_the_model(model: torch.nn.Module) -> int:
    """Graphs the model itself runs inside one forward+backward on the engine (ops the TorchScript backend runs
    eagerly read their inputs: rotary embeddings, masks), without dropbp."""
    plain = copy.deepcopy(model).to("lazy")
    torch._lazy.mark_step()
    ids = batch(0).to("lazy")
    before = graph_runs()
    plain(input_ids=ids, labels=ids).loss.backward()
    early = graph_runs() - before
    torch._lazy.mark_step()
    return early


def train(model, ctl, breaks: Breaks, steps: int, micro_batches: int) -> list[int]:
    """A hand loop with ``ctl.backward`` / ``ctl.optimizer_step``; the graphs compiled by the end of each step."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3, momentum=0.9)
    totals = []
    start = compiled_graphs()
    for step in range(steps):
        for j in range(micro_batches):
            ids = batch(step * micro_batches + j).to("lazy")
            loss = model(input_ids=ids, labels=ids).loss / micro_batches
            breaks.label = "backward"
            count = len(breaks.events)
            assert ctl.backward(loss)
            assert len(breaks.events) == count + 1  # one break, at the end of the backward
        breaks.label = "optimizer step"
        count = len(breaks.events)
        ctl.optimizer_step(optimizer)
        assert len(breaks.events) == count + 1
        optimizer.zero_grad(set_to_none=True)
        totals.append(compiled_graphs() - start)
    return totals


def step_equals_the_reference(model, ctl, reference, ids: torch.Tensor) -> None:
    """One training step on the engine; its loss and gradients equal the CPU reference's with the pattern's branch
    outputs detached by plain hooks."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids.to("lazy"), labels=ids.to("lazy")).loss
    assert ctl.backward(loss)
    grads = {n: None if p.grad is None else p.grad.cpu() for n, p in model.named_parameters()}
    handles = detach_outputs(reference, ctl.last_dropped)
    ref_loss, ref_grads = loss_and_grads(reference, ids)
    for h in handles:
        h.remove()
    torch.testing.assert_close(loss.cpu(), ref_loss, atol=1e-5, rtol=0)
    assert_same_grads(grads, ref_grads, atol=1e-5)


_FULL = [(p, a, "full") for p in ("cut", "uniform") for a in (1, 2, 8)]


@pytest.mark.parametrize(("pattern", "micro_batches", "method"), [*_FULL, ("cut", 2, "lora"), ("uniform", 2, "lora")])
def test_graphs_are_bounded_by_the_plan_and_stop_when_the_rates_settle(pattern, micro_batches, method):
    backend = LazyEngineBackend()
    steps = {1: 60, 2: 40, 8: 16}[micro_batches]
    total = steps * micro_batches
    model = own_model()
    model = with_lora(model) if method == "lora" else model
    early = early_runs_of_the_model(model)
    model = model.to("lazy")
    # attach's shape of run: a warm-up over 20% of the run, the time schedule over its known length
    ctl = dropbp.apply(model, 0.5, seed=0, pattern=pattern, warmup_steps=total // 5, total_steps=total, backend=backend)
    assert ctl.max_patterns == 16
    torch._lazy.mark_step()  # the set-up's own graph (moving the model), before the first training step
    plan = ctl.schedule.patterns(micro_batches=micro_batches)
    assert plan.settled_at <= steps * 3 // 4  # some steps left to show that nothing more compiles
    breaks = Breaks(backend)
    totals = train(model, ctl, breaks, steps, micro_batches)

    # breaks: one after each backward and one after each optimizer step, nothing read early but what the model
    # itself reads without dropbp
    assert [label for label, _, _ in breaks.events] == (["backward"] * micro_batches + ["optimizer step"]) * steps
    assert all(e == early for label, _, e in breaks.events if label == "backward")
    assert all(e == 0 for label, _, e in breaks.events if label == "optimizer step")
    # compiled graphs: the forward+backward graphs at most the plan's prefixes, the update graphs its sequences,
    # each with the first step's once more; in all, at most the plan's graphs
    at_backward = sum(n for label, n, _ in breaks.events if label == "backward")
    at_update = sum(n for label, n, _ in breaks.events if label == "optimizer step")
    assert 1 < at_backward <= plan.prefixes + micro_batches
    assert 1 < at_update <= plan.sequences + 1
    assert at_backward + at_update <= plan.graphs
    # and nothing new once the plan has settled (the rates stopped moving)
    assert totals[plan.settled_at - 1 :] == [totals[-1]] * (steps - plan.settled_at + 1), totals


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("pattern", ["cut", "uniform"])
def test_gradients_on_the_engine_equal_the_reference(pattern, method):
    model = own_model()
    model = with_lora(model) if method == "lora" else model
    reference = copy.deepcopy(model)
    model = model.to("lazy")
    ctl = dropbp.apply(model, 0.5, seed=1, pattern=pattern, backend=LazyEngineBackend())
    seen = set()
    for step in range(6):
        step_equals_the_reference(model, ctl, reference, batch(step))
        seen.add(ctl.last_dropped)
    assert len(seen) > 1 and any(seen)  # several patterns, some dropping


@pytest.mark.parametrize("rate", [0.75, 0.875])
def test_the_memory_bound_on_the_engine_is_exact_and_its_graphs_are_the_plans(rate, monkeypatch):
    """The bound (on from 0.75) checkpoints layers through the backend: on the engine, whose device has no module for
    ``torch.utils.checkpoint`` to look up, it crashed before. Gradients equal the pattern's, every kept branch above
    the bound is recomputed, and a run's graphs stay within the plan and stop once its rates settle."""
    backend = LazyEngineBackend()  # starts the engine
    model = own_model(layers=8)
    reference = copy.deepcopy(model)
    model = model.to("lazy")
    ctl = dropbp.apply(model, rate, seed=2, backend=backend)
    assert ctl.memory_bound and ctl.pattern == "cut"
    keep = ctl.schedule.max_kept_branches
    counts = count_forwards(monkeypatch, {b.name: b.module for b in ctl.branches})
    bounded_steps = 0
    for step in range(20):  # the weights stay put: each step against the same reference
        counts.clear()
        step_equals_the_reference(model, ctl, reference, batch(step))
        kept = [b.name for b in ctl.branches if b.name not in set(ctl.last_dropped)]
        stored = [name for name in kept if counts[name] == 1]
        assert len(stored) <= keep and all(counts[name] == 2 for name in kept if name not in stored)
        bounded_steps += len(kept) > keep
    assert bounded_steps > 0

    steps, micro_batches = 40, 2  # a run of its own (a new vocabulary: no graph of the steps above)
    model = own_model(layers=8).to("lazy")
    ctl = dropbp.apply(model, rate, seed=0, warmup_steps=8, total_steps=steps * micro_batches, backend=backend)
    assert ctl.memory_bound
    torch._lazy.mark_step()
    plan = ctl.schedule.patterns(micro_batches=micro_batches)
    breaks = Breaks(backend)
    totals = train(model, ctl, breaks, steps, micro_batches)
    at_backward = sum(n for label, n, _ in breaks.events if label == "backward")
    at_update = sum(n for label, n, _ in breaks.events if label == "optimizer step")
    assert 1 < at_backward <= plan.prefixes + micro_batches and 1 < at_update <= plan.sequences + 1
    assert at_backward + at_update <= plan.graphs
    assert totals[plan.settled_at - 1 :] == [totals[-1]] * (steps - plan.settled_at + 1), totals


def test_the_plan_needs_the_runs_length():
    ctl = dropbp.apply(tiny_model("llama", layers=2), 0.5)
    with pytest.raises(ValueError, match="schedule.patterns needs optimizer_steps"):
        ctl.schedule.patterns()
    with pytest.raises(ValueError, match="micro_batches"):
        ctl.schedule.patterns(10, micro_batches=0)
    plan = ctl.schedule.patterns(10)
    assert plan.sequences == plan.prefixes == plan.patterns and plan.graphs == 2 * plan.patterns + 2


class _GaudiLikeTrainer(transformers.Trainer):
    """A stand-in of optimum-habana's ``GaudiTrainer`` in lazy mode on the engine: the model and batches on the lazy
    device, ``mark_step`` after each micro-batch's training step and after each optimizer step, as it places them."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.device_placement = False  # the model stays on the lazy device

    def compute_loss(self, *args, **kwargs):
        out = super().compute_loss(*args, **kwargs)
        if self.args.use_lazy_mode and self.args.pipelining_fwd_bwd:  # a break between forward and backward too
            self.mark_step("forward")
        return out

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.mark_step("backward")
        return loss

    def mark_step(self, label: str) -> None:
        self.breaks.label = label
        self.engine.graph_break()


@dataclasses.dataclass
class _LazyArguments(transformers.TrainingArguments):
    """The Trainer's arguments on the lazy device, with the fields of optimum-habana's ``GaudiTrainingArguments`` that
    bear on graphs (its defaults; ``use_lazy_mode`` on, as on Gaudi before software 1.21)."""

    use_lazy_mode: bool = True
    use_hpu_graphs_for_training: bool = False
    pipelining_fwd_bwd: bool = False
    throughput_warmup_steps: int = 0

    @property
    def device(self) -> torch.device:
        transformers.TrainingArguments.device.fget(self)  # the trainer's own set-up (processes, accelerate state)
        return torch.device("lazy")


class _AfterOptimizerStep(transformers.TrainerCallback):
    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.mark_step("optimizer step")


def _train_like_gaudi(
    tmp_path, steps: int, micro_batches: int, callbacks: list, **gaudi_arguments
) -> tuple[Breaks, torch.nn.Module]:
    """``steps`` optimizer steps of a fresh model through the Gaudi-like trainer, ``gaudi_arguments`` set; its
    breaks."""
    model = own_model()
    data = [{"input_ids": batch(i, size=1)[0], "labels": batch(i, size=1)[0]} for i in range(steps * micro_batches)]
    args = _LazyArguments(
        str(tmp_path), max_steps=steps, per_device_train_batch_size=1, gradient_accumulation_steps=micro_batches,
        optim="sgd", learning_rate=1e-3, lr_scheduler_type="constant", max_grad_norm=0, logging_nan_inf_filter=False,
        logging_steps=10_000, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, **gaudi_arguments,
    )  # fmt: skip
    after_step = _AfterOptimizerStep()
    callbacks = [*callbacks, after_step]
    trainer = _GaudiLikeTrainer(model=model.to("lazy"), args=args, train_dataset=data, callbacks=callbacks)
    after_step.trainer = trainer
    trainer.engine = SimpleNamespace(graph_break=torch._lazy.mark_step)
    trainer.breaks = Breaks(trainer.engine)
    trainer.train()
    return trainer.breaks, model


@pytest.mark.parametrize("micro_batches", [1, 2, 8])
def test_the_trainer_on_the_engine_compiles_what_the_plan_says(micro_batches, tmp_path):
    from dropbp.integrations.hf import DropBPCallback

    steps = {1: 60, 2: 40, 8: 16}[micro_batches]
    backend = LazyEngineBackend()
    placed_by_dropbp = []
    backend.graph_break = lambda: placed_by_dropbp.append(1)
    callback = DropBPCallback(drop_rate=0.5, backend=backend)
    plans = []
    callback.on_train_begin = _after(callback.on_train_begin, lambda: plans.append(_plan(callback, micro_batches)))
    breaks, _ = _train_like_gaudi(tmp_path / "dropbp", steps, micro_batches, [callback])
    plain, _ = _train_like_gaudi(tmp_path / "plain", steps, micro_batches, [])
    plan = plans[0]

    assert callback.controller.step == steps * micro_batches and not placed_by_dropbp  # the trainer's breaks only
    assert [label for label, _, _ in breaks.events] == (["backward"] * micro_batches + ["optimizer step"]) * steps
    # nothing read inside a step but what the model and the trainer read without dropbp
    assert [e for _, _, e in breaks.events] == [e for _, _, e in plain.events]
    compiled = [n for _, n, _ in breaks.events]
    assert 1 < sum(compiled) <= plan.graphs
    per_step = [sum(compiled[i * (micro_batches + 1) : (i + 1) * (micro_batches + 1)]) for i in range(steps)]
    assert plan.settled_at <= steps * 3 // 4 and not any(per_step[plan.settled_at :]), per_step


def _after(method, then):
    def wrapped(*args, **kwargs):
        out = method(*args, **kwargs)
        then()
        return out

    return wrapped


def _plan(callback, micro_batches: int):
    return callback.controller.schedule.patterns(micro_batches=micro_batches)


def test_the_device_bound_holds_through_setters_and_states_from_other_devices():
    """``max_patterns=None`` means the device's bound at every entry: ``apply``, the setter, a state saved on the CPU
    (a Trainer resumed on Gaudi from a CPU checkpoint); ``memory_bound="auto"`` follows a later drop rate."""
    lazy = dropbp.apply(own_model(), 0.5, backend="lazy", pattern="uniform")
    assert lazy.max_patterns == lazy.backend.default_max_patterns == 16
    lazy.max_patterns = 4
    assert lazy.max_patterns == 4
    lazy.max_patterns = None
    assert lazy.max_patterns == 16
    cpu = dropbp.apply(own_model(), 0.5, backend="cpu", pattern="uniform", seed=3)
    assert cpu.max_patterns is None
    lazy.load_state_dict(cpu.state_dict() | {"branches": [b.name for b in lazy.branches]})
    assert lazy.max_patterns == 16 and lazy.seed == 3
    stratified = [dropbp.experimental.StratifiedCuts(2)]
    with pytest.raises(ValueError, match=r"StratifiedCuts\(2\) .* no pattern pool \(max_patterns=16: .*default bound"):
        dropbp.apply(own_model(), 0.5, backend="lazy", features=stratified)

    auto = dropbp.apply(own_model(), 0.5, backend="lazy", pattern="uniform")
    assert auto.memory_bound is False
    auto.drop_rate = 0.875
    assert auto.memory_bound is True and auto.schedule.max_kept_branches == 1
    state = auto.state_dict()
    auto.drop_rate = 0.5
    assert auto.memory_bound is False
    auto.load_state_dict(state)
    assert auto.memory_bound is True and auto.schedule.max_kept_branches == 1


def _checkpointed(model: torch.nn.Module, checkpointing: bool) -> torch.nn.Module:
    if checkpointing:  # the MLP branches recomputed on their kept rows
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_token_drops_on_the_engine_are_exact_and_compile_no_graph_per_selection(checkpointing):
    """Token drops gather a fixed number of rows (:meth:`LazyGraphBackend.kept_row_count`), so a selection is data in
    the same graph: exact against the CPU reference, and the compiled graphs stop with the patterns; with
    checkpointing too (the MLP branches recomputed on their kept rows)."""
    backend = LazyEngineBackend()
    model = _checkpointed(own_model(), checkpointing)
    reference = copy.deepcopy(model)
    model = model.to("lazy")
    ctl = dropbp.apply(model, 0.5, seed=1, backend=backend, features=[dropbp.experimental.TokenDrops(0.5)])
    for step in range(3):
        model.zero_grad(set_to_none=True)
        ids = batch(step)
        assert ctl.backward(model(input_ids=ids.to("lazy"), labels=ids.to("lazy")).loss)
        grads = {n: None if p.grad is None else p.grad.cpu() for n, p in model.named_parameters()}
        weights = {
            name: w.cpu() for name, w in ctl.features["token_drops"].weights().items() if name not in ctl.last_dropped
        }
        handles = [*detach_outputs(reference, ctl.last_dropped), *weighted_outputs(reference, weights)]
        _, want = loss_and_grads(reference, ids)
        for h in handles:
            h.remove()
        assert_same_grads(grads, want, atol=1e-5)

    def graphs(**options) -> list[int]:  # a run of its own (a new vocabulary): graphs counted from its start
        model = _checkpointed(own_model(), checkpointing).to("lazy")
        ctl = apply_arm(model, 0.5, seed=0, backend=backend, **options)
        torch._lazy.mark_step()
        return train(model, ctl, Breaks(backend), steps=40, micro_batches=1)

    branches_only, with_tokens = graphs(), graphs(token_drop_rate=0.5)
    # the same patterns compile no more graphs with token drops, and nothing new once every pattern has run
    assert with_tokens[-1] <= branches_only[-1] and with_tokens[-10:] == [with_tokens[-1]] * 10, with_tokens
    # TokenDrops("auto"): one share for every branch (the backend compiles graphs: token_shares), so at most a graph per
    # pattern and share, and none new once the shares settle
    with_auto = graphs(token_drop_rate="auto")
    assert with_auto[-1] <= len(AUTO_KEEP_SHARES) * branches_only[-1] and with_auto[-10:] == [with_auto[-1]] * 10


def test_an_engine_the_user_started_first_is_used_as_it_is():
    """Reliability round 5 (E): ``apply(backend="lazy")`` after the user started the engine (as PyTorch's docs do)
    crashed with "multiple backend fallbacks"; it now trains on the running engine."""
    import subprocess
    import sys

    code = (
        "import torch, torch._lazy.ts_backend, transformers, dropbp\n"
        "torch._lazy.ts_backend.init()\n"
        "config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,\n"
        "    num_attention_heads=2, vocab_size=40)\n"
        "model = transformers.LlamaForCausalLM(config).to('lazy')\n"
        "ctl = dropbp.apply(model, 0.5, backend='lazy')\n"
        "ids = torch.randint(0, 40, (1, 8)).to('lazy')\n"
        "print('trained', ctl.backward(model(input_ids=ids, labels=ids).loss))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "trained True" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_gaudis_pipelining_of_forward_and_backward_compiles_at_most_twice_the_plan(micro_batches, tmp_path):
    """``pipelining_fwd_bwd`` (optimum-habana's break between each forward and its backward) splits every
    forward+backward graph of the plan in two: at most twice the plan's graphs, none after the plan settles."""
    from dropbp.integrations.hf import DropBPCallback

    steps = {1: 60, 2: 40}[micro_batches]
    backend = LazyEngineBackend()
    backend.graph_break = lambda: None
    callback = DropBPCallback(drop_rate=0.5, backend=backend)
    plans = []
    callback.on_train_begin = _after(callback.on_train_begin, lambda: plans.append(_plan(callback, micro_batches)))
    breaks, _ = _train_like_gaudi(tmp_path, steps, micro_batches, [callback], pipelining_fwd_bwd=True)
    plan = plans[0]
    step_breaks = ["forward", "backward"] * micro_batches + ["optimizer step"]
    assert [label for label, _, _ in breaks.events] == step_breaks * steps
    compiled = [n for _, n, _ in breaks.events]
    per_step = [sum(compiled[i * (2 * micro_batches + 1) : (i + 1) * (2 * micro_batches + 1)]) for i in range(steps)]
    assert sum(compiled) <= 2 * plan.graphs
    assert not any(per_step[plan.settled_at :]), per_step


def test_gaudis_hpu_graphs_for_training_are_refused_with_the_reason(tmp_path):
    """``use_hpu_graphs_for_training`` replays a captured forward by input shape alone: dropbp refuses it before the
    first step, naming the flag, why and what to set; through ``attach`` too."""
    from dropbp.integrations.hf import DropBPCallback, check_gaudi_arguments

    refused = r"use_hpu_graphs_for_training=True cannot be used.*Set use_hpu_graphs_for_training=False"
    with pytest.raises(ValueError, match=refused):
        _train_like_gaudi(tmp_path, 2, 1, [DropBPCallback(drop_rate=0.5, backend=LazyEngineBackend())],
                          use_hpu_graphs_for_training=True)  # fmt: skip
    check_gaudi_arguments(SimpleNamespace(use_hpu_graphs_for_training=False, pipelining_fwd_bwd=True))
    with pytest.raises(ValueError, match="replayed by input shape"):
        dropbp.attach(_hpu_graphs_trainer(tmp_path), drop_rate=0.5)


def _hpu_graphs_trainer(tmp_path) -> transformers.Trainer:
    args = _LazyArguments(str(tmp_path), max_steps=1, report_to=[], use_cpu=True, use_hpu_graphs_for_training=True)
    return transformers.Trainer(model=own_model(), args=args)


def test_token_drops_with_sdpa_compile_the_step_graphs_of_branch_drops_alone():
    """transformers' default attention (SDPA) on the engine: the TorchScript backend runs SDPA eagerly, reading its
    inputs, so a step also compiles small graphs outside its breaks (more with token drops: their gathered query rows
    are other inputs). The graphs a step compiles at its breaks, the ones a lazy-graph device runs, are the same with
    and without token drops, and no graph is new once every pattern has run."""
    import transformers
    from conftest import _COMMON, TINY_CONFIGS

    def graphs(**options) -> tuple[int, list[int]]:
        config = transformers.AutoConfig.for_model(
            "llama", **{**_COMMON, **TINY_CONFIGS["llama"], "num_hidden_layers": 4, "vocab_size": next(_vocab_sizes)}
        )
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train().to("lazy")
        backend = LazyEngineBackend()
        ctl = apply_arm(model, 0.5, seed=0, backend=backend, **options)
        torch._lazy.mark_step()
        breaks = Breaks(backend)
        totals = train(model, ctl, breaks, steps=40, micro_batches=1)
        return sum(compiled for _, compiled, _ in breaks.events), totals

    (at_breaks, alone), (with_tokens_at_breaks, with_tokens) = graphs(), graphs(token_drop_rate=0.5)
    assert with_tokens_at_breaks == at_breaks
    assert alone[-8:] == [alone[-1]] * 8 and with_tokens[-8:] == [with_tokens[-1]] * 8, (alone, with_tokens)
