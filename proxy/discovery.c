/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/discovery.h"

#include <arpa/inet.h>
#include <event2/dns.h>
#include <event2/util.h>
#include <netdb.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "proxy/ctx.h"
#include "proxy/route.h"

#define HOSTS_FILE "/etc/hosts"

typedef struct dns_entry {
    struct px_discovery *d; /* borrowed: the owner */
    px_pool *pool;          /* borrowed */
    char *url;              /* owned */
    char host[256];
    int port;
    struct evdns_getaddrinfo_request *req; /* in flight, or NULL (control thread) */
    atomic_int unresolved;                 /* the last try failed, or none finished yet */
    int cancelled;                         /* req was cancelled: its callback is due */
} dns_entry;

struct px_discovery {
    px_gen *g;               /* borrowed: the generation whose pools this fills */
    px_gen *old;             /* borrowed, while starting: the generation it replaces */
    struct event_base *base; /* borrowed: the control loop */
    struct evdns_base *dns;  /* owned, NULL when no backend is a name */
    dns_entry *e;            /* owned */
    size_t n;
    struct event *timer; /* owned: the next round */
    px_k8s *k8s;         /* owned: k8s:// backends, or NULL */
    const px_k8s_cfg *k8s_cfg; /* borrowed, while starting */
    size_t inflight;     /* control thread only */
    atomic_ullong failures;
};

