// TernGrad CUDA kernels (loaded with cupy.RawModule by backends/cuda.py; also compiled for the host
// through host_launch.cpp beside this file, which emulates the launch with loops: backends/host_build.py).
//
// They evaluate exactly the operations the reference codec (horovod_terngrad/codec) specifies, so the
// bytes are identical to the CPU paths:
//   statistics   fp64 sums in blocks of 2048 elements, 32 interleaved lanes per block summed sequentially;
//                all lane partials then reduced level by level, groups of 8 values combined as
//                ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)) (zero-padded).  One thread sums 8 adjacent lanes (its
//                reads: 8 consecutive elements per step, 32 bytes of fp32) and writes their group of 8, the
//                tree's first level, with the max |g| of its elements beside it: no atomics.
//   threshold    the last tree launch computes c·σ and the scalers as codec.clip_threshold / local_scalers
//                do, in the same IEEE operations (fp64 mean, variance clamped at 0, sqrt, fp32 rounding).
//   ternarize    c = clamp(g, -thr, thr); keep = (float)(h >> 8) < (|c| / s) * 2^24,
//                h = mix32(mix32(lo ^ k0) ^ hi ^ k1) over the 64-bit element index hi:lo.
//   pack         code 0 (t = 0), 1 (t = +1), 2 (t = -1); 2bit: 4 codes per byte, code q in bits 2q..2q+1;
//                base3: 5 codes per byte as sum code_q * 3^q.
//   levels       the four-level code (codec/levels.py, format byte 3, 2bit's layout): y = (c / s + 1) * 1.5,
//                L = min(floor(y), 2), code = L + ((float)(2^24 - 1 - u) < (y - L) * 2^24) (0 where !(s > 0)),
//                u the rank's stratified 24-bit dither.
//   decode       shared scalers (ternary only): ((float)k * s) / divisor, k = sum of ternary values (exact
//                integer); otherwise (sum over payloads, in order, of v * s_p) / divisor in fp32, v the ternary
//                value or the four-level code's level / s in {-1, -1/3, 1/3, 1}.
// bf16 gradients are read as they are (bf16 -> fp32 is exact: the bits shifted up by 16), so a bf16 tensor
// gives the bytes its fp32 copy gives.
//
// Bytes moved per element (backends/cuda.py: traffic), in = 4 (fp32) or 2 (bf16), codes = 1/4 (2bit), 1/5 (base3):
//   tg_stats_*          reads in                 (+ 20 bytes per 512 elements of partials)
//   tg_tree             reads and writes the partials: 20 bytes per 512 elements, then 1/8 of that per level
//   tg_bucket_max_*     reads in                 (bucketed scalers only)
//   tg_pack_*           reads in, writes codes
//   tg_levels_pack_*    reads in, writes codes (1/4)
//   compress            2·in + codes             (fp32 2bit: 8.25; bucketed: 3·in + codes)
//   tg_decode           reads payloads·codes, writes 4
//   tg_owner_sums       reads N·codes, writes bits/8 (bits = ceil(log2(2N+1)))
//   tg_decode_sums      reads bits/8, writes 4
//   tg_requant_encode   reads 4 (the group twice, from cache the second time), writes 1/2 (+ the noise channel:
//                       reads 4 more, writes 1/8)
//   tg_requant_decode   reads 1/2 (+ 1/8), writes 4 (+ 4)
//
// Each thread of the two big kernels handles one 32-bit word of packed codes (16 elements in 2bit, 20 in
// base3): one bucket division per word, vector loads (float4 for fp32, 8 bytes for bf16) where the tensor
// is aligned for them, one 32-bit store of the codes (decode: one 32-bit load per payload, float4 stores).
// Unaligned pointers and the ragged end take element-wise paths with the same arithmetic.
// Compile with --fmad=false and without fast math: no contraction may change a rounding.
// Every kernel uses 64-bit indices and a grid-stride loop, so any grid size covers any n.
// No shared memory, no __syncthreads and no warp shuffles: each thread is independent (atomics only to
// combine maxima, which are exact in any order), which is what lets the host emulation run the very same source.

#ifndef TG_HOST_EMULATION
typedef long long tg_i64;
typedef unsigned long long tg_u64;
typedef unsigned int tg_u32;
typedef unsigned short tg_u16;
typedef unsigned char tg_u8;
#define TG_EXTERN extern "C"
#endif

#define TG_STATS_BLOCK 2048
#define TG_LANES 32
#define TG_OCTETS (TG_LANES / 8)   // groups of 8 lanes per block: one thread each

__device__ __forceinline__ tg_u32 tg_mix32(tg_u32 x) {
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
    return x;
}

