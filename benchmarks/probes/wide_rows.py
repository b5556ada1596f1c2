"""Probe: the last rows below stock. (1) float32 SwiGLU, 0.98-0.99x a compiled ``nn.silu(g) * u``:
is it the launch? MLX's compiled elementwise kernels take 16 bytes a thread in blocks of the
kernel's largest size (1024; ``mlx/backend/cuda/compiled.cpp``, ``get_launch_args``); the library
takes 16 bytes in blocks of 256. Times every block of 128-1024 threads with 16- and 32-byte
vectors. (2) float32 softmax on 16384-wide rows, 0.97x ``mx.softmax``: both read each row twice
(the second read mostly from L2). A variant keeps the row in dynamic shared memory (64 KiB a
block, three blocks an SM), so it reads DRAM once.
(3) ``shared16``: the library's shared-memory softmax on bfloat16 rows (where it was not chosen).
(4) ``small-blocks``: float32 SwiGLU in blocks of 32-256.
Run from the checkout: python benchmarks/probes/wide_rows.py [shared16 | small-blocks]
"""

import statistics
import sys
from dataclasses import replace

sys.path.insert(0, "benchmarks")

import mlx.core as mx
import mlx.nn as nn
from gpu_kernels import _gpu_time

from graphkern.kernels._base import Plan, run
from graphkern.kernels._headers import dual_header
from graphkern.kernels.ops import softmax as S
from graphkern.kernels.ops import swiglu as W
from graphkern.nodes import TemplateArg

ROUNDS = 5


def report(title: str, times: dict[str, list[float]], errors: dict[str, float]) -> None:
    print(title, flush=True)
    for name, us in times.items():
        print(f"  {name:34} median {statistics.median(us):7.1f} us  min {min(us):7.1f}"
              f"  err {errors.get(name, 0.0):.3g}", flush=True)


