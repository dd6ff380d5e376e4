// Vectorisable fp32 loops for the CPU kernels (cpu_vec.h). Built with -O3 -fopenmp-simd
// -fno-math-errno -fno-trapping-math (so the selects in exp_poly if-convert) and without
// the torch precompiled header (CMakeLists.txt). On x86-64 each
// function is compiled three times (AVX-512, AVX2, baseline) and the loader picks one for
// the CPU it runs on (GCC/Clang target_clones).
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MT_VEC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MT_VEC_CLONES
#endif

namespace megatorch::kernels::vec {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) = 2^n · exp(r), n = round(x / ln 2), r = x - n·ln 2 (in two parts), |r| <= ln2/2;
// exp(r) by Cephes' degree-7 polynomial: about 1 ulp on [-87, 88]. Inputs below -87.3
// (-inf included) give exactly 0; above 88 it saturates at exp(88) (the callers pass
// x - max <= 0, or 2z of a tanh, where that saturation reads as 1).
inline float exp_poly(float x) {
  // Branch-free (min/max, copysign, a 0/1 factor) so that every loop calling it vectorises.
  const float xc = std::min(std::max(x, -87.0f), 88.0f);
  const float fx = xc * 1.44269504088896341f;
  const int n = static_cast<int>(fx + std::copysign(0.5f, fx));
  const float fn = static_cast<float>(n);
  float r = xc - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int bits = (n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(float));
  return e * two_n * static_cast<float>(x >= -87.0f);
}

// tanh(z) = 1 - 2 / (exp(2z) + 1): saturates to ±1 without overflow.
inline float tanh_exp(float z) { return 1.0f - 2.0f / (exp_poly(2.0f * z) + 1.0f); }

constexpr float kAlpha = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kBeta = 0.044715f;

}  // namespace

MT_VEC_CLONES void bias_gelu(const float* x, const float* b, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float u = x[i] + b[i];
    const float t = tanh_exp(kAlpha * (u + kBeta * u * u * u));
    y[i] = 0.5f * u * (1.0f + t);
  }
}

MT_VEC_CLONES void bias_gelu_backward(const float* x, const float* b, const float* g, float* dx, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float u = x[i] + b[i];
    const float t = tanh_exp(kAlpha * (u + kBeta * u * u * u));
    const float d = 0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * kAlpha * (1.0f + 3.0f * kBeta * u * u);
    dx[i] = g[i] * d;
  }
}

MT_VEC_CLONES void swiglu(const float* a, const float* b, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] / (1.0f + exp_poly(-a[i])) * b[i];
}

MT_VEC_CLONES void swiglu_backward(const float* a, const float* b, const float* g, float* da, float* db, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float u = a[i], sig = 1.0f / (1.0f + exp_poly(-u));
    da[i] = g[i] * b[i] * sig * (1.0f + u * (1.0f - sig));
    db[i] = g[i] * u * sig;
  }
}

MT_VEC_CLONES float exp_shift_sum(float* x, float shift, int64_t n) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) {
    x[i] = exp_poly(x[i] - shift);
    s += x[i];
  }
  return s;
}

MT_VEC_CLONES float exp_sum(const float* x, float shift, int64_t n) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += exp_poly(x[i] - shift);
  return s;
}

MT_VEC_CLONES float max(const float* x, int64_t n) {
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

MT_VEC_CLONES float sum(const float* x, int64_t n) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}

MT_VEC_CLONES float dot(const float* a, const float* b, int64_t n) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

MT_VEC_CLONES void scale(float* x, float s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

MT_VEC_CLONES float scale_mask_max(const float* x, float s, const bool* mask, int64_t mask_stride, int64_t limit,
                                   float* y, int64_t n) {
  float m = kNegInf;
  if (mask) {
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; ++i) {
      const float xs = x[i] * s;  // loaded unconditionally: no branch in the loop
      const float v = ((i >= limit) | mask[i * mask_stride]) ? kNegInf : xs;
      y[i] = v;
      m = v > m ? v : m;
    }
  } else {
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; ++i) {
      const float xs = x[i] * s;
      const float v = i >= limit ? kNegInf : xs;
      y[i] = v;
      m = v > m ? v : m;
    }
  }
  return m;
}

MT_VEC_CLONES void softmax_backward(const float* g, const float* y, float scale, float* dx, int64_t n) {
  float d = 0;
#pragma omp simd reduction(+ : d)
  for (int64_t i = 0; i < n; ++i) d += g[i] * y[i];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dx[i] = scale * y[i] * (g[i] - d);
}

MT_VEC_CLONES void normalize(const float* x, float mean, float rstd, const float* w, const float* b, float* y,
                             int64_t n) {
  if (b) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * rstd * w[i] + b[i];
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * rstd * w[i];
  }
}

MT_VEC_CLONES void adamw(float* p, const float* g, float* m, float* v, int64_t n, float decay, float one_minus_beta1,
                         float beta2, float one_minus_beta2, float eps, float step_size, float bias_correction2_sqrt) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float grad = g[i];
    float param = p[i] * decay;
    const float mi = m[i] + one_minus_beta1 * (grad - m[i]);
    const float vi = v[i] * beta2 + one_minus_beta2 * grad * grad;
    param -= step_size * (mi / (std::sqrt(vi) / bias_correction2_sqrt + eps));
    p[i] = param;
    m[i] = mi;
    v[i] = vi;
  }
}

MT_VEC_CLONES void bf16_to_f32(const uint16_t* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(&y[i], &bits, sizeof(float));
  }
}

MT_VEC_CLONES void f32_to_bf16(const float* x, uint16_t* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], sizeof(float));
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    y[i] = static_cast<uint16_t>(x[i] != x[i] ? 0x7FC0u : rounded);
  }
}

MT_VEC_CLONES float sq_dev_sum(const float* x, float c, int64_t n) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += (x[i] - c) * (x[i] - c);
  return s;
}

MT_VEC_CLONES void norm_backward_row(const float* x, const float* g, const float* w, float mean, float rstd, float* dx,
                                   float* dw, float* db, int64_t n, bool rms) {
  float sum_gw = 0, sum_gwx = 0;
#pragma omp simd reduction(+ : sum_gw, sum_gwx)
  for (int64_t i = 0; i < n; ++i) {
    const float xh = (x[i] - mean) * rstd, gw = g[i] * w[i];
    sum_gw += gw;
    sum_gwx += gw * xh;
    dw[i] += g[i] * xh;
    db[i] += g[i];
  }
  const float a = rms ? 0.0f : sum_gw / static_cast<float>(n), b = sum_gwx / static_cast<float>(n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dx[i] = rstd * (g[i] * w[i] - a - (x[i] - mean) * rstd * b);
}

}  // namespace megatorch::kernels::vec
