"""Backends: resolution, plugins, error messages, IPEX handling, controller helpers, the example script.

This machine has only a CPU. The Gaudi backend is exercised against a stand-in of its API in
``test_hpu_standin.py``; the CUDA tests below skip, with the reason, when no GPU is present.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from conftest import batch, tiny_model

import dropbp
from dropbp import backends
from dropbp.tools import device_tools
from dropbp.tools.device_tools import EventTimer, HostTimer, tools_for

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "finetune.py"
NO_GPU = "no CUDA GPU on this machine (torch.cuda.is_available() is False)"
cpu_module = backends.cpu


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
    monkeypatch.delenv("DROPBP_BACKEND", raising=False)


def _one_line_error(exc_info: pytest.ExceptionInfo) -> str:
    """The message, after checking it is one line with no chained traceback behind it."""
    message = str(exc_info.value)
    assert "\n" not in message
    assert exc_info.value.__cause__ is None and exc_info.value.__suppress_context__
    return message


class Recording(backends.cpu.CPUBackend):
    """The CPU backend, noting its step boundaries."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def after_backward(self) -> None:
        self.log.append("after_backward")

    def after_optimizer_step(self) -> None:
        self.log.append("after_optimizer_step")


# -- resolution ---------------------------------------------------------------------------------------
def test_cpu_backend_facts():
    cpu = backends.get("cpu")
    assert cpu.device == torch.device("cpu")
    assert cpu.autocast_dtype == torch.bfloat16
    assert cpu.distributed_backend == "gloo" and cpu.default_max_patterns is None
    assert cpu.max_memory_allocated() == 0 and tools_for(cpu).graph_compilations() is None
    with cpu.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")


