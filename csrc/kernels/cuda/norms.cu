// LayerNorm and RMSNorm, forward and backward (docs/kernels.md, "LayerNorm and RMSNorm on
// CUDA"). fp32 statistics and math whatever the input dtype.
//
// Register-resident kernels (the row length a multiple of the 16-byte vector width V and
// every pointer 16-byte aligned): blockDim = (tpr, rows_per_block); the tpr threads of a
// row (a warp for rows of up to 128 packs, else a multiple of 32) hold K packs each —
// packs tx, tx + tpr, ... — so every row is read from global memory exactly once and kept
// in registers (raw 16-byte packs) for all the passes over it:
//   forward:  mean = Σx / n, then var = Σ(x - mean)² / n from the registers (two passes,
//             no E[x²] - mean² cancellation), then y = (x - mean)·rstd·w + b;
//   backward: x̂ = (x - mean)·rstd, dx = rstd·(g·w - mean(g·w) - x̂·mean(g·w·x̂)) (RMSNorm:
//             mean = 0 and no mean(g·w) term); each thread accumulates dw += g·x̂ and
//             db += g for its columns in registers over all the rows its block handles
//             (a grid of about one wave of blocks loops over the rows), and the block
//             writes its sums once, as one row of the fp32 workspace; a second kernel
//             sums the workspace's rows in a fixed order into the weight dtype.
// Generic kernels (any row length, any alignment, and rows too long for the registers):
// the same arithmetic with strided scalar loops that re-read the row (from L1/L2), and
// per-(block, row slot) partial rows accumulated in the workspace itself.
//
// Row sums are warp shuffles, then (rows of several warps) one exchange through shared
// memory; every thread of a row ends with the bitwise same sum. Everything is
// deterministic: no atomics, fixed summation orders.
#include "common.cuh"

namespace megatorch::kernels::cuda {
namespace {

constexpr int kMaxRowThreads = 512;  // launch bound: at most 128 registers a thread
// Rows per block = max(1, kSlotThreads / threads per row). The backward's blocks are
// larger: every block writes a row of partial sums, so fewer, wider blocks mean a smaller
// workspace. The slots' sums meet in shared memory, rows_per_block · cols floats: with
// packs <= 4·tpr and rows_per_block <= 256 / tpr that is <= 1024 packs, 32 KiB at most.
constexpr int kForwardSlotThreads = 128;
constexpr int kBackwardSlotThreads = 256;

// Sum of v over the blockDim.x threads of this row (row slot threadIdx.y). blockDim.x is a
// multiple of 32 and blockDim.x·blockDim.y <= 1024. `red` holds NV·32 floats; two
// reductions may reuse a buffer only with a __syncthreads between them (the callers
// alternate buffers between row iterations). Every lane returns the same bits.
template <int NV>
__device__ __forceinline__ void row_sum(float (&v)[NV], float* red) {
#pragma unroll
  for (int i = 0; i < NV; ++i) v[i] = warp_sum(v[i]);
  const int wpr = blockDim.x >> 5;
  if (wpr == 1) return;  // uniform over the block
  const int lane = threadIdx.x & 31, base = threadIdx.y * wpr;
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < NV; ++i) red[i * 32 + base + (threadIdx.x >> 5)] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < NV; ++i) v[i] = warp_sum(lane < wpr ? red[i * 32 + base + lane] : 0.0f);
}

template <typename T>
__device__ __forceinline__ Pack<T, kVec<T>> zero_pack() {
  Pack<T, kVec<T>> z;
#pragma unroll
  for (int e = 0; e < kVec<T>; ++e) z.v[e] = from_float<T>(0.0f);
  return z;
}

// ---------------------------------------------------------------- forward, registers

