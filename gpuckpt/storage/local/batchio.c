/*
 * Batches of small chunk files, written and read without the interpreter.
 *
 * A checkpoint of many small tensors is mostly system calls: per tensor a directory,
 * an array document and a chunk file, each created, written (the chunk with its
 * CRC-32C trailer) and closed; on load each chunk is checked, opened, read, its
 * checksum verified and the file closed. Done from Python, every one of these calls
 * holds the interpreter for a few microseconds, so the I/O threads take turns instead
 * of running in parallel. Here one call runs a whole batch with the GIL released
 * (ctypes releases it), and reports per item what happened, so that Python raises the
 * same typed errors as the per-file path (gpuckpt/storage/local/batchio.py).
 *
 * Built by the package's build hook into _batchio.so and loaded with ctypes; without a
 * C compiler gpuckpt writes and reads the same files one by one from Python. No Python
 * headers are needed. Linux only (openat/mkdirat/fstatat, sync_file_range).
 *
 * CRC-32C follows the usual convention (reflected, initial value and final XOR
 * 0xFFFFFFFF) and is computed with the kernels shared with crccopy.c (crc32c_simd.h),
 * or a table where the CPU has no CRC instructions.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h> /* renameat */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "crc32c_simd.h"

#define GBIO_ABI 9

/* What an item is (kind). */
/* GBIO_TAKEDIR: a directory taken from the reused tree given to gbio_write (one rename), else
 * made; its pad field says how many of the next items are its files, all of them (see
 * gbio_write). */
enum { GBIO_MKDIR = 1, GBIO_FILE = 2, GBIO_CHUNK = 3, GBIO_TAKEDIR = 4 };

/* Where an item stopped (step); 0 when it completed. */
enum {
    GBIO_OK = 0,
    GBIO_STEP_MKDIR = 1,
    GBIO_STEP_OPEN = 2,
    GBIO_STEP_WRITE = 3,
    GBIO_STEP_FSYNC = 4,
    GBIO_STEP_CLOSE = 5,
    GBIO_STEP_STAT = 6,
    GBIO_STEP_NOTREG = 7, /* the file is not a regular file (mode says what it is): never read */
    GBIO_STEP_READ = 8,
    GBIO_STEP_SHORT = 9,    /* fewer bytes than the item needs: the file is truncated */
    GBIO_STEP_MISMATCH = 10, /* the bytes do not match the trailer or the expected CRC */
    GBIO_STEP_LONG = 11      /* a whole file read (GBIO_FILE) holds more bytes than the item */
};

/* Write flags: fsync each file as written; start the writeback of large files; fsync the
 * files once a group of them is written; write every file over the one of its name where
 * there is one, as in a taken directory (see gbio_write). */
enum { GBIO_FSYNC = 1, GBIO_WRITEBACK = 2, GBIO_FSYNC_GROUP = 4, GBIO_OVER = 8 };
/* flags of gbio_read */
enum { GBIO_CHECKED = 1 };

/* files held open until their group's fsync */
#define GROUP 64

/* One item of a batch. The layout is mirrored by a NumPy structured dtype in batchio.py
 * (gbio_item_size() guards against drift). */
struct gbio_item {
    const char *path; /* relative to the batch's directory; no ".." (the caller validated names) */
    void *data;       /* bytes to write, or where a read puts the chunk's leading bytes */
    uint64_t nbytes;  /* size of data */
    uint64_t pad;     /* chunk: zero bytes after data (write), or bytes read, checksummed, dropped (read) */
    uint32_t kind;    /* GBIO_MKDIR, GBIO_FILE (no trailer), GBIO_CHUNK (CRC-32C trailer) */
    uint32_t expect;  /* read: the CRC-32C the metadata lists */
    /* results */
    int32_t err;     /* errno of the failed step, else 0 */
    int32_t step;    /* GBIO_STEP_* where the item stopped, GBIO_OK when done */
    uint32_t crc;    /* CRC-32C of data and padding (written, or read) */
    uint32_t stored; /* read: the trailer's value */
    uint64_t done;   /* bytes written or read, trailer included */
    uint32_t mode;   /* GBIO_STEP_NOTREG: the st_mode found */
    uint32_t taken;  /* GBIO_TAKEDIR: 1 when taken from the reused tree; a file: 1 when written over one */
};

