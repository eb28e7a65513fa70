// Grouped multi-LoRA (the library lorafleet_cpu_lora; its Python side: lorafleet_worker/ops/cpu_lora.py):
// lora_small, the shrink and expand of every adapter of one projection group in one call, and the module that
// binds it.
//
// `lora_small` walks the step's short segments (each adapter's decode tokens, prompt chunks) in two passes split
// over ATen's thread pool:
//   shrink  per (segment, slice with rank r > 0, 64 of its tokens): xa[token, slice, :r] = x[row] . A[slot,
//           slice, :r]^T, each A row read once for 4 tokens at a time, float32 sums;
//   expand  per (segment, slice, block of 256 output columns, 64 tokens): out[row, cols] += scaling .
//           xa[token, slice, :r] . B[slot, cols, :r]^T; with the pool's rank-major B (B[slot] stored as [r, out])
//           this is r axpys over contiguous rows; a B stored [out, r] is read as one dot product per column.
// With AVX2 + FMA both passes run register tiles on blocks of 3-4 tokens (shrink: 4 tokens x 2 rows of A, 8
// independent sums; expand: 3-4 tokens x 16 columns held in registers over the whole rank). In bfloat16 on a
// CPU with AVX512-BF16 the shrink's tiles multiply bfloat16 pairs (`vdpbf16ps`, x and A read as they are). A
// segment of one or two tokens reads each A row once for both tokens and takes two-token expand loops with each
// B row widened once for both tokens. A step whose every segment is one token (one user's decode) skips the work
// lists: `run_tokens`, 1-token tiles on the calling thread (AVX2 + FMA), B streamed row by row, and every row the
// call reads requested into L2 before the first is used; in bfloat16 with AVX512-BF16 it is `run_tokens_bf16`,
// bfloat16 pairs in both passes, the call split over ATen's threads. Only each adapter's own rank is read (no max-rank
// padding), slices of rank 0 are skipped, x rows are read in place through the step's row list (no gather, no
// scatter).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd8.h"

#if defined(__AVX2__) && defined(__FMA__)
#define LF_AVX2 1
#endif

namespace {

constexpr int64_t TB = 4;     // tokens per block: one weight row is read once for up to TB tokens
constexpr int64_t NC = 256;   // output columns per expand work item
constexpr int64_t PC = 64;    // tokens per work item: a long segment (a prompt) is split over the threads too

template <typename T>
inline const float* widen(const T* src, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}
template <>
inline const float* widen<float>(const float* src, float*, int64_t) { return src; }
// One element as float inside a vectorized loop: bfloat16 is the top half of a float, a 16-bit shift.
// A and B are read in place and widened in registers (converting them into a buffer per token block first,
// element by element, made a one-user bfloat16 decode step with an adapter ~10 ms slower than float32's).
inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <>
inline const float* widen<at::BFloat16>(const at::BFloat16* src, float* buf, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buf[i] = to_float(src[i]);
  return buf;
}

struct Seg {
  int64_t slot, start, end;
};

#ifdef LF_AVX2
// Register tiles (AVX2 + FMA; on AVX-512 machines as fast: Zen 4 splits a zmm FMA in two): 8 independent
// accumulators keep both FMA pipes busy, where the portable loops below ran one dependent chain per sum.
// (load8, reduce8, store8: simd8.h)

// sums[t * NA + i] = x[t] · a[i] over K (a multiple of 8) for NT float rows x and NA rows a of T; NT * NA * U = 8
// accumulators, U of them over consecutive k for each product (one row of A then streams through 8 FMA chains)
template <typename T, int NT, int NA, int U>
inline void dot_tile(const float* const* x, const T* const* a, int64_t K, float* sums) {
  __m256 acc[U][NT * NA];
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
    for (int i = 0; i < NT * NA; ++i) acc[u][i] = _mm256_setzero_ps();
  const auto step = [&](int u, int64_t k) {
    __m256 w[NA];
#pragma GCC unroll 8
    for (int i = 0; i < NA; ++i) w[i] = load8(a[i] + k);
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      const __m256 xv = _mm256_loadu_ps(x[t] + k);
#pragma GCC unroll 8
      for (int i = 0; i < NA; ++i) acc[u][t * NA + i] = _mm256_fmadd_ps(xv, w[i], acc[u][t * NA + i]);
    }
  };
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) step(u, k + 8 * u);
  for (; k < K; k += 8) step(0, k);
#pragma GCC unroll 8
  for (int i = 0; i < NT * NA; ++i) {
    __m256 v = acc[0][i];
#pragma GCC unroll 8
    for (int u = 1; u < U; ++u) v = _mm256_add_ps(v, acc[u][i]);
    sums[i] = reduce8(v);
  }
}

