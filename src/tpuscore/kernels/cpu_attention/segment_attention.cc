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
// o [B, T, K, G, H] float32; attributes scale: the score scale, bf16: q, k and v rounded to
// bfloat16 and their dots on AVX-512 BF16 (`BlockBf16`; the caller checks the CPU has it), k and
// v then token-major [B, T, K, H] (the kernel pairs them itself) and o bfloat16.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "bf16_tiles.h"

namespace {

using namespace tpuscore_cpu;

struct Packed {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* prefix_len;
  const int32_t* seg_start;
  void* o;  // float, or with bf16 the bfloat16 bits (uint16_t)
  int64_t B, T, K, G, H;
  int64_t window;
  float scale;
  // q, k and v rounded to bfloat16, dots on AVX-512 BF16 (`BlockBf16`): then k and v are
  // token-major, [B, T, K, H], and o is bfloat16.
  bool bf16;
  // With bf16, k and v as bfloat16 pairs (`PairKeysAndValues`), per batch row and kv head:
  // key_pairs [H / 2][P] (the pair k[2m][key], k[2m + 1][key]) and value_pairs [P / 2][H] (the
  // pair v[key][h], v[key + 1][h] for even keys), P: T padded to whole 32-key panels with 0.
  const uint32_t* key_pairs;
  const uint32_t* value_pairs;
  int64_t P;
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

// The keys a block of rows [r0, r0 + count) of batch row b can see, as columns: the query's
// [0, a_end) then the rows' own segments' [b_start, b_end), each a whole number of 32-key panels.
struct Span {
  int count;
  int64_t last;  // the block's last token
  int64_t prefix_len, a_end, b_start, b_end;
  int columns;
  int64_t key(int64_t column) const { return column < a_end ? column : b_start + column - a_end; }
  // The value pass's column ranges: keys up to the last row (the rest weigh 0, and past T are
  // not there), the second range's columns right after the first's panels.
  std::pair<int64_t, int64_t> a_values() const { return {0, std::min(a_end, last + 1)}; }
  std::pair<int64_t, int64_t> b_values() const {
    return {a_end, a_end + std::max<int64_t>(0, last + 1 - b_start)};
  }
};

Span SpanOf(const Packed& x, int64_t b, int64_t r0) {
  const int64_t T = x.T;
  Span span;
  span.count = int(std::min<int64_t>(kBlockRows, T * x.G - r0));
  const int64_t first_token = r0 / x.G;
  span.last = (r0 + span.count - 1) / x.G;
  span.prefix_len = std::clamp<int64_t>(x.prefix_len[b], 0, T);
  const int32_t* seg = x.seg_start + b * T;
  span.a_end = (std::min(span.prefix_len, span.last + 1) + kScoreKeys - 1) / kScoreKeys * kScoreKeys;
  int64_t lowest = span.last + 1;  // the smallest key of the rows' own segments
  for (int64_t t = first_token; t <= span.last; ++t)
    lowest = std::min<int64_t>(lowest, std::max<int64_t>(seg[t], 0));
  span.b_start = std::max(span.a_end, lowest / kScoreKeys * kScoreKeys);
  span.b_end = std::max(span.b_start, (span.last + 1 + kScoreKeys - 1) / kScoreKeys * kScoreKeys);
  span.columns = int(span.a_end + span.b_end - span.b_start);
  return span;
}

// Row i of the block (flat row r0 + i = token * G + group): its offset in q and o, over H. Rows
// past the end repeat the last; never written.
inline int64_t RowOffset(const Packed& x, int64_t b, int64_t head, int64_t r0, const Span& span,
                         int i) {
  const int64_t r = r0 + std::min(i, span.count - 1);
  return ((b * x.T + r / x.G) * x.K + head) * x.G + r % x.G;
}

// Scores [count][columns] (scaled) to exp(score - row max) over each row's visible keys, 0
// elsewhere; totals[i]: row i's sum.
inline void Softmax(const Packed& x, int64_t b, int64_t r0, const Span& span, float* scores,
                    float* totals) {
  const int32_t* seg = x.seg_start + b * x.T;
  for (int i = 0; i < span.count; ++i) {
    const int64_t t = (r0 + i) / x.G;
    float* s = scores + i * span.columns;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int c0 = 0; c0 < span.columns; c0 += 16) {
      const __mmask16 seen = Visible(span.key(c0), t, span.prefix_len, seg[t], x.window);
      top = _mm512_mask_max_ps(top, seen, top, _mm512_loadu_ps(s + c0));
    }
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int c0 = 0; c0 < span.columns; c0 += 16) {
      const __mmask16 seen = Visible(span.key(c0), t, span.prefix_len, seg[t], x.window);
      const __m512 e = _mm512_maskz_mov_ps(seen, Exp(_mm512_sub_ps(_mm512_loadu_ps(s + c0), shift)));
      sum = _mm512_add_ps(sum, e);
      _mm512_storeu_ps(s + c0, e);
    }
    totals[i] = _mm512_reduce_add_ps(sum);
  }
}

