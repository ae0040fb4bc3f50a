"""dropbp 0.3's surface: a small core (the paper's DropBP), features that own their settings, the experiments out of
``apply``'s signature with 0.2's spellings saying where they went, and no stale pointer in the library or docs."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch
from conftest import batch, tiny_model

import dropbp
from dropbp.controller import DropBPController
from dropbp.features.base import Feature, feature_classes
from dropbp.options import INTERNAL, MOVED, MOVED_MEMBERS

ROOT = Path(dropbp.__file__).parent.parent
PACKAGE = ROOT / "dropbp"
OUT_OF_APPLY = (
    "token_selection",
    "unbiased",
    "dropped_grads",
    "stratify",
    "ramp",
    "drop_schedule",
    "windows",
    "seq_len",
)


def test_apply_and_the_callback_take_at_most_ten_options_besides_the_drop_rate():
    options = [n for n in inspect.signature(dropbp.apply).parameters if n not in ("model", "drop_rate")]
    assert len(options) <= 10, options
    assert not set(OUT_OF_APPLY) & set(options)
    pytest.importorskip("transformers")
    from dropbp.integrations.hf import DropBPCallback

    callback = [n for n in inspect.signature(DropBPCallback).parameters if n != "drop_rate"]
    assert len(callback) <= 10 and not set(OUT_OF_APPLY) & set(callback)


#: Every option an earlier release took that 0.4's ``apply`` does not, with the release that moved it and the way now.
_MOVED_OPTIONS = {
    **{name: ("0.3", way) for name, way in MOVED.items()},
    **{name: ("0.4", way) for name, way in INTERNAL.items()},
    **{name: ("0.4", way) for cls in feature_classes().values() for name, way in cls.replaces.items()},
}


def test_every_0_3_experimental_option_has_a_feature_that_replaces_it():
    experiments = {"unbiased", "dropped_grads", "drop_schedule", "ramp", "stratify", "seq_len", "windows"}
    assert experiments <= set(_MOVED_OPTIONS)


@pytest.mark.parametrize("name", sorted(_MOVED_OPTIONS))
def test_a_moved_option_says_where_it_went_everywhere_it_could_be_given(name):
    model = tiny_model("llama", layers=2)
    release, way = _MOVED_OPTIONS[name]
    said = rf"no longer takes {name} \(dropbp {release}\): .*{re.escape(way)}"
    with pytest.raises(TypeError, match=said):
        dropbp.apply(model, 0.5, **{name: 1})
    with pytest.raises(TypeError, match=rf"dropbp.experimental.apply is gone in dropbp 0.4: .*{name} \(dropbp"):
        dropbp.experimental.apply(model, 0.5, **{name: 1})  # 0.3's entry point for the experiments
    ctl = dropbp.apply(model, 0.5, seed=2)
    before = (ctl.state_dict(), [ctl.dropped_at(s) for s in range(20)])
    with pytest.raises(TypeError, match=said):
        ctl.replace_options(**{name: 1})
    if not hasattr(DropBPController, name):  # (windows is the controller's own setting in 0.4)
        with pytest.raises(AttributeError, match=rf"no setting '{name}' \(dropbp {release}\)"):
            setattr(ctl, name, 1)
    assert (ctl.state_dict(), [ctl.dropped_at(s) for s in range(20)]) == before
    pytest.importorskip("transformers")
    from dropbp.integrations.hf import DropBPCallback

    with pytest.raises(TypeError, match=said):
        DropBPCallback(0.5, **{name: 1})
    with pytest.raises(TypeError, match=rf"DropBPCallback.experimental is gone in dropbp 0.4: .*{name} \(dropbp"):
        DropBPCallback.experimental(0.5, **{name: 1})


def test_the_controller_is_lean():
    """At most 29 public names (methods, properties and attributes set in ``__init__``) and 350 lines: 0.3's 28, and
    ``windows``, which left the options in 0.4 (the run's optimizer-step windows, set by the Trainer integration)."""
    source = (PACKAGE / "controller.py").read_text()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "DropBPController")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    names |= {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    names |= {
        t.attr
        for n in ast.walk(init)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    public = sorted(n for n in names if not n.startswith("_"))
    assert len(public) <= 29, public
    assert len(source.splitlines()) <= 350


def _auto_comparisons() -> list[str]:
    found = []
    for path in PACKAGE.rglob("*.py"):
        if "tools" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                sides += [e for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set)) for e in s.elts]
                if any(
                    isinstance(s, ast.Constant) and s.value == "auto" or getattr(s, "id", "") == "AUTO" for s in sides
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_auto_is_resolved_in_few_places():
    """Each ``"auto"`` is resolved by one function of the feature or option that owns it; the core compares it in
    at most 10 places outside the tools."""
    assert len(_auto_comparisons()) <= 10, _auto_comparisons()


_MOD = re.compile(r":mod:`~?(\.?[\w.]+)`")
_DOC = re.compile(r"(?<![\w/.-])docs/([\w.-]+\.md)")


def _pointer_files() -> list[Path]:
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "backends").glob("*.py"), *(ROOT / "docs").glob("*.md")]
    return [*files, ROOT / "README.md", *(ROOT / "examples").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]


