"""The ``dropbp`` command: ``dropbp demo`` and ``dropbp bench`` (also ``python -m dropbp``).

Bad arguments, a missing backend or an unwritable output folder end with one line on stderr and
exit code 2; nothing else is printed as a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import date
from pathlib import Path

from ..imports import MissingDependency, require

__all__ = ["main"]


class UsageError(Exception):
    """A problem with what the user asked for: reported in one line, exit code 2."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a drop rate in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a drop rate in [0, 1), got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2 (argparse prints usage too)
        raise UsageError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dropbp", description="DropBP: faster fine-tuning by dropping backward passes.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="fine-tune a real LLM three ways and compare (no downloads)")
    demo.add_argument("--backend", help="cpu, cuda, hpu, xpu or auto (default: $DROPBP_BACKEND, else auto)")
    demo.add_argument("--steps", type=_positive, help="baseline training steps (default 60; --quick: 6)")
    demo.add_argument("--quick", action="store_true", help="a 2-minute version: short sequences, few steps")
    demo.add_argument("--out", type=Path, default=Path("dropbp-demo"), help="folder for demo.json and demo.png")
    demo.add_argument("--model", help="a model id or path instead of the bundled SmolLM2-135M-Instruct")

    bench = sub.add_parser("bench", help="step time, ideal vs measured, throughput and memory")
    bench.add_argument("--backend", help="cpu, cuda, hpu, xpu or auto (default: $DROPBP_BACKEND, else auto)")
    bench.add_argument("--presets", nargs="+", default=["tiny", "small"], help="tiny small 1b 7b")
    bench.add_argument("--methods", nargs="+", default=["full", "lora"], help="full lora")
    bench.add_argument("--rates", nargs="+", type=_rate, default=[0.0, 0.5, 0.75, 0.875])
    bench.add_argument("--seq-lens", nargs="+", type=_positive, default=[128])
    bench.add_argument("--batch-sizes", nargs="+", type=_positive, default=[2])
    bench.add_argument("--rounds", type=_positive, default=10)
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU, bfloat16 elsewhere"
    )
    bench.add_argument(
        "--memory",
        action="store_true",
        help="memory table at --seq-lens: peak of one real step (micro-batch 1) in a fresh process per "
        "configuration, and the saved activations split into dropped/kept branches and the rest",
    )
    bench.add_argument(
        "--max-seq-len",
        action="store_true",
        help="longest trainable sequence per drop rate within --memory-budget (micro-batch 1; every probe a "
        "real training step in a fresh process)",
    )
    bench.add_argument(
        "--memory-budget",
        help="peak-memory budget of --max-seq-len, e.g. 6GiB (default: half the available memory on the CPU; "
        "on devices, until out of memory)",
    )
    bench.add_argument(
        "--chunked-loss",
        choices=["off", "on", "both"],
        default="off",
        help="memory runs with the plain loss, dropbp's chunked loss, or both",
    )
    bench.add_argument("--no-speed", action="store_true", help="skip the step-time grid (memory runs only)")
    bench.add_argument("--out", type=Path, default=Path("dropbp-bench"), help="folder for bench.json/.md/.png")
    return parser


