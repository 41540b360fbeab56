// The eager fast path of fuseml's elementwise ops, the on-chip softmax, the plain 16-bit
// linear layer and the one-adapter LoRA layer's in-loop launch (ops/_fastcall.py): a
// repeat call launches the kernel the Python path compiled for the same call signature,
// from C++.
//
// An eager fuseml call used to spend ~3x torch's time on the host (gelu on 64 x 512:
// 26 us against 8.8, H200 host): validation, the plan lookup, Triton's launcher (a Python
// method call and a cuPointerGetAttribute per pointer). Here a call is one lookup of its
// signature, an allocation and cuLaunchKernelEx.
//
// The Python path decides everything (kernel, specialization, grid, warps, PDL) and, after
// its launch, registers the plan with `register_plan`: this file recomputes the kernel's
// arguments from the same tensors and keeps the plan only if every argument it would pass
// equals the one Python passed, and the compiled function's parameter list
// (cuFuncGetParamInfo) has exactly the sizes it will write. A call this file cannot vouch
// for (a tensor subclass, a dispatch mode, autograd recording, a non-contiguous input, a
// signature never registered) returns None and the caller takes the Python path.
//
// The key holds everything the Python plan depends on: op, activation / log flag, device,
// dtype, rows, columns (and the GEMM's depth), which optional inputs are given and the
// settings the plan reads (read on each call, as the Python side reads them), and for the
// LoRA layer the adapter's rank. Plans come only from launches with every pointer 16-byte
// aligned (Triton specializes on it), and a call whose pointers are not takes the Python
// path. A GEMM plan is offered only from a launch with the tuned (or heuristic) tile,
// never from the tuner's timed candidates.

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
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// Ops, as ops/_fastcall.py names them.
constexpr int64_t kElementwise = 0;  // _elementwise._bias_act_kernel: act(x + bias + alpha y)
constexpr int64_t kSoftmaxRows = 1;  // _softmax/rows.py: the on-chip softmax of each row
constexpr int64_t kGemm = 2;  // gemm/pointer.py, stream.py: act(x @ W^T + bias), 16-bit
// gemm/pointer.py _lora_kernel, in-loop mode, one adapter A (r, K), B (N, r), scaling s:
// act(x @ W^T + bias + s (x @ A^T) @ B^T), 16-bit; eager calls only (not while capturing)
constexpr int64_t kLora = 3;

// Kinds of kernel parameters.
constexpr int64_t kPtr = 0, kI32 = 1, kI64 = 2, kF32 = 3;

constexpr int kMaxArgs = 24;

using Key = std::array<int64_t, 10>;

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
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
};

// One argument of the kernel, as the Python path passes it.
struct Value {
  int64_t i = 0;   // a pointer or an int
  double f = 0.0;  // a float
};

std::mutex table_lock;
std::unordered_map<Key, Plan, KeyHash> table;
int64_t hits = 0, misses = 0;

using LaunchEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using ParamInfo = CUresult (*)(CUfunction, size_t, size_t*, size_t*);

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

