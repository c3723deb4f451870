// Chain and tree verification on CPU: one row per task, float64 decisions, same
// arithmetic as spec_ext/reference.py so the same uniforms give the same tokens.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace spec_ext {
namespace {

constexpr int64_t kBlock = 256;

// Smallest j with cumsum(mass)[j] > u * sum(mass); the last positive index when rounding
// leaves none; -1 if the mass is not positive. Block sums (four accumulators, so the
// compiler can vectorise) find the block, then one block is scanned element by element.
template <typename Mass>
int64_t inverse_cdf(int64_t V, double u, Mass mass) {
  const int64_t num_blocks = (V + kBlock - 1) / kBlock;
  std::vector<double> blocks(num_blocks);
  double total = 0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t lo = b * kBlock, hi = std::min(V, lo + kBlock);
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t j = lo;
    for (; j + 4 <= hi; j += 4) {
      s0 += mass(j);
      s1 += mass(j + 1);
      s2 += mass(j + 2);
      s3 += mass(j + 3);
    }
    for (; j < hi; ++j) s0 += mass(j);
    blocks[b] = (s0 + s1) + (s2 + s3);
    total += blocks[b];
  }
  if (!(total > 0)) return -1;
  const double threshold = u * total;
  double acc = 0;
  int64_t b = 0;
  while (b < num_blocks && !(acc + blocks[b] > threshold)) acc += blocks[b++];
  for (int64_t j = b * kBlock; j < V; ++j) {
    const double m = mass(j);
    acc += m;
    if (acc > threshold && m > 0) return j;
  }
  for (int64_t j = V - 1; j >= 0; --j)
    if (mass(j) > 0) return j;
  return -1;
}

template <typename Mass, typename Fallback>
int64_t sample(int64_t V, double u, Mass mass, Fallback fallback) {
  int64_t token = inverse_cdf(V, u, mass);
  if (token < 0) token = inverse_cdf(V, u, fallback);
  return token < 0 ? 0 : token;
}

