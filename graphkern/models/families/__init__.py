"""What graphkern knows of each model family, one module a family: the forwards it recognises (as
``Forward`` patterns of mlx-lm's source), the layout of its blocks (``BlockLayout``), the few layers
of its own, and ``RULES``, its rules built from ``graphkern.models.rules``. The machinery (patched
layers, segments, stacks) lives in ``graphkern.models.layers``; ``graphkern.models.patching`` tries
every family's rules, then those of the layers all families share.

Adding a family is a module here, its ``RULES`` added to ``patching.RULES``, and its tests: a tiny
config in ``graphkern.models.tiny`` and the model comparisons of ``tests/test_fusions.py``.
"""
