// Box copies between channels-last tensors and logical (channels-first) order.
//
// A channels-last tensor with logical shape (N, C, S...) lies in memory as
// [N][S...][C]; its logical C-order copy is [N][C][S...].  Seen per batch item
// that is a transpose of a (spatial x channel) matrix.  Two paths do it:
//
//  * the tiled path (many channels): a batched 2-D transpose staged through a
//    shared-memory tile; the channels-last side is read (or written) along C,
//    the logical side along the spatial run, and both global accesses are
//    coalesced (gpuckpt_cl_to_cf_<size>, gpuckpt_cf_to_cl_<size>);
//  * the pixel path (C = 1..8): each thread moves whole pixels, the C channels
//    of a few consecutive positions, with vector loads and stores on both
//    sides and the transpose done in registers; no shared memory, no barrier
//    (gpuckpt_px_cl_to_cf_<size>_<C>, gpuckpt_px_cf_to_cl_<size>_<C>).
//
// The host (gpuckpt/device/kernels.py: choose_path, plan_box_copy) picks the
// path by shape, once per layout, and describes a "box" (offsets and sizes in
// logical coordinates) as:
//   * a run: the innermost spatial dimensions that the box covers whole merge
//     into one run of `run_len` positions, `cl_qs` elements apart in the
//     channels-last tensor and contiguous in the logical buffer;
//   * lines: up to three outer dimensions (batch and the spatial dimensions
//     that could not merge), `nlines` of them, decomposed with sizes l1, l2;
//   * `nch` channels, 1 apart in the channels-last tensor and `cf_cs` apart in
//     the logical buffer.
// The whole-tensor transpose is the box that covers everything.
//
// In the tiled path, tiles that lie wholly inside the box (all of them but
// the edges, for large tensors) take a path without bounds checks, with
// 32-bit offsets inside the tile, and with 2-byte elements moved through
// global memory as 32-bit words where the addresses allow it.  Edge tiles
// take the checked path.
//
// This file includes nothing and uses only what NVRTC provides without headers
// and what the CPU emulation (kernels/emu/cuda_emu.h) supports, so that the
// very same text runs on the GPU and, through g++, on the CPU in the tests.
//
typedef long long gk_index;

#define GK_IN_RUN(q) ((q) < run_len)

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
  (void)run_len;  // unused where a test's mutant drops the bounds check
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

  __syncthreads();  // the tile is complete before anyone reads it

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
          __syncthreads();
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

// ==========================================================================
// The pixel path: few channels (C = 1..8), whole pixels per thread.
// ==========================================================================
//
// Each block covers GK_THREADS * M consecutive positions of one line of the
// box, M = 16*G / sizeof(T) per thread (G = 4, 2, 1 for C = 1, 2, more: at
// least 48 bytes in flight per thread).  A thread's positions come in K
// "slots" of P = W / sizeof(T) positions: slot k of thread t starts at
// position Q0 + (k*GK_THREADS + t)*P, so consecutive lanes own consecutive
// slots.  A slot is W bytes of each plane (contiguous in the logical buffer)
// and the W*C bytes of the same P pixels (contiguous in the channels-last
// tensor): a warp access is 32*W contiguous bytes of a plane, or W bytes
// W*C apart of the pixels (the C accesses of a slot together cover 32*W*C
// contiguous bytes).  A thread issues all its loads first, so that they are
// in flight together, then reorders in registers and stores.
//
// W, the access unit, is 16 bytes when both pointers and every stride are
// aligned to 16 bytes, else 4 (8 for 8-byte elements) when they are aligned to
// that; the kernel works it out from its arguments (a uniform branch), so the
// plan does not depend on the pointers.  1- and 2-byte elements whose planes
// are not even 4-byte aligned (odd sizes) go element by element, lanes on
// consecutive positions, still coalesced on the plane side.
//
// The register layout does not depend on W: position m of the thread (slot
// m / P) and channel c are pixel byte (m*C + c)*ES and plane byte
// c*16*G + m*ES, so one reordering serves both units.
//
// The box may hold fewer channels than the tensor (nch < C, from channel c0):
// whole pixels are still read, but written channel by channel (never a byte
// outside the box).  A slot that runs past the end of the line goes element
// by element (the thread's full slots before it do not).  No shared memory,
// no barrier.