def _writable(folder: Path) -> Path:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create the output folder {folder}: {err.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise UsageError(f"the output folder {folder} is not writable")
    return folder


def _backend(name: str | None):
    from ..backends import BackendUnavailable, get

    try:
        return get(name)
    except BackendUnavailable as err:
        raise UsageError(str(err)) from None


def _check_choices(values: list[str], allowed: tuple[str, ...] | list[str], what: str) -> None:
    bad = [v for v in values if v not in allowed]
    if bad:
        raise UsageError(f"unknown {what} {', '.join(bad)}; choose from {', '.join(allowed)}")


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoSettings, run_demo, table

    settings = DemoSettings.quick() if args.quick else DemoSettings()
    if args.steps is not None:
        settings = DemoSettings(**{**settings.__dict__, "steps": args.steps})
    out = _writable(args.out)
    backend = _backend(args.backend)
    record = run_demo(settings, backend, out, args.model)
    print(table(record))
    print(f"\nwrote {out / 'demo.json'} and {out / 'demo.png'}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .. import __version__
    from .bench import METHODS, PRESETS, PRETRAINED, Point, measure, write_outputs
    from .membench import parse_size

    _check_choices(args.presets, [*PRESETS, PRETRAINED], "preset")
    _check_choices(args.methods, METHODS, "method")
    budget = None
    if args.memory_budget is not None:
        try:
            budget = parse_size(args.memory_budget)
        except ValueError as err:
            raise UsageError(f"--memory-budget: {err}") from None
    out = _writable(args.out)
    backend = _backend(args.backend)
    if args.max_seq_len and budget is None and not backend.has_allocator_stats:
        budget = _available_memory() // 2
    dtype = getattr(torch, args.dtype) if args.dtype else backend.training_dtype
    if args.no_speed:
        if not (args.memory or args.max_seq_len):
            raise UsageError("--no-speed leaves nothing to run: add --memory or --max-seq-len")
        return _memory(args, backend, dtype, budget, out)
    tqdm = require("tqdm.auto", "dropbp bench").tqdm

    points = [
        Point(p, m, s, b) for p in args.presets for m in args.methods for s in args.seq_lens for b in args.batch_sizes
    ]
    bar = tqdm(total=len(points) * (args.rounds + args.warmup), desc="bench", unit="round")

    def progress(text: str) -> None:
        bar.set_postfix_str(text)
        bar.update(1)

    results = {
        "dropbp": __version__,
        "date": date.today().isoformat(),
        "device": str(backend.device),
        "backend": backend.name,
        "dtype": str(dtype).split(".")[1],
        "torch": torch.__version__,
        "rounds": args.rounds,
        "points": [measure(pt, args.rates, backend, dtype, args.rounds, args.warmup, False, progress) for pt in points],
    }
    bar.close()
    paths = write_outputs(results, out)
    print((out / "bench.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    if args.memory or args.max_seq_len:
        return _memory(args, backend, dtype, budget, out)
    return 0


def _available_memory() -> int:
    """MemAvailable of /proc/meminfo: what the CPU budget's default is half of."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise UsageError("cannot read MemAvailable from /proc/meminfo: pass --memory-budget")


def _memory(args: argparse.Namespace, backend, dtype, budget: int | None, out: Path) -> int:
    """The memory table and the longest-sequence search (:mod:`dropbp.tools.membench`)."""
    import torch

    from .. import __version__
    from .membench import longest_sequence, memory_table, write

    chunked = {"off": [False], "on": [True], "both": [False, True]}[args.chunked_loss]
    common = {"backend": backend.name, "dtype": str(dtype).split(".")[1]}

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    results: dict = {
        "dropbp": __version__,
        "date": date.today().isoformat(),
        "device": str(backend.device),
        "backend": backend.name,
        "dtype": common["dtype"],
        "torch": torch.__version__,
        "command": "dropbp " + " ".join(sys.argv[1:]),
        "memory_budget": budget,
        "memory": [],
        "max_seq_len": {},
    }
    for preset in args.presets:
        for method in args.methods:
            if args.memory:

                def keep(row: dict) -> None:
                    results["memory"].append(row)
                    write(results, out)

                memory_table(preset, method, args.seq_lens, args.rates, chunked, common, say, on_row=keep)
            if args.max_seq_len:
                found: dict = {}
                results["max_seq_len"][f"{preset}/{method}"] = found
                for c in chunked:  # plain first: what it fits, the chunked loss fits too
                    plain = found.get("plain", {})
                    known = {r: v["longest"] for r, v in plain.items()}
                    found["chunked" if c else "plain"] = longest_sequence(
                        preset, method, args.rates, c, budget, common, say=say, known=known
                    )
                    write(results, out)
            write(results, out)  # after each model: a stopped run keeps what it measured
    paths = write(results, out)
    print((out / "memory.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        return _demo(args) if args.command == "demo" else _bench(args)
    except (UsageError, MissingDependency) as err:
        print(f"dropbp: {err}" if not str(err).startswith("dropbp") else str(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dropbp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