int64_t argmax(const float* row, int64_t V) {
  int64_t best = 0;
  for (int64_t j = 1; j < V; ++j)
    if (row[j] > row[best]) best = j;
  return best;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> chain_verify_cpu(
    const at::Tensor& target_in, const at::Tensor& draft_tokens_in,
    const std::optional<at::Tensor>& draft_probs_in, const at::Tensor& num_draft_in,
    const std::optional<at::Tensor>& uniforms_in, bool greedy) {
  auto target = target_in.contiguous();
  auto draft_tokens = draft_tokens_in.contiguous();
  auto num_draft = num_draft_in.contiguous();
  const int64_t B = target.size(0), K1 = target.size(1), V = target.size(2), K = K1 - 1;
  at::Tensor draft_probs, uniforms;
  if (draft_probs_in) draft_probs = draft_probs_in->contiguous();
  if (uniforms_in) uniforms = uniforms_in->contiguous();
  TORCH_CHECK(greedy || uniforms.defined(), "chain_verify: uniforms are required when sampling");
  auto tokens = at::full({B, K1}, -1, draft_tokens.options());
  auto num_accepted = at::zeros({B}, draft_tokens.options());
  const float* P = target.data_ptr<float>();
  const float* Q = draft_probs.defined() ? draft_probs.data_ptr<float>() : nullptr;
  const double* U = uniforms.defined() ? uniforms.data_ptr<double>() : nullptr;
  const int64_t* X = draft_tokens.data_ptr<int64_t>();
  const int64_t* N = num_draft.data_ptr<int64_t>();
  int64_t* out = tokens.data_ptr<int64_t>();
  int64_t* acc = num_accepted.data_ptr<int64_t>();

  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const double u_final = U ? U[b * K1 + K] : 0.0;
      for (int64_t i = 0; i < K1; ++i) {
        const float* p = P + (b * K1 + i) * V;
        const int64_t x = (i < K && i < N[b]) ? X[b * K + i] : -1;
        int64_t token;
        if (greedy) {
          token = argmax(p, V);
          if (x == token) { out[b * K1 + i] = x; continue; }
        } else if (x >= 0 && x < V) {
          const float* q = Q ? Q + (b * K + i) * V : nullptr;
          const double qx = q ? q[x] : 1.0;
          if (qx > 0 && U[b * K1 + i] * qx < static_cast<double>(p[x])) {
            out[b * K1 + i] = x;
            continue;
          }
          auto fallback = [&](int64_t j) { return static_cast<double>(p[j]); };
          if (q) {
            token = sample(V, u_final, [&](int64_t j) {
              const double d = static_cast<double>(p[j]) - static_cast<double>(q[j]);
              return d > 0 ? d : 0.0;
            }, fallback);
          } else {
            token = sample(V, u_final, [&](int64_t j) { return j == x ? 0.0 : static_cast<double>(p[j]); },
                           fallback);
          }
        } else {
          auto mass = [&](int64_t j) { return static_cast<double>(p[j]); };
          token = sample(V, u_final, mass, mass);
        }
        out[b * K1 + i] = token;
        acc[b] = i;
        break;
      }
    }
  });
  return {tokens, num_accepted};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_verify_cpu(
    const at::Tensor& target_in, const at::Tensor& tree_tokens_in, const at::Tensor& parents_in,
    const std::optional<at::Tensor>& draft_probs_in, const std::optional<at::Tensor>& uniforms_in,
    bool greedy, bool without_replacement) {
  auto target = target_in.contiguous();
  auto tree_tokens = tree_tokens_in.contiguous();
  auto parents = parents_in.contiguous();
  const int64_t B = target.size(0), T = target.size(1), V = target.size(2);
  at::Tensor draft_probs, uniforms;
  if (draft_probs_in) draft_probs = draft_probs_in->contiguous();
  if (uniforms_in) uniforms = uniforms_in->contiguous();
  TORCH_CHECK(greedy || uniforms.defined(), "tree_verify: uniforms are required when sampling");
  auto path = at::full({B, T}, -1, tree_tokens.options());
  auto tokens = at::full({B, T}, -1, tree_tokens.options());
  auto num_accepted = at::zeros({B}, tree_tokens.options());
  const float* P = target.data_ptr<float>();
  const float* Q = draft_probs.defined() ? draft_probs.data_ptr<float>() : nullptr;
  const double* U = uniforms.defined() ? uniforms.data_ptr<double>() : nullptr;
  const int64_t* X = tree_tokens.data_ptr<int64_t>();
  const int64_t* par = parents.data_ptr<int64_t>();
  int64_t* path_out = path.data_ptr<int64_t>();
  int64_t* tok_out = tokens.data_ptr<int64_t>();
  int64_t* acc_out = num_accepted.data_ptr<int64_t>();

  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> residual(V), rest(V), q(V);
    for (int64_t b = begin; b < end; ++b) {
      int64_t node = 0, depth = 0;
      path_out[b * T] = 0;
      while (true) {
        const float* p = P + (b * T + node) * V;
        for (int64_t j = 0; j < V; ++j) residual[j] = p[j];
        if (Q) for (int64_t j = 0; j < V; ++j) q[j] = Q[(b * T + node) * V + j];
        const int64_t best = argmax(p, V);
        int64_t accepted = -1;
        for (int64_t child = node + 1; child < T; ++child) {
          const int64_t x = X[b * T + child];
          if (par[b * T + child] != node || x < 0 || x >= V) continue;
          if (greedy) {
            if (x == best) { accepted = child; break; }
            continue;
          }
          const double qx = Q ? q[x] : 1.0;
          if (qx > 0 && U[b * (T + 1) + child] * qx < residual[x]) { accepted = child; break; }
          double sum = 0;
          for (int64_t j = 0; j < V; ++j) {
            rest[j] = Q ? std::max(residual[j] - q[j], 0.0) : (j == x ? 0.0 : residual[j]);
            sum += rest[j];
          }
          if (sum > 0) for (int64_t j = 0; j < V; ++j) residual[j] = rest[j] / sum;
          if (Q && without_replacement) {
            q[x] = 0;
            double qsum = 0;
            for (int64_t j = 0; j < V; ++j) qsum += q[j];
            if (qsum > 0) for (int64_t j = 0; j < V; ++j) q[j] /= qsum;
          }
        }
        if (accepted < 0) {
          if (greedy) {
            tok_out[b * T + depth] = best;
          } else {
            auto mass = [&](int64_t j) { return residual[j]; };
            tok_out[b * T + depth] = sample(V, U[b * (T + 1) + T], mass, mass);
          }
          acc_out[b] = depth;
          break;
        }
        ++depth;
        path_out[b * T + depth] = accepted;
        tok_out[b * T + depth - 1] = X[b * T + accepted];
        node = accepted;
      }
    }
  });
  return {path, tokens, num_accepted};
}

TORCH_LIBRARY_IMPL(spec_ext, CPU, m) {
  m.impl("chain_verify", &chain_verify_cpu);
  m.impl("tree_verify", &tree_verify_cpu);
}

}  // namespace spec_ext