def _resolves(module: str) -> bool:
    """Whether a dotted name is a module of the checkout, or a name defined at the top of one."""
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:cut])
        if parts[0] == "dropbp" and len(parts) > 1 and parts[1] == "backends":
            path = ROOT.joinpath("backends", *parts[2:cut])
        found = [f for f in (path.with_suffix(".py"), path / "__init__.py") if f.is_file()]
        if found:
            if cut == len(parts):
                return True
            name = re.escape(parts[cut])
            return bool(re.search(rf"^(class |def ){name}\b|^{name}\s*[:=]", found[0].read_text(), re.M))
    return False


@pytest.mark.skipif(not (ROOT / "pyproject.toml").is_file(), reason="dropbp installed without its checkout: no docs")
def test_every_module_and_docs_pointer_resolves():
    stale = []
    for path in _pointer_files():
        text = path.read_text()
        package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])  # where a relative :mod: starts
        named = [package + m if m.startswith(".") else m for m in _MOD.findall(text)]
        stale += [f"{path.relative_to(ROOT)}: :mod:`{m}`" for m in named if m.startswith("dropbp") and not _resolves(m)]
        stale += [
            f"{path.relative_to(ROOT)}: docs/{d}" for d in _DOC.findall(text) if not (ROOT / "docs" / d).is_file()
        ]
    assert not stale


def test_the_pointer_check_sees_a_stale_one(tmp_path):
    assert _resolves("dropbp.features.noise_scale") and _resolves("dropbp.options.DropBPOptions")
    assert not _resolves("dropbp.execution.gradient_noise") and not _resolves("dropbp.chunked_loss")
    assert _DOC.findall("see docs/architectures.md and ../docs/x.md") == ["architectures.md"]
    assert _MOD.findall(":mod:`.graphs` and :mod:`~dropbp.policy`") == [".graphs", "dropbp.policy"]


class _Refusing(Feature):
    key = "refusing"

    def check(self, model, framework):
        raise RuntimeError("this feature cannot run here")


def test_a_feature_that_refuses_leaves_the_model_as_it_was():
    model = tiny_model("llama", layers=2)
    hooks = lambda: sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())  # noqa: E731, SLF001
    before, forward = hooks(), vars(model).get("forward")
    with pytest.raises(RuntimeError, match="cannot run here"):
        dropbp.apply(model, 0.5, features=[_Refusing()])
    assert hooks() == before and vars(model).get("forward") is forward
    dropbp.apply(model, 0.5)  # nothing was left attached


def test_features_are_one_object_per_model_and_removed_with_the_controller():
    noise = dropbp.NoiseScale()
    model = tiny_model("llama", layers=2)
    ctl = dropbp.apply(model, 0.5, features=[noise])
    assert ctl.features == {"noise_scale": noise}
    with pytest.raises(ValueError, match="attached to another controller"):
        dropbp.apply(tiny_model("llama", layers=2), 0.5, features=[noise])
    with pytest.raises(ValueError, match="two features of one kind"):
        dropbp.apply(tiny_model("llama", layers=2), 0.5, features=[dropbp.NoiseScale(), dropbp.NoiseScale()])
    with pytest.raises(TypeError, match="must be a list of dropbp features"):
        dropbp.apply(tiny_model("llama", layers=2), 0.5, features=["noise"])
    ctl.remove()
    assert not noise.attached
    other = dropbp.apply(tiny_model("llama", layers=2), 0.5, features=[noise])  # free again
    assert other.features["noise_scale"] is noise


