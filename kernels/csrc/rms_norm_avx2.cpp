// Fused RMSNorm (optionally with the residual add) over the rows of a float32 [T, H] tensor, AVX2.
// One pass per row for the sum of squares (fp32, 4x8 lanes) and one for the scaled output; the
// residual sum is written back into x in the first pass. Bindings: quantized_linear_bindings.cpp.

#include <immintrin.h>

#include "avx2_common.h"

#include <cmath>
#include <cstdint>

namespace deepinfer {

// Rows [row_begin, row_end) of x [T, H] (row stride ldx): with residual (row stride ldr, may be
// null) x := x + residual first; out[t] = x[t] * (1 / sqrt(mean(x[t]^2) + eps)) * weight.
void rms_norm_rows(float* x, int64_t ldx, const float* residual, int64_t ldr,
                   const float* weight, float eps, float* out, int64_t ldo, int64_t hidden,
                   int64_t row_begin, int64_t row_end) {
  for (int64_t t = row_begin; t < row_end; ++t) {
    float* xr = x + t * ldx;
    float* orow = out + t * ldo;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
    int64_t i = 0;
    float tail = 0.f;
    if (residual != nullptr) {
      const float* rr = residual + t * ldr;
      for (; i + 16 <= hidden; i += 16) {
        __m256 a = _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(rr + i));
        __m256 b = _mm256_add_ps(_mm256_loadu_ps(xr + i + 8), _mm256_loadu_ps(rr + i + 8));
        _mm256_storeu_ps(xr + i, a);
        _mm256_storeu_ps(xr + i + 8, b);
        acc0 = _mm256_fmadd_ps(a, a, acc0);
        acc1 = _mm256_fmadd_ps(b, b, acc1);
      }
      for (; i < hidden; ++i) {
        const float v = xr[i] + rr[i];
        xr[i] = v;
        tail += v * v;
      }
    } else {
      for (; i + 32 <= hidden; i += 32) {
        __m256 a = _mm256_loadu_ps(xr + i), b = _mm256_loadu_ps(xr + i + 8);
        __m256 c = _mm256_loadu_ps(xr + i + 16), d = _mm256_loadu_ps(xr + i + 24);
        acc0 = _mm256_fmadd_ps(a, a, acc0);
        acc1 = _mm256_fmadd_ps(b, b, acc1);
        acc2 = _mm256_fmadd_ps(c, c, acc2);
        acc3 = _mm256_fmadd_ps(d, d, acc3);
      }
      for (; i + 8 <= hidden; i += 8) {
        __m256 a = _mm256_loadu_ps(xr + i);
        acc0 = _mm256_fmadd_ps(a, a, acc0);
      }
      for (; i < hidden; ++i) tail += xr[i] * xr[i];
    }
    const float sum = hsum8(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3))) +
                      tail;
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    i = 0;
    for (; i + 8 <= hidden; i += 8) {
      __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv);
      _mm256_storeu_ps(orow + i, _mm256_mul_ps(v, _mm256_loadu_ps(weight + i)));
    }
    for (; i < hidden; ++i) orow[i] = (xr[i] * inv) * weight[i];
  }
}

}  // namespace deepinfer
