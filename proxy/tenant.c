/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/tenant.h"

#include <arpa/inet.h>
#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/util.h"

/* ---------- tenant keys ---------- */

typedef struct tkey {
    unsigned char digest[32];
    char *tenant; /* owned */
} tkey;

struct px_tkeys {
    tkey *v; /* owned */
    size_t n;
};

static void trim(const char **s, size_t *n) {
    while (*n && (**s == ' ' || **s == '\t'))
        (*s)++, (*n)--;
    while (*n && ((*s)[*n - 1] == ' ' || (*s)[*n - 1] == '\t' || (*s)[*n - 1] == '\r'))
        (*n)--;
}

int px_tkeys_load(const char *path, px_tkeys **out, char *err, size_t errlen) {
    *out = NULL;
    if (!path || !*path) return 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, errlen, "--tenant-keys '%s': %s", path, strerror(errno));
        return -1;
    }
    px_tkeys *k = px_xcalloc(1, sizeof *k);
    char *line = NULL;
    size_t cap = 0, lineno = 0;
    int rc = 0;
    while (getline(&line, &cap, f) >= 0) {
        lineno++;
        const char *s = line;
        size_t n = strcspn(line, "\n");
        trim(&s, &n);
        if (!n || *s == '#') continue;
        const char *colon = memchr(s, ':', n);
        const char *t = s, *key = colon ? colon + 1 : NULL;
        size_t tn = colon ? (size_t)(colon - s) : 0, kn = colon ? n - tn - 1 : 0;
        if (colon) {
            trim(&t, &tn);
            trim(&key, &kn);
        }
        if (!colon || !tn || !kn || tn > 200 || memchr(t, '\0', tn)) {
            /* The line holds a key: its text never goes into a message. */
            snprintf(err, errlen, "--tenant-keys '%s' line %zu: expected TENANT:KEY", path,
                     lineno);
            rc = -1;
            break;
        }
        k->v = px_xrealloc(k->v, (k->n + 1) * sizeof *k->v);
        SHA256((const unsigned char *)key, kn, k->v[k->n].digest);
        k->v[k->n].tenant = px_xstrndup(t, tn);
        for (size_t i = 0; i < k->n && rc == 0; i++)
            if (!memcmp(k->v[i].digest, k->v[k->n].digest, 32) &&
                strcmp(k->v[i].tenant, k->v[k->n].tenant)) {
                snprintf(err, errlen, "--tenant-keys '%s' line %zu: an earlier line gives this "
                         "key to another tenant", path, lineno);
                rc = -1;
            }
        k->n++;
        if (rc) break;
    }
    OPENSSL_cleanse(line, cap);
    free(line);
    fclose(f);
    if (rc == 0 && !k->n) {
        snprintf(err, errlen, "--tenant-keys '%s': no TENANT:KEY line in the file", path);
        rc = -1;
    }
    if (rc < 0) {
        px_tkeys_destroy(k);
        return -1;
    }
    *out = k;
    return 0;
}

void px_tkeys_destroy(px_tkeys *k) {
    if (!k) return;
    for (size_t i = 0; i < k->n; i++)
        free(k->v[i].tenant);
    free(k->v);
    free(k);
}

size_t px_tkeys_count(const px_tkeys *k) {
    return k ? k->n : 0;
}

int px_bearer_digest(const px_http_head *h, unsigned char digest[32]) {
    const px_http_header *a = px_http_find(h, "authorization");
    if (!a || a->value_len < 8 || !px_http_token_eq(a->value, 6, "bearer") || a->value[6] != ' ')
        return 0;
    SHA256((const unsigned char *)a->value + 7, a->value_len - 7, digest);
    return 1;
}

long px_tkeys_find(const px_tkeys *k, const px_http_head *h, unsigned char digest[32]) {
    unsigned char d[32];
    if (!px_bearer_digest(h, d)) return -1;
    if (digest) memcpy(digest, d, 32);
    if (!k) return -1;
    /* No early exit and no branch on a match: the time does not tell which
     * entry (if any) matched. */
    long found = -1;
    for (size_t i = 0; i < k->n; i++) {
        long eq = CRYPTO_memcmp(d, k->v[i].digest, 32) == 0;
        long mask = -eq; /* all ones on a match */
        found = (found & ~mask) | ((long)i & mask);
    }
    return found;
}

