// XXH3-128 content hashes of chunks, computed on the device (incremental saves).
//
// A chunk's hash is a one-level tree (gpuckpt/format/contenthash.py):
//   hash(b) = XXH3_128(b)                                  if len(b) <= 1 MiB
//           = XXH3_128(leaf digests, 16 bytes each)         otherwise
// where the leaves are the 1 MiB pieces of b (the last one shorter) and every
// digest is XXH3's canonical form (high half first, each half big-endian).
// The seed is 0 and the secret XXH3's default one.
//
// gpuckpt_xxh3_leaves: one thread per leaf (any byte range of `data`).
// gpuckpt_xxh3_roots:  one thread per chunk, over its leaves' digests.
//
// Includes nothing (NVRTC has no standard headers); runs on the CPU through
// kernels/emu/cuda_emu.h unchanged. Reads are byte loads unless the address
// is 8-byte aligned, so any byte offset is safe on the device.

typedef unsigned long long gk_u64;
typedef unsigned int gk_u32;
typedef unsigned char gk_u8;

#define GK_P32_1 0x9E3779B1U
#define GK_P32_2 0x85EBCA77U
#define GK_P32_3 0xC2B2AE3DU
#define GK_P64_1 0x9E3779B185EBCA87ULL
#define GK_P64_2 0xC2B2AE3D27D4EB4FULL
#define GK_P64_3 0x165667B19E3779F9ULL
#define GK_P64_4 0x85EBCA77C2B2AE63ULL
#define GK_P64_5 0x27D4EB2F165667C5ULL
#define GK_MX1 0x165667919E3779F9ULL
#define GK_MX2 0x9FB21C651E98DF25ULL

// XXH3's default secret (192 bytes), a constant of the algorithm.
__device__ const gk_u8 gk_xxh3_secret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

struct gk_h128 {
  gk_u64 lo, hi;
};

__device__ __forceinline__ gk_u64 gk_rd64(const gk_u8* p) {
  if ((((gk_u64)p) & 7) == 0) return *(const gk_u64*)p;  // little-endian, aligned
  gk_u64 v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

__device__ __forceinline__ gk_u32 gk_rd32(const gk_u8* p) {
  if ((((gk_u64)p) & 3) == 0) return *(const gk_u32*)p;
  return (gk_u32)p[0] | ((gk_u32)p[1] << 8) | ((gk_u32)p[2] << 16) | ((gk_u32)p[3] << 24);
}

__device__ __forceinline__ gk_u64 gk_rotl64(gk_u64 x, int r) { return (x << r) | (x >> (64 - r)); }
__device__ __forceinline__ gk_u32 gk_rotl32(gk_u32 x, int r) { return (x << r) | (x >> (32 - r)); }

__device__ __forceinline__ gk_u32 gk_swap32(gk_u32 x) {
  return ((x << 24) & 0xff000000U) | ((x << 8) & 0x00ff0000U) | ((x >> 8) & 0x0000ff00U) |
         ((x >> 24) & 0x000000ffU);
}

__device__ __forceinline__ gk_u64 gk_swap64(gk_u64 x) {
  return ((gk_u64)gk_swap32((gk_u32)x) << 32) | gk_swap32((gk_u32)(x >> 32));
}

// the full 128-bit product of two 64-bit values, from four 32x32 products
__device__ __forceinline__ gk_h128 gk_mul128(gk_u64 a, gk_u64 b) {
  const gk_u64 lo_lo = (a & 0xFFFFFFFFULL) * (b & 0xFFFFFFFFULL);
  const gk_u64 hi_lo = (a >> 32) * (b & 0xFFFFFFFFULL);
  const gk_u64 lo_hi = (a & 0xFFFFFFFFULL) * (b >> 32);
  const gk_u64 hi_hi = (a >> 32) * (b >> 32);
  const gk_u64 cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFULL) + lo_hi;
  gk_h128 r;
  r.hi = (hi_lo >> 32) + (cross >> 32) + hi_hi;
  r.lo = (cross << 32) | (lo_lo & 0xFFFFFFFFULL);
  return r;
}

__device__ __forceinline__ gk_u64 gk_fold64(gk_u64 a, gk_u64 b) {
  const gk_h128 p = gk_mul128(a, b);
  return p.lo ^ p.hi;
}

__device__ __forceinline__ gk_u64 gk_avalanche_xxh64(gk_u64 h) {
  h ^= h >> 33;
  h *= GK_P64_2;
  h ^= h >> 29;
  h *= GK_P64_3;
  h ^= h >> 32;
  return h;
}

__device__ __forceinline__ gk_u64 gk_avalanche(gk_u64 h) {
  h ^= h >> 37;
  h *= GK_MX1;
  h ^= h >> 32;
  return h;
}

