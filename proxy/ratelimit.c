/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/ratelimit.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"

void px_bucket_init(px_bucket *b, uint64_t per_minute) {
    atomic_init(&b->limit, 0);
    atomic_init(&b->interval_ns, 0);
    atomic_init(&b->tat, 0);
    px_bucket_set(b, per_minute);
}

void px_bucket_set(px_bucket *b, uint64_t per_minute) {
    uint64_t iv = per_minute ? PX_RL_WINDOW_NS / per_minute : 0;
    if (per_minute && !iv) iv = 1;
    /* The interval first: a take seeing the new limit never divides by a
     * stale zero interval. */
    atomic_store(&b->interval_ns, iv);
    atomic_store(&b->limit, per_minute);
}

/* Where the bucket's TAT stands for a take at `now`: never in the past. */
static uint64_t base_of(uint64_t tat, uint64_t now) {
    return tat > now ? tat : now;
}

int px_bucket_take(px_bucket *b, uint64_t now, uint64_t n, uint64_t *retry_ns) {
    uint64_t iv = atomic_load_explicit(&b->interval_ns, memory_order_relaxed);
    if (!atomic_load_explicit(&b->limit, memory_order_relaxed) || !iv) return 1;
    uint64_t tat = atomic_load_explicit(&b->tat, memory_order_relaxed);
    for (;;) {
        uint64_t next = base_of(tat, now) + n * iv;
        if (next > now + PX_RL_WINDOW_NS) {
            if (retry_ns) *retry_ns = next - (now + PX_RL_WINDOW_NS);
            return 0;
        }
        if (atomic_compare_exchange_weak_explicit(&b->tat, &tat, next, memory_order_relaxed,
                                                  memory_order_relaxed))
            return 1;
    }
}

