// Batch-invariant float32 linear y[M, N] = x[M, K] @ W[N, K].T on CPUs with AVX2 + FMA, for
// KernelConfig.batch_invariant (kernels/linear.py). MKL's sgemm picks its kernel and blocking
// by M, so a row's bits change with the rows beside it; here every y[m, n] is one fixed chain
// of float32 operations over K whatever M is: two accumulators taking alternate 8-wide slices
// (k in steps of 16), one more slice into the first when K % 16 >= 8, `hsum8` of their sum,
// then the K % 8 tail in order. Rows run in tiles of up to kTileRows sharing each weight load;
// every tile row runs the same chain, so a row's result does not depend on its tile either.
// Output rows are the outer loop: a weight row stays in L1 while every x tile passes over it.
// Pure C++ (no torch headers); quantized_linear_bindings.cpp checks the tensors and splits
// output rows [n_begin, n_end) over torch's threads.

#include <immintrin.h>

#include "avx2_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kTileRows = 4;

template <int MR>
inline void tile_dot(const float* x, int64_t ldx, const float* w, int64_t K, float* y,
                     int64_t ldy) {
  __m256 acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
    for (int r = 0; r < MR; ++r) {
      acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * ldx + k + 8), acc1[r]);
    }
  }
  if (k + 8 <= K) {
    const __m256 w0 = _mm256_loadu_ps(w + k);
    for (int r = 0; r < MR; ++r)
      acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), acc0[r]);
    k += 8;
  }
  for (int r = 0; r < MR; ++r) {
    float s = deepinfer::hsum8(_mm256_add_ps(acc0[r], acc1[r]));
    for (int64_t t = k; t < K; ++t) s = std::fma(w[t], x[r * ldx + t], s);
    y[r * ldy] = s;
  }
}

}  // namespace

namespace deepinfer {

// x [num_rows][K] (row stride ldx), w [N][K] contiguous -> y[m][n] for n in [n_begin, n_end)
// (row stride ldy).
void f32_linear_rows(const float* x, int64_t num_rows, int64_t ldx, const float* w, int64_t K,
                     float* y, int64_t n_begin, int64_t n_end, int64_t ldy) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const float* wn = w + n * K;
    for (int64_t m0 = 0; m0 < num_rows; m0 += kTileRows) {
      const float* xt = x + m0 * ldx;
      float* yt = y + m0 * ldy + n;
      switch (std::min(kTileRows, num_rows - m0)) {
        case 1: tile_dot<1>(xt, ldx, wn, K, yt, ldy); break;
        case 2: tile_dot<2>(xt, ldx, wn, K, yt, ldy); break;
        case 3: tile_dot<3>(xt, ldx, wn, K, yt, ldy); break;
        default: tile_dot<4>(xt, ldx, wn, K, yt, ldy);
      }
    }
  }
}

}  // namespace deepinfer
