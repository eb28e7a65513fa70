// Base-model linears in 16-wide weight panels (the library lorafleet_cpu_gemm; its Python side:
// lorafleet_worker/ops/cpu_gemm.py): pack_panels, panel_linear (float32, bfloat16 and int8 panels) and
// panel_linear_w8a8 (int8 panels times 8-bit activations on AVX512-VNNI), and the module that binds them.
//
// A micro-tile computes 16 outputs of up to 6 rows of x in twelve AVX2 registers, reading its panel front to back
// and broadcasting x (the 6 x 16 tile of BLIS and of llamafile's tinyBLAS): with one row of x the panels stream
// from memory once; with many rows, x is packed tile by tile and a 256-input slice of a panel stays in L1 while
// every tile of a 48-row block reads it. bfloat16 panels are widened in registers (a 16-bit shift), int8 panels
// converted and scaled per output channel at the end; sums are float32, the output is in x's dtype, a bias is
// added in the same pass. int8 panels times bfloat16 x of more than one tile's rows run in integers instead:
// each row of x rounded to int16 with its own scale, two k at a time through `vpmaddwd`, int32 sums per
// 256-input slice (`linear_i8_i16`). `panel_linear_w8a8` rounds those rows to int8 instead, one scale per 32
// inputs of a row as llama.cpp's Q8_0 does, and multiplies four k at once with `vpdpbusd` in 16-output zmm tiles.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

// Panel layout: a weight [N, K] becomes [ceil(N / 16), K, 16]: for each group of 16 output channels, the
// 16 weights of input k side by side, so a micro-tile reads one panel front to back and keeps 16 outputs of
// up to 6 rows of x in registers (the 6 x 16 AVX2 tile of BLIS / llamafile's tinyBLAS).
constexpr int64_t NR = 16;
constexpr int64_t MR = 6;
constexpr int64_t MB = 48;  // rows of x per block: the block's x stays in L2 while every panel passes it
constexpr int64_t KC = 256;  // inputs per slice: a slice of a panel stays in L1 while every tile of the block reads it

static inline float widen(float x) { return x; }
static inline float widen(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
static inline float widen(int8_t x) { return static_cast<float>(x); }

#if defined(__AVX2__) && defined(__FMA__)
static inline void load16(const float* p, __m256& a, __m256& b) { a = _mm256_loadu_ps(p); b = _mm256_loadu_ps(p + 8); }
static inline void load16(const at::BFloat16* p, __m256& a, __m256& b) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
  b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
}
// int8: each half widened straight from an 8-byte load (vpmovsxbd with a memory operand), not from a 16-byte
// register split by a shift: one shuffle fewer per 16 weights
static inline void load16(const int8_t* p, __m256& a, __m256& b) {
  a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
}

