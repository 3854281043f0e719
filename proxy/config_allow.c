/* SPDX-License-Identifier: Apache-2.0 */
/* Allowlist entries (--prefiller-allowlist): HOST:PORTS, HOST a CIDR, an
 * address or a host name; and whether a target is in a list of them. */
#include <arpa/inet.h>
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "proxy/config_int.h"

/* Parses "addr/bits" (or a bare address: every bit). */
static int cidr_parse(const char *s, int *fam, unsigned char a[16], int *bits) {
    char buf[64];
    const char *slash = strchr(s, '/');
    size_t n = slash ? (size_t)(slash - s) : strlen(s);
    if (n >= sizeof buf) return -1;
    memcpy(buf, s, n);
    buf[n] = '\0';
    if (inet_pton(AF_INET, buf, a) == 1)
        *fam = AF_INET, *bits = 32;
    else if (inet_pton(AF_INET6, buf, a) == 1)
        *fam = AF_INET6, *bits = 128;
    else
        return -1;
    if (slash) {
        char *end;
        long b = strtol(slash + 1, &end, 10);
        if (*end || end == slash + 1 || b < 0 || b > *bits) return -1;
        *bits = (int)b;
    }
    return 0;
}

static int is_host_name(const char *s) {
    if (!*s || strlen(s) > 253) return 0;
    for (const char *p = s; *p; p++)
        if (!isalnum((unsigned char)*p) && *p != '-' && *p != '.') return 0;
    return 1;
}

/* Splits an allowlist entry HOST:PORTS (HOST a CIDR, an address or a host
 * name, an IPv6 one in brackets; PORTS a port, a range N-M, or * for every
 * port) into host and [lo, hi]. -1 when it is not so written. */
static int allow_split(const char *e, char *host, size_t hn, int *lo, int *hi) {
    const char *colon;
    const char *h = e;
    size_t hl;
    if (e[0] == '[') {
        const char *close = strchr(e, ']');
        if (!close || close[1] != ':') return -1;
        h = e + 1;
        hl = (size_t)(close - h);
        colon = close + 1;
    } else {
        colon = strrchr(e, ':');
        if (!colon || memchr(e, ':', (size_t)(colon - e))) return -1; /* v6: brackets */
        hl = (size_t)(colon - e);
    }
    if (!hl || hl >= hn) return -1;
    memcpy(host, h, hl);
    host[hl] = '\0';
    const char *p = colon + 1;
    if (!strcmp(p, "*")) {
        *lo = 1, *hi = 65535;
        return 0;
    }
    char *end;
    long a = strtol(p, &end, 10), b = a;
    if (end == p || *p == '-' || *p == '+') return -1;
    if (*end == '-') {
        const char *q = end + 1;
        if (*q < '0' || *q > '9') return -1;
        b = strtol(q, &end, 10);
    }
    if (*end || a < 1 || b > 65535 || a > b) return -1;
    *lo = (int)a, *hi = (int)b;
    return 0;
}

int px_target_allowed(const px_strlist *allow, const char *host, int port) {
    unsigned char h[16];
    int hfam = 0;
    if (inet_pton(AF_INET, host, h) == 1)
        hfam = AF_INET;
    else if (inet_pton(AF_INET6, host, h) == 1)
        hfam = AF_INET6;
    for (size_t i = 0; i < allow->n; i++) {
        unsigned char a[16];
        int fam, bits, lo, hi;
        char eh[300];
        if (allow_split(allow->v[i], eh, sizeof eh, &lo, &hi) < 0 || port < lo || port > hi)
            continue;
        if (cidr_parse(eh, &fam, a, &bits) == 0) {
            if (fam != hfam) continue;
            size_t full = (size_t)bits / 8;
            int rest = bits % 8;
            if (memcmp(a, h, full)) continue;
            if (rest && ((a[full] ^ h[full]) & (0xff << (8 - rest)) & 0xff)) continue;
            return 1;
        }
        if (!hfam && !strcasecmp(eh, host)) return 1;
    }
    return 0;
}

int px_cfg_allow_check(const char *name, const char *v, char *err, size_t errlen) {
    int fam, bits, lo, hi;
    unsigned char a[16];
    char h[300];
    if (allow_split(v, h, sizeof h, &lo, &hi) < 0) {
        snprintf(err, errlen,
                 "--%s '%s': not HOST:PORT (HOST a CIDR, an address or a host name, an IPv6 "
                 "one in brackets; PORT a port, a range N-M, or * for every port)",
                 name, v);
        return -1;
    }
    if (cidr_parse(h, &fam, a, &bits) == 0 || (!strchr(h, '/') && is_host_name(h))) return 0;
    snprintf(err, errlen, "--%s '%s': '%s' is not a CIDR, an address or a host name", name, v, h);
    return -1;
}
