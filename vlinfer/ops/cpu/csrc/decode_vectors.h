// Pieces the paged decode attention kernels share: the bf16 one (attention_bf16.cpp, AVX512-BF16)
// and the float32 one (paged_ops.cpp, AVX-512). Scalar pieces for every build, vector pieces where
// the build has AVX-512.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// The masked-score and initial-max value: finite, because -ffast-math lets the compiler assume no
// infinities.
constexpr float kLowest = std::numeric_limits<float>::lowest();

// The `group` query heads that share KV head kvh of sequence b, as float32 rows of qf, times the
// softmax scale.
template <typename scalar_t>
inline void scaled_query_group(const scalar_t* q, int64_t stride_b, int64_t stride_h, int64_t b,
                               int64_t kvh, int64_t group, int64_t head_dim, float scale,
                               float* qf) {
  for (int64_t g = 0; g < group; ++g) {
    const scalar_t* qv = q + b * stride_b + (kvh * group + g) * stride_h;
    for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = static_cast<float>(qv[d]) * scale;
  }
}

// Softmax of one query head's scores over its sequence, in place (the scalar kernels: generic
// builds, quantized caches).
inline void softmax_in_place(float* scores, int64_t len) {
  float m = kLowest;
  for (int64_t t = 0; t < len; ++t) m = std::max(m, scores[t]);
  float sum = 0.f;
  for (int64_t t = 0; t < len; ++t) { scores[t] = std::exp(scores[t] - m); sum += scores[t]; }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < len; ++t) scores[t] *= inv;
}

