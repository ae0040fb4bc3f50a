"""The Gaudi (HPU) backend against a stand-in of the Habana API: no Gaudi hardware is involved.

The stand-in installs the same module and function names the backend uses (``habana_frameworks``,
``habana_frameworks.torch.core.mark_step``, ``habana_frameworks.torch.hpu.is_available`` /
``device_count`` / ``metrics.metric_global``, ``habana_frameworks.torch.utils.internal.is_lazy`` and
``torch.hpu`` memory functions) and imitates lazy mode: inside :meth:`HabanaStandIn.on_device` every
aten op that runs (tensors stay on the CPU) becomes a node of a pending graph: the op, where each
input tensor comes from (an earlier node or an outside input), shapes, dtypes and non-float
constants. ``mark_step`` cuts the pending graph; a graph never seen before is a compilation. Reading
a value (``.item()``) runs the pending graph early, as on the device. Every call and boundary goes
into ``log`` in order, so the tests can check where graph breaks fall.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace

import pytest
import torch
from conftest import batch, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import dropbp
from dropbp import backends
from dropbp.tools.device_tools import tools_for

LAZY_MAX_PATTERNS = backends.base.LAZY_MAX_PATTERNS

STEPS = 200


class _LazyRecorder(TorchDispatchMode):
    def __init__(self, standin: HabanaStandIn) -> None:
        super().__init__()
        self.standin = standin

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":  # record_function markers are host bookkeeping, not graph ops
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.standin.run_pending("sync")  # reading a value executes the graph recorded so far
            return func(*args, **kwargs)
        node = (str(func), self.standin.describe(args), self.standin.describe(kwargs))
        out = func(*args, **kwargs)
        self.standin.record(node, out)
        return out


class HabanaStandIn:
    """The Habana API surface the backend touches, with lazy-graph bookkeeping."""

    def __init__(self, version: str = "1.20.0", has_is_lazy: bool = True, device_present: bool = True) -> None:
        self.version = version
        self.device_present = device_present
        self.has_is_lazy = has_is_lazy
        self.log: list[str] = []
        self.pending: list[tuple] = []  # the nodes of the graph recorded since the last cut
        self._produced: dict[int, str] = {}  # id(tensor) -> the node of the pending graph that made it
        self._inputs: dict[int, str] = {}  # id(tensor) -> outside input number, in first-use order
        self._alive: list[torch.Tensor] = []
        self.graphs: dict[tuple, int] = {}  # graph -> id, in order of first compilation
        self.runs: list[tuple[str, int]] = []  # (last event before the cut, graph id) per graph run
        self.allocated = 0
        self.peak = 0

    # -- lazy mode bookkeeping --------------------------------------------------------------------
    def describe(self, value: object) -> object:
        """A graph node's inputs: where each tensor comes from (an earlier node of this graph, or the
        n-th outside input), its shape and dtype, and every non-float constant. Float scalars, such
        as a learning rate, are fed to the graph at run time and do not change it."""
        if isinstance(value, torch.Tensor):
            source = self._produced.get(id(value))
            if source is None:
                source = self._inputs.setdefault(id(value), f"input{len(self._inputs)}")
                self._alive.append(value)  # keeps id() unique while this graph is pending
            return (source, tuple(value.shape), value.dtype)
        if isinstance(value, (list, tuple)):
            return tuple(self.describe(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, self.describe(v)) for k, v in sorted(value.items()))
        return "float" if isinstance(value, float) else repr(value)

    def record(self, node: tuple, out: object) -> None:
        if not self.log or self.log[-1] != "ops":
            self.log.append("ops")
        index = len(self.pending)
        self.pending.append(node)
        for i, t in enumerate(out if isinstance(out, (list, tuple)) else [out]):
            if isinstance(t, torch.Tensor):
                self._produced[id(t)] = f"node{index}.{i}"
                self._alive.append(t)

    def run_pending(self, cause: str) -> None:
        after = self.log[-1] if self.log else ""
        self.log.append(cause)
        if self.pending:
            graph = tuple(self.pending)
            self.graphs.setdefault(graph, len(self.graphs))
            self.runs.append((after, self.graphs[graph]))
        self.pending, self._produced, self._inputs, self._alive = [], {}, {}, []

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """Ops inside run "on the HPU": they are recorded into the lazy graph."""
        with _LazyRecorder(self):
            yield

    # -- the API, under Habana's names ------------------------------------------------------------
    def mark_step(self, device_str: str = "", sync: bool = False) -> None:
        self.run_pending("mark_step")

    def is_lazy(self) -> bool:
        default = "1" if tuple(int(x) for x in self.version.split(".")[:2]) < (1, 21) else "0"
        return os.environ.get("PT_HPU_LAZY_MODE", default) != "0"

    def metric_global(self, name: str) -> SimpleNamespace:
        assert name == "graph_compilation", name
        return SimpleNamespace(stats=lambda: [["TotalNumber", len(self.graphs)], ["TotalTime", 0], ["AvgTime", 0.0]])

    def _reset_peak(self) -> None:
        self.log.append("reset_peak_memory_stats")
        self.peak = self.allocated

    def install(self, monkeypatch: pytest.MonkeyPatch) -> HabanaStandIn:
        def module(name: str, package: bool = False, **attrs: object) -> ModuleType:
            mod = ModuleType(name)
            if package:
                mod.__path__ = []
            mod.__dict__.update(attrs)
            monkeypatch.setitem(sys.modules, name, mod)
            return mod

        metrics = module("habana_frameworks.torch.hpu.metrics", metric_global=self.metric_global)
        hpu = module(
            "habana_frameworks.torch.hpu",
            package=True,
            is_available=lambda: self.device_present,
            device_count=lambda: int(self.device_present),
            metrics=metrics,
        )
        core = module("habana_frameworks.torch.core", mark_step=self.mark_step)
        children: dict[str, object] = {"core": core, "hpu": hpu, "__version__": self.version}
        if self.has_is_lazy:
            internal = module("habana_frameworks.torch.utils.internal", is_lazy=self.is_lazy)
            children["utils"] = module("habana_frameworks.torch.utils", package=True, internal=internal)
        else:  # an older stack: the backend must fall back to PT_HPU_LAZY_MODE
            monkeypatch.setitem(sys.modules, "habana_frameworks.torch.utils.internal", None)
        ht = module("habana_frameworks.torch", package=True, **children)
        module("habana_frameworks", package=True, torch=ht)
        torch_hpu = SimpleNamespace(
            memory_allocated=lambda: self.allocated,
            max_memory_allocated=lambda: self.peak,
            reset_peak_memory_stats=self._reset_peak,
            synchronize=lambda: self.log.append("synchronize"),
        )
        monkeypatch.setattr(torch, "hpu", torch_hpu, raising=False)
        return self


@pytest.fixture
def gaudi(monkeypatch: pytest.MonkeyPatch) -> HabanaStandIn:
    """A Gaudi software stack 1.20 (lazy by default) with one device, PT_HPU_LAZY_MODE unset."""
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    monkeypatch.delenv("DROPBP_BACKEND", raising=False)
    return HabanaStandIn().install(monkeypatch)


def _train(standin: HabanaStandIn, ctl: dropbp.DropBPController, model: torch.nn.Module, steps: int) -> list:
    """A hand-written loop with ``ctl.backward`` / ``ctl.optimizer_step``; both ends are logged.

    SGD with momentum keeps each update in one graph, as Habana's FusedAdamW does; torch's AdamW
    reads its step counter with ``.item()`` per parameter, which would cut the update graph apart.
    Returns the total graph compilations after each step.
    """
    engine = torch.autograd.Variable._execution_engine
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    optimizer.register_step_post_hook(lambda *_: standin.log.append("optimizer.step"))
    ids = batch(size=2, length=12)
    totals = []
    with standin.on_device():
        for _ in range(steps):
            loss = model(input_ids=ids, labels=ids).loss
            # The callback runs when the autograd engine has finished this backward.
            loss.register_hook(lambda g: engine.queue_callback(lambda: standin.log.append("backward")))
            assert ctl.backward(loss)
            ctl.optimizer_step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            totals.append(tools_for(ctl.backend).graph_compilations())
    return totals


def _graphs_after(standin: HabanaStandIn, event: str) -> set[int]:
    return {graph for after, graph in standin.runs if after == event}


def test_lazy_mode_200_steps_compilations_stop_at_the_bound_and_every_step_is_cut(gaudi):
    model = tiny_model("llama", layers=8)  # 16 branches
    ctl = dropbp.apply(
        model, 0.5, seed=0, pattern="uniform"
    )  # DROPBP_BACKEND unset: auto-detection finds the HPU first
    assert ctl.backend.name == "hpu" and ctl.backend.lazy
    assert ctl.max_patterns == LAZY_MAX_PATTERNS == 16
    ctl.set_rates([0.3, 0.7] * 8)  # uneven rates, as calibrate() sets them
    first = ctl.step
    totals = _train(gaudi, ctl, model, STEPS)
    patterns = {ctl.dropped_at(s) for s in range(first, first + STEPS)}

    # Graph breaks: every backward and every optimizer step is followed at once by a mark_step, and
    # there is no other break: none doubled, no value read inside a step.
    log = gaudi.log
    assert log.count("backward") == log.count("optimizer.step") == STEPS
    assert log.count("mark_step") == len(gaudi.runs) == 2 * STEPS and "sync" not in log
    for i, event in enumerate(log):
        if event in ("backward", "optimizer.step"):
            assert log[i + 1] == "mark_step", log[i - 2 : i + 3]
        if event == "mark_step":
            assert log[i - 1] in ("backward", "optimizer.step"), log[i - 2 : i + 3]

    # Compilations: one forward+backward graph per distinct pattern; an update graph per pattern plus
    # at most one first-time variant each (momentum buffers created); nothing new after warm-up.
    assert 1 < len(patterns) <= LAZY_MAX_PATTERNS
    forward_backward = _graphs_after(gaudi, "backward")
    update = _graphs_after(gaudi, "optimizer.step")
    assert len(forward_backward) == len(patterns)
    assert len(patterns) <= len(update) <= 2 * len(patterns)
    assert totals[-1] == len(gaudi.graphs) == len(forward_backward) + len(update)
    assert totals[-1] <= 3 * LAZY_MAX_PATTERNS
    assert totals[STEPS // 4 - 1] == totals[-1], f"graph cache still growing after warm-up: {totals}"


def test_without_the_bound_every_new_pattern_compiles(gaudi):
    """The stand-in's counting is what makes the bound matter: unbounded patterns keep compiling."""
    hpu = backends.get("hpu")
    hpu.default_max_patterns = None
    model = tiny_model("llama", layers=8)
    ctl = dropbp.apply(model, 0.5, seed=0, backend=hpu, pattern="uniform")
    assert ctl.max_patterns is None
    first = ctl.step
    totals = _train(gaudi, ctl, model, 30)
    patterns = {ctl.dropped_at(s) for s in range(first, first + 30)}
    assert len(patterns) > LAZY_MAX_PATTERNS
    assert len(_graphs_after(gaudi, "backward")) == len(patterns)
    assert totals[-1] > totals[19] > totals[9]


