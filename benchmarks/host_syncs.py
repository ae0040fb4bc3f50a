"""Host syncs per optimizer step while the gradient noise scale is measured, counted with a dispatch mode.

A host sync is a read of a tensor's values by the host (``aten._local_scalar_dense``: ``.item()``, ``float(t)``, a
tensor in an ``if``; and ``.tolist()``, which reads without dispatching an op, counted by wrapping it); on a GPU or a
Gaudi each one waits for the device. A tiny Llama (4 layers) trains 6 optimizer
steps of 4 micro-batches; the ops dispatched during the last 4 steps are counted, with the noise scale off and on,
so the difference is the noise scale's own. Counts do not depend on the machine's load.

    python benchmarks/host_syncs.py            # from a checkout; prints one line per configuration

Writes benchmarks/results/host_syncs_<stem>.{json,md} (``--stem``, default ``cpu``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import Counter
from datetime import date
from pathlib import Path

import torch
import transformers
from hot_path import _commit
from torch.utils._python_dispatch import TorchDispatchMode

import dropbp

RESULTS = Path(__file__).resolve().parent / "results"
SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


class SyncCounter(TorchDispatchMode):
    """Counts the dispatched ops that make the host wait for the device's result, and ``Tensor.tolist`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()
        self._tolist = torch.Tensor.tolist

    def __enter__(self):  # noqa: ANN204
        counter, tolist = self.syncs, self._tolist

        def counted(tensor: torch.Tensor) -> object:
            counter["Tensor.tolist"] += 1
            return tolist(tensor)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.tolist = self._tolist
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in SYNCS:
            self.syncs[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _model() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()


def _noise_scale_on(model: torch.nn.Module, rate: float) -> None:
    """dropbp with the noise scale measured, in the spelling this checkout takes (0.2: an option; 0.3: a feature)."""
    if hasattr(dropbp, "NoiseScale"):
        dropbp.apply(model, rate, features=[dropbp.NoiseScale()])
    else:
        dropbp.apply(model, rate, measure_noise_scale=True)  # 0.2


def count(config: str, steps: int = 6, counted: int = 4, micro: int = 4) -> float:
    """Host syncs per optimizer step over the last ``counted`` of ``steps`` steps."""
    model = _model()
    if config == "dropbp 0.5":
        dropbp.apply(model, 0.5)
    elif config != "without dropbp":
        _noise_scale_on(model, 0.5 if config.endswith("0.5") else 0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(3, 64, (steps * micro, 8), generator=torch.Generator().manual_seed(0))
    counter = SyncCounter()
    for step in range(steps):
        mode = counter if step >= steps - counted else None
        if mode is not None:
            mode.__enter__()
        for m in range(micro):
            batch = ids[step * micro + m : step * micro + m + 1]
            (model(input_ids=batch, labels=batch).loss / micro).backward()
        optimizer.step()
        optimizer.zero_grad()
        if mode is not None:
            mode.__exit__(None, None, None)
    return sum(counter.syncs.values()) / counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--stem", default="cpu")
    args = parser.parse_args()
    configs = ["without dropbp", "dropbp 0.5", "dropbp 0, noise scale measured", "dropbp 0.5, noise scale measured"]
    rows = [{"config": c, "syncs_per_optimizer_step": count(c)} for c in configs]
    record = {
        "benchmark": "host_syncs",
        "date": date.today().isoformat(),
        "command": "python " + shlex.join(sys.argv),
        "commit": _commit(),
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"host_syncs_{args.stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"Host syncs (aten._local_scalar_dense, aten.is_nonzero, Tensor.tolist) per optimizer step of 4 micro-batches, "
        f"tiny Llama (4 layers), counted over 4 steps after 2, torch {torch.__version__}, {record['date']}, dropbp at "
        f"commit {record['commit']}. Command: `{record['command']}`",
        "",
        "| configuration | host syncs per optimizer step |",
        "|---|---|",
        *(f"| {r['config']} | {r['syncs_per_optimizer_step']:g} |" for r in rows),
    ]
    (args.out / f"host_syncs_{args.stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
