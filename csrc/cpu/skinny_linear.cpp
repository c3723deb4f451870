// y = x @ weight.T (+ bias) for a few rows of x (decode steps, verification blocks),
// float32, on AVX-512, AVX2 + FMA or portable C++, bit-equal on all three. MKL's GEMM reads cold weights at 4-7 GB/s on this machine for up to ~64 rows;
// here each weight row is streamed from memory once and dotted with every row of x (which
// stays in cache): 19-32 GB/s for 1-2 rows, 15-19 for 5-8, 8 at 16 and 1.1-1.3x MKL at
// 24-64 (single runs; this box's speed varies by 2x between runs). Up to 24 rows of x one
// weight row is streamed at a time; beyond, blocks of 4 weight rows x 6 rows of x keep 24
// accumulators in registers. Each y[m, n] is one fixed-order dot product (see tail_dot),
// so a row's result does not depend on how many other rows come with it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace spec_ext {
namespace {

// The order of every sum, on every path: 16 interleaved partial sums over k (lane j takes
// k = j mod 16, one fused multiply-add per step), added as a tree (j + j+8, then j + j+4,
// j + j+2, j + j+1), then the tail k >= K - K % 16 fused in order.
inline float tail_dot(float s, const float* w, const float* x, int64_t k, int64_t K) {
  for (; k < K; ++k) s = std::fma(w[k], x[k], s);
  return s;
}

float finish_portable(float* lanes, const float* w, const float* x, int64_t k, int64_t K) {
  for (int64_t width = 8; width >= 1; width /= 2)
    for (int64_t j = 0; j < width; ++j) lanes[j] = lanes[j] + lanes[j + width];
  return tail_dot(lanes[0], w, x, k, K);
}

void rows_portable(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                   int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      float lanes[16] = {0.f};
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        for (int64_t j = 0; j < 16; ++j) lanes[j] = std::fma(wr[k + j], xr[k + j], lanes[j]);
      y[m * N + n] = finish_portable(lanes, wr, xr, k, K);
    }
  }
}

