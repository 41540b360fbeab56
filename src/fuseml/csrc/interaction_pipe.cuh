// The gather + interaction's pipelined tensor-core form (one-hot 16-bit tables, d of 16,
// 32, 64 or 128): included by interaction.cu inside its anonymous namespace, after the
// shared parts it uses (Args, the pair order, kept_column, mma_16816, the launch helpers).
#pragma once

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

// The samples of a warp striding over them: warp k of the grid's K takes b = k, k + K, ...
// (step = K).
__device__ __forceinline__ void warp_samples(int warp, int64_t& b, int64_t& step) {
  const int warps = blockDim.x / kWarp;
  step = static_cast<int64_t>(gridDim.x) * warps;
  b = static_cast<int64_t>(blockIdx.x) * warps + warp;
}

// Where a lane's Gram entries land in the kept triangle, for the six 16 x 8 tiles t (rows
// rb, columns cb) (0, 0), (0, 8), (16, 0), (16, 8), (16, 16), (16, 24): every kept entry
// for F <= 32. Accumulator entry e of tile t is (rb + g + 8 (e / 2), cb + 2 q + e % 2),
// lane = 4 g + q; it lands at column tri[k] + cb + e % 2 of the triangle, k = rb / 8 +
// e / 2, where it is kept (bit 4 t + e of keep). Worked out once a warp, pinned.
struct TriPlaces {
  int tri[4];
  uint32_t keep;
};

__device__ __forceinline__ TriPlaces tri_places(int g, int q, int f, bool self) {
  TriPlaces p;
  p.keep = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int i = g + 8 * k;
    p.tri[k] = pinned((self ? i * (i + 1) / 2 : i * (i - 1) / 2) + 2 * q);
  }
#pragma unroll
  for (int t = 0; t < 6; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = (t < 2 ? 0 : 16) + g + 8 * (e >> 1);
      const int j = (t < 2 ? t * 8 : (t - 2) * 8) + 2 * q + (e & 1);
      if (i < f && (self ? j <= i : j < i)) p.keep |= 1u << (4 * t + e);
    }
  }
  p.keep = pinned(p.keep);
  return p;
}

// The kept entries of the six tiles' accumulators c into the staged triangle tri_out.
template <typename Tr, typename S>
__device__ __forceinline__ void store_kept(S* tri_out, const TriPlaces& p, const float (&c)[6][4]) {
#pragma unroll
  for (int t = 0; t < 6; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int k = (t < 2 ? 0 : 2) + (e >> 1);
      const int cb = t < 2 ? t * 8 : (t - 2) * 8;
      if (p.keep & (1u << (4 * t + e))) tri_out[p.tri[k] + cb + (e & 1)] = Tr::from_float(c[t][e]);
    }
  }
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
  int64_t b, step;
  warp_samples(warp, b, step);
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
  const TriPlaces places = tri_places(lane >> 2, lane & 3, f, a.self);
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
    store_kept<Tr>(tri_out, places, c);
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

// Launches a kernel whose warps stride over the samples (warp_samples): blocks of ``warps``
// warps, as many as are resident at once, at most one warp a sample.
template <typename Kernel>
void launch_striding(Kernel kernel, int warps, size_t smem, const Args& a, cudaStream_t stream,
                     bool pdl) {
  const int per_sm = blocks_per_sm(kernel, warps * kWarp, smem);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((a.rows + warps - 1) / warps, std::max(per_sm, 1) * sms);
  launch_pdl_smem(pdl, kernel, dim3(static_cast<unsigned>(blocks)), dim3(warps * kWarp), smem,
                  stream, a);
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
  launch_striding(kernel, warps, smem, a, stream, pdl);
}

// Are the rows of p (strides s0, s1 in elements of S) contiguous, each starting at a
// multiple of ``bytes``?
template <typename S>
bool rows_aligned(const void* p, int64_t s0, int64_t s1, int bytes) {
  return s1 == 1 && (s0 * static_cast<int64_t>(sizeof(S))) % bytes == 0 &&
         reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Does the pipelined form serve this call? One-hot ids, the tensor-core form, d of 16,
// 32, 64 or 128, x and the rows of w 16-byte aligned, two Z buffers and the output row
// within a warp's share.
template <typename S>
bool pipe_form(const Args& a) {
  return pipe_width(a.d) && rows_aligned<S>(a.w, a.w_s0, a.w_s1, 16) &&
         rows_aligned<S>(a.x, a.x_s0, a.x_s1, 16) &&
         pipe_stages(a.tables, a.d, a.out_w) > 0;
}
