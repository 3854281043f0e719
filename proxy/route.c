/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/route.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/hash.h"
#include "base/log.h"
#include "base/util.h"
#include "proxy/pindex.h" /* prefix_affinity's block chains */
#include "proxy/kvindex.h"

#define RING_POINTS 64 /* virtual nodes per backend */

static const char *const policy_names[] = {"round_robin",          "least_inflight", "power_of_two",
                                           "prefix_affinity",      "load_aware",     "kv_aware",
                                           "prefix_affinity_bytes", "latency"};
static const char *const outcome_names[] = {
    "ok", "client_error", "server_error", "connect_error", "reset", "timeout", "cancelled"};

int px_policy_parse(const char *s) {
    for (int i = 0; i < (int)(sizeof policy_names / sizeof *policy_names); i++)
        if (!strcmp(s, policy_names[i])) return i;
    return -1;
}

const char *px_policy_name(px_policy p) {
    return policy_names[p];
}

const char *px_outcome_name(px_outcome o) {
    return outcome_names[o];
}

void px_backend_release(px_backend *b) {
    if (!b || atomic_fetch_sub(&b->refs, 1) != 1) return;
    free(b->name);
    free(b->url);
    free(b->src);
    free(b->authority);
    free(b);
}

/* An address for host:port: a literal as is; a name (the toy flags' hosts,
 * "localhost" most often) through the system resolver once, IPv4 first as
 * engines usually listen there. 0 on success. */
static int resolve_addr(const char *host, int port, struct sockaddr_storage *out, socklen_t *len) {
    memset(out, 0, sizeof *out);
    struct sockaddr_in *a4 = (struct sockaddr_in *)out;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)out;
    if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
        a4->sin_family = AF_INET;
        a4->sin_port = htons((uint16_t)port);
        *len = sizeof *a4;
        return 0;
    }
    if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons((uint16_t)port);
        *len = sizeof *a6;
        return 0;
    }
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, NULL, &hints, &res) != 0) return -1;
    struct addrinfo *pick = NULL;
    for (struct addrinfo *ai = res; ai && !pick; ai = ai->ai_next)
        if (ai->ai_family == AF_INET) pick = ai;
    if (!pick) pick = res;
    memcpy(out, pick->ai_addr, pick->ai_addrlen);
    *len = pick->ai_addrlen;
    if (pick->ai_family == AF_INET)
        a4->sin_port = htons((uint16_t)port);
    else
        a6->sin6_port = htons((uint16_t)port);
    freeaddrinfo(res);
    return 0;
}

void px_pool_init(px_pool *p, const char *role, const px_pool_cfg *cfg) {
    memset(p, 0, sizeof *p);
    p->role = role;
    p->cfg = *cfg;
    pthread_mutex_init(&p->mu, NULL);
}

void px_pool_cleanup(px_pool *p) {
    for (size_t i = 0; i < p->n; i++)
        px_backend_release(p->b[i]);
    free(p->b);
    free(p->ring);
    px_pindex_destroy(p->chains);
    pthread_mutex_destroy(&p->mu);
    memset(p, 0, sizeof *p);
}

