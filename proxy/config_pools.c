/* SPDX-License-Identifier: Apache-2.0 */
/* Pools and backends of the settings: pool specs, the toy proxy's
 * host/port lists, the effective pools, backend URLs in their one
 * spelling, and the checks that a backend is not this proxy itself. */
#include <arpa/inet.h>
#include <ctype.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/util.h"
#include "proxy/config_int.h"
#include "proxy/k8s_url.h"

static void spec_free(px_pool_spec *p) {
    free(p->name);
    free(p->prefill_policy);
    free(p->decode_policy);
    free(p->dispatch);
    px_strlist_clear(&p->models);
    px_strlist_clear(&p->prefill);
    px_strlist_clear(&p->decode);
    px_strlist_clear(&p->prefill_toy);
    px_strlist_clear(&p->decode_toy);
}

void px_pool_specs_free(px_pool_spec *v, size_t n) {
    for (size_t i = 0; v && i < n; i++)
        spec_free(&v[i]);
    free(v);
}

static px_pool_spec *specs_copy(const px_pool_spec *v, size_t n) {
    px_pool_spec *o = px_xcalloc(n ? n : 1, sizeof *o);
    for (size_t i = 0; i < n; i++) {
        o[i].name = px_xstrdup(v[i].name);
        o[i].prefill_policy = px_xstrdup(v[i].prefill_policy ? v[i].prefill_policy : "");
        o[i].decode_policy = px_xstrdup(v[i].decode_policy ? v[i].decode_policy : "");
        o[i].dispatch = px_xstrdup(v[i].dispatch ? v[i].dispatch : "");
        o[i].line = v[i].line;
        px_cfg_list_copy(&o[i].models, &v[i].models);
        px_cfg_list_copy(&o[i].prefill, &v[i].prefill);
        px_cfg_list_copy(&o[i].decode, &v[i].decode);
        px_cfg_list_copy(&o[i].prefill_toy, &v[i].prefill_toy);
        px_cfg_list_copy(&o[i].decode_toy, &v[i].decode_toy);
    }
    return o;
}

px_pool_spec *px_cfg_pool_new(px_config *c, const char *v, size_t len) {
    c->pools = px_xrealloc(c->pools, (c->npools + 1) * sizeof *c->pools);
    px_pool_spec *p = &c->pools[c->npools++];
    memset(p, 0, sizeof *p);
    const char *eq = memchr(v, '=', len);
    p->name = px_xstrndup(v, eq ? (size_t)(eq - v) : len);
    p->prefill_policy = px_xstrdup("");
    p->decode_policy = px_xstrdup("");
    p->dispatch = px_xstrdup("");
    for (const char *m = eq ? eq + 1 : NULL; m && m < v + len;) {
        size_t l = strcspn(m, ", ");
        if (m + l > v + len) l = (size_t)(v + len - m);
        if (l) px_cfg_list_push(&p->models, m, l);
        m += l + 1;
    }
    return p;
}

static void toy_urls(px_strlist *out, const px_strlist *hosts, const px_strlist *ports) {
    for (size_t i = 0; i < hosts->n && i < ports->n; i++) {
        const char *h = hosts->v[i];
        int v6 = strchr(h, ':') != NULL && h[0] != '[';
        char u[600];
        snprintf(u, sizeof u, "http://%s%s%s:%s", v6 ? "[" : "", h, v6 ? "]" : "", ports->v[i]);
        px_strlist_push(out, u);
    }
}

/* The toy lists count when given. Their defaults (localhost:8100 and
 * localhost:8200) apply only when no backend of either role is given any
 * other way: beside --prefill/--decode URLs or a file's backends, a default
 * would be a phantom backend that gets ejected and shows as an outage (the
 * sidecar passes --decode alone). The toy flags alone keep the toy proxy's
 * defaults for the role they do not name. */
int px_cfg_toy_in_effect(const px_config *c, int prefill) {
    if (c->npools) return 0;
    int given =
        prefill ? px_config_is_set(c, "prefiller-hosts") || px_config_is_set(c, "prefiller-ports")
                : px_config_is_set(c, "decoder-hosts") || px_config_is_set(c, "decoder-ports");
    if (given) return 1;
    /* Behind a --config file the toy defaults never apply unasked: a file
     * emptied by a bad deploy must not turn into localhost:8100/8200; nor
     * does a sidecar, whose prefills come with the requests, get one. */
    if (c->config_file[0] || (prefill && c->prefiller_from_header)) return 0;
    return !c->prefill_urls.n && !c->decode_urls.n;
}

