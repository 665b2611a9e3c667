/* Fused CPU codec of horovod-terngrad: one pass per stage, no tensor-sized temporaries.
 *
 * It computes exactly the fp32/fp64 operations the reference (horovod_terngrad/codec) specifies, in
 * the same order, so its bytes are identical to the reference and to kernels/terngrad.cu:
 *   stats:     fp64 sums in blocks of TG_STATS_BLOCK elements, 32 interleaved lanes per block summed
 *              sequentially; all lane partials (block-major) reduced by an 8-way tree: groups of 8
 *              become ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)), level by level, zero-padded;
 *              max |g| per bucket; a NaN/Inf flag.
 *   ternarize: c = clamp(g, -thr, thr); keep = (float)(h >> 8) < (|c| / s) * 2^24 with
 *              h = mix32(mix32(lo ^ k0) ^ hi ^ k1); code 1 for +1, 2 for -1, 0 for 0.
 *   levels:    four-level rounding (codec/levels.py, format byte 3): y = (c / s + 1) * 1.5, L = min(floor(y), 2),
 *              code = L + ((float)(2^24 - 1 - u) < (y - L) * 2^24), u the rank's stratified 24-bit dither; code 0
 *              where s is not > 0; packed as 2bit packs.
 *   decode:    out = (sum over payloads in order of v * s) / divisor, all fp32; v the ternary value, or for fmt 3
 *              the four levels {-1, -1/3, 1/3, 1} (squares {1, 1/9, 1/9, 1} for the noise estimate).
 *   nearest:   code of sign(d) where 2|d| >= s and s > 0, else 0 (codec/nearest.py: no randomness).
 *   squares:   per row, sum of clamp(g, -thr, thr)^2 in fp32, 8 contiguous parts combined level by level as
 *              ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)) (codec/squares.py, ordered_row_sums).
 * Build with -ffp-contract=off (no fused multiply-add changing roundings) and no -ffast-math;
 * -fno-trapping-math only lets the compiler if-convert float selects so the loops vectorize.
 */
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define TG_STATS_BLOCK 2048
#define TG_LANES 32
#define TG_CHUNK 1280 /* elements per packing chunk: a multiple of 4 and of 5 */

int tg_abi_version(void) { return 12; }

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
    return x;
}

/* Lane partial sums (lane_sum/lane_sq, nblk * TG_LANES entries, block-major) and per-bucket max |g|.  NaN/Inf need no
 * check of their own: they make the fp64 sums non-finite (finite fp32 squares cannot overflow fp64). */
static inline double sum8(const double *x) {
    return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

static void stats_lanes(const float *g, int64_t n, int64_t bucket, double *lane_sum, double *lane_sq,
                        float *maxabs, int64_t nbuckets, int nthreads) {
    int64_t nblk = (n + TG_STATS_BLOCK - 1) / TG_STATS_BLOCK;
    float whole = 0.0f;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(max : whole)
    for (int64_t b = 0; b < nblk; b++) {
        double s[TG_LANES] = {0}, q[TG_LANES] = {0};
        float m[TG_LANES] = {0};
        int64_t lo = b * TG_STATS_BLOCK, hi = lo + TG_STATS_BLOCK < n ? lo + TG_STATS_BLOCK : n;
        int64_t i = lo;
        for (; i + TG_LANES <= hi; i += TG_LANES) {
            for (int l = 0; l < TG_LANES; l++) {
                float a = g[i + l];
                double v = (double)a;
                s[l] += v;
                q[l] += v * v;
                a = fabsf(a);
                m[l] = a > m[l] ? a : m[l];
            }
        }
        for (int l = 0; i < hi; i++, l++) {
            float a = g[i];
            double v = (double)a;
            s[l] += v;
            q[l] += v * v;
            a = fabsf(a);
            m[l] = a > m[l] ? a : m[l];
        }
        for (int l = 0; l < TG_LANES; l++) {
            lane_sum[b * TG_LANES + l] = s[l];
            lane_sq[b * TG_LANES + l] = q[l];
        }
        for (int l = 0; l < TG_LANES; l++) whole = m[l] > whole ? m[l] : whole;
    }
    if (bucket <= 0) {
        maxabs[0] = whole;
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t k = 0; k < nbuckets; k++) {
        int64_t lo = k * bucket, hi = lo + bucket < n ? lo + bucket : n;
        float m = 0.0f;
        /* max is exact in any order (NaN never enters m: a > m is false for it), so lanes may split it */
#pragma omp simd reduction(max : m)
        for (int64_t j = lo; j < hi; j++) {
            float a = fabsf(g[j]);
            m = a > m ? a : m;
        }
        maxabs[k] = m;
    }
}

/* In-place 8-way tree over x[0..m): groups of 8 consecutive values (zero-padded), level by level. */
static double tree8(double *x, int64_t m) {
    while (m > 1) {
        int64_t groups = (m + 7) / 8;
        for (int64_t k = 0; k < groups; k++) {
            double v[8];
            for (int j = 0; j < 8; j++) v[j] = 8 * k + j < m ? x[8 * k + j] : 0.0;
            x[k] = sum8(v);
        }
        m = groups;
    }
    return m == 1 ? x[0] : 0.0;
}

/* totals[0] = sum g, totals[1] = sum g^2 (lane partials by the 8-way tree), maxabs per bucket. */
int tg_stats(const float *g, int64_t n, int64_t bucket, double *totals, float *maxabs, int64_t nbuckets,
             int nthreads) {
    int64_t m = (n + TG_STATS_BLOCK - 1) / TG_STATS_BLOCK * TG_LANES;
    double stack_buf[2 * 256];
    double *buf = m <= 256 ? stack_buf : (double *)malloc(sizeof(double) * 2 * (size_t)m);
    if (!buf) return -1;
    stats_lanes(g, n, bucket, buf, buf + m, maxabs, nbuckets, nthreads);
    totals[0] = tree8(buf, m);
    totals[1] = tree8(buf + m, m);
    if (buf != stack_buf) free(buf);
    return 0;
}

/* s[j] = the scaler of element first + j: scalers[0] for every j where bucket <= 0 (one scaler per tensor), else
 * bucket by bucket, one division per chunk, not one per element (a 64-bit division per element made bucketed
 * encode and decode several times slower than layer-wise). */
static inline void fill_scalers(const float *scalers, int64_t bucket, int64_t first, int64_t cnt, float *s) {
    if (bucket <= 0) {
        for (int64_t j = 0; j < cnt; j++) s[j] = scalers[0];
        return;
    }
    int64_t j = 0, b = first / bucket;
    while (j < cnt) {
        int64_t end = (b + 1) * bucket - first;
        if (end > cnt) end = cnt;
        const float v = scalers[b++];
        for (; j < end; j++) s[j] = v;
    }
}

/* Codes per packed byte of format fmt: 5 for base3 (fmt 2); 4 for 2bit (fmt 1) and the four-level code (fmt 3),
 * which share the 2-bit layout. */
static inline int codes_per_byte(int fmt) { return fmt == 2 ? 5 : 4; }

/* Pack one chunk's cnt codes (zero-padded to TG_CHUNK) into ceil(cnt / per) bytes at o: 2bit (fmt 1) and the
 * four-level code (fmt 3) four codes per byte, low bits first; base3 (fmt 2) five, c0 + 3c1 + 9c2 + 27c3 + 81c4. */
static inline void pack_chunk(uint8_t *codes, int64_t cnt, int fmt, uint8_t *o) {
    const int per = codes_per_byte(fmt);
    for (int64_t j = cnt; j < TG_CHUNK; j++) codes[j] = 0;
    int64_t nbytes = (cnt + per - 1) / per;
    if (per == 4) {
        for (int64_t b = 0; b < nbytes; b++)
            o[b] = (uint8_t)(codes[4 * b] | (codes[4 * b + 1] << 2) | (codes[4 * b + 2] << 4) | (codes[4 * b + 3] << 6));
    } else {
        for (int64_t b = 0; b < nbytes; b++)
            o[b] = (uint8_t)(codes[5 * b] + 3 * codes[5 * b + 1] + 9 * codes[5 * b + 2] + 27 * codes[5 * b + 3] +
                             81 * codes[5 * b + 4]);
    }
}

/* Ternarize and pack (fmt 1 = 2bit, 2 = base3) into out (ceil(n/4) or ceil(n/5) bytes). */
void tg_ternarize_pack(const float *g, int64_t n, float thr, const float *scalers, int64_t bucket,
                       uint32_t k0, uint32_t k1, int fmt, uint8_t *out, int nthreads) {
    const int per = fmt == 1 ? 4 : 5;
    int64_t nchunks = (n + TG_CHUNK - 1) / TG_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        uint8_t codes[TG_CHUNK];
        int64_t lo = ch * TG_CHUNK;
        int64_t cnt = n - lo < TG_CHUNK ? n - lo : TG_CHUNK;
        /* Element index split as hi:lo 32-bit words; lo wraps inside a chunk at most once. */
        const uint32_t base_lo = (uint32_t)lo, base_hi = (uint32_t)((uint64_t)lo >> 32);
        float sbuf[TG_CHUNK];
        fill_scalers(scalers, bucket, lo, cnt, sbuf);
        const float *gc = g + lo;
        /* Two simple loops (hash, then decide) vectorize far better than one fused body. */
        uint32_t hbuf[TG_CHUNK];
        for (int j = 0; j < (int)cnt; j++) {
            uint32_t ilo = base_lo + (uint32_t)j;
            uint32_t ihi = base_hi + (uint32_t)(ilo < base_lo);
            hbuf[j] = mix32(mix32(ilo ^ k0) ^ ihi ^ k1) >> 8;
        }
        for (int j = 0; j < (int)cnt; j++) {
            float c = gc[j];
            c = c > thr ? thr : c;
            c = c < -thr ? -thr : c;
            float p = fabsf(c) / sbuf[j];
            int keep = (float)(int32_t)hbuf[j] < p * 16777216.0f;
            int code = (c > 0.0f) | ((c < 0.0f) << 1);
            codes[j] = (uint8_t)(keep ? code : 0);
        }
        pack_chunk(codes, cnt, fmt, out + lo / per);
    }
}

