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
// Three forms. One-hot 16-bit tables with d of 16, 32, 64 or 128, aligned rows and at most
// 32 rows of Z (DLRM's 27) take the pipelined form (interaction_pipe_kernel): each warp
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

// ------------------------------------------------------ pipelined tensor-core form
// One-hot ids, the tensor-core form, rows and x 16-byte aligned. One warp per sample keeps
// too few loads in flight (each sample: its ids, then its rows, then the Gram), so here
// each warp strides over the samples (warp k of K takes k, k + K, ...) and copies each
// sample's x and rows into a ring of Z buffers with cp.async, up to three samples ahead of
// the one it forms (ids one further, in registers): the copies in flight hold no
// registers. A sample's Z serves both MMA operands (B's fragments for columns c..c+7 are
// A's for rows c..c+7), read by ldmatrix; the kept entries go to a staged output row,
// stored 16 bytes a lane. What does not change from sample to sample (each table's first
// row and size, where a lane's accumulator entries land, which of them are kept) is
// worked out once per warp.

constexpr int kMaxStages = 4;
constexpr int64_t kPipeWarpBytes = 12 * 1024;  // a warp's buffers: 4 warps a 48 KiB block

// Bytes of one Z buffer: F rows of d + 8 16-bit elements (the 8 rows one ldmatrix reads
// fall in different banks).
__host__ __device__ __forceinline__ int64_t pipe_z_bytes(int tables, int d) {
  return round16(static_cast<int64_t>(tables + 1) * (d + 8) * 2);
}

// Z buffers a warp rings through: as many as fit kPipeWarpBytes beside the output row, 2
// to kMaxStages (0: not even 2 fit).
__host__ __device__ __forceinline__ int pipe_stages(int tables, int d, int out_w) {
  const int64_t room = kPipeWarpBytes - round16(static_cast<int64_t>(out_w) * 2);
  const int64_t n = room > 0 ? room / pipe_z_bytes(tables, d) : 0;
  return n < 2 ? 0 : static_cast<int>(n < kMaxStages ? n : kMaxStages);
}

__host__ __device__ __forceinline__ int64_t pipe_warp_smem_bytes(int tables, int d, int out_w) {
  return pipe_stages(tables, d, out_w) * pipe_z_bytes(tables, d) +
         round16(static_cast<int64_t>(out_w) * 2);
}

// 16 bytes from global to shared memory, in flight until waited for; zeros where !ok
// (nothing read: src may be any valid address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" : : "r"(s), "l"(src),
               "r"(ok ? 16 : 0) : "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" : : : "memory");
#endif
}

// Wait until at most n (< kMaxStages) committed groups of this thread are in flight.
__device__ __forceinline__ void cp_async_wait(int n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (n >= 3) {
    asm volatile("cp.async.wait_group 3;" : : : "memory");
  } else if (n == 2) {
    asm volatile("cp.async.wait_group 2;" : : : "memory");
  } else {
    asm volatile("cp.async.wait_group 1;" : : : "memory");
  }
#endif
}

// Four 8 x 8 16-bit matrices from shared memory; lane l gives the address of row l % 8 of
// matrix l / 8, and r[m] holds row lane / 4, columns 2 (lane % 4) + {0, 1} of matrix m.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(src));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
#else
  __trap();
#endif
}

// Hold v in a register across the sample loop: an opaque copy the compiler cannot work out
// again in the loop (under the 64-register bound it would rather recompute what a lane's
// accumulator entries are than keep it).
template <typename T>
__device__ __forceinline__ T pinned(T v) {
  if constexpr (sizeof(T) == 8) {
    asm volatile("" : "+l"(v));
  } else {
    asm volatile("" : "+r"(v));
  }
  return v;
}

// Widths of d the pipelined form is built for (d / 8 16-byte pieces a row: 2 to 16).
constexpr bool pipe_width(int d) { return d == 16 || d == 32 || d == 64 || d == 128; }

