// What the CUDA C++ twins (elementwise.cu, softmax.cu, interaction.cu) share: the dtype traits, the
// 16-byte pack, weak stores in inline PTX, and the programmatic dependent launch. Included
// inside each file's anonymous namespace, so each translation unit keeps its own copy.
#pragma once

// The widest single global load / store.
constexpr int kVecBytes = 16;

// Half and bf16 travel as raw 16-bit words so that packing them into 16-byte vectors does
// not depend on the constructors of __half / __nv_bfloat16 (or on torch's
// __CUDA_NO_HALF_CONVERSIONS__ flags); conversions are the round-to-nearest-even intrinsics.
struct Fp32 {
  using Storage = float;
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float v) { return v; }
  static __device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }
};

struct Fp16 {
  using Storage = unsigned short;
  static __device__ __forceinline__ float to_float(unsigned short v) {
    return __half2float(__ushort_as_half(v));
  }
  static __device__ __forceinline__ unsigned short from_float(float v) {
    return __half_as_ushort(__float2half_rn(v));
  }
  static __device__ __forceinline__ unsigned short neg_inf() {
    return static_cast<unsigned short>(0xFC00u);  // sign 1, exponent all ones, mantissa 0
  }
};

struct Bf16 {
  using Storage = unsigned short;
  static __device__ __forceinline__ float to_float(unsigned short v) {
    return __bfloat162float(__ushort_as_bfloat16(v));
  }
  static __device__ __forceinline__ unsigned short from_float(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
  static __device__ __forceinline__ unsigned short neg_inf() {
    return static_cast<unsigned short>(0xFF80u);  // the top half of fp32 -inf
  }
};

// VEC elements moved by one load/store instruction (LDG/STG.128 when VEC * sizeof(S) == 16).
template <typename S, int VEC>
struct alignas(sizeof(S) * VEC) Pack {
  S v[VEC];
};

// Weak stores of one word in inline PTX (STG.E.U16 / STG.E / STG.E.128 in the SASS). A
// plain C++ store of a 16-byte pack (or of a uint4 copied from it) was left to the
// compiler, which split it into four 4-byte stores on some paths while the loads stayed
// LDG.E.128. __stwb (st.global.wb) compiles to a STRONG.SM store instead, ordered at SM
// scope, which neither a plain C++ store nor Triton's stores are.
template <typename W>
__device__ __forceinline__ void store_weak(W* p, const W& w) {
  if constexpr (sizeof(W) == 2) {
    asm volatile("st.global.b16 [%0], %1;" : : "l"(p), "h"(w) : "memory");
  } else if constexpr (sizeof(W) == 4) {
    asm volatile("st.global.b32 [%0], %1;" : : "l"(p), "r"(w) : "memory");
  } else if constexpr (sizeof(W) == 8) {
    asm volatile("st.global.v2.b32 [%0], {%1, %2};" : : "l"(p), "r"(w.x), "r"(w.y) : "memory");
  } else {
    static_assert(sizeof(W) == 16, "no weak store of this word's size");
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};"
                 :
                 : "l"(p), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
                 : "memory");
  }
}

// Programmatic dependent launch (PDL; fuseml.ops._utils.pdl_launch says what it does and
// buys): on sm_90 and later, unless FUSEML_PDL=0 (read on each call, as the Python side
// reads it), a launch may begin while the kernel before it on the stream finishes. Every
// kernel launched through launch_pdl starts with pdl_begin(), which is a no-op on a plain
// launch.
inline bool pdl_enabled() {
  const char* v = std::getenv("FUSEML_PDL");
  if (v != nullptr) {
    const std::string s(v);
    TORCH_CHECK(s == "0" || s == "1", "FUSEML_PDL must be 0 or 1, got '", s, "'");
    if (s == "0") return false;
  }
  return at::cuda::getCurrentDeviceProperties()->major >= 9;
}

// Wait until every grid before this one on the stream has completed and its writes are
// visible, then let the next PDL launch begin. Nothing may touch global memory before it.
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" : : : "memory");
  asm volatile("griddepcontrol.launch_dependents;" : : : "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute where pdl is set.
template <typename... Params, typename... Args>
void launch_pdl_smem(bool pdl, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                     cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// kernel<<<grid, block, 0, stream>>>(args...), with the PDL attribute where pdl is set.
template <typename... Params, typename... Args>
void launch_pdl(bool pdl, void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                Args&&... args) {
  launch_pdl_smem(pdl, kernel, grid, block, 0, stream, std::forward<Args>(args)...);
}
