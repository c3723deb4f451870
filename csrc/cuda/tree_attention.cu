// Tree attention on CUDA. A block owns one (row, KV head) and up to kRows query rows of
// that head's group; key/value tiles are staged in shared memory once per block and every
// warp runs an online softmax over them for its rows. Mask bits are read per key.
// With a sliding window each tile also stages its keys' positions (prefix key s at s, node
// j at prefix + the popcount of its mask row - 1); a sink starts each row's online softmax
// as a logit with no value (-inf: no sink; a query that sees no key gets zeros). Keys
// outside what the block's queries can see (from prefix + T on, below the shallowest
// query's window) are never read. Not yet run on a GPU.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "common.cuh"

namespace spec_ext {
namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 2;
constexpr int kRows = kWarps * kRowsPerWarp;
constexpr int kMaxChunks = 8;  // head dim up to 256

// Depth of tree node j from its packed mask row (nullptr: the causal chain, depth j).
__device__ inline int64_t node_depth(const uint32_t* row, int64_t j, int64_t W) {
  if (!row) return j;
  int64_t count = 0;
  for (int64_t w = 0; w < W; ++w) count += __popc(row[w]);
  return count - 1;
}

// tanh to a few ulp: --use_fast_math turns tanhf into tanh.approx.f32 (relative error 2^-11,
// seen in the PTX), which would move soft-capped scores by up to softcap * 5e-4.
__device__ inline float accurate_tanh(float x) {
  const float e = expm1f(2.f * fminf(fabsf(x), 10.f));  // tanh(10) rounds to 1 in float
  return copysignf(e / (e + 2.f), x);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kWarps * 32) tree_attention_kernel(
    const scalar_t* __restrict__ Qp, const scalar_t* __restrict__ Kp, const scalar_t* __restrict__ Vp,
    const int32_t* __restrict__ prefix_lens, const uint32_t* __restrict__ mask, int64_t mask_rows, int64_t W,
    float scale, int64_t window, float softcap, const float* __restrict__ sinks, int64_t Hq, int64_t Hkv, int64_t T,
    int64_t S, int64_t D, int64_t tile, scalar_t* __restrict__ O) {
  extern __shared__ float smem[];
  float* ktile = smem;
  float* vtile = smem + tile * D;
  int64_t* key_pos = reinterpret_cast<int64_t*>(vtile + tile * D);  // [tile] when window > 0
  const int64_t b = blockIdx.z, hkv = blockIdx.y, group = Hq / Hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t prefix = prefix_lens[b];
  const int64_t limit = min(S, prefix + T);
  const uint32_t* rows_bits = mask ? mask + (mask_rows == 1 ? 0 : b) * T * W : nullptr;  // this row's [T, W]
  __shared__ int64_t lowest_query[kWarps];

  int64_t rows[kRowsPerWarp], query_pos[kRowsPerWarp];
  float q[kRowsPerWarp][kMaxChunks], acc[kRowsPerWarp][kMaxChunks], m[kRowsPerWarp], l[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    rows[r] = static_cast<int64_t>(blockIdx.x) * kRows + warp * kRowsPerWarp + r;  // g * T + i
    const bool valid = rows[r] < group * T;
    const int64_t h = hkv * group + (valid ? rows[r] / T : 0), i = valid ? rows[r] % T : 0;
    query_pos[r] = prefix + node_depth(rows_bits ? rows_bits + i * W : nullptr, i, W);
    m[r] = sinks ? sinks[h] : -INFINITY;  // the sink: logit m[r], weight exp(0) = 1 unless -inf
    l[r] = m[r] == -INFINITY ? 0.f : 1.f;
    for (int c = 0; c < kMaxChunks; ++c) {
      const int64_t d = lane + 32 * c;
      q[r][c] = (valid && d < D) ? static_cast<float>(Qp[((b * Hq + h) * T + i) * D + d]) * scale : 0.f;
      acc[r][c] = 0.f;
    }
  }
  // the keys this block reads start at its shallowest query's position - window + 1 (the
  // root sits at prefix; a mask row without its own bit has depth -1): no key before that
  // is read, so unseen keys may hold anything (0 * NaN is NaN)
  int64_t lowest = INT64_MAX;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (rows[r] < group * T) lowest = min(lowest, query_pos[r]);
  }
  if (lane == 0) lowest_query[warp] = lowest;
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) lowest = min(lowest, lowest_query[w]);
  const int64_t first = window ? max(lowest - window + 1, int64_t{0}) : 0;
  const scalar_t* kbase = Kp + (b * Hkv + hkv) * S * D;
  const scalar_t* vbase = Vp + (b * Hkv + hkv) * S * D;
  for (int64_t start = first; start < limit; start += tile) {
    const int64_t n = min(tile, limit - start);
    __syncthreads();
    for (int64_t e = threadIdx.x; e < n * D; e += blockDim.x) {
      ktile[e] = static_cast<float>(kbase[start * D + e]);
      vtile[e] = static_cast<float>(vbase[start * D + e]);
    }
    if (window) {
      for (int64_t s = threadIdx.x; s < n; s += blockDim.x) {
        const int64_t j = start + s - prefix;
        key_pos[s] = j < 0 ? start + s : prefix + node_depth(rows_bits ? rows_bits + j * W : nullptr, j, W);
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      if (rows[r] >= group * T) continue;
      const int64_t i = rows[r] % T;
      const uint32_t* bits = rows_bits ? rows_bits + i * W : nullptr;
      for (int64_t s = 0; s < n; ++s) {
        const int64_t j = start + s - prefix;
        const bool visible = j < 0 || (bits ? ((bits[j / 32] >> (j % 32)) & 1u) : j <= i);
        if (!visible) continue;
        if (window && query_pos[r] - key_pos[s] >= window) continue;
        float dot = 0.f;
        for (int c = 0; c < kMaxChunks; ++c) {
          const int64_t d = lane + 32 * c;
          if (d < D) dot += q[r][c] * ktile[s * D + d];
        }
        for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, offset);
        if (softcap > 0.f) dot = softcap * accurate_tanh(dot / softcap);
        const float m_new = fmaxf(m[r], dot);
        const float correction = __expf(m[r] - m_new);
        const float w = __expf(dot - m_new);
        l[r] = l[r] * correction + w;
        for (int c = 0; c < kMaxChunks; ++c) {
          const int64_t d = lane + 32 * c;
          if (d < D) acc[r][c] = acc[r][c] * correction + w * vtile[s * D + d];
        }
        m[r] = m_new;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (rows[r] >= group * T) continue;
    const int64_t h = hkv * group + rows[r] / T, i = rows[r] % T;
    for (int c = 0; c < kMaxChunks; ++c) {
      const int64_t d = lane + 32 * c;
      if (d < D) O[((b * Hq + h) * T + i) * D + d] = static_cast<scalar_t>(l[r] > 0.f ? acc[r][c] / l[r] : 0.f);
    }
  }
}

}  // namespace