/* The four-level code with stratified dithers (codec/levels.py, the reference, states the math and its why).
 * Element i draws its own 24-bit u = mix32(mix32(lo ^ k0) ^ hi ^ k1) >> 8 and the group's shared 32-bit
 * h = mix32(mix32(lo ^ sk0) ^ hi ^ sk1); with k strata bits (k = 0: the dither is u), b = h mod 2^k,
 * a = 1 + (h >> k) mod (2^k - 1), stratum = a·rank xor b in GF(2^k) (modulo poly), and the dither is
 * (stratum << (24 - k)) | (u >> k).  (k = 1: a = 1, as the reference sets it: GF(2)'s one nonzero element.)
 * Multiplying by the fixed rank is linear over GF(2), so a·rank is the xor of rows[j] = x^j·rank over a's set bits
 * j: one pass per bit over the chunk, branch-free, which vectorizes.  The mod by d = 2^k - 1 of x = h >> k
 * (k >= 2) takes no division: with M = ceil(2^32 / d) = (2^32 + e) / d, 0 <= e < d, the quotient is
 * q = (x·M) >> 32 exactly, since x·M / 2^32 = x / d + x·e / (d·2^32) and x·e < 2^(32-k)·2^k = 2^32 keeps the
 * excess below 1/d; M < 2^31, so x·M is one 32 x 32 -> 64-bit product per lane. */
static void levels_dithers(int64_t lo, int cnt, uint32_t k0, uint32_t k1, uint32_t sk0, uint32_t sk1, int k,
                           const uint32_t *rows, uint32_t *dither) {
    const uint32_t base_lo = (uint32_t)lo, base_hi = (uint32_t)((uint64_t)lo >> 32);
    uint32_t h[TG_CHUNK], a[TG_CHUNK];
    for (int j = 0; j < cnt; j++) {
        uint32_t ilo = base_lo + (uint32_t)j;
        uint32_t ihi = base_hi + (uint32_t)(ilo < base_lo);
        dither[j] = mix32(mix32(ilo ^ k0) ^ ihi ^ k1) >> 8;
        h[j] = mix32(mix32(ilo ^ sk0) ^ ihi ^ sk1);
    }
    if (k == 0) return;
    const uint32_t mask = (1u << k) - 1u;
    const uint32_t magic = k >= 2 ? (uint32_t)((0x100000000ULL + mask - 1) / mask) : 0u;
    for (int j = 0; j < cnt; j++) {
        const uint32_t x = h[j] >> k;
        const uint32_t q = (uint32_t)(((uint64_t)x * magic) >> 32);
        a[j] = k >= 2 ? 1u + (x - q * mask) : 1u;
        h[j] &= mask;                                  /* b: the stratum is built on it */
    }
    for (int i = 0; i < k; i++) {
        const uint32_t row = rows[i];
        for (int j = 0; j < cnt; j++) h[j] ^= row & (0u - ((a[j] >> i) & 1u));
    }
    for (int j = 0; j < cnt; j++) dither[j] = (h[j] << (24 - k)) | (dither[j] >> k);
}