#define GK_PX_FULL(q, p) ((q) + (p) <= run_len)

// G: 16-byte groups of each plane per thread (must match
// pixel_positions_per_thread in gpuckpt/device/kernels.py).
template <int C>
__device__ __forceinline__ constexpr int gk_px_groups() {
  return C == 1 ? 4 : (C == 2 ? 2 : 1);
}

// 16- and 8-byte access units are CUDA's built-in uint4 and uint2 (NVRTC has
// them without headers; the CPU emulation defines them).  Stores go through
// __stwb (an ordinary write-back store) so that each is one vector
// instruction: left to itself the compiler splits some into 32-bit stores.

// Load U bytes (4, 8 or 16) at p, aligned to U, into words w[o ..].
template <int U>
__device__ __forceinline__ void gk_ld_unit(const unsigned char* p,
                                           unsigned int* w, int o) {
  if constexpr (U == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[o] = v.x;
    w[o + 1] = v.y;
    w[o + 2] = v.z;
    w[o + 3] = v.w;
  } else if constexpr (U == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[o] = v.x;
    w[o + 1] = v.y;
  } else {
    w[o] = *reinterpret_cast<const unsigned int*>(p);
  }
}

// Store U bytes (4, 8 or 16) from words w[o ..] at p, aligned to U.
template <int U>
__device__ __forceinline__ void gk_st_unit(unsigned char* p,
                                           const unsigned int* w, int o) {
  if constexpr (U == 16) {
    __stwb(reinterpret_cast<uint4*>(p),
           make_uint4(w[o], w[o + 1], w[o + 2], w[o + 3]));
  } else if constexpr (U == 8) {
    __stwb(reinterpret_cast<uint2*>(p), make_uint2(w[o], w[o + 1]));
  } else {
    *reinterpret_cast<unsigned int*>(p) = w[o];
  }
}

// Copy one ES-byte element from byte a of s to byte b of d (register arrays;
// a sub-word destination must be zero beforehand).  a and b are multiples of
// ES, so an element never straddles two words.
template <int ES>
__device__ __forceinline__ void gk_mv(const unsigned int* s, int a,
                                      unsigned int* d, int b) {
  if constexpr (ES >= 4) {
#pragma unroll
    for (int j = 0; j < ES / 4; ++j) d[(b >> 2) + j] = s[(a >> 2) + j];
  } else {
    const unsigned int m = ES == 1 ? 0xffu : 0xffffu;
    d[b >> 2] |= ((s[a >> 2] >> ((a & 3) * 8)) & m) << ((b & 3) * 8);
  }
}

// Element by element: the k_n slots of p_n positions of one thread, from
// position q0 (slot k at q0 + k*GK_THREADS*p_n), channels [c0, c0 + nch),
// positions past run_len skipped.  Serves the slot that runs past the end of
// a line, boxes with some of the channels (to channels-last) and, with
// p_n = 1, planes of 1- and 2-byte elements that are not 4-byte aligned
// (lanes on consecutive positions: still coalesced on the plane side).  Two
// slots at a time: the loads of two pixels are in flight together (more
// would spill under the register cap).
// Positions increase with (k, j), so the first one past the run ends it.
template <typename T, int C, bool TO_CF>
__device__ __forceinline__ void gk_px_elements(
    const T* __restrict__ src, T* __restrict__ dst, gk_index cl_line,
    gk_index cf_line, gk_index cf_cs, gk_index run_len, gk_index q0, int k_n,
    int p_n, int c0, gk_index nch) {
  (void)run_len;  // unused where a test's mutant drops the bounds check
  constexpr int B = 2;
#pragma unroll 1
  for (int k0 = 0; k0 < k_n; k0 += B) {
#pragma unroll 1
    for (int j = 0; j < p_n; ++j) {
      const gk_index qb = q0 + (gk_index)k0 * GK_THREADS * p_n + j;
      const gk_index step = (gk_index)GK_THREADS * p_n;
      if (!GK_PX_FULL(qb, 1)) return;
      T v[B][C];
#pragma unroll
      for (int i = 0; i < B; ++i) {
        const gk_index q = qb + i * step;
        const bool in = k0 + i < k_n && GK_PX_FULL(q, 1);
#pragma unroll
        for (int c = 0; c < C; ++c) {
          v[i][c] = (T)0;
          if (in && (gk_index)c < nch)
            v[i][c] = TO_CF ? src[cl_line + q * C + c0 + c]
                            : src[cf_line + c * cf_cs + q];
        }
      }
#pragma unroll
      for (int i = 0; i < B; ++i) {
        const gk_index q = qb + i * step;
        if (!(k0 + i < k_n && GK_PX_FULL(q, 1))) break;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          if ((gk_index)c >= nch) continue;
          if (TO_CF)
            dst[cf_line + c * cf_cs + q] = v[i][c];
          else
            dst[cl_line + q * C + c0 + c] = v[i][c];
        }
      }
    }
  }
}

