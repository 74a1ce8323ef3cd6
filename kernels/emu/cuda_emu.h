// CPU emulation of the part of the CUDA execution model that gpuckpt's
// kernels use, so that g++ can compile an unchanged .cu file and the tests can
// run it on a machine without a GPU.
//
// Supported: __global__/__device__/__forceinline__/__launch_bounds__,
// __noinline__, __restrict__, __shared__ (function-scope), threadIdx/blockIdx/blockDim/
// gridDim, __syncthreads(), the vector types uint2 and uint4 (with their
// alignment, which UBSan checks), make_uint2/make_uint4 and __stwb().
// Nothing else.
//
// Two execution modes:
//
//  * fibers (default): blocks run one after another, so a function-scope
//    __shared__ variable can simply be static storage.  The threads of a block
//    are cooperative fibers (ucontext) on one OS thread; __syncthreads()
//    switches back to a scheduler, which resumes the threads in forward,
//    reverse or random order once all of them have reached the barrier.  A
//    changing order exposes read-before-write races that one fixed order would
//    hide.  A barrier that some threads never reach (they finished, or wait at
//    another __syncthreads()) is reported as an error.
//
//  * OS threads (-DGPUCKPT_EMU_OS_THREADS, C++20): one std::thread per CUDA
//    thread and a std::barrier, for ThreadSanitizer, which then sees every
//    unsynchronised shared-memory access as a data race.
//
// A launch may run only a sub-range of the grid's blocks (linear index, x
// fastest), so that a huge tensor can be exercised at its far end without
// touching all of it.

#ifndef GPUCKPT_CUDA_EMU_H
#define GPUCKPT_CUDA_EMU_H

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#ifdef GPUCKPT_EMU_OS_THREADS
#include <atomic>
#include <barrier>
#include <thread>
#else
#include <sys/mman.h>
#include <ucontext.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
// AddressSanitizer must be told about stack switches, or it misreads the
// fiber stacks.
extern "C" void __sanitizer_start_switch_fiber(void** fake_stack_save,
                                               const void* bottom,
                                               size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void* fake_stack_save,
                                                const void** bottom_old,
                                                size_t* size_old);
#define GK_EMU_ASAN 1
#else
#define GK_EMU_ASAN 0
#endif

// ---- CUDA keywords -------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
// Blocks never run concurrently, so block-shared storage is static storage.
#define __shared__ static

struct uint3 {
  unsigned int x, y, z;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z,
                        unsigned int w) {
  return uint4{x, y, z, w};
}
// Store with the default (write-back) cache policy: a plain store here.
inline void __stwb(uint2* p, uint2 v) { *p = v; }
inline void __stwb(uint4* p, uint4 v) { *p = v; }
struct dim3 {
  unsigned int x, y, z;
};

// Per CUDA thread: thread_local works for both modes (in fiber mode the
// scheduler rewrites it on every switch).
inline thread_local uint3 threadIdx = {0, 0, 0};
inline thread_local uint3 blockIdx = {0, 0, 0};
inline dim3 blockDim = {1, 1, 1};
inline dim3 gridDim = {1, 1, 1};

namespace gk_emu {

enum Order { kForward = 0, kReverse = 1, kRandom = 2 };

// Error codes returned by launch().
enum Status {
  kOk = 0,
  kBarrierDivergence = 1,  // a barrier not reached by every thread
  kBadLaunch = 2,          // invalid grid/block/range
};

inline int g_order = -1;  // -1: not set yet, read GPUCKPT_EMU_ORDER
inline std::mt19937_64 g_rng{12345};

inline void set_order(int order, unsigned long long seed) {
  g_order = order;
  g_rng.seed(seed);
}

inline int order() {
  if (g_order < 0) {
    const char* env = std::getenv("GPUCKPT_EMU_ORDER");
    g_order = kForward;
    if (env && env[0] == 'r' && env[1] == 'e') g_order = kReverse;
    if (env && env[0] == 'r' && env[1] == 'a') g_order = kRandom;
  }
  return g_order;
}

// A permutation of 0..n-1 in the configured order.
inline void make_order(std::vector<long long>& idx, long long n) {
  idx.resize((size_t)n);
  std::iota(idx.begin(), idx.end(), 0LL);
  if (order() == kReverse) std::reverse(idx.begin(), idx.end());
  if (order() == kRandom) std::shuffle(idx.begin(), idx.end(), g_rng);
}

inline void set_block_index(long long linear) {
  const long long gx = gridDim.x, gy = gridDim.y;
  blockIdx.x = (unsigned int)(linear % gx);
  blockIdx.y = (unsigned int)((linear / gx) % gy);
  blockIdx.z = (unsigned int)(linear / (gx * gy));
}

#ifndef GPUCKPT_EMU_OS_THREADS
// ---- fiber mode ----------------------------------------------------------

enum FiberState { kRunnable, kAtBarrier, kDone };

struct Fiber {
  ucontext_t ctx;
  FiberState state;
  int site;  // source line of the barrier it waits at
  void* fake_stack;
};

inline constexpr size_t kStackSize = 256 * 1024;

struct Scheduler {
  ucontext_t main_ctx;
  std::vector<Fiber> fibers;
  std::vector<char*> stacks;
  long long current = 0;
  const std::function<void()>* body = nullptr;
  const void* main_stack_bottom = nullptr;
  size_t main_stack_size = 0;
  void* main_fake_stack = nullptr;

