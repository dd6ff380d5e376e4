// Rotary position embedding over the first r of each head's d features (the rest copied),
// and its transpose for backward, fp32 math (docs/kernels.md, "CUDA implementation: SwiGLU and RoPE").
//
// Input and output [s, bh, d], cos/sin fp32 [s, r], h = r / 2. Rotate-half pairs channel j
// with j + h (j < h), so a row's work splits into units that read every input element
// once: h / V rotation units — pack [j, j + V) of the first half and its partner pack
// [j + h, j + h + V), both loaded once and both written — then (d − r) / V pass-through
// units that copy one pack. V is the widest of 16 bytes, 8, 4, 2 and 1 element(s) that
// divides h and d and the pointers' alignment (bf16/fp16: h % 8 == 0 and d % 8 == 0,
// fp32: h % 4 == 0 and d % 4 == 0, 16-byte aligned tensors: 16-byte packs, the V cos/sin
// values of a pack as float4 loads). A grid-stride loop over the units; the unit's
// (position, row of the position, unit of the row) is stepped with carries, not divided:
// a thread splits its first unit and the grid stride once, so the loop has no division;
// offsets are 64-bit (channels 32-bit: d < 2^30). The grid is about one wave of resident
// blocks, evened out. cos/sin are shared by the bh rows of a position: after the first
// row they come from L1/L2.
//
// Each element gets exactly the former scalar kernel's expression (results unchanged bit
// for bit): out_j = fma(x_j, cos_j, rot) with rot one rounded product,
//   forward:  rot = −(x_{j+h}·sin_j) (j < h),   x_{j−h}·sin_j (j >= h);
//   backward: rot = x_{j+h}·sin_{j+h} (j < h), −(x_{j−h}·sin_{j−h}) (j >= h).
#include "common.cuh"

namespace megatorch::kernels::cuda {
namespace {

constexpr int kThreads = kElementwiseThreads;

template <typename T, int V, bool kBackward>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const RotaryParams p) {
  using P = Pack<T, V>;
  // d < 2^30 (the launcher checks), so the channel indices are 32-bit and u + su fits.
  const int d = static_cast<int>(p.d), r = static_cast<int>(p.r), h = r / 2;
  const int rot_units = h / V, units = rot_units + (d - r) / V;  // per row; units >= 1
  const int64_t bh = p.bh;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // unit index = (pos · bh + b) · units + u, for the first unit and for the stride: the only
  // divisions.
  int64_t t = first / units;
  int u = static_cast<int>(first - t * units);
  int64_t pos = t / bh, b = t - pos * bh;
  t = stride / units;
  const int su = static_cast<int>(stride - t * units);
  const int64_t sp = t / bh, sb = t - sp * bh;
  const T* x = static_cast<const T*>(p.input);
  T* out = static_cast<T*>(p.out);
  while (pos < p.s) {
    const int64_t row = (pos * bh + b) * d;
    if (u < rot_units) {
      const int j = u * V;
      const P lo_raw = *reinterpret_cast<const P*>(x + row + j);
      const P hi_raw = *reinterpret_cast<const P*>(x + row + j + h);
      const float* cs = p.cos + pos * r + j;
      const float* sn = p.sin + pos * r + j;
      float lo[V], hi[V], c_lo[V], c_hi[V], s_lo[V], s_hi[V], o_lo[V], o_hi[V];
      unpack_float(lo_raw, lo);
      unpack_float(hi_raw, hi);
      load_float<float, V>(cs, c_lo);
      load_float<float, V>(cs + h, c_hi);
      load_float<float, V>(sn, s_lo);
      load_float<float, V>(sn + h, s_hi);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if constexpr (!kBackward) {
          o_lo[e] = __fmaf_rn(lo[e], c_lo[e], -__fmul_rn(hi[e], s_lo[e]));
          o_hi[e] = __fmaf_rn(hi[e], c_hi[e], __fmul_rn(lo[e], s_hi[e]));
        } else {
          o_lo[e] = __fmaf_rn(lo[e], c_lo[e], __fmul_rn(hi[e], s_hi[e]));
          o_hi[e] = __fmaf_rn(hi[e], c_hi[e], -__fmul_rn(lo[e], s_lo[e]));
        }
      }
      store_float<T, V>(out + row + j, o_lo);
      store_float<T, V>(out + row + j + h, o_hi);
    } else {  // pass-through channels r + (u − rot_units)·V ...: copied bit for bit
      const int j = r + (u - rot_units) * V;
      *reinterpret_cast<P*>(out + row + j) = *reinterpret_cast<const P*>(x + row + j);
    }
    // Next unit: u += su, b += sb, pos += sp, with carries (each part stays below twice its
    // range, so one subtraction each).
    u += su;
    b += sb;
    pos += sp;
    if (u >= units) {
      u -= units;
      ++b;
    }
    if (b >= bh) {
      b -= bh;
      ++pos;
    }
  }
}

template <typename T, int V, bool kBackward>
void launch_width(const RotaryParams& p, cudaStream_t stream) {
  const int64_t units = p.s * p.bh * (p.r / 2 / V + (p.d - p.r) / V);
  const int64_t blocks = one_wave_blocks<rotary_kernel<T, V, kBackward>>(ceil_div(units, kThreads), kThreads);
  rotary_kernel<T, V, kBackward><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
}

// The widest pack of W elements (W a power of two <= 16 bytes) that h, d and every pointer
// allow (cos/sin: W floats at offsets that are multiples of W, loaded in <= 16-byte parts).
template <typename T, bool kBackward, int W = kVec<T>>
void launch(const RotaryParams& p, cudaStream_t stream) {
  if constexpr (W > 1) {
    const uintptr_t bytes = W * sizeof(T), table_bytes = std::min<uintptr_t>(16, W * sizeof(float));
    if ((p.r / 2) % W != 0 || p.d % W != 0 || !aligned_to(p.input, bytes) || !aligned_to(p.out, bytes) ||
        !aligned_to(p.cos, table_bytes) || !aligned_to(p.sin, table_bytes)) {
      return launch<T, kBackward, W / 2>(p, stream);
    }
  }
  launch_width<T, W, kBackward>(p, stream);
}

}  // namespace

void rotary(const RotaryParams& p, void* stream) {
  if (p.s <= 0 || p.bh <= 0 || p.d <= 0) return;
  if (p.d >= (int64_t{1} << 30)) throw std::runtime_error("megatorch: rotary: head dim too large");
  MEGATORCH_CUDA_DISPATCH(p.dtype, T, {
    if (p.backward) {
      launch<T, true>(p, as_stream(stream));
    } else {
      launch<T, false>(p, as_stream(stream));
    }
  });
  check_launch("rotary");
}

}  // namespace megatorch::kernels::cuda