void px_bucket_charge(px_bucket *b, uint64_t now, uint64_t n) {
    uint64_t iv = atomic_load_explicit(&b->interval_ns, memory_order_relaxed);
    if (!atomic_load_explicit(&b->limit, memory_order_relaxed) || !iv || !n) return;
    uint64_t tat = atomic_load_explicit(&b->tat, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(&b->tat, &tat, base_of(tat, now) + n * iv,
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

uint64_t px_bucket_remaining(px_bucket *b, uint64_t now) {
    uint64_t limit = atomic_load_explicit(&b->limit, memory_order_relaxed);
    uint64_t iv = atomic_load_explicit(&b->interval_ns, memory_order_relaxed);
    if (!limit || !iv) return 0;
    uint64_t base = base_of(atomic_load_explicit(&b->tat, memory_order_relaxed), now);
    if (base >= now + PX_RL_WINDOW_NS) return 0;
    uint64_t left = (now + PX_RL_WINDOW_NS - base) / iv;
    return left > limit ? limit : left;
}

uint64_t px_bucket_reset_ns(px_bucket *b, uint64_t now) {
    return base_of(atomic_load_explicit(&b->tat, memory_order_relaxed), now) - now;
}

static int parse_u64(const char *s, uint64_t max, uint64_t *out) {
    char *end;
    if (*s < '0' || *s > '9') return -1;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || v > max) return -1;
    *out = v;
    return 0;
}

/* One spec "NAME[:weight=W][:rpm=N][:tpm=N]" into t. */
static int parse_one(const char *spec, px_tenant *t, char *err, size_t errlen) {
    char buf[256];
    if (strlen(spec) >= sizeof buf) {
        snprintf(err, errlen, "--tenant '%.40s...': longer than %zu bytes", spec, sizeof buf - 1);
        return -1;
    }
    snprintf(buf, sizeof buf, "%s", spec);
    char *save = NULL;
    char *name = strtok_r(buf, ":", &save);
    if (!name || !*name || spec[0] == ':') {
        snprintf(err, errlen, "--tenant '%s': expected NAME[:weight=W][:rpm=N][:tpm=N]", spec);
        return -1;
    }
    uint64_t weight = 1, rpm = 0, tpm = 0;
    long long floor = 0;
    int has_floor = 0;
    uint64_t seen = 0;
    for (char *kv = strtok_r(NULL, ":", &save); kv; kv = strtok_r(NULL, ":", &save)) {
        char *eq = strchr(kv, '=');
        uint64_t *dst = NULL, max = 0;
        if (eq && (size_t)(eq - kv) == 5 && !strncmp(kv, "floor", 5)) {
            char *end;
            errno = 0;
            floor = strtoll(eq + 1, &end, 10);
            if (!eq[1] || *end || errno || has_floor) {
                snprintf(err, errlen, "--tenant '%s': '%s' is not an integer priority%s", spec,
                         kv, has_floor ? " (given twice)" : "");
                return -1;
            }
            has_floor = 1;
            continue;
        }
        if (eq && (size_t)(eq - kv) == 6 && !strncmp(kv, "weight", 6))
            dst = &weight, max = 1000;
        else if (eq && (size_t)(eq - kv) == 3 && !strncmp(kv, "rpm", 3))
            dst = &rpm, max = 1000000000;
        else if (eq && (size_t)(eq - kv) == 3 && !strncmp(kv, "tpm", 3))
            dst = &tpm, max = 1000000000000ULL;
        if (!dst) {
            snprintf(err, errlen,
                     "--tenant '%s': unknown setting '%s' (weight=, rpm=, tpm=, floor=)", spec, kv);
            return -1;
        }
        uint64_t bit = dst == &weight ? 1 : dst == &rpm ? 2 : 4;
        if (seen & bit) {
            snprintf(err, errlen, "--tenant '%s': '%.*s' is given twice", spec,
                     (int)(eq - kv), kv);
            return -1;
        }
        seen |= bit;
        if (parse_u64(eq + 1, max, dst) < 0 || (dst == &weight && weight == 0)) {
            snprintf(err, errlen, "--tenant '%s': '%s' is not an integer in %d..%llu", spec, kv,
                     dst == &weight ? 1 : 0, (unsigned long long)max);
            return -1;
        }
    }
    t->name = px_xstrdup(name);
    t->weight = (uint32_t)weight;
    t->live = 1;
    atomic_init(&t->floor, floor);
    atomic_init(&t->has_floor, has_floor);
    px_bucket_init(&t->rpm, rpm);
    px_bucket_init(&t->tpm, tpm);
    return 0;
}

int px_tenant_spec_check(const char *spec, char *err, size_t errlen) {
    px_tenant t = {0};
    if (parse_one(spec, &t, err, errlen) < 0) return -1;
    free(t.name);
    return 0;
}

/* The name of a --tenant spec that sets the default tenant's settings. */
#define DEFAULT_NAME "default"

int px_tenants_parse(char *const *specs, size_t n, px_tenants *t, char *err, size_t errlen) {
    px_tenant *v = px_xcalloc(n + 1, sizeof *v);
    px_tenant def = {0};
    int has_def = 0;
    size_t m = 0; /* named tenants parsed into v[0..m) */
    for (size_t i = 0; i < n; i++) {
        px_tenant one = {0};
        int bad = parse_one(specs[i], &one, err, errlen) < 0;
        if (!bad && !strcmp(one.name, DEFAULT_NAME)) {
            if (has_def) {
                snprintf(err, errlen, "--tenant '%s': tenant '%s' is defined twice", specs[i],
                         one.name);
                bad = 1;
            }
            free(def.name);
            def = one;
            has_def = 1;
        } else if (!bad) {
            v[m++] = one;
            for (size_t j = 0; !bad && j + 1 < m; j++)
                if (!strcmp(v[j].name, one.name)) {
                    snprintf(err, errlen, "--tenant '%s': tenant '%s' is defined twice",
                             specs[i], one.name);
                    bad = 1;
                }
        }
        if (bad) {
            for (size_t j = 0; j < m; j++)
                free(v[j].name);
            free(def.name);
            free(v);
            return -1;
        }
    }
    /* The default tenant: weight 1 and no limits unless a "default" spec
     * says otherwise. Its name stays "" (requests never name it). */
    free(def.name);
    v[m].name = px_xstrdup("");
    v[m].weight = has_def ? def.weight : 1;
    v[m].live = 1;
    atomic_init(&v[m].floor, has_def ? atomic_load(&def.floor) : 0);
    atomic_init(&v[m].has_floor, has_def ? atomic_load(&def.has_floor) : 0);
    px_bucket_init(&v[m].rpm, has_def ? atomic_load(&def.rpm.limit) : 0);
    px_bucket_init(&v[m].tpm, has_def ? atomic_load(&def.tpm.limit) : 0);
    t->v = v;
    t->cap = m;
    atomic_init(&t->n, m);
    return 0;
}

void px_tenants_cleanup(px_tenants *t) {
    if (!t->v) return;
    size_t n = atomic_load(&t->n);
    for (size_t i = 0; i < n; i++)
        free(t->v[i].name);
    free(t->v[t->cap].name);
    free(t->v);
    t->v = NULL;
    t->cap = 0;
    atomic_store(&t->n, 0);
}

/* Copies a tenant's settings into a slot in use. */
static void copy_settings(px_tenant *dst, const px_tenant *src) {
    px_bucket_set(&dst->rpm, atomic_load(&src->rpm.limit));
    px_bucket_set(&dst->tpm, atomic_load(&src->tpm.limit));
    atomic_store(&dst->weight, atomic_load(&src->weight));
    atomic_store(&dst->floor, atomic_load(&src->floor));
    atomic_store(&dst->has_floor, atomic_load(&src->has_floor));
}

void px_tenants_reserve(px_tenants *t, size_t cap) {
    if (cap <= t->cap) return;
    size_t n = atomic_load(&t->n);
    px_tenant *v = px_xcalloc(cap + 1, sizeof *v);
    for (size_t i = 0; i < n; i++) {
        v[i].name = t->v[i].name;
        copy_settings(&v[i], &t->v[i]);
        v[i].live = atomic_load(&t->v[i].live);
    }
    v[cap].name = t->v[t->cap].name;
    copy_settings(&v[cap], &t->v[t->cap]);
    v[cap].live = 1;
    free(t->v);
    t->v = v;
    t->cap = cap;
}

/* The slot named name among the first n, live or not; n when none. */
static size_t slot_of(const px_tenants *t, size_t n, const char *name, size_t len) {
    for (size_t i = 0; i < n; i++)
        if (strlen(t->v[i].name) == len && !memcmp(t->v[i].name, name, len)) return i;
    return n;
}

size_t px_tenants_find(const px_tenants *t, const char *name, size_t len) {
    if (!name) return t->cap;
    size_t n = atomic_load_explicit(&t->n, memory_order_acquire);
    size_t i = slot_of(t, n, name, len);
    return i < n && atomic_load_explicit(&t->v[i].live, memory_order_relaxed) ? i : t->cap;
}

int px_tenants_apply(px_tenants *t, const px_tenants *nt, uint32_t *weights, size_t *added,
                     size_t *removed, char *err, size_t errlen) {
    size_t n = atomic_load(&t->n), nn = atomic_load(&nt->n), fresh = 0, gone = 0, back = 0;
    for (size_t j = 0; j < nn; j++)
        if (slot_of(t, n, nt->v[j].name, strlen(nt->v[j].name)) == n) fresh++;
    if (n + fresh > t->cap) {
        snprintf(err, errlen,
                 "%zu new tenants do not fit: %zu of %zu tenant slots are used (removed tenants "
                 "keep theirs until a restart)",
                 fresh, n, t->cap);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        px_tenant *d = &t->v[i];
        size_t j = slot_of(nt, nn, d->name, strlen(d->name));
        if (j < nn) {
            copy_settings(d, &nt->v[j]);
            if (!atomic_load(&d->live)) back++;
            atomic_store(&d->live, 1);
        } else {
            if (atomic_load(&d->live)) gone++;
            atomic_store(&d->live, 0);
            /* Weight 1, no limits (its queued and running requests keep
             * their index; the default tenant's limits are not theirs). */
            px_bucket_set(&d->rpm, 0);
            px_bucket_set(&d->tpm, 0);
            atomic_store(&d->weight, 1);
            atomic_store(&d->floor, atomic_load(&nt->v[nt->cap].floor));
            atomic_store(&d->has_floor, atomic_load(&nt->v[nt->cap].has_floor));
        }
        __atomic_store_n(&weights[i], atomic_load(&d->weight), __ATOMIC_RELAXED);
    }
    for (size_t j = 0; j < nn; j++) {
        if (slot_of(t, n, nt->v[j].name, strlen(nt->v[j].name)) < n) continue;
        px_tenant *d = &t->v[n];
        d->name = px_xstrdup(nt->v[j].name);
        px_bucket_init(&d->rpm, 0);
        px_bucket_init(&d->tpm, 0);
        copy_settings(d, &nt->v[j]);
        atomic_store(&d->live, 1);
        __atomic_store_n(&weights[n], atomic_load(&d->weight), __ATOMIC_RELAXED);
        /* Published: workers reading n with acquire see the slot whole. */
        atomic_store_explicit(&t->n, ++n, memory_order_release);
    }
    /* The default tenant takes the settings of nt's ("default" spec or
     * none: weight 1, no limits). */
    copy_settings(&t->v[t->cap], &nt->v[nt->cap]);
    __atomic_store_n(&weights[t->cap], atomic_load(&t->v[t->cap].weight), __ATOMIC_RELAXED);
    if (added) *added = fresh + back;
    if (removed) *removed = gone;
    return 0;
}

void px_bucket_refund(px_bucket *b, uint64_t now, uint64_t n) {
    uint64_t iv = atomic_load_explicit(&b->interval_ns, memory_order_relaxed);
    if (!atomic_load_explicit(&b->limit, memory_order_relaxed) || !iv || !n) return;
    uint64_t tat = atomic_load_explicit(&b->tat, memory_order_relaxed), next;
    do {
        if (tat <= now) return; /* full already */
        next = tat - now > n * iv ? tat - n * iv : now;
    } while (!atomic_compare_exchange_weak_explicit(&b->tat, &tat, next, memory_order_relaxed,
                                                    memory_order_relaxed));
}

px_rl_verdict px_tenant_admit(px_tenant *t, uint64_t now, uint64_t tokens, uint64_t *retry_ns) {
    uint64_t tl = atomic_load_explicit(&t->tpm.limit, memory_order_relaxed);
    if (tl && tokens > tl) return PX_RL_TOO_LARGE;
    if (tl && !tokens && px_bucket_remaining(&t->tpm, now) == 0) {
        uint64_t base = base_of(atomic_load_explicit(&t->tpm.tat, memory_order_relaxed), now);
        *retry_ns = base - (now + PX_RL_WINDOW_NS) + t->tpm.interval_ns;
        return PX_RL_TOKENS;
    }
    if (tl && tokens && !px_bucket_take(&t->tpm, now, tokens, retry_ns)) return PX_RL_TOKENS;
    if (!px_bucket_take(&t->rpm, now, 1, retry_ns)) {
        if (tl && tokens) px_bucket_refund(&t->tpm, now, tokens);
        return PX_RL_REQUESTS;
    }
    return PX_RL_OK;
}

void px_tenant_settle(px_tenant *t, uint64_t now, uint64_t reserved, uint64_t used) {
    if (used > reserved)
        px_bucket_charge(&t->tpm, now, used - reserved);
    else
        px_bucket_refund(&t->tpm, now, reserved - used);
}

/* OpenAI's reset spelling: "1s", "6m0s", "20ms". */
/* Appends the NUL-terminated text s at *o, within end; 0 when it did not fit. */
static int put(char **o, const char *end, const char *s) {
    size_t n = strlen(s);
    if ((size_t)(end - *o) < n) return 0;
    memcpy(*o, s, n);
    *o += n;
    return 1;
}

/* Appends v in decimal (px_u64_dec, no printf). */
static int put_u64(char **o, const char *end, uint64_t v) {
    char d[24];
    d[sizeof d - 1] = '\0';
    return put(o, end, px_u64_dec(d + sizeof d - 1, v));
}

/* The time until a bucket is full again, as OpenAI writes it: "500ms",
 * "1.5s" (three digits), "1m0s". */
static int put_reset(char **o, const char *end, uint64_t ns) {
    uint64_t ms = (ns + 999999) / 1000000;
    if (ms < 1000) return put_u64(o, end, ms) && put(o, end, "ms");
    if (ms >= 60000)
        return put_u64(o, end, ms / 60000) && put(o, end, "m") &&
               put_u64(o, end, ms % 60000 / 1000) && put(o, end, "s");
    char g[32];
    snprintf(g, sizeof g, "%.3gs", (double)ms / 1000);
    return put(o, end, g);
}

/* Every answer to a tenant with limits carries these lines: formatted by
 * hand, since snprintf's parsing was most of their cost (7,000
 * instructions a request for both groups). */
void px_tenant_headers(px_tenant *t, uint64_t now, char *out, size_t cap) {
    size_t len = strlen(out);
    const struct {
        px_bucket *b;
        const char *what;
    } rows[] = {{&t->rpm, "requests"}, {&t->tpm, "tokens"}};
    for (size_t i = 0; i < 2; i++) {
        if (!rows[i].b->limit || len >= cap) continue;
        char *o = out + len;
        const char *end = out + cap - 1; /* room for the NUL */
        const char *w = rows[i].what;
        if (!(put(&o, end, "x-ratelimit-limit-") && put(&o, end, w) && put(&o, end, ": ") &&
              put_u64(&o, end, rows[i].b->limit) && put(&o, end, "\r\nx-ratelimit-remaining-") &&
              put(&o, end, w) && put(&o, end, ": ") &&
              put_u64(&o, end, px_bucket_remaining(rows[i].b, now)) &&
              put(&o, end, "\r\nx-ratelimit-reset-") && put(&o, end, w) && put(&o, end, ": ") &&
              put_reset(&o, end, px_bucket_reset_ns(rows[i].b, now)) && put(&o, end, "\r\n"))) {
            out[len] = 0; /* never half a header line */
            return;
        }
        *o = 0;
        len = (size_t)(o - out);
    }
}

/* The last total_tokens number in p[0..n). */
static void scan(const char *p, size_t n, uint64_t *total) {
    static const char key[] = "\"total_tokens\"";
    const size_t klen = sizeof key - 1;
    const char *end = p + n;
    for (const char *q = p; (size_t)(end - q) >= klen;) {
        const char *hit = memmem(q, (size_t)(end - q), key, klen);
        if (!hit) return;
        const char *s = hit + klen;
        while (s < end && (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r'))
            s++;
        if (s < end && *s == ':') {
            s++;
            while (s < end && (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r'))
                s++;
            uint64_t v = 0;
            const char *d = s;
            while (s < end && *s >= '0' && *s <= '9' && s - d < 18)
                v = v * 10 + (uint64_t)(*s++ - '0');
            if (s > d) *total = v;
        }
        q = hit + klen;
    }
}

void px_tokscan_feed(px_tokscan *s, const char *p, size_t n) {
    /* Across the seam: the tail kept from before and the start of p. */
    char seam[sizeof s->tail + 48];
    size_t head = n < 48 ? n : 48;
    memcpy(seam, s->tail, s->ntail);
    memcpy(seam + s->ntail, p, head);
    scan(seam, s->ntail + head, &s->total);
    scan(p, n, &s->total);
    /* Keep the last bytes for the next seam. */
    size_t keep = sizeof s->tail;
    if (n >= keep) {
        memcpy(s->tail, p + n - keep, keep);
        s->ntail = keep;
    } else {
        size_t old = s->ntail + n > keep ? keep - n : s->ntail;
        memmove(s->tail, s->tail + s->ntail - old, old);
        memcpy(s->tail + old, p, n);
        s->ntail = old + n;
    }
}
