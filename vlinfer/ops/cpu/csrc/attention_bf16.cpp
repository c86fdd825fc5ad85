// bfloat16 attention on CPUs with AVX512-BF16 (vdpbf16ps: bf16 pair dot products into float32
// lanes).
//
// 1. Paged decode attention (the engine's decode step): per (sequence, kv head) the keys and values
// are read once
//    for all query heads of the group; scores by bf16 dot products, softmax and the value sum in
//    float32. The generic kernel in paged_ops.cpp converts every element to float first and ran at
//    ~7 GB/s of KV here, a third of a decode step.
// 2. A flash-attention loop (online softmax over key blocks, float32 scores and accumulators, both
// matmuls on
//    vdpbf16ps) for the vision tower's bidirectional attention within packed segments and for
//    causal prefill chunks over the paged cache. Why not SDPA: torch's CPU flash kernel runs these
//    shapes at about a third of this CPU's bf16 matmul rate without AMX, and the vision tower spent
//    ~40% of its time there.
//
// Rounding follows torch's flash kernel: scores and the softmax in float32, probabilities rounded
// to bfloat16 for the P.V product, the row sum taken before that rounding, the output normalized in
// float32 and rounded once. The block sizes differ from torch's, so results differ from SDPA at
// bfloat16 resolution (tests bound it).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define VLINFER_BF16_ATTENTION 1
#endif

#include "decode_vectors.h"

namespace {

#ifdef VLINFER_BF16_ATTENTION

constexpr int64_t kBlockQ =
  48;  // query rows per work item (a multiple of 12: both microkernels' row counts)
constexpr int64_t kBlockK =
  256;  // keys per online-softmax step (a multiple of the 64-key score tile)
constexpr int kScoreRows = 6;     // query rows per score tile (6 x 64 keys = 24 accumulators)
constexpr int64_t kMaxVectors = 8;  // head_dim up to 128 (padded to 16-lane vectors)

inline __m512bh broadcast_pair(const uint16_t* pair) {
  int32_t bits;
  std::memcpy(&bits, pair, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}

// The unnormalized softmax terms of one row: p[t] = bf16(exp(s[t] - m)) for t < n (a multiple of
// 16); returns their float32 sum, taken before the rounding as torch's flash kernel does.
inline float exp_row_bf16(const float* s, float m, uint16_t* p, int64_t n) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), (__m256i)_mm512_cvtneps_pbh(e));
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// scores[R][64] = scale * q[R][Dp] . keys^T for 64 keys, keys from valid[r] on masked to kLowest,
// and each row's running block maximum updated while the tile is in registers. Keys are packed in
// groups of 16 as [d_pair][16][2], the layout vdpbf16ps wants for a 16-lane column of dot products;
// q rows are broadcast a bf16 pair at a time.
template <int R, bool kMasked>
inline void qk_tile(const uint16_t* q, int64_t dp, const uint16_t* keys, float scale,
                    const int64_t* valid, float* scores, int64_t ld, float* block_max) {
  const int64_t pairs = dp / 2;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh k[4];
    for (int c = 0; c < 4; ++c) k[c] = (__m512bh)_mm512_loadu_si512(keys + (c * pairs + p) * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh qp = broadcast_pair(q + r * dp + 2 * p);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qp, k[c]);
    }
  }
  const __m512 lowest = _mm512_set1_ps(kLowest), s = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    __mmask16 live[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
    if (kMasked) {
      for (int c = 0; c < 4; ++c) {
        const int64_t left = valid[r] - c * 16;
        live[c] = left <= 0 ? 0 : (left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1));
      }
    }
    __m512 mx = lowest;
    for (int c = 0; c < 4; ++c) {
      const __m512 x = _mm512_mask_mul_ps(lowest, live[c], acc[r][c], s);
      _mm512_storeu_ps(scores + r * ld + c * 16, x);
      mx = _mm512_max_ps(mx, x);
    }
    block_max[r] = std::max(block_max[r], _mm512_reduce_max_ps(mx));
  }
}

