// Block-quantized linear y[M, N] = x[M, K] @ W[N, K].T on x86 CPUs with AVX2 + FMA + F16C.
// Pure C++ (no torch headers, so it compiles in seconds); quantized_linear_bindings.cpp checks
// the tensors, splits output rows over torch's threads and calls the entry points at the end.
//
// W is stored in ggml's Q4_1 or Q8_0 block formats (32 weights per block along K), see
// kernels/quantized_linear.py. Each weight is reconstructed exactly as the float32 the reference
// dequantizes to (Q4_1: fma(d, q, m), exact because d * q is exact in float32; Q8_0: d * q), and
// products are accumulated with FMA in float32 (summation order differs from MKL's).
//
// Loop nest (one thread, output rows [n_begin, n_end)): panels of 32 output rows, whose quantized
// weights (<= 32 x 816 bytes) stay in L1/L2 while tiles of up to 4 x rows pass over them; in a
// tile, each 8-weight slice is dequantized once into a register and used for every x row. At
// decode (M <= 4) every weight is read from memory and dequantized exactly once.
// Measured on a 2-core Zen AVX2 VM (1 thread, L2-resident Q4_1 576-wide rows): ~3 ns per block
// at M = 1, ~1.7 ns per block per x row at M = 4..16.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kScaleChunk = 64;  // blocks whose fp16 scales are converted at once

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// fp16 bits [count] -> float [count].
inline void half_to_float(const uint16_t* src, int64_t count, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < count; ++i) dst[i] = _cvtsh_ss(src[i]);
}

struct Q41Weight {
  static constexpr bool kHasMins = true;
  const uint8_t* codes;
  const uint16_t* scales;
  const uint16_t* mins;
  int64_t num_blocks;

  // Elements 8j..8j+7 of block b of row n, as exact float32: fma(d, q, m).
  inline __m256 sub(int64_t n, int64_t b, int j, __m256 d, __m256 m) const {
    const uint8_t* q = codes + (n * num_blocks + b) * 16 + 8 * (j & 1);
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    v = j < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(v, 4);
    return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(v), m);
  }
};

struct Q80Weight {
  static constexpr bool kHasMins = false;
  const int8_t* codes;
  const uint16_t* scales;
  const uint16_t* mins;  // unused
  int64_t num_blocks;

  inline __m256 sub(int64_t n, int64_t b, int j, __m256 d, __m256) const {
    const int8_t* q = codes + (n * num_blocks + b) * kBlock + 8 * j;
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(v));
  }
};

// y[r, n + c] = sum_k x[r, k] * W[n + c, k] for r < MR, c < NR.
template <int MR, int NR, class W>
inline void tile_dot(const W& weight, int64_t n, const float* x, int64_t ldx, float* y,
                     int64_t ldy) {
  constexpr int NACC = (MR * NR >= 4) ? 1 : (MR * NR >= 2 ? 2 : 4);
  __m256 acc[MR][NR][NACC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c)
      for (int a = 0; a < NACC; ++a) acc[r][c][a] = _mm256_setzero_ps();
  alignas(32) float ds[NR][kScaleChunk];
  alignas(32) float ms[NR][kScaleChunk];
  const int64_t nb = weight.num_blocks;
  for (int64_t b0 = 0; b0 < nb; b0 += kScaleChunk) {
    const int64_t count = std::min(kScaleChunk, nb - b0);
    for (int c = 0; c < NR; ++c) {
      half_to_float(weight.scales + (n + c) * nb + b0, count, ds[c]);
      if (W::kHasMins) half_to_float(weight.mins + (n + c) * nb + b0, count, ms[c]);
    }
    for (int64_t i = 0; i < count; ++i) {
      const int64_t b = b0 + i;
      __m256 d[NR], m[NR];
      for (int c = 0; c < NR; ++c) {
        d[c] = _mm256_broadcast_ss(&ds[c][i]);
        m[c] = W::kHasMins ? _mm256_broadcast_ss(&ms[c][i]) : _mm256_setzero_ps();
      }
      const float* xb = x + b * kBlock;
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m256 w[NR];
        for (int c = 0; c < NR; ++c) w[c] = weight.sub(n + c, b, j, d[c], m[c]);
        for (int r = 0; r < MR; ++r) {
          const __m256 xv = _mm256_loadu_ps(xb + r * ldx + 8 * j);
          for (int c = 0; c < NR; ++c)
            acc[r][c][j % NACC] = _mm256_fmadd_ps(w[c], xv, acc[r][c][j % NACC]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) {
      __m256 s = acc[r][c][0];
      for (int a = 1; a < NACC; ++a) s = _mm256_add_ps(s, acc[r][c][a]);
      y[r * ldy + n + c] = hsum(s);
    }
}

// All x rows [0, num_rows) against output rows [n_begin, n_end).
template <class W>
void rows(const W& weight, const float* x, int64_t num_rows, int64_t ldx, float* y,
          int64_t n_begin, int64_t n_end, int64_t ldy) {
  constexpr int64_t kTileRows = 4;    // x rows sharing one dequantized weight slice
  constexpr int64_t kPanelRows = 32;  // output rows whose weights stay cached across x tiles
  for (int64_t p0 = n_begin; p0 < n_end; p0 += kPanelRows) {
    const int64_t p1 = std::min(n_end, p0 + kPanelRows);
    for (int64_t m0 = 0; m0 < num_rows; m0 += kTileRows) {
      const float* xt = x + m0 * ldx;
      float* yt = y + m0 * ldy;
      switch (std::min(kTileRows, num_rows - m0)) {
        case 1: for (int64_t n = p0; n < p1; ++n) tile_dot<1, 1>(weight, n, xt, ldx, yt, ldy); break;
        case 2: for (int64_t n = p0; n < p1; ++n) tile_dot<2, 1>(weight, n, xt, ldx, yt, ldy); break;
        case 3: for (int64_t n = p0; n < p1; ++n) tile_dot<3, 1>(weight, n, xt, ldx, yt, ldy); break;
        default: for (int64_t n = p0; n < p1; ++n) tile_dot<4, 1>(weight, n, xt, ldx, yt, ldy);
      }
    }
  }
}

}  // namespace

namespace deepinfer {

void q4_1_linear_rows(const float* x, int64_t num_rows, int64_t ldx, const uint8_t* codes,
                      const uint16_t* scales, const uint16_t* mins, int64_t in_features,
                      float* y, int64_t n_begin, int64_t n_end, int64_t num_out) {
  const Q41Weight weight{codes, scales, mins, in_features / kBlock};
  rows(weight, x, num_rows, ldx, y, n_begin, n_end, num_out);
}

void q8_0_linear_rows(const float* x, int64_t num_rows, int64_t ldx, const int8_t* codes,
                      const uint16_t* scales, int64_t in_features, float* y, int64_t n_begin,
                      int64_t n_end, int64_t num_out) {
  const Q80Weight weight{codes, scales, nullptr, in_features / kBlock};
  rows(weight, x, num_rows, ldx, y, n_begin, n_end, num_out);
}

}  // namespace deepinfer
