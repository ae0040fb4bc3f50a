"""The fast tier (``pytest -m fast``, tests/conftest.py): Llama's parametrisations of the quick modules, and the
named exactness tests of the slow ones, nothing else of theirs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_the_fast_tier_holds_llama_and_one_exactness_test_of_each_slow_module():
    files = ["test_gradients.py", "test_distributed.py", "test_deepspeed.py", "test_compile.py"]
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "fast", "-p", "no:cacheprovider"]
    listed = subprocess.run([*command, *files], cwd=TESTS, capture_output=True, text=True, timeout=300).stdout
    ids = {line.strip().removeprefix("tests/") for line in listed.splitlines() if "::" in line}
    assert "test_gradients.py::test_gradients_equal_detached_reference[llama-full]" in ids
    assert "test_gradients.py::test_gradients_equal_detached_reference[gpt2-full]" not in ids
    assert "test_distributed.py::test_two_ranks_train_as_one[ddp-cut]" in ids
    assert not [i for i in ids if i.startswith("test_distributed.py::") and not i.endswith("[ddp-cut]")]
    assert not [i for i in ids if i.startswith("test_deepspeed.py::")]
    assert not [i for i in ids if "test_compiling_around_the_branches_says_once" in i]  # long, no gradient checked
    assert [i for i in ids if i.startswith("test_compile.py::")]  # the rest of a quick module stays
