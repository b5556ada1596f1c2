"""scripts/nvrtc_check.py's SASS reading (the NVRTC compile itself needs the NVIDIA wheels)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
import nvrtc_check  # noqa: E402 - a script, not a package module

# lines of cuobjdump -sass for the 16-bit RMSNorm (8 KiB rows): vector x loads, a weight split into
# 2-byte loads, an evict-first variant, a predicated load, and stores
SASS = """
        /*1910*/              @!P0 LDG.E.64 R10, desc[UR6][R2.64] ;
        /*2120*/                   LDG.E.U16 R25, desc[UR6][R2.64] ;
        /*2130*/                   LDG.E.U16 R24, desc[UR6][R2.64+0x2] ;
        /*2140*/                   LDG.E.EF.128 R4, desc[UR6][R2.64] ;
        /*2150*/                   LDG.E.NA.64.CONSTANT R4, desc[UR6][R2.64] ;
        /*2300*/                   STG.E.64 desc[UR6][R20.64], R10 ;
        /*1380*/                   STG.E.U16 desc[UR6][R6.64], R4 ;
        /*1390*/                   STG.E desc[UR6][R6.64], R4 ;
        /*0b80*/              @!P1 BRA 0xc50 ;
        /*0390*/                   LDS R2, [R3] ;
"""


def test_global_accesses_are_counted_by_width():
    counts = nvrtc_check.global_accesses(SASS)
    assert counts == {"ld": {64: 2, 16: 2, 128: 1}, "st": {64: 1, 16: 1, 32: 1}}


def test_a_listing_without_global_accesses_counts_none():
    assert nvrtc_check.global_accesses("LDS R2, [R3] ;\nSTS [R4], R2 ;\nEXIT ;") == {"ld": {}, "st": {}}
