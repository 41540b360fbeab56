// The CUDA C++ twin of fuseml's fused elementwise epilogue (ops/_elementwise.py):
//
//     out[m, n] = act(x[m, n] + bias[n] + alpha * y[m, n])
//
// bias and y are optional; the math runs in float32 and is rounded once to the output dtype.
// x, y and out are (M, N) with unit column stride and their own row strides; bias is
// contiguous of length N. out may be x (or y) itself: every element is read before it is
// written, by the same thread, so no pointer below is __restrict__.
//
// Paths, picked on the host per call:
//   * FLAT:   no bias and every operand's rows packed back to back -> one flat index, in a
//             kernel of its own (a vector a thread, no div/mod); a tail of numel % VEC
//             elements is done one by one.
//   * 2-D:    a block takes a tile of TILE_COLS neighbouring vectors (a power of two, up to
//             a block's threads) of ROWS_PER_STEP x U rows (U <= kUnroll, fewer for mid
//             sizes), where ROWS_PER_STEP = threads / TILE_COLS: a thread's row and
//             column come from shifts, and its bias vector is loaded once for its rows (the
//             same tiling as the Triton kernel's 2-D tiles, in the same row-major order).
//   * VEC:    16-byte accesses when every pointer is 16-byte aligned and, for 2-D, N and
//             every row stride are multiples of the vector width. VEC == 1 otherwise.
// The activation, the dtype, HAS_Y, HAS_BIAS and VEC are all template parameters, so the
// inner loops branch only on the bounds.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <utility>

