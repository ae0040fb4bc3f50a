"""dropbp bench's memory tools: size parsing, the longest-sequence search, and one real probe."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from dropbp.tools import membench
from dropbp.tools.membench import grid_length, longest_sequence, markdown, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [("6GiB", 6 * 2**30), ("6G", 6 * 2**30), ("512MiB", 512 * 2**20), ("1.5g", 3 * 2**29), ("1000", 1000)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "six", "6 GB of RAM", "-1G"])
def test_parse_size_refuses(bad):
    with pytest.raises(ValueError, match="expected a size such as 6GiB"):
        parse_size(bad)


def test_grid_is_geometric_in_multiples_of_64():
    lengths = [grid_length(k) for k in range(13)]
    assert lengths[0] == 256 and lengths[4] == 512 and lengths[8] == 1024 and lengths[12] == 2048
    assert all(n % 64 == 0 for n in lengths) and lengths == sorted(set(lengths))


def test_search_finds_the_longest_fitting_grid_length(monkeypatch):
    """A fake probe that fits up to a per-rate limit: the search returns the longest grid length under it,
    and a higher rate starts from the lower rate's result (never re-probing what is known to fit)."""
    limits = {None: 1000, 0.5: 3000, 0.875: 100_000}
    seen: list[tuple] = []

    def probe(spec, say=print):
        seen.append((spec["rate"], spec["seq_len"]))
        assert spec["budget"] == 123 and spec["chunked"] is True
        return {"seq_len": spec["seq_len"], "fits": spec["seq_len"] <= limits[spec["rate"]]}

    monkeypatch.setattr(membench, "run_probe", probe)
    out = longest_sequence("tiny", "lora", [0.875, 0, 0.5], True, 123, {}, limit=20_000, say=lambda s: None)
    want = {r: max(grid_length(k) for k in range(60) if grid_length(k) <= min(limits[r], 20_000)) for r in limits}
    assert [out[k]["longest"] for k in ("0", "0.5", "0.875")] == [want[None], want[0.5], want[0.875]]
    assert not any(rate == 0.5 and seq <= want[None] for rate, seq in seen)
    assert len(out["0"]["probes"]) == sum(rate is None for rate, _ in seen)


def test_the_memory_table_takes_each_checkpointing_setting_and_its_own_baseline(monkeypatch):
    """``dropbp bench --memory --checkpointing both`` probes each setting (it ignored the flag: every probe ran without
    checkpointing), and each row is set against the baseline of its own setting, "less" only where it is less."""
    seen = []

    def probe(spec, say=print):
        seen.append((spec["checkpointing"], spec["rate"]))
        peak = {(False, None): 800, (False, 0.5): 500, (True, None): 200, (True, 0.5): 250}[seen[-1]]
        saved = {"total": 0, "kept_branches": 0, "rest": 0, "dropped_branches": 0}
        return {**spec, "peak_above_level_bytes": peak << 20, "saved": saved, "step_s": [1.0]}

    monkeypatch.setattr(membench, "run_probe", probe)
    rows = membench.memory_table("tiny", "lora", [64], [0, 0.5], [False], {}, lambda s: None, None, [False, True])
    assert seen == [(False, None), (False, 0.5), (True, None), (True, 0.5)]
    text = markdown({"device": "cpu", "dtype": "float32", "torch": "x", "date": "d", "memory": rows})
    assert "| tiny | lora | plain | off | 64 | 0.5 | 0.49 | 1.60x less |" in text
    assert "| tiny | lora | plain | on | 64 | 0.5 | 0.24 | 1.25x more |" in text


def test_markdown_reports_the_gain():
    results = {
        "device": "cpu",
        "dtype": "float32",
        "torch": "x",
        "date": "d",
        "memory_budget": 2**30,
        "max_seq_len": {"m/lora": {"plain": {"0": {"longest": 512}, "0.875": {"longest": 2048}}}},
    }
    text = markdown(results)
    assert "| plain | 512 | 2048 | 4.00x |" in text and "budget 1.00 GiB" in text


def test_a_real_probe_in_a_fresh_process():
    """The tiny preset, LoRA, drop rate 0.5, chunked loss: a real step, its peak and its saved bytes; then a
    1-byte budget, which the watchdog stops at once."""
    spec = {"preset": "tiny", "method": "lora", "seq_len": 64, "rate": 0.5, "chunked": True, "backend": "cpu"}
    run = [sys.executable, "-m", "dropbp.tools.memprobe"]
    out = subprocess.run([*run, json.dumps(spec | {"account": True})], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["fits"] and result["peak_bytes"] >= result["level_bytes"] > 0
    assert result["peak_above_level_bytes"] == result["peak_bytes"] - result["level_bytes"]
    assert len(result["dropped"]) == 4 and result["branches"] == 8  # uniform: half of 8 branches every step
    saved = result["saved"]
    assert saved["dropped_packs"] == 0 and saved["total"] == saved["kept_branches"] + saved["rest"]
    assert saved["full_total"] - saved["total"] == saved["dropped_branches"] > 0
    out = subprocess.run([*run, json.dumps(spec | {"budget": 1})], capture_output=True, text=True, check=True)
    stopped = json.loads(out.stdout.strip().splitlines()[-1])
    assert stopped["fits"] is False and stopped["stopped_at_bytes"] > 1


def test_memory_docs_cite_only_recorded_results():
    """docs/memory.md's figures come from files in benchmarks/results/ that are in the repository."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "memory.md").read_text()
    cited = set(re.findall(r"benchmarks/results/[\w./-]+\.(?:md|png|json)", text))
    assert cited
    assert not sorted(p for p in cited if not (root / p).is_file())
