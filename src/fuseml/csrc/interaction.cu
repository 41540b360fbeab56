// The CUDA C++ twin of fuseml.ops.embedding_interaction (ops/_interaction_kernels.py): DLRM's
// embedding gather and dot interaction, one output row per sample,
//
//     out[b] = [x[b], tril(Z Z^T), zeros]    Z = [x[b], e_1, ..., e_T]  (F = T + 1 rows of d)
//
// with e_t row table_offsets[t] + ids[b, t] of the concatenated table w (one-hot), or the
// sum of the rows of bag t of sample b (bags: ids flat, bag t * B + b at
// ids[starts[t * B + b] .. starts[t * B + b + 1])), summed in float32 and rounded once to
// w's dtype as embedding_bag rounds. The kept triangle is tril_indices(F, F, -1) (or
// (F, F, 0) with the diagonal) in row-major order; each product is a float32 sum of exact
// products, rounded once to the output dtype.
//
// Four forms. From 8,192 samples, one-hot 16-bit tables with d = 16 (kaggle), contiguous
// 8-byte aligned rows and at most 32 rows of Z take the fragment form
// (interaction_frag_kernel): each lane loads its 8 bytes of four rows of Z straight into
// the MMA fragments (K taken in another order, which a sum over K does not see), rows two
// samples ahead. Other one-hot 16-bit tables with d of 16, 32, 64 or 128, aligned rows and
// at most 32 rows of Z (DLRM's 27) take the pipelined form (interaction_pipe_kernel): each warp
// strides over the samples, its rows copied by cp.async into a ring of Z buffers a few
// samples ahead of the one it forms on tensor cores. Otherwise one warp per sample: 16-bit
// tables with d a multiple of 16 and at most 32 rows of Z take tensor cores
// (interaction_mma_kernel): Z staged as stored, the Gram's lower 16 x 8 tiles by
// mma.sync, the kept entries placed in a staged output row that leaves 16 bytes a lane.
// The rest stage Z as float32 (row stride d + 1, so that lanes reading different rows at
// one column fall in different banks) and each lane takes every 32nd pair on the CUDA
// cores, so a warp's stores of one step land on consecutive columns: a DLRM sample's 351
// pairs of d = 16 products are ~530 instructions a lane there, against 6 MMAs.
//
// The gather is bound by latency: with one-hot ids a warp first resolves each table's row
// (its offset and id, one lane a table, all in flight together), then loads the rows with
// no load waiting on another, 16 bytes a lane where the rows are aligned. (Loading the id
// for every element made each lane wait on two loads in turn per element: 26 tables x 16
// columns at 235 us for kaggle's 65536 rows, 4.5x the Triton kernel.)

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cmath>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace fuseml {
namespace {

#include "common.cuh"

constexpr int kWarp = 32;
constexpr int kMaxWarps = 4;             // samples per block
constexpr int kSmemBytes = 48 * 1024;    // the default dynamic shared memory limit

struct Args {
  const void* x;
  int64_t x_s0, x_s1;
  const void* w;
  int64_t w_s0, w_s1;
  const void* toff;  // (T + 1,) int32 or int64
  int64_t toff_s;
  bool toff64;  // toff is int64
  const void* ids;  // (B, T), or flat (bags)
  int64_t ids_s0, ids_s1;
  const int64_t* starts;  // bags: (T * B + 1,)
  int32_t* bad;  // (T,) or null: bad[t] = 1 where an id of table t lies outside it
  void* out;              // (B, out_w) contiguous
  int64_t rows;
  int tables;  // T
  int d;
  int pairs;
  int out_w;
  bool self;  // keep the diagonal
};

// Row i and column j of kept pair p (row-major triangle; with the diagonal, row i has i + 1
// entries from i(i+1)/2, else i entries from i(i-1)/2). The square root's guess is off by
// at most one either way; the loops correct it exactly in integers.
__device__ __forceinline__ void pair_of(int p, bool self, int& i, int& j) {
  if (self) {
    i = static_cast<int>((sqrtf(8.0f * p + 1.0f) - 1.0f) * 0.5f);
    while (i * (i + 1) / 2 > p) --i;
    while ((i + 1) * (i + 2) / 2 <= p) ++i;
    j = p - i * (i + 1) / 2;
  } else {
    i = static_cast<int>((sqrtf(8.0f * p + 1.0f) + 1.0f) * 0.5f);
    while (i * (i - 1) / 2 > p) --i;
    while ((i + 1) * i / 2 <= p) ++i;
    j = p - i * (i - 1) / 2;
  }
}

template <typename Id>
__device__ __forceinline__ int64_t load_id(const void* base, int64_t at) {
  return static_cast<int64_t>(static_cast<const Id*>(base)[at]);
}

// Bytes of shared memory a warp takes: each table's row of w (int64; one-hot ids), then Z
// as float32 with rows of d + 1; rounded up to 16 so that the next warp's int64 rows stay
// aligned.
__host__ __device__ __forceinline__ int64_t warp_smem_bytes(int tables, int d) {
  const int64_t bytes =
      static_cast<int64_t>(tables) * 8 + static_cast<int64_t>(tables + 1) * (d + 1) * 4;
  return (bytes + 15) / 16 * 16;
}

// Elements of w's dtype in 16 bytes.
template <typename S>
constexpr int kVec = 16 / static_cast<int>(sizeof(S));

// One-hot ids: rows[t] = the row of w of table t's id for sample b, or -1 for an id outside
// its table (flagged in a.bad when given); then Z's rows 1..T from those rows.
template <typename Id, typename Off>
__device__ __forceinline__ void resolve_rows(const Args& a, int64_t b, int lane, int64_t* rows) {
  for (int t = lane; t < a.tables; t += kWarp) {
    const int64_t first = load_id<Off>(a.toff, t * a.toff_s);
    const int64_t size =
        a.bad != nullptr ? load_id<Off>(a.toff, (t + 1) * a.toff_s) - first : INT64_MAX;
    const int64_t id = load_id<Id>(a.ids, b * a.ids_s0 + t * a.ids_s1);
    const bool ok = id >= 0 && id < size;
    if (!ok && a.bad != nullptr) a.bad[t] = 1;
    rows[t] = ok ? first + id : -1;
  }
  __syncwarp();
}

// Can rows of w be read 16 bytes at a time (unit column stride, rows and w 16-byte
// aligned, d a multiple of the 16-byte vector)?
template <typename S>
__device__ __forceinline__ bool rows_vec16(const Args& a) {
  return a.w_s1 == 1 && a.d % kVec<S> == 0 && (a.w_s0 * sizeof(S)) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(a.w) % 16 == 0;
}

// Z's rows 1..T (row stride zs) from the resolved rows of w, zero where a row is -1: as
// float32 (kAsStored false), or in w's own 16-bit storage (kAsStored: 16-byte copies where
// rows_vec16 holds, Z's rows then 16-byte aligned).
template <typename Tr, bool kAsStored>
__device__ __forceinline__ void fill_rows(
    const Args& a, int lane, const int64_t* rows,
    std::conditional_t<kAsStored, typename Tr::Storage, float>* z, int zs) {
  using S = typename Tr::Storage;
  const S* w = static_cast<const S*>(a.w);
  const int d = a.d;
  constexpr int kV = kVec<S>;
  if (rows_vec16<S>(a)) {
    const int per_row = d / kV;
    const int cells = a.tables * per_row;
#pragma unroll 2
    for (int c = lane; c < cells; c += kWarp) {
      const int t = c / per_row;
      const int k = (c - t * per_row) * kV;
      const int64_t row = rows[t];
      uint4 raw = make_uint4(0u, 0u, 0u, 0u);  // (all-zero bits: 0 in every dtype)
      if (row >= 0) raw = *reinterpret_cast<const uint4*>(w + row * a.w_s0 + k);
      if constexpr (kAsStored) {
        *reinterpret_cast<uint4*>(z + (t + 1) * zs + k) = raw;
      } else {
        const S* e = reinterpret_cast<const S*>(&raw);
#pragma unroll
        for (int i = 0; i < kV; ++i) z[(t + 1) * zs + k + i] = Tr::to_float(e[i]);
      }
    }
    return;
  }
  const int cells = a.tables * d;
#pragma unroll 4
  for (int c = lane; c < cells; c += kWarp) {
    const int t = c / d;
    const int k = c - t * d;
    const int64_t row = rows[t];
    const S v = row >= 0 ? w[row * a.w_s0 + k * a.w_s1] : Tr::from_float(0.0f);
    if constexpr (kAsStored) {
      z[(t + 1) * zs + k] = v;
    } else {
      z[(t + 1) * zs + k] = Tr::to_float(v);
    }
  }
}

// The sample of the calling warp (one a warp), or -1 past the last; the kernel's first
// statement (pdl_begin: nothing touches global memory before it).
__device__ __forceinline__ int64_t warp_sample(const Args& a) {
  pdl_begin();
  const int64_t b = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  return b < a.rows ? b : -1;
}

// Column k of bag t of sample b, its rows summed in float32 and rounded once to w's dtype
// (as embedding_bag rounds); with a flag, an id outside its table is skipped and flags it.
template <typename Tr, typename Id, typename Off>
__device__ __forceinline__ typename Tr::Storage pooled(const Args& a, int64_t b, int t, int k) {
  using S = typename Tr::Storage;
  const S* w = static_cast<const S*>(a.w);
  const int64_t first = load_id<Off>(a.toff, t * a.toff_s);
  const int64_t size =
      a.bad != nullptr ? load_id<Off>(a.toff, (t + 1) * a.toff_s) - first : INT64_MAX;
  const int64_t bag = static_cast<int64_t>(t) * a.rows + b;
  float acc = 0.0f;
  for (int64_t e = a.starts[bag]; e < a.starts[bag + 1]; ++e) {
    const int64_t id = load_id<Id>(a.ids, e * a.ids_s0);
    if (id < 0 || id >= size) {
      if (a.bad != nullptr) a.bad[t] = 1;
      continue;
    }
    acc += Tr::to_float(w[(first + id) * a.w_s0 + k * a.w_s1]);
  }
  return Tr::from_float(acc);
}

// Z of sample b, row stride zs (float32, or w's storage with kAsStored; see fill_rows):
// row 0 is x, also copied as stored to the output row's first d columns; rows 1..T the
// gathered rows (one-hot), or each bag's rows pooled (lanes over (table, column)).
template <typename Tr, typename Id, typename Off, bool kBags, bool kAsStored>
__device__ __forceinline__ void fill_z(
    const Args& a, int64_t b, int lane, int64_t* rows,
    std::conditional_t<kAsStored, typename Tr::Storage, float>* z, int zs,
    typename Tr::Storage* out_row) {
  using S = typename Tr::Storage;
  const S* x = static_cast<const S*>(a.x);
  const int d = a.d;
  for (int k = lane; k < d; k += kWarp) {
    const S v = x[b * a.x_s0 + k * a.x_s1];
    if constexpr (kAsStored) {
      z[k] = v;
    } else {
      z[k] = Tr::to_float(v);
    }
    out_row[k] = v;
  }
  if constexpr (!kBags) {
    resolve_rows<Id, Off>(a, b, lane, rows);
    fill_rows<Tr, kAsStored>(a, lane, rows, z, zs);
  } else {
    const int cells = a.tables * d;
    for (int c = lane; c < cells; c += kWarp) {
      const int t = c / d;
      const int k = c - t * d;
      const S v = pooled<Tr, Id, Off>(a, b, t, k);
      if constexpr (kAsStored) {
        z[(t + 1) * zs + k] = v;
      } else {
        z[(t + 1) * zs + k] = Tr::to_float(v);
      }
    }
  }
  __syncwarp();
}

template <typename Tr, typename Id, typename Off, bool kBags>
__global__ void interaction_kernel(Args a) {
  using S = typename Tr::Storage;
  extern __shared__ int64_t smem_i64[];
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t b = warp_sample(a);
  if (b < 0) return;
  const int d = a.d;
  const int stride = d + 1;
  char* mine = reinterpret_cast<char*>(smem_i64) + warp * warp_smem_bytes(a.tables, d);
  int64_t* rows = reinterpret_cast<int64_t*>(mine);
  float* z = reinterpret_cast<float*>(mine + static_cast<int64_t>(a.tables) * 8);
  S* out = static_cast<S*>(a.out) + b * a.out_w;

  fill_z<Tr, Id, Off, kBags, false>(a, b, lane, rows, z, stride, out);

  for (int p = lane; p < a.pairs; p += kWarp) {
    int i, j;
    pair_of(p, a.self, i, j);
    const float* zi = z + i * stride;
    const float* zj = z + j * stride;
    float acc = 0.0f;
    for (int k = 0; k < d; ++k) acc = fmaf(zi[k], zj[k], acc);
    out[d + p] = Tr::from_float(acc);
  }
  const S zero = Tr::from_float(0.0f);
  for (int c = d + a.pairs + lane; c < a.out_w; c += kWarp) out[c] = zero;
}

// ---------------------------------------------------------------- tensor-core form
// 16-bit tables, d a multiple of 16, F = T + 1 <= 32 rows: the warp stages Z as stored
// (16-bit, row stride d + 8 elements, so that the 8 rows a fragment load touches fall in
// different banks), forms the Gram's lower 16 x 8 tiles with mma.sync m16n8k16 (float32
// accumulation; 6 tiles at F = 27 against the 351 x d FMAs a lane set costs on the CUDA
// cores), puts every kept entry at its place in a staged output row, and stores the row
// 16 bytes a lane where it is aligned. Each entry is a float32 sum of exact products,
// rounded once, as in the FMA form.

constexpr int kMmaRows = 32;  // Z's rows padded to two 16-row tiles

__host__ __device__ __forceinline__ int64_t round16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// Shared memory a warp takes in the tensor-core form: the tables' rows of w (int64), Z
// (kMmaRows x (d + 8), 16-bit) and the output row (out_w, 16-bit).
__host__ __device__ __forceinline__ int64_t mma_warp_smem_bytes(int tables, int d, int out_w) {
  return round16(static_cast<int64_t>(tables) * 8) +
         round16(static_cast<int64_t>(kMmaRows) * (d + 8) * 2) +
         round16(static_cast<int64_t>(out_w) * 2);
}

// c += A (16 x 16, row-major) B (16 x 8, column-major), float32 accumulation; the 16-bit
// operands in b32 pairs as mma.sync m16n8k16 lays its fragments out.
#define MMA_16816_ASM(TYPE)                                                              \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                       \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"       \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

template <typename Tr>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<Tr, Bf16>) {
    MMA_16816_ASM("bf16");
  } else {
    static_assert(std::is_same_v<Tr, Fp16>, "mma_16816: 16-bit storage only");
    MMA_16816_ASM("f16");
  }
#else
  __trap();  // (the host takes this form on sm_80 and later only)
#endif
}
#undef MMA_16816_ASM

