"""DropBP under ``torch.distributed``: what DDP needs to know; FSDP2 needs nothing.

Every rank draws the same pattern without communicating (:mod:`dropbp.policy.sampler`), so the collectives of DDP and
FSDP2 ``fully_shard`` match, and a dropped branch's parameters get no gradient (``.grad`` stays ``None``), as on one
process. A DDP wrapper without ``find_unused_parameters=True``, or with ``static_graph=True``, is refused with a
message saying what to pass (:func:`check_ddp`): when it is given to ``dropbp.apply`` and, for a model wrapped after
``apply``, at its first training forward (:class:`RunningDDPCheck`); so is re-entrant activation checkpointing under
DDP (:func:`check_running_ddp_checkpointing`). DeepSpeed ZeRO: :mod:`dropbp.integrations.deepspeed`.
Why, and what is tested: docs/scaling-out.md; DeepSpeed: docs/deepspeed.md.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from dropbp.internals import running_ddp

__all__ = ["RunningDDPCheck", "check_ddp", "check_running_ddp", "check_running_ddp_checkpointing"]


def check_ddp(ddp: DistributedDataParallel | None) -> None:
    """Raise ``ValueError`` unless ``ddp`` (None: no DDP) copes with parameters that get no gradient in a step."""
    if ddp is None:
        return
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
    """Step listener (:class:`dropbp.execution.hooks.StepListener`): a DDP wrapper added after ``apply`` must cope with
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
