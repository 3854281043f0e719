/* SPDX-License-Identifier: Apache-2.0 */
#include "base/log.h"

#include "base/logsink.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

px_log_level_t px_log_threshold = PX_LOG_INFO;
int px_log_json = 0;

/* Keys whose values are identifiers: strings in JSON even when they are
 * made of digits (a request id "12345" is not a number). */
static int string_key(const char *k, size_t n) {
    static const char *const keys[] = {"req",     "trace_id", "id",     "name",
                                       "backend", "prefill",  "decode", "ts"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (strlen(keys[i]) == n && !memcmp(keys[i], k, n)) return 1;
    return 0;
}

/* A JSON number, as RFC 8259 spells it (so "1e3" yes, "0x10", "01", "1."
 * and "inf" no). */
static int json_number(const char *s, size_t n) {
    size_t i = 0;
    if (i < n && s[i] == '-') i++;
    if (i >= n) return 0;
    if (s[i] == '0') {
        i++;
    } else if (s[i] >= '1' && s[i] <= '9') {
        while (i < n && s[i] >= '0' && s[i] <= '9')
            i++;
    } else {
        return 0;
    }
    if (i < n && s[i] == '.') {
        size_t d = ++i;
        while (i < n && s[i] >= '0' && s[i] <= '9')
            i++;
        if (i == d) return 0;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < n && (s[i] == '+' || s[i] == '-')) i++;
        size_t d = i;
        while (i < n && s[i] >= '0' && s[i] <= '9')
            i++;
        if (i == d) return 0;
    }
    return i == n;
}

/* Rewrites a logfmt line (key=value, key="quoted \" value") as a JSON
 * object, so every log line has one source of truth for its fields. Quoted
 * values are strings; bare ones are numbers when they read as one. */
static size_t logfmt_to_json(const char *in, size_t n, char *out, size_t cap) {
    size_t o = 0;
#define PUT(c)                                                                                     \
    do {                                                                                           \
        if (o + 1 < cap) out[o++] = (c);                                                           \
    } while (0)
    PUT('{');
    size_t i = 0;
    int first = 1;
    while (i < n) {
        while (i < n && in[i] == ' ')
            i++;
        if (i >= n) break;
        size_t ks = i;
        while (i < n && in[i] != '=' && in[i] != ' ')
            i++;
        size_t ke = i;
        if (!first) PUT(',');
        first = 0;
        PUT('"');
        for (size_t k = ks; k < ke; k++)
            PUT(in[k] == '"' ? '_' : in[k]);
        PUT('"');
        PUT(':');
        if (i < n && in[i] == '=' && i + 1 < n && in[i + 1] != '"' &&
            !string_key(in + ks, ke - ks)) {
            size_t vs = i + 1, ve = vs;
            while (ve < n && in[ve] != ' ')
                ve++;
            if (json_number(in + vs, ve - vs)) {
                for (size_t k = vs; k < ve; k++)
                    PUT(in[k]);
                i = ve;
                continue;
            }
        }
        PUT('"');
        if (i < n && in[i] == '=') {
            i++;
            if (i < n && in[i] == '"') {
                i++;
                while (i < n && in[i] != '"') {
                    if (in[i] == '\\' && i + 1 < n) {
                        PUT('\\');
                        PUT(in[i + 1]);
                        i += 2;
                        continue;
                    }
                    unsigned char c = (unsigned char)in[i++];
                    if (c < 0x20) {
                        char esc[8];
                        snprintf(esc, sizeof esc, "\\u%04x", c);
                        for (char *e = esc; *e; e++)
                            PUT(*e);
                    } else {
                        PUT((char)c);
                    }
                }
                if (i < n) i++;
            } else {
                while (i < n && in[i] != ' ') {
                    unsigned char c = (unsigned char)in[i++];
                    if (c == '\\' || c == '"') PUT('\\');
                    if (c >= 0x20) PUT((char)c);
                }
            }
        }
        PUT('"');
    }
    PUT('}');
#undef PUT
    return o;
}

static const char *const names[] = {"debug", "info", "warn", "error"};

int px_log_level_parse(const char *s) {
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0) return i;
    return -1;
}

/* bare[c]: byte c may stand in a logfmt value unquoted (not NUL, a space,
 * another control character, '=', '"', '\\' or DEL). */