__device__ __forceinline__ tg_i64 tg_tid() { return (tg_i64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ tg_i64 tg_stride() { return (tg_i64)gridDim.x * blockDim.x; }

// a / b for a >= 0, b > 0: 32-bit division (a short sequence on a GPU) whenever both fit, which is always
// below 2^32 elements; 64-bit division otherwise.
__device__ __forceinline__ tg_i64 tg_div(tg_i64 a, tg_i64 b) {
    if ((((tg_u64)a | (tg_u64)b) >> 32) == 0) return (tg_i64)((tg_u32)a / (tg_u32)b);
    return a / b;
}

__device__ __forceinline__ double tg_sum8(const double *x) {
    return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

__device__ __forceinline__ float tg_maxf(float a, float b) { return b > a ? b : a; }

// -- element loads: fp32 or bf16 (uint16 bits) into fp32 -----------------------------------------------------------
__device__ __forceinline__ float tg_ld(const float *__restrict__ g, tg_i64 i) { return g[i]; }
__device__ __forceinline__ float tg_ld(const tg_u16 *__restrict__ g, tg_i64 i) {
    return __uint_as_float((tg_u32)g[i] << 16);
}

__device__ __forceinline__ void tg_unpack4(const float4 &x, float *v) {
    v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
}
__device__ __forceinline__ void tg_unpack4(const uint2 &x, float *v) {   // 4 bf16, element 0 in the low half
    v[0] = __uint_as_float(x.x << 16); v[1] = __uint_as_float(x.x & 0xFFFF0000u);
    v[2] = __uint_as_float(x.y << 16); v[3] = __uint_as_float(x.y & 0xFFFF0000u);
}

template <typename T> struct tg_vec4;                         // the vector type of 4 elements
template <> struct tg_vec4<float> { typedef float4 type; };    // 16 bytes
template <> struct tg_vec4<tg_u16> { typedef uint2 type; };    // 8 bytes

// Whether g may be read 4 elements at a time from every index that is a multiple of 4.
template <typename T> __device__ __forceinline__ bool tg_vec_aligned(const T *g) {
    return ((tg_u64)g & (tg_u64)(4 * sizeof(T) - 1)) == 0;
}

// v[0..CNT) = g[i0 .. i0+CNT), 0 past n.  i0 and CNT are multiples of 4.
template <typename T, int CNT>
__device__ __forceinline__ void tg_load(const T *__restrict__ g, tg_i64 n, tg_i64 i0, bool aligned, float *v) {
    if (aligned && i0 + CNT <= n) {
        const typename tg_vec4<T>::type *p = reinterpret_cast<const typename tg_vec4<T>::type *>(g + i0);
#pragma unroll
        for (int j = 0; j < CNT / 4; j++) tg_unpack4(p[j], v + 4 * j);
    } else {
#pragma unroll
        for (int j = 0; j < CNT; j++) v[j] = i0 + j < n ? tg_ld(g, i0 + j) : 0.0f;
    }
}

// -- (a) statistics --------------------------------------------------------------------------------------------------
// Thread t: lanes 8u..8u+7 (u = t mod 4) of block t / 4.  Each lane is summed sequentially from +0 (a zero past
// n adds nothing: the sum never is -0), then the 8 lane partials are combined by the tree's rule: output t is
// level 1 of the tree.  om[t]: max |g| over the 8 lanes (NaN is ignored here; the NaN/Inf flag comes from the sums).
template <typename T>
__device__ __forceinline__ void tg_stats_body(const T *__restrict__ g, tg_i64 n, double *__restrict__ os,
                                              double *__restrict__ oq, float *__restrict__ om) {
    const tg_i64 groups = ((n + TG_STATS_BLOCK - 1) / TG_STATS_BLOCK) * TG_OCTETS;
    const bool aligned = tg_vec_aligned(g);
    for (tg_i64 t = tg_tid(); t < groups; t += tg_stride()) {
        const tg_i64 base = (t / TG_OCTETS) * TG_STATS_BLOCK + (t % TG_OCTETS) * 8;
        double s[8], q[8];
        float m = 0.0f;
#pragma unroll
        for (int l = 0; l < 8; l++) { s[l] = 0.0; q[l] = 0.0; }
        for (int j = 0; j < TG_STATS_BLOCK / TG_LANES; j++) {
            const tg_i64 i = base + (tg_i64)j * TG_LANES;
            if (i >= n) break;
            float v[8];
            tg_load<T, 8>(g, n, i, aligned, v);
#pragma unroll
            for (int l = 0; l < 8; l++) {
                const double d = (double)v[l];
                s[l] += d;
                q[l] += d * d;
                m = tg_maxf(m, fabsf(v[l]));
            }
        }
        os[t] = tg_sum8(s);
        oq[t] = tg_sum8(q);
        om[t] = m;
    }
}

TG_EXTERN __global__ void tg_stats_f32(const float *__restrict__ g, tg_i64 n, double *__restrict__ os,
                                       double *__restrict__ oq, float *__restrict__ om) {
    tg_stats_body(g, n, os, oq, om);
}

TG_EXTERN __global__ void tg_stats_bf16(const tg_u16 *__restrict__ g, tg_i64 n, double *__restrict__ os,
                                        double *__restrict__ oq, float *__restrict__ om) {
    tg_stats_body(g, n, os, oq, om);
}

__device__ __forceinline__ bool tg_finite(double x) {
    return ((tg_u64)__double_as_longlong(x) & 0x7FF0000000000000ULL) != 0x7FF0000000000000ULL;
}

// s = min(max|g|, thr) as torch.minimum (neither is NaN here), 0 where the tensor held NaN/Inf.
__device__ __forceinline__ float tg_scaler(float maxabs, float thr, bool bad) {
    return bad ? 0.0f : (thr < maxabs ? thr : maxabs);
}

// One group of 8 partials (zero-padded past m): sums, squares, max.
__device__ __forceinline__ void tg_group8(const double *__restrict__ is, const double *__restrict__ iq,
                                          const float *__restrict__ im, tg_i64 m, tg_i64 first, double &s,
                                          double &q, float &mx) {
    double a[8], b[8];
    float c = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const bool in = first + j < m;
        a[j] = in ? is[first + j] : 0.0;
        b[j] = in ? iq[first + j] : 0.0;
        if (in) c = tg_maxf(c, im[first + j]);
    }
    s = tg_sum8(a);
    q = tg_sum8(b);
    mx = c;
}

// (a) statistics, the tree: `levels` (1 or 2) levels of it for sums, squares and max together.  Two levels in one
// thread give what two launches give: a group of the second level whose inputs all lie past the first level's end
// sums zero-padding to +0, the value the padding has.  When `prep` is not null the output is the single total, and
// this thread also writes the clip threshold prep[0], the NaN/Inf flag and (one scaler per tensor) prep[1].
TG_EXTERN __global__ void tg_tree(const double *__restrict__ is, const double *__restrict__ iq,
                                  const float *__restrict__ im, tg_i64 m, int levels, double *__restrict__ os,
                                  double *__restrict__ oq, float *__restrict__ om, tg_i64 n, double clip,
                                  tg_i64 nb, float *__restrict__ prep, tg_u8 *__restrict__ nonfinite) {
    const tg_i64 span = levels == 2 ? 64 : 8;
    const tg_i64 outs = (m + span - 1) / span;
    for (tg_i64 k = tg_tid(); k < outs; k += tg_stride()) {
        double s, q;
        float mx;
        if (levels == 2) {
            double a[8], b[8];
            mx = 0.0f;
            for (int j = 0; j < 8; j++) {
                float c;
                tg_group8(is, iq, im, m, 64 * k + 8 * j, a[j], b[j], c);
                mx = tg_maxf(mx, c);
            }
            s = tg_sum8(a);
            q = tg_sum8(b);
        } else {
            tg_group8(is, iq, im, m, 8 * k, s, q, mx);
        }
        os[k] = s;
        oq[k] = q;
        om[k] = mx;
        if (prep) {   // codec.clip_threshold, operation by operation
            float thr = __int_as_float(0x7f800000);
            if (clip > 0.0) {
                const double mean = s / (double)n;
                double var = q / (double)n - mean * mean;
                var = var < 0.0 ? 0.0 : var;                 // torch.clamp(min=0): NaN stays NaN
                const float t = (float)(clip * sqrt(var));
                thr = t > 0.0f ? t : thr;                    // 0 or NaN: no clipping
            }
            const bool bad = !(tg_finite(s) && tg_finite(q));
            prep[0] = thr;
            *nonfinite = bad ? 1 : 0;
            if (nb == 1) prep[1] = tg_scaler(mx, thr, bad);
        }
    }
}

// (a) statistics, bucketed scalers: max |g| per bucket of `bucket` elements into maxbits (zeroed before), as the
// bits of non-negative floats, which order like unsigned ints.  A thread reads 16 elements and combines one
// maximum per bucket it touches with atomicMax (exact in any order).
template <typename T>
__device__ __forceinline__ void tg_bucket_max_body(const T *__restrict__ g, tg_i64 n, tg_i64 bucket,
                                                   tg_u32 *__restrict__ maxbits) {
    const tg_i64 chunks = (n + 15) / 16;
    const bool aligned = tg_vec_aligned(g);
    for (tg_i64 c = tg_tid(); c < chunks; c += tg_stride()) {
        const tg_i64 i0 = 16 * c;
        float v[16];
        tg_load<T, 16>(g, n, i0, aligned, v);
        tg_i64 k = tg_div(i0, bucket), next = (k + 1) * bucket;
        float m = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            if (i0 + j >= n) break;
            if (i0 + j >= next) {               // at most one boundary per element
                atomicMax(maxbits + k, __float_as_uint(m));
                k++;
                next += bucket;
                m = 0.0f;
            }
            m = tg_maxf(m, fabsf(v[j]));
        }
        atomicMax(maxbits + k, __float_as_uint(m));
    }
}

TG_EXTERN __global__ void tg_bucket_max_f32(const float *__restrict__ g, tg_i64 n, tg_i64 bucket,
                                            tg_u32 *__restrict__ maxbits) {
    tg_bucket_max_body(g, n, bucket, maxbits);
}

TG_EXTERN __global__ void tg_bucket_max_bf16(const tg_u16 *__restrict__ g, tg_i64 n, tg_i64 bucket,
                                             tg_u32 *__restrict__ maxbits) {
    tg_bucket_max_body(g, n, bucket, maxbits);
}

// prep[1 + k] = the scaler of bucket k, from its max and the threshold and flag tg_tree wrote.
TG_EXTERN __global__ void tg_bucket_scalers(const tg_u32 *__restrict__ maxbits, tg_i64 nb,
                                            const tg_u8 *__restrict__ nonfinite, float *__restrict__ prep) {
    const float thr = prep[0];
    const bool bad = *nonfinite != 0;
    for (tg_i64 k = tg_tid(); k < nb; k += tg_stride()) prep[1 + k] = tg_scaler(__uint_as_float(maxbits[k]), thr, bad);
}

// -- (b) fused clip + stochastic ternarize + pack ------------------------------------------------------------------
__device__ __forceinline__ tg_u32 tg_code(float c, tg_i64 i, float thr, float s, tg_u32 k0, tg_u32 k1) {
    c = c > thr ? thr : c;
    c = c < -thr ? -thr : c;
    const tg_u32 h = tg_mix32(tg_mix32((tg_u32)((tg_u64)i & 0xFFFFFFFFULL) ^ k0) ^ (tg_u32)((tg_u64)i >> 32) ^ k1);
    const float p = fabsf(c) / s;
    const bool keep = (float)(int)(h >> 8) < p * 16777216.0f;
    return keep ? (c > 0.0f ? 1u : (c < 0.0f ? 2u : 0u)) : 0u;
}

// Word w of packed codes (bytes 4w..4w+3 of nbytes): one 32-bit store where out is 4-byte aligned and the word is
// whole, else byte by byte (the last, short word; an unaligned region).
__device__ __forceinline__ void tg_store_word(tg_u8 *__restrict__ out, tg_i64 w, tg_u32 word, tg_i64 nbytes,
                                              bool out_aligned) {
    if (out_aligned && 4 * w + 4 <= nbytes) {
        *reinterpret_cast<tg_u32 *>(out + 4 * w) = word;
    } else {
        for (int b = 0; b < 4; b++)
            if (4 * w + b < nbytes) out[4 * w + b] = (tg_u8)(word >> (8 * b));
    }
}

// One thread per 32-bit word of codes (4 bytes: 4·PER elements).  thr and scalers live in device memory (no
// host sync).  The bucket of the word's first element takes one division; later elements step across
// boundaries (at most one per element).  With bucket <= 0 (one scaler per tensor) every element uses scalers[0].
template <typename T, int PER>
__device__ __forceinline__ void tg_pack_body(const T *__restrict__ g, tg_i64 n, const float *__restrict__ thr_p,
                                             const float *__restrict__ scalers, tg_i64 bucket, tg_u32 k0,
                                             tg_u32 k1, tg_u8 *__restrict__ out) {
    const int E = 4 * PER;
    const tg_i64 nbytes = (n + PER - 1) / PER, words = (nbytes + 3) / 4;
    const float thr = *thr_p;
    const bool aligned = tg_vec_aligned(g), out_aligned = ((tg_u64)out & 3) == 0;
    for (tg_i64 w = tg_tid(); w < words; w += tg_stride()) {
        const tg_i64 i0 = w * E;
        float v[E];
        tg_load<T, E>(g, n, i0, aligned, v);
        tg_i64 k = 0, next = 0;
        if (bucket > 0) {
            k = tg_div(i0, bucket);
            next = (k + 1) * bucket;
        }
        float s = scalers[k];
        tg_u32 word = 0;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            tg_u32 byte = 0, mul = 1;
#pragma unroll
            for (int q = 0; q < PER; q++) {
                const tg_i64 i = i0 + b * PER + q;
                if (i < n) {
                    if (bucket > 0 && i >= next) {
                        k++;
                        next += bucket;
                        s = scalers[k];
                    }
                    const tg_u32 code = tg_code(v[b * PER + q], i, thr, s, k0, k1);
                    if (PER == 4) byte |= code << (2 * q);
                    else byte += code * mul;
                }
                mul *= 3;
            }
            word |= byte << (8 * b);
        }
        tg_store_word(out, w, word, nbytes, out_aligned);
    }
}

