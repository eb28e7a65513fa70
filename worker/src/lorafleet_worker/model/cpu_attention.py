"""Paged decode attention for CPU: one C++ loop that reads each sequence's K/V blocks in place.

The torch decode path (`attention._torch_decode`) gathers every sequence's blocks into a padded
[B, max_blocks * block_size, KVH, D] copy on every layer of every decode step and then runs masked SDPA:
at concurrency 32 the copy alone was a quarter of decode attention. This kernel walks the block table
instead: for each sequence it reads each token's key row (all KV heads, contiguous in the block) once,
scores every query head against its KV head's slice (GQA without copying K/V), takes the softmax and
accumulates the value rows the same way, so a sequence's blocks are read front to back. Work is split
over sequences with ATen's thread pool; float32 and bfloat16 caches (bf16 rows are widened to float32,
the sums are float32).

It is compiled at first use with `torch.utils.cpp_extension.load_inline` (g++ and ninja, about a
minute once; the build is cached under `$TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`).
Where it cannot be built, `available()` is False, the reason is logged once, and the engine keeps the
torch path. `LORAFLEET_CPU_ATTENTION=torch` turns it off.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from torch import Tensor

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

template <typename T>
static inline const float* as_float(const T* src, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}

template <>
inline const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}

// One work item per sequence: each token's K (then V) row of all KV heads is contiguous in its block
// ([block, offset, KVH, D]), so a sequence's blocks are read front to back, each byte once.
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
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), row(row_len), scores, denom(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lp[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.resize(H * n);
      const T* qb = qp + b * H * D;
      for (int64_t j = 0; j < H * D; ++j) qf[j] = static_cast<float>(qb[j]) * fscale;
      const int32_t* table = btp + b * maxb;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const T* kr = kp + (static_cast<int64_t>(table[pos / bs]) * bs + pos % bs) * row_len;
        const float* rf = as_float<T>(kr, row.data(), row_len);
        for (int64_t hh = 0; hh < H; ++hh) {  // query head hh reads KV head hh / G
          const float* qh = qf.data() + hh * D;
          const float* kh = rf + (hh / G) * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
          scores[hh * n + t] = s;
        }
      }
      for (int64_t hh = 0; hh < H; ++hh) {
        float* sh = scores.data() + hh * n;
        float m = -INFINITY;
        for (int64_t t = 0; t < n; ++t) m = std::max(m, sh[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          sh[t] = std::exp(sh[t] - m);
          sum += sh[t];
        }
        denom[hh] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const T* vr = vp + (static_cast<int64_t>(table[pos / bs]) * bs + pos % bs) * row_len;
        const float* rf = as_float<T>(vr, row.data(), row_len);
        for (int64_t hh = 0; hh < H; ++hh) {
          const float p = scores[hh * n + t];
          const float* vh = rf + (hh / G) * D;
          float* ah = acc.data() + hh * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ah[d] += p * vh[d];
        }
      }
      T* ob = op + b * H * D;
      for (int64_t hh = 0; hh < H; ++hh) {
        const float inv = 1.f / denom[hh];
        for (int64_t d = 0; d < D; ++d) ob[hh * D + d] = static_cast<T>(acc[hh * D + d] * inv);
      }
    }
  });
}

at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "head shapes");
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
"""


@functools.cache
def _module() -> Any | None:
    if os.environ.get("LORAFLEET_CPU_ATTENTION", "").lower() == "torch":
        log.info("CPU paged decode attention: the torch path (LORAFLEET_CPU_ATTENTION=torch)")
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            name="lorafleet_cpu_attention_v2",
            cpp_sources=[_SOURCE],
            functions=["paged_decode"],
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch path still works
        log.warning("CPU paged decode attention not built (%s); decode attention gathers K/V with torch", exc)
        return None


def available() -> bool:
    """True when the kernel is built (or could be built now) on this machine."""
    return _module() is not None


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int | None,
) -> Tensor:
    """Attention of one query per sequence (q [B, H, D]) over its blocks; `window`: sliding window or None."""
    mod = _module()
    assert mod is not None, "check available() first"
    out: Tensor = mod.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, float(scale), int(window or 0))
    return out


__all__ = ["available", "paged_decode"]
