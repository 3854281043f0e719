/* SPDX-License-Identifier: Apache-2.0 */
#include "base/json.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

typedef struct scan {
    const char *base;
    const char *end;
    char *err;
    size_t errlen;
} scan;

static const char *fail(scan *sc, const char *at, const char *why) {
    if (sc->err && sc->errlen && !sc->err[0])
        snprintf(sc->err, sc->errlen, "%s at byte %ld", why, (long)(at - sc->base));
    return NULL;
}

static const char *skip_ws(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
        p++;
    return p;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Length of the valid UTF-8 sequence at p (1..4), or 0 when invalid:
 * overlong forms, surrogates and code points above U+10FFFF are rejected. */
static int utf8_len(const unsigned char *p, const unsigned char *end) {
    unsigned c = p[0];
    if (c < 0x80) return 1;
    int n;
    unsigned min;
    unsigned cp;
    if (c >= 0xc2 && c <= 0xdf) {
        n = 2, cp = c & 0x1f, min = 0x80;
    } else if (c >= 0xe0 && c <= 0xef) {
        n = 3, cp = c & 0x0f, min = 0x800;
    } else if (c >= 0xf0 && c <= 0xf4) {
        n = 4, cp = c & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (end - p < n) return 0;
    for (int i = 1; i < n; i++) {
        if ((p[i] & 0xc0) != 0x80) return 0;
        cp = (cp << 6) | (p[i] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
    return n;
}

/* The bytes of 8 that end, escape or break a string: '"', '\\', a control
 * character, anything outside ASCII (those take the byte-wise path). Bit 7
 * of byte i is set when byte i is one of them; above the first such byte a
 * bit may be set wrongly (a borrow), never below it, so the lowest set bit
 * is exact. */
static uint64_t special8(const char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    const uint64_t ones = 0x0101010101010101ull, high = 0x8080808080808080ull;
    uint64_t q = v ^ (ones * '"'), b = v ^ (ones * '\\');
    return (v & high) | ((v - ones * 0x20) & ~v & high) | ((q - ones) & ~q & high) |
           ((b - ones) & ~b & high);
}

#ifdef __SSE2__
/* special8's test on sixteen bytes (SSE2, every x86-64): bit i set when
 * byte i is '"', '\\', a control character or beyond ASCII (the signed
 * compare below 0x20 takes both of the last two). */
static unsigned special16(const char *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)(const void *)p);
    __m128i q = _mm_cmpeq_epi8(v, _mm_set1_epi8('"'));
    __m128i b = _mm_cmpeq_epi8(v, _mm_set1_epi8('\\'));
    __m128i c = _mm_cmplt_epi8(v, _mm_set1_epi8(0x20));
    return (unsigned)_mm_movemask_epi8(_mm_or_si128(_mm_or_si128(q, b), c));
}
#endif

/* plain[c]: the byte c neither ends, escapes nor breaks a string (ASCII,
 * no control character, no '"', no '\\'): special8's test one byte at a time. */
#define R16(v) v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v
static const unsigned char plain[256] = {
    R16(0), R16(0), /* control characters */
    1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, /* ' ' '!' '"' ... */
    R16(1), R16(1),
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, /* ... '[' '\\' ']' ... */
    R16(1), R16(1),
    R16(0), R16(0), R16(0), R16(0), R16(0), R16(0), R16(0), R16(0), /* beyond ASCII */
};
#undef R16

/* p points just past the opening quote; returns a pointer past the closing one. */
static const char *scan_string(scan *sc, const char *p) {
    const char *end = sc->end;
    while (p < end) {
        /* Eight bytes at a time: past them while they are plain, else
         * straight to the first that is not (on a little-endian machine the
         * lowest set bit is the first byte in memory); the last few bytes
         * of the buffer one at a time. */
        uint64_t sp = 0;
#ifdef __SSE2__
        /* Sixteen at a time where SSE2 is (a prompt is mostly one long
         * string): a quarter of the instructions of special8's loop. */
        unsigned m = 0;
        while (end - p >= 16 && !(m = special16(p)))
            p += 16;
        if (m)
            p += __builtin_ctz(m);
        else
#endif
            while (end - p >= 8 && !(sp = special8(p)))
                p += 8;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        if (sp)
            p += __builtin_ctzll(sp) >> 3;
        else
#endif
            while (p < end && plain[(unsigned char)*p])
                p++;
        if (p >= end) break;
        unsigned char c = (unsigned char)*p;
        if (c == '"') return p + 1;
        if (c == '\\') {
            if (++p >= end) break;
            switch (*p) {
            case '"':
            case '\\':
            case '/':
            case 'b':
            case 'f':
            case 'n':
            case 'r':
            case 't':
                p++;
                break;
            case 'u':
                if (end - p < 5) return fail(sc, p, "truncated \\u escape");
                for (int i = 1; i <= 4; i++)
                    if (hexval(p[i]) < 0) return fail(sc, p, "bad \\u escape");
                p += 5;
                break;
            default:
                return fail(sc, p, "bad escape");
            }
            continue;
        }
        if (c < 0x20) return fail(sc, p, "control character in string");
        int n = utf8_len((const unsigned char *)p, (const unsigned char *)end);
        if (!n) return fail(sc, p, "invalid UTF-8");
        p += n;
    }
    return fail(sc, p, "unterminated string");
}

static const char *scan_number(scan *sc, const char *p) {
    const char *end = sc->end, *s = p;
    if (p < end && *p == '-') p++;
    if (p >= end) return fail(sc, s, "bad number");
    if (*p == '0') {
        p++;
    } else if (*p >= '1' && *p <= '9') {
        while (p < end && *p >= '0' && *p <= '9')
            p++;
    } else {
        return fail(sc, s, "bad number");
    }
    if (p < end && *p == '.') {
        p++;
        if (p >= end || *p < '0' || *p > '9') return fail(sc, s, "bad number");
        while (p < end && *p >= '0' && *p <= '9')
            p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        if (p >= end || *p < '0' || *p > '9') return fail(sc, s, "bad number");
        while (p < end && *p >= '0' && *p <= '9')
            p++;
    }
    return p;
}

static const char *scan_value(scan *sc, const char *p, int depth, px_json_type *type);

static const char *scan_literal(scan *sc, const char *p, const char *lit) {
    size_t n = strlen(lit);
    if ((size_t)(sc->end - p) < n || memcmp(p, lit, n) != 0) return fail(sc, p, "unexpected token");
    return p + n;
}

static const char *scan_container(scan *sc, const char *p, int depth, int is_obj) {
    const char *end = sc->end;
    char close = is_obj ? '}' : ']';
    if (depth >= PX_JSON_MAX_DEPTH) return fail(sc, p, "nesting too deep");
    p = skip_ws(p + 1, end);
    if (p < end && *p == close) return p + 1;
    for (;;) {
        px_json_type t;
        if (is_obj) {
            if (p >= end || *p != '"') return fail(sc, p, "expected object key");
            if (!(p = scan_string(sc, p + 1))) return NULL;
            p = skip_ws(p, end);
            if (p >= end || *p != ':') return fail(sc, p, "expected ':'");
            p = skip_ws(p + 1, end);
        }
        if (!(p = scan_value(sc, p, depth + 1, &t))) return NULL;
        p = skip_ws(p, end);
        if (p >= end) return fail(sc, p, "unterminated container");
        if (*p == close) return p + 1;
        if (*p != ',') return fail(sc, p, "expected ',' or end of container");
        p = skip_ws(p + 1, end);
    }
}

static const char *scan_value(scan *sc, const char *p, int depth, px_json_type *type) {
    if (p >= sc->end) return fail(sc, p, "unexpected end of input");
    switch (*p) {
    case '{':
        *type = PX_JSON_OBJECT;
        return scan_container(sc, p, depth, 1);
    case '[':
        *type = PX_JSON_ARRAY;
        return scan_container(sc, p, depth, 0);
    case '"':
        *type = PX_JSON_STRING;
        return scan_string(sc, p + 1);
    case 't':
        *type = PX_JSON_TRUE;
        return scan_literal(sc, p, "true");
    case 'f':
        *type = PX_JSON_FALSE;
        return scan_literal(sc, p, "false");
    case 'n':
        *type = PX_JSON_NULL;
        return scan_literal(sc, p, "null");
    default:
        *type = PX_JSON_NUMBER;
        return scan_number(sc, p);
    }
}

px_json_type px_json_validate(const char *s, size_t n, char *err, size_t errlen) {
    scan sc = {s, s + n, err, errlen};
    if (err && errlen) err[0] = '\0';
    px_json_type t = PX_JSON_INVALID;
    const char *p = skip_ws(s, sc.end);
    if (!(p = scan_value(&sc, p, 0, &t))) return PX_JSON_INVALID;
    p = skip_ws(p, sc.end);
    if (p != sc.end) {
        fail(&sc, p, "trailing data after JSON value");
        return PX_JSON_INVALID;
    }
    return t;
}

int px_json_iter_init(px_json_iter *it, const char *obj, size_t n) {
    const char *end = obj + n;
    const char *p = skip_ws(obj, end);
    if (p >= end || *p != '{') return -1;
    p = skip_ws(p + 1, end);
    it->p = p;
    it->end = end;
    it->done = (p < end && *p == '}');
    return 0;
}

int px_json_iter_next(px_json_iter *it, px_json_member *m) {
    if (it->done) return 0;
    scan sc = {it->p, it->end, NULL, 0};
    const char *p = it->p, *end = it->end;
    if (p >= end || *p != '"') return -1;
    m->start = p;
    const char *q = scan_string(&sc, p + 1);
    if (!q) return -1;
    m->key = p + 1;
    m->key_len = (size_t)(q - 1 - (p + 1));
    p = skip_ws(q, end);
    if (p >= end || *p != ':') return -1;
    p = skip_ws(p + 1, end);
    m->val = p;
    q = scan_value(&sc, p, 1, &m->type);
    if (!q) return -1;
    m->val_len = (size_t)(q - p);
    p = skip_ws(q, end);
    if (p >= end) return -1;
    if (*p == '}') {
        it->done = 1;
    } else if (*p == ',') {
        p = skip_ws(p + 1, end);
    } else {
        return -1;
    }
    it->p = p;
    return 1;
}

int px_json_iter_whole(const px_json_iter *it) {
    return skip_ws(it->p + 1, it->end) == it->end;
}

/* Decodes one character of a raw JSON string at *pp into a code point. */
static long next_cp(const char **pp, const char *end) {
    const char *p = *pp;
    if (p >= end) return -1;
    if (*p != '\\') {
        int n = utf8_len((const unsigned char *)p, (const unsigned char *)end);
        if (!n) return -1;
        long cp = (unsigned char)p[0];
        if (n > 1) {
            cp &= (n == 2) ? 0x1f : (n == 3) ? 0x0f : 0x07;
            for (int i = 1; i < n; i++)
                cp = (cp << 6) | (p[i] & 0x3f);
        }
        *pp = p + n;
        return cp;
    }
    if (end - p < 2) return -1;
    p++;
    long cp;
    switch (*p) {
    case '"':
        cp = '"';
        break;
    case '\\':
        cp = '\\';
        break;
    case '/':
        cp = '/';
        break;
    case 'b':
        cp = '\b';
        break;
    case 'f':
        cp = '\f';
        break;
    case 'n':
        cp = '\n';
        break;
    case 'r':
        cp = '\r';
        break;
    case 't':
        cp = '\t';
        break;
    case 'u': {
        if (end - p < 5) return -1;
        cp = 0;
        for (int i = 1; i <= 4; i++) {
            int h = hexval(p[i]);
            if (h < 0) return -1;
            cp = cp * 16 + h;
        }
        p += 5;
        /* A high surrogate followed by an escaped low one forms one code point. */
        if (cp >= 0xd800 && cp <= 0xdbff && end - p >= 6 && p[0] == '\\' && p[1] == 'u') {
            long lo = 0;
            int ok = 1;
            for (int i = 2; i <= 5; i++) {
                int h = hexval(p[i]);
                if (h < 0) ok = 0;
                lo = lo * 16 + (h < 0 ? 0 : h);
            }
            if (ok && lo >= 0xdc00 && lo <= 0xdfff) {
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                p += 6;
            }
        }
        *pp = p;
        return cp;
    }
    default:
        return -1;
    }
    *pp = p + 1;
    return cp;
}

int px_json_str_eq_full(const char *raw, size_t len, const char *lit) {
    const char *p = raw, *end = raw + len;
    const unsigned char *l = (const unsigned char *)lit;
    /* Fast paths. An escape is longer than the character it stands for
     * (and an escaped NUL ends the text), so a raw string no longer than
     * lit equals it only byte for byte (lit has no backslash); a longer
     * one only through an escape. */
    /* The first byte tells most keys apart: unless it opens an escape, it
     * is the first character (lit is ASCII), and an empty raw string
     * equals only an empty lit. */
    if (!len) return !*l;
    if (*raw != '\\' && (unsigned char)*raw != *l) return 0;
    size_t n = strlen(lit);
    if (len <= n) return len == n && memcmp(raw, lit, len) == 0;
    if (!memchr(raw, '\\', len)) return 0;
    while (p < end) {
        long cp = next_cp(&p, end);
        /* An escaped NUL ends the key for C consumers (cJSON reads
         * "kv_transfer_params\u0000x" as "kv_transfer_params"), so it ends
         * the comparison too: a key an engine may read as `lit` is `lit`. */
        if (cp == 0) return *l == 0;
        if (cp < 0 || cp > 0x7f || *l == 0 || (long)*l != cp) {
            /* `lit` is ASCII; a non-ASCII code point never matches. */
            return 0;
        }
        l++;
    }
    return *l == 0;
}

long px_json_str_decode(const char *raw, size_t len, char *out, size_t outcap) {
    const char *p = raw, *end = raw + len;
    size_t o = 0;
    while (p < end) {
        /* A plain byte (printable ASCII, no escape) is itself. */
        if (plain[(unsigned char)*p]) {
            if (o + 1 >= outcap) return -1;
            out[o++] = *p++;
            continue;
        }
        long cp = next_cp(&p, end);
        if (cp < 0) return -1;
        unsigned char tmp[4];
        int n;
        if (cp < 0x80) {
            tmp[0] = (unsigned char)cp, n = 1;
        } else if (cp < 0x800) {
            tmp[0] = (unsigned char)(0xc0 | (cp >> 6)),
            tmp[1] = (unsigned char)(0x80 | (cp & 0x3f)), n = 2;
        } else if (cp < 0x10000) {
            tmp[0] = (unsigned char)(0xe0 | (cp >> 12));
            tmp[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
            tmp[2] = (unsigned char)(0x80 | (cp & 0x3f)), n = 3;
        } else {
            tmp[0] = (unsigned char)(0xf0 | (cp >> 18));
            tmp[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3f));
            tmp[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
            tmp[3] = (unsigned char)(0x80 | (cp & 0x3f)), n = 4;
        }
        if (o + (size_t)n >= outcap) return -1;
        memcpy(out + o, tmp, (size_t)n);
        o += (size_t)n;
    }
    if (outcap == 0) return -1;
    out[o] = '\0';
    return (long)o;
}

int px_json_find(const char *obj, size_t n, const char *key, px_json_member *m) {
    px_json_iter it;
    px_json_member cur;
    int found = 0, r;
    if (px_json_iter_init(&it, obj, n) < 0) return 0;
    while ((r = px_json_iter_next(&it, &cur)) == 1) {
        if (px_json_str_eq(cur.key, cur.key_len, key)) {
            *m = cur;
            found = 1;
        }
    }
    return r < 0 ? 0 : found;
}

int px_json_object_find(const char *obj, size_t n, const char *const *keys, size_t nkeys,
                        px_json_member *found) {
    px_json_iter it;
    px_json_member m;
    int r;
    for (size_t i = 0; i < nkeys; i++)
        found[i].val = NULL;
    if (px_json_iter_init(&it, obj, n) < 0) return -1;
    /* px_json_iter_next validates each value it steps over, at the depth
     * px_json_validate would; what it leaves is the closing brace and
     * whatever follows it. */
    while ((r = px_json_iter_next(&it, &m)) == 1)
        for (size_t i = 0; i < nkeys; i++)
            if (px_json_str_eq(m.key, m.key_len, keys[i])) {
                found[i] = m;
                break;
            }
    if (r < 0 || !px_json_iter_whole(&it)) return -1;
    return 0;
}
