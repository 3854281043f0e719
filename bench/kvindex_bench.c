/* SPDX-License-Identifier: Apache-2.0 */
/* The KV index's figures (issue 24): event ingestion in blocks per second
 * on one core (msgpack batches decoded and applied, as the subscriber does),
 * memory per indexed block, and the kv_aware routing decision's time (p50,
 * p99) with a million blocks indexed over the pool's backends.
 *
 *   build/bin/kvindex_bench [total_blocks] [backends] [prompt_tokens]
 *
 * Ingestion is timed three ways over the same packed batches: decode only,
 * insert only (from decoded arrays) and both (the subscriber's path), each
 * in wall time and in the thread's CPU time (what one core spends, whatever
 * else the machine runs). Prints one line of key=value figures. Not a test:
 * nothing is asserted. */
#include <msgpack.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "proxy/kvevents.h"
#include "proxy/kvindex.h"
#include "proxy/route.h"

#define BS 16
#define PER_EVENT 16 /* blocks per BlockStored, as a prefill of 256 tokens stores */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static long rss_kb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6)) kb = strtol(line + 6, NULL, 10);
    if (f) fclose(f);
    return kb;
}

/* Decoded batches kept for the insert-only phase: blocks appended. */
typedef struct capture {
    uint64_t *hashes, *parent;
    int *has_parent;
    uint32_t *tok;
    size_t nev, nblk;
} capture;

static void on_capture(void *arg, const px_kv_stored *s) {
    capture *c = arg;
    memcpy(c->hashes + c->nblk, s->hashes, s->n * sizeof *s->hashes);
    memcpy(c->tok + c->nblk * BS, s->tok, s->n * BS * sizeof *s->tok);
    c->parent[c->nev] = s->parent;
    c->has_parent[c->nev++] = s->has_parent;
    c->nblk += s->n;
}

static void on_count(void *arg, const px_kv_stored *s) {
    *(size_t *)arg += s->n;
}

typedef struct store_ctx {
    px_kvindex *x;
    int slot;
} store_ctx;

static void on_store(void *arg, const px_kv_stored *s) {
    store_ctx *c = arg;
    px_kvindex_store(c->x, c->slot, s->hashes, s->n, s->has_parent, s->parent, s->tok,
                     s->block_size, s->extra, NULL);
}

static double cpu_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* Ingestion that runs while picks are timed: stores and removes chains on
 * backend 0 for as long as `stop` is 0. */
typedef struct churn {
    px_kvindex *x;
    atomic_int stop;
    size_t blocks;
} churn;

static void *churn_main(void *arg) {
    churn *c = arg;
    uint32_t tok[PER_EVENT * BS];
    uint64_t eh[PER_EVENT];
    uint64_t h = 1ull << 60;
    int slot = px_kvindex_slot(c->x, "10.0.0.1:8000", 0);
    while (!atomic_load(&c->stop)) {
        for (int i = 0; i < PER_EVENT; i++)
            eh[i] = h + (uint64_t)i;
        for (int i = 0; i < PER_EVENT * BS; i++)
            tok[i] = (uint32_t)(h >> 4) + (uint32_t)i;
        px_kvindex_store(c->x, slot, eh, PER_EVENT, 0, 0, tok, BS, NULL, NULL);
        px_kvindex_remove(c->x, slot, eh, PER_EVENT);
        h += PER_EVENT;
        c->blocks += PER_EVENT;
    }
    return NULL;
}