template <typename T, typename W, int K>
__global__ void __launch_bounds__(kMaxRowThreads) norm_forward_vec_kernel(const NormParams p) {
  constexpr int V = kVec<T>;
  using PT = Pack<T, V>;
  __shared__ float red[2][2][32];  // [iteration parity][mean, variance][warp]
  const int tpr = blockDim.x, tx = threadIdx.x;
  const int packs = static_cast<int>(p.cols / V);  // <= kMaxRowThreads · K
  const float n = static_cast<float>(p.cols);
  const int64_t slots = blockDim.y, stride = static_cast<int64_t>(gridDim.x) * slots;
  const T* in = static_cast<const T*>(p.input);
  T* out = static_cast<T*>(p.out);
  const W* weight = static_cast<const W*>(p.weight);
  const W* bias = static_cast<const W*>(p.bias);
  int parity = 0;
  // Uniform loop over groups of rows (every thread of the block runs every iteration:
  // row_sum's barrier), row slot threadIdx.y of each group.
  for (int64_t row0 = blockIdx.x * slots; row0 < p.rows; row0 += stride, parity ^= 1) {
    const int64_t row = row0 + threadIdx.y;
    const bool live = row < p.rows;
    const T* x = in + (live ? row : 0) * p.cols;
    PT xv[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = tx + k * tpr;
      xv[k] = live && j < packs ? *reinterpret_cast<const PT*>(x + static_cast<int64_t>(j) * V) : zero_pack<T>();
    }
    float mean = 0.0f;
    if (!p.rms) {
      float s[1] = {0.0f};
#pragma unroll
      for (int k = 0; k < K; ++k) {
        float xf[V];
        unpack_float(xv[k], xf);
#pragma unroll
        for (int e = 0; e < V; ++e) s[0] += xf[e];  // padding packs are 0
      }
      row_sum(s, red[parity][0]);
      mean = s[0] / n;
    }
    float q[1] = {0.0f};
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (tx + k * tpr < packs) {
        float xf[V];
        unpack_float(xv[k], xf);
#pragma unroll
        for (int e = 0; e < V; ++e) q[0] += (xf[e] - mean) * (xf[e] - mean);
      }
    }
    row_sum(q, red[parity][1]);
    const float rstd = rsqrtf(q[0] / n + p.eps);
    if (!live) continue;  // after the last barrier of the iteration
    if (tx == 0) {
      if (p.mean) p.mean[row] = mean;
      p.rstd[row] = rstd;
    }
    T* y = out + row * p.cols;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = tx + k * tpr;
      if (j < packs) {
        const int c = j * V;
        float w[V], xf[V], o[V];
        load_float<W, V>(weight + c, w);
        unpack_float(xv[k], xf);
        if (bias) {
          float b[V];
          load_float<W, V>(bias + c, b);
#pragma unroll
          for (int e = 0; e < V; ++e) o[e] = (xf[e] - mean) * rstd * w[e] + b[e];
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) o[e] = (xf[e] - mean) * rstd * w[e];
        }
        store_float<T, V>(y + c, o);
      }
    }
  }
}

// ---------------------------------------------------------------- backward, registers

