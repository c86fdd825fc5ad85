// Paged decode attention on AVX2 (8-float vectors, 16 registers), for builds without AVX-512:
// float32, bf16 and fp16 caches of the compute dtype (paged_ops.cpp) and the compressed caches
// (kv_quant.cpp: int8 rows with a scale per token and KV head, bf16 / fp16 / fp8 rows with one per
// tensor). Without it those builds ran the plain loops, which the compiler vectorizes poorly (a
// block-table division per row, one horizontal sum per dot product). Semantics are the reference's
// (vlinfer/ops/reference/, reference/kv_cache.py): float32 accumulation, a row's scale multiplying
// its dot product (K) or its softmax weight (V).
#pragma once

#include "decode_vectors.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define VLINFER_AVX2_DECODE 1
#include <immintrin.h>

#include <type_traits>
#include <vector>

namespace {

// 8 stored values from p as float32, unscaled.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
    _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// fp8 through float16, exactly (as kv_quant.cpp's AVX-512 load16): e5m2 is float16's top byte;
// e4m3fn's magnitude bits in float16's place read as float16 are the value / 2^8.
inline __m256 load8(const c10::Float8_e5m2* p) {
  const __m128i codes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(codes, 8));
}
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i codes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(codes, _mm_set1_epi16(0x7F)), 7);
  const __m256 value = _mm256_mul_ps(_mm256_cvtph_ps(magnitude), _mm256_set1_ps(256.f));
  const __m256i sign =
    _mm256_slli_epi32(_mm256_and_si256(_mm256_cvtepu16_epi32(codes), _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(value), sign));
}

// Lane j of the result is the sum of v[j]'s 8 lanes: two rounds of hadd leave each vector's 128-bit
// halves summed at lane j of the low (j < 4) or high half; the halves are then swapped into place
// and added.
inline __m256 sum8(const __m256 v[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp of s - max <= 0 (decode_vectors.h kExpPoly), the power of two built in the exponent bits
// (AVX2 has no vscalefps): inputs clamped at -87, where 2^n is still a normal float and e^-87 is
// nothing next to the row's maximum term of 1.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256i power =
    _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

// One query head's scores [len, padded to 8) in place as exp(score - max) x the value row's scale
// (v_scales), the lanes past len masked; returns 1 / the sum of the exp terms (the weighted value
// sum is divided by it at the end).
inline float softmax8_unnormalized(float* sg, const float* v_scales, int64_t len, int64_t padded) {
  for (int64_t t = len; t < padded; ++t) sg[t] = kLowest;
  __m256 mx = _mm256_set1_ps(kLowest);
  for (int64_t t = 0; t < padded; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + t));
  const __m256 m = _mm256_set1_ps(reduce_max8(mx));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), m));
    _mm256_storeu_ps(sg + t, _mm256_mul_ps(e, _mm256_loadu_ps(v_scales + t)));
    sum = _mm256_add_ps(sum, e);
  }
  return 1.f / reduce_add8(sum);
}

// One query head's dot products with 8 key rows (lane j: qg . rows[j]), NV vectors of 8 per row: 4
// rows at a time, each summed in two accumulators (8 chains of FMAs in flight: one chain a row
// waited on the FMA latency), against 4 of the query's vectors held in registers (12 of the 16
// registers).
template <int NV, typename T>
inline __m256 scores8(const float* qg, const T* const rows[8]) {
  constexpr int kQ = NV < 4 ? NV : 4;
  __m256 acc[8];
  for (int j0 = 0; j0 < 8; j0 += 4) {
    __m256 sums[4][2];
    for (int j = 0; j < 4; ++j) sums[j][0] = sums[j][1] = _mm256_setzero_ps();
    for (int c0 = 0; c0 < NV; c0 += kQ) {
      __m256 qv[kQ];
      for (int i = 0; i < kQ; ++i) qv[i] = _mm256_loadu_ps(qg + 8 * (c0 + i));
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < kQ; ++i)
          sums[j][i & 1] =
            _mm256_fmadd_ps(qv[i], load8(rows[j0 + j] + 8 * (c0 + i)), sums[j][i & 1]);
    }
    for (int j = 0; j < 4; ++j) acc[j0 + j] = _mm256_add_ps(sums[j][0], sums[j][1]);
  }
  return sum8(acc);
}

