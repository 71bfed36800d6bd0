// Quantized matrix products on CPUs: y = x @ W^T with W as GGUF stores it (Q8_0, Q4_0, Q4_1,
// Q5_0 blocks of 32 weights per row, Q4_K and Q6_K super-blocks of 256), for decode and short
// batches, where reading the weights is the cost: a Q4_1 row costs 0.625 bytes per weight
// against float32's 4.
//
// Formats (GGUF's; a block is 32 consecutive weights of a row):
//   Q8_0: fp16 d, int8 q[32]                 w = d * q
//   Q4_0: fp16 d, uint8 qs[16]               w = d * (nibble - 8)
//   Q4_1: fp16 d, fp16 m, uint8 qs[16]       w = d * nibble + m
//   Q5_0: fp16 d, uint32 qh, uint8 qs[16]    w = d * ((nibble | bit j of qh << 4) - 16)
// with element j < 16 in the low nibble of qs[j] and element j + 16 in its high nibble;
//   Q4_K: 256 weights: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, qs[128]
//         block j: w = (d * sc[j]) * nibble - dmin * m[j]
//   Q6_K: 256 weights: ql[128], qh[64], int8 scales[16], fp16 d    w = (d * sc) * (q6 - 32)
// laid out as gguf's dequantize (and llama.cpp) read them (see block_floats).
//
// The weights are dequantized in registers, bit for bit what the reference (gguf's dequantize)
// makes, and multiplied with float32 activations by FMA, AVX-512 where the build has it, AVX2
// otherwise, scalar C++ on other CPUs: the products of the dequantized weights in float32, only
// summed in another order: the default. llama.cpp's arithmetic, activations rounded to int8 per
// block for exact integer sums, is the opt-in *_I8 kinds ("Int8 activations" below): 2-4x faster,
// answers that move a little (tests/engine/model/test_gguf_int8_activations.py bounds how far).
// No PyTorch headers: built by portcullis/kernels/native_build.py, called through ctypes
// (portcullis/kernels/cpu_quant.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;
// The *_I8 kinds are Q8_0, Q4_0 and Q4_1 repacked for int8 activations (see "Int8 activations").
enum Kind : int { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q5_0 = 3, Q4_K = 4, Q6_K = 5, Q8_0_I8 = 6, Q4_0_I8 = 7, Q4_1_I8 = 8 };
// Bytes per block of 32 weights, or per super-block of 256 for the K-quants.
constexpr int64_t BLOCK_BYTES[9] = {34, 18, 20, 22, 144, 210, 34, 18, 20};
constexpr bool is_int8(int kind) { return kind >= Q8_0_I8; }
constexpr int stored_kind(int kind) { return is_int8(kind) ? kind - Q8_0_I8 : kind; }
constexpr bool is_k_quant(int kind) { return kind == Q4_K || kind == Q6_K; }
constexpr int64_t weights_per_block(int kind) { return is_k_quant(kind) ? 256 : QK; }
constexpr int64_t row_bytes(int kind, int64_t K) { return K / weights_per_block(kind) * BLOCK_BYTES[kind]; }

// Where block b (of 32 weights) of a row starts: its own bytes, or its super-block's.
template <int KIND>
inline const uint8_t* block_at(const uint8_t* row, int64_t b) {
    return is_k_quant(KIND) ? row + (b / 8) * BLOCK_BYTES[KIND] : row + b * BLOCK_BYTES[KIND];
}
constexpr int NR = 4;  // weight rows decoded together
// From this many activation rows on, the outer-product GEMM (gemm_panel) instead of decoding blocks
// inside dot products: the crossovers measured on SmolLM2's shapes (AVX-512, 2 threads, 2026-12-06).
// Q4_1 576x3072: dot 0.133 / 0.262 ms at 8 / 16 rows, GEMM 0.137 / 0.199. The Q8_0 head
// 576x49152: dot 1.54 / 3.04 / 6.14 ms at 8 / 16 / 32 rows, GEMM 2.85 / 3.89 / 5.79 (its panels
// cost more to build than its cheap blocks save).
constexpr int64_t gemm_rows(int kind) { return kind == Q8_0 ? 32 : 8; }

#if !defined(__F16C__)
float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    if (exponent == 0) {  // zero or subnormal
        const float f = std::ldexp(static_cast<float>(mantissa), -24);
        return sign ? -f : f;
    }
    uint32_t bits = exponent == 31 ? (sign | 0x7f800000u | (mantissa << 13))
                                   : (sign | ((exponent + 112) << 23) | (mantissa << 13));
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
#endif

uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

inline float load_half(const uint8_t* p) {
#if defined(__F16C__)
    return _cvtsh_ss(load_u16(p));
#else
    return half_to_float(load_u16(p));
#endif
}

