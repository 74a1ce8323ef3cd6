/*
 * CRC-32C kernels for x86-64 shared by the native libraries (crccopy.c, batchio.c):
 * the SSE4.2 CRC instruction for short runs and heads/tails, and carry-less multiply
 * folding (PCLMULQDQ, or AVX-512 + VPCLMULQDQ) for the bulk, optionally copying the
 * bytes to a destination with streaming stores in the same pass.
 *
 * Static functions and data only: each library that includes this gets its own copy.
 * Include it after <stdint.h> and <string.h>; GCK_HAVE_X86_CRC says whether the
 * kernels exist on this target. Raw CRC values here are not inverted: callers apply
 * the initial and final XOR. setup() (through the caller's isa accessor) must run
 * once before any kernel, on one thread.
 */
#ifndef GCK_CRC32C_SIMD_H
#define GCK_CRC32C_SIMD_H

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GCK_HAVE_X86_CRC 1
#include <immintrin.h>

#define TARGET_SSE __attribute__((target("sse4.2,pclmul")))
#define TARGET_512 __attribute__((target("sse4.2,pclmul,avx512f,avx512bw,vpclmulqdq")))

enum { ISA_NONE = 0, ISA_PCLMUL = 1, ISA_AVX512 = 2 };
static int isa = -1;

/* Fold constants: for a 128-bit lane whose low qword L and high qword H sit D bits
 * before the lane they are folded into, L*x^(64+D) + H*x^D (mod P). In the reflected
 * domain a carry-less product carries an extra factor x, hence the -1. */
static uint64_t k128[2], k512[8] __attribute__((aligned(64)));

static uint32_t xpow_mod(uint64_t n) /* x^n mod P, bit j = coefficient of x^j */
{
    uint64_t r = 1;
    while (n--) {
        uint64_t top = r >> 31 & 1;
        r = (r << 1) & 0xffffffffu;
        if (top) r ^= 0x1EDC6F41u;
    }
    return (uint32_t)r;
}

static uint64_t reflect(uint32_t p) /* coefficient of x^j -> bit 63-j */
{
    uint64_t k = 0;
    for (int j = 0; j < 32; j++)
        if (p >> j & 1) k |= 1ull << (63 - j);
    return k;
}

static void setup(void)
{
    k128[0] = reflect(xpow_mod(64 + 512 - 1));
    k128[1] = reflect(xpow_mod(512 - 1));
    uint64_t lo = reflect(xpow_mod(64 + 2048 - 1)), hi = reflect(xpow_mod(2048 - 1));
    for (int i = 0; i < 8; i += 2) {
        k512[i] = lo;
        k512[i + 1] = hi;
    }
    __builtin_cpu_init();
    int sse = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul");
    int wide = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("vpclmulqdq");
    isa = !sse ? ISA_NONE : wide ? ISA_AVX512 : ISA_PCLMUL;
}

/* raw CRC (no inversion) over n bytes, 8 at a time, copying when d is not NULL */
TARGET_SSE static uint32_t crc_bytes(uint32_t c, const uint8_t *s, uint8_t *d, size_t n)
{
    uint64_t cc = c;
    for (; n >= 8; n -= 8, s += 8) {
        uint64_t x;
        memcpy(&x, s, 8);
        cc = _mm_crc32_u64(cc, x);
        if (d) {
            memcpy(d, &x, 8);
            d += 8;
        }
    }
    c = (uint32_t)cc;
    for (; n; n--, s++) {
        c = _mm_crc32_u8(c, *s);
        if (d) *d++ = *s;
    }
    return c;
}

/* Head: bytes until d is 64-byte aligned, so the bulk can use aligned streaming stores. */
static size_t head_len(const uint8_t *d, size_t n)
{
    size_t h = d ? (size_t)(-(uintptr_t)d & 63) : 0;
    return h < n ? h : n;
}

/* Raw CRC of the 4*16-byte or 4*64-byte accumulator block, which stands for all bytes folded so far. */
TARGET_SSE static uint32_t crc_block(const void *acc, size_t n) { return crc_bytes(0, acc, NULL, n); }

TARGET_SSE static uint32_t fold_copy_128(uint32_t c, const uint8_t *s, uint8_t *d, size_t n)
{
    size_t h = head_len(d, n);
    c = crc_bytes(c, s, d, h);
    s += h, n -= h;
    if (d) d += h;
    if (n < 128) return crc_bytes(c, s, d, n);
    const __m128i k = _mm_loadu_si128((const __m128i *)k128);
    __m128i a[4];
    for (int i = 0; i < 4; i++) a[i] = _mm_loadu_si128((const __m128i *)(s + 16 * i));
    if (d)
        for (int i = 0; i < 4; i++) _mm_stream_si128((__m128i *)(d + 16 * i), a[i]);
    a[0] = _mm_xor_si128(a[0], _mm_cvtsi32_si128((int)c)); /* the running CRC enters as the first 4 bytes */
    s += 64, n -= 64;
    if (d) d += 64;
    for (; n >= 64; s += 64, n -= 64) {
        for (int i = 0; i < 4; i++) {
            __m128i x = _mm_loadu_si128((const __m128i *)(s + 16 * i));
            if (d) _mm_stream_si128((__m128i *)(d + 16 * i), x);
            a[i] = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a[i], k, 0x00),
                                               _mm_clmulepi64_si128(a[i], k, 0x11)), x);
        }
        if (d) d += 64;
    }
    if (d) _mm_sfence();
    uint8_t buf[64];
    for (int i = 0; i < 4; i++) _mm_storeu_si128((__m128i *)(buf + 16 * i), a[i]);
    return crc_bytes(crc_block(buf, sizeof buf), s, d, n);
}

TARGET_512 static uint32_t fold_copy_512(uint32_t c, const uint8_t *s, uint8_t *d, size_t n)
{
    size_t h = head_len(d, n);
    c = crc_bytes(c, s, d, h);
    s += h, n -= h;
    if (d) d += h;
    if (n < 512) return fold_copy_128(c, s, d, n);
    const __m512i k = _mm512_load_si512(k512);
    __m512i a[4];
    for (int i = 0; i < 4; i++) a[i] = _mm512_loadu_si512(s + 64 * i);
    if (d)
        for (int i = 0; i < 4; i++) _mm512_stream_si512((void *)(d + 64 * i), a[i]);
    a[0] = _mm512_xor_si512(a[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)c)));
    s += 256, n -= 256;
    if (d) d += 256;
    for (; n >= 256; s += 256, n -= 256) {
        for (int i = 0; i < 4; i++) {
            __m512i x = _mm512_loadu_si512(s + 64 * i);
            if (d) _mm512_stream_si512((void *)(d + 64 * i), x);
            /* 0x96: three-way XOR */
            a[i] = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a[i], k, 0x00),
                                             _mm512_clmulepi64_epi128(a[i], k, 0x11), x, 0x96);
        }
        if (d) d += 256;
    }
    if (d) _mm_sfence();
    uint8_t buf[256];
    for (int i = 0; i < 4; i++) _mm512_storeu_si512(buf + 64 * i, a[i]);
    return crc_bytes(crc_block(buf, sizeof buf), s, d, n);
}

#else
#define GCK_HAVE_X86_CRC 0
#endif

#endif /* GCK_CRC32C_SIMD_H */
