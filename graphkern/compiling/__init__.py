"""Compiled graphs: ``gk.compile``, a function under ``mx.compile`` guarded by a graphkern trace per
input signature (``compiled.CompiledGraph``); ``check_finite`` (``finite``); what compiled graphs
take from the layers above them (``extensions``: the ranks' agreement, the value inspector).

>>> import mlx.core as mx
>>> cf = compile(lambda x: mx.exp(x) * 2)
>>> cf(mx.zeros((2,))).tolist(), [s.call for s in cf.signatures()]
([2.0, 2.0], ['<lambda>(float32[2])'])
"""

from __future__ import annotations

from .compiled import CompiledGraph, FiniteCheckedGraph, TracedSignature, compile
from .finite import all_finite, non_finite_error

__all__ = ["CompiledGraph", "FiniteCheckedGraph", "TracedSignature", "all_finite", "compile",
           "non_finite_error"]