// o[t][c .. c + 8 * CW) += sum_j coef[t * R + j] * b[j * bs + c ..] for NT rows, every full chunk of 8 * CW
// columns below nc; returns the first column not done
template <typename T, int NT, int CW>
inline int64_t expand_tile(const float* coef, int64_t R, const T* b, int64_t bs, int64_t r, T* const* o, int64_t nc) {
  int64_t c = 0;
  for (; c + 8 * CW <= nc; c += 8 * CW) {
    __m256 acc[NT * CW];
#pragma GCC unroll 8
    for (int i = 0; i < NT * CW; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < r; ++j) {
      __m256 w[CW];
#pragma GCC unroll 8
      for (int q = 0; q < CW; ++q) w[q] = load8(b + j * bs + c + 8 * q);
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) {
        const __m256 cv = _mm256_broadcast_ss(coef + t * R + j);
#pragma GCC unroll 8
        for (int q = 0; q < CW; ++q) acc[t * CW + q] = _mm256_fmadd_ps(cv, w[q], acc[t * CW + q]);
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 8
      for (int q = 0; q < CW; ++q) {
        T* p = o[t] + c + 8 * q;
        store8(p, _mm256_add_ps(load8(p), acc[t * CW + q]));
      }
  }
  return c;
}
#endif

#ifdef LF_AVX2
// Requests `n` rows of `len` elements, `stride` apart from `p`, into L2 (a read prefetch, one per cache line).
template <typename T>
inline void prefetch_rows(const T* p, int64_t stride, int64_t n, int64_t len) {
  for (int64_t j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(p + j * stride);
    for (int64_t b = 0; b < len * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(row + b, 0, 2);
  }
}

// Steps whose every segment is one token (a one-user decode, or each adapter's single decode row): per segment
// and slice the shrink in tiles of 4 rank rows against the token's widened row (no token repeated to fill a tile),
// then the expand: B's rank rows read front to back into float sums, added to the token's output row once.
// On the calling thread, with no work lists; its buffers (the widened row, coefficients, sums) are reused.
template <typename T>
void run_tokens(const T* xp, int64_t xs, T* op, int64_t os, const T* ap, int64_t as_slot, int64_t as_slice,
                int64_t as_rank, const T* bp, int64_t bs_slot, int64_t bs_rank, const int32_t* rk, int64_t rs_slot,
                const float* sc, int64_t ss_slot, const std::vector<int64_t>& offs, const int32_t* rp,
                const std::vector<Seg>& segs, int64_t n_slices, int64_t K, int64_t R) {
  thread_local std::vector<float> xbuf, coef, accbuf;
  xbuf.resize(static_cast<size_t>(K));
  coef.resize(static_cast<size_t>(R));
  accbuf.resize(static_cast<size_t>(offs.back()));
  for (const Seg& sg : segs) {
    if (sg.end == sg.start) continue;
    const int64_t row = rp[sg.start];
    const float* xr = widen<T>(xp + row * xs, xbuf.data(), K);
    // Every A and B row this segment reads, requested into L2 before the first is used. An adapter's rows come
    // from memory (the base weights read between two calls evict them) and are short (a rank row of A is K
    // elements, of B one slice's columns): the hardware's stream prefetch is not ahead of them before they end.
    for (int64_t s = 0; s < n_slices; ++s) {
      const int64_t r = rk[sg.slot * rs_slot + s];
      if (r <= 0) continue;
      prefetch_rows(ap + sg.slot * as_slot + s * as_slice, as_rank, r, K);
      prefetch_rows(bp + sg.slot * bs_slot + offs[s], bs_rank, r, offs[s + 1] - offs[s]);
    }
    for (int64_t s = 0; s < n_slices; ++s) {
      const int64_t r = rk[sg.slot * rs_slot + s];
      if (r <= 0) continue;
      const float scale = sc[sg.slot * ss_slot + s];
      const T* a_base = ap + sg.slot * as_slot + s * as_slice;
      for (int64_t j = 0; j < r; j += 4) {  // a tile past r repeats row r - 1
        const T* a[4];
        for (int64_t i = 0; i < 4; ++i) a[i] = a_base + std::min(j + i, r - 1) * as_rank;
        float sums[4];
        dot_tile<T, 1, 4, 2>(&xr, a, K, sums);
        for (int64_t i = 0; i < std::min<int64_t>(4, r - j); ++i) coef[j + i] = scale * sums[i];
      }
      // the expand reads B's rank rows front to back, 4 at a time (4 sequential streams), into float sums
      const int64_t nc = offs[s + 1] - offs[s], n8 = nc & ~int64_t{7};
      T* o = op + row * os + offs[s];
      const T* b = bp + sg.slot * bs_slot + offs[s];
      float* acc = accbuf.data();
      std::fill(acc, acc + nc, 0.f);
      for (int64_t j = 0; j < r; j += 4) {  // rows past r repeat row r - 1 with a zero coefficient
        const T* b0 = b + j * bs_rank;
        const T* b1 = b + std::min(j + 1, r - 1) * bs_rank;
        const T* b2 = b + std::min(j + 2, r - 1) * bs_rank;
        const T* b3 = b + std::min(j + 3, r - 1) * bs_rank;
        const float c0 = coef[j], c1 = j + 1 < r ? coef[j + 1] : 0.f, c2 = j + 2 < r ? coef[j + 2] : 0.f,
                    c3 = j + 3 < r ? coef[j + 3] : 0.f;
        const __m256 v0 = _mm256_set1_ps(c0), v1 = _mm256_set1_ps(c1), v2 = _mm256_set1_ps(c2),
                     v3 = _mm256_set1_ps(c3);
        for (int64_t i = 0; i < n8; i += 8) {
          __m256 a = _mm256_fmadd_ps(v0, load8(b0 + i), _mm256_loadu_ps(acc + i));
          a = _mm256_fmadd_ps(v1, load8(b1 + i), a);
          a = _mm256_fmadd_ps(v2, load8(b2 + i), a);
          _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(v3, load8(b3 + i), a));
        }
        for (int64_t i = n8; i < nc; ++i)
          acc[i] += c0 * to_float(b0[i]) + c1 * to_float(b1[i]) + c2 * to_float(b2[i]) + c3 * to_float(b3[i]);
      }
      int64_t i = 0;
      for (; i < n8; i += 8) store8(o + i, _mm256_add_ps(load8(o + i), _mm256_loadu_ps(acc + i)));
      for (; i < nc; ++i) o[i] = static_cast<T>(static_cast<float>(o[i]) + acc[i]);
    }
  }
}
#endif

#if defined(LF_AVX2) && defined(__GNUC__)
// bfloat16 shrink tiles with AVX512-BF16 `vdpbf16ps` (32 products of bfloat16 pairs into 16 float32 lanes an
// instruction, twice a widened FMA's work and no widening): compiled function by function into every x86 build
// (the prebuilt x86-64-v3 / v4 libraries too) and taken where the CPU has it (`has_bf16_dot`). The products are
// exact in float32, summed with float32 rounding (denormal inputs read as zero), as the FMA tiles sum them.
#define LF_BF16_DOT 1
#define LF_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
bool has_bf16_dot() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

// sums[t * 2 + i] = x[t] · a[i] over K (a multiple of 32) for 4 bfloat16 rows x and 2 bfloat16 rows a
LF_BF16_TARGET void dot_tile_bf16(const at::BFloat16* const* x, const at::BFloat16* const* a, int64_t K, float* sums) {
  __m512 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(a[0] + k), w1 = (__m512bh)_mm512_loadu_si512(a[1] + k);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[t] + k);
      acc[2 * t] = _mm512_dpbf16_ps(acc[2 * t], xv, w0);
      acc[2 * t + 1] = _mm512_dpbf16_ps(acc[2 * t + 1], xv, w1);
    }
  }
  for (int i = 0; i < 8; ++i) sums[i] = _mm512_reduce_add_ps(acc[i]);
}