// Block b of a row as 32 floats, each rounded as gguf's numpy dequantize rounds it: the scale
// products first (d * sc), then the value times the scale, then the minimum.
template <int KIND>
void block_floats(const uint8_t* row, int64_t b, float* dst) {
    const uint8_t* block = block_at<KIND>(row, b);
    if constexpr (KIND == Q4_K) {
        const int j = static_cast<int>(b % 8);
        const uint8_t* sc6 = block + 4;
        int sc, mn;
        if (j < 4) {
            sc = sc6[j] & 63;
            mn = sc6[j + 4] & 63;
        } else {
            sc = (sc6[j + 4] & 0x0f) | ((sc6[j - 4] >> 6) << 4);
            mn = (sc6[j + 4] >> 4) | ((sc6[j] >> 6) << 4);
        }
        const float d = load_half(block) * static_cast<float>(sc);
        const float dm = load_half(block + 2) * static_cast<float>(mn);
        const uint8_t* qs = block + 16 + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int i = 0; i < QK; ++i) dst[i] = d * static_cast<float>((qs[i] >> shift) & 0x0f) - dm;
    } else if constexpr (KIND == Q6_K) {
        const int j = static_cast<int>(b % 8), h = j / 4, t = j % 4;
        const uint8_t* ql = block + 64 * h + 32 * (t % 2);
        const uint8_t* qh = block + 128 + 32 * h;
        const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
        const float d = load_half(block + 208);
        const int lshift = 4 * (t / 2), hshift = 2 * t;
        for (int i = 0; i < QK; ++i) {
            const int q = (((ql[i] >> lshift) & 0x0f) | (((qh[i] >> hshift) & 3) << 4)) - 32;
            dst[i] = (d * static_cast<float>(scales[2 * j + i / 16])) * static_cast<float>(q);
        }
    } else {
        const float d = load_half(block);
        if constexpr (KIND == Q8_0) {
            for (int i = 0; i < QK; ++i) dst[i] = d * static_cast<float>(static_cast<int8_t>(block[2 + i]));
            return;
        }
        uint32_t qh = 0;
        if constexpr (KIND == Q5_0) std::memcpy(&qh, block + 2, 4);
        const uint8_t* qs = block + (KIND == Q4_1 ? 4 : KIND == Q5_0 ? 6 : 2);
        for (int i = 0; i < QK; ++i) {
            int q = i < 16 ? qs[i] & 0x0f : qs[i - 16] >> 4;
            if constexpr (KIND == Q4_0) q -= 8;
            if constexpr (KIND == Q5_0) q = (q | (((qh >> i) & 1) << 4)) - 16;
            dst[i] = d * static_cast<float>(q);
            if constexpr (KIND == Q4_1) dst[i] += load_half(block + 2);
        }
    }
}

#if defined(__AVX2__)
float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif

// One row of nb blocks as float32, bit for bit gguf's dequantize.
template <int KIND>
void dequantize_row(const uint8_t* row, int64_t nb, float* dst) {
    for (int64_t b = 0; b < nb; ++b) {
#if defined(__AVX2__)
        if constexpr (KIND == Q8_0 || KIND == Q4_0 || KIND == Q4_1) {
            const uint8_t* block = block_at<KIND>(row, b);
            __m256i q;
            if constexpr (KIND == Q8_0) {
                q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
            } else {
                const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (KIND == Q4_1 ? 4 : 2)));
                const __m128i mask = _mm_set1_epi8(0x0f);
                q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), mask), _mm_and_si128(qs, mask));
                if constexpr (KIND == Q4_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
            }
            const __m256 d = _mm256_set1_ps(load_half(block));
            const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
            for (int c = 0; c < 4; ++c) {
                const __m128i bytes = c % 2 ? _mm_srli_si128(halves[c / 2], 8) : halves[c / 2];
                __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d);
                if constexpr (KIND == Q4_1) v = _mm256_add_ps(v, _mm256_set1_ps(load_half(block + 2)));
                _mm256_storeu_ps(dst + b * QK + 8 * c, v);
            }
            continue;
        }
#endif
        block_floats<KIND>(row, b, dst + b * QK);
    }
}

// Float activations: weights are dequantized in registers, bit for bit the reference's (d * q,
// then + m, rounded apart), and multiplied with float32 activation rows by FMA: the products of
// the dequantized weights in float32, summed in another order, from the stored bytes. Below
// gemm_rows(kind) rows (decode) each block is decoded inside a dot product; from there (batched decode,
// prefill) the GEMM below runs over dequantized panels.
#if defined(__AVX512F__)
using fvec = __m512;
constexpr int FVL = 16, FMR = 4;  // 16 accumulators + 4 weight vectors + 1 activation of 32 registers
inline fvec fzero() { return _mm512_setzero_ps(); }
inline fvec fload(const float* p) { return _mm512_loadu_ps(p); }
inline void fstore(float* p, fvec v) { _mm512_storeu_ps(p, v); }
inline fvec ffma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline float freduce(fvec v) { return _mm512_reduce_add_ps(v); }
inline fvec fbroadcast(float v) { return _mm512_set1_ps(v); }
constexpr int GMR = 8;  // GEMM rows: 8 x 2 accumulators + 2 weight vectors + 1 broadcast

inline __m512 lo64(__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); }
inline __m512 hi64(__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); }

// dst[c][r] = src[r][c] for a 16 x 16 tile (rows ss and ds floats apart): 64 shuffles.
inline void transpose_tile(const float* src, int64_t ss, float* dst, int64_t ds) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ss);
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = lo64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = hi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = lo64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = hi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 4; ++j) {
            t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; ++j) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
    }
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ds, r[i]);
}

