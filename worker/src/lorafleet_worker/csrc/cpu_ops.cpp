// The Python module of the library lorafleet_cpu_ops: the functions of attention.cpp and layer_ops.cpp
// (declared in cpu_ops.h), each bound as torch's load_inline binds a function (C++ errors raised as Python's).
#include <torch/extension.h>

#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("decode_attention", torch::wrap_pybind_function(decode_attention), "decode_attention");
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
  m.def("add_rms_norm_", torch::wrap_pybind_function(add_rms_norm_), "add_rms_norm_");
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul), "silu_mul");
  m.def("rope_", torch::wrap_pybind_function(rope_), "rope_");
  m.def("greedy_pick", torch::wrap_pybind_function(greedy_pick), "greedy_pick");
}
