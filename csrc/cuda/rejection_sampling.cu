// Chain and tree verification on CUDA: one block per row, one launch per call. The
// acceptance tests are scalar; only the final (residual or bonus) draw and greedy
// argmaxes sweep the vocabulary. No [B,K,V] residual is materialised.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common.cuh"

namespace spec_ext {
namespace {

struct Shared {
  double partial[kThreads];
  int64_t last_pos[kThreads];
  float best_val[kThreads];
  int64_t best_idx[kThreads];
  int64_t result;
  int64_t decision;
};

template <typename Mass, typename Fallback>
__device__ int64_t sample(int64_t V, double u, Mass mass, Fallback fallback, Shared& sh) {
  int64_t token = block_inverse_cdf(V, u, mass, sh.partial, sh.last_pos, &sh.result);
  if (token < 0) token = block_inverse_cdf(V, u, fallback, sh.partial, sh.last_pos, &sh.result);
  return token < 0 ? 0 : token;
}

__global__ void __launch_bounds__(kThreads) chain_verify_kernel(
    const float* __restrict__ P, const int64_t* __restrict__ X, const float* __restrict__ Q,
    const int64_t* __restrict__ N, const double* __restrict__ U, bool greedy, int64_t K, int64_t V,
    int64_t* __restrict__ out, int64_t* __restrict__ num_accepted) {
  __shared__ Shared sh;
  const int64_t b = blockIdx.x, K1 = K + 1;
  const double u_final = U ? U[b * K1 + K] : 0.0;
  for (int64_t i = threadIdx.x; i < K1; i += blockDim.x) out[b * K1 + i] = -1;
  __syncthreads();
  for (int64_t i = 0; i < K1; ++i) {
    const float* p = P + (b * K1 + i) * V;
    const int64_t x = (i < K && i < N[b]) ? X[b * K + i] : -1;
    int64_t token;
    if (greedy) {
      token = block_argmax(p, V, sh.best_val, sh.best_idx);
      if (x == token) {
        if (threadIdx.x == 0) out[b * K1 + i] = x;
        continue;
      }
    } else if (x >= 0 && x < V) {
      const float* q = Q ? Q + (b * K + i) * V : nullptr;
      const double qx = q ? q[x] : 1.0;
      if (qx > 0 && U[b * K1 + i] * qx < static_cast<double>(p[x])) {
        if (threadIdx.x == 0) out[b * K1 + i] = x;
        continue;
      }
      auto fallback = [=](int64_t j) { return static_cast<double>(p[j]); };
      if (q) {
        token = sample(V, u_final, [=](int64_t j) {
          return fmax(static_cast<double>(p[j]) - static_cast<double>(q[j]), 0.0);
        }, fallback, sh);
      } else {
        token = sample(V, u_final, [=](int64_t j) { return j == x ? 0.0 : static_cast<double>(p[j]); },
                       fallback, sh);
      }
    } else {
      auto mass = [=](int64_t j) { return static_cast<double>(p[j]); };
      token = sample(V, u_final, mass, mass, sh);
    }
    if (threadIdx.x == 0) {
      out[b * K1 + i] = token;
      num_accepted[b] = i;
    }
    return;
  }
}

__global__ void __launch_bounds__(kThreads) tree_verify_kernel(
    const float* __restrict__ P, const int64_t* __restrict__ X, const int64_t* __restrict__ parents,
    const float* __restrict__ Q, const double* __restrict__ U, bool greedy, bool without_replacement,
    int64_t T, int64_t V, double* residual_all, double* rest_all, double* q_all, int64_t* path_out,
    int64_t* tok_out, int64_t* acc_out) {
  __shared__ Shared sh;
  __shared__ double reduce[kThreads];
  const int64_t b = blockIdx.x;
  double* residual = residual_all + b * V;
  double* rest = rest_all + b * V;
  double* q = q_all + b * V;
  for (int64_t i = threadIdx.x; i < T; i += blockDim.x) {
    path_out[b * T + i] = -1;
    tok_out[b * T + i] = -1;
  }
  __syncthreads();
  if (threadIdx.x == 0) path_out[b * T] = 0;
  int64_t node = 0, depth = 0;
  while (true) {
    const float* p = P + (b * T + node) * V;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      residual[j] = p[j];
      if (Q) q[j] = Q[(b * T + node) * V + j];
    }
    __syncthreads();
    const int64_t best = block_argmax(p, V, sh.best_val, sh.best_idx);
    int64_t accepted = -1;
    for (int64_t child = node + 1; child < T; ++child) {
      const int64_t x = X[b * T + child];
      if (parents[b * T + child] != node || x < 0 || x >= V) continue;
      if (greedy) {
        if (x == best) { accepted = child; break; }
        continue;
      }
      const double qx = Q ? q[x] : 1.0;
      if (qx > 0 && U[b * (T + 1) + child] * qx < residual[x]) { accepted = child; break; }
      double local = 0;
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        rest[j] = Q ? fmax(residual[j] - q[j], 0.0) : (j == x ? 0.0 : residual[j]);
        local += rest[j];
      }
      const double sum = block_sum(local, reduce);
      if (sum > 0)
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) residual[j] = rest[j] / sum;
      if (Q && without_replacement) {
        __syncthreads();
        if (threadIdx.x == 0) q[x] = 0;
        __syncthreads();
        double qlocal = 0;
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) qlocal += q[j];
        const double qsum = block_sum(qlocal, reduce);
        if (qsum > 0)
          for (int64_t j = threadIdx.x; j < V; j += blockDim.x) q[j] /= qsum;
      }
      __syncthreads();
    }
    if (accepted < 0) {
      int64_t token = best;
      if (!greedy) {
        auto mass = [=](int64_t j) { return residual[j]; };
        token = sample(V, U[b * (T + 1) + T], mass, mass, sh);
      }
      if (threadIdx.x == 0) {
        tok_out[b * T + depth] = token;
        acc_out[b] = depth;
      }
      return;
    }
    ++depth;
    if (threadIdx.x == 0) {
      path_out[b * T + depth] = accepted;
      tok_out[b * T + depth - 1] = X[b * T + accepted];
    }
    node = accepted;
    __syncthreads();
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> chain_verify_cuda(
    const at::Tensor& target_in, const at::Tensor& draft_tokens_in,
    const std::optional<at::Tensor>& draft_probs_in, const at::Tensor& num_draft_in,
    const std::optional<at::Tensor>& uniforms_in, bool greedy) {
  const c10::cuda::CUDAGuard guard(target_in.device());
  auto target = target_in.contiguous();
  auto draft_tokens = draft_tokens_in.contiguous();
  auto num_draft = num_draft_in.contiguous();
  at::Tensor draft_probs, uniforms;
  if (draft_probs_in) draft_probs = draft_probs_in->contiguous();
  if (uniforms_in) uniforms = uniforms_in->contiguous();
  TORCH_CHECK(greedy || uniforms.defined(), "chain_verify: uniforms are required when sampling");
  const int64_t B = target.size(0), K = target.size(1) - 1, V = target.size(2);
  auto tokens = at::empty({B, K + 1}, draft_tokens.options());
  auto num_accepted = at::zeros({B}, draft_tokens.options());
  if (B > 0) {
    chain_verify_kernel<<<B, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        target.data_ptr<float>(), draft_tokens.data_ptr<int64_t>(),
        draft_probs.defined() ? draft_probs.data_ptr<float>() : nullptr, num_draft.data_ptr<int64_t>(),
        uniforms.defined() ? uniforms.data_ptr<double>() : nullptr, greedy, K, V,
        tokens.data_ptr<int64_t>(), num_accepted.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {tokens, num_accepted};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_verify_cuda(
    const at::Tensor& target_in, const at::Tensor& tree_tokens_in, const at::Tensor& parents_in,
    const std::optional<at::Tensor>& draft_probs_in, const std::optional<at::Tensor>& uniforms_in,
    bool greedy, bool without_replacement) {
  const c10::cuda::CUDAGuard guard(target_in.device());
  auto target = target_in.contiguous();
  auto tree_tokens = tree_tokens_in.contiguous();
  auto parents = parents_in.contiguous();
  at::Tensor draft_probs, uniforms;
  if (draft_probs_in) draft_probs = draft_probs_in->contiguous();
  if (uniforms_in) uniforms = uniforms_in->contiguous();
  TORCH_CHECK(greedy || uniforms.defined(), "tree_verify: uniforms are required when sampling");
  const int64_t B = target.size(0), T = target.size(1), V = target.size(2);
  auto path = at::empty({B, T}, tree_tokens.options());
  auto tokens = at::empty({B, T}, tree_tokens.options());
  auto num_accepted = at::zeros({B}, tree_tokens.options());
  auto scratch = at::empty({3, B, V}, target.options().dtype(at::kDouble));
  if (B > 0) {
    tree_verify_kernel<<<B, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        target.data_ptr<float>(), tree_tokens.data_ptr<int64_t>(), parents.data_ptr<int64_t>(),
        draft_probs.defined() ? draft_probs.data_ptr<float>() : nullptr,
        uniforms.defined() ? uniforms.data_ptr<double>() : nullptr, greedy, without_replacement, T, V,
        scratch[0].data_ptr<double>(), scratch[1].data_ptr<double>(), scratch[2].data_ptr<double>(),
        path.data_ptr<int64_t>(), tokens.data_ptr<int64_t>(), num_accepted.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {path, tokens, num_accepted};
}

TORCH_LIBRARY_IMPL(spec_ext, CUDA, m) {
  m.impl("chain_verify", &chain_verify_cuda);
  m.impl("tree_verify", &tree_verify_cuda);
}

}  // namespace spec_ext
