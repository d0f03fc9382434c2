/* RMS norm of float32 rows (`model/native_norm.py`): out = x / sqrt(mean(x^2) + eps) * w.
 *
 * The squares are summed in 16 float32 lanes, then across them; the scale is applied in
 * the order Hugging Face's Llama applies it (normalize, then weight). Rows go to torch's
 * OpenMP threads when there are enough of them to pay for waking the second.
 * Vectors are GCC's generic 16-float vectors: AVX-512 registers where the CPU has them,
 * pairs of AVX2 ones elsewhere. Compiled at first use by `engine/native_build.py`.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float f32x16 __attribute__((vector_size(64)));

static inline f32x16 load16(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static void one_row(const float *x, const float *w, int64_t n, float eps, float *out) {
    f32x16 lanes = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        f32x16 v = load16(x + i);
        lanes += v * v;
    }
    float sum = 0;
    for (int j = 0; j < 16; j++) sum += lanes[j];
    for (; i < n; i++) sum += x[i] * x[i];
    float scale = 1.0f / sqrtf(sum / (float)n + eps);
    for (i = 0; i + 16 <= n; i += 16) {
        f32x16 o = load16(x + i) * scale * load16(w + i);
        memcpy(out + i, &o, sizeof o);
    }
    for (; i < n; i++) out[i] = x[i] * scale * w[i];
}

void wavecore_rms_norm(const float *x, const float *w, int64_t rows, int64_t n, float eps,
                       float *out) {
    #pragma omp parallel for schedule(static) if (rows * n >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) one_row(x + r * n, w, n, eps, out + r * n);
}