def test_a_feature_added_or_left_out_by_replace_options_is_attached_or_removed():
    model = tiny_model("llama", layers=2)
    ctl = dropbp.apply(model, 0.0)
    chunked = dropbp.ChunkedLoss(8)
    ctl.replace_options(features=[chunked])
    ids = batch(1)
    assert model(input_ids=ids, labels=ids).logits is None  # the chunked loss computes no logits
    assert ctl.schedule.options.memory_bound is True  # a feature that buys memory turns memory_bound="auto" on
    ctl.replace_options(features=[])
    assert model(input_ids=ids, labels=ids).logits is not None and not chunked.attached


def test_drop_rate_auto_adds_the_noise_scale_and_its_state_resumes():
    model = tiny_model("llama", layers=2)
    ctl = dropbp.apply(model, "auto")
    assert isinstance(ctl.features["noise_scale"], dropbp.NoiseScale) and ctl.drop_rate == 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(3):
        for m in range(2):
            ids = batch(10 * step + m)
            (model(input_ids=ids, labels=ids).loss / 2).backward()
        opt.step()
        opt.zero_grad()
    state = ctl.state_dict()
    assert state["drop_rate"] == "auto" and state["noise_scale"]["steps"] >= 1
    fresh = dropbp.apply(tiny_model("llama", layers=2), "auto")
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    with pytest.raises(ValueError, match=r"state\['token_shares'\] is 0.2's automatic token shares.*'token_drops'"):
        fresh.load_state_dict({**state, "token_shares": {}})
    assert fresh.state_dict() == state


def test_the_controller_a_researcher_builds_is_the_same_class():
    stratified, weights = dropbp.experimental.StratifiedCuts(2), dropbp.experimental.ImportanceWeights()
    ctl = dropbp.apply(tiny_model("llama", layers=2), 0.5, features=[stratified, weights])
    assert type(ctl) is DropBPController
    assert ctl.features == {"stratified_cuts": stratified, "importance_weights": weights}
    ctl.replace_options(features=[weights])  # the experiments change as every feature does
    assert list(ctl.features) == ["importance_weights"] and not stratified.attached


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def test_a_refused_feature_changes_nothing(monkeypatch):
    """A feature that refuses the model (the noise scale on a DeepSpeed engine or FSDP shards) does so before
    anything is attached or changed: in apply, in a setter (drop_rate="auto" adds it), in replace_options. The model
    keeps no hook and no patched forward; the controller keeps its options and features."""
    model = tiny_model("llama", layers=2)

    def refuse(self, model, framework):
        raise RuntimeError("the noise scale is refused here")

    monkeypatch.setattr(dropbp.NoiseScale, "check", refuse)
    before = _hooks(model)
    attempts = (lambda: dropbp.apply(model, 0.5, features=[dropbp.NoiseScale()]), lambda: dropbp.apply(model, "auto"))
    for attempt in attempts:
        with pytest.raises(RuntimeError, match="refused here"):
            attempt()
        assert _hooks(model) == before and "forward" not in vars(model)
    ctl = dropbp.apply(model, 0.5)
    attached = _hooks(model)
    with pytest.raises(RuntimeError, match="refused here"):
        ctl.drop_rate = "auto"
    with pytest.raises(RuntimeError, match="refused here"):
        ctl.replace_options(features=[dropbp.NoiseScale()], drop_rate=0.25)
    assert ctl.options.drop_rate == 0.5 and ctl.drop_rate == 0.5 and not ctl.features and _hooks(model) == attached
    ctl.remove()
    assert _hooks(model) == before and "forward" not in vars(model)


class _FailingFeature(Feature):
    """A feature whose ``attach`` raises after the features before it were attached (issue 71, class B)."""

    key = "failing"

    def attach(self, host) -> None:
        super().attach(host)
        raise RuntimeError("this feature cannot attach")


