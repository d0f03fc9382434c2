/* LoRA deltas of one fused product for a whole step, every adapter in one call.
 *
 * For each row t whose owner[t] = i >= 0, and adapter i's delta d (its table's entry
 * `entry`, skipped where d->a is NULL):
 *     h = x[t] @ d->a                      (d->a: [in, R], R a multiple of 16)
 *     out[t, blk.out_start:blk.out_stop] += h[blk.start:blk.stop] @ blk.b   per block
 * Rows of one adapter go in groups of up to four, so each weight read serves four
 * rows; the groups are spread over `threads` OpenMP threads (the process's runtime,
 * the one torch loaded). Each row's sums run in the same order whatever its group or
 * the batch around it. Weights are float32 or bfloat16 (two entry points below); the
 * activations and the accumulation are float32.
 *
 * On a CPU with AVX-512 BF16 a third entry point takes bfloat16 weights laid out in
 * pairs (a: [in/2][R][2], each block's b: [ceil(rank/2)][width][2]) and multiplies
 * with `vdpbf16ps`, two products per lane and instruction, after rounding each row of
 * x, and of h, to bfloat16 (as the base's own bfloat16 kernels round the rows they
 * take); the sums stay float32. `wc_lora_pairs` says whether it was built.
 *
 * Compiled at first use by `engine/native_build.py` (`cc -O3 -march=native -fopenmp`); the
 * vectors are GCC's generic ones, so the same source builds wherever GCC or Clang
 * does, with the widest registers the CPU has. Python (`native.py`) checks every
 * descriptor against the model's shapes when it builds one; this file trusts them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t start, stop;         /* this block's columns of h */
    int32_t out_start, out_stop; /* its columns of out */
    const void *b;               /* [stop - start, out_stop - out_start], row-major */
} wc_block;

typedef struct {
    const void *a; /* [in, R], row-major; NULL: the adapter has no delta here */
    int32_t R;
    int32_t n_blocks;
    const wc_block *blocks;
} wc_delta;

typedef float v16 __attribute__((vector_size(64)));
/* Unaligned views: loads and stores through these are single vector moves. */
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t h16u __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint32_t w16 __attribute__((vector_size(64)));

#define GROUP 4

static inline v16 splat(float s) { return (v16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
static inline v16 load(const float *p) { return *(const v16u *)p; }
static inline void store(float *p, v16 v) { *(v16u *)p = v; }

/* 16 weights from element i of w, widened to float32 (bfloat16: the high half). */
static inline __attribute__((always_inline)) v16 weights(const void *w, long i, const int bf16) {
    if (bf16) return (v16)(__builtin_convertvector(*(const h16u *)((const uint16_t *)w + i), w16) << 16);
    return load((const float *)w + i);
}

static inline __attribute__((always_inline)) float weight(const void *w, long i, const int bf16) {
    if (bf16) {
        union { uint32_t u; float f; } v = {(uint32_t)((const uint16_t *)w)[i] << 16};
        return v.f;
    }
    return ((const float *)w)[i];
}

/* h[r][0:R] = x[r] @ a for nr <= GROUP rows. */
static inline __attribute__((always_inline)) void shrink(
    const int nr, const float *const *x, int in, const void *a, int R, float *h, const int bf16)
{
    int c = 0;
    for (; c + 64 <= R; c += 64) {
        v16 acc[GROUP][4] = {{{0}}};
        for (int k = 0; k < in; k++) {
            long i = (long)k * R + c;
            v16 a0 = weights(a, i, bf16), a1 = weights(a, i + 16, bf16);
            v16 a2 = weights(a, i + 32, bf16), a3 = weights(a, i + 48, bf16);
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) {
                v16 xv = splat(x[r][k]);
                acc[r][0] += xv * a0; acc[r][1] += xv * a1;
                acc[r][2] += xv * a2; acc[r][3] += xv * a3;
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) store(h + r * R + c + 16 * q, acc[r][q]);
    }
    for (; c < R; c += 16) {
        v16 acc[GROUP] = {{0}};
        for (int k = 0; k < in; k++) {
            v16 a0 = weights(a, (long)k * R + c, bf16);
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) acc[r] += splat(x[r][k]) * a0;
        }
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) store(h + r * R + c, acc[r]);
    }
}

