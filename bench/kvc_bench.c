/* SPDX-License-Identifier: Apache-2.0 */
/* kvc_bench: libkvconnector bandwidth and latency on one host.
 *
 * Forks a producer process; the parent is the consumer.  For each block size
 * (16 KiB, 256 KiB, 2 MiB), block count (1, 64, 4096) and id pattern
 * (contiguous, runs of 8, random) it publishes requests on the producer and
 * times kvc_fetch -> FETCH_DONE (data + notification) on the consumer.
 * It also measures, in the same run: memcpy bandwidth of the same total size,
 * a plain TCP loopback stream, and 1-block fetch latency with and without a
 * cached handshake.  UCX_TLS is taken from --tls (default: environment).
 *
 * Push-mode registration (--pending, also at the end of a full run): the
 * time from kvc_publish's return on the producer to FETCH_DONE on the
 * consumer, for a fetch started after the publication (today's path) and
 * for one registered before it (KVC_FETCH_FIELD_WAIT, held by the producer
 * and served on publish), medians side by side.
 *
 * usage: kvc_bench [--tls tcp,self|sm,tcp,self] [--max-mb 1024] [--min-mb 256]
 *                  [--quick] [--latency-only] [--pending]
 * GB/s figures use the median iteration (this box is shared and noisy); the
 * memcpy baseline runs right before each row's fetches.
 * Output: one "key=value" line per measurement (grep-friendly). */
#include "include/kvconnector.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what, kvc_status_t st) {
    fprintf(stderr, "kvc_bench: %s: %s\n", what, kvc_status_str(st));
    exit(1);
}

static bool xread(int fd, void *p, size_t n) {
    char *c = p;
    while (n) {
        ssize_t k = read(fd, c, n);
        if (k <= 0) {
            if (k < 0 && errno == EINTR) continue;
            return false;
        }
        c += k;
        n -= (size_t)k;
    }
    return true;
}

static bool xwrite(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t k = write(fd, c, n);
        if (k <= 0) {
            if (k < 0 && errno == EINTR) continue;
            return false;
        }
        c += k;
        n -= (size_t)k;
    }
    return true;
}

static kvc_agent_t *mk_agent(const char *name, size_t block_len, uint64_t nblocks) {
    kvc_agent_params_t ap = {0};
    ap.field_mask = KVC_AGENT_FIELD_ENGINE_ID;
    ap.engine_id = name;
    kvc_agent_t *a;
    kvc_status_t st = kvc_agent_create(&ap, &a);
    if (st != KVC_OK) die("agent", st);
    kvc_region_params_t rp = {.len = block_len * nblocks};
    if ((st = kvc_agent_register_regions(a, nblocks, &rp, 1)) != KVC_OK) die("regions", st);
    return a;
}

/* ------------------------------------------------------------ producer -- */

/* Control messages (parent -> child): u32 op, then op-specific words.
 *  op 1 CFG:  u64 block_len, u64 nblocks        -> reply u32 port
 *  op 2 PUB:  u32 k, u32 n, n * u64 ids         -> reply u32 0 when published
 *  op 3 TCP:  u32 port, u64 bytes, u64 chunk    -> streams bytes, reply u32 0
 *  op 4 QUIT
 *  op 5 PUBTOK: u32 n, char id[64], char token[32], n * u64 ids
 *                                               -> reply u64 ns (monotonic) after publish */
