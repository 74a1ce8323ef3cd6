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
 * (gpuckpt/storage/local/crccopy.py); without a C compiler, or on other CPUs, gpuckpt
 * reads through pread and a CRC library instead. No Python headers are needed.
 *
 * CRC-32C here follows the usual convention (reflected, initial value and final
 * XOR 0xFFFFFFFF); functions take and return the finished value, so a CRC can be
 * continued across calls as with the crc32c package.
 *
 * A file truncated while it is mapped (cp, rsync --inplace or `: > file` over a
 * checkpoint during a load), or a page that cannot be read (a medium error), turns the
 * next read of the map into SIGBUS, which kills the process. So the copy out of a map
 * runs under a guard: the library's SIGBUS handler jumps back out of the copy when the
 * fault is on the map or the destination of a copy running on the faulting thread; the
 * copy then reports that the file changed, and the caller reads it with pread, which
 * meets the file as it now is (a short file: the typed "truncated" error of every
 * other read). Any other SIGBUS goes to the handler that was there before, as if the
 * library had never been loaded (see on_sigbus).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#define GCK_ABI 5
#define TMPFS_MAGIC_ 0x01021994 /* linux/magic.h */

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

/* Whether the page holding byte i of the map is in the page cache. mincore reads
 * nothing and starts no I/O, unlike a one-byte preadv2(RWF_NOWAIT): that starts the
 * readahead of a missing page (up to the device's read_ahead_kb, 8 MiB on some disks) and
 * returns the byte when that I/O completes first, so it can call a cold file cached. */
static int cached_at(const uint8_t *map, size_t i, long page)
{
    unsigned char v = 0;
    const uint8_t *p = map + (i & ~(size_t)(page - 1));
    return mincore((void *)p, (size_t)page, &v) == 0 && (v & 1);
}

/* ---- The guard against SIGBUS on a mapped file ------------------------------------
 *
 * A copy in progress holds one slot of `guards`: its thread id and the two ranges it
 * touches. The handler finds the slot of the faulting thread by a scan of plain atomic
 * loads: no thread-local storage (a dlopen'ed library's TLS may be allocated lazily,
 * with malloc, on first use from a thread, which a signal handler must not do), no
 * locks, nothing but async-signal-safe calls.
 *
 * Other code installs SIGBUS handlers too (Python's faulthandler, pytest through it), so
 * each copy first checks that the library's handler is the one installed and installs
 * it again, under a lock, when another replaced it; the replaced handler becomes the
 * one a fault outside a copy is handed to. Handing over means restoring that handler
 * and letting the fault happen again under it (for a fault: the instruction runs
 * again), so the next handler sees the genuine signal, with its address, exactly as if
 * this library were not there; faulthandler, for one, prints its traceback and then
 * restores and re-raises to the handler it replaced. The record of the previous
 * handler is used once: if the chain comes back here (faulthandler restores the
 * handler it replaced, which may be this one), the signal goes to the default action
 * instead of around the loop again. The next copy installs the handler again. */

#define GUARDS 256

struct guard {
    _Atomic long tid; /* the owning thread while a copy runs; 0 free, -1 being set up */
    uintptr_t src, src_len, dst, dst_len;
    sigjmp_buf *jump;
};

static struct guard guards[GUARDS];
static atomic_ulong faults;                 /* copies a fault interrupted (for tests, diagnostics) */
static struct sigaction previous[2];        /* the handlers the library replaced, in turn */
static atomic_int previous_at = 2;          /* which of them chains next; 2: the default action */
static const struct sigaction default_action = {.sa_handler = SIG_DFL};
static pthread_mutex_t install_lock = PTHREAD_MUTEX_INITIALIZER;
static int at_fork_registered;

static long thread_id(void) { return syscall(SYS_gettid); }

/* A fault the CPU raised on this thread (it happens again when the handler returns),
 * rather than a signal sent by kill/raise or an asynchronous memory error report. */
