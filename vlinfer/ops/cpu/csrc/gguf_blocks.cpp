// Linear layers on GGUF Q8_0 / Q4_0 / Q4_1 weights: y[M, N] = X(x)[M, K] @ W[N, K]^T with integer
// dot products per block. X(x) is x held as two int8 digits per element, per 32 along K: x ~ d *
// (q1 + q2 / 256), q1 the int8 of llama.cpp's Q8 rule (d = max|x| / 127) and q2 the int8 of what q1
// left (|x - d q1| <= d / 2). One digit, as llama.cpp has it, moves the real SmolLM2-135M's greedy
// answers (the first token of "What is the capital of France?" flips from "The" to "L'": llama.cpp
// answers "L'Étoile, la Cité, ..."); two leave a relative error of ~1e-5 of the block's largest
// value, under bf16 rounding, for twice the dot products: still far under the memory time. The op
// is defined by vlinfer/ops/reference/gguf.py (quantize_activations, gguf_linear); tests compare.
//
// Weights are repacked once at load (gguf_pack) from the file's block rows into groups of 16 output
// rows, so that one 512-bit integer dot product (vpdpbusd; vpmaddubsw + vpmaddwd without VNNI, two
// 256-bit halves on AVX2) takes four weights of each of the 16 rows against four activations
// broadcast to all of them, and every lane of the result belongs to one output row: no horizontal
// sums, each block's 16 scales one fp16 -> fp32 conversion. Per 16 rows x 32 weights that is 16 dot
// products, 8-12 unpacking operations and ~6 others, against 12 float operations per row x 32
// weights when each block was converted to float32 and multiplied with float activations
// (~6 GB/s, compute-bound). The packed layout has the same bytes per weight as the file (a group of
// 16 Q4_1 blocks of 20 bytes is 320 bytes: 256 of nibbles, 16 fp16 d, 16 fp16 m).
//
// Packed layout, uint8 [N, nblocks, block_bytes] (3-D, so a packed weight is never mistaken for the
// file's 2-D blocks): groups g = 0 .. N/16-1, then the N % 16 tail rows in the file's own row
// layout. Group g, block b at byte (g * nblocks + b) * 16 * block_bytes:
//   Q4_0 / Q4_1: 4 chunks p of 64 bytes, byte 4r + i of chunk p = qs[4p + i] of row r (low nibble:
//   weight 4p + i,
//                high nibble: weight 16 + 4p + i); then d[16] fp16; Q4_1 then m[16] fp16.
//   Q8_0:        8 chunks p of 64 bytes, byte 4r + i of chunk p = qs[4p + i] of row r plus 128
//   (unsigned); d[16].
// So chunk j's (unpacked) bytes always meet activations 4j .. 4j+3 of the block.
//
// Per block, with Q = 256 q1 + q2 the activations' integers, dx = d / 256 their unit and sq =
// sum(Q):
//   Q4_1:  y += dw * (dx * sum(u * Q)) + m * (dx * sq)         u = nibble
//   Q4_0:  y += dw * (dx * (sum(u * Q) - 8 * sq))              (the file's weight is (u - 8) * dw)
//   Q8_0:  y += dw * (dx * (sum(u * Q) - 128 * sq))            u = qs + 128
// sum(u * Q) = 256 sum(u * q1) + sum(u * q2) is exact in int32 (|.| < 2^31 for Q8_0's u <= 255), so
// results differ from the reference (a float32 matmul of X(x) and the dequantized weights) only by
// float32 rounding. Two accumulators per output (even and odd blocks) keep the FMA chain short.
// Dequantizing (embedding rows, which stay in the file's layout) follows gguf-py exactly; this file
// is built with -ffp-contract=off so the compiler fuses neither that `q * d + m` nor the
// activations' `x - q1 * d`. Work is split over groups with at::parallel_for. The SIMD path is
// chosen at compile time by the -m flags of the build (vlinfer/ops/cpu/gguf.py builds one extension
// per instruction-set level); the tail rows and the generic build run the scalar path, which is the
// same arithmetic in the same order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// ggml type ids (ggml.h: GGML_TYPE_Q4_0 = 2, Q4_1 = 3, Q8_0 = 8).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 16;  // output rows per packed group

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;  // fp16 d; uint8 qs[16]
    case kQ4_1: return 20;  // fp16 d, m; uint8 qs[16]
    case kQ8_0: return 34;  // fp16 d; int8 qs[32]
    default:
      TORCH_CHECK(false, "GGUF kernels take ggml types Q4_0 (2), Q4_1 (3) and Q8_0 (8), got ",
                  type);
  }
  return 0;
}