// The eight sums of eight 16-lane accumulators, as one 8-lane vector (halves added, then a transposing hadd tree).
LF_BF16_TARGET inline __m256 reduce8x16(const __m512* a) {
  __m256 h[8];
  for (int i = 0; i < 8; ++i)
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// o[c .. c + 32 * CB) += scale * sum_j coef_j * b[j * bs + c ..] over the rank rows j < r, in `vdpbf16ps` on pairs
// of rank rows: rows j and j + 1 interleaved word by word (one unpack each half) against the pair of bfloat16
// coefficients (`pairs[j / 2]`: coef_j low, coef_j+1 high; an odd rank's last pair repeats row r - 1 with a zero
// coefficient). CB blocks of 32 columns keep 2 * CB independent sums. The unpacks work within 128-bit lanes, so the
// low half holds columns 8L..8L+3 of each lane L and the high half 8L+4..8L+7; one permute puts them in order.
template <int CB>
LF_BF16_TARGET inline void expand_pairs_bf16(const uint32_t* pairs, const at::BFloat16* b, int64_t bs, int64_t r,
                                             float scale, at::BFloat16* o) {
  __m512 lo[CB], hi[CB];
  for (int q = 0; q < CB; ++q) lo[q] = hi[q] = _mm512_setzero_ps();
  for (int64_t j = 0; j < r; j += 2) {
    const at::BFloat16* b0 = b + j * bs;
    const at::BFloat16* b1 = b + std::min(j + 1, r - 1) * bs;
    const __m512bh cv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[j / 2]));
#pragma GCC unroll 4
    for (int q = 0; q < CB; ++q) {
      const __m512i r0 = _mm512_loadu_si512(b0 + 32 * q), r1 = _mm512_loadu_si512(b1 + 32 * q);
      lo[q] = _mm512_dpbf16_ps(lo[q], (__m512bh)_mm512_unpacklo_epi16(r0, r1), cv);
      hi[q] = _mm512_dpbf16_ps(hi[q], (__m512bh)_mm512_unpackhi_epi16(r0, r1), cv);
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m256 sv = _mm256_set1_ps(scale);
  for (int q = 0; q < CB; ++q) {
    const __m512 c[2] = {_mm512_permutex2var_ps(lo[q], first, hi[q]), _mm512_permutex2var_ps(lo[q], second, hi[q])};
    at::BFloat16* p = o + 32 * q;
    for (int h = 0; h < 2; ++h) {
      const __m256 c_lo = _mm512_castps512_ps256(c[h]);
      const __m256 c_hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c[h]), 1));
      store8(p + 16 * h, _mm256_fmadd_ps(sv, c_lo, load8(p + 16 * h)));
      store8(p + 16 * h + 8, _mm256_fmadd_ps(sv, c_hi, load8(p + 16 * h + 8)));
    }
  }
}