px_pool_spec *px_config_effective_pools(const px_config *c, size_t *n) {
    if (c->npools) {
        *n = c->npools;
        return specs_copy(c->pools, c->npools);
    }
    px_pool_spec *p = px_xcalloc(1, sizeof *p);
    p->name = px_xstrdup("");
    p->prefill_policy = px_xstrdup("");
    p->decode_policy = px_xstrdup("");
    p->dispatch = px_xstrdup("");
    if (px_cfg_toy_in_effect(c, 1))
        toy_urls(&p->prefill_toy, &c->prefiller_hosts, &c->prefiller_ports);
    if (px_cfg_toy_in_effect(c, 0)) toy_urls(&p->decode_toy, &c->decoder_hosts, &c->decoder_ports);
    px_cfg_list_copy(&p->prefill, &c->prefill_urls);
    px_cfg_list_copy(&p->decode, &c->decode_urls);
    *n = 1;
    return p;
}

/* The literal address of a host, v4-mapped v6 as v4. 4 or 16 bytes in a,
 * the length returned; 0 when not a literal. */
static int literal_addr(const char *host, unsigned char a[16]) {
    if (inet_pton(AF_INET, host, a) == 1) return 4;
    if (inet_pton(AF_INET6, host, a) != 1) return 0;
    static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (!memcmp(a, mapped, 12)) {
        memmove(a, a + 12, 4);
        return 4;
    }
    return 16;
}

