// horovod_terngrad.optim's default-mode Adam(W) update of many fp32 tensors in one launch (loaded with
// cupy.RawModule by backends/cuda_adam.py; also compiled for the host through adam_host.cpp beside this file,
// which runs the launch as loops over blocks and threads: tests compare it with the fused CPU pass).
//
// Per element, the operations and their order of tg_adam_corrected (kernels/terngrad_cpu.c), in fp32:
//   g' = (maximize ? -g : g) + l2 * p
//   m  = m + c1 * (g' - m);  v = b2 * v + c2 * (g' * g');  n = b2 * n + (noise ? coef * noise : 0)
//   vh = max(v - n, floor * v)   (amsgrad: vmax = max(vmax, vh); vh = vmax)
//   p  = p * decay - step * m / (sqrt(vh) * inv_bias2_sqrt + eps)
// Compile with --fmad=false and without fast math (sqrt and division IEEE-rounded, NVRTC's default): then the
// bytes are those of the CPU pass given the same scalars.
//
// Per tensor, the noise's coefficient (1 - b2) * |g|^2 / |average|^2 comes from two fp32 norms on the device
// (no host read): |g| of the gradient now and |average| of the exchange's result, in the CPU path's host
// arithmetic (optim/adam.py): sq = (double)gn * gn, at = (double)(an * an) with the square in fp32, factor =
// at > 0 ? sq / at : 1, coef = (float)(one_minus_b2 * factor).
//
// The launch: a table of tensors (TG_ADAM_FIELDS int64 words each) and the prefix of their chunk counts; block b
// finds its tensor by binary search over the prefix and walks its chunk of TG_ADAM_CHUNK elements with a
// block-stride loop.  No shared memory, no __syncthreads: each thread is independent (the host emulation runs
// the very same source).

#ifndef TG_HOST_EMULATION
typedef long long tg_i64;
typedef unsigned int tg_u32;
#define TG_EXTERN extern "C"
#endif

#define TG_ADAM_CHUNK 32768
// the table's words per tensor: pointers (0 for none) p, m, v, n, g, noise, vmax, gnorm, anorm; numel; the
// fp32 bits of step (lr / bias1) and of inv_bias2_sqrt
#define TG_ADAM_FIELDS 12

__device__ __forceinline__ float tg_bits_to_float(tg_i64 w) {
    union { tg_u32 u; float f; } x;
    x.u = (tg_u32)w;
    return x.f;
}

// buf: [ntensors + 1] prefix of chunk counts (buf[0] = 0), then the table [ntensors][TG_ADAM_FIELDS]
TG_EXTERN __global__ void tg_adam_multi(const tg_i64 *__restrict__ buf, int ntensors, float c1, float b2, float c2,
                                        double one_minus_b2, float eps, float decay, float l2, float floor_,
                                        int maximize) {
    const tg_i64 chunk = (tg_i64)blockIdx.x;
    if (chunk >= buf[ntensors]) return;
    int lo = 0, hi = ntensors - 1;               // the last tensor whose first chunk is <= chunk
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (buf[mid] <= chunk) lo = mid; else hi = mid - 1;
    }
    const tg_i64 *t = buf + (ntensors + 1) + (tg_i64)lo * TG_ADAM_FIELDS;
    float *p = (float *)t[0];
    float *m = (float *)t[1];
    float *v = (float *)t[2];
    float *n = (float *)t[3];
    const float *g = (const float *)t[4];
    const float *noise = (const float *)t[5];
    float *vmax = (float *)t[6];
    const float *gnorm = (const float *)t[7];
    const float *anorm = (const float *)t[8];
    const tg_i64 count = t[9];
    const float step = tg_bits_to_float(t[10]);
    const float inv_bias2_sqrt = tg_bits_to_float(t[11]);
    float coef = 0.0f;
    if (noise) {
        const double gn = (double)gnorm[0];
        const float an = anorm[0];
        const double at = (double)(an * an);
        const double factor = at > 0 ? (gn * gn) / at : 1.0;
        coef = (float)(one_minus_b2 * factor);
    }
    const tg_i64 start = (chunk - buf[lo]) * TG_ADAM_CHUNK;
    const tg_i64 end = start + TG_ADAM_CHUNK < count ? start + TG_ADAM_CHUNK : count;
    for (tg_i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
        float gi = maximize ? -g[i] : g[i];
        gi = gi + l2 * p[i];
        const float mi = m[i] + c1 * (gi - m[i]);
        const float vi = b2 * v[i] + c2 * (gi * gi);
        const float ni = b2 * n[i] + (noise ? coef * noise[i] : 0.0f);
        float vh = vi - ni;
        const float fl = floor_ * vi;
        vh = vh > fl ? vh : fl;
        if (vmax) {
            const float x = vmax[i] > vh ? vmax[i] : vh;
            vmax[i] = x;
            vh = x;
        }
        m[i] = mi; v[i] = vi; n[i] = ni;
        p[i] = p[i] * decay - step * mi / (sqrtf(vh) * inv_bias2_sqrt + eps);
    }
}