def test_cut_patterns_bound_the_graphs_by_themselves(gaudi):
    """The default cut shape has at most N distinct patterns (the top branch is always kept), so
    even without ``max_patterns`` the graph cache stops at about one forward+backward graph and one
    or two update graphs per depth."""
    hpu = backends.get("hpu")
    hpu.default_max_patterns = None
    model = tiny_model("llama", layers=8)  # 16 branches
    ctl = dropbp.apply(model, 0.5, seed=0, backend=hpu)
    assert ctl.pattern == "cut" and ctl.max_patterns is None
    steps = 60
    totals = _train(gaudi, ctl, model, steps)
    patterns = {ctl.dropped_at(s) for s in range(steps)}
    names = [b.name for b in ctl.branches]
    assert all(list(p) == names[: len(p)] for p in patterns)  # each one a cut
    assert 4 < len(patterns) <= 16
    forward_backward = _graphs_after(gaudi, "backward")
    assert len(forward_backward) == len(patterns)
    assert totals[-1] == len(gaudi.graphs) <= 3 * 16


def test_max_patterns_stays_configurable(gaudi):
    ctl = dropbp.apply(tiny_model("llama"), 0.5, max_patterns=4, pattern="uniform")
    assert ctl.backend.name == "hpu" and ctl.max_patterns == 4


