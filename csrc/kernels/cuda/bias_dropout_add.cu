// residual + dropout(input + bias) (docs/kernels.md, "bias-dropout-add on CUDA").
//
// Rounding as the unfused chain in the input's dtype T: v = T(x + b), kept: T(v · T(1/keep)),
// out = T(residual + v), with fp32 arithmetic in between (the CPU kernel's order).
//
// Draws (params.h): element i = row·cols + col takes component i % 4 of the Philox4x32-10
// block at (seed, subsequence i / 4, offset): the mask depends on the seed and offset only,
// not on the launch configuration or the path below, and a call consumes one 128-bit block
// per subsequence (offset increment 4).
//
// Vector path (cols a multiple of the 16-byte width N, 16-byte aligned tensors): thread
// (x, y) of the 2D grid owns column pack j (x) — its bias pack is loaded once — and walks
// the rows y, y + rows_in_grid, ...; every step moves 16-byte packs of input, residual and
// output and N mask bytes in one store, with one (fp32: N = 4) or two (16-bit: N = 8)
// Philox blocks. No division per element. Scalar path otherwise: four consecutive elements
// a thread (one Philox block), the column from one division per four elements.
#include <curand_kernel.h>

#include "common.cuh"

namespace megatorch::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// The four uniforms in (0, 1] of subsequence `group` (elements 4·group .. 4·group + 3):
// curand_init(seed, group, offset, &s) then curand_uniform4(&s), written out so that the
// block after the one drawn is computed only for an offset that is not a multiple of 4
// (curand_uniform4 then takes values from both; PyTorch's offsets are multiples of 4), not
// for every draw as inside curand4.
__device__ __forceinline__ float4 draw4(const BiasDropoutAddParams& p, uint64_t group) {
  const uint64_t block = p.offset / 4;
  const uint2 key = make_uint2(static_cast<uint32_t>(p.seed), static_cast<uint32_t>(p.seed >> 32));
  uint4 ctr = make_uint4(static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                         static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32));
  uint4 r = curand_Philox4x32_10(ctr, key);
  const unsigned skip = static_cast<unsigned>(p.offset & 3);
  if (skip != 0) {  // the 128-bit counter + 1, as Philox_State_Incr
    if (++ctr.x == 0 && ++ctr.y == 0 && ++ctr.z == 0) ++ctr.w;
    const uint4 nx = curand_Philox4x32_10(ctr, key);
    r = skip == 1 ? make_uint4(r.y, r.z, r.w, nx.x)
                  : skip == 2 ? make_uint4(r.z, r.w, nx.x, nx.y) : make_uint4(r.w, nx.x, nx.y, nx.z);
  }
  return _curand_uniform4(r);
}

template <typename T, int N, bool kDrop>
__global__ void __launch_bounds__(kThreads) bias_dropout_add_vec_kernel(const BiasDropoutAddParams p,
                                                                        const int64_t packs_per_row) {
  static_assert(N % 4 == 0, "a pack covers whole Philox blocks");
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= packs_per_row) return;
  const int64_t c0 = j * N;
  float bias[N];
  if (p.bias) {
    load_float<T, N>(static_cast<const T*>(p.bias) + c0, bias);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) bias[e] = 0.0f;
  }
  const bool has_bias = p.bias != nullptr;
  const float scale = round_to<T>(1.0f / p.keep_prob);  // at::dropout scales in T
  const int64_t row_stride = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < p.rows; r += row_stride) {
    const int64_t i = r * p.cols + c0;  // a multiple of N (cols is), so of 4
    float x[N], res[N], out[N];
    load_float<T, N>(static_cast<const T*>(p.input) + i, x);
    load_float<T, N>(static_cast<const T*>(p.residual) + i, res);
    if constexpr (kDrop) {
      float u[N];
#pragma unroll
      for (int q = 0; q < N / 4; ++q) {
        const float4 d = draw4(p, static_cast<uint64_t>(i / 4 + q));
        u[4 * q] = d.x, u[4 * q + 1] = d.y, u[4 * q + 2] = d.z, u[4 * q + 3] = d.w;
      }
      Pack<uint8_t, N> keep;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float v = has_bias ? round_to<T>(x[e] + bias[e]) : x[e];
        const bool k = u[e] < p.keep_prob;
        keep.v[e] = k;
        out[e] = res[e] + (k ? round_to<T>(v * scale) : 0.0f);
      }
      *reinterpret_cast<Pack<uint8_t, N>*>(reinterpret_cast<uint8_t*>(p.mask) + i) = keep;
    } else {
#pragma unroll
      for (int e = 0; e < N; ++e) out[e] = res[e] + (has_bias ? round_to<T>(x[e] + bias[e]) : x[e]);
    }
    store_float<T, N>(static_cast<T*>(p.out) + i, out);
  }
}