static int is_ip_literal(const char *host) {
    unsigned char buf[16];
    return inet_pton(AF_INET, host, buf) == 1 || inet_pton(AF_INET6, host, buf) == 1;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Runs on the control loop (or inside evdns_getaddrinfo, for answers from
 * /etc/hosts). */
static void on_resolved(int result, struct evutil_addrinfo *res, void *arg) {
    dns_entry *e = arg;
    px_discovery *d = e->d;
    e->req = NULL;
    d->inflight--;
    if (result == EVUTIL_EAI_CANCEL) return; /* stopping */
    if (result != 0) {
        atomic_fetch_add(&d->failures, 1);
        atomic_store(&e->unresolved, 1);
        /* Keep what we had: a DNS hiccup must not empty a pool. */
        PX_LOG(PX_LOG_WARN,
               "msg=\"cannot resolve backend name; keeping its last addresses\" name=%s role=%s "
               "error=\"%s\"",
               e->host, e->pool->role, evutil_gai_strerror(result));
        return;
    }
    char **v = NULL;
    size_t n = 0;
    for (struct evutil_addrinfo *ai = res; ai; ai = ai->ai_next) {
        char ip[INET6_ADDRSTRLEN];
        const void *a = ai->ai_family == AF_INET
                            ? (const void *)&((struct sockaddr_in *)ai->ai_addr)->sin_addr
                            : (const void *)&((struct sockaddr_in6 *)ai->ai_addr)->sin6_addr;
        if (!inet_ntop(ai->ai_family, a, ip, sizeof ip)) continue;
        int dup = 0;
        for (size_t i = 0; i < n && !dup; i++)
            dup = !strcmp(v[i], ip);
        if (dup) continue;
        v = px_xrealloc(v, (n + 1) * sizeof *v);
        v[n++] = px_xstrdup(ip);
    }
    if (res) evutil_freeaddrinfo(res);
    if (n) qsort(v, n, sizeof *v, cmp_str);
    if (atomic_exchange(&e->unresolved, 0))
        PX_LOG(PX_LOG_INFO, "msg=\"backend name resolved\" name=%s role=%s addresses=%zu", e->host,
               e->pool->role, n);
    px_pool_sync_addrs(e->pool, e->url, e->host, e->port, v, n);
    for (size_t i = 0; i < n; i++)
        free(v[i]);
    free(v);
}

/* One round: every name not still being resolved is asked again, with
 * /etc/hosts read anew (a name may move there, as in tests and on hosts
 * without DNS). */
static void refresh(px_discovery *d) {
    evdns_base_clear_host_addresses(d->dns);
    if (evdns_base_load_hosts(d->dns, HOSTS_FILE) != 0) evdns_base_load_hosts(d->dns, NULL);
    for (size_t i = 0; i < d->n; i++) {
        dns_entry *e = &d->e[i];
        if (e->req) continue;
        struct evutil_addrinfo hints = {0};
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_protocol = IPPROTO_TCP;
        d->inflight++;
        /* May answer at once (from /etc/hosts) and return NULL. */
        struct evdns_getaddrinfo_request *r =
            evdns_getaddrinfo(d->dns, e->host, NULL, &hints, on_resolved, e);
        e->req = r;
    }
}

static void on_timer(evutil_socket_t fd, short what, void *arg) {
    refresh(arg);
}

/* The pool of the previous generation that `pool` continues, or NULL. */
static px_pool *old_pool(px_discovery *d, size_t i, const px_pool *pool) {
    if (!d->old) return NULL;
    const px_pset *np = &d->g->ps[i];
    for (size_t j = 0; j < d->old->nps; j++)
        if (!strcmp(d->old->ps[j].name, np->name))
            return pool == &np->prefill ? &d->old->ps[j].prefill : &d->old->ps[j].decode;
    return NULL;
}

/* A k8s:// URL: its backends of the replaced generation are adopted, and
 * the Kubernetes client follows it from here. */
static int add_k8s(px_discovery *d, px_adopt_index *prev, px_pool *pool, const char *url, char *err,
                   size_t errlen) {
    if (!d->k8s && !(d->k8s = px_k8s_create(d->base, d->k8s_cfg, err, errlen))) return -1;
    px_k8s *old = d->old && d->old->disc ? d->old->disc->k8s : NULL;
    size_t n;
    const char *const *m = px_k8s_members(old, url, &n);
    for (size_t i = 0; i < n; i++)
        px_pool_adopt_indexed(pool, prev, m[i]);
    return px_k8s_watch(d->k8s, pool, url, old, err, errlen);
}

static int add_url(px_discovery *d, px_adopt_index *prev, px_pool *pool, const char *url, int toy,
                   char *err, size_t errlen) {
    char host[256];
    int port, https;
    if (px_k8s_is_url(url)) return add_k8s(d, prev, pool, url, err, errlen);
    if (px_url_split(url, host, sizeof host, &port, &https) < 0) {
        snprintf(err, errlen, "malformed %s backend URL '%s'", pool->role, url);
        return -1;
    }
    /* Toy-style hosts are single backends: the upstream client resolves
     * them per connection. */
    if (toy || is_ip_literal(host)) {
        if (!px_pool_adopt_indexed(pool, prev, url)) px_pool_add(pool, url, NULL);
        return 0;
    }
    /* A name: its addresses so far stay members until DNS says otherwise. */
    px_pool_adopt_indexed(pool, prev, url);
    d->e = px_xrealloc(d->e, (d->n + 1) * sizeof *d->e);
    dns_entry *e = &d->e[d->n++];
    memset(e, 0, sizeof *e);
    e->pool = pool;
    e->url = px_xstrdup(url);
    snprintf(e->host, sizeof e->host, "%s", host);
    e->port = port;
    atomic_init(&e->unresolved, 1);
    return 0;
}

static int add_role(px_discovery *d, size_t pi, px_pool *pool, const px_strlist *urls,
                    const px_strlist *toy, char *err, size_t errlen) {
    /* One index of the previous pool for all URLs: O(n log n), not n scans. */
    px_adopt_index *prev = px_adopt_index_create(old_pool(d, pi, pool));
    int rc = 0;
    for (size_t i = 0; i < toy->n && !rc; i++)
        rc = add_url(d, prev, pool, toy->v[i], 1, err, errlen);
    for (size_t i = 0; i < urls->n && !rc; i++)
        rc = add_url(d, prev, pool, urls->v[i], 0, err, errlen);
    px_adopt_index_destroy(prev);
    px_pool_seal(pool);
    return rc;
}

static void on_startup_deadline(evutil_socket_t fd, short what, void *arg) {
    *(int *)arg = 1;
}

static px_discovery *wait_first(px_discovery *d, int wait);

px_discovery *px_discovery_start(px_gen *g, const px_pool_spec *specs, px_gen *old,
                                 double dns_refresh, const px_k8s_cfg *k8s, struct event_base *base,
                                 int wait, char *err, size_t errlen) {
    px_discovery *d = px_xcalloc(1, sizeof *d);
    d->g = g;
    d->old = old;
    d->base = base;
    d->k8s_cfg = k8s;
    for (size_t i = 0; i < g->nps; i++)
        if (add_role(d, i, &g->ps[i].prefill, &specs[i].prefill, &specs[i].prefill_toy, err,
                     errlen) < 0 ||
            add_role(d, i, &g->ps[i].decode, &specs[i].decode, &specs[i].decode_toy, err, errlen) <
                0) {
            d->old = NULL;
            px_discovery_stop(d);
            return NULL;
        }
    /* The failure counter goes on across reloads (a Prometheus counter). */
    if (old && old->disc) atomic_init(&d->failures, px_discovery_failures(old->disc));
    d->old = NULL; /* only while the pools are filled */
    d->k8s_cfg = NULL;
    for (size_t i = 0; i < d->n; i++)
        d->e[i].d = d;
    px_k8s_start(d->k8s);
    if (!d->n) return wait_first(d, wait);
    /* resolv.conf's name servers, search list, ndots, timeout and attempts
     * (Kubernetes sets all of them). */
    d->dns = evdns_base_new(base, EVDNS_BASE_INITIALIZE_NAMESERVERS);
    if (!d->dns) {
        snprintf(err, errlen, "cannot set up the DNS resolver (/etc/resolv.conf)");
        px_discovery_stop(d);
        return NULL;
    }
    /* The 0x20 trick changes the letters' case in queries; some resolvers
     * and caches answer such names badly. */
    evdns_base_set_option(d->dns, "randomize-case:", "0");
    d->timer = event_new(base, -1, EV_PERSIST, on_timer, d);
    double r = dns_refresh;
    struct timeval tv = {(time_t)r, (suseconds_t)((r - (double)(time_t)r) * 1e6)};
    event_add(d->timer, &tv);
    refresh(d);
    return wait_first(d, wait);
}

/* Gives the first answers (DNS, Kubernetes lists) a moment, so that the
 * pools are filled when the listeners open; a silent server costs at most
 * this second. */
static px_discovery *wait_first(px_discovery *d, int wait) {
    if (!wait || (!d->inflight && !px_k8s_unlisted(d->k8s))) return d;
    int late = 0;
    struct event *deadline = evtimer_new(d->base, on_startup_deadline, &late);
    struct timeval one = {1, 0};
    evtimer_add(deadline, &one);
    for (int i = 0; i < 1000 && (d->inflight || px_k8s_unlisted(d->k8s)) && !late; i++)
        event_base_loop(d->base, EVLOOP_ONCE);
    event_free(deadline);
    if (px_k8s_unlisted(d->k8s))
        PX_LOG(PX_LOG_WARN, "msg=\"Kubernetes endpoints not listed yet at start; their backends "
                            "join when they are\" sources=%zu",
               px_k8s_unlisted(d->k8s));
    for (size_t i = 0; i < d->n; i++)
        if (d->e[i].req)
            PX_LOG(PX_LOG_WARN,
                   "msg=\"backend name not resolved yet at start; its backends join when it "
                   "is\" name=%s role=%s",
                   d->e[i].host, d->e[i].pool->role);
    return d;
}

void px_discovery_retire(px_discovery *d) {
    if (!d) return;
    px_k8s_retire(d->k8s);
    if (d->timer) event_free(d->timer);
    d->timer = NULL;
    for (size_t i = 0; i < d->n; i++)
        if (d->e[i].req && !d->e[i].cancelled) {
            d->e[i].cancelled = 1;
            evdns_getaddrinfo_cancel(d->e[i].req); /* calls back with CANCEL */
        }
}

int px_discovery_idle(const px_discovery *d) {
    for (size_t i = 0; d && i < d->n; i++)
        if (d->e[i].req) return 0;
    return 1;
}

void px_discovery_stop(px_discovery *d) {
    if (!d) return;
    px_k8s_destroy(d->k8s);
    if (d->timer) event_free(d->timer);
    int cancelled = 0;
    for (size_t i = 0; i < d->n; i++)
        if (d->e[i].req) {
            if (!d->e[i].cancelled)
                evdns_getaddrinfo_cancel(d->e[i].req); /* calls back with CANCEL */
            d->e[i].cancelled = 1;
            cancelled = 1;
        }
    /* A cancelled lookup is freed by evdns's deferred callbacks: let them
     * run before the resolver goes. */
    if (cancelled) event_base_loop(d->base, EVLOOP_NONBLOCK);
    if (d->dns) evdns_base_free(d->dns, 0);
    for (size_t i = 0; i < d->n; i++)
        free(d->e[i].url);
    free(d->e);
    free(d);
}

void px_discovery_ready_json(px_discovery *d, px_buf *out) {
    if (!d || !px_discovery_unresolved(d)) return;
    px_buf_appends(out, ",\"unresolved\":[");
    int first = 1;
    for (size_t i = 0; i < d->n; i++) {
        if (!atomic_load(&d->e[i].unresolved)) continue;
        if (!first) px_buf_appends(out, ",");
        first = 0;
        px_buf_append_json_str(out, d->e[i].host, strlen(d->e[i].host));
    }
    px_buf_appends(out, "]");
}

uint64_t px_discovery_failures(px_discovery *d) {
    return d ? atomic_load(&d->failures) : 0;
}

size_t px_discovery_unresolved(px_discovery *d) {
    size_t n = 0;
    for (size_t i = 0; d && i < d->n; i++)
        n += atomic_load(&d->e[i].unresolved) != 0;
    return n;
}
