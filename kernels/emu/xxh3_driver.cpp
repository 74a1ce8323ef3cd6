// Shared library that runs kernels/xxh3_tree.cu on the CPU through the
// emulation in cuda_emu.h; tests/kernels/test_xxh3_emu.py loads it with ctypes.
//
// Build (the test does this):
//   g++ -std=c++20 -O2 -fPIC -shared kernels/emu/xxh3_driver.cpp -o libxxh3emu.so

#include "cuda_emu.h"

#include "../xxh3_tree.cu"

namespace {
dim3 grid_for(unsigned long long n, unsigned int threads) {
  return dim3{(unsigned int)((n + threads - 1) / threads), 1, 1};
}
}  // namespace

extern "C" int gpuckpt_emu_xxh3_leaves(const unsigned char* data, const unsigned long long* offsets,
                                       const unsigned long long* lengths, unsigned long long n,
                                       unsigned char* out, unsigned int threads) {
  if (n == 0) return 0;
  return gk_emu::launch(grid_for(n, threads), dim3{threads, 1, 1}, 0, -1,
                        [&] { gpuckpt_xxh3_leaves(data, offsets, lengths, n, out); });
}

extern "C" int gpuckpt_emu_xxh3_roots(const unsigned char* digests, const unsigned long long* first,
                                      const unsigned long long* counts, unsigned long long n,
                                      unsigned char* out, unsigned int threads) {
  if (n == 0) return 0;
  return gk_emu::launch(grid_for(n, threads), dim3{threads, 1, 1}, 0, -1,
                        [&] { gpuckpt_xxh3_roots(digests, first, counts, n, out); });
}