// o = out / total for the block's rows.
inline void Write(const Packed& x, int64_t b, int64_t head, int64_t r0, const Span& span,
                  const float* out, const float* totals, int64_t H) {
  for (int i = 0; i < span.count; ++i) {
    float* o = static_cast<float*>(x.o) + RowOffset(x, b, head, r0, span, i) * H;
    const float inverse = 1.0f / totals[i];
    for (int64_t h = 0; h < H; ++h) o[h] = out[i * H + h] * inverse;
  }
}

// Rows [r0, r0 + kBlockRows) of batch row b's kv head `head`, float32.
// kH: the head dim where it is a compile-time constant (the common ones, for speed), else 0.
template <int64_t kH>
void Block(const Packed& x, int64_t b, int64_t head, int64_t r0) {
  const int64_t H = kH ? kH : x.H, T = x.T;
  const Span span = SpanOf(x, b, r0);
  const int columns = span.columns;
  thread_local std::vector<float> scores, rows, out;
  scores.resize(size_t(kBlockRows) * columns);
  rows.resize(kBlockRows * H);
  out.resize(kBlockRows * H);
  for (int i = 0; i < kBlockRows; ++i)
    for (int64_t h = 0; h < H; ++h)
      rows[i * H + h] = x.q[RowOffset(x, b, head, r0, span, i) * H + h] * x.scale;
  const float* k = x.k + (b * x.K + head) * H * T;
  const float* v = x.v + (b * x.K + head) * T * H;
  for (int c0 = 0; c0 < columns; c0 += kScoreKeys)  // one 32-key panel of k in L1 for all rows
    for (int i0 = 0; i0 < kBlockRows; i0 += kScoreRows)
      ScoreTile(&rows[i0 * H], H, k, T, span.key(c0), &scores[i0 * columns], columns, c0);
  float totals[kBlockRows];
  Softmax(x, b, r0, span, scores.data(), totals);
  const int tiles = (span.count + kValueRows - 1) / kValueRows * kValueRows;
  bool first_values = true;
  for (const auto& [begin, end] : {span.a_values(), span.b_values()}) {
    const float* values = v + (span.key(begin) - begin) * H;  // column c's key at row c of this
    for (int64_t c0 = begin; c0 < end; c0 += kValueKeys) {
      ValueBlock(scores.data(), columns, values, H, int(c0), int(std::min(end, c0 + kValueKeys)),
                 tiles, out.data(), first_values);
      first_values = false;
    }
  }
  Write(x, b, head, r0, span, out.data(), totals, H);
}

