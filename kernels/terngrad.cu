// TernGrad CUDA kernels (loaded with cupy.RawModule by backends/cuda.py; also compiled for the host
// through host_launch.cpp beside this file, which emulates the launch with loops: backends/host_build.py).
//
// They evaluate exactly the operations the reference codec (horovod_terngrad/codec) specifies, so the
// bytes are identical to the CPU paths:
//   statistics   fp64 sums in blocks of 2048 elements, 32 interleaved lanes per block (one warp:
//                coalesced reads) summed sequentially; all lane partials then reduced level by level,
//                groups of 8 values combined as ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)) (zero-padded);
//                max |g| by atomicMax on the bits of non-negative floats (which order like unsigned ints).
//   ternarize    c = clamp(g, -thr, thr); keep = (float)(h >> 8) < (|c| / s) * 2^24,
//                h = mix32(mix32(lo ^ k0) ^ hi ^ k1) over the 64-bit element index hi:lo.
//   pack         code 0 (t = 0), 1 (t = +1), 2 (t = -1); 2bit: 4 codes per byte, code q in bits 2q..2q+1;
//                base3: 5 codes per byte as sum code_q * 3^q.
//   decode       shared scalers: ((float)k * s) / divisor, k = sum of ternary values (exact integer);
//                otherwise (sum over payloads, in order, of v * s_p) / divisor in fp32.
// Compile with --fmad=false and without fast math: no contraction may change a rounding.
// Every kernel uses 64-bit indices and a grid-stride loop, so any grid size covers any n.
// No shared memory, no __syncthreads and no warp shuffles: each thread is independent, which is what
// lets the host emulation run the very same source.

#ifndef TG_HOST_EMULATION
typedef long long tg_i64;
typedef unsigned long long tg_u64;
typedef unsigned int tg_u32;
typedef unsigned char tg_u8;
#define TG_EXTERN extern "C"
#endif

#define TG_STATS_BLOCK 2048
#define TG_LANES 32

__device__ __forceinline__ tg_u32 tg_mix32(tg_u32 x) {
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
    return x;
}