template <int64_t TYPE>
constexpr int64_t kBlockBytes = TYPE == kQ8_0 ? 34 : TYPE == kQ4_1 ? 20 : 18;
template <int64_t TYPE>
constexpr int64_t kQuantBytes = TYPE == kQ8_0 ? 32 : 16;  // bytes of quants per block
template <int64_t TYPE>
constexpr int32_t kOffset = TYPE == kQ8_0   ? 128
                            : TYPE == kQ4_0 ? 8
                                            : 0;  // the unsigned weight's zero

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// One block of the file's layout dequantized to 32 floats as gguf-py does. Element j < 16 of a Q4
// block is the low nibble of qs[j], element j + 16 its high nibble.
template <int64_t TYPE>
inline void dequant_block(const uint8_t* blk, float* out) {
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

// ---- the activations: two int8 digits per element, per 32 along K ----

struct QuantizedRows {
  std::vector<int8_t> q1, q2;  // [M, K] the digits: x ~ dx * (256 q1 + q2)
  std::vector<float> dx;       // [M, nblocks] the unit, max|x| / 127 / 256
  std::vector<int32_t> sq;     // [M, nblocks] sums of 256 q1 + q2
  std::vector<float> sx;       // [M, nblocks] dx * sq (Q4_1's m term)
};

// d = max|x| / 127, q1 = round-half-even(x * (1 / d)), q2 = round-half-even((x - q1 * d) * (256 /
// d)) clamped to
// [-127, 127]: the reference's quantize_activations to the bit (each product and difference rounded
// once).
QuantizedRows quantize_rows(const float* x, int64_t m_rows, int64_t k) {
  const int64_t nblocks = k / kBlock;
  QuantizedRows r{std::vector<int8_t>(m_rows * k), std::vector<int8_t>(m_rows * k),
                  std::vector<float>(m_rows * nblocks), std::vector<int32_t>(m_rows * nblocks),
                  std::vector<float>(m_rows * nblocks)};
  at::parallel_for(0, m_rows * nblocks, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* xb = x + i * kBlock;
      float amax = 0.f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.f;
      const float inv = d != 0.f ? 1.f / d : 0.f;
      const float inv256 = inv * 256.f;
      int32_t sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        const float q1 = std::nearbyint(xb[j] * inv);
        const float rest = xb[j] - q1 * d;
        const float q2 = std::min(127.f, std::max(-127.f, std::nearbyint(rest * inv256)));
        r.q1[i * kBlock + j] = static_cast<int8_t>(q1);
        r.q2[i * kBlock + j] = static_cast<int8_t>(q2);
        sum += 256 * static_cast<int32_t>(q1) + static_cast<int32_t>(q2);
      }
      r.dx[i] = d / 256.f;
      r.sq[i] = sum;
      r.sx[i] = r.dx[i] * static_cast<float>(sum);
    }
  });
  return r;
}

// ---- packing ----

template <int64_t TYPE>
void pack_group(const uint8_t* w, int64_t row_bytes, int64_t nblocks, int64_t g, uint8_t* out) {
  constexpr int64_t bb = kBlockBytes<TYPE>, qb = kQuantBytes<TYPE>;
  constexpr int64_t qoff = bb - qb;  // quants follow the scales in a file block
  for (int64_t b = 0; b < nblocks; ++b) {
    uint8_t* dst = out + (g * nblocks + b) * kGroup * bb;
    for (int64_t r = 0; r < kGroup; ++r) {
      const uint8_t* blk = w + (g * kGroup + r) * row_bytes + b * bb;
      for (int64_t p = 0; p < qb / 4; ++p)
        for (int i = 0; i < 4; ++i) {
          const uint8_t v = blk[qoff + 4 * p + i];
          dst[p * 64 + 4 * r + i] =
            TYPE == kQ8_0 ? static_cast<uint8_t>(v ^ 0x80) : v;  // int8 + 128
        }
      std::memcpy(dst + kGroup * qb + 2 * r, blk, 2);  // d
      if (TYPE == kQ4_1) std::memcpy(dst + kGroup * qb + 2 * kGroup + 2 * r, blk + 2, 2);  // m
    }
  }
}

// ---- one output row in the file's layout, scalar: the tail rows (N % 16) of every build ----

template <int64_t TYPE>
inline int32_t block_dot_scalar(const uint8_t* blk, const int8_t* q) {
  int32_t s = 0;
  if constexpr (TYPE == kQ8_0) {
    const uint8_t* qs = blk + 2;
    for (int j = 0; j < 32; ++j) s += (static_cast<int32_t>(qs[j] ^ 0x80)) * q[j];
  } else {
    const uint8_t* qs = blk + (TYPE == kQ4_1 ? 4 : 2);
    for (int j = 0; j < 16; ++j) s += (qs[j] & 0xF) * q[j] + (qs[j] >> 4) * q[j + 16];
  }
  return s;
}

