"""DeepSpeed ZeRO stages 1, 2 and 3 on two CPU processes (gloo), with a hand-written
``deepspeed.initialize`` loop and with the Hugging Face Trainer.

Every rank draws the same patterns; every rank's parameters are identical after every step; the
parameters of branches dropped in a step are exactly as before it (``dropped_grads="skip"``); and every
parameter after every step is what one process computes on both ranks' batches with the same patterns
and the same optimizer, written out by hand here (to float rounding: two ranks average two half-batch
gradients where one process takes the mean over the whole batch). The loss falls over 20 steps.
Every job has a time limit: a hang fails the test.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import VOCAB, detach_outputs, ranks_done, run_ranks, tiny_model

import dropbp
from dropbp.tools.arms import apply_arm


def _why_no_deepspeed() -> str:
    """ci/install.sh records why deepspeed did not install in the environment it made."""
    record = Path(sys.prefix) / "deepspeed-unavailable"
    lines = record.read_text().strip().splitlines() if record.is_file() else []
    return f"deepspeed is not installed ({lines[-1] if lines else 'pip install dropbp[deepspeed]'})"


pytest.importorskip("deepspeed", reason=_why_no_deepspeed())


WORLD = 2
STEPS = 20
JOB_TIMEOUT = 240  # seconds for one two-process job, start-up (importing deepspeed) included
LR = {"sgd": 0.05, "adamw": 0.01}
# Two ranks average two half-batch gradients, one process takes the mean over the whole batch: float
# rounding apart. Measured over the 20 steps: SGD within 1.2e-7; AdamW within 1.2e-5 (dividing by
# sqrt(v) magnifies the rounding of small gradients).
ATOL = {"sgd": 1e-6, "adamw": 5e-5}
CLIP = 1.0  # DeepSpeed's default gradient clipping, written out; the norm must not count stale gradients

# (name, ZeRO stage, optimizer, dropped_grads, gradient accumulation steps, apply before
# deepspeed.initialize, optimizer offloaded to the CPU)
CASES = [
    ("z1-sgd", 1, "sgd", "skip", 1, True, False),
    ("z2-adamw", 2, "adamw", "skip", 1, False, False),
    ("z2-adamw-accum", 2, "adamw", "skip", 2, True, False),
    ("z2-adamw-offload", 2, "adamw", "skip", 1, False, True),
    ("z2-sgd-zero", 2, "sgd", "zero", 1, True, False),
    ("z3-sgd", 3, "sgd", "skip", 1, False, False),
    ("z3-adamw", 3, "adamw", "skip", 1, True, False),
    ("z3-adamw-accum", 3, "adamw", "skip", 2, False, False),
    ("z3-adamw-zero", 3, "adamw", "zero", 1, True, False),
    ("z3-adamw-zero-offload", 3, "adamw", "zero", 1, False, True),
]


def _run_ranks(target, *args) -> None:
    run_ranks(target, *args, world=WORLD, timeout=JOB_TIMEOUT)


def _ids(step: int, micro: int, rank: int) -> torch.Tensor:
    """Two counting sequences (each token the previous plus one): learnable in a few steps."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    start = torch.randint(3, VOCAB - 12, (2, 1), generator=g)
    return start + torch.arange(12)


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR[kind], momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=LR[kind], weight_decay=0.1)


def _config(stage: int, accumulation: int, offload: bool = False) -> dict:
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": zero,
        "gradient_clipping": CLIP,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # offload with torch's AdamW, the reference's optimizer
    }


