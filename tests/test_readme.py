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
