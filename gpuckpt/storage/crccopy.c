/*
 * Copy with CRC-32C in one pass: the loader's inner loop for chunks in the page cache.
 *
 * A checked load otherwise moves every byte twice (the kernel copies it out of the
 * page cache, then a checksum reads it back); here the bytes are read once from a
 * memory map of the file, folded into the checksum with carry-less multiplies and
 * written to the destination with non-temporal stores. On x86-64 with AVX-512 +
 * VPCLMULQDQ this runs at the speed of a plain memory copy.
 *
 * Built by the package's build hook into _crccopy.so and loaded with ctypes
 * (gpuckpt/storage/crccopy.py); without a C compiler, or on other CPUs, gpuckpt
 * reads through pread and a CRC library instead. No Python headers are needed.
 *
 * CRC-32C here follows the usual convention (reflected, initial value and final
 * XOR 0xFFFFFFFF); functions take and return the finished value, so a CRC can be
 * continued across calls as with the crc32c package.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#define GCK_ABI 1

int gck_abi(void) { return GCK_ABI; }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
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

int gck_isa(void)
{
    if (isa < 0) setup();
    return isa;
}

/* Use at most the given instruction set (tests exercise every path on one machine). */
int gck_limit_isa(int most)
{
    if (gck_isa() > most) isa = most < 0 ? ISA_NONE : most;
    return isa;
}

/* CRC-32C of src[0:n] continued from crc; also copies src to dst unless dst is NULL. */
uint32_t gck_crc_copy(uint32_t crc, const void *src, void *dst, uint64_t n)
{
    uint32_t c = ~crc;
    switch (gck_isa()) {
    case ISA_AVX512: c = fold_copy_512(c, src, dst, n); break;
    case ISA_PCLMUL: c = fold_copy_128(c, src, dst, n); break;
    default: return 0; /* callers check gck_isa() first */
    }
    return ~c;
}

/* Whether the byte at off is in the page cache (a one-byte read that may not wait for I/O). */
static int cached_at(int fd, int64_t off)
{
    char b;
    struct iovec v = {&b, 1};
    return preadv2(fd, &v, 1, off, RWF_NOWAIT) == 1;
}

/* Copy n bytes at offset off of file fd into dst with their CRC-32C (continued from
 * crc) in *crc_out, reading them through a memory map. Only for a range that is in the
 * page cache: faulting an uncached file in through a map is slower than the caller's
 * large preads. Whether it is cached is probed at its first, middle and last byte (a
 * file is written or read whole, so it is cached whole or not at all; a page evicted
 * in between is still read correctly, just more slowly). Returns 0 when copied, 1 when
 * not (uncached, or the file is shorter than off + n), -errno on a system error. */
int gck_cached_copy_crc(int fd, int64_t off, void *dst, uint64_t n, uint32_t crc, uint32_t *crc_out)
{
    if (gck_isa() == ISA_NONE) return -ENOSYS;
    if (off < 0) return -EINVAL;
    if (n == 0) {
        *crc_out = crc;
        return 0;
    }
    struct stat st;
    if (fstat(fd, &st)) return -errno;
    if ((uint64_t)st.st_size < (uint64_t)off + n) return 1;
    if (!cached_at(fd, off) || !cached_at(fd, off + (int64_t)(n / 2)) || !cached_at(fd, off + (int64_t)n - 1))
        return 1;
    long page = sysconf(_SC_PAGESIZE);
    int64_t start = off & ~(int64_t)(page - 1);
    size_t len = (size_t)(off - start) + n;
    uint8_t *map = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, start);
    if (map == MAP_FAILED) return -errno;
    *crc_out = gck_crc_copy(crc, map + (off - start), dst, n);
    munmap(map, len);
    return 0;
}

#else /* not x86-64: the Python fallback reads these files */

int gck_isa(void) { return 0; }

int gck_limit_isa(int most)
{
    (void)most;
    return 0;
}

uint32_t gck_crc_copy(uint32_t crc, const void *src, void *dst, uint64_t n)
{
    (void)src, (void)dst, (void)n;
    return crc;
}

int gck_cached_copy_crc(int fd, int64_t off, void *dst, uint64_t n, uint32_t crc, uint32_t *crc_out)
{
    (void)fd, (void)off, (void)dst, (void)n, (void)crc, (void)crc_out;
    return -ENOSYS;
}

#endif