// Output column of Gram entry (i, j) (after x's d columns), or -1 where it is not kept.
__device__ __forceinline__ int kept_column(int i, int j, int f, bool self) {
  if (i >= f) return -1;
  if (self) return j <= i ? i * (i + 1) / 2 + j : -1;
  return j < i ? i * (i - 1) / 2 + j : -1;
}

template <typename Tr, typename Id, typename Off, bool kBags>
__global__ void interaction_mma_kernel(Args a) {
  using S = typename Tr::Storage;  // 16-bit
  extern __shared__ int64_t smem_i64[];
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t b = warp_sample(a);
  if (b < 0) return;
  const int d = a.d;
  const int f = a.tables + 1;
  const int zs = d + 8;  // Z's row stride, elements
  char* mine = reinterpret_cast<char*>(smem_i64) + warp * mma_warp_smem_bytes(a.tables, d, a.out_w);
  int64_t* rows = reinterpret_cast<int64_t*>(mine);
  S* z = reinterpret_cast<S*>(mine + round16(static_cast<int64_t>(a.tables) * 8));
  S* row_out = z + kMmaRows * zs;  // (16-byte aligned: Z's bytes are a multiple of 16)
  constexpr int kV = kVec<S>;

  // (Z's rows F..31 stay as they are: they meet only Gram entries not kept)
  fill_z<Tr, Id, Off, kBags, true>(a, b, lane, rows, z, zs, row_out);

  // The Gram's lower tiles: rows rb..rb+15 against rows cb..cb+7 of Z, for every column
  // tile that holds a kept entry. Lane (g, q) = (lane / 4, lane % 4) loads the 16-bit pairs
  // its fragments hold: A's rows g and g + 8, B's row (Z's) g, columns 2q and 2q + 8.
  const int g = lane >> 2;
  const int q = lane & 3;
  const uint32_t* z32 = reinterpret_cast<const uint32_t*>(z);
  const int zs32 = zs / 2;  // row stride in 32-bit words
  for (int rb = 0; rb < f; rb += 16) {
    for (int cb = 0; cb < f && cb <= rb + 15; cb += 8) {
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int k0 = 0; k0 < d; k0 += 16) {
        const int w0 = k0 / 2 + q;  // word of columns (k0 + 2q, k0 + 2q + 1)
        uint32_t fa[4];
        fa[0] = z32[(rb + g) * zs32 + w0];
        fa[1] = z32[(rb + g + 8) * zs32 + w0];
        fa[2] = z32[(rb + g) * zs32 + w0 + 4];
        fa[3] = z32[(rb + g + 8) * zs32 + w0 + 4];
        const uint32_t b0 = z32[(cb + g) * zs32 + w0];
        const uint32_t b1 = z32[(cb + g) * zs32 + w0 + 4];
        mma_16816<Tr>(c, fa, b0, b1);
      }
      // c[0], c[1]: entry (rb + g, cb + 2q + {0, 1}); c[2], c[3]: row rb + g + 8
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = rb + g + (e >> 1) * 8;
        const int j = cb + 2 * q + (e & 1);
        const int col = kept_column(i, j, f, a.self);
        if (col >= 0) row_out[d + col] = Tr::from_float(c[e]);
      }
    }
  }
  const S zero = Tr::from_float(0.0f);
  for (int col = d + a.pairs + lane; col < a.out_w; col += kWarp) row_out[col] = zero;
  __syncwarp();

  // The staged row to out[b]: 16 bytes a lane where the rows are 16-byte aligned
  S* out = static_cast<S*>(a.out) + b * a.out_w;
  if ((a.out_w * sizeof(S)) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0) {
    const uint4* src = reinterpret_cast<const uint4*>(row_out);
    uint4* dst = reinterpret_cast<uint4*>(out);
    for (int c = lane; c < a.out_w / kV; c += kWarp) store_weak(dst + c, src[c]);
  } else {
    for (int col = lane; col < a.out_w; col += kWarp) out[col] = row_out[col];
  }
}

