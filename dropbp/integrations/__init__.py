"""Integrations with training frameworks, imported on demand: ``dropbp.integrations.hf`` (Trainer, TRL),
``.axolotl``, ``.deepspeed`` (ZeRO 1-3; the core reaches it only once deepspeed has been imported)."""
