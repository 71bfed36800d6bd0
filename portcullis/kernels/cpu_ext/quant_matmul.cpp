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
// Activations are quantized per row and block to int8 (xd = max|x| / 127, xq = rint(x / xd),
// half to even), so each block's product is an exact integer dot of int8 values; only the
// scaling and the sum over blocks are float. The integer dot runs as AVX-512 VNNI (vpdpbusd)
// where the build has it, as AVX2 (vpmaddubsw + vpmaddwd) otherwise, and as scalar C++ on
// other CPUs. Weights are read from their blocks in place, four rows at a time, each block
// decoded once into registers for up to four activation rows. No PyTorch headers: built by
// portcullis/kernels/native_build.py, called through ctypes (portcullis/kernels/cpu_quant.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PQ_VNNI 1
#elif defined(__AVX2__)
#define PQ_AVX2 1
#endif

namespace {

constexpr int QK = 32;
enum Kind : int { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };
constexpr int64_t BLOCK_BYTES[3] = {34, 18, 20};
// VNNI multiplies unsigned weights by signed activations: weights are stored shifted by this
// (to 0..255) and the shift is taken back exactly, in int32, per group of four products.
constexpr int OFFSET[3] = {128, 8, 0};
constexpr int NR = 4;  // weight rows decoded together
// Activation rows multiplied with each decoded block: as many as the vector registers hold
// (AVX-512 has 32, AVX2 16).
#if defined(PQ_VNNI)
constexpr int MR_MAX = 4;
#else
constexpr int MR_MAX = 2;
#endif

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

// Activations of M rows, quantized: xq [M][K], per block xd (scale) and xsum (sum of xq),
// and for VNNI xneg [M][K/4]: minus OFFSET times each group of four xq.
struct Activations {
    int64_t K = 0, nb = 0;
    std::vector<int8_t> xq;
    std::vector<float> xd;
    std::vector<int32_t> xsum;
    std::vector<int32_t> xneg;
};

void quantize_row(const float* x, int64_t K, int8_t* xq, float* xd, int32_t* xsum) {
    for (int64_t b = 0; b < K / QK; ++b) {
        const float* xb = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < QK; ++j) {
            const int v = static_cast<int>(std::nearbyint(xb[j] * id));
            xq[b * QK + j] = static_cast<int8_t>(v);
            sum += v;
        }
        xd[b] = d;
        xsum[b] = sum;
    }
}

void quantize(const float* x, int64_t ldx, int64_t M, int64_t K, int kind, int threads,
              Activations& a) {
    a.K = K;
    a.nb = K / QK;
    a.xq.resize(M * K);
    a.xd.resize(M * a.nb);
    a.xsum.resize(M * a.nb);
#if defined(PQ_VNNI)
    a.xneg.resize(M * K / 4);
#endif
#pragma omp parallel for num_threads(threads) schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; ++m) {
        quantize_row(x + m * ldx, K, &a.xq[m * K], &a.xd[m * a.nb], &a.xsum[m * a.nb]);
#if defined(PQ_VNNI)
        const int8_t* q = &a.xq[m * K];
        for (int64_t g = 0; g < K / 4; ++g)
            a.xneg[m * K / 4 + g] = -OFFSET[kind] * (q[4 * g] + q[4 * g + 1] + q[4 * g + 2] + q[4 * g + 3]);
#else
        (void)kind;
#endif
    }
}

#if defined(PQ_VNNI) || defined(PQ_AVX2)
float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// One block's 32 weights in a register: under VNNI unsigned (the signed value + OFFSET),
// under AVX2 signed.
template <int KIND>
inline __m256i block_weights(const uint8_t* block) {
    if constexpr (KIND == Q8_0) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
#if defined(PQ_VNNI)
        return _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));  // q + 128
#else
        return q;
#endif
    } else {
        const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (KIND == Q4_1 ? 4 : 2)));
        const __m128i mask = _mm_set1_epi8(0x0f);
        const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), mask),
                                                 _mm_and_si128(qs, mask));
#if defined(PQ_AVX2)
        if constexpr (KIND == Q4_0) return _mm256_sub_epi8(nibbles, _mm256_set1_epi8(8));
#endif
        return nibbles;
    }
}

// Eight int32 partial sums of one block's 32 products, each exact.
inline __m256i block_dot(__m256i wv, const int8_t* x, const int32_t* xneg) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
#if defined(PQ_VNNI)
    const __m256i init = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xneg));
    return _mm256_dpbusd_epi32(init, wv, xv);
#else
    (void)xneg;
    // vpmaddubsw multiplies unsigned by signed bytes: move each weight's sign onto x.
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}
#endif