// One shrink tile of `run_tokens_bf16`: the 8 rank rows from `at` (past r: row r - 1) against x, their sums into
// cf[0 .. 8) and as bfloat16 pairs into pr[0 .. 4) (a row past r a zero coefficient).
LF_BF16_TARGET void shrink_tile_bf16(const at::BFloat16* xr, const at::BFloat16* a_rows, int64_t as_rank, int64_t r,
                                     int64_t at, int64_t K, float* cf, uint32_t* pr) {
  const at::BFloat16* a[8];
  for (int64_t i = 0; i < 8; ++i) a[i] = a_rows + std::min(at + i, r - 1) * as_rank;
  __m512 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + k);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], xv, (__m512bh)_mm512_loadu_si512(a[i] + k));
  }
  _mm256_storeu_ps(cf, reduce8x16(acc));
  for (int64_t j = 0; j < 8; j += 2) {
    const uint32_t lo = at + j < r ? at::BFloat16(cf[j]).x : 0, hi = at + j + 1 < r ? at::BFloat16(cf[j + 1]).x : 0;
    pr[j / 2] = lo | (hi << 16);
  }
}

// One expand block of `run_tokens_bf16`: `width` columns (128, 32, or a slice's last few) of B's rank rows from `b`
// added, scaled, to `o`.
LF_BF16_TARGET void expand_block_bf16(const uint32_t* pr, const at::BFloat16* b, int64_t bs, int64_t r,
                                      int64_t width, float scale, at::BFloat16* o) {
  if (width == 128) {
    expand_pairs_bf16<4>(pr, b, bs, r, scale, o);
  } else if (width == 32) {
    expand_pairs_bf16<1>(pr, b, bs, r, scale, o);
  } else {
    for (int64_t c = 0; c < width; ++c) {
      float v = 0.f;
      for (int64_t j = 0; j < r; ++j) {  // the coefficient as the pairs hold it (rounded once, in the shrink)
        const uint32_t bits = (pr[j / 2] >> (16 * (j & 1))) << 16;
        float cj;
        std::memcpy(&cj, &bits, sizeof(cj));
        v += cj * to_float(b[j * bs + c]);
      }
      o[c] = static_cast<at::BFloat16>(static_cast<float>(o[c]) + scale * v);
    }
  }
}

