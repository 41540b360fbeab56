// The eager fast path of fuseml's elementwise ops, the on-chip softmax, the plain 16-bit
// linear layer (its three main loops, K padded or not) and the one-adapter LoRA layer
// (ops/_fastcall.py): a repeat call launches, from C++, the kernel the Python path compiled
// for the same call signature. Validation, plan lookup and Triton's launcher made an eager
// call ~3x torch's host time (gelu 64 x 512: 26 us against 8.8, H200 host); here a call is
// one lookup of its signature, an allocation and cuLaunchKernelEx. backend='cuda' calls of
// the same ops go from here to their CUDA C++ twin's op (call_twin).
//
// The Python path decides everything (kernel, specialization, grid, warps, PDL) and, after
// its launch, registers the plan (`register_plan`, `register_gemm_plan`,
// `register_joint_plan`). This file recomputes the kernel's arguments from the same tensors
// and keeps the plan only if each equals the one Python passed and the compiled function's
// parameter list (cuFuncGetParamInfo) has exactly the sizes it writes. A call it cannot vouch
// for (tensor subclass, dispatch mode, autograd recording, non-contiguous input, unknown
// signature) returns None and the caller takes the Python path.
//
// The key holds all the plan depends on: op, activation / log flag, device, dtype, rows,
// columns (the GEMM's depth), which optional inputs are given, the settings the plan reads
// (read per call, as Python reads them), the LoRA rank. Plans come only from launches with
// every pointer 16-byte aligned (Triton specializes on it); a GEMM plan only from the tuned
// (or heuristic) tile, never from the tuner's candidates.
//
// TMA launches (the LoRA joint mode: the shrink on the SMs the tiles leave free; the plain
// layer's TMA loop) keep each host descriptor's encoding (element type, swizzle, box, as
// Triton's launcher encodes them); a call encodes its CUtensorMaps (cuTensorMapEncodeTiled).
// The joint plan also keeps xs's K split and the registering stream's slice of zeroed
// flags, so only a call on that stream takes it. Rows of x that are not 16-byte aligned run
// at a zero-padded K (ops/linear.py): the plan keeps W's padded copy (weakly referencing W,
// up to kMaxPadded weights), taken only for the same W, version and storage and never while
// capturing (a replay after an in-place write of W must see it); the call pads x and launches.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "fastcall_plan.h"
#include "fastcall_replay.h"
#include "fastcall_state.h"

namespace {

using namespace fuseml_fastcall;  // (the plan vocabulary, fastcall_plan.h)

// Ops, as ops/_fastcall.py names them.
constexpr int64_t kElementwise = 0;  // _elementwise._bias_act_kernel: act(x + bias + alpha y)
constexpr int64_t kSoftmaxRows = 1;  // _softmax/rows.py: the on-chip softmax of each row
constexpr int64_t kGemm = 2;  // gemm/{pointer,stream,tma}.py: act(x @ W^T + bias), 16-bit
// gemm/pointer.py _lora_kernel, in-loop mode, one adapter A (r, K), B (N, r), scaling s:
// act(x @ W^T + bias + s (x @ A^T) @ B^T), 16-bit; eager calls only (not while capturing)
constexpr int64_t kLora = 3;

// Kinds of kernel parameters: a pointer, ints, a float, a host tensor descriptor (the
// value is the index of the call's CUtensorMap).
constexpr int64_t kPtr = 0, kI32 = 1, kI64 = 2, kF32 = 3, kDesc = 4;

constexpr int kMaxArgs = 48;

using Key = std::array<int64_t, 10>;

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

// The joint LoRA launch's extras (kLora plans of that launch only; its descriptors: x, W,
// A, and x again with the shrink's box).
struct Joint {
  bool on = false;
  int64_t split = 1;         // K split of the shrink: xs as float32 parts, else x's dtype
  int64_t sync = 0;          // the stream's slice of zeroed flags
  cudaStream_t stream = nullptr;
  int64_t n_shrink = 0;      // the shrink's programs (the grid's first)
};

struct Plan {
  CUfunction function;
  unsigned grid[3];
  unsigned threads;
  unsigned shared;
  bool pdl;
  int n_params = 0;               // kernel parameters from the op's arguments
  int n_scratch = 0;              // trailing scratch pointers (passed as null)
  int pos[kMaxArgs];              // argument position of each parameter
  int kind[kMaxArgs];             // its kind
  Joint joint;
  Descs descs;                    // host descriptors (the TMA GEMM and the joint launch)
  std::shared_ptr<const Pad> pad;  // K padding (GEMM plans), replaced, never changed
};

std::mutex table_lock;
std::unordered_map<Key, Plan, KeyHash> table;
int64_t hits = 0, misses = 0;

int64_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default: return -1;
  }
}

