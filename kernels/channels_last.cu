// Box copies between channels-last tensors and logical (channels-first) order.
//
// A channels-last tensor with logical shape (N, C, S...) lies in memory as
// [N][S...][C]; its logical C-order copy is [N][C][S...].  Seen per batch item
// that is a transpose of a (spatial x channel) matrix, so every copy here is a
// batched 2-D transpose staged through a shared-memory tile: the channels-last
// side is read (or written) along C, the logical side along the spatial run,
// and both global accesses are coalesced.
//
// A "box" (offsets and sizes in logical coordinates) is described by the host
// planner (gpuckpt/device/kernels.py, plan_box_copy) as:
//   * a run: the innermost spatial dimensions that the box covers whole merge
//     into one run of `run_len` positions, `cl_qs` elements apart in the
//     channels-last tensor and contiguous in the logical buffer;
//   * lines: up to three outer dimensions (batch and the spatial dimensions
//     that could not merge), `nlines` of them, decomposed with sizes l1, l2;
//   * `nch` channels, 1 apart in the channels-last tensor and `cf_cs` apart in
//     the logical buffer.
// The whole-tensor transpose is the box that covers everything.
//
// Tiles that lie wholly inside the box (all of them but the edges, for large
// tensors) take a path without bounds checks, with 32-bit offsets inside the
// tile, and with 2-byte elements moved through global memory as 32-bit words
// where the addresses allow it.  Edge tiles take the checked path.
//
// This file includes nothing and uses only what NVRTC provides without headers
// and what the CPU emulation (kernels/emu/cuda_emu.h) supports, so that the
// very same text runs on the GPU and, through g++, on the CPU in the tests.
//
// The GPUCKPT_BREAK_* switches build deliberately broken variants; the test
// suite uses them to prove that its harness notices each kind of bug.

#ifdef GPUCKPT_BREAK_INDEX32
typedef int gk_index;  // broken: 32-bit offsets overflow on large tensors
#else
typedef long long gk_index;
#endif

#ifdef GPUCKPT_BREAK_BOUNDS
#define GK_IN_RUN(q) true  // broken: no bounds check along the run
#else
#define GK_IN_RUN(q) ((q) < run_len)
#endif

// Threads per block.  The host launches exactly this many (x only).
#define GK_THREADS 256
// Resident blocks per SM asked of the compiler: it caps registers at 64 so
// that enough loads are in flight; the tests check that nothing spills.
#define GK_MIN_BLOCKS 4
// Loads a thread keeps in flight (more would spill under that register cap):
// GK_BATCH words of 4 or 8 bytes, half as many narrower ones.  A power of two.
#define GK_BATCH 8
template <typename W>
__device__ __forceinline__ constexpr int gk_batch() {
  return sizeof(W) >= 4 ? GK_BATCH : GK_BATCH / 2;
}

// Unsigned quotient and remainder.  64-bit division is a long instruction
// sequence on the GPU, so the common case where both operands fit in 32 bits
// takes the 32-bit path.
__device__ __forceinline__ void gk_divmod(gk_index a, gk_index b, gk_index& q,
                                          gk_index& r) {
  if (((unsigned long long)a | (unsigned long long)b) >> 32 == 0ULL) {
    const unsigned int ua = (unsigned int)a;
    const unsigned int ub = (unsigned int)b;
    q = (gk_index)(ua / ub);
    r = (gk_index)(ua - (ua / ub) * ub);
  } else {
    q = a / b;
    r = a - q * b;
  }
}

// Global accesses of 1- and 2-byte elements go through 32-bit words where the
// addresses allow it (four or two elements per load or store): element-wise
// they would cost one instruction per byte or two, which is what limits a
// transpose of small elements.  T itself is the word for 4- and 8-byte
// elements.
template <typename T>
struct gk_word {
  typedef T type;
  static const int log_v = 0;
};
template <>
struct gk_word<unsigned short> {
  typedef unsigned int type;
  static const int log_v = 1;
};