/* One batch: a chain of PER_EVENT blocks continuing `parent`. */
static void pack_batch(msgpack_sbuffer *sb, uint64_t first_hash, int has_parent, uint64_t parent,
                       uint32_t tok0) {
    msgpack_packer pk;
    msgpack_sbuffer_clear(sb);
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, 1.0);
    msgpack_pack_array(&pk, 1);
    msgpack_pack_array(&pk, 7);
    msgpack_pack_str(&pk, 11);
    msgpack_pack_str_body(&pk, "BlockStored", 11);
    msgpack_pack_array(&pk, PER_EVENT);
    for (int i = 0; i < PER_EVENT; i++)
        msgpack_pack_uint64(&pk, first_hash + (uint64_t)i);
    if (has_parent)
        msgpack_pack_uint64(&pk, parent);
    else
        msgpack_pack_nil(&pk);
    msgpack_pack_array(&pk, PER_EVENT * BS);
    for (int i = 0; i < PER_EVENT * BS; i++)
        msgpack_pack_uint32(&pk, tok0 + (uint32_t)i);
    msgpack_pack_int(&pk, BS);
    msgpack_pack_nil(&pk);
    msgpack_pack_str(&pk, 3);
    msgpack_pack_str_body(&pk, "GPU", 3);
    msgpack_pack_int(&pk, 0);
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* PICKS kv_aware decisions, their times in lat[]; returns the cache hits. */
static size_t picks(px_pool *pool, px_kvindex *x, uint32_t *tok, size_t ptok, size_t per,
                    double *lat, int n) {
    size_t hits = 0;
    for (int i = 0; i < n; i++) {
        /* Sequence s's tokens: seq_tok values of the ingestion above. */
        uint32_t base = 1000000u * (uint32_t)(1 + (size_t)i % (per / (8 * PER_EVENT)));
        for (size_t j = 0; j < ptok; j++)
            tok[j] = j < 8 * PER_EVENT * BS ? base + (uint32_t)j : 7u + (uint32_t)(i + (int)j);
        size_t cached = 0;
        px_pick k = {.kv = x, .tok = tok, .ntok = ptok, .cached = &cached};
        double a = now_s();
        px_backend *b = px_pool_pick(pool, &k, NULL);
        lat[i] = now_s() - a;
        hits += cached > 0;
        px_backend_charge(b, -(long)ptok);
        px_backend_done(pool, b, PX_OUT_OK);
    }
    return hits;
}

