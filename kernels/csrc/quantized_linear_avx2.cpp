// Block-quantized linear y[M, N] = x[M, K] @ W[N, K].T on x86 CPUs with AVX2 + FMA + F16C.
// Pure C++ (no torch headers, so it compiles in seconds); quantized_linear_bindings.cpp checks
// the tensors, splits output rows over torch's threads and calls the entry points at the end.
//
// W is stored in ggml's Q4_1 or Q8_0 block formats (32 weights per block along K), see
// kernels/quantized_linear.py. Each weight is reconstructed exactly as the float32 the reference
// dequantizes to (Q4_1: fma(d, q, m), exact because d * q is exact in float32; Q8_0: d * q), and
// products are accumulated with FMA in float32 (summation order differs from MKL's).
//
// Two loop nests (one thread, output rows [n_begin, n_end)):
// - M < kPanelMinRows (decode of a few sequences), `rows_fused`: panels of 32 output rows, whose
//   quantized weights (<= 32 x 816 bytes) stay in L1/L2 while tiles of up to 4 x rows pass over
//   them; in a tile, each 8-weight slice is dequantized into a register and used for every x row.
//   At M <= 4 every weight is read from memory and dequantized exactly once.
// - M >= kPanelMinRows, `rows_panel`: each panel of kPanelRows output rows is dequantized once
//   into a per-thread float32 buffer (<= 24 x K floats, L2-resident), then a register-blocked
//   microkernel (4 x rows x 3 output rows: 12 accumulators + 3 weight + 1 x register of the 16
//   ymm) runs FMAs over K for every x tile, so dequantization is paid once per weight instead of
//   once per 4-row x tile. Weights in the buffer are the same exact float32 values.
// Measured on a 2-core Zen AVX2 VM (2 threads, SmolLM2-135M's 30 layers in Q4_1 + the Q8_0 LM
// head): M = 1: 8 ms (fused); M = 8: 42 -> 34 ms, M = 16: 70 -> 52 ms, M = 32: 159 -> 90 ms
// (fused -> panel). The panel nest wins from M = 5; at M <= 4 the extra store and reload of
// the dequantized panel costs more than it saves (M = 4: 16 vs 19 ms).

#include <immintrin.h>

#include "avx2_common.h"

#include <algorithm>
#include <cstdint>
#include <vector>

using deepinfer::hsum8;

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kScaleChunk = 64;  // blocks whose fp16 scales are converted at once

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
      y[r * ldy + n + c] = hsum8(s);
    }
}

// All x rows [0, num_rows) against output rows [n_begin, n_end), dequantizing in registers.
template <class W>
void rows_fused(const W& weight, const float* x, int64_t num_rows, int64_t ldx, float* y,
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

// Dequantizes output rows [n, n + count) of `weight` into dst[count][K] (exact float32 values).
template <class W>
void dequantize_rows(const W& weight, int64_t n, int64_t count, float* dst) {
  const int64_t nb = weight.num_blocks;
  alignas(32) float ds[kScaleChunk];
  alignas(32) float ms[kScaleChunk];
  for (int64_t c = 0; c < count; ++c) {
    float* row = dst + c * nb * kBlock;
    for (int64_t b0 = 0; b0 < nb; b0 += kScaleChunk) {
      const int64_t chunk = std::min(kScaleChunk, nb - b0);
      half_to_float(weight.scales + (n + c) * nb + b0, chunk, ds);
      if (W::kHasMins) half_to_float(weight.mins + (n + c) * nb + b0, chunk, ms);
      for (int64_t i = 0; i < chunk; ++i) {
        const int64_t b = b0 + i;
        const __m256 d = _mm256_broadcast_ss(&ds[i]);
        const __m256 m = W::kHasMins ? _mm256_broadcast_ss(&ms[i]) : _mm256_setzero_ps();
        float* out = row + b * kBlock;
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + 8 * j, weight.sub(n + c, b, j, d, m));
      }
    }
  }
}

// y[r, c] = sum_k x[r, k] * w[c, k] for r < MR, c < NR; w is float32 [NR][K] with row stride
// ldw, K a multiple of 8.
template <int MR, int NR>
inline void micro_dot(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t K,
                      float* y, int64_t ldy) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int c = 0; c < NR; ++c) wv[c] = _mm256_loadu_ps(w + c * ldw + k);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) y[r * ldy + c] = hsum8(acc[r][c]);
}

template <int MR>
inline void micro_dot_cols(int64_t cols, const float* w, int64_t ldw, const float* x,
                           int64_t ldx, int64_t K, float* y, int64_t ldy) {
  switch (cols) {
    case 1: micro_dot<MR, 1>(w, ldw, x, ldx, K, y, ldy); break;
    case 2: micro_dot<MR, 2>(w, ldw, x, ldx, K, y, ldy); break;
    default: micro_dot<MR, 3>(w, ldw, x, ldx, K, y, ldy);
  }
}

constexpr int64_t kPanelMinRows = 5;  // from here on, dequantize each panel once (rows_panel)

// All x rows [0, num_rows) against output rows [n_begin, n_end), through a dequantized panel.
template <class W>
void rows_panel(const W& weight, const float* x, int64_t num_rows, int64_t ldx, float* y,
                int64_t n_begin, int64_t n_end, int64_t ldy) {
  constexpr int64_t kTileRows = 4;    // x rows of the microkernel
  constexpr int64_t kTileCols = 3;    // output rows of the microkernel
  constexpr int64_t kPanelRows = 24;  // output rows dequantized at once (24 x K floats)
  const int64_t K = weight.num_blocks * kBlock;
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < kPanelRows * K) buffer.resize(kPanelRows * K);
  float* panel = buffer.data();
  for (int64_t p0 = n_begin; p0 < n_end; p0 += kPanelRows) {
    const int64_t p1 = std::min(n_end, p0 + kPanelRows);
    dequantize_rows(weight, p0, p1 - p0, panel);
    for (int64_t m0 = 0; m0 < num_rows; m0 += kTileRows) {
      const float* xt = x + m0 * ldx;
      const int64_t tile_rows = std::min(kTileRows, num_rows - m0);
      for (int64_t n = p0; n < p1; n += kTileCols) {
        const int64_t cols = std::min(kTileCols, p1 - n);
        const float* w = panel + (n - p0) * K;
        float* yt = y + m0 * ldy + n;
        switch (tile_rows) {
          case 1: micro_dot_cols<1>(cols, w, K, xt, ldx, K, yt, ldy); break;
          case 2: micro_dot_cols<2>(cols, w, K, xt, ldx, K, yt, ldy); break;
          case 3: micro_dot_cols<3>(cols, w, K, xt, ldx, K, yt, ldy); break;
          default: micro_dot_cols<4>(cols, w, K, xt, ldx, K, yt, ldy);
        }
      }
    }
  }
}

template <class W>
void rows(const W& weight, const float* x, int64_t num_rows, int64_t ldx, float* y,
          int64_t n_begin, int64_t n_end, int64_t ldy) {
  if (num_rows >= kPanelMinRows) {
    rows_panel(weight, x, num_rows, ldx, y, n_begin, n_end, ldy);
  } else {
    rows_fused(weight, x, num_rows, ldx, y, n_begin, n_end, ldy);
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