// Byte elements keep the checked path for every tile: with the interior-tile
// path beside it their kernels run out of registers.
template <typename T>
__device__ __forceinline__ constexpr bool gk_has_fast_path() {
  return sizeof(T) > 1;
}

// Interior tiles: every element of the tile lies in the box, so there are no
// bounds checks, and in-tile offsets fit in 32 bits (the caller checked) from
// a 64-bit tile base.  A "row" is the tc channels of one run position
// (contiguous in the channels-last tensor, `row_stride` apart); a "column" is
// the tq positions of one channel (contiguous in the logical block,
// `col_stride` apart).  W is the access word, 2^LOG_V elements.  All loads
// of a phase are issued before the shared-memory stores, so that they are in
// flight together.
// Offset of word `i` of the tile (words in row-major order, 2^log_wpr words
// per row) from the start of its rows, `stride` elements apart.
__device__ __forceinline__ int gk_row_off(int i, int log_wpr, int log_v,
                                          int stride) {
  return (i >> log_wpr) * stride + ((i & ((1 << log_wpr) - 1)) << log_v);
}

// Shared-memory index of element j of word `i` in column-major order
// (2^log_wpc words per column), rows `rs` elements apart.
__device__ __forceinline__ int gk_col_tile(int i, int j, int log_wpc,
                                           int log_v, int rs) {
  return (((i & ((1 << log_wpc) - 1)) << log_v) + j) * rs + (i >> log_wpc);
}

// Word i = threadIdx.x + k * GK_THREADS splits into a part of the thread and
// a part of k (the same for every thread): word counts per row or column are
// powers of two that divide, or are multiples of, GK_THREADS.  The split
// keeps the k-parts out of the per-thread registers.
template <typename T, typename W, int LOG_V, int TILE>
__device__ __forceinline__ void gk_rows_to_tile(const T* __restrict__ s,
                                                int row_stride, T* tile,
                                                int rs, int log_tc) {
  const int n = TILE / (GK_THREADS << LOG_V);  // words per thread
  const int batch = n < gk_batch<W>() ? n : gk_batch<W>();
  const int log_wpr = log_tc - LOG_V;  // words per row, log2
  const int t = (int)threadIdx.x;
  const T* g = s + gk_row_off(t, log_wpr, LOG_V, row_stride);
  T* sh = tile + gk_row_off(t, log_wpr, LOG_V, rs);
#pragma unroll
  for (int k0 = 0; k0 < n; k0 += batch) {
    W v[batch];
#pragma unroll
    for (int k = 0; k < batch; ++k)
      v[k] = *reinterpret_cast<const W*>(
          g + gk_row_off((k0 + k) * GK_THREADS, log_wpr, LOG_V, row_stride));
#pragma unroll
    for (int k = 0; k < batch; ++k) {
      T* e = sh + gk_row_off((k0 + k) * GK_THREADS, log_wpr, LOG_V, rs);
#pragma unroll
      for (int j = 0; j < (1 << LOG_V); ++j)
        e[j] = (T)(v[k] >> (j * 8 * (int)sizeof(T)));
    }
  }
}

template <typename T, typename W, int LOG_V, int TILE>
__device__ __forceinline__ void gk_cols_to_tile(const T* __restrict__ s,
                                                int col_stride, T* tile,
                                                int rs, int log_tq) {
  const int n = TILE / (GK_THREADS << LOG_V);
  const int batch = n < gk_batch<W>() ? n : gk_batch<W>();
  const int log_wpc = log_tq - LOG_V;  // words per column, log2
  const int t = (int)threadIdx.x;
  const T* g = s + gk_row_off(t, log_wpc, LOG_V, col_stride);
  T* sh = tile + gk_col_tile(t, 0, log_wpc, LOG_V, rs);
#pragma unroll
  for (int k0 = 0; k0 < n; k0 += batch) {
    W v[batch];
#pragma unroll
    for (int k = 0; k < batch; ++k)
      v[k] = *reinterpret_cast<const W*>(
          g + gk_row_off((k0 + k) * GK_THREADS, log_wpc, LOG_V, col_stride));
#pragma unroll
    for (int k = 0; k < batch; ++k) {
      const int u = (k0 + k) * GK_THREADS;
#pragma unroll
      for (int j = 0; j < (1 << LOG_V); ++j)
        sh[gk_col_tile(u, j, log_wpc, LOG_V, rs)] =
            (T)(v[k] >> (j * 8 * (int)sizeof(T)));
    }
  }
}