def test_a_skipped_backward_still_cuts_the_graph(gaudi):
    model = tiny_model("llama")
    ctl = dropbp.apply(model, 0.5, pattern="uniform")
    model.requires_grad_(False)  # frozen after apply (apply refuses a frozen model)
    ids = batch()
    with gaudi.on_device():
        loss = model(input_ids=ids, labels=ids).loss
        assert ctl.backward(loss) is False
    assert gaudi.log == ["ops", "mark_step"] and len(gaudi.runs) == 1


@pytest.mark.parametrize(
    ("version", "env", "lazy"),
    [("1.20.0", None, True), ("1.20.0", "0", False), ("1.21.0", None, False), ("1.21.0", "1", True)],
)
def test_lazy_or_eager_comes_from_the_stack(monkeypatch, version, env, lazy):
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    if env is not None:
        monkeypatch.setenv("PT_HPU_LAZY_MODE", env)
    HabanaStandIn(version=version).install(monkeypatch)
    hpu = backends.get("hpu")
    assert hpu.lazy is lazy
    assert hpu.default_max_patterns == (LAZY_MAX_PATTERNS if lazy else None)
    assert ("lazy mode" if lazy else "eager mode") in repr(hpu)


@pytest.mark.parametrize(("env", "lazy"), [(None, True), ("1", True), ("0", False)])
def test_stacks_without_is_lazy_read_the_environment(monkeypatch, env, lazy):
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    if env is not None:
        monkeypatch.setenv("PT_HPU_LAZY_MODE", env)
    HabanaStandIn(has_is_lazy=False).install(monkeypatch)
    assert backends.get("hpu").lazy is lazy