/* Four-level round and pack (format byte 3) into out (ceil(n/4) bytes): rank `rank` of a group with k strata bits
 * (codec/levels.py strata_bits; poly = POLYNOMIALS[k], unused for k <= 1).  Per element, all fp32 as the
 * reference: c = clamp(g, -thr, thr); y = (c / s + 1) * 1.5; L = min(floor(y), 2); f = y - L;
 * code = L + ((float)(2^24 - 1 - dither) < f * 2^24), or 0 where !(s > 0). */
void tg_levels_pack(const float *g, int64_t n, float thr, const float *scalers, int64_t bucket, uint32_t k0,
                    uint32_t k1, uint32_t sk0, uint32_t sk1, uint32_t rank, int k, uint32_t poly, uint8_t *out,
                    int nthreads) {
    uint32_t rows[16];
    uint32_t x = rank;
    for (int j = 0; j < k && j < 16; j++) {        /* rows[j] = x^j · rank in GF(2^k) */
        rows[j] = x;
        x <<= 1;
        if ((x >> k) & 1u) x ^= poly;
    }
    int64_t nchunks = (n + TG_CHUNK - 1) / TG_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        uint8_t codes[TG_CHUNK];
        uint32_t dither[TG_CHUNK];
        float sbuf[TG_CHUNK];
        int64_t lo = ch * TG_CHUNK;
        int cnt = (int)(n - lo < TG_CHUNK ? n - lo : TG_CHUNK);
        fill_scalers(scalers, bucket, lo, cnt, sbuf);
        levels_dithers(lo, cnt, k0, k1, sk0, sk1, k, rows, dither);
        const float *gc = g + lo;
        for (int j = 0; j < cnt; j++) {
            float c = gc[j];
            c = c > thr ? thr : c;
            c = c < -thr ? -thr : c;
            const float s = sbuf[j];
            const float y = (c / s + 1.0f) * 1.5f;
            float low = floorf(y);
            low = low > 2.0f ? 2.0f : low;
            const float f = y - low;
            const float up = (float)(int32_t)(16777215u - dither[j]) < f * 16777216.0f ? 1.0f : 0.0f;
            const int32_t code = (int32_t)(low + up);
            codes[j] = s > 0.0f ? (uint8_t)code : 0;
        }
        pack_chunk(codes, cnt, 3, out + lo / 4);
    }
}

/* Nearest-level ternary codes of d (codec/nearest.py), packed as tg_ternarize_pack packs: code 1 for +1,
 * 2 for -1 where 2|d| >= s (a tie goes to +-1) and s > 0, else 0; 2|d| is exact in fp32, so the comparison is
 * the reference's bit for bit (NaN compares false: code 0, as the reference's where). */
void tg_nearest_pack(const float *d, int64_t n, const float *scalers, int64_t bucket, int fmt, uint8_t *out,
                     int nthreads) {
    const int per = fmt == 1 ? 4 : 5;
    int64_t nchunks = (n + TG_CHUNK - 1) / TG_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        uint8_t codes[TG_CHUNK];
        float sbuf[TG_CHUNK];
        int64_t lo = ch * TG_CHUNK;
        int64_t cnt = n - lo < TG_CHUNK ? n - lo : TG_CHUNK;
        fill_scalers(scalers, bucket, lo, cnt, sbuf);
        const float *dc = d + lo;
        for (int j = 0; j < (int)cnt; j++) {
            float x = dc[j];
            int keep = (2.0f * fabsf(x) >= sbuf[j]) & (sbuf[j] > 0.0f);
            int code = (x > 0.0f) | ((x < 0.0f) << 1);
            codes[j] = (uint8_t)(keep ? code : 0);
        }
        pack_chunk(codes, cnt, fmt, out + lo / per);
    }
}

/* One level of codec/squares.py's ordered_row_sums: y[j] = ((x[j]+x[p+j])+(x[2p+j]+x[3p+j]))+((x[4p+j]+x[5p+j])+
 * (x[6p+j]+x[7p+j])) for j < p = ceil(m/8), x[i] = 0 for i >= m (the reference's zero padding).  In place is safe:
 * y[j] is written after x[j + kp] is read, and later j read only larger indices. */
static int64_t ordered_level(const float *x, int64_t m, float *y) {
    const int64_t p = (m + 7) / 8;
    for (int64_t j = 0; j < p; j++) {
        float v[8];
        for (int k = 0; k < 8; k++) v[k] = j + k * p < m ? x[j + k * p] : 0.0f;
        y[j] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    }
    return p;
}

/* out[r] = ordered sum of clamp(g, -thr, thr)^2 over row r of `rows` contiguous rows of len elements (len >= 1):
 * codec/squares.py's clipped_square_sums on a run of equal shards, the same bits.  The first level (the one over
 * the whole row) runs on the OpenMP threads, each element's 8 parts fetched and clipped and squared there. */
int tg_clipped_square_sums(const float *g, int64_t rows, int64_t len, float thr, float *out, int nthreads) {
    const int64_t p = (len + 7) / 8;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(p > 0 ? p : 1));
    if (!buf) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = g + r * len;
        if (len == 1) {
            float c = x[0] > thr ? thr : x[0];
            c = c < -thr ? -thr : c;
            out[r] = c * c;
            continue;
        }
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t j = 0; j < p; j++) {
            float v[8];
            for (int k = 0; k < 8; k++) {
                float c = j + k * p < len ? x[j + k * p] : 0.0f;
                c = c > thr ? thr : c;
                c = c < -thr ? -thr : c;
                v[k] = c * c;
            }
            buf[j] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
        }
        int64_t m = p;
        while (m > 1) m = ordered_level(buf, m, buf);
        out[r] = buf[0];
    }
    free(buf);
    return 0;
}

/* Counting decode tables: each byte maps to its codes' (t + 1) values in lanes of a uint64, so N
 * payloads are summed with one 64-bit add per byte and payload with no carry between lanes.
 * 2bit: 4 lanes of 16 bits (groups of up to 32767 payloads); base3: 5 lanes of 12 bits (up to 2047). */
static uint64_t lut_lo2[256], lut_lo3[256];
/* Magnitude tables (magnitude=1 in the decodes: the noise estimate's sum of s^2·|t|): each code's |t| in the
 * same lanes, unbiased.  They read codes exactly as the estimate's byte mapping does (exchange/allgather.py
 * noise_estimate): 2bit |t| = (code != 0), so the invalid code 3 counts 1; base3 the five low base-3 digits
 * of the byte, also for the invalid bytes >= 243. */