def swiglu_launches(shape: tuple[int, int], dt: mx.Dtype, blocks: tuple[int, ...] = (128, 256, 512, 1024),
                    widths: tuple[int, ...] = (1, 2)) -> None:
    g = (2.0 * mx.random.normal(shape, key=mx.random.key(0))).astype(dt)
    u = mx.random.normal(shape, key=mx.random.key(1)).astype(dt)
    mx.eval(g, u)
    ref = (nn.silu(g.astype(mx.float32)) * u.astype(mx.float32))
    base = W.plan_swiglu(g, u)
    v0 = base.template_values["V"]
    forms: dict[str, object] = {"stock (compiled)": mx.compile(lambda s: (nn.silu(s[0]) * s[1], s[1]))}
    for v in (v0 * w for w in widths):
        for block in blocks:
            template = tuple(replace(t, value=v) if t.name == "V" else t for t in base.template)
            plan = replace(base, grid=(g.size // v, 1, 1), threadgroup=(block, 1, 1), template=template)
            forms[f"V{v} block {block}"] = plan
    times: dict[str, list[float]] = {name: [] for name in forms}
    errors = {}
    for name, form in forms.items():
        if isinstance(form, Plan):
            errors[name] = mx.abs(run(form)[0].astype(mx.float32) - ref).max().item()
    for _ in range(ROUNDS):
        for name, form in forms.items():
            step = (lambda s, p=form: (run(replace(p, inputs=s))[0], s[1])) if isinstance(form, Plan) \
                else form
            times[name].append(_gpu_time(step, (g, u)) * 1e6)
    report(f"swiglu {dt} {shape}", times, errors)


SMEM_CUDA = r"""
namespace gk {

// The row goes to dynamic shared memory as it is read (U vectors in flight a thread), with the
// online max and sum; the output pass reads it back from there, not from L2 or DRAM.
template <typename T, int NT, int V, int U>
__device__ __forceinline__ void softmax_row_smem(const T* __restrict__ x, T* __restrict__ out, int n) {
  extern __shared__ __align__(16) unsigned char gk_row[];
  __shared__ float red[32];
  using VT = Vec<T, V>;
  VT* buf = reinterpret_cast<VT*>(gk_row);
  const VT* src = reinterpret_cast<const VT*>(x);
  const int nv = n / V;
  float m = Max::identity();
  float s = 0.0f;
  for (int k0 = threadIdx.x; k0 < nv; k0 += NT * U) {
    VT r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + u * NT;
      if (k < nv) {
        r[u] = src[k];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + u * NT;
      if (k < nv) {
        buf[k] = r[u];
        float v[V];
        unpack<T, V>(r[u], v);
        float cm = v[0];
#pragma unroll
        for (int j = 1; j < V; ++j) {
          cm = fmaxf(cm, v[j]);
        }
        if (cm > m) {
          s *= __expf(m - cm);
          m = cm;
        }
#pragma unroll
        for (int j = 0; j < V; ++j) {
          s += __expf(v[j] - m);
        }
      }
    }
  }
  const float gm = block_max<NT>(m, red);
  const float inv = 1.0f / block_sum<NT>(s * __expf(m - gm), red);
  VT* dst = reinterpret_cast<VT*>(out);
  for (int k = threadIdx.x; k < nv; k += NT) {
    float v[V];
    unpack<T, V>(buf[k], v);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      v[j] = __expf(v[j] - gm) * inv;
    }
    dst[k] = pack<T, V>(v);
  }
}

}  // namespace gk
"""

SMEM_BODY = r"""
  const int n = x_shape[x_ndim - 1];
  const long long off = static_cast<long long>(blockIdx.x) * n;
  gk::softmax_row_smem<T, NT, V, U>(x + off, out + off, n);
"""


def softmax_smem_plan(x: mx.array, threads: int, v: int, u: int) -> Plan:
    n = x.shape[-1]
    kernel = replace(S.SOFTMAX, name=f"gk_softmax_smem_{n}", cuda=SMEM_BODY,
                     header=dual_header(S._CUDA + SMEM_CUDA, ""), shared_memory=n * x.dtype.size)
    rows = x.size // n
    template = (TemplateArg.dtype("T", x.dtype), TemplateArg.int("NT", threads), TemplateArg.int("V", v),
                TemplateArg.int("U", u))
    specs = S.plan_softmax(x).output_specs
    return Plan(kernel, (x,), specs, (rows * threads, 1, 1), (threads, 1, 1), template)


def softmax_smem(shape: tuple[int, int], dt: mx.Dtype) -> None:
    x = (4.0 * mx.random.normal(shape, key=mx.random.key(0))).astype(dt)
    mx.eval(x)
    ref = mx.softmax(x.astype(mx.float32), axis=-1)
    forms: dict[str, object] = {"stock mx.softmax": mx.compile(lambda a: mx.softmax(a, axis=-1)),
                                "library": S.plan_softmax(x)}
    for threads in (256, 512, 1024):
        for u in (1, 2, 4):
            forms[f"smem NT{threads} V4 U{u}"] = softmax_smem_plan(x, threads, 4, u)
    times: dict[str, list[float]] = {name: [] for name in forms}
    errors = {}
    for name, form in forms.items():
        if isinstance(form, Plan):
            errors[name] = mx.abs(run(form)[0].astype(mx.float32) - ref).max().item()
    for _ in range(ROUNDS):
        for name, form in forms.items():
            step = (lambda a, p=form: run(replace(p, inputs=(a,)))[0]) if isinstance(form, Plan) else form
            times[name].append(_gpu_time(step, x) * 1e6)
    report(f"softmax {dt} {shape}", times, errors)


def softmax_shared_16bit(shape: tuple[int, int], dt: mx.Dtype) -> None:
    """The library's shared-memory softmax (float32 only) on 16-bit rows, against its streamed one."""
    x = (4.0 * mx.random.normal(shape, key=mx.random.key(0))).astype(dt)
    mx.eval(x)
    ref = mx.softmax(x.astype(mx.float32), axis=-1)
    forms = {"stock mx.softmax": mx.compile(lambda a: mx.softmax(a, axis=-1)),
             "library (streamed)": S._plan(x, False), "library shared": S._plan(x, True)}
    times: dict[str, list[float]] = {name: [] for name in forms}
    errors = {name: mx.abs(run(form)[0].astype(mx.float32) - ref).max().item()
              for name, form in forms.items() if isinstance(form, Plan)}
    for _ in range(ROUNDS):
        for name, form in forms.items():
            step = (lambda a, p=form: run(replace(p, inputs=(a,)))[0]) if isinstance(form, Plan) else form
            times[name].append(_gpu_time(step, x) * 1e6)
    report(f"softmax {dt} {shape}", times, errors)


if __name__ == "__main__" and sys.argv[1:] == ["small-blocks"]:
    for shape in ((8192, 4096), (16384, 8192), (4096, 16384)):
        swiglu_launches(shape, mx.float32, blocks=(32, 64, 128, 256), widths=(1,))
elif __name__ == "__main__" and sys.argv[1:] == ["shared16"]:
    for shape in ((8192, 4096), (4096, 16384)):
        softmax_shared_16bit(shape, mx.bfloat16)
elif __name__ == "__main__":
    for shape in ((8192, 4096), (4096, 16384)):
        softmax_smem(shape, mx.float32)
    for shape in ((8192, 4096), (16384, 8192)):
        swiglu_launches(shape, mx.float32)
    swiglu_launches((8192, 4096), mx.bfloat16)