// y[m * ldy] for activation rows [m0, m1) and one weight row in the file's layout.
template <int64_t TYPE>
void row_scalar(const uint8_t* row, int64_t nblocks, const QuantizedRows& a, int64_t m0, int64_t m1,
                float* y, int64_t ldy) {
  constexpr int64_t bb = kBlockBytes<TYPE>;
  const int64_t k = nblocks * kBlock;
  for (int64_t m = m0; m < m1; ++m) {
    float acc[2] = {0.f, 0.f};
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* blk = row + b * bb;
      const int64_t i = m * nblocks + b;
      const int64_t at = m * k + b * kBlock;
      const int32_t s = 256 * block_dot_scalar<TYPE>(blk, a.q1.data() + at) +
                        block_dot_scalar<TYPE>(blk, a.q2.data() + at) - kOffset<TYPE> * a.sq[i];
      float& c = acc[b & 1];
      c = std::fma(half_to_float(blk), static_cast<float>(s) * a.dx[i], c);
      if constexpr (TYPE == kQ4_1) c = std::fma(half_to_float(blk + 2), a.sx[i], c);
    }
    y[m * ldy] = acc[0] + acc[1];
  }
}

#if defined(__AVX512F__)
// 16 lanes = the group's 16 rows. The block's integer sum per lane: sum over chunks j of the 4
// unsigned weight bytes of w[j] times the 4 int8 activations xq[4j .. 4j+3], broadcast to every
// lane.
inline __m512i broadcast4(const int8_t* x4) {
  int32_t v;
  std::memcpy(&v, x4, 4);
  return _mm512_set1_epi32(v);
}

#if defined(__AVX512VNNI__)
template <int64_t TYPE>
inline __m512i block_dot(const __m512i w[8], const __mmask64*, const int8_t* xq) {
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int j = 0; j < 8; j += 2) {
    s0 = _mm512_dpbusd_epi32(s0, w[j], broadcast4(xq + 4 * j));
    s1 = _mm512_dpbusd_epi32(s1, w[j + 1], broadcast4(xq + 4 * j + 4));
  }
  return _mm512_add_epi32(s0, s1);
}
#else
// vpmaddubsw adds u8 x s8 pairs into int16: Q4 pairs stay within 2 * 15 * 127, but Q8_0's unsigned
// weights reach 2 * 255 * 127, so Q8_0 comes here as |w - 128| with w's sign moved onto x
// (`negative`: llama.cpp's vpsignb trick), which makes the sum signed: no 128 offset to take off.
template <int64_t TYPE>
inline __m512i block_dot(const __m512i w[8], const __mmask64* negative, const int8_t* xq) {
  const __m512i ones = _mm512_set1_epi16(1);
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int j = 0; j < 8; j += 2) {
    __m512i x0 = broadcast4(xq + 4 * j), x1 = broadcast4(xq + 4 * j + 4);
    if constexpr (TYPE == kQ8_0) {
      x0 = _mm512_mask_sub_epi8(x0, negative[j], _mm512_setzero_si512(), x0);
      x1 = _mm512_mask_sub_epi8(x1, negative[j + 1], _mm512_setzero_si512(), x1);
    }
    s0 = _mm512_add_epi32(s0, _mm512_madd_epi16(_mm512_maddubs_epi16(w[j], x0), ones));
    s1 = _mm512_add_epi32(s1, _mm512_madd_epi16(_mm512_maddubs_epi16(w[j + 1], x1), ones));
  }
  return _mm512_add_epi32(s0, s1);
}
#endif

template <int64_t TYPE, int MT>
void group_rows(const uint8_t* grp, int64_t nblocks, const QuantizedRows& a, int64_t m0, float* y,
                int64_t ldy) {
  constexpr int64_t gbb = kGroup * kBlockBytes<TYPE>, qb = kQuantBytes<TYPE>, chunks = qb / 4;
#if defined(__AVX512VNNI__)
  constexpr int32_t offset = kOffset<TYPE>;
#else
  constexpr int32_t offset = TYPE == kQ8_0 ? 0 : kOffset<TYPE>;  // Q8_0 went signed (block_dot)
#endif
  const int64_t k = nblocks * kBlock;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* blk = grp + b * gbb;
    __m512i w[8];
    __mmask64 negative[8];
    for (int p = 0; p < chunks; ++p) w[p] = _mm512_loadu_si512(blk + 64 * p);
    if constexpr (TYPE != kQ8_0) {
      for (int p = 0; p < 4; ++p) {
        w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(w[p], 4), low4);
        w[p] = _mm512_and_si512(w[p], low4);
      }
    }
