/* SPDX-License-Identifier: Apache-2.0 */
/* engine-sim: flags → sim_config → engine. One table drives the flags and
 * --help. */
#include <getopt.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "sim/engine.h"
#include "sim/link.h"

typedef enum { O_STR, O_INT, O_U32, O_U64, O_ROLE, O_LEVEL } otype;

typedef struct sim_opt {
    const char *name; /* long flag without dashes */
    otype type;
    size_t off;       /* into sim_config */
    long min, max;    /* bounds for numbers */
    const char *arg;  /* the value's name in --help */
    const char *help; /* lines after the first are indented under it */
} sim_opt;

#define OFF(f) offsetof(sim_config, f)

static const sim_opt opts[] = {
    {"role", O_ROLE, OFF(role), 0, 0, "prefill|decode|both",
     "informational; every role serves every request (both)"},
    {"host", O_STR, OFF(host), 0, 0, "ADDR", "HTTP listen address (127.0.0.1)"},
    {"port", O_INT, OFF(port), 1, 65535, "N", "HTTP port (8100)"},
    {"model", O_STR, OFF(model), 0, 0, "NAME", "served model name (sim-model)"},
    {"kv-host", O_STR, OFF(kv_host), 0, 0, "ADDR",
     "KV side-channel address, bound and advertised (127.0.0.1)"},
    {"kv-port", O_INT, OFF(kv_port), 0, 65535, "N", "KV side-channel port, 0 = any free port (0)"},
    {"num-blocks", O_U64, OFF(num_blocks), 1, 1L << 24, "N", "KV pool size in blocks (1024)"},
    {"block-tokens", O_U32, OFF(block_tokens), 1, 4096, "N", "tokens per KV block (16)"},
    {"layers", O_U32, OFF(layers), 1, 512, "N", "layers; each has a K and a V region (2)"},
    {"block-bytes", O_U32, OFF(block_bytes), 8, 64L << 20, "N",
     "bytes per block per region (4096)"},
    {"ttft-ms", O_U32, OFF(ttft_ms), 0, 3600000, "N", "time to first token, ms (0)"},
    {"itl-ms", O_U32, OFF(itl_ms), 0, 3600000, "N", "inter-token latency, ms (0)"},
    {"engine-id", O_STR, OFF(engine_id), 0, 0, "ID", "KV engine id (sim-<role>-<port>)"},
    {"max-queue", O_U32, OFF(max_queue), 0, 1000000, "N",
     "requests that may wait for free KV blocks; when the\n"
     "pool is full and the queue too, 503 + Retry-After (256)"},
    {"max-num-queued-reqs", O_U32, OFF(max_num_queued_reqs), 0, 1000000, "N",
     "vLLM's cap of that name: with N requests in the engine\n"
     "(waiting + running) a new one gets 429 (0: no cap)"},
    {"max-num-seqs", O_U32, OFF(max_num_seqs), 0, 1000000, "N",
     "vLLM's cap of that name: N requests generate at once;\n"
     "one whose prompt is ready (computed, or its KV\n"
     "received) waits for a slot, first come first served.\n"
     "Prefill-only requests take none (0: no cap)"},
    {"kv-expiry-ms", O_U32, OFF(kv_expiry_ms), 1, 86400000, "N",
     "published blocks not claimed in time are freed (480000)"},
    {"kv-lease-ms", O_U32, OFF(kv_lease_ms), 0, 86400000, "N",
     "prefill frees published blocks whose lease decode did\n"
     "not renew for this long (0: none; expiry still caps);\n"
     "decode renews its queued requests' every N/6 (30000)"},
    {"kv-secret-file", O_STR, OFF(kv_secret_file), 0, 0, "PATH",
     "cluster secret authenticating the KV side channel (file\n"
     "content, trailing newline stripped); default: env\n"
     "KVC_SECRET_FILE, else KVC_SECRET, else none (warned)"},
    {"tp-size", O_U32, OFF(tp_size), 1, 1024, "N",
     "tensor-parallel size of this engine; a decode with a\n"
     "larger TP than its prefill notifies once per rank (1)"},
    {"prefill-us-per-token", O_U32, OFF(prefill_us_per_token), 0, 1000000, "N",
     "compute time of one prompt token, us; prompts are\n"
     "computed one at a time, cached prefixes skipped (0)"},
    {"layer-compute-us", O_U32, OFF(layer_compute_us), 0, 10000000, "N",
     "prefill's forward pass: N us per layer after the\n"
     "prompt's compute, before the answer (0)"},
    {"kv-layerwise", O_U32, OFF(kv_layerwise), 0, 1, "0|1",
     "with --layer-compute-us: publish before the first\n"
     "layer and mark each layer's K and V ready as it is\n"
     "computed, so decode's fetch overlaps the pass (0)"},
    {"decode-us-per-token", O_U32, OFF(decode_us_per_token), 0, 60000000, "N",
     "time between two output tokens, us; 0 = --itl-ms (0)"},
    {"kv-peer-cost", O_STR, OFF(kv_peer_cost), 0, 0, "PEER=MS[/MBPS],...",
     "what fetching KV from a prefill costs beyond the copy:\n"
     "a delay in ms and a bandwidth cap in MB/s (fetches\n"
     "over one link queue for it); PEER is the prefill's\n"
     "engine id, its KV \"host:port\", or * for any (none)"},
    {"prefix-cache-blocks", O_U64, OFF(prefix_cache_blocks), 0, 1L << 24, "N",
     "prefix cache capacity in blocks, least recently used\n"
     "evicted first; 0 = --num-blocks (0)"},
    {"kv-events-endpoint", O_STR, OFF(kv_events_endpoint), 0, 0, "URL",
     "publish vLLM KV cache events on a ZeroMQ PUB socket\n"
     "bound here, e.g. tcp://127.0.0.1:5557 (off)"},
    {"kv-events-replay-endpoint", O_STR, OFF(kv_events_replay_endpoint), 0, 0, "URL",
     "ZeroMQ ROUTER socket replaying buffered batches from\n"
     "a sequence number (off)"},
    {"kv-events-topic", O_STR, OFF(kv_events_topic), 0, 0, "TOPIC",
     "first frame of every event message (empty)"},
    {"kv-events-buffer-steps", O_U32, OFF(kv_events_buffer_steps), 1, 1000000, "N",
     "event batches kept for replay (10000)"},
    {"kv-events-encoding", O_STR, OFF(kv_events_encoding), 0, 0, "array|map",
     "msgspec array_like structs (vLLM before PR 42892) or\n"
     "tagged maps (after) (array)"},
    {"kv-events-drop-seq", O_INT, OFF(kv_events_drop_seq), -1, 2147483647, "N",
     "test aid: batch N is buffered for replay but never\n"
     "sent on the PUB socket, a gap (-1: none)"},
    {"kv-load-failure-policy", O_STR, OFF(kv_load_failure_policy), 0, 0, "recompute|fail",
     "a decode whose KV load fails computes the prompt\n"
     "itself, or fails the request as vLLM does with 'fail'\n"
     "(500 InternalServerError; in a stream, an error event)\n"
     "(recompute)"},
    {"kv-transfer-mode", O_STR, OFF(kv_transfer_mode), 0, 0, "pull|push",
     "as vLLM's NixlConnector (pull: a prefill publishes\n"
     "under its own id; a decode without remote_block_ids\n"
     "is the assertion that kills vLLM's engine core: 500)\n"
     "or NixlPushConnector (push); answers say which in\n"
     "transfer_mode (pull)"},
    {"data-parallel-size", O_U32, OFF(dp_size), 1, 64, "N",
     "engine cores behind this API server; a request may\n"
     "name one in X-data-parallel-rank (0..N-1), which is\n"
     "echoed in X-Data-Parallel-Rank and counted (1)"},
    {"log-level", O_LEVEL, OFF(log_level), 0, 0, "L", "debug|info|warn|error (info)"},
};
#define NOPTS (sizeof opts / sizeof opts[0])
enum { OPT_HELP = NOPTS, OPT_VERSION };