static int synchronous(const siginfo_t *info)
{
    if (info == NULL) return 0;
    int code = info->si_code;
    return code == BUS_ADRALN || code == BUS_ADRERR || code == BUS_OBJERR || code == BUS_MCEERR_AR;
}

/* Give the signal to the handler the library replaced (see above). */
static void hand_over(int sig, siginfo_t *info)
{
    int at = atomic_exchange(&previous_at, 2);
    sigaction(sig, at == 2 ? &default_action : &previous[at], NULL);
    if (synchronous(info)) return; /* the faulting instruction runs again under that handler */
    /* sent (or reported asynchronously): send it again, with the same information, to this
     * thread; it waits until this handler returns (SIGBUS is blocked meanwhile) */
    if (syscall(SYS_rt_tgsigqueueinfo, getpid(), thread_id(), sig, info) != 0) raise(sig);
}

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    (void)context;
    int saved_errno = errno;
    if (synchronous(info)) {
        long tid = thread_id();
        uintptr_t at = (uintptr_t)info->si_addr;
        for (int i = 0; i < GUARDS; i++) {
            struct guard *g = &guards[i];
            if (atomic_load(&g->tid) != tid) continue;
            if (at - g->src < g->src_len || at - g->dst < g->dst_len) {
                atomic_fetch_add(&faults, 1);
                siglongjmp(*g->jump, 1);
            }
            break; /* a thread runs one copy at a time */
        }
    }
    hand_over(sig, info);
    errno = saved_errno;
}

/* In a child of fork only the thread that forked runs, and it was not copying: the
 * slots of the parent's other threads would never be freed, nor the lock if one of
 * them held it. */
static void after_fork_in_child(void)
{
    for (int i = 0; i < GUARDS; i++) atomic_store(&guards[i].tid, 0);
    install_lock = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
}

static int is_ours(const struct sigaction *a)
{
    return (a->sa_flags & SA_SIGINFO) && a->sa_sigaction == on_sigbus;
}

/* Whether the handler is installed (installing it if another replaced it). One
 * sigaction query per copy: the copies are of 1 MiB and more. */
static int guard_installed(void)
{
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now)) return 0;
    if (is_ours(&now)) return 1;
    pthread_mutex_lock(&install_lock);
    if (!at_fork_registered) at_fork_registered = pthread_atfork(NULL, NULL, after_fork_in_child) == 0;
    int ok = 1;
    if (sigaction(SIGBUS, NULL, &now) || !is_ours(&now)) {
        struct sigaction mine;
        memset(&mine, 0, sizeof mine);
        mine.sa_sigaction = on_sigbus;
        mine.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&mine.sa_mask);
        /* write the record the handler is not reading, then point it there */
        int at = atomic_load(&previous_at) == 0 ? 1 : 0;
        ok = sigaction(SIGBUS, &mine, &previous[at]) == 0;
        if (ok) atomic_store(&previous_at, at);
    }
    pthread_mutex_unlock(&install_lock);
    return ok;
}

/* A free slot, set up (not yet armed) for this copy; NULL when all are taken. */
static struct guard *claim_guard(long tid)
{
    for (int k = 0; k < GUARDS; k++) {
        struct guard *g = &guards[(tid + k) % GUARDS];
        long free_slot = 0;
        if (atomic_compare_exchange_strong(&g->tid, &free_slot, -1)) return g;
    }
    return NULL;
}

/* After a jump out of AVX-512 code: no dirty upper register halves left behind (they
 * slow later SSE code on some CPUs). */
__attribute__((target("avx"))) static void clear_upper(void) { _mm256_zeroupper(); }

/* Whether a copy on this thread can be guarded: SIGBUS not blocked here (a thread that blocks
 * it is killed by a fault whatever the handler) and the handler installed; the thread's signal
 * mask in *mask. */
