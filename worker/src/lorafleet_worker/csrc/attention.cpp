// Paged decode attention (`paged_decode`) and a decode-only step's whole attention in one call
// (`decode_attention`), of the library lorafleet_cpu_ops (its Python module: cpu_ops.cpp).
//
// The kernel walks each sequence's block table instead of gathering its blocks into a padded copy. A work item
// is a sequence (or, with fewer sequences than 4 x threads, a range of its KV heads): it scores the query heads
// of its KV heads against each token's key slice (GQA without copying K/V; AVX-512 or AVX2 dot products where
// the compiler targets it, bfloat16 widened to float32 in registers), takes the softmax (a branch-free
// vectorised exp) and accumulates the value rows the same way, reading the sequence's blocks front to back and
// prefetching the next block. Items run on ATen's OpenMP thread pool (the library is compiled with -fopenmp:
// without it ATen's `parallel_for` runs serially).
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

// q . k over D values (q already float), and acc += p * v: AVX-512 or AVX2 + FMA where the compiler targets
// it and D is a multiple of 16 (head dims 64, 128, ...), portable loops otherwise.
#if defined(__AVX512F__)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#endif
// AVX2: 8 floats a register (simd8.h: load8, reduce8, store8, bf16_bits8; also on AVX-512 builds, where SiLU x
// up in layer_ops.cpp uses them). Without them the dot product below stays a scalar chain (GCC does not reorder
// a float sum without -ffast-math): 64 dependent FMAs per score.

template <typename T>
static inline float dot(const float* q, const T* k, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), a);
    return _mm512_reduce_add_ps(a);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (D % 16 == 0) {  // two accumulators: two FMA chains in flight
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a);
      b = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), b);
    }
    return reduce8(_mm256_add_ps(a, b));
  }
#endif
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += q[d] * widen(k[d]);
  return s;
}

template <typename T>
static inline void axpy(float p, const T* v, float* acc, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    const __m512 pp = _mm512_set1_ps(p);
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pp, load16(v + d), _mm512_loadu_ps(acc + d)));
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    const __m256 pp = _mm256_set1_ps(p);
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pp, load8(v + d), _mm256_loadu_ps(acc + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) acc[d] += p * widen(v[d]);
}

// softmax in place over each of `rows` rows of n scores (a branch-free vectorised exp)
static inline void softmax_rows(float* scores, int64_t rows, int64_t n) {
  for (int64_t hh = 0; hh < rows; ++hh) {
    float* sh = scores + hh * n;
    float m = sh[0];
    float sum = 0.f;
    int64_t t0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    // eight lanes at a time (`omp simd` left exp_nonpos scalar: a quarter of a 160-token head's time)
    if (n >= 8) {
      __m256 mv = _mm256_loadu_ps(sh);
      for (int64_t t = 8; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sh + t));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mv);
      for (int l = 0; l < 8; ++l) m = std::max(m, lanes[l]);
      for (int64_t t = n - n % 8; t < n; ++t) m = std::max(m, sh[t]);
      const __m256 mb = _mm256_set1_ps(m);
      __m256 sv = _mm256_setzero_ps();
      for (; t0 + 8 <= n; t0 += 8) {
        const __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(sh + t0), mb));
        _mm256_storeu_ps(sh + t0, e);
        sv = _mm256_add_ps(sv, e);
      }
      sum = reduce8(sv);
    }
#endif
    if (t0 == 0) {
#pragma omp simd reduction(max : m)
      for (int64_t t = 1; t < n; ++t) m = std::max(m, sh[t]);
    }
#pragma omp simd reduction(+ : sum)
    for (int64_t t = t0; t < n; ++t) {
      const float e = exp_nonpos(sh[t] - m);
      sh[t] = e;
      sum += e;
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) sh[t] *= inv;
  }
}

