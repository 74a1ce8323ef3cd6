/*
 * System-call faults for tests of native code: an LD_PRELOAD library that makes libc's
 * file calls fail, the way a failing disk or a full file system does, for files under one
 * directory only.
 *
 * gpuckpt's Python I/O is tested by swapping the `os` module its storage modules see
 * (gpuckpt/testing/faults.py); native code (batchio.c) calls libc directly, so the same
 * faults are injected one level lower: this library defines open/openat/mkdir/mkdirat/
 * write/writev/pwrite/fsync/fdatasync/posix_fallocate/read/readv/close, passes each to the
 * real function (dlsym RTLD_NEXT), and fails the Nth call of the chosen kind on a path under
 * GCK_FAULT_DIR and every later one. Python's own os.* calls go through the same libc
 * functions, so the native path and the Python path of the same operation meet the same
 * faults. Configured by the environment (read once):
 *
 *   GCK_FAULT_DIR      absolute directory; only files under it (and mkdirs in it) are affected
 *   GCK_FAULT_CALL     open (that creates: O_CREAT) | mkdir | write (write, writev, pwrite)
 *                      | fsync (fsync, fdatasync) | fallocate (posix_fallocate)
 *                      | read (read, readv, pread, preadv, preadv2) | close
 *   GCK_FAULT_NTH      the first call that fails (1-based, counted over affected calls)
 *   GCK_FAULT_ERRNO    the errno it fails with (e.g. 5 EIO, 28 ENOSPC)
 *   GCK_FAULT_PARTIAL  write only: the failing call first writes this many bytes and returns
 *                      that short count; the next write fails (a file system that fills up)
 *
 *   GCK_TRACE_FILE     optional: a file (outside GCK_FAULT_DIR) where every fsync, fdatasync
 *                      and sync_file_range of a file under GCK_FAULT_DIR is logged as a line
 *                      "<call> <st_dev> <st_ino> <st_size>" (GCK_FAULT_CALL=none: trace only)
 *
 * gck_fault_reset() starts the count again (a test runs the native and the Python path
 * of one operation in one process, each meeting the same fault).
 *
 * Build: cc -shared -fPIC -o faultshim.so faultshim.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_FD 65536

static char dir[PATH_MAX];
static size_t dir_len;
static char call[16];
static long nth, partial;
static int err_no;
static atomic_long seen;
static atomic_int partial_done;
static atomic_uchar marked[MAX_FD]; /* fds of files under dir */
static int configured = -1;
static int trace_fd = -1;

static void *real(const char *name);

static void configure(void)
{
    if (configured >= 0) return;
    const char *d = getenv("GCK_FAULT_DIR"), *c = getenv("GCK_FAULT_CALL");
    configured = d && c && *d == '/';
    if (!configured) return;
    snprintf(dir, sizeof dir, "%s", d);
    dir_len = strlen(dir);
    snprintf(call, sizeof call, "%s", c);
    nth = getenv("GCK_FAULT_NTH") ? atol(getenv("GCK_FAULT_NTH")) : 1;
    err_no = getenv("GCK_FAULT_ERRNO") ? atoi(getenv("GCK_FAULT_ERRNO")) : EIO;
    partial = getenv("GCK_FAULT_PARTIAL") ? atol(getenv("GCK_FAULT_PARTIAL")) : 0;
    const char *t = getenv("GCK_TRACE_FILE");
    if (t && *t)
        trace_fd = ((int (*)(const char *, int, ...))real("open"))(t, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC,
                                                                    0644);
}

/* one line per traced call (a single write with O_APPEND: lines of threads do not mix) */
static void trace(const char *what, int fd)
{
    struct stat st;
    if (trace_fd < 0 || fstat(fd, &st)) return;
    char line[128];
    int n = snprintf(line, sizeof line, "%s %llu %llu %lld\n", what, (unsigned long long)st.st_dev,
                     (unsigned long long)st.st_ino, (long long)st.st_size);
    ((ssize_t(*)(int, const void *, size_t))real("write"))(trace_fd, line, (size_t)n);
}

void gck_fault_reset(void)
{
    atomic_store(&seen, 0);
    atomic_store(&partial_done, 0);
}

static void *real(const char *name)
{
    void *f = dlsym(RTLD_NEXT, name);
    if (!f) abort();
    return f;
}