// The unrolled slots of one thread, access unit W (whole pixels when writing
// channels-last): the first k_full slots, those wholly inside the run.
// Offsets in elements.
template <typename T, int C, int W, bool TO_CF>
__device__ __forceinline__ void gk_px_slots(const T* __restrict__ src,
                                            T* __restrict__ dst,
                                            gk_index cl_line, gk_index cf_line,
                                            gk_index cf_cs, gk_index q0,
                                            int k_full, int c0, gk_index nch) {
  constexpr int ES = (int)sizeof(T);
  constexpr int G = gk_px_groups<C>();
  constexpr int P = W / ES;      // positions per slot
  constexpr int K = 16 * G / W;  // slots per thread
  constexpr int M = K * P;       // positions per thread
  constexpr int PB = 16 * G;     // bytes of one plane per thread
  constexpr int NW = 4 * G * C;  // words of the thread's pixels
  constexpr int UW = W / 4;      // words per unit
  unsigned int px[NW];
#pragma unroll
  for (int i = 0; i < NW; ++i) px[i] = 0u;

  if (TO_CF) {
    // Pixels in: slot k is pixel bytes [k*W*C, (k+1)*W*C).
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (k >= k_full) break;
      const unsigned char* g = (const unsigned char*)(
          src + cl_line + (q0 + (gk_index)k * GK_THREADS * P) * C);
#pragma unroll
      for (int u = 0; u < C; ++u)
        gk_ld_unit<W>(g + u * W, px, (k * C + u) * UW);
    }
    // Planes out, one at a time (those of the box).
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int cb = c - c0;
      if (cb < 0 || (gk_index)cb >= nch) continue;
      unsigned int pl[4 * G];
#pragma unroll
      for (int i = 0; i < 4 * G; ++i) pl[i] = 0u;
      if constexpr (C == 1) {
#pragma unroll
        for (int i = 0; i < 4 * G; ++i) pl[i] = px[i];
      } else {
#pragma unroll
        for (int m = 0; m < M; ++m)
          gk_mv<ES>(px, (m * C + c) * ES, pl, m * ES);
      }
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (k >= k_full) break;
        gk_st_unit<W>((unsigned char*)(dst + cf_line + cb * cf_cs + q0 +
                                       (gk_index)k * GK_THREADS * P),
                      pl, k * UW);
      }
    }
  } else {
    (void)c0;
    (void)nch;
    // Planes in: channel c, position m at byte c*PB + m*ES.
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (k >= k_full) break;
        gk_ld_unit<W>((const unsigned char*)(src + cf_line + c * cf_cs + q0 +
                                             (gk_index)k * GK_THREADS * P),
                      px, (c * PB + k * W) / 4);
      }
    }
    // Pixels out, W bytes at a time: piece v is pixel bytes [v*W, (v+1)*W)
    // of slot v / C, element i = m*C + c of the thread's pixels.
#pragma unroll
    for (int v = 0; v < K * C; ++v) {
      const int k = v / C;
      if (k >= k_full) break;
      unsigned int pc[UW];
#pragma unroll
      for (int i = 0; i < UW; ++i) pc[i] = 0u;
      if constexpr (C == 1) {
#pragma unroll
        for (int i = 0; i < UW; ++i) pc[i] = px[v * UW + i];
      } else {
#pragma unroll
        for (int e = 0; e < P; ++e) {
          const int i = v * P + e;
          gk_mv<ES>(px, (i % C) * PB + (i / C) * ES, pc, e * ES);
        }
      }
      gk_st_unit<W>(
          (unsigned char*)(dst + cl_line +
                           (q0 + (gk_index)k * GK_THREADS * P) * C) +
              (v % C) * W,
          pc, 0);
    }
  }
}