int px_url_split(const char *url, char *host, size_t hostcap, int *port, int *https) {
    const char *h;
    if (!strncmp(url, "http://", 7)) {
        h = url + 7;
        *https = 0;
    } else if (!strncmp(url, "https://", 8)) {
        h = url + 8;
        *https = 1;
    } else {
        return -1;
    }
    *port = *https ? 443 : 80;
    const char *end = h + strcspn(h, "/");
    const char *hs = h, *he, *colon = NULL;
    if (*h == '[') {
        const char *rb = memchr(h, ']', (size_t)(end - h));
        if (!rb) return -1;
        hs = h + 1;
        he = rb;
        if (rb + 1 < end) {
            if (rb[1] != ':') return -1;
            colon = rb + 1;
        }
    } else {
        colon = memchr(h, ':', (size_t)(end - h));
        he = colon ? colon : end;
    }
    if (he <= hs || (size_t)(he - hs) >= hostcap) return -1;
    memcpy(host, hs, (size_t)(he - hs));
    host[he - hs] = '\0';
    if (colon) {
        char *e;
        long p = strtol(colon + 1, &e, 10);
        if (e != end || p < 1 || p > 65535) return -1;
        *port = (int)p;
    }
    return 0;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* One virtual node of member i, whose name hashes to `key`. The ring
 * depends only on the members' names, so every replica builds the same. */
static uint64_t ring_point(uint64_t key, uint64_t v, size_t i) {
    return (px_mix64(key + v * 0x9e3779b97f4a7c15ull) & ~0xffffull) | i;
}

/* Sorts n keys ascending: a least-significant-digit radix sort, 8 bits a
 * pass, skipping the passes where every key has the same digit (the high
 * bits of the member index). A ring of 5,000 members has 320,000 points;
 * qsort's comparisons took two thirds of a reload at 10,000 backends. */
static void sort_u64(uint64_t *a, size_t n) {
    if (n < 2) return;
    size_t(*count)[256] = px_xcalloc(8, sizeof *count);
    for (size_t i = 0; i < n; i++)
        for (int d = 0; d < 8; d++)
            count[d][(a[i] >> (8 * d)) & 0xff]++;
    uint64_t *tmp = px_xmalloc(n * sizeof *tmp), *src = a, *dst = tmp;
    for (int d = 0; d < 8; d++) {
        size_t *c = count[d];
        if (c[(src[0] >> (8 * d)) & 0xff] == n) continue; /* one digit: the order stands */
        size_t at = 0;
        for (int v = 0; v < 256; v++) {
            size_t k = c[v];
            c[v] = at;
            at += k;
        }
        for (size_t i = 0; i < n; i++)
            dst[c[(src[i] >> (8 * d)) & 0xff]++] = src[i];
        uint64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) memcpy(a, src, n * sizeof *a);
    free(tmp);
    free(count);
}

/* A sorted ring of n members with these name hashes; NULL when n is 0.
 * Needs no lock: it reads only `keys`. */
static uint64_t *ring_build(const uint64_t *keys, size_t n, size_t *nring) {
    *nring = 0;
    if (!n) return NULL;
    uint64_t *r = px_xmalloc(n * RING_POINTS * sizeof *r);
    for (size_t i = 0; i < n && i < 0xffff; i++)
        for (uint64_t v = 0; v < RING_POINTS; v++)
            r[(*nring)++] = ring_point(keys[i], v, i);
    sort_u64(r, *nring);
    return r;
}

/* Under p->mu. */
static void rebuild_ring(px_pool *p) {
    uint64_t *keys = px_xmalloc((p->n ? p->n : 1) * sizeof *keys);
    for (size_t i = 0; i < p->n; i++)
        keys[i] = p->b[i]->key_hash;
    free(p->ring);
    p->ring = ring_build(keys, p->n, &p->nring);
    free(keys);
}

/* Under p->mu, after member i was appended: its virtual nodes merged into
 * the sorted ring, O(ring) instead of a sort. */
static void ring_insert(px_pool *p, size_t i) {
    if (i >= 0xffff) return; /* beyond what an entry can name: as rebuild_ring */
    uint64_t add[RING_POINTS];
    for (uint64_t v = 0; v < RING_POINTS; v++)
        add[v] = ring_point(p->b[i]->key_hash, v, i);
    qsort(add, RING_POINTS, sizeof *add, cmp_u64);
    uint64_t *r = px_xmalloc((p->nring + RING_POINTS) * sizeof *r);
    size_t a = 0, k = 0, o = 0;
    while (a < p->nring || k < RING_POINTS)
        r[o++] =
            k == RING_POINTS || (a < p->nring && p->ring[a] < add[k]) ? p->ring[a++] : add[k++];
    free(p->ring);
    p->ring = r;
    p->nring = o;
}

/* Under p->mu, after member i was taken out and those behind it moved up
 * one place: its nodes dropped and the later members' renumbered in one
 * pass (renumbering keeps the order: the index is below the point bits). */
static void ring_remove(px_pool *p, size_t i) {
    if (p->n + 1 > 0xffff) { /* members moved into the range an entry names */
        rebuild_ring(p);
        return;
    }
    size_t o = 0;
    for (size_t a = 0; a < p->nring; a++) {
        uint64_t e = p->ring[a];
        size_t at = (size_t)(e & 0xffff);
        if (at == i) continue;
        p->ring[o++] = at > i ? e - 1 : e;
    }
    p->nring = o;
}

static px_backend *backend_new(const char *url, const char *name, const char *src) {
    px_backend *b = px_xcalloc(1, sizeof *b);
    b->url = px_xstrdup(url);
    b->name = px_xstrdup(name);
    b->src = px_xstrdup(src);
    b->key_hash = px_hash64(name, strlen(name));
    atomic_init(&b->refs, 1);
    atomic_init(&b->healthy, 1);
    return b;
}

/* Under p->mu. */
static void add_member(px_pool *p, px_backend *b) {
    if (p->n == p->cap) {
        p->cap = p->cap ? p->cap * 2 : 8;
        p->b = px_xrealloc(p->b, p->cap * sizeof *p->b);
    }
    p->b[p->n++] = b;
    p->members_ver++;
}

static px_backend *backend_make(const char *role, const char *url, const char *connect_ip) {
    char host[256];
    int port, https;
    if (px_url_split(url, host, sizeof host, &port, &https) < 0) return NULL;
    const char *hp = strstr(url, "://") + 3;
    size_t hl = strcspn(hp, "/");
    px_buf name, u;
    px_buf_init(&name);
    px_buf_init(&u);
    px_buf_append(&u, url, (size_t)(hp - url) + hl); /* without a trailing slash */
    if (connect_ip) {
        /* The address is the backend's identity; the URL keeps the host name
         * for Host, SNI and certificate checks (upstream.c pins https
         * transfers to the address the name stands for). */
        int v6 = strchr(connect_ip, ':') != NULL;
        px_buf_printf(&name, "%s%s%s:%d", v6 ? "[" : "", connect_ip, v6 ? "]" : "", port);
    } else {
        px_buf_append(&name, hp, hl);
    }
    px_backend *b = backend_new(u.data, name.data, url);
    b->authority = px_xstrndup(hp, hl);
    b->https = https;
    if (!https && resolve_addr(connect_ip ? connect_ip : host, port, &b->addr, &b->addrlen) < 0) {
        b->addrlen = 0;
        PX_LOG(PX_LOG_WARN,
               "msg=\"cannot resolve backend host; requests to it fail until restarted (use "
               "--prefill/--decode URLs for names that DNS should follow)\" role=%s backend=%s",
               role, name.data);
    }
    px_buf_cleanup(&u);
    px_buf_cleanup(&name);
    return b;
}

px_backend *px_backend_create(const char *url) {
    return backend_make("prefill", url, NULL);
}

px_backend *px_pool_add(px_pool *p, const char *url, const char *connect_ip) {
    px_backend *b = backend_make(p->role, url, connect_ip);
    if (!b) return NULL;
    pthread_mutex_lock(&p->mu);
    add_member(p, b);
    pthread_mutex_unlock(&p->mu);
    return b;
}

/* Both prefix policies fall back to the consistent-hash ring. */
static int uses_ring(const px_pool *p) {
    return p->cfg.policy == PX_POLICY_PREFIX_AFFINITY ||
           p->cfg.policy == PX_POLICY_PREFIX_AFFINITY_BYTES;
}

void px_pool_seal(px_pool *p) {
    if (!uses_ring(p)) return;
    /* The sort runs off the lock, so that picks go on meanwhile; the new
     * ring replaces the old one only if the members did not change since
     * (they change on the control thread, as this runs: a retry is rare). */
    for (int tries = 0; tries < 3; tries++) {
        pthread_mutex_lock(&p->mu);
        size_t n = p->n;
        unsigned long ver = p->members_ver;
        uint64_t *keys = px_xmalloc((n ? n : 1) * sizeof *keys);
        for (size_t i = 0; i < n; i++)
            keys[i] = p->b[i]->key_hash;
        pthread_mutex_unlock(&p->mu);
        size_t nring;
        uint64_t *ring = ring_build(keys, n, &nring);
        free(keys);
        pthread_mutex_lock(&p->mu);
        int same = p->members_ver == ver;
        if (same) {
            uint64_t *old = p->ring;
            p->ring = ring;
            p->nring = nring;
            ring = old;
        }
        pthread_mutex_unlock(&p->mu);
        free(ring); /* the replaced one, or the stale one just built */
        if (same) return;
    }
    pthread_mutex_lock(&p->mu);
    rebuild_ring(p);
    pthread_mutex_unlock(&p->mu);
}

px_backend *px_pool_insert(px_pool *p, const char *url) {
    px_backend *b = backend_make(p->role, url, NULL); /* may resolve: off the lock */
    if (!b) return NULL;
    pthread_mutex_lock(&p->mu);
    add_member(p, b);
    if (uses_ring(p)) ring_insert(p, p->n - 1);
    pthread_mutex_unlock(&p->mu);
    return b;
}

size_t px_pool_remove_src(px_pool *p, const char *src) {
    px_backend *gone[16];
    size_t k = 0;
    pthread_mutex_lock(&p->mu);
    for (size_t i = p->n; i-- > 0 && k < sizeof gone / sizeof *gone;) {
        if (strcmp(p->b[i]->src, src)) continue;
        gone[k++] = p->b[i];
        memmove(&p->b[i], &p->b[i + 1], (p->n - i - 1) * sizeof *p->b);
        p->n--;
        p->members_ver++;
        if (uses_ring(p)) ring_remove(p, i);
    }
    pthread_mutex_unlock(&p->mu);
    for (size_t i = 0; i < k; i++) /* a request may hold it still: it finishes there */
        px_backend_release(gone[i]);
    return k;
}

size_t px_pool_set_drained_src(px_pool *p, const char *src, int on) {
    size_t k = 0;
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < p->n; i++)
        if (!strcmp(p->b[i]->src, src)) {
            atomic_store(&p->b[i]->drained, on);
            k++;
        }
    pthread_mutex_unlock(&p->mu);
    return k;
}

