/*
 * A file truncated under a memory map at the worst moment, for tests: an LD_PRELOAD
 * library that wraps mmap and mincore and truncates each file under GCK_TRUNCATE_DIR to
 * GCK_TRUNCATE_TO bytes (default 0) once it is mapped.
 *
 * A load that copies a cached chunk out of a map (gpuckpt/storage/local/crccopy.c) checks the
 * file's size, maps it, asks mincore whether its pages are cached, then copies: truncated
 * in between (cp, rsync --inplace or `: > file` over a checkpoint), the copy reads pages
 * past the new end of the file, which is SIGBUS. Here that happens on every load: a map
 * made by a library named *crccopy* is truncated right after mincore has reported the
 * map's last page cached (its last probe), before the first byte is copied (a populated
 * map of the copy loop, a tmpfs file's, once mmap has made it); a map made by
 * anything else (Python's mmap, NumPy's memmap) is truncated before mmap returns. No
 * change to the code under test: it calls mmap and mincore through libc, and this
 * library's come first.
 *
 * Build: cc -shared -fPIC -o truncate_on_mmap.so truncate_on_mmap.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

typedef void *(*mmap_fn)(void *, size_t, int, int, int, off_t);

typedef int (*mincore_fn)(void *, size_t, unsigned char *);

/* The file of fd when it lies under GCK_TRUNCATE_DIR (into path), else 0. */
static int under_dir(int fd, char *path)
{
    const char *dir = getenv("GCK_TRUNCATE_DIR");
    if (fd < 0 || dir == NULL || *dir != '/') return 0;
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, PATH_MAX - 1);
    if (n < 0) return 0;
    path[n] = 0;
    size_t len = strlen(dir);
    return strncmp(path, dir, len) == 0 && path[len] == '/';
}

static void truncate_path(const char *path)
{
    const char *to = getenv("GCK_TRUNCATE_TO");
    if (truncate(path, to ? atoll(to) : 0) != 0) abort(); /* a test that truncates nothing proves nothing */
}

/* Maps made by the copy loop, each truncated at the mincore of its last page. */
#define PENDING 64
static struct {
    uintptr_t end; /* 0: a free slot */
    char path[PATH_MAX];
} pending[PENDING];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static int from_copy_loop(const void *caller)
{
    Dl_info info;
    return caller != NULL && dladdr(caller, &info) && info.dli_fname != NULL && strstr(info.dli_fname, "crccopy");
}

static void *mapped(const char *name, const void *caller, void *addr, size_t len, int prot, int flags, int fd,
                    off_t off)
{
    mmap_fn real = (mmap_fn)dlsym(RTLD_NEXT, name);
    if (real == NULL) abort();
    void *m = real(addr, len, prot, flags, fd, off);
    char path[PATH_MAX];
    if (m == MAP_FAILED || !under_dir(fd, path)) return m;
    if (!from_copy_loop(caller) || (flags & MAP_POPULATE)) {
        /* (the copy loop populates the maps of tmpfs files, whose pages it does not probe:
         * truncated once the map is made and filled, before the first byte is copied) */
        truncate_path(path);
        return m;
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uintptr_t end = (uintptr_t)m + (len + page - 1) / page * page;
    pthread_mutex_lock(&lock);
    int slot = 0;
    while (slot < PENDING && pending[slot].end != 0) slot++;
    if (slot == PENDING) abort();
    pending[slot].end = end;
    strcpy(pending[slot].path, path);
    pthread_mutex_unlock(&lock);
    return m;
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
    return mapped("mmap", __builtin_return_address(0), addr, len, prot, flags, fd, off);
}

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
    return mapped("mmap64", __builtin_return_address(0), addr, len, prot, flags, fd, off);
}

int mincore(void *addr, size_t len, unsigned char *vec)
{
    mincore_fn real = (mincore_fn)dlsym(RTLD_NEXT, "mincore");
    if (real == NULL) abort();
    int rc = real(addr, len, vec);
    uintptr_t end = (uintptr_t)addr + len;
    char path[PATH_MAX];
    int found = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < PENDING && !found; i++) {
        if (pending[i].end == end) {
            strcpy(path, pending[i].path);
            pending[i].end = 0;
            found = 1;
        }
    }
    pthread_mutex_unlock(&lock);
    if (found) truncate_path(path);
    return rc;
}

/* A map of the copy loop unmapped before its last page was probed (it declined): forgotten. */
int munmap(void *addr, size_t len)
{
    int (*real)(void *, size_t) = (int (*)(void *, size_t))dlsym(RTLD_NEXT, "munmap");
    if (real == NULL) abort();
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uintptr_t end = (uintptr_t)addr + (len + page - 1) / page * page;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < PENDING; i++)
        if (pending[i].end == end) pending[i].end = 0;
    pthread_mutex_unlock(&lock);
    return real(addr, len);
}
