"""DropBP under ``torch.distributed``: what DDP needs to know; FSDP2 needs nothing.

Every rank draws the same pattern without communicating (a pure function of seed and step,
:mod:`dropbp.sampler`), so every rank skips the same branches and the collectives of DDP and FSDP2
``fully_shard`` match. Parameters of dropped branches get no gradient at all (``.grad`` stays
``None``, so AdamW neither decays nor moves them), exactly as on one process:

- **FSDP2** reduce-scatters only the parameters that received a gradient, the same set on every
  rank. ``dropbp.apply`` works before or after ``fully_shard`` (it finds the branches by module
  path, which sharding keeps, and reads parameters at use).
- **DDP** waits for a gradient of every parameter unless it looks for unused ones
  (``find_unused_parameters=True``). Without that it finishes the first step with buckets pending,
  never reducing the gradients in them, and raises "Expected to have finished reduction" at the next;
  with ``static_graph=True`` it assumes the unused set never changes, which DropBP changes every
  step. So a DDP wrapper with either setting is refused with a message saying what to pass, when it
  is given to ``dropbp.apply`` and, for a model wrapped after ``apply``, at its first training forward
  (DDP names the wrapper running a forward in ``DistributedDataParallel._active_ddp_module``). With
  ``find_unused_parameters=True`` DDP leaves the gradient of a parameter unused on every rank untouched.
- **DeepSpeed** ZeRO treats a parameter without a gradient differently per stage, never as one process
  does; :mod:`dropbp.integrations.deepspeed` makes it (a ``DeepSpeedEngine`` given to ``apply`` is unwrapped
  like DDP, :func:`dropbp.frameworks.unwrap`).
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from .internals import running_ddp

__all__ = ["RunningDDPCheck", "check_ddp", "check_running_ddp", "check_running_ddp_checkpointing"]


def check_ddp(ddp: DistributedDataParallel) -> None:
    """Raise ``ValueError`` unless ``ddp`` copes with parameters that get no gradient in a step."""
    if getattr(ddp, "static_graph", False):
        problem = "static_graph=True (it assumes the same parameters are used every step)"
    elif not ddp.find_unused_parameters:
        problem = "find_unused_parameters=False (it would wait for their gradients and fail at the next step)"
    else:
        return
    raise ValueError(
        "DropBP leaves the parameters of dropped branches without a gradient, which "
        f"DistributedDataParallel with {problem} cannot handle: wrap with "
        "DistributedDataParallel(model, find_unused_parameters=True) (Accelerate: "
        "DistributedDataParallelKwargs(find_unused_parameters=True); Hugging Face Trainer: "
        "ddp_find_unused_parameters=True in its arguments, which dropbp.integrations.hf.attach sets when it is "
        "left unset and DropBPCallback, given to the trainer when it is made, cannot)"
    )


def check_running_ddp() -> None:
    """:func:`check_ddp` on the DDP wrapper whose forward is running now, if there is one."""
    ddp = running_ddp()
    if ddp is not None:
        check_ddp(ddp)


class RunningDDPCheck:
    """Step listener (:class:`dropbp.hooks.StepListener`): a DDP wrapper added after ``apply`` must cope with
    parameters that get no gradient, checked at each training forward that drops a branch."""

    def on_training_forward(self, pattern: frozenset[int]) -> None:
        if pattern:
            check_running_ddp()

    def on_remove(self) -> None:
        """Nothing to undo."""


def check_running_ddp_checkpointing() -> None:
    """Raise ``ValueError`` if a DDP forward is running: called when re-entrant checkpointing was seen.

    Re-entrant checkpointing hides the parameters of each checkpointed region from DDP's search for
    unused parameters and then produces their gradients in a second backward, which DDP rejects
    ("Expected to mark a variable ready only once"); its workaround, ``static_graph``, cannot follow
    patterns that change every step.
    """
    if running_ddp() is not None:
        raise ValueError(
            "DropBP under DistributedDataParallel needs non-re-entrant activation checkpointing: re-entrant "
            "checkpointing cannot be combined with find_unused_parameters=True. Use "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) or, in Hugging Face, "
            "gradient_checkpointing_kwargs={'use_reentrant': False}"
        )