const char *px_tkeys_tenant(const px_tkeys *k, long i) {
    return k && i >= 0 && (size_t)i < k->n ? k->v[i].tenant : "";
}

/* ---------- trusted gateways ---------- */

/* Parses "ADDR" or "ADDR/BITS" into family, 16 bytes and a prefix length. */
static int cidr_parse(const char *spec, int *fam, unsigned char a[16], int *bits) {
    char buf[64];
    size_t n = strlen(spec);
    if (!n || n >= sizeof buf) return -1;
    memcpy(buf, spec, n + 1);
    char *slash = strchr(buf, '/');
    if (slash) *slash = 0;
    memset(a, 0, 16);
    if (inet_pton(AF_INET, buf, a) == 1)
        *fam = AF_INET;
    else if (inet_pton(AF_INET6, buf, a) == 1)
        *fam = AF_INET6;
    else
        return -1;
    int max = *fam == AF_INET ? 32 : 128;
    *bits = max;
    if (slash) {
        char *end;
        long b = strtol(slash + 1, &end, 10);
        if (!slash[1] || *end || b < 0 || b > max) return -1;
        *bits = (int)b;
    }
    return 0;
}

int px_cidr_check(const char *spec, char *err, size_t errlen) {
    int fam, bits;
    unsigned char a[16];
    if (cidr_parse(spec, &fam, a, &bits) == 0) return 0;
    snprintf(err, errlen, "--tenant-header-from '%s': not an address or a CIDR (10.0.0.0/8, "
             "fd00::/8, 192.0.2.7)", spec);
    return -1;
}

int px_cidr_list_match(char *const *items, size_t nitems, const char *addr) {
    unsigned char h[16];
    int hfam;
    const char *mapped = !strncasecmp(addr, "::ffff:", 7) && strchr(addr + 7, '.') ? addr + 7
                                                                                   : NULL;
    if (inet_pton(AF_INET, mapped ? mapped : addr, h) == 1)
        hfam = AF_INET;
    else if (inet_pton(AF_INET6, addr, h) == 1)
        hfam = AF_INET6;
    else
        return 0;
    for (size_t i = 0; i < nitems; i++) {
        unsigned char a[16];
        int fam, bits;
        if (cidr_parse(items[i], &fam, a, &bits) < 0 || fam != hfam) continue;
        size_t full = (size_t)bits / 8;
        int rest = bits % 8;
        if (memcmp(a, h, full)) continue;
        if (rest && ((a[full] ^ h[full]) & (0xff << (8 - rest)) & 0xff)) continue;
        return 1;
    }
    return 0;
}

/* ---------- cache salts ---------- */

px_salt_mode px_salt_mode_of(const char *mode, int creds) {
    const char *name = mode ? mode : "auto";
    if (!strcmp(name, "key")) return PX_SALT_KEY;
    if (!strcmp(name, "off")) return PX_SALT_OFF;
    if (!strcmp(name, "tenant")) return PX_SALT_TENANT;
    return creds ? PX_SALT_TENANT : PX_SALT_OFF; /* auto */
}

void px_salt_derive(const char *tenant, const unsigned char *key, const char *own, size_t own_len,
                    char out[PX_SALT_LEN + 1]) {
    /* A domain tag (with its NUL), what the salt is of, then the client's
     * own salt: one buffer, one SHA-256. */
    static const char tag[] = "pdproxy cache_salt v1";
    size_t tl = key ? 32 : strlen(tenant) + 1;
    px_buf b;
    px_buf_init(&b);
    px_buf_append(&b, tag, sizeof tag);
    px_buf_append(&b, key ? "k" : "t", 2);
    px_buf_append(&b, key ? (const char *)key : tenant, tl);
    if (own_len) px_buf_append(&b, own, own_len);
    unsigned char d[32];
    SHA256((const unsigned char *)b.data, b.len, d);
    px_buf_cleanup(&b);
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < PX_SALT_LEN / 2; i++) {
        out[2 * i] = hex[d[i] >> 4];
        out[2 * i + 1] = hex[d[i] & 15];
    }
    out[PX_SALT_LEN] = 0;
}