static void usage(FILE *out) {
    fputs("Usage: engine-sim [options]\n"
          "An OpenAI-compatible engine that behaves like one vLLM instance of a P/D pair:\n"
          "prefill computes KV blocks (bytes derived from the prompt) and publishes them\n"
          "with libkvconnector; decode fetches them over UCX, verifies every byte, notifies\n"
          "prefill by remote_request_id, and generates deterministic text.  Push mode\n"
          "(--kv-transfer-mode push): prefill publishes under the caller's remote_request_id\n"
          "and remote_kv_token; decode, given no remote_block_ids, registers its fetch at\n"
          "prefill at once and is served when prefill publishes (X-KV-Wait-Ms: its wait).\n\n",
          out);
    for (size_t i = 0; i < NOPTS; i++) {
        char flag[64];
        snprintf(flag, sizeof flag, "--%s %s", opts[i].name, opts[i].arg);
        fprintf(out, "  %-28s", flag);
        for (const char *p = opts[i].help; *p; p++) {
            fputc(*p, out);
            if (*p == '\n') fprintf(out, "%30s", "");
        }
        fputc('\n', out);
    }
    fputs("  --help, --version\n", out);
}

/* Sets the option's field from v; exits 2 with the flag, the value and
 * the reason when v does not fit. */