static int can_guard(sigset_t *mask)
{
    if (pthread_sigmask(SIG_SETMASK, NULL, mask) || sigismember(mask, SIGBUS) == 1) return 0;
    return guard_installed();
}

/* The copy under guard g (claimed by thread tid), which it frees: 0 with the CRC in
 * *crc, or 2 when a fault interrupted it. Nothing that the copy changes is read after
 * a jump, and what is read after it (g, mask) is not changed after sigsetjmp, so no
 * local needs to be volatile. */
static int guarded_copy(struct guard *g, long tid, const sigset_t *mask, const uint8_t *src, void *dst,
                        uint64_t n, uint32_t *crc)
{
    sigjmp_buf jump;
    g->jump = &jump;
    if (sigsetjmp(jump, 0)) {
        /* the handler jumped here, leaving SIGBUS blocked (it was not at the start) */
        atomic_store(&g->tid, 0);
        pthread_sigmask(SIG_SETMASK, mask, NULL);
        if (isa == ISA_AVX512) clear_upper();
        _mm_sfence(); /* the streaming stores made so far, before the caller reads again */
        return 2;
    }
    atomic_store(&g->tid, tid); /* armed: the handler may jump from here on */
    *crc = gck_crc_copy(*crc, src, dst, n);
    atomic_store(&g->tid, 0);
    return 0;
}

/* Copy n bytes at offset off of file fd into dst with their CRC-32C (continued from
 * crc) in *crc_out, reading them through a memory map. Only for a range that is in the
 * page cache: faulting an uncached file in through a map is slower than the caller's
 * large preads. A tmpfs file is always copied (its pages are in memory; the map is made
 * populated). Otherwise whether it is cached is asked of mincore at its first, middle and last byte (a
 * file is written or read whole, so it is cached whole or not at all; a page evicted
 * in between is still read correctly, just more slowly). Returns 0 when copied; 1 when
 * not (uncached, the file is shorter than off + n, or no guard could be set up);
 * 2 when the copy was interrupted by a fault on the file's pages or on dst (the file
 * was truncated under the map, or a page could not be read): part of dst may have
 * been written, and the caller should read the range again with pread, which reports
 * what the file now holds; -errno on a system error. */
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
    /* tmpfs (a local tier): its pages are in memory, and mincore says nothing. They are
     * mapped populated, in one call: pread copies them a base page at a time, at half the
     * speed of a copy out of the map (256 MiB with their checksum, 4 processes at once on a
     * 2-vCPU VM: 67-72 ms against 131-135 ms). Files present at a drop_caches map slower
     * until they are written again (126-139 ms populated, 215-229 ms faulted in; pread
     * 145-152 ms): bench/RESULTS.md, the local tier, 2026-12-05. */
    struct statfs fs;
    int memory = fstatfs(fd, &fs) == 0 && fs.f_type == TMPFS_MAGIC_;
    sigset_t mask;
    if (!can_guard(&mask)) return 1;
    long page = sysconf(_SC_PAGESIZE);
    int64_t start = off & ~(int64_t)(page - 1);
    size_t len = (size_t)(off - start) + n;
    uint8_t *map = mmap(NULL, len, PROT_READ, MAP_SHARED | (memory ? MAP_POPULATE : 0), fd, start);
    if (map == MAP_FAILED) return -errno;
    size_t first = (size_t)(off - start);
    if (!memory && (!cached_at(map, first, page) || !cached_at(map, first + n / 2, page) ||
                    !cached_at(map, first + n - 1, page))) {
        munmap(map, len);
        return 1;
    }
    long tid = thread_id();
    struct guard *g = claim_guard(tid);
    int rc = 1;
    if (g != NULL) {
        g->src = (uintptr_t)map, g->src_len = len;
        g->dst = (uintptr_t)dst, g->dst_len = n;
        rc = guarded_copy(g, tid, &mask, map + (off - start), dst, n, &crc);
    }
    munmap(map, len);
    if (rc == 0) *crc_out = crc;
    return rc;
}