def _full_params(model: torch.nn.Module, stage: int) -> dict[str, torch.Tensor]:
    if stage == 3:  # ZeRO-3 holds one shard per rank: gather (a collective)
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_case(stage: int, kind: str, dropped_grads: str, accumulation: int, apply_first: bool, offload: bool) -> dict:
    import deepspeed

    model = tiny_model("llama", layers=3)
    if apply_first:
        ctl = apply_arm(model, 0.5, seed=0, pattern="uniform", dropped_grads=dropped_grads)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=_optimizer(kind, model.parameters()), config=_config(stage, accumulation, offload)
    )
    if not apply_first:
        ctl = apply_arm(engine, 0.5, seed=0, pattern="uniform", dropped_grads=dropped_grads)
    rank = dist.get_rank()
    record = {"initial": _full_params(model, stage), "steps": []}
    for step in range(STEPS):
        patterns, losses = [], []
        for micro in range(accumulation):
            ids = _ids(step, micro, rank)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()  # steps the optimizer at the end of the accumulation window only
            patterns.append(ctl.last_dropped)
            losses.append(loss.item())
        record["steps"].append({"patterns": patterns, "losses": losses, "after": _full_params(model, stage)})
    ctl.remove()
    engine.destroy()
    return record


def _calibrate(stage: int) -> dict:
    """Sensitivities measured under ZeRO ``stage`` on this rank's batch, and what a closure that
    calls the engine instead of the model it wraps is told."""
    import deepspeed

    model = tiny_model("llama", layers=3)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=_optimizer("sgd", model.parameters()), config=_config(stage, 1)
    )
    ctl = dropbp.apply(engine, 0.5, seed=0, pattern="uniform")
    ids = _ids(0, 0, dist.get_rank())
    try:
        ctl.calibrate(lambda: engine(input_ids=ids, labels=ids).loss)
        refused = ""
    except ValueError as err:
        refused = str(err)
    sensitivities = ctl.calibrate(lambda: engine.module(input_ids=ids, labels=ids).loss)
    ctl.remove()
    engine.destroy()
    return {"sensitivities": sensitivities, "engine closure": refused}


def _refusals() -> dict[str, str]:
    """What apply says about DeepSpeed set-ups it cannot train with."""
    import deepspeed

    errors = {}
    for case, (config, dropped_grads) in {
        "reuse": (_config(3, 1), "reuse"),
        "offload with accumulation": (_config(2, 2, offload=True), "skip"),
        "ignore_unused_parameters=false": (
            {**_config(2, 1), "zero_optimization": {"stage": 2, "ignore_unused_parameters": False}},
            "skip",
        ),
    }.items():
        model = tiny_model("llama", layers=2)
        engine, *_ = deepspeed.initialize(model=model, optimizer=_optimizer("sgd", model.parameters()), config=config)
        try:
            apply_arm(engine, 0.5, dropped_grads=dropped_grads)
        except ValueError as err:
            errors[case] = str(err)
        engine.destroy()
    model = tiny_model("llama", layers=2)  # applied before deepspeed.initialize: stopped at the first forward
    ctl = dropbp.apply(model, 0.5, pattern="uniform")
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=_optimizer("sgd", model.parameters()), config=_config(3, 2, offload=True)
    )
    try:
        engine(input_ids=_ids(0, 0, 0), labels=_ids(0, 0, 0))
    except ValueError as err:
        errors["offload with accumulation, at the forward"] = str(err)
    ctl.remove()
    engine.destroy()
    return errors


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # as a launcher does: two processes share the cores
    env = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=WORLD, LOCAL_WORLD_SIZE=WORLD)
    os.environ.update({k: str(v) for k, v in env.items()})
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:  # deepspeed.initialize uses the process group opened here
        result = {case[0]: _train_case(*case[1:]) for case in CASES}
        result["calibration"] = {stage: _calibrate(stage) for stage in (2, 3)}
        result["refusals"] = _refusals()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        ranks_done()
    finally:
        dist.destroy_process_group()


