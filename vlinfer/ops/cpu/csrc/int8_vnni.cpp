// Per-channel int8 linears on integer dot products (AVX512-VNNI vpdpbusd): y = x @ (q * scale)^T
// (+ bias), the int8 weights q packed once at load as VNNI panels, int8 [N / 32, K / 4, 32, 4]: 32
// consecutive outputs, and per output 4 consecutive k side by side (the 4 bytes vpdpbusd sums into
// one int32 lane); one zmm holds 16 outputs x 4 k. Packing: vlinfer/ops/cpu/int8_panels.py.
//
// The activations are quantized per row (token) once per call, as `digits` unsigned bytes each:
// - digits = 1 (W8A8, the reference's quantize_per_token): s = max|x| / 127, v = round(x / s) half
//   to even (the MXCSR default, as torch.round), clamped to [-128, 127], held as v + 128.
// - digits = 2 (weight-only W8A16, decode): s = max|x| / 32767, v = round(x / s) in [-32767,
//   32767], held as two bytes, hi = (v >> 8) + 128 and lo = v & 255 (v = 256 (hi - 128) + lo):
//   each activation within s / 2 = max|x| / 65534 of its value.
// The +128 of the signed digit (vpdpbusd multiplies u8 by s8) is taken back per output with the
// weight sums packed at load: sum (v + 128) q = sum v q + 128 sum q. int32 sums stay exact up to
// K = 2^31 / (255 * 128) ~ 65k. Outputs: float(acc) * scale[n] * s_row (+ bias), the reference's
// order of float32 products; digits = 2 combine 256 * float(hi sum) + float(lo sum).
//
// Work per 64 weight bytes and row: `digits` vpdpbusd, where the bf16 panels (panels.h) take two
// vdpbf16ps on 128 bytes: W8A8 does twice bf16's products per instruction (compute-bound many
// rows), W8A16 the same products on half the bytes (memory-bound few rows). bf16 W8A16 at many
// rows widens each panel to bf16(q * scale) once per call and runs panels.h's bf16 tiles (digits =
// 0): the reference's numerics at the dense rate. int8_panels.py picks the path per call.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panels.h"

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr int64_t kQuad = 4;       // k per int32 lane of vpdpbusd
constexpr int64_t kDotRowBlock = 64;  // rows per work item: many rows split over the cores too

inline __m512 load16(const float* x, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x); }
inline __m512 load16(const c10::BFloat16* x, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// a / b as IEEE vdivps, as the reference divides: under -ffast-math GCC emits vrcp14ps and a
// Newton step for _mm512_div_ps, whose last bit moves values at a rounding tie.
inline __m512 divide(__m512 a, __m512 b) {
  __m512 q;
  asm("vdivps %2, %1, %0" : "=v"(q) : "v"(a), "v"(b));
  return q;
}

// One row of k activations -> `digits` rows of k bytes (q) and its scale (definitions above).
template <typename T>
void quantize_row(const T* x, int64_t k, int digits, uint8_t* q, float* scale) {
  __m512 mx = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = k - i >= 16 ? 0xFFFF : (__mmask16)((1u << (k - i)) - 1);
    mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(x + i, m)));
  }
  const float top = digits == 1 ? 127.0f : 32767.0f;
  volatile float divisor = top;  // a division as the reference does it, not a reciprocal product
  const float s = _mm512_reduce_max_ps(mx) / divisor;
  *scale = s;
  const __m512 sv = _mm512_set1_ps(s > 0 ? s : 1.0f);
  const __m512i lo_v = _mm512_set1_epi32(digits == 1 ? -128 : -32767);
  const __m512i hi_v = _mm512_set1_epi32(digits == 1 ? 127 : 32767);
  const __m512i offset = _mm512_set1_epi32(128), low_byte = _mm512_set1_epi32(255);
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = k - i >= 16 ? 0xFFFF : (__mmask16)((1u << (k - i)) - 1);
    __m512i v = _mm512_cvtps_epi32(divide(load16(x + i, m), sv));
    v = _mm512_min_epi32(_mm512_max_epi32(v, lo_v), hi_v);
    if (digits == 1) {
      _mm512_mask_cvtepi32_storeu_epi8(q + i, m, _mm512_add_epi32(v, offset));
    } else {
      const __m512i hi = _mm512_add_epi32(_mm512_srai_epi32(v, 8), offset);
      _mm512_mask_cvtepi32_storeu_epi8(q + i, m, hi);
      _mm512_mask_cvtepi32_storeu_epi8(q + k + i, m, _mm512_and_si512(v, low_byte));
    }
  }
}

