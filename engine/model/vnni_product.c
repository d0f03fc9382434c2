/* Weight-only products with int8 activations through AVX-512 VNNI dot products
 * (kernel "woq-vnni", `model/vnni_linear.py`): llama.cpp's way of multiplying its
 * 4-bit blocks, for one to a few rows.
 *
 * Activations: each row of `x` is rounded per group of 32 inputs to int8 codes with a
 * scale (the group's largest magnitude / 127), as llama.cpp's Q8 blocks.
 * Weights, in tiles of 16 output rows, each tile's bytes contiguous (one stream):
 * - 4 bits (a GGUF's Q4_1 groups: weight = code * scale + minimum, codes 0..15): per
 *   group of 32 inputs, 256 bytes of codes, then the 16 rows' scales and minimums as
 *   float16 (the GGUF's own values). Byte `row * 4 + b` of the codes' 64-byte part `q`
 *   holds input `8q + b` of that row in its low half and input `8q + 4 + b` in its high.
 * - 8 bits per output channel (weight = code * scale, codes -127..127): the tile's 16
 *   float scales, then per group 512 bytes, part `j` holding inputs `4j..4j+3` of the
 *   16 rows as `code + 128` (the unsigned operand of the dot product).
 * `vpdpbusd` multiplies 64 unsigned weight bytes by 4 broadcast activation bytes and
 * adds each row's 4 products into its 32-bit lane: one instruction per 4 inputs of 16
 * rows, exact integers; each group's sum is scaled once, in float32. The 4-bit form's
 * minimum term is `minimum * sum(x)`, the 8-bit form's offset `128 * sum(x)`, both from
 * the activation's group sums.
 *
 * Up to 8 rows share each tile's weights while they are in registers; more rows take
 * further passes. Tiles are spread over torch's OpenMP threads. Built at first use by
 * `engine/native_build.py`; without AVX-512 VNNI it builds a stub that says so.
 */
#include <stdint.h>
#include <stdlib.h>

#define GROUP 32
#define TILE 16
#define MAX_ROWS 8

/* The bytes of the packed weights for `bits`-bit weights of `k` inputs and `n` outputs
 * (0: shapes the layout cannot take). */
int64_t wavecore_vnni_packed_bytes(int bits, int64_t k, int64_t n) {
    if (k < GROUP || k % GROUP || n < TILE || n % TILE || (bits != 4 && bits != 8)) return 0;
    int64_t groups = k / GROUP;
    return n / TILE * (bits == 4 ? groups * 320 : TILE * (int64_t)sizeof(float) + groups * 512);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

int wavecore_vnni_available(void) { return 1; }

/* One row: its int8 codes per group, each group's scale and scale * sum(codes). */
static void quantize_row(const float *x, int64_t groups, int8_t *codes, float *scale,
                         float *scaled_sum) {
    for (int64_t g = 0; g < groups; g++) {
        __m512 a = _mm512_loadu_ps(x + g * GROUP), b = _mm512_loadu_ps(x + g * GROUP + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        __m512 inverse = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));
        __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
        _mm_storeu_si128((__m128i *)(codes + g * GROUP), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(codes + g * GROUP + 16), _mm512_cvtsepi32_epi8(qb));
        scale[g] = amax / 127.0f;
        scaled_sum[g] = scale[g] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}

/* The activations' four codes at `codes[4 * part]`, in every 32-bit lane. */
static inline __m512i broadcast4(const int8_t *codes, int part) {
    return _mm512_set1_epi32(((const int32_t *)codes)[part]);
}

static inline __attribute__((always_inline)) void tile_4bit(
    const uint8_t *p, int64_t groups, int rows, const int8_t *codes, const float *scale,
    const float *scaled_sum, float *out, int64_t n) {
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low_half = _mm512_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; g++, p += 320) {
        __m512i w[8];
        for (int q = 0; q < 4; q++) {
            __m512i both = _mm512_loadu_si512(p + 64 * q);
            w[2 * q] = _mm512_and_si512(both, low_half);
            w[2 * q + 1] = _mm512_and_si512(_mm512_srli_epi16(both, 4), low_half);
        }
        __m512 w_scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
        __m512 w_min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));
        for (int r = 0; r < rows; r++) {
            const int8_t *x = codes + r * groups * GROUP + g * GROUP;
            __m512i dot = _mm512_setzero_si512();
            for (int part = 0; part < 8; part++)
                dot = _mm512_dpbusd_epi32(dot, w[part], broadcast4(x, part));
            int64_t at = r * groups + g;
            __m512 both_scales = _mm512_mul_ps(w_scale, _mm512_set1_ps(scale[at]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), both_scales, acc[r]);
            acc[r] = _mm512_fmadd_ps(w_min, _mm512_set1_ps(scaled_sum[at]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * n, acc[r]);
}

static inline __attribute__((always_inline)) void tile_8bit(
    const uint8_t *p, int64_t groups, int rows, const int8_t *codes, const float *scale,
    const float *row_sum, float *out, int64_t n) {
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    __m512 w_scale = _mm512_loadu_ps((const float *)p);
    p += TILE * sizeof(float);
    for (int64_t g = 0; g < groups; g++, p += 512) {
        __m512i dot[MAX_ROWS];
        for (int r = 0; r < rows; r++) dot[r] = _mm512_setzero_si512();
        for (int part = 0; part < 8; part++) {
            __m512i w = _mm512_loadu_si512(p + 64 * part);
            for (int r = 0; r < rows; r++)
                dot[r] = _mm512_dpbusd_epi32(
                    dot[r], w, broadcast4(codes + r * groups * GROUP + g * GROUP, part));
        }
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                                     _mm512_set1_ps(scale[r * groups + g]), acc[r]);
    }
    /* sum((code + 128) x) = sum(code x) + 128 sum(x) */
    for (int r = 0; r < rows; r++) {
        __m512 offset = _mm512_set1_ps(128.0f * row_sum[r]);
        _mm512_storeu_ps(out + r * n, _mm512_mul_ps(w_scale, _mm512_sub_ps(acc[r], offset)));
    }
}

