// The functions of the library lorafleet_cpu_ops (bound to Python in cpu_ops.cpp): decode attention
// (attention.cpp) and the small ops of a decoder layer (layer_ops.cpp).
#pragma once

#include <ATen/ATen.h>
#include <cstdint>
#include <tuple>

// Attention of one query per sequence (q [B, H, D]) over its KV blocks; window 0: no sliding window.
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor seq_lens, double scale, int64_t window);
// A decode-only step's attention from the qkv projection [T, (H + 2 KVH) D] in one call: per-head q/k RMSNorm,
// RoPE, k/v into the caches at slot_mapping, paged decode. Returns [T, H * D].
at::Tensor decode_attention(at::Tensor qkv, at::Tensor cos, at::Tensor sin, c10::optional<at::Tensor> q_norm,
                            c10::optional<at::Tensor> k_norm, double eps, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                            int64_t num_heads, double scale, int64_t window);
// RMSNorm of the rows of x [T, dim].
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
// h += delta in place, then returns rms_norm(h).
at::Tensor add_rms_norm_(at::Tensor h, at::Tensor delta, at::Tensor w, double eps);
// gate_up [T, 2I] -> silu(gate) * up [T, I].
at::Tensor silu_mul(at::Tensor gate_up);
// Rotate-half RoPE in place on x [T, heads, D] with tables cos/sin [T, D].
void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin);
// Each row's greedy token and its log-probability for float32 logits [N, V]; two empty tensors where a row is
// not finite.
std::tuple<at::Tensor, at::Tensor> greedy_pick(at::Tensor logits);
