// Quantized matrix products on CPUs: y = x @ W^T with W as GGUF stores it (Q8_0, Q4_0, Q4_1
// blocks of 32 weights per row), for decode and short batches, where reading the weights is
// the cost: a Q4_1 row costs 0.625 bytes per weight against float32's 4.
//
// Formats (GGUF's, one block = 32 consecutive weights of a row):
//   Q8_0: fp16 d, int8 q[32]                 w = d * q
//   Q4_0: fp16 d, uint8 qs[16]               w = d * (nibble - 8)
//   Q4_1: fp16 d, fp16 m, uint8 qs[16]       w = d * nibble + m
// with element j < 16 in the low nibble of qs[j] and element j + 16 in its high nibble.
//
// The weights are dequantized in registers, bit for bit what the reference (gguf's dequantize)
// makes, and multiplied with float32 activations by FMA, AVX-512 where the build has it, AVX2
// otherwise, scalar C++ on other CPUs: the products of the dequantized weights in float32, only
// summed in another order. (llama.cpp rounds activations to int8 per block for integer dots;
// measured on SmolLM2-135M's Q4_1 file that flipped greedy answers the float path keeps — "Paris"
// among them — and was no faster at one row, slower at many: benchmarks/quant_matmul_cpu.py.)
// No PyTorch headers: built by portcullis/kernels/native_build.py, called through ctypes
// (portcullis/kernels/cpu_quant.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;
enum Kind : int { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };
constexpr int64_t BLOCK_BYTES[3] = {34, 18, 20};
constexpr int NR = 4;  // weight rows decoded together

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

// One block's 32 weights as signed integers (the value before scaling and the Q4_1 minimum),
// and its scale and minimum.
[[maybe_unused]] void block_values(const uint8_t* block, int kind, int8_t* q, float* d, float* m) {
    *d = load_half(block);
    *m = kind == Q4_1 ? load_half(block + 2) : 0.0f;
    if (kind == Q8_0) {
        std::memcpy(q, block + 2, QK);
        return;
    }
    const uint8_t* qs = block + (kind == Q4_1 ? 4 : 2);
    const int shift = kind == Q4_0 ? 8 : 0;
    for (int j = 0; j < QK / 2; ++j) {
        q[j] = static_cast<int8_t>((qs[j] & 0x0f) - shift);
        q[j + QK / 2] = static_cast<int8_t>((qs[j] >> 4) - shift);
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

// One row of blocks as float32: d * q (+ m for Q4_1), rounded as numpy rounds it (gguf's own).
template <int KIND>
void dequantize_row(const uint8_t* row, int64_t nb, float* dst) {
    constexpr int64_t BB = BLOCK_BYTES[KIND];
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = row + b * BB;
#if defined(__AVX2__)
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
#else
        int8_t q[QK];
        float d, m;
        block_values(block, KIND, q, &d, &m);
        for (int j = 0; j < QK; ++j)
            dst[b * QK + j] = KIND == Q4_1 ? d * static_cast<float>(q[j]) + m : d * static_cast<float>(q[j]);
#endif
    }
}

// Float activations: weights are dequantized in registers, bit for bit the reference's (d * q,
// then + m, rounded apart), and multiplied with float32 activation rows by FMA: the products of
// the dequantized weights in float32, summed in another order, from the stored bytes. For a few
// rows each block is decoded inside the product; for many, each group of NR weight rows is
// decoded once into a float panel (NR x K, in L1/L2) that all activation rows then pass.
#if defined(__AVX512F__)
using fvec = __m512;
constexpr int FVL = 16, FMR = 4;  // 16 accumulators + 4 weight vectors + 1 activation of 32 registers
inline fvec fzero() { return _mm512_setzero_ps(); }
inline fvec fload(const float* p) { return _mm512_loadu_ps(p); }
inline void fstore(float* p, fvec v) { _mm512_storeu_ps(p, v); }
inline fvec ffma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline float freduce(fvec v) { return _mm512_reduce_add_ps(v); }

// One block's 32 weights as two vectors of 16 floats (elements 0-15, 16-31).
template <int KIND>
inline void decode_block(const uint8_t* block, fvec* out) {
    const __m512 d = _mm512_set1_ps(load_half(block));
    __m512i q[2];
    if constexpr (KIND == Q8_0) {
        for (int h = 0; h < 2; ++h)
            q[h] = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * h)));
    } else {
        const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (KIND == Q4_1 ? 4 : 2)));
        const __m128i mask = _mm_set1_epi8(0x0f);
        q[0] = _mm512_cvtepu8_epi32(_mm_and_si128(qs, mask));
        q[1] = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), mask));
        if constexpr (KIND == Q4_0)
            for (int h = 0; h < 2; ++h) q[h] = _mm512_sub_epi32(q[h], _mm512_set1_epi32(8));
    }
    for (int h = 0; h < 2; ++h) {
        out[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(q[h]), d);
        if constexpr (KIND == Q4_1) out[h] = _mm512_add_ps(out[h], _mm512_set1_ps(load_half(block + 2)));
    }
}
#elif defined(__AVX2__)
using fvec = __m256;
constexpr int FVL = 8, FMR = 2;  // 8 accumulators + 4 weight vectors + 1 activation of 16 registers
inline fvec fzero() { return _mm256_setzero_ps(); }
inline fvec fload(const float* p) { return _mm256_loadu_ps(p); }
inline void fstore(float* p, fvec v) { _mm256_storeu_ps(p, v); }
inline fvec ffma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline float freduce(fvec v) { return hsum(v); }
#else
using fvec = float;
constexpr int FVL = 1, FMR = 1;
inline fvec fzero() { return 0.0f; }
inline fvec fload(const float* p) { return *p; }
inline void fstore(float* p, fvec v) { *p = v; }
inline fvec ffma(fvec a, fvec b, fvec c) { return a * b + c; }
inline float freduce(fvec v) { return v; }
#endif