/* out[r][blk's columns] += h[r][blk's columns of h] @ blk->b for nr <= GROUP rows. */
static inline __attribute__((always_inline)) void expand(
    const int nr, float *const *out, const float *h, int R, const wc_block *blk, const int bf16)
{
    const int rank = blk->stop - blk->start, width = blk->out_stop - blk->out_start;
    const void *b = blk->b;
    int o = 0;
    for (; o + 64 <= width; o += 64) {
        v16 acc[GROUP][4];
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) acc[r][q] = load(out[r] + blk->out_start + o + 16 * q);
        for (int j = 0; j < rank; j++) {
            long i = (long)j * width + o;
            v16 b0 = weights(b, i, bf16), b1 = weights(b, i + 16, bf16);
            v16 b2 = weights(b, i + 32, bf16), b3 = weights(b, i + 48, bf16);
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) {
                v16 hv = splat(h[r * R + blk->start + j]);
                acc[r][0] += hv * b0; acc[r][1] += hv * b1;
                acc[r][2] += hv * b2; acc[r][3] += hv * b3;
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) store(out[r] + blk->out_start + o + 16 * q, acc[r][q]);
    }
    for (; o + 16 <= width; o += 16) {
        v16 acc[GROUP];
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) acc[r] = load(out[r] + blk->out_start + o);
        for (int j = 0; j < rank; j++) {
            v16 b0 = weights(b, (long)j * width + o, bf16);
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) acc[r] += splat(h[r * R + blk->start + j]) * b0;
        }
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) store(out[r] + blk->out_start + o, acc[r]);
    }
    for (; o < width; o++)
        for (int r = 0; r < nr; r++) {
            float sum = out[r][blk->out_start + o];
            for (int j = 0; j < rank; j++)
                sum += h[r * R + blk->start + j] * weight(b, (long)j * width + o, bf16);
            out[r][blk->out_start + o] = sum;
        }
}

static inline __attribute__((always_inline)) void group(
    const int nr, const float *const *x, float *const *out, int in, const wc_delta *d,
    float *h, const int bf16)
{
    shrink(nr, x, in, d->a, d->R, h, bf16);
    for (int i = 0; i < d->n_blocks; i++) expand(nr, out, h, d->R, d->blocks + i, bf16);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

int wc_lora_pairs(void) { return 1; }

/* dst[0:n_pad] = src[0:n] rounded to bfloat16 (nearest even), zeros after n. */
static inline void round_row(const float *src, int n, uint16_t *dst, int n_pad)
{
    for (int i = 0; i < n_pad; i += 16) {
        int left = n - i;
        __mmask16 mask = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + i));
        int keep = n_pad - i < 16 ? n_pad - i : 16;
        _mm256_mask_storeu_epi16(dst + i, (__mmask16)((1u << keep) - 1), (__m256i)v);
    }
}

/* A pair of bfloat16 values (p[0], p[1]) in every lane. */
static inline __m512bh pair(const uint16_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return (__m512bh)_mm512_set1_epi32((int)v);
}

static inline __m512bh pairs_at(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }

/* acc[r][q] += w[:, col + 16q : col + 16q + 16] . x[r] for q < 4 and nr <= GROUP rows:
 * w is `pairs` rows of `width` bfloat16 pairs, x[r] the row at x + r * x_stride, both the
 * shrink's (w = a, x = the rounded input) and the expand's (w = b, x = the rounded h). */