def test_eager_mode_places_no_graph_breaks(monkeypatch):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    standin = HabanaStandIn().install(monkeypatch)
    model = tiny_model("llama")
    ctl = dropbp.apply(model, 0.5, backend="hpu", pattern="uniform")
    assert ctl.max_patterns is None
    _train(standin, ctl, model, 3)
    assert "mark_step" not in standin.log and standin.graphs == {}
    assert standin.log.count("backward") == standin.log.count("optimizer.step") == 3


def test_device_facts_memory_and_compilation_count(gaudi):
    hpu = backends.get("hpu")
    assert hpu.device == torch.device("hpu") and hpu.autocast_dtype == torch.bfloat16
    assert hpu.distributed_backend == "hccl"
    gaudi.allocated, gaudi.peak = 100, 300
    assert hpu.max_memory_allocated() == 300
    hpu.reset_peak_memory()
    assert hpu.max_memory_allocated() == 100
    with tools_for(hpu).timer() as timer:
        pass
    assert gaudi.log == ["reset_peak_memory_stats", "synchronize", "synchronize"] and timer.seconds >= 0
    assert tools_for(hpu).graph_compilations() == 0
    with gaudi.on_device():
        torch.ones(3).add_(1)
    hpu.graph_break()
    assert tools_for(hpu).graph_compilations() == 1


def test_no_compilation_count_without_the_metrics_api(gaudi, monkeypatch):
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch.hpu.metrics", None)
    assert tools_for(backends.get("hpu")).graph_compilations() is None


def test_a_gaudi_stack_without_a_device_fails_in_one_line(monkeypatch):
    monkeypatch.delenv("DROPBP_BACKEND", raising=False)
    HabanaStandIn(device_present=False).install(monkeypatch)
    with pytest.raises(backends.BackendUnavailable) as info:
        backends.get("hpu")
    message = str(info.value)
    assert "\n" not in message and info.value.__suppress_context__
    assert message.startswith("dropbp backend 'hpu' is unavailable: habana_frameworks is installed but sees no")
    assert "hl-smi" in message
    assert backends.get().name == "cpu"  # auto-detection passes over a Gaudi stack without a device


def test_a_broken_gaudi_stack_fails_in_one_line(gaudi, monkeypatch):
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch.core", None)  # half installed
    with pytest.raises(backends.BackendUnavailable) as info:
        backends.get("hpu")
    message = str(info.value)
    assert "\n" not in message and info.value.__suppress_context__
    assert "cannot be imported (ModuleNotFoundError: import of habana_frameworks.torch.core halted" in message
    assert "Intel's installer" in message and "not on PyPI" in message
