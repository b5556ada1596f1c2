#!/usr/bin/env python3
"""Check, without a GPU, that graphkern's CUDA kernels compile as MLX's CUDA backend compiles them.

Redoes MLX's ``build_kernel`` (mlx/backend/cuda/custom_kernel.cpp) and NVRTC ``compile()``
(jit_module.cpp) for sm_90a (H100/H200), and reports registers, spills, stack and shared memory per
variant from ptxas's verbose report, registers and stack cross-checked against the CUBIN's ELF.
A dev script, not part of the package. Setup: ``pip install nvidia-cuda-nvrtc==13.5.37
nvidia-cuda-runtime==13.5.37 nvidia-cuda-cccl==13.1.115``; MLX's device headers come from an MLX
checkout or bare mirror (``--mlx-src`` or ``$MLX_SRC``).

    python scripts/nvrtc_check.py            # every LIBRARY entry; exit status 1 if any fails
    python scripts/nvrtc_check.py softmax -d float16 -s 8192,4096 --print-source
    python scripts/nvrtc_check.py --unique --memory   # plus global loads/stores by width (SASS)
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import importlib.util
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphkern.kernels.base import Plan  # noqa: E402
from graphkern.kernels.registry import LIBRARY  # noqa: E402
from graphkern.launching.backends import mlx_kernel_name  # noqa: E402
from graphkern.launching.source_text import for_backend  # noqa: E402
from graphkern.nodes import Kernel, KernelError, OutputSpec, TemplateArg, dtype_name  # noqa: E402

DEFAULT_MLX_SRC = "/work/.mirror/ml-explore+mlx/repo"
ARCH = "sm_90a"  # what MLX picks on an H100/H200 (compute capability 9.0, arch tag "a")
#: Shapes every entry is checked at besides its own (rows of a 4096- and an 8192-wide model).
BIG_SHAPES: tuple[tuple[int, ...], ...] = ((8192, 4096), (16384, 8192))
DTYPES: tuple[mx.Dtype, ...] = (mx.float32, mx.float16, mx.bfloat16)

# dtype_to_cuda_type (mlx/backend/cuda/utils.cpp) and get_type_string (mlx/backend/common/compiled.cpp)
_CUDA_TYPE = {
    "bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
    "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
    "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double",
    "complex64": "mlx::core::cu::complex64_t",
}
_TYPE_STRING = {**{k: v for k, v in _CUDA_TYPE.items() if k not in ("float16", "bfloat16")},
                "float16": "float16_t", "bfloat16": "bfloat16_t", "complex64": "complex64_t"}

_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'


# ----------------------------------------------------------------------------- the generated source


def cuda_type(dtype: mx.Dtype) -> str:
    return _CUDA_TYPE.get(dtype_name(dtype), "unknown")


def template_hash(template: Sequence[TemplateArg]) -> str:
    """``template_arguments_hash``: the suffix MLX appends to the kernel's name."""
    parts = []
    for t in template:
        if isinstance(t.value, mx.Dtype):
            parts.append(_TYPE_STRING[dtype_name(t.value)])
        elif isinstance(t.value, bool):
            parts.append("t" if t.value else "f")
        else:
            parts.append(str(t.value))
    return "".join(f"_{p}" for p in parts)


