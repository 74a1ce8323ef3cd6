/*
 * A file truncated under a memory map at the worst moment, for tests: an LD_PRELOAD
 * library that wraps mmap and, whenever a file under GCK_TRUNCATE_DIR has just been
 * mapped, truncates it to GCK_TRUNCATE_TO bytes (default 0) before the map is returned.
 *
 * A load that copies a cached chunk out of a map (gpuckpt/storage/local/crccopy.c) checks the
 * file's size, maps it, then copies: truncated in between (cp, rsync --inplace or
 * `: > file` over a checkpoint), the copy reads pages past the new end of the file, which
 * is SIGBUS. Here that happens on every load, after the size check and the map and before
 * the first byte is copied, with no change to the code under test: it calls mmap through
 * libc, and this library's mmap comes first.
 *
 * Build: cc -shared -fPIC -o truncate_on_mmap.so truncate_on_mmap.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

typedef void *(*mmap_fn)(void *, size_t, int, int, int, off_t);

static void truncate_if_under(int fd)
{
    const char *dir = getenv("GCK_TRUNCATE_DIR");
    if (fd < 0 || dir == NULL || *dir != '/') return;
    char link[64], path[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 0) return;
    path[n] = 0;
    size_t len = strlen(dir);
    if (strncmp(path, dir, len) != 0 || path[len] != '/') return;
    const char *to = getenv("GCK_TRUNCATE_TO");
    if (truncate(path, to ? atoll(to) : 0) != 0) abort(); /* a test that truncates nothing proves nothing */
}

static void *mapped(const char *name, void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
    mmap_fn real = (mmap_fn)dlsym(RTLD_NEXT, name);
    if (real == NULL) abort();
    void *m = real(addr, len, prot, flags, fd, off);
    if (m != MAP_FAILED) truncate_if_under(fd);
    return m;
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
    return mapped("mmap", addr, len, prot, flags, fd, off);
}

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
    return mapped("mmap64", addr, len, prot, flags, fd, off);
}