template <typename T, typename W, int K, bool kRms>
__global__ void __launch_bounds__(kMaxRowThreads) norm_backward_vec_kernel(const NormParams p) {
  constexpr int V = kVec<T>;
  constexpr int NS = kRms ? 1 : 2;  // row sums: [Σ g·w (LayerNorm),] Σ g·w·x̂
  using PT = Pack<T, V>;
  extern __shared__ float4 slot_sums_[];  // [rows_per_block, cols] floats when rows_per_block > 1
  float* slot_sums = reinterpret_cast<float*>(slot_sums_);  // (float4: 16-byte aligned for the stores)
  __shared__ float red[2][NS * 32];     // [iteration parity][sum][warp]
  const int tpr = blockDim.x, tx = threadIdx.x;
  const int packs = static_cast<int>(p.cols / V);
  const float n = static_cast<float>(p.cols);
  const int64_t slots = blockDim.y, stride = static_cast<int64_t>(gridDim.x) * slots;
  const T* in = static_cast<const T*>(p.input);
  const T* grad = static_cast<const T*>(p.grad);
  T* out = static_cast<T*>(p.out);
  const W* weight = static_cast<const W*>(p.weight);

  float dw[K][V], db[K][V];  // this thread's columns, summed over its rows (db: LayerNorm)
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int e = 0; e < V; ++e) dw[k][e] = db[k][e] = 0.0f;
  }

  int parity = 0;
  for (int64_t row0 = blockIdx.x * slots; row0 < p.rows; row0 += stride, parity ^= 1) {
    const int64_t row = row0 + threadIdx.y;
    const bool live = row < p.rows;
    const int64_t off = (live ? row : 0) * p.cols;
    PT xv[K], gv[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = tx + k * tpr;
      const bool ok = live && j < packs;
      xv[k] = ok ? *reinterpret_cast<const PT*>(in + off + static_cast<int64_t>(j) * V) : zero_pack<T>();
      gv[k] = ok ? *reinterpret_cast<const PT*>(grad + off + static_cast<int64_t>(j) * V) : zero_pack<T>();
    }
    // A dead row slot has g = 0 and mean = rstd = 0: it adds nothing to any sum.
    const float mean = !kRms && live ? p.mean[row] : 0.0f;
    const float rstd = live ? p.rstd[row] : 0.0f;
    float s[NS];
#pragma unroll
    for (int i = 0; i < NS; ++i) s[i] = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = tx + k * tpr;
      if (j < packs) {
        float w[V], xf[V], gf[V];
        load_float<W, V>(weight + j * V, w);
        unpack_float(xv[k], xf);
        unpack_float(gv[k], gf);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float xh = (xf[e] - mean) * rstd, gw = gf[e] * w[e];
          if constexpr (!kRms) s[0] += gw;
          s[NS - 1] += gw * xh;
          dw[k][e] += gf[e] * xh;
          if constexpr (!kRms) db[k][e] += gf[e];
        }
      }
    }
    row_sum(s, red[parity]);
    if (!live) continue;  // after the iteration's only barrier
    const float a = kRms ? 0.0f : s[0] / n, b = s[NS - 1] / n;
    T* dx = out + off;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = tx + k * tpr;
      if (j < packs) {
        // x and g converted again from the raw packs (16-bit: half the registers of fp32
        // copies), the weight loaded again (L1) rather than kept.
        float w[V], xf[V], gf[V], o[V];
        load_float<W, V>(weight + j * V, w);
        unpack_float(xv[k], xf);
        unpack_float(gv[k], gf);
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] = rstd * (gf[e] * w[e] - a - (xf[e] - mean) * rstd * b);
        store_float<T, V>(dx + j * V, o);
      }
    }
  }

  // This block's sums: one row of each workspace (partial row blockIdx.x).
  float* dwp = p.grad_weight_partial + static_cast<int64_t>(blockIdx.x) * p.cols;
  float* dbp = kRms ? nullptr : p.grad_bias_partial + static_cast<int64_t>(blockIdx.x) * p.cols;
  if (blockDim.y == 1) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = tx + k * tpr;
      if (j < packs) {
        store_float<float, V>(dwp + j * V, dw[k]);
        if constexpr (!kRms) store_float<float, V>(dbp + j * V, db[k]);
      }
    }
    return;
  }
  // Several row slots share the columns: add them up through shared memory, slot 0 first.
  const int nthreads = tpr * blockDim.y, tid = threadIdx.y * tpr + tx;
  float* mine = slot_sums + threadIdx.y * p.cols;
#pragma unroll
  for (int which = 0; which < (kRms ? 1 : 2); ++which) {
    __syncthreads();  // slot_sums is free (the previous round's reads are done)
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = tx + k * tpr;
      if (j < packs) store_float<float, V>(mine + j * V, which == 0 ? dw[k] : db[k]);
    }
    __syncthreads();
    float* dst = which == 0 ? dwp : dbp;
    for (int c = tid; c < p.cols; c += nthreads) {
      float t = 0.0f;
      for (int y = 0; y < static_cast<int>(blockDim.y); ++y) t += slot_sums[y * p.cols + c];
      dst[c] = t;
    }
  }
}

// ---------------------------------------------------------------- generic kernels