// One thread's share of a block with access unit W: its full slots through
// the registers.  Returns the first position of the slot that runs past the
// end of the line, for the caller to copy element by element, or -1.
template <typename T, int C, int W, bool TO_CF>
__device__ __forceinline__ gk_index gk_px_thread(
    const T* __restrict__ src, T* __restrict__ dst, gk_index cl_line,
    gk_index cf_line, gk_index cf_cs, gk_index run_len, gk_index q0, int c0,
    gk_index nch) {
  constexpr int P = W / (int)sizeof(T);
  constexpr int K = 16 * gk_px_groups<C>() / W;
  int k_full = 0;  // slots lie in increasing positions: a prefix is full
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (GK_PX_FULL(q0 + (gk_index)k * GK_THREADS * P, P)) k_full = k + 1;
  if (k_full > 0)
    gk_px_slots<T, C, W, TO_CF>(src, dst, cl_line, cf_line, cf_cs, q0, k_full,
                                c0, nch);
  const gk_index q = q0 + (gk_index)k_full * GK_THREADS * P;
  return k_full < K && q < run_len ? q : (gk_index)-1;
}

// TO_CF = true: src channels-last, dst logical; false: the reverse.  The
// parameters are those of the tiled path (GK_PARAMS): cl_base points at
// channel 0 of the box's first pixel, cl_qs == C, and the first int is the
// box's first channel c0 (the second is unused).
template <typename T, int C, bool TO_CF>
__device__ __forceinline__ void gk_px_copy(
    const T* __restrict__ src, T* __restrict__ dst, long long cl_base,
    long long nlines, long long l1, long long l2, long long cl_s0,
    long long cl_s1, long long cl_s2, long long cf_s0, long long cf_s1,
    long long cf_s2, long long run_len_arg, long long cl_qs, long long nch_arg,
    long long cf_cs_arg, int c0, int unused) {
  (void)cl_qs;
  (void)unused;
  constexpr int ES = (int)sizeof(T);
  constexpr int G = gk_px_groups<C>();
  constexpr int M = 16 * G / ES;  // positions per thread
  const gk_index run_len = run_len_arg;
  const gk_index nch = nch_arg;
  const gk_index cf_cs = cf_cs_arg;
  // Every byte offset that enters an address, on both sides.
  const unsigned long long bits =
      (unsigned long long)src | (unsigned long long)dst |
      (unsigned long long)((cl_base | cl_s0 | cl_s1 | cl_s2 | cf_s0 | cf_s1 |
                            cf_s2 | cf_cs_arg) *
                           ES);
  // The narrower unit: 4 bytes (8 for 8-byte elements).
  constexpr int WN = ES == 8 ? 8 : 4;
  const int w = (bits & 15ULL) == 0ULL                              ? 16
                : (bits & (unsigned long long)(WN - 1)) == 0ULL ? WN
                                                                : 0;
  // Writing channels-last needs whole pixels for the unrolled slots.
  const bool slots_ok = TO_CF || nch == C;
  const gk_index per_block = (gk_index)GK_THREADS * M;  // positions
  for (gk_index line = blockIdx.y; line < nlines; line += gridDim.y) {
    gk_index rest, a0, a1, a2;
    gk_divmod(line, (gk_index)l2, rest, a2);
    gk_divmod(rest, (gk_index)l1, a0, a1);
    const gk_index cl_line = (gk_index)cl_base + a0 * (gk_index)cl_s0 +
                             a1 * (gk_index)cl_s1 + a2 * (gk_index)cl_s2;
    const gk_index cf_line =
        a0 * (gk_index)cf_s0 + a1 * (gk_index)cf_s1 + a2 * (gk_index)cf_s2;
    for (gk_index q_blk = (gk_index)blockIdx.x * per_block; q_blk < run_len;
         q_blk += (gk_index)gridDim.x * per_block) {
      const int t = (int)threadIdx.x;
      // Element by element: the partial slot of a thread, or all of its
      // positions (slots of one) where no unit fits; one call site, where
      // few registers are live.
      gk_index eq;
      int ek, ep;
      if (slots_ok && w == 16) {
        eq = gk_px_thread<T, C, 16, TO_CF>(src, dst, cl_line, cf_line, cf_cs,
                                           run_len,
                                           q_blk + (gk_index)t * (16 / ES), c0,
                                           nch);
        ek = 1;
        ep = 16 / ES;
      } else if (slots_ok && w == WN) {
        eq = gk_px_thread<T, C, WN, TO_CF>(src, dst, cl_line, cf_line, cf_cs,
                                           run_len,
                                           q_blk + (gk_index)t * (WN / ES), c0,
                                           nch);
        ek = 1;
        ep = WN / ES;
      } else {
        eq = q_blk + t;
        ek = M;
        ep = 1;
      }
      if (eq >= 0)
        gk_px_elements<T, C, TO_CF>(src, dst, cl_line, cf_line, cf_cs,
                                    run_len, eq, ek, ep, c0, nch);
    }
  }
}

