// The small fused ops of a decoder layer, of the library lorafleet_cpu_ops (its Python module: cpu_ops.cpp):
// RMSNorm, residual add + RMSNorm, SiLU x up, RoPE in place, and greedy sampling's pick. The same rounding as
// the torch ops they replace.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <limits>
#include <tuple>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_ops.h"
#include "simd8.h"
#include "vec_math.h"

// out = w * T(x * rsqrt(mean(x^2) + eps)), x read as float (Hugging Face's LlamaRMSNorm); with `delta`,
// h += delta first (rounded to T) and the sum is what is normalised.
template <typename T>
static void rms_norm_impl(at::Tensor& h, const at::Tensor* delta, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t rows = h.size(0), dim = h.size(1);
  T* hp = h.data_ptr<T>();
  const T* dp = delta != nullptr ? delta->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t hs = h.stride(0), ds = delta != nullptr ? delta->stride(0) : 0;
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* x = hp + r * hs;
      if (dp != nullptr) {
        const T* d = dp + r * ds;
        for (int64_t i = 0; i < dim; ++i) x[i] = narrow_to<T>(widen(x[i]) + widen(d[i]));
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < dim; ++i) ss += widen(x[i]) * widen(x[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + static_cast<float>(eps));
      T* o = op + r * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] = narrow_to<T>(widen(wp[i]) * widen(narrow_to<T>(widen(x[i]) * inv)));
    }
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() && w.size(0) == x.size(1), "rms_norm shapes");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm dtypes");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(x, nullptr, w, out, eps);
  else if (x.scalar_type() == at::kBFloat16) rms_norm_impl<at::BFloat16>(x, nullptr, w, out, eps);
  else TORCH_CHECK(false, "float32 or bfloat16 only");
  return out;
}

// h += delta in place, then returns rms_norm(h).
at::Tensor add_rms_norm_(at::Tensor h, at::Tensor delta, at::Tensor w, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.stride(1) == 1 && delta.sizes() == h.sizes() && delta.stride(1) == 1, "shapes");
  TORCH_CHECK(w.is_contiguous() && w.size(0) == h.size(1), "rms_norm weight");
  TORCH_CHECK(h.scalar_type() == w.scalar_type() && h.scalar_type() == delta.scalar_type(), "dtypes");
  auto out = at::empty({h.size(0), h.size(1)}, h.options());
  if (h.scalar_type() == at::kFloat) rms_norm_impl<float>(h, &delta, w, out, eps);
  else if (h.scalar_type() == at::kBFloat16) rms_norm_impl<at::BFloat16>(h, &delta, w, out, eps);
  else TORCH_CHECK(false, "float32 or bfloat16 only");
  return out;
}


// gate_up [T, 2I] (gate | up) -> T(silu(gate)) * up, each op rounded to T as F.silu(gate) * up does. Eight
// at a time with AVX2 (`omp simd` left the loop scalar: 8-12 us a 1536-wide row, 0.3 ms of a decode step).
template <typename T>
static void silu_mul_impl(const at::Tensor& gu, at::Tensor& out) {
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2, rs = gu.stride(0);
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * rs;
      const T* u = g + inter;
      T* o = op + r * inter;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
      for (; i + 8 <= inter; i += 8) {
        const __m256 x = load8(g + i);
        const __m256 e = exp_nonpos8(_mm256_or_ps(x, sign));  // exp(-|x|)
        const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
        const __m256 s = round8(_mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(one, e))), T{});
        store8(o + i, _mm256_mul_ps(s, load8(u + i)));
      }
#endif
      for (; i < inter; ++i) {
        const float x = widen(g[i]);
        const float e = exp_nonpos(-std::fabs(x));  // silu(x) = x * sigmoid(x), sigmoid from exp(-|x|)
        const float sig = (x >= 0.f ? 1.f : e) / (1.f + e);
        const float s = widen(narrow_to<T>(x * sig));
        o[i] = narrow_to<T>(s * widen(u[i]));
      }
    }
  });
}

at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0, "silu_mul shapes");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) silu_mul_impl<float>(gate_up, out);
  else if (gate_up.scalar_type() == at::kBFloat16) silu_mul_impl<at::BFloat16>(gate_up, out);
  else TORCH_CHECK(false, "float32 or bfloat16 only");
  return out;
}

