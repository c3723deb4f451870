#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

namespace spec_ext {

constexpr int kThreads = 256;

// Sum over the block; every thread gets the result. `scratch` holds kThreads doubles.
__device__ inline double block_sum(double value, double* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) scratch[threadIdx.x] += scratch[threadIdx.x + stride];
    __syncthreads();
  }
  const double total = scratch[0];
  __syncthreads();
  return total;
}

// First index of the maximum of row[0:V]; every thread gets the result.
__device__ inline int64_t block_argmax(const float* row, int64_t V, float* best_val, int64_t* best_idx) {
  float value = -INFINITY;
  int64_t index = V;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    const float x = row[j];
    if (x > value || index == V) { value = x; index = j; }
  }
  best_val[threadIdx.x] = value;
  best_idx[threadIdx.x] = index;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      const float v2 = best_val[threadIdx.x + stride];
      const int64_t i2 = best_idx[threadIdx.x + stride];
      const float v1 = best_val[threadIdx.x];
      const int64_t i1 = best_idx[threadIdx.x];
      if (i2 < V && (i1 == V || v2 > v1 || (v2 == v1 && i2 < i1))) {
        best_val[threadIdx.x] = v2;
        best_idx[threadIdx.x] = i2;
      }
    }
    __syncthreads();
  }
  const int64_t result = best_idx[0] == V ? 0 : best_idx[0];
  __syncthreads();
  return result;
}

// Smallest j with cumsum(mass)[j] > u * sum(mass), or the last positive index when
// rounding leaves none; -1 if the mass is not positive. Each thread owns a contiguous
// chunk so the scan follows index order.
template <typename Mass>
__device__ int64_t block_inverse_cdf(int64_t V, double u, Mass mass, double* partial, int64_t* last_pos,
                                     int64_t* result) {
  const int64_t chunk = (V + blockDim.x - 1) / blockDim.x;
  const int64_t lo = threadIdx.x * chunk, hi = min(V, lo + chunk);
  double local = 0;
  int64_t last = -1;
  for (int64_t j = lo; j < hi; ++j) {
    const double m = mass(j);
    if (m > 0) { local += m; last = j; }
  }
  partial[threadIdx.x] = local;
  last_pos[threadIdx.x] = last;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    int64_t final_last = -1;
    for (int t = 0; t < blockDim.x; ++t) {
      total += partial[t];
      if (last_pos[t] >= 0) final_last = last_pos[t];
    }
    int64_t token = -1;
    if (total > 0) {
      const double threshold = u * total;
      double acc = 0;
      for (int t = 0; t < blockDim.x && token < 0; ++t) {
        if (acc + partial[t] > threshold) {
          const int64_t a = t * chunk, z = min(V, a + chunk);
          for (int64_t j = a; j < z; ++j) {
            const double m = mass(j);
            if (m > 0) {
              acc += m;
              if (acc > threshold) { token = j; break; }
            }
          }
          if (token < 0) token = last_pos[t];
        } else {
          acc += partial[t];
        }
      }
      if (token < 0) token = final_last;
    }
    *result = token;
  }
  __syncthreads();
  const int64_t token = *result;
  __syncthreads();
  return token;
}

}  // namespace spec_ext
