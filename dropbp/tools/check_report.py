"""What ``dropbp check`` found, as data (``CheckResult``) and as text and files to attach to an issue.

Kept apart from the checks themselves so that the result object is all a notebook needs, and so that
the terminal text and ``check.md`` are one rendering of the same ``check.json``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dropbp.files import write_atomically

__all__ = ["PASS", "FAIL", "SKIP", "CheckResult", "Outcome", "render", "write"]

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

#: The exit codes of ``dropbp check``: all passed; a check failed (2, bad arguments or a missing device
#: stack, comes from the command line before any check runs).
EXIT_PASSED, EXIT_FAILED = 0, 1


@dataclass
class Outcome:
    """One check: its name (stable, for scripts), PASS / FAIL / SKIP, a one-line detail, and figures."""

    name: str
    status: str
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass
class CheckResult:
    """Everything ``dropbp check`` found: ``passed`` and ``exit_code`` sum it up."""

    environment: dict[str, Any]
    model: dict[str, Any]
    checks: list[Outcome]
    speed: dict[str, Any] | None = None
    seconds: float = 0.0
    noise: dict[str, Any] | None = None  # the gradient noise scale and its forecast (:mod:`.check_noise`)

    @property
    def failed(self) -> list[Outcome]:
        """The checks that failed."""
        return [c for c in self.checks if c.status == FAIL]

    @property
    def passed(self) -> bool:
        """True when no check failed (skipped ones say why they could not run here)."""
        return not self.failed

    @property
    def exit_code(self) -> int:
        return EXIT_PASSED if self.passed else EXIT_FAILED

    def check(self, name: str) -> Outcome:
        """The outcome called ``name`` (KeyError if there is none)."""
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "seconds": round(self.seconds, 1),
            "environment": self.environment,
            "model": self.model,
            "checks": [asdict(c) for c in self.checks],
            "speed": self.speed,
            "noise_scale": self.noise,
        }


def _short(reason: str | None) -> str:
    return "available" if reason is None else reason.split(";")[0]


def _bytes(n: int | None) -> str:
    if not n:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _environment_lines(env: dict[str, Any], model: dict[str, Any]) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v is not None)
    stack = {
        k: v
        for k, v in env.items()
        if k not in ("backend", "backend_source", "detection", "device", "device_name", "device_count", "collectives")
        and k not in ("pattern_bound", "graph_compilations_reported", "allocator_stats", "versions", "platform")
        and v is not None
    }
    coll = env["collectives"]
    lines = [
        f"backend   {env['backend']} ({env['backend_source']}) on {env['device']}: {env['device_name']}"
        + (f" x {env['device_count']}" if env["device_count"] else ""),
        "detection " + "; ".join(f"{n}: {_short(r)}" for n, r in env["detection"].items()),
        f"software  {versions}",
    ]
    if stack:
        lines.append("stack     " + ", ".join(f"{k} {v}" for k, v in stack.items()))
    lines.append(
        f"collective {coll['name']} (torch.distributed {'available' if coll['torch_distributed'] else 'missing'}"
        + ("" if coll["registered"] is None else f", registered now: {coll['registered']}")
        + f"); pattern bound: {env['pattern_bound'] or 'none (no graph per pattern)'}"
    )
    lines.append(
        f"model     {model['name']}, {model['method']}, {model['dtype']}: {model['branches']} branches, "
        f"{model['parameters'] / 1e6:.1f}M parameters ({model['trainable_parameters'] / 1e6:.2f}M trainable)"
        + (", activation checkpointing on" if model.get("activation_checkpointing") else "")
    )
    return lines


def _speed_lines(speed: dict[str, Any]) -> list[str]:
    lines = [
        f"What it buys here: {speed['note']}",
        "| pattern | drop rate | step (s) | speedup | at expected FLOPs dropped | ideal | efficiency | peak memory "
        "| saved for backward |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = speed["baseline"]
    lines.append(
        f"| no library | | {base['step_s']:.4f} | 1.00x | | | | {_bytes(base['peak_memory_bytes'])} "
        f"| {_bytes(base.get('saved_bytes'))} |"
    )
    for r in speed["rows"]:
        lines.append(
            f"| {r.get('pattern', '')} | {r['drop_rate']} | {r['step_s']:.4f} | {r['speedup']:.2f}x "
            f"| {r['speedup_at_expected']:.2f}x | {r['ideal_speedup']:.2f}x "
            f"| {r['efficiency']:.2f} | {_bytes(r['peak_memory_bytes'])} | {_bytes(r.get('saved_bytes'))} |"
        )
    return lines


def render(result: CheckResult) -> str:
    """The terminal text, which is also ``check.md``: environment, one line per check, figures, summary."""
    lines = ["dropbp check", "", *_environment_lines(result.environment, result.model), "", "Checks"]
    width = max(len(c.name) for c in result.checks)
    lines += [f"  {c.status}  {c.name:<{width}}  {c.detail}" for c in result.checks]
    if result.speed is not None:
        lines += ["", *_speed_lines(result.speed)]
    if result.noise is not None:
        noise = result.noise
        lines += [
            "",
            f"Gradient noise scale at the model's weights as loaded ({noise['measured_steps']} steps of "
            f"{noise['measured_tokens_per_step']:,.0f} tokens, no optimizer step; branches' share of a step from "
            f"{noise['branch_share_from']}):",
            noise["message"],
        ]
    counts = {s: sum(c.status == s for c in result.checks) for s in (PASS, FAIL, SKIP)}
    verdict = "PASS" if result.passed else "FAIL: " + ", ".join(c.name for c in result.failed)
    lines += [
        "",
        f"Summary: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped in {result.seconds:.0f} s"
        f" -> {verdict}",
    ]
    return "\n".join(lines) + "\n"


def write(result: CheckResult, out: Path) -> list[Path]:
    """``check.json`` and ``check.md`` (the terminal text) into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "check.json", out / "check.md"]
    write_atomically(paths[0], json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    write_atomically(paths[1], "```\n" + render(result) + "```\n")
    return paths
