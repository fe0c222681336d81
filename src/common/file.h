/*
 * file.h -- opening and reading the files a checkpoint is made of, safely:
 * a FIFO, device or directory in place of a file is refused before it can
 * block open() or read() forever, and a whole-file read has a size limit.
 */
#ifndef K3_COMMON_FILE_H
#define K3_COMMON_FILE_H

#include <stddef.h>

#include "k3.h"

/* Opens path read-only (O_CLOEXEC) if it is a regular file; *fd gets the
 * descriptor. Opening uses O_NONBLOCK, so a FIFO with no writer does not
 * block, and is then refused by its type. */
k3_status k3_file_open_regular(const char *path, int *fd, k3_error *err);

/* Reads a whole regular file of at most max bytes into a NUL-terminated
 * malloc'd buffer (*len excludes the NUL). what names the file in the
 * message of a larger one ("a tokenizer file"). */
k3_status k3_file_read(const char *path, size_t max, const char *what, char **out, size_t *len, k3_error *err);

#endif /* K3_COMMON_FILE_H */
