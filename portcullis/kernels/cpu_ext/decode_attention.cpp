// Decode attention read straight from the paged KV cache: one pass over each sequence's K
// blocks, one over its V blocks, no gathered copy. Plain C++ with OpenMP and no PyTorch headers,
// so that it compiles in seconds; kernels/cpu_decode.py builds it once per machine and calls it
// through ctypes with the tensors' data pointers.
//
// Work item: one decoding sequence, all of its heads (a block's rows of every KV head are
// adjacent, so the cache is read front to back), and all of its query rows: a decode has one;
// a short query (the 1 + K tokens of a speculative verification) has one per token, each seeing
// the keys up to its own position, and its context is read once for all of them. Scores go to a per-thread buffer
// [q_heads, visible keys], softmax in float32, then V rows are accumulated with the
// probabilities; every sum is in float32 whatever the cache's dtype. Each thread takes a
// contiguous share of the sequences, so it knows every block it will read, in order, and
// requests them ahead of the arithmetic (see BlockOrder). With AVX-512 (built with
// -march=native) the dot products and weighted sums use intrinsics, bf16 rows are widened in
// registers, and with AVX512-BF16 the bf16 scores use `vdpbf16ps`; elsewhere (AVX2, as built
// with -march=x86-64-v3, or other CPUs) plain loops that the compiler vectorizes as it can,
// their sums in an order the source fixes (see kLanes). Either way a score, a softmax and an
// output row round alike wherever their keys sit, which keeps a verification row bit for bit
// the decode it stands for.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
// The AVX2 build's own loops (x86-64-v3): an AVX-512 build has wider ones, others the portable.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define AVX2_PATH 1
#else
#define AVX2_PATH 0
#endif

namespace {

// bfloat16 is the top half of a float32.
inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float32 to bfloat16, rounded to nearest even as PyTorch rounds (a NaN stays a quiet NaN).
inline uint16_t float_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (std::isnan(x)) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
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

// The call's arguments that every work item shares.
struct Batch {
  int q_heads, kv_heads, head_dim, block_size, window;
  int64_t q_row_stride, out_row_stride, table_stride;
  const int32_t* tables;
  const int32_t* context_lens;
  const int64_t* seqs;
  const int64_t* rows;
  const int32_t* spans;  // query rows per item; null: one each

  const int32_t* table(int64_t item) const { return tables + seqs[item] * table_stride; }
  int span(int64_t item) const { return spans == nullptr ? 1 : spans[item]; }
  // The key positions [row_first, row_last) that query row r of an item sees.
  int row_last(int64_t item, int r) const { return context_lens[seqs[item]] - (span(item) - 1 - r); }
  int row_first(int64_t item, int r) const {
    return window > 0 ? std::max(0, row_last(item, r) - window) : 0;
  }
  // The key positions [first, last) that any row of the item sees: what is read.
  int first(int64_t item) const { return row_first(item, 0); }
  int last(int64_t item) const { return context_lens[seqs[item]]; }
};

// Blocks sit anywhere in the cache, so the hardware prefetcher loses the stream at each one.
// A thread's blocks are known in advance: for each of its items, the K blocks of the visible
// keys, then the V blocks. BlockOrder walks that order; the arithmetic runs one walk and a
// prefetcher another, PREFETCH_AHEAD blocks ahead, through K/V and item boundaries alike.
// Requests go out a few lines at a time between the arithmetic: all of a block at once stalled
// the core (AMD EPYC, Zen 4 and Zen 5; 1.2-1.6x the time on Zen 4). They bring lines into L2
// (prefetcht1), not L1: on an AMD EPYC Zen 4 that let one core read the cache at 1.7-2.3x the
// rate of L1 requests (whose misses queue behind the L1's few outstanding-miss slots), where on
// Zen 5 the earlier kernel had measured L1 requests 1.1-1.2x faster. 8 blocks ahead measured a
// little better than 2 or 4 (and as 16) on Zen 4.
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 8
#endif

class BlockOrder {
 public:
  BlockOrder(const char* k, const char* v, int64_t token_bytes, const Batch& b, int64_t begin,
             int64_t end)
      : k_(k), v_(v), token_bytes_(token_bytes), b_(b), item_(begin), end_(end) {
    start_pass(0);
  }

  bool done() const { return item_ >= end_; }
  // The current block's first visible row, and its rows from there.
  const char* address() const {
    const int64_t row = b_.table(item_)[block_] * int64_t{b_.block_size} + pos_ - block_ * b_.block_size;
    return (pass_ == 0 ? k_ : v_) + row * token_bytes_;
  }
  int64_t bytes() const { return rows() * token_bytes_; }
  int pos() const { return pos_; }
  int rows() const { return stop_ - pos_; }

  void next() {
    pos_ = stop_;
    if (pos_ < last_) {
      ++block_;
      stop_ = std::min(last_, stop_ + b_.block_size);
      return;
    }
    if (pass_ == 0) return start_pass(1);
    ++item_;
    start_pass(0);
  }