struct px_adopt_index {
    px_backend **m;      /* references, sorted by src */
    unsigned char *took; /* took[i]: m[i]'s reference went to a pool */
    size_t n;
};

static int cmp_src(const void *a, const void *b) {
    return strcmp((*(px_backend *const *)a)->src, (*(px_backend *const *)b)->src);
}

px_adopt_index *px_adopt_index_create(px_pool *from) {
    px_adopt_index *x = px_xcalloc(1, sizeof *x);
    if (from) x->m = px_pool_members(from, &x->n);
    x->took = px_xcalloc(x->n ? x->n : 1, 1);
    if (x->n) qsort(x->m, x->n, sizeof *x->m, cmp_src);
    return x;
}

size_t px_pool_adopt_indexed(px_pool *p, px_adopt_index *x, const char *src) {
    size_t lo = 0, hi = x->n;
    while (lo < hi) { /* the first member whose src is not below `src` */
        size_t mid = lo + (hi - lo) / 2;
        if (strcmp(x->m[mid]->src, src) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    size_t k = 0;
    pthread_mutex_lock(&p->mu);
    for (size_t i = lo; i < x->n && !strcmp(x->m[i]->src, src); i++)
        if (!x->took[i]) {
            add_member(p, x->m[i]); /* the index's reference becomes the pool's */
            x->took[i] = 1;
            k++;
        }
    pthread_mutex_unlock(&p->mu);
    return k;
}

void px_adopt_index_destroy(px_adopt_index *x) {
    if (!x) return;
    for (size_t i = 0; i < x->n; i++)
        if (!x->took[i]) px_backend_release(x->m[i]);
    free(x->m);
    free(x->took);
    free(x);
}

size_t px_pool_sync_addrs(px_pool *p, const char *url, const char *host, int port, char **ips,
                          size_t nips) {
    size_t changed = 0;
    /* Names of the backends the addresses stand for. */
    char **names = px_xcalloc(nips ? nips : 1, sizeof *names);
    for (size_t i = 0; i < nips; i++) {
        px_buf b;
        px_buf_init(&b);
        int v6 = strchr(ips[i], ':') != NULL;
        px_buf_printf(&b, "%s%s%s:%d", v6 ? "[" : "", ips[i], v6 ? "]" : "", port);
        names[i] = b.data;
    }
    pthread_mutex_lock(&p->mu);
    /* Drop members of this URL whose address went away. */
    for (size_t i = 0; i < p->n;) {
        px_backend *b = p->b[i];
        int keep = strcmp(b->src, url) != 0;
        for (size_t j = 0; !keep && j < nips; j++)
            keep = !strcmp(b->name, names[j]);
        if (keep) {
            i++;
            continue;
        }
        PX_LOG(PX_LOG_INFO, "msg=\"backend removed: gone from DNS\" role=%s backend=%s name=%s",
               p->role, b->name, host);
        memmove(&p->b[i], &p->b[i + 1], (p->n - i - 1) * sizeof *p->b);
        p->n--;
        p->members_ver++;
        px_backend_release(b);
        changed++;
    }
    pthread_mutex_unlock(&p->mu);
    for (size_t j = 0; j < nips; j++) {
        int have = 0;
        pthread_mutex_lock(&p->mu);
        for (size_t i = 0; i < p->n && !have; i++)
            have = !strcmp(p->b[i]->name, names[j]);
        pthread_mutex_unlock(&p->mu);
        if (!have) {
            px_pool_add(p, url, ips[j]);
            PX_LOG(PX_LOG_INFO, "msg=\"backend added from DNS\" role=%s backend=%s name=%s",
                   p->role, names[j], host);
            changed++;
        }
    }
    if (changed) px_pool_seal(p);
    for (size_t i = 0; i < nips; i++)
        free(names[i]);
    free(names);
    return changed;
}

/* Under p->mu: may b take a request now? */
static int eligible(px_pool *p, px_backend *b, uint64_t now) {
    if (atomic_load(&b->drained)) return 0;
    if (atomic_load(&b->healthy)) return 1;
    if (p->cfg.active_checks) return 0;
    /* No active checks: after its backoff an ejected backend gets one try. */
    if (now >= atomic_load(&b->readmit_ns)) {
        atomic_store(&b->fails, p->cfg.unhealthy_after - 1);
        atomic_store(&b->healthy, 1);
        PX_LOG(PX_LOG_INFO, "msg=\"backend on probation after backoff\" role=%s backend=%s",
               p->role, b->name);
        return 1;
    }
    return 0;
}

static int excluded(const px_pick *k, px_backend *b) {
    for (size_t i = 0; k && i < k->nexclude; i++)
        if (k->exclude[i] == b) return 1;
    return 0;
}

static double load_score(px_backend *b) {
    double s = atomic_load(&b->inflight);
    if (atomic_load(&b->load_known))
        s += 4.0 * atomic_load(&b->waiting) + atomic_load(&b->running) +
             2.0 * atomic_load(&b->kv_usage_milli) / 1000.0;
    return s;
}

/* Under p->mu; cand[] holds eligible member indexes, in member order. */
double px_kv_score(const px_pool_cfg *c, size_t cached, long load_tokens) {
    return c->kv_cache_weight * (double)cached - c->kv_load_weight * (double)load_tokens;
}

void px_backend_charge(px_backend *b, long tokens) {
    if (b && tokens) atomic_fetch_add(&b->tokens, tokens);
}

size_t px_kv_reusable(size_t blocks, size_t bs, size_t ntok) {
    size_t most = ntok && bs ? (ntok - 1) / bs : 0;
    return (blocks < most ? blocks : most) * bs;
}

/* kv_aware: the candidate with the best score (px_kv_score over the
 * tokens each engine would reuse and the uncached tokens queued on it).
 * Ties go to the highest px_mix64(tie ^ backend key), where `tie` is the
 * key of the prompt's first block (else a hash of its routing key): a
 * rendezvous hash, so replicas that see the same caches and loads agree,
 * prompts opening alike (one system prompt) meet on one idle engine and
 * others spread. The prompt's block keys are hashed once, lazily, as far as
 * lookups need them (px_kv_prompt). *cached_out: the winner's reusable
 * tokens. */
static size_t choose_kv(px_pool *p, const px_pick *k, const size_t *cand, size_t nc,
                        size_t *cached_out) {
    uint64_t tie = k && k->key ? px_hash64(k->key, k->key_len) : 0;
    int use_kv = k && k->tok && k->kv;
    px_kv_prompt pr;
    px_kv_prompt_init(&pr, use_kv ? k->tok : NULL, use_kv ? k->ntok : 0, use_kv ? k->kv_extra : 0);
    pr.salt = use_kv ? k->kv_salt : 0;
    int exact = 0;
    if (use_kv) {
        /* The first block's key at the first block size an engine announced:
         * the tie key, whatever the candidates' order. */
        for (size_t j = 0; j < nc && !exact; j++) {
            int slot = px_kvindex_slot(k->kv, p->b[cand[j]]->name, 0);
            if (!px_kvindex_block_size(k->kv, slot)) continue;
            px_kvindex_match_prompt(k->kv, slot, &pr);
            exact = 1;
            if (pr.n) tie = pr.keys[0];
        }
    }
    size_t best = cand[0], best_cached = 0, most = 0;
    double bs = -1e300;
    uint64_t bt = 0;
    for (size_t j = 0; j < nc; j++) {
        px_backend *b = p->b[cand[j]];
        size_t cached = 0;
        if (exact) {
            size_t m = px_kvindex_match_prompt(k->kv, px_kvindex_slot(k->kv, b->name, 0), &pr);
            cached = px_kv_reusable(m, pr.bs, k->ntok);
        }
        double s = px_kv_score(&p->cfg, cached, atomic_load(&b->tokens));
        uint64_t t = px_mix64(tie ^ b->key_hash);
        if (cached > most) most = cached;
        if (s > bs || (s == bs && t > bt)) {
            bs = s;
            bt = t;
            best = cand[j];
            best_cached = cached;
        }
    }
    px_kv_prompt_cleanup(&pr);
    /* Why it chose as it did, to compare with an oracle that knows every
     * cache: the winner's reusable tokens and load against the most any
     * candidate would reuse. */
    PX_LOG(PX_LOG_DEBUG,
           "msg=\"kv_aware pick\" role=%s backend=%s tokens=%zu exact=%d cached=%zu "
           "most_cached=%zu load_tokens=%ld candidates=%zu",
           p->role, p->b[best]->name, k ? k->ntok : 0, exact, best_cached, most,
           (long)atomic_load(&p->b[best]->tokens), nc);
    *cached_out = best_cached;
    return best;
}

/* ---------- sessions ---------- */

#define SESSION_STRIPES 64

typedef struct sess {
    uint64_t key, backend;
    uint64_t used_ns;
} sess;

struct px_sessions {
    pthread_mutex_t mu[SESSION_STRIPES];
    sess *e; /* owned; direct-mapped: a new session may take an old one's cell */
    size_t n;
    uint64_t ttl_ns;
};

px_sessions *px_sessions_create(size_t entries, double ttl) {
    px_sessions *s = px_xcalloc(1, sizeof *s);
    s->n = entries ? entries : 1;
    s->e = px_xcalloc(s->n, sizeof *s->e);
    s->ttl_ns = (uint64_t)(ttl * 1e9);
    for (int i = 0; i < SESSION_STRIPES; i++)
        pthread_mutex_init(&s->mu[i], NULL);
    return s;
}

void px_sessions_destroy(px_sessions *s) {
    if (!s) return;
    for (int i = 0; i < SESSION_STRIPES; i++)
        pthread_mutex_destroy(&s->mu[i]);
    free(s->e);
    free(s);
}

int px_sessions_get(px_sessions *s, uint64_t key, uint64_t *backend) {
    size_t i = (size_t)(px_mix64(key) % s->n);
    uint64_t now = px_now_ns();
    pthread_mutex_t *mu = &s->mu[i % SESSION_STRIPES];
    pthread_mutex_lock(mu);
    int ok = s->e[i].key == key && key && now - s->e[i].used_ns <= s->ttl_ns;
    if (ok) *backend = s->e[i].backend;
    pthread_mutex_unlock(mu);
    return ok;
}

void px_sessions_put(px_sessions *s, uint64_t key, uint64_t backend) {
    size_t i = (size_t)(px_mix64(key) % s->n);
    pthread_mutex_t *mu = &s->mu[i % SESSION_STRIPES];
    pthread_mutex_lock(mu);
    s->e[i] = (sess){key, backend, px_now_ns()};
    pthread_mutex_unlock(mu);
}

/* The session's backend among the candidates, when it is not overloaded;
 * (size_t)-1 otherwise. */
static size_t session_member(px_pool *p, const px_pick *k, const size_t *cand, size_t nc) {
    uint64_t bk;
    if (!k || !k->sessions || !k->session || !px_sessions_get(k->sessions, k->session, &bk))
        return (size_t)-1;
    long total = 0;
    size_t at = (size_t)-1;
    for (size_t j = 0; j < nc; j++) {
        total += atomic_load(&p->b[cand[j]]->inflight);
        if (p->b[cand[j]]->key_hash == bk) at = cand[j];
    }
    if (at == (size_t)-1) return at;
    double cap = p->cfg.load_factor * (double)(total + 1) / (double)nc;
    return (double)atomic_load(&p->b[at]->inflight) + 1 <= cap + 1 ? at : (size_t)-1;
}

/* ---------- prefix_affinity ---------- */

/* Entries of a pool's memory of block chains (px_pool.chains): 128-byte
 * blocks, so 65536 entries recall 8 MiB of prompts, in about 1.3 MiB. */
#define PREFIX_CHAINS 65536

/* Under p->mu. Consistent hashing with bounded loads: from the ring point
 * of h, the first candidate under ceil(c * mean in-flight); the first
 * candidate when all are over it. */
static size_t ring_walk(px_pool *p, uint64_t h, const unsigned char *is_cand, long icap) {
    h = px_mix64(h) & ~0xffffull;
    size_t lo = 0, hi = p->nring;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if ((p->ring[mid] & ~0xffffull) < h)
            lo = mid + 1;
        else
            hi = mid;
    }
    size_t best = (size_t)-1, first = (size_t)-1;
    for (size_t j = 0; j < p->nring; j++) {
        size_t i = (size_t)(p->ring[(lo + j) % p->nring] & 0xffff);
        if (i >= p->n || !is_cand[i]) continue;
        if (first == (size_t)-1) first = i;
        if (atomic_load(&p->b[i]->inflight) + 1 <= icap) {
            best = i;
            break;
        }
    }
    return best != (size_t)-1 ? best : first;
}

/* Under p->mu. prefix_affinity_bytes: the ring point of the key (the
 * prompt's first --prefix-bytes bytes), so every prompt opening alike
 * lands on one member. prefix_affinity: over the prompt's whole block
 * chain (px_pindex_hashes: chained hashes of its 128-byte blocks), the
 * member that was last given the longest prefix of this chain among those
 * under the load cap, when that prefix is at least half the chain (a
 * multi-turn conversation follows its history, a tenant's users their long
 * system prompt); otherwise the ring point of the whole prompt, so prompts
 * that share only an opening spread. A prompt shorter than one block: the ring point of its first
 * --prefix-bytes bytes, as before. */
static size_t choose_prefix(px_pool *p, const px_pick *k, const size_t *cand, size_t nc) {
    if (!k || !k->key || !p->nring) return cand[p->rr++ % nc];
    long total = 0;
    for (size_t j = 0; j < nc; j++)
        total += atomic_load(&p->b[cand[j]]->inflight);
    double cap = p->cfg.load_factor * (double)(total + 1) / (double)nc;
    long icap = (long)cap + ((double)(long)cap < cap);
    unsigned char is_cand_local[64];
    unsigned char *is_cand = p->n <= 64 ? is_cand_local : px_xmalloc(p->n);
    memset(is_cand, 0, p->n);
    for (size_t j = 0; j < nc; j++)
        is_cand[cand[j]] = 1;
    size_t head = k->key_len;
    if (p->cfg.prefix_bytes && head > p->cfg.prefix_bytes) head = p->cfg.prefix_bytes;
    size_t nh = 0, best = (size_t)-1;
    uint64_t *h = NULL;
    if (p->cfg.policy == PX_POLICY_PREFIX_AFFINITY && k->key_len >= PX_PINDEX_BLOCK_BYTES) {
        size_t max = k->key_len / PX_PINDEX_BLOCK_BYTES;
        if (max > PX_PINDEX_MAX_BLOCKS) max = PX_PINDEX_MAX_BLOCKS;
        h = px_xmalloc(max * sizeof *h);
        nh = px_pindex_hashes(k->key, k->key_len, h, max);
        if (!p->chains) p->chains = px_pindex_create(PREFIX_CHAINS);
        size_t most = 0;
        uint64_t bt = 0;
        for (size_t j = 0; j < nc; j++) {
            px_backend *b = p->b[cand[j]];
            if (atomic_load(&b->inflight) + 1 > icap) continue;
            size_t m = px_pindex_match(p->chains, b->key_hash, h, nh);
            uint64_t t = px_mix64(h[0] ^ b->key_hash);
            if (m > most || (m && m == most && t > bt)) {
                most = m;
                bt = t;
                best = cand[j];
            }
        }
        /* A match of under half the chain is an opening many prompts share
         * (a common preamble), not this prompt's history: following it
         * would pile every such prompt onto one member. */
        if (best != (size_t)-1 && 2 * most < nh) best = (size_t)-1;
        if (best == (size_t)-1) best = ring_walk(p, px_hash64(k->key, k->key_len), is_cand, icap);
        px_pindex_add(p->chains, p->b[best]->key_hash, h, nh);
        free(h);
    } else {
        best = ring_walk(p, px_hash64(k->key, head), is_cand, icap);
    }
    if (is_cand != is_cand_local) free(is_cand);
    return best;
}

/* latency: the member the plan preferred, when it is a candidate. */
static size_t choose_preferred(px_pool *p, const px_pick *k, const size_t *cand, size_t nc,
                               size_t *cached) {
    for (size_t j = 0; k && k->prefer && j < nc; j++)
        if (p->b[cand[j]]->key_hash == k->prefer) {
            *cached = k->prefer_cached;
            return cand[j];
        }
    return choose_kv(p, k, cand, nc, cached);
}

static size_t choose(px_pool *p, const px_pick *k, const size_t *cand, size_t nc, size_t *cached) {
    switch (p->cfg.policy) {
    case PX_POLICY_KV_AWARE:
        return choose_kv(p, k, cand, nc, cached);
    case PX_POLICY_LATENCY:
        return choose_preferred(p, k, cand, nc, cached);
    case PX_POLICY_ROUND_ROBIN:
    default: {
        /* The first candidate at or after the cursor. */
        size_t start = p->rr % p->n, best = cand[0];
        for (size_t i = 0; i < nc; i++)
            if (cand[i] >= start) {
                best = cand[i];
                break;
            }
        p->rr = best + 1;
        return best;
    }
    case PX_POLICY_LEAST_INFLIGHT:
    case PX_POLICY_LOAD_AWARE: {
        size_t start = p->rr++ % nc, best = cand[start];
        double bs = 1e300;
        for (size_t j = 0; j < nc; j++) {
            size_t i = cand[(start + j) % nc];
            double s = p->cfg.policy == PX_POLICY_LOAD_AWARE ? load_score(p->b[i])
                                                             : atomic_load(&p->b[i]->inflight);
            if (s < bs) {
                bs = s;
                best = i;
            }
        }
        return best;
    }
    case PX_POLICY_POWER_OF_TWO: {
        if (nc == 1) return cand[0];
        size_t a = cand[px_rand64() % nc], b = cand[px_rand64() % (nc - 1)];
        if (b == a) b = cand[nc - 1];
        return atomic_load(&p->b[b]->inflight) < atomic_load(&p->b[a]->inflight) ? b : a;
    }
    case PX_POLICY_PREFIX_AFFINITY:
    case PX_POLICY_PREFIX_AFFINITY_BYTES:
        return choose_prefix(p, k, cand, nc);
    }
}

px_backend *px_pool_pick(px_pool *p, const px_pick *k, size_t *nmembers) {
    uint64_t now = px_now_ns();
    px_backend *b = NULL;
    pthread_mutex_lock(&p->mu);
    if (nmembers) *nmembers = p->n;
    /* Candidates on the stack for any usual pool; a heap array beyond. */
    size_t local[64], nc = 0;
    size_t *cand = p->n <= 64 ? local : px_xmalloc(p->n * sizeof *cand);
    for (int pass = 0; pass < 2 && nc == 0; pass++)
        for (size_t i = 0; i < p->n; i++)
            if ((pass == 1 || !excluded(k, p->b[i])) && eligible(p, p->b[i], now)) cand[nc++] = i;
    if (!nc) {
        /* Panic: every member is out. Those ejected for failed requests may
         * have recovered already (one engine restarting, one burst of 5xx):
         * untried ones first, as above. */
        for (int pass = 0; pass < 2 && nc == 0; pass++)
            for (size_t i = 0; i < p->n; i++)
                if ((pass == 1 || !excluded(k, p->b[i])) && !atomic_load(&p->b[i]->check_failing) &&
                    !atomic_load(&p->b[i]->drained))
                    cand[nc++] = i;
        if (nc) atomic_fetch_add_explicit(&p->panic_routed, 1, memory_order_relaxed);
    }
    if (nc) {
        size_t at = session_member(p, k, cand, nc), cached = 0;
        b = p->b[at != (size_t)-1 ? at : choose(p, k, cand, nc, &cached)];
        if (k && k->cached) *k->cached = cached;
        if (k && k->sessions && k->session) px_sessions_put(k->sessions, k->session, b->key_hash);
        atomic_fetch_add(&b->refs, 1);
        atomic_fetch_add(&b->inflight, 1);
        if ((p->cfg.policy == PX_POLICY_KV_AWARE || p->cfg.policy == PX_POLICY_LATENCY) && k)
            px_backend_charge(b, (long)k->ntok - (long)cached);
    }
    pthread_mutex_unlock(&p->mu);
    if (cand != local) free(cand);
    return b;
}

size_t px_pool_snapshot(px_pool *p, const px_pick *k, px_kv_prompt *pr, px_lat_cand *out,
                        size_t cap) {
    uint64_t now = px_now_ns();
    int use_kv = k && k->tok && k->kv && pr;
    size_t n = 0;
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < p->n && n < cap; i++) {
        px_backend *b = p->b[i];
        if (excluded(k, b) || !eligible(p, b, now)) continue;
        size_t cached = 0;
        if (use_kv) {
            size_t m = px_kvindex_match_prompt(k->kv, px_kvindex_slot(k->kv, b->name, 0), pr);
            cached = px_kv_reusable(m, pr->bs, k->ntok);
        }
        out[n++] = (px_lat_cand){.key = b->key_hash,
                                 .tokens = atomic_load(&b->tokens),
                                 .inflight = atomic_load(&b->inflight),
                                 .cached = cached};
    }
    pthread_mutex_unlock(&p->mu);
    return n;
}