#include "interaction_pipe.cuh"  // the pipelined tensor-core form
#include "interaction_frag.cuh"  // d = 16: rows straight into MMA fragments

// Does the tensor-core form serve this call? 16-bit tables on sm_80 and later, d a
// multiple of 16, at most kMmaRows rows of Z, a warp's staging within the limit.
template <typename Tr>
bool mma_form(const Args& a) {
  if constexpr (sizeof(typename Tr::Storage) != 2) {
    return false;
  } else {
    return at::cuda::getCurrentDeviceProperties()->major >= 8 && a.d % 16 == 0 &&
           a.tables + 1 <= kMmaRows && mma_warp_smem_bytes(a.tables, a.d, a.out_w) <= kSmemBytes;
  }
}

template <typename Tr, typename Id, typename Off>
void launch_ids(const Args& a, bool bags, cudaStream_t stream, bool pdl) {
  if constexpr (sizeof(typename Tr::Storage) == 2) {
    if (mma_form<Tr>(a) && !bags && frag_form<typename Tr::Storage>(a)) {
      launch_frag<Tr, Id>(a, stream, pdl);
      return;
    }
    if (mma_form<Tr>(a) && !bags && pipe_form<typename Tr::Storage>(a)) {
      launch_pipe<Tr, Id>(a, stream, pdl);
      return;
    }
    if (mma_form<Tr>(a)) {
      const int64_t per_warp = mma_warp_smem_bytes(a.tables, a.d, a.out_w);
      const int warps = static_cast<int>(std::min<int64_t>(kMaxWarps, kSmemBytes / per_warp));
      const int64_t blocks = (a.rows + warps - 1) / warps;
      auto kernel = bags ? interaction_mma_kernel<Tr, Id, Off, true>
                         : interaction_mma_kernel<Tr, Id, Off, false>;
      launch_pdl_smem(pdl, kernel, dim3(static_cast<unsigned>(blocks)), dim3(warps * kWarp),
                      static_cast<size_t>(warps * per_warp), stream, a);
      return;
    }
  }
  const int64_t per_warp = warp_smem_bytes(a.tables, a.d);
  TORCH_CHECK(per_warp <= kSmemBytes, "embedding_interaction_cuda_out: T int64 rows and "
              "(T + 1) x (d + 1) float32 must fit 48 KiB of shared memory, got T = ", a.tables,
              ", d = ", a.d);
  const int warps = static_cast<int>(std::min<int64_t>(kMaxWarps, kSmemBytes / per_warp));
  const int64_t blocks = (a.rows + warps - 1) / warps;
  const dim3 grid(static_cast<unsigned>(blocks));
  const dim3 block(warps * kWarp);
  const size_t smem = static_cast<size_t>(warps * per_warp);
  auto kernel =
      bags ? interaction_kernel<Tr, Id, Off, true> : interaction_kernel<Tr, Id, Off, false>;
  launch_pdl_smem(pdl, kernel, grid, block, smem, stream, a);
}