// y[m0 + i][n0 + r] for MR activation rows and R weight rows (pointers to their blocks): each
// block of the R rows is decoded once into registers and used by all MR activation rows.
template <int KIND, int MR, int R>
void tile(const Activations& a, int64_t m0, const uint8_t* const* rows, float* y, int64_t ldy, int64_t n0) {
    constexpr int64_t BB = BLOCK_BYTES[KIND];
    const int64_t K = a.K, nb = a.nb;
    float mins[MR][R] = {};
#if defined(PQ_VNNI) || defined(PQ_AVX2)
    __m256 acc[MR][R];
    for (int i = 0; i < MR; ++i)
        for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256i wv[R];
        __m256 wd[R];
        for (int r = 0; r < R; ++r) {
            // The same block of the next group of rows (rows are contiguous): several rows stream
            // at once, which the hardware prefetcher follows poorly (measured on a 30 MB head).
            _mm_prefetch(reinterpret_cast<const char*>(rows[r] + b * BB) + R * nb * BB, _MM_HINT_T0);
            wv[r] = block_weights<KIND>(rows[r] + b * BB);
            wd[r] = _mm256_set1_ps(load_half(rows[r] + b * BB));
        }
        for (int i = 0; i < MR; ++i) {
            const int64_t m = m0 + i;
            const int8_t* x = &a.xq[m * K + b * QK];
            const int32_t* xneg = a.xneg.empty() ? nullptr : &a.xneg[m * K / 4 + b * QK / 4];
            const __m256 xd = _mm256_set1_ps(a.xd[m * nb + b]);
            for (int r = 0; r < R; ++r) {
                const __m256 dots = _mm256_mul_ps(_mm256_cvtepi32_ps(block_dot(wv[r], x, xneg)), xd);
                acc[i][r] = _mm256_fmadd_ps(dots, wd[r], acc[i][r]);
            }
        }
        if constexpr (KIND == Q4_1) {
            for (int r = 0; r < R; ++r) {
                const float wm = load_half(rows[r] + b * BB + 2);
                for (int i = 0; i < MR; ++i)
                    mins[i][r] += wm * (a.xd[(m0 + i) * nb + b] * static_cast<float>(a.xsum[(m0 + i) * nb + b]));
            }
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int r = 0; r < R; ++r) y[(m0 + i) * ldy + n0 + r] = hsum(acc[i][r]) + mins[i][r];
#else
    for (int i = 0; i < MR; ++i) {
        const int64_t m = m0 + i;
        const int8_t* x = &a.xq[m * K];
        for (int r = 0; r < R; ++r) {
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                int8_t w[QK];
                float d, mn;
                block_values(rows[r] + b * BB, KIND, w, &d, &mn);
                int32_t dot = 0;
                for (int j = 0; j < QK; ++j) dot += w[j] * x[b * QK + j];  // signed here
                sum += d * a.xd[m * nb + b] * static_cast<float>(dot);
                mins[i][r] += mn * (a.xd[m * nb + b] * static_cast<float>(a.xsum[m * nb + b]));
            }
            y[m * ldy + n0 + r] = sum + mins[i][r];
        }
    }
#endif
}

// Activation rows a few at a time (MR_MAX: what the registers hold) against R weight rows.
template <int KIND, int R>
void all_rows(const Activations& a, int64_t M, const uint8_t* const* rows, float* y, int64_t ldy, int64_t n0) {
    int64_t m = 0;
    for (; m + MR_MAX <= M; m += MR_MAX) tile<KIND, MR_MAX, R>(a, m, rows, y, ldy, n0);
    for (; m < M; ++m) tile<KIND, 1, R>(a, m, rows, y, ldy, n0);
}

// Rows [first, first + count) of y for every activation row: NR weight rows at a time, each
// group kept in L1 while all activation rows pass.
template <int KIND>
void multiply_rows(const Activations& a, int64_t M, const uint8_t* w, int64_t first, int64_t count,
                   float* y, int64_t ldy) {
    const int64_t row_bytes = a.nb * BLOCK_BYTES[KIND];
    int64_t n = first;
    for (; n + NR <= first + count; n += NR) {
        const uint8_t* rows[NR];
        for (int r = 0; r < NR; ++r) rows[r] = w + (n + r) * row_bytes;
        all_rows<KIND, NR>(a, M, rows, y, ldy, n);
    }
    for (; n < first + count; ++n) {
        const uint8_t* row = w + n * row_bytes;
        all_rows<KIND, 1>(a, M, &row, y, ldy, n);
    }
}

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

bool valid_kind(int kind) { return kind == Q8_0 || kind == Q4_0 || kind == Q4_1; }

}  // namespace

extern "C" {

// Which integer-dot code this build runs: 2 AVX-512 VNNI, 1 AVX2, 0 scalar.
int portcullis_quant_isa() {
#if defined(PQ_VNNI)
    return 2;
#elif defined(PQ_AVX2)
    return 1;
#else
    return 0;
#endif
}

// The activation quantization the products use (for tests): xq [M][K], xd and xsum [M][K/32].
int portcullis_quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* xq,
                             float* xd, int32_t* xsum) {
    if (K % QK) return 1;
    for (int64_t m = 0; m < M; ++m)
        quantize_row(x + m * ldx, K, xq + m * K, xd + m * (K / QK), xsum + m * (K / QK));
    return 0;
}

// y[m][n] = sum_k x[m][k] * W[n][k], W given as N rows of K/32 GGUF blocks of `kind`
// (0 Q8_0, 1 Q4_0, 2 Q4_1). x: float32 rows ldx apart; y: float32 rows ldy apart.
int portcullis_quant_matmul(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w,
                            int kind, int64_t N, float* y, int64_t ldy, int threads) {
    if (!valid_kind(kind) || K % QK || M < 0 || N < 0 || threads < 1) return 1;
    if (M == 0 || N == 0) return 0;
    Activations a;
    quantize(x, ldx, M, K, kind, threads, a);
    // Chunks of whole NR-row groups, several per thread: OpenMP's static split of the groups.
    const int64_t groups = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = g * NR, count = std::min<int64_t>(NR, N - first);
        switch (kind) {
            case Q8_0: multiply_rows<Q8_0>(a, M, w, first, count, y, ldy); break;
            case Q4_0: multiply_rows<Q4_0>(a, M, w, first, count, y, ldy); break;
            default: multiply_rows<Q4_1>(a, M, w, first, count, y, ldy); break;
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