#if defined(__AVX512F__)
// The fast path of one (sequence, KV head): its G query heads live in registers (NCH = D / 16 vectors each)
// for the whole context, each key row is loaded once for the G dot products, and the G output rows are
// accumulated in registers over the value rows (no accumulator traffic through memory). `kc` / `vc` point
// at this KV head's slice of the caches; the next block's rows are prefetched while a block is read.
template <typename T, int NCH, int G>
static void attend_kv_head(const T* q, float scale, const T* kc, const T* vc, const int32_t* table, int64_t bs,
                           int64_t row_len, int64_t first, int64_t n, float* scores, T* out) {
  constexpr int64_t D = NCH * 16;
  __m512 qv[G][NCH];
  const __m512 sc = _mm512_set1_ps(scale);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NCH; ++c) qv[g][c] = _mm512_mul_ps(load16(q + g * D + c * 16), sc);
  for (int pass = 0; pass < 2; ++pass) {  // 0: scores over K, 1: weighted sum over V
    const T* base = pass == 0 ? kc : vc;
    __m512 acc[G][NCH];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NCH; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n;) {
      const int64_t pos = first + t;
      const int64_t off = pos % bs;
      const int64_t run = std::min(bs - off, n - t);
      const T* row = base + (int64_t{table[pos / bs]} * bs + off) * row_len;
      const T* next = t + run < n ? base + int64_t{table[(first + t + run) / bs]} * bs * row_len : nullptr;
      for (int64_t i = 0; i < run; ++i, row += row_len) {
        if (next != nullptr) {
          const char* nr = reinterpret_cast<const char*>(next + i * row_len);
          for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(nr + b);
        }
        __m512 x[NCH];
        for (int c = 0; c < NCH; ++c) x[c] = load16(row + c * 16);
        if (pass == 0) {
          for (int g = 0; g < G; ++g) {
            __m512 a = _mm512_mul_ps(qv[g][0], x[0]);
            for (int c = 1; c < NCH; ++c) a = _mm512_fmadd_ps(qv[g][c], x[c], a);
            scores[g * n + t + i] = _mm512_reduce_add_ps(a);
          }
        } else {
          for (int g = 0; g < G; ++g) {
            const __m512 p = _mm512_set1_ps(scores[g * n + t + i]);
            for (int c = 0; c < NCH; ++c) acc[g][c] = _mm512_fmadd_ps(p, x[c], acc[g][c]);
          }
        }
      }
      t += run;
    }
    if (pass == 0) {
      softmax_rows(scores, G, n);
      continue;
    }
    for (int g = 0; g < G; ++g) {
      alignas(64) float tmp[D];
      for (int c = 0; c < NCH; ++c) _mm512_store_ps(tmp + c * 16, acc[g][c]);
      for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(tmp[d]);
    }
  }
}

#define LF_HEAD_LANES 16  // floats a register
#elif defined(__AVX2__) && defined(__FMA__)
// The AVX2 fast path of one (sequence, KV head), the same walk with 16 registers instead of 32: the G query
// heads (scaled, as float) stay in L1 and each key row is widened once into NCH = D / 8 registers for the G
// dot products; the value pass keeps G x CH output vectors in registers (CH <= NCH, at most 12 accumulators)
// and walks the value rows NCH / CH times, once per CH-vector slice of D. The general loop below instead
// widens each key row once per query head and accumulates the output through memory: 28.7 us against this
// path's 13.7 us (with the vector softmax) for 9 query heads on 3 KV heads over 160 bf16 tokens, one EPYC thread.
template <int NCH, int G>
struct Avx2Slices {  // the value pass's slice width: the largest power of two dividing NCH with G x CH <= 12
  static constexpr int pick(int c) { return (c > 1 && (G * c > 12 || NCH % c != 0)) ? pick(c / 2) : c; }
  static constexpr int CH = pick(NCH);
};