static uint64_t lut_abs2[256], lut_abs3[256];
static void init_luts(void) {
    static volatile int done = 0;
    if (done) return;
    for (unsigned x = 0; x < 256; x++) {
        uint64_t a = 0, b = 0;
        unsigned y = x;
        for (int q = 0; q < 5; q++) {
            unsigned c2 = (x >> (2 * q)) & 3;               /* code 3 is invalid: read as 0 */
            unsigned c3 = x < 243 ? y % 3 : 0;
            y /= 3;
            unsigned t2 = c2 == 1 ? 2 : (c2 == 2 ? 0 : 1), t3 = c3 == 1 ? 2 : (c3 == 2 ? 0 : 1);
            if (q < 4) a |= (uint64_t)t2 << (16 * q);
            b |= (uint64_t)t3 << (12 * q);
        }
        lut_lo2[x] = a;
        lut_lo3[x] = b;
        uint64_t a2 = 0, b3 = 0;
        unsigned z = x;
        for (int q = 0; q < 5; q++) {
            if (q < 4) a2 |= (uint64_t)(((x >> (2 * q)) & 3) != 0) << (16 * q);
            b3 |= (uint64_t)(z % 3 != 0) << (12 * q);
            z /= 3;
        }
        lut_abs2[x] = a2;
        lut_abs3[x] = b3;
    }
    done = 1;
}


/* Shared scaler (every payload carries the same scalers): out = ((float)k * s) / divisor with
 * k = sum of the payloads' ternary values, an exact integer. */
/* k[j] = sum over the npay payloads of the code value of element start + j, j < cnt <= TG_CHUNK
 * (start a multiple of TG_CHUNK).  Codes are added as biased lanes through a 256-entry table: four 16-bit
 * lanes per 2bit byte, five 12-bit lanes per base3 byte, in groups small enough not to overflow a lane. */
static void sum_codes_chunk(const uint8_t *const *packed, int npay, int64_t start, int64_t cnt, int fmt,
                            int magnitude, int32_t *k) {
    uint64_t lo[TG_CHUNK / 4];
    const int per = fmt == 1 ? 4 : 5;
    const uint64_t *lut = magnitude ? (fmt == 1 ? lut_abs2 : lut_abs3) : (fmt == 1 ? lut_lo2 : lut_lo3);
    const int maxgroup = fmt == 1 ? 32767 : 2047;
    const int64_t nbytes = (cnt + per - 1) / per;
    const int64_t b0 = start / per;
    for (int64_t j = 0; j < TG_CHUNK; j++) k[j] = 0;
    for (int p0 = 0; p0 < npay; p0 += maxgroup) {
        int p1 = p0 + maxgroup < npay ? p0 + maxgroup : npay;
        const int32_t bias = magnitude ? 0 : p1 - p0;
        for (int64_t b = 0; b < nbytes; b++) lo[b] = 0;
        for (int p = p0; p < p1; p++) {
            const uint8_t *src = packed[p] + b0;
            for (int64_t b = 0; b < nbytes; b++) lo[b] += lut[src[b]];
        }
        if (fmt == 1) {
            const uint16_t *l16 = (const uint16_t *)lo;   /* little-endian lanes, in element order */
            for (int64_t j = 0; j < cnt; j++) k[j] += (int32_t)l16[j] - bias;
        } else {
            for (int64_t b = 0; b < nbytes; b++) {
                const uint64_t a = lo[b];
                k[5 * b + 0] += (int32_t)(a & 0xFFF) - bias;
                k[5 * b + 1] += (int32_t)((a >> 12) & 0xFFF) - bias;
                k[5 * b + 2] += (int32_t)((a >> 24) & 0xFFF) - bias;
                k[5 * b + 3] += (int32_t)((a >> 36) & 0xFFF) - bias;
                k[5 * b + 4] += (int32_t)((a >> 48) & 0xFFF) - bias;
            }
        }
    }
}

/* o[j] = ((float)k[j] * s) / divisor, s the scaler of element first + j (one per tensor, or per bucket). */
static inline void scale_chunk(const int32_t *k, int64_t cnt, const float *scalers, int64_t bucket, int64_t first,
                               float divisor, float *o) {
    if (bucket <= 0) {
        const float s = scalers[0];
        for (int64_t j = 0; j < cnt; j++) o[j] = ((float)k[j] * s) / divisor;
    } else {
        float sbuf[TG_CHUNK];
        fill_scalers(scalers, bucket, first, cnt, sbuf);
        for (int64_t j = 0; j < cnt; j++) o[j] = ((float)k[j] * sbuf[j]) / divisor;
    }
}

void tg_decode_average(const uint8_t *const *packed, const float *const *scalers, int npay, int64_t n,
                       int fmt, int64_t bucket, float divisor, int magnitude, float *out, int nthreads);

/* fmt 1 and 2 only: four-level codes (fmt 3) have no integer sums, so they take the general formula (callers send
 * them to tg_decode_average; given one here, it is passed on with every payload pointing at the one scaler set;
 * out of memory for those npay pointers, nothing is written). */
void tg_decode_shared(const uint8_t *const *packed, const float *scalers, int npay, int64_t n, int fmt,
                      int64_t bucket, float divisor, int magnitude, float *out, int nthreads) {
    if (fmt == 3) {
        const float **sp = (const float **)malloc(sizeof(float *) * (size_t)(npay > 0 ? npay : 1));
        if (!sp) return;
        for (int p = 0; p < npay; p++) sp[p] = scalers;
        tg_decode_average(packed, sp, npay, n, fmt, bucket, divisor, magnitude, out, nthreads);
        free(sp);
        return;
    }
    init_luts();
    int64_t nchunks = (n + TG_CHUNK - 1) / TG_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        int32_t k[TG_CHUNK];
        int64_t start = ch * TG_CHUNK;
        int64_t cnt = n - start < TG_CHUNK ? n - start : TG_CHUNK;
        sum_codes_chunk(packed, npay, start, cnt, fmt, magnitude, k);
        scale_chunk(k, cnt, scalers, bucket, start, divisor, out + start);
    }
}

/* acc[per·b + q] = 0 + row (the first payload) or += row (the others), row = table[src[b]], q < per; per is a
 * constant at each call, so the compiler specializes both loops. */
static inline void add_table_rows(float *acc, const uint8_t *src, int64_t nbytes, const float *table, const int per,
                                  int first) {
    if (first) {
        for (int64_t b = 0; b < nbytes; b++) {
            const float *r = table + 8 * src[b];
            for (int q = 0; q < per; q++) acc[per * b + q] = 0.0f + r[q];
        }
    } else {
        for (int64_t b = 0; b < nbytes; b++) {
            const float *r = table + 8 * src[b];
            for (int q = 0; q < per; q++) acc[per * b + q] += r[q];
        }
    }
}