static void eject(px_pool *p, px_backend *b, const char *why) {
    int expected = 1;
    if (!atomic_compare_exchange_strong(&b->healthy, &expected, 0)) return;
    atomic_store(&b->ejected_by_check, !strcmp(why, "health_check"));
    int n = atomic_fetch_add(&b->ejections, 1);
    uint64_t backoff = 1000000000ull << (n < 6 ? n : 6); /* 1 s doubling to 64 s */
    atomic_store(&b->readmit_ns, px_now_ns() + backoff);
    atomic_store(&b->oks, 0);
    PX_LOG(PX_LOG_WARN, "msg=\"backend ejected\" role=%s backend=%s reason=%s failures=%d", p->role,
           b->name, why, atomic_load(&b->fails));
}

static void backend_done(px_pool *p, px_backend *b, px_outcome o, int count_failure) {
    if (!b) return;
    atomic_fetch_sub(&b->inflight, 1);
    atomic_fetch_add_explicit(&b->outcomes[o], 1, memory_order_relaxed);
    switch (o) {
    case PX_OUT_OK:
    case PX_OUT_CLIENT_ERR: {
        atomic_store(&b->fails, 0);
        /* A success after probation ends the backoff escalation. */
        if (!p->cfg.active_checks) atomic_store(&b->ejections, 0);
        /* It answered (panic routing sent it a request): back at once,
         * unless its own health check says otherwise (a straggler that
         * started before the checks ejected it proves nothing). */
        int expected = 0;
        if (!atomic_load(&b->check_failing) &&
            atomic_compare_exchange_strong(&b->healthy, &expected, 1)) {
            atomic_store(&b->ejections, 0);
            PX_LOG(PX_LOG_INFO,
                   "msg=\"backend readmitted after a successful request\" role=%s backend=%s",
                   p->role, b->name);
        }
        break;
    }
    case PX_OUT_SERVER_ERR:
    case PX_OUT_CONNECT_ERR:
    case PX_OUT_RESET:
    case PX_OUT_TIMEOUT:
        if (count_failure && atomic_fetch_add(&b->fails, 1) + 1 >= p->cfg.unhealthy_after)
            eject(p, b, px_outcome_name(o));
        break;
    default:
        break;
    }
    px_backend_release(b);
}