#if !defined(__AVX512F__)
// One block's 32 weights as 32 / FVL vectors, through the row dequantizer.
template <int KIND>
inline void decode_block(const uint8_t* block, fvec* out) {
    alignas(64) float tmp[QK];
    dequantize_row<KIND>(block, 1, tmp);
    for (int v = 0; v < QK / FVL; ++v) out[v] = fload(tmp + v * FVL);
}
#endif

constexpr int FV = QK / FVL;  // vectors per block

// y[m0 + i][n0 + r] for MR activation rows and R weight rows; the weights come decoded from
// `panel` (R rows of K floats) or, without one, from their blocks.
template <int KIND, int MR, int R>
void float_tile(const float* x, int64_t ldx, const uint8_t* const* rows, const float* panel, int64_t K,
                float* y, int64_t ldy, int64_t m0, int64_t n0) {
    fvec acc[MR][R];
    for (int i = 0; i < MR; ++i)
        for (int r = 0; r < R; ++r) acc[i][r] = fzero();
    for (int64_t b = 0; b < K / QK; ++b) {
        fvec w[R][FV];
        for (int r = 0; r < R; ++r) {
            if (panel) {
                for (int v = 0; v < FV; ++v) w[r][v] = fload(panel + r * K + b * QK + v * FVL);
            } else {
                // The same block of the next group of rows (rows are contiguous): several rows
                // stream at once, which the hardware prefetcher follows poorly (measured: a 28 MB
                // Q8_0 head took twice as long without this).
                __builtin_prefetch(rows[r] + (b + R * (K / QK)) * BLOCK_BYTES[KIND], 0, 3);
                decode_block<KIND>(rows[r] + b * BLOCK_BYTES[KIND], w[r]);
            }
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
void float_rows(const float* x, int64_t ldx, int64_t M, const uint8_t* const* rows, const float* panel,
                int64_t K, float* y, int64_t ldy, int64_t n0) {
    int64_t m = 0;
    for (; m + FMR <= M; m += FMR) float_tile<KIND, FMR, R>(x, ldx, rows, panel, K, y, ldy, m, n0);
    for (; m < M; ++m) float_tile<KIND, 1, R>(x, ldx, rows, panel, K, y, ldy, m, n0);
}

// Rows [first, first + count) of y for every activation row, NR weight rows at a time.
template <int KIND>
void float_group(const float* x, int64_t ldx, int64_t M, const uint8_t* w, int64_t K, int64_t first,
                 int64_t count, float* y, int64_t ldy, float* panel) {
    const int64_t nb = K / QK, row_bytes = nb * BLOCK_BYTES[KIND];
    const uint8_t* rows[NR];
    for (int64_t r = 0; r < count; ++r) rows[r] = w + (first + r) * row_bytes;
    if (panel)  // many activation rows: decode once for all of them
        for (int64_t r = 0; r < count; ++r)
            for (int64_t b = 0; b < nb; ++b) {
                __builtin_prefetch(rows[r] + (b + NR * nb) * BLOCK_BYTES[KIND], 0, 3);  // as in float_tile
                fvec v[FV];
                decode_block<KIND>(rows[r] + b * BLOCK_BYTES[KIND], v);
                for (int i = 0; i < FV; ++i) fstore(panel + r * K + b * QK + i * FVL, v[i]);
            }
    if (count == NR) {
        float_rows<KIND, NR>(x, ldx, M, rows, panel, K, y, ldy, first);
    } else {
        for (int64_t r = 0; r < count; ++r)
            float_rows<KIND, 1>(x, ldx, M, &rows[r], panel ? panel + r * K : nullptr, K, y, ldy, first + r);
    }
}

bool valid_kind(int kind) { return kind == Q8_0 || kind == Q4_0 || kind == Q4_1; }

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

// y[m][n] = sum_k x[m][k] * W[n][k], W given as N rows of K/32 GGUF blocks of `kind`
// (0 Q8_0, 1 Q4_0, 2 Q4_1). x: float32 rows ldx apart; y: float32 rows ldy apart.
int portcullis_quant_matmul(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w,
                            int kind, int64_t N, float* y, int64_t ldy, int threads) {
    if (!valid_kind(kind) || K % QK || M < 0 || N < 0 || threads < 1) return 1;
    if (M == 0 || N == 0) return 0;
    const int64_t groups = (N + NR - 1) / NR;
    const bool use_panel = M > 2 * FMR;  // measured: decoding in place wins up to a few tiles
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> panel(use_panel ? NR * K : 0);
        float* p = use_panel ? panel.data() : nullptr;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t first = g * NR, count = std::min<int64_t>(NR, N - first);
            switch (kind) {
                case Q8_0: float_group<Q8_0>(x, ldx, M, w, K, first, count, y, ldy, p); break;
                case Q4_0: float_group<Q4_0>(x, ldx, M, w, K, first, count, y, ldy, p); break;
                default: float_group<Q4_1>(x, ldx, M, w, K, first, count, y, ldy, p); break;
            }
        }
    }
    return 0;
}

// Built with -ffp-contract=off: multiply and add round apart, as numpy (gguf's dequantize)
// does, so the two agree exactly.
// out[i][:] = row rows[i] of W dequantized to float32 (rows == nullptr: rows first .. first+n-1),
// out rows ldo apart: embedding lookups, and tiles of W for a float GEMM at many rows.
int portcullis_dequantize_rows(const uint8_t* w, int kind, int64_t K, const int64_t* rows,
                               int64_t first, int64_t n, float* out, int64_t ldo, int threads) {
    if (!valid_kind(kind) || K % QK || n < 0 || threads < 1) return 1;
    const int64_t nb = K / QK, row_bytes = nb * BLOCK_BYTES[kind];
#pragma omp parallel for num_threads(threads) schedule(static) if (n * K >= (1 << 16))
    for (int64_t i = 0; i < n; ++i) {
        const uint8_t* row = w + (rows ? rows[i] : first + i) * row_bytes;
        switch (kind) {
            case Q8_0: dequantize_row<Q8_0>(row, nb, out + i * ldo); break;
            case Q4_0: dequantize_row<Q4_0>(row, nb, out + i * ldo); break;
            default: dequantize_row<Q4_1>(row, nb, out + i * ldo); break;
        }
    }
    return 0;
}

}  // extern "C"
