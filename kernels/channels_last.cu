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
        T v[TILE / GK_THREADS];

        // Phase 1: global -> registers -> tile.  All loads are issued before
        // the shared stores so that they are in flight together.
#pragma unroll
        for (int k = 0; k < TILE / GK_THREADS; ++k) {
          const int i = (int)threadIdx.x + k * GK_THREADS;
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
        for (int k = 0; k < TILE / GK_THREADS; ++k) {
          const int i = (int)threadIdx.x + k * GK_THREADS;
          if (i < tile_elems) {
            if (TO_CF) {
              tile[(i >> log_tc) * rs + (i & (tc - 1))] = v[k];
            } else {
              tile[(i & (tq - 1)) * rs + (i >> log_tq)] = v[k];
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