// Heads [g0, g0 + H) of a group, columns [8 c0, 8 (c0 + C)) of their output rows: H x C
// accumulators over every value row, p already times the row's scale (softmax8). A row's vectors
// are converted one at a time, so the accumulators, the H weights and one row vector are what is
// live (at most 11 of the 16 registers: a pass holding more spilled an accumulator to the stack, a
// store-to-load wait per row). fetch: the rows to prefetch ahead on the first pass (from DRAM),
// nullptr on the later ones (their rows are in L2).
template <int C, int H, typename cache_t>
inline void value_pass(const float* p, int64_t padded, const cache_t* v_base, RowCursor vcur,
                       int64_t len, int c0, const HeadPrefetch* fetch, const float* inv_sum,
                       float* out, int64_t head_dim) {
  __m256 acc[H][C];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < C; ++i) acc[h][i] = _mm256_setzero_ps();
  RowCursor vpre = vcur.ahead(kPrefetch);
  for (int64_t t = 0; t < len; ++t, vcur.next(), vpre.next()) {
    const cache_t* v = vcur.row(v_base) + 8 * c0;
    if (fetch && t + kPrefetch < len)
      prefetch_lines(vpre.row(v_base) - fetch->offset, fetch->lines);
    __m256 w[H];
    for (int h = 0; h < H; ++h) w[h] = _mm256_broadcast_ss(p + h * padded + t);
    for (int i = 0; i < C; ++i) {
      const __m256 vv = load8(v + 8 * i);
      for (int h = 0; h < H; ++h) acc[h][i] = _mm256_fmadd_ps(w[h], vv, acc[h][i]);
    }
  }
  for (int h = 0; h < H; ++h) {
    const __m256 inv = _mm256_set1_ps(inv_sum[h]);
    for (int i = 0; i < C; ++i)
      _mm256_storeu_ps(out + h * head_dim + 8 * (c0 + i), _mm256_mul_ps(acc[h][i], inv));
  }
}

// Where one (sequence, KV head)'s row scales are: per token and KV head beside the cache (int8;
// walked by `cursor` over the [blocks, block_size, kv_heads] scales from this head's first), else
// one per tensor.
struct RowScales {
  const float* k;
  const float* v;
  bool per_row;
  RowCursor cursor;
};

// Per-thread buffers of decode_one_avx2.
struct DecodeScratch {
  std::vector<float> scores, v_scales, inv_sum, converted;
};

// One (sequence, KV head): scores 8 keys at a time (a group's query heads sharing each key row,
// converted to float32 once into L1 when stored narrower), softmax with exp256, then the value rows
// weighted by p x their scale in passes of value_pass (the later passes re-read the rows from L2).
// q: the group's query rows times the softmax scale; out: the group's output rows, float32,
// head_dim apart.
template <int NV, typename cache_t>
void decode_one_avx2(const float* q, int64_t group, const cache_t* k_base, const cache_t* v_base,
                     const RowCursor& start, RowScales scales, int64_t len,
                     const HeadPrefetch& fetch, float* out, DecodeScratch& s) {
  constexpr int64_t kHeadDim = 8 * NV;
  constexpr int kChunk = NV < 8 ? NV : 8;  // vectors of a row per value pass
  constexpr bool kFloatRows = std::is_same_v<cache_t, float>;
  const int64_t padded = (len + 7) / 8 * 8;
  s.scores.resize(group * padded);
  s.v_scales.resize(padded);
  s.inv_sum.resize(group);
  s.converted.resize(8 * kHeadDim);
  RowCursor cur = start, pre = start.ahead(kPrefetch), scale_cur = scales.cursor;
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, len - t0);
    const cache_t* rows[8];
    alignas(32) float k_row_scale[8];
    for (int64_t i = 0; i < 8; ++i) {
      if (i >= n) {  // lanes past the end: any row, masked in the softmax
        rows[i] = rows[0];
        k_row_scale[i] = 0.f;
        continue;
      }
      rows[i] = cur.row(k_base);
      if (t0 + i + kPrefetch < len) prefetch_lines(pre.row(k_base) - fetch.offset, fetch.lines);
      const int64_t at = scales.per_row ? scale_cur.index() : 0;
      k_row_scale[i] = scales.k[at];
      s.v_scales[t0 + i] = scales.v[at];
      cur.next();
      pre.next();
      scale_cur.next();
    }
    const __m256 row_scale = _mm256_load_ps(k_row_scale);
    if (kFloatRows || group == 1) {
      for (int64_t g = 0; g < group; ++g)
        _mm256_storeu_ps(s.scores.data() + g * padded + t0,
                         _mm256_mul_ps(scores8<NV>(q + g * kHeadDim, rows), row_scale));
      continue;
    }
    const float* float_rows[8];
    for (int64_t j = 0; j < 8; ++j) {
      float* dst = s.converted.data() + j * kHeadDim;
      float_rows[j] = dst;
      for (int i = 0; i < NV; ++i) _mm256_storeu_ps(dst + 8 * i, load8(rows[j] + 8 * i));
    }
    for (int64_t g = 0; g < group; ++g)
      _mm256_storeu_ps(s.scores.data() + g * padded + t0,
                       _mm256_mul_ps(scores8<NV>(q + g * kHeadDim, float_rows), row_scale));
  }
  for (int64_t g = 0; g < group; ++g)
    s.inv_sum[g] =
      softmax8_unnormalized(s.scores.data() + g * padded, s.v_scales.data(), len, padded);
  // Value rows: up to 3 query heads a pass (3 x 2 vectors, 2 x 4, or one head 8 wide), each row
  // vector converted once a pass.
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    const int64_t heads = std::min<int64_t>(3, group - g0);
    const float* p = s.scores.data() + g0 * padded;
    const float* inv = s.inv_sum.data() + g0;
    float* out_rows = out + g0 * kHeadDim;
    const int width = heads == 3 ? 2 : heads == 2 ? 4 : kChunk;
    for (int c0 = 0; c0 < NV; c0 += width) {
      const HeadPrefetch* ahead = g0 == 0 && c0 == 0 ? &fetch : nullptr;
      if (heads == 3)
        value_pass<2, 3>(p, padded, v_base, start, len, c0, ahead, inv, out_rows, kHeadDim);
      else if (heads == 2)
        value_pass<4, 2>(p, padded, v_base, start, len, c0, ahead, inv, out_rows, kHeadDim);
      else
        value_pass<kChunk, 1>(p, padded, v_base, start, len, c0, ahead, inv, out_rows, kHeadDim);
    }
  }
}

