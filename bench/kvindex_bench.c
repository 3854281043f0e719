/* SPDX-License-Identifier: Apache-2.0 */
/* The KV index's figures (issue 24): event ingestion in blocks per second
 * on one core (msgpack batches decoded and applied, as the subscriber does),
 * memory per indexed block, and the kv_aware routing decision's time (p50,
 * p99) with a million blocks indexed over the pool's backends.
 *
 *   build/bin/kvindex_bench [total_blocks] [backends] [prompt_tokens]
 *
 * Prints one line of key=value figures. Not a test: nothing is asserted. */
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

/* The decoder's output of one batch, kept past the callback so that the
 * index insert is timed apart from the decoding. */
typedef struct sink_ctx {
    uint64_t hashes[PER_EVENT], parent;
    uint32_t tok[PER_EVENT * BS];
    size_t n, block_size;
    int has_parent;
} sink_ctx;

static void on_stored(void *arg, const px_kv_stored *s) {
    sink_ctx *c = arg;
    c->n = s->n < PER_EVENT ? s->n : PER_EVENT;
    memcpy(c->hashes, s->hashes, c->n * sizeof *c->hashes);
    memcpy(c->tok, s->tok, c->n * s->block_size * sizeof *c->tok);
    c->block_size = s->block_size;
    c->has_parent = s->has_parent;
    c->parent = s->parent;
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
    px_kvindex *x = px_kvindex_create(total, nb);
    char name[64];
    long rss0 = rss_kb();
    /* Ingestion: every backend holds total/nb blocks, stored as sequences
     * of 8 events of PER_EVENT blocks (prompts of 2048 tokens). */
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    size_t per = total / nb, blocks = 0;
    double t_dec = 0, t_ins = 0, bytes_in = 0;
    uint64_t h = 1;
    uint32_t seq_tok = 0;
    for (size_t b = 0; b < nb; b++) {
        snprintf(name, sizeof name, "10.0.0.%zu:8000", b + 1);
        int slot = px_kvindex_slot(x, name, 1);
        static sink_ctx c;
        px_kv_sink sink = {&c, on_stored, NULL, NULL};
        for (size_t k = 0; k < per; k += PER_EVENT) {
            int first = (k / PER_EVENT) % 8 == 0;
            if (first) seq_tok += 1000000;
            pack_batch(&sb, h, !first, h - 1,
                       seq_tok + (uint32_t)((k / PER_EVENT) % 8 * PER_EVENT * BS));
            h += PER_EVENT;
            bytes_in += (double)sb.size;
            size_t bad = 0;
            char err[64];
            double a = now_s();
            px_kv_decode(sb.data, sb.size, &sink, &bad, err, sizeof err);
            double m = now_s();
            px_kvindex_store(x, slot, c.hashes, c.n, c.has_parent, c.parent, c.tok, c.block_size,
                             NULL, NULL);
            double e = now_s();
            t_dec += m - a;
            t_ins += e - m;
            blocks += PER_EVENT;
        }
    }
    double t_ing = t_dec + t_ins;
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
           "decode_blocks_per_s=%.0f insert_blocks_per_s=%.0f "
           "index_bytes=%zu bytes_per_block=%.1f rss_bytes_per_block=%.1f prompt_tokens=%zu "
           "pick_p50_us=%.2f pick_p99_us=%.2f pick_cache_hits=%zu/%d "
           "pick_ingesting_p50_us=%.2f pick_ingesting_p99_us=%.2f ingesting_blocks=%zu\n",
           st.blocks, nb, t_ing, (double)blocks / t_ing, bytes_in / t_ing / 1e6,
           (double)blocks / t_dec, (double)blocks / t_ins, st.bytes,
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
