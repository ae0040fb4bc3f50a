"""``dropbp bench --memory`` and ``--max-seq-len``: real peak memory and the longest trainable sequence.

Every figure comes from a real training step (micro-batch 1) in a fresh process (:mod:`dropbp.tools.memprobe`).
:func:`memory_table`: per sequence length and configuration, the peak above the level after loading the model and
optimizer, next to the exact saved-activation count of the same pattern (:mod:`dropbp.tools.memory`), split into dropped
branches, kept branches and the rest. :func:`longest_sequence`: the longest length on the grid of
:func:`grid_length` whose probe's measured absolute peak fits a budget (doubling, then bisection; each drop rate
starts from the previous rate's longest). Every DropBP configuration uses ``pattern="uniform"``; rate 0 is the
baseline: the model without the library (with ``chunked_loss``: the chunked loss alone). Method, and why uniform:
docs/memory.md ("Commands").
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dropbp.tools.report import finish_axes, save_figure, write_record

__all__ = [
    "grid_length",
    "longest_sequence",
    "memory_table",
    "parse_size",
    "peak_against",
    "run_probe",
    "worst_case_seed",
]

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """``"6GiB"``, ``"6G"``, ``"512MiB"`` or a number of bytes -> bytes (binary units)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if not match:
        raise ValueError(f"expected a size such as 6GiB, 512MiB or a number of bytes, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def grid_length(k: int) -> int:
    """The k-th length of the search grid: 256 x 2^(k/4), rounded to a multiple of 64."""
    return max(64, round(256 * 2 ** (k / 4) / 64) * 64)


def worst_case_seed(model: Any, rate: float, steps: int = 1) -> int:
    """The first seed whose cut (the default shape) keeps every branch in one of its first ``steps`` training
    forwards: the step a memory bound must hold in."""
    from dropbp import apply

    for seed in range(10_000):
        ctl = apply(model, rate, seed=seed, memory_bound=False)
        found = any(not ctl.dropped_at(step) for step in range(steps))
        ctl.remove()
        if found:
            return seed
    raise ValueError(f"no seed below 10000 keeps every branch within {steps} steps at drop rate {rate}")


def run_probe(spec: dict[str, Any], say: Callable[[str], None] = print) -> dict[str, Any]:
    """One probe in a fresh process (its progress lines pass through to stderr)."""
    label = _label(spec)
    say(f"probe {label} ...")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "dropbp.tools.memprobe", json.dumps(spec)], stdout=subprocess.PIPE, text=True
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"memory probe {label} failed (exit code {proc.returncode}); its stderr is above")
    result = json.loads(lines[-1])
    result["wall_s"] = time.perf_counter() - start
    verdict = "fits" if result["fits"] else "does not fit"
    peak = result.get("peak_bytes") or result.get("stopped_at_bytes")
    say(f"probe {label}: {verdict}, peak {peak / 2**30:.2f} GiB ({result['wall_s']:.0f} s)")
    return result


def _label(spec: dict[str, Any]) -> str:
    rate = "baseline" if spec["rate"] is None else f"rate {spec['rate']}"
    loss = "chunked loss" if spec["chunked"] else "plain loss"
    return f"{spec['preset']}/{spec['method']} seq {spec['seq_len']} {rate}, {loss}"


def _spec(
    preset: str, method: str, seq: int, rate: float, chunked: bool, common: dict[str, Any], checkpointing: bool = False
) -> dict[str, Any]:
    spec = {"preset": preset, "method": method, "seq_len": seq, "rate": None if rate == 0 else rate, "chunked": chunked}
    return spec | {"checkpointing": checkpointing} | common


def memory_table(
    preset: str,
    method: str,
    seq_lens: Sequence[int],
    rates: Sequence[float],
    chunked: Sequence[bool],
    common: dict[str, Any],
    say: Callable[[str], None] = print,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    checkpointing: Sequence[bool] = (False,),
) -> list[dict[str, Any]]:
    """Peak memory and saved-activation bytes per sequence length, drop rate, loss path and Hugging Face activation
    checkpointing (off, on or both); ``on_row`` sees each row as it comes (to save it: a stopped run keeps what it
    measured)."""
    rows = []
    for ckpt in checkpointing:
        for c in chunked:
            for s in seq_lens:
                for r in rates:
                    spec = _spec(preset, method, s, r, c, common | {"account": True}, ckpt)
                    rows.append(run_probe(spec, say) | {"checkpointing": ckpt})
                    if on_row is not None:
                        on_row(rows[-1])
    return rows


