/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/tenant.h"

#include <arpa/inet.h>
#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/sha.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <pthread.h>
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

/* Reads the TENANT:VALUE lines of a --tenant-keys or --tenant-certs file
 * (blank lines and '#' comments skipped, spaces around both parts trimmed)
 * and hands each pair to add(). A line's text never goes into a message
 * (it may hold a key). 0, or -1 with err naming the flag, the file and the
 * line. */
typedef int (*pair_fn)(void *arg, const char *t, size_t tn, const char *v, size_t vn);
static int read_pairs(const char *flag, const char *what, const char *noun, const char *path,
                      pair_fn add, void *arg, char *err, size_t errlen) {
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, errlen, "%s '%s': %s", flag, path, strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t cap = 0, lineno = 0, pairs = 0;
    int rc = 0;
    while (rc == 0 && getline(&line, &cap, f) >= 0) {
        lineno++;
        const char *s = line;
        size_t n = strcspn(line, "\n");
        trim(&s, &n);
        if (!n || *s == '#') continue;
        const char *colon = memchr(s, ':', n);
        const char *t = s, *v = colon ? colon + 1 : NULL;
        size_t tn = colon ? (size_t)(colon - s) : 0, vn = colon ? n - tn - 1 : 0;
        if (colon) {
            trim(&t, &tn);
            trim(&v, &vn);
        }
        if (!colon || !tn || !vn || tn > 200 || memchr(t, '\0', tn) || memchr(v, '\0', vn)) {
            snprintf(err, errlen, "%s '%s' line %zu: expected TENANT:%s", flag, path, lineno,
                     what);
            rc = -1;
        } else if (add(arg, t, tn, v, vn) < 0) {
            snprintf(err, errlen, "%s '%s' line %zu: an earlier line gives this %s to another "
                     "tenant", flag, path, lineno, noun);
            rc = -1;
        }
        pairs++;
    }
    OPENSSL_cleanse(line, cap);
    free(line);
    fclose(f);
    if (rc == 0 && !pairs) {
        snprintf(err, errlen, "%s '%s': no TENANT:%s line in the file", flag, path, what);
        rc = -1;
    }
    return rc;
}

static int add_key(void *arg, const char *t, size_t tn, const char *key, size_t kn) {
    px_tkeys *k = arg;
    k->v = px_xrealloc(k->v, (k->n + 1) * sizeof *k->v);
    SHA256((const unsigned char *)key, kn, k->v[k->n].digest);
    k->v[k->n].tenant = px_xstrndup(t, tn);
    k->n++;
    for (size_t i = 0; i + 1 < k->n; i++)
        if (!memcmp(k->v[i].digest, k->v[k->n - 1].digest, 32) &&
            strcmp(k->v[i].tenant, k->v[k->n - 1].tenant))
            return -1;
    return 0;
}