template <typename T, int NCH, int G>
static void attend_kv_head(const T* q, float scale, const T* kc, const T* vc, const int32_t* table, int64_t bs,
                           int64_t row_len, int64_t first, int64_t n, float* scores, T* out) {
  constexpr int64_t D = NCH * 8;
  constexpr int CH = Avx2Slices<NCH, G>::CH;
  alignas(32) float qf[G * D];
  const __m256 sc = _mm256_set1_ps(scale);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NCH; ++c) _mm256_store_ps(qf + g * D + c * 8, _mm256_mul_ps(load8(q + g * D + c * 8), sc));
  // scores over K
  for (int64_t t = 0; t < n;) {
    const int64_t pos = first + t, off = pos % bs, run = std::min(bs - off, n - t);
    const T* row = kc + (int64_t{table[pos / bs]} * bs + off) * row_len;
    const T* next = t + run < n ? kc + int64_t{table[(first + t + run) / bs]} * bs * row_len : nullptr;
    for (int64_t i = 0; i < run; ++i, row += row_len) {
      if (next != nullptr) {
        const char* nr = reinterpret_cast<const char*>(next + i * row_len);
        for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(nr + b);
      }
      __m256 x[NCH];
      for (int c = 0; c < NCH; ++c) x[c] = load8(row + c * 8);
      for (int g = 0; g < G; ++g) {
        const float* qg = qf + g * D;
        __m256 a = _mm256_mul_ps(_mm256_load_ps(qg), x[0]);
        __m256 b = NCH > 1 ? _mm256_mul_ps(_mm256_load_ps(qg + 8), x[1]) : _mm256_setzero_ps();
        for (int c = 2; c + 1 < NCH; c += 2) {
          a = _mm256_fmadd_ps(_mm256_load_ps(qg + c * 8), x[c], a);
          b = _mm256_fmadd_ps(_mm256_load_ps(qg + c * 8 + 8), x[c + 1], b);
        }
        if (NCH > 1 && NCH % 2 == 1) a = _mm256_fmadd_ps(_mm256_load_ps(qg + (NCH - 1) * 8), x[NCH - 1], a);
        scores[g * n + t + i] = reduce8(_mm256_add_ps(a, b));
      }
    }
    t += run;
  }
  softmax_rows(scores, G, n);
  // the weighted sum over V, one CH-vector slice of D at a time
  for (int c0 = 0; c0 < NCH; c0 += CH) {
    __m256 acc[G][CH];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CH; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n;) {
      const int64_t pos = first + t, off = pos % bs, run = std::min(bs - off, n - t);
      const T* row = vc + (int64_t{table[pos / bs]} * bs + off) * row_len + c0 * 8;
      for (int64_t i = 0; i < run; ++i, row += row_len) {
        __m256 x[CH];
        for (int c = 0; c < CH; ++c) x[c] = load8(row + c * 8);
        for (int g = 0; g < G; ++g) {
          const __m256 p = _mm256_broadcast_ss(scores + g * n + t + i);
          for (int c = 0; c < CH; ++c) acc[g][c] = _mm256_fmadd_ps(p, x[c], acc[g][c]);
        }
      }
      t += run;
    }
    for (int g = 0; g < G; ++g) {
      alignas(32) float tmp[CH * 8];
      for (int c = 0; c < CH; ++c) _mm256_store_ps(tmp + c * 8, acc[g][c]);
      for (int64_t d = 0; d < CH * 8; ++d) out[g * D + c0 * 8 + d] = static_cast<T>(tmp[d]);
    }
  }
}

#define LF_HEAD_LANES 8
#endif

template <typename T>
using KvHeadFn = void (*)(const T*, float, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                          float*, T*);
#ifdef LF_HEAD_LANES
template <typename T, int NCH>
static KvHeadFn<T> pick_group(int64_t G) {
  switch (G) {
    case 1: return &attend_kv_head<T, NCH, 1>;
    case 2: return &attend_kv_head<T, NCH, 2>;
    case 3: return &attend_kv_head<T, NCH, 3>;
    case 4: return &attend_kv_head<T, NCH, 4>;
    case 5: return &attend_kv_head<T, NCH, 5>;
    case 6: return &attend_kv_head<T, NCH, 6>;
    case 7: return &attend_kv_head<T, NCH, 7>;
    case 8: return &attend_kv_head<T, NCH, 8>;
    default: return nullptr;
  }
}