static inline __attribute__((always_inline)) void dot_pairs_64(
    const int nr, __m512 acc[][4], const uint16_t *w, int width, int col, const uint16_t *x,
    int x_stride, int pairs)
{
    for (int k = 0; k < pairs; k++) {
        const uint16_t *wk = w + ((long)k * width + col) * 2;
        __m512bh w0 = pairs_at(wk), w1 = pairs_at(wk + 32);
        __m512bh w2 = pairs_at(wk + 64), w3 = pairs_at(wk + 96);
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) {
            __m512bh xv = pair(x + r * x_stride + 2 * k);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, xv);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w3, xv);
        }
    }
}

/* The same for one strip of 16 columns, the lanes outside `mask` read as zeros (they may
 * lie past `width`, in the next pairs' row: the caller masks them out of its store). */
static inline __attribute__((always_inline)) void dot_pairs_16(
    const int nr, __m512 acc[], const uint16_t *w, int width, int col, __mmask16 mask,
    const uint16_t *x, int x_stride, int pairs)
{
    for (int k = 0; k < pairs; k++) {
        __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi32(mask, w + ((long)k * width + col) * 2);
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], w0, pair(x + r * x_stride + 2 * k));
    }
}

/* h[r][0:R] = xb[r] @ a for nr <= GROUP rows already rounded (in_pad even; R a multiple
 * of 16). */
static inline __attribute__((always_inline)) void shrink_pairs(
    const int nr, const uint16_t *xb, int in_pad, const uint16_t *a, int R, float *h)
{
    int c = 0;
    for (; c + 64 <= R; c += 64) {
        __m512 acc[GROUP][4];
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) acc[r][q] = _mm512_setzero_ps();
        dot_pairs_64(nr, acc, a, R, c, xb, in_pad, in_pad / 2);
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) _mm512_storeu_ps(h + r * R + c + 16 * q, acc[r][q]);
    }
    for (; c < R; c += 16) {
        __m512 acc[GROUP];
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
        dot_pairs_16(nr, acc, a, R, c, 0xFFFF, xb, in_pad, in_pad / 2);
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) _mm512_storeu_ps(h + r * R + c, acc[r]);
    }
}

/* out[r][blk's columns] += hb[r] @ blk->b for nr <= GROUP rows; hb rows of `pairs` pairs. */
static inline __attribute__((always_inline)) void expand_pairs(
    const int nr, float *const *out, const uint16_t *hb, int pairs, const wc_block *blk)
{
    const int width = blk->out_stop - blk->out_start;
    int o = 0;
    for (; o + 64 <= width; o += 64) {
        __m512 acc[GROUP][4];
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++)
                acc[r][q] = _mm512_loadu_ps(out[r] + blk->out_start + o + 16 * q);
        dot_pairs_64(nr, acc, blk->b, width, o, hb, 2 * pairs, pairs);
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++)
                _mm512_storeu_ps(out[r] + blk->out_start + o + 16 * q, acc[r][q]);
    }
    for (; o < width; o += 16) {
        int left = width - o;
        __mmask16 mask = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
        __m512 acc[GROUP];
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++)
            acc[r] = _mm512_maskz_loadu_ps(mask, out[r] + blk->out_start + o);
        dot_pairs_16(nr, acc, blk->b, width, o, mask, hb, 2 * pairs, pairs);
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) _mm512_mask_storeu_ps(out[r] + blk->out_start + o, mask, acc[r]);
    }
}

static inline __attribute__((always_inline)) void group_pairs(
    const int nr, const float *const *x, float *const *out, int in, const wc_delta *d,
    float *h, uint16_t *xb, uint16_t *hb)
{
    const int in_pad = (in + 1) / 2 * 2;
    for (int r = 0; r < nr; r++) round_row(x[r], in, xb + r * in_pad, in_pad);
    shrink_pairs(nr, xb, in_pad, d->a, d->R, h);
    for (int i = 0; i < d->n_blocks; i++) {
        const wc_block *blk = d->blocks + i;
        const int rank = blk->stop - blk->start, pairs = (rank + 1) / 2;
        for (int r = 0; r < nr; r++)
            round_row(h + r * d->R + blk->start, rank, hb + r * 2 * pairs, 2 * pairs);
        expand_pairs(nr, out, hb, pairs, blk);
    }
}
#else
int wc_lora_pairs(void) { return 0; }
#endif