// c[i][0..16) (+)= sum_k xt[k, i] * panel[k, 0..16) for i < mr, k < kc; xt: the tile's rows of x packed [kc][mr].
// Twelve named accumulators (not an array, which GCC keeps on the stack): the 6 x 16 tile fills 15 of the
// 16 ymm registers.
#define LF_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
template <typename W, int mr>
static inline void tile(const float* xt, const W* panel, int64_t kc, float* c, bool first) {
#define LF_DECL(i) __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = _mm256_setzero_ps();
  LF_ROWS(LF_DECL)
#define LF_LOAD(i)                            \
  if constexpr (i < mr) if (!first) {         \
      a##i##0 = _mm256_loadu_ps(c + i * NR);     \
      a##i##1 = _mm256_loadu_ps(c + i * NR + 8); \
    }
  LF_ROWS(LF_LOAD)
  for (int64_t k = 0; k < kc; ++k) {
    __m256 w0, w1;
    load16(panel + k * NR, w0, w1);
#define LF_FMA(i)                                                   \
  if constexpr (i < mr) {                                           \
    const __m256 xv = _mm256_broadcast_ss(xt + k * mr + i);         \
    a##i##0 = _mm256_fmadd_ps(xv, w0, a##i##0);                     \
    a##i##1 = _mm256_fmadd_ps(xv, w1, a##i##1);                     \
  }
    LF_ROWS(LF_FMA)
  }
#define LF_STORE(i) \
  if constexpr (i < mr) { _mm256_storeu_ps(c + i * NR, a##i##0); _mm256_storeu_ps(c + i * NR + 8, a##i##1); }
  LF_ROWS(LF_STORE)
#undef LF_DECL
#undef LF_LOAD
#undef LF_FMA
#undef LF_STORE
}

// One row of x (a decode step of one sequence): `tile<W, 1>` has two accumulators, so every k waits for the
// previous k's FMA (4-5 cycles) and the kernel runs at the FMA latency, not at the memory's speed. Four
// accumulator pairs over consecutive k keep four chains in flight; they are summed at the end.
template <typename W>
inline void tile1(const float* x, const W* panel, int64_t kc, float* c, bool first) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
  int64_t k = 0;
  for (; k + 4 <= kc; k += 4) {
    __m256 w0, w1, v0, v1, u0, u1, t0, t1;
    load16(panel + k * NR, w0, w1);
    load16(panel + (k + 1) * NR, v0, v1);
    load16(panel + (k + 2) * NR, u0, u1);
    load16(panel + (k + 3) * NR, t0, t1);
    const __m256 x0 = _mm256_broadcast_ss(x + k), x1 = _mm256_broadcast_ss(x + k + 1);
    const __m256 x2 = _mm256_broadcast_ss(x + k + 2), x3 = _mm256_broadcast_ss(x + k + 3);
    a0 = _mm256_fmadd_ps(x0, w0, a0);
    a1 = _mm256_fmadd_ps(x0, w1, a1);
    b0 = _mm256_fmadd_ps(x1, v0, b0);
    b1 = _mm256_fmadd_ps(x1, v1, b1);
    c0 = _mm256_fmadd_ps(x2, u0, c0);
    c1 = _mm256_fmadd_ps(x2, u1, c1);
    d0 = _mm256_fmadd_ps(x3, t0, d0);
    d1 = _mm256_fmadd_ps(x3, t1, d1);
  }
  for (; k < kc; ++k) {
    __m256 w0, w1;
    load16(panel + k * NR, w0, w1);
    const __m256 xv = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(xv, w0, a0);
    a1 = _mm256_fmadd_ps(xv, w1, a1);
  }
  a0 = _mm256_add_ps(_mm256_add_ps(a0, b0), _mm256_add_ps(c0, d0));
  a1 = _mm256_add_ps(_mm256_add_ps(a1, b1), _mm256_add_ps(c1, d1));
  if (!first) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(c));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(c + 8));
  }
  _mm256_storeu_ps(c, a0);
  _mm256_storeu_ps(c + 8, a1);
}
// bfloat16 at one row: each 32-bit lane of a panel row holds two weights, so `& 0xffff0000` is the odd one
// and `<< 16` the even one as float32, two cheap ops for 16 weights where `load16` spends five (two of them
// lane-crossing). The accumulators hold even and odd outputs; they are put back in order once at the end.
template <>
inline void tile1<at::BFloat16>(const float* x, const at::BFloat16* panel, int64_t kc, float* c, bool first) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 e0 = _mm256_setzero_ps(), o0 = e0, e1 = e0, o1 = e0, e2 = e0, o2 = e0, e3 = e0, o3 = e0;
  int64_t k = 0;
#define LF_EO(w, e, o, xk)                                                                            \
  {                                                                                                   \
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));                      \
    const __m256 xv = _mm256_broadcast_ss(xk);                                                        \
    e = _mm256_fmadd_ps(xv, _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)), e);                     \
    o = _mm256_fmadd_ps(xv, _mm256_castsi256_ps(_mm256_and_si256(raw, hi)), o);                       \
  }
  for (; k + 4 <= kc; k += 4) {
    LF_EO(panel + k * NR, e0, o0, x + k)
    LF_EO(panel + (k + 1) * NR, e1, o1, x + k + 1)
    LF_EO(panel + (k + 2) * NR, e2, o2, x + k + 2)
    LF_EO(panel + (k + 3) * NR, e3, o3, x + k + 3)
  }
  for (; k < kc; ++k) LF_EO(panel + k * NR, e0, o0, x + k)
#undef LF_EO
  const __m256 even = _mm256_add_ps(_mm256_add_ps(e0, e1), _mm256_add_ps(e2, e3));  // outputs 0, 2, ..., 14
  const __m256 odd = _mm256_add_ps(_mm256_add_ps(o0, o1), _mm256_add_ps(o2, o3));   // outputs 1, 3, ..., 15
  const __m256 lo = _mm256_unpacklo_ps(even, odd);  // outputs 0-3 | 8-11
  const __m256 up = _mm256_unpackhi_ps(even, odd);  // outputs 4-7 | 12-15
  __m256 a0 = _mm256_permute2f128_ps(lo, up, 0x20), a1 = _mm256_permute2f128_ps(lo, up, 0x31);
  if (!first) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(c));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(c + 8));
  }
  _mm256_storeu_ps(c, a0);
  _mm256_storeu_ps(c + 8, a1);
}
#define LF_TILE1(W, xt, panel, kc, c, first) tile1<W>(xt, panel, kc, c, first)

