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

#include "crc32c_simd.h"

#if GCK_HAVE_X86_CRC

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