 private:
  void start_pass(int pass) {
    pass_ = pass;
    for (; !done(); ++item_) {  // an item with nothing visible reads no blocks
      pos_ = b_.first(item_);
      last_ = b_.last(item_);
      if (pos_ >= last_) continue;
      block_ = pos_ / b_.block_size;
      stop_ = std::min(last_, (block_ + 1) * b_.block_size);
      return;
    }
  }

  const char *k_, *v_;
  int64_t token_bytes_;
  const Batch& b_;
  int64_t item_, end_;
  int pass_ = 0, pos_ = 0, stop_ = 0, last_ = 0, block_ = 0;
};

// Cache lines to request, which a loop spreads over its iterations: a request in every
// iteration keeps memory busy while the core computes, where bursts left it idle in between.
struct Lines {
  static constexpr int kMaxPer = 4;  // lines per iteration, at most
  const char* from = nullptr;
  int n = 0, per = 0;

  // Spread over `iters` iterations (Prefetcher::step keeps n <= kMaxPer * iters).
  Lines over(int iters) const { return {from, n, (n + iters - 1) / iters}; }
  // Iteration i's share: straight-line code, so that the loop around keeps its registers.
  void request(int i) const {
    for (int j = 0; j < kMaxPer; ++j)
      if (j < per && i * per + j < n) __builtin_prefetch(from + 64 * (i * per + j), 0, 2);
  }
};

// Hands out the lines of the blocks ahead: for each block the arithmetic starts, as many lines
// as the block has, spread over the steps the arithmetic will take.
class Prefetcher {
 public:
  explicit Prefetcher(BlockOrder order) : order_(order) {
    for (int i = 0; i < PREFETCH_AHEAD && !order_.done(); ++i) order_.next();
    load();
  }

  // A block of `lines` lines starts, its arithmetic in about `steps` steps.
  void start(int64_t lines, int64_t steps) {
    request(budget_);  // what the last block's steps left over
    budget_ = lines;
    per_step_ = std::max<int64_t>(1, (lines + steps - 1) / steps);
  }
  // The next step's lines, for a loop of `iters` iterations (fewer at the end of a block
  // ahead, or than the loop can spread: the rest waits for start()).
  Lines step(int iters) {
    if (base_ == nullptr) return {};
    const int64_t n = std::min({per_step_, budget_, lines_ - line_, int64_t{Lines::kMaxPer} * iters});
    const Lines run = Lines{base_ + 64 * line_, static_cast<int>(n)}.over(iters);
    budget_ -= n;
    line_ += n;
    if (line_ == lines_) {
      order_.next();
      load();
    }
    return run;
  }

 private:
  void request(int64_t lines) {
    while (lines > 0 && base_ != nullptr) {
      const int64_t n = std::min(lines, lines_ - line_);
      const char* from = base_ + 64 * line_;
      for (int64_t i = 0; i < n; ++i) __builtin_prefetch(from + 64 * i, 0, 2);
      line_ += n;
      lines -= n;
      if (line_ == lines_) {
        order_.next();
        load();
      }
    }
  }

  void load() {
    base_ = order_.done() ? nullptr : order_.address();
    lines_ = base_ == nullptr ? 0 : (order_.bytes() + 63) / 64;
    line_ = 0;
  }