// int8 weights times int16 rows (`linear_i8_i16`): `vpmaddwd` multiplies two k at once, 16 products and 8
// pair sums an instruction, where the float tile spends one FMA per 8 products. w: a slice widened to int16
// pairs [kc2][16 outputs][2 k]; xt: the tile's rows as int16 pairs [kc2][mr] (one int32 each); xs: each row's
// scale. A slice is at most KC = 256 inputs, 128 pairs: |sum| <= 128 * 2 * 32767 * 127 < 2^31, so the int32
// sums cannot overflow; they are widened and scaled into c once a slice.
template <int mr>
static inline void tile_i16(const int32_t* xt, const int16_t* w, int64_t kc2, const float* xs, float* c, bool first) {
#define LF_IDECL(i) __m256i a##i##0 = _mm256_setzero_si256(), a##i##1 = _mm256_setzero_si256();
  LF_ROWS(LF_IDECL)
  for (int64_t k = 0; k < kc2; ++k) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 2 * NR));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 2 * NR + NR));
#define LF_IMADD(i)                                                    \
  if constexpr (i < mr) {                                              \
    const __m256i xv = _mm256_set1_epi32(xt[k * mr + i]);              \
    a##i##0 = _mm256_add_epi32(a##i##0, _mm256_madd_epi16(xv, w0));   \
    a##i##1 = _mm256_add_epi32(a##i##1, _mm256_madd_epi16(xv, w1));   \
  }
    LF_ROWS(LF_IMADD)
  }
#define LF_ISTORE(i)                                                                              \
  if constexpr (i < mr) {                                                                         \
    const __m256 s = _mm256_set1_ps(xs[i]);                                                       \
    __m256 f0 = _mm256_mul_ps(_mm256_cvtepi32_ps(a##i##0), s);                                    \
    __m256 f1 = _mm256_mul_ps(_mm256_cvtepi32_ps(a##i##1), s);                                    \
    if (!first) {                                                                                 \
      f0 = _mm256_add_ps(f0, _mm256_loadu_ps(c + i * NR));                                        \
      f1 = _mm256_add_ps(f1, _mm256_loadu_ps(c + i * NR + 8));                                    \
    }                                                                                             \
    _mm256_storeu_ps(c + i * NR, f0);                                                             \
    _mm256_storeu_ps(c + i * NR + 8, f1);                                                         \
  }
  LF_ROWS(LF_ISTORE)
#undef LF_IDECL
#undef LF_IMADD
#undef LF_ISTORE
}

static void tile_i16_any(int mr, const int32_t* xt, const int16_t* w, int64_t kc2, const float* xs, float* c,
                         bool first) {
  switch (mr) {
    case 1: tile_i16<1>(xt, w, kc2, xs, c, first); break;
    case 2: tile_i16<2>(xt, w, kc2, xs, c, first); break;
    case 3: tile_i16<3>(xt, w, kc2, xs, c, first); break;
    case 4: tile_i16<4>(xt, w, kc2, xs, c, first); break;
    case 5: tile_i16<5>(xt, w, kc2, xs, c, first); break;
    default: tile_i16<6>(xt, w, kc2, xs, c, first); break;
  }
}

// A KC slice of an int8 panel [kc][16] as int16 pairs [kc2][16][2]: rows k and k + 1 interleaved byte by byte,
// then sign-extended (an odd last k is paired with zeros).
static void widen_pairs(const int8_t* slice, int64_t kc, int16_t* out) {
  const __m128i zero = _mm_setzero_si128();
  for (int64_t k = 0; k < kc; k += 2) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(slice + k * NR));
    const __m128i b = k + 1 < kc ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(slice + (k + 1) * NR)) : zero;
    int16_t* dst = out + k * NR;  // pair k / 2 starts at (k / 2) * 32
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + NR), _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b)));
  }
}
#define LF_HAS_I16 1
#else
template <typename W, int mr>
static inline void tile(const float* xt, const W* panel, int64_t kc, float* c, bool first) {
  float acc[mr][NR];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = first ? 0.0f : c[i * NR + j];
  for (int64_t k = 0; k < kc; ++k) {
    const W* w = panel + k * NR;
    for (int i = 0; i < mr; ++i) {
      const float xv = xt[k * mr + i];
#pragma omp simd
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * widen(w[j]);
    }
  }
  for (int i = 0; i < mr; ++i) std::memcpy(c + i * NR, acc[i], sizeof(acc[i]));
}
#define LF_TILE1(W, xt, panel, kc, c, first) tile<W, 1>(xt, panel, kc, c, first)
#endif