// ==========================================================================
// The micro-tile path: many channels, in 16-byte groups.
// ==========================================================================
//
// For boxes that span whole 16-byte groups of channels (the channel count,
// the first channel's offset and the tensor's pixel size all multiples of 16
// bytes), each thread moves micro-tiles of U = 16 / sizeof(T) channels by
// M positions (M = 16 for 1-byte elements, 8 otherwise: 256 or 128 bytes):
// one 16-byte load (or store) per position on the channels-last side, one
// unit of W bytes per channel and slot on the logical side, the transpose in
// registers.  No shared memory, no barrier.
//
// A block covers 2^log_cgs channel groups, the lanes' fastest index (a warp
// reads whole pixels, or 512 contiguous bytes of one), by 256 >> log_cgs
// position groups.  As on the pixel path a thread's positions come in K
// slots of P = W / sizeof(T) positions, slot k of position group g at
// Q0 + (k * (256 >> log_cgs) + g) * P, so that lanes of one channel group
// write consecutive units of a plane; W is 16 bytes when the logical side is
// 16-byte aligned, else 4 (8 for 8-byte elements), else the thread goes
// element by element.  Grid: x along the run, y over tiles of channel
// groups, z over lines; all three loop.

#define GK_MT_LANE(t) (t)

// M: positions per thread (must match micro_positions_per_thread in
// gpuckpt/device/kernels.py).
template <typename T>
__device__ __forceinline__ constexpr int gk_mt_positions() {
  return sizeof(T) == 1 ? 16 : 8;
}

// Element by element: k_n slots of p_n positions (slot k at q0 + k*stride),
// the U channels from ch0.
template <typename T, bool TO_CF>
__device__ __forceinline__ void gk_mt_elements(
    const T* __restrict__ src, T* __restrict__ dst, gk_index cl_line,
    gk_index cf_line, gk_index cl_qs, gk_index cf_cs, gk_index run_len,
    gk_index q0, gk_index stride, int k_n, int p_n, gk_index ch0) {
  (void)run_len;  // unused where a test's mutant drops the bounds check
  constexpr int U = 16 / (int)sizeof(T);
#pragma unroll 1
  for (int k = 0; k < k_n; ++k) {
#pragma unroll 1
    for (int j = 0; j < p_n; ++j) {
      const gk_index q = q0 + (gk_index)k * stride + j;
      if (!GK_PX_FULL(q, 1)) return;  // the rest lies further along the run
      T v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        v[u] = TO_CF ? src[cl_line + q * cl_qs + ch0 + u]
                     : src[cf_line + (ch0 + u) * cf_cs + q];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (TO_CF)
          dst[cf_line + (ch0 + u) * cf_cs + q] = v[u];
        else
          dst[cl_line + q * cl_qs + ch0 + u] = v[u];
      }
    }
  }
}