__device__ __forceinline__ gk_u64 gk_mix16(const gk_u8* in, const gk_u8* sec) {
  return gk_fold64(gk_rd64(in) ^ gk_rd64(sec), gk_rd64(in + 8) ^ gk_rd64(sec + 8));
}

__device__ __forceinline__ gk_h128 gk_mix32(gk_h128 acc, const gk_u8* a, const gk_u8* b,
                                            const gk_u8* sec) {
  acc.lo += gk_mix16(a, sec);
  acc.lo ^= gk_rd64(b) + gk_rd64(b + 8);
  acc.hi += gk_mix16(b, sec + 16);
  acc.hi ^= gk_rd64(a) + gk_rd64(a + 8);
  return acc;
}

__device__ __forceinline__ gk_h128 gk_finish_mid(gk_h128 acc, gk_u64 len) {
  gk_h128 h;
  h.lo = gk_avalanche(acc.lo + acc.hi);
  h.hi = (gk_u64)0 - gk_avalanche(acc.lo * GK_P64_1 + acc.hi * GK_P64_4 + len * GK_P64_2);
  return h;
}

__device__ gk_h128 gk_xxh3_short(const gk_u8* in, gk_u64 len) {
  const gk_u8* s = gk_xxh3_secret;
  gk_h128 h;
  if (len > 8) {
    const gk_u64 flip_lo = gk_rd64(s + 32) ^ gk_rd64(s + 40);
    const gk_u64 flip_hi = gk_rd64(s + 48) ^ gk_rd64(s + 56);
    const gk_u64 in_lo = gk_rd64(in);
    gk_u64 in_hi = gk_rd64(in + len - 8);
    gk_h128 m = gk_mul128(in_lo ^ in_hi ^ flip_lo, GK_P64_1);
    m.lo += (len - 1) << 54;
    in_hi ^= flip_hi;
    m.hi += in_hi + (gk_u64)(gk_u32)in_hi * (gk_u64)(GK_P32_2 - 1);
    m.lo ^= gk_swap64(m.hi);
    h = gk_mul128(m.lo, GK_P64_2);
    h.hi += m.hi * GK_P64_2;
    h.lo = gk_avalanche(h.lo);
    h.hi = gk_avalanche(h.hi);
    return h;
  }
  if (len >= 4) {
    const gk_u64 in64 = (gk_u64)gk_rd32(in) + ((gk_u64)gk_rd32(in + len - 4) << 32);
    const gk_u64 keyed = in64 ^ (gk_rd64(s + 16) ^ gk_rd64(s + 24));
    gk_h128 m = gk_mul128(keyed, GK_P64_1 + (len << 2));
    m.hi += m.lo << 1;
    m.lo ^= m.hi >> 3;
    m.lo ^= m.lo >> 35;
    m.lo *= GK_MX2;
    m.lo ^= m.lo >> 28;
    m.hi = gk_avalanche(m.hi);
    return m;
  }
  if (len > 0) {
    const gk_u32 c1 = in[0], c2 = in[len >> 1], c3 = in[len - 1];
    const gk_u32 lo = (c1 << 16) | (c2 << 24) | c3 | ((gk_u32)len << 8);
    const gk_u32 hi = gk_rotl32(gk_swap32(lo), 13);
    h.lo = gk_avalanche_xxh64((gk_u64)lo ^ (gk_u64)(gk_rd32(s) ^ gk_rd32(s + 4)));
    h.hi = gk_avalanche_xxh64((gk_u64)hi ^ (gk_u64)(gk_rd32(s + 8) ^ gk_rd32(s + 12)));
    return h;
  }
  h.lo = gk_avalanche_xxh64(gk_rd64(s + 64) ^ gk_rd64(s + 72));
  h.hi = gk_avalanche_xxh64(gk_rd64(s + 80) ^ gk_rd64(s + 88));
  return h;
}

__device__ gk_h128 gk_xxh3_mid(const gk_u8* in, gk_u64 len) {
  const gk_u8* s = gk_xxh3_secret;
  gk_h128 acc;
  acc.lo = len * GK_P64_1;
  acc.hi = 0;
  if (len <= 128) {
    if (len > 32) {
      if (len > 64) {
        if (len > 96) acc = gk_mix32(acc, in + 48, in + len - 64, s + 96);
        acc = gk_mix32(acc, in + 32, in + len - 48, s + 64);
      }
      acc = gk_mix32(acc, in + 16, in + len - 32, s + 32);
    }
    acc = gk_mix32(acc, in, in + len - 16, s);
    return gk_finish_mid(acc, len);
  }
  for (gk_u64 i = 32; i < 160; i += 32) acc = gk_mix32(acc, in + i - 32, in + i - 16, s + i - 32);
  acc.lo = gk_avalanche(acc.lo);
  acc.hi = gk_avalanche(acc.hi);
  for (gk_u64 i = 160; i <= len; i += 32) acc = gk_mix32(acc, in + i - 32, in + i - 16, s + 3 + i - 160);
  // the last 32 bytes, in reverse order, against the secret's end (136 - 17 - 16)
  acc = gk_mix32(acc, in + len - 16, in + len - 32, s + 103);
  return gk_finish_mid(acc, len);
}

