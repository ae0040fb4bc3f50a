"""``dropbp check``: passes on the CPU and writes its files, runs the Gaudi checks on the Habana
stand-in, fails naming the check on broken stand-ins, and a missing device is one line, exit 2.

Small models and settings keep each run to seconds; nothing here asserts a timing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import tiny_model
from test_hpu_standin import LAZY_MAX_PATTERNS, HabanaStandIn

import dropbp.execution.hooks
from dropbp import backends
from dropbp.experimental.token_rows import GatheredRows
from dropbp.tools import cli
from dropbp.tools.check import CheckSettings, CheckSetupError, run_check
from dropbp.tools.check_report import render

TINY = CheckSettings(seq_len=16, batch_size=1, rounds=1, warmup=0)
CORRECTNESS = [
    "gradients-equal-reference-uniform",
    "gradients-equal-reference-cut",
    "gradients-equal-reference-tokens",
    "dropped-branches-build-no-graph",
    "rate-0-equals-no-library",
    "eval-drops-nothing",
    "remove-restores-model",
    "state-round-trip",
]
GRAPHS = ["graph-break-after-backward", "graph-break-after-optimizer-step", "compilations-stop-at-pattern-bound"]


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
    monkeypatch.delenv("DROPBP_BACKEND", raising=False)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a shared 2-core CI machine, two OpenMP threads competing with other
    processes spin for tens of seconds per check; the results do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama (4 layers: 8 branches, so drop rate 0.875 is allowed) saved as a local model."""
    folder = tmp_path_factory.mktemp("check-model")
    tiny_model("llama", layers=4).save_pretrained(folder)
    return str(folder)


def _statuses(result) -> dict[str, str]:
    return {c.name: c.status for c in result.checks}


