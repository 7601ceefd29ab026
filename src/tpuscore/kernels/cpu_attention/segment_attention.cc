// Attention of packed rows under the shared-prefix segment mask on x86-64 CPUs with AVX-512,
// float32: packed_segment's attention on CPU (`backends/packed/steps.py`), as an XLA FFI handler.
//
// A packed row holds a query and its items; row r sees key c when c <= r and (c < prefix_len or
// c >= seg_start[r]), cut to a sliding window as `kernels/segment/mask.py` draws it. XLA's ops
// compute every (row, key) pair of the [T, T] block, masked, with the scores in memory; here
// each block of kBlockRows rows of one kv head computes only the keys its rows can see: the
// query's [0, min(prefix_len, last row + 1)) and its items' own [first segment start, last row],
// each range in panels of 32 keys aligned to multiples of 32 (so a key's lane never depends on
// the block), masks each score by the rule, and takes max, exp, sum and the values as the prefix
// kernel does. Output is normalized: o = sum(exp * v) / sum(exp).
//
// Layouts (row-major): q [B, T, K, G, H] (K kv heads, G query heads per kv head), k [B, K, H, T],
// v [B, K, T, H], prefix_len [B], seg_start [B, T], window: int32 scalar (INT32_MAX: none);
// o [B, T, K, G, H]; attribute scale: the score scale.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "common.h"

namespace {

using namespace tpuscore_cpu;

struct Packed {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* prefix_len;
  const int32_t* seg_start;
  float* o;
  int64_t B, T, K, G, H;
  int64_t window;
  float scale;
};

// Row t's visible keys among c0 .. c0 + 15, as `segment_mask`: causal, the query's keys and its
// own segment's, each within the window (from the row's position for query keys, from the row
// itself for its segment's).
inline __mmask16 Visible(int64_t c0, int64_t t, int64_t prefix_len, int64_t seg, int64_t window) {
  const int64_t pos = t - std::max<int64_t>(seg - prefix_len, 0);
  const __m512i c = _mm512_add_epi32(_mm512_set1_epi32(int32_t(c0)),
                                     _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                       13, 14, 15));
  auto above = [&](int64_t lo) {  // c > lo, for lo of any size
    return lo < -1 ? __mmask16(0xffff)
                   : _mm512_cmpgt_epi32_mask(c, _mm512_set1_epi32(int32_t(std::min<int64_t>(
                                                     lo, INT32_MAX - 1))));
  };
  const __mmask16 causal = _mm512_cmple_epi32_mask(c, _mm512_set1_epi32(int32_t(t)));
  const __mmask16 query = _mm512_cmplt_epi32_mask(c, _mm512_set1_epi32(int32_t(prefix_len))) &
                          above(pos - window);
  const __mmask16 own = _mm512_cmpge_epi32_mask(c, _mm512_set1_epi32(int32_t(seg))) &
                        above(t - window);
  return causal & (query | own);
}

