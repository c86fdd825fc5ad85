// Weights in 32-output panels, the layout of our few-row and matmul kernels for experts
// (moe_experts.cpp) and dense linears (panel_linear.cpp). A panel holds 32 consecutive output rows
// of a [N, K] weight, k-major: float32 [K][32] (one k: 32 outputs, two zmm loads, an FMA each
// against the broadcast x[k]); bf16 [K / 2][32][2] (one pair of k: 32 outputs' two weights side by
// side, vdpbf16ps against the broadcast pair of x). No horizontal sums, and a work item streams its
// panels front to back. Packing: vlinfer/ops/cpu/panels.py to_panels.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tile_sizes.h"

#if defined(__AVX512F__)
#include <immintrin.h>

constexpr int64_t kPanel = 32;            // outputs per panel: two 16-lane accumulators
constexpr int64_t kPanelPrefetch =
  1024;  // elements ahead in the panel's stream (within noise of 512-2048)

inline void store16(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
#if defined(__AVX512BF16__)
inline void store16(c10::BFloat16* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// R rows x P panels over k. x rows of ldx elements; panel p starts panel_stride elements after
// panel p - 1. bias (float32, the 32 * P outputs') or null. float32: one k per step; bf16: one pair
// of k per step.
template <int R, int P, typename T>
inline void panel_tile(const T* x, int64_t ldx, const T* w, int64_t panel_stride, int64_t k,
                       const float* bias, T* out, int64_t ldo) {
  __m512 acc[R][2 * P];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * P; ++c)
      acc[r][c] = bias ? _mm512_loadu_ps(bias + c * 16) : _mm512_setzero_ps();
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < k; ++i) {
      __m512 wv[2 * P];
      for (int p = 0; p < P; ++p) {
        const float* wp = w + p * panel_stride + i * kPanel;
        wv[2 * p] = _mm512_loadu_ps(wp);
        wv[2 * p + 1] = _mm512_loadu_ps(wp + 16);
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPanelPrefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPanelPrefetch + 16), _MM_HINT_T0);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + i]);
        for (int c = 0; c < 2 * P; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
  } else {
#if defined(__AVX512BF16__)
    const auto* x16 = reinterpret_cast<const uint16_t*>(x);
    const auto* w16 = reinterpret_cast<const uint16_t*>(w);
    for (int64_t kp = 0; kp < k / 2; ++kp) {
      __m512bh wv[2 * P];
      for (int p = 0; p < P; ++p) {
        const uint16_t* wp = w16 + p * panel_stride + kp * 2 * kPanel;
        wv[2 * p] = (__m512bh)_mm512_loadu_si512(wp);
        wv[2 * p + 1] = (__m512bh)_mm512_loadu_si512(wp + kPanel);
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPanelPrefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPanelPrefetch + kPanel), _MM_HINT_T0);
      }
      for (int r = 0; r < R; ++r) {
        int32_t pair;  // x[r][2kp], x[r][2kp + 1] as one 32-bit lane
        std::memcpy(&pair, x16 + r * ldx + 2 * kp, sizeof(pair));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int c = 0; c < 2 * P; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
      }
    }
#endif
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * P; ++c) store16(out + r * ldo + c * 16, acc[r][c]);
}

// `rows` rows against P panels: up to 4 rows share every weight load (decode); more rows go 8 at a
// time, panel by panel, the panel re-read from L2 for each 8 (ops/cpu/backend.py bounds a dense
// panel at 256 KB).
template <int P, typename T>
void panel_rows(const T* x, int64_t rows, int64_t k, const T* w, int64_t panel_stride,
                const float* bias, T* out, int64_t ldo) {
  if (rows <= 4) {
    with_rows(rows, [&](auto r) {
      panel_tile<decltype(r)::value, P>(x, k, w, panel_stride, k, bias, out, ldo);
    });
    return;
  }
  for (int p = 0; p < P; ++p) {
    const T* wp = w + p * panel_stride;
    const float* bp = bias ? bias + p * kPanel : nullptr;
    T* op = out + p * kPanel;
    int64_t r0 = 0;
    for (; r0 + 8 <= rows; r0 += 8)
      panel_tile<8, 1>(x + r0 * k, k, wp, panel_stride, k, bp, op + r0 * ldo, ldo);
    for (; r0 < rows; r0 += 4) {
      with_rows(std::min<int64_t>(4, rows - r0), [&](auto r) {
        panel_tile<decltype(r)::value, 1>(x + r0 * k, k, wp, panel_stride, k, bp, op + r0 * ldo,
                                          ldo);
      });
    }
  }
}
#endif