static int lora_delta(
    int32_t rows, int32_t in, const float *x, int64_t x_stride, float *out, int64_t out_stride,
    const int32_t *owner, int32_t n_adapters, const wc_delta *const *tables, int32_t entry,
    int32_t threads, const int bf16)
{
    /* The rows in adapter order, and the groups: first row (in that order), rows, adapter. */
    int32_t *order = malloc(sizeof(int32_t) * 4 * (size_t)(rows > 0 ? rows : 1));
    if (!order) return 1;
    int32_t *group_first = order + rows, *group_rows = group_first + rows;
    int32_t *group_adapter = group_rows + rows;
    int n_groups = 0, n_ordered = 0;
    for (int i = 0; i < n_adapters; i++) {
        if (!tables[i][entry].a) continue;
        int first = n_ordered;
        for (int t = 0; t < rows; t++)
            if (owner[t] == i) order[n_ordered++] = t;
        for (int g = first; g < n_ordered; g += GROUP) {
            group_first[n_groups] = g;
            group_rows[n_groups] = n_ordered - g < GROUP ? n_ordered - g : GROUP;
            group_adapter[n_groups++] = i;
        }
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (n_groups > 1)
    for (int g = 0; g < n_groups; g++) {
        const wc_delta *d = &tables[group_adapter[g]][entry];
        const int nr = group_rows[g];
        const float *xs[GROUP];
        float *outs[GROUP];
        for (int r = 0; r < nr; r++) {
            long t = order[group_first[g] + r];
            xs[r] = x + t * x_stride;
            outs[r] = out + t * out_stride;
        }
        float h[GROUP * d->R];
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
        if (bf16 == 2) {
            uint16_t xb[GROUP * ((in + 1) / 2 * 2)], hb[GROUP * (d->R + 1)];
            switch (nr) {
                case 1: group_pairs(1, xs, outs, in, d, h, xb, hb); break;
                case 2: group_pairs(2, xs, outs, in, d, h, xb, hb); break;
                case 3: group_pairs(3, xs, outs, in, d, h, xb, hb); break;
                default: group_pairs(GROUP, xs, outs, in, d, h, xb, hb); break;
            }
            continue;
        }
#endif
        switch (nr) {
            case 1: group(1, xs, outs, in, d, h, bf16); break;
            case 2: group(2, xs, outs, in, d, h, bf16); break;
            case 3: group(3, xs, outs, in, d, h, bf16); break;
            default: group(GROUP, xs, outs, in, d, h, bf16); break;
        }
    }
    free(order);
    return 0;
}

/* 0 on success, 1 when the scratch for the row order cannot be allocated. */
int wc_lora_delta_f32(
    int32_t rows, int32_t in, const float *x, int64_t x_stride, float *out, int64_t out_stride,
    const int32_t *owner, int32_t n_adapters, const wc_delta *const *tables, int32_t entry,
    int32_t threads)
{
    return lora_delta(rows, in, x, x_stride, out, out_stride, owner, n_adapters, tables, entry,
                      threads, 0);
}

int wc_lora_delta_bf16(
    int32_t rows, int32_t in, const float *x, int64_t x_stride, float *out, int64_t out_stride,
    const int32_t *owner, int32_t n_adapters, const wc_delta *const *tables, int32_t entry,
    int32_t threads)
{
    return lora_delta(rows, in, x, x_stride, out, out_stride, owner, n_adapters, tables, entry,
                      threads, 1);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
int wc_lora_delta_bf16_pairs(
    int32_t rows, int32_t in, const float *x, int64_t x_stride, float *out, int64_t out_stride,
    const int32_t *owner, int32_t n_adapters, const wc_delta *const *tables, int32_t entry,
    int32_t threads)
{
    return lora_delta(rows, in, x, x_stride, out, out_stride, owner, n_adapters, tables, entry,
                      threads, 2);
}
#endif