static void producer(int ctl) {
    kvc_agent_t *a = NULL;
    uint64_t gen = 0;
    for (;;) {
        struct pollfd pf[2] = {{.fd = ctl, .events = POLLIN}, {.fd = -1, .events = POLLIN}};
        if (a) kvc_agent_get_fd(a, &pf[1].fd);
        poll(pf, 2, -1);
        if (a) {
            kvc_agent_progress(a);
            kvc_event_t ev;
            while (kvc_agent_next_event(a, &ev) == KVC_OK) {
            }
        }
        if (!(pf[0].revents & (POLLIN | POLLHUP))) continue;
        uint32_t op;
        if (!xread(ctl, &op, 4)) break;
        if (op == 1) {
            uint64_t v[2];
            xread(ctl, v, sizeof(v));
            kvc_agent_destroy(a);
            a = mk_agent("bench-P", v[0], v[1]);
            void *base;
            kvc_region_base(a, 0, &base);
            for (uint64_t i = 0; i < v[0] * v[1]; i += 8)
                ((uint64_t *)base)[i / 8] = i * 2654435761u;
            uint16_t port;
            kvc_agent_get_port(a, &port);
            uint32_t p32 = port;
            xwrite(ctl, &p32, 4);
        } else if (op == 2) {
            uint32_t kn[2];
            xread(ctl, kn, sizeof(kn));
            uint64_t *ids = malloc(kn[1] * sizeof(uint64_t) + 8);
            char *toks = malloc((size_t)kn[0] * 32 + 1);
            xread(ctl, ids, kn[1] * sizeof(uint64_t));
            for (uint32_t i = 0; i < kn[0]; i++) {
                char id[64], *json;
                snprintf(id, sizeof(id), "bench-%llu-%u", (unsigned long long)gen, i);
                kvc_status_t st = kvc_publish(a, id, ids, kn[1], NULL, &json);
                if (st != KVC_OK) die("publish", st);
                /* The publication's token travels to the consumer, as the
                 * proxy carries it in kv_transfer_params. */
                const char *t = strstr(json, "\"remote_kv_token\":\"");
                if (!t) die("publish (no token)", KVC_ERR_PROTOCOL);
                memcpy(toks + (size_t)i * 32, t + 19, 32);
                kvc_free(json);
            }
            gen++;
            free(ids);
            uint32_t z = 0;
            xwrite(ctl, &z, 4);
            xwrite(ctl, toks, (size_t)kn[0] * 32);
            free(toks);
        } else if (op == 5) {
            uint32_t n;
            char id[65] = {0}, tok[33] = {0};
            xread(ctl, &n, 4);
            xread(ctl, id, 64);
            xread(ctl, tok, 32);
            uint64_t *ids = malloc(n * sizeof(uint64_t) + 8);
            xread(ctl, ids, n * sizeof(uint64_t));
            kvc_publish_params_t pp = {.field_mask = KVC_PUBLISH_FIELD_TOKEN, .kv_token = tok};
            char *json;
            kvc_status_t st = kvc_publish(a, id, ids, n, &pp, &json);
            if (st != KVC_OK) die("publish", st);
            /* Served now, before the reply: held fetches go out on this turn. */
            kvc_agent_progress(a);
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            uint64_t t = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
            kvc_free(json);
            free(ids);
            xwrite(ctl, &t, 8);
        } else if (op == 3) {
            uint32_t port;
            uint64_t v[2];
            xread(ctl, &port, 4);
            xread(ctl, v, sizeof(v));
            int s = socket(AF_INET, SOCK_STREAM, 0);
            struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
            sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            char *buf = calloc(1, v[1]);
            if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) == 0)
                for (uint64_t sent = 0; sent < v[0]; sent += v[1])
                    xwrite(s, buf, v[1]);
            close(s);
            free(buf);
            uint32_t z = 0;
            xwrite(ctl, &z, 4);
        } else {
            break;
        }
    }
    kvc_agent_destroy(a);
    _exit(0);
}

/* ------------------------------------------------------------ consumer -- */

static int ctl;
static uint16_t pport;
static uint64_t gen;
static char *tokens; /* 32 hex digits per request of the current generation */

static void cfg(size_t block_len, uint64_t nblocks) {
    uint32_t op = 1, p32;
    uint64_t v[2] = {block_len, nblocks};
    xwrite(ctl, &op, 4);
    xwrite(ctl, v, sizeof(v));
    xread(ctl, &p32, 4);
    pport = (uint16_t)p32;
}

static void pub(uint32_t k, const uint64_t *ids, uint32_t n) {
    uint32_t op = 2, kn[2] = {k, n}, z;
    xwrite(ctl, &op, 4);
    xwrite(ctl, kn, sizeof(kn));
    xwrite(ctl, ids, n * sizeof(uint64_t));
    xread(ctl, &z, 4);
    free(tokens);
    tokens = malloc((size_t)k * 32 + 1);
    if (!tokens || !xread(ctl, tokens, (size_t)k * 32)) die("publish tokens", KVC_ERR_IO);
}