/* Two 2bit payloads with one scaler each (the allgather exchange at N = 2): a 256-entry table indexed by a
 * nibble of each payload (two codes of payload 0 in the low half, payload 1's in the high half) holds the two
 * elements' finished averages ((0 + v0·s0) + v1·s1) / divisor, the general loop's fp32 operations in its order,
 * so one byte of each payload becomes four outputs with two lookups and no arithmetic.  Full bytes only: the
 * caller decodes the last partial byte's elements. */
static void decode_pair_2bit(const uint8_t *p0, const uint8_t *p1, float s0, float s1, int64_t nbytes,
                             float divisor, const float *val, float *out, int nthreads) {
    float pair[256][2];
    for (unsigned x = 0; x < 256; x++)
        for (int q = 0; q < 2; q++) {
            float acc = 0.0f + val[(x >> (2 * q)) & 3] * s0;
            acc += val[(x >> (4 + 2 * q)) & 3] * s1;
            pair[x][q] = acc / divisor;
        }
    const int64_t per_chunk = TG_CHUNK / 4;
    int64_t nchunks = (nbytes + per_chunk - 1) / per_chunk;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        int64_t b1 = (ch + 1) * per_chunk < nbytes ? (ch + 1) * per_chunk : nbytes;
        for (int64_t b = ch * per_chunk; b < b1; b++) {
            const unsigned x0 = p0[b], x1 = p1[b];
            memcpy(out + 4 * b, pair[(x0 & 15u) | ((x1 & 15u) << 4)], 2 * sizeof(float));
            memcpy(out + 4 * b + 2, pair[(x0 >> 4) | (x1 & 0xF0u)], 2 * sizeof(float));
        }
    }
}

/* One scaler per payload: each payload's byte -> its codes' products val[c]·s through a table built once per
 * payload (256 x 8 floats: the same fp32 products the general loop forms element by element), so a byte costs
 * one table row instead of per-code lookups and multiplies.  The sums keep the general loop's order:
 * acc = 0 + x_0, acc += x_p, then / divisor.  Returns -1 (nothing written) when the table cannot be allocated. */
static int decode_average_layerwise(const uint8_t *const *packed, const float *const *scalers, int npay, int64_t n,
                                    int fmt, float divisor, const float *val, float *out, int nthreads) {
    const int per = codes_per_byte(fmt);
    int64_t done = 0;            /* elements the two-payload table wrote; the general loop does the rest */
    if (npay == 2 && per == 4) {
        decode_pair_2bit(packed[0], packed[1], scalers[0][0], scalers[1][0], n / 4, divisor, val, out, nthreads);
        done = n / 4 * 4;
        if (done == n) return 0;
    }
    float *lut = (float *)malloc(sizeof(float) * 8 * 256 * (size_t)(npay > 0 ? npay : 1));
    if (!lut) return -1;
    for (int p = 0; p < npay; p++) {
        const float s = scalers[p][0];
        for (unsigned x = 0; x < 256; x++) {
            float *row = lut + ((size_t)p * 256 + x) * 8;
            unsigned y = x;
            for (int q = 0; q < 8; q++) row[q] = 0.0f;
            for (int q = 0; q < per; q++) {
                unsigned c = per == 4 ? (x >> (2 * q)) & 3 : y % 3;   /* as the general loop reads bytes */
                y /= 3;
                row[q] = val[c] * s;
            }
        }
    }
    int64_t nchunks = (n + TG_CHUNK - 1) / TG_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t ch = done / TG_CHUNK; ch < nchunks; ch++) {
        float acc[TG_CHUNK];
        int64_t lo = ch * TG_CHUNK;
        int64_t cnt = n - lo < TG_CHUNK ? n - lo : TG_CHUNK;
        int64_t nbytes = (cnt + per - 1) / per;
        for (int p = 0; p < npay; p++) {
            const uint8_t *src = packed[p] + lo / per;
            const float *table = lut + (size_t)p * 256 * 8;
            if (per == 4) add_table_rows(acc, src, nbytes, table, 4, p == 0);
            else add_table_rows(acc, src, nbytes, table, 5, p == 0);
        }
        for (int64_t j = 0; j < cnt; j++) out[lo + j] = acc[j] / divisor;
    }
    free(lut);
    return 0;
}

/* Scalers differ between payloads, or the codes are four-level ones (fmt 3, which has no shared-scaler integer
 * path): out[i] = (sum_p v_p[i] * s_p[i]) / divisor, fp32, in payload order.  v: the ternary value of the code, or
 * (fmt 3) its level / s in {-1, -1/3, 1/3, 1}; with magnitude, |t| or (fmt 3) the squared level {1, 1/9, 1/9, 1},
 * the noise estimate's (callers pass squared scalers and divisor). */
void tg_decode_average(const uint8_t *const *packed, const float *const *scalers, int npay, int64_t n,
                       int fmt, int64_t bucket, float divisor, int magnitude, float *out, int nthreads) {
    static const float signed_val[4] = {0.0f, 1.0f, -1.0f, 0.0f}; /* code 3 is invalid: read as 0 */
    static const float abs_val[4] = {0.0f, 1.0f, 1.0f, 1.0f};     /* |t|, as lut_abs2 reads codes */
    static const float level_val[4] = {-1.0f, -1.0f / 3.0f, 1.0f / 3.0f, 1.0f};
    static const float level_sq[4] = {1.0f, 1.0f / 9.0f, 1.0f / 9.0f, 1.0f};
    const float *val = fmt == 3 ? (magnitude ? level_sq : level_val) : (magnitude ? abs_val : signed_val);
    const int per = codes_per_byte(fmt);
    int64_t nchunks = (n + TG_CHUNK - 1) / TG_CHUNK;
    if (bucket <= 0 && decode_average_layerwise(packed, scalers, npay, n, fmt, divisor, val, out, nthreads) == 0)
        return;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        float acc[TG_CHUNK];
        float v[TG_CHUNK];
        int64_t lo = ch * TG_CHUNK;
        int64_t cnt = n - lo < TG_CHUNK ? n - lo : TG_CHUNK;
        int64_t nbytes = (cnt + per - 1) / per;
        for (int p = 0; p < npay; p++) {
            const uint8_t *src = packed[p] + lo / per;
            if (per == 4) {
                for (int64_t b = 0; b < nbytes; b++) {
                    uint8_t x = src[b];
                    v[4 * b] = val[x & 3]; v[4 * b + 1] = val[(x >> 2) & 3];
                    v[4 * b + 2] = val[(x >> 4) & 3]; v[4 * b + 3] = val[(x >> 6) & 3];
                }
            } else {
                for (int64_t b = 0; b < nbytes; b++) {
                    unsigned x = src[b];
                    for (int q = 0; q < 5; q++) { v[5 * b + q] = val[x % 3]; x /= 3; }
                }
            }
            if (bucket <= 0) {
                const float s = scalers[p][0];
                if (p == 0) for (int64_t j = 0; j < cnt; j++) acc[j] = 0.0f + v[j] * s;
                else for (int64_t j = 0; j < cnt; j++) acc[j] += v[j] * s;
            } else {
                float sbuf[TG_CHUNK];
                fill_scalers(scalers[p], bucket, lo, cnt, sbuf);
                if (p == 0) for (int64_t j = 0; j < cnt; j++) acc[j] = 0.0f + v[j] * sbuf[j];
                else for (int64_t j = 0; j < cnt; j++) acc[j] += v[j] * sbuf[j];
            }
        }
        for (int64_t j = 0; j < cnt; j++) out[lo + j] = acc[j] / divisor;
    }
}

