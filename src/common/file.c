/* file.c -- see file.h. */
#include "common/file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"

static const char *kind(mode_t m) {
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISDIR(m)) return "a directory";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISSOCK(m)) return "a socket";
    return "not a regular file";
}

k3_status k3_file_open_regular(const char *path, int *fd, k3_error *err) {
    *fd = -1;
    const int f = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (f < 0) return k3_err(err, K3_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(f, &sb) != 0) {
        const int e = errno;
        close(f);
        return k3_err(err, K3_ERR_IO, "cannot stat %s: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(f);
        return k3_err(err, K3_ERR_IO, "%s is %s, not a regular file", path, kind(sb.st_mode));
    }
    const int fl = fcntl(f, F_GETFL);
    if (fl >= 0) (void)fcntl(f, F_SETFL, fl & ~O_NONBLOCK);
    *fd = f;
    return K3_OK;
}

k3_status k3_file_read(const char *path, size_t max, const char *what, char **out, size_t *len, k3_error *err) {
    *out = NULL;
    *len = 0;
    int fd;
    k3_status st = k3_file_open_regular(path, &fd, err);
    if (st != K3_OK) return st;
    struct stat sb;
    size_t cap = fstat(fd, &sb) == 0 && sb.st_size > 0 && (uint64_t)sb.st_size <= max ? (size_t)sb.st_size : 1 << 16;
    size_t n = 0;
    char *buf = malloc(cap + 1);
    for (;;) {
        if (!buf) {
            st = k3_err(err, K3_ERR_NOMEM, "out of memory reading %s", path);
            break;
        }
        if (n == cap) {
            if (cap > max) break; /* read past the limit: refused below */
            const size_t ncap = cap > max / 2 ? max + 1 : cap * 2;
            char *nb = realloc(buf, ncap + 1);
            if (!nb) {
                free(buf);
                buf = NULL;
                continue;
            }
            buf = nb;
            cap = ncap;
        }
        const ssize_t got = read(fd, buf + n, cap - n);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) {
            st = k3_err(err, K3_ERR_IO, "cannot read %s: %s", path, strerror(errno));
            break;
        }
        if (got == 0) break;
        n += (size_t)got;
    }
    close(fd);
    if (st == K3_OK && n > max)
        st = k3_err(err, K3_ERR_FORMAT, "%s is larger than the %zu MB limit for %s", path, max >> 20, what);
    if (st != K3_OK) {
        free(buf);
        return st;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return K3_OK;
}