// fmt: 1 = 2bit, otherwise base3 (codec.packing.FORMATS).
TG_EXTERN __global__ void tg_pack_f32(const float *__restrict__ g, tg_i64 n, const float *__restrict__ thr_p,
                                      const float *__restrict__ scalers, tg_i64 bucket, tg_u32 k0, tg_u32 k1,
                                      int fmt, tg_u8 *__restrict__ out) {
    if (fmt == 1) tg_pack_body<float, 4>(g, n, thr_p, scalers, bucket, k0, k1, out);
    else tg_pack_body<float, 5>(g, n, thr_p, scalers, bucket, k0, k1, out);
}

TG_EXTERN __global__ void tg_pack_bf16(const tg_u16 *__restrict__ g, tg_i64 n, const float *__restrict__ thr_p,
                                       const float *__restrict__ scalers, tg_i64 bucket, tg_u32 k0, tg_u32 k1,
                                       int fmt, tg_u8 *__restrict__ out) {
    if (fmt == 1) tg_pack_body<tg_u16, 4>(g, n, thr_p, scalers, bucket, k0, k1, out);
    else tg_pack_body<tg_u16, 5>(g, n, thr_p, scalers, bucket, k0, k1, out);
}

// -- (b') the four-level code with stratified dithers (codec/levels.py, the reference; tg_levels_pack of
// kernels/terngrad_cpu.c) -------------------------------------------------------------------------------------------
// a·r in GF(2^k) modulo poly (bit k set): shift-and-add over r's bits, reducing after each shift.
__device__ __forceinline__ tg_u32 tg_gf_mul(tg_u32 a, tg_u32 r, int k, tg_u32 poly) {
    tg_u32 out = 0, x = a;
    for (int i = 0; i < k; i++) {
        if ((r >> i) & 1u) out ^= x;
        x <<= 1;
        if ((x >> k) & 1u) x ^= poly;
    }
    return out;
}

