// The CUDA C++ twin of fuseml's softmax / log_softmax (ops/softmax.py), along the last dim of
// an (M, N) matrix:
//
//     softmax:      out = exp(x - max) / sum(exp(x - max))
//     log_softmax:  out = (x - max) - log(sum(exp(x - max)))
//
// The math runs in float32 and is rounded once to the output dtype. There are no special
// cases, so the edge cases are torch's: a row of all -inf gives NaN (x - max = -inf - -inf),
// and a +inf or a NaN anywhere in a row makes the sum, and so the whole row, NaN.
// x and out are (M, N) with unit column stride and their own row strides; out may be x
// itself (every kernel reads a whole row before it writes any of it).
//
// Kernels, picked on the host per call from the row's "span" (below):
//   * WARP   (span <= 1024; fp32 <= 512): a group of LANES lanes (a warp, or 1/2 ... 1/32 of
//            one for short rows) owns a row, which stays in registers; max and sum are
//            shuffle reductions.
//   * BLOCK  (span <= 32768): a block owns a row, which stays in registers (16 or 32 values
//            per thread; fp32 rows of 513-1024 on two-warp blocks); block reductions through
//            shuffles and 32 floats of shared memory.
//   * SPLIT  (longer rows, up to 64 blocks of 8192 or 16384 columns): a row split over
//            consecutive blocks, each holding its chunk in registers; a block reduces its
//            chunk to (max, sum), posts the pair to a scratch buffer, waits until every
//            block of its row has posted, combines the pairs and writes its chunk.
//   * ONLINE (longer rows still, and layouts where vectors are illegal): a block per row and
//            two reads: pass 1 keeps a running (max, sum) per thread, pass 2 writes the
//            output. Pass 2 walks the row backwards, so it starts on what pass 1 read last
//            (most likely still in L2), and its loads and stores are marked evict-first.
// WARP, BLOCK and SPLIT are one read and one write of every element.
//
// Vectors: a row's columns are grouped in packs of V = 16 / sizeof(element) counted from the
// 16-byte boundary at or before the row's start (`lead` elements before column 0). A pack
// wholly inside the row moves with one 16-byte access; the (at most two) packs that the row's
// ends cut are done element by element. This needs x's and out's rows to share their offset
// within 16 bytes (true for any pair of contiguous tensors); when they do not, the ONLINE
// kernel runs with one-element packs. span = N, plus V - 1 when some row is not 16-byte
// aligned (room for the lead).
//
// Instantiations: dtype (3) x log (2) x {WARP: 9 fp32 / 8 16-bit shapes, BLOCK: 5 shapes
// (6 in fp32), SPLIT: 2 shapes, ONLINE: 2 pack widths} = 106 kernels.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

namespace fuseml {
namespace {

#include "common.cuh"

constexpr int kWarp = 32;
constexpr int kMaxThreads = 1024;         // per block
constexpr int kWarpKernelThreads = 128;   // 4 warps per block, each on its own row(s)
constexpr int64_t kMaxWarpSpan = 1024;    // 32 values per lane at most
constexpr int64_t kMaxBlockSpan = 32768;  // 32 values per thread of a 1024-thread block
constexpr int kOnlineThreads = 1024;
constexpr int64_t kMaxSplitChunks = 64;  // blocks per row of the SPLIT kernel
// Elements per thread per step of the ONLINE kernel: 64 bytes of fp32 (4 wide loads) or 32 of
// a 16-bit dtype in flight per thread, 32-64 KiB per 1024-thread block.
constexpr int kOnlineStepElems = 16;

// Elements per 16-byte pack.
template <typename S>
constexpr int kVec = kVecBytes / static_cast<int>(sizeof(S));

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// Fp32 / Fp16 / Bf16 (their neg_inf() is -inf in storage: what a column outside the row
// reads as), Pack and store_weak: common.cuh.

// e^z as one MUFU instruction (ex2.approx.ftz of z * log2(e)).
__device__ __forceinline__ float exp_approx(float z) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(z * 1.4426950408889634f));
  return y;
}

// Memory access (predicated loads, one-instruction stores, packs of a row).
#include "softmax_access.cuh"