/* Instantiated per row count, so that each keeps its accumulators in registers. */
#define FOR_ROWS(CALL)                 \
    switch (rows) {                    \
    case 1: CALL(1); break;            \
    case 2: CALL(2); break;            \
    case 3: CALL(3); break;            \
    case 4: CALL(4); break;            \
    case 5: CALL(5); break;            \
    case 6: CALL(6); break;            \
    case 7: CALL(7); break;            \
    default: CALL(8); break;           \
    }

/* out[m, n] = x[m, k] @ W.T for W packed as above (`bits` 4 or 8). 0 on success, 1 for
 * shapes it cannot take, 2 when out of memory. */
int wavecore_vnni_product(const float *x, int64_t m, int64_t k, int64_t n, int bits,
                          const uint8_t *weights, float *out) {
    if (m < 1 || k < GROUP || k % GROUP || n % TILE || (bits != 4 && bits != 8)) return 1;
    int64_t groups = k / GROUP;
    /* codes, then per row and group: scale, scaled sum; then per row the sums' total */
    float *scale = malloc(sizeof(float) * (2 * m * groups + m) + m * k);
    if (!scale) return 2;
    float *scaled_sum = scale + m * groups, *row_sum = scaled_sum + m * groups;
    int8_t *codes = (int8_t *)(row_sum + m);
    for (int64_t r = 0; r < m; r++) {
        quantize_row(x + r * k, groups, codes + r * k, scale + r * groups,
                     scaled_sum + r * groups);
        float total = 0;
        for (int64_t g = 0; g < groups; g++) total += scaled_sum[r * groups + g];
        row_sum[r] = total;
    }
    int64_t tile_bytes = wavecore_vnni_packed_bytes(bits, k, n) / (n / TILE);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < n / TILE; t++) {
        const uint8_t *p = weights + t * tile_bytes;
        for (int64_t first = 0; first < m; first += MAX_ROWS) {
            int rows = m - first < MAX_ROWS ? (int)(m - first) : MAX_ROWS;
            const int8_t *c = codes + first * k;
            float *o = out + first * n + t * TILE;
            if (bits == 4) {
#define TILE_4BIT(R) \
    tile_4bit(p, groups, R, c, scale + first * groups, scaled_sum + first * groups, o, n)
                FOR_ROWS(TILE_4BIT)
            } else {
#define TILE_8BIT(R) \
    tile_8bit(p, groups, R, c, scale + first * groups, row_sum + first, o, n)
                FOR_ROWS(TILE_8BIT)
            }
        }
    }
    free(scale);
    return 0;
}

#else
int wavecore_vnni_available(void) { return 0; }

int wavecore_vnni_product(const float *x, int64_t m, int64_t k, int64_t n, int bits,
                          const uint8_t *weights, float *out) {
    return 1;
}
#endif
