"""Two CPU processes (gloo): DDP and FSDP2 drop the same branches on every rank, keep every rank's
parameters identical, and give the gradients of one process on the concatenated batch; DDP set-ups
that cannot work fail with a clear message; the Trainer and the torchrun examples run. Every job has a
time limit: a hang fails the test."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import (
    assert_same_grads,
    batch,
    detach_outputs,
    ranks_done,
    run_ranks,
    tiny_model,
    weighted_outputs,
    with_lora,
)
from torch.nn.parallel import DistributedDataParallel

import dropbp
from dropbp.tools.arms import apply_arm

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
STEPS = 10
JOB_TIMEOUT = 150  # seconds for one two-process job, start-up included


def _run_ranks(target, *args) -> None:
    run_ranks(target, *args, world=WORLD, timeout=JOB_TIMEOUT)


def _ids(step: int, rank: int) -> torch.Tensor:
    return batch(seed=100 + WORLD * step + rank, size=2)


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A plain CPU copy of a parameter or gradient, gathered when FSDP2 shards it (a collective)."""
    if t is None:
        return None
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().clone()


def _distribute(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """``model`` under DDP (unused parameters allowed: dropped branches leave some) or FSDP2 (each layer sharded)."""
    if mode == "ddp":
        return DistributedDataParallel(model, find_unused_parameters=True)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _wrap(
    model: torch.nn.Module, mode: str, order: str, pattern: str
) -> tuple[torch.nn.Module, dropbp.DropBPController]:
    """DropBP and DDP / FSDP2 in either order; returns the model to call and the controller. ``"cut+bound"``: the
    cut with the memory bound in force (at 0.5 a step keeping more than 3 of the 6 branches runs its lowest kept
    layers checkpointed)."""
    options = {"pattern": "cut", "memory_bound": True} if pattern == "cut+bound" else {"pattern": pattern}
    if order == "apply-first":
        ctl = dropbp.apply(model, 0.5, seed=0, **options)
    wrapped = _distribute(model, mode)
    if order == "wrap-first":
        ctl = dropbp.apply(wrapped, 0.5, seed=0, **options)
    return wrapped, ctl


def _train(mode: str, order: str, pattern: str) -> list[dict]:
    model = tiny_model("llama", layers=3)
    wrapped, ctl = _wrap(model, mode, order, pattern)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    names = [n for n, _ in model.named_parameters()]  # FSDP2 keeps the names; DDP's inner module
    rank = dist.get_rank()
    record = []
    for step in range(STEPS):
        before = [_full(p) for p in model.parameters()]
        ids = _ids(step, rank)
        wrapped(input_ids=ids, labels=ids).loss.backward()
        grads = [_full(p.grad) for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record.append(
            {
                "dropped": ctl.last_dropped,
                "before": dict(zip(names, before, strict=True)),
                "grads": dict(zip(names, grads, strict=True)),
                "after": {n: _full(p) for n, p in zip(names, model.parameters(), strict=True)},
            }
        )
    return record


def _clear_errors() -> dict[str, str]:
    """What DropBP says about DDP set-ups that cannot work, raised on every rank alike."""
    errors = {}
    cases = {
        "apply to DDP without find_unused_parameters": lambda m: dropbp.apply(
            DistributedDataParallel(m), 0.5, pattern="uniform"
        ),
        "DDP without find_unused_parameters after apply": lambda m: (
            dropbp.apply(m, 0.5, pattern="uniform"),
            DistributedDataParallel(m)(input_ids=_ids(0, 0), labels=_ids(0, 0)),
        ),
        "re-entrant checkpointing under DDP": lambda m: (
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True}),
            dropbp.apply(m, 0.5, pattern="uniform"),
            DistributedDataParallel(m, find_unused_parameters=True)(input_ids=_ids(0, 0), labels=_ids(0, 0)),
        ),
    }
    for case, run in cases.items():
        try:
            run(tiny_model("llama", layers=2))
        except ValueError as err:
            errors[case] = str(err)
    return errors


def _rank_main(rank: int, init_file: str, out_dir: str, mode: str, pattern: str) -> None:
    torch.set_num_threads(1)  # as torchrun does: two processes share the cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        result = {order: _train(mode, order, pattern) for order in ("apply-first", "wrap-first")}
        if mode == "ddp":
            result["errors"] = _clear_errors()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        ranks_done()
    finally:
        dist.destroy_process_group()


def _single_process_grads(reference: torch.nn.Module, record: dict, step: int) -> dict:
    """Gradients of one process on both ranks' batches, from the same parameters and pattern."""
    reference.load_state_dict(record["before"])
    reference.zero_grad(set_to_none=True)
    handles = detach_outputs(reference, record["dropped"])
    ids = torch.cat([_ids(step, rank) for rank in range(WORLD)])
    reference(input_ids=ids, labels=ids).loss.backward()
    for h in handles:
        h.remove()
    return {n: None if p.grad is None else p.grad.clone() for n, p in reference.named_parameters()}