/* Sharded exchange: owners' sums k in [-N, N] stored as k + N in L bits, little-endian bitstream.
 * Work goes in chunks of TG_CHUNK elements (a multiple of 8), so every chunk starts on a byte of the
 * stream and threads never share a byte.  With L <= 8, 8 values fill exactly L bytes. */
static void pack_bits_chunk(const int32_t *k, int64_t cnt, int32_t bias, int bits, uint8_t *dst) {
    int64_t j = 0;
    if (bits <= 8) {
        for (; j + 8 <= cnt; j += 8) {
            uint64_t v = 0;
            for (int q = 0; q < 8; q++) v |= (uint64_t)(uint32_t)(k[j + q] + bias) << (q * bits);
            uint8_t *o = dst + (j / 8) * bits;
            for (int b = 0; b < bits; b++) o[b] = (uint8_t)(v >> (8 * b));
        }
    }
    uint8_t *o = dst + (j * bits) / 8;          /* j is a multiple of 8 */
    uint64_t acc = 0;
    int have = 0;
    for (; j < cnt; j++) {
        acc |= (uint64_t)(uint32_t)(k[j] + bias) << have;
        have += bits;
        while (have >= 8) { *o++ = (uint8_t)acc; acc >>= 8; have -= 8; }
    }
    if (have > 0) *o = (uint8_t)acc;
}

static void unpack_bits_chunk(const uint8_t *src, int64_t cnt, int32_t bias, int bits, int32_t *k) {
    const uint64_t mask = (1ULL << bits) - 1;
    int64_t j = 0;
    if (bits <= 8) {
        for (; j + 8 <= cnt; j += 8) {
            const uint8_t *i = src + (j / 8) * bits;
            uint64_t v = 0;
            for (int b = 0; b < bits; b++) v |= (uint64_t)i[b] << (8 * b);
            for (int q = 0; q < 8; q++) k[j + q] = (int32_t)((v >> (q * bits)) & mask) - bias;
        }
    }
    const uint8_t *i = src + (j * bits) / 8;
    uint64_t acc = 0;
    int have = 0;
    for (; j < cnt; j++) {
        while (have < bits) { acc |= (uint64_t)*i++ << have; have += 8; }
        k[j] = (int32_t)(acc & mask) - bias;
        acc >>= bits;
        have -= bits;
    }
}

/* One owner's shard of m elements: add the N ranks' code chunks (rank order) and pack k + N in L bits. */
void tg_owner_sums(const uint8_t *const *packed, int npay, int64_t m, int fmt, int bits, uint8_t *out,
                   int nthreads) {
    init_luts();
    int64_t nchunks = (m + TG_CHUNK - 1) / TG_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        int32_t k[TG_CHUNK];
        int64_t start = ch * TG_CHUNK;
        int64_t cnt = m - start < TG_CHUNK ? m - start : TG_CHUNK;
        sum_codes_chunk(packed, npay, start, cnt, fmt, 0, k);
        pack_bits_chunk(k, cnt, npay, bits, out + (start * bits) / 8);
    }
}

/* out[i] = ((float)k * s) / divisor for the m sums of one shard that starts at element `start`. */
void tg_unpack_sums(const uint8_t *data, int64_t m, int nranks, int bits, const float *scalers, int64_t bucket,
                    int64_t start, float divisor, float *out, int nthreads) {
    int64_t nchunks = (m + TG_CHUNK - 1) / TG_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        int32_t k[TG_CHUNK];
        int64_t lo = ch * TG_CHUNK;
        int64_t cnt = m - lo < TG_CHUNK ? m - lo : TG_CHUNK;
        unpack_bits_chunk(data + (lo * bits) / 8, cnt, nranks, bits, k);
        scale_chunk(k, cnt, scalers, bucket, start + lo, divisor, out + lo);
    }
}

/* horovod_terngrad.optim's default-mode Adam(W) step on one fp32 tensor, one pass instead of a dozen foreach
 * passes (optim/adam.py writes the same update with torch ops, used on other devices and dtypes):
 *   g' = (maximize ? -g : g) + l2 * p                 (l2: Adam's L2 weight decay, 0 for AdamW)
 *   m  = m + c1 * (g' - m)                            (c1 = 1 - b1, c2 = 1 - b2: rounded from the doubles on
 *   v  = b2 * v + c2 * g' * g'                          the host, as torch rounds its Python-float scalars)
 *   n  = b2 * n + noise_coef * noise                  (noise NULL: n = b2 * n)
 *   vh = max(v - n, floor * v)    (vmax non-NULL, amsgrad: vmax = max(vmax, vh); vh = vmax)
 *   p  = p * decay - step * m / (sqrt(vh) * inv_bias2_sqrt + eps)   (decay: 1 - lr * wd for AdamW; step = lr / bias1)
 * All fp32, elementwise: no ordering question across threads.  One loop per combination of the three flags
 * (maximize, an estimate, amsgrad), restrict-qualified and built with -fno-math-errno (cpu.py), so that the compiler
 * vectorizes it: sqrt and division stay IEEE-rounded per lane, the bytes those of the scalar loop. */