def build_kernel(func_name: str, header: str, source: str, input_names: Sequence[str],
                 inputs: Sequence[tuple[mx.Dtype, int]], output_names: Sequence[str],
                 output_dtypes: Sequence[mx.Dtype], template: Sequence[TemplateArg]) -> str:
    """MLX's ``build_kernel``; ``inputs`` are (dtype, ndim) pairs."""
    out = [_DEFAULT_HEADER, header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
           f"__global__ void {func_name}(\n"]
    for name, (dtype, ndim) in zip(input_names, inputs):
        out.append(f"    const {cuda_type(dtype)}* {name},\n")
        if ndim > 0:  # shape_infos: found in the body, not the header
            if f"{name}_shape" in source:
                out.append(f"    const __grid_constant__ Shape {name}_shape,\n")
            if f"{name}_strides" in source:
                out.append(f"    const __grid_constant__ Strides {name}_strides,\n")
            if f"{name}_ndim" in source:
                out.append(f"    const __grid_constant__ int {name}_ndim,\n")
    for i, (name, dtype) in enumerate(zip(output_names, output_dtypes)):
        out.append(f"    {cuda_type(dtype)}* {name}" + (",\n" if i < len(output_names) - 1 else ") {\n"))
    for t in template:
        if isinstance(t.value, mx.Dtype):
            out.append(f"  using {t.name} = {cuda_type(t.value)};\n")
        elif isinstance(t.value, bool):
            out.append(f"  constexpr bool {t.name} = {'true' if t.value else 'false'};\n")
        else:
            out.append(f"  constexpr int {t.name} = {t.value};\n")
    if template:
        out.append("\n")
    out.append(f"{source}\n}}\n\n}} // namespace mlx::core::cu\n")
    return "".join(out)


def std_hash(data: bytes) -> int:
    """libstdc++'s ``std::hash<std::string>`` (``_Hash_bytes``, 64-bit), for MLX's module name."""
    mask, mul = (1 << 64) - 1, (0xC6A4A793 << 32) + 0x5BD1E995

    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    h = (0xC70F6907 ^ (len(data) * mul)) & mask
    aligned = len(data) & ~7
    for i in range(0, aligned, 8):
        word = shift_mix(int.from_bytes(data[i:i + 8], "little") * mul & mask) * mul & mask
        h = ((h ^ word) * mul) & mask
    if len(data) & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * mul) & mask
    return shift_mix(shift_mix(h) * mul & mask)


@dataclasses.dataclass(frozen=True)
class Generated:
    """What MLX would hand NVRTC for one launch."""

    name: str  # custom_kernel_<name>_<hash><template hash>
    source: str

    @property
    def module_name(self) -> str:
        return f"{self.name}_{std_hash(self.source.encode()):x}"


def generate(kernel: Kernel, inputs: Sequence[Any], output_specs: Sequence[OutputSpec],
             template: Sequence[TemplateArg]) -> Generated:
    """The kernel name and source ``mx.fast.cuda_kernel`` builds for this launch."""
    if kernel.cuda is None:
        raise ValueError(f"kernel {kernel.name!r} has no CUDA source")
    arrays = [a if isinstance(a, mx.array) else mx.array(a) for a in inputs]  # as MLX's to_array
    name = f"custom_kernel_{mlx_kernel_name(kernel)}{template_hash(template)}"
    source = build_kernel(name, for_backend(kernel.header, "cuda"), for_backend(kernel.cuda, "cuda"),
                          kernel.input_names,
                          [(a.dtype, a.ndim) for a in arrays], kernel.output_names,
                          [s.dtype for s in output_specs], template)
    return Generated(name, source)


def generate_plan(plan: Plan) -> Generated:
    return generate(plan.kernel, plan.inputs, plan.output_specs, plan.template)


# ----------------------------------------------------------------------------- NVRTC


def _wheel_roots() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    return [Path(base) / "cu13" for base in ((spec.submodule_search_locations or []) if spec else [])]


@functools.lru_cache(maxsize=1)
def cuda_root() -> Path:
    """Where lib/libnvrtc.so.13 and include/ are: $NVRTC_CUDA_ROOT (``--cuda-root``), else
    ``site-packages/nvidia/cu13`` of the nvidia-cuda-nvrtc and nvidia-cuda-runtime wheels."""
    env = os.environ.get("NVRTC_CUDA_ROOT")
    for root in [Path(env)] if env else _wheel_roots():
        if (root / "lib" / "libnvrtc.so.13").exists() and (root / "include" / "cuda_fp16.h").exists():
            return root
    raise RuntimeError(f"NVRTC 13 not found in {env or 'site-packages/nvidia/cu13'}: pip install "
                       "nvidia-cuda-nvrtc==13.* nvidia-cuda-runtime==13.* nvidia-cuda-cccl==13.1.*")


