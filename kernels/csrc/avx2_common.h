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

// fp16 bits [count] -> float [count].
inline void half_to_float(const uint16_t* src, int64_t count, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(half));
  }
  for (; i < count; ++i) dst[i] = _cvtsh_ss(src[i]);
}

// The first 64-byte aligned address at or after p (p must have 15 floats of slack after it).
inline float* aligned64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

}  // namespace deepinfer
