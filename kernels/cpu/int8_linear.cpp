// Weight-only int8 linear for few rows (decode steps, small batches): y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]
// with q int8 [N, K] per output channel (the W8A16 layout of ops/cpu_quant.py) and x float32 or bfloat16.
//
// Why ours: at one row torch's _weight_int8pack_mm ran SmolLM2's decode at 8 tok/s, 2.5x slower than the float32
// weights it replaces (bench/quantized.py). A decode step reads every weight once, so this kernel streams the int8
// rows once, both threads on disjoint blocks of output channels, and reuses each loaded weight vector for up to
// kRows rows of x. The activations are widened to float32 once per call; products and sums are float32, the scale
// is applied to the finished sum, so the result is the reference's dequantize-then-matmul up to float rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "tile_sizes.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define VLINFER_INT8_AVX512 1
#endif

namespace {

constexpr int64_t kRows = 4;     // rows of x sharing each weight load
constexpr int64_t kCols = 4;     // weight rows per microkernel
constexpr int64_t kBlockN = 64;  // output channels per work item

#ifdef VLINFER_INT8_AVX512
// 16 int8 weights widened to float32 lanes (exact). Tails are masked loads: zeros add nothing.
inline __m512 widen16(const int8_t* q, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, q)));
}

template <int R, int C>
inline void tile_avx512(const float* x, const int8_t* q, int64_t k, float* out, int64_t ldo) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 mask = k - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1);
    __m512 wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = widen16(q + c * k + i, mask);
      _mm_prefetch(reinterpret_cast<const char*>(q + c * k + i + 768), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * k + i);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]);
}

void tile(const float* x, int64_t rows, const int8_t* q, int64_t cols, int64_t k, float* out, int64_t ldo) {
  with_tile_size(rows, cols, [&](auto r, auto c) {
    tile_avx512<decltype(r)::value, decltype(c)::value>(x, q, k, out, ldo);
  });
}
#else
// rows x cols sums of x[r] * q[c] over k, any build: a plain loop the compiler vectorizes for its level.
void tile(const float* x, int64_t rows, const int8_t* q, int64_t cols, int64_t k, float* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float* xr = x + r * k;
      const int8_t* qc = q + c * k;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < k; ++i) acc += xr[i] * static_cast<float>(qc[i]);
      out[r * ldo + c] = acc;
    }
  }
}
#endif

}  // namespace

// x [M, K] float32 / bfloat16, q int8 [N, K], scales float32 [N] -> [M, N] in x's dtype.
at::Tensor int8_weight_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "int8_weight_linear: x must be [M, K] and the "
              "weight [N, K]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(),
              "int8_weight_linear: the weight must be contiguous int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == q.size(0), "int8_weight_linear: scales must be "
              "float32 [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int8_weight_linear: x must be "
              "float32 or bfloat16");
  const int64_t m = x.size(0), n = q.size(0), k = q.size(1);
  const auto xf = x.to(at::kFloat).contiguous();
  const auto sc = scales.contiguous();
  auto acc = at::empty({m, n}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* ap = acc.data_ptr<float>();
  const int64_t blocks = (n + kBlockN - 1) / kBlockN;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlockN, n1 = std::min(n, n0 + kBlockN);
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = std::min(kRows, m - r0);
        for (int64_t c0 = n0; c0 < n1; c0 += kCols) {
          tile(xp + r0 * k, rows, qp + c0 * k, std::min(kCols, n1 - c0), k, ap + r0 * n + c0, n);
        }
        for (int64_t r = r0; r < r0 + rows; ++r)
          for (int64_t c = n0; c < n1; ++c) ap[r * n + c] *= sp[c];
      }
    }
  });
  return x.scalar_type() == at::kFloat ? acc : acc.to(x.scalar_type());
}
