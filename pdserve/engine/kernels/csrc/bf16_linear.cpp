// bf16 matmuls against a weight blocked for VDPBF16PS, whose next block is prefetched while the
// current one is multiplied (CPU, AVX-512 BF16).
//
// oneDNN's bf16 matmul on a reordered weight waits for each weight as it streams from memory: in a
// decode step the 236 MB of SmolLM2's bf16 weights do not stay in cache, and at 64 rows the
// matmuls took 27 ms of a 37 ms step where the same shapes took 19.5 ms with their weights hot
// (bench/results/engine_bf16_epyc.md). Here each block of 32 output columns is one contiguous run
// of memory (K / 2 pairs of 32 columns x 2), and while a block's first row tile runs, the next
// block's lines are prefetched into L2, two per k pair, so the read of one overlaps the arithmetic
// of the other. All 121 matmuls of a forward, weights streamed: 0.63-0.89x oneDNN's time at 1-64
// rows, 0.87-0.95x at 128, 0.98-1.00x at 512-2048, on one core and on two
// (bench/bench_bf16_linear.py, bench/results/bf16_linear_epyc.md).
//
// Products: VDPBF16PS on pairs along k (exact bf16 products, fp32 sums in k order), one rounding
// to bf16 at the end, as oneDNN's kernels do; the two differ only where their fp32 sums round to
// neighbouring bf16 values (about 3 outputs in 100,000, one ulp).
//
// Ops: pdserve::pack_bf16_linear(w [N, K] bf16) -> [ceil(N / 32), K / 2, 32, 2] bf16 (columns past
//        N are zero; K even)
//      pdserve::bf16_linear(x [M, K] bf16, k contiguous, any row stride, packed, N) -> [M, N] bf16
//      pdserve::bf16_linear_supported() -> bool: built for AVX-512 BF16
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>

#include "ops.h"

namespace {

constexpr int64_t kN = 32;  // output columns per block: two vectors of 16 fp32 sums

[[maybe_unused]] void check_packed(const at::Tensor& packed) {  // unused without AVX-512 BF16
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kBFloat16 &&
                  packed.dim() == 4 && packed.size(2) == kN && packed.size(3) == 2 &&
                  packed.is_contiguous(),
              "bf16_linear: packed must be a contiguous CPU bf16 [blocks, K / 2, 32, 2] tensor");
}

at::Tensor pack_bf16_linear(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2,
              "pack_bf16_linear: w must be a 2-D CPU bf16 tensor");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N > 0 && K > 0 && K % 2 == 0, "pack_bf16_linear: K must be even, got ", K);
  const at::Tensor wc = w.contiguous();
  const int64_t blocks = (N + kN - 1) / kN;
  at::Tensor out = at::zeros({blocks, K / 2, kN, 2}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < kN && b * kN + j < N; ++j) {
        const uint16_t* row = src + (b * kN + j) * K;
        uint16_t* col = dst + (b * (K / 2) * kN + j) * 2;
        for (int64_t p = 0; p < K / 2; ++p) {
          col[p * kN * 2] = row[2 * p];
          col[p * kN * 2 + 1] = row[2 * p + 1];
        }
      }
  });
  return out;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PDSERVE_BF16_LINEAR 1

constexpr int kRows = 12;      // rows per tile: 24 sums, 2 weight vectors, 1 broadcast
constexpr int64_t kChunk = 192;  // rows whose x stays in L2 while all of a thread's blocks pass

