"""Backend resolution (the CPU backend is all this machine has)."""

from __future__ import annotations

import pytest
import torch

from dropbp import backends


def test_cpu_backend_facts():
    cpu = backends.get("cpu")
    assert cpu.device == torch.device("cpu")
    assert cpu.autocast_dtype == torch.bfloat16
    assert cpu.distributed_backend == "gloo" and cpu.default_max_patterns is None
    assert cpu.memory_allocated() == 0


def test_environment_variable_and_auto(monkeypatch):
    monkeypatch.setenv("DROPBP_BACKEND", "CPU")
    assert backends.get().name == "cpu"
    monkeypatch.setenv("DROPBP_BACKEND", "auto")
    assert backends.get().name == "cpu"
    monkeypatch.delenv("DROPBP_BACKEND")
    assert backends.get().name == "cpu"


def test_unknown_name_lists_valid_ones(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown dropbp backend 'tpu'; valid names: cpu, auto"):
        backends.get("tpu")
    monkeypatch.setenv("DROPBP_BACKEND", "nope")
    with pytest.raises(ValueError, match="'nope'"):
        backends.get()
