// Scalar and eight-lane float helpers of the CPU ops (attention.cpp, layer_ops.cpp): an element widened to
// float and narrowed back to T, and a branch-free exp of a non-positive x (scalar `exp_nonpos`, AVX2
// `exp_nonpos8`, the same arithmetic) with `round8`, a float vector's rounding to T and back.
#pragma once

#include <ATen/ATen.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd8.h"

// Widen one element to float: float as is, bfloat16 by a 16-bit shift (vectorizes under `omp simd`).
static inline float widen(float x) { return x; }
static inline float widen(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x) for x <= 0 (scores minus their max): Cody-Waite range reduction (n by the 1.5 * 2^23 rounding trick)
// and Cephes' expf polynomial,
// about 1 ulp, branch-free so that the softmax loop vectorizes (std::exp does not without -ffast-math).
static inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (vectorizes)
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return y * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight lanes of the scalar helpers above, the same arithmetic: `exp_nonpos`, a float's rounding to T (bfloat16:
// to nearest even, NaN kept a quiet NaN, as c10::BFloat16 rounds) and back.
static inline __m256 exp_nonpos8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic), magic);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
static inline __m256 round8(__m256 f, float) { return f; }
static inline __m256 round8(__m256 f, at::BFloat16) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(f), 16));
}
#endif

template <typename T>
static inline T narrow_to(float x) { return static_cast<T>(x); }