/* One fetch of request i of the current publish generation; seconds. */
static double fetch_one(kvc_agent_t *a, uint32_t i, const uint64_t *rids, const uint64_t *lids,
                        size_t n) {
    char id[64], tok[33];
    snprintf(id, sizeof(id), "bench-%llu-%u", (unsigned long long)gen, i);
    memcpy(tok, tokens + (size_t)i * 32, 32);
    tok[32] = '\0';
    kvc_fetch_params_t fp = {0};
    fp.remote_kv_token = tok;
    fp.field_mask = KVC_FETCH_FIELD_REMOTE | KVC_FETCH_FIELD_LOCAL_BLOCKS;
    fp.remote_engine_id = "bench-P";
    fp.remote_request_id = id;
    fp.remote_host = "127.0.0.1";
    fp.remote_port = pport;
    fp.remote_block_ids = rids;
    fp.num_remote_blocks = n;
    fp.local_block_ids = lids;
    fp.num_local_blocks = n;
    uint64_t xid;
    double t0 = now_s();
    kvc_status_t st = kvc_fetch(a, &fp, &xid);
    if (st != KVC_INPROGRESS) die("fetch", st);
    for (;;) {
        kvc_agent_wait(a, 100);
        kvc_event_t ev;
        while (kvc_agent_next_event(a, &ev) == KVC_OK) {
            if (ev.type == KVC_EV_FETCH_DONE && ev.xfer_id == xid) return now_s() - t0;
            if (ev.type == KVC_EV_FETCH_FAILED) {
                fprintf(stderr, "fetch failed: %s\n", ev.message);
                exit(1);
            }
        }
        if (now_s() - t0 > 60) die("fetch", KVC_ERR_TIMED_OUT);
    }
}

