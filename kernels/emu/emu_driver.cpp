// Shared library that runs kernels/channels_last.cu on the CPU through the
// emulation in cuda_emu.h.  The tests load it with ctypes.
//
// Build (the tests do this, with extra -D and -fsanitize flags per variant):
//   g++ -std=c++20 -O2 -fPIC -shared kernels/emu/emu_driver.cpp -o libemu.so

#include "cuda_emu.h"

#include <cstring>

#include "../channels_last.cu"

namespace {

// Kernel parameters after the two pointers, in signature order.
struct Params {
  long long v[14];  // cl_base .. cf_cs, see GK_PARAMS
};

typedef void (*KernelFn)(const void*, void*, const Params&, int, int);

#define GK_EMU_WRAP(NAME, T)                                                  \
  void wrap_##NAME(const void* a, void* b, const Params& p, int ltc,        \
                   int ltq) {                                                 \
    NAME((const T*)a, (T*)b, p.v[0], p.v[1], p.v[2], p.v[3], p.v[4], p.v[5], \
         p.v[6], p.v[7], p.v[8], p.v[9], p.v[10], p.v[11], p.v[12], p.v[13],  \
         ltc, ltq);                                                           \
  }

GK_EMU_WRAP(gpuckpt_cl_to_cf_1, unsigned char)
GK_EMU_WRAP(gpuckpt_cf_to_cl_1, unsigned char)
GK_EMU_WRAP(gpuckpt_cl_to_cf_2, unsigned short)
GK_EMU_WRAP(gpuckpt_cf_to_cl_2, unsigned short)
GK_EMU_WRAP(gpuckpt_cl_to_cf_4, unsigned int)
GK_EMU_WRAP(gpuckpt_cf_to_cl_4, unsigned int)
GK_EMU_WRAP(gpuckpt_cl_to_cf_8, unsigned long long)
GK_EMU_WRAP(gpuckpt_cf_to_cl_8, unsigned long long)

struct Entry {
  const char* name;
  KernelFn fn;
};

#define GK_EMU_ENTRY(NAME) {#NAME, wrap_##NAME}

const Entry kKernels[] = {
    GK_EMU_ENTRY(gpuckpt_cl_to_cf_1), GK_EMU_ENTRY(gpuckpt_cf_to_cl_1),
    GK_EMU_ENTRY(gpuckpt_cl_to_cf_2), GK_EMU_ENTRY(gpuckpt_cf_to_cl_2),
    GK_EMU_ENTRY(gpuckpt_cl_to_cf_4), GK_EMU_ENTRY(gpuckpt_cf_to_cl_4),
    GK_EMU_ENTRY(gpuckpt_cl_to_cf_8), GK_EMU_ENTRY(gpuckpt_cf_to_cl_8),
};

}  // namespace

extern "C" {

// Thread (and block) order: 0 forward, 1 reverse, 2 random with `seed`.
int gpuckpt_emu_set_order(int order, unsigned long long seed) {
  if (order < 0 || order > 2) return gk_emu::kBadLaunch;
  gk_emu::set_order(order, seed);
  return gk_emu::kOk;
}

// Launch kernel `name` over `grid` with `block_x` threads, running only the
// blocks [first, last) (last < 0: all).  `params` holds the 14 long long
// kernel parameters.  Returns a gk_emu::Status; 3 for an unknown kernel.
int gpuckpt_emu_launch(const char* name, unsigned int gx, unsigned int gy,
                       unsigned int gz, unsigned int block_x, long long first,
                       long long last, const void* a, void* b,
                       const long long* params, int log_tc, int log_tq) {
  for (const Entry& e : kKernels) {
    if (std::strcmp(e.name, name) != 0) continue;
    Params p;
    std::memcpy(p.v, params, sizeof(p.v));
    const KernelFn fn = e.fn;
    const std::function<void()> body = [fn, a, b, &p, log_tc, log_tq] {
      fn(a, b, p, log_tc, log_tq);
    };
    return gk_emu::launch(dim3{gx, gy, gz}, dim3{block_x, 1, 1}, first, last,
                          body);
  }
  std::fprintf(stderr, "cuda_emu: unknown kernel %s\n", name);
  return 3;
}

}  // extern "C"