template <typename T, typename W, int LOG_V, int TILE>
__device__ __forceinline__ void gk_tile_to_rows(const T* tile,
                                                T* __restrict__ d,
                                                int row_stride, int rs,
                                                int log_tc) {
  const int n = TILE / (GK_THREADS << LOG_V);
  const int log_wpr = log_tc - LOG_V;
  const int t = (int)threadIdx.x;
  T* g = d + gk_row_off(t, log_wpr, LOG_V, row_stride);
  const T* sh = tile + gk_row_off(t, log_wpr, LOG_V, rs);
#pragma unroll 8
  for (int k = 0; k < n; ++k) {
    const T* e = sh + gk_row_off(k * GK_THREADS, log_wpr, LOG_V, rs);
    W w = (W)e[0];
#pragma unroll
    for (int j = 1; j < (1 << LOG_V); ++j)
      w |= (W)e[j] << (j * 8 * (int)sizeof(T));
    *reinterpret_cast<W*>(
        g + gk_row_off(k * GK_THREADS, log_wpr, LOG_V, row_stride)) = w;
  }
}

template <typename T, typename W, int LOG_V, int TILE>
__device__ __forceinline__ void gk_tile_to_cols(const T* tile,
                                                T* __restrict__ d,
                                                int col_stride, int rs,
                                                int log_tq) {
  const int n = TILE / (GK_THREADS << LOG_V);
  const int log_wpc = log_tq - LOG_V;
  const int t = (int)threadIdx.x;
  T* g = d + gk_row_off(t, log_wpc, LOG_V, col_stride);
  const T* sh = tile + gk_col_tile(t, 0, log_wpc, LOG_V, rs);
#pragma unroll 8
  for (int k = 0; k < n; ++k) {
    const int u = k * GK_THREADS;
    W w = (W)sh[gk_col_tile(u, 0, log_wpc, LOG_V, rs)];
#pragma unroll
    for (int j = 1; j < (1 << LOG_V); ++j)
      w |= (W)sh[gk_col_tile(u, j, log_wpc, LOG_V, rs)]
           << (j * 8 * (int)sizeof(T));
    *reinterpret_cast<W*>(g + gk_row_off(u, log_wpc, LOG_V, col_stride)) = w;
  }
}

// Whether a pointer and the element offsets from it are all multiples of
// 2^log_v elements (32-bit words for 1- and 2-byte elements).
__device__ __forceinline__ bool gk_aligned(const void* p, int log_v,
                                           long long a, long long b,
                                           long long c, long long d,
                                           long long e) {
  const long long m = (1LL << log_v) - 1;
  return (((unsigned long long)p & 3ULL) == 0ULL || log_v == 0) &&
         ((a | b | c | d | e) & m) == 0;
}

