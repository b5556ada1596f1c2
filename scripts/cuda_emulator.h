// A CPU stand-in for the CUDA device code graphkern's kernels use, so that their bodies, as MLX's
// cuda_kernel writes them, compile with a host C++ compiler and run (scripts/cuda_emulate.py).
//
// Every CUDA thread of a block is a fiber (ucontext) on one host thread, run until it reaches a
// barrier: __syncthreads waits for the block's live threads, a warp shuffle for its warp's lanes
// in the mask. Blocks run one after another, so a __shared__ variable (made a function static)
// is one per block at a time. A barrier no thread can get past (a __syncthreads some threads
// never reach, a shuffle with a lane that exited or waits elsewhere) is reported as an error, as
// is a misaligned __ldg or any other access through a pointer off its type's alignment (the
// translation unit is compiled with -fsanitize=alignment, whose check calls the handler defined
// here: a vector load or store that faults on a GPU fails the launch). Arithmetic is the host's:
// float math in float (the fast intrinsics at full precision), 16-bit types rounded to nearest
// even.
#pragma once

#include <math.h>
#include <ucontext.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __grid_constant__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static thread_local  // one a block at a time, and a host thread

#ifndef MAX_NDIM
#define MAX_NDIM 10
#endif

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3() = default;
  dim3(unsigned x_, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace gk_emu {

struct Fault {
  std::string what;
};

enum class State { runnable, at_block_barrier, at_warp_barrier, done };

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  dim3 index;
  int linear = 0;
  State state = State::runnable;
  unsigned warp_mask = 0;  // the lanes a warp barrier waits for
  unsigned shuffles = 0;   // this lane's shuffles so far: which exchange slots it uses
};

struct Launch {
  dim3 grid, block, block_index;
  std::vector<Fiber> fibers;
  std::vector<unsigned char> dynamic_shared;
  // two exchange slots a lane: a lane can be at most one shuffle ahead of its warp's others
  std::vector<std::array<uint64_t, 2>> slots;
  std::function<void()> body;
  ucontext_t scheduler;
  Fiber* current = nullptr;
  std::string fault;
};

inline Launch*& launch_state() {
  static thread_local Launch* state = nullptr;  // a launch a host thread
  return state;
}

inline Fiber& self() { return *launch_state()->current; }

inline void fail(const std::string& what) {
  Launch& l = *launch_state();
  if (l.fault.empty()) {
    char where[96];
    std::snprintf(where, sizeof where, " (block %u,%u,%u thread %u,%u,%u)", l.block_index.x,
                  l.block_index.y, l.block_index.z, self().index.x, self().index.y, self().index.z);
    l.fault = what + where;
  }
  throw Fault{what};
}

inline void yield_to_scheduler() {
  Launch& l = *launch_state();
  swapcontext(&l.current->context, &l.scheduler);
}

inline void entry() {
  Launch& l = *launch_state();
  try {
    l.body();
  } catch (const Fault&) {
  }
  l.current->state = State::done;
  swapcontext(&l.current->context, &l.scheduler);
}

inline int lane_of(const Fiber& f) { return f.linear & 31; }
inline int warp_of(const Fiber& f) { return f.linear >> 5; }

// Releases the barriers every live participant has reached; false when none could be.
inline bool release(Launch& l) {
  bool released = false;
  bool all_at_block = true;
  bool any_at_block = false;
  for (Fiber& f : l.fibers) {
    if (f.state == State::done) continue;
    if (f.state == State::at_block_barrier) {
      any_at_block = true;
    } else {
      all_at_block = false;
    }
  }
  if (any_at_block && all_at_block) {
    for (Fiber& f : l.fibers) {
      if (f.state == State::at_block_barrier) f.state = State::runnable;
    }
    released = true;
  }
  const int warps = static_cast<int>((l.fibers.size() + 31) / 32);
  for (int w = 0; w < warps; ++w) {
    unsigned waiting = 0, mask = 0;
    bool blocked = false;
    for (int lane = 0; lane < 32 && w * 32 + lane < static_cast<int>(l.fibers.size()); ++lane) {
      Fiber& f = l.fibers[w * 32 + lane];
      if (f.state == State::at_warp_barrier) {
        waiting |= 1u << lane;
        mask |= f.warp_mask;
      }
    }
    if (!waiting) continue;
    for (int lane = 0; lane < 32; ++lane) {
      if (!(mask >> lane & 1u)) continue;
      const int at = w * 32 + lane;
      if (at >= static_cast<int>(l.fibers.size()) || l.fibers[at].state == State::done) {
        // a lane the shuffle names has exited (or does not exist): nothing to read from it
        blocked = true;
        break;
      }
      if (!(waiting >> lane & 1u)) blocked = true;  // still on its way, or at another barrier
    }
    if (blocked) continue;
    for (int lane = 0; lane < 32; ++lane) {
      if (waiting >> lane & 1u) l.fibers[w * 32 + lane].state = State::runnable;
    }
    released = true;
  }
  return released;
}

inline std::string run_block(Launch& l) {
  const int n = static_cast<int>(l.block.x * l.block.y * l.block.z);
  l.fibers.resize(n);
  l.slots.assign(n, {0, 0});
  for (int i = 0; i < n; ++i) {
    Fiber& f = l.fibers[i];
    f.linear = i;
    f.index = dim3(i % l.block.x, (i / l.block.x) % l.block.y, i / (l.block.x * l.block.y));
    f.state = State::runnable;
    f.shuffles = 0;
    if (f.stack.empty()) f.stack.resize(256 * 1024);
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.data();
    f.context.uc_stack.ss_size = f.stack.size();
    f.context.uc_link = nullptr;
    makecontext(&f.context, entry, 0);
  }
  for (;;) {
    bool ran = false;
    for (Fiber& f : l.fibers) {
      if (f.state != State::runnable) continue;
      l.current = &f;
      swapcontext(&l.scheduler, &f.context);
      ran = true;
      if (!l.fault.empty()) return l.fault;
    }
    bool finished = true;
    for (const Fiber& f : l.fibers) finished = finished && f.state == State::done;
    if (finished) return "";
    if (!release(l) && !ran) {
      return "deadlock: a __syncthreads or warp shuffle that not every thread it waits for reaches";
    }
  }
}

inline std::string run(dim3 grid, dim3 block, size_t dynamic_shared, std::function<void()> body) {
  Launch l;
  l.grid = grid;
  l.block = block;
  l.body = std::move(body);
  l.dynamic_shared.assign(dynamic_shared + 16, 0xff);
  launch_state() = &l;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        l.block_index = dim3(x, y, z);
        std::string fault = run_block(l);
        if (!fault.empty()) {
          launch_state() = nullptr;
          return fault;
        }
      }
    }
  }
  launch_state() = nullptr;
  return "";
}