@functools.lru_cache(maxsize=1)
def _nvrtc() -> ctypes.CDLL:
    for builtins in sorted((cuda_root() / "lib").glob("libnvrtc-builtins.so.13.*")):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)  # some releases cannot find it themselves
    lib = ctypes.CDLL(str(cuda_root() / "lib" / "libnvrtc.so.13"))
    p, s, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    sigs: dict[str, list[Any]] = {
        "nvrtcVersion": [ctypes.POINTER(i), ctypes.POINTER(i)],
        "nvrtcCreateProgram": [ctypes.POINTER(p), ctypes.c_char_p, ctypes.c_char_p, i,
                               ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)],
        "nvrtcDestroyProgram": [ctypes.POINTER(p)],
        "nvrtcAddNameExpression": [p, ctypes.c_char_p],
        "nvrtcCompileProgram": [p, i, ctypes.POINTER(ctypes.c_char_p)],
        "nvrtcGetProgramLogSize": [p, ctypes.POINTER(s)],
        "nvrtcGetProgramLog": [p, ctypes.c_char_p],
        "nvrtcGetCUBINSize": [p, ctypes.POINTER(s)],
        "nvrtcGetCUBIN": [p, ctypes.c_char_p],
        "nvrtcGetLoweredName": [p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)],
    }
    for fn, args in sigs.items():
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = i
    lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [i], ctypes.c_char_p
    return lib


def nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def _check(fn: str, code: int) -> None:
    if code:
        raise RuntimeError(f"{fn} failed: {_nvrtc().nvrtcGetErrorString(code).decode()}")


@functools.lru_cache(maxsize=4)
def mlx_headers(mlx_src: str = "", rev: str = "HEAD") -> tuple[tuple[str, bytes], ...]:
    """MLX's in-memory device headers (``g_include_names``/``g_headers``) as (include name, text).

    ``mlx_src`` is an MLX source checkout or a bare git mirror (then read at ``rev``)."""
    src = Path(mlx_src or os.environ.get("MLX_SRC", DEFAULT_MLX_SRC))

    def read(path: str) -> bytes:
        if (src / path).is_file():
            return (src / path).read_bytes()
        return subprocess.run(["git", "--git-dir", str(src if (src / "HEAD").exists() else src / ".git"),
                               "show", f"{rev}:{path}"], check=True, capture_output=True).stdout

    jit = read("mlx/backend/cuda/jit_module.cpp").decode()
    names = re.findall(r'INCLUDE_PREFIX "([\w.]+)"', jit)
    if not names:
        raise RuntimeError(f"no g_include_names in {src}'s mlx/backend/cuda/jit_module.cpp")
    prefix = "mlx/backend/cuda/device/"
    return tuple((prefix + n, read(prefix + n)) for n in names)


def include_args(mlx_include: str | None = None) -> list[str]:
    """MLX's ``include_path_args()``: <mlx>/include, its cccl/, then the CUDA headers. Without an
    mlx-cuda wheel's ``mlx/include`` (``mlx_include``), CCCL comes from the nvidia-cuda-cccl wheel."""
    inc = cuda_root() / "include"
    if mlx_include:
        paths = [Path(mlx_include), Path(mlx_include) / "cccl"]
    else:
        paths = [next((p for p in [inc / "cccl", *(r / "include" / "cccl" for r in _wheel_roots())]
                       if p.exists()), inc / "cccl")]
    return [f"--include-path={p}" for p in [*paths, inc] if p.exists()]


@dataclasses.dataclass
class Result:
    """One compile: ``ok`` and NVRTC's ``log``; registers per thread, spill (store, load) bytes and
    static + dynamic shared memory bytes per block (None when the compile failed)."""

    ok: bool
    log: str
    registers: int | None = None
    spills: tuple[int, int] | None = None
    smem: int | None = None
    stack: int | None = None  # stack frame bytes per thread (local memory)
    name: str = ""
    cubin: bytes = b""


