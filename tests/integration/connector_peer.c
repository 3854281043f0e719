/* SPDX-License-Identifier: Apache-2.0 */
/* kvc_testpeer: one libkvconnector agent driven by line commands on stdin,
 * reporting on stdout, for the two-process integration tests
 * (connector_test.py).  Producer and consumer are the same program.
 *
 * usage: kvc_testpeer --engine ID [--regions R] [--blocks N] [--block-len L]
 *                     [--user-mem] [--port P] [--layout TAG] [--expiry-ms MS]
 *                     [--connect-timeout-ms MS] [--xfer-timeout-ms MS] [--tp-size N]
 *                     [--max-handshakes N]
 * The cluster secret comes from the environment (KVC_SECRET / KVC_SECRET_FILE).
 * prints "READY port=<port>", then one line per command and per event:
 *   fill SEED                      -> "OK"   (block b of region r := pattern)
 *   clear                          -> "OK"
 *   publish REQ IDS [EXPIRY_MS [CONSUMERS]] -> "PUBLISHED <json>" | "ERR <status>"
 *   fetch LOCAL_IDS JSON           -> "FETCHING <xfer>" | "ERR <status>"
 *   verify SEED REMOTE_IDS LOCAL_IDS -> "VERIFY ok" | "VERIFY bad ..."
 *   zero IDS                       -> "ZERO yes" | "ZERO no" (every region of
 *                                     those local blocks still all zero bytes)
 *   stat                           -> "STAT k=v ..."
 *   quit                           -> exits 0 (agent destroyed, in-flight cancelled)
 * IDS are comma-separated block ids, "-" for none.  Events:
 *   "EVENT <TYPE> status=<S> xfer=<X> req=<R> n=<N> bytes=<B> msg=<M>" */
#include "include/kvconnector.h"

#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static kvc_agent_t *agent;
static size_t nreg = 1, block_len = 4096;
static uint64_t nblocks = 64;
static void *user_mem[64];

static uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void pattern(uint64_t seed, size_t r, uint64_t b, uint8_t *out) {
    uint64_t base = mix(seed ^ ((uint64_t)r << 48) ^ (b << 8));
    for (size_t i = 0; i < block_len; i += 8) {
        uint64_t v = mix(base + i);
        size_t k = block_len - i < 8 ? block_len - i : 8;
        memcpy(out + i, &v, k);
    }
}

static uint8_t *block_ptr(size_t r, uint64_t b) {
    void *base;
    if (kvc_region_base(agent, r, &base) != KVC_OK) return NULL;
    return (uint8_t *)base + b * block_len;
}

static size_t parse_ids(const char *s, uint64_t **out) {
    *out = NULL;
    if (!s || !strcmp(s, "-")) return 0;
    size_t n = 1;
    for (const char *p = s; *p; p++)
        n += *p == ',';
    uint64_t *v = calloc(n, sizeof(*v));
    if (!v) return 0;
    char *end;
    for (size_t i = 0; i < n; i++) {
        v[i] = strtoull(s, &end, 10);
        s = end + (*end == ',');
    }
    *out = v;
    return n;
}

static void print_events(void) {
    static const char *names[] = {"?",        "FETCH_DONE", "FETCH_FAILED",
                                  "RELEASED", "EXPIRED",    "UNKNOWN_NOTIFY"};
    kvc_event_t ev;
    while (kvc_agent_next_event(agent, &ev) == KVC_OK) {
        printf("EVENT %s status=%s xfer=%llu req=%s n=%zu bytes=%llu msg=%s\n",
               names[ev.type <= 5 ? ev.type : 0], kvc_status_str(ev.status),
               (unsigned long long)ev.xfer_id, ev.request_id ? ev.request_id : "-", ev.num_blocks,
               (unsigned long long)ev.bytes, ev.message);
    }
    fflush(stdout);
}

static void stat_line(void) {
    static const char *k[] = {"published",     "released",      "expired",     "unknown",
                              "fetch_done",    "fetch_failed",  "bytes",       "handshakes",
                              "published_now", "authenticated", "auth_failed", "denied",
                              "peer_errors"};
    printf("STAT");
    for (int i = 0; i <= KVC_STAT_PEER_ERRORS; i++) {
        uint64_t v = 0;
        kvc_agent_stat(agent, (kvc_stat_t)i, &v);
        printf(" %s=%llu", k[i], (unsigned long long)v);
    }
    printf("\n");
}

