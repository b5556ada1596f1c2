#!/usr/bin/env python3
"""Run graphkern's CUDA kernels on the CPU: each launch's source as MLX's ``cuda_kernel`` writes it
(``nvrtc_check.generate_plan``), compiled by the host C++ compiler against ``cuda_emulator.h``
(every CUDA thread a fiber, barriers and warp shuffles exact), run on the plan's inputs, and
compared with the kernel's pure-MLX reference at the entry's tolerances.

What it shows: the body's indexing, its barriers and shuffles, its rounding points, and its
writes (outputs start as NaN, so an element no thread writes fails; NaN canary bytes around
every buffer, so a write past an output or into an input fails, and a read past an input's end
that reaches an output shows), and any access off its type's alignment (``--misaligned`` runs the
narrow-load paths that guard against it). What it cannot: speed, the device's memory model,
NVRTC's own errors (``nvrtc_check.py``), or fast-math differences. A dev script, not part of the
package; needs ``g++`` (or ``$CXX``).

    python scripts/cuda_emulate.py                      # every LIBRARY entry at its own shapes
    python scripts/cuda_emulate.py rope_qk_norm -d bfloat16 -s 1,1,256
    python scripts/cuda_emulate.py --misaligned -d float16   # inputs off their vectors' alignment
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nvrtc_check  # noqa: E402 - a sibling script: MLX's build_kernel, redone

from graphkern.debugging.kernel_checks import _fit_shape  # noqa: E402
from graphkern.debugging.tolerance import TOLERANCES, worst_errors  # noqa: E402
from graphkern.kernels.base import Plan, apply_plan, output_spec, template_arg  # noqa: E402
from graphkern.kernels.registry import LIBRARY  # noqa: E402
from graphkern.launching.backends import using_backend  # noqa: E402
from graphkern.nodes import dtype_name  # noqa: E402

HERE = Path(__file__).resolve().parent
HEADER = HERE / "cuda_emulator.h"
MAX_NDIM = 10
CACHE = Path(os.environ.get("GRAPHKERN_EMULATOR_CACHE",
                            Path(tempfile.gettempdir()) / "graphkern-cuda-emulator"))

# the dynamic shared memory MLX passes at launch, declared by the body as an unsized extern array
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s*)?"
                            r"([\w:]+(?:\s+[\w:]+)*?)\s+(\w+)\s*\[\s*\]\s*;")
_NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int32": np.int32,
          "uint32": np.uint32, "int64": np.int64, "uint8": np.uint8, "int8": np.int8, "bool": np.bool_,
          "uint16": np.uint16, "int16": np.int16, "uint64": np.uint64}


class EmulationError(RuntimeError):
    """The emulated launch could not run: the source did not compile, or the run faulted."""


def emulated_source(plan: Plan) -> tuple[str, str]:
    """(the kernel's function name, the C++ translation unit: MLX's generated source on the
    emulator's header, plus ``gk_emu_launch``)."""
    generated = nvrtc_check.generate_plan(plan)
    source = generated.source.replace(nvrtc_check._DEFAULT_HEADER, '\n#include "cuda_emulator.h"\n', 1)
    source = _EXTERN_SHARED.sub(lambda m: f"{m[1]}* {m[2]} = static_cast<{m[1]}*>(gk_emu::dynamic_shared());",
                                source)
    params = re.search(rf"__global__ void {generated.name}\((.*?)\) {{", source, re.S)
    if params is None:
        raise EmulationError(f"no kernel signature for {generated.name}")
    args, array = [], 0
    for param in (p.strip() for p in params[1].split(",\n")):
        kind, name = param.rsplit(" ", 1)
        if kind.endswith("Shape"):
            args.append(f"shape_of(shapes + {array - 1} * {MAX_NDIM})")
        elif kind.endswith("Strides"):
            args.append(f"strides_of(strides + {array - 1} * {MAX_NDIM})")
        elif kind.endswith(" int"):
            args.append(f"ndims[{array - 1}]")
        else:
            args.append(f"static_cast<{kind.replace('*', '').strip()}*>(buffers[{array}])")
            array += 1
    call = ", ".join(args)
    launcher = f"""
static mlx::core::cu::Shape shape_of(const int32_t* p) {{
  mlx::core::cu::Shape s{{}};
  for (int i = 0; i < {MAX_NDIM}; ++i) s[i] = p[i];
  return s;
}}
static mlx::core::cu::Strides strides_of(const int64_t* p) {{
  mlx::core::cu::Strides s{{}};
  for (int i = 0; i < {MAX_NDIM}; ++i) s[i] = p[i];
  return s;
}}
extern "C" const char* gk_emu_launch(void** buffers, const int32_t* shapes, const int64_t* strides,
                                     const int* ndims, const unsigned* dims, unsigned long smem) {{
  static thread_local std::string fault;
  fault = gk_emu::run(dim3(dims[0], dims[1], dims[2]), dim3(dims[3], dims[4], dims[5]), smem,
                      [&] {{ mlx::core::cu::{generated.name}({call}); }});
  return fault.c_str();
}}
"""
    return generated.name, source + launcher


def compiler() -> str | None:
    """The host C++ compiler the emulator uses, or None when there is none."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


@functools.cache
def _library(source: str) -> ctypes.CDLL:
    cxx = compiler()
    if cxx is None:
        raise EmulationError("no C++ compiler (g++, clang++ or $CXX)")
    digest = hashlib.sha256((source + HEADER.read_text()).encode()).hexdigest()[:24]
    CACHE.mkdir(parents=True, exist_ok=True)
    target = CACHE / f"{digest}.so"
    if not target.exists():
        src = CACHE / f"{digest}.{os.getpid()}.{threading.get_ident()}.cpp"
        src.write_text(source)
        partial = CACHE / f"{digest}.{os.getpid()}.{threading.get_ident()}.so"
        done = subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-w", "-fsanitize=alignment",
                               "-fsanitize-recover=alignment", f"-I{HERE}", str(src), "-o", str(partial)],
                              capture_output=True, text=True)
        if done.returncode:
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            raise EmulationError("the kernel did not compile on the host: " + "\n".join(errors[:5]))
        partial.replace(target)
    lib = ctypes.CDLL(str(target))
    lib.gk_emu_launch.restype = ctypes.c_char_p
    lib.gk_emu_launch.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_ulong]
    return lib


def _to_numpy(a: mx.array) -> np.ndarray:
    a = mx.contiguous(a)
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a))


#: Canary bytes either side of every buffer a launch gets: a write outside an output, or into an
#: input, fails the launch (on a GPU it would land in another array). They are NaN in every float
#: dtype, so a read past an input's end that reaches an output shows there too.
GUARD = 64
_CANARY = 0xFF


class _Placed:
    """A copy of an array in a room of canary bytes, ``shift`` bytes past a 16-byte-aligned address."""

    def __init__(self, data: np.ndarray, shift: int = 0):
        self.room = np.full(data.nbytes + 2 * GUARD + 16, _CANARY, np.uint8)
        self.start = (-self.room.ctypes.data) % 16 + GUARD + shift
        self.end = self.start + data.nbytes
        self.array = self.room[self.start:self.end].view(data.dtype).reshape(data.shape)
        self.array[...] = data
        self.original = data

    def trespassed(self, written: bool) -> str:
        """What the launch did outside its bounds ('' for nothing): a write past either end, or
        (for an input, ``written`` False) into the array itself."""
        outside = np.concatenate([self.room[:self.start], self.room[self.end:]])
        if (outside != _CANARY).any():
            return "wrote outside its bounds"
        if not written and not np.array_equal(self.array.view(np.uint8), self.original.view(np.uint8)):
            return "wrote into it (an input)"
        return ""


def _to_mlx(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


def emulate(plan: Plan, *, misaligned: bool = False) -> list[mx.array]:
    """``plan``'s launch run on the CPU through the emulator: its outputs, as the GPU would give
    them. Raises :class:`EmulationError` if the source does not compile or the run faults (a
    misaligned vector access among them), or writes outside an output's bounds or into an input
    (canary bytes, ``GUARD`` of them, around every buffer). ``misaligned`` starts every input one
    element past an aligned address, as a slice of a larger array does on the GPU.

    >>> from graphkern.kernels.registry import LIBRARY
    >>> entry = LIBRARY["rms_norm"]
    >>> case = entry.make_inputs((2, 64), mx.float32, mx.random.key(0))
    >>> out = emulate(entry.plan(*case.args, **case.kwargs))   # doctest: +SKIP
    """
    _, source = emulated_source(plan)
    lib = _library(source)
    arrays = [a if isinstance(a, mx.array) else mx.array(a) for a in plan.inputs]
    placed_inputs = []
    for a in arrays:
        data = _to_numpy(a)
        placed_inputs.append(_Placed(data, data.itemsize if misaligned and data.ndim else 0))
    placed_outputs = []
    for spec in plan.output_specs:
        buf = np.empty(spec.shape, dtype=_NUMPY[dtype_name(spec.dtype)])
        buf.view(np.uint8)[...] = _CANARY  # NaN in every float dtype: an unwritten element shows
        placed_outputs.append(_Placed(buf))
    inputs = [p.array for p in placed_inputs]
    outputs = [p.array for p in placed_outputs]
    count = len(inputs)
    shapes = np.zeros((max(count, 1), MAX_NDIM), np.int32)
    strides = np.zeros((max(count, 1), MAX_NDIM), np.int64)
    ndims = np.zeros(max(count, 1), np.int32)
    for i, a in enumerate(arrays):
        shapes[i, :a.ndim] = a.shape
        strides[i, :a.ndim] = [s // inputs[i].itemsize for s in inputs[i].strides]
        ndims[i] = a.ndim
    threads = [min(t, g) for t, g in zip(plan.threadgroup, plan.grid)]
    blocks = [-(-g // t) for g, t in zip(plan.grid, threads)]
    dims = np.array([*blocks, *threads], np.uint32)
    buffers = (ctypes.c_void_p * (count + len(outputs)))(*[b.ctypes.data for b in (*inputs, *outputs)])
    fault = lib.gk_emu_launch(buffers, shapes.ctypes.data, strides.ctypes.data, ndims.ctypes.data,
                              dims.ctypes.data, plan.kernel.shared_memory)
    if fault:
        raise EmulationError(f"{plan.kernel.name}: {fault.decode()}")
    names = [*plan.kernel.input_names, *plan.kernel.output_names]
    for index, placed in enumerate([*placed_inputs, *placed_outputs]):
        trespass = placed.trespassed(written=index >= count)
        if trespass:
            raise EmulationError(f"{plan.kernel.name}: {trespass} at {names[index]}")
    return [_to_mlx(o, spec.dtype) for o, spec in zip(outputs, plan.output_specs)]


def float32_truth(plan: Plan) -> list[mx.array]:
    """``plan``'s reference on float32 copies of its 16-bit inputs with ``T`` float32, each output
    rounded once to its dtype: what a kernel that computes in float32 gives, where the reference
    in the dtype may round between steps (stock's quantized CPU products sum 16-bit rows in the
    dtype)."""
    inputs = [a.astype(mx.float32) if isinstance(a, mx.array) and a.dtype in (mx.float16, mx.bfloat16) else a
              for a in plan.inputs]
    template = tuple(template_arg("T", mx.float32) if t.name == "T" else t for t in plan.template)
    specs = tuple(output_spec(spec.shape, mx.float32) for spec in plan.output_specs)
    wide = dataclasses.replace(plan, inputs=tuple(inputs), output_specs=specs, template=template)
    return [o.astype(spec.dtype) for o, spec in zip(apply_plan(wide, "reference"), plan.output_specs)]


def compare(name: str, shape: Sequence[int], dtype: mx.Dtype, seed: int = 0, *,
            misaligned: bool = False) -> tuple[float, float, bool]:
    """Entry ``name``'s emulated CUDA kernel against its reference on random inputs of ``shape``
    (``misaligned`` as :func:`emulate` takes it): (max absolute error, max relative error, within
    the entry's tolerance). In 16-bit, a kernel outside the tolerance of its reference is held to
    :func:`float32_truth` instead, and the errors are that comparison's."""
    entry = LIBRARY[name]
    atol, rtol = entry.tolerances.get(dtype, TOLERANCES[dtype])
    label = f"{name}:{tuple(shape)}:{dtype_name(dtype)}"
    key = mx.random.key((seed * 1_000_003 + zlib.crc32(label.encode())) % 2**32)
    shape = _fit_shape(shape, entry)
    case = entry.make_inputs(shape, dtype, key)
    with using_backend("cuda"):  # plans lay data out for the backend they run on
        plan = entry.plan(*case.args, **case.kwargs)
    out = emulate(plan, misaligned=misaligned)
    errors = worst_errors(out, apply_plan(plan, "reference"), rtol=rtol, atol=atol)
    if errors[2] or dtype == mx.float32:
        return errors
    return worst_errors(out, float32_truth(plan), rtol=rtol, atol=atol)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("entries", nargs="*", help="LIBRARY entries (default: all)")
    parser.add_argument("-d", "--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("-s", "--shape", help="one shape, comma-separated (default: each entry's own)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--misaligned", action="store_true",
                        help="every input one element past an aligned address")
    args = parser.parse_args(argv)
    names = args.entries or sorted(n for n, e in LIBRARY.items() if e.kernel.cuda)
    dtypes = [getattr(mx, d) for d in args.dtypes.split(",")]
    cases = [(n, tuple(int(v) for v in args.shape.split(",")) if args.shape else s, d)
             for n in names for s in ([None] if args.shape else LIBRARY[n].shapes) for d in dtypes]

    def one(case: tuple[str, tuple[int, ...], mx.Dtype]) -> str:
        name, shape, dtype = case
        try:
            err_abs, err_rel, ok = compare(name, shape, dtype, misaligned=args.misaligned)
        except EmulationError as exc:
            return f"FAIL {name} {shape} {dtype_name(dtype)}: {exc}"
        verdict = "ok  " if ok else "FAIL"
        return f"{verdict} {name} {shape} {dtype_name(dtype)}: max abs {err_abs:.3g}, rel {err_rel:.3g}"

    failed = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(one, cases):
            print(line, flush=True)
            failed += line.startswith("FAIL")
    print(f"{len(cases) - failed} of {len(cases)} cases match their reference")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