// Rank `rank`'s 24-bit dither of element i: its own u = mix32(mix32(lo ^ k0) ^ hi ^ k1) >> 8 and the group's shared
// h = mix32(mix32(lo ^ sk0) ^ hi ^ sk1); with k strata bits (k = 0: u), b = h mod 2^k, a = 1 + (h >> k) mod (2^k - 1)
// (1 for k = 1), stratum = a·rank xor b, dither = (stratum << (24 - k)) | (u >> k): exactly uniform on [0, 2^24).
__device__ __forceinline__ tg_u32 tg_level_dither(tg_i64 i, tg_u32 k0, tg_u32 k1, tg_u32 sk0, tg_u32 sk1, tg_u32 rank,
                                                  int k, tg_u32 poly) {
    const tg_u32 lo = (tg_u32)((tg_u64)i & 0xFFFFFFFFULL), hi = (tg_u32)((tg_u64)i >> 32);
    const tg_u32 u = tg_mix32(tg_mix32(lo ^ k0) ^ hi ^ k1) >> 8;
    if (k == 0) return u;
    const tg_u32 h = tg_mix32(tg_mix32(lo ^ sk0) ^ hi ^ sk1), mask = (1u << k) - 1u;
    const tg_u32 a = k >= 2 ? 1u + (h >> k) % mask : 1u;
    return ((tg_gf_mul(a, rank, k, poly) ^ (h & mask)) << (24 - k)) | (u >> k);
}

// The code 0..3 of element value c (clipped at thr) under scaler s: the reference's fp32 operations, each pinned to
// round to nearest (no contraction, whatever the compiler's options).  Kept as the low byte of the integer, as the
// reference's conversion to uint8 keeps it: scalers below some |c| (no caller's: s >= max|c| of its bucket) give
// codes outside 0..3, and the bytes still match the reference's and the CPU's.
__device__ __forceinline__ tg_u32 tg_level_code(float c, float thr, float s, tg_u32 dither) {
    c = c > thr ? thr : c;
    c = c < -thr ? -thr : c;
    if (!(s > 0.0f)) return 0u;
    const float y = __fmul_rn(__fadd_rn(__fdiv_rn(c, s), 1.0f), 1.5f);
    float low = floorf(y);
    low = low > 2.0f ? 2.0f : low;
    const float f = __fsub_rn(y, low);
    const float up = (float)(int)(16777215u - dither) < __fmul_rn(f, 16777216.0f) ? 1.0f : 0.0f;
    return (tg_u32)(int)__fadd_rn(low, up) & 0xFFu;
}

