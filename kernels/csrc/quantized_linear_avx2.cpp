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
// - M <= kFusedMaxRows (decode of a few sequences, speculative verify rows of 1 + k tokens),
//   `rows_fused`: one tile of all M x rows, packed once per call ([K/8][M][8], 64-byte aligned,
//   so each x load is a fixed offset from one pointer and never splits a cache line); each
//   8-weight slice of an output row is dequantized once into a register and used for every x
//   row, so every weight is read and dequantized exactly once. One accumulator per x row (2 at
//   M = 2..4, 4 at M = 1: >= 8 FMA chains in flight where the registers allow).
//   On CPUs with AVX-512F the same nest runs in 16-lane registers, up to kAvx512MaxRows = 8
//   (quantized_linear_avx512.cpp, chosen at run time; `allow_avx512`).
// - M > kFusedMaxRows, `rows_panel`: each panel of kPanelRows output rows is dequantized once
//   into a per-thread float32 buffer (<= 24 x K floats, L2-resident), then a register-blocked
//   microkernel (4 x rows x 3 output rows: 12 accumulators + 3 weight + 1 x register of the 16
//   ymm) runs FMAs over K for every x tile, so dequantization is paid once per weight instead of
//   once per 4-row x tile. Weights in the buffer are the same exact float32 values.
// Why one fused tile up to M = 7 (8): at M >= 2 the nest is bound by the FMA ports (per
// 32-weight block: 4 conversions + 4 FMAs to dequantize, then 4 M products), not by memory; a
// second x tile dequantizes every weight again, and the panel nest adds a store and reload.
// SmolLM2-135M's 30 layers in Q4_1 + its Q8_0 LM head (49152 x 576), 2 threads, 2-core VM
// (Xeon with AVX-512, 2026-12-04, load 1.5), ms per forward, layers + head:
//   M      1            4             6             8             16            32
//   before 11.5+3.6     13.6+4.6      16.0+4.9      17.2+5.1      26.6+7.6      44.7+12.8
//   AVX2   9.8+3.3      12.6+3.6      14.6+4.7      (panel)       27.6+7.3      48.3+12.5
//   AVX512 6.7+2.1      11.8+2.7      11.5+3.5      13.0+3.9      (panel, AVX2)
// (before: 4-row fused tiles up to M = 4, the panel nest from M = 5; the panel nest is
// unchanged, its M = 32 difference is the box's noise: 46.4 vs 44.8 ms in a second interleaved
// run.) M >= 9 keeps the panel nest: fused tiles of 8 + 1 rows would dequantize twice.
//
// Batch-invariant mode (`row_invariant`, KernelConfig.batch_invariant): a row's result must not
// depend on M or on the rows beside it. The fused nest's accumulator count depends on M, so
// there every tile keeps one accumulator per row: then a row's sum is the same chain of FMAs
// over K in steps of 8, then `hsum8`, in the fused nest and in the panel microkernel alike.
// On CPUs with AVX-512F the AVX-512 nest (whose row order never depends on its tile) runs
// every x row instead, in tiles of up to kAvx512MaxRows.

#include <immintrin.h>

#include "avx2_common.h"

#include <algorithm>
#include <cstdint>
#include <vector>

using deepinfer::aligned64;
using deepinfer::half_to_float;
using deepinfer::hsum8;

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kScaleChunk = 64;  // blocks whose fp16 scales are converted at once

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

// Independent FMA chains per accumulator of a tile of `rows` x rows: enough chains in flight to
// cover the FMA latency (4 cycles, 2 ports: 8 chains) within the 16 ymm registers.
constexpr int accumulators_per_row(int rows) { return rows == 1 ? 4 : (rows <= 4 ? 2 : 1); }

