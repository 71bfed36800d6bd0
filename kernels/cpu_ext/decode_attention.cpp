// Decode attention read straight from the paged KV cache: one pass over each sequence's K
// blocks, one over its V blocks, no gathered copy. Plain C++ with OpenMP and no PyTorch headers,
// so that it compiles in seconds; kernels/cpu_decode.py builds it once per machine and calls it
// through ctypes with the tensors' data pointers.
//
// Work item: one decoding sequence, all of its heads (a block's rows of every KV head are
// adjacent, so the cache is read front to back). Scores go to a per-thread buffer
// [q_heads, visible keys], softmax in float32, then V rows are accumulated with the
// probabilities; every sum is in float32 whatever the cache's dtype. With AVX-512 (built with
// -march=native) the dot products and weighted sums use intrinsics; elsewhere plain loops that
// the compiler vectorizes as it can.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// bfloat16 is the top half of a float32.
inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(x) for x <= 0 to ~2 ulp, in plain arithmetic so that loops over it vectorize (libm's
// expf does not, and -ffast-math would change the whole process's float environment).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);  // below, exp underflows; clamping keeps 2^n a normal float
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // x - n ln2, in two steps
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

struct Shape {
  int q_heads, kv_heads, head_dim, block_size;
  int64_t q_row_stride, out_row_stride, table_stride;
};

// Per-thread buffers, grown as needed and reused across sequences.
struct Scratch {
  std::vector<float> q, scores, acc, tile, inv_sum;
};

// A block's rows [rows][kv_heads * D] as float32: a float32 cache is read in place, a bf16
// one is widened into `tile` first.
inline const float* block_rows(const float* src, int64_t, float*) { return src; }
inline const float* block_rows(const uint16_t* src, int64_t elems, float* tile) {
#pragma omp simd
  for (int64_t i = 0; i < elems; ++i) tile[i] = bf16_to_float(src[i]);
  return tile;
}

// Blocks sit anywhere in the cache, so the hardware prefetcher loses the stream at each one.
// The block two ahead is requested into L2 (prefetcht2) in slices, one per query head, between
// the arithmetic: requested all at once, or into L1, the requests stalled the core (measured on
// an AMD EPYC: about 0.6x the time of no prefetching, against 0.8x for one block ahead).
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2
#endif
#ifndef PREFETCH_SPREAD
#define PREFETCH_SPREAD 1
#endif
struct Prefetch {
  const char* base = nullptr;
  int64_t bytes = 0;

  void slice(int i, int parts) const {
    if (base == nullptr) return;
    const int64_t lines = (bytes + 63) / 64, from = lines * i / parts, to = lines * (i + 1) / parts;
    for (int64_t line = from; line < to; ++line) __builtin_prefetch(base + 64 * line, 0, 1);
  }
};

// Visits the visible key positions [first, last) block by block: fn(position of the block's
// first visited row, rows, those rows' K or V (all heads) as float32 [rows][kv_heads * D],
// the block to prefetch meanwhile).
template <typename T, typename Fn>
inline void for_each_block(const T* cache, const int32_t* table, const Shape& s, int first,
                           int last, float* tile, Fn fn) {
  const int64_t token_elems = static_cast<int64_t>(s.kv_heads) * s.head_dim;
  const int64_t block_elems = s.block_size * token_elems;
  const int last_block = (last - 1) / s.block_size;
  for (int pos = first; pos < last;) {
    const int b = pos / s.block_size, offset = pos % s.block_size;
    const int rows = std::min(last, (b + 1) * s.block_size) - pos;
    Prefetch ahead;
    if (PREFETCH_AHEAD > 0 && b < last_block) {
      ahead.base = reinterpret_cast<const char*>(
          cache + table[std::min(b + PREFETCH_AHEAD, last_block)] * block_elems);
      ahead.bytes = block_elems * static_cast<int64_t>(sizeof(T));
      if (!PREFETCH_SPREAD) {
        ahead.slice(0, 1);
        ahead.base = nullptr;
      }
    }
    const T* src = cache + table[b] * block_elems + offset * token_elems;
    fn(pos, rows, block_rows(src, rows * token_elems, tile), ahead);
    pos += rows;
  }
}

// out[t] = q . k_t for `rows` keys `stride` floats apart.
template <int D>
inline void dots(const float* q, const float* k, int64_t stride, int rows, float* out) {
  for (int t = 0; t < rows; ++t) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < D; ++i) sum += q[i] * k[t * stride + i];
    out[t] = sum;
  }
}

// acc += sum_t p[t] v_t for `rows` values `stride` floats apart.
template <int D>
inline void weighted_sum(const float* p, const float* v, int64_t stride, int rows, float* acc) {
  for (int t = 0; t < rows; ++t) {
#pragma omp simd
    for (int i = 0; i < D; ++i) acc[i] += p[t] * v[t * stride + i];
  }
}