/* whether path (relative to dirfd) lies under dir */
static int under(int dirfd, const char *path)
{
    configure();
    if (!configured || !path) return 0;
    char full[2 * PATH_MAX + 2];
    if (path[0] == '/') {
        snprintf(full, sizeof full, "%s", path);
    } else {
        char link[64], base[PATH_MAX];
        ssize_t n;
        if (dirfd == AT_FDCWD) {
            if (!getcwd(base, sizeof base)) return 0;
            n = (ssize_t)strlen(base);
        } else {
            snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
            n = readlink(link, base, sizeof base - 1);
            if (n < 0) return 0;
        }
        base[n] = 0;
        snprintf(full, sizeof full, "%s/%s", base, path);
    }
    return strncmp(full, dir, dir_len) == 0 && (full[dir_len] == '/' || full[dir_len] == 0);
}

static int is_marked(int fd) { return configured > 0 && fd >= 0 && fd < MAX_FD && marked[fd]; }

/* whether this call (of kind k, affected) fails now */
static int fails(const char *k)
{
    if (strcmp(call, k) != 0) return 0;
    return atomic_fetch_add(&seen, 1) + 1 >= nth;
}

static int opened(int fd, int dirfd, const char *path)
{
    if (fd >= 0 && fd < MAX_FD) marked[fd] = (unsigned char)under(dirfd, path);
    return fd;
}

#define OPEN_BODY(realname, ...)                                                                  \
    mode_t mode = 0;                                                                              \
    if (flags & (O_CREAT | O_TMPFILE)) {                                                          \
        va_list ap;                                                                               \
        va_start(ap, flags);                                                                      \
        mode = va_arg(ap, mode_t);                                                                \
        va_end(ap);                                                                               \
    }                                                                                             \
    if ((flags & O_CREAT) && under(dirfd_, path) && fails("open")) {                              \
        errno = err_no;                                                                           \
        return -1;                                                                                \
    }                                                                                             \
    return opened(((int (*)())real(realname))(__VA_ARGS__), dirfd_, path);

int open(const char *path, int flags, ...)
{
    int dirfd_ = AT_FDCWD;
    OPEN_BODY("open", path, flags, mode)
}

int open64(const char *path, int flags, ...)
{
    int dirfd_ = AT_FDCWD;
    OPEN_BODY("open64", path, flags, mode)
}

int openat(int dirfd, const char *path, int flags, ...)
{
    int dirfd_ = dirfd;
    OPEN_BODY("openat", dirfd, path, flags, mode)
}

int openat64(int dirfd, const char *path, int flags, ...)
{
    int dirfd_ = dirfd;
    OPEN_BODY("openat64", dirfd, path, flags, mode)
}

int mkdir(const char *path, mode_t mode)
{
    if (under(AT_FDCWD, path) && fails("mkdir")) {
        errno = err_no;
        return -1;
    }
    return ((int (*)(const char *, mode_t))real("mkdir"))(path, mode);
}

int mkdirat(int dirfd, const char *path, mode_t mode)
{
    if (under(dirfd, path) && fails("mkdir")) {
        errno = err_no;
        return -1;
    }
    return ((int (*)(int, const char *, mode_t))real("mkdirat"))(dirfd, path, mode);
}

/* a failing write: a short one first where GCK_FAULT_PARTIAL says so */
static ssize_t write_fault(int fd, const void *buf, size_t n)
{
    if (partial > 0 && !atomic_exchange(&partial_done, 1)) {
        size_t k = (size_t)partial < n ? (size_t)partial : n;
        return ((ssize_t(*)(int, const void *, size_t))real("write"))(fd, buf, k);
    }
    errno = err_no;
    return -1;
}

ssize_t write(int fd, const void *buf, size_t n)
{
    if (is_marked(fd) && fails("write")) return write_fault(fd, buf, n);
    return ((ssize_t(*)(int, const void *, size_t))real("write"))(fd, buf, n);
}

ssize_t writev(int fd, const struct iovec *iov, int cnt)
{
    if (is_marked(fd) && fails("write")) {
        if (cnt > 0) return write_fault(fd, iov[0].iov_base, iov[0].iov_len);
        errno = err_no;
        return -1;
    }
    return ((ssize_t(*)(int, const struct iovec *, int))real("writev"))(fd, iov, cnt);
}

ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off)
{
    if (is_marked(fd) && fails("write")) {
        errno = err_no;
        return -1;
    }
    return ((ssize_t(*)(int, const struct iovec *, int, off_t))real("pwritev"))(fd, iov, cnt, off);
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off)
{
    if (is_marked(fd) && fails("write")) {
        errno = err_no;
        return -1;
    }
    return ((ssize_t(*)(int, const void *, size_t, off_t))real("pwrite"))(fd, buf, n, off);
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off)
{
    if (is_marked(fd) && fails("write")) {
        errno = err_no;
        return -1;
    }
    return ((ssize_t(*)(int, const void *, size_t, off_t))real("pwrite64"))(fd, buf, n, off);
}