// Edge tiles (and small tensors): every access is checked.
template <typename T, int TILE, bool TO_CF>
__device__ __forceinline__ void gk_edge_tile(
    const T* __restrict__ src, T* __restrict__ dst, T* tile, gk_index cl_line,
    gk_index cf_line, gk_index q0, gk_index c0, gk_index run_len,
    gk_index nch, gk_index cl_qs, gk_index cf_cs, int log_tc, int log_tq,
    int rs) {
  (void)run_len;  // unused in the GPUCKPT_BREAK_BOUNDS variant
  const int tc = 1 << log_tc;
  const int tq = 1 << log_tq;
  const int tile_elems = tc << log_tq;
  // Phase 1: global -> registers -> tile, GK_BATCH loads in flight together.
  const int n_all = TILE / GK_THREADS;
  const int batch = n_all < GK_BATCH ? n_all : GK_BATCH;
#pragma unroll
  for (int k0 = 0; k0 < n_all; k0 += batch) {
    T v[batch];
#pragma unroll
    for (int k = 0; k < batch; ++k) {
      const int i = (int)threadIdx.x + (k0 + k) * GK_THREADS;
      v[k] = (T)0;
      if (i < tile_elems) {
        if (TO_CF) {
          // Row-major over the tile: consecutive lanes, consecutive
          // channels of one position (contiguous in channels-last).
          const int r = i >> log_tc;
          const int c = i & (tc - 1);
          const gk_index q = q0 + r;
          if (GK_IN_RUN(q) && c0 + c < nch)
            v[k] = src[cl_line + q * cl_qs + c0 + c];
        } else {
          // Column-major: consecutive lanes, consecutive positions of
          // one channel (contiguous in logical order).
          const int c = i >> log_tq;
          const int r = i & (tq - 1);
          const gk_index q = q0 + r;
          if (GK_IN_RUN(q) && c0 + c < nch)
            v[k] = src[cf_line + (c0 + c) * cf_cs + q];
        }
      }
    }
#pragma unroll
    for (int k = 0; k < batch; ++k) {
      const int i = (int)threadIdx.x + (k0 + k) * GK_THREADS;
      if (i < tile_elems) {
        if (TO_CF) {
          tile[(i >> log_tc) * rs + (i & (tc - 1))] = v[k];
        } else {
          tile[(i & (tq - 1)) * rs + (i >> log_tq)] = v[k];
        }
      }
    }
  }

#ifdef GPUCKPT_BREAK_DIVERGENCE
  // broken: one thread skips the barrier
  if (threadIdx.x != GK_THREADS - 1)
#endif
#ifndef GPUCKPT_BREAK_SYNC
    __syncthreads();  // the tile is complete before anyone reads it
#endif

  // Phase 2: tile -> global, in the other orientation.
#pragma unroll
  for (int k = 0; k < TILE / GK_THREADS; ++k) {
    const int i = (int)threadIdx.x + k * GK_THREADS;
    if (i < tile_elems) {
      if (TO_CF) {
        const int c = i >> log_tq;
        const int r = i & (tq - 1);
        const gk_index q = q0 + r;
        if (GK_IN_RUN(q) && c0 + c < nch)
          dst[cf_line + (c0 + c) * cf_cs + q] = tile[r * rs + c];
      } else {
        const int r = i >> log_tc;
        const int c = i & (tc - 1);
        const gk_index q = q0 + r;
        if (GK_IN_RUN(q) && c0 + c < nch)
          dst[cl_line + q * cl_qs + c0 + c] = tile[r * rs + c];
      }
    }
  }
}

// The same, out of line: where the interior-tile path is compiled in, its
// registers then do not add to those of this one.
template <typename T, int TILE, bool TO_CF>
__device__ __noinline__ void gk_edge_tile_call(
    const T* __restrict__ src, T* __restrict__ dst, T* tile, gk_index cl_line,
    gk_index cf_line, gk_index q0, gk_index c0, gk_index run_len,
    gk_index nch, gk_index cl_qs, gk_index cf_cs, int log_tc, int log_tq,
    int rs) {
  gk_edge_tile<T, TILE, TO_CF>(src, dst, tile, cl_line, cf_line, q0, c0,
                               run_len, nch, cl_qs, cf_cs, log_tc, log_tq, rs);
}