// ------------------------------------------------------------------------- reductions
// Over aligned groups of WIDTH lanes (a power of two <= 32); every lane of the warp must call
// it, and every lane gets its group's result. fmaxf drops a NaN, which is harmless: the NaN
// still reaches the sum (exp(NaN - max) is NaN) and so every output of its row.
template <int WIDTH>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Over the block; every thread must call it, and every thread gets the result. `slots` (one
// float per warp, shared) is rewritten only after the block's next barrier, so the kernels
// alternate two arrays: the max of a row and the sum of a row each pass a barrier of the other
// before a warp can write their slots again.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* slots) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int warps = static_cast<int>(blockDim.x) / kWarp;
  v = MAX ? group_max<kWarp>(v) : group_sum<kWarp>(v);
  if (lane == 0) slots[warp] = v;
  __syncthreads();
  // Every warp finishes the reduction itself: no second barrier, no broadcast slot.
  v = lane < warps ? slots[lane] : (MAX ? neg_inf() : 0.f);
  return MAX ? group_max<kWarp>(v) : group_sum<kWarp>(v);
}

// (max, sum of exp(x - max)) pairs: the pair of the union of two sets. The sums are rescaled
// to the larger max (a max of -inf: both sums are 0, and so is the result's).
__device__ __forceinline__ float2 combine_stats(float2 a, float2 b) {
  const float m = fmaxf(a.x, b.x);
  const float sh = m == neg_inf() ? 0.f : m;
  return make_float2(m, a.y * exp_approx(a.x - sh) + b.y * exp_approx(b.x - sh));
}

// The warp's combined pair, in every lane.
__device__ __forceinline__ float2 warp_reduce_stats(float2 st) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) {
    st = combine_stats(st, make_float2(__shfl_xor_sync(0xffffffffu, st.x, o),
                                       __shfl_xor_sync(0xffffffffu, st.y, o)));
  }
  return st;
}

// The block's combined pair, in every thread: one barrier.
__device__ __forceinline__ float2 block_reduce_stats(float2 st, float* max_slots,
                                                     float* sum_slots) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int warps = static_cast<int>(blockDim.x) / kWarp;
  st = warp_reduce_stats(st);
  if (lane == 0) {
    max_slots[warp] = st.x;
    sum_slots[warp] = st.y;
  }
  __syncthreads();
  st = lane < warps ? make_float2(max_slots[lane], sum_slots[lane]) : make_float2(neg_inf(), 0.f);
  return warp_reduce_stats(st);
}

// The reductions row_in_registers uses: over the LANES lanes sharing a row, or over the block.
template <int LANES>
struct GroupReduce {
  __device__ __forceinline__ float all_max(float v) const { return group_max<LANES>(v); }
  __device__ __forceinline__ float all_sum(float v) const { return group_sum<LANES>(v); }
};

struct BlockReduce {
  float* max_slots;  // shared, one float per warp
  float* sum_slots;
  __device__ __forceinline__ float all_max(float v) const {
    return block_reduce<true>(v, max_slots);
  }
  __device__ __forceinline__ float all_sum(float v) const {
    return block_reduce<false>(v, sum_slots);
  }
};

// ---------------------------------------------------------------------------- kernels
template <typename S>
struct RowArgs {
  const S* x;
  S* out;
  int64_t rows;
  int64_t cols;
  int64_t x_row_stride;  // in elements
  int64_t out_row_stride;
};

// A thread's part of a row held in registers: ELEMS values in packs PACK_STRIDE columns
// apart from column c_first (negative inside the lead), every register index a
// compile-time constant. Loads them into v (float) and returns their max; every wide load
// is issued before any partial pack is filled in (see load_full).
template <class Tr, int ELEMS, int PACK_STRIDE, typename I>
__device__ __forceinline__ float load_part(const typename Tr::Storage* xrow, I c_first, I n,
                                           float (&v)[ELEMS]) {
  using S = typename Tr::Storage;
  constexpr int V = kVec<S>;
  constexpr int PACKS = ELEMS / V;
  static_assert(ELEMS % V == 0, "ELEMS must be a whole number of packs");
  Pack<S, V> raw[PACKS];
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    raw[k] = load_full<Tr, V, false>(xrow, c_first + k * PACK_STRIDE, n);
  }
#pragma unroll
  for (int k = 0; k < PACKS; ++k) load_partial<Tr, V>(xrow, c_first + k * PACK_STRIDE, n, raw[k]);
  float mx = neg_inf();
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      v[k * V + j] = Tr::to_float(raw[k].v[j]);
      mx = fmaxf(mx, v[k * V + j]);
    }
  }
  return mx;
}

// Writes out(v[i]) for the values load_part loaded, at the same columns.
template <class Tr, int ELEMS, int PACK_STRIDE, typename I, class Out>
__device__ __forceinline__ void store_part(typename Tr::Storage* orow, I c_first, I n,
                                           const float (&v)[ELEMS], const Out& out) {
  using S = typename Tr::Storage;
  constexpr int V = kVec<S>;
#pragma unroll
  for (int k = 0; k < ELEMS / V; ++k) {
    Pack<S, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = Tr::from_float(out(v[k * V + j]));
    store_pack<Tr, V, false>(orow, c_first + k * PACK_STRIDE, n, o);
  }
}