template <typename W>
static void tile_any(int mr, const float* xt, const W* panel, int64_t kc, float* c, bool first) {
  switch (mr) {
    case 1: LF_TILE1(W, xt, panel, kc, c, first); break;
    case 2: tile<W, 2>(xt, panel, kc, c, first); break;
    case 3: tile<W, 3>(xt, panel, kc, c, first); break;
    case 4: tile<W, 4>(xt, panel, kc, c, first); break;
    case 5: tile<W, 5>(xt, panel, kc, c, first); break;
    default: tile<W, 6>(xt, panel, kc, c, first); break;
  }
}

// A block of mb rows in tiles of at most MR rows, as even as possible (32 rows: 6 6 5 5 5 5): tile t holds rows
// [rows[t], rows[t + 1]); returns the number of tiles.
static int64_t tile_rows(int64_t mb, int64_t* rows) {
  const int64_t tiles = (mb + MR - 1) / MR;
  for (int64_t t = 0; t <= tiles; ++t) rows[t] = t * mb / tiles;
  return tiles;
}

// A panel's sums c [mb][16] into out's rows m0.. and columns n0..: times the per-channel scales, plus the bias.
template <typename O>
static void store_panel(const float* c, int64_t mb, O* op, int64_t m0, int64_t N, int64_t n0, const float* scales,
                        const float* bias) {
  const int64_t nw = std::min(NR, N - n0);
  for (int64_t i = 0; i < mb; ++i) {
    O* row = op + (m0 + i) * N + n0;
    const float* ci = c + i * NR;
    for (int64_t j = 0; j < nw; ++j) {
      float v = ci[j];
      if (scales) v *= scales[n0 + j];
      if (bias) v += bias[n0 + j];
      row[j] = static_cast<O>(v);
    }
  }
}

template <typename W, typename O>
static void linear_impl(const at::Tensor& x, const at::Tensor& panels, const float* scales, const float* bias,
                        at::Tensor& out, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  const O* xp = reinterpret_cast<const O*>(x.data_ptr());  // x is in the output's dtype, widened while packed
  const W* wp = reinterpret_cast<const W*>(panels.data_ptr());
  O* op = reinterpret_cast<O*>(out.data_ptr());
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(1, P / (threads * 4));
  std::vector<float> xpack(std::min(MB, M) * K);
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t mb = std::min(MB, M - m0);
    // x's block in tiles, each packed [K][mr] (k-major) so that a tile's broadcasts read one stream
    int64_t rows[MB / MR + 2];
    const int64_t tiles = tile_rows(mb, rows);
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t mr = rows[t + 1] - rows[t];
      float* dst = xpack.data() + rows[t] * K;
      for (int64_t i = 0; i < mr; ++i) {
        const O* src = xp + (m0 + rows[t] + i) * K;
        for (int64_t k = 0; k < K; ++k) dst[k * mr + i] = widen(src[k]);
      }
    }
    at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
      float c[MB * NR];
      float wide[KC * NR];
      for (int64_t p = p0; p < p1; ++p) {
        const W* panel = wp + p * K * NR;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {  // a KC slice of the panel stays in L1 for every tile
          const int64_t kc = std::min(KC, K - k0);
          const W* slice = panel + k0 * NR;
          if (!std::is_same<W, float>::value && mb > MR) {  // several tiles: widen the slice once, not per tile
            for (int64_t e = 0; e < kc * NR; ++e) wide[e] = widen(slice[e]);
            for (int64_t t = 0; t < tiles; ++t)
              tile_any<float>(rows[t + 1] - rows[t], xpack.data() + rows[t] * K + k0 * (rows[t + 1] - rows[t]),
                              wide, kc, c + rows[t] * NR, k0 == 0);
          } else {
            for (int64_t t = 0; t < tiles; ++t)
              tile_any<W>(rows[t + 1] - rows[t], xpack.data() + rows[t] * K + k0 * (rows[t + 1] - rows[t]), slice,
                          kc, c + rows[t] * NR, k0 == 0);
          }
        }
        store_panel(c, mb, op, m0, N, p * NR, scales, bias);
      }
    });
  }
}

