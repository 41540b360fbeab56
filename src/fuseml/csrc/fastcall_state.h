// The replay key of a module's state, read in C++ (fuseml.serving.state_key): for every
// parameter and buffer slot, the tensor's data pointer, version, dtype and sizes, so that a
// CUDA graph captured for a module is never replayed after a weight was written in place
// (a new version) or replaced (a new pointer; a new shape or dtype where a freed block's
// address came back). Python reads the same fields in ~0.5 us a tensor; a DLRM's ~25 slots
// took ~11 us of each replayed eager call on an H200 host.
//
// The plan (fuseml.serving._state_plan) lists the module tree's children as (the parent's
// _modules dict, name, child) and the slots as (a _parameters or _buffers dict, name); the
// key is built only while every child is still in place, else the caller lists them again.
// Included by fastcall.cpp (and, on the CPU, by the tests' checks).
#pragma once

#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace fuseml_fastcall {

// d[name], nullptr where absent (a Python error raised as one)
inline PyObject* dict_item(const py::handle& d, const py::handle& name) {
  PyObject* got = PyDict_GetItemWithError(d.ptr(), name.ptr());
  if (got == nullptr && PyErr_Occurred()) throw py::error_already_set();
  return got;
}

// The key as bytes (each slot: -1 where it holds None, else data pointer, version, dtype,
// dim and sizes: the encoding is unambiguous as no pointer is -1); False where a child
// module was replaced since the plan was listed; None where a slot holds an inference
// tensor (no version counter) or something other than a tensor.
inline py::object state_key(const py::list& children, const py::list& slots) {
  for (const py::handle& item : children) {
    auto child = py::reinterpret_borrow<py::tuple>(item);
    if (dict_item(child[0], child[1]) != child[2].ptr()) return py::bool_(false);
  }
  std::vector<int64_t> key;
  key.reserve(slots.size() * 6);
  for (const py::handle& item : slots) {
    auto slot = py::reinterpret_borrow<py::tuple>(item);
    PyObject* value = dict_item(slot[0], slot[1]);
    if (value == nullptr || value == Py_None) {
      key.push_back(-1);
      continue;
    }
    if (!THPVariable_Check(value)) return py::none();
    const at::Tensor& t = THPVariable_Unpack(value);
    if (t.is_inference()) return py::none();
    key.push_back(t.has_storage() ? reinterpret_cast<int64_t>(t.data_ptr()) : 0);
    key.push_back(static_cast<int64_t>(t._version()));
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(t.dim());
    for (int64_t size : t.sizes()) key.push_back(size);
  }
  return py::bytes(reinterpret_cast<const char*>(key.data()), key.size() * sizeof(int64_t));
}

}  // namespace fuseml_fastcall