void px_backend_done(px_pool *p, px_backend *b, px_outcome o) {
    backend_done(p, b, o, 1);
}

void px_backend_take(px_backend *b) {
    atomic_fetch_add(&b->refs, 1);
    atomic_fetch_add(&b->inflight, 1);
}

void px_backend_done_repeat(px_pool *p, px_backend *b, px_outcome o) {
    backend_done(p, b, o, 0);
}

void px_backend_check(px_pool *p, px_backend *b, int ok) {
    if (ok) {
        atomic_store(&b->fails, 0);
        atomic_store(&b->check_failing, 0);
        int oks = atomic_fetch_add(&b->oks, 1) + 1;
        int expected = 0;
        /* Ejected for failed requests, a passing check is enough to return;
         * ejected by checks, --healthy-after of them in a row. */
        if ((oks >= p->cfg.healthy_after || !atomic_load(&b->ejected_by_check)) &&
            atomic_compare_exchange_strong(&b->healthy, &expected, 1)) {
            atomic_store(&b->ejections, 0);
            PX_LOG(PX_LOG_INFO, "msg=\"backend readmitted\" role=%s backend=%s checks_ok=%d",
                   p->role, b->name, oks);
        }
    } else {
        atomic_store(&b->oks, 0);
        atomic_store(&b->check_failing, 1);
        if (atomic_fetch_add(&b->fails, 1) + 1 >= p->cfg.unhealthy_after) {
            eject(p, b, "health_check");
            atomic_store(&b->ejected_by_check, 1);
        }
    }
}

