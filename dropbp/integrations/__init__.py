"""Integrations with training frameworks, imported on demand: ``dropbp.integrations.hf`` (Trainer, TRL),
``.axolotl``; ``.deepspeed`` (ZeRO 1-3) is imported by ``import dropbp`` and registers itself with
:mod:`dropbp.execution.frameworks`, through which alone the core reaches it."""