static int addr_loopback(const unsigned char *a, int len) {
    static const unsigned char lo6[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    return len == 4 ? a[0] == 127 : !memcmp(a, lo6, 16);
}

static int addr_any(const unsigned char *a, int len) {
    static const unsigned char zero[16];
    return !memcmp(a, zero, (size_t)len);
}

static int addr_local_iface(const unsigned char *a, int len) {
    struct ifaddrs *ifs, *i;
    int found = 0;
    if (getifaddrs(&ifs) < 0) return 0;
    for (i = ifs; i && !found; i = i->ifa_next) {
        if (!i->ifa_addr) continue;
        if (len == 4 && i->ifa_addr->sa_family == AF_INET)
            found = !memcmp(&((struct sockaddr_in *)i->ifa_addr)->sin_addr, a, 4);
        else if (len == 16 && i->ifa_addr->sa_family == AF_INET6)
            found = !memcmp(&((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr, a, 16);
    }
    freeifaddrs(ifs);
    return found;
}

/* Whether host:port reaches a listener of ours on `lhost`:`lport`. */
static int reaches(const char *host, long port, const char *lhost, long lport) {
    if (!lport || port != lport) return 0;
    if (!strcasecmp(host, lhost)) return 1;
    unsigned char a[16], l[16];
    int alen = !strcasecmp(host, "localhost") ? (inet_pton(AF_INET, "127.0.0.1", a), 4)
                                              : literal_addr(host, a);
    if (!alen) return 0;
    int llen = !strcasecmp(lhost, "localhost") ? (inet_pton(AF_INET, "127.0.0.1", l), 4)
                                               : literal_addr(lhost, l);
    if (!llen) return 0;
    if (addr_any(l, llen)) /* every address of this host */
        return addr_loopback(a, alen) || addr_any(a, alen) || addr_local_iface(a, alen);
    if (alen == llen && !memcmp(a, l, (size_t)alen)) return 1;
    /* 0.0.0.0 and :: as a destination are this host. */
    return addr_any(a, alen) && (addr_loopback(l, llen) || addr_local_iface(l, llen));
}

int px_config_url_is_self(const px_config *c, const char *url) {
    int tls = !strncmp(url, "https://", 8);
    const char *h = url + (tls ? 8 : !strncmp(url, "http://", 7) ? 7 : 0);
    char host[256];
    size_t n;
    long port = tls ? 443 : 80;
    const char *rest;
    if (*h == '[') {
        const char *e = strchr(h, ']');
        if (!e) return 0;
        n = (size_t)(e - h - 1);
        if (n >= sizeof host) return 0;
        memcpy(host, h + 1, n);
        rest = e + 1;
    } else {
        n = strcspn(h, ":/");
        if (n >= sizeof host) return 0;
        memcpy(host, h, n);
        rest = h + n;
    }
    host[n] = '\0';
    if (*rest == ':') port = strtol(rest + 1, NULL, 10);
    const char *mhost = c->metrics_host && c->metrics_host[0] ? c->metrics_host : c->host;
    return reaches(host, port, c->host, (long)c->port) ||
           reaches(host, port, mhost, (long)c->metrics_port) ||
           reaches(host, port, c->admin_host, (long)c->admin_port);
}

/* "scheme host port" of a URL with its spelling undone; 0, or -1. */
static int url_canon(const char *url, char *out, size_t outlen) {
    int tls;
    if (px_k8s_is_url(url)) /* one spelling: the source as written */
        return (size_t)snprintf(out, outlen, "k8s %s", url) < outlen ? 0 : -1;
    if (!strncasecmp(url, "http://", 7))
        tls = 0;
    else if (!strncasecmp(url, "https://", 8))
        tls = 1;
    else
        return -1;
    const char *h = url + (tls ? 8 : 7), *rest;
    char host[256];
    size_t n;
    if (*h == '[') {
        const char *e = strchr(h, ']');
        if (!e || (size_t)(e - h - 1) >= sizeof host) return -1;
        n = (size_t)(e - h - 1);
        memcpy(host, h + 1, n);
        rest = e + 1;
    } else {
        n = strcspn(h, ":/");
        if (n >= sizeof host) return -1;
        memcpy(host, h, n);
        rest = h + n;
    }
    host[n] = '\0';
    for (size_t i = 0; i < n; i++)
        host[i] = (char)tolower((unsigned char)host[i]);
    long port = *rest == ':' ? strtol(rest + 1, NULL, 10) : (tls ? 443 : 80);
    struct in_addr a4;
    unsigned char a[16];
    char lit[INET6_ADDRSTRLEN];
    if (!strcmp(host, "localhost")) {
        snprintf(host, sizeof host, "127.0.0.1");
    } else if (inet_aton(host, &a4)) { /* 127.1, 0x7f.1 and the like */
        inet_ntop(AF_INET, &a4, lit, sizeof lit);
        snprintf(host, sizeof host, "%s", lit);
    } else {
        int len = literal_addr(host, a);
        if (len) {
            inet_ntop(len == 4 ? AF_INET : AF_INET6, a, lit, sizeof lit);
            snprintf(host, sizeof host, "%s", lit);
        }
    }
    snprintf(out, outlen, "%d %s %ld", tls, host, port);
    return 0;
}

/* http[s]://a.b.c.d:port in its one spelling (no leading zeros, explicit
 * port, nothing after): two such URLs are the same backend exactly when
 * they are the same string, which spares the admin API's checks over
 * thousands of backends the canonicalisation. */
static int plain_url(const char *u) {
    const char *p = !strncmp(u, "http://", 7) ? u + 7 : !strncmp(u, "https://", 8) ? u + 8 : NULL;
    if (!p) return 0;
    for (int part = 0; part < 5; part++) {
        if (*p < '0' || *p > '9' || (*p == '0' && p[1] >= '0' && p[1] <= '9')) return 0;
        long v = 0;
        int digits = 0;
        while (*p >= '0' && *p <= '9' && digits < 6) {
            v = v * 10 + (*p++ - '0');
            digits++;
        }
        if (part < 4 && v > 255) return 0;
        if (part == 4) return !*p && v >= 1 && v <= 65535;
        if (*p++ != (part < 3 ? '.' : ':')) return 0;
    }
    return 0;
}

int px_config_url_key(const char *url, char *out, size_t outlen) {
    if (plain_url(url)) { /* its one spelling already: no parsing, no lookup */
        int tls = url[4] == 's';
        const char *h = url + (tls ? 8 : 7), *colon = strrchr(h, ':');
        int w = snprintf(out, outlen, "%d %.*s %s", tls, (int)(colon - h), h, colon + 1);
        return w > 0 && (size_t)w < outlen ? 0 : -1;
    }
    return url_canon(url, out, outlen);
}

int px_config_url_same(const char *a, const char *b) {
    if (plain_url(a) && plain_url(b)) return !strcmp(a, b);
    char ca[300], cb[300];
    if (url_canon(a, ca, sizeof ca) < 0 || url_canon(b, cb, sizeof cb) < 0) return !strcmp(a, b);
    return !strcmp(ca, cb);
}

static int check_list_self(const px_config *c, const px_pool_spec *p, const px_strlist *l,
                           const char *role, char *err, size_t errlen) {
    for (size_t i = 0; i < l->n; i++)
        if (px_config_url_is_self(c, l->v[i])) {
            snprintf(err, errlen,
                     "%s%s%s%s backend %s is this proxy's own listen address (--host %s "
                     "--port %lld): every request would loop through it",
                     p->name[0] ? "pool '" : "", p->name, p->name[0] ? "': " : "", role, l->v[i],
                     c->host, (long long)c->port);
            return -1;
        }
    return 0;
}

int px_config_check_pools(const px_config *c, const px_pool_spec *v, size_t n, int reloading,
                          char *err, size_t errlen) {
    for (size_t i = 0; i < n; i++) {
        const px_pool_spec *p = &v[i];
        if (check_list_self(c, p, &p->prefill, "prefill", err, errlen) < 0 ||
            check_list_self(c, p, &p->prefill_toy, "prefill", err, errlen) < 0 ||
            check_list_self(c, p, &p->decode, "decode", err, errlen) < 0 ||
            check_list_self(c, p, &p->decode_toy, "decode", err, errlen) < 0)
            return -1;
        if (!reloading || c->allow_empty_pools) continue;
        int need_p = !c->fallback_decode_only && !c->prefiller_from_header;
        const char *missing = !p->decode.n && !p->decode_toy.n               ? "decode"
                              : need_p && !p->prefill.n && !p->prefill_toy.n ? "prefill"
                                                                             : NULL;
        if (missing) {
            snprintf(err, errlen,
                     "%s%s%s has no %s backend: refused (--allow-empty-pools accepts it; "
                     "the running configuration stays)",
                     p->name[0] ? "pool '" : "the configuration", p->name, p->name[0] ? "'" : "",
                     missing);
            return -1;
        }
    }
    return 0;
}

int px_config_pool_for(const px_config *c, const char *model, size_t n) {
    for (size_t i = 0; i < c->npools; i++)
        for (size_t j = 0; j < c->pools[i].models.n; j++)
            if (strlen(c->pools[i].models.v[j]) == n && !memcmp(c->pools[i].models.v[j], model, n))
                return (int)i;
    return -1;
}

int px_cfg_validate_pools(px_config *c, char *err, size_t errlen) {
    if (!c->npools) return 0;
    if (c->prefill_urls.n || c->decode_urls.n || px_config_is_set(c, "prefiller-hosts") ||
        px_config_is_set(c, "decoder-hosts")) {
        snprintf(err, errlen,
                 "backends outside any pool (--prefill/--decode before the first "
                 "--pool, or the toy host lists) cannot be combined with pools: "
                 "give every backend inside a pool");
        return -1;
    }
    for (size_t i = 0; i < c->npools; i++) {
        px_pool_spec *p = &c->pools[i];
        char where[300];
        if (p->line)
            snprintf(where, sizeof where, "%s:%zu: pool '%s'", c->config_file, p->line, p->name);
        else
            snprintf(where, sizeof where, "--pool '%s'", p->name);
        if (!p->name[0]) {
            snprintf(err, errlen, "%s: a pool needs a name", where);
            return -1;
        }
        for (size_t j = 0; j < i; j++)
            if (!strcmp(c->pools[j].name, p->name)) {
                snprintf(err, errlen, "%s: two pools have this name", where);
                return -1;
            }
        if (!p->models.n) px_strlist_push(&p->models, p->name);
        for (size_t m = 0; m < p->models.n; m++) {
            const char *mo = p->models.v[m];
            int at = px_config_pool_for(c, mo, strlen(mo));
            if (at >= 0 && (size_t)at < i) {
                snprintf(err, errlen, "%s: model '%s' is served by pool '%s' already", where, mo,
                         c->pools[at].name);
                return -1;
            }
        }
    }
    return 0;
}