px_backend **px_pool_members(px_pool *p, size_t *n) {
    pthread_mutex_lock(&p->mu);
    px_backend **v = px_xmalloc((p->n ? p->n : 1) * sizeof *v);
    for (size_t i = 0; i < p->n; i++) {
        v[i] = p->b[i];
        atomic_fetch_add(&v[i]->refs, 1);
    }
    *n = p->n;
    pthread_mutex_unlock(&p->mu);
    return v;
}

px_backend **px_pool_members_slice(px_pool *p, unsigned slice, unsigned nslices, size_t *n) {
    pthread_mutex_lock(&p->mu);
    size_t from = p->n * slice / nslices, to = p->n * (slice + 1) / nslices;
    px_backend **v = px_xmalloc((to > from ? to - from : 1) * sizeof *v);
    for (size_t i = from; i < to; i++) {
        v[i - from] = p->b[i];
        atomic_fetch_add(&p->b[i]->refs, 1);
    }
    *n = to - from;
    pthread_mutex_unlock(&p->mu);
    return v;
}

size_t px_pool_usable(px_pool *p) {
    size_t h, panic = 0;
    px_pool_counts(p, NULL, &h);
    if (h) return h;
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < p->n; i++)
        panic += !atomic_load(&p->b[i]->check_failing) && !atomic_load(&p->b[i]->drained);
    pthread_mutex_unlock(&p->mu);
    return panic;
}