def longest_sequence(
    preset: str,
    method: str,
    rates: Sequence[float],
    chunked: bool,
    budget: int,
    common: dict[str, Any],
    limit: int = 1 << 17,
    say: Callable[[str], None] = print,
    known: dict[str, int] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per drop rate (ascending), the longest grid length whose training step peaks within ``budget``.

    ``known``: per rate (as a string), a grid length already measured to fit (e.g. the plain loss's
    longest, which the chunked loss, never needing more memory, fits too); the search starts there.
    """
    out: dict[str, dict[str, Any]] = {}
    fit_k = None  # grid index known to fit (a lower rate's longest)
    for rate in sorted(rates):
        if known and known.get(str(rate)):
            k_known = max(k for k in range(200) if grid_length(k) <= known[str(rate)])
            fit_k = k_known if fit_k is None else max(fit_k, k_known)
        probes: list[dict[str, Any]] = []

        def fits(k: int, rate: float = rate, probes: list = probes) -> bool:
            probes.append(
                run_probe(_spec(preset, method, grid_length(k), rate, chunked, common | {"budget": budget}), say)
            )
            return probes[-1]["fits"]

        low, high = fit_k, None  # low fits, high does not
        step = 4  # x2
        k = 0 if low is None else low + step
        while True:
            if grid_length(k) > limit:
                high = k  # past the limit: treated as not fitting, the bisection stays under it
                break
            if fits(k):
                low, k = k, k + step
            else:
                high = k
                break
        if low is None:
            high = 0
        elif high is not None:
            while high - low > 1:
                mid = (low + high) // 2
                low, high = (mid, high) if fits(mid) else (low, mid)
        longest = 0 if low is None else grid_length(low)
        out[str(rate)] = {"longest": longest, "probes": _brief(probes)}
        say(f"longest at rate {rate} ({'chunked' if chunked else 'plain'} loss): {longest} tokens")
        fit_k = low
    return out


def _brief(probes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("seq_len", "fits", "peak_bytes", "stopped_at_bytes", "level_bytes", "step_s", "wall_s")
    return [{k: p[k] for k in keys if k in p} for p in probes]


def markdown(results: dict[str, Any]) -> str:
    """The memory table and the longest-sequence table."""
    lines = [
        f"Memory on {results['device']} ({results['dtype']}, torch {results['torch']}, {results['date']}); "
        "every figure is one real training step (micro-batch 1) in a fresh process; DropBP with "
        '`pattern="uniform"`; rate 0 is the model without the library.',
        "",
    ]
    rows = results.get("memory") or []
    if rows:
        lines += [
            "| model | method | loss | checkpointing | seq | drop rate | peak above load (GiB) | vs baseline "
            "| saved for backward (GiB) | kept branches | rest | freed by dropping | step (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]

        def same(r: dict) -> tuple:
            return r["preset"], r["method"], r["chunked"], r.get("checkpointing", False), r["seq_len"]

        base = {same(r): r for r in rows if r["rate"] is None}
        for r in rows:
            b = base.get(same(r))
            ratio = peak_against(b["peak_above_level_bytes"], r["peak_above_level_bytes"]) if b else ""
            s = r["saved"]
            ckpt = "on" if r.get("checkpointing") else "off"
            lines.append(
                f"| {r['preset']} | {r['method']} | {'chunked' if r['chunked'] else 'plain'} | {ckpt} | "
                f"{r['seq_len']} | "
                f"{r['rate'] or 0} | {_gib(r['peak_above_level_bytes'])} | {ratio} | {_gib(s['total'])} | "
                f"{_gib(s['kept_branches'])} | {_gib(s['rest'])} | {_gib(s['dropped_branches'])} | "
                f"{r['step_s'][0]:.1f} |"
            )
        lines.append("")
    for key, by_loss in (results.get("max_seq_len") or {}).items():
        lines += [
            f"Longest trainable sequence, {key}, micro-batch 1, budget {_gib(results['memory_budget'])} GiB "
            "of peak resident memory (whole process):",
            "",
            "| loss | "
            + " | ".join(f"rate {r}" for r in next(iter(by_loss.values())))
            + " | longest at max rate / baseline |",
            "|---|" + "---|" * (len(next(iter(by_loss.values()))) + 1),
        ]
        for loss, by_rate in by_loss.items():
            values = [v["longest"] for v in by_rate.values()]
            gain = f"{values[-1] / values[0]:.2f}x" if values[0] else "n/a"
            lines.append(f"| {loss} | " + " | ".join(str(v) for v in values) + f" | {gain} |")
        lines.append("")
    return "\n".join(lines)


def peak_against(base: float, peak: float) -> str:
    """A peak against the baseline's, in the words that are true of it."""
    if peak == base:
        return "the same"
    return f"{base / peak:.2f}x less" if peak < base else f"{peak / base:.2f}x more"


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def plot(results: dict[str, Any], path: Path) -> None:
    """Peak memory against sequence length (one line per rate and loss); longest sequence against rate."""
    from dropbp.imports import require

    matplotlib = require("matplotlib", "dropbp bench")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    points: dict[tuple[bool, float], list[tuple[int, float]]] = {}
    for r in results.get("memory") or []:
        points.setdefault((r["chunked"], r["rate"] or 0, r.get("checkpointing", False)), []).append(
            (r["seq_len"], r["peak_above_level_bytes"] / 2**30)
        )
    for by_loss in (results.get("max_seq_len") or {}).values():  # the search's fitting probes are real steps too
        for loss, by_rate in by_loss.items():
            for rate, found in by_rate.items():
                for p in found["probes"]:
                    if p["fits"]:
                        above = (p["peak_bytes"] - p["level_bytes"]) / 2**30
                        points.setdefault((loss == "chunked", float(rate), False), []).append((p["seq_len"], above))
    for (chunked, rate, ckpt), pts in sorted(points.items()):
        style = "-" if chunked else "--"
        label = f"rate {rate}, {'chunked' if chunked else 'plain'} loss{', checkpointing' if ckpt else ''}"
        left.plot(*zip(*sorted(pts), strict=True), marker="o", linestyle=style, label=label)
    finish_axes(left, "sequence length (tokens)", "peak memory above load (GiB)")
    for key, by_loss in (results.get("max_seq_len") or {}).items():
        for loss, by_rate in by_loss.items():
            right.plot(
                [float(r) for r in by_rate],
                [v["longest"] for v in by_rate.values()],
                marker="o",
                label=f"{key}, {loss} loss",
            )
    finish_axes(right, "drop rate", "longest trainable sequence (tokens)")
    save_figure(fig, path)


def write(results: dict[str, Any], out: Path) -> list[Path]:
    """memory.json, memory.md and memory.png into ``out`` (:func:`write_record`)."""
    return write_record(out, "memory", results, markdown(results), plot)