// out[R][Dp] = alpha[r] * out[r] + probs[R][0:2*pairs] . values. Values are packed per key pair as
// [Dp][2].
template <int R, int NV>
inline void pv_tile(const uint16_t* probs, int64_t ld, const uint16_t* values, int64_t pairs,
                    const float* alpha, float* out) {
  constexpr int64_t dp = NV * 16;
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int v = 0; v < NV; ++v)
      acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(out + r * dp + v * 16), a);
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh val[NV];
    for (int v = 0; v < NV; ++v)
      val[v] = (__m512bh)_mm512_loadu_si512(values + (p * dp + v * 16) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512bh pr = broadcast_pair(probs + r * ld + 2 * p);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pr, val[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + r * dp + v * 16, acc[r][v]);
}

template <int NV>
void pv_rows(const uint16_t* probs, const uint16_t* values, int64_t pairs, const float* alpha,
             float* out, int64_t rows) {
  // Rows per tile so that R * NV accumulators stay within the 32 vector registers; 12 | kBlockQ
  // rows padded.
  constexpr int R = NV <= 4 ? 6 : (NV <= 6 ? 4 : 3);
  for (int64_t r = 0; r < rows; r += R)
    pv_tile<R, NV>(probs + r * kBlockK, kBlockK, values, pairs, alpha + r, out + r * NV * 16);
}

using PvRows = void (*)(const uint16_t*, const uint16_t*, int64_t, const float*, float*, int64_t);
constexpr PvRows kPvRows[kMaxVectors + 1] = {nullptr,    pv_rows<1>, pv_rows<2>,
                                             pv_rows<3>, pv_rows<4>, pv_rows<5>,
                                             pv_rows<6>, pv_rows<7>, pv_rows<8>};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Keys and values of every kv head packed for the two microkernels, zero-padded to whole key blocks
// and to dp.
struct PackedKV {
  int64_t n, nk, dp;  // keys, keys padded to kBlockK, head_dim padded to 16
  std::vector<uint16_t> k, v;
};

// Keys [group of 16 keys][pair][16][2]: the 16 keys' bf16 pair p is one 32-bit gather over their
// rows. Rows past n (in the last group) and pairs past d read nothing and are zero. Even d only
// (pairs never straddle a row end).
template <typename RowFn>
void pack_keys(uint32_t* dst, int64_t n, int64_t nk, int64_t dp, int64_t d, const uint16_t* k,
               int64_t h, RowFn row) {
  const int64_t pairs = dp / 2, full_pairs = d / 2;
  for (int64_t g = 0; g * 16 < n; ++g) {
    int64_t offsets[16];
    const int64_t live = std::min<int64_t>(16, n - g * 16);
    for (int64_t i = 0; i < 16; ++i) offsets[i] = i < live ? row(g * 16 + i, h) * 2 : 0;  // bytes
    const __m512i lo = _mm512_loadu_si512(offsets), hi = _mm512_loadu_si512(offsets + 8);
    const __mmask8 m_lo = static_cast<__mmask8>(live >= 8 ? 0xFF : (1u << live) - 1);
    const __mmask8 m_hi = static_cast<__mmask8>(live >= 16  ? 0xFF
                                                : live <= 8 ? 0
                                                            : (1u << (live - 8)) - 1);
    uint32_t* out = dst + g * pairs * 16;
    for (int64_t p = 0; p < full_pairs; ++p) {
      const void* base = k + 2 * p;
      const __m256i a = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), m_lo, lo, base, 1);
      const __m256i b = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), m_hi, hi, base, 1);
      _mm512_storeu_si512(out + p * 16, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
    }
    std::memset(out + full_pairs * 16, 0, (pairs - full_pairs) * 16 * sizeof(uint32_t));
  }
  const int64_t used = (n + 15) / 16 * pairs * 16;
  std::memset(dst + used, 0, (nk / 16 * pairs * 16 - used) * sizeof(uint32_t));
}