// Greedy sampling's pick in two passes over each row of float32 logits [N, V] instead of four torch ops
// (log_softmax, argmax, gather: ~60 us each over 49,152 logits): the first index of the row's max, and its
// log-probability -log(sum exp(x - max)). Returns false (and the caller keeps torch) where a row holds a NaN
// or an infinity, whose IEEE results torch defines.
static bool greedy_row(const float* x, int64_t V, int64_t& token, float& logprob) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t arg = 0, v0 = 0;
  bool finite = true;
#if defined(__AVX2__) && defined(__FMA__)
  if (V >= 8) {
    __m256 mv = _mm256_loadu_ps(x);
    __m256i iv = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 bad = _mm256_cmp_ps(_mm256_and_ps(mv, abs_mask), big, _CMP_NLE_UQ);  // NaN or |x| = inf
    __m256i idx = _mm256_add_epi32(iv, _mm256_set1_epi32(8));
    const __m256i step = _mm256_set1_epi32(8);
    for (v0 = 8; v0 + 8 <= V; v0 += 8, idx = _mm256_add_epi32(idx, step)) {
      const __m256 v = _mm256_loadu_ps(x + v0);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(v, abs_mask), big, _CMP_NLE_UQ));
      const __m256 gt = _mm256_cmp_ps(v, mv, _CMP_GT_OQ);  // strictly greater: each lane keeps its first max
      mv = _mm256_max_ps(v, mv);
      iv = _mm256_blendv_epi8(iv, idx, _mm256_castps_si256(gt));
    }
    finite = _mm256_movemask_ps(bad) == 0;
    alignas(32) float lm[8];
    alignas(32) int32_t li[8];
    _mm256_store_ps(lm, mv);
    _mm256_store_si256(reinterpret_cast<__m256i*>(li), iv);
    for (int l = 0; l < 8; ++l)
      if (lm[l] > m || (lm[l] == m && li[l] < arg)) m = lm[l], arg = li[l];
  }
#endif
  for (int64_t v = v0; v < V; ++v) {
    finite = finite && std::isfinite(x[v]);
    if (x[v] > m) m = x[v], arg = v;
  }
  if (!finite) return false;
  float sum = 0.f;
  int64_t v = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (; v + 8 <= V; v += 8) sv = _mm256_add_ps(sv, exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(x + v), mb)));
  sum = reduce8(sv);
#endif
  for (; v < V; ++v) sum += exp_nonpos(x[v] - m);
  token = arg;
  logprob = -std::log(sum);
  return true;
}

// -> (tokens int64 [N], log-probabilities float32 [N]), or two empty tensors where a row is not finite
std::tuple<at::Tensor, at::Tensor> greedy_pick(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "greedy_pick: contiguous float32 logits [N, V]");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31), "greedy_pick: 0 < V < 2^31");
  const int64_t N = logits.size(0), V = logits.size(1);
  auto tokens = at::empty({N}, logits.options().dtype(at::kLong));
  auto logprobs = at::empty({N}, logits.options());
  const float* xp = logits.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      if (!greedy_row(xp + r * V, V, tp[r], lp[r])) ok = false;
  });
  if (!ok) return {at::empty({0}, tokens.options()), at::empty({0}, logprobs.options())};
  return {tokens, logprobs};
}

// In place on x [T, heads, D] (any row/head strides, unit stride in D): rotate-half RoPE with tables
// cos/sin [T, D] (already scaled and in x's dtype): x*cos + rotate_half(x)*sin, rounded like the torch ops.
template <typename T>
static void rope_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rows = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(D);
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cp + r * D;
      const T* s = sp + r * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + r * s0 + h * s1;
        for (int64_t i = 0; i < D; ++i) {
          const float rot = i < half ? -widen(v[i + half]) : widen(v[i - half]);
          const float a = widen(narrow_to<T>(widen(v[i]) * widen(c[i])));
          const float b = widen(narrow_to<T>(rot * widen(s[i])));
          tmp[i] = widen(narrow_to<T>(a + b));
        }
        for (int64_t i = 0; i < D; ++i) v[i] = narrow_to<T>(tmp[i]);
      }
    }
  });
}

void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rope shapes");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2), "rope tables");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(), "rope dtypes");
  if (x.scalar_type() == at::kFloat) rope_impl<float>(x, cos, sin);
  else if (x.scalar_type() == at::kBFloat16) rope_impl<at::BFloat16>(x, cos, sin);
  else TORCH_CHECK(false, "float32 or bfloat16 only");
}