// Decode attention (one query token per sequence) over rows of cache_t, queries and output of
// scalar_t: every (sequence, KV head) through decode_one_avx2, work items as the AVX-512 kernels
// split them (DecodeItems). k_scale / v_scale: [blocks, block_size, kv_heads] when per_row, else
// one value each. false where no vector kernel fits (head_dim other than 64 / 128): the caller runs
// its plain loops.
template <typename scalar_t, typename cache_t>
bool decode_attention_avx2(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const float* k_scale, const float* v_scale,
                           bool per_row, const at::Tensor& tables, const at::Tensor& lens,
                           double scale, at::Tensor& out) {
  const int64_t head_dim = q.size(2);
  if (head_dim != 64 && head_dim != 128) return false;
  const int64_t batch = q.size(0), num_heads = q.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2),
                group = num_heads / num_kv_heads;
  const int64_t max_blocks = tables.size(1);
  const int64_t sb = k_cache.stride(0), st = k_cache.stride(1), sh = k_cache.stride(2);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = reinterpret_cast<const cache_t*>(k_cache.data_ptr());
  const cache_t* vp = reinterpret_cast<const cache_t*>(v_cache.data_ptr());
  scalar_t* op = out.data_ptr<scalar_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t head_lines =
    std::max<int64_t>(1, head_dim * static_cast<int64_t>(sizeof(cache_t)) / 64);
  const DecodeItems items(batch, num_kv_heads, at::get_num_threads());
  at::parallel_for(0, items.count(), 1, [&](int64_t begin, int64_t end) {
    DecodeScratch scratch;
    std::vector<float> qf(group * head_dim), acc(group * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = items.sequence(item);
      const int32_t* table = tp + b * max_blocks;
      for (int64_t kvh = items.first_head(item); kvh < items.end_head(item); ++kvh) {
        scaled_query_group(qp, q.stride(0), q.stride(1), b, kvh, group, head_dim,
                           static_cast<float>(scale), qf.data());
        const RowCursor rows{table, block_size, sb, st};
        const RowScales row_scales{
          per_row ? k_scale + kvh : k_scale, per_row ? v_scale + kvh : v_scale, per_row,
          RowCursor{table, block_size, block_size * num_kv_heads, num_kv_heads}};
        const HeadPrefetch fetch = items.fetch(kvh, head_dim, head_lines, sh, st);
        if (head_dim == 64)
          decode_one_avx2<8>(qf.data(), group, kp + kvh * sh, vp + kvh * sh, rows, row_scales,
                             lp[b], fetch, acc.data(), scratch);
        else
          decode_one_avx2<16>(qf.data(), group, kp + kvh * sh, vp + kvh * sh, rows, row_scales,
                              lp[b], fetch, acc.data(), scratch);
        for (int64_t g = 0; g < group; ++g) {
          scalar_t* ov = op + b * out.stride(0) + (kvh * group + g) * out.stride(1);
          for (int64_t d = 0; d < head_dim; ++d)
            ov[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
        }
      }
    }
  });
  return true;
}

}  // namespace

#endif  // AVX2 without AVX-512