template <typename T, typename W>
__global__ void __launch_bounds__(kMaxRowThreads) norm_forward_generic_kernel(const NormParams p) {
  __shared__ float red[2][2][32];
  const int tpr = blockDim.x, tx = threadIdx.x;
  const float n = static_cast<float>(p.cols);
  const int64_t slots = blockDim.y, stride = static_cast<int64_t>(gridDim.x) * slots;
  const W* weight = static_cast<const W*>(p.weight);
  const W* bias = static_cast<const W*>(p.bias);
  int parity = 0;
  for (int64_t row0 = blockIdx.x * slots; row0 < p.rows; row0 += stride, parity ^= 1) {
    const int64_t row = row0 + threadIdx.y;
    const bool live = row < p.rows;
    const T* x = static_cast<const T*>(p.input) + (live ? row : 0) * p.cols;
    const int64_t cols = live ? p.cols : 0;
    float mean = 0.0f;
    if (!p.rms) {
      float s[1] = {0.0f};
      for (int64_t c = tx; c < cols; c += tpr) s[0] += to_float(x[c]);
      row_sum(s, red[parity][0]);
      mean = s[0] / n;
    }
    float q[1] = {0.0f};
    for (int64_t c = tx; c < cols; c += tpr) {
      const float d = to_float(x[c]) - mean;
      q[0] += d * d;
    }
    row_sum(q, red[parity][1]);
    const float rstd = rsqrtf(q[0] / n + p.eps);
    if (!live) continue;
    if (tx == 0) {
      if (p.mean) p.mean[row] = mean;
      p.rstd[row] = rstd;
    }
    T* y = static_cast<T*>(p.out) + row * p.cols;
    for (int64_t c = tx; c < cols; c += tpr) {
      const float v = (to_float(x[c]) - mean) * rstd * to_float(weight[c]);
      y[c] = from_float<T>(bias ? v + to_float(bias[c]) : v);
    }
  }
}

// Partial row blockIdx.x · rows_per_block + threadIdx.y of the workspaces belongs to this
// row slot: the thread owning column c is the only one to touch element c of it.
template <typename T, typename W, bool kRms>
__global__ void __launch_bounds__(kMaxRowThreads) norm_backward_generic_kernel(const NormParams p) {
  constexpr int NS = kRms ? 1 : 2;
  __shared__ float red[2][NS * 32];
  const int tpr = blockDim.x, tx = threadIdx.x;
  const float n = static_cast<float>(p.cols);
  const int64_t slots = blockDim.y, stride = static_cast<int64_t>(gridDim.x) * slots;
  const W* weight = static_cast<const W*>(p.weight);
  const int64_t prow = static_cast<int64_t>(blockIdx.x) * slots + threadIdx.y;
  float* dwp = p.grad_weight_partial + prow * p.cols;
  float* dbp = kRms ? nullptr : p.grad_bias_partial + prow * p.cols;
  for (int64_t c = tx; c < p.cols; c += tpr) {
    dwp[c] = 0.0f;
    if constexpr (!kRms) dbp[c] = 0.0f;
  }
  int parity = 0;
  for (int64_t row0 = blockIdx.x * slots; row0 < p.rows; row0 += stride, parity ^= 1) {
    const int64_t row = row0 + threadIdx.y;
    const bool live = row < p.rows;
    const int64_t off = (live ? row : 0) * p.cols, cols = live ? p.cols : 0;
    const T* x = static_cast<const T*>(p.input) + off;
    const T* g = static_cast<const T*>(p.grad) + off;
    const float mean = !kRms && live ? p.mean[row] : 0.0f;
    const float rstd = live ? p.rstd[row] : 0.0f;
    float s[NS];
#pragma unroll
    for (int i = 0; i < NS; ++i) s[i] = 0.0f;
    for (int64_t c = tx; c < cols; c += tpr) {
      const float xh = (to_float(x[c]) - mean) * rstd, gf = to_float(g[c]), gw = gf * to_float(weight[c]);
      if constexpr (!kRms) s[0] += gw;
      s[NS - 1] += gw * xh;
      dwp[c] += gf * xh;
      if constexpr (!kRms) dbp[c] += gf;
    }
    row_sum(s, red[parity]);
    if (!live) continue;
    const float a = kRms ? 0.0f : s[0] / n, b = s[NS - 1] / n;
    T* dx = static_cast<T*>(p.out) + off;
    for (int64_t c = tx; c < cols; c += tpr) {
      const float xh = (to_float(x[c]) - mean) * rstd;
      dx[c] = from_float<T>(rstd * (to_float(g[c]) * to_float(weight[c]) - a - xh * b));
    }
  }
}

// ---------------------------------------------------------------- weight-gradient reduction