@pytest.mark.parametrize(
    ("mode", "pattern"),
    [("ddp", "uniform"), ("ddp", "cut"), ("fsdp2", "uniform"), ("ddp", "cut+bound"), ("fsdp2", "cut+bound")],
)
def test_two_ranks_train_as_one(mode, pattern):
    with tempfile.TemporaryDirectory() as tmp:
        _run_ranks(_rank_main, os.path.join(tmp, "init"), tmp, mode, pattern)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    reference = tiny_model("llama", layers=3)
    ctl_branches = dropbp.apply(tiny_model("llama", layers=3), 0.0).branches
    if pattern != "uniform":  # the run saw several depths, some steps dropping nothing
        assert len({len(s["dropped"]) for s in ranks[0]["apply-first"]}) > 2
    if pattern == "cut+bound":  # some steps kept more than the bound: some layers ran checkpointed
        assert any(len(s["dropped"]) < 3 for s in ranks[0]["apply-first"])
    for order in ("apply-first", "wrap-first"):
        records = [r[order] for r in ranks]
        assert [s["dropped"] for s in records[0]] == [s["dropped"] for s in ranks[0]["apply-first"]]
        for step in range(STEPS):
            a, b = records[0][step], records[1][step]
            assert a["dropped"] == b["dropped"] and len(a["dropped"]) < 6, (order, step)
            if pattern == "uniform":  # systematic sampling: 3 of 6 in every step
                assert len(a["dropped"]) == 3, (order, step)
            else:  # a cut: the branches below a depth, the top one always kept
                assert list(a["dropped"]) == [b.name for b in ctl_branches[: len(a["dropped"])]], (order, step)
            for name in a["after"]:
                assert torch.equal(a["after"][name], b["after"][name]), (order, step, name)
                if a["grads"][name] is None:  # no gradient: AdamW leaves the parameter exactly alone
                    assert torch.equal(a["after"][name], a["before"][name]), (order, step, name)
            assert_same_grads(a["grads"], _single_process_grads(reference, a, step), atol=1e-5)
    if mode == "ddp":
        for errors in (r["errors"] for r in ranks):
            assert len(errors) == 3, errors
            assert all("find_unused_parameters=True" in e for e in errors.values())
            assert "use_reentrant" in errors["re-entrant checkpointing under DDP"]


def _train_with_trainer(out_dir: Path) -> dict:
    import transformers
    from test_hf_integration import _args, _dataset

    from dropbp.integrations.hf import attach

    args = _args(
        out_dir,
        max_steps=10,
        gradient_checkpointing=True,  # the Trainer would turn find_unused_parameters off
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    trainer = transformers.Trainer(
        model=with_lora(tiny_model("llama", layers=4)),
        args=args,
        train_dataset=_dataset(),
        data_collator=transformers.default_data_collator,
    )
    callback = attach(trainer, drop_rate=0.5, pattern="uniform")  # calibrates at step 1 of 10
    patterns: list[tuple[str, ...]] = []

    def record(module, inputs, output):
        if module.training and torch.is_grad_enabled() and callback.controller.forced is None:
            patterns.append(callback.controller.last_dropped)

    trainer.model.register_forward_hook(record)
    trainer.train()
    return {
        "world": dist.get_world_size(),
        "wrapper": type(trainer.model_wrapped).__name__,
        "patterns": patterns,
        "rates": callback.controller.rates,
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad},
    }


def _trainer_rank_main(rank: int, init_file: str, out_dir: str) -> None:
    """One process of a two-process Hugging Face Trainer job, set up as torchrun would (the process
    group is opened here through a file, which Accelerate then uses: no network port to race for)."""
    torch.set_num_threads(1)
    env = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=WORLD, LOCAL_WORLD_SIZE=WORLD, OMP_NUM_THREADS=1)
    os.environ.update({k: str(v) for k, v in env.items()})
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:  # the trainer and its DDP wrapper are gone before the process group
        result = _train_with_trainer(Path(out_dir) / f"rank{rank}")
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        ranks_done()
    finally:
        dist.destroy_process_group()