__device__ __forceinline__ tg_i64 tg_tid() { return (tg_i64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ tg_i64 tg_stride() { return (tg_i64)gridDim.x * blockDim.x; }

// (a) statistics, stage 1: per (block, lane) sequential fp64 sums; whole-tensor max |g| bits.
TG_EXTERN __global__ void tg_stats_lanes(const float *__restrict__ g, tg_i64 n, double *__restrict__ lane_sum,
                                         double *__restrict__ lane_sq, tg_u32 *__restrict__ maxbits) {
    const tg_i64 nlanes = ((n + TG_STATS_BLOCK - 1) / TG_STATS_BLOCK) * TG_LANES;
    for (tg_i64 t = tg_tid(); t < nlanes; t += tg_stride()) {
        const tg_i64 base = (t / TG_LANES) * TG_STATS_BLOCK + (t % TG_LANES);
        double s = 0.0, q = 0.0;
        float m = 0.0f;
        for (int j = 0; j < TG_STATS_BLOCK / TG_LANES; j++) {
            const tg_i64 i = base + (tg_i64)j * TG_LANES;
            if (i >= n) break;
            const float a = g[i];
            const double v = (double)a;
            s += v;
            q += v * v;
            const float fa = fabsf(a);
            m = fa > m ? fa : m;
        }
        lane_sum[t] = s;
        lane_sq[t] = q;
        atomicMax(maxbits, __float_as_uint(m));
    }
}

// (a) statistics, stage 2 (run level by level): out[k] = sum8(in[8k .. 8k+7]), zero-padded.
TG_EXTERN __global__ void tg_sum8(const double *__restrict__ in, tg_i64 m, double *__restrict__ out) {
    const tg_i64 groups = (m + 7) / 8;
    for (tg_i64 k = tg_tid(); k < groups; k += tg_stride()) {
        double x[8];
        for (int j = 0; j < 8; j++) x[j] = 8 * k + j < m ? in[8 * k + j] : 0.0;
        out[k] = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
    }
}

// (a) statistics, optional: max |g| per bucket of `bucket` elements.
TG_EXTERN __global__ void tg_bucket_max(const float *__restrict__ g, tg_i64 n, tg_i64 bucket,
                                        float *__restrict__ maxabs) {
    const tg_i64 nb = (n + bucket - 1) / bucket;
    for (tg_i64 k = tg_tid(); k < nb; k += tg_stride()) {
        const tg_i64 lo = k * bucket, hi = lo + bucket < n ? lo + bucket : n;
        float m = 0.0f;
        for (tg_i64 i = lo; i < hi; i++) {
            const float a = fabsf(g[i]);
            m = a > m ? a : m;
        }
        maxabs[k] = m;
    }
}

__device__ __forceinline__ tg_u32 tg_code(const float *__restrict__ g, tg_i64 i, float thr, float s,
                                          tg_u32 k0, tg_u32 k1) {
    float c = g[i];
    c = c > thr ? thr : c;
    c = c < -thr ? -thr : c;
    const tg_u32 h = tg_mix32(tg_mix32((tg_u32)((tg_u64)i & 0xFFFFFFFFULL) ^ k0) ^ (tg_u32)((tg_u64)i >> 32) ^ k1);
    const float p = fabsf(c) / s;
    const bool keep = (float)(int)(h >> 8) < p * 16777216.0f;
    return keep ? (c > 0.0f ? 1u : (c < 0.0f ? 2u : 0u)) : 0u;
}

// Bucket index of every element of packed byte b: one 64-bit division per byte, then steps.  64-bit division
// is a long instruction sequence on a GPU; it used to run per element, and per payload in the decode (not yet
// timed on a GPU).  With bucket <= 0 (one scaler per tensor) every index is 0.
__device__ __forceinline__ void tg_bucket_of(tg_i64 b, int per, tg_i64 bucket, tg_i64 *__restrict__ kq) {
    if (bucket <= 0) {
        for (int q = 0; q < per; q++) kq[q] = 0;
        return;
    }
    tg_i64 i = b * per, k = i / bucket, next = (k + 1) * bucket;
    for (int q = 0; q < per; q++, i++) {
        if (i >= next) { k++; next += bucket; }     // i moves by one: at most one boundary per element
        kq[q] = k;
    }
}

// (b) fused clip + stochastic ternarize + pack. thr and scalers live in device memory (no host sync).
TG_EXTERN __global__ void tg_ternarize_pack(const float *__restrict__ g, tg_i64 n, const float *__restrict__ thr_p,
                                            const float *__restrict__ scalers, tg_i64 bucket, tg_u32 k0, tg_u32 k1,
                                            int fmt, tg_u8 *__restrict__ out) {
    const int per = fmt == 1 ? 4 : 5;
    const tg_i64 nbytes = (n + per - 1) / per;
    const float thr = *thr_p;
    for (tg_i64 b = tg_tid(); b < nbytes; b += tg_stride()) {
        tg_u32 byte = 0, mul = 1;
        tg_i64 kq[5];
        tg_bucket_of(b, per, bucket, kq);
        for (int q = 0; q < per; q++) {
            const tg_i64 i = b * per + q;
            tg_u32 code = 0;
            if (i < n) code = tg_code(g, i, thr, scalers[kq[q]], k0, k1);
            if (fmt == 1) byte |= code << (2 * q);
            else { byte += code * mul; mul *= 3; }
        }
        out[b] = (tg_u8)byte;
    }
}

__device__ __forceinline__ int tg_value(tg_u32 byte, int q, int fmt) {
    tg_u32 code;
    if (fmt == 1) code = (byte >> (2 * q)) & 3u;
    else {
        if (byte > 242u) return 0;
        tg_u32 x = byte;
        for (int r = 0; r < q; r++) x /= 3u;
        code = x % 3u;
    }
    return code == 1u ? 1 : (code == 2u ? -1 : 0);
}

// (c) fused unpack + scale + accumulate of npay payloads into the average.
//     packed[p] = gathered + packed_off[p]; scalers is [npay, nb] fp32; *shared != 0 when every
//     payload carries the same scalers (decided on the device: no host sync).
TG_EXTERN __global__ void tg_decode(const tg_u8 *__restrict__ gathered, const tg_i64 *__restrict__ packed_off,
                                    int npay, tg_i64 n, int fmt, const float *__restrict__ scalers, tg_i64 nb,
                                    tg_i64 bucket, const int *__restrict__ shared, float divisor,
                                    float *__restrict__ out) {
    const int per = fmt == 1 ? 4 : 5;
    const tg_i64 nbytes = (n + per - 1) / per;
    const bool same = *shared != 0;
    for (tg_i64 b = tg_tid(); b < nbytes; b += tg_stride()) {
        int k[5] = {0, 0, 0, 0, 0};
        float acc[5] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        tg_i64 kq[5];
        tg_bucket_of(b, per, bucket, kq);    // past the end (i >= n) an index may be nb: never read below
        for (int p = 0; p < npay; p++) {
            const tg_u32 byte = gathered[packed_off[p] + b];
            for (int q = 0; q < per; q++) {
                const int v = tg_value(byte, q, fmt);
                if (same) k[q] += v;
                else if (b * per + q < n) {
                    acc[q] = acc[q] + (float)v * scalers[(tg_i64)p * nb + kq[q]];
                }
            }
        }
        for (int q = 0; q < per; q++) {
            const tg_i64 i = b * per + q;
            if (i >= n) break;
            const float s0 = scalers[kq[q]];
            out[i] = same ? ((float)k[q] * s0) / divisor : acc[q] / divisor;
        }
    }
}