int gbio_abi(void) { return GBIO_ABI; }

int gbio_item_size(void) { return (int)sizeof(struct gbio_item); }

/* ---- CRC-32C ------------------------------------------------------------------------ */

static uint32_t table[256];

static void table_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        table[i] = c;
    }
}

/* raw (not inverted) CRC by table: any CPU */
static uint32_t crc_table(uint32_t c, const uint8_t *s, size_t n)
{
    while (n--) c = table[(c ^ *s++) & 0xff] ^ (c >> 8);
    return c;
}

static int level = -1; /* 0: table, 1: SSE/PCLMUL folding, 2: AVX-512 folding */

/* Which CRC code is in use; chooses it on the first call (batchio.py calls this once at load). */
int gbio_isa(void)
{
    if (level < 0) {
        table_init();
#if GCK_HAVE_X86_CRC
        setup();
        level = isa;
#else
        level = 0;
#endif
    }
    return level;
}

/* Use at most the given level (tests exercise every path on one machine). */
int gbio_limit_isa(int most)
{
    if (gbio_isa() > most) level = most < 0 ? 0 : most;
    return level;
}

static uint32_t crc_update(uint32_t c, const uint8_t *s, size_t n)
{
#if GCK_HAVE_X86_CRC
    if (level == 2) return fold_copy_512(c, s, NULL, n);
    if (level == 1) return fold_copy_128(c, s, NULL, n);
#endif
    return crc_table(c, s, n);
}

/* CRC-32C of src[0:n] continued from crc (the finished value of a previous call, or 0). */
uint32_t gbio_crc32c(uint32_t crc, const void *src, uint64_t n)
{
    gbio_isa();
    return ~crc_update(~crc, src, n);
}

/* ---- writing ------------------------------------------------------------------------ */

#define ZEROS (64 * 1024)
static const uint8_t zeros[ZEROS];

static uint32_t crc_zeros(uint32_t c, uint64_t n)
{
    for (; n; n -= n < ZEROS ? n : ZEROS) c = crc_update(c, zeros, n < ZEROS ? n : ZEROS);
    return c;
}