// Block b of a row as two vectors of 16 floats (elements 0-15, 16-31).
template <int KIND>
inline void decode_block(const uint8_t* row, int64_t b, fvec* out) {
    if constexpr (!(KIND == Q8_0 || KIND == Q4_0 || KIND == Q4_1)) {
        alignas(64) float tmp[QK];
        block_floats<KIND>(row, b, tmp);
        out[0] = _mm512_load_ps(tmp);
        out[1] = _mm512_load_ps(tmp + 16);
        return;
    }
    const uint8_t* block = block_at<KIND>(row, b);
    const __m512 d = _mm512_set1_ps(load_half(block));
    if constexpr (KIND == Q8_0) {
        for (int h = 0; h < 2; ++h) {
            const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * h)));
            out[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);
        }
        return;
    }
    // A 4-bit block has 16 possible weights: compute them once (rounded as the reference rounds
    // d * (q - 8) and d * q + m), then each nibble picks its own with one permute (measured:
    // SmolLM2's decode step 7.6 -> 7.4 ms, medians of alternated runs, against converting and
    // scaling every nibble).
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = KIND == Q4_1
        ? _mm512_add_ps(_mm512_mul_ps(levels, d), _mm512_set1_ps(load_half(block + 2)))
        : _mm512_mul_ps(_mm512_sub_ps(levels, _mm512_set1_ps(8)), d);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (KIND == Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    out[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(qs, mask)), table);
    out[1] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), mask)), table);
}
#elif defined(__AVX2__)
using fvec = __m256;
constexpr int FVL = 8, FMR = 2;  // 8 accumulators + 4 weight vectors + 1 activation of 16 registers
inline fvec fzero() { return _mm256_setzero_ps(); }
inline fvec fload(const float* p) { return _mm256_loadu_ps(p); }
inline void fstore(float* p, fvec v) { _mm256_storeu_ps(p, v); }
inline fvec ffma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline float freduce(fvec v) { return hsum(v); }
inline fvec fbroadcast(float v) { return _mm256_set1_ps(v); }
constexpr int GMR = 4;  // GEMM rows: 4 x 2 accumulators + 2 weight vectors + 1 broadcast

// dst[c][r] = src[r][c] for an 8 x 8 tile (rows ss and ds floats apart): 24 shuffles.
inline void transpose_tile(const float* src, int64_t ss, float* dst, int64_t ds) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ss);
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int j = 0; j < 4; ++j) {
        r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
        r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + i * ds, r[i]);
}
#else
using fvec = float;
constexpr int FVL = 1, FMR = 1;
inline fvec fzero() { return 0.0f; }
inline fvec fload(const float* p) { return *p; }
inline void fstore(float* p, fvec v) { *p = v; }
inline fvec ffma(fvec a, fvec b, fvec c) { return a * b + c; }
inline float freduce(fvec v) { return v; }
inline fvec fbroadcast(float v) { return v; }
constexpr int GMR = 4;
inline void transpose_tile(const float* src, int64_t, float* dst, int64_t) { *dst = *src; }
#endif

#if !defined(__AVX512F__)
// Block b of a row as 32 / FVL vectors, through the row dequantizer.
template <int KIND>
inline void decode_block(const uint8_t* row, int64_t b, fvec* out) {
    alignas(64) float tmp[QK];
    if constexpr (is_k_quant(KIND)) {
        block_floats<KIND>(row, b, tmp);
    } else {
        dequantize_row<KIND>(block_at<KIND>(row, b), 1, tmp);  // a row of one block
    }
    for (int v = 0; v < QK / FVL; ++v) out[v] = fload(tmp + v * FVL);
}
#endif

constexpr int FV = QK / FVL;  // vectors per block

// y[m0 + i][n0 + r] for MR activation rows and R weight rows, each block of the R rows decoded
// once into registers for the MR activation rows.
template <int KIND, int MR, int R>
void float_tile(const float* x, int64_t ldx, const uint8_t* const* rows, int64_t K, float* y, int64_t ldy,
                int64_t m0, int64_t n0) {
    fvec acc[MR][R];
    for (int i = 0; i < MR; ++i)
        for (int r = 0; r < R; ++r) acc[i][r] = fzero();
    for (int64_t b = 0; b < K / QK; ++b) {
        fvec w[R][FV];
        for (int r = 0; r < R; ++r) {
            // The same block four groups of rows ahead (rows are contiguous): several rows stream
            // at once, which the hardware prefetcher follows poorly (measured: a 28 MB Q8_0 head
            // took twice as long without this; SmolLM2's decode step, alternated runs, 7.6 ms
            // prefetching one group ahead, 7.3 two, 6.9 four, 7.9 eight).
            __builtin_prefetch(block_at<KIND>(rows[r] + 4 * R * row_bytes(KIND, K), b), 0, 3);
            decode_block<KIND>(rows[r], b, w[r]);
        }
        for (int v = 0; v < FV; ++v)
            for (int i = 0; i < MR; ++i) {
                const fvec xv = fload(x + (m0 + i) * ldx + b * QK + v * FVL);
                for (int r = 0; r < R; ++r) acc[i][r] = ffma(xv, w[r][v], acc[i][r]);
            }
    }
    for (int i = 0; i < MR; ++i)
        for (int r = 0; r < R; ++r) y[(m0 + i) * ldy + n0 + r] = freduce(acc[i][r]);
}

template <int KIND, int R>
void float_rows(const float* x, int64_t ldx, int64_t M, const uint8_t* const* rows, int64_t K, float* y,
                int64_t ldy, int64_t n0) {
    int64_t m = 0;
    for (; m + FMR <= M; m += FMR) float_tile<KIND, FMR, R>(x, ldx, rows, K, y, ldy, m, n0);
    for (; m < M; ++m) float_tile<KIND, 1, R>(x, ldx, rows, K, y, ldy, m, n0);
}