// Values [key pair][dp][2]: rows j and j + 1 interleaved element by element (a zero row after an
// odd last key).
template <typename RowFn>
void pack_values(uint16_t* dst, int64_t n, int64_t nk, int64_t dp, int64_t d, const uint16_t* v,
                 int64_t h, RowFn row) {
  alignas(64) static constexpr uint16_t kLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                   37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                   11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                   53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                   27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo_idx = _mm512_load_si512(kLo), hi_idx = _mm512_load_si512(kHi);
  for (int64_t j = 0; j < n; j += 2) {
    const uint16_t* a = v + row(j, h);
    const uint16_t* b = j + 1 < n ? v + row(j + 1, h) : nullptr;
    uint16_t* out = dst + (j / 2) * dp * 2;
    for (int64_t e = 0; e < dp; e += 32) {
      const int64_t left = std::max<int64_t>(0, std::min<int64_t>(32, d - e));
      const __mmask32 m = static_cast<__mmask32>(left >= 32 ? 0xFFFFFFFFu : (1u << left) - 1);
      const __m512i x = _mm512_maskz_loadu_epi16(m, a + e);
      const __m512i y = b ? _mm512_maskz_loadu_epi16(m, b + e) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * e, _mm512_permutex2var_epi16(x, lo_idx, y));
      if (dp - e > 16)
        _mm512_storeu_si512(out + 2 * e + 32, _mm512_permutex2var_epi16(x, hi_idx, y));
    }
  }
  const int64_t used = (n + 1) / 2 * dp * 2;
  std::memset(dst + used, 0, (nk * dp - used) * sizeof(uint16_t));
}

// row(j, h) -> offset of key j of kv head h in k (values: the same offset in v). Every element is
// written, the padding as zeros, so the buffers are reused across calls without clearing.
template <typename RowFn>
void pack_kv(PackedKV& kv, int64_t n, int64_t kv_heads, int64_t d, const uint16_t* k,
             const uint16_t* v, RowFn row) {
  TORCH_CHECK(d % 2 == 0, "bf16 attention: head_dim must be even");
  kv.n = n;
  kv.nk = round_up(n, kBlockK);
  kv.dp = round_up(d, 16);
  const int64_t size = kv.nk * kv.dp;
  kv.k.resize(kv_heads * size);
  kv.v.resize(kv_heads * size);
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      pack_keys(reinterpret_cast<uint32_t*>(kv.k.data() + h * size), n, kv.nk, kv.dp, d, k, h, row);
      pack_values(kv.v.data() + h * size, n, kv.nk, kv.dp, d, v, h, row);
    }
  });
}

