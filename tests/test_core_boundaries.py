"""dropbp 0.4's boundaries, checked on the source: the experiments live in ``dropbp/experimental`` only, ``apply``'s
options are the paper's DropBP, the device interface holds what execution and a user's script ask of a device, and a
0.3 checkpoint state still loads."""

from __future__ import annotations

import ast
import copy
import dataclasses
import re
from pathlib import Path

import pytest
from conftest import batch, loss_and_grads, tiny_model
from dropbp.backends.base import Backend

import dropbp
from dropbp.options import DropBPOptions

ROOT = Path(dropbp.__file__).parent.parent
#: The experiments' names: 0.3's options, and token drops' row operations.
EXPERIMENT_NAMES = {"unbiased", "dropped_grads", "drop_schedule", "ramp", "stratify"}
ROW_NAMES = {"kept_row_count", "place_rows", "ROW_BUCKETS", "row_local_linears", "recomputes_on_kept_rows"}


def _core_files() -> list[Path]:
    """The core: the package but for its experiments and its measurement tools (whose results tables keep 0.3's arm
    names, read by each feature's ``from_flat``), and the device files."""
    package = ROOT / "dropbp"
    outside = (package / "experimental", package / "tools")
    files = [p for p in package.rglob("*.py") if not any(p.is_relative_to(o) for o in outside)]
    return files + sorted((ROOT / "backends").glob("*.py"))


def _names_in_code(path: Path) -> set[str]:
    """Every name the code of ``path`` uses: identifiers, attributes, arguments, keywords and string constants
    (docstrings and comments left out: prose may tell the history)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names.update(re.findall(r"[A-Za-z_]+", node.value))
    return names


def test_no_core_module_names_an_experiment():
    named = EXPERIMENT_NAMES | ROW_NAMES
    found = {str(p.relative_to(ROOT)): sorted(_names_in_code(p) & named) for p in _core_files()}
    assert {path: names for path, names in found.items() if names} == {}


def test_the_scan_sees_an_experiment_named_in_code(tmp_path):
    """The check above can fail: a name in code, in a keyword or in a string is found; one in a docstring is not."""
    source = tmp_path / "mod.py"
    source.write_text('"""unbiased in prose."""\n\ndef f(x):\n    return g(stratify=x, key="drop_schedule")\n')
    assert _names_in_code(source) & EXPERIMENT_NAMES == {"stratify", "drop_schedule"}


def test_the_options_are_apply_s_only():
    assert len(dataclasses.fields(DropBPOptions)) <= 10
    assert not {f.name for f in dataclasses.fields(DropBPOptions)} & (EXPERIMENT_NAMES | {"seq_len", "windows"})


def test_every_public_member_of_the_device_interface_is_used_by_the_core_or_the_examples():
    """What only the tools or the experiments ask of a device is theirs (:mod:`dropbp.tools.device_tools`,
    :mod:`dropbp.experimental.token_rows`), not the interface's. A member the interface's own code reads (a class
    attribute its methods consult) counts as used by the core."""
    texts = [p.read_text() for p in _core_files() + sorted((ROOT / "examples").glob("*.py"))]
    members = sorted(n for n in dir(Backend) if not n.startswith("_"))
    unused = []
    for member in members:
        defined = re.compile(rf"(def {member}\b|^\s+{member}\s*[:=])", re.M)
        uses = sum(len(re.findall(rf"\b{member}\b", defined.sub("", t))) for t in texts)
        if uses == 0:
            unused.append(member)
    assert unused == []


def test_the_device_interface_check_can_fail(monkeypatch):
    monkeypatch.setattr(Backend, "only_for_a_tool", lambda self: None, raising=False)
    texts = [p.read_text() for p in _core_files()]
    assert not any(re.search(r"\bonly_for_a_tool\b", t) for t in texts)


def _state_0_3(state: dict, **settings: object) -> dict:
    """A 0.4 state as dropbp 0.3 wrote it: version 1, with its experimental settings."""
    return {**state, "version": 1, "drop_schedule": "constant", "ramp": 0.5, "stratify": 1, **settings}


def test_a_0_3_state_loads_and_resumes_the_same_patterns():
    model = tiny_model("llama", layers=3)
    ctl = dropbp.apply(model, 0.5, seed=4, warmup_steps=3, total_steps=20)
    for step in range(5):
        loss_and_grads(model, batch(step))
    saved = ctl.state_dict()
    resumed = dropbp.apply(copy.deepcopy(tiny_model("llama", layers=3)), 0.5)
    resumed.load_state_dict(_state_0_3(saved))
    assert resumed.state_dict() == saved
    assert [resumed.dropped_at(s) for s in range(20)] == [ctl.dropped_at(s) for s in range(20)]


@pytest.mark.parametrize(
    ("settings", "feature", "message"),
    [
        ({"drop_schedule": "linear", "ramp": 0.25}, dropbp.experimental.RisingSchedule("linear", ramp=0.25),
         r"drop_schedule='linear', ramp=0.25: pass features=\[dropbp.experimental.RisingSchedule\('linear', "
         r"ramp=0.25\)"),
        ({"stratify": 2}, dropbp.experimental.StratifiedCuts(2),
         r"stratify=2: pass features=\[dropbp.experimental.StratifiedCuts\(2\)\]"),
    ],
)  # fmt: skip
def test_a_0_3_state_with_an_experiment_loads_where_its_feature_is_given(settings, feature, message):
    model = tiny_model("llama", layers=3)
    ctl = dropbp.apply(model, 0.5, seed=1, total_steps=40, features=[feature])
    loss_and_grads(model, batch(0))
    saved = ctl.state_dict()
    plain = dropbp.apply(tiny_model("llama", layers=3), 0.5, total_steps=40)
    before = plain.state_dict()
    with pytest.raises(ValueError, match=message):
        plain.load_state_dict(_state_0_3(saved, **settings))
    assert plain.state_dict() == before  # refused: nothing changed
    again = type(feature).from_config(feature.config())
    resumed = dropbp.apply(tiny_model("llama", layers=3), 0.5, total_steps=40, features=[again])
    resumed.load_state_dict(_state_0_3(saved, **settings))
    assert [resumed.dropped_at(s) for s in range(40)] == [ctl.dropped_at(s) for s in range(40)]
