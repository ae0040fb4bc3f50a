"""One memory probe: a fresh process that trains one real step and reports its peak memory.

``python -m dropbp.tools.memprobe '<json spec>'`` (run by :mod:`dropbp.tools.membench`, one process per
configuration) builds the model and optimizer, records the memory level, trains micro-batch 1 for ``steps`` steps
and prints one JSON line: the peak above that level and the absolute peak (CPU: the high-water resident set
``VmHWM``, with glibc's mmap threshold fixed at 64 KiB; devices with an allocator: its peak). With a budget, a CPU
probe stops as soon as its resident set passes it. Optionally it counts the saved activations of the same pattern
(:mod:`dropbp.tools.memory`). The spec may name the pattern shape (``"pattern"``, default uniform), the memory bound
(``"memory_bound"``, default off), the seed and ``"checkpointing"``. Progress goes to stderr. Why: docs/memory.md.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import time
from typing import Any

import torch

from dropbp.tools.device_tools import tools_for

__all__ = ["main", "rss_bytes"]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """This process's resident set now."""
    return _status("VmRSS")


#: glibc's mallopt parameter for the mmap threshold (fixing it also turns off its dynamic adjustment).
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 64 * 2**10


def _map_large_allocations() -> bool:
    """Large allocations mapped and unmapped one by one (glibc); False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def _reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _say(text: str) -> None:
    print(f"    {text}", file=sys.stderr, flush=True)


def _emit(result: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def _watch(budget: int, result: dict[str, Any]) -> None:
    """Stop the process the moment its resident set passes the budget: the probe does not fit."""
    while True:
        rss = rss_bytes()
        if rss > budget:
            _emit({**result, "fits": False, "stopped_at_bytes": rss})
            _say(f"over budget ({rss / 2**30:.2f} GiB): stopped")
            os._exit(0)
        time.sleep(0.01)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from dropbp import backends
    from dropbp.features.chunked_loss import ChunkedHead
    from dropbp.tools.arms import apply_arm as apply
    from dropbp.tools.bench import build_model

    backend = backends.get(spec.get("backend"))
    mapped = not backend.has_allocator_stats and _map_large_allocations()
    dtype = getattr(torch, spec.get("dtype", "float32"))
    seq, rate, chunked = spec["seq_len"], spec["rate"], spec["chunked"]
    checkpointing = spec.get("checkpointing", False)
    model = build_model(spec["preset"], spec["method"], seq, dtype, backend.device, checkpointing)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    if rate is None:  # the baseline: no DropBP (the chunked loss alone, if asked)
        attached: Any = ChunkedHead(model) if chunked else None
    else:
        attached = apply(
            model,
            rate,
            seed=spec.get("seed", 0),
            pattern=spec.get("pattern", "uniform"),
            memory_bound=spec.get("memory_bound", False),
            chunked_loss=chunked,
            backend=backend,
        )
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0)).to(backend.device)
    allocator = backend.has_allocator_stats
    with torch.no_grad():  # page in weights a loader may have mapped lazily: they belong to the level
        for p in model.parameters():
            p.sum()
    gc.collect()
    level = getattr(torch, backend.torch_module).memory_allocated() if allocator else rss_bytes()
    result: dict[str, Any] = {**spec, "level_bytes": level, "heap_mmap_threshold": mapped}
    if allocator:
        backend.reset_peak_memory()
    else:
        _reset_high_water_mark()
        if spec.get("budget"):
            threading.Thread(target=_watch, args=(spec["budget"], result), daemon=True).start()
    times = []
    try:
        for step in range(spec.get("steps", 1)):
            start = time.perf_counter()
            with tools_for(backend).training_autocast():
                loss = model(input_ids=ids, labels=ids).loss
            _say(f"step {step + 1}: forward {time.perf_counter() - start:.1f} s")
            if loss.requires_grad:
                loss.backward()
            backend.after_backward()
            opt.step()
            backend.after_optimizer_step()
            opt.zero_grad(set_to_none=True)
            backend.synchronize()
            times.append(time.perf_counter() - start)
            _say(f"step {step + 1}: done in {times[-1]:.1f} s")
            del loss
    except torch.OutOfMemoryError:
        return {**result, "fits": False, "out_of_memory": True}
    peak = backend.max_memory_allocated() if allocator else _status("VmHWM")
    budget = spec.get("budget")
    result.update(
        peak_bytes=peak,
        peak_above_level_bytes=peak - level,
        step_s=times,
        fits=budget is None or peak <= budget,
        dropped=list(attached.dropped_at(0)) if rate is not None else [],
        kept_per_step=[len(attached.branches) - len(attached.dropped_at(i)) for i in range(len(times))]
        if rate is not None
        else [],
        branches=None if rate is None else len(attached.branches),
    )
    if spec.get("account"):
        result["saved"] = _account(model, attached, ids, rate, chunked)
    return result


def _account(model, attached, ids: torch.Tensor, rate: float | None, chunked: bool) -> dict[str, int]:
    """Saved-activation bytes of the pattern the measured step used (the baseline: none dropped)."""
    from dropbp.tools.arms import apply_arm as apply
    from dropbp.tools.memory import saved_bytes

    _say("counting saved activations")
    if rate is None:
        if attached is not None:
            attached.remove()
        attached = apply(model, 0.0, pattern="uniform", chunked_loss=chunked)
    pattern = attached.dropped_at(0) if rate is not None else ()
    got = saved_bytes(attached, ids, pattern)
    return {
        "total": got.total,
        "kept_branches": got.kept,
        "rest": got.rest,
        "full_total": got.full_total,
        "dropped_branches": got.saved_by_dropping,
        "dropped_packs": got.dropped_packs,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import transformers

    transformers.logging.set_verbosity_error()
    _emit(run(json.loads(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
