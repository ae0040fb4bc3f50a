"""The README's example runs as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run(tmp_path, monkeypatch, capsys):
    """Both complete examples (with their imports) run as written: the first screen's and the training loop's."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    blocks = [b for b in blocks if "import dropbp" in b and "ctl.remove()" in b]  # complete: not litgpt's sketch
    assert len(blocks) == 2, "README has the first screen's example and the training loop's"
    for index, block in enumerate(blocks):
        code = block.replace("/tmp/dropbp_state.pt", str(tmp_path / "state.pt"))
        exec(compile(code, f"README example {index}", "exec"), {"__name__": "readme"})
        assert capsys.readouterr().out.count("dropped:") == 5
    assert (tmp_path / "state.pt").exists()


ROOT = README.parent
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_point_only_at_recorded_results_and_existing_pages(page):
    """Every results file a page cites (tables, figures) is in the repository, and every relative
    link (to a docs page, a results folder, an image) resolves from where the page is."""
    text = page.read_text()
    cited = set(re.findall(r"benchmarks/results/[\w./-]+\.(?:md|png|json)", text))
    missing = sorted(p for p in cited if not (ROOT / p).is_file())
    assert not missing, f"{page.name} cites missing files: {missing}"
    links = re.findall(r"\]\((?!https?://|#)([^)\s]+)\)", text)
    broken = sorted(link for link in links if not (page.parent / link.split("#")[0]).exists())
    assert not broken, f"{page.name} has broken links: {broken}"


def test_the_readme_cites_results_and_links_every_docs_page():
    text = README.read_text()
    assert re.search(r"benchmarks/results/[\w./-]+\.(?:md|png|json)", text)
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in text, f"README does not link docs/{page.name}"


def test_quick_start_is_two_commands_and_ci_runs_the_second():
    """The first code block under "## Quick start" holds exactly two lines: the demo, and the test
    command that .ci/run runs verbatim."""
    section = README.read_text().split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    demo, tests = block.strip().splitlines()
    assert "dropbp demo" in demo and demo.startswith("bash ci/install.sh && ")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == tests, f".ci/run ends with {ci[-1]!r}, the README's test line is {tests!r}"
    assert "ci/install.sh" in (ROOT / "ci" / "test.sh").read_text()  # line 2 sets up, too