// Queries q [n_q, heads, d] (strides q_st, q_sh) against packed keys/values; query head h reads kv
// head h / (heads / kv_heads). causal: query i sits at absolute position q_pos0 + i and sees keys
// 0..that position; otherwise every query sees every key. Work items are (head, block of kBlockQ
// queries), in parallel.
void flash_attention(const uint16_t* q, int64_t q_st, int64_t q_sh, int64_t n_q, int64_t heads,
                     int64_t kv_heads, int64_t d, const PackedKV& kv, bool causal, int64_t q_pos0,
                     float scale, uint16_t* out, int64_t o_st, int64_t o_sh) {
  const int64_t dp = kv.dp, group = heads / kv_heads, q_blocks = (n_q + kBlockQ - 1) / kBlockQ;
  const PvRows pv_rows_fn = kPvRows[dp / 16];
  at::parallel_for(0, heads * q_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> qbuf(kBlockQ * dp), probs(kBlockQ * kBlockK);
    std::vector<float> scores(kBlockQ * kBlockK), acc(kBlockQ * dp), row_max(kBlockQ),
      row_sum(kBlockQ), alpha(kBlockQ), block_max(kBlockQ);
    std::vector<int64_t> row_keys(kBlockQ);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t h = work / q_blocks, q0 = (work % q_blocks) * kBlockQ;
      const int64_t rows = std::min(kBlockQ, n_q - q0), rows_padded = round_up(rows, 12);
      // Keys this block of queries sees at all, and each row's own count (padding rows: all,
      // unused).
      const int64_t n_keys = causal ? std::min(kv.n, q_pos0 + q0 + rows) : kv.n;
      for (int64_t i = 0; i < kBlockQ; ++i)
        row_keys[i] = causal && i < rows ? q_pos0 + q0 + i + 1 : n_keys;
      std::fill(qbuf.begin(), qbuf.end(), 0);
      for (int64_t i = 0; i < rows; ++i)
        std::memcpy(qbuf.data() + i * dp, q + (q0 + i) * q_st + h * q_sh, d * sizeof(uint16_t));
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), kLowest);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      std::fill(probs.begin(), probs.end(), 0);
      std::fill(alpha.begin(), alpha.end(), 1.f);
      const uint16_t* pk = kv.k.data() + (h / group) * kv.nk * dp;
      const uint16_t* pv = kv.v.data() + (h / group) * kv.nk * dp;

      for (int64_t k0 = 0; k0 < n_keys; k0 += kBlockK) {
        const int64_t keys = std::min(kBlockK, n_keys - k0), cols = round_up(keys, 64);
        std::fill(block_max.begin(), block_max.end(), kLowest);
        for (int64_t r = 0; r < rows_padded; r += kScoreRows)
          for (int64_t c = 0; c < cols; c += 64) {
            int64_t valid[kScoreRows];
            bool full = true;
            for (int i = 0; i < kScoreRows; ++i) {
              valid[i] = std::min(keys, row_keys[r + i] - k0) - c;
              full = full && valid[i] >= 64;
            }
            if (full)  // every tile but the last of a row of blocks, and the causal diagonal's
              qk_tile<kScoreRows, false>(qbuf.data() + r * dp, dp, pk + (k0 + c) * dp, scale, valid,
                                         scores.data() + r * kBlockK + c, kBlockK,
                                         block_max.data() + r);
            else
              qk_tile<kScoreRows, true>(qbuf.data() + r * dp, dp, pk + (k0 + c) * dp, scale, valid,
                                        scores.data() + r * kBlockK + c, kBlockK,
                                        block_max.data() + r);
          }
        for (int64_t i = 0; i < rows; ++i) {
          // Key 0 is always visible, so row_max is finite from the first block on; a later block a
          // causal row cannot see at all leaves it unchanged (alpha 1) and adds zeros.
          const float m_new = std::max(row_max[i], block_max[i]);
          alpha[i] = std::exp(row_max[i] - m_new);  // 0 on the first block (row_max = lowest)
          row_max[i] = m_new;
          row_sum[i] = row_sum[i] * alpha[i] + exp_row_bf16(scores.data() + i * kBlockK, m_new,
                                                            probs.data() + i * kBlockK, cols);
        }
        pv_rows_fn(probs.data(), pv + k0 * dp, cols / 2, alpha.data(), acc.data(), rows_padded);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const __m512 inv = _mm512_set1_ps(1.f / row_sum[i]);
        uint16_t* o = out + (q0 + i) * o_st + h * o_sh;
        for (int64_t e = 0; e < dp; e += 16) {
          const __m256bh y =
            _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc.data() + i * dp + e), inv));
          uint16_t lanes[16];
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), (__m256i)y);
          std::memcpy(o + e, lanes, std::min<int64_t>(16, d - e) * sizeof(uint16_t));
        }
      }
    }
  });
}

// ----------------------------------------------------------------------------------------- paged
// decode attention