// One row held in registers: ELEMS values per thread, in packs STRIDE packs apart, so that
// the STRIDE threads sharing the row read consecutive packs (coalesced) and every register
// index is a compile-time constant. c_first: the first column of this thread's first pack
// (negative inside the lead). n == 0 marks a group with no row: it loads and stores nothing
// but still takes part in the reductions, which `red` (GroupReduce or BlockReduce) does over
// the threads sharing the row.
template <class Tr, bool LOG, int ELEMS, int STRIDE, class Reduce>
__device__ __forceinline__ void row_in_registers(const typename Tr::Storage* xrow,
                                                 typename Tr::Storage* orow, int n, int c_first,
                                                 const Reduce& red) {
  constexpr int kPackStride = STRIDE * kVec<typename Tr::Storage>;  // between its packs
  float v[ELEMS];
  float mx = red.all_max(load_part<Tr, ELEMS, kPackStride>(xrow, c_first, n, v));

  // Keep exp(x - max) for softmax, x - max for log_softmax: one exp per element either way.
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < ELEMS; ++i) {
    const float z = v[i] - mx;  // NaN for a row of all -inf, as in torch
    const float e = exp_approx(z);
    sum += e;
    v[i] = LOG ? z : e;
  }
  sum = red.all_sum(sum);
  // softmax: one reciprocal a row, then a multiply an element (the Triton kernels' way): a
  // float32 division an element, as torch does, is ~8 more instructions, which kept the
  // fp32 softmax 1.4x slower than log_softmax.
  const float post = LOG ? logf(sum) : 1.f / sum;
  store_part<Tr, ELEMS, kPackStride>(orow, c_first, n, v, [&](float t) {
    return LOG ? t - post : t * post;
  });
}

// WARP: LANES lanes per row, ELEMS values per lane, 32 / LANES rows per warp; warps stride
// over the rows.
template <class Tr, bool LOG, int ELEMS, int LANES>
__global__ void __launch_bounds__(kWarpKernelThreads)
    softmax_warp_kernel(const RowArgs<typename Tr::Storage> a) {
  using S = typename Tr::Storage;
  pdl_begin();
  constexpr int V = kVec<S>;
  constexpr int kRowsPerWarp = kWarp / LANES;
  constexpr int kWarps = kWarpKernelThreads / kWarp;
  static_assert(LANES >= 1 && LANES <= kWarp && kWarp % LANES == 0, "LANES must divide 32");
  static_assert(ELEMS * LANES <= kMaxWarpSpan, "rows longer than 1024 go to BLOCK");

  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int sub = lane % LANES;  // lane within its row's group
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps * kRowsPerWarp;
  // `first` is the same for the whole warp, so the loop (and the shuffles in it) stays
  // warp-uniform; a group past the last row runs with n = 0.
  for (int64_t first =
           (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp) * kRowsPerWarp;
       first < a.rows; first += step) {
    const int64_t row = first + lane / LANES;
    const bool live = row < a.rows;
    const int64_t r = live ? row : 0;
    const S* xrow = a.x + r * a.x_row_stride;
    S* orow = a.out + r * a.out_row_stride;
    const int n = live ? static_cast<int>(a.cols) : 0;
    row_in_registers<Tr, LOG, ELEMS, LANES>(xrow, orow, n, sub * V - lead_of<V>(xrow),
                                            GroupReduce<LANES>{});
  }
}

// BLOCK: one row per block at a time, ELEMS values per thread; blocks stride over the rows.
template <class Tr, bool LOG, int THREADS, int ELEMS>
__global__ void __launch_bounds__(THREADS)
    softmax_block_kernel(const RowArgs<typename Tr::Storage> a) {
  using S = typename Tr::Storage;
  pdl_begin();
  constexpr int V = kVec<S>;
  static_assert(THREADS % kWarp == 0 && THREADS <= kMaxThreads, "bad block size");
  __shared__ float red_max[kWarp];
  __shared__ float red_sum[kWarp];

  const BlockReduce red{red_max, red_sum};
  const int n = static_cast<int>(a.cols);
  const int c_thread = static_cast<int>(threadIdx.x) * V;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const S* xrow = a.x + row * a.x_row_stride;
    S* orow = a.out + row * a.out_row_stride;
    row_in_registers<Tr, LOG, ELEMS, THREADS>(xrow, orow, n, c_thread - lead_of<V>(xrow), red);
  }
}

