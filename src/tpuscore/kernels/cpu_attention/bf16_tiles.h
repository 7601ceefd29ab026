// The segment kernel's tiles with bfloat16 operands on AVX-512 BF16 (VDPBF16PS: two bfloat16
// products added to a float32 lane per step). Compiled for that extension function by function
// (TPUSCORE_BF16), so the library still loads on CPUs without it; callers check first.
//
// Operands travel as pairs: a uint32 holding two bfloat16s, the first in the low half. q.k pairs
// the head dim (q[2m], q[2m + 1] against k[2m][key], k[2m + 1][key]); e.v pairs keys (e[c],
// e[c + 1] against v[key c][h], v[key c + 1][h]).
#ifndef TPUSCORE_KERNELS_CPU_ATTENTION_BF16_TILES_H_
#define TPUSCORE_KERNELS_CPU_ATTENTION_BF16_TILES_H_

#include <cstring>

#include "common.h"

#define TPUSCORE_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace tpuscore_cpu {

// 16 pairs (even[j], odd[j]), each rounded to the nearest bfloat16 (ties to even).
TPUSCORE_BF16 inline __m512i Interleave(__m512 even, __m512 odd) {
  alignas(64) static const int16_t kOrder[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                 21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // even in 0-15, odd in 16-31
  return _mm512_permutexvar_epi16(_mm512_load_si512(kOrder), both);
}

// out[m] = the pair (x[2m], x[2m + 1]) for m < H / 2 (H even).
TPUSCORE_BF16 inline void RoundRow(const float* x, int64_t H, uint32_t* out) {
  for (int64_t h0 = 0; h0 < H; h0 += 32) {
    const __m512 low = _mm512_maskz_loadu_ps(Lanes(H - h0), x + h0);
    const __m512 high = _mm512_maskz_loadu_ps(Lanes(H - h0 - 16), x + h0 + 16);
    const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(high, low);  // in order: pairs already
    _mm512_mask_storeu_epi32(out + h0 / 2, Lanes((H - h0) / 2), pairs);
  }
}

// s[i][c0 : c0 + 32] = scale * q[i] . keys[:, p0 : p0 + 32] for the tile's 12 rows (q
// [12][pairs], keys [pairs][P]: the pairs of P keys).
TPUSCORE_BF16 [[gnu::always_inline]] inline void ScoreTileBf16(const uint32_t* q, int64_t pairs,
                                                               const uint32_t* keys, int64_t P,
                                                               int64_t p0, float* s, int stride,
                                                               int c0, float scale) {
  __m512 acc[kScoreRows][2];
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  for (int64_t m = 0; m < pairs; ++m) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(keys + m * P + p0);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(keys + m * P + p0 + 16);
#pragma GCC unroll 12
    for (int i = 0; i < kScoreRows; ++i) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(int32_t(q[i * pairs + m]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], b, k0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], b, k1);
    }
  }
  const __m512 factor = _mm512_set1_ps(scale);
  for (int i = 0; i < kScoreRows; ++i) {
    _mm512_storeu_ps(s + i * stride + c0, _mm512_mul_ps(acc[i][0], factor));
    _mm512_storeu_ps(s + i * stride + c0 + 16, _mm512_mul_ps(acc[i][1], factor));
  }
}

// o[i][c0 : c0 + w] (+)= e[i][p0:p1] @ v[p0:p1][c0 : c0 + w] for the tile's 6 rows, w <= 16 C
// (e [6][stride] bfloat16; values [p / 2][H]: the pairs of keys p, p + 1; p0 even, and an odd
// p1 takes key p1 too, whose e must be 0).
template <int C>
TPUSCORE_BF16 [[gnu::always_inline]] inline void ValueTileBf16(const uint16_t* e, int stride,
                                                               const uint32_t* values, int64_t H,
                                                               int p0, int p1, int64_t c0,
                                                               float* o, bool first) {
  __mmask16 lanes[C];
  for (int j = 0; j < C; ++j) lanes[j] = Lanes(H - c0 - 16 * j);
  __m512 acc[kValueRows][C];
  for (int i = 0; i < kValueRows; ++i)
    for (int j = 0; j < C; ++j)
      acc[i][j] = first ? _mm512_setzero_ps()
                        : _mm512_maskz_loadu_ps(lanes[j], o + i * H + c0 + 16 * j);
  for (int p = p0; p < p1; p += 2) {
    __m512bh vp[C];
    for (int j = 0; j < C; ++j)
      vp[j] = (__m512bh)_mm512_maskz_loadu_epi32(lanes[j], values + p / 2 * H + c0 + 16 * j);
#pragma GCC unroll 6
    for (int i = 0; i < kValueRows; ++i) {
      uint32_t pair;
      std::memcpy(&pair, e + i * stride + p, sizeof(pair));
      const __m512bh b = (__m512bh)_mm512_set1_epi32(int32_t(pair));
      for (int j = 0; j < C; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], b, vp[j]);
    }
  }
  for (int i = 0; i < kValueRows; ++i)
    for (int j = 0; j < C; ++j) _mm512_mask_storeu_ps(o + i * H + c0 + 16 * j, lanes[j], acc[i][j]);
}

// `ValueBlock` with bfloat16 e and value pairs.
TPUSCORE_BF16 inline void ValueBlockBf16(const uint16_t* e, int stride, const uint32_t* values,
                                         int64_t H, int p0, int p1, int tiles, float* out,
                                         bool first) {
  for (int64_t c0 = 0; c0 < H; c0 += 64)
    for (int i0 = 0; i0 < tiles; i0 += kValueRows) {
      const uint16_t* ei = e + i0 * stride;
      float* o = out + i0 * H;
      switch (std::min<int64_t>(4, (H - c0 + 15) / 16)) {
        case 1: ValueTileBf16<1>(ei, stride, values, H, p0, p1, c0, o, first); break;
        case 2: ValueTileBf16<2>(ei, stride, values, H, p0, p1, c0, o, first); break;
        case 3: ValueTileBf16<3>(ei, stride, values, H, p0, p1, c0, o, first); break;
        default: ValueTileBf16<4>(ei, stride, values, H, p0, p1, c0, o, first); break;
      }
    }
}

}  // namespace tpuscore_cpu

#endif  // TPUSCORE_KERNELS_CPU_ATTENTION_BF16_TILES_H_
