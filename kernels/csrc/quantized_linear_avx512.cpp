// The few-row (decode / verify, M <= kAvx512MaxRows = 8) nest of quantized_linear_avx2.cpp in
// 512-bit registers, for CPUs with AVX-512F (chosen at run time: `avx512_available`). Same
// contract and numerics: each weight is reconstructed as the exact float32 the reference
// dequantizes to (Q4_1: fma(d, q, m); Q8_0: d * q) and products are accumulated with FMA in
// float32; only the summation order differs (16 lanes instead of 8). A row's order does not
// depend on M: a decode row (M = 1) and the same row inside a verify step give the same bits.
//
// Why: at M = 6 (a verify row of 1 + 5 drafts) the AVX2 nest is bound by its FMA ports (per
// 32-weight block: 4 dequantizing conversions + 4 FMAs + 4 x 6 products), not by memory; a
// 16-lane register halves every one of those instructions. Each function carries the target
// attribute, so the rest of the extension stays AVX2 and runs on CPUs without AVX-512.

#include <immintrin.h>

#include "avx2_common.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#define DEEPINFER_AVX512 __attribute__((target("avx512f")))

using deepinfer::aligned64;
using deepinfer::half_to_float;

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kScaleChunk = 64;  // blocks whose fp16 scales are converted at once

struct Q41Block {
  static constexpr bool kHasMins = true;
  const uint8_t* codes;  // [N][num_blocks][16]
  int64_t num_blocks;

  // Elements 0..15 (half 0) and 16..31 (half 1) of block b of row n: fma(d, q, m).
  DEEPINFER_AVX512 inline void halves(int64_t n, int64_t b, __m512 d, __m512 m, __m512* w0,
                                      __m512* w1) const {
    const __m128i raw = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(codes + (n * num_blocks + b) * 16));
    const __m512i v = _mm512_cvtepu8_epi32(raw);
    const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(0x0F));
    const __m512i hi = _mm512_srli_epi32(v, 4);
    *w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lo), m);
    *w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(hi), m);
  }
};

struct Q80Block {
  static constexpr bool kHasMins = false;
  const int8_t* codes;  // [N][num_blocks][32]
  int64_t num_blocks;

  DEEPINFER_AVX512 inline void halves(int64_t n, int64_t b, __m512 d, __m512, __m512* w0,
                                      __m512* w1) const {
    const int8_t* q = codes + (n * num_blocks + b) * kBlock;
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
    *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
    *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
  }
};

// y[r, n] = sum_k x[r, k] * W[n, k] for r < MR. xp is x packed as [K/16][MR][16], so every x
// load of a block is at a fixed offset from one pointer; each 16-weight half of a block is
// dequantized once into a register and used for all MR rows (two accumulators per row: the
// halves alternate, so MR >= 4 keeps 8 FMA chains in flight).
template <int MR, class B>
DEEPINFER_AVX512 inline void tile_dot(const B& block, const uint16_t* scales,
                                      const uint16_t* mins, int64_t n, const float* xp, float* y,
                                      int64_t ldy) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  alignas(64) float ds[kScaleChunk];
  alignas(64) float ms[kScaleChunk];
  const int64_t nb = block.num_blocks;
  for (int64_t b0 = 0; b0 < nb; b0 += kScaleChunk) {
    const int64_t count = std::min(kScaleChunk, nb - b0);
    half_to_float(scales + n * nb + b0, count, ds);
    if (B::kHasMins) half_to_float(mins + n * nb + b0, count, ms);
    const float* xb = xp + b0 * kBlock * MR;
    for (int64_t i = 0; i < count; ++i, xb += kBlock * MR) {
      const __m512 d = _mm512_set1_ps(ds[i]);
      const __m512 m = B::kHasMins ? _mm512_set1_ps(ms[i]) : _mm512_setzero_ps();
      __m512 w0, w1;
      block.halves(n, b0 + i, d, m, &w0, &w1);
      for (int r = 0; r < MR; ++r)
        acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb + r * 16), acc[r][0]);
      for (int r = 0; r < MR; ++r)
        acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + (MR + r) * 16), acc[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r)
    y[r * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

template <int MR, class B>
DEEPINFER_AVX512 void tile_rows(const B& block, const uint16_t* scales, const uint16_t* mins,
                                const float* xp, float* y, int64_t n_begin, int64_t n_end,
                                int64_t ldy) {
  for (int64_t n = n_begin; n < n_end; ++n) tile_dot<MR>(block, scales, mins, n, xp, y, ldy);
}

// All x rows [0, num_rows <= 8) against output rows [n_begin, n_end).
template <class B>
DEEPINFER_AVX512 void rows_fused(const B& block, const uint16_t* scales, const uint16_t* mins,
                                 const float* x, int64_t num_rows, int64_t ldx, float* y,
                                 int64_t n_begin, int64_t n_end, int64_t ldy) {
  const int64_t K = block.num_blocks * kBlock;
  thread_local std::vector<float> packed;
  if (static_cast<int64_t>(packed.size()) < num_rows * K + 16) packed.resize(num_rows * K + 16);
  float* const xp = aligned64(packed.data());  // no x load splits a cache line
  float* dst = xp;
  for (int64_t k = 0; k < K; k += 16)  // x [num_rows][K] -> xp [K/16][num_rows][16]
    for (int64_t r = 0; r < num_rows; ++r, dst += 16)
      _mm512_storeu_ps(dst, _mm512_loadu_ps(x + r * ldx + k));
  switch (num_rows) {
    case 1: tile_rows<1>(block, scales, mins, xp, y, n_begin, n_end, ldy); break;
    case 2: tile_rows<2>(block, scales, mins, xp, y, n_begin, n_end, ldy); break;
    case 3: tile_rows<3>(block, scales, mins, xp, y, n_begin, n_end, ldy); break;
    case 4: tile_rows<4>(block, scales, mins, xp, y, n_begin, n_end, ldy); break;
    case 5: tile_rows<5>(block, scales, mins, xp, y, n_begin, n_end, ldy); break;
    case 6: tile_rows<6>(block, scales, mins, xp, y, n_begin, n_end, ldy); break;
    case 7: tile_rows<7>(block, scales, mins, xp, y, n_begin, n_end, ldy); break;
    default: tile_rows<8>(block, scales, mins, xp, y, n_begin, n_end, ldy);
  }
}

}  // namespace

namespace deepinfer {

bool avx512_available() {
  static const bool available = __builtin_cpu_supports("avx512f");
  return available;
}

void q4_1_linear_rows_avx512(const float* x, int64_t num_rows, int64_t ldx,
                             const uint8_t* codes, const uint16_t* scales, const uint16_t* mins,
                             int64_t in_features, float* y, int64_t n_begin, int64_t n_end,
                             int64_t num_out) {
  const Q41Block block{codes, in_features / kBlock};
  rows_fused(block, scales, mins, x, num_rows, ldx, y, n_begin, n_end, num_out);
}

void q8_0_linear_rows_avx512(const float* x, int64_t num_rows, int64_t ldx, const int8_t* codes,
                             const uint16_t* scales, int64_t in_features, float* y,
                             int64_t n_begin, int64_t n_end, int64_t num_out) {
  const Q80Block block{codes, in_features / kBlock};
  rows_fused(block, scales, nullptr, x, num_rows, ldx, y, n_begin, n_end, num_out);
}

}  // namespace deepinfer