// One templated body for both directions.
//   TO_CF = true : src is the channels-last tensor, dst the logical buffer.
//   TO_CF = false: src is the logical buffer, dst the channels-last tensor.
// T is an unsigned integer of the element size: the copy never looks at the
// values, so one instantiation per size serves every dtype.
// TILE is the tile capacity in elements (a multiple of GK_THREADS); the host
// picks tile sides 2^log_tc (channels) x 2^log_tq (run) with product <= TILE.
template <typename T, int TILE, bool TO_CF>
__device__ __forceinline__ void gk_box_copy(
    const T* __restrict__ src, T* __restrict__ dst, long long cl_base,
    long long nlines, long long l1, long long l2, long long cl_s0,
    long long cl_s1, long long cl_s2, long long cf_s0, long long cf_s1,
    long long cf_s2, long long run_len_arg, long long cl_qs_arg,
    long long nch_arg, long long cf_cs_arg, int log_tc, int log_tq) {
  // Twice the capacity: the padded row stride below needs at most 2x.
  __shared__ T tile[2 * TILE];

  const gk_index run_len = run_len_arg;
  const gk_index cl_qs = cl_qs_arg;
  const gk_index nch = nch_arg;
  const gk_index cf_cs = cf_cs_arg;
  const int tc = 1 << log_tc;
  const int tq = 1 << log_tq;
  const int tile_elems = tc << log_tq;
  // Rows of the tile are `tc` channels of one run position.  The logical side
  // walks a column of the tile (one channel, consecutive positions), so rows
  // are padded to an odd number of 32-bit words: consecutive lanes then hit
  // distinct banks.  Rows narrower than 8 bytes are packed densely instead;
  // a column walk over them touches consecutive words anyway.
  const int pad = (tc * (int)sizeof(T) >= 8)
                      ? ((int)sizeof(T) >= 4 ? 1 : 4 / (int)sizeof(T))
                      : 0;
  const int rs = tc + pad;
  const gk_index nqt = (run_len + tq - 1) >> log_tq;
  const gk_index nct = (nch + tc - 1) >> log_tc;

  // Interior tiles take the fast path when in-tile offsets fit in 32 bits;
  // each side uses words when its addresses are aligned for them.  These are
  // the same for every block (uniform branches).
  typedef typename gk_word<T>::type W;
  const int log_v = gk_word<T>::log_v;
  const bool fast_ok =
      gk_has_fast_path<T>() && tile_elems == TILE &&
      (gk_index)(tq - 1) * cl_qs + tc <= (gk_index)0x7fffffff &&
      (gk_index)(tc - 1) * cf_cs + tq <= (gk_index)0x7fffffff;
  const T* cl_ptr = TO_CF ? (const T*)src : (const T*)dst;
  const T* cf_ptr = TO_CF ? (const T*)dst : (const T*)src;
  const bool vec_cl = log_v > 0 && log_tc >= log_v &&
                      gk_aligned(cl_ptr, log_v, cl_base, cl_s0, cl_s1, cl_s2,
                                 cl_qs);
  const bool vec_cf = log_v > 0 && log_tq >= log_v &&
                      gk_aligned(cf_ptr, log_v, 0, cf_s0, cf_s1, cf_s2, cf_cs);
  // Word-wise column walks read rows 2^log_v apart: an odd row stride (in
  // elements) keeps their lanes in distinct banks.
  const int rs_fast = vec_cf ? tc + 1 : rs;

  // Grid-stride loops in all three grid dimensions: the host caps the grid at
  // the hardware limits, so any tensor size is covered.
  for (gk_index line = blockIdx.z; line < nlines; line += gridDim.z) {
    gk_index rest, a0, a1, a2;
    gk_divmod(line, (gk_index)l2, rest, a2);
    gk_divmod(rest, (gk_index)l1, a0, a1);
    const gk_index cl_line = (gk_index)cl_base + a0 * (gk_index)cl_s0 +
                             a1 * (gk_index)cl_s1 + a2 * (gk_index)cl_s2;
    const gk_index cf_line =
        a0 * (gk_index)cf_s0 + a1 * (gk_index)cf_s1 + a2 * (gk_index)cf_s2;

    for (gk_index ct = blockIdx.y; ct < nct; ct += gridDim.y) {
      const gk_index c0 = ct << log_tc;
      for (gk_index qt = blockIdx.x; qt < nqt; qt += gridDim.x) {
        const gk_index q0 = qt << log_tq;
        if (fast_ok && q0 + tq <= run_len && c0 + tc <= nch) {
          const gk_index cl_off = cl_line + q0 * cl_qs + c0;
          const gk_index cf_off = cf_line + c0 * cf_cs + q0;
          if (TO_CF) {
            if (vec_cl)
              gk_rows_to_tile<T, W, gk_word<T>::log_v, TILE>(
                  src + cl_off, (int)cl_qs, tile, rs_fast, log_tc);
            else
              gk_rows_to_tile<T, T, 0, TILE>(src + cl_off, (int)cl_qs, tile,
                                             rs_fast, log_tc);
          } else {
            if (vec_cf)
              gk_cols_to_tile<T, W, gk_word<T>::log_v, TILE>(
                  src + cf_off, (int)cf_cs, tile, rs_fast, log_tq);
            else
              gk_cols_to_tile<T, T, 0, TILE>(src + cf_off, (int)cf_cs, tile,
                                             rs_fast, log_tq);
          }
#ifdef GPUCKPT_BREAK_DIVERGENCE
          if (threadIdx.x != GK_THREADS - 1)
#endif
#ifndef GPUCKPT_BREAK_SYNC
          __syncthreads();
#endif
          if (TO_CF) {
            if (vec_cf)
              gk_tile_to_cols<T, W, gk_word<T>::log_v, TILE>(
                  tile, dst + cf_off, (int)cf_cs, rs_fast, log_tq);
            else
              gk_tile_to_cols<T, T, 0, TILE>(tile, dst + cf_off, (int)cf_cs,
                                             rs_fast, log_tq);
          } else {
            if (vec_cl)
              gk_tile_to_rows<T, W, gk_word<T>::log_v, TILE>(
                  tile, dst + cl_off, (int)cl_qs, rs_fast, log_tc);
            else
              gk_tile_to_rows<T, T, 0, TILE>(tile, dst + cl_off, (int)cl_qs,
                                             rs_fast, log_tc);
          }
          __syncthreads();
          continue;
        }
        if (gk_has_fast_path<T>())
          gk_edge_tile_call<T, TILE, TO_CF>(src, dst, tile, cl_line, cf_line,
                                            q0, c0, run_len, nch, cl_qs,
                                            cf_cs, log_tc, log_tq, rs);
        else
          gk_edge_tile<T, TILE, TO_CF>(src, dst, tile, cl_line, cf_line, q0,
                                       c0, run_len, nch, cl_qs, cf_cs, log_tc,
                                       log_tq, rs);
        // Everyone has read the tile before the next iteration refills it.
        __syncthreads();
      }
    }
  }
}