// `run_tokens` in bfloat16 on a CPU with AVX512-BF16 (K a multiple of 32): the shrink in tiles of 8 rank rows, x read
// in place, 32 bfloat16 products an instruction; the shrunk activations rounded to bfloat16 (as PEFT's bfloat16
// lora_A output is) so that the expand runs on pairs of rank rows (`expand_pairs_bf16`), the scaling applied in
// float32 to the sums before they are added to the output row once. The rows come from memory (the base weights
// read between two calls evict them), so the call is split over ATen's threads, each requesting its own rows first:
// the shrink tiles of every segment and slice shared out, one barrier, then the expand's column blocks.
void run_tokens_bf16(const at::BFloat16* xp, int64_t xs, at::BFloat16* op, int64_t os,
                     const at::BFloat16* ap, int64_t as_slot, int64_t as_slice, int64_t as_rank,
                     const at::BFloat16* bp, int64_t bs_slot, int64_t bs_rank, const int32_t* rk,
                     int64_t rs_slot, const float* sc, int64_t ss_slot, const std::vector<int64_t>& offs,
                     const int32_t* rp, const std::vector<Seg>& segs, int64_t n_slices, int64_t K) {
  struct Part {
    int64_t seg, slice, r, at;  // `at`: the first of its 8 rank rows (a tile) or columns (a block of `width`)
    int64_t width;              // a block's columns: 128, 32 or the slice's last few (below 32)
    int64_t coef;               // where the (segment, slice)'s coefficients start in `coef` / `pairs`
  };
  // the calling thread's buffers, named through references: the threads of the region below share them
  thread_local std::vector<Part> tiles_tl, blocks_tl;
  thread_local std::vector<float> coef_tl;
  thread_local std::vector<uint32_t> pairs_tl;
  std::vector<Part>& tiles = tiles_tl;
  std::vector<Part>& blocks = blocks_tl;
  std::vector<float>& coef = coef_tl;
  std::vector<uint32_t>& pairs = pairs_tl;
  tiles.clear();
  blocks.clear();
  int64_t n_coef = 0;
  for (int64_t g = 0; g < static_cast<int64_t>(segs.size()); ++g) {
    if (segs[g].end == segs[g].start) continue;
    for (int64_t s = 0; s < n_slices; ++s) {
      const int64_t r = rk[segs[g].slot * rs_slot + s];
      if (r <= 0) continue;
      for (int64_t j = 0; j < r; j += 8) tiles.push_back({g, s, r, j, 0, n_coef});
      const int64_t nc = offs[s + 1] - offs[s];
      int64_t c = 0;
      for (; c + 128 <= nc; c += 128) blocks.push_back({g, s, r, c, 128, n_coef});
      for (; c + 32 <= nc; c += 32) blocks.push_back({g, s, r, c, 32, n_coef});
      if (c < nc) blocks.push_back({g, s, r, c, nc - c, n_coef});
      n_coef += (r + 7) / 8 * 8;
    }
  }
  if (tiles.empty()) return;
  coef.resize(static_cast<size_t>(n_coef));
  pairs.resize(static_cast<size_t>(n_coef / 2));
  const auto a_rows = [&](const Part& p) { return ap + segs[p.seg].slot * as_slot + p.slice * as_slice; };
  const auto b_cols = [&](const Part& p) { return bp + segs[p.seg].slot * bs_slot + offs[p.slice] + p.at; };
  const auto shrink = [&](const Part& p) {
    shrink_tile_bf16(xp + rp[segs[p.seg].start] * xs, a_rows(p), as_rank, p.r, p.at, K, coef.data() + p.coef + p.at,
                     pairs.data() + (p.coef + p.at) / 2);
  };
  const auto expand = [&](const Part& p) {
    expand_block_bf16(pairs.data() + p.coef / 2, b_cols(p), bs_rank, p.r, p.width,
                      sc[segs[p.seg].slot * ss_slot + p.slice], op + rp[segs[p.seg].start] * os + offs[p.slice] + p.at);
  };
  const int64_t n_tiles = static_cast<int64_t>(tiles.size()), n_blocks = static_cast<int64_t>(blocks.size());
  const int threads = at::in_parallel_region() ? 1 : static_cast<int>(std::min<int64_t>(at::get_num_threads(), n_tiles));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t t0 = n_tiles * t / n, t1 = n_tiles * (t + 1) / n, b0 = n_blocks * t / n, b1 = n_blocks * (t + 1) / n;
    for (int64_t i = t0; i < t1; ++i)
      prefetch_rows(a_rows(tiles[i]) + tiles[i].at * as_rank, as_rank, std::min<int64_t>(8, tiles[i].r - tiles[i].at), K);
    for (int64_t i = b0; i < b1; ++i) prefetch_rows(b_cols(blocks[i]), bs_rank, blocks[i].r, blocks[i].width);
    for (int64_t i = t0; i < t1; ++i) shrink(tiles[i]);
#pragma omp barrier
    for (int64_t i = b0; i < b1; ++i) expand(blocks[i]);
  }
}

#else
bool has_bf16_dot() { return false; }
#endif

