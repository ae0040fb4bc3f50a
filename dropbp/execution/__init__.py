"""The execution of a dropped backward: how a pattern reaches the model and its branches.

Which modules are branches (:mod:`.discovery`); the per-step hooks (:mod:`.hooks`); a branch's forward, dropped under
``torch.no_grad()`` or kept with a gradient weight (:mod:`.branch_forward`); activation checkpointing that skips dropped
branches (:mod:`.recompute`); the memory bound (:mod:`.bound`); ``torch.compile`` (:mod:`.compile_guards`); instance
patches and clean copies (:mod:`.patching`); DDP (:mod:`.distributed`) and other frameworks (:mod:`.frameworks`). What
differs per device is asked of the backend (:mod:`dropbp.backends`).
"""
