// Eight float32 lanes of float or bfloat16 under AVX2 + FMA, shared by the CPU ops (attention.cpp, layer_ops.cpp)
// and the LoRA kernel (lora.cpp): load8 (bfloat16 widened by a 16-bit shift), reduce8 (the sum across the lanes),
// bf16_bits8 and store8 (bfloat16 rounded to nearest even, a NaN kept a quiet NaN, as c10::BFloat16 rounds).
// Without AVX2 + FMA this header defines nothing.
#pragma once

#include <ATen/ATen.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline float reduce8(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}
static inline __m256i bf16_bits8(__m256 f) {  // round to nearest even; the 16 bits in each lane's low half
  const __m256i b = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
}
static inline void store8(float* p, __m256 f) { _mm256_storeu_ps(p, f); }
static inline void store8(at::BFloat16* p, __m256 f) {
  const __m256i b = bf16_bits8(f);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
#endif