#ifdef LF_HAS_I16
// int8 panels times bfloat16 x with more rows than one tile (prefill, batched decode: compute-bound): each row of
// x rounded to int16 with its own scale max|x| / 32767, products summed in int32 by `tile_i16`. That rounding
// (at most 1 / 65534 of the row's largest value) is far below the bfloat16 output's own, so only bfloat16 x takes
// this path; float32 x keeps float sums (`linear_impl`).
static void linear_i8_i16(const at::Tensor& x, const at::Tensor& panels, const float* scales, const float* bias,
                          at::Tensor& out, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), K2 = (K + 1) / 2;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const int8_t* wp = panels.data_ptr<int8_t>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(1, P / (threads * 4));
  std::vector<int32_t> xpack(std::min(MB, M) * K2);
  float xs[MB];
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t mb = std::min(MB, M - m0);
    int64_t rows[MB / MR + 2];
    const int64_t tiles = tile_rows(mb, rows);
    for (int64_t t = 0; t < tiles; ++t) {  // each tile packed [K2][mr] as int16 pairs (k, k + 1)
      const int64_t mr = rows[t + 1] - rows[t];
      int32_t* dst = xpack.data() + rows[t] * K2;
      for (int64_t i = 0; i < mr; ++i) {
        const at::BFloat16* src = xp + (m0 + rows[t] + i) * K;
        float amax = 0.0f;
        for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(widen(src[k])));
        const float scale = amax > 0.0f ? amax / 32767.0f : 1.0f, inv = 1.0f / scale;
        xs[rows[t] + i] = scale;
        for (int64_t k2 = 0; k2 < K2; ++k2) {
          const int64_t k = 2 * k2;
          const auto lo = static_cast<int16_t>(std::nearbyint(widen(src[k]) * inv));
          const auto hi = k + 1 < K ? static_cast<int16_t>(std::nearbyint(widen(src[k + 1]) * inv)) : int16_t{0};
          const uint32_t pair = static_cast<uint16_t>(lo) | static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16;
          dst[k2 * mr + i] = static_cast<int32_t>(pair);  // k in the low half: vpmaddwd pairs it with w[k]
        }
      }
    }
    at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
      float c[MB * NR];
      alignas(32) int16_t wide[KC * NR];
      for (int64_t p = p0; p < p1; ++p) {
        const int8_t* panel = wp + p * K * NR;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {  // KC is even: a slice starts on a pair
          const int64_t kc = std::min(KC, K - k0), kc2 = (kc + 1) / 2;
          widen_pairs(panel + k0 * NR, kc, wide);
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t mr = rows[t + 1] - rows[t];
            tile_i16_any(static_cast<int>(mr), xpack.data() + rows[t] * K2 + (k0 / 2) * mr, wide, kc2,
                         xs + rows[t], c + rows[t] * NR, k0 == 0);
          }
        }
        store_panel(c, mb, op, m0, N, p * NR, scales, bias);
      }
    });
  }
}
#endif

#if defined(LF_HAS_I16) && defined(__GNUC__)
// Compiled for AVX512-VNNI function by function (`LF_VNNI`) into every x86 build, the prebuilt x86-64-v3 / v4
// libraries of the worker image included, and taken only where the CPU has it (`has_w8a8`).
#define LF_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
// int8 panels times 8-bit rows (`linear_w8a8`, `--quantization w8a8_int8`): `vpdpbusd` multiplies four k at
// once, 32 products and their sums into 8 int32 lanes an instruction (twice `vpmaddwd`'s products, and no add).
// It takes unsigned bytes times signed ones, so the weights are offset by 128 (`quad_slice`, once a slice) and the
// offset's share, 128 * sum(q), is taken off once a row; each row of x is rounded to int8 per QB = 32 inputs with
// its own scale max|x| / 127 (llama.cpp's Q8_0 activation blocks), so the int32 sums of a block are scaled into
// float32 sums every 8 quads. |block sum| <= 32 * 255 * 127 < 2^31.
#define LF_HAS_Q8 1
constexpr int64_t QB = 32;  // inputs per activation scale

