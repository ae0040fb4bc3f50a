"""The measurement tools: the ``dropbp`` command (demo, bench), the lockstep comparison engine, reports,
text corpora and the offline pretrained model. The core never imports this package. The tools use the core's public
API and, where they measure the execution itself (``bench``, ``check_grads``, ``compare``), its internals; device
questions go to the backend, and the tools' own (timers, reports, training dtype) to :mod:`.device_tools`.
"""