  ~Scheduler() {
    for (char* s : stacks) munmap(s, kStackSize);
  }

  void ensure(size_t nthreads) {
    fibers.resize(nthreads);
    while (stacks.size() < nthreads) {
      // mmap keeps untouched stack pages free.
      void* p = mmap(nullptr, kStackSize, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) {
        std::fprintf(stderr, "cuda_emu: cannot allocate a fiber stack\n");
        std::abort();
      }
      stacks.push_back((char*)p);
    }
  }
};

inline Scheduler g_sched;

// Switch from the running fiber back to the scheduler.  `dying` marks the
// final switch of a fiber, whose stack ASan may then forget.
inline void switch_to_scheduler(bool dying) {
  Fiber& f = g_sched.fibers[(size_t)g_sched.current];
#if GK_EMU_ASAN
  __sanitizer_start_switch_fiber(dying ? nullptr : &f.fake_stack,
                                 g_sched.main_stack_bottom,
                                 g_sched.main_stack_size);
#endif
  if (dying) {
    setcontext(&g_sched.main_ctx);
  } else {
    swapcontext(&f.ctx, &g_sched.main_ctx);
  }
#if GK_EMU_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, &g_sched.main_stack_bottom,
                                  &g_sched.main_stack_size);
#endif
}

inline void fiber_entry() {
#if GK_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g_sched.main_stack_bottom,
                                  &g_sched.main_stack_size);
#endif
  (*g_sched.body)();
  g_sched.fibers[(size_t)g_sched.current].state = kDone;
  switch_to_scheduler(true);
}

inline void sync_threads(int site) {
  Fiber& f = g_sched.fibers[(size_t)g_sched.current];
  f.state = kAtBarrier;
  f.site = site;
  switch_to_scheduler(false);
}

inline void resume(long long t) {
  Fiber& f = g_sched.fibers[(size_t)t];
  g_sched.current = t;
  const long long bx = blockDim.x, by = blockDim.y;
  threadIdx.x = (unsigned int)(t % bx);
  threadIdx.y = (unsigned int)((t / bx) % by);
  threadIdx.z = (unsigned int)(t / (bx * by));
#if GK_EMU_ASAN
  __sanitizer_start_switch_fiber(&g_sched.main_fake_stack,
                                 g_sched.stacks[(size_t)t], kStackSize);
#endif
  swapcontext(&g_sched.main_ctx, &f.ctx);
#if GK_EMU_ASAN
  __sanitizer_finish_switch_fiber(g_sched.main_fake_stack, nullptr, nullptr);
#endif
}

// getcontext() returns twice as far as the compiler knows, so it lives in a
// function of its own with no loop state to clobber.
__attribute__((noinline)) inline void init_fiber(Fiber& f, char* stack) {
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = stack;
  f.ctx.uc_stack.ss_size = kStackSize;
  f.ctx.uc_link = &g_sched.main_ctx;
  makecontext(&f.ctx, fiber_entry, 0);
  f.state = kRunnable;
  f.site = -1;
  f.fake_stack = nullptr;
}

inline int run_block(long long nthreads, long long block) {
  for (long long t = 0; t < nthreads; ++t)
    init_fiber(g_sched.fibers[(size_t)t], g_sched.stacks[(size_t)t]);
  std::vector<long long> idx;
  for (;;) {
    make_order(idx, nthreads);
    for (long long t : idx)
      if (g_sched.fibers[(size_t)t].state == kRunnable) resume(t);

    long long done = 0, first_done = -1, first_wait = -1;
    for (long long t = 0; t < nthreads; ++t) {
      if (g_sched.fibers[(size_t)t].state == kDone) {
        ++done;
        if (first_done < 0) first_done = t;
      } else if (first_wait < 0) {
        first_wait = t;
      }
    }
    if (done == nthreads) return kOk;
    if (done > 0) {
      std::fprintf(stderr,
                   "cuda_emu: barrier divergence in block %lld: thread %lld "
                   "finished while thread %lld waits at __syncthreads() "
                   "(line %d); %lld of %lld threads finished\n",
                   block, first_done, first_wait,
                   g_sched.fibers[(size_t)first_wait].site, done, nthreads);
      return kBarrierDivergence;
    }
    const int site = g_sched.fibers[0].site;
    for (long long t = 1; t < nthreads; ++t) {
      if (g_sched.fibers[(size_t)t].site != site) {
        std::fprintf(stderr,
                     "cuda_emu: barrier divergence in block %lld: thread 0 "
                     "waits at __syncthreads() on line %d, thread %lld on "
                     "line %d\n",
                     block, site, t, g_sched.fibers[(size_t)t].site);
        return kBarrierDivergence;
      }
    }
    for (long long t = 0; t < nthreads; ++t)
      g_sched.fibers[(size_t)t].state = kRunnable;
  }
}