#if defined(__AVX512F__)
// Lane j of the result is the sum of v[j]'s 16 lanes: halves, then quarters of all 16 vectors added
// pairwise with 128-bit shuffles, then a 4 x 4 transpose-and-add inside each 128-bit lane, which
// leaves v[4k + L]'s sum at lane 4L + k; one permute puts it at lane 4k + L.
inline __m512 sum16(const __m512 v[16]) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes 0-1: v[2i]'s halves added; 2-3: v[2i + 1]'s
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: 4 partial sums of v[4i + L]
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(y[2], y[3]), _mm512_unpackhi_ps(y[2], y[3]));
  const __m512 r =
    _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
  return _mm512_permutexvar_ps(
    _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

#endif  // __AVX512F__

// A head's rows are head_dim apart from the next head's, so consecutive tokens are a cache-line run
// every kv_heads * head_dim elements: a stride the hardware prefetcher follows poorly. Fetch
// kPrefetch tokens ahead; the first kv head of a sequence fetches the whole row, which the others
// then find in L2. (Walking all heads token by token instead, one pass for the sequence, measured
// slower: the value accumulators of every head no longer fit in registers.) 8 -> 16 tokens ahead:
// 0.75 -> 0.73 ms for a 64-sequence SmolLM2 decode layer (AMD EPYC, 2 threads).
constexpr int64_t kPrefetch = 16;

// `lines` 64-byte lines from `row` on (0: nothing).
inline void prefetch_lines(const void* row, int64_t lines) {
  for (int64_t i = 0; i < lines; ++i)
    __builtin_prefetch(static_cast<const char*>(row) + 64 * i, 0, 3);  // into L1
}

// Token t's cache row, walked in order: the block and offset advance by one each step. Deriving
// them per token as t / block_size and t % block_size cost an integer division per row read (a
// runtime block size): 0.73 -> 0.63 ms for a cache-resident 64-sequence bf16 decode layer on 64-dim
// heads when it went.
struct RowCursor {
  const int32_t* table;
  int64_t block_size, stride_block, stride_tok;
  int64_t block = 0, offset = 0;
  int64_t index() const { return table[block] * stride_block + offset * stride_tok; }
  template <typename T>
  const T* row(const T* base) const { return base + index(); }
  void next() {
    if (++offset == block_size) {
      offset = 0;
      ++block;
    }
  }
  RowCursor ahead(int64_t tokens) const {  // the cursor `tokens` rows further on
    RowCursor c = *this;
    for (int64_t i = 0; i < tokens; ++i) c.next();
    return c;
  }
};

// What kv head kvh's pass prefetches, per token: `offset` elements back from its part of the row to
// where the prefetch starts, and how many 64-byte `lines` (head_lines per head). Where a token's
// row holds every head's part contiguously (the cache as [blocks, block_size, kv_heads, head_dim])
// the first head fetches the whole row and the others find it in L2; otherwise each head fetches
// its own part.
struct HeadPrefetch {
  int64_t offset, lines;
};
inline HeadPrefetch head_prefetch(int64_t kvh, int64_t kv_heads, int64_t head_dim,
                                  int64_t head_lines, int64_t stride_h, int64_t stride_tok) {
  if (stride_h != head_dim || stride_tok != kv_heads * stride_h) return {0, head_lines};
  return {kvh * stride_h, kvh == 0 ? head_lines * kv_heads : 0};
}

// A decode attention kernel's work items: one per sequence, its kv heads in turn (head_prefetch),
// or one per (sequence, kv head) when there are fewer sequences than threads, each fetching its own
// head's part of the rows: a single stream's attention otherwise ran on one core while the others
// waited.
struct DecodeItems {
  int64_t batch, kv_heads;
  bool per_head;
  DecodeItems(int64_t batch, int64_t kv_heads, int64_t threads)
      : batch(batch), kv_heads(kv_heads), per_head(batch < threads && kv_heads > 1) {}
  int64_t count() const { return per_head ? batch * kv_heads : batch; }
  int64_t sequence(int64_t item) const { return per_head ? item / kv_heads : item; }
  int64_t first_head(int64_t item) const { return per_head ? item % kv_heads : 0; }
  int64_t end_head(int64_t item) const { return per_head ? item % kv_heads + 1 : kv_heads; }
  HeadPrefetch fetch(int64_t kvh, int64_t head_dim, int64_t head_lines, int64_t stride_h,
                     int64_t stride_tok) const {
    if (per_head) return {0, head_lines};
    return head_prefetch(kvh, kv_heads, head_dim, head_lines, stride_h, stride_tok);
  }
};

// The next (up to) 16 key rows from `cur` into rows[], prefetching kPrefetch rows ahead through
// `pre`; past the end, rows[] repeats the first row (the caller masks those scores).
template <typename T>
inline void next_rows16(RowCursor& cur, RowCursor& pre, const T* base, int64_t t0, int64_t len,
                        const HeadPrefetch& fetch, const T* rows[16]) {
  const int64_t n = std::min<int64_t>(16, len - t0);
  for (int64_t i = 0; i < n; ++i, cur.next(), pre.next()) {
    rows[i] = cur.row(base);
    if (t0 + i + kPrefetch < len) prefetch_lines(pre.row(base) - fetch.offset, fetch.lines);
  }
  for (int64_t i = n; i < 16; ++i) rows[i] = rows[0];
}

// exp for the softmax kernels (exp512 here, exp256 in decode_avx2.h): x = n ln2 + r with ln2 split
// in two for accuracy, e^r by its degree-6 Taylor polynomial (~1 ulp), highest coefficient first,
// then times 2^n.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[7] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

#if defined(__AVX512F__)
// exp for the softmax, whose inputs are s - max <= 0 (kExpPoly), the power of two applied by
// vscalefps. Inputs are clamped at -100 so the masked kLowest scores give 2^-144 * p, which rounds
// to 0 in bfloat16 (a float32 denormal) and is nothing next to the row's maximum term of 1.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  return _mm512_scalef_ps(p, n);
}

// One query head's dot products with 16 key rows (lane j: qg . rows[j]), NV vectors of 16 per row;
// load(p) gives 16 of a row's values as float32 (a plain load, or a conversion of stored rows).
template <int NV, typename T, typename Load>
inline __m512 scores16(const float* qg, const T* const rows[16], Load load) {
  __m512 qv[NV];
  for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(qg + 16 * i);
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_mul_ps(qv[0], load(rows[j]));
    for (int i = 1; i < NV; ++i) acc[j] = _mm512_fmadd_ps(qv[i], load(rows[j] + 16 * i), acc[j]);
  }
  return sum16(acc);
}

// One query head's scores [len, padded to 16) in place as exp(score - max), the lanes past len
// masked; returns 1 / their sum (the value sum is divided by it at the end).
inline float softmax16_unnormalized(float* sg, int64_t len, int64_t padded) {
  for (int64_t t = len; t < padded; ++t) sg[t] = kLowest;
  __m512 mx = _mm512_set1_ps(kLowest);
  for (int64_t t = 0; t < padded; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < padded; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + t), m));
    _mm512_storeu_ps(sg + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

#endif  // __AVX512F__

}  // namespace