// The settings a plan depends on, as part of the key: a change of one is a new signature.
// FUSEML_PDL for every op; for the GEMM also FUSEML_AUTOTUNE and FUSEML_CACHE (tuned or
// heuristic tiles, and which tuning table).
int64_t settings_hash(bool gemm) {
  uint64_t h = 1469598103934665603ull;
  const char* names[] = {"FUSEML_PDL", "FUSEML_AUTOTUNE", "FUSEML_CACHE"};
  for (int i = 0; i < (gemm ? 3 : 1); ++i) {
    const char* v = std::getenv(names[i]);
    for (const char* c = v ? v : ""; *c; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;  // (separator)
  }
  return static_cast<int64_t>(h);
}

// Tensors the fast path may read as raw memory: a plain dense CUDA tensor on the current
// device, not under autograd recording, no Python or functorch dispatch keys.
bool plain(const at::Tensor& t, int64_t device, bool grad) {
  if (!t.defined() || !t.is_cuda() || t.device().index() != device) return false;
  if (grad && t.requires_grad()) return false;
  constexpr c10::DispatchKeySet kWrapped({
      c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
      c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
      c10::DispatchKey::FuncTorchVmapMode, c10::DispatchKey::Batched,
  });
  return !t.key_set().has_any(kWrapped) && t.is_contiguous() && !t.is_conj() && !t.is_neg();
}

// The LoRA layer's adapter (kLora only; null for the other ops).
struct Adapter {
  const at::Tensor* a = nullptr;  // (r, K)
  const at::Tensor* b = nullptr;  // (N, r)
};

// The call's key and the kernel arguments it implies (given ``out``), or false when the
// call is not one this file handles (dim: the softmax's).
bool describe(int64_t op, int64_t code, const at::Tensor& x, const std::optional<at::Tensor>& y,
              const std::optional<at::Tensor>& bias, int64_t dim, Key& key, int64_t& rows,
              int64_t& cols, int64_t& depth, const Adapter& lora = Adapter()) {
  const int64_t device = c10::cuda::current_device();
  const bool grad = at::GradMode::is_enabled();
  if (!plain(x, device, grad) || x.numel() == 0 || x.dim() == 0) return false;
  const int64_t dt = dtype_code(x.scalar_type());
  if (dt < 0) return false;
  if (c10::impl::TorchDispatchModeTLS::any_modes_set()) return false;
  const bool has_y = y.has_value() && y->defined();
  const bool has_b = bias.has_value() && bias->defined();
  depth = 0;
  if (op == kGemm || op == kLora) {  // y is the weight (N, K)
    if (dt == 0 || !has_y || !plain(*y, device, grad) || y->scalar_type() != x.scalar_type() ||
        y->dim() != 2 || y->size(1) != x.size(-1) || y->size(0) == 0) {
      return false;
    }
    depth = x.size(-1);
    cols = y->size(0);
    rows = x.numel() / depth;
    if (has_b && (!plain(*bias, device, grad) || bias->scalar_type() != x.scalar_type() ||
                  bias->dim() != 1 || bias->size(0) != cols)) {
      return false;
    }
    int64_t rank = 0;
    if (op == kLora) {
      const at::Tensor* a = lora.a;
      const at::Tensor* b = lora.b;
      if (a == nullptr || b == nullptr || !plain(*a, device, grad) || !plain(*b, device, grad) ||
          a->scalar_type() != x.scalar_type() || b->scalar_type() != x.scalar_type() ||
          a->dim() != 2 || b->dim() != 2 || a->size(0) < 1 || a->size(1) != depth ||
          b->size(0) != cols || b->size(1) != a->size(0)) {
        return false;
      }
      rank = a->size(0);
    }
    key = {op, code, device, dt, rows, cols, depth, has_b, settings_hash(true), rank};
    return true;
  }
  if (has_y && (!plain(*y, device, grad) || y->scalar_type() != x.scalar_type() ||
                y->sizes() != x.sizes())) {
    return false;
  }
  cols = x.size(-1);
  rows = x.numel() / cols;
  if (op == kElementwise) {
    if (has_b) {
      if (!plain(*bias, device, grad) || bias->scalar_type() != x.scalar_type() ||
          bias->dim() != 1 || bias->size(0) != cols) {
        return false;
      }
    } else {  // one flat pass over the storage
      rows = 1;
      cols = x.numel();
    }
  } else if (op == kSoftmaxRows) {  // over the last dim
    if (has_y || has_b || (dim != -1 && dim != x.dim() - 1)) return false;
  } else {
    return false;
  }
  key = {op, code, device, dt, rows, cols, has_y, has_b, settings_hash(false), 0};
  return true;
}

// The op's arguments in the kernel's order, up to its first constexpr; their count.
int fill(int64_t op, int64_t rows, int64_t cols, int64_t depth, const at::Tensor& x,
         const std::optional<at::Tensor>& y, const std::optional<at::Tensor>& bias,
         const at::Tensor& out, double alpha, Value* v, const Adapter& lora = Adapter()) {
  auto ptr = [](const at::Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); };
  const bool has_y = y.has_value() && y->defined();
  const bool has_b = bias.has_value() && bias->defined();
  if (op == kGemm || op == kLora) {
    // (x, weight, bias or x, residual: x, out, [LoRA: A, B, xa: x, ids: x, scales: x,]
    //  m, n, k, x's strides, weight's strides, the residual's row stride: 0, out's row
    //  stride, [LoRA: A's row stride, B's row stride (r), the residual's scale: 1,] alpha
    //  (the LoRA layer's: its scaling))
    Values a(v);
    a.ints({ptr(x), ptr(*y), has_b ? ptr(*bias) : ptr(x), ptr(x), ptr(out)});
    if (op == kLora) a.ints({ptr(*lora.a), ptr(*lora.b), ptr(x), ptr(x), ptr(x)});
    a.ints({rows, cols, depth, depth, 1, depth, 1, 0, cols});
    if (op == kLora) {
      a.ints({depth, lora.a->size(0)});
      a.f(1.0);
    }
    a.f(alpha);
    return a.n;
  }
  if (op == kElementwise) {
    // (x, y or x, bias or x, out, n_rows, n_cols, stride_x, stride_y, stride_out, alpha)
    v[0].i = ptr(x);
    v[1].i = has_y ? ptr(*y) : ptr(x);
    v[2].i = has_b ? ptr(*bias) : ptr(x);
    v[3].i = ptr(out);
    v[4].i = rows;
    v[5].i = cols;
    const int64_t stride = has_b ? cols : 0;  // the flat pass takes no strides
    v[6].i = stride;
    v[7].i = has_y ? stride : 0;
    v[8].i = stride;
    v[9].f = alpha;
    return 10;
  }
  // (x, out, n_rows, n_cols, stride_x, stride_out)
  v[0].i = ptr(x);
  v[1].i = ptr(out);
  v[2].i = rows;
  v[3].i = cols;
  v[4].i = cols;
  v[5].i = cols;
  return 6;
}