#if defined(__AVX512F__)
// Per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3.
inline __m512 pair_sum(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

// Per 128-bit lane: the lane sums of a, b, c, d (from pair_sum(a, b) and pair_sum(c, d)).
inline __m512 quad_sum(__m512 ab, __m512 cd) {
  const __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// Sums across lanes pairwise: [a.L0+a.L1, a.L2+a.L3, b.L0+b.L1, b.L2+b.L3].
inline __m512 lane_sum(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The 16 horizontal sums of v[0..16) as one vector: a transposing reduction costs about three
// instructions per sum where sixteen separate reductions cost about twelve.
inline __m512 horizontal_sums16(const __m512* v) {
  __m512 quads[4];
  for (int i = 0; i < 4; ++i)
    quads[i] = quad_sum(pair_sum(v[4 * i], v[4 * i + 1]), pair_sum(v[4 * i + 2], v[4 * i + 3]));
  return lane_sum(lane_sum(quads[0], quads[1]), lane_sum(quads[2], quads[3]));
}

template <int D>
inline void dots16(const float* q, const float* k, int64_t stride, float* out) {
  __m512 sums[16];
  for (int t = 0; t < 16; ++t) {
    const float* kt = k + t * stride;
    __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(kt));
    for (int i = 16; i < D; i += 16)
      s = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(kt + i), s);
    sums[t] = s;
  }
  _mm512_storeu_ps(out, horizontal_sums16(sums));
}

template <int D>
inline void weighted_sum16(const float* p, const float* v, int64_t stride, int rows, float* acc) {
  __m512 a[D / 16];  // the accumulator stays in registers over the block's rows
  for (int i = 0; i < D / 16; ++i) a[i] = _mm512_loadu_ps(acc + 16 * i);
  for (int t = 0; t < rows; ++t) {
    const __m512 w = _mm512_set1_ps(p[t]);
    for (int i = 0; i < D / 16; ++i)
      a[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + t * stride + 16 * i), a[i]);
  }
  for (int i = 0; i < D / 16; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}
#endif

// The block's dot products: 16 keys at a time with AVX-512 where the head size allows.
template <int D>
inline void block_dots(const float* q, const float* k, int64_t stride, int rows, float* out) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    int t = 0;
    for (; t + 16 <= rows; t += 16) dots16<D>(q, k + t * stride, stride, out + t);
    dots<D>(q, k + t * stride, stride, rows - t, out + t);
    return;
  }
#endif
  dots<D>(q, k, stride, rows, out);
}

template <int D>
inline void block_weighted_sum(const float* p, const float* v, int64_t stride, int rows,
                               float* acc) {
#if defined(__AVX512F__)
  if (D % 16 == 0) return weighted_sum16<D>(p, v, stride, rows, acc);
#endif
  weighted_sum<D>(p, v, stride, rows, acc);
}

// scores[qh][j] = q_qh . k_j (query pre-scaled) over the visible keys, every head.
template <typename T, int D>
void all_scores(const float* q, const T* kc, const int32_t* table, int first, int last,
                const Shape& s, float* scores, float* tile) {
  const int n = last - first, group = s.q_heads / s.kv_heads, token_elems = s.kv_heads * D;
  for_each_block(kc, table, s, first, last, tile, [&](int pos, int rows, const float* k,
                                                     const Prefetch& ahead) {
    for (int qh = 0; qh < s.q_heads; ++qh) {
      ahead.slice(qh, s.q_heads);
      block_dots<D>(q + qh * D, k + (qh / group) * D, token_elems, rows,
                    scores + static_cast<int64_t>(qh) * n + (pos - first));
    }
  });
}

// Softmax of each row of scores in place, left unnormalised; returns 1 / sum per row.
inline void softmax_rows(float* scores, int rows, int n, float* inv_sum) {
  for (int g = 0; g < rows; ++g) {
    float* row = scores + static_cast<int64_t>(g) * n;
    const float peak = *std::max_element(row, row + n);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < n; ++j) {
      row[j] = exp_nonpositive(row[j] - peak);
      sum += row[j];
    }
    inv_sum[g] = 1.f / sum;
  }
}

// acc[qh] = sum_j p[qh][j] v_j over the visible values, every head.
template <typename T, int D>
void all_values(const float* probs, const T* vc, const int32_t* table, int first, int last,
                const Shape& s, float* acc, float* tile) {
  const int n = last - first, group = s.q_heads / s.kv_heads, token_elems = s.kv_heads * D;
  for_each_block(vc, table, s, first, last, tile, [&](int pos, int rows, const float* v,
                                                     const Prefetch& ahead) {
    for (int qh = 0; qh < s.q_heads; ++qh) {
      ahead.slice(qh, s.q_heads);
      block_weighted_sum<D>(probs + static_cast<int64_t>(qh) * n + (pos - first),
                            v + (qh / group) * D, token_elems, rows, acc + qh * D);
    }
  });
}

