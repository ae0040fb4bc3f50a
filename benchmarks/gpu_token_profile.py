"""Where a token-dropped step's time goes on CUDA (issue 49): SmolLM2-135M's shape (random weights), bf16 autocast.

Per (method, batch x seq): the step time of full backprop and of token drops at 0.5, interleaved, medians of
``--steps``; the same with the selection's random draws put in pinned host memory first (a copy from pageable
memory to the device waits for the stream, one wait per branch per step: does it cost?); then one profiled step
of token drops at 0.5: the operations that take the most host and device time, and the host-device waits.

    python3 -P benchmarks/gpu_token_profile.py --model FOLDER --out FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager

import torch
import transformers

import dropbp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to try the script out


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _model(folder: str, method: str) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(DEVICE).train()
    if method == "lora":
        from dropbp.tools.qlora import with_lora

        model = with_lora(model)
    return model


@contextmanager
def _pinned_draws():
    """``torch.randperm`` and ``torch.rand`` on the host return pinned tensors (their copies then need no wait)."""
    randperm, rand = torch.randperm, torch.rand
    pin = (lambda t: t.pin_memory()) if DEVICE == "cuda" else (lambda t: t)
    torch.randperm = lambda *a, **k: pin(randperm(*a, **k))
    torch.rand = lambda *a, **k: pin(rand(*a, **k))
    try:
        yield
    finally:
        torch.randperm, torch.rand = randperm, rand


def _step(model, opt, ids) -> float:
    _sync()
    start = time.perf_counter()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync()
    return time.perf_counter() - start


def measure(folder: str, method: str, batch: int, seq: int, steps: int) -> dict:
    model = _model(folder, method)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), device=DEVICE)
    ctl = dropbp.apply(model, 0.0, backend=DEVICE, features=[dropbp.experimental.TokenDrops(0.5)])
    arms = {"full": 0.0, "tokens0.5": 0.5, "tokens0.5-pinned": 0.5}
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for round_ in range(steps + 3):
        for arm, rate in arms.items():
            ctl.features["token_drops"].rate = rate
            if arm.endswith("pinned"):
                with _pinned_draws():
                    seconds = _step(model, opt, ids)
            else:
                seconds = _step(model, opt, ids)
            if round_ >= 3:
                times[arm].append(seconds)
    medians = {arm: statistics.median(t) for arm, t in times.items()}
    ctl.features["token_drops"].rate = 0.5
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])]) as prof:
        _step(model, opt, ids)
    events = prof.key_averages()
    host = events.table(sort_by="self_cpu_time_total", row_limit=22)
    device = events.table(sort_by="self_cuda_time_total" if DEVICE == "cuda" else "cpu_time_total", row_limit=15)
    waits = {e.key: e.count for e in events if "Synchronize" in e.key or "Memcpy" in e.key}
    ctl.remove()
    return {"method": method, "batch": batch, "seq": seq, "median_s": medians, "waits": waits,
            "host_table": host, "device_table": device}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--points", nargs="+", default=["lora:8x512", "full:8x512", "lora:8x2048", "full:8x2048"])
    args = parser.parse_args()
    results = []
    for point in args.points:
        method, shape = point.split(":")
        batch, seq = (int(n) for n in shape.split("x"))
        result = measure(args.model, method, batch, seq, args.steps)
        results.append(result)
        print(point, json.dumps(result["median_s"]), json.dumps(result["waits"]), flush=True)
        print(result["host_table"], result["device_table"], sep="\n", flush=True)
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
                    "torch": torch.__version__,
                    "results": results,
                },
                f,
            )


if __name__ == "__main__":
    main()
