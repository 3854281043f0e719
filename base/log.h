/* SPDX-License-Identifier: Apache-2.0 */
/* Leveled logging to stderr, one logfmt line per event, or one JSON object
 * per line (--log-format json): there, bare values that are numbers become
 * JSON numbers (except for keys that name identifiers, such as req), and
 * everything else a string. Once logsink.h's sink is started, lines go
 * through it (stderr or a file, never blocking the caller); before, they
 * are written to stderr at once. */
#ifndef PX_LOG_H
#define PX_LOG_H

#include <stddef.h>

typedef enum {
    PX_LOG_DEBUG = 0,
    PX_LOG_INFO = 1,
    PX_LOG_WARN = 2,
    PX_LOG_ERROR = 3
} px_log_level_t;

extern px_log_level_t px_log_threshold;
/* 0: logfmt (key=value), 1: one JSON object per line. */
extern int px_log_json;

/* Parses "debug|info|warn|error"; returns -1 when unknown. */
int px_log_level_parse(const char *s);

/* Renders s as one logfmt value in out (cap bytes): as it is when it holds no
 * space, '=', '"', '\\' or control character, else quoted and escaped.
 * Returns out. Use it for every value that comes from outside. */
const char *px_log_value(const char *s, char *out, size_t cap);

void px_log_write(px_log_level_t lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The same for a line formatted already, text[0..n) (cut to the line's
 * limit, as px_log_write cuts), that may wait in the thread's log buffer
 * to be written in a batch (the access log: logsink.h). */
void px_log_put_batched(px_log_level_t lvl, const char *text, size_t n);

/* Checks the level before any formatting happens. `fmt` continues the line
 * after "ts=… level=…", in key=value form, e.g. PX_LOG(PX_LOG_WARN,
 * "req=%s msg=\"…\"", id). */
#define PX_LOG(lvl, ...)                                                                           \
    do {                                                                                           \
        if ((lvl) >= px_log_threshold) px_log_write((lvl), __VA_ARGS__);                           \
    } while (0)

#endif
