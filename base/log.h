/* Leveled logging to stderr, one logfmt line per event, or one JSON object
 * per line (--log-format json): there, bare values that are numbers become
 * JSON numbers (except for keys that name identifiers, such as req), and
 * everything else a string. */
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

/* One request's access-log line. What is not known is left out of the line
 * rather than written as a placeholder: NULL strings, negative times. */
typedef struct px_access {
    const char *req;      /* borrowed: the request id, already a logfmt value */
    const char *endpoint; /* borrowed */
    const char *prefill;  /* borrowed: backend name; NULL: none was chosen */
    const char *decode;   /* borrowed: backend name; NULL: none was chosen */
    int status;
    double prefill_ms; /* < 0: no prefill answered */
    double ttfb_ms;    /* < 0: no byte of an answer from decode */
    double total_ms;
    size_t bytes_out;
    const char *outcome;  /* borrowed */
    const char *trace_id; /* borrowed; NULL: none */
    /* How the request was served: "disaggregated" or "decode_only", why,
     * and the decode-only fallback taken after prefill failed (NULL:
     * left out of the line). */
    const char *decision;
    const char *decision_reason;
    const char *fallback;
    int estimated; /* the two estimates below are set */
    long prompt_tokens_est;
    long uncached_tokens_est;
} px_access;

/* Writes the access line at level info (checked first). */
void px_log_access(const px_access *a);

/* Checks the level before any formatting happens. `fmt` continues the line
 * after "ts=… level=…", in key=value form, e.g. PX_LOG(PX_LOG_WARN,
 * "req=%s msg=\"…\"", id). */
#define PX_LOG(lvl, ...)                                                                           \
    do {                                                                                           \
        if ((lvl) >= px_log_threshold) px_log_write((lvl), __VA_ARGS__);                           \
    } while (0)

#endif
