"""Each private read of :mod:`dropbp.internals` still reads what it says, on the installed torch and transformers
(CI runs this with the torch version it installs; a release that moves an internal fails here, by name)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from dropbp import internals
from dropbp.execution.recompute import reentrant_regions


class _Probe(torch.autograd.Function):
    """Identity whose backward records what the internals say while it runs."""

    seen: dict = {}

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _Probe.seen.update(task=internals.backward_task(), node=internals.running_node())
        internals.at_backward_end(lambda: _Probe.seen.update(ended=internals.backward_task()))
        return grad


def test_backward_task_node_and_end_callback():
    assert internals.backward_task() == -1 and internals.running_node() is None
    x = torch.ones(3, requires_grad=True)
    y = _Probe.apply(x * 2)
    _Probe.seen.clear()
    y.sum().backward()
    assert _Probe.seen["task"] != -1
    assert _Probe.seen["node"] is not None and type(_Probe.seen["node"]).__name__ == "_ProbeBackward"
    assert "ended" in _Probe.seen and internals.backward_task() == -1


def test_backward_hooks_of_a_tensor_and_a_module():
    x = torch.ones(2, requires_grad=True) * 3
    assert internals.backward_hooks(x) == {}
    handle = x.register_hook(lambda g: g)
    assert list(internals.backward_hooks(x)) == [handle.id]
    layer = torch.nn.Linear(2, 2)
    pre = layer.register_forward_pre_hook(lambda m, a: None)
    post = layer.register_forward_hook(lambda m, a, o: None)
    back = layer.register_full_backward_hook(lambda m, gi, go: None)
    assert internals.module_hooks(layer) == ((pre.id,), (post.id,), (back.id,), ())


def _regions(use_reentrant: bool) -> tuple[list, list]:
    """The region the forward saw (the non-re-entrant call's frame object; for a re-entrant call, its node found in
    the output's graph) and the region the recomputation saw, for one checkpointed call."""
    forward, recomputed = [], []

    def region_fn(x):
        hook = internals.checkpoint_hook()
        if internals.backward_task() == -1:
            if hook is not None:
                forward.append(internals.captured(hook, "frame"))
        else:
            recomputed.append(
                internals.captured(hook, "target_frame_ref")() if hook is not None else internals.running_node()
            )
        return torch.sin(x) * 2

    x = torch.ones(4, requires_grad=True)
    y = checkpoint(region_fn, x * 1, use_reentrant=use_reentrant) * 3
    if use_reentrant:
        forward.extend(reentrant_regions(y, ()))
    y.sum().backward()
    return forward, recomputed


def test_non_reentrant_checkpoint_names_its_region_in_forward_and_recomputation():
    assert internals.checkpoint_hook() is None
    forward, recomputed = _regions(use_reentrant=False)
    assert len(forward) == len(recomputed) == 1 and forward[0] is not None and forward[0] is recomputed[0]


def test_reentrant_checkpoint_region_is_found_in_the_graph_and_runs_the_recomputation():
    assert internals.running_node() is None
    forward, recomputed = _regions(use_reentrant=True)
    assert len(forward) == len(recomputed) == 1 and forward[0] is not None and forward[0] is recomputed[0]


def test_built_with_agrees_with_the_public_build_flags():
    assert internals.built_with("cuda") == torch.backends.cuda.is_built()
    assert isinstance(internals.built_with("xpu"), bool)


def test_running_ddp_is_the_wrapper_whose_forward_runs(tmp_path):
    import torch.distributed as dist

    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def forward(self, x):
            seen.append(internals.running_ddp())
            return self.layer(x)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(Model())
        assert internals.running_ddp() is None
        ddp(torch.ones(1, 2))
        assert seen == [ddp] and internals.running_ddp() is None
    finally:
        dist.destroy_process_group()


def test_torch_lazy_has_what_the_lazy_engine_harness_uses():
    lazy = internals.torch_lazy()
    assert callable(lazy.mark_step) and callable(lazy.ts_backend.init) and callable(lazy.metrics.counter_value)


def test_trainer_prepares_inputs_and_a_config_names_its_attention():
    import inspect

    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    assert list(inspect.signature(Trainer._prepare_inputs).parameters) == ["self", "inputs"]
    config = LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config)
    assert internals.attention_implementation(model.config) == "eager"


def test_deepspeed_marks_are_read_as_absent_on_plain_parameters():
    """On a parameter no ZeRO optimizer holds, every DeepSpeed mark reads as absent; the marks themselves are read
    on real ZeRO 1-3 engines by tests/test_deepspeed.py (``zero_stage`` and the dropped-gradient guard)."""
    p = torch.nn.Parameter(torch.ones(2))
    assert internals.deepspeed_zero3_optimizer(p) is None
    assert internals.deepspeed_fp32_mapping(p) is None
    assert internals.deepspeed_zero_optimizer(p) is None
