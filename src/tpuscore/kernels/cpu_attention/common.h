// What the CPU attention kernels share (x86-64, AVX-512F, float32): the exp, the score and value
// tiles, and the runner that spreads a kernel's blocks over XLA's thread pool.
//
// Every row's arithmetic is the same whichever rows share its block: each score is one FMA chain
// over the head dim, and sums over keys run in key order, each key in a fixed lane.
#ifndef TPUSCORE_KERNELS_CPU_ATTENTION_COMMON_H_
#define TPUSCORE_KERNELS_CPU_ATTENTION_COMMON_H_

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace tpuscore_cpu {

namespace ffi = xla::ffi;

constexpr int kScoreRows = 12;  // rows per score tile: 12 x 32 scores in 24 registers
constexpr int kScoreKeys = 32;  // keys per score tile
constexpr int kValueRows = 6;   // rows per value tile: 6 x 64 outputs in 24 registers
constexpr int kBlockRows = 48;  // rows per block: 4 score tiles, 8 value tiles
constexpr int kValueKeys = 64;  // keys per value block: 64 x 64 floats of V stay in L1
constexpr float kLowest = -3.4028234663852886e38f;  // finfo(float32).min, as jnp's masked max

// exp over 16 lanes for x <= 0 (Cephes' expf polynomial on x - n ln 2, scaled by 2^n): NaN
// for NaN, 0 below -87 (-inf included), as XLA's exp gives them (so 0 * inf is NaN in both).
inline __m512 Exp(__m512 x) {
  const __mmask16 above = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // NaN in the second operand stays NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(above, _mm512_scalef_ps(p, n));
}

inline __mmask16 Lanes(int64_t count) {  // the first `count` lanes (all from 16 on)
  return count >= 16 ? __mmask16(0xffff) : __mmask16((1u << std::max<int64_t>(count, 0)) - 1);
}

// s[i][c0 : c0 + 32] = q[i] . k[:, p0 : p0 + 32] for the tile's 12 rows (q [12][stride H],
// k [H][P]; keys from P on read as 0).
[[gnu::always_inline]] inline void ScoreTile(const float* q, int64_t H, const float* k, int64_t P,
                                             int64_t p0, float* s, int stride, int c0) {
  __m512 acc[kScoreRows][2];
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  const __mmask16 lanes0 = Lanes(P - p0), lanes1 = Lanes(P - p0 - 16);  // k's end
  for (int64_t h = 0; h < H; ++h) {
    const __m512 k0 = _mm512_maskz_loadu_ps(lanes0, k + h * P + p0);
    const __m512 k1 = _mm512_maskz_loadu_ps(lanes1, k + h * P + p0 + 16);
#pragma GCC unroll 12
    for (int i = 0; i < kScoreRows; ++i) {
      const __m512 b = _mm512_set1_ps(q[i * H + h]);
      acc[i][0] = _mm512_fmadd_ps(b, k0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(b, k1, acc[i][1]);
    }
  }
  for (int i = 0; i < kScoreRows; ++i) {
    _mm512_storeu_ps(s + i * stride + c0, acc[i][0]);
    _mm512_storeu_ps(s + i * stride + c0 + 16, acc[i][1]);
  }
}

// o[i][c0 : c0 + w] (+)= e[i][p0:p1] @ v[p0:p1][c0 : c0 + w] for the tile's 6 rows, w <= 16 C
// (o [6][H], v [P][H]).
template <int C>
[[gnu::always_inline]] inline void ValueTile(const float* e, int stride, const float* v,
                                             int64_t H, int p0, int p1, int64_t c0, float* o,
                                             bool first) {
  __mmask16 lanes[C];
  for (int j = 0; j < C; ++j) lanes[j] = Lanes(H - c0 - 16 * j);
  __m512 acc[kValueRows][C];
  for (int i = 0; i < kValueRows; ++i)
    for (int j = 0; j < C; ++j)
      acc[i][j] = first ? _mm512_setzero_ps()
                        : _mm512_maskz_loadu_ps(lanes[j], o + i * H + c0 + 16 * j);
  for (int p = p0; p < p1; ++p) {
    __m512 vp[C];
    for (int j = 0; j < C; ++j) vp[j] = _mm512_maskz_loadu_ps(lanes[j], v + p * H + c0 + 16 * j);
#pragma GCC unroll 6
    for (int i = 0; i < kValueRows; ++i) {
      const __m512 b = _mm512_set1_ps(e[i * stride + p]);
      for (int j = 0; j < C; ++j) acc[i][j] = _mm512_fmadd_ps(b, vp[j], acc[i][j]);
    }
  }
  for (int i = 0; i < kValueRows; ++i)
    for (int j = 0; j < C; ++j) _mm512_mask_storeu_ps(o + i * H + c0 + 16 * j, lanes[j], acc[i][j]);
}

// out[0 : tiles rows][H] (+)= e[:, p0:p1] @ v[p0:p1] over every column group of H, for `tiles`
// rows (a multiple of kValueRows) of e [rows][stride]; first: out is written, not added to.
inline void ValueBlock(const float* e, int stride, const float* v, int64_t H, int p0, int p1,
                       int tiles, float* out, bool first) {
  for (int64_t c0 = 0; c0 < H; c0 += 64)  // up to 4 x 16 columns per tile
    for (int i0 = 0; i0 < tiles; i0 += kValueRows) {
      const float* ei = e + i0 * stride;
      float* o = out + i0 * H;
      switch (std::min<int64_t>(4, (H - c0 + 15) / 16)) {
        case 1: ValueTile<1>(ei, stride, v, H, p0, p1, c0, o, first); break;
        case 2: ValueTile<2>(ei, stride, v, H, p0, p1, c0, o, first); break;
        case 3: ValueTile<3>(ei, stride, v, H, p0, p1, c0, o, first); break;
        default: ValueTile<4>(ei, stride, v, H, p0, p1, c0, o, first); break;
      }
    }
}

// Runs block(0) ... block(blocks - 1) on the caller and on pool threads, which claim blocks from
// a shared counter: the caller waits only for blocks another thread has started, so a pool
// whose threads are all busy (or waiting in calls like this one) cannot deadlock it.
inline void RunBlocks(ffi::ThreadPool& pool, int64_t blocks, std::function<void(int64_t)> block) {
  struct Shared {
    std::function<void(int64_t)> block;
    int64_t blocks;
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mutex;
    std::condition_variable finished;
  };
  auto shared = std::make_shared<Shared>();
  shared->block = std::move(block);
  shared->blocks = blocks;
  auto work = [](Shared& s) {
    for (int64_t b; (b = s.next.fetch_add(1)) < s.blocks;) {
      s.block(b);
      if (s.done.fetch_add(1) + 1 == s.blocks) {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.finished.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), blocks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared, work] { work(*shared); });
  work(*shared);
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->finished.wait(lock, [&] { return shared->done.load() == shared->blocks; });
}

}  // namespace tpuscore_cpu

#endif  // TPUSCORE_KERNELS_CPU_ATTENTION_COMMON_H_