// The fast path for head dims 64 and 128 with up to 8 query heads per KV head; nullptr: the general loop.
template <typename T>
static KvHeadFn<T> pick_fast(int64_t D, int64_t G) {
  if (D == 64) return pick_group<T, 64 / LF_HEAD_LANES>(G);
  if (D == 128) return pick_group<T, 128 / LF_HEAD_LANES>(G);
  return nullptr;
}
#else
template <typename T>
static KvHeadFn<T> pick_fast(int64_t, int64_t) { return nullptr; }
#endif

// One work item per (sequence, range of KV heads): the query heads of those KV heads score every
// token's key slice (D contiguous values per KV head in the token's [KVH, D] row of its block), then
// the softmax, then the weighted sum of the value rows. With enough sequences an item takes all KV
// heads, so it reads its sequence's blocks front to back as whole rows (the prefetcher's best case;
// the next block, anywhere in the pool, is prefetched a row at a time while the current one is read);
// with few sequences the KV heads are split so every thread has work. Items are spread over ATen's
// (OpenMP) thread pool.
template <typename T>
static void decode_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& bt,
                        const at::Tensor& lens, at::Tensor& out, double scale, int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), KVH = kc.size(2), G = H / KVH, maxb = bt.size(1), row_len = KVH * D;
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
  const int64_t splits = B >= want ? 1 : std::min<int64_t>(KVH, (want + B - 1) / B);
  const int64_t per_split = (KVH + splits - 1) / splits;
  const int64_t row_bytes = row_len * static_cast<int64_t>(sizeof(T));
  const KvHeadFn<T> fast = pick_fast<T>(D, G);
  const int64_t items = B * splits;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), scores;
    for (int64_t j = begin; j < end; ++j) {
      // items in zig-zag order (0, n - 1, 1, n - 2, ...): each thread takes one contiguous range of j, and the
      // rows of a prefill cost more the later they come (a longer causal prefix), so every range gets both ends
      const int64_t item = j % 2 == 0 ? j / 2 : items - 1 - j / 2;
      const int64_t b = item / splits, kv0 = (item % splits) * per_split;
      const int64_t kv1 = std::min(KVH, kv0 + per_split);
      if (kv0 >= kv1) continue;
      const int64_t h0 = kv0 * G, nh = (kv1 - kv0) * G;  // query heads [h0, h0 + nh)
      const int64_t len = lp[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      T* ob = op + (b * H + h0) * D;
      if (n <= 0) {
        for (int64_t j = 0; j < nh * D; ++j) ob[j] = static_cast<T>(0.f);
        continue;
      }
      const int32_t* table = btp + b * maxb;
      if (fast != nullptr) {
        scores.resize(G * n);
        for (int64_t kv = kv0; kv < kv1; ++kv)
          fast(qp + (b * H + kv * G) * D, fscale, kp + kv * D, vp + kv * D, table, bs, row_len, first, n,
               scores.data(), op + (b * H + kv * G) * D);
        continue;
      }
      scores.resize(nh * n);
      const T* qb = qp + (b * H + h0) * D;
      for (int64_t j = 0; j < nh * D; ++j) qf[j] = widen(qb[j]) * fscale;
      for (int pass = 0; pass < 2; ++pass) {  // 0: scores over K, 1: weighted sum over V
        const T* base = pass == 0 ? kp : vp;
        if (pass == 1) std::fill(acc.begin(), acc.begin() + nh * D, 0.f);
        for (int64_t t = 0; t < n;) {
          const int64_t pos = first + t;
          const int64_t blk = table[pos / bs], off = pos % bs;
          const int64_t run = std::min(bs - off, n - t);
          const T* row = base + (blk * bs + off) * row_len + kv0 * D;
          const int64_t tn = t + run;  // the next block, prefetched a row per row read
          const char* next = nullptr;
          if (tn < n) next = reinterpret_cast<const char*>(base + int64_t{table[(first + tn) / bs]} * bs * row_len);
          for (int64_t i = 0; i < run; ++i, row += row_len) {
            if (next != nullptr) {
              for (int64_t c = 0; c < row_bytes; c += 64) __builtin_prefetch(next + i * row_bytes + c);
            }
            for (int64_t hh = 0; hh < nh; ++hh) {
              const T* r = row + (hh / G) * D;
              if (pass == 0) {
                scores[hh * n + t + i] = dot(qf.data() + hh * D, r, D);
              } else {
                axpy(scores[hh * n + t + i], r, acc.data() + hh * D, D);
              }
            }
          }
          t = tn;
        }
        if (pass == 1) break;
        softmax_rows(scores.data(), nh, n);
      }
      for (int64_t j = 0; j < nh * D; ++j) ob[j] = static_cast<T>(acc[j]);
    }
  });
}