  BlockOrder order_;
  const char* base_ = nullptr;
  int64_t lines_ = 0, line_ = 0, budget_ = 0, per_step_ = 1;
};

inline float bf16_or_float(float x) { return x; }
inline float bf16_or_float(uint16_t x) { return bf16_to_float(x); }

// The portable path's sums are written out in a fixed order: element i into lane i % kLanes,
// the lanes then added in a fixed tree. With `omp simd reduction` the order was the
// compiler's, and GCC made two copies of the score loop (one for when the prefetcher has run
// out of blocks), vectorized one and summed the other in a single lane: a key's score then
// depended on where the thread's walk stood, and a verification row differed from its decode.
// Written out, every copy rounds alike, vectorized or not.
constexpr int kLanes = 8;  // one AVX2 register; every head size the kernel takes is a multiple

inline float lanes_total(float* part) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

// a * b + c, rounded once where the CPU has FMA: stated, not left to contraction, which the
// compiler may apply to one copy of a loop and not another.
inline float mul_add(float a, float b, float c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// out[t] = q . k_t for `rows` keys `stride` elements apart (portable path).
template <typename T, int D>
inline void dots(const float* q, const T* k, int64_t stride, int rows, float* out) {
  static_assert(D % kLanes == 0, "head sizes are multiples of kLanes");
  for (int t = 0; t < rows; ++t) {
    float part[kLanes] = {};
#pragma GCC unroll 32  // left a loop, float32 scores took ~10% longer (x86-64-v3, AMD EPYC)
    for (int i = 0; i < D; i += kLanes)
      for (int l = 0; l < kLanes; ++l)
        part[l] = mul_add(q[i + l], bf16_or_float(k[t * stride + i + l]), part[l]);
    out[t] = lanes_total(part);
  }
}

// acc += sum_t p[t] v_t for `rows` values `stride` elements apart (portable path).
template <typename T, int D>
inline void weighted_sum(const float* p, const T* v, int64_t stride, int rows, float* acc) {
  for (int t = 0; t < rows; ++t) {
#pragma omp simd
    for (int i = 0; i < D; ++i) acc[i] = mul_add(p[t], bf16_or_float(v[t * stride + i]), acc[i]);
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bf16 widened: each moved to the top half
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

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

// How a key row meets a query held in registers: float32 rows (or bf16 rows widened) against
// the float32 query.
template <typename T, int D>
struct WideKeys {
  static constexpr int kRegs = D / 16;
  using Reg = __m512;
  static void load_query(const float* q, const uint16_t*, Reg* r) {
    for (int c = 0; c < kRegs; ++c) r[c] = _mm512_loadu_ps(q + 16 * c);
  }
  static void load_row(const T* k, Reg* r) {
    for (int c = 0; c < kRegs; ++c) r[c] = load16(k + 16 * c);
  }
  static __m512 dot(const Reg* q, const Reg* k) {  // 16 partial sums
    __m512 s = _mm512_mul_ps(q[0], k[0]);
    for (int c = 1; c < kRegs; ++c) s = _mm512_fmadd_ps(q[c], k[c], s);
    return s;
  }
};

#if defined(__AVX512BF16__)
// bf16 keys against the query rounded to bf16 (as the PyTorch path rounds it): `vdpbf16ps`
// multiplies pairs exactly and sums in float32, with no widening of K.
template <int D>
struct Bf16Keys {
  static constexpr int kRegs = D / 32;
  using Reg = __m512i;
  static void load_query(const float*, const uint16_t* q, Reg* r) {
    for (int c = 0; c < kRegs; ++c) r[c] = _mm512_loadu_si512(q + 32 * c);
  }
  static void load_row(const uint16_t* k, Reg* r) {
    for (int c = 0; c < kRegs; ++c) r[c] = _mm512_loadu_si512(k + 32 * c);
  }
  static __m512 dot(const Reg* q, const Reg* k) {
    __m512 s = _mm512_setzero_ps();
    for (int c = 0; c < kRegs; ++c) s = _mm512_dpbf16_ps(s, (__m512bh)q[c], (__m512bh)k[c]);
    return s;
  }
};
#endif

// Lane r * P + g -> lane g * (16 / P) + r: from row-major [row][head] to one run per head.
template <int P>
inline __m512 heads_first(__m512 s) {
  if constexpr (P == 1) return s;
  alignas(64) int32_t idx[16];
  for (int g = 0; g < P; ++g)
    for (int r = 0; r < 16 / P; ++r) idx[g * (16 / P) + r] = r * P + g;
  return _mm512_permutexvar_ps(_mm512_load_si512(idx), s);
}

// out[g][0 .. 16 / P) = lanes g * (16 / P) ... of s.
template <int P>
inline void store_heads(__m512 s, float* const* out, int t) {
  if constexpr (P == 1) {
    _mm512_storeu_ps(out[0] + t, s);
  } else if constexpr (P == 2) {
    _mm256_storeu_ps(out[0] + t, _mm512_castps512_ps256(s));
    _mm256_storeu_ps(out[1] + t, _mm512_extractf32x8_ps(s, 1));
  } else {
    _mm_storeu_ps(out[0] + t, _mm512_castps512_ps128(s));
    _mm_storeu_ps(out[1] + t, _mm512_extractf32x4_ps(s, 1));
    _mm_storeu_ps(out[2] + t, _mm512_extractf32x4_ps(s, 2));
    _mm_storeu_ps(out[3] + t, _mm512_extractf32x4_ps(s, 3));
  }
}

// out[g][t] = q_g . k_t for P query heads of one KV head over `rows` keys. Each key row is
// loaded (and widened) once for the P heads, whose queries stay in registers, and the P x (16 /
// P) partial sums of 16 / P rows share one transposing reduction: a group costs the K loads of
// one head, where a pass per head cost them P times (and loaded the query from memory).
template <class K, int P, typename T>
inline void head_pass_scores(const float* const* q, const uint16_t* const* qb, const T* k,
                             int64_t stride, int rows, float* const* out, Prefetcher& ahead) {
  constexpr int R = 16 / P;  // rows per reduction
  typename K::Reg qr[P][K::kRegs], kr[K::kRegs];
  for (int g = 0; g < P; ++g) K::load_query(q[g], qb[g], qr[g]);
  int t = 0;
  for (; t + R <= rows; t += R) {
    const Lines run = ahead.step(R);
    __m512 part[4], quads[4];
#pragma GCC unroll 16  // constant indices: the partial sums stay in registers
    for (int i = 0; i < 16; ++i) {  // partial sum i: row i / P, head i % P
      if (i % P == 0) {
        run.request(i / P);
        K::load_row(k + (t + i / P) * stride, kr);
      }
      part[i % 4] = K::dot(qr[i % P], kr);
      if (i % 4 == 3) quads[i / 4] = quad_sum(pair_sum(part[0], part[1]), pair_sum(part[2], part[3]));
    }
    const __m512 s = lane_sum(lane_sum(quads[0], quads[1]), lane_sum(quads[2], quads[3]));
    store_heads<P>(heads_first<P>(s), out, t);
  }
  if (t < rows) {
    // The block's last rows, through the same reduction (its spare slots repeat the last row):
    // a score's rounding must not depend on where its key falls in a block, or a verification
    // row (which reads its sequence's context to the end) could differ from the decode it
    // stands for in the last bit, and so in a near-tie, in the token.
    const int left = rows - t;
    const Lines run = ahead.step(left);
    __m512 part[4], quads[4];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (i % P == 0) {
        run.request(i / P);
        K::load_row(k + (t + std::min(i / P, left - 1)) * stride, kr);
      }
      part[i % 4] = K::dot(qr[i % P], kr);
      if (i % 4 == 3) quads[i / 4] = quad_sum(pair_sum(part[0], part[1]), pair_sum(part[2], part[3]));
    }
    alignas(64) float sums[16];
    _mm512_store_ps(sums, heads_first<P>(lane_sum(lane_sum(quads[0], quads[1]), lane_sum(quads[2], quads[3]))));
    for (int g = 0; g < P; ++g)
      for (int r = 0; r < left; ++r) out[g][t + r] = sums[g * R + r];
  }
}

// acc[g] += sum_t p[g][t] v_t for G query heads sharing one KV head: each V row is loaded (and
// widened) once for the G heads; the G x D accumulators stay in registers over the block's rows.
template <int G, typename T, int D>
inline void weighted_sums16(const float* const* p, const T* v, int64_t stride, int rows,
                            float* const* acc, Lines ahead) {
  constexpr int C = D / 16;
  __m512 a[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc[g] + 16 * c);
  for (int t = 0; t < rows; ++t) {
    ahead.request(t);
    __m512 vt[C];
    for (int c = 0; c < C; ++c) vt[c] = load16(v + t * stride + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(p[g][t]);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(w, vt[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc[g] + 16 * c, a[g][c]);
}
#endif

// f(h, g, P) for a pass of p <= MAXP heads, P = p as a compile-time constant (the callers size
// their register arrays by it).
template <int MAXP, class F>
inline void pass_of(int p, int h, int g, F& f) {
  if constexpr (MAXP > 1)
    if (p < MAXP) return pass_of<MAXP - 1>(p, h, g, f);
  f(h, g, std::integral_constant<int, MAXP>{});
}

// f(h, g, P) for each KV head h and each pass over its query heads g .. g + P - 1 (`group` of them
// per KV head), passes of MAXP heads and the rest in one.
template <int MAXP, class F>
inline void head_passes(int kv_heads, int group, F&& f) {
  for (int h = 0; h < kv_heads; ++h)
    for (int g = h * group, end = (h + 1) * group; g < end;) {
      const int p = std::min(MAXP, end - g);
      pass_of<MAXP>(p, h, g, f);
      g += p;
    }
}

#if AVX2_PATH
// AVX2 (the x86-64-v3 build): the portable path's sums in the same order, with the eight lanes
// of `dots` in one register and eight keys' lanes totalled together (the tree of lanes_total, by
// shuffles), and the value accumulators held in registers over a block's rows. The query heads
// of one KV head go in passes of up to three, so that each key and value row is loaded, and
// widened from bf16, once a pass rather than once a head (bf16 1.4-1.5x at SmolLM2's 3 heads per
// KV head, float32 unchanged). Each score and output element rounds as the portable loops round it.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bf16 widened: each moved to the top half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// lanes_total's three levels for eight keys at once. Level 1 for keys a, b:
// [a0+a4 .. a3+a7 | b0+b4 .. b3+b7].
inline __m256 halves_sum(__m256 a, __m256 b) {
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
// Level 2 of two level-1 results x, y, per 128-bit half: [x0+x2, x1+x3, y0+y2, y1+y3].
inline __m256 pairs_sum(__m256 x, __m256 y) {
  return _mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
}
// Level 3, per 128-bit half: [u0+u1, u2+u3, v0+v1, v2+v3].
inline __m256 ends_sum(__m256 u, __m256 v) {
  return _mm256_add_ps(_mm256_shuffle_ps(u, v, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(u, v, _MM_SHUFFLE(3, 1, 3, 1)));
}

// out[h][i] = q[h] . k_{t0 + min(i, last)} for i < 8 and P heads sharing the keys: each key's
// elements loaded (and widened) once for the P heads, each head's lanes summed in `dots`' order,
// then totalled eight keys at a time (keys paired 0-4, 1-5, 2-6, 3-7 so that the shuffles leave
// them in order).
template <typename T, int D, int P>
inline void eight_scores(const float* const* q, const T* k, int64_t stride, int t0, int last, const Lines& run,
                         float* const* out) {
  alignas(32) float lanes[P][8][8];
  for (int i = 0; i < 8; ++i) {
    run.request(i);
    const T* key = k + (t0 + std::min(i, last)) * stride;
    __m256 s[P];
    for (int h = 0; h < P; ++h) s[h] = _mm256_setzero_ps();
    for (int c = 0; c < D / 8; ++c) {
      const __m256 kc = load8(key + 8 * c);
      for (int h = 0; h < P; ++h) s[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + 8 * c), kc, s[h]);
    }
    for (int h = 0; h < P; ++h) _mm256_store_ps(lanes[h][i], s[h]);
  }
  for (int h = 0; h < P; ++h) {
    const auto key = [&](int i) { return _mm256_load_ps(lanes[h][i]); };
    const __m256 u = pairs_sum(halves_sum(key(0), key(4)), halves_sum(key(1), key(5)));
    const __m256 v = pairs_sum(halves_sum(key(2), key(6)), halves_sum(key(3), key(7)));
    _mm256_storeu_ps(out[h], ends_sum(u, v));
  }
}

// out[h][t] = q[h] . k_t for `rows` keys and P heads sharing them, eight keys at a time (a
// prefetch step each).
template <typename T, int D, int P>
inline void dots8(const float* const* q, const T* k, int64_t stride, int rows, float* const* out, Prefetcher& ahead) {
  float* o[P];
  int t = 0;
  for (; t + 8 <= rows; t += 8) {
    for (int h = 0; h < P; ++h) o[h] = out[h] + t;
    eight_scores<T, D, P>(q, k, stride, t, 7, ahead.step(8), o);
  }
  if (t < rows) {  // the block's last keys through the same sums, the spare lanes repeating the last
    alignas(32) float s[P][8];
    for (int h = 0; h < P; ++h) o[h] = s[h];
    eight_scores<T, D, P>(q, k, stride, t, rows - t - 1, ahead.step(8), o);
    for (int h = 0; h < P; ++h)
      for (int i = 0; t + i < rows; ++i) out[h][t + i] = s[h][i];
  }
}

// acc[h][0 .. 8W) += sum_t p[h][t] v_t[0 .. 8W) for P heads sharing the values: each value row's
// elements loaded and widened once for the P heads, the P x W accumulators in registers.
template <int W, int P, typename T>
inline void weighted_run(const float* const* p, const T* v, int64_t stride, int rows, float* const* acc, Lines ahead) {
  __m256 a[P][W];
  for (int h = 0; h < P; ++h)
    for (int c = 0; c < W; ++c) a[h][c] = _mm256_loadu_ps(acc[h] + 8 * c);
  for (int t = 0; t < rows; ++t) {
    ahead.request(t);
    __m256 w[P];
    for (int h = 0; h < P; ++h) w[h] = _mm256_set1_ps(p[h][t]);
    for (int c = 0; c < W; ++c) {
      const __m256 x = load8(v + t * stride + 8 * c);
      for (int h = 0; h < P; ++h) a[h][c] = _mm256_fmadd_ps(w[h], x, a[h][c]);
    }
  }
  for (int h = 0; h < P; ++h)
    for (int c = 0; c < W; ++c) _mm256_storeu_ps(acc[h] + 8 * c, a[h][c]);
}

// weighted_run over the D elements in runs of W vectors (P x W accumulators of the 16
// registers), the first run requesting the step's lines.
template <int P, typename T, int D>
inline void weighted_sum8(const float* const* p, const T* v, int64_t stride, int rows, float* const* acc,
                          Lines ahead) {
  constexpr int C = D / 8, W = std::min(C, 12 / P), REST = C % W ? C % W : W;
  float* a[P];
  for (int c = 0; c < C; c += W, ahead = Lines{}) {
    for (int h = 0; h < P; ++h) a[h] = acc[h] + 8 * c;
    if (c + W <= C) weighted_run<W, P, T>(p, v + 8 * c, stride, rows, a, ahead);
    else weighted_run<REST, P, T>(p, v + 8 * c, stride, rows, a, ahead);
  }
}

#endif

// Per-thread buffers, grown as needed and reused across items.
struct Scratch {
  std::vector<float> q, scores, acc, inv_sum;
  std::vector<uint16_t> q_bf16;
};

#if defined(__AVX512F__)
// The heads of each KV group in passes of P: as many as 16 registers hold (4 heads of 64 float32
// dimensions), then the largest power of two left (Qwen's 7 heads per KV head: 4, 2, 1).
// Each query row's heads are grouped as a decode's would be, so its scores round alike.
template <class K, typename T, int D>
inline void group_scores(const Scratch& w, const T* k, int rows, const Batch& b, int span,
                         float* scores, int64_t n, Prefetcher& ahead, int64_t lines) {
  constexpr int kMaxP = K::kRegs <= 4 ? 4 : K::kRegs <= 8 ? 2 : 1;  // P x kRegs <= 16 registers
  const int group = b.q_heads / b.kv_heads;
  const int64_t stride = static_cast<int64_t>(b.kv_heads) * D;
  ahead.start(lines, b.kv_heads * span * ((rows * group + 15) / 16));  // a step per reduction, about
  for (int hr = 0; hr < b.kv_heads * span; ++hr) {  // KV head hr / span, query row hr % span
    const int h = hr / span;
    for (int g0 = hr * group, end = (hr + 1) * group; g0 < end;) {
      const int p = end - g0 >= kMaxP ? kMaxP : end - g0 >= 2 ? 2 : 1;
      const float* q[4];
      const uint16_t* qb[4];
      float* out[4];
      for (int i = 0; i < p; ++i) {
        q[i] = w.q.data() + (g0 + i) * D;
        qb[i] = w.q_bf16.data() + (g0 + i) * D;
        out[i] = scores + (g0 + i) * n;
      }
      const T* kh = k + h * D;
      if (p == 1) head_pass_scores<K, 1>(q, qb, kh, stride, rows, out, ahead);
      else if (p == 2) head_pass_scores<K, std::min(2, kMaxP)>(q, qb, kh, stride, rows, out, ahead);
      else head_pass_scores<K, kMaxP>(q, qb, kh, stride, rows, out, ahead);
      g0 += p;
    }
  }
}
#endif

// Heads of an item's `span` query rows are numbered (KV head, row, head in its group): the
// rows sharing a KV head are adjacent, so one pass over a block serves them all.
// scores[vh][j] = q_vh . k_j over one block's `rows` keys, every head of every row.
template <typename T, int D>
inline void block_scores(const Scratch& w, const T* k, int rows, const Batch& b, int span,
                         float* scores, int64_t n, Prefetcher& ahead, int64_t lines) {
#if defined(__AVX512F__)
  if constexpr (D % 16 == 0) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, uint16_t> && D % 32 == 0)
      return group_scores<Bf16Keys<D>, T, D>(w, k, rows, b, span, scores, n, ahead, lines);
#endif
    return group_scores<WideKeys<T, D>, T, D>(w, k, rows, b, span, scores, n, ahead, lines);
  }
#endif
  const int group = span * b.q_heads / b.kv_heads;
  const int64_t stride = static_cast<int64_t>(b.kv_heads) * D;
#if AVX2_PATH
  // The heads of each KV head in passes of at most three: each key loaded (and widened) once a pass.
  ahead.start(lines, b.kv_heads * ((group + 2) / 3) * ((rows + 7) / 8));
  head_passes<3>(b.kv_heads, group, [&](int h, int g, auto heads) {
    constexpr int P = decltype(heads)::value;
    const float* q[P];
    float* out[P];
    for (int i = 0; i < P; ++i) {
      q[i] = w.q.data() + (g + i) * D;
      out[i] = scores + (g + i) * n;
    }
    dots8<T, D, P>(q, k + h * D, stride, rows, out, ahead);
  });
#else
  ahead.start(lines, span * b.q_heads);
  for (int vh = 0; vh < span * b.q_heads; ++vh, ahead.step(1).request(0))
    dots<T, D>(w.q.data() + vh * D, k + (vh / group) * D, stride, rows, scores + vh * n);
#endif
}

// acc[vh] += sum_t p[vh][t] v_t over one block's `rows` values, every head of every row.
template <typename T, int D>
inline void block_values(const float* probs, const T* v, int rows, const Batch& b, int span,
                         float* acc, int64_t n, Prefetcher& ahead, int64_t lines) {
  const int group = span * b.q_heads / b.kv_heads;  // heads per KV head, all rows
  const int64_t stride = static_cast<int64_t>(b.kv_heads) * D;
#if defined(__AVX512F__)
  if constexpr (D % 16 == 0) {
    // Up to H heads of a group at a time: H x D / 16 accumulators fit the 32 registers.
    constexpr int H = std::clamp(256 / D, 1, 4);
    ahead.start(lines, b.kv_heads * ((group + H - 1) / H));
    head_passes<H>(b.kv_heads, group, [&](int h, int g, auto heads) {
      constexpr int P = decltype(heads)::value;
      const float* p[P];
      float* a[P];
      for (int i = 0; i < P; ++i) {
        p[i] = probs + (g + i) * n;
        a[i] = acc + (g + i) * D;
      }
      weighted_sums16<P, T, D>(p, v + h * D, stride, rows, a, ahead.step(rows));
    });
    return;
  }
#endif
#if AVX2_PATH
  // As block_scores: each value row loaded (and widened) once a pass of at most three heads.
  ahead.start(lines, b.kv_heads * ((group + 2) / 3));
  head_passes<3>(b.kv_heads, group, [&](int h, int g, auto heads) {
    constexpr int P = decltype(heads)::value;
    const float* p[P];
    float* a[P];
    for (int i = 0; i < P; ++i) {
      p[i] = probs + (g + i) * n;
      a[i] = acc + (g + i) * D;
    }
    weighted_sum8<P, T, D>(p, v + h * D, stride, rows, a, ahead.step(rows));
  });
#else
  ahead.start(lines, span * b.q_heads);
  for (int vh = 0; vh < span * b.q_heads; ++vh, ahead.step(1).request(0))
    weighted_sum<T, D>(probs + vh * n, v + (vh / group) * D, stride, rows, acc + vh * D);
#endif
}

#if AVX2_PATH
// exp_nonpositive on eight lanes: GCC leaves the scalar loop unvectorized for AVX2 (its clamp
// is control flow under the default trapping math), and it was about a seventh of the attention.
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.f), x);  // x itself where x is NaN, as std::max(x, -87.f)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x));
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// softmax below, eight scores at a time; the last few through masked loads and stores, so that
// every score's exponential rounds alike wherever it sits in the row.
inline float softmax(float* row, int64_t n) {
  const auto tail = [&](int64_t j) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  };
  const int64_t whole = n / kLanes * kLanes;
  __m256 top = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < whole; j += kLanes) top = _mm256_max_ps(top, _mm256_loadu_ps(row + j));
  if (whole < n)
    top = _mm256_max_ps(top, _mm256_blendv_ps(top, _mm256_maskload_ps(row + whole, tail(whole)),
                                              _mm256_castsi256_ps(tail(whole))));
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, top);
  const __m256 peak = _mm256_set1_ps(*std::max_element(lanes, lanes + kLanes));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < whole; j += kLanes) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(row + j), peak));
    _mm256_storeu_ps(row + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (whole < n) {
    const __m256i m = tail(whole);
    const __m256 e = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(_mm256_maskload_ps(row + whole, m), peak)),
                                   _mm256_castsi256_ps(m));
    _mm256_maskstore_ps(row + whole, m, e);
    sum = _mm256_add_ps(sum, e);
  }
  _mm256_store_ps(lanes, sum);
  return 1.f / lanes_total(lanes);
}
#else
// Softmax of n scores in place, left unnormalised; returns 1 / sum, summed in lanes as dots
// sums (the maximum is exact in any order).
inline float softmax(float* row, int64_t n) {
  float peak = row[0];
#pragma omp simd reduction(max : peak)
  for (int64_t j = 0; j < n; ++j) peak = row[j] > peak ? row[j] : peak;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) row[j] = exp_nonpositive(row[j] - peak);
  float part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] += row[j + l];
  for (; j < n; ++j) part[j % kLanes] += row[j];
  return 1.f / lanes_total(part);
}
#endif

