// Linear layers on GGUF Q8_0 / Q4_0 / Q4_1 weights kept in their GGUF blocks: y[M, N] = x[M, K] @ W[N, K]^T, W a
// uint8 [N, K / 32 * block_bytes] tensor holding the file's blocks row after row (blocks run along K, as ggml's
// ne[0]). Semantics are defined by vlinfer/ops/gguf_reference.py (dequantize the way gguf-py does, then a float32
// matmul); tests compare against it.
//
// Few rows (decode, small batches): each 32-weight block's integers are converted to float32 in registers and
// multiplied into float32 accumulators for every row of x, with the block's scales factored out (Q4_1:
// d * sum(q * x) + m * sum(x), sum(x) per 32 activations computed once per call), so each weight byte is read from
// memory once per call and a block costs 7-9 vector operations. The activations are not quantized (llama.cpp
// quantizes them to Q8 per 32 for int8 dot products): results stay within float32 summation-order noise of a
// float32 matmul on the dequantized weights, which greedy decoding against transformers needs.
// Dequantizing (the tiled path and embedding rows) follows gguf-py exactly (Q8_0: q * d; Q4_0: (q - 8) * d; Q4_1:
// q * d + m, each product and sum rounded once: this file is built with -ffp-contract=off so the compiler does not
// fuse them).
// Many rows (prefill): each thread dequantizes a tile of weight rows into a buffer that stays in cache and runs the
// BLAS / oneDNN matmul on it, so the arithmetic runs at the dense matmul rate.
// Work is split over output rows N with at::parallel_for. AVX-512 and AVX2 paths are chosen at compile time by the
// -m flags of the build (vlinfer/ops/gguf_cpu.py builds one extension per instruction-set level).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// ggml type ids (ggml.h: GGML_TYPE_Q4_0 = 2, Q4_1 = 3, Q8_0 = 8).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kBlock = 32;

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;  // fp16 d; uint8 qs[16]
    case kQ4_1: return 20;  // fp16 d, m; uint8 qs[16]
    case kQ8_0: return 34;  // fp16 d; int8 qs[32]
    default: TORCH_CHECK(false, "GGUF kernels take ggml types Q4_0 (2), Q4_1 (3) and Q8_0 (8), got ", type);
  }
  return 0;
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// The float32 value of every fp16 bit pattern (256 KiB, built once): a block's scale becomes one table load the
// SIMD paths broadcast from memory, instead of a conversion on the vector ports for every block.
const float* half_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t bits = 0; bits < 65536; ++bits) t[bits] = c10::detail::fp16_ieee_to_fp32_value(static_cast<uint16_t>(bits));
    return t;
  }();
  return table.data();
}

inline float half_at(const float* table, const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return table[bits];
}

// Few-row dot products factor each block's scales out of its 32 products: for Q4_1,
//   sum_j (q_j * d + m) * x_j = d * sum_j q_j * x_j + m * sum_j x_j,
// with sum_j x_j (xsum, one per 32 activations) computed once per call and shared by all N weight rows; Q8_0 and
// Q4_0 are d * sum_j q_j * x_j (Q4_0 with q_j - 8). The integer q_j are exact in float32, so this is the same real
// sum as the dequantized matmul, rounded in a different order: within float32 summation noise of it (tests check
// against a float64 matmul), at 7-9 vector operations per block instead of 12-15.
// One block dequantized to 32 floats (scalar; also the reference for the SIMD paths). Element j < 16 of a Q4 block
// is the low nibble of qs[j], element j + 16 its high nibble.
template <int64_t TYPE>
inline void dequant_block_scalar(const uint8_t* blk, float* out) {
  const float d = half_to_float(blk);
  if constexpr (TYPE == kQ8_0) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(qs[j]) * d;
  } else if constexpr (TYPE == kQ4_0) {
    const uint8_t* qs = blk + 2;
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<float>(static_cast<int>(qs[j] & 0xF) - 8) * d;
      out[j + 16] = static_cast<float>(static_cast<int>(qs[j] >> 4) - 8) * d;
    }
  } else {
    const float m = half_to_float(blk + 2);
    const uint8_t* qs = blk + 4;
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<float>(qs[j] & 0xF) * d + m;
      out[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
    }
  }
}