def _benchmark(name: str):
    """benchmarks/NAME.py, loaded by path (benchmarks/ is not a package)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass resolves its annotations through its module
    spec.loader.exec_module(module)
    return module


def _readme_results():
    return _benchmark("readme_results")


RESULTS_PAGE = ROOT / "docs" / "results.md"


def _tables(text: str) -> list[list[str]]:
    """The markdown tables of ``text``, each as its lines (header, separator, rows)."""
    tables, current = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


def test_the_readme_first_screen_is_a_product_page():
    """README's first 40 lines: the picture (drawn from the records), a clone + install line, a runnable example with
    its imports, who should try it and who should not (each linked to its evidence); then what it buys (made from the
    records) and the install table; every table of figures names its baseline in its header."""
    results = _readme_results()
    text = README.read_text()
    first_40 = "\n".join(text.splitlines()[:40])
    assert "![" in first_40 and "(benchmarks/results/readme_figure/figure.png)" in first_40
    assert json.loads((results.FIGURE / "figure.json").read_text()) == results.figure_data()  # drawn from the records
    assert re.search(r"^git clone .+ && cd dropbp && pip install \"\.\[hf\]\"", first_40, flags=re.M)
    example = re.search(r"```python\n(.*?)```", first_40, flags=re.S).group(1)
    assert "import dropbp" in example and "import torch" in example and "dropbp.apply(model, 0.5)" in example
    for who in ("**Try it**", "**Not**"):
        sentence = first_40.split(who, 1)[1].split("**", 1)[0] if who == "**Try it**" else first_40.split(who, 1)[1]
        assert re.search(r"\]\((?:#|docs/)[^)]+\)", sentence.split("\n\n", 1)[0]), f"{who} links no evidence"
    assert "DropBPCallback(drop_rate=0.5)" in first_40 and "dropbp check --model" in first_40
    assert results.between(text, results.BUYS_BEGIN, results.BUYS_END) == results.buys_tables()
    assert results.between(text, results.CLAIMS_BEGIN, results.CLAIMS_END) == results.claims_table()
    assert re.search(r"^\| .+ \| `pip install [^`]+` \|$", text, flags=re.M)  # ci/install-lines.sh runs these
    claims = results.claims_table()
    for claim in ("| 44% less |", "| 1.5x faster |", "| 6.2x longer |", "| +79% |", "| +117% |"):
        assert claim in claims
    for table in _tables(results.buys_tables() + "\n" + claims + "\n" + results.arms_table(few=True)):
        if any(re.search(r"\d\.\d\dx|\d%", row) for row in table[2:]):  # a table of figures
            assert "against" in table[0], f"a table of figures whose header names no baseline: {table[0][:80]}"


def _long_header_cells(text: str, most: int = 60) -> list[str]:
    return [cell for table in _tables(text) for cell in table[0].strip("|").split(" | ") if len(cell.strip()) > most]


def test_no_readme_table_header_cell_is_over_60_characters():
    """Conditions go in one line under a table, not in its header."""
    assert _long_header_cells(README.read_text()) == []
    planted = "| step speedup against full backprop at one batch, both with checkpointing on | CPU |\n|---|---|\n"
    assert _long_header_cells(planted)  # the check sees a long one


def test_a_table_of_figures_that_names_no_baseline_fails_the_first_screen_test():
    """The header check above sees a table of speedups without a baseline (a check that cannot fail is no check)."""
    table = _tables("| arm | speedup |\n|---|---|\n| DropBP 0.5 | 1.34x |\n")[0]
    assert any(re.search(r"\d\.\d\dx", row) for row in table[2:]) and "against" not in table[0]


def test_the_readme_shows_four_arms_and_the_results_page_every_arm():
    """README: full backprop, branch drops at 0.5, drop_rate="auto" and the best token arm against full backprop at
    its best batch; docs/results.md: every arm of benchmarks/token_drops.py, best first; both made from the records;
    docs/token-drops.md's step times and frontier too."""
    results = _readme_results()
    text = README.read_text()
    four = results.arms_table(few=True)
    assert results.between(text, results.FOUR_BEGIN, results.FOUR_END) == four
    arms = [line for line in _tables(four)[0][2:]]
    assert len(arms) == 4 and arms[-1].startswith("| nothing: full backprop at its best batch")
    made = results.arms_table()
    assert results.between(RESULTS_PAGE.read_text(), results.ARMS_BEGIN, results.ARMS_END) == made
    rows = [line.split("**")[1::2] for line in made.splitlines() if line.startswith("| ") and "**" in line]
    means = [sum(float(cell.split("x")[0]) for cell in row) / len(row) for row in rows]
    assert means == sorted(means, reverse=True) and len(means) >= 8  # the best arm first
    page = results.TOKEN_PAGE.read_text()
    assert results.between(page, results.TBENCH_BEGIN, results.TBENCH_END) == results.token_bench_table()
    assert results.between(page, results.KEPT_BEGIN, results.KEPT_END) == results.kept_rows_table()
    assert results.between(page, results.TGPU_BEGIN, results.TGPU_END) == results.gpu_token_bench_table()
    assert results.between(page, results.TFRONT_BEGIN, results.TFRONT_END) == results.token_frontier_table()
    made = results.token_frontier_checkpointing_table()
    assert results.between(page, results.TCKPT_BEGIN, results.TCKPT_END) == made
    assert results.between(page, results.TSMOL_BEGIN, results.TSMOL_END) == results.smollm2_token_table()


def test_the_noise_scale_page_tables_are_the_records():
    results = _readme_results()
    page = results.NOISE_PAGE.read_text()
    assert results.between(page, results.NOISE_BEGIN, results.NOISE_END) == results.noise_tables()
    assert "validation.md" in results.noise_tables() and "cost_cpu.md" in results.noise_tables()