// R rows x P panels over all of k, D digits. q: the rows' digit bytes, row r digit d at
// q + (r * D + d) * k. comp: 128 * sum_k q per output (the signed digit's offset).
template <int R, int P, int D, typename T>
inline void dot_tile(const uint8_t* q, int64_t k, const int8_t* w, int64_t panel_stride,
                     const float* row_scale, const float* scale, const int32_t* comp,
                     const float* bias, T* out, int64_t ldo) {
  __m512i acc[R][D][2 * P];
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < D; ++d)
      for (int c = 0; c < 2 * P; ++c) acc[r][d][c] = _mm512_setzero_si512();
  for (int64_t i = 0; i < k; i += kQuad) {
    __m512i wv[2 * P];
    for (int p = 0; p < P; ++p) {
      const int8_t* wp = w + p * panel_stride + i * kPanel;
      wv[2 * p] = _mm512_loadu_si512(wp);
      wv[2 * p + 1] = _mm512_loadu_si512(wp + 64);
      _mm_prefetch(reinterpret_cast<const char*>(wp + 2 * kPanelPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wp + 2 * kPanelPrefetch + 64), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < D; ++d) {
        int32_t quad;  // 4 consecutive k of one row's digit as one 32-bit lane
        std::memcpy(&quad, q + (r * D + d) * k + i, sizeof(quad));
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int c = 0; c < 2 * P; ++c)
          acc[r][d][c] = _mm512_dpbusd_epi32(acc[r][d][c], xv, wv[c]);
      }
  }
  for (int c = 0; c < 2 * P; ++c) {
    const int64_t o = (c / 2) * kPanel + (c % 2) * 16;  // panel c / 2, half c % 2
    const __m512i cv = _mm512_loadu_si512(comp + o);
    const __m512 sv = _mm512_loadu_ps(scale + o);
    for (int r = 0; r < R; ++r) {
      __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][0][c], cv));
      if constexpr (D == 2)
        f = _mm512_add_ps(_mm512_mul_ps(f, _mm512_set1_ps(256.0f)),
                          _mm512_cvtepi32_ps(acc[r][1][c]));
      __m512 y = _mm512_mul_ps(_mm512_mul_ps(f, sv), _mm512_set1_ps(row_scale[r]));
      if (bias) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + o));
      store16(out + r * ldo + o, y);
    }
  }
}

// `rows` rows against P panels: up to 4 rows share every weight load (one pass over the panel);
// more rows go 8 at a time (4 with two digits: the accumulators' registers), the panel re-read
// from L2 for each tile.
template <int P, int D, typename T>
void dot_rows(const uint8_t* q, const float* row_scale, int64_t rows, int64_t k, const int8_t* w,
              int64_t panel_stride, const float* scale, const int32_t* comp, const float* bias,
              T* out, int64_t ldo) {
  constexpr int kTile = D == 1 && P == 1 ? 8 : 4;
  int64_t r0 = 0;
  for (; r0 + kTile <= rows; r0 += kTile)
    dot_tile<kTile, P, D>(q + r0 * D * k, k, w, panel_stride, row_scale + r0, scale, comp, bias,
                          out + r0 * ldo, ldo);
  for (; r0 < rows; r0 += 4)
    with_rows(std::min<int64_t>(4, rows - r0), [&](auto r) {
      dot_tile<decltype(r)::value, P, D>(q + r0 * D * k, k, w, panel_stride, row_scale + r0,
                                         scale, comp, bias, out + r0 * ldo, ldo);
    });
}