// One (sequence, kv head): NB = head_dim / 32 bf16 vectors per row. Query heads of the group are
// served in chunks of kHeadsPerPass so their float32 value accumulators stay in registers.
template <int NB>
void decode_one(const uint16_t* q, int64_t q_stride_h, int64_t group, const uint16_t* k_base,
                const uint16_t* v_base, const int32_t* table, int64_t block_size,
                int64_t c_stride_block, int64_t c_stride_tok, int64_t len, float scale,
                uint16_t* out, int64_t o_stride_h, const HeadPrefetch& fetch,
                std::vector<float>& scores, std::vector<uint16_t>& probs,
                std::vector<float>& inv_sum) {
  constexpr int64_t kHeadsPerPass = 8 / NB;  // 16 accumulators
  const int64_t padded = round_up(len, 16);
  scores.resize(group * padded);
  probs.resize(group * padded);
  const RowCursor start{table, block_size, c_stride_block, c_stride_tok};
  // Scores, 16 tokens at a time: per query head, 16 dot products whose lanes one transpose-and-add
  // sums (sum16), not 16 horizontal reductions (a quarter of the kernel's time). The tile's key
  // rows stay in L1 across heads.
  const __m512 vscale = _mm512_set1_ps(scale);
  RowCursor cur = start, pre = start.ahead(kPrefetch);
  const uint16_t* rows[16];
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    next_rows16(cur, pre, k_base, t0, len, fetch, rows);  // lanes past the end: masked below
    for (int64_t g = 0; g < group; ++g) {
      const uint16_t* qg = q + g * q_stride_h;
      __m512bh qv[NB];
      for (int i = 0; i < NB; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(qg + 32 * i);
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        acc[j] =
          _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(rows[j]));
        for (int i = 1; i < NB; ++i)
          acc[j] = _mm512_dpbf16_ps(acc[j], qv[i], (__m512bh)_mm512_loadu_si512(rows[j] + 32 * i));
      }
      _mm512_storeu_ps(scores.data() + g * padded + t0, _mm512_mul_ps(sum16(acc), vscale));
    }
  }
  // Softmax, unnormalized (the value sum is divided by the row sum at the end); the probabilities
  // are rounded to bf16 for the value product, as the reference does.
  inv_sum.resize(group);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * padded;
    for (int64_t t = len; t < padded; ++t) s[t] = kLowest;
    __m512 mx = _mm512_set1_ps(kLowest);
    for (int64_t t = 0; t < padded; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
    inv_sum[g] = 1.f / exp_row_bf16(s, _mm512_reduce_max_ps(mx), probs.data() + g * padded, padded);
  }
  // Values, two tokens at a time: rows t and t+1 interleaved element-wise are the (v[t][d],
  // v[t+1][d]) pairs that vdpbf16ps multiplies by the (p[t], p[t+1]) pair. unpacklo/hi work within
  // 128-bit lanes, so of each 32 values the lo accumulator holds d = 8j..8j+3 and the hi one d =
  // 8j+4..8j+7 in lane j; put back in order at the end.
  const __m512i zero = _mm512_setzero_si512();
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
    _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
    const int64_t heads = std::min(kHeadsPerPass, group - g0);
    __m512 acc[kHeadsPerPass][2 * NB];
    for (int64_t h = 0; h < kHeadsPerPass; ++h)
      for (int j = 0; j < 2 * NB; ++j) acc[h][j] = _mm512_setzero_ps();
    RowCursor cur = start, pre = start.ahead(kPrefetch);
    for (int64_t t = 0; t < len; t += 2) {
      const uint16_t* v0 = cur.row(v_base);
      cur.next();
      const uint16_t* v1 = t + 1 < len ? cur.row(v_base) : nullptr;
      cur.next();
      for (int64_t ahead = t + kPrefetch; ahead < std::min(t + kPrefetch + 2, len);
           ++ahead, pre.next())
        prefetch_lines(pre.row(v_base) - fetch.offset, fetch.lines);
      __m512bh pairs[2 * NB];
      for (int i = 0; i < NB; ++i) {
        const __m512i a = _mm512_loadu_si512(v0 + 32 * i),
                      b = v1 ? _mm512_loadu_si512(v1 + 32 * i) : zero;
        pairs[2 * i] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        pairs[2 * i + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
      for (int64_t h = 0; h < kHeadsPerPass; ++h) {
        if (h >= heads) break;
        const __m512bh p = broadcast_pair(probs.data() + (g0 + h) * padded + t);
        for (int j = 0; j < 2 * NB; ++j) acc[h][j] = _mm512_dpbf16_ps(acc[h][j], p, pairs[j]);
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* o = out + (g0 + h) * o_stride_h;
      const __m512 inv = _mm512_set1_ps(inv_sum[g0 + h]);
      for (int i = 0; i < NB; ++i) {
        const __m512 lo = acc[h][2 * i], hi = acc[h][2 * i + 1];
        const __m512 a = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv);
        const __m512 b = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv);
        _mm512_storeu_si512(o + 32 * i, (__m512i)_mm512_cvtne2ps_pbh(b, a));
      }
    }
  }
}

