/* Leveled logging to stderr, one logfmt line per event. */
#ifndef PX_LOG_H
#define PX_LOG_H

typedef enum { PX_LOG_DEBUG = 0, PX_LOG_INFO = 1, PX_LOG_WARN = 2, PX_LOG_ERROR = 3 } px_log_level_t;

extern px_log_level_t px_log_threshold;
/* 0: logfmt (key=value), 1: one JSON object per line. */
extern int px_log_json;

/* Parses "debug|info|warn|error"; returns -1 when unknown. */
int px_log_level_parse(const char *s);

void px_log_write(px_log_level_t lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Checks the level before any formatting happens. `fmt` continues the line
 * after "ts=… level=…", in key=value form, e.g. PX_LOG(PX_LOG_WARN,
 * "req=%s msg=\"…\"", id). */
#define PX_LOG(lvl, ...)                                                                           \
    do {                                                                                           \
        if ((lvl) >= px_log_threshold) px_log_write((lvl), __VA_ARGS__);                           \
    } while (0)

#endif