// Kernel parameters after the two pointers; the host planner fills them in
// this order.
#define GK_PARAMS                                                           \
  long long cl_base, long long nlines, long long l1, long long l2,          \
      long long cl_s0, long long cl_s1, long long cl_s2, long long cf_s0,   \
      long long cf_s1, long long cf_s2, long long run_len, long long cl_qs, \
      long long nch, long long cf_cs, int log_tc, int log_tq
#define GK_ARGS                                                          \
  cl_base, nlines, l1, l2, cl_s0, cl_s1, cl_s2, cf_s0, cf_s1, cf_s2, run_len, \
      cl_qs, nch, cf_cs, log_tc, log_tq

#define GK_DEFINE(ES, T, TILE)                                            \
  extern "C" __global__ void __launch_bounds__(GK_THREADS, GK_MIN_BLOCKS) \
      gpuckpt_cl_to_cf_##ES(const T* __restrict__ cl, T* __restrict__ cf, \
                            GK_PARAMS) {                                  \
    gk_box_copy<T, TILE, true>(cl, cf, GK_ARGS);                          \
  }                                                                       \
  extern "C" __global__ void __launch_bounds__(GK_THREADS, GK_MIN_BLOCKS) \
      gpuckpt_cf_to_cl_##ES(const T* __restrict__ cf, T* __restrict__ cl, \
                            GK_PARAMS) {                                  \
    gk_box_copy<T, TILE, false>(cf, cl, GK_ARGS);                         \
  }

// Tile capacity per element size (see GK_MIN_BLOCKS for the register cap).
GK_DEFINE(1, unsigned char, 4096)
GK_DEFINE(2, unsigned short, 4096)
GK_DEFINE(4, unsigned int, 2048)
GK_DEFINE(8, unsigned long long, 1024)
