"""The package's shape: settings that cannot desync, read-only branch views, no import cycles, light import."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_model

import dropbp
from dropbp.controller import DropBPController
from dropbp.options import DropBPOptions
from dropbp.policy.drop_policy import DropPolicy

PACKAGE = Path(dropbp.__file__).parent


def patterns(ctl, steps=40):
    return [ctl.dropped_at(s) for s in range(steps)]


@pytest.mark.parametrize(
    "setting, value",
    [("seed", 7), ("max_patterns", 3), ("drop_rate", 0.25), ("warmup_steps", 10), ("max_patterns", None)],
)
def test_a_setting_changes_every_later_pattern_as_if_applied_with_it(setting, value):
    """Setting after apply gives exactly the patterns of a controller applied with that setting,
    warm-up steps included (the old controller rebuilt only some of its samplers)."""
    base = {"seed": 1, "warmup_steps": 6, "max_patterns": 5}
    ctl = dropbp.apply(tiny_model("llama", layers=4), 0.5, **base, pattern="uniform")
    patterns(ctl)  # samplers are built and cached before the change
    setattr(ctl, setting, value)
    fresh_args = {**base, setting: value}
    fresh = dropbp.apply(
        tiny_model("llama", layers=4), fresh_args.pop("drop_rate", 0.5), **fresh_args, pattern="uniform"
    )
    assert getattr(ctl, setting) == value
    assert patterns(ctl) == patterns(fresh)


@pytest.mark.parametrize(
    "setting, value, error, match",
    [
        ("seed", -1, ValueError, "seed must be an int >= 0"),
        ("seed", "7", TypeError, "seed must be an int"),
        ("max_patterns", 0, ValueError, "max_patterns must be an int >= 1"),
        ("drop_rate", 1.0, ValueError, r"drop_rate must be in \[0, 1\)"),
        ("drop_rate", 0.9, ValueError, "would drop every branch"),
        ("warmup_steps", -2, ValueError, "warmup_steps must be an int >= 0"),
        ("unbiased", True, AttributeError, r"no setting 'unbiased' \(dropbp 0.4\): .*ImportanceWeights\(\)"),
        ("token_drop_rate", 0.5, AttributeError, r"no setting 'token_drop_rate' \(dropbp 0.3\): .* pass features="),
        ("replace_option", 1, AttributeError, r"no setting 'replace_option'$"),
    ],
)
def test_a_bad_setting_raises_and_changes_nothing(setting, value, error, match):
    ctl = dropbp.apply(tiny_model("llama", layers=2), 0.5, seed=3, pattern="uniform")
    ctl.set_rates([0.1, 0.2, 0.3, 0.4])
    before = (ctl.state_dict(), patterns(ctl))
    with pytest.raises(error, match=match):
        setattr(ctl, setting, value)
    assert (ctl.state_dict(), patterns(ctl)) == before


def test_drop_rate_setting_makes_every_rate_uniform():
    ctl = dropbp.apply(tiny_model("llama", layers=2), 0.5, pattern="uniform")
    ctl.set_rates([0.1, 0.2, 0.3, 0.4])
    ctl.drop_rate = 0.25
    assert ctl.rates == [0.25] * 4 and ctl.drop_rate == 0.25


def test_branches_are_read_only_views():
    ctl = dropbp.apply(tiny_model("llama", layers=2), 0.5, pattern="uniform")
    branch = ctl.branches[0]
    with pytest.raises(AttributeError, match=r"read-only.*ctl.set_rates"):
        branch.rate = 0.1
    ctl.set_rates([0.1, 0.2, 0.3, 0.4])
    assert branch.rate == 0.5 and ctl.branches[0].rate == 0.1  # a view of when it was taken


def test_a_bad_state_loads_nothing():
    ctl = dropbp.apply(tiny_model("llama", layers=2), 0.5, seed=3, pattern="uniform")
    state = ctl.state_dict()
    before = (ctl.state_dict(), patterns(ctl))
    with pytest.raises(ValueError, match=r"rates\[1\] must be in"):
        ctl.load_state_dict({**state, "seed": 99, "rates": [0.1, 1.5, 0.1, 0.1]})
    assert (ctl.state_dict(), patterns(ctl)) == before


def test_a_controller_built_directly_validates_its_parts():
    model = tiny_model("llama", layers=2)
    with pytest.raises(ValueError, match="drop_rate must be in"):
        DropPolicy([1.0] * 4, DropBPOptions(1.5, pattern="uniform"))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        DropBPController("model", 0.5)
    with pytest.raises(TypeError, match="drop_rate must be a number in \\[0, 1\\), got dict"):
        DropBPController(model, {"drop_rate": 0.5})
    with pytest.raises(TypeError, match=r"no longer takes stratify .*StratifiedCuts"):
        DropBPController(model, 0.5, stratify=4)
    ctl = DropBPController(model, 0.5, pattern="uniform")  # what dropbp.apply does: apply's arguments
    assert ctl.backend.name == "cpu" and len(ctl.branches) == 4
    assert list(inspect.signature(DropBPController).parameters) == list(inspect.signature(dropbp.apply).parameters)


def _imports(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports, type-only imports included."""
    inside = path.relative_to(PACKAGE) if path.is_relative_to(PACKAGE) else Path("backends", path.name)
    module = "dropbp." + ".".join(inside.with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            found.update(n if n.replace(".", "/") in _MODULES else target for n in names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("dropbp.") and m.replace(".", "/") in _MODULES}


_MODULES = {
    "dropbp/" + "/".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix("/__init__"): p
    for p in PACKAGE.rglob("*.py")
}
_MODULES = {k.rstrip("/"): v for k, v in _MODULES.items()}
_MODULES |= {f"dropbp/backends/{p.stem}".removesuffix("/__init__"): p for p in PACKAGE.parent.glob("backends/*.py")}


def test_no_import_cycle_inside_the_package():
    graph = {name.replace("/", "."): _imports(path) for name, path in _MODULES.items()}
    graph = {k: {d for d in deps if d != k and not k.startswith(d + ".")} for k, deps in graph.items()}
    visiting, done = set(), set()

    def visit(node, trail):
        if node in done:
            return
        assert node not in visiting, "import cycle: " + " -> ".join([*trail, node])
        visiting.add(node)
        for dep in sorted(graph.get(node, ())):
            visit(dep, [*trail, node])
        visiting.discard(node)
        done.add(node)

    for node in sorted(graph):
        visit(node, [])


def test_every_module_says_what_it_owns():
    missing = [name for name, path in _MODULES.items() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert not missing


def _optional_imported(code: str) -> list[str]:
    probe = f"{code}; import sys; print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(_OPTIONAL)!r})))"
    return eval(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)


_OPTIONAL = {"matplotlib", "tqdm", "gguf", "peft", "transformers"}


def test_importing_dropbp_imports_no_optional_package():
    """Nothing beyond what ``import torch`` itself brings: torch.hub imports tqdm whenever it is
    installed (and transformers requires it), which no code of dropbp can prevent."""
    assert _optional_imported("import dropbp") == _optional_imported("import torch")
    assert set(_optional_imported("import torch")) <= {"tqdm"}


def test_a_missing_optional_package_is_one_error_with_the_install_line(monkeypatch):
    from dropbp import imports

    imports.is_available.cache_clear()
    real = imports.importlib.util.find_spec
    monkeypatch.setattr(imports.importlib.util, "find_spec", lambda name: None if name == "matplotlib" else real(name))
    try:
        with pytest.raises(imports.MissingDependency, match=r"plotting needs matplotlib.*pip install 'dropbp\[demo\]'"):
            imports.require("matplotlib.pyplot", "plotting")
        assert imports.require("torch", "x").__name__ == "torch"
    finally:
        imports.is_available.cache_clear()


def test_the_cli_reports_a_missing_package_in_one_line(monkeypatch, capsys, tmp_path):
    from dropbp import imports
    from dropbp.tools import cli

    def missing(*args, **kwargs):
        raise imports.MissingDependency("dropbp bench needs tqdm, which is not installed: pip install 'dropbp[demo]'")

    monkeypatch.setattr(cli, "require", missing)
    assert cli.main(["bench", "--out", str(tmp_path / "b"), "--backend", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'dropbp[demo]'" in err


def test_device_questions_are_asked_of_the_backend():
    from contextlib import nullcontext

    import torch

    from dropbp import backends
    from dropbp.tools.device_tools import tools_for

    cpu = backends.get("cpu")
    tools = tools_for(cpu)
    assert tools.training_dtype == torch.float32 and isinstance(tools.training_autocast(), nullcontext)
    assert cpu.has_allocator_stats is False
    for name in ("cuda", "hpu", "xpu"):
        assert backends.BUILTIN[name].has_allocator_stats is True


def test_no_device_type_test_outside_backends():
    """Device questions (allocator, cache, dtype, autocast) are asked of the backend, never by device type."""
    patterns = ("device.type ==", "device.type !=", "device.type)")
    offenders = [str(p) for p in PACKAGE.rglob("*.py") if any(t in p.read_text() for t in patterns)]
    assert not offenders


def test_the_architecture_tables_are_one_module_read_by_discovery_and_options():
    """Which modules are branches is data in ``dropbp/architectures.py``; only discovery applies it (and options
    name BERT's branches in their help); the execution defines no table of its own."""
    faces = ("dropbp", "dropbp/__init__")
    readers = sorted(n for n, p in _MODULES.items() if "dropbp.architectures" in _imports(p) and n not in faces)
    assert readers == ["dropbp/execution/discovery", "dropbp/experimental/token_rows", "dropbp/options"]
    tables = ("SUPPORTED_ARCHITECTURES", "POST_NORMS", "ROW_LOCAL_ATTENTION_PROJECTIONS", "EXPERTS", "MLP_NAMES")
    defined = {n for n, p in _MODULES.items() for t in tables if re.search(rf"^{t}\b.*=", p.read_text(), re.M)}
    assert defined == {"dropbp/architectures"}


def test_execution_holds_the_dropped_backward_only():
    """Calibration, the chunked loss, the measurement tools' device questions and the forecast's data live outside
    the execution and outside the backends' contract."""
    execution = {p.stem for p in (PACKAGE / "execution").glob("*.py")}
    assert not execution & {"sensitivity", "calibration", "chunked_loss", "graphs", "discovery_tables"}
    from dropbp.backends.base import Backend

    tools_only = {"timer", "environment", "training_dtype", "training_autocast", "graph_compilations"}
    assert not tools_only & set(dir(Backend))
    assert not list(PACKAGE.joinpath("policy").glob("*.json"))


def test_each_device_file_overrides_an_execution_member_or_says_why_not():
    from dropbp.backends.base import Backend, LazyGraphBackend

    from dropbp import backends

    execution = {"checkpoint", "rng_state", "set_rng_state", "collective_device", "graph_break",
                 "mark_step", "prepare", "default_max_patterns"}  # fmt: skip
    for name, cls in backends.BUILTIN.items():
        own = execution & set(vars(cls)) or execution & set(vars(cls).get("__init__", lambda: 0).__code__.co_names)
        said = (cls.__doc__ or "").strip()
        assert own or said.startswith("The execution's defaults hold"), name
    assert all(issubclass(backends.BUILTIN[n], LazyGraphBackend) for n in ("hpu", "lazy"))
    assert not issubclass(backends.BUILTIN["lazy"], backends.BUILTIN["hpu"]) and LazyGraphBackend.__base__ is Backend


def test_the_core_never_imports_the_tools():
    core = {n: p for n, p in _MODULES.items() if not n.startswith("dropbp/tools") and n != "dropbp/__main__"}
    assert not [name for name, path in core.items() if any(d.startswith("dropbp.tools") for d in _imports(path))]


def test_forward_patches_restore_exactly():
    """One helper patches ``forward`` on an instance (chunked loss, recompute); removal puts back what was there."""
    from torch import nn

    from dropbp.execution.patching import ForwardPatch, map_output

    layer, other = nn.Identity(), nn.Identity()
    own = layer.forward = lambda x: "own"  # an earlier instance patch (another library's)
    with ForwardPatch(layer, lambda x: "outer") as outer:
        inner = ForwardPatch(layer, lambda x: "inner").install()
        assert layer(1) == "inner" and other(1) == 1 and outer.original() is own
        inner.remove()
        inner.remove()  # twice: nothing more happens
        assert layer(1) == "outer"
    assert vars(layer)["forward"] is own
    del layer.forward
    with ForwardPatch(layer, lambda x: "patched") as patch:
        assert patch.original()(2) == 2
    assert "forward" not in vars(layer) and layer(3) == 3
    assert map_output((1, "a", 2), lambda v: v * 2) == (2, "aa", 4) and map_output(5, lambda v: -v) == -5


def test_an_option_is_declared_once_and_reaches_apply_attach_the_callback_and_axolotl():
    """``dropbp/options.py`` is the one place an option is written: ``apply``'s signature and ``help()``, the
    Trainer integration's and axolotl's keys all follow from its fields."""
    import dataclasses
    import inspect
    import pydoc

    from dropbp.options import DropBPOptions, TrainerOptions, option_fields

    names = [f.name for f in option_fields(DropBPOptions)]
    assert list(inspect.signature(dropbp.apply).parameters) == ["model", *names]
    text = pydoc.render_doc(dropbp.apply)
    assert all(f"{name}: " in text for name in names)
    run = [f.name for f in option_fields(TrainerOptions)]
    assert run == [n for n in names if n not in ("warmup_steps", "total_steps")] + ["warmup", "calibrate_at"]
    assert len(names) == len(dataclasses.fields(DropBPOptions)) <= 10  # apply's options, and nothing else
    with pytest.raises(dataclasses.FrozenInstanceError):
        DropBPOptions(0.5).seed = 3
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        DropBPOptions(0.5, seed=-1)
    pytest.importorskip("transformers")
    from dropbp.integrations.hf import DropBPCallback, attach, build_callback

    assert list(inspect.signature(attach).parameters) == ["trainer", *run]
    assert list(inspect.signature(build_callback).parameters) == ["trainer", *run]
    assert list(inspect.signature(DropBPCallback).parameters) == run
    pytest.importorskip("pydantic")
    from dropbp.features.base import feature_classes
    from dropbp.integrations.axolotl import DropBPArgs

    keys = [f"dropbp_{n}" for n in run if n != "features"] + [f"dropbp_{key}" for key in feature_classes()]
    assert list(DropBPArgs.model_fields) == keys


#: The layers, bottom first: a module imports from its own layer or those below, never above (function-level
#: imports included). ``dropbp/__init__.py`` and ``__main__.py`` are the package's faces, where the layers meet.
LAYERS = {
    "support": (
        "dropbp.checks",
        "dropbp.files",
        "dropbp.imports",
        "dropbp.internals",
        "dropbp.backends",
        "dropbp.architectures",
    ),
    "policy": ("dropbp.policy",),
    "execution": ("dropbp.execution",),
    "features": ("dropbp.features",),
    "api": (
        "dropbp.options",
        "dropbp.state",
        "dropbp.run_schedule",
        "dropbp.controller",
        "dropbp.api",
        "dropbp.calibration",
        "dropbp.research",
        "dropbp.layer",
        "dropbp.handler",
    ),
    "experimental": ("dropbp.experimental",),
    "integrations": ("dropbp.integrations",),
    "tools": ("dropbp.tools",),
}


def _layer(module: str) -> int:
    found = [i for i, within in enumerate(LAYERS.values()) for p in within if module == p or module.startswith(p + ".")]
    assert len(found) == 1, f"{module} is in no layer (or in several): add it to LAYERS"
    return found[0]


def _backend_modules() -> dict[str, Path]:
    folder = PACKAGE.parent / "backends"
    return {f"dropbp.backends.{p.stem}".removesuffix(".__init__"): p for p in folder.glob("*.py")}


def test_the_core_imports_nothing_above_it():
    """Every module sits in one layer of :data:`LAYERS` and imports nothing from a layer above it: the policy knows
    neither the execution nor a device, the execution no controller, nothing below the tools imports a tool."""
    faces = ("dropbp/__init__", "dropbp/__main__", "dropbp")
    modules = {n.replace("/", "."): p for n, p in _MODULES.items() if n not in faces and not n.endswith("/__init__")}
    modules |= {n.replace("/", "."): p for n, p in _MODULES.items() if p.name == "__init__.py" and n not in faces}
    modules |= _backend_modules()
    offenders = {
        name: sorted(d for d in _imports(path) if d != "dropbp" and _layer(d) > _layer(name))
        for name, path in modules.items()
    }
    assert len(modules) > 40 and not {n: d for n, d in offenders.items() if d}


def test_the_policy_touches_no_module_and_no_device():
    """The drop policy is arithmetic on numbers: no hooks on modules, no device, no autograd."""
    words = ("register_forward", "register_full_backward", "register_hook", ".device", "torch.autograd", "no_grad")
    found = {
        str(p.relative_to(PACKAGE)): [w for w in words if w in p.read_text()]
        for p in (PACKAGE / "policy").glob("*.py")
    }
    assert not {n: w for n, w in found.items() if w}


def test_importing_dropbp_imports_no_integration_nor_tool():
    """``dropbp.attach`` and ``dropbp.DropBPCallback`` (the names the messages give) import the Trainer integration
    on first use only."""
    pytest.importorskip("transformers")
    from dropbp.integrations import hf

    assert dropbp.attach is hf.attach and dropbp.DropBPCallback is hf.DropBPCallback
    with pytest.raises(AttributeError, match="module 'dropbp' has no attribute 'atach'"):
        dropbp.atach  # noqa: B018
    above = ("dropbp.integrations", "dropbp.tools")
    probe = f"import dropbp, sys; print(sorted(m for m in sys.modules if m.startswith({above!r})))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_each_device_is_one_file_of_the_backends_and_the_core_tests_no_device():
    """One registry (``dropbp.backends.BUILTIN``), one file per device; outside ``backends/`` no module compares a
    device type or imports a device's torch module."""
    from dropbp import backends

    files = {p.stem for p in (PACKAGE.parent / "backends").glob("*.py")} - {"__init__", "base"}
    assert files == set(backends.BUILTIN)
    assert all(cls.__module__ == f"dropbp.backends.{name}" for name, cls in backends.BUILTIN.items())
    device_test = re.compile(r"device\.type\s*(==|!=|in\b|not in\b)|\.type\s*==\s*[\"'](cpu|cuda|hpu|xpu|lazy)[\"']")
    device_import = re.compile(r"^\s*(import|from)\s+torch\.(cuda|hpu|xpu|mps)\b|habana_frameworks|intel_ext", re.M)
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if device_test.search(p.read_text()) or device_import.search(p.read_text())
    ]
    assert not offenders


def test_only_the_deepspeed_module_asks_whether_deepspeed_was_imported():
    import re

    probe = re.compile(r"""["']deepspeed["']\s+(not\s+)?in\s+sys\.modules|sys\.modules(\.get\(|\[)\s*["']deepspeed""")
    found = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if probe.search(p.read_text())}
    assert found == {"integrations/deepspeed.py"}


#: Private names of other libraries that tests read, and why (the package reads them only in dropbp.internals).
_FOREIGN_PRIVATES = {
    "_C": "torch's C bindings: the autograd state that recomputation reads",
    "_autograd": "torch._C._autograd: the saved-tensor hooks in force",
    "_top_saved_tensors_default_hooks": "torch: the saved-tensor hooks in force",
    "_current_autograd_node": "torch: the node a backward runs now",
    "_current_graph_task_id": "torch: which backward runs now",
    "_execution_engine": "torch: a callback at the end of the running backward (a stand-in test)",
    "_prepare_inputs": "transformers.Trainer: the batch as the trainer feeds it",
    "_attn_implementation": "transformers: the attention a model was loaded with",
    "_active_ddp_module": "torch DDP: the wrapper whose forward runs now",
    "_register_device_module": "torch: the lazy engine's stand-in device module (dropbp.backends.lazy)",
    "_is_compiled": "torch.xpu._is_compiled, which a test stands in for on a machine without XPU",
    "_hp_mapping": "DeepSpeed ZeRO 1-2's mark on the parameters it holds",
    "_z3_optimizer": "DeepSpeed ZeRO-3's mark on the parameters it holds",
    "_zero_optimizer": "DeepSpeed ZeRO 1-2's optimizer on its parameters",
    "_forward_pre_hooks": "torch.nn.Module: tests check that remove() leaves no hook behind",
    "_forward_hooks": "torch.nn.Module: tests check that remove() leaves no hook behind",
    "_backward_hooks": "torch: hooks on a module or on a tensor's backward",
    "_backward_pre_hooks": "torch.nn.Module: tests check that remove() leaves no hook behind",
    "_dynamo": "torch._dynamo: tests reset compiled graphs between cases",
    "_lazy": "torch._lazy: PyTorch's lazy-tensor engine, the HPU backend's lazy mode on the CPU",
    "_local_scalar_dense": "torch.ops.aten: the op a host sync runs, counted by the HPU stand-in test",
    "_weight_prepack": "intel_extension_for_pytorch: where its prepacked linear layer lives (test_ipex)",
    "_IPEXLinear": "intel_extension_for_pytorch: its prepacked linear layer (test_ipex)",
    "_convert_weight_packed_for_cpu": "bitsandbytes: whether its CPU 4-bit path packs weights (test_qlora)",
    "_version": "torch: a tensor's version counter (the noise scale's reads see zero_grad's in-place zeros)",
}
#: Private names of the standard library the package may read anywhere: documented there, stable.
_STDLIB_PRIVATES = {
    "_exit": "os: the memory probe's child process and the tests' spawned ranks end without interpreter teardown",
}
#: The one module of the package that reads other libraries' private names.
_INTERNALS = PACKAGE / "internals.py"
#: Never read from outside, whatever a file defines: the controller's parts and the attached-model registry.
_CONTROLLER_PRIVATES = {"_hooks", "_policy", "_model", "_ATTACHED", "_undo", "_fill", "_tally"}


def _named_reads(tree: ast.AST) -> list[tuple[int, str, str | None, str]]:
    """``(line, name, base, text)`` for ``x._name`` and for ``getattr`` / ``hasattr`` / ``setattr`` with a
    constant string name (``base``: the name ``x`` when it is a plain name)."""
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value.id if isinstance(node.value, ast.Name) else None
            reads.append((node.lineno, node.attr, base, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            base = node.args[0].id if isinstance(node.args[0], ast.Name) else None
            reads.append((node.lineno, node.args[1].value, base, ast.unparse(node)))
    return reads


def _private_reads(path: Path, allowed: set[str]) -> list[str]:
    """``x._name`` (or ``getattr(x, "_name")``) in ``path`` where ``x`` is not ``self``/``cls``, ``_name`` no
    dunder, not a method or instance attribute of a class of this file (``other._state`` inside the class that
    defines it), nor in ``allowed``."""
    tree = ast.parse(path.read_text())
    own = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")
    }
    own |= {d.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for d in c.body if hasattr(d, "name")}
    found = []
    for line, name, base, text in _named_reads(tree):
        if not name.startswith("_") or name.startswith("__"):
            continue
        if base in ("self", "cls") or name in allowed:
            continue
        if name in own and name not in _CONTROLLER_PRIVATES and base not in ("ctl", "controller"):
            continue
        found.append(f"{path.name}:{line}: {text}")
    return found


def _package_files() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "backends").glob("*.py")])


