"""The measurement tools: the ``dropbp`` command (demo, bench), the lockstep comparison engine, reports,
text corpora and the offline pretrained model. The core never imports this package; the tools use
the core only through its public API, and ask device questions of the backend.
"""