// One thread per 32-bit word of codes (16 elements), as tg_pack_body: thr and scalers in device memory, one bucket
// division per word.  k and poly: codec/levels.py's strata_bits(group size) and POLYNOMIALS[k] (0 for k <= 1).
template <typename T>
__device__ __forceinline__ void tg_levels_body(const T *__restrict__ g, tg_i64 n, const float *__restrict__ thr_p,
                                               const float *__restrict__ scalers, tg_i64 bucket, tg_u32 k0, tg_u32 k1,
                                               tg_u32 sk0, tg_u32 sk1, tg_u32 rank, int k, tg_u32 poly,
                                               tg_u8 *__restrict__ out) {
    const tg_i64 nbytes = (n + 3) / 4, words = (nbytes + 3) / 4;
    const float thr = *thr_p;
    const bool aligned = tg_vec_aligned(g), out_aligned = ((tg_u64)out & 3) == 0;
    for (tg_i64 w = tg_tid(); w < words; w += tg_stride()) {
        const tg_i64 i0 = w * 16;
        float v[16];
        tg_load<T, 16>(g, n, i0, aligned, v);
        tg_i64 kb = 0, next = 0;
        if (bucket > 0) {
            kb = tg_div(i0, bucket);
            next = (kb + 1) * bucket;
        }
        float s = scalers[kb];
        tg_u32 word = 0;
#pragma unroll
        for (int e = 0; e < 16; e++) {
            const tg_i64 i = i0 + e;
            if (i < n) {
                if (bucket > 0 && i >= next) {
                    kb++;
                    next += bucket;
                    s = scalers[kb];
                }
                const tg_u32 d = tg_level_dither(i, k0, k1, sk0, sk1, rank, k, poly);
                word |= ((tg_level_code(v[e], thr, s, d) << (2 * (e & 3))) & 0xFFu) << (8 * (e >> 2));
            }
        }
        tg_store_word(out, w, word, nbytes, out_aligned);
    }
}

TG_EXTERN __global__ void tg_levels_pack_f32(const float *__restrict__ g, tg_i64 n, const float *__restrict__ thr_p,
                                             const float *__restrict__ scalers, tg_i64 bucket, tg_u32 k0, tg_u32 k1,
                                             tg_u32 sk0, tg_u32 sk1, tg_u32 rank, int k, tg_u32 poly,
                                             tg_u8 *__restrict__ out) {
    tg_levels_body<float>(g, n, thr_p, scalers, bucket, k0, k1, sk0, sk1, rank, k, poly, out);
}

TG_EXTERN __global__ void tg_levels_pack_bf16(const tg_u16 *__restrict__ g, tg_i64 n, const float *__restrict__ thr_p,
                                              const float *__restrict__ scalers, tg_i64 bucket, tg_u32 k0, tg_u32 k1,
                                              tg_u32 sk0, tg_u32 sk1, tg_u32 rank, int k, tg_u32 poly,
                                              tg_u8 *__restrict__ out) {
    tg_levels_body<tg_u16>(g, n, thr_p, scalers, bucket, k0, k1, sk0, sk1, rank, k, poly, out);
}

// -- (c) fused unpack + scale + accumulate of npay payloads into the average ---------------------------------------
// Before tg_decode: the npay·nb scalers, at scalers_at bytes into each payload (any byte offset), into an aligned
// [npay, nb] fp32 array, and *shared (1 before) set to 0 when any differs from payload 0's, compared as floats
// (torch.equal: -0 equals +0, NaN equals nothing).  Threads that find a difference all write the same 0.
TG_EXTERN __global__ void tg_decode_scalers(const tg_u8 *__restrict__ gathered, const tg_i64 *__restrict__ off,
                                            tg_i64 scalers_at, int npay, tg_i64 nb, float *__restrict__ scalers,
                                            int *__restrict__ shared) {
    const tg_i64 total = (tg_i64)npay * nb;
    for (tg_i64 t = tg_tid(); t < total; t += tg_stride()) {
        const tg_i64 p = t / nb, k = t - p * nb;
        const tg_u8 *src = gathered + off[p] + scalers_at + 4 * k, *first = gathered + off[0] + scalers_at + 4 * k;
        tg_u32 a = 0, b = 0;
        for (int j = 0; j < 4; j++) {
            a |= (tg_u32)src[j] << (8 * j);
            b |= (tg_u32)first[j] << (8 * j);
        }
        const float s = __uint_as_float(a);
        scalers[t] = s;
        if (s != __uint_as_float(b)) *shared = 0;
    }
}

// The ternary values of one packed byte: 2bit fields, or the 5 base-3 digits (a byte above 242 is no valid
// code: all zero).  Division by the constant 3 compiles to a multiply and shift; every digit costs one.
template <int PER>
__device__ __forceinline__ void tg_values(tg_u32 byte, int *v) {
    if (PER == 4) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const tg_u32 c = (byte >> (2 * q)) & 3u;
            v[q] = c == 1u ? 1 : (c == 2u ? -1 : 0);
        }
    } else {
        tg_u32 x = byte > 242u ? 0u : byte;
#pragma unroll
        for (int q = 0; q < PER; q++) {
            const tg_u32 d = x / 3u, c = x - 3u * d;
            v[q] = c == 1u ? 1 : (c == 2u ? -1 : 0);
            x = d;
        }
    }
}

