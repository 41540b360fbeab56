// The eager fast path's plan vocabulary (fastcall.cpp): kernel arguments as values, the
// CUDA driver entry points it launches and encodes through, host tensor descriptors
// encoded as Triton's launcher encodes them, and a K-padded GEMM plan's kept weight copies.
// Included by fastcall.cpp alone (one translation unit).
#pragma once

#include <ATen/ATen.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fuseml_fastcall {

constexpr int kMaxDescs = 4;

// How one host tensor descriptor is encoded (as Triton's launcher encodes it for the
// compiled kernel).
struct DescSpec {
  int elem_type = 0;  // CUtensorMapDataType
  int swizzle = 0;    // CUtensorMapSwizzle
  int padding = 0;    // 1: out-of-bounds elements read as NaN, else zero
  uint32_t box[2] = {0, 0};  // rows, columns of one copy
};

// Which tensor of a call a host descriptor reads.
constexpr int kOfX = 0, kOfW = 1, kOfA = 2, kOfOut = 3;

// A plan's host tensor descriptors: how each is encoded, and over which tensor.
struct Descs {
  int n = 0;
  DescSpec spec[kMaxDescs];
  int of[kMaxDescs] = {};
};

// A K-padded GEMM plan's copy of one weight with zero columns up to the plan's K, kept
// while that weight is the same tensor (held weakly: no other tensor can take its place
// while this lives) at the same version and storage.
struct PaddedWeight {
  PaddedWeight(const at::Tensor& w, at::Tensor padded)
      : of(w.getIntrusivePtr()), version(w._version()),
        ptr(reinterpret_cast<int64_t>(w.data_ptr())), copy(std::move(padded)) {}
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> of;
  int64_t version;
  int64_t ptr;
  at::Tensor copy;  // (N, kp), contiguous
};

// K padding of a GEMM plan (rows of x not 16-byte aligned, see ops/linear.py): the call's
// x is padded with zero columns to kp, and W's kept copy read instead of W.
struct Pad {
  int64_t kp = 0;
  std::vector<PaddedWeight> weights;  // of the layers of this signature, most recent last
};
constexpr size_t kMaxPadded = 4;  // weights a plan keeps copies of

// One argument of the kernel, as the Python path passes it.
struct Value {
  int64_t i = 0;   // a pointer or an int
  double f = 0.0;  // a float
};

using LaunchEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using ParamInfo = CUresult (*)(CUfunction, size_t, size_t*, size_t*);
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

template <typename F>
F driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12040, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<F>(fn);
}

inline LaunchEx launch_ex() {
  static LaunchEx fn = driver_entry<LaunchEx>("cuLaunchKernelEx");
  return fn;
}

inline EncodeTiled encode_tiled() {
  static EncodeTiled fn = driver_entry<EncodeTiled>("cuTensorMapEncodeTiled");
  return fn;
}

inline ParamInfo param_info() {
  static ParamInfo fn = driver_entry<ParamInfo>("cuFuncGetParamInfo");
  return fn;
}

// The 2-D tensor t (row-major, unit column stride) as a descriptor of spec's boxes, encoded
// as Triton's launcher encodes it; false where the driver refuses.
inline bool encode(const DescSpec& spec, const at::Tensor& t, CUtensorMap* map) {
  const EncodeTiled fn = encode_tiled();
  if (fn == nullptr || t.dim() != 2 || t.stride(1) != 1) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(t.size(1)),
                              static_cast<cuuint64_t>(t.size(0))};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(t.stride(0) * t.element_size()),
                                 static_cast<cuuint64_t>(t.size(0) * t.stride(0) * t.element_size())};
  const cuuint32_t box[2] = {spec.box[1], spec.box[0]};
  const cuuint32_t unit[2] = {1, 1};
  return fn(map, static_cast<CUtensorMapDataType>(spec.elem_type), 2, t.data_ptr(), dims,
            strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
            static_cast<CUtensorMapSwizzle>(spec.swizzle), CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            spec.padding == 1 ? CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
                              : CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Appends kernel arguments to v in order; n of them so far.
struct Values {
  Value* v;
  int n = 0;
  explicit Values(Value* values) : v(values) {}
  void i(int64_t x) { v[n++].i = x; }  // a pointer or an int
  void ints(std::initializer_list<int64_t> xs) {
    for (const int64_t x : xs) i(x);
  }
  void f(double x) { v[n++].f = x; }
};

// The plain TMA GEMM's parameters after alpha that are constexprs (gemm/tma.py,
// _linear_tma_kernel: HAS_BIAS ... PDL), before its output descriptor.
constexpr int kTmaConstexprs = 12;

// The plain TMA GEMM's arguments up to its last descriptor, each host descriptor expanded
// (descriptor, shape, strides), a constexpr's position holding 0: (x [desc 0], W [desc 1],
// bias or out, residual: out, out, m, n, k, the residual's row stride: 0, out's row stride,
// alpha, the constexprs, o [desc 2: out's tiles where the kernel stores through a
// descriptor, else x's]); their count.
inline int fill_tma(int64_t rows, int64_t cols, int64_t depth,
                    const std::optional<at::Tensor>& bias, const at::Tensor& out, double alpha,
                    const Descs& descs, Value* v) {
  auto ptr = [](const at::Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); };
  const bool has_b = bias.has_value() && bias->defined();
  Values a(v);
  a.ints({0, rows, depth, depth, 1, 1, cols, depth, depth, 1});
  a.ints({has_b ? ptr(*bias) : ptr(out), ptr(out), ptr(out), rows, cols, depth, 0, cols});
  a.f(alpha);
  for (int j = 0; j < kTmaConstexprs; ++j) a.i(0);
  if (descs.of[2] == kOfOut) {
    a.ints({2, rows, cols, cols, 1});
  } else {
    a.ints({2, rows, depth, depth, 1});
  }
  return a.n;
}