template <typename Tr, typename Id>
void launch_offsets(const Args& a, at::ScalarType off_type, bool bags, cudaStream_t stream,
                    bool pdl) {
  if (off_type == at::kInt) {
    launch_ids<Tr, Id, int32_t>(a, bags, stream, pdl);
  } else {
    launch_ids<Tr, Id, int64_t>(a, bags, stream, pdl);
  }
}

template <typename Tr>
void launch_dtype(const Args& a, at::ScalarType id_type, at::ScalarType off_type, bool bags,
                  cudaStream_t stream, bool pdl) {
  if (id_type == at::kInt) {
    launch_offsets<Tr, int32_t>(a, off_type, bags, stream, pdl);
  } else {
    launch_offsets<Tr, int64_t>(a, off_type, bags, stream, pdl);
  }
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.is_cuda() && t.device() == x.device(), "embedding_interaction_cuda_out: ", name,
              " is on ", t.device(), " but x is on ", x.device());
}

}  // namespace

// The arguments are the Python op's, validated there; the checks here guard the kernel's
// own assumptions (devices, dtypes, shapes it indexes by).
void embedding_interaction_cuda_out(const at::Tensor& x, const at::Tensor& weight,
                                    const at::Tensor& table_offsets, const at::Tensor& ids,
                                    const std::optional<at::Tensor>& bag_starts,
                                    bool self_interaction, at::Tensor& out,
                                    const std::optional<at::Tensor>& bad_ids) {
  TORCH_CHECK(x.is_cuda(), "embedding_interaction_cuda_out: x must be a CUDA tensor, got one on ",
              x.device());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "embedding_interaction_cuda_out: x must be float32, float16 or bfloat16, got ",
              dtype);
  TORCH_CHECK(x.dim() == 2, "embedding_interaction_cuda_out: x must be 2-D, got ", x.dim(), "-D");
  check_same_device(weight, "weight", x);
  check_same_device(table_offsets, "table_offsets", x);
  check_same_device(ids, "ids", x);
  check_same_device(out, "out", x);
  TORCH_CHECK(weight.scalar_type() == dtype && out.scalar_type() == dtype,
              "embedding_interaction_cuda_out: weight and out must have x's dtype ", dtype);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1),
              "embedding_interaction_cuda_out: weight must be (rows, ", x.size(1), "), got ",
              weight.sizes());
  const auto id_type = ids.scalar_type();
  const auto off_type = table_offsets.scalar_type();
  TORCH_CHECK((id_type == at::kInt || id_type == at::kLong) &&
                  (off_type == at::kInt || off_type == at::kLong),
              "embedding_interaction_cuda_out: ids and table_offsets must be int32 or int64, "
              "got ", id_type, " and ", off_type);
  const int64_t rows = x.size(0);
  const int64_t tables = table_offsets.size(0) - 1;
  const bool bags = bag_starts.has_value();
  if (bags) {
    TORCH_CHECK(ids.dim() == 1, "embedding_interaction_cuda_out: bags' ids must be 1-D");
    const at::Tensor& s = *bag_starts;
    check_same_device(s, "bag_starts", x);
    TORCH_CHECK(s.scalar_type() == at::kLong && s.dim() == 1 && s.size(0) == tables * rows + 1 &&
                    s.stride(0) == 1,
                "embedding_interaction_cuda_out: bag_starts must be contiguous int64 of (T * B "
                "+ 1,) = (", tables * rows + 1, ",), got ", s.sizes());
  } else {
    TORCH_CHECK(ids.dim() == 2 && ids.size(0) == rows && ids.size(1) == tables,
                "embedding_interaction_cuda_out: ids must be (", rows, ", ", tables, "), got ",
                ids.sizes());
  }
  if (bad_ids.has_value()) {
    const at::Tensor& f = *bad_ids;
    check_same_device(f, "bad_ids", x);
    TORCH_CHECK(f.scalar_type() == at::kInt && f.dim() == 1 && f.size(0) == tables &&
                    f.stride(0) == 1,
                "embedding_interaction_cuda_out: bad_ids must be contiguous int32 of (T,) = (",
                tables, ",), got ", f.scalar_type(), " ", f.sizes());
  }
  const int64_t f = tables + 1;
  const int64_t pairs = self_interaction ? f * (f + 1) / 2 : f * (f - 1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) >= x.size(1) + pairs &&
                  out.is_contiguous(),
              "embedding_interaction_cuda_out: out must be contiguous (", rows, ", >= ",
              x.size(1) + pairs, "), got ", out.sizes());
  if (rows == 0) return;

  c10::cuda::CUDAGuard device_guard(x.device());
  Args a;
  a.x = x.const_data_ptr();
  a.x_s0 = x.stride(0);
  a.x_s1 = x.stride(1);
  a.w = weight.const_data_ptr();
  a.w_s0 = weight.stride(0);
  a.w_s1 = weight.stride(1);
  a.toff = table_offsets.const_data_ptr();
  a.toff_s = table_offsets.stride(0);
  a.toff64 = off_type == at::kLong;
  a.ids = ids.const_data_ptr();
  a.ids_s0 = ids.stride(0);
  a.ids_s1 = bags ? 0 : ids.stride(1);
  a.starts = bags ? bag_starts->const_data_ptr<int64_t>() : nullptr;
  a.out = out.mutable_data_ptr();
  a.bad = bad_ids.has_value() ? bad_ids->mutable_data_ptr<int32_t>() : nullptr;
  a.rows = rows;
  a.tables = static_cast<int>(tables);
  a.d = static_cast<int>(x.size(1));
  a.pairs = static_cast<int>(pairs);
  a.out_w = static_cast<int>(out.size(1));
  a.self = self_interaction;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool pdl = pdl_enabled();
  switch (dtype) {
    case at::kFloat: launch_dtype<Fp32>(a, id_type, off_type, bags, stream, pdl); break;
    case at::kHalf: launch_dtype<Fp16>(a, id_type, off_type, bags, stream, pdl); break;
    case at::kBFloat16: launch_dtype<Bf16>(a, id_type, off_type, bags, stream, pdl); break;
    default: TORCH_CHECK(false, "embedding_interaction_cuda_out: unsupported dtype ", dtype);
  }
}

}  // namespace fuseml

TORCH_LIBRARY_FRAGMENT(fuseml, m) {
  m.def(
      "embedding_interaction_cuda_out(Tensor x, Tensor weight, Tensor table_offsets, Tensor ids, "
      "Tensor? bag_starts, bool self_interaction, Tensor(a!) out, Tensor(b!)? bad_ids) -> ()");
}

TORCH_LIBRARY_IMPL(fuseml, CUDA, m) {
  m.impl("embedding_interaction_cuda_out", &fuseml::embedding_interaction_cuda_out);
}

// Shape-only kernel for tracing (see elementwise.cu's): writes `out` and `bad_ids` only,
// returns nothing.
TORCH_LIBRARY_IMPL(fuseml, Meta, m) {
  m.impl("embedding_interaction_cuda_out",
         [](const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
            const std::optional<at::Tensor>&, bool, at::Tensor&,
            const std::optional<at::Tensor>&) {});
}
