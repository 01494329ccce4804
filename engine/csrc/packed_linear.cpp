// Matmul against weights stored as block codes (CPU): y = x @ W.T, fp32 in and out.
//
// W [N, K] is kept as it ships in a quantized GGUF: blocks of 32 weights along K, each block
// w = code * scale + offset with a 4-bit code (two per byte, the block's first 16 weights in the
// low nibbles, the next 16 in the high ones, as in GGML's Q4_1) or an 8-bit signed code (GGML's
// Q8_0, no offset). engine/packed_linear.py only packs a weight whose every value this formula
// gives back exactly, so the kernel multiplies by the very weights the fp32 matmul would: only the
// order of the fp32 sums differs. A decode step reads its weights from memory once; at 4.6 bits
// a weight instead of 32 it reads about a sixth of the bytes.
//
// Per task of NT output rows: the rows are decoded once into an fp32 buffer that stays in L1,
// then every MT rows of x are multiplied against it with MT x NT vector accumulators. The vector
// types are GCC's, so the same code takes zmm registers with AVX-512 and ymm pairs with AVX2.
//
// Op: pdserve::packed_linear(x, codes, scale, offset, bits) -> y
//   x       [M, K] fp32 contiguous, K a multiple of 32
//   codes   [N, K / 2] uint8 (bits 4) or [N, K] int8 (bits 8), contiguous, N a multiple of NT
//   scale   [N, K / 32] fp32
//   offset  [N, K / 32] fp32 (bits 4), or an empty tensor (bits 8)
//   y       [M, N] fp32
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));

constexpr int64_t BLOCK = 32;
constexpr int64_t NT = 4;  // output rows per task (4 x 1536 fp32 of decoded weights: 24 KiB)
constexpr int64_t MT = 4;  // rows of x per accumulator tile (MT x NT = 16 vector accumulators)

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

inline float hsum(v16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}

// One weight row [K] from its codes into fp32. code * scale is exact in fp32 (an 11-bit fp16
// scale times an integer of at most 8 bits), so with the offset added it rounds once: the same
// value the packer checked. With AVX-512 the codes widen with one instruction per 16 (GCC's
// generic conversions of narrow integers come out scalar); elsewhere the plain loop.
template <int BITS>
void decode_row(const uint8_t* codes, const float* scale, const float* offset, int64_t K,
                float* out) {
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    const uint8_t* c = codes + b * (BITS == 4 ? 16 : BLOCK);
    float* o = out + b * BLOCK;
#if defined(__AVX512F__)
    const __m512 d = _mm512_set1_ps(scale[b]);
    if constexpr (BITS == 4) {
      const __m512 m = _mm512_set1_ps(offset[b]);
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
      const __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(15));
      const __m512i hi = _mm512_srli_epi32(q, 4);
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m));
      _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m));
    } else {
      for (int h = 0; h < 2; ++h) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + h * 16));
        _mm512_storeu_ps(o + h * 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), d));
      }
    }
#else
    const float d = scale[b];
    if constexpr (BITS == 4) {
      const float m = offset[b];
      for (int i = 0; i < 16; ++i) {
        o[i] = static_cast<float>(c[i] & 15) * d + m;
        o[i + 16] = static_cast<float>(c[i] >> 4) * d + m;
      }
    } else {
      for (int i = 0; i < BLOCK; ++i) o[i] = static_cast<float>(static_cast<int8_t>(c[i])) * d;
    }
#endif
  }
}

// y[r, n0 + j] for rows r in [r0, r0 + R) and j < NT, from NT decoded rows `w` [NT, K].
template <int R>
void tile(const float* x, int64_t K, const float* w, float* y, int64_t N, int64_t r0, int64_t n0) {
  v16 acc[R][NT] = {};
  for (int64_t k = 0; k < K; k += 16) {
    v16 wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = load16(w + j * K + k);
    for (int r = 0; r < R; ++r) {
      const v16 xv = load16(x + (r0 + r) * K + k);
      for (int j = 0; j < NT; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NT; ++j) y[(r0 + r) * N + n0 + j] = hsum(acc[r][j]);
}

template <int BITS>
void run(const float* x, const uint8_t* codes, const float* scale, const float* offset,
         int64_t M, int64_t N, int64_t K, float* y) {
  const int64_t row_bytes = BITS == 4 ? K / 2 : K, blocks = K / BLOCK;
  at::parallel_for(0, N / NT, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(NT * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NT;
      for (int64_t j = 0; j < NT; ++j) {
        const int64_t n = n0 + j;
        decode_row<BITS>(codes + n * row_bytes, scale + n * blocks,
                         BITS == 4 ? offset + n * blocks : nullptr, K, w.data() + j * K);
      }
      int64_t r0 = 0;
      for (; r0 + MT <= M; r0 += MT) tile<MT>(x, K, w.data(), y, N, r0, n0);
      switch (M - r0) {
        case 3: tile<3>(x, K, w.data(), y, N, r0, n0); break;
        case 2: tile<2>(x, K, w.data(), y, N, r0, n0); break;
        case 1: tile<1>(x, K, w.data(), y, N, r0, n0); break;
        default: break;
      }
    }
  });
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                         const at::Tensor& offset, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "packed_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "packed_linear: x must be a contiguous fp32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % BLOCK == 0, "packed_linear: K (", K, ") must be a multiple of ", BLOCK);
  TORCH_CHECK(N % NT == 0, "packed_linear: N (", N, ") must be a multiple of ", NT);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) == (bits == 4 ? K / 2 : K) &&
                  codes.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              "packed_linear: codes must be contiguous ", bits == 4 ? "uint8 [N, K/2]" : "int8 [N, K]");
  for (const at::Tensor* t : {&scale, &offset}) {
    if (t == &offset && bits == 8) continue;
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == N && t->size(1) == K / BLOCK,
                "packed_linear: scale and offset must be contiguous fp32 [N, K/32]");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* c = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* off = bits == 4 ? offset.data_ptr<float>() : nullptr;
  if (bits == 4)
    run<4>(x.data_ptr<float>(), c, scale.data_ptr<float>(), off, M, N, K, y.data_ptr<float>());
  else
    run<8>(x.data_ptr<float>(), c, scale.data_ptr<float>(), off, M, N, K, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("packed_linear(Tensor x, Tensor codes, Tensor scale, Tensor offset, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("packed_linear", &packed_linear); }
