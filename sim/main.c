/* engine-sim: flags → sim_config → engine. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine.h"
#include "log.h"

static void usage(FILE *out) {
    fprintf(
        out,
        "Usage: engine-sim [options]\n"
        "An OpenAI-compatible engine that behaves like one vLLM instance of a P/D pair:\n"
        "prefill computes KV blocks (bytes derived from the prompt) and publishes them\n"
        "with libkvconnector; decode fetches them over UCX, verifies every byte, notifies\n"
        "prefill by remote_request_id, and generates deterministic text.\n\n"
        "  --role prefill|decode|both  informational; every role serves every request (both)\n"
        "  --host ADDR                 HTTP listen address (127.0.0.1)\n"
        "  --port N                    HTTP port (8100)\n"
        "  --model NAME                served model name (sim-model)\n"
        "  --kv-host ADDR              KV side-channel address, bound and advertised (127.0.0.1)\n"
        "  --kv-port N                 KV side-channel port, 0 = any free port (0)\n"
        "  --num-blocks N              KV pool size in blocks (1024)\n"
        "  --block-tokens N            tokens per KV block (16)\n"
        "  --layers N                  layers; each has a K and a V region (2)\n"
        "  --block-bytes N             bytes per block per region (4096)\n"
        "  --ttft-ms N                 time to first token, ms (0)\n"
        "  --itl-ms N                  inter-token latency, ms (0)\n"
        "  --engine-id ID              KV engine id (sim-<role>-<port>)\n"
        "  --max-queue N               requests that may wait for free KV blocks; when the\n"
        "                              pool is full and the queue too, 503 + Retry-After (256)\n"
        "  --kv-expiry-ms N            published blocks not claimed in time are freed (480000)\n"
        "  --kv-secret-file PATH       cluster secret authenticating the KV side channel (file\n"
        "                              content, trailing newline stripped); default: env\n"
        "                              KVC_SECRET_FILE, else KVC_SECRET, else none (warned)\n"
        "  --tp-size N                 tensor-parallel size of this engine; a decode with a\n"
        "                              larger TP than its prefill notifies once per rank (1)\n"
        "  --prefill-us-per-token N    compute time of one prompt token, us; prompts are\n"
        "                              computed one at a time, cached prefixes skipped (0)\n"
        "  --log-level L               debug|info|warn|error (info)\n"
        "  --help, --version\n");
}

static long num(const char *flag, const char *v, long min, long max) {
    char *end;
    long x = strtol(v, &end, 10);
    if (!*v || *end || x < min || x > max) {
        fprintf(stderr, "engine-sim: --%s '%s': expected an integer in %ld..%ld\n", flag, v, min,
                max);
        exit(2);
    }
    return x;
}

int main(int argc, char **argv) {
    static const struct option opts[] = {
        {"role", 1, 0, 'r'},         {"host", 1, 0, 'H'},
        {"port", 1, 0, 'p'},         {"model", 1, 0, 'm'},
        {"kv-host", 1, 0, 'K'},      {"kv-port", 1, 0, 'k'},
        {"num-blocks", 1, 0, 'n'},   {"block-tokens", 1, 0, 't'},
        {"layers", 1, 0, 'l'},       {"block-bytes", 1, 0, 'b'},
        {"ttft-ms", 1, 0, 'f'},      {"itl-ms", 1, 0, 'i'},
        {"engine-id", 1, 0, 'e'},    {"max-queue", 1, 0, 'q'},
        {"kv-expiry-ms", 1, 0, 'x'}, {"kv-secret-file", 1, 0, 'S'},
        {"tp-size", 1, 0, 'T'},      {"prefill-us-per-token", 1, 0, 'U'},
        {"log-level", 1, 0, 'L'},    {"help", 0, 0, 'h'},
        {"version", 0, 0, 'V'},      {0, 0, 0, 0}};
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
                    .log_level = 1,
                    .kv_secret_file = NULL,
                    .tp_size = 1};
    int o;
    while ((o = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (o) {
        case 'r':
            if (strcmp(optarg, "prefill") && strcmp(optarg, "decode") && strcmp(optarg, "both")) {
                fprintf(stderr, "engine-sim: --role '%s': expected prefill, decode or both\n",
                        optarg);
                return 2;
            }
            c.role = optarg;
            break;
        case 'H':
            c.host = optarg;
            break;
        case 'p':
            c.port = (int)num("port", optarg, 1, 65535);
            break;
        case 'm':
            c.model = optarg;
            break;
        case 'K':
            c.kv_host = optarg;
            break;
        case 'k':
            c.kv_port = (int)num("kv-port", optarg, 0, 65535);
            break;
        case 'n':
            c.num_blocks = (uint64_t)num("num-blocks", optarg, 1, 1L << 24);
            break;
        case 't':
            c.block_tokens = (uint32_t)num("block-tokens", optarg, 1, 4096);
            break;
        case 'l':
            c.layers = (uint32_t)num("layers", optarg, 1, 512);
            break;
        case 'b':
            c.block_bytes = (uint32_t)num("block-bytes", optarg, 8, 64L << 20);
            break;
        case 'f':
            c.ttft_ms = (uint32_t)num("ttft-ms", optarg, 0, 3600000);
            break;
        case 'i':
            c.itl_ms = (uint32_t)num("itl-ms", optarg, 0, 3600000);
            break;
        case 'e':
            c.engine_id = optarg;
            break;
        case 'q':
            c.max_queue = (uint32_t)num("max-queue", optarg, 0, 1000000);
            break;
        case 'x':
            c.kv_expiry_ms = (uint32_t)num("kv-expiry-ms", optarg, 1, 86400000);
            break;
        case 'S':
            c.kv_secret_file = optarg;
            break;
        case 'U':
            c.prefill_us_per_token = (uint32_t)num("prefill-us-per-token", optarg, 0, 1000000);
            break;
        case 'T':
            c.tp_size = (uint32_t)num("tp-size", optarg, 1, 1024);
            break;
        case 'L':
            c.log_level = px_log_level_parse(optarg);
            if (c.log_level < 0) {
                fprintf(stderr, "engine-sim: --log-level '%s': expected debug|info|warn|error\n",
                        optarg);
                return 2;
            }
            break;
        case 'h':
            usage(stdout);
            return 0;
        case 'V':
            printf("engine-sim %s\n", PDPROXY_VERSION);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "engine-sim: unexpected argument '%s'\n", argv[optind]);
        return 2;
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
