"""The GPU benchmark scripts prepared for a lent device, run here on the CPU at a tiny shape: what they record is
complete before a device's minutes are spent on them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_long_document_gpu_script_records_every_arm(tmp_path, monkeypatch):
    """Issue 69 item 6's script: each arm a fresh SFTTrainer on one LoRA model, rounds rotated, DropBP taken off the
    model after each run; full backprop's speedup is 1 and every arm has its rounds' timed steps."""
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)
    script = _script("gpu_long_document")
    out = tmp_path / "out"
    script.main(["--shapes", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1", "--rounds", "2",
                 "--out", str(out)])  # fmt: skip
    record = json.loads((out / "long_document_gpu.json").read_text())
    (point,) = record["points"]
    assert point["shape"] == "tiny" and point["tokens"] == 64
    assert list(point["arms"]) == ["full", "0.5", "0.875"]
    assert all(arm["steps"] == 4 and arm["peak_allocated_bytes"] is None for arm in point["arms"].values())
    assert point["arms"]["full"]["speedup"] == 1.0 and point["arms"]["full"]["dropped_share"] == [0.0] * 4
    for rate in (0.5, 0.875):  # each step's dropped share is a cut's: a share of the branch FLOPs, the top kept
        assert all(0.0 <= share < 1.0 for share in point["arms"][f"{rate:g}"]["dropped_share"])
    assert any(share > 0.0 for share in point["arms"]["0.875"]["dropped_share"])
    assert "| tiny | 64 | cut @ 0.875 |" in (out / "long_document_gpu.md").read_text()
    with pytest.raises(ValueError, match="unknown shape 'huge'"):
        script.config_of("huge", 64)