const char *px_pool_unusable_why(px_pool *p) {
    size_t drained = 0, n;
    pthread_mutex_lock(&p->mu);
    n = p->n;
    for (size_t i = 0; i < n; i++)
        drained += atomic_load(&p->b[i]->drained) != 0;
    pthread_mutex_unlock(&p->mu);
    if (!n) return "";
    return drained == n ? ", all drained" : drained ? ", all ejected or drained" : ", all ejected";
}

void px_pool_counts(px_pool *p, size_t *n, size_t *healthy) {
    pthread_mutex_lock(&p->mu);
    size_t h = 0;
    for (size_t i = 0; i < p->n; i++)
        h += atomic_load(&p->b[i]->healthy) && !atomic_load(&p->b[i]->drained);
    if (n) *n = p->n;
    if (healthy) *healthy = h;
    pthread_mutex_unlock(&p->mu);
}

/* ---------- addresses of the members, for retiring connections ---------- */

typedef struct addr_key {
    uint16_t family, port;
    unsigned char a[16];
} addr_key;

struct px_addrset {
    atomic_int refs;
    addr_key *k;   /* owned; family 0: free slot */
    size_t cap, n; /* cap: a power of two, over twice n */
};

static int addr_key_of(const struct sockaddr *sa, socklen_t len, addr_key *k) {
    memset(k, 0, sizeof *k);
    if (sa->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)sa;
        k->port = a->sin_port;
        memcpy(k->a, &a->sin_addr, 4);
    } else if (sa->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)sa;
        k->port = a->sin6_port;
        memcpy(k->a, &a->sin6_addr, 16);
    } else {
        return -1;
    }
    k->family = sa->sa_family;
    return 0;
}