at::Tensor tree_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                               const at::Tensor& prefix_lens_in, const std::optional<at::Tensor>& tree_mask_in,
                               double scale, int64_t window, double softcap, const std::optional<at::Tensor>& sinks_in) {
  TORCH_CHECK(window >= 0, "tree_attention (cuda): window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "tree_attention (cuda): softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(!sinks_in || sinks_in->numel() == q_in.size(1), "tree_attention (cuda): sinks must hold one logit per query head (",
              q_in.size(1), "), got ", sinks_in ? sinks_in->numel() : 0);
  const c10::cuda::CUDAGuard guard(q_in.device());
  auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  auto prefix_lens = prefix_lens_in.to(at::kInt).contiguous();
  at::Tensor tree_mask;
  if (tree_mask_in) tree_mask = tree_mask_in->contiguous();
  at::Tensor sinks;
  if (sinks_in) sinks = sinks_in->to(at::kFloat).contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(D <= 32 * kMaxChunks, "tree_attention (cuda): head dim must be at most ", 32 * kMaxChunks);
  TORCH_CHECK(v_in.size(3) == D, "tree_attention (cuda): values must have the keys' head size D=", D, ", got Dv=",
              v_in.size(3), " (MLA: use the sdpa, cpu or torch backend)");
  auto out = at::empty_like(q);
  if (q.numel() == 0) return out;
  const int64_t tile = std::max<int64_t>(8, 4096 / D);
  const size_t smem = 2 * tile * D * sizeof(float) + (window ? tile * sizeof(int64_t) : 0);
  const dim3 grid((Hq / Hkv * T + kRows - 1) / kRows, Hkv, B);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "tree_attention_cuda", [&] {
    tree_attention_kernel<scalar_t><<<grid, kWarps * 32, smem, at::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), prefix_lens.data_ptr<int32_t>(),
        tree_mask.defined() ? reinterpret_cast<const uint32_t*>(tree_mask.data_ptr<int32_t>()) : nullptr,
        tree_mask.defined() ? tree_mask.size(0) : 0, tree_mask.defined() ? tree_mask.size(2) : 0,
        static_cast<float>(scale), window, static_cast<float>(softcap),
        sinks.defined() ? sinks.data_ptr<float>() : nullptr, Hq, Hkv, T, S, D, tile, out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

TORCH_LIBRARY_IMPL(spec_ext, CUDA, m) { m.impl("tree_attention", &tree_attention_cuda); }

}  // namespace spec_ext
