/* SPDX-License-Identifier: Apache-2.0 */
/* The latency policy's decision cost (issue 42), as kvindex_bench times
 * kv_aware's: a request's prefill and decode picks under kv_aware, and
 * under latency (the two pools' snapshots with the KV index's cached
 * tokens, the plan over every pair, the two picks of the planned members),
 * timed side by side in one loop, with the model taught and, in a second
 * pass, another thread observing answers into it all the while (workers
 * publishing lines as others read them).
 *
 *   build/bin/latency_bench [prefills] [decodes] [prompt_tokens] [decisions]
 *
 * Prints one line of key=value figures: each decision's p50 and p99 in
 * microseconds and the latency decision's added cost (its time less
 * kv_aware's, per decision, then p50 and p99). Not a test: nothing is
 * asserted. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/hash.h"
#include "proxy/kvindex.h"
#include "proxy/latency.h"
#include "proxy/route.h"

#define BS 16

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, size_t n, double p) {
    qsort(v, n, sizeof *v, cmp_d);
    return v[(size_t)(p * (double)(n - 1))];
}

static void pool_make(px_pool *p, const char *role, px_policy pol, int base, size_t n) {
    px_pool_cfg pc = {.policy = pol,
                      .unhealthy_after = 3,
                      .healthy_after = 1,
                      .load_factor = 1.25,
                      .kv_cache_weight = 1,
                      .kv_load_weight = 1};
    px_pool_init(p, role, &pc);
    for (size_t b = 0; b < n; b++) {
        char url[80];
        snprintf(url, sizeof url, "http://10.0.%d.%zu:8000", base, b + 1);
        px_pool_add(p, url, NULL);
    }
    px_pool_seal(p);
}

/* Observations as workers make them, until stop. */
typedef struct observer {
    px_latmodel *m;
    size_t np, nd;
    atomic_int stop;
    size_t n;
} observer;

static uint64_t key_of(int base, size_t i) {
    char name[64];
    snprintf(name, sizeof name, "10.0.%d.%zu:8000", base, i + 1);
    return px_hash64(name, strlen(name));
}

static void *observe_main(void *arg) {
    observer *o = arg;
    uint64_t t = 1000000000ull;
    for (size_t i = 0; !atomic_load(&o->stop); i++, t += 1000000) {
        size_t p = i % o->np, d = i % o->nd;
        double x = 500 + (double)(i % 1000);
        px_lat_observe(o->m, key_of(1, p), "p", PX_LAT_PREFILL, x, 0.005 + x * 1e-4 * (1 + p % 2),
                       t);
        px_lat_observe(o->m, key_of(2, d), "d", PX_LAT_DECODE, 0, 0.01, t);
        px_lat_observe_pair(o->m, key_of(1, p), key_of(2, d), "p", "d", x, 0.001 + x * 1e-6, t);
        o->n += 3;
    }
    return NULL;
}

/* One request's decisions under both policies; times into kv[i], lat[i]. */
static void decide(px_pool *kp, px_pool *kd, px_pool *lp, px_pool *ld, px_kvindex *x,
                   px_latmodel *m, const uint32_t *tok, size_t ntok, double *kv, double *lat) {
    size_t cached = 0;
    double a = now_s();
    px_pick k = {.kv = x, .tok = tok, .ntok = ntok, .cached = &cached};
    px_backend *p = px_pool_pick(kp, &k, NULL);
    px_backend *d = px_pool_pick(kd, &k, NULL);
    double b = now_s();
    px_backend_charge(p, -(long)(ntok - cached));
    px_backend_done(kp, p, PX_OUT_OK);
    px_backend_charge(d, -(long)ntok);
    px_backend_done(kd, d, PX_OUT_OK);

    double c = now_s();
    px_lat_cand P[64], D[64];
    px_pick q = {.kv = x, .tok = tok, .ntok = ntok};
    px_kv_prompt pr;
    px_kv_prompt_init(&pr, tok, ntok, 0);
    size_t np = px_pool_snapshot(lp, &q, &pr, P, 64), nd = px_pool_snapshot(ld, &q, &pr, D, 64);
    px_kv_prompt_cleanup(&pr);
    px_lat_plan plan;
    px_lat_plan_make(m, P, np, D, nd, ntok, 0, &plan);
    px_pick qp = {.ntok = ntok, .prefer = plan.pkey, .prefer_cached = plan.p_cached};
    px_pick qd = {.ntok = ntok, .prefer = plan.dkey, .prefer_cached = ntok};
    px_backend *lp_b = px_pool_pick(lp, &qp, NULL);
    px_backend *ld_b = px_pool_pick(ld, &qd, NULL);
    double e = now_s();
    px_backend_charge(lp_b, -(long)(ntok - plan.p_cached));
    px_backend_done(lp, lp_b, PX_OUT_OK);
    px_backend_done(ld, ld_b, PX_OUT_OK);
    *kv = b - a;
    *lat = e - c;
}

