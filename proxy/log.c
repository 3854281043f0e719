#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

px_log_level_t px_log_threshold = PX_LOG_INFO;

static const char *const names[] = {"debug", "info", "warn", "error"};

int px_log_level_parse(const char *s)
{
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0) return i;
    return -1;
}

void px_log_write(px_log_level_t lvl, const char *fmt, ...)
{
    char line[2048];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "ts=%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ level=%s ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, names[lvl]);
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2) len = sizeof line - 2;
    line[len++] = '\n';
    /* One write per line so lines from several threads never interleave. */
    fwrite(line, 1, len, stderr);
}
