#pragma once
// The inner loops of the CPU kernels over fp32 arrays, written so that the compiler
// vectorises them (branch-free polynomial exp, no libm calls, simd reductions) and built
// for AVX-512, AVX2 and baseline x86-64 with runtime selection (cpu_vec.cpp). The kernels
// call them per row (or per chunk) after converting 16-bit rows to fp32; double inputs
// (gradcheck) keep the plain loops in each kernel's file.
#include <cstdint>

namespace megatorch::kernels::vec {

// y = gelu_tanh(x + b)
void bias_gelu(const float* x, const float* b, float* y, int64_t n);
// dx = g · gelu_tanh'(x + b)
void bias_gelu_backward(const float* x, const float* b, const float* g, float* dx, int64_t n);
// y = silu(a) · b
void swiglu(const float* a, const float* b, float* y, int64_t n);
// da, db of y = silu(a) · b for the output gradient g
void swiglu_backward(const float* a, const float* b, const float* g, float* da, float* db, int64_t n);
// x = exp(x - shift) in place (x = -inf gives exactly 0); returns the sum.
float exp_shift_sum(float* x, float shift, int64_t n);
// Σ exp(x - shift), x unchanged.
float exp_sum(const float* x, float shift, int64_t n);
float max(const float* x, int64_t n);  // -inf for n = 0
float sum(const float* x, int64_t n);
float dot(const float* a, const float* b, int64_t n);
void scale(float* x, float s, int64_t n);
// y = x · s, entries at or past `limit` or where mask[k·mask_stride] is true set to -inf
// (mask may be null); returns the max.
float scale_mask_max(const float* x, float s, const bool* mask, int64_t mask_stride, int64_t limit, float* y,
                     int64_t n);

// dx = scale · y · (g - Σ g·y): the softmax backward of one row.
void softmax_backward(const float* g, const float* y, float scale, float* dx, int64_t n);
// y = (x - mean) · rstd · w (+ b when b is not null)
void normalize(const float* x, float mean, float rstd, const float* w, const float* b, float* y, int64_t n);

// One AdamW step on fp32 p, m, v with fp32 grads g (fused_adamw.h has the formula).
// one_minus_beta1/2 are 1 - beta computed in double and rounded once (as torch passes them).
void adamw(float* p, const float* g, float* m, float* v, int64_t n, float decay, float one_minus_beta1, float beta2,
           float one_minus_beta2, float eps, float step_size, float bias_correction2_sqrt);
// bfloat16 (as its bits) <-> fp32; round to nearest even, NaN kept a (quiet) NaN.
void bf16_to_f32(const uint16_t* x, float* y, int64_t n);
void f32_to_bf16(const float* x, uint16_t* y, int64_t n);
// Σ (x - c)²
float sq_dev_sum(const float* x, float c, int64_t n);
// One row of the LayerNorm / RMSNorm backward (norms.cpp has the formula): dx, and the
// row's terms added into the weight and bias gradient sums dw += g·x̂, db += g.
void norm_backward_row(const float* x, const float* g, const float* w, float mean, float rstd, float* dx, float* dw,
                       float* db, int64_t n, bool rms);

}  // namespace megatorch::kernels::vec