template <typename T, bool kDrop>
__global__ void __launch_bounds__(kThreads) bias_dropout_add_scalar_kernel(const BiasDropoutAddParams p) {
  const T* x = static_cast<const T*>(p.input);
  const T* b = static_cast<const T*>(p.bias);
  const T* res = static_cast<const T*>(p.residual);
  T* out = static_cast<T*>(p.out);
  const int64_t n = p.rows * p.cols, groups = (n + 3) / 4;
  const float scale = round_to<T>(1.0f / p.keep_prob);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < groups;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i0 = 4 * t;
    int64_t c = i0 % p.cols;  // then stepped: one division per four elements
    float u[4] = {1.0f, 1.0f, 1.0f, 1.0f};  // (unused without dropout)
    if constexpr (kDrop) {
      const float4 d = draw4(p, static_cast<uint64_t>(t));
      u[0] = d.x, u[1] = d.y, u[2] = d.z, u[3] = d.w;
    }
    (void)u;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t i = i0 + e;
      if (i < n) {
        float v = to_float(x[i]);
        if (b) v = round_to<T>(v + to_float(b[c]));
        if constexpr (kDrop) {
          const bool k = u[e] < p.keep_prob;
          p.mask[i] = k;
          v = k ? round_to<T>(v * scale) : 0.0f;
        }
        out[i] = from_float<T>(to_float(res[i]) + v);
      }
      if (++c == p.cols) c = 0;
    }
  }
}

int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

template <typename T, bool kDrop>
void launch(const BiasDropoutAddParams& p, cudaStream_t stream) {
  constexpr int N = kVec<T>;
  const bool vec = p.cols % N == 0 && aligned16(p.input) && aligned16(p.bias) && aligned16(p.residual) &&
                   aligned16(p.out) && aligned_to(p.mask, N);
  if (!vec) {
    bias_dropout_add_scalar_kernel<T, kDrop>
        <<<elementwise_blocks(ceil_div(p.rows * p.cols, 4)), kThreads, 0, stream>>>(p);
    return;
  }
  // Block = bx column packs × by rows (bx · by = 256): bx divides the row's packs when one
  // of 256, 128, 64, 32 does (no idle lanes: 5120 bf16 = 640 packs -> 128), else 256 (a
  // partly idle last block), or the next power of two for rows of fewer than 256 packs.
  const int64_t packs = p.cols / N;
  int64_t bx = kThreads;
  if (packs < kThreads) {
    bx = pow2_at_least(packs);
  } else {
    for (const int64_t w : {256, 128, 64, 32}) {
      if (packs % w == 0) {
        bx = w;
        break;
      }
    }
  }
  const int64_t by = kThreads / bx;
  const int64_t gx = ceil_div(packs, bx);
  // Rows: about one wave of resident blocks in all, evened out; the rest by the loop.
  const int64_t resident = static_cast<int64_t>(device_sm_count()) *
                           resident_blocks_per_sm(bias_dropout_add_vec_kernel<T, N, kDrop>, kThreads, 0);
  const int64_t gy = std::min<int64_t>(balanced_blocks(ceil_div(p.rows, by), ceil_div(resident, gx)), 65535);
  if (gx > 0x7fffffff) throw std::runtime_error("megatorch: bias_dropout_add: rows too long");
  bias_dropout_add_vec_kernel<T, N, kDrop>
      <<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), dim3(static_cast<unsigned>(bx),
                                                                           static_cast<unsigned>(by)),
         0, stream>>>(p, packs);
}

}  // namespace

void bias_dropout_add_forward(const BiasDropoutAddParams& p, void* stream) {
  if (p.rows <= 0 || p.cols <= 0) return;
  MEGATORCH_CUDA_DISPATCH(p.dtype, T, {
    if (p.mask) {
      launch<T, true>(p, as_stream(stream));
    } else {
      launch<T, false>(p, as_stream(stream));
    }
  });
  check_launch("bias_dropout_add");
}

}  // namespace megatorch::kernels::cuda