def test_no_figure_in_the_readme_has_two_values():
    """One value per figure: no ranges of speedups or percentages, no "a / b" pairs of one figure."""
    import re

    text = README.read_text()
    ranges = re.findall(r"\b\d+(?:\.\d+)?x?\s?[-\u2013]\s?\d+(?:\.\d+)?x\b", text)
    ranges += re.findall(r"\b\d+(?:\.\d+)?%?\s?[-\u2013]\s?\d+(?:\.\d+)?%", text)
    ranges += re.findall(r"\d\.\d+x\s*/\s*\d\.\d+x|[+-]\d\.\d+ to [+-]\d\.\d+", text)
    assert not ranges


def test_the_results_page_tables_are_the_ones_the_records_make():
    """docs/results.md: the map (speedup at equal quality), SmolLM2's equal-quality figure and the step and loss
    figures at equal steps and equal time, each generated from its records, in that order."""
    results = _readme_results()
    text = RESULTS_PAGE.read_text()
    assert results.between(text, results.MAP_BEGIN, results.MAP_END) == results.map_table()
    assert results.between(text, results.EQ_BEGIN, results.EQ_END) == results.smollm2_table()
    assert results.readme_table(text) == results.table()
    assert text.index(results.MAP_BEGIN) < text.index(results.EQ_BEGIN) < text.index(results.BEGIN)
    assert "speedup at equal quality" in results.map_table() and "x 1k tokens" in results.map_table()
    assert "SmolLM2-135M" in results.smollm2_table() and "speedup at equal quality" in results.smollm2_table()
    assert "full, Python help text" in results.table() and "LoRA, Python help text" in results.table()


LAB_NOTEBOOK = (r"issue \d", r"\(issue", "session", "was lent", "the aim was", "the goal was", "reverted",
                "the issue asked", "against the targets")  # fmt: skip


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "history.md"], ids=lambda p: p.name)
def test_user_pages_say_what_holds_now_not_how_it_came_about(page):
    """README and docs/ (history.md aside) hold no lab notebook: no issue numbers, sessions, goals or reverted
    attempts."""
    text = page.read_text().lower()
    found = [phrase for phrase in LAB_NOTEBOOK if re.search(phrase, text)]
    assert not found, f"{page.name} says {found}: move it to docs/history.md or state what holds now"


USER_PAGES = [p for p in PAGES if p.name != "history.md"]


@pytest.mark.parametrize("figure", _benchmark("figures").FIGURES, ids=lambda f: f.name)
def test_a_figure_the_pages_quote_has_its_records_value_everywhere(figure):
    """Each place a page states a registered figure (benchmarks/figures.py) is there and says the record's value:
    one truth per figure."""
    value = figure.read()
    for page, pattern in figure.places:
        said = [re.sub(r"\s+", " ", m) for m in re.findall(pattern, (ROOT / page).read_text())]
        assert said, f"{page} no longer states {figure.name!r} where {pattern!r} looks: update benchmarks/figures.py"
        assert set(said) == {value}, f"{page} says {figure.name} is {said}; its record says {value}"


def test_every_speedup_interval_on_the_pages_is_one_a_record_holds():
    """A speedup quoted with its 95% interval anywhere in README and docs/ (history aside) is a mean and interval
    that some record under benchmarks/results holds: no interval typed by hand, none left behind by a re-run."""
    recorded = _benchmark("figures").recorded_intervals()
    quoted = [
        (page.name, f"{m[0]}x [{m[1]}, {m[2]}]")
        for page in USER_PAGES
        for m in re.findall(r"(\d+\.\d\d)x(?:\*\*)? \[(?:95%: )?(-?\d+\.\d\d), (-?\d+\.\d\d)\]", page.read_text())
    ]
    assert len(quoted) > 50  # the pattern still finds the pages' intervals
    unrecorded = sorted({q for q in quoted if q[1] not in recorded})
    assert not unrecorded, f"intervals no record holds: {unrecorded}"


# One truth: each class of contradiction the pages once held, checked where it could come back.

LAB_NOTEBOOK = (r"\bthe issue('s)?\b", r"previous commit", r"an earlier record", r"No space left", r"GB of disk")