// A KC slice of an int8 panel [kc][16] as unsigned quads [kc4][16][4]: k..k+3 of one output in one 32-bit lane,
// each weight + 128; a k past kc pads with weight 0 (its x is 0 too).
LF_VNNI static void quad_slice(const int8_t* slice, int64_t kc, uint8_t* out) {
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80)), zero = _mm_setzero_si128();
  for (int64_t k = 0; k < kc; k += 4) {
    __m128i r[4];
    for (int64_t j = 0; j < 4; ++j)
      r[j] = k + j < kc ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(slice + (k + j) * NR)) : zero;
    const __m128i ab0 = _mm_unpacklo_epi8(r[0], r[1]), ab1 = _mm_unpackhi_epi8(r[0], r[1]);
    const __m128i cd0 = _mm_unpacklo_epi8(r[2], r[3]), cd1 = _mm_unpackhi_epi8(r[2], r[3]);
    __m128i* dst = reinterpret_cast<__m128i*>(out + k * NR);  // quad k / 4 starts at (k / 4) * 64
    _mm_storeu_si128(dst, _mm_xor_si128(_mm_unpacklo_epi16(ab0, cd0), flip));      // outputs 0-3
    _mm_storeu_si128(dst + 1, _mm_xor_si128(_mm_unpackhi_epi16(ab0, cd0), flip));  // 4-7
    _mm_storeu_si128(dst + 2, _mm_xor_si128(_mm_unpacklo_epi16(ab1, cd1), flip));  // 8-11
    _mm_storeu_si128(dst + 3, _mm_xor_si128(_mm_unpackhi_epi16(ab1, cd1), flip));  // 12-15
  }
}

// c[i][0..16) (+)= sum over the slice's blocks of xs[b][i] * (int32 sum of the block); first: starting from -r[i]
// (the offset's share). xt: the tile's rows as quads [kc4][mr]; w: `quad_slice`'s [kc4][16][4]; xs: [nb][mr].
template <int mr>
LF_VNNI static inline void tile_q8(const int32_t* xt, const uint8_t* w, int64_t kc4, const float* xs, const float* r,
                           float* c, bool first) {
#define LF_QDECL(i) __m512 f##i;
  LF_ROWS(LF_QDECL)
#define LF_QINIT(i) \
  if constexpr (i < mr) f##i = first ? _mm512_set1_ps(-r[i]) : _mm512_loadu_ps(c + i * NR);
  LF_ROWS(LF_QINIT)
  for (int64_t q0 = 0, b = 0; q0 < kc4; q0 += QB / 4, ++b) {
    const int64_t q1 = std::min(kc4, q0 + QB / 4);
#define LF_QZERO(i) __m512i a##i = _mm512_setzero_si512();
    LF_ROWS(LF_QZERO)
    for (int64_t q = q0; q < q1; ++q) {
      const __m512i w0 = _mm512_loadu_si512(w + q * 4 * NR);
#define LF_QDOT(i) \
  if constexpr (i < mr) a##i = _mm512_dpbusd_epi32(a##i, w0, _mm512_set1_epi32(xt[q * mr + i]));
      LF_ROWS(LF_QDOT)
    }
#define LF_QSCALE(i) \
  if constexpr (i < mr) f##i = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##i), _mm512_set1_ps(xs[b * mr + i]), f##i);
    LF_ROWS(LF_QSCALE)
  }
#define LF_QSTORE(i) \
  if constexpr (i < mr) _mm512_storeu_ps(c + i * NR, f##i);
  LF_ROWS(LF_QSTORE)
#undef LF_QDECL
#undef LF_QINIT
#undef LF_QZERO
#undef LF_QDOT
#undef LF_QSCALE
#undef LF_QSTORE
}

LF_VNNI static void tile_q8_any(int mr, const int32_t* xt, const uint8_t* w, int64_t kc4, const float* xs,
                                const float* r, float* c, bool first) {
  switch (mr) {
    case 1: tile_q8<1>(xt, w, kc4, xs, r, c, first); break;
    case 2: tile_q8<2>(xt, w, kc4, xs, r, c, first); break;
    case 3: tile_q8<3>(xt, w, kc4, xs, r, c, first); break;
    case 4: tile_q8<4>(xt, w, kc4, xs, r, c, first); break;
    case 5: tile_q8<5>(xt, w, kc4, xs, r, c, first); break;
    default: tile_q8<6>(xt, w, kc4, xs, r, c, first); break;
  }
}

// 32 values of a row as float32
LF_VNNI static inline __m512 load_block(const float* p, int64_t k) { return _mm512_loadu_ps(p + k); }
LF_VNNI static inline __m512 load_block(const at::BFloat16* p, int64_t k) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
constexpr int64_t KQ = 32768;  // the most inputs a row may have on this path (a row buffer on the stack)

// One row of x rounded to int8 per QB inputs (round to nearest even, as `nearbyint`), zero past K: into
// `out` [ceil(K / QB) * QB], each block's scale max|x| / 127 at xs[b * stride]. Returns the weights' offset
// share of the row, 128 * sum over blocks of scale * sum(q).
template <typename O>
LF_VNNI static float quantize_row(const O* src, int64_t K, int8_t* out, float* xs, int64_t stride) {
  double share = 0.0;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t k0 = 0, b = 0; k0 < K; k0 += QB, ++b) {
    const int64_t n = std::min(QB, K - k0);
    __m512 v0, v1;
    if (n == QB) {
      v0 = load_block(src, k0);
      v1 = load_block(src, k0 + 16);
    } else {  // a short last block, through a zero-padded copy
      alignas(64) float tail[QB] = {};
      for (int64_t k = 0; k < n; ++k) tail[k] = widen(src[k0 + k]);
      v0 = _mm512_load_ps(tail);
      v1 = _mm512_load_ps(tail + 16);
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k0), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k0 + 16), _mm512_cvtsepi32_epi8(q1));
    xs[b * stride] = amax / 127.0f;
    share += 128.0 * (amax / 127.0f) * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
  return static_cast<float>(share);
}