static size_t addr_slot(const px_addrset *s, const addr_key *k) {
    size_t i = (size_t)px_hash64(k, sizeof *k) & (s->cap - 1);
    while (s->k[i].family && memcmp(&s->k[i], k, sizeof *k))
        i = (i + 1) & (s->cap - 1);
    return i;
}

px_addrset *px_addrset_create(void) {
    px_addrset *s = px_xcalloc(1, sizeof *s);
    atomic_init(&s->refs, 1);
    s->cap = 64;
    s->k = px_xcalloc(s->cap, sizeof *s->k);
    return s;
}

void px_addrset_add_pool(px_addrset *s, px_pool *p) {
    pthread_mutex_lock(&p->mu);
    if (2 * (s->n + p->n) > s->cap) {
        addr_key *old = s->k;
        size_t oc = s->cap;
        while (2 * (s->n + p->n) > s->cap)
            s->cap *= 2;
        s->k = px_xcalloc(s->cap, sizeof *s->k);
        for (size_t i = 0; i < oc; i++)
            if (old[i].family) s->k[addr_slot(s, &old[i])] = old[i];
        free(old);
    }
    for (size_t i = 0; i < p->n; i++) {
        addr_key k;
        if (!p->b[i]->addrlen ||
            addr_key_of((const struct sockaddr *)&p->b[i]->addr, p->b[i]->addrlen, &k) < 0)
            continue;
        size_t at = addr_slot(s, &k);
        if (!s->k[at].family) {
            s->k[at] = k;
            s->n++;
        }
    }
    pthread_mutex_unlock(&p->mu);
}

int px_addrset_has(const px_addrset *s, const struct sockaddr *sa, socklen_t len) {
    addr_key k;
    if (addr_key_of(sa, len, &k) < 0) return 0;
    return s->k[addr_slot(s, &k)].family != 0;
}

px_addrset *px_addrset_ref(px_addrset *s) {
    atomic_fetch_add(&s->refs, 1);
    return s;
}

void px_addrset_release(px_addrset *s) {
    if (!s || atomic_fetch_sub(&s->refs, 1) != 1) return;
    free(s->k);
    free(s);
}
