// Scalar math written so that the loops calling it vectorize (shared by the CPU kernels).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pdserve_vec {

// exp(x) for fp32 x, clamped to [-87, 88] (where exp stays a normal float). Written out (range
// reduction to [-ln2/2, ln2/2], degree-6 polynomial, scale by 2^n) so that the compiler
// vectorizes the loop that calls it; glibc's expf is a call per element. Relative error under
// 2e-7 (about 1.5 ulp).
inline float exp_f32(float x) {
  // NaN (from inf inputs) -> -87 too: no NaN-to-int cast below
  x = x > -87.0f ? (x < 88.0f ? x : 88.0f) : -87.0f;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  // x - n * ln2 in two steps, the exact one first: n times ln2's leading 15 bits is exact and so
  // is its difference from x; the rest of ln2 is then a small correction
  const float r = std::fma(n, -1.428606765330187e-06f, std::fma(n, -0.693145751953125f, x));
  float p = 1.0f / 720.0f;
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const int e = static_cast<int>(n) + 127;
  union { int i; float f; } s;
  s.i = e << 23;
  return p * s.f;
}

// bf16 <-> fp32 on the raw bits, written so that the loops calling them vectorize: c10's
// conversions went element by element (in bf16, SiLU * up was a third of a prefill on an AMX core,
// measured). fp32 -> bf16 rounds to nearest even and makes any NaN 0x7FC0: the bits c10 gives.
inline float bf16_bits_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(r);
}

}  // namespace pdserve_vec
