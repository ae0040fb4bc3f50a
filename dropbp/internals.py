"""Every read of another library's private names (torch, transformers, DeepSpeed).

Each function reads one internal and says what it needs; ``tests/test_internals.py`` checks each against the
installed versions (CI runs it with the torch it installs), and ``tests/test_architecture.py`` refuses private
names of other libraries anywhere else in the package, and frame inspection everywhere. A release that moves one
of these fails there first, with the function's name.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "at_backward_end",
    "attention_implementation",
    "backward_hooks",
    "backward_task",
    "built_with",
    "captured",
    "checkpoint_hook",
    "deepspeed_fp32_mapping",
    "deepspeed_zero3_optimizer",
    "deepspeed_zero_optimizer",
    "module_hooks",
    "prepared_inputs",
    "running_node",
    "running_ddp",
    "tensor_version",
    "torch_lazy",
]


# -- torch autograd ------------------------------------------------------------------------------------------------
def backward_task() -> int:
    """The id of the backward the autograd engine runs in this thread, -1 outside every backward."""
    return torch._C._current_graph_task_id()


def running_node() -> object | None:
    """The autograd node whose backward runs now (a re-entrant checkpoint's node during its recomputation)."""
    return torch._C._current_autograd_node()


def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: it moves at every in-place write (``zero_grad(set_to_none=False)``'s)."""
    return tensor._version


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward ends."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def backward_hooks(tensor: torch.Tensor) -> dict[int, Callable[..., Any]]:
    """The hooks registered on ``tensor``'s own backward (DeepSpeed's engine registers one on its loss)."""
    return getattr(tensor, "_backward_hooks", None) or {}


def module_hooks(module: torch.nn.Module) -> tuple[tuple[int, ...], ...]:
    """The ids of ``module``'s forward pre-, forward, backward and backward pre-hooks, in that order."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
    return tuple(tuple(getattr(module, kind, {})) for kind in kinds)


# -- torch.utils.checkpoint ----------------------------------------------------------------------------------------
def checkpoint_hook() -> object | None:
    """The pack hook of the non-re-entrant ``torch.utils.checkpoint`` call running now, if any."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint":
        return hooks[0]
    return None


def captured(hook: Callable[..., Any], name: str) -> Any:
    """The variable ``name`` that one of ``torch.utils.checkpoint``'s hook closures captured."""
    fn = inspect.unwrap(hook)  # the recomputation's hook is wrapped by torch._dynamo.disable
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is not None and name in code.co_freevars:
        return cells[code.co_freevars.index(name)].cell_contents
    raise RuntimeError(
        f"dropbp cannot find the checkpointed region in torch {torch.__version__}'s torch.utils.checkpoint "
        f"(its hook captures no {name!r}), so it cannot tell which forward a recomputation replays; "
        "please report this with your torch version, and train without activation checkpointing meanwhile"
    )


# -- torch devices and engines -------------------------------------------------------------------------------------
def built_with(device_module: str) -> bool:
    """Whether this torch was built with the device module ``torch.<device_module>`` (``"xpu"``) compiled in."""
    return bool(getattr(torch, device_module)._is_compiled())


def running_ddp() -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` wrapper whose forward runs now, if any."""
    return getattr(DistributedDataParallel, "_active_ddp_module", None)


def torch_lazy() -> ModuleType:
    """``torch._lazy``, PyTorch's lazy-tensor engine (``mark_step``, ``metrics``, ``ts_backend``)."""
    for name in ("torch._lazy", "torch._lazy.metrics", "torch._lazy.ts_backend"):
        importlib.import_module(name)
    return torch._lazy


def register_device_module(device_type: str, module: ModuleType) -> None:
    """``torch.<device_type>`` becomes ``module`` (as out-of-tree devices register theirs), once."""
    if not hasattr(torch, device_type):
        torch._register_device_module(device_type, module)


# -- transformers --------------------------------------------------------------------------------------------------
def prepared_inputs(trainer: Any, batch: Any) -> Any:
    """``batch`` as ``trainer`` feeds it to its model (``Trainer._prepare_inputs``: on the device, and so on)."""
    return trainer._prepare_inputs(batch)


def attention_implementation(config: Any) -> str | None:
    """The attention implementation a Hugging Face model was loaded with (its config's ``_attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)


# -- DeepSpeed -----------------------------------------------------------------------------------------------------
def deepspeed_zero3_optimizer(p: torch.nn.Parameter) -> Any:
    """The ZeRO-3 optimizer holding ``p``, if any (DeepSpeed marks its parameters with it)."""
    return getattr(p, "_z3_optimizer", None)


def deepspeed_fp32_mapping(p: torch.nn.Parameter) -> Any:
    """ZeRO 1-2's map from ``p`` to its slice of fp32 master weights (``hp_fragment``), if any."""
    return getattr(p, "_hp_mapping", None)


def deepspeed_zero_optimizer(p: torch.nn.Parameter) -> Any:
    """The ZeRO 1-2 optimizer holding ``p``, if any."""
    return getattr(p, "_zero_optimizer", None)
