// SwiGLU of [gate; up] rows, silu(gate) * up, and its backward, fp32 math
// (docs/kernels.md, "CUDA implementation: SwiGLU and RoPE").
//
// Input rows are [gate (f) | up (f)], output rows [f] (backward: grad [f] in, [2f] out).
// Every thread walks a grid-stride loop over packs of V consecutive columns of a row: one
// pack of gate and one of up are loaded (backward: and one of grad), one pack is stored
// (backward: two). V is the widest of 16 bytes, 8, 4, 2 and 1 element(s) that divides f
// and the pointers' alignment (f % 8 == 0 bf16/fp16, f % 4 == 0 fp32, 16-byte aligned
// tensors: 16-byte packs). The pack's (row, column) is stepped, not divided: a thread
// splits its first pack index and the grid stride into (row, column) once, then adds the
// stride's parts with one carry per iteration, so the loop has no division at all;
// offsets are 64-bit (the column within a row 32-bit: f < 2^30). The grid is about one
// wave of resident blocks, evened out so that every thread runs the same number of
// iterations (but the last few).
//
// Each element gets exactly the former scalar kernel's expression (results unchanged bit
// for bit): y = u / (1 + __expf(-u)) · v; backward sig = 1 / (1 + __expf(-u)),
// du = g·v·sig·(1 + u·(1 − sig)) with the inner 1 + u·(1 − sig) one fused multiply-add
// (as nvcc contracted it), dv = g·u·sig.
#include "common.cuh"

namespace megatorch::kernels::cuda {
namespace {

constexpr int kThreads = kElementwiseThreads;

__device__ __forceinline__ float swiglu_value(float u, float v) { return u / (1.0f + __expf(-u)) * v; }

// d/du and d/dv of u·sigmoid(u)·v times the incoming gradient g.
__device__ __forceinline__ void swiglu_grads(float u, float v, float g, float& du, float& dv) {
  const float sig = 1.0f / (1.0f + __expf(-u));
  du = g * v * sig * __fmaf_rn(u, 1.0f - sig, 1.0f);
  dv = g * u * sig;
}

template <typename T, int V, bool kBackward>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(const SwigluParams p) {
  using P = Pack<T, V>;
  const int64_t f = p.f;
  const int cols = static_cast<int>(f / V);  // packs per half row; f < 2^30 (the launcher
                                             // checks), so col + scol fits in an int
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // (row, column pack) of this thread's first pack and of the stride: the only divisions.
  int64_t row = first / cols;
  int col = static_cast<int>(first - row * cols);
  const int64_t srow = stride / cols;
  const int scol = static_cast<int>(stride - srow * cols);
  const T* x = static_cast<const T*>(p.input);
  T* out = static_cast<T*>(p.out);
  while (row < p.rows) {
    const int64_t a = row * 2 * f + col * V;  // gate pack; up at a + f (col · V < f)
    const int64_t o = row * f + col * V;      // [rows, f]: output (forward), grad (backward)
    const P gate = *reinterpret_cast<const P*>(x + a);
    const P up = *reinterpret_cast<const P*>(x + a + f);
    float u[V], v[V];
    unpack_float(gate, u);
    unpack_float(up, v);
    if constexpr (kBackward) {
      const P grad = *reinterpret_cast<const P*>(static_cast<const T*>(p.grad) + o);
      float g[V];
      unpack_float(grad, g);
      P du, dv;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        float a_, b_;
        swiglu_grads(u[e], v[e], g[e], a_, b_);
        du.v[e] = from_float<T>(a_);
        dv.v[e] = from_float<T>(b_);
      }
      *reinterpret_cast<P*>(out + a) = du;
      *reinterpret_cast<P*>(out + a + f) = dv;
    } else {
      P y;
#pragma unroll
      for (int e = 0; e < V; ++e) y.v[e] = from_float<T>(swiglu_value(u[e], v[e]));
      *reinterpret_cast<P*>(out + o) = y;
    }
    col += scol;
    row += srow;
    if (col >= cols) {
      col -= cols;
      ++row;
    }
  }
}

template <typename T, int V, bool kBackward>
void launch_width(const SwigluParams& p, cudaStream_t stream) {
  const int64_t packs = p.rows * (p.f / V);
  const int64_t blocks = one_wave_blocks<swiglu_kernel<T, V, kBackward>>(ceil_div(packs, kThreads), kThreads);
  swiglu_kernel<T, V, kBackward><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
}

// The widest pack of W elements (W a power of two <= 16 bytes) that f and every pointer allow.
template <typename T, bool kBackward, int W = kVec<T>>
void launch(const SwigluParams& p, cudaStream_t stream) {
  if constexpr (W > 1) {
    const uintptr_t bytes = W * sizeof(T);
    if (p.f % W != 0 || !aligned_to(p.input, bytes) || !aligned_to(p.grad, bytes) || !aligned_to(p.out, bytes)) {
      return launch<T, kBackward, W / 2>(p, stream);
    }
  }
  launch_width<T, W, kBackward>(p, stream);
}

template <bool kBackward>
void run(const SwigluParams& p, void* stream) {
  if (p.rows <= 0 || p.f <= 0) return;
  if (p.f >= (int64_t{1} << 30)) throw std::runtime_error("megatorch: swiglu: rows too long");
  MEGATORCH_CUDA_DISPATCH(p.dtype, T, launch<T, kBackward>(p, as_stream(stream)));
  check_launch(kBackward ? "swiglu_backward" : "swiglu_forward");
}

}  // namespace

void swiglu_forward(const SwigluParams& p, void* stream) { run<false>(p, stream); }
void swiglu_backward(const SwigluParams& p, void* stream) { run<true>(p, stream); }

}  // namespace megatorch::kernels::cuda