def _shared_step_count(optimizer: torch.optim.Optimizer, steps_done: int) -> None:
    """Give every parameter the optimizer's step count, as ZeRO's one flat partition has.

    AdamW keeps a step count per parameter; ZeRO's optimizer holds one flat tensor per rank, so a
    parameter that was skipped still has its bias correction advance with the others."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:  # what torch.optim.AdamW creates at a parameter's first step
                state.update(
                    step=torch.tensor(0.0),
                    exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                    exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
                )
            state["step"].fill_(steps_done)


def _reference(kind: str, dropped_grads: str, accumulation: int, steps: list[dict]) -> list[dict]:
    """One process, written out by hand: both ranks' micro-batches, the recorded patterns applied by
    detaching the dropped branches' outputs, for "zero" a zero gradient for the dropped branches'
    parameters, the gradient clipped to norm CLIP, the optimizer step."""
    model = tiny_model("llama", layers=3)
    optimizer = _optimizer(kind, model.parameters())
    modules = dict(model.named_modules())
    after = []
    for step, record in enumerate(steps):
        for micro, pattern in enumerate(record["patterns"]):
            handles = detach_outputs(model, pattern)
            ids = torch.cat([_ids(step, micro, rank) for rank in range(WORLD)])
            (model(input_ids=ids, labels=ids).loss / accumulation).backward()
            for h in handles:
                h.remove()
        if dropped_grads == "zero":
            for name in {n for pattern in record["patterns"] for n in pattern}:
                for p in modules[name].parameters():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if kind == "adamw":
            _shared_step_count(optimizer, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return after


def _in_branch(name: str, branches) -> bool:
    return any(name.startswith(b + ".") for b in branches)


@pytest.fixture(scope="module")
def zero_runs():
    with tempfile.TemporaryDirectory() as tmp:
        _run_ranks(_rank_main, os.path.join(tmp, "init"), tmp)
        yield [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_zero_trains_as_one_process(zero_runs, case):
    name, stage, kind, dropped_grads, accumulation, *_ = case
    a, b = (r[name] for r in zero_runs)
    assert all(torch.equal(a["initial"][n], b["initial"][n]) for n in a["initial"])
    reference = _reference(kind, dropped_grads, accumulation, a["steps"])
    previous = a["initial"]
    skipped = 0
    for step, (sa, sb, want) in enumerate(zip(a["steps"], b["steps"], reference, strict=True)):
        assert sa["patterns"] == sb["patterns"] and all(len(p) == 3 for p in sa["patterns"]), step
        dropped_all = set.intersection(*(set(p) for p in sa["patterns"]))  # no gradient in the window
        for n, value in sa["after"].items():
            assert torch.equal(value, sb["after"][n]), (step, n)  # every rank alike
            if dropped_grads == "skip" and _in_branch(n, dropped_all):
                assert torch.equal(value, previous[n]), (step, n)  # untouched: no stale gradient, no decay
                skipped += 1
            torch.testing.assert_close(
                value, want[n], atol=ATOL[kind], rtol=0, msg=lambda m, s=step, n=n: f"{s} {n}: {m}"
            )
        previous = sa["after"]
    assert dropped_grads != "skip" or skipped > 0
    losses = [sum(s["losses"]) / accumulation for s in a["steps"]]
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5]), losses  # the last 5 steps >= 10% below the first 5


@pytest.mark.parametrize("stage", [2, 3])
def test_calibration_under_zero(zero_runs, stage):
    """The model the engine wraps calibrates as one process does on each rank's batch, averaged."""
    a, b = (r["calibration"][stage] for r in zero_runs)
    assert a["sensitivities"] == b["sensitivities"]
    model = tiny_model("llama", layers=3)
    ctl = dropbp.apply(model, 0.5, seed=0, pattern="uniform")
    per_rank = [ctl.calibrate(lambda r=r: model(input_ids=_ids(0, 0, r), labels=_ids(0, 0, r)).loss) for r in range(2)]
    want = [(x + y) / 2 for x, y in zip(*per_rank, strict=True)]
    torch.testing.assert_close(torch.tensor(a["sensitivities"]), torch.tensor(want), rtol=1e-4, atol=1e-9)
    assert "engine.module" in a["engine closure"], a["engine closure"]


