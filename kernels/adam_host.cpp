// Host build of kernels/adam.cu: g++ -O2 -std=c++17 -ffp-contract=off -shared -fPIC adam_host.cpp
// host_tg_adam_multi(grid, block, args...) runs the kernel for every (block, thread) of that launch.
#include "host_shim.h"
#include "adam.cu"

extern "C" {
void host_tg_adam_multi(unsigned grid, unsigned block, const tg_i64 *buf, int ntensors, float c1, float b2, float c2,
                        double one_minus_b2, float eps, float decay, float l2, float floor_, int maximize) {
    tg_host_launch(grid, block, [&] { tg_adam_multi(buf, ntensors, c1, b2, c2, one_minus_b2, eps, decay, l2, floor_,
                                                    maximize); });
}
}