#define R16(v) v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v
static const unsigned char bare[256] = {
    R16(0), R16(0),                                 /* NUL and control characters */
    0, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, /* ' ' '!' '"' ... */
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, /* ... '=' ... */
    R16(1),
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, /* ... '\\' ... */
    R16(1),
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, /* ... DEL */
    R16(1), R16(1), R16(1), R16(1), R16(1), R16(1), R16(1), R16(1), /* beyond ASCII */
};
#undef R16

const char *px_log_value(const char *s, char *out, size_t cap) {
    /* One table load a byte, to the first byte that is not bare: the end
     * (NUL) when the value is plain. */
    const char *p = s;
    while (bare[(unsigned char)*p])
        p++;
    int plain = !*p && p != s;
    size_t o = 0;
    if (plain) { /* as snprintf(out, cap, "%s", s) would, cut to fit */
        size_t n = (size_t)(p - s);
        if (cap) {
            if (n >= cap) n = cap - 1;
            memcpy(out, s, n);
            out[n] = '\0';
        }
        return out;
    }
    if (cap < 3) return "\"\"";
    out[o++] = '"';
    for (const char *q = s; *q && o + 6 < cap; q++) {
        unsigned char c = (unsigned char)*q;
        if (c == '"' || c == '\\') {
            out[o++] = '\\';
            out[o++] = (char)c;
        } else if (c < 0x20 || c == 0x7f) {
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", c);
        } else {
            out[o++] = (char)c;
        }
    }
    out[o++] = '"';
    out[o] = '\0';
    return out;
}

/* "YYYY-MM-DDTHH:MM:SS" of the current second, formatted once a second
 * per thread. */
static const char *ts_prefix(time_t sec) {
    static _Thread_local time_t last = -1;
    static _Thread_local char text[80];
    if (sec != last) {
        struct tm tm;
        gmtime_r(&sec, &tm);
        snprintf(text, sizeof text, "%04d-%02d-%02dT%02d:%02d:%02d", tm.tm_year + 1900,
                 tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec);
        last = sec;
    }
    return text;
}

#define LINE_MAX_BYTES 2048

/* Writes "ts=... level=... " at line's start; returns its length (written
 * by hand: it starts every line, the access line of every request too). */
static size_t line_prefix(px_log_level_t lvl, char *line) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    const char *t = ts_prefix(ts.tv_sec), *name = names[lvl];
    size_t n = 0, tl = strlen(t), nl = strlen(name);
    long ms = ts.tv_nsec / 1000000;
    memcpy(line, "ts=", 3);
    n = 3;
    memcpy(line + n, t, tl);
    n += tl;
    line[n++] = '.';
    line[n++] = (char)('0' + ms / 100);
    line[n++] = (char)('0' + ms / 10 % 10);
    line[n++] = (char)('0' + ms % 10);
    memcpy(line + n, "Z level=", 8);
    n += 8;
    memcpy(line + n, name, nl);
    n += nl;
    line[n++] = ' ';
    return n;
}

/* Hands the line[0..len) (room for one byte more) to the sink, as it is or
 * as JSON. */
static void line_emit(int batched, char *line, size_t len) {
    if (px_log_json) {
        char js[4096];
        size_t jl = logfmt_to_json(line, len, js, sizeof js - 1);
        js[jl++] = '\n';
        if (!px_logsink_put(js, jl, batched)) fwrite(js, 1, jl, stderr);
        return;
    }
    line[len++] = '\n';
    /* One write per line so lines from several threads never interleave
     * (the sink keeps whole lines too). */
    if (!px_logsink_put(line, len, batched)) fwrite(line, 1, len, stderr);
}

static void log_line(px_log_level_t lvl, int batched, const char *fmt, va_list ap) {
    char line[LINE_MAX_BYTES];
    size_t n = line_prefix(lvl, line);
    int m = vsnprintf(line + n, sizeof line - n - 1, fmt, ap);
    size_t len = n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2) len = sizeof line - 2;
    line_emit(batched, line, len);
}

void px_log_write(px_log_level_t lvl, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    log_line(lvl, 0, fmt, ap);
    va_end(ap);
}

void px_log_put_batched(px_log_level_t lvl, const char *text, size_t n) {
    char line[LINE_MAX_BYTES];
    size_t p = line_prefix(lvl, line);
    if (n > sizeof line - 2 - p) n = sizeof line - 2 - p;
    memcpy(line + p, text, n);
    line_emit(1, line, p + n);
}