namespace fuseml {
namespace {

#include "common.cuh"

// Codes shared with ops/_activations.py (ACTIVATIONS); the op schema carries them as int.
enum Activation : int {
  kNone = 0,
  kRelu = 1,
  kLeakyRelu = 2,
  kGelu = 3,
  kGeluTanh = 4,
  kSilu = 5,
  kSigmoid = 6,
  kTanh = 7,
};

constexpr int kThreads = 256;  // threads per block (2-D)
// FLAT: one 16-byte vector a thread in 128-thread blocks (8-byte packs in 256-thread blocks
// for add from kHalfPackMinNumel elements, half_packs() below), as the Triton kernel's
// tiles, the best or within 1% of it from 1M to 268M elements; this is also how torch's
// vectorized kernels are laid out (docs/performance/elementwise.md).
constexpr int kFlatThreads = 128;
// FLAT with half packs (8 bytes a thread, see half_packs()): twice the threads a block, so
// that a block still moves kFlatThreads * 16 bytes of each operand.
template <typename S, int VEC>
constexpr int kFlatBlock =
    VEC * static_cast<int>(sizeof(S)) * 2 == kVecBytes ? 2 * kFlatThreads : kFlatThreads;
// 2-D: rows per thread (U), all loaded before any is stored (one vector column of U rows,
// its bias pack loaded and converted once for all of them), at most kUnroll. 16-bit kernels
// take at most 2: at 4 they need about 90 registers a thread (2 blocks of 256 threads an
// SM). U is a template parameter, one kernel per value, because the registers follow it:
// a kernel built for 4 rows and run with 1 keeps the registers of 4.
template <typename S>
constexpr int kUnroll = sizeof(S) == 2 ? 2 : 4;

// ------------------------------------------------------------------------- dtype traits
// Fp32 / Fp16 / Bf16, Pack and store_weak: common.cuh.

// Store a pack with one instruction: its four 32-bit words through store_weak
// (st.global.v4.b32, STG.E.128 in the SASS). A plain `*reinterpret_cast<P*>(p) = r` (or a
// uint4 copied from it) was left to the compiler, which on the 2-D path split every 16-byte
// pack into four 4-byte stores (st.global.v2.u16 / .f32 x 4 in the PTX, STG.E x 4 in the
// SASS) while the loads stayed LDG.E.128.
template <class P>
__device__ __forceinline__ void store_pack(void* dst, const P& r) {
  if constexpr (sizeof(P) == 16) {
    uint4 w;
    if constexpr (sizeof(r.v[0]) == 2) {
      w.x = static_cast<uint32_t>(r.v[0]) | (static_cast<uint32_t>(r.v[1]) << 16);
      w.y = static_cast<uint32_t>(r.v[2]) | (static_cast<uint32_t>(r.v[3]) << 16);
      w.z = static_cast<uint32_t>(r.v[4]) | (static_cast<uint32_t>(r.v[5]) << 16);
      w.w = static_cast<uint32_t>(r.v[6]) | (static_cast<uint32_t>(r.v[7]) << 16);
    } else {
      w = make_uint4(__float_as_uint(r.v[0]), __float_as_uint(r.v[1]), __float_as_uint(r.v[2]),
                     __float_as_uint(r.v[3]));
    }
    store_weak(static_cast<uint4*>(dst), w);
  } else if constexpr (sizeof(P) == 8) {
    uint2 w;
    if constexpr (sizeof(r.v[0]) == 2) {
      w.x = static_cast<uint32_t>(r.v[0]) | (static_cast<uint32_t>(r.v[1]) << 16);
      w.y = static_cast<uint32_t>(r.v[2]) | (static_cast<uint32_t>(r.v[3]) << 16);
    } else {
      w = make_uint2(__float_as_uint(r.v[0]), __float_as_uint(r.v[1]));
    }
    store_weak(static_cast<uint2*>(dst), w);
  } else {
    *reinterpret_cast<P*>(dst) = r;
  }
}

// ----------------------------------------------------------------------------- math
// The same formulas as the Triton kernel (ops/_activations.py), on the same two PTX
// approximations: 2^x and 1/x are one MUFU instruction each (ex2.approx.ftz: ~2 ulp;
// rcp.approx.ftz: 1 ulp; subnormal results flush to 0). expf and an IEEE division cost
// ~8 more instructions each, which makes 16-bit erf-GELU compute-bound.
// Plain asm (not volatile): the compiler may schedule and merge them like other math.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float sigmoid(float h) {
  return rcp_approx(1.f + exp2_approx(-kLog2e * h));  // e^-h = inf below -88: gives 0
}

// Phi(h) = 0.5 * erfc(-h / sqrt(2)), with erfc(z) = t * exp(P(t) - z^2), t = 1 / (1 + z/2),
// from a Chebyshev fit of fractional error < 1.2e-7 (Numerical Recipes' erfcc). Folded for
// exp2: w = z * sqrt(log2 e), 0.5 * erfc(z) = t * 2^(P2(t) - w^2), P2 = log2(e) * P - 1.
// One reciprocal, one exp2 and 9 FMAs; no cancellation in the negative tail.
__device__ __forceinline__ float normal_cdf(float h) {
  const float w = fabsf(h) * 0.8493218002880191f;
  const float t = rcp_approx(fmaf(0.41627730557884884f, w, 1.f));
  float p = fmaf(0.246517298f, t, -1.18611495f);
  p = fmaf(p, t, 2.14747446f);
  p = fmaf(p, t, -1.63775315f);
  p = fmaf(p, t, 0.402321582f);
  p = fmaf(p, t, -0.26875686f);
  p = fmaf(p, t, 0.139630057f);
  p = fmaf(p, t, 0.539700616f);
  p = fmaf(p, t, 1.4427292f);
  p = fmaf(p, t, -2.82574822f);
  const float half_erfc = t * exp2_approx(fmaf(-w, w, p));
  return h < 0.f ? half_erfc : 1.f - half_erfc;
}

template <int ACT>
__device__ __forceinline__ float activate(float h) {
  if constexpr (ACT == kRelu) {
    return h < 0.f ? 0.f : h;  // NaN fails the test and passes through, as in torch.relu
  } else if constexpr (ACT == kLeakyRelu) {
    return h < 0.f ? 0.01f * h : h;  // NaN passes through
  } else if constexpr (ACT == kGelu) {
    return h * normal_cdf(h);
  } else if constexpr (ACT == kGeluTanh) {
    // 0.5 * (1 + tanh(u)) == sigmoid(2u) exactly, u = c (h + k h^3); -2 c log2(e) and
    // -2 c k log2(e) are folded into the two constants.
    const float v = h * fmaf(-0.1029432395800235f, h * h, -2.302208198144325f);
    return h * rcp_approx(1.f + exp2_approx(v));
  } else if constexpr (ACT == kSilu) {
    return h * sigmoid(h);
  } else if constexpr (ACT == kSigmoid) {
    return sigmoid(h);
  } else if constexpr (ACT == kTanh) {
    return tanhf(h);
  } else {
    static_assert(ACT == kNone, "unknown activation code");
    return h;
  }
}

template <class Tr, int ACT, bool HAS_Y, bool HAS_BIAS>
__device__ __forceinline__ typename Tr::Storage fused(typename Tr::Storage x,
                                                      typename Tr::Storage y,
                                                      typename Tr::Storage b, float alpha) {
  float h = Tr::to_float(x);
  if constexpr (HAS_BIAS) h += Tr::to_float(b);
  if constexpr (HAS_Y) h = fmaf(alpha, Tr::to_float(y), h);
  return Tr::from_float(activate<ACT>(h));
}

// ---------------------------------------------------------------------------- kernel
template <typename S>
struct Args {
  const S* x;
  const S* y;     // nullptr unless HAS_Y
  const S* bias;  // nullptr unless HAS_BIAS
  S* out;
  int64_t x_row_stride;  // in elements (2-D only)
  int64_t y_row_stride;
  int64_t out_row_stride;
  int64_t items;      // FLAT: work items (vectors of VEC elements); 2-D: items per row
  int64_t rows;       // 2-D: rows
  int64_t col_tiles;  // 2-D: tiles across a row, ceil(items / TILE_COLS)
  int tile_shift;     // 2-D: log2(TILE_COLS)
  int tail;           // FLAT, VEC > 1: trailing numel % VEC elements past the last vector
  float alpha;
};

// FLAT: a kernel of its own, thread v taking vector v (blockIdx.x * BLOCK + threadIdx.x;
// BLOCK is kFlatBlock, or kWideFlatThreads, see launch()) and the threads just past the
// last vector one tail element each. I: the index type, 32-bit wherever the tensor allows
// (picked on the host, so the loads wait on a handful of instructions and no branch), its
// own launch bounds, no tail pass after the vector.
template <class Tr, int ACT, int VEC, bool HAS_Y, typename I, int BLOCK>
__global__ void __launch_bounds__(BLOCK) bias_act_flat_kernel(const Args<typename Tr::Storage> a) {
  using S = typename Tr::Storage;
  using P = Pack<S, VEC>;
  pdl_begin();
  const I v = static_cast<I>(blockIdx.x) * static_cast<I>(BLOCK) + static_cast<I>(threadIdx.x);
  const I items = static_cast<I>(a.items);
  if (v < items) {
    const P xv = *reinterpret_cast<const P*>(a.x + static_cast<int64_t>(v) * VEC);
    P yv;  // not zero-filled (two instructions an element for 16-bit packs): read if HAS_Y
    if constexpr (HAS_Y) yv = *reinterpret_cast<const P*>(a.y + static_cast<int64_t>(v) * VEC);
    P r;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      r.v[j] = fused<Tr, ACT, HAS_Y, false>(xv.v[j], HAS_Y ? yv.v[j] : S(), S(), a.alpha);
    }
    store_pack(a.out + static_cast<int64_t>(v) * VEC, r);
  } else if (VEC > 1 && v - items < static_cast<I>(a.tail)) {
    // fewer than VEC elements past the last whole vector, one a thread
    const int64_t i = static_cast<int64_t>(items) * VEC + static_cast<int64_t>(v - items);
    S y = S();
    if constexpr (HAS_Y) y = a.y[i];
    a.out[i] = fused<Tr, ACT, HAS_Y, false>(a.x[i], y, S(), a.alpha);
  }
}