static void set_opt(sim_config *c, const sim_opt *o, const char *v) {
    void *field = (char *)c + o->off;
    if (o->type == O_STR) {
        *(const char **)field = v;
    } else if (o->type == O_ROLE) {
        if (strcmp(v, "prefill") && strcmp(v, "decode") && strcmp(v, "both")) {
            fprintf(stderr, "engine-sim: --role '%s': expected prefill, decode or both\n", v);
            exit(2);
        }
        *(const char **)field = v;
    } else if (o->type == O_LEVEL) {
        int l = px_log_level_parse(v);
        if (l < 0) {
            fprintf(stderr, "engine-sim: --log-level '%s': expected debug|info|warn|error\n", v);
            exit(2);
        }
        *(int *)field = l;
    } else {
        char *end;
        long x = strtol(v, &end, 10);
        if (!*v || *end || x < o->min || x > o->max) {
            fprintf(stderr, "engine-sim: --%s '%s': expected an integer in %ld..%ld\n", o->name, v,
                    o->min, o->max);
            exit(2);
        }
        if (o->type == O_INT)
            *(int *)field = (int)x;
        else if (o->type == O_U32)
            *(uint32_t *)field = (uint32_t)x;
        else
            *(uint64_t *)field = (uint64_t)x;
    }
}

/* Parses the flags into c. Returns -1 to go on, else the exit status. */
static int parse_flags(sim_config *c, int argc, char **argv) {
    struct option lo[NOPTS + 3];
    for (size_t i = 0; i < NOPTS; i++)
        lo[i] = (struct option){opts[i].name, required_argument, NULL, (int)i};
    lo[NOPTS] = (struct option){"help", no_argument, NULL, OPT_HELP};
    lo[NOPTS + 1] = (struct option){"version", no_argument, NULL, OPT_VERSION};
    lo[NOPTS + 2] = (struct option){NULL, 0, NULL, 0};
    int o;
    while ((o = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        if (o >= 0 && o < (int)NOPTS) {
            set_opt(c, &opts[o], optarg);
        } else if (o == OPT_HELP || o == 'h') {
            usage(stdout);
            return 0;
        } else if (o == OPT_VERSION) {
            printf("engine-sim %s\n", PDPROXY_VERSION);
            return 0;
        } else {
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "engine-sim: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    return -1;
}

int main(int argc, char **argv) {
    sim_config c = {.role = "both",
                    .host = "127.0.0.1",
                    .port = 8100,
                    .model = "sim-model",
                    .kv_host = "127.0.0.1",
                    .kv_port = 0,
                    .num_blocks = 1024,
                    .block_tokens = 16,
                    .layers = 2,
                    .block_bytes = 4096,
                    .ttft_ms = 0,
                    .itl_ms = 0,
                    .engine_id = NULL,
                    .max_queue = 256,
                    .kv_expiry_ms = 480000,
                    .kv_lease_ms = 30000,
                    .log_level = 1,
                    .kv_secret_file = NULL,
                    .tp_size = 1,
                    .prefix_cache_blocks = 0,
                    .kv_events_endpoint = NULL,
                    .kv_events_replay_endpoint = NULL,
                    .kv_events_topic = "",
                    .kv_events_buffer_steps = 10000,
                    .kv_events_encoding = "array",
                    .kv_events_drop_seq = -1,
                    .kv_load_failure_policy = "recompute",
                    .kv_transfer_mode = "pull",
                    .dp_size = 1};
    int rc = parse_flags(&c, argc, argv);
    if (rc >= 0) return rc;
    if (strcmp(c.kv_load_failure_policy, "recompute") && strcmp(c.kv_load_failure_policy, "fail")) {
        fprintf(stderr, "engine-sim: --kv-load-failure-policy must be recompute or fail\n");
        return 2;
    }
    if (strcmp(c.kv_transfer_mode, "pull") && strcmp(c.kv_transfer_mode, "push")) {
        fprintf(stderr, "engine-sim: --kv-transfer-mode '%s': expected pull or push\n",
                c.kv_transfer_mode);
        return 2;
    }
    if (c.kv_peer_cost) {
        char err[256];
        sim_links *l = sim_links_parse(c.kv_peer_cost, err, sizeof err);
        if (!l) {
            fprintf(stderr, "engine-sim: --kv-peer-cost %s\n", err);
            return 2;
        }
        sim_links_free(l);
    }
    uint64_t pool = c.num_blocks * c.block_bytes;
    if (pool > (16ull << 30)) {
        fprintf(stderr,
                "engine-sim: --num-blocks x --block-bytes = %llu bytes per region is too "
                "large (16 GiB at most)\n",
                (unsigned long long)pool);
        return 2;
    }
    char idbuf[96];
    if (!c.engine_id) {
        snprintf(idbuf, sizeof idbuf, "sim-%s-%d", c.role, c.port);
        c.engine_id = idbuf;
    }
    px_log_threshold = (px_log_level_t)c.log_level;
    return sim_engine_run(&c);
}
