// Host build of kernels/terngrad.cu: g++ -O2 -std=c++17 -ffp-contract=off -shared -fPIC host_launch.cpp
// Each host_<kernel>(grid, block, args...) runs the kernel for every (block, thread) of that launch.
#include "host_shim.h"
#include "terngrad.cu"

extern "C" {
void host_tg_stats_lanes(unsigned grid, unsigned block, const float *g, tg_i64 n, double *ls, double *lq,
                         tg_u32 *maxbits) {
    tg_host_launch(grid, block, [&] { tg_stats_lanes(g, n, ls, lq, maxbits); });
}
void host_tg_sum8(unsigned grid, unsigned block, const double *in, tg_i64 m, double *out) {
    tg_host_launch(grid, block, [&] { tg_sum8(in, m, out); });
}
void host_tg_bucket_max(unsigned grid, unsigned block, const float *g, tg_i64 n, tg_i64 bucket, float *maxabs) {
    tg_host_launch(grid, block, [&] { tg_bucket_max(g, n, bucket, maxabs); });
}
void host_tg_ternarize_pack(unsigned grid, unsigned block, const float *g, tg_i64 n, const float *thr,
                            const float *scalers, tg_i64 bucket, tg_u32 k0, tg_u32 k1, int fmt, tg_u8 *out) {
    tg_host_launch(grid, block, [&] { tg_ternarize_pack(g, n, thr, scalers, bucket, k0, k1, fmt, out); });
}
void host_tg_decode(unsigned grid, unsigned block, const tg_u8 *gathered, const tg_i64 *off, int npay, tg_i64 n,
                    int fmt, const float *scalers, tg_i64 nb, tg_i64 bucket, const int *shared, float divisor,
                    float *out) {
    tg_host_launch(grid, block, [&] { tg_decode(gathered, off, npay, n, fmt, scalers, nb, bucket, shared, divisor, out); });
}
}
