/* SPDX-License-Identifier: Apache-2.0 */
/* For unit tests of what goes to stderr (the log). Needs cmocka.h first. */
#ifndef PX_STDERR_CAPTURE_H
#define PX_STDERR_CAPTURE_H

#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* Runs fn with stderr sent to a temporary file; returns what it wrote
 * (one line), from the first occurrence of `from` on. */
static void capture(void (*fn)(void), const char *from, char *out, size_t cap) {
    FILE *tmp = tmpfile();
    assert_non_null(tmp);
    fflush(stderr);
    int saved = dup(2);
    assert_true(saved >= 0);
    assert_true(dup2(fileno(tmp), 2) >= 0);
    fn();
    fflush(stderr);
    assert_true(dup2(saved, 2) >= 0);
    close(saved);
    rewind(tmp);
    char line[4096] = "";
    size_t n = fread(line, 1, sizeof line - 1, tmp);
    line[n] = '\0';
    fclose(tmp);
    const char *p = strstr(line, from);
    assert_non_null(p);
    snprintf(out, cap, "%s", p);
}

#endif