#if !defined(__AVX512VNNI__)
    if constexpr (TYPE == kQ8_0) {
      for (int p = 0; p < 8; ++p) {
        const __m512i signed_w = _mm512_xor_si512(w[p], _mm512_set1_epi8(static_cast<char>(0x80)));
        negative[p] = _mm512_movepi8_mask(signed_w);
        w[p] = _mm512_abs_epi8(signed_w);
      }
    }
#endif
    const __m512 d =
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kGroup * qb)));
    __m512 mn = _mm512_setzero_ps();
    if constexpr (TYPE == kQ4_1)
      mn = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kGroup * qb + 2 * kGroup)));
    for (int m = 0; m < MT; ++m) {
      const int64_t i = (m0 + m) * nblocks + b, at = (m0 + m) * k + b * kBlock;
      __m512i s =
        _mm512_add_epi32(_mm512_slli_epi32(block_dot<TYPE>(w, negative, a.q1.data() + at), 8),
                         block_dot<TYPE>(w, negative, a.q2.data() + at));
      if constexpr (offset != 0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(offset * a.sq[i]));
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(a.dx[i]));
      __m512& c = acc[m][b & 1];
      c = _mm512_fmadd_ps(d, t, c);
      if constexpr (TYPE == kQ4_1) c = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.sx[i]), c);
    }
  }
  for (int m = 0; m < MT; ++m)
    _mm512_storeu_ps(y + (m0 + m) * ldy, _mm512_add_ps(acc[m][0], acc[m][1]));
}
constexpr int kRowsPerPass = 4;

#elif defined(__AVX2__)
// 8 lanes: the group is run as two halves of 8 rows (bytes 0..31 and 32..63 of each chunk, d[0..7]
// and d[8..15]). vpmaddubsw as in the AVX-512 build without VNNI: Q8_0 weights signed, their sign
// moved onto x (vpsignb).
inline __m256i broadcast4(const int8_t* x4) {
  int32_t v;
  std::memcpy(&v, x4, 4);
  return _mm256_set1_epi32(v);
}

template <int64_t TYPE>
inline __m256i block_dot(const __m256i w[8], const int8_t* xq) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
  for (int j = 0; j < 8; j += 2) {
    __m256i w0 = w[j], w1 = w[j + 1], x0 = broadcast4(xq + 4 * j), x1 = broadcast4(xq + 4 * j + 4);
    if constexpr (TYPE == kQ8_0) {
      x0 = _mm256_sign_epi8(x0, w0);
      x1 = _mm256_sign_epi8(x1, w1);
      w0 = _mm256_sign_epi8(w0, w0);
      w1 = _mm256_sign_epi8(w1, w1);
    }
    s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), ones));
    s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), ones));
  }
  return _mm256_add_epi32(s0, s1);
}

template <int64_t TYPE, int MT>
void group_rows(const uint8_t* grp, int64_t nblocks, const QuantizedRows& a, int64_t m0, float* y,
                int64_t ldy) {
  constexpr int64_t gbb = kGroup * kBlockBytes<TYPE>, qb = kQuantBytes<TYPE>, chunks = qb / 4;
  constexpr int32_t offset = TYPE == kQ8_0 ? 0 : kOffset<TYPE>;  // Q8_0 went signed
  const int64_t k = nblocks * kBlock;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* blk = grp + b * gbb;
      __m256i w[8];
      for (int p = 0; p < chunks; ++p)
        w[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * p + 32 * h));
      if constexpr (TYPE == kQ8_0) {
        for (int p = 0; p < 8; ++p)
          w[p] = _mm256_xor_si256(w[p], _mm256_set1_epi8(static_cast<char>(0x80)));
      } else {
        for (int p = 0; p < 4; ++p) {
          w[p + 4] = _mm256_and_si256(_mm256_srli_epi16(w[p], 4), low4);
          w[p] = _mm256_and_si256(w[p], low4);
        }
      }
      const __m256 d = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kGroup * qb + 16 * h)));
      __m256 mn = _mm256_setzero_ps();
      if constexpr (TYPE == kQ4_1)
        mn = _mm256_cvtph_ps(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(blk + kGroup * qb + 2 * kGroup + 16 * h)));
      for (int m = 0; m < MT; ++m) {
        const int64_t i = (m0 + m) * nblocks + b, at = (m0 + m) * k + b * kBlock;
        __m256i s = _mm256_add_epi32(_mm256_slli_epi32(block_dot<TYPE>(w, a.q1.data() + at), 8),
                                     block_dot<TYPE>(w, a.q2.data() + at));
        if constexpr (offset != 0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(offset * a.sq[i]));
        const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(a.dx[i]));
        __m256& c = acc[m][b & 1];
        c = _mm256_fmadd_ps(d, t, c);
        if constexpr (TYPE == kQ4_1) c = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.sx[i]), c);
      }
    }
    for (int m = 0; m < MT; ++m)
      _mm256_storeu_ps(y + (m0 + m) * ldy + 8 * h, _mm256_add_ps(acc[m][0], acc[m][1]));
  }
}
constexpr int kRowsPerPass = 2;