// Rows [first, first + count) of y for every activation row, NR weight rows at a time.
template <int KIND>
void float_group(const float* x, int64_t ldx, int64_t M, const uint8_t* w, int64_t K, int64_t first,
                 int64_t count, float* y, int64_t ldy) {
    const int64_t bytes = row_bytes(KIND, K);
    const uint8_t* rows[NR];
    for (int64_t r = 0; r < count; ++r) rows[r] = w + (first + r) * bytes;
    if (count == NR) {
        float_rows<KIND, NR>(x, ldx, M, rows, K, y, ldy, first);
    } else {
        for (int64_t r = 0; r < count; ++r) float_rows<KIND, 1>(x, ldx, M, &rows[r], K, y, ldy, first + r);
    }
}

// Many activation rows (prefill): a GEMM by outer products, as BLAS kernels do. A panel of
// GN = 2 * FVL weight rows is dequantized once into [K][GN] (column j of the panel at k), then
// each group of GMR activation rows accumulates acc[i][:] += x[i][k] * panel[k][:] over k: no
// horizontal sums, two panel loads per 2 * GMR FMAs. Each output is one sequential float32 sum.
constexpr int GN = 2 * FVL;

template <int MR>
void gemm_tile(const float* x, int64_t ldx, int64_t m0, const float* panel, int64_t K, float* y, int64_t ldy,
               int64_t n0, int64_t cols) {
    fvec acc[MR][2];
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = fzero();
    for (int64_t k = 0; k < K; ++k) {
        const fvec w0 = fload(panel + k * GN), w1 = fload(panel + k * GN + FVL);
        for (int i = 0; i < MR; ++i) {
            const fvec xv = fbroadcast(x[(m0 + i) * ldx + k]);
            acc[i][0] = ffma(xv, w0, acc[i][0]);
            acc[i][1] = ffma(xv, w1, acc[i][1]);
        }
    }
    alignas(64) float row[GN];
    for (int i = 0; i < MR; ++i) {
        fstore(row, acc[i][0]);
        fstore(row + FVL, acc[i][1]);
        std::memcpy(y + (m0 + i) * ldy + n0, row, cols * sizeof(float));
    }
}

// Output columns [n0, n0 + cols) (cols <= GN) for all M rows, through one panel.
template <int KIND>
void gemm_panel(const float* x, int64_t ldx, int64_t M, const uint8_t* w, int64_t K, int64_t n0, int64_t cols,
                float* y, int64_t ldy, float* panel) {
    const int64_t bytes = row_bytes(KIND, K);
    alignas(64) float tile[GN][QK];  // block b of each panel row, transposed into the panel below
    for (int64_t b = 0; b < K / QK; ++b) {
        for (int64_t j = 0; j < GN; ++j) {
            if (j >= cols) {  // a partial last panel: zero columns, never stored
                std::memset(tile[j], 0, sizeof(tile[j]));
                continue;
            }
            fvec v[FV];
            decode_block<KIND>(w + (n0 + j) * bytes, b, v);
            for (int i = 0; i < FV; ++i) fstore(tile[j] + i * FVL, v[i]);
        }
        for (int j = 0; j < GN; j += FVL)  // FVL x FVL tiles of the transpose, in registers
            for (int t = 0; t < QK; t += FVL) transpose_tile(&tile[j][t], QK, panel + (b * QK + t) * GN + j, GN);
    }
    int64_t m = 0;
    for (; m + GMR <= M; m += GMR) gemm_tile<GMR>(x, ldx, m, panel, K, y, ldy, n0, cols);
    for (; m < M; ++m) gemm_tile<1>(x, ldx, m, panel, K, y, ldy, n0, cols);
}

// Whether `kind` is one of ours and a row of K weights holds whole blocks of it (and, repacked,
// N rows whole groups of 16).
bool valid(int kind, int64_t K, int64_t N = 0) {
    return kind >= Q8_0 && kind <= Q4_1_I8 && K % weights_per_block(kind) == 0 && (!is_int8(kind) || N % 16 == 0);
}

// f(Kind constant) for a runtime kind.
template <typename F>
void dispatch(int kind, F&& f) {
    switch (kind) {
        case Q8_0: f(std::integral_constant<int, Q8_0>{}); break;
        case Q4_0: f(std::integral_constant<int, Q4_0>{}); break;
        case Q4_1: f(std::integral_constant<int, Q4_1>{}); break;
        case Q5_0: f(std::integral_constant<int, Q5_0>{}); break;
        case Q4_K: f(std::integral_constant<int, Q4_K>{}); break;
        default: f(std::integral_constant<int, Q6_K>{}); break;
    }
}

// ---- Int8 activations (opt-in: llama.cpp's arithmetic) ----
// Each activation row is rounded per block of 32 to int8 with its own scale (dx = max|x| / 127,
// q = round-half-even(x / dx), as llama.cpp's Q8_0/Q8_1 activations), and each block's product is
// an exact integer sum of q times the stored weight integers, scaled once by (weight scale x dx):
//   Q4_1: y += d dx sum(n q) + m (dx sum q)      Q4_0: y += d dx (sum(n q) - 8 sum q)
//   Q8_0: y += d dx sum(w q)
// Only the activations' rounding differs from the float path (measured in the tests' agreement
// bounds); the integer sums take four times fewer instructions than float FMAs on AVX-512 VNNI.
//
// Repacked layout (same bytes as the stored rows): per group of 16 rows g and block b, at
// (g * nb + b) * 16 * block bytes, the weight integers as [chunk][row of 16][4 bytes], then the 16
// scales (fp16), then for Q4_1 the 16 minima. Q4 chunk j (of 4) holds, for each row, stored bytes
// qs[4j .. 4j+3]: low nibbles are weights 4j.., high nibbles 16+4j..; Q8_0 chunk j (of 8) holds
// weights 4j .. 4j+3. One 64-byte load is then 16 rows x 4 weights, what VNNI's dpbusd multiplies.
constexpr int I8_ROWS = 16;
constexpr int64_t i8_group_block_bytes(int kind) { return I8_ROWS * BLOCK_BYTES[kind]; }
constexpr int i8_chunk_count(int kind) { return stored_kind(kind) == Q8_0 ? 8 : 4; }
constexpr int i8_scales_at(int kind) { return 64 * i8_chunk_count(kind); }

