// Shared library that runs kernels/channels_last.cu on the CPU through the
// emulation in cuda_emu.h.  The tests load it with ctypes.  The GK_BUILD_*
// switches of the kernel source select which entry points it holds.
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

#define GK_EMU_WRAP_PX(ES, T, C)                  \
  GK_EMU_WRAP(gpuckpt_px_cl_to_cf_##ES##_##C, T) \
  GK_EMU_WRAP(gpuckpt_px_cf_to_cl_##ES##_##C, T)
#define GK_EMU_WRAP_PX_ALL(ES, T) \
  GK_EMU_WRAP_PX(ES, T, 1)        \
  GK_EMU_WRAP_PX(ES, T, 2)        \
  GK_EMU_WRAP_PX(ES, T, 3)        \
  GK_EMU_WRAP_PX(ES, T, 4)        \
  GK_EMU_WRAP_PX(ES, T, 5)        \
  GK_EMU_WRAP_PX(ES, T, 6)        \
  GK_EMU_WRAP_PX(ES, T, 7)        \
  GK_EMU_WRAP_PX(ES, T, 8)

#if GK_BUILD_TILED
GK_EMU_WRAP(gpuckpt_cl_to_cf_1, unsigned char)
GK_EMU_WRAP(gpuckpt_cf_to_cl_1, unsigned char)
GK_EMU_WRAP(gpuckpt_cl_to_cf_2, unsigned short)
GK_EMU_WRAP(gpuckpt_cf_to_cl_2, unsigned short)
GK_EMU_WRAP(gpuckpt_cl_to_cf_4, unsigned int)
GK_EMU_WRAP(gpuckpt_cf_to_cl_4, unsigned int)
GK_EMU_WRAP(gpuckpt_cl_to_cf_8, unsigned long long)
GK_EMU_WRAP(gpuckpt_cf_to_cl_8, unsigned long long)
#endif
#if GK_BUILD_MICRO
GK_EMU_WRAP(gpuckpt_mt_cl_to_cf_1, unsigned char)
GK_EMU_WRAP(gpuckpt_mt_cf_to_cl_1, unsigned char)
GK_EMU_WRAP(gpuckpt_mt_cl_to_cf_2, unsigned short)
GK_EMU_WRAP(gpuckpt_mt_cf_to_cl_2, unsigned short)
GK_EMU_WRAP(gpuckpt_mt_cl_to_cf_4, unsigned int)
GK_EMU_WRAP(gpuckpt_mt_cf_to_cl_4, unsigned int)
GK_EMU_WRAP(gpuckpt_mt_cl_to_cf_8, unsigned long long)
GK_EMU_WRAP(gpuckpt_mt_cf_to_cl_8, unsigned long long)
#endif
#if GK_BUILD_PX_SIZES & 1
GK_EMU_WRAP_PX_ALL(1, unsigned char)
#endif
#if GK_BUILD_PX_SIZES & 2
GK_EMU_WRAP_PX_ALL(2, unsigned short)
#endif
#if GK_BUILD_PX_SIZES & 4
GK_EMU_WRAP_PX_ALL(4, unsigned int)
#endif
#if GK_BUILD_PX_SIZES & 8
GK_EMU_WRAP_PX_ALL(8, unsigned long long)
#endif

struct Entry {
  const char* name;
  KernelFn fn;
};

#define GK_EMU_ENTRY(NAME) {#NAME, wrap_##NAME},
#define GK_EMU_ENTRY_PX(ES, C)                   \
  GK_EMU_ENTRY(gpuckpt_px_cl_to_cf_##ES##_##C) \
  GK_EMU_ENTRY(gpuckpt_px_cf_to_cl_##ES##_##C)
#define GK_EMU_ENTRY_PX_ALL(ES) \
  GK_EMU_ENTRY_PX(ES, 1)        \
  GK_EMU_ENTRY_PX(ES, 2)        \
  GK_EMU_ENTRY_PX(ES, 3)        \
  GK_EMU_ENTRY_PX(ES, 4)        \
  GK_EMU_ENTRY_PX(ES, 5)        \
  GK_EMU_ENTRY_PX(ES, 6)        \
  GK_EMU_ENTRY_PX(ES, 7)        \
  GK_EMU_ENTRY_PX(ES, 8)

// The kernels this build defines (see GK_BUILD_* in channels_last.cu).
const Entry kKernels[] = {
#if GK_BUILD_TILED
    GK_EMU_ENTRY(gpuckpt_cl_to_cf_1) GK_EMU_ENTRY(gpuckpt_cf_to_cl_1)
    GK_EMU_ENTRY(gpuckpt_cl_to_cf_2) GK_EMU_ENTRY(gpuckpt_cf_to_cl_2)
    GK_EMU_ENTRY(gpuckpt_cl_to_cf_4) GK_EMU_ENTRY(gpuckpt_cf_to_cl_4)
    GK_EMU_ENTRY(gpuckpt_cl_to_cf_8) GK_EMU_ENTRY(gpuckpt_cf_to_cl_8)
#endif
#if GK_BUILD_MICRO
    GK_EMU_ENTRY(gpuckpt_mt_cl_to_cf_1) GK_EMU_ENTRY(gpuckpt_mt_cf_to_cl_1)
    GK_EMU_ENTRY(gpuckpt_mt_cl_to_cf_2) GK_EMU_ENTRY(gpuckpt_mt_cf_to_cl_2)
    GK_EMU_ENTRY(gpuckpt_mt_cl_to_cf_4) GK_EMU_ENTRY(gpuckpt_mt_cf_to_cl_4)
    GK_EMU_ENTRY(gpuckpt_mt_cl_to_cf_8) GK_EMU_ENTRY(gpuckpt_mt_cf_to_cl_8)
#endif
#if GK_BUILD_PX_SIZES & 1
    GK_EMU_ENTRY_PX_ALL(1)
#endif
#if GK_BUILD_PX_SIZES & 2
    GK_EMU_ENTRY_PX_ALL(2)
#endif
#if GK_BUILD_PX_SIZES & 4
    GK_EMU_ENTRY_PX_ALL(4)
#endif
#if GK_BUILD_PX_SIZES & 8
    GK_EMU_ENTRY_PX_ALL(8)
#endif
    {nullptr, nullptr},
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
// kernel parameters, `int0` and `int1` the two int ones.  Returns a
// gk_emu::Status; 3 for a kernel this build does not define.
int gpuckpt_emu_launch(const char* name, unsigned int gx, unsigned int gy,
                       unsigned int gz, unsigned int block_x, long long first,
                       long long last, const void* a, void* b,
                       const long long* params, int int0, int int1) {
  for (const Entry& e : kKernels) {
    if (e.name == nullptr || std::strcmp(e.name, name) != 0) continue;
    Params p;
    std::memcpy(p.v, params, sizeof(p.v));
    const KernelFn fn = e.fn;
    const std::function<void()> body = [fn, a, b, &p, int0, int1] {
      fn(a, b, p, int0, int1);
    };
    return gk_emu::launch(dim3{gx, gy, gz}, dim3{block_x, 1, 1}, first, last,
                          body);
  }
  std::fprintf(stderr, "cuda_emu: unknown kernel %s\n", name);
  return 3;
}

}  // extern "C"