// ONLINE: one row per block at a time (any blockDim that is a multiple of 32), packs of V
// elements (kVec, or 1 when x and out are not co-aligned). Step st covers packs
// [st * chunk, (st + 1) * chunk), U per thread, blockDim apart (coalesced).
template <class Tr, bool LOG, int V>
__global__ void __launch_bounds__(kMaxThreads)
    softmax_online_kernel(const RowArgs<typename Tr::Storage> a) {
  using S = typename Tr::Storage;
  pdl_begin();
  using P = Pack<S, V>;
  constexpr int U = kOnlineStepElems / V;  // packs per thread per step
  static_assert(U >= 1 && U * V == kOnlineStepElems, "V must divide the step");
  __shared__ float red_max[kWarp];
  __shared__ float red_sum[kWarp];

  const int64_t threads = blockDim.x;
  const int64_t n = a.cols;
  const int64_t chunk = threads * U;       // packs per step
  const int64_t col_stride = threads * V;  // columns between one thread's packs
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const S* xrow = a.x + row * a.x_row_stride;
    S* orow = a.out + row * a.out_row_stride;
    const int lead = lead_of<V>(xrow);
    const int64_t packs = (lead + n + V - 1) / V;
    const int64_t steps = (packs + chunk - 1) / chunk;  // the same for the whole block
    const int64_t c_thread = static_cast<int64_t>(threadIdx.x) * V - lead;

    // Pass 1: running max m and sum s of exp(x - m) over this thread's elements. A step
    // rescales s once, by exp(m_old - m_new); columns past the row read as -inf and add 0.
    // While m is -inf (nothing but -inf seen yet), shift by 0 instead, so that s stays 0
    // rather than exp(-inf - -inf) = NaN.
    float m = neg_inf();
    float s = 0.f;
    for (int64_t st = 0; st < steps; ++st) {
      const int64_t c_step = st * chunk * V + c_thread;
      P raw[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        raw[u] = load_full<Tr, V, false>(xrow, c_step + u * col_stride, n);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) load_partial<Tr, V>(xrow, c_step + u * col_stride, n, raw[u]);
      float v[U * V];
      float cm = neg_inf();
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          v[u * V + j] = Tr::to_float(raw[u].v[j]);
          cm = fmaxf(cm, v[u * V + j]);
        }
      }
      const float m_new = fmaxf(m, cm);
      const float shift = m_new == neg_inf() ? 0.f : m_new;
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < U * V; ++i) acc += exp_approx(v[i] - shift);
      s = s * expf(m - shift) + acc;  // a NaN or +inf in x has made acc, then s, NaN
      m = m_new;
    }

    // Row statistics: max, then the threads' sums rescaled to it (a thread that saw only -inf
    // adds 0 * exp(-inf) = 0). A row of all -inf keeps row_max = -inf and total = 0; pass 2's
    // x - row_max is then NaN, as in torch.
    const float row_max = block_reduce<true>(m, red_max);
    const float shift = row_max == neg_inf() ? 0.f : row_max;
    const float total = block_reduce<false>(s * expf(m - shift), red_sum);
    const float post = LOG ? logf(total) : 1.f / total;

    // Pass 2, last step first: the end of the row is the part of it most recently read.
    for (int64_t st = steps - 1; st >= 0; --st) {
      const int64_t c_step = st * chunk * V + c_thread;
      P raw[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        raw[u] = load_full<Tr, V, true>(xrow, c_step + u * col_stride, n);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) load_partial<Tr, V>(xrow, c_step + u * col_stride, n, raw[u]);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        P o;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float z = Tr::to_float(raw[u].v[j]) - row_max;
          o.v[j] = Tr::from_float(LOG ? z - post : exp_approx(z) * post);
        }
        store_pack<Tr, V, true>(orow, c_step + u * col_stride, n, o);
      }
    }
  }
}

// The SPLIT kernel's per-row counter: a release add (the poster's earlier stores are
// visible to whoever reads the new count) and an acquire load (a plain L2 read to poll, not
// an atomic read-modify-write). Before sm_70: fences around relaxed operations.
__device__ __forceinline__ void post_count(int* count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(count) : "memory");
#else
  __threadfence();
  atomicAdd(count, 1);
#endif
}

__device__ __forceinline__ int acquire_count(const int* count) {
  int v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
#else
  v = *reinterpret_cast<const volatile int*>(count);
  __threadfence();
#endif
  return v;
}