// Activation rows rounded to int8: q [M][nb][32], and per (row, block) dx, dx * sum q, sum q.
struct Int8Rows {
    std::vector<int8_t> q;
    std::vector<float> d, ds;
    std::vector<int32_t> sum;
    Int8Rows(int64_t M, int64_t K) : q(M * K), d(M * (K / QK)), ds(M * (K / QK)), sum(M * (K / QK)) {}
};

void quantize_block(const float* v, int8_t* q, float& d, float& ds, int32_t& sum) {
    float amax = 0.0f;
#if defined(__AVX512F__)
    const __m512 a = _mm512_loadu_ps(v), c = _mm512_loadu_ps(v + 16);
    amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
#elif defined(__AVX2__)
    __m256 x[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        top = _mm256_max_ps(top, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x[i]));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    amax = *std::max_element(lanes, lanes + 8);
#else
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
#endif
    d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t s = 0;
#if defined(__AVX512F__)
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));  // half to even
    const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qc));
    s = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
#elif defined(__AVX2__)
    __m256i n[4];
    for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], _mm256_set1_ps(id)));  // half to even
    // Packing works per 128-bit half (the four vectors' low halves, then their high halves); the
    // permute puts each vector's eight bytes back together, in order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    alignas(32) int32_t parts[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(parts),
                       _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3])));
    for (const int32_t part : parts) s += part;
#else
    for (int i = 0; i < QK; ++i) {
        q[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));  // the default rounding: half to even
        s += q[i];
    }
#endif
    ds = d * static_cast<float>(s);
    sum = s;
}