LaunchEx launch_ex() {
  static LaunchEx fn = driver_entry<LaunchEx>("cuLaunchKernelEx");
  return fn;
}

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
  if (op == kGemm) {
    // (x, weight, bias or x, residual: x, out, m, n, k, x's strides, weight's strides,
    //  the residual's row stride: 0, out's row stride, alpha)
    v[0].i = ptr(x);
    v[1].i = ptr(*y);
    v[2].i = has_b ? ptr(*bias) : ptr(x);
    v[3].i = ptr(x);
    v[4].i = ptr(out);
    v[5].i = rows;
    v[6].i = cols;
    v[7].i = depth;
    v[8].i = depth;
    v[9].i = 1;
    v[10].i = depth;
    v[11].i = 1;
    v[12].i = 0;
    v[13].i = cols;
    v[14].f = alpha;
    return 15;
  }
  if (op == kLora) {
    // (x, weight, bias or x, residual: x, out, A, B, xa: x, ids: x, scales: x, m, n, k,
    //  x's strides, weight's strides, the residual's row stride: 0, out's row stride, A's
    //  row stride, B's row stride (r), the residual's scale: 1, the LoRA scaling: alpha)
    const int64_t rank = lora.a->size(0);
    v[0].i = ptr(x);
    v[1].i = ptr(*y);
    v[2].i = has_b ? ptr(*bias) : ptr(x);
    v[3].i = ptr(x);
    v[4].i = ptr(out);
    v[5].i = ptr(*lora.a);
    v[6].i = ptr(*lora.b);
    v[7].i = ptr(x);
    v[8].i = ptr(x);
    v[9].i = ptr(x);
    v[10].i = rows;
    v[11].i = cols;
    v[12].i = depth;
    v[13].i = depth;
    v[14].i = 1;
    v[15].i = depth;
    v[16].i = 1;
    v[17].i = 0;
    v[18].i = cols;
    v[19].i = depth;
    v[20].i = rank;
    v[21].f = 1.0;
    v[22].f = alpha;
    return 23;
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

void launch(const Plan& plan, const Value* v, cudaStream_t stream) {
  alignas(8) unsigned char storage[kMaxArgs + 2][8];
  void* params[kMaxArgs + 2];
  for (int j = 0; j < plan.n_params; ++j) {
    const Value& a = v[plan.pos[j]];
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
  }
  const bool gemm = op == kGemm || op == kLora;
  at::Tensor out = gemm ? at::empty({rows, cols}, x.options()) : at::empty_like(x);
  Value v[kMaxArgs];
  fill(op, rows, cols, depth, x, y, bias, out, alpha, v, lora);
  if (!aligned16(v, plan)) {
    std::lock_guard<std::mutex> guard(table_lock);
    ++misses;
    return py::none();  // (the output's allocation is simply dropped)
  }
  launch(plan, v, stream);
  {
    std::lock_guard<std::mutex> guard(table_lock);
    ++hits;
  }
  if (gemm && x.dim() != 2) {  // (..., N), as the Python path returns it
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

// The LoRA layer's fast call (kLora): the output, or None.
py::object call_lora(int64_t code, const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, const at::Tensor& lora_a,
                     const at::Tensor& lora_b, double scaling) {
  Adapter lora;
  lora.a = &lora_a;
  lora.b = &lora_b;
  return call_with(kLora, code, x, weight, bias, scaling, -1, lora);
}

// Keep the plan of a launch the Python path just made: "" when kept, else why not.
std::string register_plan(int64_t op, int64_t code, const at::Tensor& x,
                          const std::optional<at::Tensor>& y, const std::optional<at::Tensor>& bias,
                          const at::Tensor& out, double alpha, int64_t function,
                          std::vector<int64_t> grid, int64_t num_warps, int64_t shared, bool pdl,
                          std::vector<int64_t> positions, std::vector<int64_t> kinds,
                          std::vector<py::object> passed, const std::optional<at::Tensor>& lora_a,
                          const std::optional<at::Tensor>& lora_b) {
  if (launch_ex() == nullptr) return "cuLaunchKernelEx is not available";
  static ParamInfo param_info = driver_entry<ParamInfo>("cuFuncGetParamInfo");
  if (param_info == nullptr) return "cuFuncGetParamInfo is not available";
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
  const int n = static_cast<int>(positions.size());
  if (n > kMaxArgs || kinds.size() != positions.size() || passed.size() != positions.size() ||
      grid.size() != 3) {
    return "malformed plan";
  }
  Value v[kMaxArgs];
  const int n_values = fill(op, rows, cols, depth, x, y, bias, out, alpha, v, lora);
  Plan plan;
  plan.function = reinterpret_cast<CUfunction>(function);
  for (int d = 0; d < 3; ++d) plan.grid[d] = static_cast<unsigned>(grid[d]);
  plan.threads = static_cast<unsigned>(32 * num_warps);
  plan.shared = static_cast<unsigned>(shared);
  plan.pdl = pdl;
  plan.n_params = n;
  for (int j = 0; j < n; ++j) {
    const int pos = static_cast<int>(positions[j]);
    if (pos < 0 || pos >= n_values) return "a parameter this file does not compute";
    plan.pos[j] = pos;
    plan.kind[j] = static_cast<int>(kinds[j]);
    const py::object& p = passed[j];
    if (plan.kind[j] == kF32) {
      if (static_cast<float>(p.cast<double>()) != static_cast<float>(v[pos].f)) {
        return "argument " + std::to_string(pos) + " differs";
      }
    } else if (plan.kind[j] == kPtr) {
      const int64_t ptr = THPVariable_Check(p.ptr())
          ? reinterpret_cast<int64_t>(THPVariable_Unpack(p.ptr()).data_ptr())
          : p.cast<int64_t>();
      if (ptr != v[pos].i) return "pointer argument " + std::to_string(pos) + " differs";
    } else if (plan.kind[j] == kI32 || plan.kind[j] == kI64) {
      if (p.cast<int64_t>() != v[pos].i) return "argument " + std::to_string(pos) + " differs";
    } else {
      return "unknown parameter kind";
    }
  }
  if (!aligned16(v, plan)) return "unaligned pointers";
  {  // kept already (a call the fast path does not take, e.g. in place, offers it each time)
    std::lock_guard<std::mutex> guard(table_lock);
    auto it = table.find(key);
    if (it != table.end() && same_launch(it->second, plan)) return "";
  }
  // The compiled function's parameters: ours with these sizes, then at most two 8-byte
  // scratch pointers (Triton's global / profile scratch), nothing more.
  for (int j = 0; j < n + 3; ++j) {
    size_t offset = 0, size = 0;
    const bool exists = param_info(plan.function, j, &offset, &size) == CUDA_SUCCESS;
    if (j < n) {
      const size_t want = (plan.kind[j] == kI32 || plan.kind[j] == kF32) ? 4 : 8;
      if (!exists || size != want) return "parameter " + std::to_string(j) + " has another size";
    } else if (!exists) {
      plan.n_scratch = j - n;
      break;
    } else if (size != 8 || j == n + 2) {
      return "the kernel takes parameters this file does not pass";
    }
  }
  std::lock_guard<std::mutex> guard(table_lock);
  table[key] = plan;
  return "";
}

// The compiled function's parameter sizes, in order (for tests and diagnosis).
std::vector<int64_t> param_sizes(int64_t function) {
  static ParamInfo param_info = driver_entry<ParamInfo>("cuFuncGetParamInfo");
  TORCH_CHECK(param_info != nullptr, "cuFuncGetParamInfo is not available");
  std::vector<int64_t> sizes;
  for (size_t j = 0; j < 64; ++j) {
    size_t offset = 0, size = 0;
    if (param_info(reinterpret_cast<CUfunction>(function), j, &offset, &size) != CUDA_SUCCESS) break;
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
  m.def("register_plan", &register_plan, "keep a launch's plan: '' when kept, else why not");
  m.def("stats", &stats, "(hits, misses, plans)");
  m.def("param_sizes", &param_sizes, "a compiled function's parameter sizes");
  m.def("available", []() { return launch_ex() != nullptr; }, "cuLaunchKernelEx found");
  m.def("clear", &clear, "forget every plan (tests)");
}
