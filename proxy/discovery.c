#include "discovery.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "route.h"
#include "server.h"

typedef struct dns_entry {
    px_pool *pool; /* borrowed */
    char *url;     /* owned */
    char host[256];
    int port;
} dns_entry;

struct px_discovery {
    px_server *s;
    dns_entry *e; /* owned */
    size_t n;
    pthread_t thread;
    int running;
    int stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

static int is_ip_literal(const char *host) {
    unsigned char buf[16];
    return inet_pton(AF_INET, host, buf) == 1 || inet_pton(AF_INET6, host, buf) == 1;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Resolves host to its distinct addresses, sorted. Returns the count, or -1. */
static long resolve(const char *host, char ***out) {
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(host, NULL, &hints, &res);
    if (rc) {
        PX_LOG(PX_LOG_WARN, "msg=\"cannot resolve backend name\" name=%s error=\"%s\"", host,
               gai_strerror(rc));
        return -1;
    }
    char **v = NULL;
    long n = 0;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        char ip[INET6_ADDRSTRLEN];
        const void *a = ai->ai_family == AF_INET
                            ? (const void *)&((struct sockaddr_in *)ai->ai_addr)->sin_addr
                            : (const void *)&((struct sockaddr_in6 *)ai->ai_addr)->sin6_addr;
        if (!inet_ntop(ai->ai_family, a, ip, sizeof ip)) continue;
        int dup = 0;
        for (long i = 0; i < n && !dup; i++)
            dup = !strcmp(v[i], ip);
        if (dup) continue;
        v = px_xrealloc(v, (size_t)(n + 1) * sizeof *v);
        v[n++] = px_xstrdup(ip);
    }
    freeaddrinfo(res);
    qsort(v, (size_t)n, sizeof *v, cmp_str);
    *out = v;
    return n;
}

static void refresh(px_discovery *d) {
    for (size_t i = 0; i < d->n; i++) {
        char **ips = NULL;
        long n = resolve(d->e[i].host, &ips);
        if (n < 0) continue; /* keep what we had: a DNS hiccup must not empty a pool */
        px_pool_sync_addrs(d->e[i].pool, d->e[i].url, d->e[i].host, d->e[i].port, ips, (size_t)n);
        for (long j = 0; j < n; j++)
            free(ips[j]);
        free(ips);
    }
}

static void *refresh_main(void *arg) {
    px_discovery *d = arg;
    pthread_mutex_lock(&d->mu);
    while (!d->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double s = d->s->cfg->dns_refresh;
        ts.tv_sec += (time_t)s;
        ts.tv_nsec += (long)((s - (double)(time_t)s) * 1e9);
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        int rc = 0;
        while (!d->stop && rc != ETIMEDOUT)
            rc = pthread_cond_timedwait(&d->cv, &d->mu, &ts);
        if (d->stop) break;
        pthread_mutex_unlock(&d->mu);
        refresh(d);
        pthread_mutex_lock(&d->mu);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

static int add_url(px_discovery *d, px_pool *pool, const char *url, char *err, size_t errlen) {
    char host[256];
    int port, https;
    if (px_url_split(url, host, sizeof host, &port, &https) < 0) {
        snprintf(err, errlen, "malformed %s backend URL '%s'", pool->role, url);
        return -1;
    }
    if (is_ip_literal(host)) {
        px_pool_add(pool, url, NULL);
        return 0;
    }
    d->e = px_xrealloc(d->e, (d->n + 1) * sizeof *d->e);
    dns_entry *e = &d->e[d->n++];
    e->pool = pool;
    e->url = px_xstrdup(url);
    snprintf(e->host, sizeof e->host, "%s", host);
    e->port = port;
    return 0;
}

static int add_role(px_discovery *d, px_pool *pool, const px_strlist *urls, const char *toy_name,
                    const px_strlist *hosts, const px_strlist *ports, char *err, size_t errlen) {
    const px_config *cfg = d->s->cfg;
    /* The toy lists count when given, or when no URL is (their defaults). */
    if (!urls->n || px_config_is_set(cfg, toy_name)) {
        for (size_t i = 0; i < hosts->n; i++) {
            const char *h = hosts->v[i];
            int v6 = strchr(h, ':') != NULL && h[0] != '[';
            px_buf u;
            px_buf_init(&u);
            px_buf_printf(&u, "http://%s%s%s:%s", v6 ? "[" : "", h, v6 ? "]" : "", ports->v[i]);
            /* Toy-style hosts are single backends: curl resolves them. */
            px_pool_add(pool, u.data, NULL);
            px_buf_cleanup(&u);
        }
    }
    for (size_t i = 0; i < urls->n; i++)
        if (add_url(d, pool, urls->v[i], err, errlen) < 0) return -1;
    return 0;
}

px_discovery *px_discovery_start(px_server *s, char *err, size_t errlen) {
    px_discovery *d = px_xcalloc(1, sizeof *d);
    d->s = s;
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, NULL);
    const px_config *c = s->cfg;
    if (add_role(d, &s->prefill, &c->prefill_urls, "prefiller-hosts", &c->prefiller_hosts,
                 &c->prefiller_ports, err, errlen) < 0 ||
        add_role(d, &s->decode, &c->decode_urls, "decoder-hosts", &c->decoder_hosts,
                 &c->decoder_ports, err, errlen) < 0) {
        px_discovery_stop(d);
        return NULL;
    }
    if (d->n) {
        refresh(d);
        if (pthread_create(&d->thread, NULL, refresh_main, d) == 0) d->running = 1;
    }
    return d;
}

void px_discovery_stop(px_discovery *d) {
    if (!d) return;
    if (d->running) {
        pthread_mutex_lock(&d->mu);
        d->stop = 1;
        pthread_cond_signal(&d->cv);
        pthread_mutex_unlock(&d->mu);
        pthread_join(d->thread, NULL);
    }
    for (size_t i = 0; i < d->n; i++)
        free(d->e[i].url);
    free(d->e);
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->cv);
    free(d);
}