static uint64_t rng = 88172645463325252ull;
static uint64_t xs(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static void shuffle(uint64_t *v, size_t n) {
    for (size_t i = n; i > 1; i--) {
        size_t j = xs() % i;
        uint64_t t = v[i - 1];
        v[i - 1] = v[j];
        v[j] = t;
    }
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, size_t n) {
    qsort(v, n, sizeof(double), cmp_d);
    return v[n / 2];
}

/* memcpy of `total` bytes between two warmed buffers: median seconds of
 * `iters` copies, measured right before the fetches it is compared with so
 * that both see the same machine load. */
/* Push-mode registration vs fetch after publish: seconds from kvc_publish's
 * return (the producer's clock, CLOCK_MONOTONIC is system-wide) to FETCH_DONE. */
static double pub_to_done(kvc_agent_t *a, const uint64_t *ids, uint32_t n, bool early) {
    static uint32_t seq;
    char id[64] = {0}, tok[33];
    snprintf(id, sizeof(id), "pend-%u", seq++);
    if (kvc_token_new(tok) != KVC_OK) die("token", KVC_ERR_IO);
    kvc_fetch_params_t fp = {0};
    fp.field_mask = KVC_FETCH_FIELD_REMOTE | KVC_FETCH_FIELD_LOCAL_BLOCKS |
                    (early ? KVC_FETCH_FIELD_WAIT : 0);
    fp.remote_kv_token = tok;
    fp.remote_engine_id = "bench-P";
    fp.remote_request_id = id;
    fp.remote_host = "127.0.0.1";
    fp.remote_port = pport;
    fp.remote_block_ids = ids;
    fp.num_remote_blocks = n;
    fp.local_block_ids = ids;
    fp.num_local_blocks = n;
    fp.wait_ms = 10000;
    uint64_t xid = 0;
    uint32_t op = 5;
    if (early) { /* register first; let the pull reach the producer */
        if (kvc_fetch(a, &fp, &xid) != KVC_INPROGRESS) die("fetch", KVC_ERR_STATE);
        double t0 = now_s();
        while (now_s() - t0 < 0.005)
            kvc_agent_wait(a, 1);
    }
    xwrite(ctl, &op, 4);
    xwrite(ctl, &n, 4);
    xwrite(ctl, id, 64);
    xwrite(ctl, tok, 32);
    xwrite(ctl, ids, n * sizeof(uint64_t));
    uint64_t tpub;
    if (!xread(ctl, &tpub, 8)) die("publish", KVC_ERR_IO);
    if (!early && kvc_fetch(a, &fp, &xid) != KVC_INPROGRESS) die("fetch", KVC_ERR_STATE);
    double t0 = now_s();
    for (;;) {
        kvc_agent_wait(a, 100);
        kvc_event_t ev;
        while (kvc_agent_next_event(a, &ev) == KVC_OK) {
            if (ev.type == KVC_EV_FETCH_FAILED) {
                fprintf(stderr, "fetch failed: %s\n", ev.message);
                exit(1);
            }
            if (ev.type == KVC_EV_FETCH_DONE && ev.xfer_id == xid) {
                struct timespec ts;
                clock_gettime(CLOCK_MONOTONIC, &ts);
                uint64_t t = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
                return (double)(t - tpub) * 1e-9;
            }
        }
        if (now_s() - t0 > 60) die("fetch", KVC_ERR_TIMED_OUT);
    }
}

static void bench_pending(bool quick) {
    static const size_t bls[] = {16 << 10, 256 << 10};
    static const uint32_t ns[] = {1, 64};
    int iters = quick ? 15 : 60;
    double *after = malloc(sizeof(double) * (size_t)iters);
    double *early = malloc(sizeof(double) * (size_t)iters);
    for (int k = 0; k < 2; k++) {
        cfg(bls[k], 64);
        kvc_agent_t *a = mk_agent("bench-D", bls[k], 64);
        uint64_t ids[64];
        for (uint32_t i = 0; i < 64; i++)
            ids[i] = i;
        pub_to_done(a, ids, ns[k], false); /* warm-up: handshake */
        for (int i = 0; i < iters; i++) { /* interleaved: same noise on both */
            after[i] = pub_to_done(a, ids, ns[k], false);
            early[i] = pub_to_done(a, ids, ns[k], true);
        }
        kvc_agent_destroy(a);
        double ma = median(after, (size_t)iters), me = median(early, (size_t)iters);
        printf("pending_registration block=%zu count=%u publish_to_done_median_us "
               "fetch_after_publish=%.1f registered_before_publish=%.1f ratio=%.2f n=%d\n",
               bls[k], ns[k], ma * 1e6, me * 1e6, me / ma, iters);
        fflush(stdout);
    }
    free(after);
    free(early);
}

static double memcpy_median_s(size_t total, uint32_t iters) {
    char *s = malloc(total), *d = malloc(total);
    double *t = malloc(sizeof(double) * iters);
    memset(s, 1, total);
    memset(d, 2, total);
    memcpy(d, s, total);
    for (uint32_t i = 0; i < iters; i++) {
        double t0 = now_s();
        memcpy(d, s, total);
        t[i] = now_s() - t0;
    }
    volatile char sink = d[total / 2];
    (void)sink;
    double m = median(t, iters);
    free(s);
    free(d);
    free(t);
    return m;
}

static double tcp_gbs(uint64_t bytes, uint64_t chunk) {
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof(sa);
    bind(ls, (struct sockaddr *)&sa, sizeof(sa));
    listen(ls, 1);
    getsockname(ls, (struct sockaddr *)&sa, &sl);
    uint32_t op = 3, port = ntohs(sa.sin_port), z;
    uint64_t v[2] = {bytes, chunk};
    xwrite(ctl, &op, 4);
    xwrite(ctl, &port, 4);
    xwrite(ctl, v, sizeof(v));
    int s = accept(ls, NULL, NULL);
    char *buf = malloc(chunk);
    double t0 = now_s();
    uint64_t got = 0;
    while (got < bytes) {
        ssize_t k = read(s, buf, chunk);
        if (k <= 0) break;
        got += (uint64_t)k;
    }
    double t = now_s() - t0;
    xread(ctl, &z, 4);
    close(s);
    close(ls);
    free(buf);
    return (double)got / t / 1e9;
}

int main(int argc, char **argv) {
    size_t max_mb = 1024, min_mb = 256;
    bool quick = false, latency_only = false, pending_only = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tls") && i + 1 < argc)
            setenv("UCX_TLS", argv[++i], 1);
        else if (!strcmp(argv[i], "--max-mb") && i + 1 < argc)
            max_mb = strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--min-mb") && i + 1 < argc)
            min_mb = strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--quick"))
            quick = true;
        else if (!strcmp(argv[i], "--latency-only"))
            latency_only = true;
        else if (!strcmp(argv[i], "--pending"))
            pending_only = true;
        else {
            fprintf(stderr, "usage: kvc_bench [--tls T] [--max-mb N] [--min-mb N] [--quick] "
                            "[--latency-only] [--pending]\n");
            return 2;
        }
    }
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 0);
    int sv[2];
    socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        producer(sv[1]);
    }
    close(sv[1]);
    ctl = sv[0];
    const char *tls = getenv("UCX_TLS") ? getenv("UCX_TLS") : "(default)";
    printf("# kvc_bench UCX_TLS=%s proto=%s\n", tls,
           getenv("KVC_PROTO") ? getenv("KVC_PROTO") : "auto");

    if (pending_only) {
        bench_pending(quick);
        uint32_t op = 4;
        xwrite(ctl, &op, 4);
        waitpid(pid, NULL, 0);
        return 0;
    }
    static const size_t sizes[] = {16 << 10, 256 << 10, 2 << 20};
    static const uint64_t counts[] = {1, 64, 4096};
    static const char *pats[] = {"contiguous", "runs8", "random"};
    for (size_t si = 0; si < 3 && !latency_only; si++) {
        for (size_t ci = 0; ci < 3; ci++) {
            size_t bl = sizes[si];
            uint64_t n = counts[ci];
            size_t total = bl * n;
            if (total > (max_mb << 20)) {
                printf("block=%zu count=%llu skipped=memory(%zu MiB > --max-mb %zu)\n", bl,
                       (unsigned long long)n, total >> 20, max_mb);
                continue;
            }
            /* The producer holds a region of n blocks (random ids permute it). */
            cfg(bl, n);
            kvc_agent_t *a = mk_agent("bench-D", bl, n);
            uint64_t *rids = malloc(n * sizeof(uint64_t)), *lids = malloc(n * sizeof(uint64_t));
            for (uint64_t i = 0; i < n; i++)
                lids[i] = i;
            for (int pi = 0; pi < 3; pi++) {
                if (n == 1 && pi) continue;
                for (uint64_t i = 0; i < n; i++)
                    rids[i] = i;
                if (pi == 1 && n >= 8) { /* shuffle groups of 8 */
                    uint64_t g = n / 8, *perm = malloc(g * sizeof(uint64_t));
                    for (uint64_t i = 0; i < g; i++)
                        perm[i] = i;
                    shuffle(perm, g);
                    for (uint64_t i = 0; i < n; i++)
                        rids[i] = perm[i / 8] * 8 + i % 8;
                    free(perm);
                } else if (pi == 2) {
                    shuffle(rids, n);
                }
                uint32_t iters = (uint32_t)((min_mb << 20) / total);
                if (quick) iters /= 8;
                if (iters < 5) iters = 5;
                if (iters > 500) iters = 500;
                pub(iters + 1, rids, (uint32_t)n);
                fetch_one(a, 0, rids, lids, n); /* warm-up: handshake, registration */
                double mc = (double)total / memcpy_median_s(total, iters < 5 ? 5 : iters) / 1e9;
                double *ft = malloc(sizeof(double) * iters), sum = 0;
                for (uint32_t i = 1; i <= iters; i++)
                    sum += ft[i - 1] = fetch_one(a, i, rids, lids, n);
                gen++;
                double gbs = (double)total / median(ft, iters) / 1e9;
                free(ft);
                printf("block=%zu count=%llu pattern=%s fetch_GBps=%.3f memcpy_GBps=%.3f "
                       "pct_memcpy=%.1f mean_fetch_us=%.1f iters=%u\n",
                       bl, (unsigned long long)n, pats[pi], gbs, mc, 100 * gbs / mc,
                       sum / iters * 1e6, iters);
                fflush(stdout);
            }
            kvc_agent_destroy(a);
            free(rids);
            free(lids);
        }
    }

    /* Latency of a 1-block fetch (16 KiB), cached handshake vs a fresh one. */
    cfg(16 << 10, 64);
    uint64_t one = 3;
    int nl = quick ? 50 : 300, nh = quick ? 5 : 20;
    double *lat = malloc(sizeof(double) * (size_t)nl);
    kvc_agent_t *a = mk_agent("bench-D", 16 << 10, 64);
    pub((uint32_t)nl + 1, &one, 1);
    fetch_one(a, 0, &one, &one, 1);
    for (int i = 0; i < nl; i++)
        lat[i] = fetch_one(a, (uint32_t)i + 1, &one, &one, 1);
    gen++;
    kvc_agent_destroy(a);
    qsort(lat, (size_t)nl, sizeof(double), cmp_d);
    printf("latency_1block cached_handshake median_us=%.1f p99_us=%.1f n=%d\n", lat[nl / 2] * 1e6,
           lat[nl * 99 / 100] * 1e6, nl);
    pub((uint32_t)nh, &one, 1);
    for (int i = 0; i < nh; i++) {
        a = mk_agent("bench-D", 16 << 10, 64); /* new agent: no cached handshake */
        lat[i] = fetch_one(a, (uint32_t)i, &one, &one, 1);
        kvc_agent_destroy(a);
    }
    gen++;
    qsort(lat, (size_t)nh, sizeof(double), cmp_d);
    printf("latency_1block first_fetch_with_handshake median_us=%.1f max_us=%.1f n=%d\n",
           lat[nh / 2] * 1e6, lat[nh - 1] * 1e6, nh);
    free(lat);

    bench_pending(quick);
    for (size_t si = 0; si < 3 && !latency_only; si++) {
        uint64_t bytes = quick ? (256ull << 20) : (1ull << 30);
        printf("baseline tcp_loopback chunk=%zu GBps=%.3f\n", sizes[si], tcp_gbs(bytes, sizes[si]));
    }
    uint32_t op = 4;
    xwrite(ctl, &op, 4);
    waitpid(pid, NULL, 0);
    return 0;
}