#if defined(__AVX512F__)
// A block as two 16-float vectors: elements 0..15 and 16..31.
template <int64_t TYPE>
inline void dequant_block(const uint8_t* blk, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(half_to_float(blk));
  if constexpr (TYPE == kQ8_0) {
    const __m128i* qs = reinterpret_cast<const __m128i*>(blk + 2);
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs))), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs + 1))), d);
  } else {
    const int off = TYPE == kQ4_1 ? 4 : 2;
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off)));
    __m512i ql = _mm512_and_si512(q, _mm512_set1_epi32(0xF));
    __m512i qh = _mm512_srli_epi32(q, 4);
    if constexpr (TYPE == kQ4_0) {
      ql = _mm512_sub_epi32(ql, _mm512_set1_epi32(8));
      qh = _mm512_sub_epi32(qh, _mm512_set1_epi32(8));
      lo = _mm512_mul_ps(_mm512_cvtepi32_ps(ql), d);
      hi = _mm512_mul_ps(_mm512_cvtepi32_ps(qh), d);
    } else {
      const __m512 m = _mm512_set1_ps(half_to_float(blk + 2));
      lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ql), d), m);
      hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(qh), d), m);
    }
  }
}

template <int64_t TYPE>
inline void dequant_block_to(const uint8_t* blk, float* out) {
  __m512 lo, hi;
  dequant_block<TYPE>(blk, lo, hi);
  _mm512_storeu_ps(out, lo);
  _mm512_storeu_ps(out + 16, hi);
}

// Rows [n0, n1) of W against MT rows of x (float32, row stride ldx): y[m][n] = sum_k x[m][k] W[n][k]. xsum[m][b]
// (row stride nblocks) is the sum of x[m]'s block b (used by Q4_1 only). Two accumulators per x row (even and odd
// blocks) keep the FMA latency chain off the critical path.
template <int64_t TYPE, int MT>
void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t nblocks, const float* x, int64_t ldx, const float* xsum,
              int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int64_t bb = TYPE == kQ8_0 ? 34 : TYPE == kQ4_1 ? 20 : 18;
  const float* ht = half_table();
  const __m512i low4 = _mm512_set1_epi32(0xF), eight = _mm512_set1_epi32(8);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m512 acc[MT][2];
    float acc_m[MT][2];
    for (int m = 0; m < MT; ++m) {
      acc[m][0] = acc[m][1] = _mm512_setzero_ps();
      acc_m[m][0] = acc_m[m][1] = 0.f;
    }
    auto block = [&](int64_t b, int half) {
      const uint8_t* blk = row + b * bb;
      const __m512 d = _mm512_set1_ps(half_at(ht, blk));
      __m512 q_lo, q_hi;
      if constexpr (TYPE == kQ8_0) {
        const __m128i* qs = reinterpret_cast<const __m128i*>(blk + 2);
        q_lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs)));
        q_hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs + 1)));
      } else {
        const __m512i q = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (TYPE == kQ4_1 ? 4 : 2))));
        __m512i ql = _mm512_and_si512(q, low4), qh = _mm512_srli_epi32(q, 4);
        if constexpr (TYPE == kQ4_0) {
          ql = _mm512_sub_epi32(ql, eight);
          qh = _mm512_sub_epi32(qh, eight);
        }
        q_lo = _mm512_cvtepi32_ps(ql);
        q_hi = _mm512_cvtepi32_ps(qh);
      }
      const float* xb = x + b * kBlock;
      for (int m = 0; m < MT; ++m) {
        const __m512 t = _mm512_fmadd_ps(q_hi, _mm512_loadu_ps(xb + m * ldx + 16),
                                         _mm512_mul_ps(q_lo, _mm512_loadu_ps(xb + m * ldx)));
        acc[m][half] = _mm512_fmadd_ps(t, d, acc[m][half]);
      }
      if constexpr (TYPE == kQ4_1) {
        const float mn = half_at(ht, blk + 2);
        for (int m = 0; m < MT; ++m) acc_m[m][half] = std::fma(mn, xsum[m * nblocks + b], acc_m[m][half]);
      }
    };
    int64_t b = 0;
    for (; b + 2 <= nblocks; b += 2) {
      block(b, 0);
      block(b + 1, 1);
    }
    if (b < nblocks) block(b, 0);
    for (int m = 0; m < MT; ++m)
      y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) + (acc_m[m][0] + acc_m[m][1]);
  }
}

