"""Graphs the lazy engine compiles with eager and with SDPA attention, branch drops alone and with token drops.

A 4-layer tiny Llama (the tests' shape, random weights) on PyTorch's lazy-tensor engine (the stand-in of Gaudi's lazy
mode, ``DROPBP_BACKEND=lazy``), drop rate 0.5, 40 steps of one micro-batch: the graphs compiled in all, and those
compiled at the step's breaks (after the backward and the optimizer step: what a lazy-graph device runs). The rest
are the TorchScript backend's early runs of ops it executes eagerly (SDPA among them), reading their inputs.

    python benchmarks/lazy_graphs_sdpa.py      # prints the table; results/lazy_graphs_sdpa.md holds a run's
"""

from __future__ import annotations

import collections
import itertools
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_lazy_engine as engine_tests  # noqa: E402  (its graph-break counter and hand loop)
from conftest import _COMMON, TINY_CONFIGS  # noqa: E402
from dropbp.backends.lazy import LazyEngineBackend, compiled_graphs, start  # noqa: E402

from dropbp.tools.arms import apply_arm  # noqa: E402

STEPS = 40


def main() -> None:
    start()  # the lazy-tensor engine (TorchScript backend)
    vocab = itertools.count(501)  # a vocabulary per run: no run reuses another's graphs
    print(f"| attention | token drops | graphs in all | at the step's breaks | early runs ({STEPS} steps) |")
    print("|---|---|---|---|---|")
    for attention in ("eager", "sdpa"):
        for tokens in (None, 0.5):
            config = transformers.AutoConfig.for_model(
                "llama", **{**_COMMON, **TINY_CONFIGS["llama"], "num_hidden_layers": 4, "vocab_size": next(vocab)}
            )
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
            model = model.train().to("lazy")
            backend = LazyEngineBackend()
            options = {} if tokens is None else {"token_drop_rate": tokens}
            ctl = apply_arm(model, 0.5, seed=0, backend=backend, **options)
            torch._lazy.mark_step()
            breaks = engine_tests.Breaks(backend)
            before = compiled_graphs()
            engine_tests.train(model, ctl, breaks, steps=STEPS, micro_batches=1)
            at_breaks, early = collections.Counter(), 0
            for label, compiled, runs in breaks.events:
                at_breaks[label] += compiled
                early += runs
            total = compiled_graphs() - before
            print(f"| {attention} | {tokens or 'off'} | {total} | {sum(at_breaks.values())} | {early} |")


if __name__ == "__main__":
    main()