// One item: `order` stands at its first K block and is left past its last V block.
template <typename T, int D>
void decode_item(const float* q, float scale, const Batch& b, int64_t item, BlockOrder& order,
                 Prefetcher& ahead, float* out, Scratch& w) {
  const int span = b.span(item), group = b.q_heads / b.kv_heads, heads = span * b.q_heads;
  const int first = b.first(item), last = b.last(item);
  const int64_t n = last - first, token_bytes = static_cast<int64_t>(b.kv_heads) * D * sizeof(T);
  // Head vh of the item is head qh of query row r (numbered as block_scores says).
  const auto row_of = [&](int vh) { return vh / group % span; };
  const auto head_of = [&](int vh) { return vh / (span * group) * group + vh % group; };
  if (n <= 0) {  // nothing visible (not a well-formed batch): zeros rather than garbage
    for (int r = 0; r < span; ++r) std::fill(out + r * b.out_row_stride, out + r * b.out_row_stride + b.q_heads * D, 0.f);
    return;
  }
  w.q.resize(static_cast<size_t>(heads) * D);
  w.q_bf16.resize(static_cast<size_t>(heads) * D);
  w.scores.resize(static_cast<size_t>(heads) * n);
  w.acc.assign(static_cast<size_t>(heads) * D, 0.f);
  w.inv_sum.resize(heads);
  for (int vh = 0; vh < heads; ++vh) {
    const float* src = q + row_of(vh) * b.q_row_stride + head_of(vh) * D;
    for (int i = 0; i < D; ++i) {
      const float x = src[i] * scale;
      w.q[vh * D + i] = x;
      w.q_bf16[vh * D + i] = float_to_bf16(x);
    }
  }
  for (int pos = first; pos < last; order.next()) {  // K blocks
    const int rows = order.rows();
    block_scores<T, D>(w, reinterpret_cast<const T*>(order.address()), rows, b, span,
                       w.scores.data() + (pos - first), n, ahead, (rows * token_bytes + 63) / 64);
    pos += rows;
  }
  for (int vh = 0; vh < heads; ++vh) {  // each row's softmax over its own keys; zeros elsewhere
    float* row = w.scores.data() + vh * n;
    const int r = row_of(vh), lo = b.row_first(item, r) - first, hi = b.row_last(item, r) - first;
    std::fill(row, row + lo, 0.f);
    std::fill(row + hi, row + n, 0.f);
    w.inv_sum[vh] = softmax(row + lo, hi - lo);
  }
  for (int pos = first; pos < last; order.next()) {  // V blocks
    const int rows = order.rows();
    block_values<T, D>(w.scores.data() + (pos - first), reinterpret_cast<const T*>(order.address()),
                       rows, b, span, w.acc.data(), n, ahead, (rows * token_bytes + 63) / 64);
    pos += rows;
  }
  for (int vh = 0; vh < heads; ++vh) {
    float* dst = out + row_of(vh) * b.out_row_stride + head_of(vh) * D;
    for (int i = 0; i < D; ++i) dst[i] = w.acc[vh * D + i] * w.inv_sum[vh];
  }
}