// Rows [r0, r0 + kBlockRows) of batch row b's kv head `head` (flat row r = token * G + group).
// kH: the head dim where it is a compile-time constant (the common ones, for speed), else 0.
template <int64_t kH>
void Block(const Packed& x, int64_t b, int64_t head, int64_t r0) {
  const int64_t H = kH ? kH : x.H, T = x.T;
  const int count = int(std::min<int64_t>(kBlockRows, T * x.G - r0));
  const int64_t first_token = r0 / x.G, last = (r0 + count - 1) / x.G;  // the block's tokens
  const int64_t prefix_len = std::clamp<int64_t>(x.prefix_len[b], 0, T);
  const int32_t* seg = x.seg_start + b * T;
  // Keys [0, a_end) then [b_start, b_end), each a whole number of 32-key panels.
  const int64_t a_end = (std::min(prefix_len, last + 1) + kScoreKeys - 1) / kScoreKeys * kScoreKeys;
  int64_t lowest = last + 1;  // the smallest key of the rows' own segments
  for (int64_t t = first_token; t <= last; ++t) lowest = std::min<int64_t>(lowest, std::max<int64_t>(seg[t], 0));
  const int64_t b_start = std::max(a_end, lowest / kScoreKeys * kScoreKeys);
  const int64_t b_end = std::max(b_start, (last + 1 + kScoreKeys - 1) / kScoreKeys * kScoreKeys);
  const int columns = int(a_end + b_end - b_start);
  auto key = [&](int column) { return column < a_end ? column : b_start + column - a_end; };
  thread_local std::vector<float> scores, rows, out;
  scores.resize(size_t(kBlockRows) * columns);
  rows.resize(kBlockRows * H);
  out.resize(kBlockRows * H);
  auto offset = [&](int i) {  // row r0 + i: its offset in q and o, over H
    const int64_t r = r0 + std::min(i, count - 1);
    return ((b * T + r / x.G) * x.K + head) * x.G + r % x.G;
  };
  for (int i = 0; i < kBlockRows; ++i)  // rows past the end repeat the last; never written
    for (int64_t h = 0; h < H; ++h) rows[i * H + h] = x.q[offset(i) * H + h] * x.scale;
  const float* k = x.k + (b * x.K + head) * H * T;
  const float* v = x.v + (b * x.K + head) * T * H;
  for (int c0 = 0; c0 < columns; c0 += kScoreKeys)  // one 32-key panel of k in L1 for all rows
    for (int i0 = 0; i0 < kBlockRows; i0 += kScoreRows)
      ScoreTile(&rows[i0 * H], H, k, T, key(c0), &scores[i0 * columns], columns, c0);
  float totals[kBlockRows];
  for (int i = 0; i < count; ++i) {  // max, exp and sum over the row's visible keys
    const int64_t t = (r0 + i) / x.G;
    float* s = &scores[i * columns];
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int c0 = 0; c0 < columns; c0 += 16) {
      const __mmask16 seen = Visible(key(c0), t, prefix_len, seg[t], x.window);
      top = _mm512_mask_max_ps(top, seen, top, _mm512_loadu_ps(s + c0));
    }
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int c0 = 0; c0 < columns; c0 += 16) {
      const __mmask16 seen = Visible(key(c0), t, prefix_len, seg[t], x.window);
      const __m512 e = _mm512_maskz_mov_ps(seen, Exp(_mm512_sub_ps(_mm512_loadu_ps(s + c0), shift)));
      sum = _mm512_add_ps(sum, e);
      _mm512_storeu_ps(s + c0, e);
    }
    totals[i] = _mm512_reduce_add_ps(sum);
  }
  // Values only of keys up to the last row (the rest weigh 0, and past T are not there).
  const int tiles = (count + kValueRows - 1) / kValueRows * kValueRows;
  const int64_t a_keys = std::min(a_end, last + 1), b_keys = std::max<int64_t>(0, last + 1 - b_start);
  const std::pair<int64_t, int64_t> ranges[] = {{0, a_keys}, {a_end, a_end + b_keys}};
  bool first_values = true;
  for (const auto& [begin, end] : ranges) {
    const float* values = v + (key(int(begin)) - begin) * H;  // column c's key at row c of this
    for (int64_t c0 = begin; c0 < end; c0 += kValueKeys) {
      ValueBlock(scores.data(), columns, values, H, int(c0), int(std::min(end, c0 + kValueKeys)),
                 tiles, out.data(), first_values);
      first_values = false;
    }
  }
  for (int i = 0; i < count; ++i) {
    float* o = x.o + offset(i) * H;
    const float inverse = 1.0f / totals[i];
    for (int64_t h = 0; h < H; ++h) o[h] = out[i * H + h] * inverse;
  }
}

void Run(const Packed& x, ffi::ThreadPool& pool) {
  void (*block)(const Packed&, int64_t, int64_t, int64_t) =
      x.H == 64 ? Block<64> : x.H == 128 ? Block<128> : x.H == 256 ? Block<256> : Block<0>;
  const int64_t per_head = (x.T * x.G + kBlockRows - 1) / kBlockRows, per_row = x.K * per_head;
  RunBlocks(pool, x.B * per_row, [x, block, per_head, per_row](int64_t i) {
    block(x, i / per_row, i % per_row / per_head, (i % per_head) * kBlockRows);
  });
}

ffi::Error SegmentAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                            ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> prefix_len,
                            ffi::Buffer<ffi::S32> seg_start, ffi::Buffer<ffi::S32> window,
                            ffi::ResultBuffer<ffi::F32> o, float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || kd[0] != qd[0] || kd[1] != qd[2] ||
      kd[2] != qd[4] || kd[3] != qd[1] || vd[0] != qd[0] || vd[1] != qd[2] || vd[2] != qd[1] ||
      vd[3] != qd[4] || prefix_len.element_count() != qd[0] ||
      seg_start.element_count() != qd[0] * qd[1])
    return ffi::Error::InvalidArgument(
        "q must be [B, T, K, G, H], k [B, K, H, T], v [B, K, T, H], prefix_len [B] and "
        "seg_start [B, T]");
  Packed x{q.typed_data(), k.typed_data(), v.typed_data(), prefix_len.typed_data(),
           seg_start.typed_data(), o->typed_data(), qd[0], qd[1], qd[2], qd[3], qd[4],
           window.typed_data()[0], scale};
  if (x.B * x.T * x.K > 0) Run(x, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpuscoreSegmentAttention, SegmentAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
