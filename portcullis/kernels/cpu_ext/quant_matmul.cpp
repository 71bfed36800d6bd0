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
// other CPUs. Each thread unpacks a tile of weight rows (nibbles to bytes, scales to float)
// once and multiplies it with every activation row. No PyTorch headers: built by
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
constexpr int NR = 4;  // weight rows multiplied together against one activation row

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

uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

// One block's 32 weights as signed integers (the value before scaling and the Q4_1 minimum),
// and its scale and minimum.
void block_values(const uint8_t* block, int kind, int8_t* q, float* d, float* m) {
    *d = half_to_float(load_u16(block));
    *m = kind == Q4_1 ? half_to_float(load_u16(block + 2)) : 0.0f;
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

// Weight rows unpacked for the integer dots: wq [rows][K] (signed values, or under VNNI
// shifted by OFFSET to unsigned), wd and wm [rows][nb] (scale, Q4_1 minimum).
struct Tile {
    std::vector<uint8_t> wq;
    std::vector<float> wd, wm;
};

void unpack_rows(const uint8_t* w, int kind, int64_t K, int64_t first, int rows, Tile& t) {
    const int64_t nb = K / QK, row_bytes = nb * BLOCK_BYTES[kind];
    t.wq.resize(static_cast<size_t>(rows) * K);
    t.wd.resize(static_cast<size_t>(rows) * nb);
    t.wm.resize(static_cast<size_t>(rows) * nb);
    for (int r = 0; r < rows; ++r) {
        const uint8_t* row = w + (first + r) * row_bytes;
        for (int64_t b = 0; b < nb; ++b) {
            int8_t q[QK];
            block_values(row + b * BLOCK_BYTES[kind], kind, q, &t.wd[r * nb + b], &t.wm[r * nb + b]);
            uint8_t* dst = &t.wq[r * K + b * QK];
            for (int j = 0; j < QK; ++j) {
#if defined(PQ_VNNI)
                dst[j] = static_cast<uint8_t>(q[j] + OFFSET[kind]);
#else
                dst[j] = static_cast<uint8_t>(q[j]);
#endif
            }
        }
    }
}

#if defined(PQ_VNNI) || defined(PQ_AVX2)
float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Eight int32 partial sums of one block's 32 products, each exact.
inline __m256i block_dot(const uint8_t* w, const int8_t* x, const int32_t* xneg) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
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

// out[r] = dot of activation row m with tile rows r0 .. r0 + R - 1.
template <int R>
void dot_rows(const Activations& a, int64_t m, const Tile& t, int r0, int kind, float* out) {
    const int64_t K = a.K, nb = a.nb;
    const int8_t* x = &a.xq[m * K];
    const float* xd = &a.xd[m * nb];
    const int32_t* xsum = &a.xsum[m * nb];
    float mins[R] = {};
#if defined(PQ_VNNI) || defined(PQ_AVX2)
    const int32_t* xneg = a.xneg.empty() ? nullptr : &a.xneg[m * K / 4];
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < R; ++r) {
            const int64_t row = r0 + r;
            const __m256i lanes = block_dot(&t.wq[row * K + b * QK], x + b * QK,
                                            xneg ? xneg + b * QK / 4 : nullptr);
            const __m256 scale = _mm256_set1_ps(t.wd[row * nb + b] * xd[b]);
            acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(lanes), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
#else
    for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        float sum = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const int8_t* w = reinterpret_cast<const int8_t*>(&t.wq[row * K + b * QK]);
            int32_t dot = 0;
            for (int j = 0; j < QK; ++j) dot += w[j] * x[b * QK + j];  // signed here
            sum += t.wd[row * nb + b] * xd[b] * static_cast<float>(dot);
        }
        out[r] = sum;
    }
#endif
    if (kind == Q4_1) {
        for (int r = 0; r < R; ++r) {
            const float* wm = &t.wm[(r0 + r) * nb];
            for (int64_t b = 0; b < nb; ++b) mins[r] += wm[b] * (xd[b] * static_cast<float>(xsum[b]));
        }
    }
    for (int r = 0; r < R; ++r) out[r] += mins[r];
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
    // Tiles small enough that every thread gets several, large enough to reuse each
    // activation row over a few weight rows.
    const int64_t tile = N >= 64 * threads ? 16 : NR;
    const int64_t tiles = (N + tile - 1) / tile;
#pragma omp parallel num_threads(threads)
    {
        Tile t;
        float out[NR];
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tiles; ++i) {
            const int64_t first = i * tile;
            const int rows = static_cast<int>(std::min(tile, N - first));
            unpack_rows(w, kind, K, first, rows, t);
            for (int64_t m = 0; m < M; ++m) {
                int r = 0;
                for (; r + NR <= rows; r += NR) {
                    dot_rows<NR>(a, m, t, r, kind, out);
                    std::memcpy(y + m * ldy + first + r, out, sizeof(out));
                }
                for (; r < rows; ++r) dot_rows<1>(a, m, t, r, kind, y + m * ldy + first + r);
            }
        }
    }
    return 0;
}

// Multiply and add rounded apart, as numpy (gguf's dequantize) does: the two agree exactly.
__attribute__((optimize("fp-contract=off")))
// out[i][:] = row rows[i] of W dequantized to float32 (rows == nullptr: rows first .. first+n-1),
// out rows ldo apart: embedding lookups, and tiles of W for a float GEMM at many rows.
int portcullis_dequantize_rows(const uint8_t* w, int kind, int64_t K, const int64_t* rows,
                               int64_t first, int64_t n, float* out, int64_t ldo, int threads) {
    if (!valid_kind(kind) || K % QK || n < 0 || threads < 1) return 1;
    const int64_t nb = K / QK, row_bytes = nb * BLOCK_BYTES[kind];
#pragma omp parallel for num_threads(threads) schedule(static) if (n * K >= (1 << 16))
    for (int64_t i = 0; i < n; ++i) {
        const uint8_t* row = w + (rows ? rows[i] : first + i) * row_bytes;
        float* dst = out + i * ldo;
        for (int64_t b = 0; b < nb; ++b) {
            int8_t q[QK];
            float d, m;
            block_values(row + b * BLOCK_BYTES[kind], kind, q, &d, &m);
            for (int j = 0; j < QK; ++j) dst[b * QK + j] = d * static_cast<float>(q[j]) + m;
        }
    }
    return 0;
}

}  // extern "C"