template <class Tr, int ACT, int VEC, bool HAS_Y, bool HAS_BIAS, int U>
__global__ void __launch_bounds__(kThreads) bias_act_kernel(const Args<typename Tr::Storage> a) {
  static_assert(U >= 1, "U: rows per thread");
  pdl_begin();
  using S = typename Tr::Storage;
  using P = Pack<S, VEC>;

  // Tile: TILE_COLS vectors x (ROWS_PER_STEP * U) rows; thread (ty, tx) takes vector
  // column tx of rows ty, ty + ROWS_PER_STEP, ... (U of them).
  // Blocks go row-major over (row block, column tile), as the Triton kernel's programs
  // do: consecutive blocks read consecutive stretches of a row. (Column tiles on
  // gridDim.y, with row blocks fastest, left 4 KiB pieces of many rows in flight at
  // once: fp32 65536 x 4096 ran 4-5% behind the Triton kernel.)
  const int tile_cols = 1 << a.tile_shift;
  const int tx = static_cast<int>(threadIdx.x) & (tile_cols - 1);
  const int ty = static_cast<int>(threadIdx.x) >> a.tile_shift;
  const int rows_per_step = kThreads >> a.tile_shift;
  // A grid of (column tiles, row blocks) where the row blocks fit gridDim.y (launch()):
  // the tile without dividing the block index (a software divide ahead of the first
  // load); else one axis over (row block, column tile), divided.
  unsigned row_block, ct;
  if (gridDim.y > 1) {
    row_block = blockIdx.y;
    ct = blockIdx.x;
  } else {
    const unsigned col_tiles = static_cast<unsigned>(a.col_tiles);  // launch() checked it
    row_block = blockIdx.x / col_tiles;
    ct = blockIdx.x - row_block * col_tiles;
  }
  const int64_t item = static_cast<int64_t>(ct) * tile_cols + tx;
  if (item >= a.items) return;  // no barriers below: an idle thread may leave
  const int64_t row0 = static_cast<int64_t>(row_block) * rows_per_step * U + ty;
  const int64_t col = item * VEC;
  // The bias is N elements, reread by every row: it stays in L1/L2.
  // Packs are not zero-filled (as in the flat kernel): each is read only where loaded.
  P bv;
  if constexpr (HAS_BIAS) bv = *reinterpret_cast<const P*>(a.bias + col);
  P xv[U];
  P yv[U];
  bool live[U];
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int64_t row = row0 + static_cast<int64_t>(k) * rows_per_step;
    live[k] = row < a.rows;
    if (live[k]) {
      xv[k] = *reinterpret_cast<const P*>(a.x + row * a.x_row_stride + col);
      if constexpr (HAS_Y) yv[k] = *reinterpret_cast<const P*>(a.y + row * a.y_row_stride + col);
    }
  }
