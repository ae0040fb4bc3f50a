"""Integrations with training frameworks, imported on demand: ``dropbp.integrations.hf`` (Trainer, TRL, and the
start-of-run forecast from the measured map, ``.forecast``), ``.axolotl``; ``.deepspeed`` (ZeRO 1-3) is loaded by
:mod:`dropbp.execution.frameworks` through the ``dropbp.frameworks`` entry point at the first ``apply`` (never by
``import dropbp``), and the core reaches it through that module alone."""