// The joint LoRA launch's arguments up to its first constexpr, each host descriptor
// expanded as Triton's launcher passes it (descriptor, shape (int32), strides (int64)):
// (x [desc 0], W [desc 1], A [desc 2], x [desc 3: the shrink's box], bias or out,
//  residual: out, out, B, xs, ids: out, scales: out, the flags, m, n, k, the residual's row
//  stride: 0, out's row stride, B's row stride (r), the residual's scale: 1, the scaling,
//  the shrink's programs); their count. The descriptors' values are their indices.
int fill_joint(int64_t rows, int64_t cols, int64_t depth,
               const std::optional<at::Tensor>& bias, const at::Tensor& out,
               const at::Tensor& xs, double alpha, const Adapter& lora, const Joint& joint,
               Value* v) {
  auto ptr = [](const at::Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); };
  const int64_t rank = lora.a->size(0);
  const int64_t desc_rows[kMaxDescs] = {rows, cols, rank, rows};
  Values a(v);
  for (int d = 0; d < kMaxDescs; ++d) {
    a.ints({d, desc_rows[d], depth, depth, 1});  // the descriptor's index, shape, strides
  }
  const bool has_b = bias.has_value() && bias->defined();
  a.ints({has_b ? ptr(*bias) : ptr(out), ptr(out), ptr(out), ptr(*lora.b), ptr(xs), ptr(out),
          ptr(out), joint.sync, rows, cols, depth, 0, cols, rank});
  a.f(1.0);
  a.f(alpha);
  a.i(joint.n_shrink);
  return a.n;
}

bool gemm_op(int64_t op) { return op == kGemm || op == kLora; }

bool aligned16(const Value* v, const Plan& plan) {
  int64_t bits = 0;
  for (int j = 0; j < plan.n_params; ++j) {
    if (plan.kind[j] == kPtr) bits |= v[plan.pos[j]].i;
  }
  return bits % 16 == 0;
}

bool same_launch(const Plan& a, const Plan& b) {
  if (a.function != b.function || a.threads != b.threads || a.shared != b.shared ||
      a.pdl != b.pdl || a.n_params != b.n_params) {
    return false;
  }
  for (int d = 0; d < 3; ++d) {
    if (a.grid[d] != b.grid[d]) return false;
  }
  for (int j = 0; j < a.n_params; ++j) {
    if (a.pos[j] != b.pos[j] || a.kind[j] != b.kind[j]) return false;
  }
  return true;
}

