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
// Every row's arithmetic is the same whichever rows share its call or its block (`common.h`), so
// results are batch invariant. Layouts (row-major):
//   q [R, K, G, H] (R query tokens, K kv heads, G query heads per kv head), k [K, H, P],
//   v [K, P, H], length: int32 scalar (keys [0, length) are read);
//   o [R, K, G, H], m and l [R, K, G]; attribute scale: the score scale.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

using namespace tpuscore_cpu;

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
      ScoreTile(&rows[i0 * H], H, k, x.P, p0, &scores[i0 * padded], padded, p0);
  for (int i = 0; i < count; ++i)
    Softmax(&scores[i * padded], x.length, padded, x.length < x.P, &x.m[offset(i)],
            &x.l[offset(i)]);
  const int tiles = (count + kValueRows - 1) / kValueRows * kValueRows;
  for (int p0 = 0; p0 < x.length; p0 += kValueKeys)  // the exps past length are 0: skipped
    ValueBlock(scores.data(), padded, v, H, p0, std::min(x.length, p0 + kValueKeys), tiles,
               out.data(), p0 == 0);
  for (int i = 0; i < count; ++i) std::copy_n(&out[i * H], H, x.o + offset(i) * H);
}

// Every (kv head, row block) on XLA's thread pool (`RunBlocks`).
void Run(const Problem& x, ffi::ThreadPool& pool) {
  void (*block)(const Problem&, int64_t, int64_t) =
      x.H == 64 ? Block<64> : x.H == 128 ? Block<128> : x.H == 256 ? Block<256> : Block<0>;
  const int64_t per_head = (x.R * x.G + kBlockRows - 1) / kBlockRows;
  RunBlocks(pool, x.K * per_head,
            [x, block, per_head](int64_t b) { block(x, b / per_head, (b % per_head) * kBlockRows); });
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
