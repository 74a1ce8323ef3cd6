// Shared library that runs kernels/batched_copy.cu on the CPU through the
// emulation in cuda_emu.h (tests/kernels/test_batched_copy_emu.py loads it
// with ctypes). The table holds real host addresses: the emulated threads copy
// host memory exactly as the device threads copy device memory.
//
// Build (the test does this, with -fsanitize flags for one variant):
//   g++ -std=c++20 -O2 -fPIC -shared kernels/emu/emu_batched_copy.cpp -o libbc.so

#include "cuda_emu.h"

#include "../batched_copy.cu"

extern "C" {

// Thread (and block) order: 0 forward, 1 reverse, 2 random with `seed`.
int gpuckpt_emu_set_order(int order, unsigned long long seed) {
  if (order < 0 || order > 2) return gk_emu::kBadLaunch;
  gk_emu::set_order(order, seed);
  return gk_emu::kOk;
}

// Launch the batched copy over `blocks` blocks of `threads` threads.
int gpuckpt_emu_batched_copy(unsigned int blocks, unsigned int threads,
                             const unsigned long long* table,
                             long long npieces) {
  const std::function<void()> body = [table, npieces] {
    gpuckpt_batched_copy(table, npieces);
  };
  return gk_emu::launch(dim3{blocks, 1, 1}, dim3{threads, 1, 1}, 0, -1, body);
}

}  // extern "C"