void team_quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, Int8Rows& a) {
    const int64_t nb = K / QK;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M * nb; ++i)
        quantize_block(x + (i / nb) * ldx + (i % nb) * QK, a.q.data() + i * QK, a.d[i], a.ds[i], a.sum[i]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 16 rows of weights per vector; a tile is two groups (32 outputs) by 4 activation rows.
using ivec = __m512i;
using svec = __m512;
constexpr int IVL = 16, I8_R = 4, I8_V = 2;
constexpr bool I8_Q8_OFFSET = true;  // dpbusd multiplies unsigned by signed bytes: Q8_0 weights + 128
inline ivec izero() { return _mm512_setzero_si512(); }
inline ivec iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline ivec inibbles_lo(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
inline ivec inibbles_hi(ivec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)); }
inline ivec ioffset(ivec v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
inline ivec idot(ivec acc, ivec w, int32_t a) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(a)); }
inline ivec idot_signed(ivec acc, ivec w, int32_t a) { return idot(acc, w, a); }  // w already offset
inline ivec isums(ivec acc) { return acc; }  // idot's sums are int32 already
inline ivec isub(ivec acc, int32_t c) { return _mm512_sub_epi32(acc, _mm512_set1_epi32(c)); }
inline svec scvt(ivec v) { return _mm512_cvtepi32_ps(v); }
inline svec shalves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline svec szero() { return _mm512_setzero_ps(); }
inline svec smul(svec a, float b) { return _mm512_mul_ps(a, _mm512_set1_ps(b)); }
inline svec sfma(svec a, svec b, svec c) { return _mm512_fmadd_ps(a, b, c); }
inline svec sfma1(svec a, float b, svec c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(b), c); }
inline void sstore(float* p, svec v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__)
// 8 rows of weights per vector (half of a group); a tile is 8 outputs by 4 activation rows (measured
// against 16 by 2: 1.3x at 16 rows, as each unpacked weight vector serves twice the rows).
using ivec = __m256i;
using svec = __m256;
constexpr int IVL = 8, I8_R = 4, I8_V = 1;
constexpr bool I8_Q8_OFFSET = false;  // signs moved onto the activations instead (llama.cpp's AVX2 way)
inline ivec izero() { return _mm256_setzero_si256(); }
inline ivec iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline ivec inibbles_lo(ivec v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
inline ivec inibbles_hi(ivec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }
inline ivec ioffset(ivec v) { return v; }
// Unsigned weights (at most 15) by signed activations (at most 127): a pair of products is at most
// 3,810, so a block's 8 pairs per lane sum in int16 (at most 30,480) and widen once (isums).
inline ivec idot(ivec acc, ivec w, int32_t a) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, _mm256_set1_epi32(a))); }
inline ivec isums(ivec acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
// Signed weights: |w| by the activation with w's sign (|w| <= 128, a pair within int16, int32 sums).
inline ivec idot_signed(ivec acc, ivec w, int32_t a) {
    const ivec pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(_mm256_set1_epi32(a), w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline ivec isub(ivec acc, int32_t c) { return _mm256_sub_epi32(acc, _mm256_set1_epi32(c)); }
inline svec scvt(ivec v) { return _mm256_cvtepi32_ps(v); }
inline svec shalves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline svec szero() { return _mm256_setzero_ps(); }
inline svec smul(svec a, float b) { return _mm256_mul_ps(a, _mm256_set1_ps(b)); }
inline svec sfma(svec a, svec b, svec c) { return _mm256_fmadd_ps(a, b, c); }
inline svec sfma1(svec a, float b, svec c) { return _mm256_fmadd_ps(a, _mm256_set1_ps(b), c); }
inline void sstore(float* p, svec v) { _mm256_storeu_ps(p, v); }
#endif

#if defined(__AVX2__)
constexpr int I8_AHEAD = 4;

// Outputs [n0, n0 + I8_V * IVL) for activation rows [m0, m0 + R): vector v covers rows of the
// group (n0 + v * IVL) / 16, at byte (n0 + v * IVL) % 16 * 4 of each chunk.
template <int KIND, int R, int V>
void int8_tile(const uint8_t* w, int64_t nb, const Int8Rows& a, int64_t m0, float* y, int64_t ldy, int64_t n0,
               bool stream) {
    constexpr int BASE = stored_kind(KIND);
    constexpr int I8_V = V;
    svec f[R][I8_V];
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < I8_V; ++v) f[r][v] = szero();
    const uint8_t* at[I8_V];
    int lane[I8_V];
    for (int v = 0; v < I8_V; ++v) {
        const int64_t n = n0 + v * IVL;
        at[v] = w + (n / I8_ROWS) * nb * i8_group_block_bytes(KIND);
        lane[v] = static_cast<int>(n % I8_ROWS);
    }
    for (int64_t b = 0; b < nb; ++b) {
        ivec acc[R][I8_V];
        for (int r = 0; r < R; ++r)
            for (int v = 0; v < I8_V; ++v) acc[r][v] = izero();
        for (int v = 0; v < I8_V; ++v) {
            const uint8_t* blk = at[v] + b * i8_group_block_bytes(KIND) + 4 * lane[v];
            for (int j = 0; j < i8_chunk_count(KIND); ++j) {
                // Weights larger than the caches (a head): a block's chunks I8_AHEAD blocks on, as
                // each group is its own stream, which the hardware prefetcher follows poorly.
                if (stream) __builtin_prefetch(blk + I8_AHEAD * i8_group_block_bytes(KIND) + 64 * j, 0, 3);
                const ivec raw = iload(blk + 64 * j);
                if constexpr (BASE == Q8_0) {
                    const ivec wv = ioffset(raw);
                    for (int r = 0; r < R; ++r) {
                        const int32_t* q = reinterpret_cast<const int32_t*>(a.q.data() + ((m0 + r) * nb + b) * QK);
                        acc[r][v] = idot_signed(acc[r][v], wv, q[j]);
                    }
                } else {
                    const ivec lo = inibbles_lo(raw), hi = inibbles_hi(raw);
                    for (int r = 0; r < R; ++r) {
                        const int32_t* q = reinterpret_cast<const int32_t*>(a.q.data() + ((m0 + r) * nb + b) * QK);
                        acc[r][v] = idot(acc[r][v], lo, q[j]);
                        acc[r][v] = idot(acc[r][v], hi, q[j + 4]);
                    }
                }
            }
        }
        for (int v = 0; v < I8_V; ++v) {
            const uint8_t* blk = at[v] + b * i8_group_block_bytes(KIND) + i8_scales_at(KIND);
            const svec d = shalves(blk + 2 * lane[v]);
            for (int r = 0; r < R; ++r) {
                const int64_t i = (m0 + r) * nb + b;
                ivec sum = BASE == Q8_0 ? acc[r][v] : isums(acc[r][v]);
                if constexpr (BASE == Q4_0) sum = isub(sum, 8 * a.sum[i]);
                if constexpr (BASE == Q8_0 && I8_Q8_OFFSET) sum = isub(sum, 128 * a.sum[i]);
                f[r][v] = sfma(smul(d, a.d[i]), scvt(sum), f[r][v]);
                if constexpr (BASE == Q4_1) f[r][v] = sfma1(shalves(blk + 32 + 2 * lane[v]), a.ds[i], f[r][v]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < I8_V; ++v) sstore(y + (m0 + r) * ldy + n0 + v * IVL, f[r][v]);
}

// Outputs [n0, n0 + cols) for every activation row; cols is I8_COLS, or 16 for a last group.
template <int KIND>
void int8_columns(const uint8_t* w, int64_t nb, int64_t M, const Int8Rows& a, float* y, int64_t ldy, int64_t n0,
                  int64_t cols, bool stream) {
    int64_t m = 0;
    if (cols == I8_V * IVL) {
        for (; m + I8_R <= M; m += I8_R) int8_tile<KIND, I8_R, I8_V>(w, nb, a, m, y, ldy, n0, stream);
        for (; m < M; ++m) int8_tile<KIND, 1, I8_V>(w, nb, a, m, y, ldy, n0, stream);
    } else {
        for (; m + I8_R <= M; m += I8_R) int8_tile<KIND, I8_R, I8_ROWS / IVL>(w, nb, a, m, y, ldy, n0, stream);
        for (; m < M; ++m) int8_tile<KIND, 1, I8_ROWS / IVL>(w, nb, a, m, y, ldy, n0, stream);
    }
}
constexpr int64_t I8_COLS = I8_V * IVL;
#else
// Scalar: one output at a time, the same sums in the same order.
template <int KIND>
void int8_columns(const uint8_t* w, int64_t nb, int64_t M, const Int8Rows& a, float* y, int64_t ldy, int64_t n,
                  int64_t, bool) {
    constexpr int BASE = stored_kind(KIND);
    const uint8_t* group = w + (n / I8_ROWS) * nb * i8_group_block_bytes(KIND);
    const int lane = static_cast<int>(n % I8_ROWS);
    for (int64_t m = 0; m < M; ++m) {
        float f = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = group + b * i8_group_block_bytes(KIND);
            const int8_t* q = a.q.data() + (m * nb + b) * QK;
            int32_t sum = 0;
            for (int j = 0; j < i8_chunk_count(KIND); ++j)
                for (int i = 0; i < 4; ++i) {
                    const uint8_t byte = blk[64 * j + 4 * lane + i];
                    if constexpr (BASE == Q8_0) {
                        sum += static_cast<int8_t>(byte) * q[4 * j + i];
                    } else {
                        sum += (byte & 0x0f) * q[4 * j + i] + (byte >> 4) * q[16 + 4 * j + i];
                    }
                }
            const int64_t i = m * nb + b;
            if constexpr (BASE == Q4_0) sum -= 8 * a.sum[i];
            f = std::fma(load_half(blk + i8_scales_at(KIND) + 2 * lane) * a.d[i], static_cast<float>(sum), f);
            if constexpr (BASE == Q4_1) f = std::fma(load_half(blk + i8_scales_at(KIND) + 32 + 2 * lane), a.ds[i], f);
        }
        y[m * ldy + n] = f;
    }
}
constexpr int64_t I8_COLS = 1;
#endif

void team_int8_matmul(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int kind, int64_t N,
                      float* y, int64_t ldy, Int8Rows& a) {
    team_quantize_rows(x, ldx, M, K, a);
    const bool stream = N * row_bytes(kind, K) > (8 << 20);  // measured: a 28 MB head 1.2-1.5x faster with it
#pragma omp for schedule(static)
    for (int64_t c = 0; c < (N + I8_COLS - 1) / I8_COLS; ++c) {
        const int64_t n0 = c * I8_COLS, cols = std::min<int64_t>(I8_COLS, N - n0);  // N: whole groups of 16
        switch (kind) {
            case Q8_0_I8: int8_columns<Q8_0_I8>(w, K / QK, M, a, y, ldy, n0, cols, stream); break;
            case Q4_0_I8: int8_columns<Q4_0_I8>(w, K / QK, M, a, y, ldy, n0, cols, stream); break;
            default: int8_columns<Q4_1_I8>(w, K / QK, M, a, y, ldy, n0, cols, stream); break;
        }
    }
}

// Block b of row n of repacked weights, back in the stored layout (into `block`).
void stored_block(const uint8_t* w, int kind, int64_t nb, int64_t n, int64_t b, uint8_t* block) {
    const uint8_t* blk = w + ((n / I8_ROWS) * nb + b) * i8_group_block_bytes(kind);
    const int lane = static_cast<int>(n % I8_ROWS), base = stored_kind(kind);
    const int ints = base == Q4_1 ? 4 : 2;  // bytes before the weights: d, and m for Q4_1
    std::memcpy(block, blk + i8_scales_at(kind) + 2 * lane, 2);
    if (base == Q4_1) std::memcpy(block + 2, blk + i8_scales_at(kind) + 32 + 2 * lane, 2);
    for (int j = 0; j < i8_chunk_count(kind); ++j) std::memcpy(block + ints + 4 * j, blk + 64 * j + 4 * lane, 4);
}

// The team_* steps run inside a parallel region, every thread of the team calling them in the
// same order; each splits its loop over the team and ends at the team's barrier (outside a region
// they run whole on the caller).

// y = x W^T (see portcullis_quant_matmul).
void team_matmul(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int kind, int64_t N,
                 float* y, int64_t ldy, Int8Rows* int8_rows) {
    if (is_int8(kind)) {
        team_int8_matmul(x, ldx, M, K, w, kind, N, y, ldy, *int8_rows);
        return;
    }
    if (M >= gemm_rows(kind)) {
        std::vector<float> panel(K * GN);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < (N + GN - 1) / GN; ++g) {
            const int64_t n0 = g * GN, cols = std::min<int64_t>(GN, N - n0);
            dispatch(kind, [&](auto k) { gemm_panel<decltype(k)::value>(x, ldx, M, w, K, n0, cols, y, ldy, panel.data()); });
        }
        return;
    }
#pragma omp for schedule(static)
    for (int64_t g = 0; g < (N + NR - 1) / NR; ++g) {
        const int64_t first = g * NR, count = std::min<int64_t>(NR, N - first);
        dispatch(kind, [&](auto k) { float_group<decltype(k)::value>(x, ldx, M, w, K, first, count, y, ldy); });
    }
}

// dst (M x K) = gamma * (x * (1 / sqrt(mean(x^2) + eps))) per row: Hugging Face's float32
// RMSNorm, its sum of squares in another order.
void team_rms_norm(const float* x, int64_t ldx, int64_t M, int64_t K, const float* gamma, float eps, float* dst) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
        const float* row = x + m * ldx;
        fvec acc = fzero();
        int64_t k = 0;
        for (; k + FVL <= K; k += FVL) acc = ffma(fload(row + k), fload(row + k), acc);
        float squares = freduce(acc);
        for (; k < K; ++k) squares += row[k] * row[k];
        const float inv = 1.0f / std::sqrt(squares / static_cast<float>(K) + eps);
        for (k = 0; k < K; ++k) dst[m * K + k] = gamma[k] * (row[k] * inv);
    }
}

// y += residual, M x N, in runs of 64 columns.
void team_add(const float* residual, int64_t ldr, int64_t M, int64_t N, float* y, int64_t ldy) {
    constexpr int64_t RUN = 64;
#pragma omp for collapse(2) schedule(static)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n0 = 0; n0 < N; n0 += RUN)
            for (int64_t n = n0; n < std::min(N, n0 + RUN); ++n) y[m * ldy + n] = residual[m * ldr + n] + y[m * ldy + n];
}

}  // namespace