// The four-level code's level / s: code 0..3 -> -1, -1/3, 1/3, 1 (fp32), built from its bits with no table (which
// would live in local memory): the sign bit set for codes 0 and 1, the magnitude 1 (0x3f800000) for the outer codes
// 0 and 3 and fp32(1/3) = 0x3eaaaaab for the inner ones 1 and 2 (those with c xor (c >> 1) odd).
__device__ __forceinline__ float tg_level_value(tg_u32 c) {
    const tg_u32 inner = (c ^ (c >> 1)) & 1u;
    return __uint_as_float((0x3f800000u - inner * (0x3f800000u - 0x3eaaaaabu)) | ((~c & 2u) << 30));
}

// Buckets started after the word's first element, up to element e.
__device__ __forceinline__ int tg_dk(tg_u32 steps, int e) { return __popc(steps & ((2u << e) - 1u)); }

// One thread per 32-bit word of codes of every payload: payload p starts at gathered + off[p], its codes codes_at
// bytes later (any byte offset: one 32-bit load where the word is aligned, else 4 byte loads); scalers is
// [npay, nb] fp32 and *shared != 0 when every payload carries the same scalers (both from tg_decode_scalers).
// levels: four-level codes (PER = 4), whose values are no integers: always the general formula, *shared unread.
// (A flag, not a third instantiation: three inlined bodies in the one kernel spill registers under its bounds.)
template <int PER>
__device__ __forceinline__ void tg_decode_body(bool levels, const tg_u8 *__restrict__ gathered,
                                               const tg_i64 *__restrict__ off, tg_i64 codes_at, int npay, tg_i64 n,
                                               const float *__restrict__ scalers, tg_i64 nb, tg_i64 bucket,
                                               const int *__restrict__ shared, float divisor,
                                               float *__restrict__ out) {
    const int E = 4 * PER;
    const tg_i64 nbytes = (n + PER - 1) / PER, words = (nbytes + 3) / 4;
    const bool same = !levels && *shared != 0;
    const bool out_aligned = ((tg_u64)out & 15) == 0;
    for (tg_i64 w = tg_tid(); w < words; w += tg_stride()) {
        const tg_i64 i0 = w * E;
        tg_i64 k0 = 0;
        tg_u32 steps = 0;              // bit e: a bucket starts at element i0 + e (e > 0); its bucket: k0 + dk(e)
        if (bucket > 0) {
            k0 = tg_div(i0, bucket);
            tg_i64 next = (k0 + 1) * bucket;
#pragma unroll
            for (int e = 1; e < E; e++) {
                if (i0 + e >= next) { steps |= 1u << e; next += bucket; }
            }
        }
        // acc: the sum of the ternary values (exact integers) when the scalers are shared, else of v·s_p
        float acc[E];
#pragma unroll
        for (int e = 0; e < E; e++) acc[e] = 0.0f;
        const bool whole = 4 * w + 4 <= nbytes;
        for (int p = 0; p < npay; p++) {
            const tg_u8 *src = gathered + off[p] + codes_at + 4 * w;
            tg_u32 word = 0;
            if (whole && ((tg_u64)src & 3) == 0) {
                word = *reinterpret_cast<const tg_u32 *>(src);
            } else {
                for (int b = 0; b < 4; b++)
                    if (4 * w + b < nbytes) word |= (tg_u32)src[b] << (8 * b);
            }
            const float *sp = scalers + (tg_i64)p * nb + k0;
#pragma unroll
            for (int b = 0; b < 4; b++) {
                const tg_u32 byte = (word >> (8 * b)) & 255u;
                int v[PER];
                tg_values<PER>(byte, v);
#pragma unroll
                for (int q = 0; q < PER; q++) {
                    const int e = b * PER + q;
                    const float x = PER == 4 && levels ? tg_level_value((byte >> (2 * q)) & 3u) : (float)v[q];
                    if (same) acc[e] += x;
                    else if (i0 + e < n) acc[e] = acc[e] + x * sp[tg_dk(steps, e)];
                }
            }
        }
        float r[E];
#pragma unroll
        for (int e = 0; e < E; e++) {
            r[e] = 0.0f;
            if (i0 + e < n) r[e] = same ? (acc[e] * scalers[k0 + tg_dk(steps, e)]) / divisor : acc[e] / divisor;
        }
        if (out_aligned && i0 + E <= n) {
            float4 *o = reinterpret_cast<float4 *>(out + i0);
#pragma unroll
            for (int j = 0; j < E / 4; j++) {
                float4 x;
                x.x = r[4 * j]; x.y = r[4 * j + 1]; x.z = r[4 * j + 2]; x.w = r[4 * j + 3];
                o[j] = x;
            }
        } else {
            for (int e = 0; e < E; e++)
                if (i0 + e < n) out[i0 + e] = r[e];
        }
    }
}

// At most 80 registers (3 blocks of 256 threads per SM) without spilling: its 16-20 accumulators and the word's
// bucket steps would otherwise take over 100 and leave fewer threads to keep stores in flight.
TG_EXTERN __global__ void __launch_bounds__(256, 3)
tg_decode(const tg_u8 *__restrict__ gathered, const tg_i64 *__restrict__ off, tg_i64 codes_at, int npay, tg_i64 n,
          int fmt, const float *__restrict__ scalers, tg_i64 nb, tg_i64 bucket, const int *__restrict__ shared,
          float divisor, float *__restrict__ out) {
    if (fmt == 2) tg_decode_body<5>(false, gathered, off, codes_at, npay, n, scalers, nb, bucket, shared, divisor, out);
    else tg_decode_body<4>(fmt == 3, gathered, off, codes_at, npay, n, scalers, nb, bucket, shared, divisor, out);
}

// -- (d) the sharded exchange: an owner's sums of N ranks' codes, and the decode of the gathered sums --------------
// Sums k in [-N, N] travel as k + N in `bits` bits, element j in bits j·bits .. (j+1)·bits - 1 of the stream (least
// significant first): 8 elements take exactly `bits` bytes, so one thread per 8 elements owns whole bytes.
template <int PER>
__device__ __forceinline__ int tg_value_at(const tg_u8 *__restrict__ packed, tg_i64 i) {
    int v[PER];
    tg_values<PER>(packed[i / PER], v);
    const int q = (int)(i % PER);
    int r = 0;
#pragma unroll
    for (int j = 0; j < PER; j++) r = j == q ? v[j] : r;
    return r;
}