def test_cli_check_on_cpu_passes_and_writes_its_files(tmp_path, capsys):
    """The command as CI runs it, on the default model (--quick keeps it to seconds)."""
    code = cli.main(["check", "--backend", "cpu", "--quick", "--seq-len", "32", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    record = json.loads((tmp_path / "check.json").read_text())
    assert record["passed"] is True
    statuses = {c["name"]: c["status"] for c in record["checks"]}
    assert all(statuses[name] == "PASS" for name in CORRECTNESS), statuses
    assert statuses["lazy-graph-checks"] == "SKIP"  # the CPU compiles no graph per pattern
    env = record["environment"]
    assert env["backend"] == "cpu" and env["backend_source"] == "named: --backend cpu"
    assert env["collectives"]["name"] == "gloo" and env["versions"]["torch"] == torch.__version__
    assert set(env["detection"]) == {"hpu", "cuda", "xpu", "cpu"} and env["detection"]["cpu"] is None
    assert record["model"]["branches"] == 8 and record["model"]["dtype"] == "fp32"
    speed = record["speed"]
    uniform = [r for r in speed["rows"] if r["pattern"] == "uniform"]
    assert [r["drop_rate"] for r in uniform] == [0.0, 0.5, 0.875]
    assert {r["pattern"] for r in speed["rows"]} == {"uniform", "cut"}
    saved = [speed["baseline"]["saved_bytes"]] + [r["saved_bytes"] for r in uniform]
    assert saved[0] == saved[1] > saved[2] > saved[3] > 0  # dropped branches keep no activations
    assert all(r["peak_memory_bytes"] is None for r in speed["rows"])  # no allocator figures on the CPU
    text = (tmp_path / "check.md").read_text()
    for name in CORRECTNESS:
        assert f"PASS  {name}" in text and f"PASS  {name}" in out
    assert "-> PASS" in out and "| uniform | 0.875 |" in out and "| cut | 0.5 |" in out
    assert str(tmp_path / "check.json") in out
    noise = record["noise_scale"]  # on Python's help text, at the measurement's own tokens per step
    assert noise["measured_steps"] == 8 and noise["tokens_per_step"] == noise["measured_tokens_per_step"] == 4 * 32
    assert [a["name"] for a in noise["forecast"]][-1] == "full backprop at half the batch"
    assert "Gradient noise scale at the model's weights as loaded" in out and noise["message"] in out


def test_the_noise_scale_is_the_users_text_measured_as_the_estimator_says(model_dir, tmp_path):
    """``--data`` and ``--tokens-per-step``: the check's figure equals the estimator fed each micro-batch's gradient
    computed apart (the text's bytes folded into the vocabulary: the folder has no tokenizer) at the weights as
    saved (no optimizer step in between); the forecast is at the user's tokens per step."""
    import math

    from transformers import AutoModelForCausalLM

    from dropbp.policy.noise_scale import NoiseScaleEstimator
    from dropbp.tools.check_noise import NOISE_MICRO_BATCHES, NOISE_STEPS

    text = tmp_path / "mine.txt"
    text.write_text("def add(a, b):\n    return a + b  # the user's own code\n" * 40)
    result = run_check("cpu", model=model_dir, settings=TINY, data=text, tokens_per_step=4096)
    noise = result.noise
    assert noise["tokens_per_step"] == 4096 and noise["branch_share_from"] == "this check's speed measurement"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    vocab = model.config.vocab_size
    ids = torch.tensor([b % vocab for b in text.read_text().encode()][: (NOISE_STEPS * NOISE_MICRO_BATCHES + 1) * 16])
    windows = ids.view(-1, 16)
    params = [p for p in model.parameters() if p.requires_grad]
    reference = NoiseScaleEstimator()
    m = NOISE_MICRO_BATCHES
    for step in range(NOISE_STEPS):
        grads = []
        for k in range(m):
            w = windows[step * m + k].unsqueeze(0)
            grads.append(torch.autograd.grad(model(input_ids=w, labels=w).loss / m, params))
        total = [sum(parts) for parts in zip(*grads, strict=True)]
        squares = [sum(float(t.double().pow(2).sum()) for t in g) * m * m for g in grads]
        reference.update(squares, sum(float(t.double().pow(2).sum()) for t in total), 16)
    want = reference.estimate()
    assert math.isclose(noise["noise_scale_tokens"], want.tokens, rel_tol=1e-3)


def test_one_document_a_step_is_measured_per_document_and_forecast_at_one(model_dir, tmp_path, capsys):
    """Issue 69: a run of one long document a step (no accumulation to read in training). The check measures its own
    micro-batches of one document each (``--seq-len L``) and forecasts at one document a step (``--tokens-per-step
    L``): each arm's forecast is the noise-scale model's at ``B_simple / L``."""
    from dropbp.policy.noise_scale import forecast_arms
    from dropbp.tools.check_noise import NOISE_MICRO_BATCHES

    text = tmp_path / "documents.txt"
    text.write_text("A long document of the user's own, one a step.\n" * 60)
    args = ["check", "--backend", "cpu", "--quick", "--model", str(model_dir), "--seq-len", "64", "--data", str(text)]
    code = cli.main([*args, "--tokens-per-step", "64", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    noise = json.loads((tmp_path / "check.json").read_text())["noise_scale"]
    assert noise["tokens_per_step"] == 64 and noise["measured_tokens_per_step"] == NOISE_MICRO_BATCHES * 64
    arms = forecast_arms(noise["noise_scale_tokens"], 64, noise["branch_share"], (0.5, 0.75))
    assert [a["name"] for a in noise["forecast"]] == [a.name for a in arms]
    assert [a["speedup"] for a in noise["forecast"]] == pytest.approx([a.speedup for a in arms], rel=1e-9)
    assert "at 64 tokens per step" in noise["message"] and noise["message"] in out


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, "does not exist"), ("too short", "the noise scale needs at least 528 tokens")],
    ids=["missing", "short"],
)
def test_bad_noise_data_is_one_line_and_exit_2(tmp_path, capsys, content, match):
    data = tmp_path / "data.txt"
    if content is not None:
        data.write_text(content)
    code = cli.main(["check", "--backend", "cpu", "--seq-len", "16", "--data", str(data), "--out", str(tmp_path)])
    _, err = capsys.readouterr()
    assert code == 2 and match in err and "Traceback" not in err


def test_run_check_function_for_notebooks(model_dir):
    result = run_check("cpu", model=model_dir, method="lora", dtype="bf16", settings=TINY)
    statuses = _statuses(result)
    assert result.passed and result.exit_code == 0, statuses
    assert statuses["gradients-equal-reference-uniform-bf16"] == "PASS"
    assert all(statuses[name] == "PASS" for name in CORRECTNESS)
    bf16 = result.check("gradients-equal-reference-uniform-bf16")
    assert bf16.figures["tolerance"] == 2e-2 and bf16.figures["dropped"]
    assert result.check("gradients-equal-reference-uniform").figures["tolerance"] == 1e-5
    assert result.model["method"] == "lora" and result.model["trainable_parameters"] < result.model["parameters"]
    assert result.model["dtype"] == "bf16 (autocast bfloat16)"


def test_the_check_runs_with_activation_checkpointing_as_a_trainer_would(model_dir, capsys):
    """``--gradient-checkpointing``: every section with Hugging Face's non-re-entrant checkpointing on; the gradients
    still equal the hand-detached reference's, and the report says it was on."""
    result = run_check("cpu", model=model_dir, method="lora", settings=TINY, gradient_checkpointing=True)
    statuses = _statuses(result)
    exact = [name for name in CORRECTNESS if name != "dropped-branches-build-no-graph"]
    assert result.passed and all(statuses[name] == "PASS" for name in exact), statuses
    assert statuses["dropped-branches-build-no-graph"] == "SKIP"  # no layer saves inside its region in the forward
    assert result.model["activation_checkpointing"] is True
    assert "activation checkpointing on" in render(result)


def test_a_drop_that_does_nothing_fails_the_gradient_check(model_dir, monkeypatch):
    """A broken library (branches never run without autograd, outputs never cut) must be caught."""
    monkeypatch.setattr(dropbp.execution.hooks, "attach_no_grad_hooks", lambda module, dropped, *scales, **named: [])
    result = run_check("cpu", model=model_dir, settings=TINY)
    statuses = _statuses(result)
    assert not result.passed and result.exit_code == 1
    assert statuses["gradients-equal-reference-uniform"] == "FAIL"
    assert statuses["dropped-branches-build-no-graph"] == "FAIL"
    assert "differ in presence" in result.check("gradients-equal-reference-uniform").detail


def test_linear_maps_that_skip_kept_rows_fail_the_token_check(model_dir, monkeypatch):
    """A token path whose linear maps run on fewer rows than the selection kept (a device's row count gone wrong)
    must be caught: their gradients then miss the rows the reference keeps."""
    monkeypatch.setattr(GatheredRows, "kept_row_count", lambda self, kept, rows: max(1, kept // 2))
    result = run_check("cpu", model=model_dir, settings=TINY)
    check = result.check("gradients-equal-reference-tokens")
    assert check.status == "FAIL" and "relative error" in check.detail, check.detail
    assert [c.name for c in result.failed] == ["gradients-equal-reference-tokens"]


def test_detach_without_no_grad_passes_gradients_but_fails_the_graph_check(model_dir, monkeypatch):
    """The research code's semantics (compute with autograd, detach after): same gradients, but the
    dropped branches still record a graph and keep activations; the check names exactly that."""

    def detach_only(module, dropped, cache=None, scale=None, inputs_scale=None):  # unbiased is off: nothing to scale
        def after(mod, args, output):
            if not (mod.training and dropped()):
                return output
            return tuple(o.detach() if torch.is_tensor(o) else o for o in output) if isinstance(
                output, tuple
            ) else output.detach()

        return [module.register_forward_hook(after)]

    monkeypatch.setattr(dropbp.execution.hooks, "attach_no_grad_hooks", detach_only)
    result = run_check("cpu", model=model_dir, settings=TINY)
    statuses = _statuses(result)
    assert statuses["gradients-equal-reference-uniform"] == "PASS"
    assert statuses["dropped-branches-build-no-graph"] == "FAIL" and result.exit_code == 1
    assert [c.name for c in result.failed] == ["dropped-branches-build-no-graph"]


# -- the Habana stand-in ------------------------------------------------------------------------------
@pytest.fixture
def gaudi(monkeypatch) -> HabanaStandIn:
    """Gaudi 1.20 in lazy mode; the "hpu" device is the CPU here (the stand-in records CPU ops)."""
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    standin = HabanaStandIn().install(monkeypatch)
    monkeypatch.setattr(backends.HPUBackend, "device", property(lambda self: torch.device("cpu")))
    return standin


def test_on_gaudi_lazy_mode_the_graph_checks_run_and_pass(gaudi, model_dir, tmp_path):
    with gaudi.on_device():
        result = run_check(None, model=model_dir, dtype="fp32", settings=TINY, out=tmp_path)
    statuses = _statuses(result)
    assert result.passed, [(c.name, c.detail) for c in result.failed]
    assert all(statuses[name] == "PASS" for name in GRAPHS + CORRECTNESS), statuses
    env = result.environment
    assert env["backend"] == "hpu" and env["backend_source"].startswith("auto-detected")
    assert env["mode"] == "lazy" and env["habana_frameworks"] == "1.20.0" and env["device_count"] == 1
    assert env["collectives"]["name"] == "hccl" and env["pattern_bound"] == LAZY_MAX_PATTERNS
    bounded = result.check("compilations-stop-at-pattern-bound").figures
    assert bounded["steps"] == 3 * LAZY_MAX_PATTERNS and bounded["compilations_in_last_pass"] == 0
    assert 0 < bounded["compilations"] <= 3 * LAZY_MAX_PATTERNS
    assert 1 < bounded["distinct_patterns"] <= LAZY_MAX_PATTERNS
    assert "graphs for" in (tmp_path / "check.md").read_text()
    assert gaudi.log.count("mark_step") >= 2 * bounded["steps"]


def test_on_gaudi_a_missing_break_after_backward_fails_naming_it(gaudi, model_dir, tmp_path, capsys):
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(backends.HPUBackend, "after_backward", lambda self: None)  # the broken boundary
    try:
        with gaudi.on_device():
            argv = ["check", "--backend", "hpu", "--model", model_dir, "--seq-len", "16", "--out", str(tmp_path)]
            argv += ["--quick", "--batch-size", "1"]
            code = cli.main(argv)
    finally:
        monkeypatch.undo()
    out, _ = capsys.readouterr()
    assert code == 1
    assert "FAIL  graph-break-after-backward" in out and "FAIL: graph-break-after-backward" in out
    assert "PASS  graph-break-after-optimizer-step" in out
    record = json.loads((tmp_path / "check.json").read_text())
    assert record["passed"] is False


def test_on_gaudi_eager_mode_skips_the_graph_checks(gaudi, model_dir, monkeypatch):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    result = run_check("hpu", model=model_dir, settings=TINY)
    assert result.passed and result.environment["mode"] == "eager"
    assert _statuses(result)["lazy-graph-checks"] == "SKIP"


# -- usage and environment errors: one line, exit code 2 ----------------------------------------------
@pytest.mark.parametrize("name", ["cuda", "hpu", "xpu"])
def test_a_missing_device_is_one_line_and_exit_2(name, tmp_path):
    if getattr(backends, f"{name.upper()}Backend").is_available():
        pytest.skip(f"{name} is present on this machine")
    run = subprocess.run(
        [sys.executable, "-m", "dropbp", "check", "--backend", name, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"dropbp backend '{name}' is unavailable" in lines[0], run.stderr
    assert "install" in lines[0] and "Traceback" not in run.stderr


def test_a_model_that_cannot_be_loaded_is_one_line(tmp_path, capsys):
    code = cli.main(["check", "--backend", "cpu", "--model", str(tmp_path / "absent"), "--out", str(tmp_path)])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not exist" in err
    with pytest.raises(CheckSetupError, match="unknown method"):
        run_check("cpu", method="dora")


@pytest.mark.parametrize("name", ["model.txt", "model.safetensors"])
def test_a_file_instead_of_a_model_folder_is_named_as_such(tmp_path, capsys, monkeypatch, name):
    (tmp_path / name).write_text("not a model")
    monkeypatch.chdir(tmp_path)
    code = cli.main(["check", "--backend", "cpu", "--model", f"./{name}", "--out", str(tmp_path / "out")])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"'./{name}' is a file, not a model folder" in err and "config.json" in err and "Repo id" not in err


def test_the_report_says_why_this_backend(monkeypatch):
    from dropbp.tools.check_env import backend_source

    assert backend_source("cpu") == "named: --backend cpu"
    monkeypatch.setenv("DROPBP_BACKEND", "cpu")
    assert backend_source(None) == "named by $DROPBP_BACKEND=cpu"
    monkeypatch.setenv("DROPBP_BACKEND", "auto")
    assert backend_source(None).startswith("auto-detected (the first available of hpu, cuda, xpu, cpu")
    assert backend_source(backends.get("cpu")) == "given as a Backend instance"


def test_a_post_norm_model_passes_against_what_the_residual_receives(tmp_path):
    """gemma2 normalises each branch's output before the residual add: the check's reference detaches
    the norm's output, and the library drops the norm with its branch, so the gradients agree."""
    shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    tiny_model("gemma2", layers=4, **shape).save_pretrained(tmp_path)
    statuses = _statuses(run_check("cpu", model=str(tmp_path), settings=TINY))
    assert statuses["gradients-equal-reference-uniform"] == "PASS", statuses
    assert statuses["gradients-equal-reference-cut"] == "PASS", statuses


def test_qlora_checks_the_4bit_model(model_dir):
    """--method qlora: the same LoRA on nf4 4-bit base weights; every correctness check passes."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install 'dropbp[qlora]')")
    result = run_check("cpu", model=model_dir, method="qlora", settings=TINY)
    statuses = _statuses(result)
    assert result.passed, statuses
    assert all(statuses[name] == "PASS" for name in CORRECTNESS)
    assert result.model["method"] == "qlora" and result.model["trainable_parameters"] < result.model["parameters"]
    assert result.model["four_bit_layers"] == 4 * 7  # every linear of the 4 decoder layers


def test_a_truncated_weights_file_is_a_one_line_setup_error(tmp_path, capsys):
    """A model folder whose safetensors file was cut short (a download or copy interrupted): exit 2, one line that
    names the error and what to check, no traceback (it was exit 1, "a check failed", with a traceback)."""
    tiny_model("llama", layers=2).save_pretrained(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    capsys.readouterr()  # save_pretrained's own progress
    code = cli.main(["check", "--backend", "cpu", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "out")])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "cannot load the model" in err and "truncated" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "is a folder"),
        (b"\x1f\x8b\x08\x00" + bytes(range(200)), "is a gzip file: decompress it first"),
        (b"PK\x03\x04" + bytes(50), "is a zip archive"),
        (b"text\xff\xfe more", "is not UTF-8 text"),
        (b"text\x00\x00 more", "NUL bytes"),
    ],
    ids=["folder", "gzip", "zip", "latin-1", "binary"],
)
def test_data_that_is_not_utf8_text_is_refused_before_the_model_loads(tmp_path, capsys, content, said):
    """--data must be a UTF-8 text file: a folder, a compressed or binary file is named as such, exit 2, one line
    (a gzip file was measured as text; a folder was reported as not existing)."""
    data = tmp_path / "data"
    data.mkdir() if content is None else data.write_bytes(content)
    code = cli.main(["check", "--backend", "cpu", "--data", str(data), "--out", str(tmp_path / "out")])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert said in err and "pass a UTF-8 text file" in err