template <typename T, int D>
void decode_one(const float* q, const T* kc, const T* vc, const int32_t* table, int context_len,
                int window, float scale, const Shape& s, float* out, Scratch& w) {
  const int hq = s.q_heads;
  const int first = window > 0 ? std::max(0, context_len - window) : 0;
  const int n = context_len - first;
  if (n <= 0) {  // nothing visible (not a well-formed batch): zeros rather than garbage
    std::fill(out, out + hq * D, 0.f);
    return;
  }
  w.q.resize(static_cast<size_t>(hq) * D);
  w.scores.resize(static_cast<size_t>(hq) * n);
  w.acc.assign(static_cast<size_t>(hq) * D, 0.f);
  w.tile.resize(static_cast<size_t>(s.block_size) * s.kv_heads * D);
  w.inv_sum.resize(hq);
  for (int i = 0; i < hq * D; ++i) w.q[i] = q[i] * scale;
  all_scores<T, D>(w.q.data(), kc, table, first, context_len, s, w.scores.data(), w.tile.data());
  softmax_rows(w.scores.data(), hq, n, w.inv_sum.data());
  all_values<T, D>(w.scores.data(), vc, table, first, context_len, s, w.acc.data(), w.tile.data());
  for (int qh = 0; qh < hq; ++qh)
    for (int i = 0; i < D; ++i) out[qh * D + i] = w.acc[qh * D + i] * w.inv_sum[qh];
}

template <typename T, int D>
void decode_all(const float* q, const T* kc, const T* vc, const int32_t* tables,
                const int32_t* context_lens, const int64_t* seqs, const int64_t* rows, int64_t n,
                int window, float scale, const Shape& s, float* out, int threads) {
#pragma omp parallel num_threads(threads)
  {
    Scratch w;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t seq = seqs[i], row = rows[i];
      decode_one<T, D>(q + row * s.q_row_stride, kc, vc, tables + seq * s.table_stride,
                       context_lens[seq], window, scale, s, out + row * s.out_row_stride, w);
    }
  }
}

template <typename T>
int dispatch_head_dim(const float* q, const void* kc, const void* vc, const int32_t* tables,
                      const int32_t* context_lens, const int64_t* seqs, const int64_t* rows,
                      int64_t n, int window, float scale, const Shape& s, float* out, int threads) {
  const T* k = static_cast<const T*>(kc);
  const T* v = static_cast<const T*>(vc);
  switch (s.head_dim) {  // a compile-time head size lets the inner loops unroll fully
#define HEAD_DIM_CASE(D) \
  case D: decode_all<T, D>(q, k, v, tables, context_lens, seqs, rows, n, window, scale, s, out, threads); return 0;
    HEAD_DIM_CASE(16) HEAD_DIM_CASE(32) HEAD_DIM_CASE(64) HEAD_DIM_CASE(80) HEAD_DIM_CASE(96)
    HEAD_DIM_CASE(128) HEAD_DIM_CASE(256)
#undef HEAD_DIM_CASE
    default: return 2;  // kernels.cpu_decode.HEAD_DIMS keeps callers to those above
  }
}

}  // namespace

extern "C" {

// Attention of one query row per decoding sequence over the paged caches.
//   q, out: float32 [tokens, q_heads, head_dim], heads and dims contiguous, rows strided
//   key_cache, value_cache: [blocks, block_size, kv_heads, head_dim] contiguous, float32
//     (cache_is_bf16 = 0) or bfloat16 (1)
//   block_tables: int32 [seqs, table_stride]; context_lens: int32 [seqs]
//   seqs[i], rows[i]: the i-th decode's sequence index and query/out row
//   window <= 0 means no sliding window.
int portcullis_decode_attention(const float* q, int64_t q_row_stride, const void* key_cache,
                                const void* value_cache, int cache_is_bf16,
                                const int32_t* block_tables, int64_t table_stride,
                                const int32_t* context_lens, const int64_t* seqs,
                                const int64_t* rows, int64_t n, int q_heads, int kv_heads,
                                int head_dim, int block_size, float scale, int window,
                                float* out, int64_t out_row_stride, int threads) {
  if (kv_heads <= 0 || q_heads % kv_heads != 0 || threads <= 0)
    return 1;
  const Shape s{q_heads, kv_heads, head_dim, block_size, q_row_stride, out_row_stride,
                table_stride};
  if (cache_is_bf16)
    return dispatch_head_dim<uint16_t>(q, key_cache, value_cache, block_tables, context_lens,
                                       seqs, rows, n, window, scale, s, out, threads);
  return dispatch_head_dim<float>(q, key_cache, value_cache, block_tables, context_lens, seqs,
                                  rows, n, window, scale, s, out, threads);
}

}  // extern "C"