inline int run_blocks(long long nthreads, const std::vector<long long>& blocks,
                      const std::function<void()>& body) {
  g_sched.ensure((size_t)nthreads);
  g_sched.body = &body;
  for (long long b : blocks) {
    set_block_index(b);
    const int rc = run_block(nthreads, b);
    if (rc != kOk) return rc;
  }
  return kOk;
}

#else
// ---- OS-thread mode --------------------------------------------------------

struct BarrierCheck {
  // Runs once per barrier phase, after every live thread arrived and before
  // any is released: threads waiting while another already finished means
  // divergence.  (The last phase, completed only by finishing threads that
  // drop out, has nobody waiting and is fine.)
  void operator()() noexcept;
};

inline std::barrier<BarrierCheck>* g_barrier = nullptr;
inline std::atomic<long long> g_done{0};
inline std::atomic<long long> g_waiting{0};
inline std::atomic<int> g_status{kOk};
inline long long g_block = 0;

inline void BarrierCheck::operator()() noexcept {
  const long long done = g_done.load();
  const long long waiting = g_waiting.exchange(0);
  if (waiting > 0 && done > 0 && g_status.load() == kOk) {
    std::fprintf(stderr,
                 "cuda_emu: barrier divergence in block %lld: %lld thread(s) "
                 "finished while others wait at __syncthreads()\n",
                 g_block, done);
    g_status.store(kBarrierDivergence);
  }
}

inline void sync_threads(int /*site*/) {
  g_waiting.fetch_add(1);
  g_barrier->arrive_and_wait();
}

inline int run_blocks(long long nthreads, const std::vector<long long>& blocks,
                      const std::function<void()>& body) {
  g_status.store(kOk);
  std::vector<long long> idx;
  for (long long b : blocks) {
    set_block_index(b);
    const uint3 block_idx = blockIdx;
    std::barrier<BarrierCheck> bar((std::ptrdiff_t)nthreads);
    g_barrier = &bar;
    g_done.store(0);
    g_waiting.store(0);
    g_block = b;
    std::vector<std::thread> threads;
    threads.reserve((size_t)nthreads);
    make_order(idx, nthreads);  // start order only; the OS decides the rest
    for (long long t : idx) {
      threads.emplace_back([t, block_idx, &body, &bar] {
        const long long bx = blockDim.x, by = blockDim.y;
        threadIdx.x = (unsigned int)(t % bx);
        threadIdx.y = (unsigned int)((t / bx) % by);
        threadIdx.z = (unsigned int)(t / (bx * by));
        blockIdx = block_idx;
        body();
        g_done.fetch_add(1);
        bar.arrive_and_drop();
      });
    }
    for (std::thread& th : threads) th.join();
    g_barrier = nullptr;
    if (g_status.load() != kOk) return g_status.load();
  }
  return kOk;
}
#endif

// Run blocks [first, last) of the grid (linear index, x fastest); last < 0
// means the whole grid.  Blocks run in the configured order.
inline int launch(dim3 grid, dim3 block, long long first, long long last,
                  const std::function<void()>& body) {
  const long long nblocks = (long long)grid.x * grid.y * grid.z;
  const long long nthreads = (long long)block.x * block.y * block.z;
  if (last < 0) last = nblocks;
  if (nthreads <= 0 || nthreads > 1024 || first < 0 || first > last ||
      last > nblocks) {
    std::fprintf(stderr,
                 "cuda_emu: bad launch: %lld blocks of %lld threads, range "
                 "[%lld, %lld)\n",
                 nblocks, nthreads, first, last);
    return kBadLaunch;
  }
  gridDim = grid;
  blockDim = block;
  std::vector<long long> blocks;
  make_order(blocks, last - first);
  for (long long& b : blocks) b += first;
  return run_blocks(nthreads, blocks, body);
}

}  // namespace gk_emu

// The source line identifies the barrier, so that threads waiting at two
// different __syncthreads() calls count as divergence.
#define __syncthreads() ::gk_emu::sync_threads(__LINE__)

#endif  // GPUCKPT_CUDA_EMU_H