int fsync(int fd)
{
    if (is_marked(fd) && fails("fsync")) {
        errno = err_no;
        return -1;
    }
    int rc = ((int (*)(int))real("fsync"))(fd);
    if (rc == 0 && is_marked(fd)) trace("fsync", fd);
    return rc;
}

int fdatasync(int fd)
{
    if (is_marked(fd) && fails("fsync")) {
        errno = err_no;
        return -1;
    }
    int rc = ((int (*)(int))real("fdatasync"))(fd);
    if (rc == 0 && is_marked(fd)) trace("fdatasync", fd);
    return rc;
}

/* posix_fallocate returns the error number (errno is left alone) */
int posix_fallocate(int fd, off_t off, off_t n)
{
    if (is_marked(fd) && fails("fallocate")) return err_no;
    return ((int (*)(int, off_t, off_t))real("posix_fallocate"))(fd, off, n);
}

int posix_fallocate64(int fd, off64_t off, off64_t n)
{
    if (is_marked(fd) && fails("fallocate")) return err_no;
    return ((int (*)(int, off64_t, off64_t))real("posix_fallocate64"))(fd, off, n);
}

int sync_file_range(int fd, off64_t off, off64_t n, unsigned int flags)
{
    if (is_marked(fd)) trace("sync_file_range", fd);
    return ((int (*)(int, off64_t, off64_t, unsigned int))real("sync_file_range"))(fd, off, n, flags);
}

ssize_t read(int fd, void *buf, size_t n)
{
    if (is_marked(fd) && fails("read")) {
        errno = err_no;
        return -1;
    }
    return ((ssize_t(*)(int, void *, size_t))real("read"))(fd, buf, n);
}

ssize_t readv(int fd, const struct iovec *iov, int cnt)
{
    if (is_marked(fd) && fails("read")) {
        errno = err_no;
        return -1;
    }
    return ((ssize_t(*)(int, const struct iovec *, int))real("readv"))(fd, iov, cnt);
}

ssize_t pread64(int fd, void *buf, size_t n, off_t off)
{
    if (is_marked(fd) && fails("read")) {
        errno = err_no;
        return -1;
    }
    return ((ssize_t(*)(int, void *, size_t, off_t))real("pread64"))(fd, buf, n, off);
}

ssize_t pread(int fd, void *buf, size_t n, off_t off)
{
    if (is_marked(fd) && fails("read")) {
        errno = err_no;
        return -1;
    }
    return ((ssize_t(*)(int, void *, size_t, off_t))real("pread"))(fd, buf, n, off);
}

ssize_t preadv(int fd, const struct iovec *iov, int cnt, off_t off)
{
    if (is_marked(fd) && fails("read")) {
        errno = err_no;
        return -1;
    }
    return ((ssize_t(*)(int, const struct iovec *, int, off_t))real("preadv"))(fd, iov, cnt, off);
}

ssize_t preadv64(int fd, const struct iovec *iov, int cnt, off_t off)
{
    if (is_marked(fd) && fails("read")) {
        errno = err_no;
        return -1;
    }
    return ((ssize_t(*)(int, const struct iovec *, int, off_t))real("preadv64"))(fd, iov, cnt, off);
}

ssize_t preadv2(int fd, const struct iovec *iov, int cnt, off_t off, int flags)
{
    if (is_marked(fd) && fails("read")) {
        errno = err_no;
        return -1;
    }
    return ((ssize_t(*)(int, const struct iovec *, int, off_t, int))real("preadv2"))(fd, iov, cnt, off, flags);
}

ssize_t preadv64v2(int fd, const struct iovec *iov, int cnt, off_t off, int flags)
{
    if (is_marked(fd) && fails("read")) {
        errno = err_no;
        return -1;
    }
    return ((ssize_t(*)(int, const struct iovec *, int, off_t, int))real("preadv64v2"))(fd, iov, cnt, off, flags);
}

int close(int fd)
{
    int hit = is_marked(fd);
    if (fd >= 0 && fd < MAX_FD) marked[fd] = 0;
    int rc = ((int (*)(int))real("close"))(fd);
    if (hit && fails("close")) {
        errno = err_no; /* the descriptor is closed all the same, as after a real error */
        return -1;
    }
    return rc;
}