@pytest.mark.parametrize("page", [*USER_PAGES, ROOT / "CHANGELOG.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_user_pages_hold_no_lab_notebook(page):
    """User pages say what holds, not how the project got there (docs/history.md keeps that): no issue wording, no
    "previous commit", no CI incident."""
    import re

    found = [m.group(0) for pattern in LAB_NOTEBOOK for m in re.finditer(pattern, page.read_text(), flags=re.I)]
    assert not found, f"{page.name}: {found}"


def test_where_it_runs_cites_every_gpu_record():
    """README's "where it runs" is made from the evidence (readme_results.RUNS), and every record made on a GPU is
    part of it: a platform cannot read "not run" while a record of it is in the repository."""
    results = _readme_results()
    text = README.read_text()
    assert results.between(text, results.RUNS_BEGIN, results.RUNS_END) == results.where_it_runs_table()
    cited = {path for columns in results.RUNS.values() for evidence in columns.values() for *_, path in evidence}
    gpu = [p for p in (ROOT / "benchmarks" / "results").iterdir() if p.name.startswith("gpu_")]
    assert gpu
    for folder in gpu:
        assert any(path.startswith(str(folder.relative_to(ROOT))) for path in cited), f"{folder.name} is cited nowhere"


def test_the_litgpt_environments_transformers_is_one_version_everywhere():
    """The transformers that CI's litgpt environment installs (ci/install-litgpt.sh) is the one pyproject.toml,
    README and docs name for it."""
    import re

    pin = re.search(r'"transformers>=([\d.]+),<', (ROOT / "ci" / "install-litgpt.sh").read_text()).group(1)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.findall(r"beside transformers ([\d.]+)", pyproject) == [pin]
    said = re.findall(r"(?:second environment does with|litgpt.{0,80}?) transformers (\d\.\d+)\b", README.read_text())
    assert said and set(said) == {pin}, said


# -- the contradictions issue 70 found, one test a class ------------------------------------------------------------


def test_one_cell_reads_the_same_on_every_page_that_shows_it():
    """SmolLM2's equal-time cell: README and docs/results.md print one text (they printed 0.93x and 0.98x)."""
    results = _readme_results()
    record = json.loads(results.SMOLLM2_EQUAL_QUALITY.read_text())
    cell = results.seeds_text(next(r["speedup"] for r in record["rows"] if r["run"] == "DropBP 0.5, equal time"))
    assert cell in README.read_text() and cell in (ROOT / "docs" / "results.md").read_text()


def test_the_claims_table_measures_what_a_record_holds_and_labels_each_figure():
    """The paper's algorithm's longest sequence is read from its record (it said "not measured"); the CPU cut figure
    is the cuts drawn and the H200 one at the expected cut, each said; the paper's conditions stand under the table,
    not over rows they do not describe."""
    results = _readme_results()
    claims = results.claims_table()
    longest = next(line for line in claims.splitlines() if line.startswith("| longest trainable sequence"))
    assert "not measured" not in longest.split(" | ")[2] and results.paper_longest() in longest
    throughput = next(line for line in claims.splitlines() if line.startswith("| throughput, NVIDIA A100"))
    assert "(the cuts drawn)" in throughput and "(at the expected cut)" in throughput
    header = claims.splitlines()[1]
    assert "70B" not in header and "LLaMA2-70B QLoRA on A100s" in claims


def test_no_page_says_the_gpu_tools_never_ran_where_a_gpu_record_holds_them():
    """docs/backends.md said `dropbp check` and `bench` never ran on a GPU; gpu_h200_core holds both."""
    assert (ROOT / "benchmarks/results/gpu_h200_core/check_cuda_final/check.md").exists()
    for page in PAGES:
        text = re.sub(r"\s+", " ", page.read_text())
        said = re.findall(r"`dropbp (?:check|bench)`[^.]*(?:have not|has not|never)[^.]*run on a GPU", text)
        assert not said, f"{page.name}: {said}"


def test_the_long_context_example_is_not_billed_as_the_longest_sequences():
    """Like for like, checkpointing with the chunked loss reaches as long a sequence as DropBP with both: the example
    makes each step cheaper, and neither README nor its own first line says it reaches longer sequences."""
    text = re.sub(r"\s+", " ", README.read_text())
    billed = text.split("(examples/long_context.py) (", 1)[1].split(")", 1)[0]
    assert "longest" not in billed
    first_line = (ROOT / "examples" / "long_context.py").read_text().split("\n", 1)[0]
    assert "longest" not in first_line.lower()
