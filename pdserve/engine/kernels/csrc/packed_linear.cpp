// Matmul against weights stored as block codes (CPU): y = x @ W.T, fp32 in and out.
//
// W [N, K] is kept as it ships in a quantized GGUF: blocks of 32 weights along K, each block
// w = code * scale + offset with a 4-bit code (GGML's Q4_1) or an 8-bit signed code (Q8_0, no
// offset). pdserve/engine/kernels/packed_linear.py only packs a weight whose every value this formula gives back
// exactly, so the kernel multiplies by the very weights the fp32 matmul would: only the order of
// the fp32 sums differs. A decode step reads its weights from memory once; at 6 bits a weight
// (codes, scale and offset) instead of 32 it reads about a fifth of the bytes.
//
// Layout: panels of 16 output rows. Within a panel the codes of one column k of all 16 rows lie
// together (4-bit: columns k and k + 1 in the low and high nibbles of 16 bytes), so one load and a
// widening give the 16 weights of column k as a vector, and the kernel computes y[m, 16 rows] as
// vector accumulators: acc[m] += w[k, 16 rows] * x[m, k] (x broadcast). No horizontal sums, and
// each decoded column serves every row of x in the tile (up to 16).
//
// Op: pdserve::packed_linear(x, codes, scale, offset, bits) -> y
//   x       [M, K] fp32 contiguous, K a multiple of 32
//   codes   [N / 16, K / 2, 16] uint8 (bits 4) or [N / 16, K, 16] int8 (bits 8), contiguous
//   scale   [N / 16, K / 32, 16] fp32
//   offset  like scale (bits 4), or an empty tensor (bits 8)
//   y       [M, N] fp32
// With a bf16 x, y is bf16: the weights rounded to bf16 first (W16 below), a bf16 model's product.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));

constexpr int64_t BLOCK = 32;
constexpr int64_t PANEL = 16;  // output rows per panel: one vector of fp32

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 codes, one byte each, widened to fp32; and 16 bytes of two 4-bit codes each, widened to the
// low and the high codes. With AVX-512 one instruction widens 16 bytes (GCC's generic conversions
// of narrow integers come out scalar); elsewhere the plain loops.
inline v16 widen_signed(const uint8_t* c) {
#if defined(__AVX512F__)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  return reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)));
#else
  v16 v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(static_cast<int8_t>(c[i]));
  return v;
#endif
}

inline void widen_nibbles(const uint8_t* c, v16& lo, v16& hi) {
#if defined(__AVX512F__)
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  lo = reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))));
  hi = reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)));
#else
  for (int i = 0; i < 16; ++i) {
    lo[i] = static_cast<float>(c[i] & 15);
    hi[i] = static_cast<float>(c[i] >> 4);
  }
#endif
}