def test_trainer_on_two_processes(tmp_path):
    _run_ranks(_trainer_rank_main, str(tmp_path / "init"), str(tmp_path))
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD))
    assert a["world"] == WORLD and a["wrapper"] == "DistributedDataParallel"
    assert len(a["patterns"]) == 10 and a["patterns"] == b["patterns"]
    assert a["rates"] == b["rates"] and a["rates"] != [0.5] * 8  # calibrated alike on both ranks
    assert a["params"].keys() == b["params"].keys()
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_torchrun_example(mode):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}"]
    command += ["examples/distributed.py", "--mode", mode, "--steps", "3"]
    for _ in range(2):  # a second run only after a teardown abort (below)
        try:
            done = subprocess.run(
                command,
                cwd=ROOT,
                env={**os.environ, "DROPBP_BACKEND": "cpu"},
                capture_output=True,
                text=True,
                timeout=JOB_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun {mode} did not finish within {JOB_TIMEOUT} s (a hang)")
        # torch's own teardown on gloo aborts a rank now and then after the run has finished and torn its process
        # group down (seen with FSDP2: "terminate called without an active exception" at interpreter exit): run
        # once more in that case only; any other failure, or the same twice, fails
        teardown_abort = "terminate called without an active exception" in done.stderr and "every rank:" in done.stdout
        if done.returncode == 0 or not teardown_abort:
            break
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "same drop patterns on every rank: True" in done.stdout
    assert mode == "fsdp2" or "same parameters on every rank: True" in done.stdout


def _raising_rank(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")


def _aborting_rank(rank: int) -> None:
    if rank == 0:
        os.abort()  # a native crash: SIGABRT


def test_a_rank_killed_by_a_signal_runs_once_more_then_fails():
    """conftest.run_ranks runs a group once more after a native crash (exit by signal), and fails when it recurs."""
    with pytest.raises(AssertionError, match=r"\[-6, 0\]"):
        run_ranks(_aborting_rank, world=2, timeout=60)


def test_a_rank_that_raises_fails_the_run():
    """Ranks leave through ``os._exit`` (conftest.run_ranks): an exception must still be a non-zero exit."""
    with pytest.raises(AssertionError, match=r"\[0, 1\]"):
        run_ranks(_raising_rank, world=2, timeout=60)


def _tokens_rank_main(rank: int, init_file: str, out_dir: str, mode: str) -> None:
    """Token drops (0.5) with branch drops (0.5) under DDP / FSDP2: each rank selects from its own batch's gradient;
    per step, the pattern, each rank's recorded token weights and the reduced gradients."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model = tiny_model("llama", layers=3)
        if mode.endswith("-checkpointing"):  # the MLP branches recomputed on their kept rows
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ctl = apply_arm(model, 0.5, seed=0, token_drop_rate="auto" if mode.endswith("-auto") else 0.5)
        wrapped = _distribute(model, mode.removesuffix("-auto").removesuffix("-checkpointing"))
        names = [n for n, _ in model.named_parameters()]
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-2)
        record = []
        for step in range(4):
            before = [_full(p) for p in model.parameters()]
            ids = _ids(step, rank)
            wrapped(input_ids=ids, labels=ids).loss.backward()
            record.append({
                "dropped": ctl.last_dropped,
                "weights": ctl.features["token_drops"].weights(),
                "before": dict(zip(names, before, strict=True)),
                "grads": {n: _full(p.grad) for n, p in zip(names, model.parameters(), strict=True)},
            })  # fmt: skip
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
        ranks_done()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "ddp-auto", "ddp-checkpointing", "fsdp2-checkpointing"])
def test_token_drops_on_two_ranks_average_each_ranks_own_selection(mode):
    """Nothing hangs; the ranks draw the same branch pattern but each its own token rows, from its own data; the
    reduced gradient is the mean over ranks of the reference (no dropbp) for each rank's batch and recorded weights.
    With token_drop_rate="auto" each rank's shares follow its own readings (every row at the first step); with
    checkpointing the MLP branches are recomputed on their kept rows."""
    with tempfile.TemporaryDirectory() as tmp:
        _run_ranks(_tokens_rank_main, os.path.join(tmp, "init"), tmp, mode)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    reference = tiny_model("llama", layers=3)
    for step in range(4):
        a, b = ranks[0][step], ranks[1][step]
        assert a["dropped"] == b["dropped"] and a["weights"].keys() == b["weights"].keys()
        if step > 0 or mode != "ddp-auto":  # own selections (auto keeps every row at first)
            assert any(not torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
        per_rank = []
        for rank, rec in enumerate((a, b)):
            reference.load_state_dict(rec["before"])
            reference.zero_grad(set_to_none=True)
            handles = detach_outputs(reference, rec["dropped"]) + weighted_outputs(reference, rec["weights"])
            ids = _ids(step, rank)
            reference(input_ids=ids, labels=ids).loss.backward()
            for h in handles:
                h.remove()
            per_rank.append({n: None if p.grad is None else p.grad.clone() for n, p in reference.named_parameters()})
        mean = {n: None if g is None else (g + per_rank[1][n]) / WORLD for n, g in per_rank[0].items()}
        assert_same_grads(a["grads"], mean, atol=1e-5)
        assert_same_grads(b["grads"], mean, atol=1e-5)


def _join(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)


def _measured_ddp_model():
    """A tiny Llama with the noise scale measured, under DDP: (model, controller, DDP wrapper, SGD)."""
    model = tiny_model("llama", layers=2)
    ctl = dropbp.apply(model, 0.0, features=[dropbp.NoiseScale()])
    wrapped = DistributedDataParallel(model, find_unused_parameters=True)
    return model, ctl, wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.05)


def _noise_rank_main(rank: int, init_file: str, out_dir: str) -> None:
    """``measure_noise_scale`` under DDP: 3 optimizer steps of 2 micro-batches (the first under ``no_sync``, as
    Trainer accumulates), then the next step's first forward; per rank, the estimate and, per step, the terms of
    this rank's micro-batch gradients computed apart (``torch.autograd.grad`` on a plain copy)."""
    import copy

    from dropbp.policy.noise_scale import window_terms

    _join(rank, init_file)
    try:
        model, ctl, wrapped, optimizer = _measured_ddp_model()
        terms = []
        for step in range(3):
            ids = [_ids(2 * step + k, rank) for k in range(2)]
            plain = copy.deepcopy(model)
            params = [p for p in plain.parameters() if p.requires_grad]
            grads = [torch.autograd.grad(plain(input_ids=x, labels=x).loss / 2, params) for x in ids]
            total = [a + b for a, b in zip(*grads, strict=True)]
            squares = [sum(float(t.double().pow(2).sum()) for t in g) * 4 for g in grads]
            terms.append(window_terms(squares, sum(float(t.double().pow(2).sum()) for t in total), ids[0].numel()))
            with wrapped.no_sync():
                (wrapped(input_ids=ids[0], labels=ids[0]).loss / 2).backward()
            (wrapped(input_ids=ids[1], labels=ids[1]).loss / 2).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        wrapped(input_ids=ids[0], labels=ids[0])  # closes the last step
        measured = ctl.features["noise_scale"].estimate()
        record = {"terms": terms, "measured": measured, "tokens": 2 * ids[0].numel()}
        torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
        ranks_done()
    finally:
        dist.destroy_process_group()


def test_the_noise_scale_under_ddp_averages_each_ranks_own_micro_batches():
    """Every rank reads its own micro-batches (before DDP writes the averaged gradient) and the step's terms are
    averaged across ranks: both ranks' estimate equals the estimator fed the mean of the ranks' terms computed apart,
    at the global tokens per step."""
    from dropbp.policy.noise_scale import NoiseScaleEstimator

    with tempfile.TemporaryDirectory() as tmp:
        _run_ranks(_noise_rank_main, os.path.join(tmp, "init"), tmp)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    reference = NoiseScaleEstimator()
    for step in range(3):
        g = sum(r["terms"][step][0] for r in ranks) / WORLD
        t = sum(r["terms"][step][1] for r in ranks) / WORLD
        reference.add(g, t, ranks[0]["tokens"] * WORLD)
    want = reference.estimate()
    for r in ranks:
        got = r["measured"]
        assert got.steps == 3 and got.tokens_per_step == want.tokens_per_step
        assert abs(got.gradient_sq_norm / want.gradient_sq_norm - 1) < 1e-4
        assert abs(got.trace / want.trace - 1) < 1e-4


def _synchronising_rank_main(rank: int, init_file: str, out_dir: str) -> None:
    """The noise scale under DDP with every micro-batch synchronised (no ``no_sync``): what it says, what it reads."""
    import warnings

    _join(rank, init_file)
    try:
        model, ctl, wrapped, optimizer = _measured_ddp_model()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for step in range(3):
                for k in range(2):
                    ids = _ids(2 * step + k, rank)
                    (wrapped(input_ids=ids, labels=ids).loss / 2).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            wrapped(input_ids=ids, labels=ids)  # closes the last step
        messages = [str(w.message) for w in said if "synchronises every micro-batch" in str(w.message)]
        record = {"said": messages, "measured": ctl.features["noise_scale"].estimate()}
        torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
        ranks_done()
    finally:
        dist.destroy_process_group()


def test_the_noise_scale_says_it_cannot_be_read_where_ddp_synchronises_every_micro_batch():
    """Issue 71, class C: without ``no_sync`` DDP writes the averaged gradient after every micro-batch, which the reads
    took for a cleared gradient: no estimate and no word. Now a warning names why and what to do (once)."""
    with tempfile.TemporaryDirectory() as tmp:
        _run_ranks(_synchronising_rank_main, os.path.join(tmp, "init"), tmp)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    for r in ranks:
        assert r["measured"] is None and len(r["said"]) == 1 and "ddp.no_sync()" in r["said"][0]