int px_tkeys_load(const char *path, px_tkeys **out, char *err, size_t errlen) {
    *out = NULL;
    if (!path || !*path) return 0;
    px_tkeys *k = px_xcalloc(1, sizeof *k);
    if (read_pairs("--tenant-keys", "KEY", "key", path, add_key, k, err, errlen) < 0) {
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

int px_digest_in(const unsigned char d[32], const unsigned char (*keys)[32], size_t n) {
    int ok = 0;
    for (size_t i = 0; i < n; i++) /* every entry: the time tells nothing */
        ok |= CRYPTO_memcmp(d, keys[i], 32) == 0;
    return ok;
}

long px_tkeys_find(const px_tkeys *k, const px_http_head *h, unsigned char digest[32]) {
    unsigned char d[32];
    if (!px_bearer_digest(h, d)) return -1;
    if (digest) memcpy(digest, d, 32);
    return px_tkeys_find_digest(k, d);
}

long px_tkeys_find_digest(const px_tkeys *k, const unsigned char d[32]) {
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

/* ---------- tenant certificates ---------- */

typedef struct tcert {
    char *name;   /* owned: a CN or subjectAltName */
    char *tenant; /* owned */
} tcert;

struct px_tcerts {
    tcert *v; /* owned */
    size_t n;
};

static int add_cert(void *arg, const char *t, size_t tn, const char *name, size_t nn) {
    px_tcerts *c = arg;
    for (size_t i = 0; i < c->n; i++)
        if (strlen(c->v[i].name) == nn && !memcmp(c->v[i].name, name, nn))
            return strlen(c->v[i].tenant) == tn && !memcmp(c->v[i].tenant, t, tn) ? 0 : -1;
    c->v = px_xrealloc(c->v, (c->n + 1) * sizeof *c->v);
    c->v[c->n].name = px_xstrndup(name, nn);
    c->v[c->n].tenant = px_xstrndup(t, tn);
    c->n++;
    return 0;
}

int px_tcerts_load(const char *path, px_tcerts **out, char *err, size_t errlen) {
    *out = NULL;
    if (!path || !*path) return 0;
    px_tcerts *c = px_xcalloc(1, sizeof *c);
    if (read_pairs("--tenant-certs", "NAME", "name", path, add_cert, c, err, errlen) < 0) {
        px_tcerts_destroy(c);
        return -1;
    }
    *out = c;
    return 0;
}

void px_tcerts_destroy(px_tcerts *c) {
    if (!c) return;
    for (size_t i = 0; i < c->n; i++) {
        free(c->v[i].name);
        free(c->v[i].tenant);
    }
    free(c->v);
    free(c);
}

size_t px_tcerts_count(const px_tcerts *c) {
    return c ? c->n : 0;
}

/* The entry whose name is the n bytes at s (no embedded NUL: a name that
 * has one is no name at all, the old CN-spoofing trick), -1 when none. */
static long cert_entry(const px_tcerts *c, const unsigned char *s, int n) {
    if (n <= 0 || memchr(s, 0, (size_t)n)) return -1;
    for (size_t i = 0; i < c->n; i++)
        if (strlen(c->v[i].name) == (size_t)n && !memcmp(c->v[i].name, s, (size_t)n))
            return (long)i;
    return -1;
}

long px_tcerts_find(const px_tcerts *c, const struct x509_st *cert) {
    if (!c || !cert) return -1;
    long best = -1;
    /* The subjectAltNames first (DNS, URI, email), then the subject's CNs;
     * of several matches the earliest line of the file wins. */
    GENERAL_NAMES *sans = X509_get_ext_d2i(cert, NID_subject_alt_name, NULL, NULL);
    for (int i = 0; i < sk_GENERAL_NAME_num(sans); i++) {
        const GENERAL_NAME *g = sk_GENERAL_NAME_value(sans, i);
        const ASN1_IA5STRING *v = g->type == GEN_DNS     ? g->d.dNSName
                                  : g->type == GEN_URI   ? g->d.uniformResourceIdentifier
                                  : g->type == GEN_EMAIL ? g->d.rfc822Name
                                                         : NULL;
        long e = v ? cert_entry(c, ASN1_STRING_get0_data(v), ASN1_STRING_length(v)) : -1;
        if (e >= 0 && (best < 0 || e < best)) best = e;
    }
    GENERAL_NAMES_free(sans);
    const X509_NAME *subj = X509_get_subject_name(cert);
    for (int i = -1; (i = X509_NAME_get_index_by_NID(subj, NID_commonName, i)) >= 0;) {
        const ASN1_STRING *v = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subj, i));
        long e = cert_entry(c, ASN1_STRING_get0_data(v), ASN1_STRING_length(v));
        if (e >= 0 && (best < 0 || e < best)) best = e;
    }
    return best;
}

const char *px_tcerts_tenant(const px_tcerts *c, long i) {
    return c && i >= 0 && (size_t)i < c->n ? c->v[i].tenant : "";
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

int px_cidrs_parse(char *const *items, size_t n, px_cidr **out, char *err, size_t errlen) {
    *out = NULL;
    if (!n) return 0;
    px_cidr *v = px_xcalloc(n, sizeof *v);
    for (size_t i = 0; i < n; i++) {
        if (cidr_parse(items[i], &v[i].fam, v[i].a, &v[i].bits) < 0) {
            free(v);
            return px_cidr_check(items[i], err, errlen);
        }
    }
    *out = v;
    return 0;
}

int px_cidr_match(const px_cidr *nets, size_t nitems, const char *addr) {
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
        const px_cidr *c = &nets[i];
        if (c->fam != hfam) continue;
        size_t full = (size_t)c->bits / 8;
        int rest = c->bits % 8;
        if (memcmp(c->a, h, full)) continue;
        if (rest && ((c->a[full] ^ h[full]) & (0xff << (8 - rest)) & 0xff)) continue;
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

/* SHA-256, fetched from OpenSSL's providers once: SHA256() fetches it on
 * every call (OpenSSL 3), a third of a salted request's digest. Kept for
 * the process's life. */
static EVP_MD *sha256_md;
static pthread_once_t sha256_once = PTHREAD_ONCE_INIT;

static void sha256_fetch(void) {
    sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
}

static void sha256(const unsigned char *b, size_t n, unsigned char d[32]) {
    pthread_once(&sha256_once, sha256_fetch);
    if (!sha256_md || !EVP_Digest(b, n, d, NULL, sha256_md, NULL)) SHA256(b, n, d);
}

void px_salt_derive(const char *tenant, const unsigned char *key, const char *own, size_t own_len,
                    char out[PX_SALT_LEN + 1]) {
    /* A domain tag (with its NUL), what the salt is of, then the client's
     * own salt: one buffer (on the stack unless the client's salt is
     * long), one SHA-256. */
    static const char tag[] = "pdproxy cache_salt v1";
    size_t tl = key ? 32 : strlen(tenant) + 1;
    size_t n = sizeof tag + 2 + tl + own_len;
    unsigned char stack[1024], *b = n <= sizeof stack ? stack : px_xmalloc(n), *p = b;
    memcpy(p, tag, sizeof tag);
    p += sizeof tag;
    memcpy(p, key ? "k" : "t", 2);
    p += 2;
    memcpy(p, key ? (const void *)key : (const void *)tenant, tl);
    p += tl;
    if (own_len) memcpy(p, own, own_len);
    unsigned char d[32];
    sha256(b, n, d);
    if (b != stack) free(b);
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < PX_SALT_LEN / 2; i++) {
        out[2 * i] = hex[d[i] >> 4];
        out[2 * i + 1] = hex[d[i] & 15];
    }
    out[PX_SALT_LEN] = 0;
}