#define TG_ADAM_LOOP(NAME, MAXIMIZE, NOISE, VMAX)                                                                      \
    static void NAME(                                                                                                \
        float *restrict p, float *restrict m, float *restrict v, float *restrict n, const float *restrict g,         \
        const float *restrict noise, float *restrict vmax, int64_t lo, int64_t hi, float c1, float b2, float c2,     \
        float step, float inv_bias2_sqrt, float eps, float decay, float l2, float noise_coef, float floor_) {        \
        (void)noise; (void)vmax; (void)noise_coef;                                                                   \
        for (int64_t i = lo; i < hi; i++) {                                                                          \
            float gi = MAXIMIZE ? -g[i] : g[i];                                                                      \
            gi = gi + l2 * p[i];                                                                                     \
            const float mi = m[i] + c1 * (gi - m[i]);                                                                \
            const float vi = b2 * v[i] + c2 * (gi * gi);                                                             \
            const float ni = b2 * n[i] + (NOISE ? noise_coef * noise[i] : 0.0f);                                     \
            float vh = vi - ni;                                                                                      \
            const float fl = floor_ * vi;                                                                            \
            vh = vh > fl ? vh : fl;                                                                                  \
            if (VMAX) {                                                                                              \
                const float x = vmax[i] > vh ? vmax[i] : vh;                                                         \
                vmax[i] = x;                                                                                         \
                vh = x;                                                                                              \
            }                                                                                                        \
            m[i] = mi; v[i] = vi; n[i] = ni;                                                                         \
            p[i] = p[i] * decay - step * mi / (sqrtf(vh) * inv_bias2_sqrt + eps);                                    \
        }                                                                                                            \
    }
TG_ADAM_LOOP(adam_loop_000, 0, 0, 0)
TG_ADAM_LOOP(adam_loop_001, 0, 0, 1)
TG_ADAM_LOOP(adam_loop_010, 0, 1, 0)
TG_ADAM_LOOP(adam_loop_011, 0, 1, 1)
TG_ADAM_LOOP(adam_loop_100, 1, 0, 0)
TG_ADAM_LOOP(adam_loop_101, 1, 0, 1)
TG_ADAM_LOOP(adam_loop_110, 1, 1, 0)
TG_ADAM_LOOP(adam_loop_111, 1, 1, 1)
#undef TG_ADAM_LOOP

typedef void (*adam_loop_fn)(float *, float *, float *, float *, const float *, const float *, float *, int64_t,
                             int64_t, float, float, float, float, float, float, float, float, float, float);

void tg_adam_corrected(float *p, float *m, float *v, float *n, const float *g, const float *noise, float *vmax,
                       int64_t count, float c1, float b2, float c2, float step, float inv_bias2_sqrt, float eps, float decay,
                       float l2, float noise_coef, float floor_, int maximize, int nthreads) {
    static const adam_loop_fn loops[8] = {adam_loop_000, adam_loop_001, adam_loop_010, adam_loop_011,
                                          adam_loop_100, adam_loop_101, adam_loop_110, adam_loop_111};
    const adam_loop_fn loop = loops[(maximize ? 4 : 0) | (noise ? 2 : 0) | (vmax ? 1 : 0)];
    if (nthreads <= 1 || count <= 65536) {
        loop(p, m, v, n, g, noise, vmax, 0, count, c1, b2, c2, step, inv_bias2_sqrt, eps, decay, l2, noise_coef,
             floor_);
        return;
    }
#ifdef _OPENMP
    #pragma omp parallel num_threads(nthreads)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t per = (count + nt - 1) / nt, lo = t * per < count ? t * per : count;
        const int64_t hi = lo + per < count ? lo + per : count;
        loop(p, m, v, n, g, noise, vmax, lo, hi, c1, b2, c2, step, inv_bias2_sqrt, eps, decay, l2, noise_coef, floor_);
    }
#else
    loop(p, m, v, n, g, noise, vmax, 0, count, c1, b2, c2, step, inv_bias2_sqrt, eps, decay, l2, noise_coef, floor_);
#endif
}

/* The requantized exchange's owner payload (codec/requant.py, the reference; sizes.requantized_owner_bytes):
 *   8 header bytes: 'R' 'Q' '4', flags (| 0x02 with the noise channel), m as uint32 little-endian;
 *   G = ceil(m/128) fp32 steps, step = max|a| / 7 over the group;
 *   ceil(m/2) bytes of codes c + 7 in 4 bits, low nibble first (an odd m's last high nibble 7, code 0);
 *   with the noise channel: G fp32 maxima νmax of ν = noise + Δ²·f·(1 - f), ceil(m/8) bytes of bits, least
 *   significant first; zeros up to a multiple of 4 bytes.
 * Per element, in the reference's fp32 operations and order: q = Δ > 0 ? a / Δ : 0, clamped to [-7, 7];
 * f = q - floor(q); up = (float)u < f·2^24 with u = uniform24(key, start + i) (tg_ternarize_pack's stream);
 * code = clamp(floor(q) + up, -7, 7) as int8 (a NaN, which only a non-finite shard produces, reads 0, as
 * torch casts it on x86); variance ((Δ·Δ)·f)·(1 - f); bit = (float)u' < (νmax > 0 ? ν / νmax : 0)·2^24.
 * Maxima: exact in any order; a NaN in a group makes its maximum the quiet NaN 0x7fc00000, as torch's amax. */
#define TG_RQ_GROUP 128
#define TG_RQ_CHUNK 1024 /* 8 groups: chunks start on a code byte, a bit byte and a group */

static inline uint32_t tg_u24(uint64_t i, uint32_t k0, uint32_t k1) {
    return mix32(mix32((uint32_t)i ^ k0) ^ (uint32_t)(i >> 32) ^ k1) >> 8;
}

/* max over x[0..cnt) starting from 0 (the reference pads a short group with zeros); with a NaN there, the
 * quiet NaN 0x7fc00000 whatever the NaN's sign and payload, as torch's amax returns */
static inline float rq_group_max(const float *x, int cnt, int take_abs) {
    float m = 0.0f;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int j = 0; j < cnt; j++) {
        float v = take_abs ? fabsf(x[j]) : x[j];
        nan |= v != v;
        m = v > m ? v : m;
    }
    if (nan) {
        const uint32_t bits = 0x7fc00000U;
        memcpy(&m, &bits, 4);
    }
    return m;
}