def test_registry_names_every_device():
    assert backends.available() == ["cpu", "cuda", "hpu", "lazy", "xpu"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: auto-detection finds it, not the CPU")
def test_environment_variable_and_auto(monkeypatch):
    monkeypatch.setenv("DROPBP_BACKEND", "CPU")
    assert backends.get().name == "cpu"
    monkeypatch.setenv("DROPBP_BACKEND", " auto ")
    assert backends.get().name == "cpu"
    monkeypatch.setenv("DROPBP_BACKEND", "")
    assert backends.get().name == "cpu"
    monkeypatch.delenv("DROPBP_BACKEND")
    assert backends.get().name == "cpu"


def test_an_explicit_name_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("DROPBP_BACKEND", "hpu")
    assert backends.get("cpu").name == "cpu"
    with pytest.raises(backends.BackendUnavailable, match="'hpu' \\(from DROPBP_BACKEND\\)"):
        backends.get()


@pytest.mark.parametrize(
    ("present", "expected"),
    [
        ({"hpu", "cuda", "xpu"}, "hpu"),
        ({"cuda", "xpu"}, "cuda"),
        ({"xpu"}, "xpu"),
        (set(), "cpu"),
    ],
)
def test_auto_detection_order(monkeypatch, present, expected):
    for name in ("hpu", "cuda", "xpu"):
        cls = backends.BUILTIN[name]
        reason = None if name in present else f"{name} absent in this test"
        monkeypatch.setattr(cls, "unavailable_reason", classmethod(lambda c, r=reason: r))
        monkeypatch.setattr(cls, "__init__", lambda self: None)
    assert backends.get().name == expected
    assert backends.get("auto").name == expected


def test_device_libraries_are_not_imported_with_the_package():
    code = (
        "import sys, dropbp, dropbp.backends\n"
        "stacks = [m for m in sys.modules if m.split('.')[0] in "
        "('habana_frameworks', 'intel_extension_for_pytorch')]\n"
        "assert not stacks, stacks\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


# -- error messages -----------------------------------------------------------------------------------
def test_unknown_name_lists_valid_ones(monkeypatch):
    with pytest.raises(ValueError) as info:  # UnknownBackend is a ValueError and a BackendUnavailable
        backends.get("tpu")
    message = _one_line_error(info)
    assert isinstance(info.value, backends.BackendUnavailable)
    assert message.startswith("unknown dropbp backend 'tpu'; valid names: cpu, cuda, hpu, lazy, xpu, auto ")
    assert "entry-point group 'dropbp.backends'" in message
    monkeypatch.setenv("DROPBP_BACKEND", "nope")
    with pytest.raises(backends.UnknownBackend) as info:
        backends.get()
    assert _one_line_error(info).startswith("unknown dropbp backend 'nope' (from DROPBP_BACKEND); valid names:")


def test_a_name_must_be_a_string():
    with pytest.raises(TypeError, match="backend name must be a str or None, got int"):
        backends.get(3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the CUDA backend is available")
def test_cuda_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with pytest.raises(backends.BackendUnavailable) as info:
        backends.get("cuda")
    assert _one_line_error(info) == (
        f"dropbp backend 'cuda' is unavailable: this PyTorch ({torch.__version__}) was built without "
        "CUDA; install a CUDA build of PyTorch (https://pytorch.org/get-started/locally/)"
    )
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    with pytest.raises(backends.BackendUnavailable) as info:
        backends.get("cuda")
    message = _one_line_error(info)
    assert "has CUDA support but sees no GPU (torch.cuda.is_available() is False)" in message
    assert "nvidia-smi" in message and "CUDA_VISIBLE_DEVICES" in message


@pytest.mark.skipif(importlib.util.find_spec("habana_frameworks") is not None, reason="a Gaudi stack is installed here")
def test_hpu_missing_says_how_to_install():
    with pytest.raises(backends.BackendUnavailable) as info:
        backends.get("hpu")
    assert _one_line_error(info) == (
        "dropbp backend 'hpu' is unavailable: the Intel Gaudi PyTorch bridge (habana_frameworks.torch) "
        "cannot be imported (ModuleNotFoundError: No module named 'habana_frameworks'); install Intel "
        "Gaudi software with Intel's installer or use the Gaudi PyTorch container "
        "(https://docs.habana.ai/en/latest/Installation_Guide/); it is not on PyPI"
    )


def test_xpu_missing_says_how_to_install(monkeypatch):
    install = "pip install torch --index-url https://download.pytorch.org/whl/xpu"
    fake = SimpleNamespace(_is_compiled=lambda: False, is_available=lambda: False)
    monkeypatch.setattr(torch, "xpu", fake)
    with pytest.raises(backends.BackendUnavailable) as info:
        backends.get("xpu")
    message = _one_line_error(info)
    assert message.startswith(f"dropbp backend 'xpu' is unavailable: this PyTorch ({torch.__version__}) was")
    assert "built without XPU support" in message and install in message
    fake._is_compiled = lambda: True
    with pytest.raises(backends.BackendUnavailable) as info:
        backends.get("xpu")
    assert "has XPU support but sees no Intel GPU (torch.xpu.is_available() is False)" in _one_line_error(info)
    monkeypatch.delattr(torch, "xpu")
    with pytest.raises(backends.BackendUnavailable) as info:
        backends.get("xpu")
    assert "has no torch.xpu" in _one_line_error(info)


def test_errors_raised_while_handling_another_carry_no_traceback_chain():
    try:
        raise KeyError("unrelated")
    except KeyError:
        with pytest.raises(backends.BackendUnavailable) as info:
            backends.get("hpu")
    _one_line_error(info)


# -- plugins (entry-point group dropbp.backends) ------------------------------------------------------
@pytest.fixture
def plugin_dist(tmp_path, monkeypatch):
    """A real (fake) installed distribution on sys.path declaring four dropbp.backends entry points."""
    (tmp_path / "fake_dropbp_npu.py").write_text(
        textwrap.dedent(
            """
            import torch
            from dropbp.backends import Backend

            class NPUBackend(Backend):
                name = "npu"
                default_max_patterns = 8

                @classmethod
                def unavailable_reason(cls):
                    return None

                @property
                def device(self):
                    return torch.device("cpu")

                @property
                def autocast_dtype(self):
                    return torch.float16

            class NotABackend:
                pass
            """
        )
    )
    info = tmp_path / "fake_dropbp_npu-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-dropbp-npu\nVersion: 1.2\n")
    (info / "entry_points.txt").write_text(
        "[dropbp.backends]\n"
        "npu = fake_dropbp_npu:NPUBackend\n"
        "cpu = fake_dropbp_npu:NPUBackend\n"
        "broken = fake_dropbp_missing:Backend\n"
        "odd = fake_dropbp_npu:NotABackend\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("fake_dropbp_npu", None)


def test_entry_point_backends_register_by_name(plugin_dist, monkeypatch):
    assert backends.available() == ["broken", "cpu", "cuda", "hpu", "lazy", "npu", "odd", "xpu"]
    npu = backends.get("npu")
    assert type(npu).__name__ == "NPUBackend" and npu.autocast_dtype == torch.float16
    monkeypatch.setenv("DROPBP_BACKEND", "NPU")
    assert backends.get().name == "npu"
    ctl = dropbp.apply(tiny_model("llama"), 0.5)
    assert ctl.backend.name == "npu" and ctl.max_patterns == 8  # the plugin's default bound


def test_the_tools_questions_are_answered_apart_from_the_backend(monkeypatch):

    class NPUBackend(backends.cpu.CPUBackend):
        name = "npu"

    assert tools_for(NPUBackend()).graph_compilations() is None  # its base's answer until it registers its own

    class CountingTools(device_tools.CPUTools):
        def graph_compilations(self):
            return 7

    device_tools.register(NPUBackend, CountingTools)  # a class of this test's own: nothing to undo
    assert tools_for(NPUBackend()).graph_compilations() == 7 and tools_for(NPUBackend()).training_dtype == torch.float32
    execution_members = set(vars(backends.base.Backend))
    assert not execution_members & {"timer", "environment", "training_dtype", "training_autocast", "graph_compilations"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: auto-detection finds it, not the CPU")
def test_plugins_never_replace_built_ins_nor_join_auto_detection(plugin_dist):
    assert type(backends.get("cpu")) is backends.cpu.CPUBackend
    assert type(backends.get()) is backends.cpu.CPUBackend


def test_broken_plugins_fail_in_one_line(plugin_dist):
    with pytest.raises(backends.BackendUnavailable) as info:
        backends.get("broken")
    assert _one_line_error(info) == (
        "dropbp backend 'broken' (entry point 'fake_dropbp_missing:Backend' from fake-dropbp-npu 1.2) "
        "failed to import (ModuleNotFoundError: No module named 'fake_dropbp_missing'); "
        "reinstall the package that provides it"
    )
    with pytest.raises(backends.BackendUnavailable) as info:
        backends.get("odd")
    assert _one_line_error(info) == (
        "dropbp backend 'odd' (entry point 'fake_dropbp_npu:NotABackend' from fake-dropbp-npu 1.2) "
        "is not a dropbp.backends.Backend subclass; fix or remove that package"
    )


# -- CPU: Intel Extension for PyTorch only when it fits ---------------------------------------------
@pytest.fixture
def fresh_ipex():
    cpu_module.ipex.cache_clear()
    yield
    cpu_module.ipex.cache_clear()


def _fake_ipex(monkeypatch, version: str) -> list:
    calls: list = []
    module = ModuleType("intel_extension_for_pytorch")
    module.__version__ = version

    def optimize(model, optimizer=None, dtype=None):
        calls.append((model, optimizer, dtype))
        return model if optimizer is None else (model, optimizer)

    module.optimize = optimize
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", module)
    return calls


def _dropbp_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "dropbp"]


def test_ipex_absent_plain_pytorch_and_one_log_line(monkeypatch, caplog, fresh_ipex):
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", None)
    caplog.set_level(logging.INFO, logger="dropbp")
    model, optimizer = torch.nn.Linear(2, 2), None
    cpu = backends.get("cpu")
    assert cpu.prepare(model) == (model, None)
    assert cpu.prepare(model, optimizer) == (model, None)
    [record] = _dropbp_records(caplog)
    assert record.getMessage() == "cpu backend: intel_extension_for_pytorch is not installed; using plain PyTorch"


def test_ipex_of_another_torch_is_not_imported(monkeypatch, caplog, fresh_ipex):
    calls = _fake_ipex(monkeypatch, "2.3.110+xpu")
    caplog.set_level(logging.INFO, logger="dropbp")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert backends.get("cpu").prepare(model, optimizer) == (model, optimizer)
    assert calls == []
    [record] = _dropbp_records(caplog)
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"cpu backend: intel_extension_for_pytorch 2.3.110+xpu does not match torch {torch.__version__} "
        "(needs the same major.minor); using plain PyTorch"
    )


def test_ipex_matching_torch_optimizes_the_model(monkeypatch, caplog, fresh_ipex):
    major, minor = torch.__version__.split(".")[:2]
    calls = _fake_ipex(monkeypatch, f"{major}.{minor}.0+cpu")
    caplog.set_level(logging.INFO, logger="dropbp")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cpu = backends.get("cpu")
    assert cpu.prepare(model, optimizer) == (model, optimizer)
    assert cpu.prepare(model.eval()) == (model, None)  # ipex.optimize takes an eval model alone
    assert calls == [(model, optimizer, torch.bfloat16), (model, None, torch.bfloat16)]
    [record] = _dropbp_records(caplog)
    assert (
        record.getMessage() == f"cpu backend: using intel_extension_for_pytorch {major}.{minor}.0+cpu (ipex.optimize)"
    )


def test_ipex_is_not_given_a_pair_it_rejects(monkeypatch, caplog, fresh_ipex):
    """The real ipex.optimize asserts a training model with its optimizer or an eval model alone
    (tests/test_ipex.py); ``dropbp check`` prepares a training model alone."""
    major, minor = torch.__version__.split(".")[:2]
    calls = _fake_ipex(monkeypatch, f"{major}.{minor}.0+cpu")
    caplog.set_level(logging.INFO, logger="dropbp")
    model = torch.nn.Linear(2, 2)
    cpu = backends.get("cpu")
    assert cpu.prepare(model) == (model, None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert cpu.prepare(model.eval(), optimizer) == (model, optimizer)
    assert calls == []
    assert [r.getMessage().split("got one in ")[1] for r in _dropbp_records(caplog)[1:]] == [
        "training mode without an optimizer, so it stays on plain PyTorch",
        "eval mode with an optimizer, so it stays on plain PyTorch",
    ]


def test_ipex_that_fails_to_import_falls_back(monkeypatch, caplog, fresh_ipex):
    monkeypatch.setattr(cpu_module, "installed_ipex_version", lambda: torch.__version__)
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", None)
    caplog.set_level(logging.INFO, logger="dropbp")
    model = torch.nn.Linear(2, 2)
    assert backends.get("cpu").prepare(model) == (model, None)
    [record] = _dropbp_records(caplog)
    assert "failed to import (ModuleNotFoundError: import of intel_extension_for_pytorch halted" in (
        record.getMessage()
    )


# -- timers ------------------------------------------------------------------------------------------
def test_host_timer_waits_for_the_device_on_both_ends():
    calls = []
    with HostTimer(lambda: calls.append("sync")) as timer:
        calls.append("work")
    assert calls == ["sync", "work", "sync"] and timer.seconds >= 0


def test_event_timer_records_around_the_block_and_reads_milliseconds():
    log = []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing
            self.id = len(log)

        def record(self):
            log.append("record")

        def synchronize(self):
            log.append("synchronize")

        def elapsed_time(self, end):
            return 1500.0

    with EventTimer(SimpleNamespace(Event=Event)) as timer:
        log.append("work")
    assert log == ["record", "work", "record"]
    assert timer.seconds == 1.5 and log[-1] == "synchronize"


# -- CUDA on a GPU -----------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_cuda_backend_on_a_gpu():
    cuda = backends.get("cuda")
    assert cuda.device.type == "cuda" and cuda.distributed_backend == "nccl"
    assert cuda.default_max_patterns is None and tools_for(cuda).graph_compilations() is None
    cuda.reset_peak_memory()
    before = torch.cuda.memory_allocated()
    with tools_for(cuda).timer() as timer:
        x = torch.ones(1024, 1024, device=cuda.device)
        y = x @ x
    assert torch.cuda.memory_allocated() > before and cuda.max_memory_allocated() >= torch.cuda.memory_allocated()
    assert timer.seconds > 0 and float(y[0, 0]) == 1024.0
    assert backends.get().name == "cuda"  # auto-detection picks the GPU when no Gaudi is present


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_example_runs_on_cuda():
    _run_example("cuda")


# -- the controller's loop helpers -------------------------------------------------------------------
def test_apply_takes_a_backend_name_or_instance(monkeypatch):
    log: list[str] = []
    mine = Recording(log)
    assert dropbp.apply(tiny_model("llama"), 0.5, backend=mine).backend is mine
    assert dropbp.apply(tiny_model("llama"), 0.5, backend="cpu").backend.name == "cpu"
    monkeypatch.setenv("DROPBP_BACKEND", "cpu")
    assert dropbp.apply(tiny_model("llama"), 0.5).backend.name == "cpu"
    with pytest.raises(TypeError, match="backend must be a name, a Backend or None, got int"):
        dropbp.apply(tiny_model("llama"), 0.5, backend=1)
    with pytest.raises(backends.UnknownBackend, match="unknown dropbp backend 'tpu'"):
        dropbp.apply(tiny_model("llama"), 0.5, backend="tpu")


def test_the_backend_default_pattern_bound_applies_unless_given():
    log: list[str] = []
    bounded = Recording(log)
    bounded.default_max_patterns = 16
    assert dropbp.apply(tiny_model("llama"), 0.5, backend=bounded).max_patterns == 16
    assert dropbp.apply(tiny_model("llama"), 0.5, backend=bounded, max_patterns=4).max_patterns == 4
    assert dropbp.apply(tiny_model("llama"), 0.5, backend="cpu").max_patterns is None


def test_backward_and_optimizer_step_place_the_step_boundaries():
    log: list[str] = []
    model = tiny_model("llama")
    ctl = dropbp.apply(model, 0.5, backend=Recording(log))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_post_hook(lambda *_: log.append("optimizer.step"))
    ids = batch()
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.register_hook(lambda g: log.append("loss.backward") or g)
        assert ctl.backward(loss) is True
        assert model.model.embed_tokens.weight.grad is not None
        ctl.optimizer_step(optimizer)
        optimizer.zero_grad()
    assert log == ["loss.backward", "after_backward", "optimizer.step", "after_optimizer_step"] * 2


def test_backward_skips_safely_when_nothing_needs_a_gradient():
    log: list[str] = []
    model = tiny_model("llama")
    ctl = dropbp.apply(model, 0.5, backend=Recording(log))
    model.requires_grad_(False)  # frozen after apply (apply refuses a frozen model)
    ids = batch()
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(RuntimeError, match="does not require grad"):
        loss.backward()
    assert ctl.backward(loss) is False
    assert log == ["after_backward"]  # the boundary still falls where the loop expects it


# -- the example: one script for every device --------------------------------------------------------
def _run_example(backend: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DROPBP_BACKEND": backend}
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_example_runs_on_cpu():
    done = _run_example("cpu", "--steps", "4", "--log-every", "2", "--layers", "2")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("<dropbp backend 'cpu' on cpu>: ") and "4 branches, drop_rate 0.5" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["1", "2", "4"]
    assert "held-out loss before" in out and "held-out loss after" in out
    assert "of branch backwards dropped (target 0.5)" in out and "0 backward(s) skipped" in out
    assert "graph compilations n/a" in out
    # the one IPEX line, via logging: not installed, does not match, or (with IPEX 2.8 on torch 2.8) used
    [line] = [line for line in done.stderr.splitlines() if line.startswith("dropbp: cpu backend: ")]
    assert "intel_extension_for_pytorch" in line


def test_example_on_a_missing_device_fails_in_one_line():
    done = _run_example("hpu", "--steps", "1")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("finetune.py: dropbp backend 'hpu' (from DROPBP_BACKEND) is unavailable: ")


_NPU_FILE = '''
"""A made-up device, written as docs/backends.md "Adding a device" says: the CPU under another name, with lazy
graphs (a graph break it counts) and a memory bound it runs itself."""

from __future__ import annotations

import torch

from dropbp.backends.base import Backend
from dropbp.tools.device_tools import DeviceTools, register


class NPUBackend(Backend):
    name = "npu"
    default_max_patterns = 4
    breaks = 0
    checkpoints = 0

    @classmethod
    def unavailable_reason(cls):
        return None

    @property
    def device(self):
        return torch.device("cpu")

    @property
    def autocast_dtype(self):
        return torch.bfloat16

    def graph_break(self):
        type(self).breaks += 1

    def checkpoint(self, function, *args, **kwargs):
        type(self).checkpoints += 1
        return super().checkpoint(function, *args, **kwargs)


class NPUTools(DeviceTools):
    def environment(self):
        return {"device_name": "NPU stand-in", "device_count": 1}


register(NPUBackend, NPUTools)
'''


def test_adding_a_device_as_the_docs_say(tmp_path, monkeypatch):
    """Step 1, one file; step 2, one line in ``BUILTIN``; step 3, what ``dropbp check`` reports of it. The core then
    places the device's graph breaks, bounds its patterns and runs the memory bound through its ``checkpoint``."""
    from dropbp.tools.check_env import environment

    path = tmp_path / "npu.py"
    path.write_text(_NPU_FILE)  # 1. the file (built in, it would be backends/npu.py: dropbp.backends.npu)
    spec = importlib.util.spec_from_file_location("dropbp.backends.npu", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "dropbp.backends.npu", module)
    spec.loader.exec_module(module)
    monkeypatch.setitem(backends.BUILTIN, "npu", module.NPUBackend)  # 2. the line in BUILTIN
    monkeypatch.setenv("DROPBP_BACKEND", "npu")

    model = tiny_model("llama", layers=4)
    ctl = dropbp.apply(model, 0.875)
    assert ctl.backend.name == "npu" and "npu" in backends.available()
    assert ctl.max_patterns == 4 and ctl.memory_bound
    for step in range(8):
        ids = batch(step)
        assert ctl.backward(model(input_ids=ids, labels=ids).loss)
    assert module.NPUBackend.breaks == 8 and module.NPUBackend.checkpoints > 0
    assert environment(ctl.backend, "npu")["device_name"] == "NPU stand-in"  # 3. dropbp check's report