def test_no_private_attribute_is_read_across_modules():
    """Tests and modules use the controller's public accessors (``ctl.model``, ``ctl.forcing``, ``ctl.forced``,
    ``ctl.at_remove``, ``controller_of``), not its parts; the package reads other libraries' private names only
    in :mod:`dropbp.internals`, ``getattr`` strings included."""
    tests = sorted(Path(__file__).parent.glob("*.py"))
    hits = [hit for path in tests for hit in _private_reads(path, set(_FOREIGN_PRIVATES) | set(_STDLIB_PRIVATES))]
    for path in _package_files():
        allowed = set(_STDLIB_PRIVATES) | (set(_FOREIGN_PRIVATES) if path == _INTERNALS else set())
        hits += _private_reads(path, allowed)
    assert not hits


def test_no_module_imports_a_private_name_of_another():
    """``from .x import _name`` would tie a module to another's internals; ``import x as _x`` is a local name."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {alias.name}"
        for path in _package_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module != "__future__"
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not found


def test_the_private_read_check_sees_getattr_strings(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nx = getattr(torch.nn.Module, '_active_ddp_module', None)\ny = torch._C\n")
    assert _private_reads(probe, set()) == [
        "probe.py:2: getattr(torch.nn.Module, '_active_ddp_module', None)",
        "probe.py:3: torch._C",
    ]


_FRAME_FUNCTIONS = {("sys", "_getframe"), ("inspect", "currentframe"), ("inspect", "stack"), ("inspect", "trace")}
_FRAME_FUNCTIONS |= {("inspect", "getouterframes"), ("inspect", "getinnerframes"), ("traceback", "extract_stack")}
_FRAME_ATTRIBUTES = {"f_back", "f_locals", "f_globals", "tb_frame", "gi_frame", "cr_frame"}


def test_no_frame_is_inspected_anywhere_in_the_package():
    """``sys._getframe``, ``inspect.currentframe`` / ``stack`` and frame attributes appear nowhere in the package,
    :mod:`dropbp.internals` included."""
    found = []
    for path in _package_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if (base, node.attr) in _FRAME_FUNCTIONS or node.attr in _FRAME_ATTRIBUTES:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not found


def test_the_controller_answers_what_other_modules_asked_its_parts():
    from conftest import batch

    from dropbp.controller import controller_of

    model = tiny_model("llama", layers=2).train()
    ctl = dropbp.apply(model, 0.5, pattern="uniform")
    assert ctl.model is model and controller_of(model) is ctl and controller_of(model.model.layers[1].mlp) is ctl
    seen = []
    model.register_forward_hook(lambda module, args, output: seen.append((ctl.forced, ctl.step)))
    with ctl.forcing({1}):
        model(input_ids=batch(0))
    model(input_ids=batch(0))
    assert seen == [((ctl.branches[1].name,), 0), (None, 1)]
    with pytest.raises(ValueError, match=r"pattern must hold branch indices in \[0, 4\), got \[4\]"), ctl.forcing({4}):
        pass
    undone = []
    ctl.at_remove(lambda: undone.append("first"))
    ctl.at_remove(lambda: undone.append("second"))
    assert not hasattr(ctl, "on_remove")  # the pre-release name is gone (StepListener.on_remove is another thing)
    ctl.remove()
    assert undone == ["second", "first"] and controller_of(model) is None
    with pytest.raises(RuntimeError, match="was removed"), ctl.forcing(()):
        pass
