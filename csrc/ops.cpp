// The schema of every spec_ext op, declared once. Backends register implementations
// in csrc/cpu/*.cpp (CPU key) and csrc/cuda/*.cu (CUDA key).
#include <Python.h>
#include <torch/library.h>

namespace spec_ext {
const char* skinny_linear_isa();  // csrc/cpu/skinny_linear.cpp
}

namespace {
PyObject* skinny_linear_isa(PyObject*, PyObject*) { return PyUnicode_FromString(spec_ext::skinny_linear_isa()); }

PyMethodDef methods[] = {
    {"skinny_linear_isa", skinny_linear_isa, METH_NOARGS,
     "The instruction set skinny_linear's CPU kernel uses now: avx512, avx2 or portable."},
    {nullptr, nullptr, 0, nullptr}};
}  // namespace

extern "C" {
// `import spec_ext._C` runs the static registrations below; the module holds one query.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
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
        "float scale, int window, float softcap, Tensor? sinks) -> Tensor");
  m.def("compact_kv(Tensor(a!) caches, Tensor src, Tensor dst_start) -> ()");
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("acceptance_head(Tensor hidden, Tensor probs, Tensor[] weights, int column, float eps) -> Tensor");
}