inline int64_t cost(const Batch& b, int64_t item) {  // keys read, arithmetic, a fixed cost
  return int64_t{std::max(0, b.last(item) - b.first(item))} * (b.span(item) + 3) / 4 + 16;
}

// Thread t of `threads` takes items [begin, end) holding about 1/threads of the visible keys
// (the work), contiguous so that its prefetcher can run into the next item.
inline void share(const Batch& b, int64_t n, int t, int threads, int64_t* begin, int64_t* end) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += cost(b, i);
  const int64_t from = total * t / threads, to = total * (t + 1) / threads;
  *begin = *end = n;
  for (int64_t i = 0, start = 0; i < n; start += cost(b, i), ++i) {
    if (start >= to) {
      *end = i;
      break;
    }
    if (start >= from && *begin == n) *begin = i;
  }
  *begin = std::min(*begin, *end);
}

template <typename T, int D>
void decode_all(const float* q, const T* kc, const T* vc, int64_t n, float scale, const Batch& b,
                float* out, int threads) {
  const int64_t token_bytes = static_cast<int64_t>(b.kv_heads) * D * sizeof(T);
#pragma omp parallel num_threads(threads)
  {
    int64_t begin, end;
    share(b, n, omp_get_thread_num(), omp_get_num_threads(), &begin, &end);
    const char *k = reinterpret_cast<const char*>(kc), *v = reinterpret_cast<const char*>(vc);
    BlockOrder order(k, v, token_bytes, b, begin, end);
    Prefetcher ahead(BlockOrder(k, v, token_bytes, b, begin, end));
    Scratch w;
    for (int64_t i = begin; i < end; ++i)
      decode_item<T, D>(q + b.rows[i] * b.q_row_stride, scale, b, i, order, ahead,
                        out + b.rows[i] * b.out_row_stride, w);
  }
}