/* Write all of iov[0:cnt] (which it consumes), retrying short writes and interruptions. */
static int writev_all(int fd, struct iovec *iov, int cnt, uint64_t *done)
{
    for (;;) {
        while (cnt > 0 && iov->iov_len == 0) iov++, cnt--;
        if (cnt == 0) return 0;
        ssize_t w = writev(fd, iov, cnt);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (w == 0) return EIO; /* a regular file that takes nothing: do not spin */
        *done += (uint64_t)w;
        size_t left = (size_t)w;
        while (cnt > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++, cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
}

static int fail(struct gbio_item *it, int step, int err)
{
    it->step = step;
    it->err = err;
    return -1;
}

static int64_t empty_dir(int dir, int depth);

/* "." or "..": listed by readdir, never an entry to remove or count */
static int dot_entry(const char *name) { return name[0] == '.' && (!name[1] || (name[1] == '.' && !name[2])); }

/* Remove the entry name of dir whatever it is (a tree: all of it), links not followed. */
static int remove_entry(int dir, const char *name)
{
    struct stat st;
    if (fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW)) return errno == ENOENT ? 0 : errno;
    if (!S_ISDIR(st.st_mode)) return unlinkat(dir, name, 0) && errno != ENOENT ? errno : 0;
    int sub = openat(dir, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (sub < 0) return errno;
    int64_t r = empty_dir(sub, 1);
    if (r < 0) return (int)-r;
    return unlinkat(dir, name, AT_REMOVEDIR) ? errno : 0;
}

/* A file of a taken directory, opened to be written over from its start: a regular file of
 * one name only (a hard link's other name keeps its bytes: that name here is removed and a
 * new file made, as for anything else found there: a link, a FIFO, a directory); *old gets
 * its size (0 for a new file). Returns the descriptor, or -1 with errno set. */
static int open_over(int dir, const char *path, uint64_t *old, uint32_t *over)
{
    *old = 0, *over = 0;
    int fd;
    do fd = openat(dir, path, O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    if (fd >= 0) {
        struct stat st;
        if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1) {
            *old = (uint64_t)st.st_size, *over = 1;
            return fd;
        }
        close(fd);
    }
    if (fd >= 0 || errno != ENOENT) {
        int err = remove_entry(dir, path);
        if (err) {
            errno = err;
            return -1;
        }
    }
    do fd = openat(dir, path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    while (fd < 0 && errno == EINTR);
    return fd;
}

/* Write one item; a file to be fsynced with its group stays open, its fd in *keep. A chunk's
 * data is copied into copy (at least nbytes long) first, and checksummed and written from
 * there: the caller's memory is read once, so the trailer is the CRC-32C of the very bytes
 * written even if the caller changes its memory meanwhile (a torn value is stored with its
 * own checksum, never a file that contradicts its trailer). over: the item's directory was
 * taken from the reused tree (see gbio_write): its file is written over the one there, and cut
 * where the new bytes end. */
static int write_one(int dir, struct gbio_item *it, uint32_t flags, uint64_t writeback_min, int *keep,
                     uint8_t *copy, int over)
{
    if (it->kind == GBIO_MKDIR) return mkdirat(dir, it->path, 0777) ? fail(it, GBIO_STEP_MKDIR, errno) : 0;
    int fd;
    uint64_t old = 0;
    if (over) {
        fd = open_over(dir, it->path, &old, &it->taken);
    } else {
        do fd = openat(dir, it->path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        while (fd < 0 && errno == EINTR);
    }
    if (fd < 0) return fail(it, GBIO_STEP_OPEN, errno);
    int err = 0;
    uint8_t trailer[4];
    struct iovec iov[2] = {{it->data, it->nbytes}, {trailer, 0}};
    if (it->kind == GBIO_CHUNK) {
        if (it->nbytes) memcpy(copy, it->data, it->nbytes);
        iov[0].iov_base = copy;
        uint32_t c = crc_zeros(crc_update(~0u, copy, it->nbytes), it->pad);
        it->crc = ~c;
        for (int i = 0; i < 4; i++) trailer[i] = (uint8_t)(it->crc >> (8 * i));
        iov[1].iov_len = 4;
    }
    if (it->pad == 0) {
        /* data and trailer in one system call */
        err = writev_all(fd, iov, it->kind == GBIO_CHUNK ? 2 : 1, &it->done);
    } else {
        err = writev_all(fd, iov, 1, &it->done);
        for (uint64_t left = it->pad; !err && left;) {
            struct iovec z = {(void *)zeros, left < ZEROS ? left : ZEROS};
            left -= z.iov_len;
            err = writev_all(fd, &z, 1, &it->done);
        }
        if (!err && it->kind == GBIO_CHUNK) err = writev_all(fd, &iov[1], 1, &it->done);
    }
    if (!err && old > it->done && ftruncate(fd, (off_t)it->done)) err = errno;
    int step = err ? GBIO_STEP_WRITE : 0;
    if (!err && (flags & GBIO_FSYNC_GROUP)) {
        sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE); /* a hint: the fsync reports errors */
        *keep = fd;
        return 0;
    }
    if (!err && (flags & GBIO_FSYNC) && fsync(fd)) err = errno, step = GBIO_STEP_FSYNC;
    if (!err && !(flags & GBIO_FSYNC) && (flags & GBIO_WRITEBACK) && it->done >= writeback_min)
        sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE); /* a hint: the final sync reports errors */
    if (close(fd) && !err && errno != EINTR) err = errno, step = GBIO_STEP_CLOSE;
    return err ? fail(it, step, err) : 0;
}

/* fsync and close the held files; returns the index of the first that failed, or -1 */
static int64_t sync_group(struct gbio_item *items, int *fds, uint64_t *idx, int count)
{
    int64_t failed = -1;
    for (int k = 0; k < count; k++) {
        struct gbio_item *it = &items[idx[k]];
        int step = 0, err = 0;
        if (failed < 0 && fsync(fds[k])) step = GBIO_STEP_FSYNC, err = errno;
        if (close(fds[k]) && !err && failed < 0 && errno != EINTR) step = GBIO_STEP_CLOSE, err = errno;
        if (err) {
            fail(it, step, err);
            failed = (int64_t)idx[k];
        }
    }
    return failed;
}

/* Take the directory it->path of the reused tree (open as reuse, or -1: none) into dir in one
 * rename: 1 when taken (a directory itself: a link or file found under that name is removed
 * and the directory made anew), 0 when made anew, -1 on failure (recorded in it). */
static int take_dir(int dir, int reuse, struct gbio_item *it)
{
    if (reuse >= 0 && renameat(reuse, it->path, dir, it->path) == 0) {
        struct stat st;
        if (fstatat(dir, it->path, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode)) return it->taken = 1;
        int err = remove_entry(dir, it->path);
        if (err) return fail(it, GBIO_STEP_MKDIR, err);
    }
    return mkdirat(dir, it->path, 0777) ? fail(it, GBIO_STEP_MKDIR, errno) : 0;
}

/* Whether the pad field of the GBIO_TAKEDIR item items[i] counts items that follow and are
 * files directly in its directory ("dirname/file"). */
static int group_valid(const struct gbio_item *items, uint64_t i, uint64_t n)
{
    const struct gbio_item *it = &items[i];
    if (it->pad > n - i - 1) return 0;
    size_t len = strlen(it->path);
    if (len == 0 || strchr(it->path, '/')) return 0;
    for (uint64_t k = i + 1; k <= i + it->pad; k++) {
        const char *p = items[k].path;
        if (items[k].kind != GBIO_FILE && items[k].kind != GBIO_CHUNK) return 0;
        if (strncmp(p, it->path, len) || p[len] != '/' || p[len + 1] == 0 || strchr(p + len + 1, '/')) return 0;
    }
    return 1;
}

/* In the taken directory of items[0], remove every entry that none of its files (the next
 * count items, "dirname/file") named: what a part written before held and this one does not. */
static int prune_dir(int dir, struct gbio_item *items, uint64_t count)
{
    int sub = openat(dir, items[0].path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (sub < 0) return errno;
    DIR *d = fdopendir(sub);
    if (d == NULL) {
        int e = errno;
        close(sub);
        return e;
    }
    size_t prefix = strlen(items[0].path) + 1;
    int err = 0, pass;
    do {
        pass = 0;
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            const char *name = e->d_name;
            if (dot_entry(name)) continue;
            int named = 0;
            for (uint64_t k = 1; k <= count && !named; k++) named = strcmp(items[k].path + prefix, name) == 0;
            if (named) continue;
            int r = remove_entry(dirfd(d), name);
            if (r && !err) err = r;
            if (!r) pass++;
        }
        rewinddir(d);
    } while (pass > 0 && !err);
    closedir(d);
    return err;
}

/* Create the items under the directory root, in order: directories (mkdir), files (data,
 * then zero padding), chunks (data, padding, CRC-32C trailer); new files are never opened
 * over existing ones (O_EXCL). Durability of the files: GBIO_FSYNC fsyncs each as it is
 * written; GBIO_FSYNC_GROUP starts each one's writeback as it is written and fsyncs the
 * files GROUP at a time once they are all written (on ext4 the first fsync of a group
 * commits the journal for all of them, and the others find little left to do: one
 * commit per group instead of one per file); GBIO_WRITEBACK starts the writeback of
 * files of writeback_min bytes or more. Stops at the first failure. Returns the number
 * of items before the first that failed (n when none did; with GBIO_FSYNC_GROUP later
 * items of its group may have been written too), or -errno when root cannot be opened (or
 * the copy that chunks are written from cannot be allocated). The trailer of each chunk is
 * the CRC-32C of the bytes written (see write_one).
 *
 * reuse (NULL: none): a directory of the same file system holding the files of a checkpoint
 * this save replaces (a local tier's retired part). A GBIO_TAKEDIR item takes its directory
 * from there in one rename (never through a link), and its pad field counts the items after
 * it that are all its files ("name/file", one level): each is written over the file of that
 * name (a regular file of one name only: otherwise a new file), cut to its new size, and what
 * else the directory held is removed. On tmpfs new files cost inodes, page allocation and
 * zeroing, and the retired part's removal as much again. GBIO_OVER: every file and chunk is
 * written so, over a file of its name where there is one (its folders must be directories:
 * the caller made them). */
int64_t gbio_write(const char *root, struct gbio_item *items, uint64_t n, uint32_t flags,
                   uint64_t writeback_min, const char *reuse)
{
    gbio_isa();
    uint64_t most = 0;
    for (uint64_t k = 0; k < n; k++)
        if (items[k].kind == GBIO_CHUNK && items[k].nbytes > most) most = items[k].nbytes;
    uint8_t *copy = most ? malloc(most) : NULL;
    if (most && !copy) return -ENOMEM;
    int dir = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) {
        int err = errno;
        free(copy);
        return -err;
    }
    int from = reuse ? open(reuse, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC) : -1;
    int fds[GROUP];
    uint64_t idx[GROUP];
    int held = 0;
    int64_t failed = -1;
    uint64_t i = 0, group_end = 0, group_start = 0;
    int over = 0;
    for (; i < n; i++) {
        struct gbio_item *it = &items[i];
        if (it->kind == GBIO_TAKEDIR) {
            if (!group_valid(items, i, n)) {
                fail(it, GBIO_STEP_MKDIR, EINVAL);
                break;
            }
            int r = take_dir(dir, from, it);
            if (r < 0) break;
            over = r, group_start = i, group_end = i + it->pad;
            if (it->pad == 0 && over) {
                int err = prune_dir(dir, it, 0);
                if (err) {
                    fail(it, GBIO_STEP_MKDIR, err);
                    break;
                }
            }
            continue;
        }
        int keep = -1;
        int onto = (over && i <= group_end) || (flags & GBIO_OVER);
        if (write_one(dir, it, flags, writeback_min, &keep, copy, onto)) break;
        if (keep >= 0) {
            fds[held] = keep, idx[held++] = i;
            if (held == GROUP) {
                failed = sync_group(items, fds, idx, held);
                held = 0;
                if (failed >= 0) break;
            }
        }
        if (over && i == group_end) {
            int err = prune_dir(dir, &items[group_start], group_end - group_start);
            over = 0;
            if (err) {
                fail(&items[group_start], GBIO_STEP_MKDIR, err);
                i = group_start;
                break;
            }
        }
    }
    if (held) {
        int64_t f = sync_group(items, fds, idx, held);
        if (failed < 0) failed = f;
    }
    if (from >= 0) close(from);
    close(dir);
    free(copy);
    return failed >= 0 && (uint64_t)failed < i ? failed : (int64_t)i;
}

/* ---- reading ------------------------------------------------------------------------ */

/* Read into iov[0:cnt] (consumed) until full or end of file. */
static int readv_full(int fd, struct iovec *iov, int cnt, uint64_t *done)
{
    for (;;) {
        while (cnt > 0 && iov->iov_len == 0) iov++, cnt--;
        if (cnt == 0) return 0;
        ssize_t r = readv(fd, iov, cnt);
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (r == 0) return 0;
        *done += (uint64_t)r;
        size_t left = (size_t)r;
        while (cnt > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++, cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
}

/* Open a checkpoint file the way gpuckpt reads untrusted files: never a symlink, never a
 * FIFO or device (checked before opening, so that none is even opened, and again after,
 * in case it was replaced meanwhile), never blocking. GBIO_CHECKED: the caller checked
 * every file with gbio_stat just before, so the check before opening is left out (a file
 * replaced since is opened without blocking, as no controlling terminal, and refused). */
static int open_regular(int dir, struct gbio_item *it, uint32_t flags)
{
    struct stat st;
    if (!(flags & GBIO_CHECKED)) {
        if (fstatat(dir, it->path, &st, AT_SYMLINK_NOFOLLOW)) return fail(it, GBIO_STEP_STAT, errno);
        if (!S_ISREG(st.st_mode)) {
            it->mode = st.st_mode;
            return fail(it, GBIO_STEP_NOTREG, ENOENT);
        }
    }
    int fd;
    do fd = openat(dir, it->path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        if (errno == ELOOP) { /* replaced by a symlink since the fstatat */
            it->mode = S_IFLNK;
            return fail(it, GBIO_STEP_NOTREG, ENOENT);
        }
        return fail(it, GBIO_STEP_OPEN, errno);
    }
    if (fstat(fd, &st)) {
        int err = errno;
        close(fd);
        return fail(it, GBIO_STEP_STAT, err);
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        it->mode = st.st_mode;
        return fail(it, GBIO_STEP_NOTREG, ENOENT);
    }
    return fd;
}

static int read_one(int dir, struct gbio_item *it, uint8_t *scratch, uint32_t flags)
{
    int fd = open_regular(dir, it, flags);
    if (fd < 0) return -1;
    uint8_t trailer[4];
    struct iovec iov[2] = {{it->data, it->nbytes}, {trailer, 4}};
    int err = 0;
    uint32_t c = ~0u;
    if (it->pad == 0) {
        err = readv_full(fd, iov, 2, &it->done);
        if (!err && it->done >= it->nbytes) c = crc_update(c, it->data, it->nbytes);
    } else {
        err = readv_full(fd, iov, 1, &it->done);
        if (!err && it->done == it->nbytes) {
            c = crc_update(c, it->data, it->nbytes);
            for (uint64_t left = it->pad; !err && left;) {
                uint64_t before = it->done;
                struct iovec s = {scratch, left < ZEROS ? left : ZEROS};
                err = readv_full(fd, &s, 1, &it->done);
                c = crc_update(c, scratch, it->done - before);
                if (it->done - before < s.iov_len) break;
                left -= s.iov_len;
            }
            if (!err && it->done == it->nbytes + it->pad) err = readv_full(fd, &iov[1], 1, &it->done);
        }
    }
    int step = err ? GBIO_STEP_READ : 0;
    if (close(fd) && !err && errno != EINTR) err = errno, step = GBIO_STEP_CLOSE;
    if (err) return fail(it, step, err);
    it->crc = ~c;
    if (it->done != it->nbytes + it->pad + 4) return fail(it, GBIO_STEP_SHORT, 0);
    it->stored = (uint32_t)trailer[0] | (uint32_t)trailer[1] << 8 | (uint32_t)trailer[2] << 16 |
                 (uint32_t)trailer[3] << 24;
    if (it->crc != it->stored || it->crc != it->expect) return fail(it, GBIO_STEP_MISMATCH, 0);
    return 0;
}

/* A whole file (GBIO_FILE) of exactly nbytes into data: one byte more is asked for, so that
 * a longer file is found (GBIO_STEP_LONG) as a shorter one is (GBIO_STEP_SHORT). */
static int read_whole(int dir, struct gbio_item *it, uint32_t flags)
{
    int fd = open_regular(dir, it, flags);
    if (fd < 0) return -1;
    uint8_t more;
    struct iovec iov[2] = {{it->data, it->nbytes}, {&more, 1}};
    int err = readv_full(fd, iov, 2, &it->done);
    int step = err ? GBIO_STEP_READ : 0;
    if (close(fd) && !err && errno != EINTR) err = errno, step = GBIO_STEP_CLOSE;
    if (err) return fail(it, step, err);
    if (it->done < it->nbytes) return fail(it, GBIO_STEP_SHORT, 0);
    if (it->done > it->nbytes) return fail(it, GBIO_STEP_LONG, 0);
    return 0;
}

/* Read the items under the directory root, in order. A chunk (GBIO_CHUNK): the file's first
 * nbytes into data, then pad bytes that are checksummed and dropped, then the 4-byte
 * trailer; the CRC-32C of data and padding must equal both the trailer and expect. A file
 * longer than that is read no further. A file (GBIO_FILE): all of it into data, which must
 * be its size (read_whole). Stops at the first item that fails (a system error, a file
 * that is not regular, a short or long file, a checksum mismatch). flags: GBIO_CHECKED (see
 * open_regular). Returns the number of items done, or -errno when root cannot be opened. */
int64_t gbio_read(const char *root, struct gbio_item *items, uint64_t n, uint32_t flags)
{
    gbio_isa();
    int dir = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) return -errno;
    uint8_t *scratch = NULL;
    uint64_t i = 0;
    for (; i < n; i++) {
        struct gbio_item *it = &items[i];
        if (it->kind == GBIO_FILE) {
            if (read_whole(dir, it, flags)) break;
            continue;
        }
        if (it->kind != GBIO_CHUNK) {
            fail(it, GBIO_STEP_OPEN, EINVAL);
            break;
        }
        if (it->pad && !scratch && !(scratch = malloc(ZEROS))) {
            fail(it, GBIO_STEP_READ, ENOMEM);
            break;
        }
        if (read_one(dir, it, scratch, flags)) break;
    }
    free(scratch);
    close(dir);
    return (int64_t)i;
}

/* The size of each item's file under root (its done field), without opening it: items
 * that are not regular files (symlinks included) get GBIO_STEP_NOTREG and their mode,
 * items that cannot be stat'ed (missing, a missing directory) GBIO_STEP_STAT and the
 * errno. Unlike reads and writes this does not stop at the first failure: a load checks
 * every chunk file of a checkpoint before it allocates or overwrites anything, and
 * reports the first one that is wrong in the order it chooses. Returns the number of
 * items that are regular files, or -errno when root cannot be opened. */
int64_t gbio_stat(const char *root, struct gbio_item *items, uint64_t n)
{
    int dir = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) return -errno;
    int64_t good = 0;
    for (uint64_t i = 0; i < n; i++) {
        struct gbio_item *it = &items[i];
        struct stat st;
        if (fstatat(dir, it->path, &st, AT_SYMLINK_NOFOLLOW)) {
            fail(it, GBIO_STEP_STAT, errno);
            continue;
        }
        if (!S_ISREG(st.st_mode)) {
            it->mode = st.st_mode;
            fail(it, GBIO_STEP_NOTREG, ENOENT);
            continue;
        }
        it->done = (uint64_t)st.st_size;
        good++;
    }
    close(dir);
    return good;
}

/* Removing a tree: deep enough for any checkpoint (an array's chunk keys nest one level per
 * axis), shallow enough for the stack. */
#define TREE_DEPTH 64

/* Remove everything in the open directory dir (taken: closed here), never following a
 * symbolic link (a link is removed, not what it points to). Returns the entries removed, or
 * -errno of the first failure (the others are still tried). The directory is read again
 * after a pass that removed something: entries removed while reading may hide others. */
static int64_t empty_dir(int dir, int depth)
{
    DIR *d = fdopendir(dir);
    if (d == NULL) {
        int e = errno;
        close(dir);
        return -e;
    }
    int fd = dirfd(d);
    int64_t removed = 0, err = 0, pass;
    do {
        pass = 0;
        struct dirent *e;
        errno = 0;
        while ((e = readdir(d)) != NULL) {
            const char *name = e->d_name;
            if (dot_entry(name)) continue;
            int is_dir = e->d_type == DT_DIR;
            if (e->d_type == DT_UNKNOWN) {
                struct stat st;
                is_dir = fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
            }
            if (is_dir) {
                if (depth >= TREE_DEPTH) {
                    if (!err) err = -ELOOP;
                    continue;
                }
                int sub = openat(fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
                if (sub < 0) {
                    if (!err) err = -errno;
                    continue;
                }
                int64_t r = empty_dir(sub, depth + 1);
                if (r < 0) {
                    if (!err) err = r;
                } else {
                    removed += r;
                }
                if (unlinkat(fd, name, AT_REMOVEDIR) == 0) {
                    removed++, pass++;
                } else if (!err) {
                    err = -errno;
                }
            } else if (unlinkat(fd, name, 0) == 0) {
                removed++, pass++;
            } else if (!err && errno != ENOENT) {
                err = -errno;
            }
            errno = 0;
        }
        if (errno && !err) err = -errno;
        rewinddir(d);
    } while (pass > 0 && !err);
    closedir(d);
    return err ? err : removed;
}

/* Remove the directory path and everything under it, never following a symbolic link (path
 * itself must be a directory, not a link to one). Returns the entries removed (path
 * included), or -errno of the first failure; what could be removed is removed. */
int64_t gbio_remove_tree(const char *path)
{
    int dir = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dir < 0) return -errno;
    int64_t r = empty_dir(dir, 0);
    if (r < 0) return r;
    if (rmdir(path)) return -errno;
    return r + 1;
}

/* Add to *total the sizes of the regular files in the open directory dir (taken: closed
 * here) and below it, never following a symbolic link (links, FIFOs, devices are not
 * counted); entries removed meanwhile, and folders that cannot be opened or lie deeper than
 * TREE_DEPTH, are passed over. Returns the files counted. */
static int64_t sum_dir(int dir, int depth, uint64_t *total)
{
    DIR *d = fdopendir(dir);
    if (d == NULL) {
        close(dir);
        return 0;
    }
    int fd = dirfd(d);
    int64_t files = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        const char *name = e->d_name;
        if (dot_entry(name)) continue;
        int is_dir = e->d_type == DT_DIR;
        if (!is_dir) {
            if (e->d_type != DT_REG && e->d_type != DT_UNKNOWN) continue;
            struct stat st;
            if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW)) continue;
            if (S_ISREG(st.st_mode)) {
                *total += (uint64_t)st.st_size;
                files++;
                continue;
            }
            is_dir = S_ISDIR(st.st_mode); /* a file system without d_type */
        }
        if (is_dir && depth < TREE_DEPTH) {
            int sub = openat(fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (sub >= 0) files += sum_dir(sub, depth + 1, total);
        }
    }
    closedir(d);
    return files;
}

/* The bytes of the regular files below the directory path (*total) and their number (the
 * return value), links never followed, what vanishes meanwhile passed over (see sum_dir);
 * -errno when path is not a directory that can be opened (a link to one is refused). */
int64_t gbio_tree_bytes(const char *path, uint64_t *total)
{
    *total = 0;
    int dir = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dir < 0) return -errno;
    return sum_dir(dir, 0, total);
}