// (64 registers a thread, 32 warps an SM, where d <= 32; wider rows take fewer warps an SM
// anyway, for their buffers)
template <typename Tr, typename Id, int kD>
__global__ void __launch_bounds__(kMaxWarps * kWarp, kD <= 32 ? 8 : 4)
    interaction_pipe_kernel(Args a) {
  using S = typename Tr::Storage;  // 16-bit
  constexpr int kV = kVec<S>;
  constexpr int kPieces = kD / kV;           // 16-byte pieces of a row of Z
  constexpr int kZs = kD + 8;                // Z's row stride, elements
  constexpr int kRowsPerRound = kWarp / kPieces;
  constexpr int kRounds = (kMmaRows + kRowsPerRound - 1) / kRowsPerRound;
  pdl_begin();
  extern __shared__ int64_t smem_i64[];
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  const int64_t step = static_cast<int64_t>(gridDim.x) * warps;
  int64_t b = static_cast<int64_t>(blockIdx.x) * warps + warp;
  if (b >= a.rows) return;
  const int tables = a.tables;
  const int f = tables + 1;
  const int stages = pipe_stages(tables, kD, a.out_w);
  const int64_t z_bytes = pipe_z_bytes(tables, kD);
  char* mine = reinterpret_cast<char*>(smem_i64) + warp * pipe_warp_smem_bytes(tables, kD, a.out_w);
  S* row_out = reinterpret_cast<S*>(mine + stages * z_bytes);

  // Lane t < T: table t's first row and size, once.
  int64_t first = 0, size = INT64_MAX;
  if (lane < tables) {
    first = a.toff64 ? load_id<int64_t>(a.toff, lane * a.toff_s)
                     : load_id<int32_t>(a.toff, lane * a.toff_s);
    if (a.bad != nullptr) {
      const int64_t end = a.toff64 ? load_id<int64_t>(a.toff, (lane + 1) * a.toff_s)
                                   : load_id<int32_t>(a.toff, (lane + 1) * a.toff_s);
      size = end - first;
    }
  }
  const S zero = Tr::from_float(0.0f);  // the padding columns, the same for every sample
  for (int col = kD + a.pairs + lane; col < a.out_w; col += kWarp) row_out[col] = zero;
  const Id* ids = static_cast<const Id*>(a.ids) + (lane < tables ? lane * a.ids_s1 : 0);
  auto id_of = [&](int64_t s) -> Id {  // (32-bit ids stay 32-bit in registers)
    return s < a.rows && lane < tables ? ids[s * a.ids_s0] : Id(0);
  };
  // Round r of a sample's copies: lane l takes piece l % kPieces of table
  // l / kPieces + r * kRowsPerRound (Z's row one more); lanes < kPieces also x's row.
  const int piece = lane % kPieces;
  const int t_lane = lane / kPieces;
  const S* w_piece = static_cast<const S*>(a.w) + piece * kV;
  const S* x_piece = static_cast<const S*>(a.x) + piece * kV;
  const int dst_lane = ((t_lane + 1) * kZs + piece * kV) * 2;  // bytes into a Z buffer
  auto issue = [&](int64_t s, int64_t id, int slot) {
    char* zb = mine + slot * z_bytes;
    long long row = -1;  // lane t: table t's row of w times its stride, or -1 (outside)
    if (lane < tables) {
      const bool ok = id >= 0 && id < size;
      if (!ok && a.bad != nullptr) a.bad[lane] = 1;
      row = ok ? (first + id) * a.w_s0 : -1;
    }
    if (lane < kPieces) cp_async16(zb + piece * kV * 2, x_piece + s * a.x_s0, true);
#pragma unroll 2
    for (int r = 0; r < kRounds; ++r) {
      if (r * kRowsPerRound >= tables) break;
      const int t = t_lane + r * kRowsPerRound;
      const long long at = __shfl_sync(0xffffffffu, row, t < tables ? t : 0);
      if (t < tables) {
        cp_async16(zb + dst_lane + r * kRowsPerRound * kZs * 2, at >= 0 ? w_piece + at : w_piece,
                   at >= 0);
      }
    }
  };
  Id first_ids[kMaxStages];  // (all in flight at once, then the first copies)
#pragma unroll
  for (int s = 0; s < kMaxStages; ++s) first_ids[s] = s < stages ? id_of(b + s * step) : Id(0);
#pragma unroll
  for (int s = 0; s < kMaxStages - 1; ++s) {
    if (s >= stages - 1) break;
    const int64_t bs = b + s * step;
    if (bs < a.rows) issue(bs, first_ids[s], s);
    cp_async_commit();
  }
  Id id_next = stages == kMaxStages ? first_ids[kMaxStages - 1]
               : stages == 3        ? first_ids[2]
                                    : first_ids[1];

  // ldmatrix rows of this lane: matrix m = lane / 8 holds rows (m % 2) * 8 + 0..7 and
  // columns (m / 2) * 8 + 0..7 of a 16 x 16 tile; rows past F read row 0 (their Gram
  // entries are not kept)
  const int m = lane >> 3;
  int r_lo = (m & 1) * 8 + (lane & 7);
  int r_hi = r_lo + 16;
  if (r_lo >= f) r_lo = 0;
  if (r_hi >= f) r_hi = 0;
  const int lo_at = pinned(r_lo * kZs + (m >> 1) * 8);
  const int hi_at = pinned(r_hi * kZs + (m >> 1) * 8);
  // Gram tiles t (rows rb, columns cb): (0, 0), (0, 8), (16, 0), (16, 8), (16, 16),
  // (16, 24): every kept entry for F <= 32. Accumulator entry e of tile t is (rb + g +
  // 8 (e / 2), cb + 2 q + e % 2), lane = 4 g + q; it lands at column tri[k] + cb + e % 2
  // of the triangle, k = rb / 8 + e / 2, where it is kept (bit 4 t + e of keep).
  const int g = lane >> 2;
  const int q = lane & 3;
  int tri[4];
  uint32_t keep = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int i = g + 8 * k;
    tri[k] = pinned((a.self ? i * (i + 1) / 2 : i * (i - 1) / 2) + 2 * q);
  }