template <typename T>
int dispatch_head_dim(const float* q, const void* kc, const void* vc, int64_t n, float scale,
                      const Batch& b, float* out, int threads) {
  const T* k = static_cast<const T*>(kc);
  const T* v = static_cast<const T*>(vc);
  switch (b.head_dim) {  // a compile-time head size lets the inner loops unroll fully
#define HEAD_DIM_CASE(D) \
  case D: decode_all<T, D>(q, k, v, n, scale, b, out, threads); return 0;
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
//   seqs[i], rows[i], spans[i]: the i-th item's sequence index, its first query/out row and
//     how many consecutive rows it has (spans null: one each); context_lens counts the keys
//     of its last row, row r seeing context_len - (span - 1 - r)
//   window <= 0 means no sliding window.
int portcullis_decode_attention(const float* q, int64_t q_row_stride, const void* key_cache,
                                const void* value_cache, int cache_is_bf16,
                                const int32_t* block_tables, int64_t table_stride,
                                const int32_t* context_lens, const int64_t* seqs,
                                const int64_t* rows, const int32_t* spans, int64_t n,
                                int q_heads, int kv_heads,
                                int head_dim, int block_size, float scale, int window,
                                float* out, int64_t out_row_stride, int threads) {
  if (kv_heads <= 0 || q_heads % kv_heads != 0 || threads <= 0)
    return 1;
  const Batch b{q_heads, kv_heads, head_dim, block_size, window, q_row_stride, out_row_stride,
                table_stride, block_tables, context_lens, seqs, rows, spans};
  if (cache_is_bf16)
    return dispatch_head_dim<uint16_t>(q, key_cache, value_cache, n, scale, b, out, threads);
  return dispatch_head_dim<float>(q, key_cache, value_cache, n, scale, b, out, threads);
}

// key_cache/value_cache rows slots[t] = key/value rows t (row_len floats each, rows ldk and ldv
// floats apart) for t < n, into caches of `num_slots` contiguous [slot][row_len] rows, float32
// (cache_is_bf16 = 0) or bfloat16 (1, rounded as PyTorch's .to(torch.bfloat16) rounds); a
// negative slot (padding) is skipped. One call for both caches: at a decode step the PyTorch
// scatter's ops cost more than the copy. Returns 1, having written nothing, if a slot is past
// the caches.
int portcullis_write_kv_cache(const float* key, int64_t ldk, const float* value, int64_t ldv, int64_t n,
                              int64_t row_len, const int64_t* slots, int64_t num_slots, void* key_cache,
                              void* value_cache, int cache_is_bf16) {
  for (int64_t t = 0; t < n; ++t)
    if (slots[t] >= num_slots) return 1;
  for (int64_t t = 0; t < n; ++t) {
    if (slots[t] < 0) continue;
    if (cache_is_bf16) {
      uint16_t* k = static_cast<uint16_t*>(key_cache) + slots[t] * row_len;
      uint16_t* v = static_cast<uint16_t*>(value_cache) + slots[t] * row_len;
      for (int64_t i = 0; i < row_len; ++i) {
        k[i] = float_to_bf16(key[t * ldk + i]);
        v[i] = float_to_bf16(value[t * ldv + i]);
      }
    } else {
      std::memcpy(static_cast<float*>(key_cache) + slots[t] * row_len, key + t * ldk, row_len * sizeof(float));
      std::memcpy(static_cast<float*>(value_cache) + slots[t] * row_len, value + t * ldv, row_len * sizeof(float));
    }
  }
  return 0;
}

}  // extern "C"