#pragma unroll
  for (int k = 0; k < U; ++k) {
    if (live[k]) {
      const int64_t row = row0 + static_cast<int64_t>(k) * rows_per_step;
      P r;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        r.v[j] = fused<Tr, ACT, HAS_Y, HAS_BIAS>(xv[k].v[j], HAS_Y ? yv[k].v[j] : S(),
                                                 HAS_BIAS ? bv.v[j] : S(), a.alpha);
      }
      store_pack(a.out + row * a.out_row_stride + col, r);
    }
  }
}

// ------------------------------------------------------------------------------ host
struct Launch {
  int sm_count;
  cudaStream_t stream;
  bool pdl;  // programmatic dependent launch (common.cuh)
};

constexpr int64_t kMinBlocksPerSm = 4;  // 2-D: 32 warps per SM before more rows a thread
constexpr int64_t kTwoRowsMinElems = int64_t{1} << 26;  // 16-bit: see launch()

// FLAT: 8-byte packs a thread (twice the threads a block) without an activation from
// kHalfPackMinNumel elements, as the Triton kernel's 8 warps there (HALF_PACK_MIN_NUMEL in
// ops/_elementwise.py).
constexpr int64_t kHalfPackMinNumel = int64_t{1} << 24;

bool half_packs(int64_t numel, int activation) {
  return activation == kNone && numel >= kHalfPackMinNumel;
}

// 2-D: 8-byte packs, one row a thread (a block of kThreads takes 2 KiB of each operand),
// from kHalfPack2dMinBytes an operand for none / ReLU / leaky ReLU, as the Triton kernel's
// 2 KiB tiles on 8 warps there (HALF_PACK_2D_MIN_BYTES in ops/_elementwise.py).
constexpr int64_t kHalfPack2dMinBytes = int64_t{1} << 27;

constexpr bool cheap_activation(int activation) {
  return activation == kNone || activation == kRelu || activation == kLeakyRelu;
}

// FLAT with a transcendental activation (not cheap_activation) from kWideFlatMinNumel
// elements: 16-byte packs in blocks of kWideFlatThreads, as the Triton kernel's 4 KiB
// tiles on 8 warps there (WIDE_FLAT_MIN_NUMEL in ops/_elementwise.py, with the numbers).
constexpr int64_t kWideFlatMinNumel = int64_t{1} << 22;
constexpr int kWideFlatThreads = 2 * kFlatThreads;

