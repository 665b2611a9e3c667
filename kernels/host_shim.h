// Lets terngrad.cu (beside this file) compile as ordinary C++ for the host: the CUDA built-ins become
// globals that host_launch.cpp sets while it runs every (block, thread) of a launch in turn.  Used only
// by tests (and by the host kernel build, backends/host_build.py) to check the kernel source without a GPU.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#define TG_HOST_EMULATION 1
typedef int64_t tg_i64;
typedef uint64_t tg_u64;
typedef uint32_t tg_u32;
typedef uint16_t tg_u16;
typedef uint8_t tg_u8;
#define TG_EXTERN static
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict

struct tg_dim3 { unsigned x, y, z; };
// thread_local: ranks on threads (tests/test_kernels.py) launch host kernels at the same time (ctypes drops the GIL)
static thread_local tg_dim3 threadIdx, blockIdx, blockDim, gridDim;

// CUDA's built-in vector types (only the members the kernels use) and bit casts.
struct float4 { float x, y, z, w; };
struct uint2 { tg_u32 x, y; };
static inline tg_u32 __float_as_uint(float f) { tg_u32 u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(tg_u32 u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline int __popc(tg_u32 x) { return __builtin_popcount(x); }
// Round-to-nearest fp32 arithmetic: the host's own IEEE operations (g++ -ffp-contract=off: never fused).
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline long long __double_as_longlong(double d) { long long u; std::memcpy(&u, &d, 8); return u; }
// Threads run one after another here, so a plain read-modify-write is the atomic operation.
static inline tg_u32 atomicMax(tg_u32 *addr, tg_u32 v) { tg_u32 old = *addr; if (v > old) *addr = v; return old; }

template <typename F>
static void tg_host_launch(unsigned grid, unsigned block, F body) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned b = 0; b < grid; b++)
        for (unsigned t = 0; t < block; t++) {
            blockIdx = {b, 0, 0};
            threadIdx = {t, 0, 0};
            body();
        }
}