// out[c] = Σ_r part[r, c] for r = 0 .. rows-1, in a fixed order: thread (tx, ty) of the
// 32 × 32 block sums rows ty, ty + 32, ... of column blockIdx.x·32 + tx, then warp ty adds
// the 32 sums of column blockIdx.x·32 + ty with a shuffle tree. blockIdx.y: 0 = weight,
// 1 = bias.
template <typename W>
__global__ void __launch_bounds__(1024) norm_grad_reduce_kernel(const NormParams p) {
  __shared__ float tile[32][33];
  const float* part = blockIdx.y == 0 ? p.grad_weight_partial : p.grad_bias_partial;
  W* dst = static_cast<W*>(blockIdx.y == 0 ? p.grad_weight : p.grad_bias);
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * 32;
  float acc = 0.0f;
  if (col0 + tx < p.cols) {
    const float* src = part + col0 + tx;
    for (int64_t r = ty; r < p.partial_rows; r += 32) acc += src[r * p.cols];
  }
  tile[ty][tx] = acc;
  __syncthreads();
  const float t = warp_sum(tile[tx][ty]);  // column col0 + ty, over the 32 row slices
  if (tx == 0 && col0 + ty < p.cols) dst[col0 + ty] = from_float<W>(t);
}

// ---------------------------------------------------------------- launch plans

struct Plan {
  bool vec;          // register-resident kernels
  int k;             // packs per thread (vec)
  int tpr;           // threads per row (multiple of 32)
  int slots;         // rows per block (blockDim.y)
};

int element_size(DType d) { return d == DType::kFloat ? 4 : 2; }

int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

Plan make_plan(const NormParams& p, bool backward) {
  const int slot_threads = backward ? kBackwardSlotThreads : kForwardSlotThreads;
  const int64_t v = 16 / element_size(p.dtype);
  const bool aligned = p.cols % v == 0 && aligned16(p.input) && aligned16(p.out) && aligned16(p.weight) &&
                       aligned16(p.bias) && (!backward || aligned16(p.grad));
  if (aligned) {
    const int64_t packs = p.cols / v;
    // A warp per row while a thread needs at most 4 packs (rows of up to 128 packs).
    for (const int k : {1, 2, 4}) {
      if (packs <= 32 * k) return {true, k, 32, slot_threads / 32};
    }
    // Wider rows: 4 packs a thread (8 in the forward once 4 would need > 512 threads).
    // The backward holds 4 packs of x and of g plus 2·4·V fp32 sums: 4 is its limit.
    for (const int k : {4, 8}) {
      if (k == 8 && backward) break;
      const int64_t tpr = round_up(ceil_div(packs, k), 32);
      if (tpr <= kMaxRowThreads) {
        return {true, k, static_cast<int>(tpr), std::max<int>(1, slot_threads / static_cast<int>(tpr))};
      }
    }
  }
  const int64_t tpr = std::min<int64_t>(kMaxRowThreads, round_up(ceil_div(p.cols, 4), 32));
  return {false, 0, static_cast<int>(tpr), std::max<int>(1, slot_threads / static_cast<int>(tpr))};
}

// Calls f(T{}, W{}) -- value-initialised tags of the input and weight types.
template <typename T>
struct Tag {
  using type = T;
};
template <typename F>
void dispatch_types(const NormParams& p, const char* what, F&& f) {
  if (p.weight_dtype != DType::kFloat && p.weight_dtype != p.dtype) {
    throw std::runtime_error(std::string("megatorch: ") + what + ": weight must be fp32 or of the input's dtype");
  }
  const bool w32 = p.weight_dtype == DType::kFloat;
  switch (p.dtype) {
    case DType::kFloat: f(Tag<float>{}, Tag<float>{}); break;
    case DType::kHalf: w32 ? f(Tag<__half>{}, Tag<float>{}) : f(Tag<__half>{}, Tag<__half>{}); break;
    case DType::kBFloat16:
      w32 ? f(Tag<__nv_bfloat16>{}, Tag<float>{}) : f(Tag<__nv_bfloat16>{}, Tag<__nv_bfloat16>{});
      break;
  }
}

template <typename T, typename W, bool kRms>
void* backward_kernel(const Plan& plan) {
  if (!plan.vec) return reinterpret_cast<void*>(&norm_backward_generic_kernel<T, W, kRms>);
  switch (plan.k) {
    case 1: return reinterpret_cast<void*>(&norm_backward_vec_kernel<T, W, 1, kRms>);
    case 2: return reinterpret_cast<void*>(&norm_backward_vec_kernel<T, W, 2, kRms>);
    default: return reinterpret_cast<void*>(&norm_backward_vec_kernel<T, W, 4, kRms>);
  }
}

size_t backward_smem(const NormParams& p, const Plan& plan) {
  return plan.vec && plan.slots > 1 ? static_cast<size_t>(plan.slots) * p.cols * sizeof(float) : 0;
}