#elif defined(__AVX2__)
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A block as four 8-float vectors: elements 0..7, 8..15, 16..23, 24..31.
template <int64_t TYPE>
inline void dequant_block(const uint8_t* blk, __m256 v[4]) {
  const __m256 d = _mm256_set1_ps(half_to_float(blk));
  if constexpr (TYPE == kQ8_0) {
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i));
      v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  } else {
    const int off = TYPE == kQ4_1 ? 4 : 2;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off));
    const __m128i mask = _mm_set1_epi8(0xF);
    const __m128i ql = _mm_and_si128(q, mask), qh = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    __m256i qi[4] = {_mm256_cvtepu8_epi32(ql), _mm256_cvtepu8_epi32(_mm_srli_si128(ql, 8)),
                     _mm256_cvtepu8_epi32(qh), _mm256_cvtepu8_epi32(_mm_srli_si128(qh, 8))};
    if constexpr (TYPE == kQ4_0) {
      for (int i = 0; i < 4; ++i)
        v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(qi[i], _mm256_set1_epi32(8))), d);
    } else {
      const __m256 m = _mm256_set1_ps(half_to_float(blk + 2));
      for (int i = 0; i < 4; ++i) v[i] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(qi[i]), d), m);
    }
  }
}

template <int64_t TYPE>
inline void dequant_block_to(const uint8_t* blk, float* out) {
  __m256 v[4];
  dequant_block<TYPE>(blk, v);
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, v[i]);
}

template <int64_t TYPE, int MT>
void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t nblocks, const float* x, int64_t ldx, const float* xsum,
              int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int64_t bb = TYPE == kQ8_0 ? 34 : TYPE == kQ4_1 ? 20 : 18;
  const float* ht = half_table();
  const __m128i low4 = _mm_set1_epi8(0xF);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[MT][2];
    float acc_m[MT][2];
    for (int m = 0; m < MT; ++m) {
      acc[m][0] = acc[m][1] = _mm256_setzero_ps();
      acc_m[m][0] = acc_m[m][1] = 0.f;
    }
    auto block = [&](int64_t b, int half) {
      const uint8_t* blk = row + b * bb;
      const __m256 d = _mm256_set1_ps(half_at(ht, blk));
      __m256 v[4];  // q of elements 0..7, 8..15, 16..23, 24..31
      if constexpr (TYPE == kQ8_0) {
        for (int i = 0; i < 4; ++i)
          v[i] = _mm256_cvtepi32_ps(
              _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i))));
      } else {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (TYPE == kQ4_1 ? 4 : 2)));
        __m128i ql = _mm_and_si128(q, low4), qh = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
        if constexpr (TYPE == kQ4_0) {
          ql = _mm_sub_epi8(ql, _mm_set1_epi8(8));
          qh = _mm_sub_epi8(qh, _mm_set1_epi8(8));
          v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ql));
          v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(ql, 8)));
          v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qh));
          v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(qh, 8)));
        } else {
          v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ql));
          v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(ql, 8)));
          v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(qh));
          v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(qh, 8)));
        }
      }
      const float* xb = x + b * kBlock;
      for (int m = 0; m < MT; ++m) {
        const float* xm = xb + m * ldx;
        const __m256 t0 = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xm + 16), _mm256_mul_ps(v[0], _mm256_loadu_ps(xm)));
        const __m256 t1 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xm + 24), _mm256_mul_ps(v[1], _mm256_loadu_ps(xm + 8)));
        acc[m][half] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), d, acc[m][half]);
      }
      if constexpr (TYPE == kQ4_1) {
        const float mn = half_at(ht, blk + 2);
        for (int m = 0; m < MT; ++m) acc_m[m][half] = std::fma(mn, xsum[m * nblocks + b], acc_m[m][half]);
      }
    };
    int64_t b = 0;
    for (; b + 2 <= nblocks; b += 2) {
      block(b, 0);
      block(b + 1, 1);
    }
    if (b < nblocks) block(b, 0);
    for (int m = 0; m < MT; ++m) y[m * ldy + n] = hsum256(_mm256_add_ps(acc[m][0], acc[m][1])) + (acc_m[m][0] + acc_m[m][1]);
  }
}