def test_a_feature_whose_attach_raises_leaves_everything_as_it_was():
    """Class B: ``apply`` with a feature that fails in ``attach`` leaves no hook, no patched forward and no feature
    attached (a noise scale given before it included); ``replace_options`` with one is all or nothing: options, rates,
    features and hooks as before."""
    model = tiny_model("llama", layers=2)
    before = _hooks(model)
    noise = dropbp.NoiseScale()
    with pytest.raises(RuntimeError, match="cannot attach"):
        dropbp.apply(model, 0.5, features=[noise, dropbp.ChunkedLoss(8), _FailingFeature()])
    assert _hooks(model) == before and "forward" not in vars(model) and not noise.attached
    ctl = dropbp.apply(model, 0.5, pattern="uniform", features=[noise])  # the model is free: apply works again
    ctl.set_rates([0.1, 0.2, 0.3, 0.4])
    state, attached = ctl.state_dict(), _hooks(model)
    chunked = dropbp.ChunkedLoss(8)
    with pytest.raises(RuntimeError, match="cannot attach"):
        ctl.replace_options(drop_rate=0.25, features=[chunked, _FailingFeature()])
    assert ctl.state_dict() == state and ctl.rates == [0.1, 0.2, 0.3, 0.4] and ctl.options.drop_rate == 0.5
    assert list(ctl.features) == ["noise_scale"] and noise.attached and not chunked.attached
    assert _hooks(model) == attached
    ctl.remove()
    assert _hooks(model) == before


def test_auto_keeps_its_measured_noise_scale_when_the_features_change():
    """Class B: under ``drop_rate="auto"`` a ``features=`` that leaves the noise scale out keeps the one measuring
    (a fresh one would start the rate in force from 0 again)."""
    model = tiny_model("llama", layers=2)
    ctl = dropbp.apply(model, "auto")
    noise = ctl.features["noise_scale"]
    ctl.replace_options(features=[dropbp.ChunkedLoss(8)])
    assert ctl.features["noise_scale"] is noise and "chunked_loss" in ctl.features
    fresh = dropbp.NoiseScale()  # given explicitly: that one
    ctl.replace_options(features=[fresh])
    assert ctl.features["noise_scale"] is fresh and not noise.attached


@pytest.mark.parametrize("name", sorted(MOVED_MEMBERS))
def test_a_controller_member_of_0_2_names_the_way_now_when_read_or_set(name):
    """Issue 71, class E: 0.2's controller reads (``ctl.noise_scale()``, ``ctl.drop_rate_at``, ...) and writes say where
    the member went, not a bare AttributeError."""
    ctl = dropbp.apply(tiny_model("llama", layers=2), 0.5)
    way = re.escape(MOVED_MEMBERS[name])
    with pytest.raises(AttributeError, match=rf"no attribute '{name}' \(dropbp 0.3\): {way}"):
        getattr(ctl, name)
    with pytest.raises(AttributeError, match=rf"no setting '{name}' \(dropbp 0.3\): {way}"):
        setattr(ctl, name, 1)
    with pytest.raises(AttributeError, match=r"no attribute 'nothing_like_this'$"):
        ctl.nothing_like_this  # noqa: B018 - what is read is the point


def test_calibrate_with_0_2_s_method_says_the_way_now():
    ctl = dropbp.apply(tiny_model("llama", layers=2), 0.5, pattern="uniform")
    with pytest.raises(TypeError, match=r"no longer takes method \(dropbp 0.3\): .*experimental.exact_recompute"):
        ctl.calibrate(lambda: None, method="exact-recompute")
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['min_rte'\]"):
        ctl.calibrate(lambda: None, min_rte=0.1)


@pytest.mark.parametrize("features", [dropbp.NoiseScale(), [dropbp.NoiseScale(), "chunked"], dropbp.NoiseScale])
def test_features_not_a_list_of_features_is_refused_naming_features(features):
    """Issue 71, class F: a feature given bare, or beside a non-feature, is refused naming ``features`` (the refusal's
    own message read the feature's repr, which raised before it was attached)."""
    with pytest.raises(TypeError, match=r"features must be a list of dropbp features"):
        dropbp.apply(tiny_model("llama", layers=2), 0.5, features=features)
    assert repr(dropbp.NoiseScale()) == "NoiseScale(estimate=None)"