extern "C" {

// Which vector code this build runs: 2 AVX-512, 1 AVX2, 0 scalar.
int portcullis_quant_isa() {
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

// y[m][n] = sum_k x[m][k] * W[n][k], W given as N rows of GGUF blocks of `kind` (0 Q8_0,
// 1 Q4_0, 2 Q4_1, 3 Q5_0, 4 Q4_K, 5 Q6_K). x: float32 rows ldx apart; y: float32 rows ldy apart.
int portcullis_quant_matmul(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w,
                            int kind, int64_t N, float* y, int64_t ldy, int threads) {
    if (!valid(kind, K, N) || M < 0 || N < 0 || threads < 1) return 1;
    Int8Rows int8_rows(is_int8(kind) ? M : 0, K);
#pragma omp parallel num_threads(threads) if (M > 0 && N > 0)
    team_matmul(x, ldx, M, K, w, kind, N, y, ldy, &int8_rows);
    return 0;
}

// y = W (gamma * x / sqrt(mean(x^2) + eps)): a decoder's RMSNorm and the projection after it in
// one parallel region. `normed` (M x K) receives the normed rows.
int portcullis_quant_norm_matmul(const float* x, int64_t ldx, int64_t M, int64_t K, const float* gamma,
                                 float eps, float* normed, const uint8_t* w, int kind, int64_t N, float* y,
                                 int64_t ldy, int threads) {
    if (!valid(kind, K, N) || M < 0 || N < 0 || threads < 1) return 1;
    Int8Rows int8_rows(is_int8(kind) ? M : 0, K);
#pragma omp parallel num_threads(threads) if (M > 0 && N > 0)
    {
        team_rms_norm(x, ldx, M, K, gamma, eps, normed);
        team_matmul(normed, K, M, K, w, kind, N, y, ldy, &int8_rows);
    }
    return 0;
}

// y = residual + x W^T: a projection back into the residual stream. y must not overlap residual.
int portcullis_quant_matmul_add(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int kind,
                                int64_t N, const float* residual, int64_t ldr, float* y, int64_t ldy, int threads) {
    if (!valid(kind, K, N) || M < 0 || N < 0 || threads < 1) return 1;
    Int8Rows int8_rows(is_int8(kind) ? M : 0, K);
#pragma omp parallel num_threads(threads) if (M > 0 && N > 0)
    {
        team_matmul(x, ldx, M, K, w, kind, N, y, ldy, &int8_rows);
        team_add(residual, ldr, M, N, y, ldy);
    }
    return 0;
}

// Built with -ffp-contract=off: multiply and add round apart, as numpy (gguf's dequantize)
// does, so the two agree exactly.
// out[i][:] = row rows[i] of W dequantized to float32 (rows == nullptr: rows first .. first+n-1),
// out rows ldo apart: embedding lookups, and tiles of W for a float GEMM at many rows.
int portcullis_dequantize_rows(const uint8_t* w, int kind, int64_t K, const int64_t* rows,
                               int64_t first, int64_t n, float* out, int64_t ldo, int threads) {
    if (!valid(kind, K) || n < 0 || threads < 1) return 1;
    const int64_t nb = K / QK, bytes = row_bytes(kind, K);
#pragma omp parallel for num_threads(threads) schedule(static) if (n * K >= (1 << 16))
    for (int64_t i = 0; i < n; ++i) {
        const int64_t r = rows ? rows[i] : first + i;
        const uint8_t* row = w + r * bytes;
        std::vector<uint8_t> stored;
        if (is_int8(kind)) {  // back in the stored layout first: the same floats as before repacking
            stored.resize(bytes);
            for (int64_t b = 0; b < nb; ++b) stored_block(w, kind, nb, r, b, stored.data() + b * BLOCK_BYTES[kind]);
            row = stored.data();
        }
        dispatch(stored_kind(kind), [&](auto k) { dequantize_row<decltype(k)::value>(row, nb, out + i * ldo); });
    }
    return 0;
}

// W (N rows of Q8_0, Q4_0 or Q4_1 blocks) repacked for int8 activations into `out` (as many
// bytes), N a multiple of 16. Returns the repacked kind, or -1 when W cannot be.
int portcullis_quant_repack_int8(const uint8_t* w, int kind, int64_t N, int64_t K, uint8_t* out, int threads) {
    if (kind < Q8_0 || kind > Q4_1 || !valid(kind, K) || N % I8_ROWS != 0 || threads < 1) return -1;
    const int packed = kind + Q8_0_I8, ints = kind == Q4_1 ? 4 : 2;
    const int64_t nb = K / QK, bytes = row_bytes(kind, K);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < N / I8_ROWS; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* dst = out + (g * nb + b) * i8_group_block_bytes(packed);
            for (int lane = 0; lane < I8_ROWS; ++lane) {
                const uint8_t* block = w + (g * I8_ROWS + lane) * bytes + b * BLOCK_BYTES[kind];
                std::memcpy(dst + i8_scales_at(packed) + 2 * lane, block, 2);
                if (kind == Q4_1) std::memcpy(dst + i8_scales_at(packed) + 32 + 2 * lane, block + 2, 2);
                for (int j = 0; j < i8_chunk_count(packed); ++j)
                    std::memcpy(dst + 64 * j + 4 * lane, block + ints + 4 * j, 4);
            }
        }
    return packed;
}

}  // extern "C"