// Keys [p0, p0 + 64) of batch row b's kv head `head` (k and v token-major) into x's key and
// value pairs (rounded to bfloat16), 0 past T.
TPUSCORE_BF16 void PairKeysAndValues(const Packed& x, int64_t b, int64_t head, int64_t p0,
                                     uint32_t* key_pairs, uint32_t* value_pairs) {
  const int64_t H = x.H, T = x.T, P = x.P, end = std::min<int64_t>(p0 + 64, P);
  auto at = [&](const float* base, int64_t key) { return base + ((b * T + key) * x.K + head) * H; };
  uint32_t* kp = key_pairs + (b * x.K + head) * (H / 2) * P;
  uint32_t* vp = value_pairs + (b * x.K + head) * (P / 2) * H;
  uint32_t pairs[256];  // one key's H / 2 pairs (H <= 512)
  for (int64_t c = p0; c < end; ++c) {  // k[c] as pairs, stored key-minor: kp[m][c]
    if (c < T) {
      RoundRow(at(x.k, c), H, pairs);
    } else {
      std::fill(pairs, pairs + H / 2, 0u);
    }
    for (int64_t m = 0; m < H / 2; ++m) kp[m * P + c] = pairs[m];
  }
  for (int64_t c = p0; c < end; c += 2)
    for (int64_t h0 = 0; h0 < H; h0 += 16) {
      const __mmask16 lanes = Lanes(H - h0);
      const __m512 even = _mm512_maskz_loadu_ps(c < T ? lanes : 0, at(x.v, c) + h0);
      const __m512 odd = _mm512_maskz_loadu_ps(c + 1 < T ? lanes : 0, at(x.v, c + 1) + h0);
      _mm512_mask_storeu_epi32(vp + c / 2 * H + h0, lanes, Interleave(even, odd));
    }
}

// The same rows with q, k and v rounded to bfloat16 and their dots on AVX-512 BF16 (float32
// sums, two products a step: q.k over pairs of the head dim, e.v over pairs of keys; e rounded
// to bfloat16 too, its sum kept in float32). A pair's keys are an even key and the next, so a
// key's pair, like its lane, never depends on the block.
template <int64_t kH>
TPUSCORE_BF16 void BlockBf16(const Packed& x, int64_t b, int64_t head, int64_t r0) {
  const int64_t H = kH ? kH : x.H, pairs = H / 2, P = x.P;
  const Span span = SpanOf(x, b, r0);
  const int columns = span.columns;
  thread_local std::vector<float> scores, out;
  thread_local std::vector<uint32_t> rows;
  thread_local std::vector<uint16_t> weights;
  scores.resize(size_t(kBlockRows) * columns);
  out.resize(kBlockRows * H);
  rows.resize(kBlockRows * pairs);
  weights.resize(size_t(kBlockRows) * columns);
  for (int i = 0; i < kBlockRows; ++i)  // q[i] as pairs (q[2m], q[2m + 1])
    RoundRow(x.q + RowOffset(x, b, head, r0, span, i) * H, H, &rows[i * pairs]);
  const uint32_t* keys = x.key_pairs + (b * x.K + head) * pairs * P;
  const uint32_t* values = x.value_pairs + (b * x.K + head) * (P / 2) * H;
  for (int c0 = 0; c0 < columns; c0 += kScoreKeys)
    for (int i0 = 0; i0 < kBlockRows; i0 += kScoreRows)
      ScoreTileBf16(&rows[i0 * pairs], pairs, keys, P, span.key(c0), &scores[i0 * columns],
                    columns, c0, x.scale);
  float totals[kBlockRows];
  Softmax(x, b, r0, span, scores.data(), totals);
  for (int i = 0; i < span.count; ++i)  // e as bfloat16, in column order
    for (int c0 = 0; c0 < columns; c0 += 32) {
      const float* e = &scores[i * columns + c0];
      _mm512_storeu_si512(&weights[i * columns + c0],
                          (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(e + 16), _mm512_loadu_ps(e)));
    }
  const int tiles = (span.count + kValueRows - 1) / kValueRows * kValueRows;
  bool first_values = true;
  for (const auto& [begin, end] : {span.a_values(), span.b_values()}) {
    // An odd end's last pair takes the next key too, past the last row: its e is 0.
    const uint32_t* shifted = values + (span.key(begin) - begin) / 2 * H;  // column c at c / 2
    for (int64_t c0 = begin; c0 < end; c0 += kValueKeys) {
      ValueBlockBf16(weights.data(), columns, shifted, H, int(c0),
                     int(std::min(end, c0 + kValueKeys)), tiles, out.data(), first_values);
      first_values = false;
    }
  }
  for (int i = 0; i < span.count; ++i) {  // o = out / total, rounded to bfloat16
    uint16_t* o = static_cast<uint16_t*>(x.o) + RowOffset(x, b, head, r0, span, i) * H;
    const __m512 inverse = _mm512_set1_ps(1.0f / totals[i]);
    for (int64_t h0 = 0; h0 < H; h0 += 16) {
      const __mmask16 lanes = Lanes(H - h0);
      const __m512 value = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, &out[i * H + h0]), inverse);
      _mm256_mask_storeu_epi16(o + h0, lanes, (__m256i)_mm512_cvtneps_pbh(value));
    }
  }
}

