// The gather + interaction at d = 16 with Z's rows loaded straight into MMA fragments:
// included by interaction.cu inside its anonymous namespace, after interaction_pipe.cuh
// (pinned, warp_samples, tri_places, store_kept, launch_striding, rows_aligned) and the
// shared parts (Args, mma_16816, round16).
#pragma once

// ---------------------------------------------------------- fragment form (d = 16)
// A Gram entry is a sum over k, so any order of k gives it. Lane (g, q) = (lane / 4,
// lane % 4) loads 8 bytes of each of Z's rows g, g + 8, g + 16, g + 24: elements 4q..4q+3
// of the row, taken as k = 2q, 2q + 1 (first word) and 2q + 8, 2q + 9 (second word). That
// is exactly the A fragment of mma.sync m16n8k16 for rows g, g + 8 (and g + 16, g + 24),
// and the B fragment for the 8 columns of rows g + 8n: Z never goes through shared memory,
// and each row is read by 4 lanes as one 32-byte piece. Each warp strides over the
// samples, the rows of the kFragAhead samples after this one in flight while its Gram is
// formed and stored, their ids one sample further. The kept entries go to a staged output row (shared memory),
// stored 16 bytes a lane.

constexpr int kFragWarps = 4;
constexpr int kFragD = 16;
constexpr int kFragAhead = 2;  // samples whose rows a warp has in flight (1 or 2)
// From this many samples on (fuseml.ops.embedding_interaction.TWIN_MIN_ROWS, which takes
// the twin there): below, the pipelined form is the faster (H200, kaggle: 2.7 against
// 3.5 us at 64 rows; 6.2 against 6.5 at 4,096; 12.4 against 17.3 at 16,384 the other way).
constexpr int64_t kFragMinRows = 8192;

__host__ __device__ __forceinline__ int64_t frag_warp_smem_bytes(int out_w) {
  return round16(static_cast<int64_t>(out_w) * 2);
}

// 8 bytes at p where ok, else zeros (a predicated load: no branch, nothing read)
__device__ __forceinline__ uint2 load8_if(const void* p, bool ok) {
  uint2 v;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
      " @p ld.global.nc.v2.b32 {%0, %1}, [%2];\n}"
      : "=r"(v.x), "=r"(v.y)
      : "l"(p), "r"(static_cast<int>(ok)));
  return v;
}

// An id at p where ok, else 0 (predicated, as load8_if)
template <typename Id>
__device__ __forceinline__ Id load_id_if(const Id* p, bool ok) {
  if constexpr (sizeof(Id) == 8) {
    unsigned long long v;
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n mov.b64 %0, 0;\n"
        " @p ld.global.nc.b64 %0, [%1];\n}"
        : "=l"(v)
        : "l"(p), "r"(static_cast<int>(ok)));
    return static_cast<Id>(v);
  } else {
    unsigned v;
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n mov.b32 %0, 0;\n"
        " @p ld.global.nc.b32 %0, [%1];\n}"
        : "=r"(v)
        : "l"(p), "r"(static_cast<int>(ok)));
    return static_cast<Id>(v);
  }
}

// What a lane reads, per row g + 8m of Z it holds: the row's table's first row of w (as a
// pointer at the lane's 8 bytes) and size, and the offset of its id in a sample's ids.
// Ids are compared unsigned, in the ids' width (a negative one is outside too; int32 ids
// against sizes clamped to 2^31). Sample-invariant: worked out once per warp.
template <typename S, typename Id>
struct FragLane {
  using U = std::conditional_t<sizeof(Id) == 8, uint64_t, uint32_t>;
  const S* base[4];
  U size[4];
  int64_t id_at[4];
  uint32_t table;  // bit m: row g + 8m is a table's
};

// Lane (g, q)'s 8 bytes of Z's rows g + 8m for the sample whose x row is at xp and ids at
// idp (zeros past the tables, for a sample past the last (ok false), or for an id outside
// its table, which sets the table's flag): one predicated load a row, no branch.
template <typename S, typename Id>
__device__ __forceinline__ void frag_rows(const Args& a, const FragLane<S, Id>& L, const S* xp,
                                          bool ok, const Id (&id)[4], int g, int q,
                                          uint2 (&r)[4]) {
  using U = typename FragLane<S, Id>::U;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const U i = static_cast<U>(id[m]);
    const bool table = ok && (L.table >> m & 1u);
    const bool valid = i < L.size[m];
    const S* p = (m == 0 && g == 0) ? xp : L.base[m] + static_cast<int64_t>(i) * kFragD;
    r[m] = load8_if(p, (m == 0 && g == 0 && ok) || (table && valid));
    if (table && !valid && q == 0 && a.bad != nullptr) a.bad[g + 8 * m - 1] = 1;
  }
}

template <typename S, typename Id>
__device__ __forceinline__ void frag_ids(const FragLane<S, Id>& L, const Id* idp, bool ok,
                                         Id (&id)[4]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) id[m] = load_id_if(idp + L.id_at[m], ok && (L.table >> m & 1u));
}