template <typename T>
void run(const at::Tensor& x, at::Tensor& out, const at::Tensor& A, const at::Tensor& B,
         const at::Tensor& ranks, const at::Tensor& scalings, const std::vector<int64_t>& offs,
         const at::Tensor& rows, const std::vector<Seg>& segs) {
  const int64_t K = x.size(1), n_slices = A.size(1), R = A.size(2);
  const int64_t xs = x.stride(0), os = out.stride(0);
  const int64_t as_slot = A.stride(0), as_slice = A.stride(1), as_rank = A.stride(2);
  const int64_t bs_slot = B.stride(0), bs_row = B.stride(1), bs_rank = B.stride(2);
  const bool rank_major = bs_row == 1;  // B[slot] laid out [rank, out]
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* ap = A.data_ptr<T>();
  const T* bp = B.data_ptr<T>();
  const int32_t* rk = ranks.data_ptr<int32_t>();
  const float* sc = scalings.data_ptr<float>();
  const int32_t* rp = rows.data_ptr<int32_t>();
  const int64_t n_rows = rows.size(0);
  const int64_t rs_slot = ranks.stride(0), ss_slot = scalings.stride(0);

#ifdef LF_AVX2
  if (rank_major && K % 8 == 0 &&
      std::all_of(segs.begin(), segs.end(), [](const Seg& g) { return g.end - g.start <= 1; })) {
    int64_t work = 0;  // multiply-adds of the step: above ~4 x 64k the work-split passes below win
    for (const Seg& g : segs)
      for (int64_t s = 0; s < n_slices; ++s)
        work += (g.end - g.start) * std::max<int32_t>(rk[g.slot * rs_slot + s], 0) * (K + offs[s + 1] - offs[s]);
    if (work < (1 << 18)) {
#ifdef LF_BF16_DOT
      static const bool bf16_dot = has_bf16_dot();
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (bf16_dot && K % 32 == 0) {
          run_tokens_bf16(xp, xs, op, os, ap, as_slot, as_slice, as_rank, bp, bs_slot, bs_rank, rk, rs_slot, sc,
                          ss_slot, offs, rp, segs, n_slices, K);
          return;
        }
      }
#endif
      run_tokens<T>(xp, xs, op, os, ap, as_slot, as_slice, as_rank, bp, bs_slot, bs_rank, rk, rs_slot, sc, ss_slot,
                    offs, rp, segs, n_slices, K, R);
      return;
    }
  }