template <int NB>
void paged_decode_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, float scale,
                       at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2),
                group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  auto qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  auto vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  auto op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t c_stride_block = k_cache.stride(0), c_stride_tok = k_cache.stride(1),
                c_stride_h = k_cache.stride(2);
  // One work item per sequence, its kv heads in turn (head_prefetch: the first head fetches whole
  // token rows, the others read the sequence's blocks from L2). Per (sequence, head) items each
  // fetched a third of every row from memory at a 384-byte stride (SmolLM2), and ran at about half
  // the speed: only with fewer sequences than threads (DecodeItems).
  const DecodeItems items(batch, num_kv_heads, at::get_num_threads());
  at::parallel_for(0, items.count(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv_sum;  // per-thread buffers, reused across work items
    std::vector<uint16_t> probs;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = items.sequence(item);
      for (int64_t kvh = items.first_head(item); kvh < items.end_head(item); ++kvh) {
        const HeadPrefetch fetch = items.fetch(kvh, NB * 32, NB, c_stride_h, c_stride_tok);
        decode_one<NB>(qp + b * q.stride(0) + kvh * group * q.stride(1), q.stride(1), group,
                       kp + kvh * c_stride_h, vp + kvh * c_stride_h, tables + b * max_blocks,
                       block_size, c_stride_block, c_stride_tok, lens[b], scale,
                       op + b * out.stride(0) + kvh * group * out.stride(1), out.stride(1), fetch,
                       scores, probs, inv_sum);
      }
    }
  });
}

#endif  // VLINFER_BF16_ATTENTION

}  // namespace

// The bf16 decode path, for head_dim 64 or 128 with AVX512-BF16; false when it does not apply (the
// caller then runs the generic kernel). Shapes and dtypes were checked by the caller.
bool paged_decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double scale, at::Tensor& out) {
#ifdef VLINFER_BF16_ATTENTION
  if (q.scalar_type() != at::kBFloat16 || k_cache.stride(3) != 1) return false;
  if (q.size(2) == 64) {
    paged_decode_bf16<2>(q, k_cache, v_cache, block_tables, seq_lens, static_cast<float>(scale),
                         out);
    return true;
  }
  if (q.size(2) == 128) {
    paged_decode_bf16<4>(q, k_cache, v_cache, block_tables, seq_lens, static_cast<float>(scale),
                         out);
    return true;
  }
#endif
  return false;
}

bool bf16_attention_available() {
#ifdef VLINFER_BF16_ATTENTION
  return true;
#else
  return false;
#endif
}