void Run(Packed x, ffi::ThreadPool& pool) {
  void (*block)(const Packed&, int64_t, int64_t, int64_t) =
      x.H == 64 ? Block<64> : x.H == 128 ? Block<128> : x.H == 256 ? Block<256> : Block<0>;
  std::vector<uint32_t> key_pairs, value_pairs;
  if (x.bf16) {  // k and v rounded once, not per block of rows
    block = x.H == 64    ? BlockBf16<64>
            : x.H == 128 ? BlockBf16<128>
            : x.H == 256 ? BlockBf16<256>
                         : BlockBf16<0>;
    x.P = (x.T + kScoreKeys - 1) / kScoreKeys * kScoreKeys;
    key_pairs.resize(size_t(x.B * x.K) * (x.H / 2) * x.P);
    value_pairs.resize(size_t(x.B * x.K) * (x.P / 2) * x.H);
    x.key_pairs = key_pairs.data();
    x.value_pairs = value_pairs.data();
    const int64_t chunks = (x.P + 63) / 64;
    RunBlocks(pool, x.B * x.K * chunks, [&x, chunks, &key_pairs, &value_pairs](int64_t i) {
      PairKeysAndValues(x, i / chunks / x.K, i / chunks % x.K, i % chunks * 64, key_pairs.data(),
                        value_pairs.data());
    });
  }
  const int64_t per_head = (x.T * x.G + kBlockRows - 1) / kBlockRows, per_row = x.K * per_head;
  RunBlocks(pool, x.B * per_row, [x, block, per_head, per_row](int64_t i) {
    block(x, i / per_row, i % per_row / per_head, (i % per_head) * kBlockRows);
  });
}

ffi::Error SegmentAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                            ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> prefix_len,
                            ffi::Buffer<ffi::S32> seg_start, ffi::Buffer<ffi::S32> window,
                            ffi::Result<ffi::AnyBuffer> o, float scale, bool bf16) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const int64_t B = qd.size() == 5 ? qd[0] : 0, T = B ? qd[1] : 0, K = B ? qd[2] : 0;
  const int64_t H = B ? qd[4] : 0;
  const bool k_ok = kd.size() == 4 && (bf16 ? kd[0] == B && kd[1] == T && kd[2] == K && kd[3] == H
                                            : kd[0] == B && kd[1] == K && kd[2] == H && kd[3] == T);
  const bool v_ok = vd.size() == 4 && (bf16 ? vd[0] == B && vd[1] == T && vd[2] == K && vd[3] == H
                                            : vd[0] == B && vd[1] == K && vd[2] == T && vd[3] == H);
  if (qd.size() != 5 || !k_ok || !v_ok || prefix_len.element_count() != B ||
      seg_start.element_count() != B * T ||
      o->element_type() != (bf16 ? ffi::DataType::BF16 : ffi::DataType::F32))
    return ffi::Error::InvalidArgument(
        "q must be [B, T, K, G, H], k [B, K, H, T], v [B, K, T, H] (with bf16: both [B, T, K, "
        "H]), prefix_len [B], seg_start [B, T] and o float32 (with bf16: bfloat16)");
  if (bf16 && (H % 2 != 0 || H > 512 || !__builtin_cpu_supports("avx512bf16")))
    return ffi::Error::InvalidArgument(
        "bfloat16 dots need an even head dim up to 512 and AVX-512 BF16");
  Packed x{q.typed_data(), k.typed_data(), v.typed_data(), prefix_len.typed_data(),
           seg_start.typed_data(), o->untyped_data(), B, T, K, qd[3], H,
           window.typed_data()[0], scale, bf16, nullptr, nullptr, 0};
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
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("bf16"));

// Whether this CPU runs the kernel's bfloat16 dots (`bf16`).
extern "C" int tpuscore_cpu_bf16_dots() { return __builtin_cpu_supports("avx512bf16"); }
