"""The drop policy: which branches drop at each step, decided from numbers alone.

Per-branch rates and the never-drop-everything rule (:mod:`.never_drop_all`), the samplers that draw a step's pattern
(:mod:`.sampler`), warm-up and time schedules (:mod:`.schedule`), sensitivity-based allocation (:mod:`.allocation`),
the drop shapes (:mod:`.shapes`), the extension points features plug into (:mod:`.plugins`), the policy that combines
them (:mod:`.drop_policy`), a run's patterns planned and tallied (:mod:`.plan`). Nothing here touches a
module, a hook or a device: the execution (:mod:`dropbp.execution`) carries a pattern to the model.
"""

from dropbp.policy.drop_policy import DropPolicy

__all__ = ["DropPolicy"]
