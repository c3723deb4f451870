// What csrc/cpu/skinny_linear.cpp tells the Python module (csrc/ops.cpp) besides the op.
#pragma once
#include <cstdint>
#include <vector>

namespace spec_ext {
// One shape skinny_linear's path choice has seen (see PathChooser): the best time of each path
// in microseconds (-1: not tried), and the path chosen ("": still trying).
struct SkinnyLinearChoice {
  int64_t rows, n, k;
  const char* weight_dtype;
  const char* chosen;
  double avx2_us, avx512_us;
};

const char* skinny_linear_isa();
std::vector<SkinnyLinearChoice> skinny_linear_choices();
}  // namespace spec_ext