#else  // generic x86-64: scalar
template <int64_t TYPE>
inline void dequant_block_to(const uint8_t* blk, float* out) { dequant_block_scalar<TYPE>(blk, out); }

// (xsum unused: the scalar path dequantizes each block as gguf-py does and multiplies.)
template <int64_t TYPE, int MT>
void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t nblocks, const float* x, int64_t ldx, const float*,
              int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int64_t bb = TYPE == kQ8_0 ? 34 : TYPE == kQ4_1 ? 20 : 18;
  float wf[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float acc[MT] = {};
    for (int64_t b = 0; b < nblocks; ++b) {
      dequant_block_scalar<TYPE>(row + b * bb, wf);
      for (int m = 0; m < MT; ++m) {
        const float* xm = x + m * ldx + b * kBlock;
        float s = 0.f;
        for (int j = 0; j < kBlock; ++j) s += wf[j] * xm[j];
        acc[m] += s;
      }
    }
    for (int m = 0; m < MT; ++m) y[m * ldy + n] = acc[m];
  }
}
#endif

const char* isa_name() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "generic";
#endif
}

template <int64_t TYPE>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t nblocks, int64_t n0, int64_t n1, float* out) {
  constexpr int64_t bb = TYPE == kQ8_0 ? 34 : TYPE == kQ4_1 ? 20 : 18;
  const int64_t k = nblocks * kBlock;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < nblocks; ++b) dequant_block_to<TYPE>(w + n * row_bytes + b * bb, out + (n - n0) * k + b * kBlock);
}

template <int64_t TYPE>
void small_m_linear(const uint8_t* w, int64_t row_bytes, int64_t nblocks, int64_t n_rows, const float* x,
                    int64_t m_rows, float* y) {
  const int64_t k = nblocks * kBlock;
  // Block sums of x, [m_rows, nblocks]: Q4_1's m term (see dot_rows); the same for every weight row.
  std::vector<float> xsum(m_rows * nblocks);
  for (int64_t i = 0; TYPE == kQ4_1 && i < m_rows * nblocks; ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) s += x[i * kBlock + j];
    xsum[i] = s;
  }
  const float* xs = xsum.data();
  // Grain: enough rows per task that a thread streams a few KiB of weights between synchronizations.
  const int64_t grain = std::max<int64_t>(8, 16384 / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, n_rows, grain, [&](int64_t n0, int64_t n1) {
    int64_t m = 0;
    for (; m + 4 <= m_rows; m += 4)
      dot_rows<TYPE, 4>(w, row_bytes, nblocks, x + m * k, k, xs + m * nblocks, n0, n1, y + m * n_rows, n_rows);
    const float* xm = x + m * k;
    const float* xsm = xs + m * nblocks;
    float* ym = y + m * n_rows;
    switch (m_rows - m) {
      case 3: dot_rows<TYPE, 3>(w, row_bytes, nblocks, xm, k, xsm, n0, n1, ym, n_rows); break;
      case 2: dot_rows<TYPE, 2>(w, row_bytes, nblocks, xm, k, xsm, n0, n1, ym, n_rows); break;
      case 1: dot_rows<TYPE, 1>(w, row_bytes, nblocks, xm, k, xsm, n0, n1, ym, n_rows); break;
      default: break;
    }
  });
}