// q, k, v [T, heads, head_dim] bfloat16 (any token / head strides, contiguous head_dim); cu_seqlens
// int32 [S + 1].
at::Tensor vision_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens, double scale) {
  TORCH_CHECK(bf16_attention_available(), "vision_attention: built without AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "q, k, v must be [T, heads, d]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "vision_attention is bfloat16 only");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(q.size(2) <= 128, "head_dim over 128");
  auto bounds = cu_seqlens.to(at::kLong).contiguous();
  auto out = at::empty(q.sizes(), q.options());
#ifdef VLINFER_BF16_ATTENTION
  const int64_t* b = bounds.data_ptr<int64_t>();
  auto qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  auto vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  TORCH_CHECK(b[0] == 0 && b[bounds.numel() - 1] == q.size(0), "cu_seqlens must span [0, T]");
  TORCH_CHECK(k.strides() == v.strides(), "k and v must share a layout");
  const int64_t st = k.stride(0), sh = k.stride(1);
  PackedKV kv;
  for (int64_t s = 0; s + 1 < bounds.numel(); ++s) {
    const int64_t start = b[s], n = b[s + 1] - start;
    TORCH_CHECK(n >= 0, "cu_seqlens must be non-decreasing");
    if (n == 0) continue;
    pack_kv(kv, n, q.size(1), q.size(2), kp + start * st, vp + start * st,
            [&](int64_t j, int64_t h) { return j * st + h * sh; });
    flash_attention(qp + start * q.stride(0), q.stride(0), q.stride(1), n, q.size(1), q.size(1),
                    q.size(2), kv,
                    /*causal=*/false, 0, static_cast<float>(scale), op + start * out.stride(0),
                    out.stride(0), out.stride(1));
  }
#endif
  return out;
}

#ifdef VLINFER_BF16_ATTENTION
namespace {

// The multi-token rows of a step: per sequence, its n_keys keys packed by pack(kv, its block table,
// n_keys), then its queries through flash_attention. Sequence i's queries are its last tokens, so
// query j of a chunk of n sits at position seq_lens[i] - n + j.
template <typename PackFn>
void prefill_sequences(const at::Tensor& q, const at::Tensor& cu_seqlens_q,
                       const at::Tensor& seq_lens, const at::Tensor& block_tables,
                       int64_t block_size, int64_t kv_heads, double scale, at::Tensor& out,
                       PackFn pack) {
  auto cu = cu_seqlens_q.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  const int64_t* c = cu.data_ptr<int64_t>();
  const int64_t* l = lens.data_ptr<int64_t>();
  const int32_t* t = tables.data_ptr<int32_t>();
  const int64_t max_blocks = tables.size(1);
  auto qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  PackedKV kv;
  for (int64_t i = 0; i + 1 < cu.numel(); ++i) {
    const int64_t n_q = c[i + 1] - c[i], n_keys = l[i];
    if (n_q <= 1) continue;
    TORCH_CHECK(n_q <= n_keys && n_keys <= max_blocks * block_size, "sequence ", i,
                ": bad lengths");
    pack(kv, t + i * max_blocks, n_keys);
    flash_attention(qp + c[i] * q.stride(0), q.stride(0), q.stride(1), n_q, q.size(1), kv_heads,
                    q.size(2), kv,
                    /*causal=*/true, n_keys - n_q, static_cast<float>(scale),
                    op + c[i] * out.stride(0), out.stride(0), out.stride(1));
  }
}

// One stored int8 row read back as ops/reference/kv_cache.py dequantize does: each value times the
// row's scale in float32, rounded to bf16 (vcvtneps2bf16 rounds to nearest even, as torch does).
inline void dequantize_row(const int8_t* x, float s, uint16_t* out, int64_t d) {
  const __m512 sv = _mm512_set1_ps(s);
  int64_t e = 0;
  for (; e + 16 <= d; e += 16) {
    const __m512 f = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + e))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + e),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(f, sv)));
  }
  for (; e < d; ++e) out[e] = c10::BFloat16(static_cast<float>(x[e]) * s).x;
}

}  // namespace
#endif  // VLINFER_BF16_ATTENTION

