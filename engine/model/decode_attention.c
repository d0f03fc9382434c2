/* Decode attention straight from a paged bfloat16 KV cache (`model/native_attention.py`).
 *
 * One query token per sequence. For each (sequence, query head): the scores against
 * every cached key of the sequence, read block by block through its block table (no
 * gathered copy), a softmax, and the values weighted by it, all in float32; keys and
 * values are widened from bfloat16 as they are read (exact). Query heads of one KV
 * head read the same rows (grouped-query attention, no repeated keys).
 *
 * Vectors are GCC's generic 16-float vectors: AVX-512 registers where the CPU has them
 * (`-march=native`), pairs of AVX2 ones elsewhere. Compiled at first use by
 * `engine/native_build.py`.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

#define MAX_CHUNKS 16 /* head_dim up to 256 */

/* 16 bfloat16 values as floats: a bfloat16 is a float's upper half. */
static inline f32x16 load_bf16(const uint16_t *p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
    u32x16 wide = __builtin_convertvector(h, u32x16) << 16;
    f32x16 f;
    memcpy(&f, &wide, sizeof f);
    return f;
}

static inline float sum16(f32x16 v) {
    f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* e^x for x <= 0 (scores less their maximum), to a few ulp: x = n ln2 + r with
 * |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial, 2^n through the exponent.
 * Below -87 (and the padding's -inf) it gives e^-87, negligible beside the maximum's 1. */
static inline f32x16 exp16(f32x16 x) {
    const f32x16 lowest = (f32x16){0} - 87.0f;
    i32x16 below = x < lowest, xi, low;
    memcpy(&xi, &x, sizeof xi);
    memcpy(&low, &lowest, sizeof low);
    xi = (xi & ~below) | (low & below);
    memcpy(&x, &xi, sizeof x);
    /* x <= 0: truncating x log2(e) - 1/2 rounds it to the nearest integer. */
    f32x16 n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f - 0.5f, i32x16),
                                       f32x16);
    f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f; /* ln2 in two parts */
    f32x16 p = (f32x16){0} + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
    f32x16 scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* One query head over one sequence: out = softmax(q . k_t * scale) . v_t for t <
 * context. `keys`/`values` point at this KV head's first row of block 0; `scores` holds
 * the context rounded up to 16. */
static void one_head(const float *q, const uint16_t *keys, const uint16_t *values,
                     const int64_t *table, int64_t context, int64_t chunks, int64_t block_size,
                     int64_t row_stride, int64_t block_stride, float scale, float *scores,
                     float *out) {
    f32x16 qv[MAX_CHUNKS];
    for (int64_t c = 0; c < chunks; c++) {
        memcpy(&qv[c], q + 16 * c, sizeof(f32x16));
        qv[c] *= scale;
    }
    float top = -INFINITY;
    for (int64_t start = 0, b = 0; start < context; start += block_size, b++) {
        const uint16_t *k = keys + table[b] * block_stride;
        int64_t rows = context - start < block_size ? context - start : block_size;
        for (int64_t j = 0; j < rows; j++, k += row_stride) {
            f32x16 dot = qv[0] * load_bf16(k);
            for (int64_t c = 1; c < chunks; c++) dot += qv[c] * load_bf16(k + 16 * c);
            float score = sum16(dot);
            scores[start + j] = score;
            top = score > top ? score : top;
        }
    }
    int64_t padded = (context + 15) / 16 * 16;
    for (int64_t t = context; t < padded; t++) scores[t] = -INFINITY;
    f32x16 sums = {0};
    for (int64_t t = 0; t < padded; t += 16) {
        f32x16 e;
        memcpy(&e, scores + t, sizeof e);
        e = exp16(e - top);
        memcpy(scores + t, &e, sizeof e);
        sums += e;
    }
    float inverse = 1.0f / sum16(sums);
    for (int64_t c = 0; c < chunks; c++) {
        f32x16 acc = {0};
        for (int64_t start = 0, b = 0; start < context; start += block_size, b++) {
            const uint16_t *v = values + table[b] * block_stride + 16 * c;
            int64_t rows = context - start < block_size ? context - start : block_size;
            for (int64_t j = 0; j < rows; j++, v += row_stride) acc += scores[start + j] * load_bf16(v);
        }
        acc *= inverse;
        memcpy(out + 16 * c, &acc, sizeof acc);
    }
}

/* queries, out: [seqs, heads, dim] float32; pools: [blocks, block_size, kv_heads, dim]
 * bfloat16; tables: [seqs, table_stride] int64 block ids; lengths: [seqs] int64, each
 * at least 1 and covered by its table. dim a multiple of 16 up to 256 and heads a
 * multiple of kv_heads, else 1; 2 when memory runs out; 0 done. The caller checks the
 * shapes; the kernel trusts them. */
int wavecore_decode_attention(const float *queries, const uint16_t *key_pool,
                              const uint16_t *value_pool, const int64_t *tables,
                              int64_t table_stride, const int64_t *lengths, int64_t seqs,
                              int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                              float scale, float *out) {
    if (dim % 16 != 0 || dim / 16 > MAX_CHUNKS || kv_heads < 1 || heads % kv_heads != 0)
        return 1;
    int64_t group = heads / kv_heads, tasks = seqs * heads, work = 0, longest = 0;
    for (int64_t s = 0; s < seqs; s++) {
        work += lengths[s];
        longest = lengths[s] > longest ? lengths[s] : longest;
    }
    int64_t row_stride = kv_heads * dim, block_stride = block_size * kv_heads * dim;
    int failed = 0;
    /* One thread below ~64k multiply-adds: waking the second costs more than it saves. */
    #pragma omp parallel if (work * heads * dim >= (1 << 16))
    {
        float *scores = malloc(sizeof(float) * ((longest + 15) / 16 * 16));
        if (scores == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (scores == NULL) continue;
            int64_t s = task / heads, h = task % heads, kv = h / group;
            one_head(queries + (s * heads + h) * dim, key_pool + kv * dim, value_pool + kv * dim,
                     tables + s * table_stride, lengths[s], dim / 16, block_size, row_stride,
                     block_stride, scale, scores, out + (s * heads + h) * dim);
        }
        free(scores);
    }
    return failed ? 2 : 0;
}
