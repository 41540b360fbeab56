// Memory access of the softmax twin (softmax.cu): predicated loads and one-instruction
// stores in inline PTX, and the 16-byte packs of a row counted from the 16-byte boundary at
// or before its start. Included inside softmax.cu's anonymous namespace, after common.cuh.
#pragma once

// An integer word of each pack size: packs move as one word, so that each is one access.
template <int BYTES>
struct WordOf;
template <>
struct WordOf<2> {
  using type = unsigned short;
};
template <>
struct WordOf<4> {
  using type = unsigned int;
};
template <>
struct WordOf<16> {
  using type = uint4;
};

// w = *p where `pred`, else w unchanged: one predicated load in inline PTX. A branch around a
// plain load would put each pack's unpacking (16-bit dtypes) next to its load, in the
// branch, so that it waits for the data before the next pack's load is issued; predicated,
// every pack's load can go out first. .ca is the default caching; STREAM (.cs, evict-first)
// marks the last use of the data, so that the ONLINE kernel's second pass does not push the
// rows still to be reread out of L2.
template <bool STREAM>
__device__ __forceinline__ void load_if(uint4& w, const void* p, bool pred) {
  if constexpr (STREAM) {
    asm volatile(
        "{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t"
        "@q ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
        : "+r"(w.x), "+r"(w.y), "+r"(w.z), "+r"(w.w)
        : "l"(p), "r"(static_cast<int>(pred)));
  } else {
    asm volatile(
        "{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t"
        "@q ld.global.ca.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
        : "+r"(w.x), "+r"(w.y), "+r"(w.z), "+r"(w.w)
        : "l"(p), "r"(static_cast<int>(pred)));
  }
}

template <bool STREAM>
__device__ __forceinline__ void load_if(unsigned int& w, const void* p, bool pred) {
  if constexpr (STREAM) {
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\t@q ld.global.cs.u32 %0, [%1];\n\t}"
                 : "+r"(w)
                 : "l"(p), "r"(static_cast<int>(pred)));
  } else {
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\t@q ld.global.ca.u32 %0, [%1];\n\t}"
                 : "+r"(w)
                 : "l"(p), "r"(static_cast<int>(pred)));
  }
}

template <bool STREAM>
__device__ __forceinline__ void load_if(unsigned short& w, const void* p, bool pred) {
  if constexpr (STREAM) {
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\t@q ld.global.cs.u16 %0, [%1];\n\t}"
                 : "+h"(w)
                 : "l"(p), "r"(static_cast<int>(pred)));
  } else {
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\t@q ld.global.ca.u16 %0, [%1];\n\t}"
                 : "+h"(w)
                 : "l"(p), "r"(static_cast<int>(pred)));
  }
}

// Stores in inline PTX too: a plain copy of the Pack (or of a uint4) was split by the
// compiler into per-element stores for every pack but the first. STREAM: .cs (__stcs,
// evict-first, a weak STG.E.EF), as above.
template <bool STREAM, typename P>
__device__ __forceinline__ void store_vec(P* p, const P& v) {
  using W = typename WordOf<sizeof(P)>::type;
  static_assert(sizeof(W) == sizeof(P), "no word of this pack's size");
  W w;
  memcpy(&w, &v, sizeof(P));
  if constexpr (STREAM) {
    __stcs(reinterpret_cast<W*>(p), w);
  } else {
    store_weak(reinterpret_cast<W*>(p), w);
  }
}

// Elements between the 16-byte boundary at or before `row` and `row` itself (0 when V == 1).
template <int V, typename S>
__device__ __forceinline__ int lead_of(const S* row) {
  return static_cast<int>((reinterpret_cast<uintptr_t>(row) / sizeof(S)) % V);
}

// Columns [c0, c0 + V) of a row of n columns, as storage: one wide load when they all lie in
// the row; storage -inf otherwise (which drops out of the max, and out of the sum as
// exp(-inf - max) == 0). load_partial then fills in the in-row elements of a pack cut by the
// row's start or end. The kernels call the two in separate loops so that every wide load is
// issued first: merging 16-bit element loads into packed registers waits for their data.
// c0 + V never overflows I: the kernels keep c0 below n + V.
template <class Tr, int V, bool STREAM, typename I>
__device__ __forceinline__ Pack<typename Tr::Storage, V> load_full(
    const typename Tr::Storage* row, I c0, I n) {
  using P = Pack<typename Tr::Storage, V>;
  using W = typename WordOf<sizeof(P)>::type;
  static_assert(sizeof(W) == sizeof(P), "no word of this pack's size");
  P pk;
#pragma unroll
  for (int j = 0; j < V; ++j) pk.v[j] = Tr::neg_inf();
  W w;
  memcpy(&w, &pk, sizeof(P));
  const bool full = c0 >= 0 && c0 + V <= n;
  load_if<STREAM>(w, row + (full ? c0 : 0), full);  // no address outside the row is formed
  memcpy(&pk, &w, sizeof(P));
  return pk;
}

template <class Tr, int V, typename I>
__device__ __forceinline__ void load_partial(const typename Tr::Storage* row, I c0, I n,
                                             Pack<typename Tr::Storage, V>& pk) {
  if (c0 + V > 0 && c0 < n && !(c0 >= 0 && c0 + V <= n)) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const I c = c0 + j;
      if (c >= 0 && c < n) pk.v[j] = row[c];
    }
  }
}

// Writes the in-row elements of columns [c0, c0 + V): one wide store for a whole pack.
template <class Tr, int V, bool STREAM, typename I>
__device__ __forceinline__ void store_pack(typename Tr::Storage* row, I c0, I n,
                                           const Pack<typename Tr::Storage, V>& pk) {
  using P = Pack<typename Tr::Storage, V>;
  if (c0 >= 0 && c0 + V <= n) {
    store_vec<STREAM>(reinterpret_cast<P*>(row + c0), pk);
  } else if (c0 + V > 0 && c0 < n) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const I c = c0 + j;
      if (c >= 0 && c < n) row[c] = pk.v[j];
    }
  }
}
