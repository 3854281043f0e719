/* SPDX-License-Identifier: Apache-2.0 */
#include "sim/link.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"

#define SIM_LINKS_MAX 64

typedef struct sim_link {
    char peer[160];
    double delay_ms;
    double mb_per_s; /* 0: no cap */
    uint64_t busy_until_ns;
} sim_link;

struct sim_links {
    sim_link v[SIM_LINKS_MAX];
    size_t n;
};

static int parse_one(sim_link *k, const char *s, size_t len, char *err, size_t errlen) {
    char buf[256];
    if (len >= sizeof buf) {
        snprintf(err, errlen, "'%.*s...': too long", 40, s);
        return -1;
    }
    memcpy(buf, s, len);
    buf[len] = '\0';
    char *eq = strrchr(buf, '=');
    if (!eq || eq == buf || (size_t)(eq - buf) >= sizeof k->peer) {
        snprintf(err, errlen, "'%s': expected PEER=DELAY_MS[/MB_PER_S]", buf);
        return -1;
    }
    *eq = '\0';
    memcpy(k->peer, buf, (size_t)(eq - buf) + 1);
    char *end;
    k->delay_ms = strtod(eq + 1, &end);
    k->mb_per_s = 0;
    if (end == eq + 1 || !(k->delay_ms >= 0 && k->delay_ms <= 3600000)) goto bad;
    if (*end == '/') {
        char *e2;
        k->mb_per_s = strtod(end + 1, &e2);
        if (e2 == end + 1 || !(k->mb_per_s >= 0 && k->mb_per_s <= 1e9)) goto bad;
        end = e2;
    }
    if (*end) goto bad;
    return 0;
bad:
    snprintf(err, errlen, "'%s=%s': expected PEER=DELAY_MS[/MB_PER_S], numbers >= 0", k->peer,
             eq + 1);
    return -1;
}

sim_links *sim_links_parse(const char *spec, char *err, size_t errlen) {
    sim_links *l = px_xcalloc(1, sizeof *l);
    for (const char *p = spec ? spec : ""; *p;) {
        size_t len = strcspn(p, ",");
        if (len) {
            if (l->n == SIM_LINKS_MAX) {
                snprintf(err, errlen, "more than %d links", SIM_LINKS_MAX);
                free(l);
                return NULL;
            }
            if (parse_one(&l->v[l->n++], p, len, err, errlen) < 0) {
                free(l);
                return NULL;
            }
        }
        p += len + (p[len] == ',');
    }
    return l;
}

void sim_links_free(sim_links *l) {
    free(l);
}

static sim_link *find(sim_links *l, const char *name) {
    for (size_t i = 0; name && i < l->n; i++)
        if (!strcmp(l->v[i].peer, name)) return &l->v[i];
    return NULL;
}

uint64_t sim_link_land(sim_links *l, const char *engine_id, const char *host_port, uint64_t bytes,
                       uint64_t now_ns) {
    if (!l) return 0;
    sim_link *k = find(l, engine_id);
    if (!k) k = find(l, host_port);
    if (!k) k = find(l, "*");
    if (!k) return 0;
    /* The bytes cross after those sent on this link before them. */
    uint64_t start = k->busy_until_ns > now_ns ? k->busy_until_ns : now_ns;
    uint64_t xfer = k->mb_per_s > 0 ? (uint64_t)((double)bytes / (k->mb_per_s * 1e6) * 1e9) : 0;
    k->busy_until_ns = start + xfer;
    return k->busy_until_ns + (uint64_t)(k->delay_ms * 1e6);
}
