// Host build of kernels/terngrad.cu: g++ -O2 -std=c++17 -ffp-contract=off -fno-strict-aliasing -shared -fPIC
// host_launch.cpp.  Each host_<kernel>(grid, block, args...) runs the kernel for every (block, thread) of that
// launch.  (The kernels read tensors through vector types, as CUDA does: hence no strict aliasing.)
#include "host_shim.h"
#include "terngrad.cu"

extern "C" {
void host_tg_stats_f32(unsigned grid, unsigned block, const float *g, tg_i64 n, double *os, double *oq, float *om) {
    tg_host_launch(grid, block, [&] { tg_stats_f32(g, n, os, oq, om); });
}
void host_tg_stats_bf16(unsigned grid, unsigned block, const tg_u16 *g, tg_i64 n, double *os, double *oq,
                        float *om) {
    tg_host_launch(grid, block, [&] { tg_stats_bf16(g, n, os, oq, om); });
}
void host_tg_tree(unsigned grid, unsigned block, const double *is, const double *iq, const float *im, tg_i64 m,
                  int levels, double *os, double *oq, float *om, tg_i64 n, double clip, tg_i64 nb, float *prep,
                  tg_u8 *nonfinite) {
    tg_host_launch(grid, block, [&] { tg_tree(is, iq, im, m, levels, os, oq, om, n, clip, nb, prep, nonfinite); });
}
void host_tg_bucket_max_f32(unsigned grid, unsigned block, const float *g, tg_i64 n, tg_i64 bucket, tg_u32 *mb) {
    tg_host_launch(grid, block, [&] { tg_bucket_max_f32(g, n, bucket, mb); });
}
void host_tg_bucket_max_bf16(unsigned grid, unsigned block, const tg_u16 *g, tg_i64 n, tg_i64 bucket, tg_u32 *mb) {
    tg_host_launch(grid, block, [&] { tg_bucket_max_bf16(g, n, bucket, mb); });
}
void host_tg_bucket_scalers(unsigned grid, unsigned block, const tg_u32 *mb, tg_i64 nb, const tg_u8 *nonfinite,
                            float *prep) {
    tg_host_launch(grid, block, [&] { tg_bucket_scalers(mb, nb, nonfinite, prep); });
}
void host_tg_pack_f32(unsigned grid, unsigned block, const float *g, tg_i64 n, const float *thr,
                      const float *scalers, tg_i64 bucket, tg_u32 k0, tg_u32 k1, int fmt, tg_u8 *out) {
    tg_host_launch(grid, block, [&] { tg_pack_f32(g, n, thr, scalers, bucket, k0, k1, fmt, out); });
}
void host_tg_pack_bf16(unsigned grid, unsigned block, const tg_u16 *g, tg_i64 n, const float *thr,
                       const float *scalers, tg_i64 bucket, tg_u32 k0, tg_u32 k1, int fmt, tg_u8 *out) {
    tg_host_launch(grid, block, [&] { tg_pack_bf16(g, n, thr, scalers, bucket, k0, k1, fmt, out); });
}
void host_tg_levels_pack_f32(unsigned grid, unsigned block, const float *g, tg_i64 n, const float *thr,
                             const float *scalers, tg_i64 bucket, tg_u32 k0, tg_u32 k1, tg_u32 sk0, tg_u32 sk1,
                             tg_u32 rank, int k, tg_u32 poly, tg_u8 *out) {
    tg_host_launch(grid, block, [&] {
        tg_levels_pack_f32(g, n, thr, scalers, bucket, k0, k1, sk0, sk1, rank, k, poly, out);
    });
}
void host_tg_levels_pack_bf16(unsigned grid, unsigned block, const tg_u16 *g, tg_i64 n, const float *thr,
                              const float *scalers, tg_i64 bucket, tg_u32 k0, tg_u32 k1, tg_u32 sk0, tg_u32 sk1,
                              tg_u32 rank, int k, tg_u32 poly, tg_u8 *out) {
    tg_host_launch(grid, block, [&] {
        tg_levels_pack_bf16(g, n, thr, scalers, bucket, k0, k1, sk0, sk1, rank, k, poly, out);
    });
}
void host_tg_decode_scalers(unsigned grid, unsigned block, const tg_u8 *gathered, const tg_i64 *off, tg_i64 at,
                            int npay, tg_i64 nb, float *scalers, int *shared) {
    tg_host_launch(grid, block, [&] { tg_decode_scalers(gathered, off, at, npay, nb, scalers, shared); });
}
void host_tg_decode(unsigned grid, unsigned block, const tg_u8 *gathered, const tg_i64 *off, tg_i64 codes_at,
                    int npay, tg_i64 n, int fmt, const float *scalers, tg_i64 nb, tg_i64 bucket, const int *shared,
                    float divisor, float *out) {
    tg_host_launch(grid, block, [&] {
        tg_decode(gathered, off, codes_at, npay, n, fmt, scalers, nb, bucket, shared, divisor, out);
    });
}
}

extern "C" {
void host_tg_owner_sums(unsigned grid, unsigned block, const tg_u8 *received, tg_i64 nbytes, int npay, tg_i64 m,
                        int fmt, int bits, tg_u8 *out) {
    tg_host_launch(grid, block, [&] { tg_owner_sums(received, nbytes, npay, m, fmt, bits, out); });
}
void host_tg_decode_sums(unsigned grid, unsigned block, const tg_u8 *data, tg_i64 m, int nranks, int bits,
                         const float *scalers, tg_i64 bucket, tg_i64 start, float divisor, float *out) {
    tg_host_launch(grid, block, [&] { tg_decode_sums(data, m, nranks, bits, scalers, bucket, start, divisor, out); });
}
}

extern "C" {
void host_tg_requant_encode(unsigned grid, unsigned block, const float *a, const float *noise, int with_noise,
                            tg_i64 m, tg_i64 start, tg_u32 ka0, tg_u32 ka1, tg_u32 kn0, tg_u32 kn1, int flags,
                            tg_u8 *out, tg_i64 total) {
    tg_host_launch(grid, block, [&] {
        tg_requant_encode(a, noise, with_noise, m, start, ka0, ka1, kn0, kn1, flags, out, total);
    });
}
void host_tg_requant_decode(unsigned grid, unsigned block, const tg_u8 *buf, tg_i64 m, float *out, float *noise_out) {
    tg_host_launch(grid, block, [&] { tg_requant_decode(buf, m, out, noise_out); });
}
}