bool half_packs_2d(int64_t operand_bytes, int activation) {
  if (!cheap_activation(activation)) return false;  // (not instantiated for the others)
  return operand_bytes >= kHalfPack2dMinBytes;
}

template <class Tr, int ACT, int VEC, bool HAS_Y, bool HAS_BIAS, int U>
void launch_kernel(const Args<typename Tr::Storage>& a, dim3 blocks, int threads,
                   const Launch& l) {
  launch_pdl(l.pdl, bias_act_kernel<Tr, ACT, VEC, HAS_Y, HAS_BIAS, U>, blocks, dim3(threads),
             l.stream, a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// One block per tile, as the Triton kernel has one program per tile: a single resident
// wave of blocks striding over the tensor was 4-6% slower at 268M elements (its last
// stride step runs a few percent full).
template <class Tr, int ACT, int VEC, bool HAS_Y, int BLOCK>
void launch_flat(const Args<typename Tr::Storage>& a, const Launch& l) {
  // A thread per vector and one per tail element (at least one block: a call may be all
  // tail, items == 0).
  const int64_t threads = a.items + a.tail;
  const int64_t blocks = std::max<int64_t>(1, (threads + BLOCK - 1) / BLOCK);
  TORCH_CHECK(blocks <= std::numeric_limits<int>::max(),
              "bias_act_cuda_out: too many elements (", a.items * VEC, ") for one launch");
  // 32-bit indices reach blocks * BLOCK (the last block's idle threads too).
  const unsigned grid = static_cast<unsigned>(blocks);
  if (blocks * BLOCK > std::numeric_limits<int32_t>::max()) {
    launch_pdl(l.pdl, bias_act_flat_kernel<Tr, ACT, VEC, HAS_Y, int64_t, BLOCK>, dim3(grid),
               dim3(BLOCK), l.stream, a);
  } else {
    launch_pdl(l.pdl, bias_act_flat_kernel<Tr, ACT, VEC, HAS_Y, int32_t, BLOCK>, dim3(grid),
               dim3(BLOCK), l.stream, a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class Tr, int ACT, int VEC, bool HAS_Y, bool HAS_BIAS, bool FLAT>
void launch(Args<typename Tr::Storage> a, const Launch& l) {
  if constexpr (FLAT) {
    static_assert(!HAS_BIAS, "a bias needs the column, i.e. the 2-D path");
    constexpr int kBlock = kFlatBlock<typename Tr::Storage, VEC>;
    if constexpr (!cheap_activation(ACT) &&
                  VEC * static_cast<int>(sizeof(typename Tr::Storage)) == kVecBytes) {
      if (a.items * VEC + a.tail >= kWideFlatMinNumel) {
        return launch_flat<Tr, ACT, VEC, HAS_Y, kWideFlatThreads>(a, l);
      }
    }
    launch_flat<Tr, ACT, VEC, HAS_Y, kBlock>(a, l);
  } else {
    // Up to kUnroll rows a thread, fewer where that would leave under kMinBlocksPerSm
    // blocks per SM (4096 x 512 fp32 at 4 rows are 512 blocks on 132 SMs, 3 or 4 an SM);
    // with 8-byte packs (half_packs_2d) one row a thread.
    constexpr int kMax = kUnroll<typename Tr::Storage>;
    constexpr bool kHalf = VEC * static_cast<int>(sizeof(typename Tr::Storage)) * 2 == kVecBytes;
    const int64_t rows_per_step = kThreads >> a.tile_shift;
    const auto blocks = [&](int rows) {
      return (a.rows + rows_per_step * rows - 1) / (rows_per_step * rows) * a.col_tiles;
    };
    const auto grid_of = [&](int rows) {
      // (column tiles, row blocks) on two axes where gridDim.y takes the row blocks; the
      // kernel tells the two layouts apart by gridDim.y.
      const int64_t row_blocks = blocks(rows) / a.col_tiles;
      const bool two_axes = row_blocks > 1 && row_blocks <= 65535;
      return two_axes ? dim3(static_cast<unsigned>(a.col_tiles), static_cast<unsigned>(row_blocks))
                      : dim3(static_cast<unsigned>(blocks(rows)));
    };
    if constexpr (kHalf) {
      TORCH_CHECK(blocks(1) <= std::numeric_limits<int>::max(),
                  "bias_act_cuda_out: too many elements (", a.rows, " x ", a.items * VEC,
                  ") for one launch");
      launch_kernel<Tr, ACT, VEC, HAS_Y, HAS_BIAS, 1>(a, grid_of(1), kThreads, l);
      return;
    }
    // 16-bit tensors under kTwoRowsMinElems elements take one row a thread (bias + GELU
    // bf16 4096 x 4096: 24.6 us against 25.2 at two rows, H100); from there two rows stay
    // ahead. fp32 with a transcendental activation takes one row a thread too; the ReLU
    // epilogue keeps the rule (docs/performance/elementwise.md).
    const bool small16 = sizeof(typename Tr::Storage) == 2 &&
                         a.rows * a.items * VEC < kTwoRowsMinElems;
    const bool heavy32 = sizeof(typename Tr::Storage) == 4 && !cheap_activation(ACT);
    int rows = small16 || heavy32 ? 1 : kMax;
    while (rows > 1 && blocks(rows) < kMinBlocksPerSm * l.sm_count) rows /= 2;
    TORCH_CHECK(blocks(rows) <= std::numeric_limits<int>::max(),
                "bias_act_cuda_out: too many elements (", a.rows, " x ", a.items * VEC,
                ") for one launch");
    const dim3 grid = grid_of(rows);
    if (rows == 1) {
      launch_kernel<Tr, ACT, VEC, HAS_Y, HAS_BIAS, 1>(a, grid, kThreads, l);
    } else if (rows == 2) {
      launch_kernel<Tr, ACT, VEC, HAS_Y, HAS_BIAS, 2>(a, grid, kThreads, l);
    } else if constexpr (kMax >= 4) {
      launch_kernel<Tr, ACT, VEC, HAS_Y, HAS_BIAS, 4>(a, grid, kThreads, l);
    }
  }
}

template <class Tr, int ACT, int VEC, bool FLAT>
void launch_operands(const Args<typename Tr::Storage>& a, const Launch& l) {
  const bool has_y = a.y != nullptr;
  if constexpr (FLAT) {  // the host never picks FLAT with a bias
    if (has_y) {
      launch<Tr, ACT, VEC, true, false, true>(a, l);
    } else {
      launch<Tr, ACT, VEC, false, false, true>(a, l);
    }
  } else {
    const bool has_bias = a.bias != nullptr;
    if (has_y && has_bias) {
      launch<Tr, ACT, VEC, true, true, false>(a, l);
    } else if (has_y) {
      launch<Tr, ACT, VEC, true, false, false>(a, l);
    } else if (has_bias) {
      launch<Tr, ACT, VEC, false, true, false>(a, l);
    } else {
      launch<Tr, ACT, VEC, false, false, false>(a, l);
    }
  }
}

struct Problem {
  const void* x;
  const void* y;
  const void* bias;
  void* out;
  int64_t rows, cols;
  int64_t x_row_stride, y_row_stride, out_row_stride;
  float alpha;
  bool flat;       // no bias and all rows packed back to back: index storage directly
  bool vectorize;  // 16-byte accesses are legal for this layout
};

template <class Tr, int ACT>
void launch_activation(const Problem& p, const Launch& l) {
  using S = typename Tr::Storage;
  constexpr int kVec = kVecBytes / static_cast<int>(sizeof(S));
  Args<S> a;
  a.x = static_cast<const S*>(p.x);
  a.y = static_cast<const S*>(p.y);
  a.bias = static_cast<const S*>(p.bias);
  a.out = static_cast<S*>(p.out);
  a.x_row_stride = p.x_row_stride;
  a.y_row_stride = p.y_row_stride;
  a.out_row_stride = p.out_row_stride;
  a.alpha = p.alpha;
  a.rows = 0;  // FLAT kernels use items and tail only
  a.col_tiles = 0;
  a.tile_shift = 0;
  a.tail = 0;
  const int64_t numel = p.rows * p.cols;
  if (p.flat && p.vectorize && half_packs(numel, ACT)) {
    constexpr int kHalf = kVec / 2;
    a.items = numel / kHalf;
    a.tail = static_cast<int>(numel % kHalf);
    launch_operands<Tr, ACT, kHalf, true>(a, l);
  } else if (p.flat && p.vectorize) {
    a.items = numel / kVec;
    a.tail = static_cast<int>(numel % kVec);
    launch_operands<Tr, ACT, kVec, true>(a, l);
  } else if (p.flat) {
    a.items = numel;
    launch_operands<Tr, ACT, 1, true>(a, l);
  } else {
    // Tile width: the row's vectors rounded up to a power of two, at most one per thread.
    const bool half = p.vectorize && half_packs_2d(numel * static_cast<int64_t>(sizeof(S)), ACT);
    a.items = p.vectorize ? p.cols / (half ? kVec / 2 : kVec) : p.cols;
    a.rows = p.rows;
    while ((int64_t{1} << a.tile_shift) < a.items && (1 << a.tile_shift) < kThreads) {
      ++a.tile_shift;
    }
    a.col_tiles = (a.items + (int64_t{1} << a.tile_shift) - 1) >> a.tile_shift;
    if constexpr (cheap_activation(ACT)) {
      if (half) {
        launch_operands<Tr, ACT, kVec / 2, false>(a, l);
        return;
      }
    }
    if (p.vectorize) {
      launch_operands<Tr, ACT, kVec, false>(a, l);
    } else {
      launch_operands<Tr, ACT, 1, false>(a, l);
    }
  }
}

template <class Tr>
void launch_dtype(const Problem& p, int64_t activation, const Launch& l) {
  switch (activation) {
    case kNone: return launch_activation<Tr, kNone>(p, l);
    case kRelu: return launch_activation<Tr, kRelu>(p, l);
    case kLeakyRelu: return launch_activation<Tr, kLeakyRelu>(p, l);
    case kGelu: return launch_activation<Tr, kGelu>(p, l);
    case kGeluTanh: return launch_activation<Tr, kGeluTanh>(p, l);
    case kSilu: return launch_activation<Tr, kSilu>(p, l);
    case kSigmoid: return launch_activation<Tr, kSigmoid>(p, l);
    case kTanh: return launch_activation<Tr, kTanh>(p, l);
    default: TORCH_CHECK(false, "bias_act_cuda_out: activation must be in 0..7, got ", activation);
  }
}

// x, y or out: CUDA, on x's device, x's dtype, 2-D of x's shape, unit column stride.
void check_matrix(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.is_cuda(), "bias_act_cuda_out: ", name, " must be a CUDA tensor, got one on ",
              t.device());
  TORCH_CHECK(t.device() == x.device(), "bias_act_cuda_out: ", name, " is on ", t.device(),
              " but x is on ", x.device());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "bias_act_cuda_out: ", name, " has dtype ",
              t.scalar_type(), " but x has dtype ", x.scalar_type());
  TORCH_CHECK(t.dim() == 2, "bias_act_cuda_out: ", name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.sizes() == x.sizes(), "bias_act_cuda_out: ", name, " has shape ", t.sizes(),
              " but x has shape ", x.sizes());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "bias_act_cuda_out: ", name,
              " must have stride(1) == 1, got strides ", t.strides());
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kVecBytes == 0; }

}  // namespace

void bias_act_cuda_out(const at::Tensor& x, const std::optional<at::Tensor>& y,
                       const std::optional<at::Tensor>& bias, double alpha, int64_t activation,
                       at::Tensor& out) {
  TORCH_CHECK(x.is_cuda(), "bias_act_cuda_out: x must be a CUDA tensor, got one on ", x.device());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "bias_act_cuda_out: x must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(x.dim() == 2, "bias_act_cuda_out: x must be 2-D, got ", x.dim(), "-D");
  check_matrix(x, "x", x);
  check_matrix(out, "out", x);
  const bool has_y = y.has_value() && y->defined();
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_y) check_matrix(*y, "y", x);
  const int64_t M = x.size(0);
  const int64_t N = x.size(1);
  if (has_bias) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.is_cuda(), "bias_act_cuda_out: bias must be a CUDA tensor, got one on ",
                b.device());
    TORCH_CHECK(b.device() == x.device(), "bias_act_cuda_out: bias is on ", b.device(),
                " but x is on ", x.device());
    TORCH_CHECK(b.scalar_type() == dtype, "bias_act_cuda_out: bias has dtype ", b.scalar_type(),
                " but x has dtype ", dtype);
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N, "bias_act_cuda_out: bias must be 1-D of length ",
                N, " (x.size(1)), got shape ", b.sizes());
    TORCH_CHECK(b.is_contiguous(), "bias_act_cuda_out: bias must be contiguous");
  }
  TORCH_CHECK(activation >= 0 && activation <= 7,
              "bias_act_cuda_out: activation must be in 0..7, got ", activation);
  if (M == 0 || N == 0) return;

  // Each output element must be written by one thread, after that thread read its inputs:
  // out's rows may not overlap, and an input sharing out's start must share its layout.
  // (Partial overlap at another offset is not detected, as in most out= kernels.)
  TORCH_CHECK(M == 1 || out.stride(0) >= N, "bias_act_cuda_out: out rows overlap (stride(0) = ",
              out.stride(0), " < size(1) = ", N, ")");
  const auto same_cells = [&](const at::Tensor& t) {
    return t.const_data_ptr() != out.const_data_ptr() || M == 1 || t.stride(0) == out.stride(0);
  };
  TORCH_CHECK(same_cells(x), "bias_act_cuda_out: x aliases out with a different row stride");
  TORCH_CHECK(!has_y || same_cells(*y),
              "bias_act_cuda_out: y aliases out with a different row stride");

  c10::cuda::CUDAGuard device_guard(x.device());

  Problem p;
  p.x = x.const_data_ptr();
  p.y = has_y ? y->const_data_ptr() : nullptr;
  p.bias = has_bias ? bias->const_data_ptr() : nullptr;
  p.out = out.mutable_data_ptr();
  p.rows = M;
  p.cols = N;
  // With a single row the row stride is never used (and may be anything).
  p.x_row_stride = M == 1 ? N : x.stride(0);
  p.y_row_stride = has_y ? (M == 1 ? N : y->stride(0)) : 0;
  p.out_row_stride = M == 1 ? N : out.stride(0);
  p.alpha = static_cast<float>(alpha);
  p.flat = !has_bias && p.x_row_stride == N && p.out_row_stride == N &&
           (!has_y || p.y_row_stride == N);
  const int64_t vec = kVecBytes / static_cast<int64_t>(x.element_size());
  p.vectorize = aligned(p.x) && aligned(p.out) && (!has_y || aligned(p.y)) &&
                (!has_bias || aligned(p.bias));
  if (!p.flat) {
    // Every vector must start on a 16-byte boundary: in each row, and at each row start.
    p.vectorize = p.vectorize && N % vec == 0 && p.x_row_stride % vec == 0 &&
                  p.out_row_stride % vec == 0 && (!has_y || p.y_row_stride % vec == 0);
  }

  Launch l;
  // getCurrentDeviceProperties is cached by ATen per device: no driver call per launch.
  l.sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  l.stream = at::cuda::getCurrentCUDAStream();
  l.pdl = pdl_enabled();

  switch (dtype) {
    case at::kFloat: launch_dtype<Fp32>(p, activation, l); break;
    case at::kHalf: launch_dtype<Fp16>(p, activation, l); break;
    case at::kBFloat16: launch_dtype<Bf16>(p, activation, l); break;
    default: TORCH_CHECK(false, "bias_act_cuda_out: unsupported dtype ", dtype);
  }
}

}  // namespace fuseml

TORCH_LIBRARY_FRAGMENT(fuseml, m) {
  m.def(
      "bias_act_cuda_out(Tensor x, Tensor? y, Tensor? bias, float alpha, int activation, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(fuseml, CUDA, m) {
  m.impl("bias_act_cuda_out", &fuseml::bias_act_cuda_out);
}

// The shape-only kernel tracing runs (torch.compile's fake tensors, opcheck): the op writes
// only into `out` and returns nothing, so there is nothing to compute. Registered with the
// op's library, so loading the extension registers nothing from Python.
TORCH_LIBRARY_IMPL(fuseml, Meta, m) {
  m.impl("bias_act_cuda_out",
         [](const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
            double, int64_t, at::Tensor&) {});
}