// y[r, n] = sum_k x[r, k] * W[n, k] for r < MR: each 8-weight slice of output row n is
// dequantized once into a register and used for all MR x rows. xp is x packed by pack_rows
// ([K/8][MR][8]), so every x load of a block is at a fixed offset from one pointer.
// kOneChain: one accumulator per row whatever MR (the batch-invariant order).
template <int MR, bool kOneChain, class W>
inline void tile_dot(const W& weight, int64_t n, const float* xp, float* y, int64_t ldy) {
  constexpr int NACC = kOneChain ? 1 : accumulators_per_row(MR);
  __m256 acc[MR][NACC];
  for (int r = 0; r < MR; ++r)
    for (int a = 0; a < NACC; ++a) acc[r][a] = _mm256_setzero_ps();
  alignas(32) float ds[kScaleChunk];
  alignas(32) float ms[kScaleChunk];
  const int64_t nb = weight.num_blocks;
  for (int64_t b0 = 0; b0 < nb; b0 += kScaleChunk) {
    const int64_t count = std::min(kScaleChunk, nb - b0);
    half_to_float(weight.scales + n * nb + b0, count, ds);
    if (W::kHasMins) half_to_float(weight.mins + n * nb + b0, count, ms);
    const float* xb = xp + b0 * kBlock * MR;
    for (int64_t i = 0; i < count; ++i, xb += kBlock * MR) {
      const __m256 d = _mm256_broadcast_ss(&ds[i]);
      const __m256 m = W::kHasMins ? _mm256_broadcast_ss(&ms[i]) : _mm256_setzero_ps();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256 w = weight.sub(n, b0 + i, j, d, m);
        for (int r = 0; r < MR; ++r)
          acc[r][j % NACC] =
              _mm256_fmadd_ps(w, _mm256_loadu_ps(xb + (j * MR + r) * 8), acc[r][j % NACC]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    __m256 s = acc[r][0];
    for (int a = 1; a < NACC; ++a) s = _mm256_add_ps(s, acc[r][a]);
    y[r * ldy + n] = hsum8(s);
  }
}

// Up to kFusedMaxRows x rows the AVX2 nest is one tile of all of them (rows_fused); from 8 on
// its panel nest is as fast or faster (M = 8: 22.0 fused vs 21.4 ms panel). The AVX-512 nest's
// one tile covers up to kAvx512MaxRows (M = 8: 16.5 ms).
constexpr int64_t kFusedMaxRows = 7;
constexpr int64_t kAvx512MaxRows = 8;

// x [num_rows][K] (row stride ldx) -> dst [K/8][num_rows][8].
inline void pack_rows(const float* x, int64_t num_rows, int64_t ldx, int64_t K, float* dst) {
  for (int64_t k = 0; k < K; k += 8)
    for (int64_t r = 0; r < num_rows; ++r, dst += 8)
      _mm256_storeu_ps(dst, _mm256_loadu_ps(x + r * ldx + k));
}

template <int MR, bool kOneChain, class W>
void tile_rows(const W& weight, const float* xp, float* y, int64_t n_begin, int64_t n_end,
               int64_t ldy) {
  for (int64_t n = n_begin; n < n_end; ++n) tile_dot<MR, kOneChain>(weight, n, xp, y, ldy);
}

// x rows [0, num_rows <= kFusedMaxRows) against output rows [n_begin, n_end) in one tile: every
// weight is read from memory and dequantized (in a register) exactly once.
template <bool kOneChain, class W>
void rows_fused(const W& weight, const float* x, int64_t num_rows, int64_t ldx, float* y,
                int64_t n_begin, int64_t n_end, int64_t ldy) {
  const int64_t K = weight.num_blocks * kBlock;
  thread_local std::vector<float> packed;
  if (static_cast<int64_t>(packed.size()) < num_rows * K + 16) packed.resize(num_rows * K + 16);
  float* xp = aligned64(packed.data());  // no x load splits a cache line
  pack_rows(x, num_rows, ldx, K, xp);
  switch (num_rows) {
    case 1: tile_rows<1, kOneChain>(weight, xp, y, n_begin, n_end, ldy); break;
    case 2: tile_rows<2, kOneChain>(weight, xp, y, n_begin, n_end, ldy); break;
    case 3: tile_rows<3, kOneChain>(weight, xp, y, n_begin, n_end, ldy); break;
    case 4: tile_rows<4, kOneChain>(weight, xp, y, n_begin, n_end, ldy); break;
    case 5: tile_rows<5, kOneChain>(weight, xp, y, n_begin, n_end, ldy); break;
    case 6: tile_rows<6, kOneChain>(weight, xp, y, n_begin, n_end, ldy); break;
    default: tile_rows<7, kOneChain>(weight, xp, y, n_begin, n_end, ldy);
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
          int64_t n_begin, int64_t n_end, int64_t ldy, bool row_invariant) {
  if (num_rows <= kFusedMaxRows && row_invariant) {
    rows_fused<true>(weight, x, num_rows, ldx, y, n_begin, n_end, ldy);
  } else if (num_rows <= kFusedMaxRows) {
    rows_fused<false>(weight, x, num_rows, ldx, y, n_begin, n_end, ldy);
  } else {
    rows_panel(weight, x, num_rows, ldx, y, n_begin, n_end, ldy);
  }
}

}  // namespace

namespace deepinfer {

// defined in quantized_linear_avx512.cpp
bool avx512_available();
void q4_1_linear_rows_avx512(const float* x, int64_t num_rows, int64_t ldx,
                             const uint8_t* codes, const uint16_t* scales, const uint16_t* mins,
                             int64_t in_features, float* y, int64_t n_begin, int64_t n_end,
                             int64_t num_out);
void q8_0_linear_rows_avx512(const float* x, int64_t num_rows, int64_t ldx, const int8_t* codes,
                             const uint16_t* scales, int64_t in_features, float* y,
                             int64_t n_begin, int64_t n_end, int64_t num_out);

void q4_1_linear_rows(const float* x, int64_t num_rows, int64_t ldx, const uint8_t* codes,
                      const uint16_t* scales, const uint16_t* mins, int64_t in_features,
                      float* y, int64_t n_begin, int64_t n_end, int64_t num_out,
                      bool allow_avx512, bool row_invariant) {
  if (allow_avx512 && (num_rows <= kAvx512MaxRows || row_invariant) && avx512_available()) {
    for (int64_t m0 = 0; m0 < num_rows; m0 += kAvx512MaxRows)
      q4_1_linear_rows_avx512(x + m0 * ldx, std::min(kAvx512MaxRows, num_rows - m0), ldx, codes,
                              scales, mins, in_features, y + m0 * num_out, n_begin, n_end,
                              num_out);
    return;
  }
  const Q41Weight weight{codes, scales, mins, in_features / kBlock};
  rows(weight, x, num_rows, ldx, y, n_begin, n_end, num_out, row_invariant);
}

void q8_0_linear_rows(const float* x, int64_t num_rows, int64_t ldx, const int8_t* codes,
                      const uint16_t* scales, int64_t in_features, float* y, int64_t n_begin,
                      int64_t n_end, int64_t num_out, bool allow_avx512, bool row_invariant) {
  if (allow_avx512 && (num_rows <= kAvx512MaxRows || row_invariant) && avx512_available()) {
    for (int64_t m0 = 0; m0 < num_rows; m0 += kAvx512MaxRows)
      q8_0_linear_rows_avx512(x + m0 * ldx, std::min(kAvx512MaxRows, num_rows - m0), ldx, codes,
                              scales, in_features, y + m0 * num_out, n_begin, n_end, num_out);
    return;
  }
  const Q80Weight weight{codes, scales, nullptr, in_features / kBlock};
  rows(weight, x, num_rows, ldx, y, n_begin, n_end, num_out, row_invariant);
}

}  // namespace deepinfer