__device__ __forceinline__ void gk_stripe(gk_u64* acc, const gk_u8* in, const gk_u8* sec) {
  for (int lane = 0; lane < 8; ++lane) {
    const gk_u64 v = gk_rd64(in + 8 * lane);
    const gk_u64 k = v ^ gk_rd64(sec + 8 * lane);
    acc[lane ^ 1] += v;
    acc[lane] += (k & 0xFFFFFFFFULL) * (k >> 32);
  }
}

__device__ __forceinline__ gk_u64 gk_merge(const gk_u64* acc, const gk_u8* sec, gk_u64 start) {
  gk_u64 r = start;
  for (int i = 0; i < 4; ++i)
    r += gk_fold64(acc[2 * i] ^ gk_rd64(sec + 16 * i), acc[2 * i + 1] ^ gk_rd64(sec + 16 * i + 8));
  return gk_avalanche(r);
}

__device__ gk_h128 gk_xxh3_long(const gk_u8* in, gk_u64 len) {
  const gk_u8* s = gk_xxh3_secret;
  gk_u64 acc[8] = {GK_P32_3, GK_P64_1, GK_P64_2, GK_P64_3, GK_P64_4, GK_P32_2, GK_P64_5, GK_P32_1};
  const gk_u64 stripes_per_block = (192 - 64) / 8;  // 16
  const gk_u64 block_len = 64 * stripes_per_block;   // 1 KiB
  const gk_u64 blocks = (len - 1) / block_len;
  for (gk_u64 n = 0; n < blocks; ++n) {
    const gk_u8* b = in + n * block_len;
    for (gk_u64 st = 0; st < stripes_per_block; ++st) gk_stripe(acc, b + 64 * st, s + 8 * st);
    for (int lane = 0; lane < 8; ++lane) {  // scramble
      gk_u64 a = acc[lane];
      a ^= a >> 47;
      a ^= gk_rd64(s + 192 - 64 + 8 * lane);
      a *= GK_P32_1;
      acc[lane] = a;
    }
  }
  const gk_u64 last = ((len - 1) - block_len * blocks) / 64;
  for (gk_u64 st = 0; st < last; ++st) gk_stripe(acc, in + blocks * block_len + 64 * st, s + 8 * st);
  gk_stripe(acc, in + len - 64, s + 192 - 64 - 7);
  gk_h128 h;
  h.lo = gk_merge(acc, s + 11, len * GK_P64_1);
  h.hi = gk_merge(acc, s + 192 - 64 - 11, ~(len * GK_P64_2));
  return h;
}

__device__ gk_h128 gk_xxh3_128(const gk_u8* in, gk_u64 len) {
  if (len <= 16) return gk_xxh3_short(in, len);
  if (len <= 240) return gk_xxh3_mid(in, len);
  return gk_xxh3_long(in, len);
}

__device__ __forceinline__ void gk_store_canonical(gk_u8* out, gk_h128 h) {
  for (int i = 0; i < 8; ++i) {
    out[i] = (gk_u8)(h.hi >> (56 - 8 * i));
    out[8 + i] = (gk_u8)(h.lo >> (56 - 8 * i));
  }
}

// Leaf i is the `lengths[i]` bytes at `data + offsets[i]`; its canonical digest goes to out[16 i].
extern "C" __global__ void gpuckpt_xxh3_leaves(const gk_u8* __restrict__ data,
                                               const gk_u64* __restrict__ offsets,
                                               const gk_u64* __restrict__ lengths, gk_u64 nleaves,
                                               gk_u8* __restrict__ out) {
  const gk_u64 i = (gk_u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= nleaves) return;
  gk_store_canonical(out + 16 * i, gk_xxh3_128(data + offsets[i], lengths[i]));
}

// Chunk c owns the `counts[c]` leaf digests from digests[16 first[c]]: its hash is the digest
// itself for one leaf, else XXH3-128 of the digests; written to out[16 c].
extern "C" __global__ void gpuckpt_xxh3_roots(const gk_u8* __restrict__ digests,
                                              const gk_u64* __restrict__ first,
                                              const gk_u64* __restrict__ counts, gk_u64 nchunks,
                                              gk_u8* __restrict__ out) {
  const gk_u64 c = (gk_u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= nchunks) return;
  const gk_u8* d = digests + 16 * first[c];
  if (counts[c] == 1) {
    for (int k = 0; k < 16; ++k) out[16 * c + k] = d[k];
    return;
  }
  gk_store_canonical(out + 16 * c, gk_xxh3_128(d, 16 * counts[c]));
}
