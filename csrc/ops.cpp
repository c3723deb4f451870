// The schema of every spec_ext op, declared once. Backends register implementations
// in csrc/cpu/*.cpp (CPU key) and csrc/cuda/*.cu (CUDA key).
#include <Python.h>
#include <torch/library.h>

#include "cpu/skinny_linear.h"

namespace {
PyObject* skinny_linear_isa(PyObject*, PyObject*) { return PyUnicode_FromString(spec_ext::skinny_linear_isa()); }

PyObject* skinny_linear_choices(PyObject*, PyObject*) {
  const auto rows = spec_ext::skinny_linear_choices();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(rows.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    PyObject* row = Py_BuildValue("{s:L,s:L,s:L,s:s,s:s,s:d,s:d}", "rows", static_cast<long long>(r.rows), "n",
                                  static_cast<long long>(r.n), "k", static_cast<long long>(r.k), "weight_dtype",
                                  r.weight_dtype, "chosen", r.chosen, "avx2_us", r.avx2_us, "avx512_us", r.avx512_us);
    if (row == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), row);
  }
  return list;
}

PyMethodDef methods[] = {
    {"skinny_linear_isa", skinny_linear_isa, METH_NOARGS,
     "The best instruction set skinny_linear's CPU kernel may use now (the CPU's, or the one SPEC_EXT_CPU_ISA "
     "forces): avx512, avx2 or portable."},
    {"skinny_linear_choices", skinny_linear_choices, METH_NOARGS,
     "The shapes skinny_linear has timed on the AVX2 and AVX-512 paths (a CPU with AVX-512, no SPEC_EXT_CPU_ISA): "
     "dicts of rows, n, k, weight_dtype, chosen ('' while still timing) and each path's best time in us (-1: not run)."},
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
  // tree_attention whose every query's output is independent of T (CPU; docs/invariance.md)
  m.def("tree_attention_invariant(Tensor q, Tensor k, Tensor v, Tensor prefix_lens, Tensor? tree_mask, "
        "float scale, int window, float softcap, Tensor? sinks) -> Tensor");
  m.def("compact_kv(Tensor(a!) caches, Tensor src, Tensor dst_start) -> ()");
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("acceptance_head(Tensor hidden, Tensor probs, Tensor[] weights, int column, float eps) -> Tensor");
}
