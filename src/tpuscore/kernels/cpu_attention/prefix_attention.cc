// Attention of many query rows to one shared prefix's K/V on x86-64 CPUs with AVX-512, float32:
// the query-side attention of prefill_extend's steps (`decoder.extend`), as an XLA FFI handler.
//
// XLA:CPU runs this attention as two matmuls with the masked softmax's max, exp and sum between
// them, the scores in memory at every step. Here each block of kBlockRows rows of one kv head
// computes its scores into a buffer that stays in L2, takes the max, exp and sum in one sweep per
// row while the row is in L1, and multiplies by V in key blocks small enough for L1; only the
// prefix keys before `length` enter the result (K is loaded to the next multiple of 32, masked;
// V to `length`). Output is unnormalized, as `attention._prefix_parts` returns it: o (the
// exp-weighted sum of values), the row's max score m and exp sum l, which the caller merges with
// the rows' own keys through their log-sum-exp.
//
// Every row's arithmetic is the same whichever rows share its call or its block (each score is
// one FMA chain over the head dim; the max, exp, sum and value sums run over the keys in a fixed
// order), so results are batch invariant. Layouts (row-major):
//   q [R, K, G, H] (R query tokens, K kv heads, G query heads per kv head), k [K, H, P],
//   v [K, P, H], length: int32 scalar (keys [0, length) are read);
//   o [R, K, G, H], m and l [R, K, G]; attribute scale: the score scale.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

// s[i][p0 : p0 + 32] = q[i] . k[:, p0 : p0 + 32] for the tile's 12 rows (q [12][stride H]).
[[gnu::always_inline]] inline void ScoreTile(const float* q, int64_t H, const float* k, int64_t P, float* s, int stride,
                      int p0) {
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
    _mm512_storeu_ps(s + i * stride + p0, acc[i][0]);
    _mm512_storeu_ps(s + i * stride + p0 + 16, acc[i][1]);
  }
}

// o[i][c0 : c0 + w] (+)= e[i][p0:p1] @ v[p0:p1][c0 : c0 + w] for the tile's 6 rows, w <= 16 C
// (o [6][H], v [P][H]).
template <int C>
[[gnu::always_inline]] inline void ValueTile(const float* e, int stride, const float* v, int64_t H, int p0, int p1, int64_t c0,
               float* o, bool first) {
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

// Max, exp and sum of one row's scores s[0:length] in place; s[length:padded] set to 0. As
// `_masked_exp` over the prefix's P keys: the max is NaN if a score is, and starts from
// finfo.min where keys past `length` are masked (-inf where none is).
inline void Softmax(float* s, int length, int padded, bool masked, float* m, float* l) {
  __m512 top = _mm512_set1_ps(masked ? kLowest : -INFINITY);
  __mmask16 nan = 0;
  for (int p = 0; p < length; p += 16) {
    const __m512 x = _mm512_mask_loadu_ps(top, Lanes(length - p), s + p);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, x);
  }
  const float max = nan ? NAN : _mm512_reduce_max_ps(top);
  const __m512 shift = _mm512_set1_ps(max);
  __m512 sum = _mm512_setzero_ps();
  for (int p = 0; p < padded; p += 16) {
    const __m512 e =
        _mm512_maskz_mov_ps(Lanes(length - p), Exp(_mm512_sub_ps(_mm512_loadu_ps(s + p), shift)));
    sum = _mm512_add_ps(sum, e);
    _mm512_storeu_ps(s + p, e);
  }
  *m = max;
  *l = _mm512_reduce_add_ps(sum);
}

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  float* o;
  float* m;
  float* l;
  int64_t R, K, G, H, P;
  int length;
  float scale;
};