// y[r0 + r, n0 .. n0 + 16 P) for r < R, from P adjacent panels (P = 1 or 2; `panel_bytes` codes
// and `panel_scales` scales apart) and the tile's rows of x stored column by column (`xt` [K, R]:
// one base pointer and constant offsets). With P = 2 each x value is broadcast once into a
// register for two FMAs: an FMA that broadcasts its own operand from memory ran at half this
// CPU's FMA rate (Ice Lake; bench/results/packed_matmuls.md). code * scale is exact in fp32 (an
// 11-bit fp16 scale times an integer of at most 8 bits), so with the offset added each weight
// rounds once: the value the packer checked. Every output sums over k in order, whatever R and P.
// noinline: inlined into its caller, GCC kept fewer accumulators in registers (slower, measured).
// W16: each decoded weight rounded to bf16 (nearest even; the bf16 model's weight, which the
// loader rounds from the same fp32 value) before it multiplies: a bf16 model's product, its bf16 x
// widened to fp32 exactly, every product exact in fp32 as in a bf16 dot product.
inline v16 round_bf16(v16 w) {
  typedef uint32_t u16v __attribute__((vector_size(64)));
  u16v u;
  std::memcpy(&u, &w, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;  // finite weights: no NaN case
  std::memcpy(&w, &u, sizeof w);
  return w;
}

template <int BITS, int R, int P, bool W16>
__attribute__((noinline)) void tile(const float* xt, int64_t K, const uint8_t* codes,
                                    int64_t panel_bytes, const float* s, const float* o,
                                    int64_t panel_scales, float* y, int64_t N, int64_t r0,
                                    int64_t n0) {
  static_assert(P == 1 || P == 2, "one or two panels");
  v16 a0[R] = {}, a1[R] = {};  // a1: the second panel's, unused when P == 1
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    const v16 d0 = load16(s + b * PANEL), d1 = load16(s + (P - 1) * panel_scales + b * PANEL);
    const float* xb = xt + b * BLOCK * R;
    if constexpr (BITS == 4) {
      const v16 m0 = load16(o + b * PANEL), m1 = load16(o + (P - 1) * panel_scales + b * PANEL);
      const uint8_t* c = codes + b * (BLOCK / 2) * PANEL;
      for (int64_t k = 0; k < BLOCK; k += 2) {
        v16 lo0, hi0, lo1, hi1;
        widen_nibbles(c + (k / 2) * PANEL, lo0, hi0);
        if constexpr (P == 2) widen_nibbles(c + panel_bytes + (k / 2) * PANEL, lo1, hi1);
        v16 w00 = lo0 * d0 + m0, w01 = hi0 * d0 + m0;  // columns k and k + 1
        v16 w10 = w00, w11 = w01;
        if constexpr (P == 2) w10 = lo1 * d1 + m1, w11 = hi1 * d1 + m1;
        if constexpr (W16) {
          w00 = round_bf16(w00), w01 = round_bf16(w01);
          if constexpr (P == 2) w10 = round_bf16(w10), w11 = round_bf16(w11);
        }
#pragma GCC unroll 16  // the accumulators must live in registers, not on the stack
        for (int r = 0; r < R; ++r) {
          const float x0 = xb[k * R + r], x1 = xb[(k + 1) * R + r];
          a0[r] += w00 * x0;
          if constexpr (P == 2) a1[r] += w10 * x0;
          a0[r] += w01 * x1;
          if constexpr (P == 2) a1[r] += w11 * x1;
        }
      }
    } else {
      const uint8_t* c = codes + b * BLOCK * PANEL;
      for (int64_t k = 0; k < BLOCK; ++k) {
        v16 w0 = widen_signed(c + k * PANEL) * d0;
        v16 w1 = w0;
        if constexpr (P == 2) w1 = widen_signed(c + panel_bytes + k * PANEL) * d1;
        if constexpr (W16) {
          w0 = round_bf16(w0);
          if constexpr (P == 2) w1 = round_bf16(w1);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const float x = xb[k * R + r];
          a0[r] += w0 * x;
          if constexpr (P == 2) a1[r] += w1 * x;
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    std::memcpy(y + (r0 + r) * N + n0, &a0[r], sizeof(v16));
    if constexpr (P == 2) std::memcpy(y + (r0 + r) * N + n0 + PANEL, &a1[r], sizeof(v16));
  }
}

// The rows of x in tiles of 16, then at most one each of 8, 4, 2 and 1 rows: (first row, rows).
std::vector<std::pair<int64_t, int>> row_tiles(int64_t M) {
  std::vector<std::pair<int64_t, int>> out;
  int64_t r = 0;
  for (; r + 16 <= M; r += 16) out.emplace_back(r, 16);
  for (int R : {8, 4, 2, 1})
    if (M - r >= R) out.emplace_back(r, R), r += R;
  return out;
}

template <int BITS, int P, bool W16>
void tile_rows(int R, const float* xt, int64_t K, const uint8_t* c, int64_t panel_bytes,
               const float* s, const float* o, int64_t panel_scales, float* y, int64_t N,
               int64_t r0, int64_t n0) {
  switch (R) {
    case 16: return tile<BITS, 16, P, W16>(xt, K, c, panel_bytes, s, o, panel_scales, y, N, r0, n0);
    case 8: return tile<BITS, 8, P, W16>(xt, K, c, panel_bytes, s, o, panel_scales, y, N, r0, n0);
    case 4: return tile<BITS, 4, P, W16>(xt, K, c, panel_bytes, s, o, panel_scales, y, N, r0, n0);
    case 2: return tile<BITS, 2, P, W16>(xt, K, c, panel_bytes, s, o, panel_scales, y, N, r0, n0);
    default: return tile<BITS, 1, P, W16>(xt, K, c, panel_bytes, s, o, panel_scales, y, N, r0, n0);
  }
}

template <int BITS, bool W16>
void run(const float* x, const uint8_t* codes, const float* scale, const float* offset, int64_t M,
         int64_t N, int64_t K, float* y) {
  const auto tiles = row_tiles(M);
  std::vector<float> xt(M * K);  // each tile's rows column by column: tile (r0, R) at xt[r0 * K]
  for (const auto& [r0, R] : tiles)
    for (int r = 0; r < R; ++r)
      for (int64_t k = 0; k < K; ++k) xt[r0 * K + k * R + r] = x[(r0 + r) * K + k];
  const int64_t panel_bytes = (BITS == 4 ? K / 2 : K) * PANEL, panel_scales = K / BLOCK * PANEL;
  // pairs of panels, and the last one alone when their number is odd
  at::parallel_for(0, (N / PANEL + 1) / 2, 2, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int64_t p = 2 * q;
      const bool pair = p + 1 < N / PANEL;
      const uint8_t* c = codes + p * panel_bytes;
      const float* s = scale + p * panel_scales;
      const float* o = BITS == 4 ? offset + p * panel_scales : nullptr;
      for (const auto& [r0, R] : tiles) {
        const float* t = xt.data() + r0 * K;
        if (pair)
          tile_rows<BITS, 2, W16>(R, t, K, c, panel_bytes, s, o, panel_scales, y, N, r0, p * PANEL);
        else
          tile_rows<BITS, 1, W16>(R, t, K, c, panel_bytes, s, o, panel_scales, y, N, r0, p * PANEL);
      }
    }
  });
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                         const at::Tensor& offset, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "packed_linear: bits must be 4 or 8, got ", bits);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || bf16),
              "packed_linear: x must be a contiguous fp32 or bf16 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), P = codes.size(0), N = P * PANEL;
  TORCH_CHECK(K % BLOCK == 0, "packed_linear: K (", K, ") must be a multiple of ", BLOCK);
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() &&
                  codes.size(1) == (bits == 4 ? K / 2 : K) && codes.size(2) == PANEL &&
                  codes.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              "packed_linear: codes must be contiguous ",
              bits == 4 ? "uint8 [N/16, K/2, 16]" : "int8 [N/16, K, 16]");
  for (const at::Tensor* t : {&scale, &offset}) {
    if (t == &offset && bits == 8) continue;
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == P && t->size(1) == K / BLOCK && t->size(2) == PANEL,
                "packed_linear: scale and offset must be contiguous fp32 [N/16, K/32, 16]");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* c = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* off = bits == 4 ? offset.data_ptr<float>() : nullptr;
  // bf16: x widened to fp32 (exact), bf16-rounded weights, the fp32 sums rounded to bf16 once
  const at::Tensor xf = bf16 ? x.to(at::kFloat) : x;
  at::Tensor yf = bf16 ? at::empty({M, N}, xf.options()) : y;
  const float *xp = xf.data_ptr<float>(), *sp = scale.data_ptr<float>();
  float* yp = yf.data_ptr<float>();
  if (bits == 4)
    bf16 ? run<4, true>(xp, c, sp, off, M, N, K, yp) : run<4, false>(xp, c, sp, off, M, N, K, yp);
  else
    bf16 ? run<8, true>(xp, c, sp, off, M, N, K, yp) : run<8, false>(xp, c, sp, off, M, N, K, yp);
  if (bf16) y.copy_(yf);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("packed_linear(Tensor x, Tensor codes, Tensor scale, Tensor offset, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("packed_linear", &packed_linear); }