// The first k_full slots of one thread's micro-tile, unit W.  cl_px is the
// element offset of the channel group at position q0, cf_pl that of its
// first plane at q0; slots are `stride` positions apart.
template <typename T, int W, bool TO_CF>
__device__ __forceinline__ void gk_mt_slots(const T* __restrict__ src,
                                            T* __restrict__ dst,
                                            gk_index cl_px, gk_index cl_qs,
                                            gk_index cf_pl, gk_index cf_cs,
                                            gk_index stride, int k_full) {
  constexpr int ES = (int)sizeof(T);
  constexpr int U = 16 / ES;                   // channels per group
  constexpr int M = gk_mt_positions<T>();      // positions per thread
  constexpr int P = W / ES;                    // positions per slot
  constexpr int K = M / P;                     // slots
  constexpr int UW = W / 4;                    // words per logical unit
  // Position m = k*P + j, channel u: byte m*16 + u*ES (channels-last
  // order) on the way in to logical order, byte u*M*ES + m*ES (logical
  // order) on the way in to channels-last.
  unsigned int r[4 * M];
#pragma unroll
  for (int i = 0; i < 4 * M; ++i) r[i] = 0u;
  if (TO_CF) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (m / P >= k_full) break;
      gk_ld_unit<16>(
          (const unsigned char*)(src + cl_px +
                                 ((gk_index)(m / P) * stride + m % P) * cl_qs),
          r, 4 * m);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (k >= k_full) break;
        unsigned int pc[UW];
#pragma unroll
        for (int i = 0; i < UW; ++i) pc[i] = 0u;
#pragma unroll
        for (int j = 0; j < P; ++j)
          gk_mv<ES>(r, (k * P + j) * 16 + u * ES, pc, j * ES);
        gk_st_unit<W>(
            (unsigned char*)(dst + cf_pl + u * cf_cs + (gk_index)k * stride),
            pc, 0);
      }
    }
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (k >= k_full) break;
        gk_ld_unit<W>((const unsigned char*)(src + cf_pl + u * cf_cs +
                                             (gk_index)k * stride),
                      r, (u * M * ES + k * W) / 4);
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (m / P >= k_full) break;
      unsigned int pc[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) pc[i] = 0u;
#pragma unroll
      for (int u = 0; u < U; ++u)
        gk_mv<ES>(r, u * M * ES + m * ES, pc, u * ES);
      gk_st_unit<16>(
          (unsigned char*)(dst + cl_px +
                           ((gk_index)(m / P) * stride + m % P) * cl_qs),
          pc, 0);
    }
  }
}

// One thread's micro-tile for unit W: the full slots through the registers.
// Returns the first position of the slot that runs past the end of the
// line, for the caller to copy element by element, or -1.
template <typename T, int W, bool TO_CF>
__device__ __forceinline__ gk_index gk_mt_thread(
    const T* __restrict__ src, T* __restrict__ dst, gk_index cl_px,
    gk_index cl_qs, gk_index cf_pl, gk_index cf_cs, gk_index run_len,
    gk_index q0, gk_index stride) {
  constexpr int P = W / (int)sizeof(T);
  constexpr int K = gk_mt_positions<T>() / P;
  int k_full = 0;  // slots lie in increasing positions: a prefix is full
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (GK_PX_FULL(q0 + (gk_index)k * stride, P)) k_full = k + 1;
  if (k_full > 0)
    gk_mt_slots<T, W, TO_CF>(src, dst, cl_px + q0 * cl_qs, cl_qs, cf_pl + q0,
                             cf_cs, stride, k_full);
  const gk_index q = q0 + (gk_index)k_full * stride;
  return k_full < K && q < run_len ? q : (gk_index)-1;
}