// Many rows: tiles of `tile` weight rows dequantized per thread (float32, then cast to x's dtype) and multiplied
// by the matmul library into the output's columns.
template <int64_t TYPE>
void tiled_linear(const uint8_t* w, int64_t row_bytes, int64_t nblocks, int64_t n_rows, const at::Tensor& x,
                  at::Tensor& y, int64_t tile) {
  const int64_t k = nblocks * kBlock;
  const int64_t tiles = (n_rows + tile - 1) / tile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    // The pool's threads do not inherit the caller's inference mode; the tensors made here are scratch.
    c10::InferenceMode guard;
    auto buffer = at::empty({tile, k}, at::kFloat);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, rows = std::min(tile, n_rows - n0);
      dequantize_rows<TYPE>(w, row_bytes, nblocks, n0, n0 + rows, buffer.data_ptr<float>());
      auto wt = buffer.narrow(0, 0, rows);
      auto out = y.narrow(1, n0, rows);
      if (x.scalar_type() == at::kFloat) {
        at::mm_out(out, x, wt.t());
      } else {
        out.copy_(at::mm(x, wt.to(x.scalar_type()).t()));
      }
    }
  });
}

template <typename F>
void dispatch_type(int64_t type, F&& f) {
  switch (type) {
    case kQ4_0: f(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ8_0: f(std::integral_constant<int64_t, kQ8_0>{}); break;
    default: block_bytes(type);  // raises naming the type
  }
}

int64_t check_weight(const at::Tensor& w, int64_t type) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "GGUF weight must be a contiguous uint8 [N, K / 32 * block_bytes] tensor");
  const int64_t bb = block_bytes(type);
  TORCH_CHECK(w.size(1) % bb == 0, "GGUF weight rows of ", w.size(1), " bytes are not whole ", bb, "-byte blocks");
  return w.size(1) / bb;
}

// y = x @ dequantize(w)^T (+ bias). x: [M, K] float32 or bfloat16; returns [M, N] in x's dtype.
// small_m_max: row counts up to this run the register path, above it the tiled matmul path.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t type, const c10::optional<at::Tensor>& bias,
                       int64_t small_m_max, int64_t tile) {
  const int64_t nblocks = check_weight(w, type);
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x.size(1) == nblocks * kBlock, "x has ", x.size(1), " features, the GGUF weight ", nblocks * kBlock);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(tile > 0, "tile must be positive");
  const int64_t m_rows = x.size(0), n_rows = w.size(0);
  at::Tensor y;
  if (m_rows <= small_m_max) {
    auto xf = x.to(at::kFloat).contiguous();
    auto yf = at::empty({m_rows, n_rows}, x.options().dtype(at::kFloat));
    if (m_rows > 0) {
      dispatch_type(type, [&](auto t) {
        small_m_linear<decltype(t)::value>(w.data_ptr<uint8_t>(), w.size(1), nblocks, n_rows, xf.data_ptr<float>(),
                                           m_rows, yf.data_ptr<float>());
      });
    }
    y = x.scalar_type() == at::kFloat ? yf : yf.to(x.scalar_type());
  } else {
    auto xc = x.contiguous();
    y = at::empty({m_rows, n_rows}, x.options());
    dispatch_type(type, [&](auto t) {
      tiled_linear<decltype(t)::value>(w.data_ptr<uint8_t>(), w.size(1), nblocks, n_rows, xc, y, tile);
    });
  }
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// dequantize(w) as float32 [N, K]: the large-batch path's tiles, and embedding rows.
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t type) {
  const int64_t nblocks = check_weight(w, type);
  const int64_t n_rows = w.size(0);
  auto out = at::empty({n_rows, nblocks * kBlock}, at::kFloat);
  dispatch_type(type, [&](auto t) {
    constexpr int64_t TYPE = decltype(t)::value;
    at::parallel_for(0, n_rows, 16, [&](int64_t n0, int64_t n1) {
      dequantize_rows<TYPE>(w.data_ptr<uint8_t>(), w.size(1), nblocks, n0, n1, out.data_ptr<float>() + n0 * nblocks * kBlock);
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_linear", &gguf_linear, "x @ dequantize(GGUF Q8_0/Q4_0/Q4_1 blocks)^T (CPU)", py::arg("x"),
        py::arg("weight"), py::arg("ggml_type"), py::arg("bias") = py::none(), py::arg("small_m_max") = 8,
        py::arg("tile") = 64);
  m.def("gguf_dequantize", &gguf_dequantize, "GGUF Q8_0/Q4_0/Q4_1 blocks to float32 [N, K] (CPU)");
  m.def("isa", &isa_name, "the SIMD path this build runs");
}