template <int D, typename T>
void vnni_linear_impl(const uint8_t* q, const float* row_scale, int64_t rows, int64_t k,
                      const int8_t* w, int64_t n_panels, const float* scale, const int32_t* comp,
                      const float* bias, T* out) {
  const int64_t n = n_panels * kPanel, panel_stride = k * kPanel;
  // Two panels per item (two weight streams, every activation broadcast feeding 64 outputs) while
  // a tile of 4 rows x 2 panels fits the registers: one digit up to 4 rows, two digits up to 2.
  const int64_t group = rows <= 4 / D ? 2 : 1;
  const int64_t groups = (n_panels + group - 1) / group,
                blocks = (rows + kDotRowBlock - 1) / kDotRowBlock;
  at::parallel_for(0, groups * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = (item % groups) * group, r0 = (item / groups) * kDotRowBlock;
      const int64_t r = std::min(kDotRowBlock, rows - r0);
      const int64_t o = p * kPanel;
      const float* b = bias ? bias + o : nullptr;
      if (group == 2 && p + 1 < n_panels)
        dot_rows<2, D>(q + r0 * D * k, row_scale + r0, r, k, w + p * panel_stride, panel_stride,
                       scale + o, comp + o, b, out + r0 * n + o, n);
      else
        dot_rows<1, D>(q + r0 * D * k, row_scale + r0, r, k, w + p * panel_stride, panel_stride,
                       scale + o, comp + o, b, out + r0 * n + o, n);
    }
  });
}

// One VNNI panel -> a bf16 panel of panels.h ([K / 2][32][2]) of bf16(q * scale): the reference's
// dequantized weight (float32 product, rounded to nearest even).
void widen_panel(const int8_t* w, int64_t k, const float* scale, c10::BFloat16* dst) {
  const __m512 s[2] = {_mm512_loadu_ps(scale), _mm512_loadu_ps(scale + 16)};
  auto* d32 = reinterpret_cast<int32_t*>(dst);
  for (int64_t qd = 0; qd < k / kQuad; ++qd)
    for (int h = 0; h < 2; ++h) {  // outputs 16h .. 16h + 15, one int32 lane of 4 k each
      const __m512i a = _mm512_loadu_si512(w + qd * 4 * kPanel + h * 64);
      __m512i b[4];  // k 4qd + j of each output as bf16 in the low 16 bits of its lane
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_srai_epi32(_mm512_slli_epi32(a, 24 - 8 * j), 24);
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(v), s[h]);
        b[j] = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(f));
      }
      int32_t* row = d32 + 2 * qd * kPanel + h * 16;  // pair rows 2qd and 2qd + 1
      _mm512_storeu_si512(row, _mm512_or_si512(b[0], _mm512_slli_epi32(b[1], 16)));
      _mm512_storeu_si512(row + kPanel, _mm512_or_si512(b[2], _mm512_slli_epi32(b[3], 16)));
    }
}

// bf16 rows against panels widened once per call (widen_panel), each item one panel over all the
// rows: W8A16 at the dense bf16 tiles' rate plus one widening per panel.
void widened_linear(const c10::BFloat16* x, int64_t rows, int64_t k, const int8_t* w,
                    int64_t n_panels, const float* scale, const float* bias, c10::BFloat16* out) {
  const int64_t n = n_panels * kPanel, panel_stride = k * kPanel;
  at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<c10::BFloat16> dense(k * kPanel);
    for (int64_t p = begin; p < end; ++p) {
      widen_panel(w + p * panel_stride, k, scale + p * kPanel, dense.data());
      panel_rows<1>(x, rows, k, dense.data(), panel_stride, bias ? bias + p * kPanel : nullptr,
                    out + p * kPanel, n);
    }
  });
}

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int digits, uint8_t* q, float* scales) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(x + r * k, k, digits, q + r * digits * k, scales + r);
  });
}
#endif

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be float32 or bf16 [M, K], got ", x.scalar_type(), " ", x.sizes());
}

}  // namespace