#pragma unroll
  for (int t = 0; t < 6; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = (t < 2 ? 0 : 16) + g + 8 * (e >> 1);
      const int j = (t < 2 ? t * 8 : (t - 2) * 8) + 2 * q + (e & 1);
      if (i < f && (a.self ? j <= i : j < i)) keep |= 1u << (4 * t + e);
    }
  }
  keep = pinned(keep);
  S* tri_out = row_out + kD;
  S* out_row = static_cast<S*>(a.out) + b * a.out_w;
  const int64_t out_step = step * a.out_w;
  const int n_vec = (a.out_w * sizeof(S)) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0
                        ? a.out_w / kV
                        : 0;

  int slot = 0;
  for (; b < a.rows; b += step, out_row += out_step) {
    const int64_t ahead = b + (stages - 1) * step;
    if (ahead < a.rows) issue(ahead, id_next, slot == 0 ? stages - 1 : slot - 1);
    cp_async_commit();
    id_next = id_of(ahead + step);
    cp_async_wait(stages - 1);  // sample b's copies have landed
    __syncwarp();

    const S* z = reinterpret_cast<const S*>(mine + slot * z_bytes);
    float c[6][4] = {};
#pragma unroll 2
    for (int k0 = 0; k0 < kD; k0 += 16) {
      uint32_t lo[4], hi[4];
      ldmatrix_x4(lo, z + lo_at + k0);
      ldmatrix_x4(hi, z + hi_at + k0);
      mma_16816<Tr>(c[0], lo, lo[0], lo[2]);
      mma_16816<Tr>(c[1], lo, lo[1], lo[3]);
      mma_16816<Tr>(c[2], hi, lo[0], lo[2]);
      mma_16816<Tr>(c[3], hi, lo[1], lo[3]);
      mma_16816<Tr>(c[4], hi, hi[0], hi[2]);
      mma_16816<Tr>(c[5], hi, hi[1], hi[3]);
    }
#pragma unroll
    for (int t = 0; t < 6; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = (t < 2 ? 0 : 2) + (e >> 1);
        const int cb = t < 2 ? t * 8 : (t - 2) * 8;
        if (keep & (1u << (4 * t + e))) tri_out[tri[k] + cb + (e & 1)] = Tr::from_float(c[t][e]);
      }
    }
    if (lane < kPieces) {  // x, as stored
      reinterpret_cast<uint4*>(row_out)[lane] = reinterpret_cast<const uint4*>(z)[lane];
    }
    __syncwarp();

    if (n_vec > 0) {
      const uint4* src = reinterpret_cast<const uint4*>(row_out);
      uint4* dst = reinterpret_cast<uint4*>(out_row);
#pragma unroll 1
      for (int k = lane; k < n_vec; k += kWarp) store_weak(dst + k, src[k]);
    } else {
#pragma unroll 1
      for (int col = lane; col < a.out_w; col += kWarp) out_row[col] = row_out[col];
    }
    slot = slot + 1 == stages ? 0 : slot + 1;
  }
}