template <typename Tr, typename Id, int kAhead>
__global__ void __launch_bounds__(kFragWarps * kWarp, kAhead == 2 ? 5 : 6)
    interaction_frag_kernel(Args a) {
  using S = typename Tr::Storage;  // 16-bit
  constexpr int kD = 16;
  constexpr int kV = kVec<S>;
  pdl_begin();
  extern __shared__ int64_t smem_i64[];
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  int64_t b, step;
  warp_samples(warp, b, step);
  if (b >= a.rows) return;
  const int g = lane >> 2;
  const int q = lane & 3;
  S* row_out = reinterpret_cast<S*>(reinterpret_cast<char*>(smem_i64) +
                                    warp * frag_warp_smem_bytes(a.out_w));

  // Each of this lane's rows: its table's first row and size, once
  FragLane<S, Id> L;
  using U = typename FragLane<S, Id>::U;
  constexpr int64_t kMaxSize = sizeof(Id) == 8 ? INT64_MAX : (int64_t{1} << 31);
  L.table = 0;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int t = g + 8 * m - 1;
    int64_t first = 0, size = 0;
    if (t >= 0 && t < a.tables) {
      L.table |= 1u << m;
      first = a.toff64 ? load_id<int64_t>(a.toff, t * a.toff_s)
                       : load_id<int32_t>(a.toff, t * a.toff_s);
      const int64_t end = a.toff64 ? load_id<int64_t>(a.toff, (t + 1) * a.toff_s)
                                   : load_id<int32_t>(a.toff, (t + 1) * a.toff_s);
      size = end - first;
    }
    L.base[m] = static_cast<const S*>(a.w) + first * kFragD + 4 * q;
    L.size[m] = static_cast<U>(size < 0 ? 0 : size > kMaxSize ? kMaxSize : size);
    L.id_at[m] = t >= 0 ? t * a.ids_s1 : 0;
  }
  const S zero = Tr::from_float(0.0f);  // the padding columns, the same for every sample
  for (int col = kD + a.pairs + lane; col < a.out_w; col += kWarp) row_out[col] = zero;

  // Where this lane's accumulator entries land and which are kept (as in the pipelined
  // form)
  const TriPlaces places = tri_places(g, q, a.tables + 1, a.self);
  S* tri_out = row_out + kD;
  const bool vec = (a.out_w * sizeof(S)) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
  const int n_vec = a.out_w / kV;

  const Id* idp = static_cast<const Id*>(a.ids) + b * a.ids_s0;  // sample b's ids
  const S* xp = static_cast<const S*>(a.x) + b * a.x_s0 + 4 * q;    // and x's row
  const int64_t id_step = step * a.ids_s0;
  const int64_t x_step = step * a.x_s0;
  // Rows kAhead samples ahead of the one formed (in registers), ids one further
  Id id[4];
  uint2 r[4], rn[4];
  frag_ids<S, Id>(L, idp, true, id);
  frag_rows<S, Id>(a, L, xp, true, id, g, q, r);
  frag_ids<S, Id>(L, idp + id_step, b + step < a.rows, id);
  if constexpr (kAhead == 2) {
    frag_rows<S, Id>(a, L, xp + x_step, b + step < a.rows, id, g, q, rn);
    frag_ids<S, Id>(L, idp + 2 * id_step, b + 2 * step < a.rows, id);
  }
  for (; b < a.rows; b += step, idp += id_step, xp += x_step) {
    uint2 ra[4];  // the rows kAhead samples on, then the ids of the one after
    frag_rows<S, Id>(a, L, xp + kAhead * x_step, b + kAhead * step < a.rows, id, g, q, ra);
    frag_ids<S, Id>(L, idp + (kAhead + 1) * id_step, b + (kAhead + 1) * step < a.rows, id);

    float c[6][4] = {};
    const uint32_t lo[4] = {r[0].x, r[1].x, r[0].y, r[1].y};
    const uint32_t hi[4] = {r[2].x, r[3].x, r[2].y, r[3].y};
    mma_16816<Tr>(c[0], lo, r[0].x, r[0].y);
    mma_16816<Tr>(c[1], lo, r[1].x, r[1].y);
    mma_16816<Tr>(c[2], hi, r[0].x, r[0].y);
    mma_16816<Tr>(c[3], hi, r[1].x, r[1].y);
    mma_16816<Tr>(c[4], hi, r[2].x, r[2].y);
    mma_16816<Tr>(c[5], hi, r[3].x, r[3].y);

    __syncwarp();  // (the last sample's row has left row_out)
    store_kept<Tr>(tri_out, places, c);
    if (g == 0) {  // x: Z's row 0, elements 4q..4q+3 as loaded
      reinterpret_cast<uint2*>(row_out)[q] = r[0];
    }
    __syncwarp();

    S* out_row = static_cast<S*>(a.out) + b * a.out_w;
    if (vec) {
      const uint4* src = reinterpret_cast<const uint4*>(row_out);
      uint4* dst = reinterpret_cast<uint4*>(out_row);
#pragma unroll 1
      for (int k = lane; k < n_vec; k += kWarp) store_weak(dst + k, src[k]);
    } else {
#pragma unroll 1
      for (int col = lane; col < a.out_w; col += kWarp) out_row[col] = row_out[col];
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      if constexpr (kAhead == 2) {
        r[m] = rn[m];
        rn[m] = ra[m];
      } else {
        r[m] = ra[m];
      }
    }
  }
}

template <typename Tr, typename Id>
void launch_frag(const Args& a, cudaStream_t stream, bool pdl) {
  const auto kernel = interaction_frag_kernel<Tr, Id, kFragAhead>;
  const size_t smem = static_cast<size_t>(kFragWarps * frag_warp_smem_bytes(a.out_w));
  launch_striding(kernel, kFragWarps, smem, a, stream, pdl);
}

// Does the fragment form serve this call? One-hot ids, d = 16, 16-bit tables, at most 32
// rows of Z, the rows of w contiguous, x and w 8-byte aligned, at least kFragMinRows rows.
template <typename S>
bool frag_form(const Args& a) {
  return a.rows >= kFragMinRows && a.d == kFragD && a.w_s0 == kFragD && a.tables + 1 <= kMmaRows &&
         rows_aligned<S>(a.w, a.w_s0, a.w_s1, 8) && rows_aligned<S>(a.x, a.x_s0, a.x_s1, 8) &&
         frag_warp_smem_bytes(a.out_w) * kFragWarps <= kSmemBytes;
}