// The call's descriptors, encoded as the plan says; tensors: x (2-D), W, A, out, by kOf*.
inline bool encode_descs(const Descs& descs, const at::Tensor* const* tensors,
                         CUtensorMap* maps) {
  for (int d = 0; d < descs.n; ++d) {
    const at::Tensor* t = tensors[descs.of[d]];
    if (t == nullptr || !encode(descs.spec[d], *t, &maps[d])) return false;
  }
  return true;
}

// W's kept zero-padded copy in a K-padded plan, or null where it keeps none for this W.
inline const at::Tensor* padded_copy(const Pad& pad, const at::Tensor& weight) {
  for (const PaddedWeight& p : pad.weights) {
    // (identity first: only a tensor registered, never an inference one, asks _version)
    if (!p.of.expired() && p.of._unsafe_get_target() == weight.unsafeGetTensorImpl() &&
        weight._version() == p.version &&
        reinterpret_cast<int64_t>(weight.data_ptr()) == p.ptr) {
      return &p.copy;
    }
  }
  return nullptr;
}

// Does a box of `box` elements tile a block of `block` (box <= block, dividing it)?
inline bool tiles(int64_t block, uint32_t box) {
  return box > 0 && box <= block && block % box == 0;
}

// The plan's descriptors from Python's specs (per descriptor: element type, swizzle,
// padding, box rows, box columns, as the compiled kernel's launcher encodes it) over the
// tensors `of` names: "" when well formed, else why not.
inline std::string set_descs(Descs& descs, const std::vector<std::vector<int64_t>>& specs,
                             std::initializer_list<int> of) {
  if (specs.size() != of.size() || of.size() > static_cast<size_t>(kMaxDescs)) {
    return "malformed plan";
  }
  descs.n = static_cast<int>(of.size());
  int d = 0;
  for (const int t : of) {
    const std::vector<int64_t>& spec = specs[d];
    if (spec.size() != 5) return "malformed descriptor";
    descs.spec[d].elem_type = static_cast<int>(spec[0]);
    descs.spec[d].swizzle = static_cast<int>(spec[1]);
    descs.spec[d].padding = static_cast<int>(spec[2]);
    descs.spec[d].box[0] = static_cast<uint32_t>(spec[3]);
    descs.spec[d].box[1] = static_cast<uint32_t>(spec[4]);
    descs.of[d++] = t;
  }
  return "";
}

inline std::vector<int64_t> ints_of(const py::object& seq) {
  std::vector<int64_t> r;
  for (auto item : seq) r.push_back(item.cast<int64_t>());
  return r;
}

// Is the host descriptor Python passed (p) the one this file encodes for descriptor d:
// over tensor t, with its shape and strides, and a block the box tiles (the compiler
// narrows a box to its swizzle's width: a 128 x 256 block of bf16 loads as 128 x 64
// boxes)? "" when it is, else why not.
inline std::string same_descriptor(const py::object& p, int d, const at::Tensor& t,
                                   const DescSpec& spec) {
  const py::object base = p.attr("base");
  if (!THPVariable_Check(base.ptr())) return "descriptor " + std::to_string(d) + " has no tensor";
  const std::vector<int64_t> shape = ints_of(p.attr("shape"));
  const std::vector<int64_t> strides = ints_of(p.attr("strides"));
  const std::vector<int64_t> block = ints_of(p.attr("block_shape"));
  if (THPVariable_Unpack(base.ptr()).data_ptr() != t.data_ptr() || t.dim() != 2 ||
      shape != std::vector<int64_t>{t.size(0), t.size(1)} ||
      strides != std::vector<int64_t>{t.stride(0), t.stride(1)} || block.size() != 2 ||
      !tiles(block[0], spec.box[0]) || !tiles(block[1], spec.box[1])) {
    return "descriptor " + std::to_string(d) + " differs";
  }
  return "";
}

}  // namespace fuseml_fastcall