// Blocks of the backward grid: at most one wave of resident blocks, evened out over the
// row groups (so the weight-gradient workspace has about one row per resident block).
int64_t backward_blocks(const NormParams& p, const Plan& plan) {
  void* kernel = nullptr;
  dispatch_types(p, "norm_backward", [&](auto tt, auto tw) {
    using T = typename decltype(tt)::type;
    using W = typename decltype(tw)::type;
    kernel = p.rms ? backward_kernel<T, W, true>(plan) : backward_kernel<T, W, false>(plan);
  });
  const int threads = plan.tpr * plan.slots;
  const int64_t resident =
      static_cast<int64_t>(device_sm_count()) * resident_blocks_per_sm(kernel, threads, backward_smem(p, plan));
  return balanced_blocks(ceil_div(p.rows, plan.slots), resident);
}

}  // namespace

void norm_forward(const NormParams& p, void* stream) {
  if (p.rows <= 0 || p.cols <= 0) return;
  const Plan plan = make_plan(p, false);
  const dim3 block(plan.tpr, plan.slots);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(ceil_div(p.rows, plan.slots), 0x7fffffff));
  const cudaStream_t s = as_stream(stream);
  dispatch_types(p, "norm_forward", [&](auto tt, auto tw) {
    using T = typename decltype(tt)::type;
    using W = typename decltype(tw)::type;
    if (!plan.vec) {
      norm_forward_generic_kernel<T, W><<<grid, block, 0, s>>>(p);
      return;
    }
    switch (plan.k) {
      case 1: norm_forward_vec_kernel<T, W, 1><<<grid, block, 0, s>>>(p); break;
      case 2: norm_forward_vec_kernel<T, W, 2><<<grid, block, 0, s>>>(p); break;
      case 4: norm_forward_vec_kernel<T, W, 4><<<grid, block, 0, s>>>(p); break;
      default: norm_forward_vec_kernel<T, W, 8><<<grid, block, 0, s>>>(p); break;
    }
  });
  check_launch("norm_forward");
}

int64_t norm_backward_partial_rows(const NormParams& p) {
  if (p.rows <= 0 || p.cols <= 0) return 0;
  const Plan plan = make_plan(p, true);
  const int64_t blocks = backward_blocks(p, plan);
  return plan.vec ? blocks : blocks * plan.slots;
}

void norm_backward(const NormParams& p, void* stream) {
  if (p.rows <= 0 || p.cols <= 0) return;
  const Plan plan = make_plan(p, true);
  const int64_t blocks = backward_blocks(p, plan);
  const int64_t needed = plan.vec ? blocks : blocks * plan.slots;
  if (p.partial_rows != needed || p.grad_weight_partial == nullptr || p.grad_weight == nullptr ||
      (!p.rms && (p.grad_bias_partial == nullptr || p.grad_bias == nullptr)) ||
      (plan.vec && (!aligned16(p.grad_weight_partial) || !aligned16(p.grad_bias_partial)))) {
    throw std::runtime_error("megatorch: norm_backward: expected fp32 workspaces (16-byte aligned) of "
                             "norm_backward_partial_rows(p) = " + std::to_string(needed) + " rows, got " +
                             std::to_string(p.partial_rows));
  }
  const cudaStream_t s = as_stream(stream);
  const dim3 block(plan.tpr, plan.slots);
  const size_t smem = backward_smem(p, plan);
  dispatch_types(p, "norm_backward", [&](auto tt, auto tw) {
    using T = typename decltype(tt)::type;
    using W = typename decltype(tw)::type;
    const void* kernel = p.rms ? backward_kernel<T, W, true>(plan) : backward_kernel<T, W, false>(plan);
    NormParams arg = p;
    void* args[] = {&arg};
    const cudaError_t err = cudaLaunchKernel(kernel, dim3(static_cast<unsigned>(blocks)), block, args, smem, s);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      throw std::runtime_error(std::string("megatorch: CUDA kernel norm_backward failed to launch: ") +
                               cudaGetErrorString(err));
    }
    const dim3 rgrid(static_cast<unsigned>(ceil_div(p.cols, 32)), p.rms ? 1 : 2);
    norm_grad_reduce_kernel<W><<<rgrid, dim3(32, 32), 0, s>>>(p);
  });
  check_launch("norm_backward");
}

}  // namespace megatorch::kernels::cuda