static void check_prefill_shapes(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& out) {
  TORCH_CHECK(bf16_attention_available(), "prefill_attention: built without AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill_attention is bfloat16 only");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "k and v caches must share a layout");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(2) <= 128, "head_dim mismatch or over 128");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must be shaped like q");
}

// The multi-token rows of paged attention (prefill chunks, with or without cached context), written
// into out: q [T, heads, d] bfloat16, caches [blocks, block_size, kv_heads, d]; one-token rows are
// the decode kernel's and are left untouched.
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                       const at::Tensor& block_tables, double scale, at::Tensor& out) {
  check_prefill_shapes(q, k_cache, v_cache, out);
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "prefill_attention reads bfloat16 caches");
#ifdef VLINFER_BF16_ATTENTION
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t sb = k_cache.stride(0), st = k_cache.stride(1), sh = k_cache.stride(2);
  auto kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  auto vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  prefill_sequences(q, cu_seqlens_q, seq_lens, block_tables, block_size, kv_heads, scale, out,
                    [&](PackedKV& kv, const int32_t* table, int64_t n_keys) {
                      pack_kv(kv, n_keys, kv_heads, q.size(2), kp, vp, [&](int64_t j, int64_t h) {
                        return table[j / block_size] * sb + (j % block_size) * st + h * sh;
                      });
                    });
#endif
}

// prefill_attention over an int8 cache with one float32 scale per slot and KV head
// (ops/reference/kv_cache.py): each sequence's rows are read back in bf16 exactly as the
// reference's dequantized blocks, then run the same flash kernel, so the result equals
// prefill_attention on those blocks. Before it an int8 cache's chunks ran SDPA on blocks read back
// in Python, the bf16 cache's kernel beside it.
void prefill_attention_int8(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& k_scale,
                            const at::Tensor& v_scale, const at::Tensor& cu_seqlens_q,
                            const at::Tensor& seq_lens, const at::Tensor& block_tables,
                            double scale, at::Tensor& out) {
  check_prefill_shapes(q, k_cache, v_cache, out);
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar,
              "prefill_attention_int8 reads int8 caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                  k_scale.is_contiguous() && v_scale.is_contiguous(),
              "scales must be contiguous float32");
  TORCH_CHECK(k_scale.sizes() == k_cache.sizes().slice(0, 3) && v_scale.sizes() == k_scale.sizes(),
              "int8 caches need one scale per slot and KV head");
#ifdef VLINFER_BF16_ATTENTION
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), d = q.size(2);
  const int8_t* kp = k_cache.data_ptr<int8_t>();
  const int8_t* vp = v_cache.data_ptr<int8_t>();
  const float* ks = k_scale.data_ptr<float>();
  const float* vs = v_scale.data_ptr<float>();
  std::vector<uint16_t> keys, values;  // a sequence's rows [n_keys, kv_heads, d] in bf16
  prefill_sequences(
    q, cu_seqlens_q, seq_lens, block_tables, block_size, kv_heads, scale, out,
    [&](PackedKV& kv, const int32_t* table, int64_t n_keys) {
      keys.resize(n_keys * kv_heads * d);
      values.resize(keys.size());
      at::parallel_for(0, n_keys, 64, [&](int64_t begin, int64_t end) {
        for (int64_t j = begin; j < end; ++j) {
          const int64_t slot = table[j / block_size] * block_size + j % block_size;
          for (int64_t h = 0; h < kv_heads; ++h) {
            const int64_t at = slot * kv_heads + h, to = (j * kv_heads + h) * d;
            dequantize_row(kp + at * d, ks[at], keys.data() + to, d);
            dequantize_row(vp + at * d, vs[at], values.data() + to, d);
          }
        }
      });
      pack_kv(kv, n_keys, kv_heads, d, keys.data(), values.data(),
              [&](int64_t j, int64_t h) { return (j * kv_heads + h) * d; });
    });
#endif
}