/* Returns 0 to go on, 1 to quit. */
static int command(char *line) {
    char *save = NULL;
    char *cmd = strtok_r(line, " \n", &save);
    if (!cmd) return 0;
    if (!strcmp(cmd, "quit")) return 1;
    if (!strcmp(cmd, "fill") || !strcmp(cmd, "clear")) {
        uint64_t seed = !strcmp(cmd, "fill") ? strtoull(strtok_r(NULL, " \n", &save), NULL, 10) : 0;
        for (size_t r = 0; r < nreg; r++)
            for (uint64_t b = 0; b < nblocks; b++) {
                if (cmd[0] == 'f')
                    pattern(seed, r, b, block_ptr(r, b));
                else
                    memset(block_ptr(r, b), 0, block_len);
            }
        printf("OK\n");
    } else if (!strcmp(cmd, "publish")) {
        char *req = strtok_r(NULL, " \n", &save);
        char *ids = strtok_r(NULL, " \n", &save);
        char *exp = strtok_r(NULL, " \n", &save);
        char *cons = strtok_r(NULL, " \n", &save);
        uint64_t *v;
        size_t n = parse_ids(ids, &v);
        kvc_publish_params_t pp = {0};
        if (exp && strcmp(exp, "-")) {
            pp.field_mask = KVC_PUBLISH_FIELD_EXPIRY;
            pp.expiry_ms = (uint32_t)strtoul(exp, NULL, 10);
        }
        if (cons) {
            pp.field_mask |= KVC_PUBLISH_FIELD_CONSUMERS;
            pp.consumers = (uint32_t)strtoul(cons, NULL, 10);
        }
        char *json = NULL;
        kvc_status_t st = kvc_publish(agent, req, v, n, &pp, &json);
        if (st == KVC_OK)
            printf("PUBLISHED %s\n", json);
        else
            printf("ERR %s\n", kvc_status_str(st));
        kvc_free(json);
        free(v);
    } else if (!strcmp(cmd, "fetch")) {
        char *ids = strtok_r(NULL, " \n", &save);
        char *json = strtok_r(NULL, "\n", &save);
        uint64_t *v;
        size_t n = parse_ids(ids, &v);
        kvc_fetch_params_t fp = {0};
        fp.field_mask = KVC_FETCH_FIELD_JSON | KVC_FETCH_FIELD_LOCAL_BLOCKS;
        fp.kv_transfer_params_json = json;
        fp.local_block_ids = v;
        fp.num_local_blocks = n;
        uint64_t id = 0;
        kvc_status_t st = kvc_fetch(agent, &fp, &id);
        if (st == KVC_INPROGRESS)
            printf("FETCHING %llu\n", (unsigned long long)id);
        else
            printf("ERR %s\n", kvc_status_str(st));
        free(v);
    } else if (!strcmp(cmd, "verify")) {
        uint64_t seed = strtoull(strtok_r(NULL, " \n", &save), NULL, 10);
        uint64_t *rem, *loc;
        size_t nr = parse_ids(strtok_r(NULL, " \n", &save), &rem);
        size_t nl = parse_ids(strtok_r(NULL, " \n", &save), &loc);
        uint8_t *want = malloc(block_len);
        const char *bad = NULL;
        size_t bi = 0, br = 0;
        for (size_t i = 0; i < nl && !bad && nr == nl; i++)
            for (size_t r = 0; r < nreg && !bad; r++) {
                pattern(seed, r, rem[i], want);
                if (memcmp(want, block_ptr(r, loc[i]), block_len)) {
                    bad = "mismatch";
                    bi = i;
                    br = r;
                }
            }
        if (nr != nl) bad = "count";
        if (bad)
            printf("VERIFY bad %s index=%zu region=%zu\n", bad, bi, br);
        else
            printf("VERIFY ok\n");
        free(want);
        free(rem);
        free(loc);
    } else if (!strcmp(cmd, "zero")) {
        uint64_t *loc;
        size_t nl = parse_ids(strtok_r(NULL, " \n", &save), &loc);
        bool zero = true;
        for (size_t i = 0; i < nl && zero; i++)
            for (size_t r = 0; r < nreg && zero && loc[i] < nblocks; r++) {
                const uint8_t *b = block_ptr(r, loc[i]);
                for (size_t k = 0; k < block_len && zero; k++)
                    zero = b[k] == 0;
            }
        printf("ZERO %s\n", zero ? "yes" : "no");
        free(loc);
    } else if (!strcmp(cmd, "stat")) {
        stat_line();
    } else {
        printf("ERR unknown command %s\n", cmd);
    }
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    kvc_agent_params_t ap = {0};
    ap.field_mask = KVC_AGENT_FIELD_ENGINE_ID;
    bool user = false;
    for (int i = 1; i + 1 < argc || (i < argc && !strcmp(argv[i], "--user-mem")); i++) {
        const char *k = argv[i];
        if (!strcmp(k, "--user-mem")) {
            user = true;
            continue;
        }
        const char *v = argv[++i];
        if (!strcmp(k, "--engine"))
            ap.engine_id = v;
        else if (!strcmp(k, "--regions"))
            nreg = strtoul(v, NULL, 10);
        else if (!strcmp(k, "--blocks"))
            nblocks = strtoull(v, NULL, 10);
        else if (!strcmp(k, "--block-len"))
            block_len = strtoul(v, NULL, 10);
        else if (!strcmp(k, "--port")) {
            ap.field_mask |= KVC_AGENT_FIELD_LISTEN_PORT;
            ap.listen_port = (uint16_t)atoi(v);
        } else if (!strcmp(k, "--layout")) {
            ap.field_mask |= KVC_AGENT_FIELD_LAYOUT_TAG;
            ap.layout_tag = v;
        } else if (!strcmp(k, "--expiry-ms")) {
            ap.field_mask |= KVC_AGENT_FIELD_EXPIRY;
            ap.expiry_ms = (uint32_t)atoi(v);
        } else if (!strcmp(k, "--connect-timeout-ms")) {
            ap.field_mask |= KVC_AGENT_FIELD_CONNECT_TIMEOUT;
            ap.connect_timeout_ms = (uint32_t)atoi(v);
        } else if (!strcmp(k, "--xfer-timeout-ms")) {
            ap.field_mask |= KVC_AGENT_FIELD_XFER_TIMEOUT;
            ap.xfer_timeout_ms = (uint32_t)atoi(v);
        } else if (!strcmp(k, "--tp-size")) {
            ap.field_mask |= KVC_AGENT_FIELD_TP_SIZE;
            ap.tp_size = (uint32_t)atoi(v);
        } else if (!strcmp(k, "--max-handshakes")) {
            ap.field_mask |= KVC_AGENT_FIELD_MAX_HANDSHAKES;
            ap.max_handshakes = (uint32_t)atoi(v);
        } else {
            fprintf(stderr, "unknown option %s\n", k);
            return 2;
        }
    }
    if (nreg == 0 || nreg > 64) return 2;
    kvc_status_t st = kvc_agent_create(&ap, &agent);
    if (st != KVC_OK) {
        printf("ERR create %s\n", kvc_status_str(st));
        return 1;
    }
    kvc_region_params_t rp[64];
    memset(rp, 0, sizeof(rp));
    for (size_t r = 0; r < nreg; r++) {
        rp[r].len = nblocks * block_len;
        if (user) {
            user_mem[r] = calloc(1, rp[r].len);
            rp[r].field_mask = KVC_REGION_FIELD_BASE;
            rp[r].base = user_mem[r];
        }
    }
    st = kvc_agent_register_regions(agent, nblocks, rp, nreg);
    if (st != KVC_OK) {
        printf("ERR regions %s\n", kvc_status_str(st));
        kvc_agent_destroy(agent);
        return 1;
    }
    uint16_t port;
    kvc_agent_get_port(agent, &port);
    printf("READY port=%u\n", port);
    fflush(stdout);

    int fd;
    kvc_agent_get_fd(agent, &fd);
    static char line[1 << 20];
    size_t len = 0;
    int rc = 0;
    for (;;) {
        struct pollfd pf[2] = {{.fd = 0, .events = POLLIN}, {.fd = fd, .events = POLLIN}};
        if (poll(pf, 2, 1000) < 0 && errno != EINTR) break;
        kvc_agent_progress(agent);
        print_events();
        if (pf[0].revents & (POLLIN | POLLHUP)) {
            ssize_t n = read(0, line + len, sizeof(line) - 1 - len);
            if (n <= 0) break; /* stdin closed: quit */
            len += (size_t)n;
            char *nl;
            int quit = 0;
            while (!quit && (nl = memchr(line, '\n', len))) {
                *nl = '\0';
                quit = command(line);
                size_t used = (size_t)(nl + 1 - line);
                memmove(line, nl + 1, len - used);
                len -= used;
                kvc_agent_progress(agent);
                print_events();
            }
            if (quit) break;
        }
    }
    kvc_agent_destroy(agent);
    for (size_t r = 0; r < nreg; r++)
        free(user_mem[r]);
    return rc;
}
