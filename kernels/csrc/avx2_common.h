// Small AVX2 helpers shared by the CPU kernels.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace deepinfer {

// Sum of the 8 float lanes of v.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The first 64-byte aligned address at or after p (p must have 15 floats of slack after it).
inline float* aligned64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

}  // namespace deepinfer