#else  // generic x86-64: each packed group's rows, scalar, in the same order as the SIMD lanes
template <int64_t TYPE>
inline int32_t packed_dot_scalar(const uint8_t* blk, int64_t r, const int8_t* xq) {
  int32_t s = 0;
  for (int64_t p = 0; p < kQuantBytes<TYPE> / 4; ++p)
    for (int j = 0; j < 4; ++j) {
      const uint8_t v = blk[p * 64 + 4 * r + j];
      if (TYPE == kQ8_0) {
        s += v * xq[4 * p + j];
      } else {
        s += (v & 0xF) * xq[4 * p + j] + (v >> 4) * xq[16 + 4 * p + j];
      }
    }
  return s;
}

template <int64_t TYPE, int MT>
void group_rows(const uint8_t* grp, int64_t nblocks, const QuantizedRows& a, int64_t m0, float* y,
                int64_t ldy) {
  constexpr int64_t gbb = kGroup * kBlockBytes<TYPE>, qb = kQuantBytes<TYPE>;
  const int64_t k = nblocks * kBlock;
  for (int64_t r = 0; r < kGroup; ++r)
    for (int m = 0; m < MT; ++m) {
      float acc[2] = {0.f, 0.f};
      for (int64_t b = 0; b < nblocks; ++b) {
        const uint8_t* blk = grp + b * gbb;
        const int64_t i = (m0 + m) * nblocks + b, at = (m0 + m) * k + b * kBlock;
        const int32_t s = 256 * packed_dot_scalar<TYPE>(blk, r, a.q1.data() + at) +
                          packed_dot_scalar<TYPE>(blk, r, a.q2.data() + at) -
                          kOffset<TYPE> * a.sq[i];
        float& c = acc[b & 1];
        c = std::fma(half_to_float(blk + kGroup * qb + 2 * r), static_cast<float>(s) * a.dx[i], c);
        if constexpr (TYPE == kQ4_1)
          c = std::fma(half_to_float(blk + kGroup * qb + 2 * kGroup + 2 * r), a.sx[i], c);
      }
      y[(m0 + m) * ldy + r] = acc[0] + acc[1];
    }
}
constexpr int kRowsPerPass = 1;
#endif

const char* isa_name() {
#if defined(__AVX512VNNI__)
  return "avx512-vnni";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "generic";
#endif
}

constexpr int64_t kRowsPerTile = 32;

template <int64_t TYPE>
void packed_linear(const uint8_t* w, int64_t n_rows, int64_t nblocks, const QuantizedRows& a,
                   int64_t m_rows, float* y) {
  constexpr int64_t bb = kBlockBytes<TYPE>;
  const int64_t groups = n_rows / kGroup, tail = n_rows % kGroup;
  const int64_t group_bytes = kGroup * nblocks * bb;
  const uint8_t* tail_rows = w + groups * group_bytes;
  // One task per group (and one for the tail): a group is 16 rows x K of weights, a few KiB to
  // stream. Within a thread, activation rows go in tiles of kRowsPerTile (their int8 rows stay in
  // L2 while the groups stream past).
  at::parallel_for(0, groups + (tail ? 1 : 0), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t m0 = 0; m0 < m_rows; m0 += kRowsPerTile) {
      const int64_t m1 = std::min(m_rows, m0 + kRowsPerTile);
      for (int64_t g = g0; g < g1; ++g) {
        if (g == groups) {
          for (int64_t r = 0; r < tail; ++r)
            row_scalar<TYPE>(tail_rows + r * nblocks * bb, nblocks, a, m0, m1,
                             y + groups * kGroup + r, n_rows);
          continue;
        }
        const uint8_t* grp = w + g * group_bytes;
        float* yg = y + g * kGroup;
        int64_t m = m0;
        for (; m + kRowsPerPass <= m1; m += kRowsPerPass)
          group_rows<TYPE, kRowsPerPass>(grp, nblocks, a, m, yg, n_rows);
        for (; m < m1; ++m) group_rows<TYPE, 1>(grp, nblocks, a, m, yg, n_rows);
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
  TORCH_CHECK(w.size(1) % bb == 0, "GGUF weight rows of ", w.size(1), " bytes are not whole ", bb,
              "-byte blocks");
  return w.size(1) / bb;
}

// The file's blocks [N, nblocks * block_bytes] -> the packed layout [N, nblocks, block_bytes] (see
// the top).
at::Tensor gguf_pack(const at::Tensor& w, int64_t type) {
  const int64_t nblocks = check_weight(w, type);
  const int64_t n_rows = w.size(0), bb = block_bytes(type);
  auto out = at::empty({n_rows, nblocks, bb}, w.options());
  const int64_t groups = n_rows / kGroup;
  uint8_t* dst = out.data_ptr<uint8_t>();
  const uint8_t* src = w.data_ptr<uint8_t>();
  dispatch_type(type, [&](auto t) {
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        pack_group<decltype(t)::value>(src, w.size(1), nblocks, g, dst);
    });
  });
  std::memcpy(dst + groups * kGroup * w.size(1), src + groups * kGroup * w.size(1),
              (n_rows % kGroup) * w.size(1));
  return out;
}