at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "head shapes");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0), "one table and length per query");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    decode_impl<float>(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_impl<at::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, out, scale, window);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16 only");
  }
  return out;
}

// In place on x [T, heads, D] (unit stride in D): each head's RMSNorm with weight w [D] (Qwen3's q_norm /
// k_norm), rounded as `rms_norm_impl` rounds.
template <typename T>
static void head_rms_norm_impl(at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t rows = x.size(0), heads = x.size(1), D = x.size(2), s0 = x.stride(0), s1 = x.stride(1);
  T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      T* v = xp + r * s0 + h * s1;
      float ss = 0.f;
      for (int64_t i = 0; i < D; ++i) ss += widen(v[i]) * widen(v[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      for (int64_t i = 0; i < D; ++i) v[i] = narrow_to<T>(widen(wp[i]) * widen(narrow_to<T>(widen(v[i]) * inv)));
    }
  }
}

// The attention of a decode-only step in one call, from the qkv projection's output [T, (H + 2 KVH) D]: the
// optional per-head q/k RMSNorm and RoPE in place on its q and k columns, k and v written into the caches
// at `slot_mapping`, then paged decode attention (one query per sequence). Returns [T, H * D]. The same
// arithmetic as the separate ops (`rope_`, the cache writes, `paged_decode`) in one call instead of a dozen.
at::Tensor decode_attention(at::Tensor qkv, at::Tensor cos, at::Tensor sin, c10::optional<at::Tensor> q_norm,
                            c10::optional<at::Tensor> k_norm, double eps, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                            int64_t num_heads, double scale, int64_t window) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && qkv.scalar_type() == v_cache.scalar_type(), "dtypes");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == qkv.size(0), "one slot per row");
  const int64_t T = qkv.size(0), KVH = k_cache.size(2), D = k_cache.size(3), H = num_heads;
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D, "qkv width is (heads + 2 kv heads) x head dim");
  auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
  auto k = qkv.narrow(1, H * D, KVH * D).view({T, KVH, D});
  const bool bf16 = qkv.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || qkv.scalar_type() == at::kFloat, "float32 or bfloat16 only");
  if (q_norm.has_value() != k_norm.has_value()) TORCH_CHECK(false, "q_norm and k_norm together");
  if (q_norm) {
    TORCH_CHECK(q_norm->is_contiguous() && k_norm->is_contiguous() && q_norm->size(0) == D, "q/k norm weights");
    TORCH_CHECK(q_norm->scalar_type() == qkv.scalar_type() && k_norm->scalar_type() == qkv.scalar_type(), "dtypes");
    if (bf16) {
      head_rms_norm_impl<at::BFloat16>(q, *q_norm, eps);
      head_rms_norm_impl<at::BFloat16>(k, *k_norm, eps);
    } else {
      head_rms_norm_impl<float>(q, *q_norm, eps);
      head_rms_norm_impl<float>(k, *k_norm, eps);
    }
  }
  rope_(q, cos, sin);
  rope_(k, cos, sin);
  const int64_t elem = static_cast<int64_t>(qkv.element_size()), row = KVH * D * elem;
  const int64_t slots = k_cache.size(0) * k_cache.size(1), rs = qkv.stride(0) * elem;
  const int64_t* sm = slot_mapping.contiguous().data_ptr<int64_t>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* base = static_cast<const char*>(qkv.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sm[t] >= 0 && sm[t] < slots, "slot out of range");
    std::memcpy(kc + sm[t] * row, base + t * rs + H * D * elem, row);
    std::memcpy(vc + sm[t] * row, base + t * rs + (H + KVH) * D * elem, row);
  }
  return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window).view({T, H * D});
}