int main(int argc, char **argv) {
    size_t total = argc > 1 ? strtoul(argv[1], NULL, 10) : 1000000;
    size_t nb = argc > 2 ? strtoul(argv[2], NULL, 10) : 4;
    size_t ptok = argc > 3 ? strtoul(argv[3], NULL, 10) : 4096;
    char name[64];
    /* Every backend holds total/nb blocks, stored as sequences of 8 events
     * of PER_EVENT blocks (prompts of 2048 tokens), packed up front. */
    msgpack_sbuffer sb, one;
    msgpack_sbuffer_init(&sb);
    msgpack_sbuffer_init(&one);
    size_t per = total / nb / PER_EVENT * PER_EVENT, nbatch = per / PER_EVENT * nb, blocks = 0;
    size_t *off = malloc((nbatch + 1) * sizeof *off);
    uint64_t h = 1;
    uint32_t seq_tok = 0;
    for (size_t b = 0, q = 0; b < nb; b++)
        for (size_t k = 0; k < per; k += PER_EVENT, q++) {
            int first = (k / PER_EVENT) % 8 == 0;
            if (first) seq_tok += 1000000;
            pack_batch(&one, h, !first, h - 1,
                       seq_tok + (uint32_t)((k / PER_EVENT) % 8 * PER_EVENT * BS));
            h += PER_EVENT;
            off[q] = sb.size;
            msgpack_sbuffer_write(&sb, one.data, one.size);
        }
    off[nbatch] = sb.size;
    size_t nbatch_per = per / PER_EVENT;
    char err[64];
    size_t bad = 0;
    /* Decoded once, untimed, for the insert-only phase. */
    capture cap = {malloc(nb * per * sizeof(uint64_t)), malloc(nbatch * sizeof(uint64_t)),
                   malloc(nbatch * sizeof(int)), malloc(nb * per * BS * sizeof(uint32_t)), 0, 0};
    px_kv_sink csink = {&cap, on_capture, NULL, NULL};
    for (size_t q = 0; q < nbatch; q++)
        px_kv_decode(sb.data + off[q], off[q + 1] - off[q], &csink, &bad, err, sizeof err);
    /* Decode only. */
    size_t counted = 0;
    px_kv_sink count = {&counted, on_count, NULL, NULL};
    double w0 = now_s(), c0 = cpu_s();
    for (size_t q = 0; q < nbatch; q++)
        px_kv_decode(sb.data + off[q], off[q + 1] - off[q], &count, &bad, err, sizeof err);
    double w_dec = now_s() - w0, c_dec = cpu_s() - c0;
    /* Insert only, from the decoded arrays. */
    px_kvindex *x2 = px_kvindex_create(total, nb);
    w0 = now_s(), c0 = cpu_s();
    for (size_t b = 0, q = 0, blk = 0; b < nb; b++) {
        snprintf(name, sizeof name, "10.0.0.%zu:8000", b + 1);
        int slot = px_kvindex_slot(x2, name, 1);
        for (size_t e = 0; e < nbatch_per; e++, q++, blk += PER_EVENT)
            px_kvindex_store(x2, slot, cap.hashes + blk, PER_EVENT, cap.has_parent[q],
                             cap.parent[q], cap.tok + blk * BS, BS, NULL, NULL);
    }
    double w_ins = now_s() - w0, c_ins = cpu_s() - c0;
    px_kvindex_destroy(x2);
    free(cap.hashes);
    free(cap.parent);
    free(cap.has_parent);
    free(cap.tok);
    /* Both, as the subscriber does: the index routing uses below. */
    long rss0 = rss_kb();
    px_kvindex *x = px_kvindex_create(total, nb);
    w0 = now_s(), c0 = cpu_s();
    for (size_t b = 0, q = 0; b < nb; b++) {
        snprintf(name, sizeof name, "10.0.0.%zu:8000", b + 1);
        store_ctx sc = {x, px_kvindex_slot(x, name, 1)};
        px_kv_sink sink = {&sc, on_store, NULL, NULL};
        for (size_t e = 0; e < nbatch_per; e++, q++) {
            px_kv_decode(sb.data + off[q], off[q + 1] - off[q], &sink, &bad, err, sizeof err);
            blocks += PER_EVENT;
        }
    }
    double t_ing = now_s() - w0, c_ing = cpu_s() - c0, bytes_in = (double)sb.size;
    free(off);
    msgpack_sbuffer_destroy(&one);
    px_kvindex_stats st;
    px_kvindex_totals(x, &st);
    long rss1 = rss_kb();

    /* Routing: a kv_aware pool of the nb backends; prompts sharing a
     * cached prefix of 2048 tokens on one backend, then uncached tokens. */
    px_pool_cfg pc = {.policy = PX_POLICY_KV_AWARE,
                      .unhealthy_after = 3,
                      .healthy_after = 1,
                      .load_factor = 1.25,
                      .kv_cache_weight = 1,
                      .kv_load_weight = 1};
    px_pool pool;
    px_pool_init(&pool, "prefill", &pc);
    for (size_t b = 0; b < nb; b++) {
        char url[80];
        snprintf(url, sizeof url, "http://10.0.0.%zu:8000", b + 1);
        px_pool_add(&pool, url, NULL);
    }
    px_pool_seal(&pool);
    uint32_t *tok = malloc(ptok * sizeof *tok);
    enum { PICKS = 20000 };
    double *lat = malloc(PICKS * sizeof *lat), *lat_w = malloc(PICKS * sizeof *lat_w);
    size_t hits = picks(&pool, x, tok, ptok, per, lat, PICKS);
    /* The same picks while another thread ingests into backend 0. */
    churn ch = {.x = x};
    pthread_t th;
    pthread_create(&th, NULL, churn_main, &ch);
    picks(&pool, x, tok, ptok, per, lat_w, PICKS);
    atomic_store(&ch.stop, 1);
    pthread_join(th, NULL);
    qsort(lat_w, PICKS, sizeof *lat_w, cmp_d);
    qsort(lat, PICKS, sizeof *lat, cmp_d);
    printf("blocks=%zu backends=%zu ingest_s=%.3f ingest_blocks_per_s=%.0f ingest_mb_per_s=%.1f "
           "ingest_cpu_blocks_per_s=%.0f decode_blocks_per_s=%.0f decode_cpu_blocks_per_s=%.0f "
           "insert_blocks_per_s=%.0f insert_cpu_blocks_per_s=%.0f "
           "index_bytes=%zu bytes_per_block=%.1f rss_bytes_per_block=%.1f prompt_tokens=%zu "
           "pick_p50_us=%.2f pick_p99_us=%.2f pick_cache_hits=%zu/%d "
           "pick_ingesting_p50_us=%.2f pick_ingesting_p99_us=%.2f ingesting_blocks=%zu\n",
           st.blocks, nb, t_ing, (double)blocks / t_ing, bytes_in / t_ing / 1e6,
           (double)blocks / c_ing, (double)counted / w_dec, (double)counted / c_dec,
           (double)cap.nblk / w_ins, (double)cap.nblk / c_ins, st.bytes,
           (double)st.bytes / (double)st.blocks, (double)(rss1 - rss0) * 1024.0 / (double)st.blocks,
           ptok, lat[PICKS / 2] * 1e6, lat[PICKS * 99 / 100] * 1e6, hits, PICKS,
           lat_w[PICKS / 2] * 1e6, lat_w[PICKS * 99 / 100] * 1e6, ch.blocks);
    free(lat);
    free(lat_w);
    free(tok);
    px_pool_cleanup(&pool);
    msgpack_sbuffer_destroy(&sb);
    px_kvindex_destroy(x);
    return 0;
}