int main(int argc, char **argv) {
    size_t np = argc > 1 ? strtoul(argv[1], NULL, 10) : 4;
    size_t nd = argc > 2 ? strtoul(argv[2], NULL, 10) : 4;
    size_t ntok = argc > 3 ? strtoul(argv[3], NULL, 10) : 2048;
    size_t n = argc > 4 ? strtoul(argv[4], NULL, 10) : 20000;
    if (!np || !nd || np > 64 || nd > 64 || ntok < 2 * BS || n < 100) {
        fprintf(stderr, "usage: latency_bench [prefills 1..64] [decodes 1..64] "
                        "[prompt_tokens >= 32] [decisions >= 100]\n");
        return 2;
    }
    /* Each prefill caches a different share of the prompt's opening: the
     * index is asked for every candidate. */
    px_kvindex *x = px_kvindex_create(1 << 20, 256);
    uint32_t *tok = malloc(ntok * sizeof *tok);
    for (size_t j = 0; j < ntok; j++)
        tok[j] = 1000 + (uint32_t)j;
    uint64_t eh = 1;
    for (size_t b = 0; b < np; b++) {
        char name[64];
        snprintf(name, sizeof name, "10.0.1.%zu:8000", b + 1);
        int slot = px_kvindex_slot(x, name, 1);
        size_t blocks = (ntok / BS) * (b + 1) / (np + 1);
        for (size_t k = 0; k < blocks; k++, eh++)
            px_kvindex_store(x, slot, &eh, 1, k > 0, eh - 1, tok + k * BS, BS, NULL, NULL);
    }
    px_pool kp, kd, lp, ld;
    pool_make(&kp, "prefill", PX_POLICY_KV_AWARE, 1, np);
    pool_make(&kd, "decode", PX_POLICY_KV_AWARE, 2, nd);
    pool_make(&lp, "prefill", PX_POLICY_LATENCY, 1, np);
    pool_make(&ld, "decode", PX_POLICY_LATENCY, 2, nd);
    px_latmodel *m = px_latmodel_create(256, 1024, 0.95, 30);
    observer ob = {.m = m, .np = np, .nd = nd};
    /* Taught: every engine and pair known. */
    for (size_t i = 0; i < 4 * np * nd; i++) {
        size_t p = i % np, d = (i / np) % nd;
        double xx = 500 + (double)(i % 100) * 10;
        px_lat_observe(m, key_of(1, p), "p", PX_LAT_PREFILL, xx, xx * 1e-4, 1000000000ull + i);
        px_lat_observe(m, key_of(2, d), "d", PX_LAT_DECODE, 0, 0.01, 1000000000ull + i);
        px_lat_observe(m, key_of(2, d), "d", PX_LAT_LOCAL, xx, xx * 3e-4, 1000000000ull + i);
        px_lat_observe_pair(m, key_of(1, p), key_of(2, d), "p", "d", xx, xx * 1e-6,
                            1000000000ull + i);
    }
    double *kv = malloc(n * sizeof *kv), *lat = malloc(n * sizeof *lat),
           *add = malloc(n * sizeof *add);
    double r[2][6];
    for (int pass = 0; pass < 2; pass++) {
        pthread_t th;
        if (pass) {
            atomic_store(&ob.stop, 0);
            pthread_create(&th, NULL, observe_main, &ob);
        }
        for (size_t i = 0; i < n; i++) {
            decide(&kp, &kd, &lp, &ld, x, m, tok, ntok, &kv[i], &lat[i]);
            add[i] = lat[i] - kv[i];
        }
        if (pass) {
            atomic_store(&ob.stop, 1);
            pthread_join(th, NULL);
        }
        r[pass][0] = pct(kv, n, 0.5) * 1e6;
        r[pass][1] = pct(kv, n, 0.99) * 1e6;
        r[pass][2] = pct(lat, n, 0.5) * 1e6;
        r[pass][3] = pct(lat, n, 0.99) * 1e6;
        r[pass][4] = pct(add, n, 0.5) * 1e6;
        r[pass][5] = pct(add, n, 0.99) * 1e6;
    }
    printf("prefills=%zu decodes=%zu prompt_tokens=%zu decisions=%zu "
           "kv_aware_p50_us=%.2f kv_aware_p99_us=%.2f latency_p50_us=%.2f latency_p99_us=%.2f "
           "added_p50_us=%.2f added_p99_us=%.2f "
           "observing_kv_aware_p99_us=%.2f observing_latency_p50_us=%.2f "
           "observing_latency_p99_us=%.2f observing_added_p50_us=%.2f "
           "observing_added_p99_us=%.2f observations=%zu\n",
           np, nd, ntok, n, r[0][0], r[0][1], r[0][2], r[0][3], r[0][4], r[0][5], r[1][1], r[1][2],
           r[1][3], r[1][4], r[1][5], ob.n);
    free(kv);
    free(lat);
    free(add);
    free(tok);
    px_latmodel_destroy(m);
    px_pool_cleanup(&kp);
    px_pool_cleanup(&kd);
    px_pool_cleanup(&lp);
    px_pool_cleanup(&ld);
    px_kvindex_destroy(x);
    return 0;
}