// y = X(x) @ dequantize(w)^T (* row_scale) (+ bias), X(x) the two-digit activations (top of the
// file). x: [M, K] in any float dtype; w: packed (gguf_pack); y in x's dtype. row_scale (float32
// [N]) scales each output feature before the cast: per-channel int8 weights run here as Q8_0 blocks
// of d = 1 (exact) times their channel's scale.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t type,
                       const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& row_scale) {
  TORCH_CHECK(
    w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() &&
      w.size(2) == block_bytes(type),
    "gguf_linear takes a weight packed by gguf_pack (uint8 [N, K / 32, block_bytes]); got ",
    w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t nblocks = w.size(1);
  TORCH_CHECK(x.size(1) == nblocks * kBlock, "x has ", x.size(1), " features, the GGUF weight ",
              nblocks * kBlock);
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be a floating-point tensor");
  const int64_t m_rows = x.size(0), n_rows = w.size(0);
  auto xf = x.to(at::kFloat).contiguous();
  auto yf = at::empty({m_rows, n_rows}, x.options().dtype(at::kFloat));
  if (m_rows > 0 && n_rows > 0) {
    const QuantizedRows a = quantize_rows(xf.data_ptr<float>(), m_rows, nblocks * kBlock);
    dispatch_type(type, [&](auto t) {
      packed_linear<decltype(t)::value>(w.data_ptr<uint8_t>(), n_rows, nblocks, a, m_rows,
                                        yf.data_ptr<float>());
    });
  }
  if (row_scale.has_value() && row_scale->defined()) {
    TORCH_CHECK(row_scale->scalar_type() == at::kFloat && row_scale->dim() == 1 &&
                  row_scale->size(0) == n_rows,
                "row_scale must be float32 [", n_rows, "], got ", row_scale->scalar_type(), " ",
                row_scale->sizes());
    yf.mul_(*row_scale);
  }
  at::Tensor y = x.scalar_type() == at::kFloat ? yf : yf.to(x.scalar_type());
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// ---- int8 per-channel weights against bfloat16 activations: AVX512-BF16 builds ----
// Where the CPU has vdpbf16ps, bf16 activations meet an int8 layer (Q8_0 blocks of d = 1,
// gguf_reference.q8_0_blocks) as bf16 too: each task turns one or two 16-row groups into bf16
// "panels" (an int8 weight is exact in bf16) and runs every activation row against them, so each
// conversion is paid once per call and row count, not per row. Beyond a dozen rows this outruns the
// two-digit integer dots (two products per weight and the activations' quantization) and, per row,
// matches the prepacked bf16 matmul (measured in ops/cpu/quant.py). No activation quantization: the
// products are exact in float32, accumulated in float32, times the channel scale, plus the bias,
// rounded once to bf16.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr bool kBf16Panels = true;
constexpr int kPanelRows =
  8;  // activation rows per tile: 8 x 2 accumulators, 2 panel vectors, 1 broadcast
constexpr int kPanelGroups = 2;  // 16-row groups per task

// Group `grp`'s Q8_0 blocks (unsigned bytes q + 128, chunk p holding weights 4p .. 4p+3 of each
// row) -> panel[kp], 16 dwords: dword r = (w[r][2kp], w[r][2kp + 1]) as two bf16. |q| <= 128 is
// exact in bf16, so the bf16 is the float's upper half and no rounding happens.
inline void group_panel_bf16(const uint8_t* grp, int64_t nblocks, __m512i* panel) {
  constexpr int64_t gbb = kGroup * kBlockBytes<kQ8_0>;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int p = 0; p < 8; ++p) {
      const __m512i v =
        _mm512_xor_si512(_mm512_loadu_si512(grp + b * gbb + 64 * p), flip);  // int8 q, 4 per row
      __m512i w[4];
      for (int i = 0; i < 4; ++i) {
        const __m512i q = _mm512_srai_epi32(i == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * i), 24);
        w[i] = _mm512_castps_si512(_mm512_cvtepi32_ps(q));
      }
      panel[16 * b + 2 * p] =
        _mm512_or_si512(_mm512_srli_epi32(w[0], 16), _mm512_and_si512(w[1], high));
      panel[16 * b + 2 * p + 1] =
        _mm512_or_si512(_mm512_srli_epi32(w[2], 16), _mm512_and_si512(w[3], high));
    }
  }
}