// received: npay chunks of nbytes bytes (rank order), each the m codes of the shard from its first element.
template <int PER>
__device__ __forceinline__ void tg_owner_sums_body(const tg_u8 *__restrict__ received, tg_i64 nbytes, int npay,
                                                   tg_i64 m, int bits, tg_u8 *__restrict__ out) {
    const tg_i64 groups = (m + 7) / 8;
    for (tg_i64 grp = tg_tid(); grp < groups; grp += tg_stride()) {
        const tg_i64 i0 = 8 * grp;
        const int cnt = m - i0 < 8 ? (int)(m - i0) : 8;
        int k[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int p = 0; p < npay; p++) {
            const tg_u8 *src = received + (tg_i64)p * nbytes;
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (e < cnt) k[e] += tg_value_at<PER>(src, i0 + e);
        }
        tg_u8 *o = out + grp * bits;
        tg_u64 acc = 0;
        int have = 0;
        for (int e = 0; e < cnt; e++) {
            acc |= (tg_u64)(tg_u32)(k[e] + npay) << have;
            have += bits;
            while (have >= 8) { *o++ = (tg_u8)acc; acc >>= 8; have -= 8; }
        }
        if (have > 0) *o = (tg_u8)acc;
    }
}

TG_EXTERN __global__ void tg_owner_sums(const tg_u8 *__restrict__ received, tg_i64 nbytes, int npay, tg_i64 m,
                                        int fmt, int bits, tg_u8 *__restrict__ out) {
    if (fmt == 1) tg_owner_sums_body<4>(received, nbytes, npay, m, bits, out);
    else tg_owner_sums_body<5>(received, nbytes, npay, m, bits, out);
}

// out[i] = ((float)k * s) / divisor for the m sums of a shard that starts at element `start` of its tensor, s the
// scaler of that element's bucket (scalers[0] with bucket <= 0).
TG_EXTERN __global__ void tg_decode_sums(const tg_u8 *__restrict__ data, tg_i64 m, int nranks, int bits,
                                         const float *__restrict__ scalers, tg_i64 bucket, tg_i64 start,
                                         float divisor, float *__restrict__ out) {
    const tg_i64 groups = (m + 7) / 8;
    const tg_u64 mask = (1ULL << bits) - 1;
    for (tg_i64 grp = tg_tid(); grp < groups; grp += tg_stride()) {
        const tg_i64 i0 = 8 * grp;
        const int cnt = m - i0 < 8 ? (int)(m - i0) : 8;
        const tg_u8 *src = data + grp * bits;
        tg_i64 k = 0, next = 0;
        if (bucket > 0) {
            k = tg_div(start + i0, bucket);
            next = (k + 1) * bucket;
        }
        float s = scalers[k];
        tg_u64 acc = 0;
        int have = 0;
        for (int e = 0; e < cnt; e++) {
            while (have < bits) { acc |= (tg_u64)*src++ << have; have += 8; }   // only the bytes element e needs
            const int sum = (int)(acc & mask) - nranks;
            acc >>= bits;
            have -= bits;
            if (bucket > 0 && start + i0 + e >= next) {
                k++;
                next += bucket;
                s = scalers[k];
            }
            out[i0 + e] = ((float)sum * s) / divisor;
        }
    }
}

// -- (e) the requantized exchange's owner payload (codec/requant.py; kernels/terngrad_cpu.c tg_requant_encode) ----
//   8 header bytes: 'R' 'Q' '4', flags (| 0x02 with the noise channel), m as uint32 little-endian;
//   G = ceil(m/128) fp32 steps, step = max|a| / 7 over the group;
//   ceil(m/2) bytes of codes c + 7 in 4 bits, low nibble first (an odd m's last high nibble 7, code 0);
//   with the noise channel: G fp32 maxima νmax of ν = noise + Δ²·f·(1 - f), ceil(m/8) bytes of bits, least
//   significant first; zeros up to `total` bytes.
// One thread per group of 128 elements (64 code bytes, 16 bit bytes: whole bytes), which it reads once for the
// maximum and again for the codes (and twice more for the noise channel): the per-element values are
// recomputed, the same operations each time, rather than kept.
#define TG_RQ_GROUP 128

__device__ __forceinline__ tg_u32 tg_u24(tg_i64 i, tg_u32 k0, tg_u32 k1) {
    return tg_mix32(tg_mix32((tg_u32)((tg_u64)i & 0xFFFFFFFFULL) ^ k0) ^ (tg_u32)((tg_u64)i >> 32) ^ k1) >> 8;
}

__device__ __forceinline__ void tg_put_f32(tg_u8 *o, float x) {
    const tg_u32 u = __float_as_uint(x);
    for (int b = 0; b < 4; b++) o[b] = (tg_u8)(u >> (8 * b));
}

__device__ __forceinline__ float tg_get_f32(const tg_u8 *s) {
    tg_u32 u = 0;
    for (int b = 0; b < 4; b++) u |= (tg_u32)s[b] << (8 * b);
    return __uint_as_float(u);
}

// max over a group from 0 (the reference pads a short group with zeros); a NaN makes it the quiet NaN 0x7fc00000,
// as torch's amax.
__device__ __forceinline__ float tg_rq_finish_max(float m, bool nan) { return nan ? __uint_as_float(0x7fc00000u) : m; }

// q's integer and fraction parts and the code c + 7 of element value x under step d (the reference's fp32 ops).
__device__ __forceinline__ float tg_rq_fraction(float x, float d, float &low) {
    float q = d > 0.0f ? x / d : 0.0f;
    q = q < -7.0f ? -7.0f : q;
    q = q > 7.0f ? 7.0f : q;
    low = floorf(q);
    return q - low;
}