// int8 panels times x (float32 or bfloat16) with more rows than one tile, x rounded to int8 per QB inputs of a row.
template <typename O>
static void linear_w8a8(const at::Tensor& x, const at::Tensor& panels, const float* scales, const float* bias,
                        at::Tensor& out, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), K4 = (K + 3) / 4, NB = (K + QB - 1) / QB;
  const O* xp = reinterpret_cast<const O*>(x.data_ptr());
  const int8_t* wp = panels.data_ptr<int8_t>();
  O* op = reinterpret_cast<O*>(out.data_ptr());
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(1, P / (threads * 4));
  std::vector<int32_t> xq(std::min(MB, M) * K4);
  std::vector<float> xs(std::min(MB, M) * NB);
  TORCH_CHECK(K <= KQ, "w8a8: at most ", KQ, " inputs");
  float offset[MB];
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t mb = std::min(MB, M - m0);
    int64_t rows[MB / MR + 2];
    const int64_t tiles = tile_rows(mb, rows);
    int64_t tile_of[MB];
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t r = rows[t]; r < rows[t + 1]; ++r) tile_of[r] = t;
    at::parallel_for(0, mb, 4, [&](int64_t r0, int64_t r1) {  // each tile: quads [K4][mr], scales [NB][mr]
      alignas(64) int8_t row[KQ];
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t t = tile_of[r], mr = rows[t + 1] - rows[t], i = r - rows[t];
        offset[r] = quantize_row(xp + (m0 + r) * K, K, row, xs.data() + rows[t] * NB + i, mr);
        int32_t* dq = xq.data() + rows[t] * K4 + i;
        for (int64_t q = 0; q < K4; ++q) std::memcpy(dq + q * mr, row + 4 * q, 4);
      }
    });
    at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
      float c[MB * NR];
      alignas(32) uint8_t quads[KC * NR];
      for (int64_t p = p0; p < p1; ++p) {
        const int8_t* panel = wp + p * K * NR;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {  // KC is a multiple of QB: a slice starts on a block
          const int64_t kc = std::min(KC, K - k0), kc4 = (kc + 3) / 4;
          quad_slice(panel + k0 * NR, kc, quads);
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t mr = rows[t + 1] - rows[t];
            tile_q8_any(static_cast<int>(mr), xq.data() + rows[t] * K4 + (k0 / 4) * mr, quads, kc4,
                        xs.data() + rows[t] * NB + (k0 / QB) * mr, offset + rows[t], c + rows[t] * NR, k0 == 0);
          }
        }
        store_panel(c, mb, op, m0, N, p * NR, scales, bias);
      }
    });
  }
}
#endif