// SPLIT: block b takes chunk b % chunks of row b / chunks, THREADS x ELEMS columns counted
// from the 16-byte boundary at or before the row's start. The wait ends if blocks start in
// index order and `chunks` of them fit on the GPU at once (the assumption of CUB's single-
// pass scan); the host keeps chunks at or under half the SMs. stats: (rows, chunks) pairs;
// count: (rows,) zeros at launch, the blocks of the row that have posted.
//
// 16-bit storage asks ptxas for 1280 threads an SM (5 blocks of 256): 48 registers a thread
// instead of 64, so 5 blocks an SM in flight instead of 4 (bf16 65536 columns: 418 against
// 442 us, H100). float32 would spill there, so it keeps the plain bound: a minimum of 0
// blocks, which gives none (an explicit 1 made ptxas use more registers, not fewer).
constexpr int kSplit16ThreadsPerSm = 1280;
template <class Tr, int THREADS>
constexpr int split_min_blocks() {
  return sizeof(typename Tr::Storage) == 2 ? std::max(1, kSplit16ThreadsPerSm / THREADS) : 0;
}

template <class Tr, bool LOG, int THREADS, int ELEMS>
__global__ void __launch_bounds__(THREADS, (split_min_blocks<Tr, THREADS>()))
    softmax_split_kernel(const RowArgs<typename Tr::Storage> a, float2* stats, int* count,
                         int chunks) {
  using S = typename Tr::Storage;
  pdl_begin();
  constexpr int V = kVec<S>;
  constexpr int kPackStride = THREADS * V;
  __shared__ float red_max[kWarp];
  __shared__ float red_sum[kWarp];

  const int64_t row = blockIdx.x / chunks;
  const int chunk = static_cast<int>(blockIdx.x % chunks);
  const S* xrow = a.x + row * a.x_row_stride;
  S* orow = a.out + row * a.out_row_stride;
  const int64_t n = a.cols;
  const int64_t c_first = static_cast<int64_t>(chunk) * THREADS * ELEMS +
                          static_cast<int64_t>(threadIdx.x) * V - lead_of<V>(xrow);
  float v[ELEMS];
  // Each thread's statistics against its own max (0 for only -inf, so that its sum is 0, not
  // NaN); v keeps exp(x - shift) for softmax, x itself for log_softmax. The block then
  // combines the (max, sum) pairs in one reduction (one barrier, not one for the max and
  // one for the sum), and each thread rescales its own values at the end. (log_softmax
  // keeps x, not x - shift: fewer registers with exp_approx.)
  const float mx = load_part<Tr, ELEMS, kPackStride>(xrow, c_first, n, v);
  const float shift = mx == neg_inf() ? 0.f : mx;
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < ELEMS; ++i) {
    const float e = exp_approx(v[i] - shift);
    sum += e;
    if (!LOG) v[i] = e;
  }
  const float2 chunk_stats = block_reduce_stats(make_float2(mx, sum), red_max, red_sum);

  float2* row_stats = stats + row * chunks;
  if (threadIdx.x == 0) {
    row_stats[chunk] = chunk_stats;
    post_count(count + row);  // the pair is visible to any block that sees the new count
    while (acquire_count(count + row) < chunks) {
    }
  }
  __syncthreads();  // after thread 0's acquire: the pairs are visible to the block
  // Every warp combines the row's pairs itself (chunks <= kMaxSplitChunks: two per lane), so
  // no second barrier and no broadcast slot.
  static_assert(kMaxSplitChunks % kWarp == 0, "the row's pairs are read whole lanes at a time");
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  float2 p[kMaxSplitChunks / kWarp];
#pragma unroll
  for (int q = 0; q < kMaxSplitChunks / kWarp; ++q) {
    const int j = lane + q * kWarp;
    p[q] = j < chunks ? __ldcg(&row_stats[j]) : make_float2(neg_inf(), 0.f);
  }
  float m_row = p[0].x;
#pragma unroll
  for (int q = 1; q < kMaxSplitChunks / kWarp; ++q) m_row = fmaxf(m_row, p[q].x);
  m_row = group_max<kWarp>(m_row);
  const float row_shift = m_row == neg_inf() ? 0.f : m_row;
  float total = p[0].y * expf(p[0].x - row_shift);  // a pair of only -inf adds 0 * 0
#pragma unroll
  for (int q = 1; q < kMaxSplitChunks / kWarp; ++q) total += p[q].y * expf(p[q].x - row_shift);
  total = group_sum<kWarp>(total);
  // out = v * exp(shift - m_row) / total (softmax), v - m_row - log(total) (log).
  // A thread of only -inf in a row with a finite max has v = 0: its factor is 0 (exp(0 -
  // m_row) may overflow); its log_softmax outputs are -inf - m_row - log(total) = -inf. A
  // row of only -inf keeps m_row = -inf, and the factor inf (0 * inf) / -inf + inf make its
  // outputs NaN, as in torch.
  const bool empty = mx == neg_inf() && m_row != neg_inf();
  const float scale = LOG ? -m_row : (empty ? 0.f : expf(shift - m_row));
  const float post = LOG ? logf(total) : 1.f / total;
  store_part<Tr, ELEMS, kPackStride>(orow, c_first, n, v, [&](float t) {
    return LOG ? t + scale - post : t * scale * post;
  });
}

