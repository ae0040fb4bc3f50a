"""dropbp composes with the other forward wrappers of the ecosystem (issue 41, items 5-6): Accelerate's mixed-precision
forward (what ``Trainer(bf16=True)`` puts on the model instance) installed before or after dropbp's, and ``remove()``
takes off only dropbp's own."""

from __future__ import annotations

import pytest
import torch
from conftest import accelerate_bf16_forward, batch, tiny_model, with_lora
from test_hf_integration import _args, _dataset

import dropbp
from dropbp.tools.arms import apply_arm

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")


def _bf16_trainer(tmp_path, method: str, callbacks=None, **kw) -> transformers.Trainer:
    model = tiny_model("llama", layers=4)
    return transformers.Trainer(
        model=with_lora(model) if method == "lora" else model,
        args=_args(tmp_path, bf16=True, max_steps=4, logging_steps=1, **kw),
        train_dataset=_dataset(),
        data_collator=transformers.default_data_collator,
        callbacks=callbacks,
    )


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("method", ["full", "lora"])
def test_trainer_bf16_with_the_chunked_loss_callback_trains_as_without_it(tmp_path, method):
    from dropbp.integrations.hf import DropBPCallback

    plain = _bf16_trainer(tmp_path / "plain", method)
    plain.train()
    callback = DropBPCallback(drop_rate=0.0, features=[dropbp.ChunkedLoss()])
    chunked = _bf16_trainer(tmp_path / "chunked", method, callbacks=[callback])
    chunked.train()  # Accelerate's forward was on the model before on_train_begin: chunked_loss goes on top of it
    assert len(_losses(chunked)) == 4
    # rate 0: the same training; the chunked head and loss run in bf16 as autocast runs the plain head
    torch.testing.assert_close(_losses(chunked), _losses(plain), atol=2e-2, rtol=0)


def _accelerate_mixed_precision(model: torch.nn.Module) -> torch.nn.Module:
    """What ``Trainer(bf16=True)`` does to the model's forward: Accelerate's autocast wrapper on the instance."""
    return accelerate_bf16_forward(model)


@pytest.mark.parametrize("chunked_loss", [False, True])
def test_remove_takes_off_only_dropbps_forward(chunked_loss):
    model = tiny_model("llama", layers=4)
    ids = batch(0)
    ctl = apply_arm(model, 0.5, seed=0, chunked_loss=chunked_loss)
    model = _accelerate_mixed_precision(model)  # installed on top of dropbp's forward
    wrapper = vars(model)["forward"]
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    assert before.dtype == torch.float32  # Accelerate's wrapper hands back fp32 of bf16 logits
    ctl.remove()
    assert vars(model)["forward"] is wrapper
    with torch.no_grad():
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, atol=0, rtol=0)  # still under autocast, as before remove()
    with torch.no_grad():
        fp32 = type(model).forward(model, input_ids=ids).logits
    assert not torch.equal(after, fp32)  # the wrapper is what makes the difference
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()  # and the model trains plainly


def test_apply_after_accelerate_then_remove_leaves_accelerates_forward():
    model = _accelerate_mixed_precision(tiny_model("llama", layers=4))
    wrapper = vars(model)["forward"]
    ctl = dropbp.apply(model, 0.5, seed=0, features=[dropbp.ChunkedLoss()])
    ids = batch(1)
    model(input_ids=ids, labels=ids).loss.backward()
    ctl.remove()
    assert vars(model)["forward"] is wrapper


def test_chunked_loss_applied_twice_is_refused():
    from dropbp.features.chunked_loss import ChunkedHead

    model = tiny_model("llama", layers=2)
    first = ChunkedHead(model)
    with pytest.raises(RuntimeError, match="already on this LlamaForCausalLM .*remove the first"):
        ChunkedHead(model)
    first.remove()
    ChunkedHead(model).remove()


def test_a_copy_leaves_out_accelerates_forward_over_dropbps_and_runs_itself():
    import copy

    model = tiny_model("llama", layers=2)
    ctl = dropbp.apply(model, 0.5, seed=0)
    model = _accelerate_mixed_precision(model)
    with pytest.warns(UserWarning, match="leaves out the forward another library wrapped around dropbp's"):
        twin = copy.deepcopy(model)
    assert "forward" not in vars(twin)
    with torch.no_grad():
        twin.model.embed_tokens.weight.zero_()  # the copy runs its own weights, not the original's
        twin.eval(), model.eval()
        ids = batch(0)
        assert not torch.equal(twin(input_ids=ids).logits, model(input_ids=ids).logits)
    ctl.remove()