def test_refused_setups(zero_runs):
    for errors in (r["refusals"] for r in zero_runs):
        assert "DroppedGradFill('reuse') cannot work under DeepSpeed" in errors["reuse"]
        assert "leave the fill out" in errors["reuse"]
        assert "ignore_unused_parameters" in errors["ignore_unused_parameters=false"]
        assert "gradient_accumulation_steps=1" in errors["offload with accumulation"]
        assert errors["offload with accumulation, at the forward"] == errors["offload with accumulation"]


def _train_with_trainer(out_dir: str, stage: int) -> dict:
    """A ZeRO ``stage`` Trainer (``deepspeed=`` in its arguments, AdamW with weight decay) with
    ``attach``: calibrated at step 2 of 20 under ZeRO, parameters gathered after every step (a no-op
    below stage 3, where every rank holds them whole)."""
    import deepspeed
    import transformers
    from test_hf_integration import _args, _dataset

    from dropbp.integrations.hf import attach, callback_for
    from dropbp.options import TrainerOptions

    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    args = _args(
        Path(out_dir), deepspeed=config, max_steps=STEPS, learning_rate=1e-2, weight_decay=0.1, logging_steps=1
    )
    args.use_cpu = False  # DeepSpeed's CPU accelerator is the device here
    trainer = transformers.Trainer(
        model=tiny_model("llama", layers=3),
        args=args,
        train_dataset=_dataset(),
        data_collator=transformers.default_data_collator,
    )
    try:
        callback_for(trainer, TrainerOptions(0.5, features=[dropbp.experimental.DroppedGradFill("reuse")]))
        refused = ""
    except ValueError as err:
        refused = str(err)
    callback = attach(trainer, drop_rate=0.5, pattern="uniform")  # calibrates at step 2
    patterns: list[tuple[str, ...]] = []
    snapshots: list[dict[str, torch.Tensor]] = []

    def record(module, inputs, output):
        if module.training and torch.is_grad_enabled() and callback.controller.forced is None:
            patterns.append(callback.controller.last_dropped)

    class Snapshot(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.on_step_end(args, state, control)

        def on_step_end(self, args, state, control, **kw):
            with deepspeed.zero.GatheredParameters(list(trainer.model.parameters())):
                snapshots.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})

    trainer.model.register_forward_hook(record)
    trainer.add_callback(Snapshot())
    trainer.train()
    return {
        "wrapper": type(trainer.model_wrapped).__name__,
        "refused": refused,
        "patterns": patterns,
        "rates": callback.controller.rates,
        "snapshots": snapshots,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }


def _trainer_rank_main(rank: int, init_file: str, out_dir: str, stage: int) -> None:
    """One process of a two-process Trainer job, set up as a launcher would."""
    torch.set_num_threads(1)
    env = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=WORLD, LOCAL_WORLD_SIZE=WORLD, OMP_NUM_THREADS=1)
    os.environ.update({k: str(v) for k, v in env.items()})
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        result = _train_with_trainer(os.path.join(out_dir, f"rank{rank}"), stage)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        ranks_done()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trainer_with_zero(tmp_path, stage):
    _run_ranks(_trainer_rank_main, str(tmp_path / "init"), str(tmp_path), stage)
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD))
    assert a["wrapper"] == "DeepSpeedEngine"
    assert "DroppedGradFill('reuse') cannot work under DeepSpeed" in a["refused"]
    assert len(a["patterns"]) == STEPS and a["patterns"] == b["patterns"]
    assert a["rates"] == b["rates"] and a["rates"] != [0.5] * 6  # calibrated under ZeRO, alike on both ranks
    assert len(a["snapshots"]) == STEPS + 1
    untouched = 0
    for step, pattern in enumerate(a["patterns"]):
        before, after, other = a["snapshots"][step], a["snapshots"][step + 1], b["snapshots"][step + 1]
        for n in after:
            assert torch.equal(after[n], other[n]), (step, n)
            if _in_branch(n, pattern):  # AdamW with weight decay 0.1 would move it
                assert torch.equal(after[n], before[n]), (step, n)
                untouched += 1
    assert untouched > 0
    assert sum(a["losses"][-5:]) < 0.9 * sum(a["losses"][:5]), a["losses"]