// R activation rows x C groups: lane j of acc[r][c] is output feature 16 c + j of row r. Per pair
// of K, one panel vector per group and the rows' pair broadcast to all lanes: no horizontal sums.
template <int R, int C>
void panel_tile(const uint32_t* x, int64_t kpairs, const __m512i* panel, const float* scale,
                const float* bias, c10::BFloat16* y, int64_t ldy) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    __m512bh w[C];
    for (int c = 0; c < C; ++c) w[c] = (__m512bh)_mm512_loadu_si512(panel + c * kpairs + kp);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * kpairs + kp]));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, w[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const __m512 s = _mm512_loadu_ps(scale + 16 * c);
    const __m512 bv = bias ? _mm512_loadu_ps(bias + 16 * c) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[r][c], s, bv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + 16 * c), (__m256i)out);
    }
  }
}

template <int C>
void panel_rows(const uint32_t* x, int64_t m_rows, int64_t kpairs, const __m512i* panel,
                const float* scale, const float* bias, c10::BFloat16* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + kPanelRows <= m_rows; m += kPanelRows)
    panel_tile<kPanelRows, C>(x + m * kpairs, kpairs, panel, scale, bias, y + m * ldy, ldy);
  const int64_t rest = m_rows - m;
  x += m * kpairs;
  y += m * ldy;
  switch (rest) {  // the last rows, on a tile of their own size
    case 1: panel_tile<1, C>(x, kpairs, panel, scale, bias, y, ldy); break;
    case 2: panel_tile<2, C>(x, kpairs, panel, scale, bias, y, ldy); break;
    case 3: panel_tile<3, C>(x, kpairs, panel, scale, bias, y, ldy); break;
    case 4: panel_tile<4, C>(x, kpairs, panel, scale, bias, y, ldy); break;
    case 5: panel_tile<5, C>(x, kpairs, panel, scale, bias, y, ldy); break;
    case 6: panel_tile<6, C>(x, kpairs, panel, scale, bias, y, ldy); break;
    case 7: panel_tile<7, C>(x, kpairs, panel, scale, bias, y, ldy); break;
    default: break;
  }
}

void int8_bf16_groups(const uint16_t* x, int64_t m_rows, const uint8_t* w, int64_t groups,
                      int64_t nblocks, const float* scale, const float* bias, c10::BFloat16* y,
                      int64_t n_rows) {
  const int64_t kpairs = nblocks * kBlock / 2, group_bytes = kGroup * nblocks * kBlockBytes<kQ8_0>;
  const auto* x32 = reinterpret_cast<const uint32_t*>(x);
  const int64_t tasks = (groups + kPanelGroups - 1) / kPanelGroups;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<__m512i> panel(kPanelGroups * kpairs);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t * kPanelGroups, count = std::min<int64_t>(kPanelGroups, groups - g);
      for (int64_t c = 0; c < count; ++c)
        group_panel_bf16(w + (g + c) * group_bytes, nblocks, panel.data() + c * kpairs);
      const float* bias_g = bias ? bias + g * kGroup : nullptr;
      if (count == 2)
        panel_rows<2>(x32, m_rows, kpairs, panel.data(), scale + g * kGroup, bias_g, y + g * kGroup,
                      n_rows);
      else
        panel_rows<1>(x32, m_rows, kpairs, panel.data(), scale + g * kGroup, bias_g, y + g * kGroup,
                      n_rows);
    }
  });
}
#else
constexpr bool kBf16Panels = false;
#endif