// w [N, K] -> [ceil(N / 16), K, 16], zero padded (same dtype)
at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "pack_panels: a 2-D weight");
  const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
  auto src = w.contiguous();
  auto padded = at::zeros({P * NR, K}, w.options());
  padded.narrow(0, 0, N).copy_(src);
  return padded.view({P, NR, K}).transpose(1, 2).contiguous();
}

// x [M, K] (float32 or bfloat16) @ W.T (+ bias) with W in panels (float32, bfloat16 or int8 with per-output
// float32 scales); out in x's dtype.
bool has_w8a8() {
#ifdef LF_HAS_Q8
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

// `w8a8`: int8 panels times more than one tile of rows take `linear_w8a8` where the CPU has AVX512-VNNI.
static at::Tensor linear_any(const at::Tensor& x_in, const at::Tensor& panels, int64_t N,
                             const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias,
                             bool w8a8) {
  TORCH_CHECK(x_in.dim() == 2 && panels.dim() == 3 && panels.size(2) == NR,
              "panel_linear: x [M, K], panels [P, K, 16]");
  TORCH_CHECK(x_in.size(1) == panels.size(1), "panel_linear: K differs");
  TORCH_CHECK(panels.is_contiguous(), "panel_linear: contiguous panels");
  // Tensors only from here on: let the server's event loop (HTTP, detokenizing) run meanwhile.
  pybind11::gil_scoped_release no_gil;
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "panel_linear: float32 or bfloat16 x");
  const at::Tensor x = x_in.contiguous();  // no copy (and no dispatch) when it already is
  at::Tensor s, b;  // float32 copies only where scales / bias are not float32 and contiguous already
  const float* sp = nullptr;
  const float* bp = nullptr;
  if (scales) {
    s = scales->scalar_type() == at::kFloat ? scales->contiguous() : scales->to(at::kFloat).contiguous();
    sp = s.data_ptr<float>();
  }
  if (bias) {
    b = bias->scalar_type() == at::kFloat ? bias->contiguous() : bias->to(at::kFloat).contiguous();
    bp = b.data_ptr<float>();
  }
  auto out = at::empty({x.size(0), N}, x_in.options());
  const bool bf16_out = x_in.scalar_type() == at::kBFloat16;
  switch (panels.scalar_type()) {
    case at::kFloat:
      if (bf16_out) linear_impl<float, at::BFloat16>(x, panels, sp, bp, out, N);
      else linear_impl<float, float>(x, panels, sp, bp, out, N);
      break;
    case at::kBFloat16:
      if (bf16_out) linear_impl<at::BFloat16, at::BFloat16>(x, panels, sp, bp, out, N);
      else linear_impl<at::BFloat16, float>(x, panels, sp, bp, out, N);
      break;
    case at::kChar:
      TORCH_CHECK(sp != nullptr, "panel_linear: int8 panels need scales");
#ifdef LF_HAS_Q8
      static const bool vnni = has_w8a8();
      if (w8a8 && vnni && x.size(0) > MR) {
        if (bf16_out) linear_w8a8<at::BFloat16>(x, panels, sp, bp, out, N);
        else linear_w8a8<float>(x, panels, sp, bp, out, N);
        break;
      }
#endif
#ifdef LF_HAS_I16
      if (bf16_out && x.size(0) > MR) {
        linear_i8_i16(x, panels, sp, bp, out, N);
        break;
      }
#endif
      if (bf16_out) linear_impl<int8_t, at::BFloat16>(x, panels, sp, bp, out, N);
      else linear_impl<int8_t, float>(x, panels, sp, bp, out, N);
      break;
    default:
      TORCH_CHECK(false, "panel_linear: float32, bfloat16 or int8 panels");
  }
  return out;
}
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                        const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias) {
  return linear_any(x, panels, N, scales, bias, false);
}

// `panel_linear` where int8 panels times more than one tile of rows (compute-bound) round x to int8 per 32 inputs
// and the CPU has AVX512-VNNI (`--quantization w8a8_int8`); otherwise the same as `panel_linear`.
at::Tensor panel_linear_w8a8(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                             const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias) {
  return linear_any(x, panels, N, scales, bias, true);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_panels", torch::wrap_pybind_function(pack_panels), "pack_panels");
  m.def("panel_linear", torch::wrap_pybind_function(panel_linear), "panel_linear");
  m.def("panel_linear_w8a8", torch::wrap_pybind_function(panel_linear_w8a8), "panel_linear_w8a8");
  m.def("has_w8a8", torch::wrap_pybind_function(has_w8a8), "has_w8a8");
}
