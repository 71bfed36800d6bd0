// Rotary position embedding on CPUs, bit for bit what PyTorch computes for Hugging
// Face's `x * cos + rotate_half(x) * sin` (portcullis/engine/model/layers.py `rotate`): built with
// -ffp-contract=off, so each product and the sum round apart as PyTorch's three ops do. One call
// for a layer's queries and keys instead of eight small PyTorch ops (at one token they cost more
// than the arithmetic). No PyTorch headers; kernels/cpu_rotary.py builds and calls it.
#include <cstdint>

namespace {

// Each of `heads` heads of each row of x (rows ld floats apart) into out ([rows][heads][D]):
// v * cos + roll(v, D / 2) * sin, the tables' rows at the row's position (sin signed: its first
// half negated, which is rotate_half's sign).
void rotate_rows(const float* x, int64_t ld, int64_t rows, int64_t heads, int64_t D, const int64_t* positions,
                 const float* cos, const float* sin, float* out) {
    const int64_t half = D / 2;
    for (int64_t r = 0; r < rows; ++r) {
        const float* c = cos + positions[r] * D;
        const float* s = sin + positions[r] * D;
        for (int64_t h = 0; h < heads; ++h) {
            const float* v = x + r * ld + h * D;
            float* o = out + (r * heads + h) * D;
            for (int64_t i = 0; i < half; ++i) o[i] = v[i] * c[i] + v[i + half] * s[i];
            for (int64_t i = half; i < D; ++i) o[i] = v[i] * c[i] + v[i - half] * s[i];
        }
    }
}

}  // namespace

extern "C" {

// q [rows][q_heads][D] (rows q_ld floats apart) and k [rows][k_heads][D] (k_ld apart) rotated
// into q_out and k_out (packed); cos and sin are float32 [positions][D] tables, and every
// position is a row of them (the caller checks). Returns 1 (nothing done) for an odd head size.
int portcullis_rotary(const float* q, int64_t q_ld, int64_t q_heads, const float* k, int64_t k_ld, int64_t k_heads,
                      int64_t rows, int64_t D, const int64_t* positions, const float* cos, const float* sin,
                      float* q_out, float* k_out) {
    if (D <= 0 || D % 2) return 1;
    rotate_rows(q, q_ld, rows, q_heads, D, positions, cos, sin, q_out);
    rotate_rows(k, k_ld, rows, k_heads, D, positions, cos, sin, k_out);
    return 0;
}

}  // extern "C"
