/* SPDX-License-Identifier: Apache-2.0 */
/* Who a request is (issue 41): the pieces that decide a request's tenant
 * from its credentials, and the cache_salt that keeps tenants' prefix
 * caches apart. Pure and leaf-level (no loop, no context): admission.c
 * puts them together for each request.
 *
 * - Tenant keys (--tenant-keys FILE): lines "TENANT:KEY". A request whose
 *   Authorization is "Bearer KEY" is that tenant's, whatever else it says.
 *   Keys are kept as SHA-256 digests only and compared in constant time
 *   (every entry, no early exit); a key is never logged.
 * - Tenant certificates (--tenant-certs FILE): lines "TENANT:NAME". A
 *   request over a TLS connection whose client certificate the handshake
 *   verified (--tls-client-ca) and which has NAME as a subjectAltName (DNS,
 *   URI, email) or as its subject's CN is that tenant's; a tenant key
 *   still decides first.
 * - Trusted gateways (--tenant-header-from CIDRS): the tenant header is
 *   believed from these peers only, and refused from any other.
 * - Salts (--cache-salt auto|tenant|key|off): vLLM keys a prompt's first KV
 *   block by the request's cache_salt (vllm/v1/core/kv_cache_utils.py,
 *   generate_block_hash_extra_keys, read at vllm-project/vllm@001cabc1), so
 *   two requests share cached blocks only with the same salt. The proxy
 *   derives the salt from the tenant (or the key) and the client's own
 *   salt: a client may split its tenant's cache further, never join
 *   another tenant's. */
#ifndef PX_TENANT_H
#define PX_TENANT_H

#include <stddef.h>
#include <stdint.h>

#include "base/http.h"

/* ---------- tenant keys ---------- */

typedef struct px_tkeys px_tkeys;

/* Reads "TENANT:KEY" lines (blank lines and lines starting with '#'
 * skipped; spaces around both parts trimmed; TENANT as --tenant names it,
 * without ':'). 0 with *out set (NULL for an empty path), or -1 with err
 * naming the file and line (never the key). */
int px_tkeys_load(const char *path, px_tkeys **out, char *err, size_t errlen);
void px_tkeys_destroy(px_tkeys *k); /* NULL: no-op */
size_t px_tkeys_count(const px_tkeys *k);
/* The entry whose key is the request's bearer token, -1 when none (or k is
 * NULL). Every entry is compared, in constant time, on SHA-256 digests.
 * `digest` (may be NULL) receives the token's digest when there is one. */
long px_tkeys_find(const px_tkeys *k, const px_http_head *h, unsigned char digest[32]);
/* The same for a token's digest (px_bearer_digest) already taken. */
long px_tkeys_find_digest(const px_tkeys *k, const unsigned char digest[32]);
/* The tenant entry i names (borrowed). */
const char *px_tkeys_tenant(const px_tkeys *k, long i);
/* The SHA-256 of the request's bearer token: 1, or 0 when it has none. */
int px_bearer_digest(const px_http_head *h, unsigned char digest[32]);
/* Whether digest d is one of keys[0..n), compared in constant time against
 * every entry. */
int px_digest_in(const unsigned char d[32], const unsigned char (*keys)[32], size_t n);

/* ---------- tenant certificates ---------- */

typedef struct px_tcerts px_tcerts;
struct x509_st;

/* Reads "TENANT:NAME" lines (as px_tkeys_load; a NAME may name one tenant
 * only). 0 with *out set (NULL for an empty path), or -1 with err. */
int px_tcerts_load(const char *path, px_tcerts **out, char *err, size_t errlen);
void px_tcerts_destroy(px_tcerts *c); /* NULL: no-op */
size_t px_tcerts_count(const px_tcerts *c);
/* The entry naming one of the certificate's names (subjectAltName DNS, URI
 * or email, or a subject CN; compared byte for byte, a name holding a NUL
 * never matches): the earliest in the file when several do; -1 when none
 * (or c or cert is NULL). */
long px_tcerts_find(const px_tcerts *c, const struct x509_st *cert);
/* The tenant entry i names (borrowed). */
const char *px_tcerts_tenant(const px_tcerts *c, long i);

/* ---------- trusted gateways ---------- */

/* One --tenant-header-from item: an IPv4 or IPv6 address, or a CIDR.
 * 0, or -1 with err. */
int px_cidr_check(const char *spec, char *err, size_t errlen);
/* A parsed item: family, address and prefix length. */
typedef struct px_cidr {
    int fam, bits;
    unsigned char a[16];
} px_cidr;
/* The n items (each as px_cidr_check takes it) parsed into *out (owned;
 * NULL when n is 0), once per configuration rather than per request: 0, or
 * -1 with err at the first bad item. */
int px_cidrs_parse(char *const *items, size_t n, px_cidr **out, char *err, size_t errlen);
/* Whether the address text `addr` (as px_conn_peer writes it; an
 * IPv4-mapped IPv6 address counts as its IPv4 one) is in one of the n
 * parsed items. */
int px_cidr_match(const px_cidr *nets, size_t n, const char *addr);

/* ---------- cache salts ---------- */

typedef enum { PX_SALT_TENANT = 0, PX_SALT_KEY, PX_SALT_OFF } px_salt_mode;
/* The mode --cache-salt's text `mode` gives; auto: tenant when tenants come
 * from credentials (`creds`: --tenant-keys or --tenant-header-from given),
 * else off. */
px_salt_mode px_salt_mode_of(const char *mode, int creds);

#define PX_SALT_LEN 32 /* hex digits */

/* The salt of a request: from its tenant's name (`tenant`, "" for the
 * default tenant) or, with `key` (a key digest, PX_SALT_KEY), from the key,
 * and the client's own cache_salt value bytes (`own`, may be empty): hex of
 * SHA-256 over a domain tag and those, cut to PX_SALT_LEN. Equal inputs give
 * equal salts in every proxy replica and across restarts. */
void px_salt_derive(const char *tenant, const unsigned char *key, const char *own, size_t own_len,
                    char out[PX_SALT_LEN + 1]);

#endif