inline void* dynamic_shared() {
  Launch& l = *launch_state();
  uintptr_t p = reinterpret_cast<uintptr_t>(l.dynamic_shared.data());
  return reinterpret_cast<void*>((p + 15) & ~uintptr_t(15));
}

template <typename T>
T shuffle(unsigned mask, T value, int source) {
  static_assert(sizeof(T) <= 8, "a shuffled value is at most 8 bytes");
  Launch& l = *launch_state();
  Fiber& me = self();
  const int lane = lane_of(me);
  if (!(mask >> lane & 1u)) fail("a warp shuffle from a lane outside its mask");
  const int slot = me.shuffles++ & 1;
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  l.slots[me.linear][slot] = bits;
  me.warp_mask = mask;
  me.state = State::at_warp_barrier;
  yield_to_scheduler();
  source &= 31;
  if (!(mask >> source & 1u)) source = lane;  // CUDA: a lane outside the mask reads its own value
  T out;
  std::memcpy(&out, &l.slots[warp_of(me) * 32 + source][slot], sizeof(T));
  return out;
}

template <typename T>
void check_aligned(const T* p) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0) fail("a misaligned vector access");
}

}  // namespace gk_emu

// UBSan's entry point for a type mismatch, defined here instead of linking its runtime: with
// -fsanitize=alignment alone, every call is an access off its type's alignment.
extern "C" void __ubsan_handle_type_mismatch_v1(void*, uintptr_t) {
  gk_emu::fail("a misaligned vector access");
}

#define threadIdx (gk_emu::self().index)
#define blockIdx (gk_emu::launch_state()->block_index)
#define blockDim (gk_emu::launch_state()->block)
#define gridDim (gk_emu::launch_state()->grid)
constexpr int warpSize = 32;

inline void __syncthreads() {
  gk_emu::self().state = gk_emu::State::at_block_barrier;
  gk_emu::yield_to_scheduler();
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)gk_emu::shuffle(mask, 0, 0); }

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  (void)width;
  return gk_emu::shuffle(mask, value, (gk_emu::self().linear & 31) ^ lane_mask);
}
template <typename T>
T __shfl_sync(unsigned mask, T value, int source, int width = 32) {
  (void)width;
  return gk_emu::shuffle(mask, value, source);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  (void)width;
  const int lane = gk_emu::self().linear & 31;
  return gk_emu::shuffle(mask, value, lane + static_cast<int>(delta) < 32 ? lane + delta : lane);
}

// ------------------------------------------------------------------------------- bits and math

inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline int __float_as_int(float f) { int v; std::memcpy(&v, &f, 4); return v; }
inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t bytes = (static_cast<uint64_t>(y) << 32) | x;
  unsigned out = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned sel = (s >> (4 * i)) & 7u;
    out |= static_cast<unsigned>((bytes >> (8 * sel)) & 0xffu) << (8 * i);
  }
  return out;
}
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }

template <typename T>
T __ldg(const T* p) {
  gk_emu::check_aligned(p);
  return *p;
}

struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) int4 { int x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

// ------------------------------------------------------------------------------- 16-bit floats

namespace gk_emu {

inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace gk_emu

struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  template <typename V, typename = std::enable_if_t<std::is_arithmetic_v<V>>>
  __nv_bfloat16(V v) : bits(gk_emu::bf16_bits(static_cast<float>(v))) {}
  operator float() const { return gk_emu::bf16_value(bits); }
};

struct __half {
  _Float16 value;
  __half() = default;
  template <typename V, typename = std::enable_if_t<std::is_arithmetic_v<V>>>
  __half(V v) : value(static_cast<_Float16>(static_cast<float>(v))) {}
  operator float() const { return static_cast<float>(value); }
};

inline float __bfloat162float(__nv_bfloat16 v) { return static_cast<float>(v); }
inline __nv_bfloat16 __float2bfloat16(float v) { return __nv_bfloat16(v); }
inline float __half2float(__half v) { return static_cast<float>(v); }
inline __half __float2half(float v) { return __half(v); }

// ------------------------------------------------------------------------------- MLX's device types

namespace mlx::core::cu {
using Shape = std::array<int32_t, MAX_NDIM>;
using Strides = std::array<int64_t, MAX_NDIM>;
}  // namespace mlx::core::cu
using mlx::core::cu::Shape;
using mlx::core::cu::Strides;

namespace cooperative_groups {}