// ν of an element: its noise estimate plus the rounding's own variance d^2·f·(1 - f), in the reference's order.
__device__ __forceinline__ float tg_rq_nu(float noise, float x, float d) {
    float low;
    const float f = tg_rq_fraction(x, d, low);
    return noise + ((d * d) * f) * (1.0f - f);
}

TG_EXTERN __global__ void tg_requant_encode(const float *__restrict__ a, const float *__restrict__ noise,
                                            int with_noise, tg_i64 m, tg_i64 start, tg_u32 ka0, tg_u32 ka1,
                                            tg_u32 kn0, tg_u32 kn1, int flags, tg_u8 *__restrict__ out,
                                            tg_i64 total) {
    const tg_i64 G = (m + TG_RQ_GROUP - 1) / TG_RQ_GROUP;
    tg_u8 *steps_at = out + 8, *codes_at = steps_at + 4 * G;
    tg_u8 *tops_at = codes_at + (m + 1) / 2, *bits_at = tops_at + 4 * G;
    const tg_i64 used = with_noise ? (tg_i64)(bits_at - out) + (m + 7) / 8 : (tg_i64)(tops_at - out);
    if (tg_tid() == 0) {
        out[0] = 'R'; out[1] = 'Q'; out[2] = '4';
        out[3] = (tg_u8)(flags | (with_noise ? 0x02 : 0));
        for (int q = 0; q < 4; q++) out[4 + q] = (tg_u8)((tg_u32)m >> (8 * q));
        for (tg_i64 b = used; b < total; b++) out[b] = 0;
    }
    for (tg_i64 g = tg_tid(); g < G; g += tg_stride()) {
        const tg_i64 lo = g * TG_RQ_GROUP;
        const int gc = m - lo < TG_RQ_GROUP ? (int)(m - lo) : TG_RQ_GROUP;
        const float *ac = a + lo;
        float mx = 0.0f;
        bool nan = false;
        for (int j = 0; j < gc; j++) {
            const float v = fabsf(ac[j]);
            nan |= v != v;
            mx = v > mx ? v : mx;
        }
        const float d = tg_rq_finish_max(mx, nan) / 7.0f;
        tg_put_f32(steps_at + 4 * g, d);
        tg_u8 *oc = codes_at + lo / 2;
        tg_u32 pending = 0;
        for (int j = 0; j < gc; j++) {
            float low;
            const float f = tg_rq_fraction(ac[j], d, low);
            float c = low + ((float)(int)tg_u24(start + lo + j, ka0, ka1) < f * 16777216.0f ? 1.0f : 0.0f);
            c = c < -7.0f ? -7.0f : c;
            c = c > 7.0f ? 7.0f : c;
            const tg_u32 u = (tg_u32)((c == c ? (int)c : 0) + 7);
            if (j & 1) oc[j / 2] = (tg_u8)(pending | (u << 4));
            else pending = u;
        }
        if (gc & 1) oc[gc / 2] = (tg_u8)(pending | (7u << 4));
        if (!with_noise) continue;
        const float *nc = noise + lo;
        float top = 0.0f;
        nan = false;
        for (int j = 0; j < gc; j++) {
            const float v = tg_rq_nu(nc[j], ac[j], d);
            nan |= v != v;
            top = v > top ? v : top;
        }
        top = tg_rq_finish_max(top, nan);
        tg_put_f32(tops_at + 4 * g, top);
        tg_u8 *ob = bits_at + lo / 8;
        tg_u32 byte = 0;
        for (int j = 0; j < gc; j++) {
            const float v = tg_rq_nu(nc[j], ac[j], d);
            const float p = top > 0.0f ? v / top : 0.0f;
            const tg_u32 bit = (float)(int)tg_u24(start + lo + j, kn0, kn1) < p * 16777216.0f ? 1u : 0u;
            byte |= bit << (j & 7);
            if ((j & 7) == 7) { ob[j / 8] = (tg_u8)byte; byte = 0; }
        }
        if (gc & 7) ob[gc / 8] = (tg_u8)byte;
    }
}

// out[i] = ((float)nibble - 7) · step; noise_out (null: not written) [i] = (float)bit · νmax.  buf: any alignment.
// One thread per 8 elements (4 code bytes, 1 bit byte).
TG_EXTERN __global__ void tg_requant_decode(const tg_u8 *__restrict__ buf, tg_i64 m, float *__restrict__ out,
                                            float *__restrict__ noise_out) {
    const tg_i64 G = (m + TG_RQ_GROUP - 1) / TG_RQ_GROUP;
    const tg_u8 *steps_at = buf + 8, *codes_at = steps_at + 4 * G;
    const tg_u8 *tops_at = codes_at + (m + 1) / 2, *bits_at = tops_at + 4 * G;
    const tg_i64 octs = (m + 7) / 8;
    for (tg_i64 t = tg_tid(); t < octs; t += tg_stride()) {
        const tg_i64 i0 = 8 * t, g = i0 / TG_RQ_GROUP;       // 8 elements never straddle a group
        const int cnt = m - i0 < 8 ? (int)(m - i0) : 8;
        const float d = tg_get_f32(steps_at + 4 * g);
        for (int e = 0; e < cnt; e++) {
            const tg_u32 x = codes_at[(i0 + e) / 2];
            out[i0 + e] = ((float)(((i0 + e) & 1) ? x >> 4 : x & 0x0Fu) - 7.0f) * d;
        }
        if (!noise_out) continue;
        const float top = tg_get_f32(tops_at + 4 * g);
        const tg_u32 bits = bits_at[t];
        for (int e = 0; e < cnt; e++) noise_out[i0 + e] = (float)((bits >> e) & 1u) * top;
    }
}