#endif
  // xa[p, s, j]: the shrunk activations of the p-th token of the segment list, slice s, rank row j
  std::vector<float> xa(static_cast<size_t>(std::max<int64_t>(n_rows, 1) * n_slices * R));
  struct Item {
    int64_t seg, slice, col, p0, p1;  // tokens [p0, p1) of segment seg
  };
  std::vector<Item> shrink, expand;
  int64_t shrink_work = 0, expand_work = 0;
  for (int64_t g = 0; g < (int64_t)segs.size(); ++g) {
    for (int64_t s = 0; s < n_slices; ++s) {
      const int64_t r = rk[segs[g].slot * rs_slot + s];
      if (r <= 0) continue;
      const int64_t len = segs[g].end - segs[g].start;
      for (int64_t p = segs[g].start; p < segs[g].end; p += PC) {
        const int64_t q = std::min(p + PC, segs[g].end);
        shrink.push_back({g, s, 0, p, q});
        for (int64_t c = offs[s]; c < offs[s + 1]; c += NC) expand.push_back({g, s, c, p, q});
      }
      shrink_work += r * K * len;
      expand_work += r * (offs[s + 1] - offs[s]) * len;
    }
  }
  if (shrink.empty()) return;
  static const bool bf16_dot = has_bf16_dot();
  // below ~64k multiply-adds a pass runs on the calling thread: waking the pool costs more than it saves
  const int64_t small = 1 << 16;

  at::parallel_for(0, (int64_t)shrink.size(), shrink_work < small ? (int64_t)shrink.size() : 1,
                   [&](int64_t begin, int64_t end) {
    std::vector<float> xbuf(TB * K);
    for (int64_t it = begin; it < end; ++it) {
      const Seg& sg = segs[shrink[it].seg];
      const int64_t s = shrink[it].slice, p1 = shrink[it].p1;
      const int64_t r = rk[sg.slot * rs_slot + s];
      const T* a_base = ap + sg.slot * as_slot + s * as_slice;
      for (int64_t p0 = shrink[it].p0; p0 < p1; p0 += TB) {
        const int64_t nt = std::min<int64_t>(TB, p1 - p0);
#ifdef LF_BF16_DOT
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          if (bf16_dot && nt > 2 && K % 32 == 0) {  // 4 tokens x 2 rank rows in bfloat16 pairs, x read in place
            const at::BFloat16* xb[TB];
            for (int64_t t = 0; t < TB; ++t) xb[t] = xp + (int64_t)rp[p0 + std::min(t, nt - 1)] * xs;
            for (int64_t j = 0; j < r; j += 2) {
              const at::BFloat16* a[2] = {a_base + j * as_rank, a_base + std::min(j + 1, r - 1) * as_rank};
              float sums[8];
              dot_tile_bf16(xb, a, K, sums);
              for (int64_t t = 0; t < nt; ++t)
                for (int64_t i = 0; i < std::min<int64_t>(2, r - j); ++i)
                  xa[((p0 + t) * n_slices + s) * R + j + i] = sums[t * 2 + i];
            }
            continue;
          }
        }
#endif
        const float* xr[TB];
        for (int64_t t = 0; t < TB; ++t)  // a short block repeats its last token (widened once)
          xr[t] = t < nt ? widen<T>(xp + (int64_t)rp[p0 + t] * xs, xbuf.data() + t * K, K) : xr[nt - 1];
#ifdef LF_AVX2
        if (K % 8 == 0) {  // register tiles: 4 tokens x 2 rank rows (a row past r repeats r - 1), or for an
                           // adapter's 1-2 decode rows 2 tokens x 1 row, which streams A once at the memory's speed
          const int64_t na = nt <= 2 ? 1 : 2;
          for (int64_t j = 0; j < r; j += na) {
            const T* a[2] = {a_base + j * as_rank, a_base + std::min(j + 1, r - 1) * as_rank};
            float sums[8];
            if (nt <= 2) dot_tile<T, 2, 1, 4>(xr, a, K, sums);
            else dot_tile<T, 4, 2, 1>(xr, a, K, sums);
            for (int64_t t = 0; t < nt; ++t)
              for (int64_t i = 0; i < std::min(na, r - j); ++i)
                xa[((p0 + t) * n_slices + s) * R + j + i] = sums[t * na + i];
          }
          continue;
        }
#endif
        const float *x0 = xr[0], *x1 = xr[1], *x2 = xr[2], *x3 = xr[3];
        for (int64_t j = 0; j < r; ++j) {
          const T* a = a_base + j * as_rank;  // read in place, widened in registers
          float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
          if (nt <= 2) {  // one or two tokens (an adapter's decode rows): half the products
#pragma omp simd reduction(+ : s0, s1)
            for (int64_t k = 0; k < K; ++k) {
              const float av = to_float(a[k]);
              s0 += x0[k] * av;
              s1 += x1[k] * av;
            }
          } else {
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t k = 0; k < K; ++k) {
              const float av = to_float(a[k]);
              s0 += x0[k] * av;
              s1 += x1[k] * av;
              s2 += x2[k] * av;
              s3 += x3[k] * av;
            }
          }
          const float sums[TB] = {s0, s1, s2, s3};
          for (int64_t t = 0; t < nt; ++t) xa[((p0 + t) * n_slices + s) * R + j] = sums[t];
        }
      }
    }
  });

  at::parallel_for(0, (int64_t)expand.size(), expand_work < small ? (int64_t)expand.size() : 1,
                   [&](int64_t begin, int64_t end) {
    std::vector<float> acc(TB * NC), coef(TB * R);
    for (int64_t it = begin; it < end; ++it) {
      const Seg& sg = segs[expand[it].seg];
      const int64_t s = expand[it].slice, c0 = expand[it].col;
      const int64_t nc = std::min<int64_t>(NC, offs[s + 1] - c0);
      const int64_t r = rk[sg.slot * rs_slot + s];
      const float scale = sc[sg.slot * ss_slot + s];
      const T* b_base = bp + sg.slot * bs_slot;
      const int64_t p1 = expand[it].p1;
      for (int64_t p0 = expand[it].p0; p0 < p1; p0 += TB) {
        const int64_t nt = std::min<int64_t>(TB, p1 - p0);
        for (int64_t t = 0; t < nt; ++t)
          for (int64_t j = 0; j < r; ++j) coef[t * R + j] = scale * xa[((p0 + t) * n_slices + s) * R + j];
        int64_t done = 0;  // columns added by the register tiles; the loops below take the rest
#ifdef LF_AVX2
        if (rank_major && nt > 2) {
          T* o[TB];
          for (int64_t t = 0; t < TB; ++t) o[t] = op + (int64_t)rp[p0 + std::min(t, nt - 1)] * os + c0;
          const T* b = b_base + c0;
          if (nt == 3) done = expand_tile<T, 3, 2>(coef.data(), R, b, bs_rank, r, o, nc);
          else done = expand_tile<T, 4, 2>(coef.data(), R, b, bs_rank, r, o, nc);
        }
#endif
        if (done == nc) continue;
        std::fill(acc.begin(), acc.begin() + nt * NC, 0.f);
        if (rank_major && nt == 2) {  // an adapter's two decode rows: each B row widened once for both
          float *a0 = acc.data(), *a1 = acc.data() + NC;
          for (int64_t j = 0; j < r; ++j) {
            const T* b = b_base + j * bs_rank + c0;
            const float cj0 = coef[j], cj1 = coef[R + j];
#pragma omp simd
            for (int64_t i = done; i < nc; ++i) {
              const float bv = to_float(b[i]);
              a0[i] += cj0 * bv;
              a1[i] += cj1 * bv;
            }
          }
        } else if (rank_major) {
          for (int64_t j = 0; j < r; ++j) {
            const T* b = b_base + j * bs_rank + c0;
            for (int64_t t = 0; t < nt; ++t) {
              const float cj = coef[t * R + j];
              float* at = acc.data() + t * NC;
#pragma omp simd
              for (int64_t i = done; i < nc; ++i) at[i] += cj * to_float(b[i]);
            }
          }
        } else {  // B[slot] laid out [out, rank]: one dot product of length r per column
          for (int64_t i = done; i < nc; ++i) {
            const T* b = b_base + (c0 + i) * bs_row;
            for (int64_t t = 0; t < nt; ++t) {
              const float* ct = coef.data() + t * R;
              float v = 0.f;
#pragma omp simd reduction(+ : v)
              for (int64_t j = 0; j < r; ++j) v += ct[j] * to_float(b[j]);
              acc[t * NC + i] = v;
            }
          }
        }
        for (int64_t t = 0; t < nt; ++t) {
          T* o = op + (int64_t)rp[p0 + t] * os + c0;
          const float* at = acc.data() + t * NC;
          int64_t i = done;
#ifdef LF_AVX2
          for (; i + 8 <= nc; i += 8) store8(o + i, _mm256_add_ps(load8(o + i), _mm256_loadu_ps(at + i)));
#endif
          for (; i < nc; ++i) o[i] = static_cast<T>(static_cast<float>(o[i]) + at[i]);
        }
      }
    }
  });
}

}  // namespace