// Rows [r0, r0 + kBlockRows) of kv head `head` (flat row r = token * G + group). kH: the head
// dim where it is a compile-time constant (the common ones, for speed), else 0.
template <int64_t kH>
void Block(const Problem& x, int64_t head, int64_t r0) {
  const int64_t H = kH ? kH : x.H;
  const int padded = (x.length + kScoreKeys - 1) / kScoreKeys * kScoreKeys;
  thread_local std::vector<float> scores, rows, out;
  scores.resize(size_t(kBlockRows) * padded);
  rows.resize(kBlockRows * H);
  out.resize(kBlockRows * H);
  const int count = int(std::min<int64_t>(kBlockRows, x.R * x.G - r0));
  auto offset = [&](int i) {  // row r0 + i of this head: its offset in m and l, times H in q, o
    const int64_t r = r0 + std::min(i, count - 1);
    return ((r / x.G) * x.K + head) * x.G + r % x.G;
  };
  if (x.length == 0) {  // no key: what `_masked_exp` gives a fully masked row
    for (int i = 0; i < count; ++i) {
      std::fill_n(x.o + offset(i) * H, H, 0.0f);
      x.m[offset(i)] = kLowest;
      x.l[offset(i)] = 0.0f;
    }
    return;
  }
  for (int i = 0; i < kBlockRows; ++i)  // rows past the end repeat the last; never written
    for (int64_t h = 0; h < H; ++h) rows[i * H + h] = x.q[offset(i) * H + h] * x.scale;
  const float* k = x.k + head * H * x.P;
  const float* v = x.v + head * x.P * H;
  for (int p0 = 0; p0 < padded; p0 += kScoreKeys)  // one 32-key panel of k in L1 for all rows
    for (int i0 = 0; i0 < kBlockRows; i0 += kScoreRows)
      ScoreTile(&rows[i0 * H], H, k, x.P, &scores[i0 * padded], padded, p0);
  for (int i = 0; i < count; ++i)
    Softmax(&scores[i * padded], x.length, padded, x.length < x.P, &x.m[offset(i)],
            &x.l[offset(i)]);
  const int tiles = (count + kValueRows - 1) / kValueRows * kValueRows;
  for (int p0 = 0; p0 < x.length; p0 += kValueKeys) {  // the exps past length are 0: skipped
    const int p1 = std::min(x.length, p0 + kValueKeys);
    for (int64_t c0 = 0; c0 < H; c0 += 64)  // up to 4 x 16 columns per tile
      for (int i0 = 0; i0 < tiles; i0 += kValueRows) {
        const float* e = &scores[i0 * padded];
        float* o = &out[i0 * H];
        switch (std::min<int64_t>(4, (H - c0 + 15) / 16)) {
          case 1: ValueTile<1>(e, padded, v, H, p0, p1, c0, o, p0 == 0); break;
          case 2: ValueTile<2>(e, padded, v, H, p0, p1, c0, o, p0 == 0); break;
          case 3: ValueTile<3>(e, padded, v, H, p0, p1, c0, o, p0 == 0); break;
          default: ValueTile<4>(e, padded, v, H, p0, p1, c0, o, p0 == 0); break;
        }
      }
  }
  for (int i = 0; i < count; ++i) std::copy_n(&out[i * H], H, x.o + offset(i) * H);
}

using BlockFn = void (*)(const Problem&, int64_t, int64_t);

// Runs every (kv head, row block) on the caller and on pool threads, which claim blocks from a
// shared counter: the caller waits only for blocks another thread has started, so a pool whose
// threads are all busy (or waiting in calls like this one) cannot deadlock it.
void Run(const Problem& x, ffi::ThreadPool& pool) {
  struct Shared {
    Problem x;
    BlockFn block;
    int64_t blocks, per_head;
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mutex;
    std::condition_variable finished;
  };
  auto shared = std::make_shared<Shared>();
  shared->x = x;
  shared->block = x.H == 64 ? Block<64> : x.H == 128 ? Block<128> : x.H == 256 ? Block<256>
                : Block<0>;
  shared->per_head = (x.R * x.G + kBlockRows - 1) / kBlockRows;
  shared->blocks = x.K * shared->per_head;
  auto work = [](Shared& s) {
    for (int64_t b; (b = s.next.fetch_add(1)) < s.blocks;) {
      s.block(s.x, b / s.per_head, (b % s.per_head) * kBlockRows);
      if (s.done.fetch_add(1) + 1 == s.blocks) {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.finished.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), shared->blocks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared, work] { work(*shared); });
  work(*shared);
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->finished.wait(lock, [&] { return shared->done.load() == shared->blocks; });
}

ffi::Error PrefixAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> length,
                           ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> m,
                           ffi::ResultBuffer<ffi::F32> l, float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 3 || vd.size() != 3 || kd[0] != qd[1] || kd[1] != qd[3] ||
      vd[0] != kd[0] || vd[1] != kd[2] || vd[2] != kd[1])
    return ffi::Error::InvalidArgument("q must be [R, K, G, H], k [K, H, P] and v [K, P, H]");
  Problem x{q.typed_data(), k.typed_data(), v.typed_data(), o->typed_data(), m->typed_data(),
            l->typed_data(), qd[0], qd[1], qd[2], qd[3], kd[2], 0, scale};
  x.length = int(std::clamp<int64_t>(length.typed_data()[0], 0, x.P));
  Run(x, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpuscorePrefixAttention, PrefixAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

// Whether this CPU runs the kernel (it is compiled for AVX-512F).
extern "C" int tpuscore_cpu_supported() { return __builtin_cpu_supports("avx512f"); }
