// The CPU ops that one kernel calls from another (decode_stack.cpp, spare_core.cpp), declared
// once: each is defined in its own file and registered there as pdserve::<name> (blocked_for is
// not an op); a direct call skips the dispatcher and Python.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace pdserve_ops {

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
void rope_store_kv_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv,
                    const at::Tensor& pages, const at::Tensor& offs, int64_t nh, int64_t nkv);
// paged_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv,
                                  const at::Tensor& page_table, const at::Tensor& seq_lens,
                                  double scale, int64_t window = 0);
// bf16_linear.cpp
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n);
// whether `packed` is a weight [n, k] blocked by pack_bf16_linear: what bf16_linear checks
bool blocked_for(const at::Tensor& packed, int64_t k, int64_t n);
bool bf16_linear_supported();

}  // namespace pdserve_ops