// TO_CF = true: src channels-last, dst logical; false: the reverse.  The
// parameters are those of the tiled path (GK_PARAMS); cl_base includes the
// box's first channel, nch is a multiple of U, and the first int is log2 of
// the channel groups per block (the second is unused).
template <typename T, bool TO_CF>
__device__ __forceinline__ void gk_mt_copy(
    const T* __restrict__ src, T* __restrict__ dst, long long cl_base,
    long long nlines, long long l1, long long l2, long long cl_s0,
    long long cl_s1, long long cl_s2, long long cf_s0, long long cf_s1,
    long long cf_s2, long long run_len_arg, long long cl_qs_arg,
    long long nch_arg, long long cf_cs_arg, int log_cgs, int unused) {
  (void)unused;
  constexpr int ES = (int)sizeof(T);
  constexpr int U = 16 / ES;
  constexpr int M = gk_mt_positions<T>();
  constexpr int WN = ES == 8 ? 8 : 4;  // the narrower logical unit
  const gk_index run_len = run_len_arg;
  const gk_index cl_qs = cl_qs_arg;
  const gk_index cf_cs = cf_cs_arg;
  const T* cl_ptr = TO_CF ? src : (const T*)dst;
  const T* cf_ptr = TO_CF ? (const T*)dst : src;
  const unsigned long long cl_bits =
      (unsigned long long)cl_ptr |
      (unsigned long long)((cl_base | cl_s0 | cl_s1 | cl_s2 | cl_qs_arg) * ES);
  const unsigned long long cf_bits =
      (unsigned long long)cf_ptr |
      (unsigned long long)((cf_s0 | cf_s1 | cf_s2 | cf_cs_arg) * ES);
  const int w = (cl_bits & 15ULL) != 0ULL                       ? 0
                : (cf_bits & 15ULL) == 0ULL                     ? 16
                : (cf_bits & (unsigned long long)(WN - 1)) == 0 ? WN
                                                                : 0;
  const int lane = GK_MT_LANE((int)threadIdx.x);
  const int cgs = 1 << log_cgs;
  const int pgs = GK_THREADS >> log_cgs;
  const int cg_lane = lane & (cgs - 1);
  const int pg = lane >> log_cgs;
  const gk_index ncg = nch_arg / U;
  const gk_index per_block = (gk_index)pgs * M;  // positions
  for (gk_index line = blockIdx.z; line < nlines; line += gridDim.z) {
    gk_index rest, a0, a1, a2;
    gk_divmod(line, (gk_index)l2, rest, a2);
    gk_divmod(rest, (gk_index)l1, a0, a1);
    const gk_index cl_line = (gk_index)cl_base + a0 * (gk_index)cl_s0 +
                             a1 * (gk_index)cl_s1 + a2 * (gk_index)cl_s2;
    const gk_index cf_line =
        a0 * (gk_index)cf_s0 + a1 * (gk_index)cf_s1 + a2 * (gk_index)cf_s2;
    for (gk_index ct = blockIdx.y; ct * cgs < ncg; ct += gridDim.y) {
      const gk_index cg = ct * cgs + cg_lane;
      if (cg >= ncg) continue;  // no barrier: idle lanes may leave
      const gk_index ch0 = cg * U;
      const gk_index cl_px = cl_line + ch0;
      const gk_index cf_pl = cf_line + ch0 * cf_cs;
      for (gk_index q_blk = (gk_index)blockIdx.x * per_block; q_blk < run_len;
           q_blk += (gk_index)gridDim.x * per_block) {
        gk_index eq;
        int ek, ep;
        gk_index es;
        if (w == 16) {
          constexpr int P = 16 / ES;
          es = (gk_index)pgs * P;
          eq = gk_mt_thread<T, 16, TO_CF>(src, dst, cl_px, cl_qs, cf_pl, cf_cs,
                                          run_len, q_blk + (gk_index)pg * P,
                                          es);
          ek = 1;
          ep = P;
        } else if (w == WN) {
          constexpr int P = WN / ES;
          es = (gk_index)pgs * P;
          eq = gk_mt_thread<T, WN, TO_CF>(src, dst, cl_px, cl_qs, cf_pl, cf_cs,
                                          run_len, q_blk + (gk_index)pg * P,
                                          es);
          ek = 1;
          ep = P;
        } else {
          es = pgs;
          eq = q_blk + pg;
          ek = M;
          ep = 1;
        }
        if (eq >= 0)
          gk_mt_elements<T, TO_CF>(src, dst, cl_line, cf_line, cl_qs, cf_cs,
                                   run_len, eq, es, ek, ep, ch0);
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

// Which entry points a build defines; everything by default.  The loader
// compiles the tiled kernels, the micro-tile kernels and the pixel kernels of
// each element size as separate modules, each on first use
// (-DGK_BUILD_TILED=0/1, -DGK_BUILD_MICRO=0/1, -DGK_BUILD_PX_SIZES=<mask of
// element sizes>); the tests' mutant builds compile only what
// they break.
#ifndef GK_BUILD_TILED
#define GK_BUILD_TILED 1
#endif
#ifndef GK_BUILD_PX_SIZES
#define GK_BUILD_PX_SIZES 15  // 1 | 2 | 4 | 8
#endif
#ifndef GK_BUILD_MICRO
#define GK_BUILD_MICRO 1
#endif

#if GK_BUILD_TILED
// Tile capacity per element size (see GK_MIN_BLOCKS for the register cap).
GK_DEFINE(1, unsigned char, 4096)
GK_DEFINE(2, unsigned short, 4096)
GK_DEFINE(4, unsigned int, 2048)
GK_DEFINE(8, unsigned long long, 1024)
#endif

// The pixel path, per element size and channel count.  Three resident blocks
// per SM cap the registers at 80; the unrolled slots of 7 and 8 channels, and
// of 8-byte elements with more than 4, need more and get two (128
// registers).  With at least 48 bytes in flight per thread (over 80 for the
// latter), 768 (512) threads keep over 36 KiB of loads in flight per SM,
// more than the memory's latency times its bandwidth share.
#define GK_PX_MIN_BLOCKS(ES, C) ((C) > 6 || ((ES) == 8 && (C) > 4) ? 2 : 3)
#define GK_PX_DEFINE(ES, T, C)                                               \
  extern "C" __global__ void __launch_bounds__(GK_THREADS,                   \
                                               GK_PX_MIN_BLOCKS(ES, C))          \
      gpuckpt_px_cl_to_cf_##ES##_##C(const T* __restrict__ cl,               \
                                     T* __restrict__ cf, GK_PARAMS) {        \
    gk_px_copy<T, C, true>(cl, cf, GK_ARGS);                                 \
  }                                                                          \
  extern "C" __global__ void __launch_bounds__(GK_THREADS,                   \
                                               GK_PX_MIN_BLOCKS(ES, C))          \
      gpuckpt_px_cf_to_cl_##ES##_##C(const T* __restrict__ cf,               \
                                     T* __restrict__ cl, GK_PARAMS) {        \
    gk_px_copy<T, C, false>(cf, cl, GK_ARGS);                                \
  }
#define GK_PX_DEFINE_ALL(ES, T) \
  GK_PX_DEFINE(ES, T, 1)        \
  GK_PX_DEFINE(ES, T, 2)        \
  GK_PX_DEFINE(ES, T, 3)        \
  GK_PX_DEFINE(ES, T, 4)        \
  GK_PX_DEFINE(ES, T, 5)        \
  GK_PX_DEFINE(ES, T, 6)        \
  GK_PX_DEFINE(ES, T, 7)        \
  GK_PX_DEFINE(ES, T, 8)

#if GK_BUILD_PX_SIZES & 1
GK_PX_DEFINE_ALL(1, unsigned char)
#endif
#if GK_BUILD_PX_SIZES & 2
GK_PX_DEFINE_ALL(2, unsigned short)
#endif
#if GK_BUILD_PX_SIZES & 4
GK_PX_DEFINE_ALL(4, unsigned int)
#endif
#if GK_BUILD_PX_SIZES & 8
GK_PX_DEFINE_ALL(8, unsigned long long)
#endif

// The micro-tile path, per element size.  Two resident blocks per SM: up to
// 128 registers for the 256-byte micro-tiles of 1-byte elements.
#define GK_MT_DEFINE(ES, T)                                                 \
  extern "C" __global__ void __launch_bounds__(GK_THREADS, 2)               \
      gpuckpt_mt_cl_to_cf_##ES(const T* __restrict__ cl, T* __restrict__ cf, \
                               GK_PARAMS) {                                 \
    gk_mt_copy<T, true>(cl, cf, GK_ARGS);                                   \
  }                                                                         \
  extern "C" __global__ void __launch_bounds__(GK_THREADS, 2)               \
      gpuckpt_mt_cf_to_cl_##ES(const T* __restrict__ cf, T* __restrict__ cl, \
                               GK_PARAMS) {                                 \
    gk_mt_copy<T, false>(cf, cl, GK_ARGS);                                  \
  }

#if GK_BUILD_MICRO
GK_MT_DEFINE(1, unsigned char)
GK_MT_DEFINE(2, unsigned short)
GK_MT_DEFINE(4, unsigned int)
GK_MT_DEFINE(8, unsigned long long)
#endif