def cubin_resources(cubin: bytes, mangled: str) -> tuple[int, int]:
    """(registers, stack frame bytes) of ``mangled`` from the CUBIN's ELF: the EIATTR_REGCOUNT (0x2f)
    and EIATTR_FRAME_SIZE (0x11) records of ``.nv.info``, keyed by the function's symbol index
    (the ``sh_info`` of its ``.text.<mangled>`` section)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + k * shentsize) for k in range(shnum)]
    strtab = heads[shstrndx][4]
    sections = {cubin[strtab + h[0]:cubin.index(b"\0", strtab + h[0])].decode(): h for h in heads}
    symbol = sections[f".text.{mangled}"][7]
    info = sections[".nv.info"]
    data, i, found = cubin[info[4]:info[4] + info[5]], 0, {}
    while i + 2 <= len(data):
        fmt, attr = data[i], data[i + 1]
        i += 2
        if fmt == 4:  # EIFMT_SVAL: u16 size, then (symbol index, value) for these two
            size = struct.unpack_from("<H", data, i)[0]
            if attr in (0x2F, 0x11) and size == 8 and struct.unpack_from("<I", data, i + 2)[0] == symbol:
                found[attr] = struct.unpack_from("<I", data, i + 6)[0]
            i += 2 + size
        elif fmt in (1, 2, 3):  # EIFMT_NVAL, BVAL, HVAL: 0, 1, 2 bytes
            i += fmt - 1
        else:
            break
    return found.get(0x2F, -1), found.get(0x11, -1)


_PTXAS = {
    "registers": r"Used (\d+) registers",
    "smem": r"(\d+) bytes smem",
    "stack": r"(\d+) bytes stack frame",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
}


def compile_source(generated: Generated, *, mlx_src: str = "", mlx_rev: str = "HEAD",
                   mlx_include: str | None = None, dynamic_smem: int = 0,
                   ptxas_report: bool = True) -> Result:
    """Compile one generated kernel as MLX's ``compile()`` does and read its resources.

    ``ptxas_report`` adds ``--ptxas-options=--verbose`` for the spill and shared-memory figures
    (without it those are None); the code is the same either way, only the CUBIN's
    ``.note.nv.tkinfo``, which records ptxas's options, differs."""
    lib = _nvrtc()
    headers = mlx_headers(mlx_src, mlx_rev)
    names = (ctypes.c_char_p * len(headers))(*[n.encode() for n, _ in headers])
    texts = (ctypes.c_char_p * len(headers))(*[t for _, t in headers])
    expression = f"mlx::core::cu::{generated.name}".encode()
    opts = [b"--device-as-default-execution-space", f"--gpu-architecture={ARCH}".encode(),
            *[a.encode() for a in include_args(mlx_include)]]
    if ptxas_report:
        opts.append(b"--ptxas-options=--verbose")
    prog = ctypes.c_void_p()
    _check("nvrtcCreateProgram", lib.nvrtcCreateProgram(
        ctypes.byref(prog), generated.source.encode(), f"{generated.module_name}.cu".encode(),
        len(headers), texts, names))
    try:
        _check("nvrtcAddNameExpression", lib.nvrtcAddNameExpression(prog, expression))
        code = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        _check("nvrtcGetProgramLogSize", lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)))
        buf = ctypes.create_string_buffer(size.value + 1)
        _check("nvrtcGetProgramLog", lib.nvrtcGetProgramLog(prog, buf))
        log = buf.value.decode(errors="replace")
        if code:
            return Result(False, log or _nvrtc().nvrtcGetErrorString(code).decode(), name=generated.name)
        lowered = ctypes.c_char_p()
        _check("nvrtcGetLoweredName", lib.nvrtcGetLoweredName(prog, expression, ctypes.byref(lowered)))
        mangled = (lowered.value or b"").decode()
        _check("nvrtcGetCUBINSize", lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        _check("nvrtcGetCUBIN", lib.nvrtcGetCUBIN(prog, cubin))
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    # ptxas prints "Compiling entry function '<mangled>'" then its "Used N registers ..." lines
    report = log.split(f"'{mangled}'", 1)[-1]
    found = {k: int(m.group(1)) if (m := re.search(p, report)) else 0 for k, p in _PTXAS.items()}
    regs, stack = cubin_resources(cubin.raw, mangled)
    if not ptxas_report:
        return Result(True, log, regs, None, None, stack, generated.name, cubin.raw)
    if (regs, stack) != (found["registers"], found["stack"]):
        log += (f"\nnvrtc_check: ptxas reports {found['registers']} registers and a {found['stack']} B stack "
                f"frame, the CUBIN {regs} and {stack}")
    spills = (found["spill_stores"], found["spill_loads"])
    return Result(True, log, regs, spills, found["smem"] + dynamic_smem, stack, generated.name, cubin.raw)


def compile_plan(plan: Plan, **options: Any) -> Result:
    """Compile ``plan``'s kernel exactly as ``mx.fast.cuda_kernel`` would launch it (see compile_source)."""
    return compile_source(generate_plan(plan), dynamic_smem=plan.kernel.shared_memory, **options)


# ----------------------------------------------------------------------------- memory accesses

_ACCESS = re.compile(r"\b(LDG|STG)((?:\.[A-Z0-9:]+)*)")
_WIDTHS = {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}


_DISASSEMBLERS = "pip install nvidia-cuda-cuobjdump==13.* nvidia-cuda-nvdisasm==13.*"


@functools.cache
def cuobjdump() -> tuple[str, dict[str, str]]:
    """cuobjdump and the environment it finds nvdisasm in: the nvidia-cuda-cuobjdump and
    nvidia-cuda-nvdisasm wheels (site-packages/nvidia/cu13/bin), else PATH (looked up once)."""
    for root in _wheel_roots():
        tool, disasm = root / "bin" / "cuobjdump", root / "bin" / "nvdisasm"
        if tool.exists() and disasm.exists():
            return str(tool), {**os.environ, "NVDISASM_PATH": str(disasm.parent)}
    found = shutil.which("cuobjdump")
    if found is None or shutil.which("nvdisasm") is None:
        raise RuntimeError(f"cuobjdump and nvdisasm not found: {_DISASSEMBLERS}")
    return found, dict(os.environ)


def global_accesses(sass: str) -> dict[str, dict[int, int]]:
    """Global loads and stores in ``sass`` (cuobjdump's listing) counted by width in bits, e.g.
    ``{"ld": {64: 4, 16: 55}, "st": {64: 4, 16: 5}}``: a vector path that should load 8 bytes at a
    time but shows 2-byte loads was split by the compiler.

    >>> global_accesses("LDG.E.64 R2, desc[UR4][R2.64] ; LDG.E.EF.128 R4 ; STG.E desc[UR4][R6.64], R9 ;")
    {'ld': {64: 1, 128: 1}, 'st': {32: 1}}
    """
    counts: dict[str, dict[int, int]] = {"ld": {}, "st": {}}
    for op, suffix in _ACCESS.findall(sass):
        width = next((_WIDTHS[t] for t in suffix.split(".") if t in _WIDTHS), 32)
        kind = counts["ld" if op == "LDG" else "st"]
        kind[width] = kind.get(width, 0) + 1
    return counts


def accesses_text(cubin: bytes) -> str:
    """``global_accesses`` of a CUBIN as ``ld 64x4 16x55 st 64x4 16x5`` (widest first)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool, env = cuobjdump()
        done = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {done.stderr.strip()} ({_DISASSEMBLERS})")
    return " ".join(f"{kind} " + " ".join(f"{w}x{n}" for w, n in sorted(c.items(), reverse=True))
                    for kind, c in global_accesses(done.stdout).items())


# ----------------------------------------------------------------------------- occupancy


def occupancy(registers: int, smem: int, threads: int) -> tuple[int, float]:
    """Blocks per SM and warp occupancy on an H100/H200 (sm_90), by cuda_occupancy.h's rules:
    64K registers in 4 sub-partitions allocated per warp in 256s, 2048 threads, 32 blocks, 228 KiB
    shared memory with 1 KiB reserved per block. MLX launches without __launch_bounds__."""
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    by_regs = (65536 // 4 // per_warp) * 4 // warps
    if per_warp * math.ceil(warps / 4) * 4 > 65536 or registers > 255:
        by_regs = 0
    by_smem = 233472 // (math.ceil((smem + 1024) / 128) * 128)
    blocks = min(32, 64 // warps, by_regs, by_smem)
    return blocks, blocks * warps / 64


# ----------------------------------------------------------------------------- CLI


@dataclasses.dataclass
class Variant:
    entry: str
    dtype: mx.Dtype
    shape: tuple[int, ...]
    plan: Plan
    generated: Generated


def variants(entries: Sequence[str], dtypes: Sequence[mx.Dtype],
             shapes: Sequence[tuple[int, ...]] | None) -> list[Variant]:
    """Each entry's plan for each dtype at its own shapes plus BIG_SHAPES (or at ``shapes``).

    MLX arrays are lazy and plans read only shapes and dtypes, so big shapes cost nothing."""
    out = []
    key = mx.random.key(0)
    for name in entries:
        entry = LIBRARY[name]
        pad = (1,) * max(0, entry.min_ndim - 2)  # rope wants (B, *, L, D)
        wanted = shapes or [*entry.shapes, *(pad + s for s in BIG_SHAPES)]
        for dtype in dtypes:
            for shape in wanted:
                shape = (1,) * max(0, entry.min_ndim - len(shape)) + tuple(shape)
                case = entry.make_inputs(shape, dtype, key)
                try:
                    plan = entry.plan(*case.args, **case.kwargs)
                except KernelError:  # a big shape past what the kernel takes (a few rows, 1024 experts)
                    if shapes or tuple(shape) in entry.shapes:
                        raise
                    continue
                out.append(Variant(name, dtype, shape, plan, generate_plan(plan)))
    return out


def _template_text(plan: Plan) -> str:
    return " ".join(t.describe() for t in plan.template
                    if t.name not in ("T", "EPS", "SCALE", "BASE", "LOG2_BASE", "IN_SCALE"))


def self_test(**options: Any) -> str | None:
    """Compile rms_norm with a broken body: None if NVRTC's error comes back, else what went wrong."""
    entry = LIBRARY["rms_norm"]
    case = entry.make_inputs((4, 64), mx.float32, mx.random.key(0))
    plan = entry.plan(*case.args, **case.kwargs)
    broken = dataclasses.replace(plan.kernel, cuda=f"{plan.kernel.cuda}\n  undeclared_thing += 1;\n")
    result = compile_plan(dataclasses.replace(plan, kernel=broken), **options)
    if result.ok or "undeclared_thing" not in result.log or "error" not in result.log:
        return f"a broken body was not reported: ok={result.ok} log={result.log[:300]!r}"
    return None


def _compile_safely(generated: Generated, dynamic_smem: int, options: dict[str, Any]) -> Result:
    try:
        return compile_source(generated, dynamic_smem=dynamic_smem, **options)
    except Exception as exc:  # an NVRTC API failure, not a compile error: report it as a failure
        return Result(False, f"{type(exc).__name__}: {exc}", name=generated.name)


_HEAD = (f"{'entry':<19}{'dtype':<9}{'shape':<17}{'template':<40}{'regs':>5}{'spill st/ld':>12}{'stack':>6}"
         f"{'smem':>6}{'block':>6}{'blk/SM':>7}{'occ':>6}  status")


def _row(v: Variant, r: Result, memory: bool = False) -> str:
    shape = "x".join(map(str, v.shape))
    text = f"{v.entry:<19}{dtype_name(v.dtype):<9}{shape:<17}{_template_text(v.plan):<40}"
    if not (r.ok and r.registers is not None and r.spills is not None and r.smem is not None):
        return f"{text}{'':>48}  FAILED"
    block = math.prod(min(t, g) for t, g in zip(v.plan.threadgroup, v.plan.grid))  # as MLX launches
    blocks, occ = occupancy(r.registers, r.smem, block)
    spills = f"{r.spills[0]}/{r.spills[1]}"
    status = "ok (ptxas and the CUBIN disagree)" if "nvrtc_check:" in r.log else "ok"
    row = (f"{text}{r.registers:>5}{spills:>12}{r.stack:>6}{r.smem:>6}{block:>6}{blocks:>7}{occ:>6.0%}"
           f"  {status}")
    return f"{row}  {accesses_text(r.cubin)}" if memory else row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("entries", nargs="*", help=f"LIBRARY entries (default: all of {', '.join(LIBRARY)})")
    parser.add_argument("-d", "--dtype", action="append", choices=[dtype_name(d) for d in DTYPES])
    big = ", ".join(",".join(map(str, s)) for s in BIG_SHAPES)
    parser.add_argument("-s", "--shape", action="append",
                        help=f"e.g. 8192,4096 (default: the entry's shapes plus {big})")
    parser.add_argument("--mlx-src", default="", help=f"MLX checkout or bare mirror (default: $MLX_SRC or "
                        f"{DEFAULT_MLX_SRC})")
    parser.add_argument("--mlx-rev", default="HEAD", help="revision of a bare mirror (default: HEAD)")
    parser.add_argument("--mlx-include", help="an mlx-cuda wheel's mlx/include (its bundled CCCL)")
    parser.add_argument("--cuda-root", help="another NVRTC: a folder with lib/libnvrtc.so.13 and include/ "
                        "(an unpacked nvidia/cu13 of other nvidia-cuda-nvrtc/-runtime wheels)")
    parser.add_argument("--unique", action="store_true", help="one row per distinct compiled kernel")
    parser.add_argument("--print-source", action="store_true", help="print each generated .cu source")
    parser.add_argument("--memory", action="store_true",
                        help="add each kernel's global loads and stores by width in bits, from its SASS "
                             f"(needs cuobjdump and nvdisasm: {_DISASSEMBLERS})")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="compiles at a time")
    args = parser.parse_args(argv)

    if args.cuda_root:
        os.environ["NVRTC_CUDA_ROOT"] = args.cuda_root  # also for the worker processes
    unknown = [e for e in args.entries if e not in LIBRARY]
    if unknown:
        parser.error(f"unknown entries {unknown}; known: {', '.join(LIBRARY)}")
    dtypes = [getattr(mx, d) for d in args.dtype] if args.dtype else list(DTYPES)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape] if args.shape else None
    options = {"mlx_src": args.mlx_src, "mlx_rev": args.mlx_rev, "mlx_include": args.mlx_include}
    mlx_headers(args.mlx_src, args.mlx_rev)  # fail early without MLX's headers

    todo = variants(args.entries or list(LIBRARY), dtypes, shapes)
    distinct = {v.generated: v.plan.kernel.shared_memory for v in todo}
    src = args.mlx_src or os.environ.get("MLX_SRC", DEFAULT_MLX_SRC)
    print(f"NVRTC {nvrtc_version()}, {ARCH}, {len(todo)} variants, {len(distinct)} distinct kernels; MLX "
          f"device headers from {src}@{args.mlx_rev}; {' '.join(include_args(args.mlx_include))}", flush=True)
    # NVRTC compiles one program at a time in a process: compile in processes
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        futures = {g: pool.submit(_compile_safely, g, smem, options) for g, smem in distinct.items()}
        results = {g: f.result() for g, f in futures.items()}

    print(f"{_HEAD}\n{'-' * len(_HEAD)}")
    seen: set[Generated] = set()
    for v in todo:
        if not (args.unique and v.generated in seen):
            print(_row(v, results[v.generated], args.memory))
            if args.print_source:
                print(v.generated.source)
        seen.add(v.generated)
    failed = {g: r for g, r in results.items() if not r.ok}
    for g, r in failed.items():
        print(f"\n=== {g.name} failed to compile:\n{r.log}")
    problem = self_test(**options)
    print(f"\nself-test (a broken body must fail with NVRTC's error): {problem or 'ok'}")
    print(f"{len(results) - len(failed)} of {len(results)} distinct kernels compiled")
    return 1 if failed or problem else 0


if __name__ == "__main__":
    sys.exit(main())