// MR rows of x times one block: y[r, 0:ncols] for r < MR. While it runs, `next` (the block after
// this one, `lines` cache lines) is prefetched into L2, two lines per k pair.
template <int MR>
void tile(const uint16_t* x, int64_t ldx, const uint16_t* wb, int64_t K, uint16_t* y,
          int64_t ldy, int64_t ncols, const char* next, int64_t lines) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  int64_t fetched = 0;
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + p * 2 * kN);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + p * 2 * kN + kN);
    if (next != nullptr && fetched < lines) {
      _mm_prefetch(next + fetched * 64, _MM_HINT_T1);
      _mm_prefetch(next + fetched * 64 + 64, _MM_HINT_T1);
      fetched += 2;
    }
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
    }
  }
  const __mmask16 lo = ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
  const __mmask16 hi =
      ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1);
  for (int r = 0; r < MR; ++r) {
    const __m256i a = (__m256i)_mm512_cvtneps_pbh(acc[r][0]);
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(acc[r][1]);
    _mm256_mask_storeu_epi16(y + r * ldy, lo, a);
    _mm256_mask_storeu_epi16(y + r * ldy + 16, hi, b);
  }
}

using Tile = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, uint16_t*, int64_t,
                      int64_t, const char*, int64_t);
constexpr Tile kTiles[kRows + 1] = {nullptr,   tile<1>, tile<2>, tile<3>,  tile<4>,
                                    tile<5>,   tile<6>, tile<7>, tile<8>,  tile<9>,
                                    tile<10>,  tile<11>, tile<12>};
#endif

}  // namespace

namespace pdserve_ops {

bool blocked_for(const at::Tensor& packed, int64_t k, int64_t n) {
  return packed.device().is_cpu() && packed.scalar_type() == at::kBFloat16 &&
         packed.dim() == 4 && packed.size(2) == kN && packed.size(3) == 2 &&
         packed.is_contiguous() && packed.size(1) * 2 == k && n > (packed.size(0) - 1) * kN &&
         n <= packed.size(0) * kN;
}

// the parameters are unused in a build without AVX-512 BF16, which only refuses the call
at::Tensor bf16_linear([[maybe_unused]] const at::Tensor& x,
                       [[maybe_unused]] const at::Tensor& packed, [[maybe_unused]] int64_t n) {
#ifndef PDSERVE_BF16_LINEAR
  TORCH_CHECK(false, "bf16_linear: built without AVX-512 BF16");
#else
  check_packed(packed);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.stride(1) == 1,
              "bf16_linear: x must be a 2-D CPU bf16 tensor with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K, "bf16_linear: x has ", K, " columns, the weight ",
              packed.size(1) * 2);
  TORCH_CHECK(n > (blocks - 1) * kN && n <= blocks * kN, "bf16_linear: ", n,
              " output columns do not match ", blocks, " blocks");
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t ldx = x.stride(0), block = K * kN, lines = block * 2 / 64;
  // Each thread takes a run of blocks; x is walked in chunks of rows so that a chunk stays in
  // L2 while the thread's blocks pass (prefill chunks of 1,000+ rows).
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t c0 = 0; c0 < M; c0 += kChunk) {
      const int64_t c1 = std::min(M, c0 + kChunk);
      for (int64_t b = b0; b < b1; ++b) {
        const uint16_t* wb = wp + b * block;
        const char* next = b + 1 < b1 ? reinterpret_cast<const char*>(wb + block) : nullptr;
        const int64_t ncols = std::min(kN, n - b * kN);
        for (int64_t r0 = c0; r0 < c1; r0 += kRows) {
          const int mr = static_cast<int>(std::min<int64_t>(kRows, c1 - r0));
          kTiles[mr](xp + r0 * ldx, ldx, wb, K, yp + r0 * n + b * kN, n, ncols,
                     r0 == c0 ? next : nullptr, lines);
        }
      }
    }
  });
  return y;
#endif
}

bool bf16_linear_supported() {
#ifdef PDSERVE_BF16_LINEAR
  return true;
#else
  return false;
#endif
}

}  // namespace pdserve_ops

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("bf16_linear_supported() -> bool", &pdserve_ops::bf16_linear_supported);
  m.def("pack_bf16_linear(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("pack_bf16_linear", &pack_bf16_linear);
  m.impl("bf16_linear", &pdserve_ops::bf16_linear);
}