// y = x @ (q * row_scale)^T (+ bias) for bf16 x and an int8 per-channel layer packed as Q8_0 blocks
// of d = 1, on the bf16 panels above (AVX512-BF16 builds only: `bf16_panels_available`). The N % 16
// tail rows, in the file's layout, are scalar.
at::Tensor int8_linear_bf16(const at::Tensor& x, const at::Tensor& w, const at::Tensor& row_scale,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kBf16Panels, "int8_linear_bf16 needs an AVX512-BF16 build of the GGUF kernels");
  TORCH_CHECK(
    w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() &&
      w.size(2) == kBlockBytes<kQ8_0>,
    "int8_linear_bf16 takes Q8_0 blocks packed by gguf_pack (uint8 [N, K / 32, 34]); got ",
    w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bfloat16 [M, K]");
  const int64_t nblocks = w.size(1), m_rows = x.size(0), n_rows = w.size(0), k = nblocks * kBlock;
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " features, the int8 weight ", k);
  TORCH_CHECK(
    row_scale.scalar_type() == at::kFloat && row_scale.dim() == 1 && row_scale.size(0) == n_rows,
    "row_scale must be float32 [", n_rows, "], got ", row_scale.scalar_type(), " ",
    row_scale.sizes());
  auto xc = x.contiguous();
  auto scale = row_scale.contiguous();
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n_rows, "bias must be [", n_rows, "]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto y = at::empty({m_rows, n_rows}, x.options());
  if (m_rows == 0 || n_rows == 0) return y;
  const int64_t groups = n_rows / kGroup;
  auto* yp = y.data_ptr<c10::BFloat16>();
  const auto* xp = xc.data_ptr<c10::BFloat16>();
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  int8_bf16_groups(reinterpret_cast<const uint16_t*>(xp), m_rows, w.data_ptr<uint8_t>(), groups,
                   nblocks, scale.data_ptr<float>(), bp, yp, n_rows);
#endif
  // Tail rows in the file's layout: d (fp16, 1) then 32 int8 per block.
  const uint8_t* tail = w.data_ptr<uint8_t>() + groups * kGroup * nblocks * kBlockBytes<kQ8_0>;
  for (int64_t r = 0; r < n_rows - groups * kGroup; ++r) {
    const int64_t n = groups * kGroup + r;
    for (int64_t m = 0; m < m_rows; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nblocks; ++b) {
        const int8_t* qs =
          reinterpret_cast<const int8_t*>(tail + (r * nblocks + b) * kBlockBytes<kQ8_0> + 2);
        for (int j = 0; j < kBlock; ++j)
          acc += static_cast<float>(xp[m * k + b * kBlock + j]) * qs[j];
      }
      yp[m * n_rows + n] =
        static_cast<c10::BFloat16>(acc * scale.data_ptr<float>()[n] + (bp ? bp[n] : 0.f));
    }
  }
  return y;
}

// dequantize(w) as float32 [N, K] from the file's layout: embedding rows.
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t type) {
  const int64_t nblocks = check_weight(w, type);
  const int64_t n_rows = w.size(0), row_bytes = w.size(1);
  auto out = at::empty({n_rows, nblocks * kBlock}, at::kFloat);
  dispatch_type(type, [&](auto t) {
    constexpr int64_t TYPE = decltype(t)::value;
    at::parallel_for(0, n_rows, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t b = 0; b < nblocks; ++b)
          dequant_block<TYPE>(w.data_ptr<uint8_t>() + n * row_bytes + b * kBlockBytes<TYPE>,
                              out.data_ptr<float>() + (n * nblocks + b) * kBlock);
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_pack", &gguf_pack, "GGUF Q8_0/Q4_0/Q4_1 blocks to the kernel's 16-row groups (CPU)");
  m.def("gguf_linear", &gguf_linear,
        "int8 activations per 32 @ packed GGUF Q8_0/Q4_0/Q4_1 weights^T (CPU)", py::arg("x"),
        py::arg("weight"), py::arg("ggml_type"), py::arg("bias") = py::none(),
        py::arg("row_scale") = py::none());
  m.def("gguf_dequantize", &gguf_dequantize, "GGUF Q8_0/Q4_0/Q4_1 blocks to float32 [N, K] (CPU)");
  m.def("int8_linear_bf16", &int8_linear_bf16,
        "bf16 x @ (int8 Q8_0 blocks of d = 1 * row_scale)^T (+ bias) (CPU, "
        "AVX512-BF16)",
        py::arg("x"), py::arg("weight"), py::arg("row_scale"), py::arg("bias") = py::none());
  m.def(
    "bf16_panels_available", [] { return kBf16Panels; },
    "built with AVX512-BF16: int8_linear_bf16 runs");
  m.def("isa", &isa_name, "the SIMD path this build runs");
}