#if defined(__x86_64__)
// finish_portable's tree over the 16 lanes, in registers
__attribute__((target("avx512f,fma"))) inline float sum_lanes(__m512 v) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// NR weight rows x MR rows of x per block: NR + MR loads feed NR * MR FMAs, the
// accumulators stay in registers (24 of the 32 zmm at 4 x 6).
template <int NR, int MR>
__attribute__((target("avx512f,fma"))) void block_avx512(const float* x, const float* w, float* y, int64_t N,
                                                          int64_t K, int64_t n, int64_t m0) {
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm512_loadu_ps(w + (n + r) * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k);
      for (int r = 0; r < NR; ++r) acc[r][i] = _mm512_fmadd_ps(wv[r], xv, acc[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i)
      y[(m0 + i) * N + n + r] = tail_dot(sum_lanes(acc[r][i]), w + (n + r) * K, x + (m0 + i) * K, k, K);
}

template <int NR>
__attribute__((target("avx512f,fma"))) void columns_avx512(const float* x, const float* w, float* y, int64_t M,
                                                            int64_t N, int64_t K, int64_t n) {
  int64_t m0 = 0;
  for (; m0 + 6 <= M; m0 += 6) block_avx512<NR, 6>(x, w, y, N, K, n, m0);
  switch (M - m0) {
    case 5: return block_avx512<NR, 5>(x, w, y, N, K, n, m0);
    case 4: return block_avx512<NR, 4>(x, w, y, N, K, n, m0);
    case 3: return block_avx512<NR, 3>(x, w, y, N, K, n, m0);
    case 2: return block_avx512<NR, 2>(x, w, y, N, K, n, m0);
    case 1: return block_avx512<NR, 1>(x, w, y, N, K, n, m0);
    default: return;
  }
}

__attribute__((target("avx512f,fma"))) void rows_avx512(const float* x, const float* w, float* y, int64_t M,
                                                         int64_t N, int64_t K, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (M > 24)  // with fewer rows of x, one weight row at a time streams faster
    for (; n + 4 <= n1; n += 4) columns_avx512<4>(x, w, y, M, N, K, n);
  for (; n < n1; ++n) columns_avx512<1>(x, w, y, M, N, K, n);
}

// The AVX2 path keeps the same 16 lanes in two 8-wide registers (lanes 0-7 and 8-15):
// every lane sees the same fused multiply-adds and lo + hi is the tree's first step, so
// each result is bit-equal to the AVX-512 path's.
__attribute__((target("avx2,fma"))) inline float sum_lanes(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// NR weight rows x MR rows of x per block, in the 16 ymm registers: 2 * NR * MR
// accumulators, 2 * NR weight vectors and 2 for a row of x (1 x 4: 12, 2 x 2: 14).
template <int NR, int MR>
__attribute__((target("avx2,fma"))) void block_avx2(const float* x, const float* w, float* y, int64_t N, int64_t K,
                                                    int64_t n, int64_t m0) {
  __m256 lo[NR][MR], hi[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) lo[r][i] = hi[r][i] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m256 wlo[NR], whi[NR];
    for (int r = 0; r < NR; ++r) {
      wlo[r] = _mm256_loadu_ps(w + (n + r) * K + k);
      whi[r] = _mm256_loadu_ps(w + (n + r) * K + k + 8);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 xlo = _mm256_loadu_ps(x + (m0 + i) * K + k), xhi = _mm256_loadu_ps(x + (m0 + i) * K + k + 8);
      for (int r = 0; r < NR; ++r) {
        lo[r][i] = _mm256_fmadd_ps(wlo[r], xlo, lo[r][i]);
        hi[r][i] = _mm256_fmadd_ps(whi[r], xhi, hi[r][i]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i)
      y[(m0 + i) * N + n + r] = tail_dot(sum_lanes(lo[r][i], hi[r][i]), w + (n + r) * K, x + (m0 + i) * K, k, K);
}

template <int NR, int MR>
__attribute__((target("avx2,fma"))) void columns_avx2(const float* x, const float* w, float* y, int64_t M, int64_t N,
                                                      int64_t K, int64_t n) {
  int64_t m0 = 0;
  for (; m0 + MR <= M; m0 += MR) block_avx2<NR, MR>(x, w, y, N, K, n, m0);
  for (; m0 < M; ++m0) block_avx2<NR, 1>(x, w, y, N, K, n, m0);
}

__attribute__((target("avx2,fma"))) void rows_avx2(const float* x, const float* w, float* y, int64_t M, int64_t N,
                                                   int64_t K, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (M > 24)
    for (; n + 2 <= n1; n += 2) columns_avx2<2, 2>(x, w, y, M, N, K, n);
  for (; n < n1; ++n) columns_avx2<1, 4>(x, w, y, M, N, K, n);
}
#endif

enum class Isa { portable = 0, avx2 = 1, avx512 = 2 };

Isa supported_isa() {
#if defined(__x86_64__)
  static const Isa best = !__builtin_cpu_supports("fma")       ? Isa::portable
                          : __builtin_cpu_supports("avx512f") ? Isa::avx512
                          : __builtin_cpu_supports("avx2")    ? Isa::avx2
                                                              : Isa::portable;
  return best;
#else
  return Isa::portable;
#endif
}

// The best path this CPU has, or a lower one that SPEC_EXT_CPU_ISA asks for (read at every
// call, so that tests and benchmarks can force each path in one process).
Isa chosen_isa() {
  const char* forced = std::getenv("SPEC_EXT_CPU_ISA");
  if (forced == nullptr || *forced == '\0') return supported_isa();
  const std::string name(forced);
  TORCH_CHECK(name == "portable" || name == "avx2" || name == "avx512",
              "SPEC_EXT_CPU_ISA must be portable, avx2 or avx512, got '", name, "'");
  const Isa wanted = name == "portable" ? Isa::portable : name == "avx2" ? Isa::avx2 : Isa::avx512;
  return std::min(wanted, supported_isa());
}

}  // namespace

// "avx512", "avx2" or "portable": the path skinny_linear takes now (spec_ext._C.skinny_linear_isa)
const char* skinny_linear_isa() {
  static const char* names[] = {"portable", "avx2", "avx512"};
  return names[static_cast<int>(chosen_isa())];
}

at::Tensor skinny_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight_in,
                             const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight_in.scalar_type() == at::kFloat,
              "skinny_linear: float32 only");
  TORCH_CHECK(x_in.dim() >= 1 && weight_in.dim() == 2 && x_in.size(-1) == weight_in.size(1),
              "skinny_linear: expected x [..., K] and weight [N, K], got ", x_in.sizes(), " and ", weight_in.sizes());
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == weight_in.size(0)),
              "skinny_linear: bias must be [N] = [", weight_in.size(0), "]");
  auto weight = weight_in.contiguous();
  const int64_t K = weight.size(1), N = weight.size(0);
  auto x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Isa isa = chosen_isa();
  // a chunk of weight rows per task: at least 64 KB of weights, so a thread's wake-up pays
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
#if defined(__x86_64__)
    if (isa == Isa::avx512) return rows_avx512(xp, wp, yp, M, N, K, n0, n1);
    if (isa == Isa::avx2) return rows_avx2(xp, wp, yp, M, N, K, n0, n1);
#endif
    rows_portable(xp, wp, yp, M, N, K, n0, n1);
  });
  if (bias) y.add_(*bias);
  return y.view(sizes);
}

TORCH_LIBRARY_IMPL(spec_ext, CPU, m) { m.impl("skinny_linear", &skinny_linear_cpu); }

}  // namespace spec_ext
