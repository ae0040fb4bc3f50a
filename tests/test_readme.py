"""The README's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    code = blocks[0].replace("/tmp/dropbp_state.pt", str(tmp_path / "state.pt"))
    exec(compile(code, "README example", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert out.count("dropped:") == 5
    assert (tmp_path / "state.pt").exists()


def test_readme_points_only_at_recorded_results():
    """Every results file the README cites (tables, figures) is in the repository."""
    cited = set(re.findall(r"benchmarks/results/[\w./-]+\.(?:md|png|json)", README.read_text()))
    assert cited
    missing = sorted(p for p in cited if not (README.parent / p).is_file())
    assert not missing, f"README cites missing files: {missing}"
