// A Llama-style decoder's layers at a decode step (one new token per sequence), in one call: per
// layer the RMSNorm and QKV projection, the rotary embedding, the K/V write, paged attention, the
// output projection into the residual, the RMSNorm and gate/up projection, SiLU(gate) * up, and
// the down projection into the residual. Each stage is the same compiled kernel the PyTorch
// path calls one by one (quant_matmul.cpp, rotary.cpp, decode_attention.cpp), reached through
// the function pointers the caller passes, so the arithmetic is theirs; only SiLU * up is
// computed here (its exponential within about 1 ulp of PyTorch's). At one token the Python between those calls cost about as much as the
// kernels' own work (about 60 us a layer on SmolLM2). kernels/cpu_stack.py builds and calls it.
#include <cstdint>
#include <initializer_list>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// e^x in float32 within about 1 ulp (Cephes' expf polynomial), written so that the compiler
// vectorizes the loop around it: std::exp is a scalar call per value, which at a decode step's
// 1,536 gate values per row and layer cost more than PyTorch's vectorized SiLU.
inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
    const float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    return p * __builtin_bit_cast(float, bits);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// exp_approx on eight lanes, for AVX2 builds: GCC vectorizes the scalar loop only with AVX-512's
// masks (under the default trapping math its clamp is control flow), and at 16 rows on AVX2 SiLU
// took a twentieth of a decode step.
inline __m256 exp_approx8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.7f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));  // NaN stays
    const __m256 shifter = _mm256_set1_ps(12582912.0f);
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), shifter), shifter);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// act[r][i] = silu(gate) * up for each row's [gate | up] (2 * inter floats): SiLU rounded to
// float, then the product, as PyTorch's F.silu(gate) * up.
void silu_mul(const float* gate_up, int64_t rows, int64_t inter, float* act, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter >= (1 << 15))
    for (int64_t r = 0; r < rows; ++r) {
        const float* g = gate_up + r * 2 * inter;
        const float* u = g + inter;
        float* a = act + r * inter;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= inter; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 e = exp_approx8(_mm256_xor_ps(x, sign));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; ++i) a[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
}

}  // namespace

extern "C" {

typedef int (*NormMatmul)(const float*, int64_t, int64_t, int64_t, const float*, float, float*, const uint8_t*, int,
                          int64_t, float*, int64_t, int);
typedef int (*MatmulAdd)(const float*, int64_t, int64_t, int64_t, const uint8_t*, int, int64_t, const float*,
                         int64_t, float*, int64_t, int);
typedef int (*Rotary)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, int64_t,
                      const int64_t*, const float*, const float*, float*, float*);
typedef int (*WriteKV)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, const int64_t*, int64_t,
                       void*, void*, int);
typedef int (*Attention)(const float*, int64_t, const void*, const void*, int, const int32_t*, int64_t,
                         const int32_t*, const int64_t*, const int64_t*, const int32_t*, int64_t, int, int, int, int,
                         float, int, float*, int64_t, int);

struct StackKernels {
    NormMatmul norm_matmul;
    MatmulAdd matmul_add;
    Rotary rotary;
    WriteKV write_kv;
    Attention attention;
};

// What every layer shares.
struct StackShape {
    int64_t hidden, q_heads, kv_heads, head_dim, inter, block_size, num_slots;
    float eps, scale;
    int cache_is_bf16;  // the caches' dtype: float32 (0) or bfloat16 (1)
};

// One layer: its norms (float32), its projections (GGUF blocks and their kinds), its caches.
struct StackLayer {
    const float* input_norm;
    const float* post_norm;
    const uint8_t* qkv;
    const uint8_t* o;
    const uint8_t* gate_up;
    const uint8_t* down;
    int qkv_kind, o_kind, gate_up_kind, down_kind;
    void* key_cache;
    void* value_cache;
    int window;  // <= 0: none
};

// This step: `rows` sequences, one query row each, row i being sequence i.
struct StackStep {
    int64_t rows;
    const int64_t* positions;
    const int64_t* slots;
    const int32_t* block_tables;
    int64_t table_stride;
    const int32_t* context_lens;
    const int64_t* sequence_index;  // 0 .. rows - 1
    const float* cos;
    const float* sin;
};

// The scratch rows a step of `rows` needs, in floats.
int64_t portcullis_stack_scratch_floats(const StackShape* s, int64_t rows) {
    const int64_t q = s->q_heads * s->head_dim, kv = s->kv_heads * s->head_dim;
    return rows * (2 * s->hidden + (q + 2 * kv) + q + kv + q + 2 * s->inter + s->inter);
}

// act (float32 [rows][inter]) = silu(gate) * up for rows of [gate | up]: the stack's SiLU, for the
// layer-by-layer path (prefill), where PyTorch's two ops read and write the rows three times.
int portcullis_silu_mul(const float* gate_up, int64_t rows, int64_t inter, float* act, int threads) {
    if (rows < 0 || inter < 0 || threads < 1) return 1;
    silu_mul(gate_up, rows, inter, act, threads);
    return 0;
}

// h (float32 [rows][hidden], contiguous) through `n_layers` layers, in place. Returns the first
// stage's non-zero status (the layer's work stops there), else 0.
int portcullis_decode_stack(const StackKernels* k, const StackShape* s, const StackLayer* layers, int n_layers,
                            const StackStep* step, float* h, float* scratch, int threads) {
    const int64_t m = step->rows, hd = s->hidden, D = s->head_dim, inter = s->inter;
    const int64_t q = s->q_heads * D, kv = s->kv_heads * D, width = q + 2 * kv;
    float* normed = scratch;
    float* h2 = normed + m * hd;
    float* qkv = h2 + m * hd;
    float* q_rot = qkv + m * width;
    float* k_rot = q_rot + m * q;
    float* attn = k_rot + m * kv;
    float* gate_up = attn + m * q;
    float* act = gate_up + m * 2 * inter;
    int status = 0;
    for (int l = 0; l < n_layers && !status; ++l) {
        const StackLayer& L = layers[l];
        status = k->norm_matmul(h, hd, m, hd, L.input_norm, s->eps, normed, L.qkv, L.qkv_kind, width, qkv, width,
                                threads);
        if (!status)
            status = k->rotary(qkv, width, s->q_heads, qkv + q, width, s->kv_heads, m, D, step->positions, step->cos,
                               step->sin, q_rot, k_rot);
        if (!status)
            status = k->write_kv(k_rot, kv, qkv + q + kv, width, m, kv, step->slots, s->num_slots, L.key_cache,
                                 L.value_cache, s->cache_is_bf16);
        if (!status)
            status = k->attention(q_rot, q, L.key_cache, L.value_cache, s->cache_is_bf16, step->block_tables, step->table_stride,
                                  step->context_lens, step->sequence_index, step->sequence_index, nullptr, m,
                                  (int)s->q_heads, (int)s->kv_heads, (int)D, (int)s->block_size, s->scale, L.window,
                                  attn, q, threads);
        if (!status)
            status = k->matmul_add(attn, q, m, q, L.o, L.o_kind, hd, h, hd, h2, hd, threads);
        if (!status)
            status = k->norm_matmul(h2, hd, m, hd, L.post_norm, s->eps, normed, L.gate_up, L.gate_up_kind, 2 * inter,
                                    gate_up, 2 * inter, threads);
        if (status) break;
        silu_mul(gate_up, m, inter, act, threads);
        status = k->matmul_add(act, inter, m, inter, L.down, L.down_kind, hd, h2, hd, h, hd, threads);
    }
    return status;
}

}  // extern "C"
