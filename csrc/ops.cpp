// The schema of every spec_ext op, declared once. Backends register implementations
// in csrc/cpu/*.cpp (CPU key) and csrc/cuda/*.cu (CUDA key).
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import spec_ext._C` runs the static registrations below; the module itself is empty.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
}

TORCH_LIBRARY(spec_ext, m) {
  m.def("tree_mask(Tensor parents) -> (Tensor depth, Tensor mask)");
  m.def("chain_verify(Tensor target, Tensor draft_tokens, Tensor? draft_probs, Tensor num_draft, "
        "Tensor? uniforms, bool greedy) -> (Tensor tokens, Tensor num_accepted)");
  m.def("tree_verify(Tensor target, Tensor tree_tokens, Tensor parents, Tensor? draft_probs, "
        "Tensor? uniforms, bool greedy, bool without_replacement) "
        "-> (Tensor path, Tensor tokens, Tensor num_accepted)");
  m.def("tree_attention(Tensor q, Tensor k, Tensor v, Tensor prefix_lens, Tensor? tree_mask, "
        "float scale) -> Tensor");
  m.def("compact_kv(Tensor(a!)[] caches, Tensor src, Tensor dst_start) -> ()");
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("acceptance_head(Tensor hidden, Tensor probs, Tensor[] weights, int column, float eps) -> Tensor");
}