// ------------------------------------------------------------------------------ host
struct Launch {
  int sm_count;
  int64_t l2_bytes;
  cudaStream_t stream;
  bool pdl;  // programmatic dependent launch (common.cuh)
};

template <typename Kernel>
int resident_blocks(Kernel kernel, int threads) {
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
  return std::max(n, 1);
}

// The WARP and BLOCK grids are one resident wave (blocks per SM from the occupancy calculator,
// once per instantiation), fewer when there are fewer rows; each block strides over the rest.
template <class Tr, bool LOG, int ELEMS, int LANES>
void launch_warp(const RowArgs<typename Tr::Storage>& a, const Launch& l) {
  static const int per_sm =
      resident_blocks(softmax_warp_kernel<Tr, LOG, ELEMS, LANES>, kWarpKernelThreads);
  constexpr int64_t kRowsPerBlock = (kWarpKernelThreads / kWarp) * (kWarp / LANES);
  const int64_t wanted = (a.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t cap = static_cast<int64_t>(l.sm_count) * per_sm;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min(wanted, cap)));
  launch_pdl(l.pdl, softmax_warp_kernel<Tr, LOG, ELEMS, LANES>, dim3(grid),
             dim3(kWarpKernelThreads), l.stream, a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Rows of up to SPAN columns: ELEMS = max(V, SPAN / 32) per lane (at least one pack), on as
// many lanes as that takes (1 ... 32). Spans below V share V's instantiation.
template <class Tr, bool LOG, int SPAN>
void launch_warp_span(const RowArgs<typename Tr::Storage>& a, const Launch& l) {
  constexpr int V = kVec<typename Tr::Storage>;
  constexpr int kElems = std::max(V, SPAN / kWarp);
  constexpr int kLanes = std::max(1, SPAN / kElems);
  launch_warp<Tr, LOG, kElems, kLanes>(a, l);
}

template <class Tr, bool LOG, int THREADS, int ELEMS>
void launch_block(const RowArgs<typename Tr::Storage>& a, const Launch& l) {
  static const int per_sm = resident_blocks(softmax_block_kernel<Tr, LOG, THREADS, ELEMS>, THREADS);
  const int64_t cap = static_cast<int64_t>(l.sm_count) * per_sm;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min(a.rows, cap)));
  launch_pdl(l.pdl, softmax_block_kernel<Tr, LOG, THREADS, ELEMS>, dim3(grid), dim3(THREADS),
             l.stream, a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class Tr, bool LOG, int THREADS, int ELEMS>
void launch_split(const RowArgs<typename Tr::Storage>& a, int chunks, const at::Tensor& like,
                  const Launch& l) {
  const at::Tensor count = at::zeros({a.rows}, like.options().dtype(at::kInt));
  const at::Tensor stats = at::empty({a.rows, chunks, 2}, like.options().dtype(at::kFloat));
  const int64_t grid = a.rows * chunks;
  TORCH_CHECK(grid <= INT32_MAX, "softmax_cuda_out: too many rows for the split kernel");
  launch_pdl(l.pdl, softmax_split_kernel<Tr, LOG, THREADS, ELEMS>,
             dim3(static_cast<unsigned>(grid)), dim3(THREADS), l.stream, a,
             reinterpret_cast<float2*>(stats.mutable_data_ptr<float>()),
             count.mutable_data_ptr<int>(), chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class Tr, bool LOG, int V>
void launch_online(const RowArgs<typename Tr::Storage>& a, int threads, const Launch& l) {
  // Blocks per SM for each block size (32 << slot threads), asked once; 0 = not asked yet.
  static std::atomic<int> per_sm_cache[6];
  int slot = 0;
  while ((kWarp << slot) < threads) ++slot;
  int per_sm = per_sm_cache[slot].load(std::memory_order_relaxed);
  if (per_sm == 0) {
    per_sm = resident_blocks(softmax_online_kernel<Tr, LOG, V>, threads);
    per_sm_cache[slot].store(per_sm, std::memory_order_relaxed);
  }
  // Pass 2 rereads each row from L2 only if the rows in flight fit in it (with room for the
  // output passing through): fewer blocks per SM when rows are long. Every SM gets the same
  // number of blocks, so that the static row-to-block assignment stays balanced.
  const int64_t row_bytes = a.cols * static_cast<int64_t>(sizeof(typename Tr::Storage));
  const int64_t fit = l.l2_bytes / 2 / std::max<int64_t>(1, row_bytes * l.sm_count);
  const int64_t blocks_per_sm = std::max<int64_t>(1, std::min<int64_t>(fit, per_sm));
  const int grid =
      static_cast<int>(std::max<int64_t>(1, std::min(a.rows, blocks_per_sm * l.sm_count)));
  launch_pdl(l.pdl, softmax_online_kernel<Tr, LOG, V>, dim3(grid), dim3(threads), l.stream, a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

struct Problem {
  const void* x;
  void* out;
  int64_t rows, cols;
  int64_t x_row_stride, out_row_stride;
  bool coaligned;     // every x row and its out row sit at the same offset within 16 bytes
  bool rows_aligned;  // ... and that offset is 0 (no lead anywhere)
  const at::Tensor* like;  // x: device and stream of the SPLIT kernel's scratch
};

template <class Tr, bool LOG>
void launch_softmax(const Problem& p, const Launch& l) {
  using S = typename Tr::Storage;
  constexpr int V = kVec<S>;
  RowArgs<S> a;
  a.x = static_cast<const S*>(p.x);
  a.out = static_cast<S*>(p.out);
  a.rows = p.rows;
  a.cols = p.cols;
  a.x_row_stride = p.x_row_stride;
  a.out_row_stride = p.out_row_stride;

  if (!p.coaligned) {
    // Element by element, on the fewest threads (32 ... 1024) that cover a row in one step.
    int threads = kWarp;
    while (threads < kMaxThreads && static_cast<int64_t>(threads) * kOnlineStepElems < p.cols) {
      threads *= 2;
    }
    return launch_online<Tr, LOG, 1>(a, threads, l);
  }
  const int64_t span = p.cols + (p.rows_aligned ? 0 : V - 1);
  if (span <= kMaxWarpSpan) {
    if constexpr (sizeof(S) == 4) {
      // fp32 rows of 513-1024 columns: two warps a row, 16 values a lane, as the Triton
      // kernel takes them, not one warp with 32 (which was 1.18x slower at 4096 x 1000).
      if (next_pow2(span) == 1024) {
        return launch_block<Tr, LOG, 64, 16>(a, l);
      }
    }
    switch (std::max<int64_t>(next_pow2(span), V)) {
      case 4: return launch_warp_span<Tr, LOG, 4>(a, l);
      case 8: return launch_warp_span<Tr, LOG, 8>(a, l);
      case 16: return launch_warp_span<Tr, LOG, 16>(a, l);
      case 32: return launch_warp_span<Tr, LOG, 32>(a, l);
      case 64: return launch_warp_span<Tr, LOG, 64>(a, l);
      case 128: return launch_warp_span<Tr, LOG, 128>(a, l);
      case 256: return launch_warp_span<Tr, LOG, 256>(a, l);
      case 512: return launch_warp_span<Tr, LOG, 512>(a, l);
      case 1024: return launch_warp_span<Tr, LOG, 1024>(a, l);
      default: break;
    }
  } else if (span <= kMaxBlockSpan) {
    // <= 32 values per thread; 16 up to 8192 columns, where small blocks keep several rows
    // per SM in flight, but 32 on four warps for a 4096-wide span, as the Triton kernel
    // takes it (WARPS_4096 in ops/_softmax/rows.py); 512 x 32 rather than 1024 x 16 at
    // 16384 for two blocks per SM.
    switch (next_pow2(span)) {
      case 2048: return launch_block<Tr, LOG, 128, 16>(a, l);
      case 4096: return launch_block<Tr, LOG, 128, 32>(a, l);
      case 8192: return launch_block<Tr, LOG, 512, 16>(a, l);
      case 16384: return launch_block<Tr, LOG, 512, 32>(a, l);
      case 32768: return launch_block<Tr, LOG, 1024, 32>(a, l);
      default: break;
    }
  } else {
    // SPLIT: 8192 columns a block (256 threads x 32), 16384 (512 x 32) where a row would
    // take more than kMaxSplitChunks blocks; at most half the SMs' worth of blocks a row.
    const int64_t limit = std::min<int64_t>(kMaxSplitChunks, l.sm_count / 2);
    const int64_t small = (span + 8191) / 8192;
    const int64_t large = (span + 16383) / 16384;
    if (small <= limit) return launch_split<Tr, LOG, 256, 32>(a, small, *p.like, l);
    if (large <= limit) return launch_split<Tr, LOG, 512, 32>(a, large, *p.like, l);
    return launch_online<Tr, LOG, V>(a, kOnlineThreads, l);
  }
  TORCH_INTERNAL_ASSERT(false, "softmax_cuda_out: no kernel for a span of ", span, " columns");
}

template <class Tr>
void launch_dtype(const Problem& p, bool log, const Launch& l) {
  if (log) {
    launch_softmax<Tr, true>(p, l);
  } else {
    launch_softmax<Tr, false>(p, l);
  }
}

// x or out: CUDA, on x's device, x's dtype, 2-D of x's shape, unit column stride.
void check_matrix(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.is_cuda(), "softmax_cuda_out: ", name, " must be a CUDA tensor, got one on ",
              t.device());
  TORCH_CHECK(t.device() == x.device(), "softmax_cuda_out: ", name, " is on ", t.device(),
              " but x is on ", x.device());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "softmax_cuda_out: ", name, " has dtype ",
              t.scalar_type(), " but x has dtype ", x.scalar_type());
  TORCH_CHECK(t.dim() == 2, "softmax_cuda_out: ", name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.sizes() == x.sizes(), "softmax_cuda_out: ", name, " has shape ", t.sizes(),
              " but x has shape ", x.sizes());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "softmax_cuda_out: ", name,
              " must have stride(1) == 1, got strides ", t.strides());
}

}  // namespace

void softmax_cuda_out(const at::Tensor& x, bool log, at::Tensor& out) {
  TORCH_CHECK(x.is_cuda(), "softmax_cuda_out: x must be a CUDA tensor, got one on ", x.device());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "softmax_cuda_out: x must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(x.dim() == 2, "softmax_cuda_out: x must be 2-D, got ", x.dim(), "-D");
  check_matrix(x, "x", x);
  check_matrix(out, "out", x);
  const int64_t M = x.size(0);
  const int64_t N = x.size(1);
  if (M == 0 || N == 0) return;

  // Each output row is written by the threads that read it, after they read all of it: out's
  // rows may not overlap, and x sharing out's start must share its layout. (Partial overlap
  // at another offset is not detected, as in most out= kernels.)
  TORCH_CHECK(M == 1 || out.stride(0) >= N, "softmax_cuda_out: out rows overlap (stride(0) = ",
              out.stride(0), " < size(1) = ", N, ")");
  TORCH_CHECK(x.const_data_ptr() != out.const_data_ptr() || M == 1 ||
                  x.stride(0) == out.stride(0),
              "softmax_cuda_out: x aliases out with a different row stride");

  c10::cuda::CUDAGuard device_guard(x.device());

  Problem p;
  p.like = &x;
  p.x = x.const_data_ptr();
  p.out = out.mutable_data_ptr();
  p.rows = M;
  p.cols = N;
  // With a single row the row stride is never used (and may be anything).
  p.x_row_stride = M == 1 ? N : x.stride(0);
  p.out_row_stride = M == 1 ? N : out.stride(0);
  // Row r of x starts at x + r * x_stride elements: all rows share out's offset within 16
  // bytes when the starts do and the strides differ by a multiple of 16 bytes.
  const int64_t es = static_cast<int64_t>(x.element_size());
  const auto x_addr = reinterpret_cast<uintptr_t>(p.x);
  const auto out_addr = reinterpret_cast<uintptr_t>(p.out);
  p.coaligned = x_addr % kVecBytes == out_addr % kVecBytes &&
                (M == 1 || ((p.x_row_stride - p.out_row_stride) * es) % kVecBytes == 0);
  p.rows_aligned = p.coaligned && x_addr % kVecBytes == 0 &&
                   (M == 1 || (p.x_row_stride * es) % kVecBytes == 0);

  // getCurrentDeviceProperties is cached by ATen per device: no driver call per launch.
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  Launch l;
  l.sm_count = props->multiProcessorCount;
  l.l2_bytes = props->l2CacheSize;
  l.stream = at::cuda::getCurrentCUDAStream();
  l.pdl = pdl_enabled();

  switch (dtype) {
    case at::kFloat: launch_dtype<Fp32>(p, log, l); break;
    case at::kHalf: launch_dtype<Fp16>(p, log, l); break;
    case at::kBFloat16: launch_dtype<Bf16>(p, log, l); break;
    default: TORCH_CHECK(false, "softmax_cuda_out: unsupported dtype ", dtype);
  }
}

}  // namespace fuseml

TORCH_LIBRARY_FRAGMENT(fuseml, m) {
  m.def("softmax_cuda_out(Tensor x, bool log, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(fuseml, CUDA, m) {
  m.impl("softmax_cuda_out", &fuseml::softmax_cuda_out);
}

// Shape-only kernel for tracing (see elementwise.cu's): writes `out` only, returns nothing.
TORCH_LIBRARY_IMPL(fuseml, Meta, m) {
  m.impl("softmax_cuda_out", [](const at::Tensor&, bool, at::Tensor&) {});
}