void launch(const Plan& plan, const Value* v, cudaStream_t stream,
            const CUtensorMap* maps = nullptr) {
  alignas(8) unsigned char storage[kMaxArgs + 2][8];
  void* params[kMaxArgs + 2];
  for (int j = 0; j < plan.n_params; ++j) {
    const Value& a = v[plan.pos[j]];
    if (plan.kind[j] == kDesc) {
      params[j] = const_cast<CUtensorMap*>(&maps[a.i]);
      continue;
    }
    switch (plan.kind[j]) {
      case kI32: { const int32_t i = static_cast<int32_t>(a.i); std::memcpy(storage[j], &i, 4); break; }
      case kF32: { const float f = static_cast<float>(a.f); std::memcpy(storage[j], &f, 4); break; }
      default: std::memcpy(storage[j], &a.i, 8); break;  // pointers, i64
    }
    params[j] = storage[j];
  }
  for (int j = plan.n_params; j < plan.n_params + plan.n_scratch; ++j) {
    std::memset(storage[j], 0, 8);  // no scratch memory (registered only without)
    params[j] = storage[j];
  }
  CUlaunchAttribute attr[1];
  CUlaunchConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.gridDimX = plan.grid[0];
  cfg.gridDimY = plan.grid[1];
  cfg.gridDimZ = plan.grid[2];
  cfg.blockDimX = plan.threads;
  cfg.blockDimY = 1;
  cfg.blockDimZ = 1;
  cfg.sharedMemBytes = plan.shared;
  cfg.hStream = reinterpret_cast<CUstream>(stream);
  if (plan.pdl) {
    attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr[0].value.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  const CUresult r = launch_ex()(&cfg, plan.function, params, nullptr);
  TORCH_CHECK(r == CUDA_SUCCESS, "fuseml fast launch failed: CUDA driver error ", static_cast<int>(r));
}

// Is the stream capturing into a CUDA graph? (A captured LoRA call takes the mode tuned
// for graphs, chosen in Python.) True where the driver cannot say.
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &status) != cudaSuccess ||
         status != cudaStreamCaptureStatusNone;
}