// out[rows[p], slice s] += scalings[slot, s] * x[rows[p]] @ A[slot, s, :r].T @ B[slot, slice s, :r].T for every
// segment (slot, start, end) of `segs` ([S, 3] int64), every p in [start, end) and slice s with r = ranks[slot, s].
void lora_small(at::Tensor x, at::Tensor out, at::Tensor A, at::Tensor B, at::Tensor ranks, at::Tensor scalings,
                std::vector<int64_t> offs, at::Tensor rows, at::Tensor segs) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && A.dim() == 4 && B.dim() == 3, "bad shapes");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == A.scalar_type() &&
              x.scalar_type() == B.scalar_type(), "x, out, A and B must share one dtype");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && A.stride(3) == 1, "rows of x, out and A must be contiguous");
  TORCH_CHECK(B.stride(1) == 1 || B.stride(2) == 1, "B must be contiguous along out or rank");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && scalings.scalar_type() == at::kFloat && ranks.stride(1) == 1 &&
              scalings.stride(1) == 1, "ranks int32, scalings float32");
  TORCH_CHECK(rows.scalar_type() == at::kInt && rows.is_contiguous(), "rows: contiguous int32");
  TORCH_CHECK(segs.scalar_type() == at::kLong && segs.dim() == 2 && segs.size(1) == 3, "segs: int64 [S, 3]");
  TORCH_CHECK((int64_t)offs.size() == A.size(1) + 1 && A.size(3) == x.size(1) && offs.back() == out.size(1) &&
              B.size(1) == out.size(1) && B.size(2) == A.size(2), "shapes do not match");
  segs = segs.contiguous();
  std::vector<Seg> sv(segs.size(0));
  const int64_t* sp = segs.data_ptr<int64_t>();
  for (int64_t g = 0; g < segs.size(0); ++g) {
    sv[g] = {sp[3 * g], sp[3 * g + 1], sp[3 * g + 2]};
    TORCH_CHECK(sv[g].slot >= 0 && sv[g].slot < A.size(0) && 0 <= sv[g].start && sv[g].start <= sv[g].end &&
                sv[g].end <= rows.size(0), "segment out of range");
  }
  if (x.scalar_type() == at::kFloat) {
    run<float>(x, out, A, B, ranks, scalings, offs, rows, sv);
  } else if (x.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(x, out, A, B, ranks, scalings, offs, rows, sv);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16 only");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_small", torch::wrap_pybind_function(lora_small), "lora_small");
}