/* noise: the first stage's estimate (m floats), read when with_noise (it may be NULL for m = 0). */
void tg_requant_encode(const float *a, const float *noise, int with_noise, int64_t m, int64_t start, uint32_t ka0,
                       uint32_t ka1, uint32_t kn0, uint32_t kn1, int flags, uint8_t *out, int64_t total,
                       int nthreads) {
    const int64_t G = (m + TG_RQ_GROUP - 1) / TG_RQ_GROUP;
    uint8_t *steps_at = out + 8, *codes_at = steps_at + 4 * G;
    uint8_t *tops_at = codes_at + (m + 1) / 2, *bits_at = tops_at + 4 * G;
    const int64_t used = with_noise ? (int64_t)(bits_at - out) + (m + 7) / 8 : (int64_t)(tops_at - out);
    const uint32_t m32 = (uint32_t)m;
    out[0] = 'R'; out[1] = 'Q'; out[2] = '4';
    out[3] = (uint8_t)(flags | (with_noise ? 0x02 : 0));
    for (int q = 0; q < 4; q++) out[4 + q] = (uint8_t)(m32 >> (8 * q));
    for (int64_t b = used; b < total; b++) out[b] = 0;
    const int64_t nchunks = (m + TG_RQ_CHUNK - 1) / TG_RQ_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        const int64_t lo = ch * TG_RQ_CHUNK;
        const int cnt = (int)(m - lo < TG_RQ_CHUNK ? m - lo : TG_RQ_CHUNK);
        const float *ac = a + lo;
        uint32_t h[TG_RQ_CHUNK];
        uint8_t u[TG_RQ_CHUNK + 1];
        float var[TG_RQ_CHUNK];
        for (int j = 0; j < cnt; j++) h[j] = tg_u24((uint64_t)(start + lo + j), ka0, ka1);
        for (int g0 = 0; g0 < cnt; g0 += TG_RQ_GROUP) {
            const int gc = cnt - g0 < TG_RQ_GROUP ? cnt - g0 : TG_RQ_GROUP;
            const float d = rq_group_max(ac + g0, gc, 1) / 7.0f;
            memcpy(steps_at + 4 * ((lo + g0) / TG_RQ_GROUP), &d, 4);
            for (int j = g0; j < g0 + gc; j++) {
                float q = d > 0.0f ? ac[j] / d : 0.0f;
                q = q < -7.0f ? -7.0f : q;
                q = q > 7.0f ? 7.0f : q;
                const float low = floorf(q);
                const float f = q - low;
                float c = low + ((float)(int32_t)h[j] < f * 16777216.0f ? 1.0f : 0.0f);
                c = c < -7.0f ? -7.0f : c;
                c = c > 7.0f ? 7.0f : c;
                u[j] = (uint8_t)((c == c ? (int)c : 0) + 7);
                var[j] = ((d * d) * f) * (1.0f - f);
            }
        }
        u[cnt] = 7;                                  /* an odd m's last high nibble: code 0 */
        uint8_t *oc = codes_at + lo / 2;
        for (int b = 0; b < (cnt + 1) / 2; b++) oc[b] = (uint8_t)(u[2 * b] | (u[2 * b + 1] << 4));
        if (!with_noise) continue;
        const float *nc = noise + lo;
        for (int j = 0; j < cnt; j++) {
            var[j] = nc[j] + var[j];                 /* ν, in the reference's order: noise + variance */
            h[j] = tg_u24((uint64_t)(start + lo + j), kn0, kn1);
        }
        for (int g0 = 0; g0 < cnt; g0 += TG_RQ_GROUP) {
            const int gc = cnt - g0 < TG_RQ_GROUP ? cnt - g0 : TG_RQ_GROUP;
            const float top = rq_group_max(var + g0, gc, 0);
            memcpy(tops_at + 4 * ((lo + g0) / TG_RQ_GROUP), &top, 4);
            for (int j = g0; j < g0 + gc; j++) {
                const float p = top > 0.0f ? var[j] / top : 0.0f;
                u[j] = (float)(int32_t)h[j] < p * 16777216.0f;
            }
        }
        for (int j = cnt; j < (cnt + 7) / 8 * 8; j++) u[j] = 0;
        uint8_t *ob = bits_at + lo / 8;
        for (int b = 0; b < (cnt + 7) / 8; b++) {
            const uint8_t *x = u + 8 * b;
            ob[b] = (uint8_t)(x[0] | (x[1] << 1) | (x[2] << 2) | (x[3] << 3) | (x[4] << 4) | (x[5] << 5) |
                              (x[6] << 6) | (x[7] << 7));
        }
    }
}

/* Decode an owner's payload of m elements at buf (any alignment): out[i] = ((float)nibble - 7) · step;
 * noise_out (NULL: not read) [i] = (float)bit · νmax, as codec/requant.py's decode. */
void tg_requant_decode(const uint8_t *buf, int64_t m, float *out, float *noise_out, int nthreads) {
    const int64_t G = (m + TG_RQ_GROUP - 1) / TG_RQ_GROUP;
    const uint8_t *steps_at = buf + 8, *codes_at = steps_at + 4 * G;
    const uint8_t *tops_at = codes_at + (m + 1) / 2, *bits_at = tops_at + 4 * G;
    const int64_t nchunks = (m + TG_RQ_CHUNK - 1) / TG_RQ_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        const int64_t lo = ch * TG_RQ_CHUNK;
        const int cnt = (int)(m - lo < TG_RQ_CHUNK ? m - lo : TG_RQ_CHUNK);
        const int ng = (cnt + TG_RQ_GROUP - 1) / TG_RQ_GROUP;
        float s[TG_RQ_CHUNK / TG_RQ_GROUP];
        float c[TG_RQ_CHUNK + 8];
        memcpy(s, steps_at + 4 * (lo / TG_RQ_GROUP), 4 * (size_t)ng);
        const uint8_t *ic = codes_at + lo / 2;
        const int nb = (cnt + 1) / 2;
        for (int b = 0; b < nb; b++) {              /* the codes as floats, nibble - 7 (exact) */
            const uint8_t x = ic[b];
            c[2 * b] = (float)(x & 0x0F) - 7.0f;
            c[2 * b + 1] = (float)(x >> 4) - 7.0f;
        }
        float *o = out + lo;
        for (int g = 0; g < ng; g++) {
            const int j0 = g * TG_RQ_GROUP, j1 = j0 + TG_RQ_GROUP < cnt ? j0 + TG_RQ_GROUP : cnt;
            const float d = s[g];
            for (int j = j0; j < j1; j++) o[j] = c[j] * d;
        }
        if (!noise_out) continue;
        memcpy(s, tops_at + 4 * (lo / TG_RQ_GROUP), 4 * (size_t)ng);
        const uint8_t *ib = bits_at + lo / 8;
        for (int b = 0; b < (cnt + 7) / 8; b++) {
            const uint8_t x = ib[b];
            for (int q = 0; q < 8; q++) c[8 * b + q] = (float)((x >> q) & 1);
        }
        float *n = noise_out + lo;
        for (int g = 0; g < ng; g++) {
            const int j0 = g * TG_RQ_GROUP, j1 = j0 + TG_RQ_GROUP < cnt ? j0 + TG_RQ_GROUP : cnt;
            const float t = s[g];
            for (int j = j0; j < j1; j++) n[j] = c[j] * t;
        }
    }
}