// Blocks of `kernel` an SM holds at once with this block and shared memory, asked of the
// runtime once per (kernel, device, block, shared memory): the query is host time a call.
template <typename K>
int blocks_per_sm(K kernel, int threads, size_t smem) {
  static std::mutex lock;
  static std::map<std::tuple<const void*, int, int, size_t>, int> known;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel),
                                   static_cast<int>(c10::cuda::current_device()), threads, smem);
  {
    std::lock_guard<std::mutex> guard(lock);
    const auto it = known.find(key);
    if (it != known.end()) return it->second;
  }
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  std::lock_guard<std::mutex> guard(lock);
  known[key] = per_sm;
  return per_sm;
}

template <typename Tr, typename Id>
void launch_pipe(const Args& a, cudaStream_t stream, bool pdl) {
  const auto kernel = a.d == 16   ? interaction_pipe_kernel<Tr, Id, 16>
                      : a.d == 32 ? interaction_pipe_kernel<Tr, Id, 32>
                      : a.d == 64 ? interaction_pipe_kernel<Tr, Id, 64>
                                  : interaction_pipe_kernel<Tr, Id, 128>;
  const int64_t per_warp = pipe_warp_smem_bytes(a.tables, a.d, a.out_w);
  const int warps = static_cast<int>(std::min<int64_t>(kMaxWarps, kSmemBytes / per_warp));
  const size_t smem = static_cast<size_t>(warps * per_warp);
  const int per_sm = blocks_per_sm(kernel, warps * kWarp, smem);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((a.rows + warps - 1) / warps, std::max(per_sm, 1) * sms);
  launch_pdl_smem(pdl, kernel, dim3(static_cast<unsigned>(blocks)), dim3(warps * kWarp), smem,
                  stream, a);
}

// Does the pipelined form serve this call? One-hot ids, the tensor-core form, d of 16,
// 32, 64 or 128, x and the rows of w 16-byte aligned, two Z buffers and the output row
// within a warp's share.
template <typename S>
bool pipe_form(const Args& a) {
  const auto aligned = [](const void* p, int64_t s0, int64_t s1) {
    return s1 == 1 && (s0 * static_cast<int64_t>(sizeof(S))) % 16 == 0 &&
           reinterpret_cast<uintptr_t>(p) % 16 == 0;
  };
  return pipe_width(a.d) && aligned(a.w, a.w_s0, a.w_s1) && aligned(a.x, a.x_s0, a.x_s1) &&
         pipe_stages(a.tables, a.d, a.out_w) > 0;
}

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