// The fast call: the output, or None when the Python path must take the call.
py::object call_with(int64_t op, int64_t code, const at::Tensor& x,
                     const std::optional<at::Tensor>& y, const std::optional<at::Tensor>& bias,
                     double alpha, int64_t dim, const Adapter& lora) {
  Key key;
  int64_t rows = 0, cols = 0, depth = 0;
  if (launch_ex() == nullptr ||
      !describe(op, code, x, y, bias, dim, key, rows, cols, depth, lora)) {
    return py::none();
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  if (op == kLora && capturing(stream)) return py::none();
  Plan plan;
  {
    std::lock_guard<std::mutex> guard(table_lock);
    auto it = table.find(key);
    if (it == table.end()) {
      ++misses;
      return py::none();
    }
    plan = it->second;
    if (plan.joint.on && stream != plan.joint.stream) {  // (the flags are that stream's)
      ++misses;
      return py::none();
    }
  }
  auto missed = []() {
    std::lock_guard<std::mutex> guard(table_lock);
    ++misses;
    return py::none();  // (allocations made so far are simply dropped)
  };
  // A K-padded GEMM plan: x padded per call, W's kept copy read in its place. Never while
  // capturing: a graph replayed after an in-place write of W must see it, so the Python
  // path pads both in the graph there.
  std::optional<at::Tensor> w_used = y;
  at::Tensor x2 = gemm_op(op) ? x.view({rows, depth}) : x;
  int64_t k_used = depth;
  if (plan.pad) {
    const at::Tensor* copy = capturing(stream) ? nullptr : padded_copy(*plan.pad, *y);
    if (copy == nullptr) return missed();
    k_used = plan.pad->kp;
    x2 = at::constant_pad_nd(x2, {0, k_used - depth}, 0);
    w_used = *copy;
  }
  at::Tensor out = gemm_op(op) ? at::empty({rows, cols}, x.options()) : at::empty_like(x);
  Value v[kMaxArgs];
  alignas(64) CUtensorMap maps[kMaxDescs];
  if (plan.joint.on) {
    const int64_t rank = lora.a->size(0);
    const at::Tensor xs = plan.joint.split > 1
        ? at::empty({plan.joint.split, rows, rank}, x.options().dtype(at::kFloat))
        : at::empty({rows, rank}, x.options());
    fill_joint(rows, cols, depth, bias, out, xs, alpha, lora, plan.joint, v);
    const at::Tensor* tensors[] = {&x2, &*y, lora.a, &out};
    if (!aligned16(v, plan) || !encode_descs(plan.descs, tensors, maps)) return missed();
    launch(plan, v, stream, maps);  // (xs lives until the launch is queued: stream order)
  } else if (plan.descs.n > 0) {  // the plain TMA GEMM
    fill_tma(rows, cols, k_used, bias, out, alpha, plan.descs, v);
    const at::Tensor* tensors[] = {&x2, &*w_used, nullptr, &out};
    if (!aligned16(v, plan) || !encode_descs(plan.descs, tensors, maps)) return missed();
    launch(plan, v, stream, maps);
  } else {
    fill(op, rows, cols, k_used, x2, w_used, bias, out, alpha, v, lora);
    if (!aligned16(v, plan)) return missed();
    launch(plan, v, stream);
  }
  {
    std::lock_guard<std::mutex> guard(table_lock);
    ++hits;
  }
  if (gemm_op(op) && x.dim() != 2) {  // (..., N), as the Python path returns it
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = cols;
    return py::cast(out.view(shape));
  }
  return py::cast(out);
}

py::object call(int64_t op, int64_t code, const at::Tensor& x, const std::optional<at::Tensor>& y,
                const std::optional<at::Tensor>& bias, double alpha, int64_t dim) {
  if (op == kLora) return py::none();  // (call_lora)
  return call_with(op, code, x, y, bias, alpha, dim, Adapter());
}

// The CUDA C++ twins' fast call (backend='cuda'; kElementwise, kSoftmaxRows): the twin's
// own registered op called here through the dispatcher, as the Python path calls it, on the
// same (rows, cols) view, so the result is the same; its checks, Python's op call and the
// views' construction stay out of the host time. The op is looked up on first use: None
// until the twin's extension is loaded (the Python path builds it).
using BiasActTwin = void(const at::Tensor&, const std::optional<at::Tensor>&,
                         const std::optional<at::Tensor>&, double, int64_t, at::Tensor&);
using SoftmaxTwin = void(const at::Tensor&, bool, at::Tensor&);

template <typename Sig>
std::optional<c10::TypedOperatorHandle<Sig>> twin_op(const char* name) {
  static std::mutex lock;
  static std::optional<c10::TypedOperatorHandle<Sig>> found;
  std::lock_guard<std::mutex> guard(lock);
  if (!found) {
    auto handle = c10::Dispatcher::singleton().findSchema({name, ""});
    if (handle && handle->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) {
      found = handle->template typed<Sig>();
    }
  }
  return found;
}

py::object call_twin(int64_t op, int64_t code, const at::Tensor& x,
                     const std::optional<at::Tensor>& y, const std::optional<at::Tensor>& bias,
                     double alpha, int64_t dim) {
  const bool known = (op == kElementwise && code >= 0 && code <= 7) ||
                     (op == kSoftmaxRows && (code == 0 || code == 1));
  Key key;
  int64_t rows = 0, cols = 0, depth = 0;
  if (!known || !describe(op, code, x, y, bias, dim, key, rows, cols, depth)) {
    return py::none();
  }
  at::Tensor out = at::empty_like(x);
  at::Tensor out2 = out.view({rows, cols});
  if (op == kElementwise) {
    const auto twin = twin_op<BiasActTwin>("fuseml::bias_act_cuda_out");
    if (!twin) return py::none();
    std::optional<at::Tensor> y2;
    if (y.has_value() && y->defined()) y2 = y->view({rows, cols});
    twin->call(x.view({rows, cols}), y2, bias, alpha, code, out2);
  } else {
    const auto twin = twin_op<SoftmaxTwin>("fuseml::softmax_cuda_out");
    if (!twin) return py::none();
    twin->call(x.view({rows, cols}), code == 1, out2);
  }
  std::lock_guard<std::mutex> guard(table_lock);
  ++hits;
  return py::cast(out);
}

// The LoRA layer's fast call (kLora): the output, or None.
py::object call_lora(int64_t code, const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, const at::Tensor& lora_a,
                     const at::Tensor& lora_b, double scaling) {
  Adapter lora;
  lora.a = &lora_a;
  lora.b = &lora_b;
  return call_with(kLora, code, x, weight, bias, scaling, -1, lora);
}

// Does the value Python passed for a parameter (a pointer, an int or a float) equal the
// one this file computes at position pos? "" when it does, else why not.
std::string same_value(int64_t kind, int pos, const Value& v, const py::object& p) {
  if (kind == kF32) {
    if (static_cast<float>(p.cast<double>()) != static_cast<float>(v.f)) {
      return "argument " + std::to_string(pos) + " differs";
    }
  } else if (kind == kPtr) {
    const int64_t ptr = THPVariable_Check(p.ptr())
        ? reinterpret_cast<int64_t>(THPVariable_Unpack(p.ptr()).data_ptr())
        : p.cast<int64_t>();
    if (ptr != v.i) return "pointer argument " + std::to_string(pos) + " differs";
  } else if (kind == kI32 || kind == kI64) {
    if (p.cast<int64_t>() != v.i) return "argument " + std::to_string(pos) + " differs";
  } else {
    return "unknown parameter kind";
  }
  return "";
}

// The compiled function's parameters: the plan's with the sizes it writes, then at most
// two 8-byte scratch pointers (Triton's global / profile scratch), nothing more; sets
// plan.n_scratch. "" when they are, else why not.
std::string check_param_sizes(Plan& plan, ParamInfo info) {
  const int n = plan.n_params;
  for (int j = 0; j < n + 3; ++j) {
    size_t offset = 0, size = 0;
    const bool exists = info(plan.function, j, &offset, &size) == CUDA_SUCCESS;
    if (j < n) {
      const size_t want = plan.kind[j] == kDesc ? sizeof(CUtensorMap)
                          : (plan.kind[j] == kI32 || plan.kind[j] == kF32) ? 4 : 8;
      if (!exists || size != want) return "parameter " + std::to_string(j) + " has another size";
    } else if (!exists) {
      plan.n_scratch = j - n;
      return "";
    } else if (size != 8 || j == n + 2) {
      return "the kernel takes parameters this file does not pass";
    }
  }
  return "";
}

// The launch a plan repeats (function, grid, block, shared memory, parameter count), as
// the Python path made it: "" when well formed, else why not.
std::string start_plan(Plan& plan, int64_t function, const std::vector<int64_t>& grid,
                       int64_t num_warps, int64_t shared, size_t n_positions, size_t n_kinds,
                       size_t n_passed) {
  if (n_positions > static_cast<size_t>(kMaxArgs) || n_kinds != n_positions ||
      n_passed != n_positions || grid.size() != 3) {
    return "malformed plan";
  }
  plan.function = reinterpret_cast<CUfunction>(function);
  for (int d = 0; d < 3; ++d) plan.grid[d] = static_cast<unsigned>(grid[d]);
  plan.threads = static_cast<unsigned>(32 * num_warps);
  plan.shared = static_cast<unsigned>(shared);
  plan.n_params = static_cast<int>(n_positions);
  return "";
}

// Parameter j's argument position and kind: "" when this file computes that position.
std::string place(Plan& plan, int j, const std::vector<int64_t>& positions,
                  const std::vector<int64_t>& kinds, int n_values) {
  const int pos = static_cast<int>(positions[j]);
  if (pos < 0 || pos >= n_values) return "a parameter this file does not compute";
  plan.pos[j] = pos;
  plan.kind[j] = static_cast<int>(kinds[j]);
  return "";
}

// Keep a checked plan for its key once the compiled function's parameters are the sizes it
// writes: "" when kept, else why not.
std::string keep(Plan& plan, const Key& key) {
  const std::string sizes = check_param_sizes(plan, param_info());
  if (!sizes.empty()) return sizes;
  std::lock_guard<std::mutex> guard(table_lock);
  table[key] = plan;
  return "";
}

// Keep the plan of a launch the Python path just made: "" when kept, else why not.
std::string register_plan(int64_t op, int64_t code, const at::Tensor& x,
                          const std::optional<at::Tensor>& y, const std::optional<at::Tensor>& bias,
                          const at::Tensor& out, double alpha, int64_t function,
                          std::vector<int64_t> grid, int64_t num_warps, int64_t shared, bool pdl,
                          std::vector<int64_t> positions, std::vector<int64_t> kinds,
                          std::vector<py::object> passed, const std::optional<at::Tensor>& lora_a,
                          const std::optional<at::Tensor>& lora_b) {
  if (op == kGemm) return "GEMM plans register through register_gemm_plan";
  if (launch_ex() == nullptr) return "cuLaunchKernelEx is not available";
  if (param_info() == nullptr) return "cuFuncGetParamInfo is not available";
  Adapter lora;
  if (op == kLora) {
    if (!lora_a.has_value() || !lora_b.has_value()) return "a LoRA plan without its adapter";
    lora.a = &*lora_a;
    lora.b = &*lora_b;
  }
  Key key;
  int64_t rows = 0, cols = 0, depth = 0;
  if (!describe(op, code, x, y, bias, -1, key, rows, cols, depth, lora)) {
    return "not a call the fast path takes";
  }
  const bool laid_out = op == kGemm || op == kLora
      ? out.dim() == 2 && out.size(0) == rows && out.size(1) == cols
      : out.sizes() == x.sizes();
  if (!out.is_contiguous() || !laid_out || out.scalar_type() != x.scalar_type()) {
    return "the output is not laid out as the fast call allocates it";
  }
  Plan plan;
  const std::string formed = start_plan(plan, function, grid, num_warps, shared,
                                        positions.size(), kinds.size(), passed.size());
  if (!formed.empty()) return formed;
  plan.pdl = pdl;
  Value v[kMaxArgs];
  const int n_values = fill(op, rows, cols, depth, x, y, bias, out, alpha, v, lora);
  for (int j = 0; j < plan.n_params; ++j) {
    std::string why = place(plan, j, positions, kinds, n_values);
    if (why.empty()) why = same_value(plan.kind[j], plan.pos[j], v[plan.pos[j]], passed[j]);
    if (!why.empty()) return why;
  }
  if (!aligned16(v, plan)) return "unaligned pointers";
  {  // kept already (a call the fast path does not take, e.g. in place, offers it each time)
    std::lock_guard<std::mutex> guard(table_lock);
    auto it = table.find(key);
    if (it != table.end() && same_launch(it->second, plan)) return "";
  }
  return keep(plan, key);
}

// Every parameter of the plan placed, and the value Python passed for it (a descriptor: one
// over the tensor this file would pass; tensors by kOf*) equal to this file's: "" when so.
std::string check_passed(Plan& plan, const std::vector<int64_t>& positions,
                         const std::vector<int64_t>& kinds, const std::vector<py::object>& passed,
                         const Value* v, int n_values, const at::Tensor* const* tensors) {
  for (int j = 0; j < plan.n_params; ++j) {
    std::string why = place(plan, j, positions, kinds, n_values);
    if (!why.empty()) return why;
    const int pos = plan.pos[j];
    if (plan.kind[j] == kDesc) {
      const int d = static_cast<int>(v[pos].i);
      if (d < 0 || d >= plan.descs.n || tensors[plan.descs.of[d]] == nullptr) {
        return "a descriptor this file does not encode";
      }
      why = same_descriptor(passed[j], d, *tensors[plan.descs.of[d]], plan.descs.spec[d]);
    } else {
      why = same_value(plan.kind[j], pos, v[pos], passed[j]);
    }
    if (!why.empty()) return why;
  }
  return "";
}

// Keep the plan of a plain GEMM launch the Python path just made (pointer, streaming or
// TMA kernel): "" when kept, else why not. descs: the TMA kernel's three host descriptors
// (x, W, then out where out_desc, else x), empty for the others. x_used and w_used: x and
// W zero-padded to a K of 16-byte rows where the launch read those (W's copy kept per
// tensor and version on the Python side; kept here likewise, see Pad).
std::string register_gemm_plan(int64_t code, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const at::Tensor& out,
                               double alpha, int64_t function, std::vector<int64_t> grid,
                               int64_t num_warps, int64_t shared, bool pdl,
                               std::vector<int64_t> positions, std::vector<int64_t> kinds,
                               std::vector<py::object> passed,
                               std::vector<std::vector<int64_t>> descs, bool out_desc,
                               const std::optional<at::Tensor>& x_used,
                               const std::optional<at::Tensor>& w_used) {
  if (launch_ex() == nullptr) return "cuLaunchKernelEx is not available";
  if (param_info() == nullptr) return "cuFuncGetParamInfo is not available";
  if (!descs.empty() && encode_tiled() == nullptr) return "cuTensorMapEncodeTiled is not available";
  Key key;
  int64_t rows = 0, cols = 0, depth = 0;
  if (!describe(kGemm, code, x, weight, bias, -1, key, rows, cols, depth)) {
    return "not a call the fast path takes";
  }
  if (!out.is_contiguous() || out.dim() != 2 || out.size(0) != rows || out.size(1) != cols ||
      out.scalar_type() != x.scalar_type()) {
    return "the output is not laid out as the fast call allocates it";
  }
  const bool padded = x_used.has_value() || w_used.has_value();
  int64_t kp = depth;
  at::Tensor x2 = x.view({rows, depth});
  at::Tensor w2 = weight;
  if (padded) {
    if (!x_used.has_value() || !w_used.has_value()) return "a padded plan without both copies";
    kp = x_used->size(-1);
    auto laid = [&](const at::Tensor& t, int64_t n) {
      return t.dim() == 2 && t.size(0) == n && t.size(1) == kp && t.is_contiguous() &&
             t.scalar_type() == x.scalar_type() && t.device() == x.device();
    };
    if (kp <= depth || !laid(*x_used, rows) || !laid(*w_used, cols)) {
      return "the padded copies are not laid out as the fast call makes them";
    }
    if (weight.is_inference()) return "an inference weight (no version to key its copy on)";
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
    if (capturing(stream)) return "a padded launch inside a capture";
    x2 = *x_used;
    w2 = *w_used;
  }
  Plan plan;
  std::string why = start_plan(plan, function, grid, num_warps, shared, positions.size(),
                               kinds.size(), passed.size());
  if (!why.empty()) return why;
  plan.pdl = pdl;
  Value v[kMaxArgs];
  int n_values = 0;
  if (descs.empty()) {
    n_values = fill(kGemm, rows, cols, kp, x2, w2, bias, out, alpha, v);
  } else {
    why = set_descs(plan.descs, descs, {kOfX, kOfW, out_desc ? kOfOut : kOfX});
    if (!why.empty()) return why;
    n_values = fill_tma(rows, cols, kp, bias, out, alpha, plan.descs, v);
  }
  const at::Tensor* tensors[] = {&x2, &w2, nullptr, &out};
  why = check_passed(plan, positions, kinds, passed, v, n_values, tensors);
  if (!why.empty()) return why;
  if (!aligned16(v, plan)) return "unaligned pointers";
  if (plan.descs.n > 0) {
    alignas(64) CUtensorMap maps[kMaxDescs];
    if (!encode_descs(plan.descs, tensors, maps)) return "a descriptor does not encode";
  }
  if (padded) {
    // This weight's copy, beside those the signature's plan keeps for other weights of
    // the same shapes (another layer): a new Pad, the table's never changed in place
    auto pad = std::make_shared<Pad>();
    pad->kp = kp;
    {
      std::lock_guard<std::mutex> guard(table_lock);
      auto it = table.find(key);
      if (it != table.end() && it->second.pad && it->second.pad->kp == kp &&
          same_launch(it->second, plan)) {
        for (const PaddedWeight& p : it->second.pad->weights) {
          if (!p.of.expired() && p.of._unsafe_get_target() != weight.unsafeGetTensorImpl()) {
            pad->weights.push_back(p);
          }
        }
      }
    }
    while (pad->weights.size() >= kMaxPadded) pad->weights.erase(pad->weights.begin());
    pad->weights.emplace_back(weight, w2);
    plan.pad = std::move(pad);
  }
  return keep(plan, key);
}

// Keep the plan of a joint LoRA launch the Python path just made (one adapter, eager, on
// the current stream): "" when kept, else why not. descs: per descriptor (element type,
// swizzle, padding, box rows, box columns) as the compiled kernel's launcher encodes it;
// xs and sync: the buffers that launch used; split: xs's float32 parts (1: x's dtype).
std::string register_joint_plan(int64_t code, const at::Tensor& x, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, const at::Tensor& out,
                                double alpha, const at::Tensor& lora_a, const at::Tensor& lora_b,
                                const at::Tensor& xs, const at::Tensor& sync, int64_t split,
                                int64_t n_shrink, int64_t function, std::vector<int64_t> grid,
                                int64_t num_warps, int64_t shared,
                                std::vector<int64_t> positions, std::vector<int64_t> kinds,
                                std::vector<py::object> passed,
                                std::vector<std::vector<int64_t>> descs) {
  if (launch_ex() == nullptr) return "cuLaunchKernelEx is not available";
  if (encode_tiled() == nullptr) return "cuTensorMapEncodeTiled is not available";
  if (param_info() == nullptr) return "cuFuncGetParamInfo is not available";
  Adapter lora;
  lora.a = &lora_a;
  lora.b = &lora_b;
  Key key;
  int64_t rows = 0, cols = 0, depth = 0;
  if (!describe(kLora, code, x, weight, bias, -1, key, rows, cols, depth, lora)) {
    return "not a call the fast path takes";
  }
  if (!out.is_contiguous() || out.dim() != 2 || out.size(0) != rows || out.size(1) != cols ||
      out.scalar_type() != x.scalar_type()) {
    return "the output is not laid out as the fast call allocates it";
  }
  const int64_t rank = lora_a.size(0);
  const bool xs_ok = split > 1
      ? xs.scalar_type() == at::kFloat && xs.dim() == 3 && xs.size(0) == split &&
            xs.size(1) == rows && xs.size(2) == rank
      : xs.scalar_type() == x.scalar_type() && xs.dim() == 2 && xs.size(0) == rows &&
            xs.size(1) == rank;
  if (!xs_ok || !xs.is_contiguous()) return "xs is not laid out as the fast call allocates it";
  Plan plan;
  std::string why = start_plan(plan, function, grid, num_warps, shared, positions.size(),
                               kinds.size(), passed.size());
  if (!why.empty()) return why;
  plan.pdl = false;  // (the joint launch's programs wait for each other: no PDL)
  plan.joint.on = true;
  plan.joint.split = split;
  plan.joint.sync = reinterpret_cast<int64_t>(sync.data_ptr());
  plan.joint.stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  plan.joint.n_shrink = n_shrink;
  why = set_descs(plan.descs, descs, {kOfX, kOfW, kOfA, kOfX});
  if (!why.empty()) return why;
  const at::Tensor x2 = x.view({rows, depth});
  const at::Tensor* tensors[] = {&x2, &weight, &lora_a, &out};
  Value v[kMaxArgs];
  const int n_values = fill_joint(rows, cols, depth, bias, out, xs, alpha, lora, plan.joint, v);
  why = check_passed(plan, positions, kinds, passed, v, n_values, tensors);
  if (!why.empty()) return why;
  if (!aligned16(v, plan)) return "unaligned pointers";
  alignas(64) CUtensorMap maps[kMaxDescs];
  if (!encode_descs(plan.descs, tensors, maps)) return "a descriptor does not encode";
  return keep(plan, key);
}

// The compiled function's parameter sizes, in order (for tests and diagnosis).
std::vector<int64_t> param_sizes(int64_t function) {
  const ParamInfo info = param_info();
  TORCH_CHECK(info != nullptr, "cuFuncGetParamInfo is not available");
  std::vector<int64_t> sizes;
  for (size_t j = 0; j < 64; ++j) {
    size_t offset = 0, size = 0;
    if (info(reinterpret_cast<CUfunction>(function), j, &offset, &size) != CUDA_SUCCESS) break;
    sizes.push_back(static_cast<int64_t>(size));
  }
  return sizes;
}

py::tuple stats() {
  std::lock_guard<std::mutex> guard(table_lock);
  return py::make_tuple(hits, misses, static_cast<int64_t>(table.size()));
}

void clear() {
  std::lock_guard<std::mutex> guard(table_lock);
  table.clear();
  hits = misses = 0;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("call", &call, "the fast call: the output, or None");
  m.def("call_lora", &call_lora, "the LoRA layer's fast call: the output, or None");
  m.def("call_twin", &call_twin, "the CUDA C++ twins' fast call: the output, or None");
  m.def("register_plan", &register_plan, "keep a launch's plan: '' when kept, else why not");
  m.def("register_gemm_plan", &register_gemm_plan,
        "keep a plain GEMM launch's plan: '' when kept, else why not");
  m.def("register_joint_plan", &register_joint_plan,
        "keep a joint LoRA launch's plan: '' when kept, else why not");
  m.def("stats", &stats, "(hits, misses, plans)");
  m.def("param_sizes", &param_sizes, "a compiled function's parameter sizes");
  m.def("available", []() { return launch_ex() != nullptr; }, "cuLaunchKernelEx found");
  m.def("clear", &clear, "forget every plan (tests)");
  m.def("state_key", &state_key, "a module's replay key (fastcall_state.h)");
  m.def("replay", &replay, "one replay of a captured forward (fastcall_replay.h)");
}