/* Copy n bytes from src into dst, a map of a file being written, with their CRC-32C
 * (continued from crc) in *crc_out, under the same guard: a file truncated under its map,
 * or a page its file system cannot give, is a SIGBUS on a write to dst. Returns 0 when
 * copied; 1 when not (no vector instruction set, SIGBUS blocked on this thread, or no
 * guard could be set up: nothing was written); 2 when a fault interrupted the copy (part
 * of dst may be written: the caller writes the file again with write(), which reports
 * what the file system refused). */
int gck_guarded_copy_crc(const void *src, void *dst, uint64_t n, uint32_t crc, uint32_t *crc_out)
{
    if (gck_isa() == ISA_NONE) return 1;
    if (n == 0) {
        *crc_out = crc;
        return 0;
    }
    sigset_t mask;
    if (!can_guard(&mask)) return 1;
    long tid = thread_id();
    struct guard *g = claim_guard(tid);
    if (g == NULL) return 1;
    g->src = (uintptr_t)src, g->src_len = n;
    g->dst = (uintptr_t)dst, g->dst_len = n;
    int rc = guarded_copy(g, tid, &mask, (const uint8_t *)src, dst, n, &crc);
    if (rc == 0) *crc_out = crc;
    return rc;
}

/* Copy the n buffers srcs[i] (lens[i] bytes each) one after the other into dst, a map of a
 * file being written, under the guard of gck_guarded_copy_crc, with the CRC-32C of each
 * segment of seg bytes of dst (from its start; the last one shorter) in crcs[k], one call
 * for a whole chunk: a chunk of many segments cost a call into the library, two buffer
 * addresses and a CRC combination in Python per segment. The caller gives room for every
 * segment of the total length. Returns 0, 1 or 2 as gck_guarded_copy_crc does. */
int gck_guarded_copy_segments(const uint64_t *srcs, const uint64_t *lens, uint64_t n, void *dst,
                              uint64_t seg, uint32_t *crcs)
{
    if (gck_isa() == ISA_NONE || seg == 0) return 1;
    sigset_t mask;
    if (!can_guard(&mask)) return 1;
    long tid = thread_id();
    uint8_t *out = dst;
    uint64_t at = 0, k = 0;
    uint32_t crc = 0;
    for (uint64_t i = 0; i < n; i++) {
        const uint8_t *src = (const uint8_t *)(uintptr_t)srcs[i];
        uint64_t left = lens[i];
        while (left) {
            uint64_t room = seg - at % seg, piece = left < room ? left : room;
            struct guard *g = claim_guard(tid); /* (guarded_copy frees it) */
            if (g == NULL) return at ? 2 : 1;   /* (2: part of dst is written) */
            g->src = (uintptr_t)src, g->src_len = piece;
            g->dst = (uintptr_t)(out + at), g->dst_len = piece;
            int rc = guarded_copy(g, tid, &mask, src, out + at, piece, &crc);
            if (rc) return rc;
            src += piece, left -= piece, at += piece;
            if (at % seg == 0) crcs[k++] = crc, crc = 0;
        }
    }
    if (at % seg) crcs[k] = crc;
    return 0;
}

/* How many copies a fault on their pages has interrupted in this process. */
unsigned long gck_faults(void) { return atomic_load(&faults); }

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

int gck_guarded_copy_crc(const void *src, void *dst, uint64_t n, uint32_t crc, uint32_t *crc_out)
{
    (void)src, (void)dst, (void)n, (void)crc, (void)crc_out;
    return 1;
}

int gck_guarded_copy_segments(const uint64_t *srcs, const uint64_t *lens, uint64_t n, void *dst,
                              uint64_t seg, uint32_t *crcs)
{
    (void)srcs, (void)lens, (void)n, (void)dst, (void)seg, (void)crcs;
    return 1;
}

unsigned long gck_faults(void) { return 0; }

#endif