bool int8_vnni_available() {
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 / bf16 -> (q uint8 [M, digits, K], row scales float32 [M]): the activation
// quantizer of int8_vnni_linear, exposed so that tests hold it to the scheme's definition.
std::vector<at::Tensor> int8_vnni_quantize(const at::Tensor& x, int64_t digits) {
  check_x(x, "int8_vnni_quantize");
  TORCH_CHECK(int8_vnni_available(), "int8_vnni_quantize: this build has no AVX512-VNNI kernels");
  TORCH_CHECK(digits == 1 || digits == 2, "int8_vnni_quantize: digits must be 1 or 2, got ",
              digits);
  const auto xc = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  auto q = at::empty({rows, digits, k}, x.options().dtype(at::kByte));
  auto scales = at::empty({rows}, x.options().dtype(at::kFloat));
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kFloat)
    quantize_rows(xc.data_ptr<float>(), rows, k, digits, q.data_ptr<uint8_t>(),
                  scales.data_ptr<float>());
  else
    quantize_rows(xc.data_ptr<c10::BFloat16>(), rows, k, digits, q.data_ptr<uint8_t>(),
                  scales.data_ptr<float>());
#endif
  return {q, scales};
}

// x [M, K] float32 / bf16; panels int8 [N / 32, K / 4, 32, 4]; comp int32 [N] (128 * sum_k q);
// scale float32 [N]; bias [N] or none; digits 1 (W8A8), 2 (W8A16) or 0 (W8A16 on bf16 panels
// widened once per call: bf16 x only). Returns [M, N] in x's dtype.
at::Tensor int8_vnni_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& comp,
                            const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                            int64_t digits) {
  check_x(x, "int8_vnni_linear");
  TORCH_CHECK(panels.scalar_type() == at::kChar && panels.is_contiguous() && panels.dim() == 4 &&
                panels.size(2) == 32 && panels.size(3) == 4,
              "int8_vnni_linear: panels must be contiguous int8 [N / 32, K / 4, 32, 4], got ",
              panels.scalar_type(), " ", panels.sizes());
  const int64_t k = panels.size(1) * 4, n = panels.size(0) * 32;
  TORCH_CHECK(x.size(1) == k, "int8_vnni_linear: x must be [M, ", k, "], got ", x.sizes());
  TORCH_CHECK(comp.scalar_type() == at::kInt && comp.is_contiguous() && comp.numel() == n,
              "int8_vnni_linear: comp must be contiguous int32 [", n, "]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "int8_vnni_linear: scale must be contiguous float32 [", n, "]");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "int8_vnni_linear: bias must be [", n,
                "]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  TORCH_CHECK(digits != 0 || x.scalar_type() == at::kBFloat16,
              "int8_vnni_linear: digits = 0 (widened bf16 panels) takes bf16 x, got ",
              x.scalar_type());
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (digits == 0) {
    const auto xc = x.contiguous();
    widened_linear(xc.data_ptr<c10::BFloat16>(), x.size(0), k, panels.data_ptr<int8_t>(),
                   panels.size(0), scale.data_ptr<float>(),
                   bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
                   out.data_ptr<c10::BFloat16>());
    return out;
  }
#endif
  const auto qs = int8_vnni_quantize(x, digits);
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  const uint8_t* q = qs[0].data_ptr<uint8_t>();
  const float* rs = qs[1].data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const auto* wp = panels.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int32_t* cp = comp.data_ptr<int32_t>();
  const int64_t rows = x.size(0), n_panels = panels.size(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto run = [&](auto* o) {
    if (digits == 1) vnni_linear_impl<1>(q, rs, rows, k, wp, n_panels, sp, cp, bp, o);
    else vnni_linear_impl<2>(q, rs, rows, k, wp, n_panels, sp, cp, bp, o);
  };
  if (bf16) run(out.data_ptr<c10::BFloat16>());
  else run(out.data_ptr<float>());
#endif
  return out;
}
