/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/config.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <sys/stat.h>
#include <unistd.h>
#include <netinet/in.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <yaml.h>

#include "base/log.h"
#include "base/util.h"
#include "proxy/dispatch.h"
#include "proxy/prio.h"
#include "proxy/ratelimit.h"
#include "proxy/slo.h"

#define PX_POLICIES                                                                                \
    "round_robin|least_inflight|power_of_two|prefix_affinity|load_aware|kv_aware|"                 \
    "prefix_affinity_bytes|latency"

typedef enum {
    CT_STR,
    CT_INT,
    CT_SECONDS,
    CT_LIST,
    CT_URLS,
    CT_FLAG,
    CT_ENUM,
    CT_SECRET,
    CT_POOL,  /* --pool: starts a pool; flag and file only */
    CT_WORDS, /* a list that may be empty */
} ctype_t;

typedef struct opt {
    const char *name;  /* long flag without dashes */
    const char *alias; /* second spelling (toy proxy's singular forms), or NULL */
    ctype_t type;
    size_t off;
    const char *def; /* default, as text */
    double min, max; /* bounds for numbers */
    const char *help;
    const char *choices; /* CT_ENUM: "a|b|c" */
    int reloads;         /* RELOADS: a reload applies it (it makes the generation of pools);
                          * AT_START: read at start only */
} opt;

#define RELOADS 1
#define AT_START 0

#define OFF(f) offsetof(px_config, f)

static const opt opts[] = {
    {"config", NULL, CT_STR, OFF(config_file), "", 0, 0,
     "YAML file of settings, keys named as the flags (pools: a list of name, models, prefill, "
     "decode, prefill-policy, decode-policy); the environment and flags win over it; SIGHUP "
     "and POST /admin/reload read it again",
     NULL, RELOADS},
    {"host", NULL, CT_STR, OFF(host), "127.0.0.1", 0, 0, "address to listen on", NULL, AT_START},
    {"port", NULL, CT_INT, OFF(port), "8000", 1, 65535, "port to listen on", NULL, AT_START},
    {"prefiller-hosts", "prefiller-host", CT_LIST, OFF(prefiller_hosts), "localhost", 0, 0,
     "prefill instance hosts (one or more; toy-proxy form)", NULL, RELOADS},
    {"prefiller-ports", "prefiller-port", CT_LIST, OFF(prefiller_ports), "8100", 1, 65535,
     "prefill instance ports, one per host", NULL, RELOADS},
    {"decoder-hosts", "decoder-host", CT_LIST, OFF(decoder_hosts), "localhost", 0, 0,
     "decode instance hosts (one or more; toy-proxy form)", NULL, RELOADS},
    {"decoder-ports", "decoder-port", CT_LIST, OFF(decoder_ports), "8200", 1, 65535,
     "decode instance ports, one per host", NULL, RELOADS},
    {"prefill", NULL, CT_URLS, OFF(prefill_urls), "", 0, 0,
     "prefill backend URL http[s]://host:port, repeatable; a host name is re-resolved every "
     "--dns-refresh and each address is a backend (with any --prefill or --decode, the toy "
     "flags' defaults apply to neither role)",
     NULL, RELOADS},
    {"decode", NULL, CT_URLS, OFF(decode_urls), "", 0, 0,
     "decode backend URL, repeatable, as --prefill", NULL, RELOADS},
    {"pool", NULL, CT_POOL, 0, "", 0, 0,
     "starts a model pool NAME[=MODEL,MODEL...] (models default to NAME): the --prefill and "
     "--decode after it are its backends, and requests whose body names one of its models go "
     "to it (flag and file only; without any pool one unnamed pool serves every model)",
     NULL, RELOADS},
    {"dns-refresh", NULL, CT_SECONDS, OFF(dns_refresh), "10", 0.1, 86400,
     "seconds between DNS re-resolutions of backend names", NULL, RELOADS},
    {"threads", NULL, CT_INT, OFF(threads), "0", 0, 1024,
     "worker threads, each with its own event loop (0: one per CPU)", NULL, AT_START},
    {"max-body-bytes", NULL, CT_INT, OFF(max_body_bytes), "33554432", 1, 1099511627776.0,
     "largest request body accepted (413 beyond)", NULL, AT_START},
    {"max-inflight", NULL, CT_INT, OFF(max_inflight), "0", 0, 100000000,
     "most requests in flight at once; beyond, 503 with Retry-After (0: unlimited)", NULL,
     AT_START},
    {"connect-timeout", NULL, CT_SECONDS, OFF(connect_timeout), "5", 0.001, 3600,
     "seconds to wait for an upstream TCP connection (504 beyond)", NULL, AT_START},
    {"prefill-timeout", NULL, CT_SECONDS, OFF(prefill_timeout), "600", 0, 86400,
     "seconds a prefill request may take in all (504 beyond; 0: no limit)", NULL, AT_START},
    {"decode-idle-timeout", NULL, CT_SECONDS, OFF(decode_idle_timeout), "600", 0, 86400,
     "seconds decode may go without sending a byte, before its response head (counted from "
     "the request) and between body bytes alike, before the request is failed: 504 before "
     "the head, the stream cut after (0: no limit)", NULL,
     AT_START},
    {"client-header-timeout", NULL, CT_SECONDS, OFF(client_header_timeout), "30", 0.001, 3600,
     "seconds a client has to send a complete request (408 beyond)", NULL, AT_START},
    {"keepalive-timeout", NULL, CT_SECONDS, OFF(keepalive_timeout), "75", 0.001, 86400,
     "seconds an idle client connection is kept open", NULL, AT_START},
    {"upstream-keepalive", NULL, CT_INT, OFF(upstream_keepalive), "256", 1, 65536,
     "idle keep-alive connections kept per backend address and worker thread (idle ones "
     "close after 4 s, before the backends' own keep-alive timeouts)",
     NULL, AT_START},
    {"send-timeout", NULL, CT_SECONDS, OFF(send_timeout), "30", 0, 86400,
     "seconds a client may read none of the output queued for it before it is closed (0: no "
     "limit)",
     NULL, AT_START},
    {"max-buffered-bytes", NULL, CT_INT, OFF(max_buffered_bytes), "268435456", 0, 1099511627776.0,
     "process-wide budget for request bodies held and responses queued; new bodies beyond it "
     "get 503 with Retry-After (0: no budget)",
     NULL, AT_START},
    {"max-connections", NULL, CT_INT, OFF(max_connections), "0", 0, 100000000,
     "most client connections open at once; past it a connection is answered 503 and closed "
     "(0: no limit but the descriptor limit)",
     NULL, AT_START},
    {"reuse-port", NULL, CT_FLAG, OFF(reuse_port), "false", 0, 0,
     "share the port with other processes that also set it (SO_REUSEPORT, one socket per "
     "worker); without it a port already served is an error and no other process can join "
     "this one (the workers share one socket)",
     NULL, AT_START},
    {"metrics-host", NULL, CT_STR, OFF(metrics_host), "", 0, 0,
     "address of the separate metrics listener (default: --host)", NULL, AT_START},
    {"metrics-port", NULL, CT_INT, OFF(metrics_port), "0", 0, 65535,
     "serve /metrics (with /health and /ready) on this port only, not on --port (0: on --port)",
     NULL, AT_START},
    {"metrics-auth", NULL, CT_FLAG, OFF(metrics_auth), "false", 0, 0,
     "/metrics on --port requires the API key like the API (probes /health, /ready stay open)",
     NULL, AT_START},
    {"health-interval", NULL, CT_SECONDS, OFF(health_interval), "5", 0, 3600,
     "seconds between active health checks, GET /health (0: none)", NULL, AT_START},
    {"health-timeout", NULL, CT_SECONDS, OFF(health_timeout), "2", 0.001, 600,
     "seconds a health check may take", NULL, AT_START},
    {"unhealthy-after", NULL, CT_INT, OFF(unhealthy_after), "3", 1, 1000,
     "consecutive failures (checks, connect errors, resets, 5xx) that eject a backend", NULL,
     RELOADS},
    {"healthy-after", NULL, CT_INT, OFF(healthy_after), "2", 1, 1000,
     "consecutive successful checks that readmit an ejected backend", NULL, RELOADS},
    {"prefill-retries", NULL, CT_INT, OFF(prefill_retries), "2", 0, 100,
     "retries of a prefill refused, reset or answering 5xx, each on another instance", NULL,
     AT_START},
    {"fallback-decode-only", NULL, CT_FLAG, OFF(fallback_decode_only), "false", 0, 0,
     "send a request to decode alone when no prefill is healthy (else 503) or when its prefill "
     "failed with 5xx or a connection error, retries spent (else 502)",
     NULL, AT_START},
    {"prefill-policy", NULL, CT_ENUM, OFF(prefill_policy), "round_robin", 0, 0,
     "how to choose a prefill instance", PX_POLICIES, RELOADS},
    {"decode-policy", NULL, CT_ENUM, OFF(decode_policy), "round_robin", 0, 0,
     "how to choose a decode instance", PX_POLICIES, RELOADS},
    {"dispatch", NULL, CT_ENUM, OFF(dispatch), "serial", 0, 0,
     "serial: prefill, then decode with prefill's kv_transfer_params; concurrent: both at once "
     "for a push connector (pdproxy mints the request id and token; a prefill whose identity "
     "is not known yet is sent serial)",
     PX_DISPATCH_MODES, RELOADS},
    {"prefill-dp-size", NULL, CT_INT, OFF(prefill_dp_size), "1", 1, 64,
     "data-parallel ranks behind each prefill (vLLM --data-parallel-size with one API server), "
     "unless its config entry declares dp_size: each request names the least loaded rank "
     "(pdproxy's requests in flight, corrected by the engine's per-rank /metrics) in "
     "X-data-parallel-rank (1: no header, the engine balances)",
     NULL, AT_START},
    {"decode-dp-size", NULL, CT_INT, OFF(decode_dp_size), "1", 1, 64,
     "data-parallel ranks behind each decode, chosen the same way (may differ from "
     "--prefill-dp-size)",
     NULL, AT_START},
    {"prefix-bytes", NULL, CT_INT, OFF(prefix_bytes), "256", 1, 1048576,
     "prefix_affinity_bytes: bytes of the prompt (or first chat messages) that are hashed; "
     "prefix_affinity: the same for a prompt shorter than one 128-byte block (longer ones "
     "follow their whole block chain)",
     NULL, RELOADS},
    {"prefix-load-factor", NULL, CT_SECONDS, OFF(prefix_load_factor), "1.25", 1, 100,
     "prefix_affinity: an instance takes at most this times the mean in-flight load", NULL,
     RELOADS},
    {"metrics-interval", NULL, CT_SECONDS, OFF(metrics_interval), "2", 0.05, 3600,
     "load_aware: seconds between load probes of each engine's /metrics", NULL, AT_START},
    /* Per-request decisions: conditional disaggregation and usage. */
    {"disagg-min-tokens", NULL, CT_INT, OFF(disagg_min_tokens), "0", 0, 100000000,
     "send a request straight to decode when its estimated uncached prompt is shorter than this "
     "many tokens (0: always disaggregate)",
     NULL, AT_START},
    {"disagg-bytes-per-token", NULL, CT_SECONDS, OFF(disagg_bytes_per_token), "4", 0.5, 64,
     "prompt bytes (as the JSON body spells them) per token in the prompt length estimate", NULL,
     AT_START},
    {"disagg-index-blocks", NULL, CT_INT, OFF(disagg_index_blocks), "65536", 1, 16777216,
     "entries of each worker's LRU index of prompt prefixes recently sent to each decode "
     "instance (one entry per 128 prompt bytes)",
     NULL, AT_START},
    {"kv-events-port", NULL, CT_INT, OFF(kv_events_port), "0", 0, 65535,
     "subscribe to each backend's vLLM KV-cache events (ZeroMQ PUB, --kv-events-config) at "
     "tcp://<backend host>:PORT and index what each engine holds (0: off; a config entry's "
     "kv_events_endpoint, or the admin API's, overrides it for that backend)",
     NULL, AT_START},
    {"kv-events-replay-port", NULL, CT_INT, OFF(kv_events_replay_port), "0", 0, 65535,
     "port of the engines' KV-event replay socket (ROUTER), asked for missed batches after a "
     "sequence gap (0: none; a gap drops that backend's index, rebuilt from later events; a "
     "config entry's kv_events_replay_endpoint overrides it)",
     NULL, AT_START},
    {"kv-cache-weight", NULL, CT_SECONDS, OFF(kv_cache_weight), "1", 0, 1000000,
     "kv_aware: score per prompt token the engine holds in its KV cache (its KV events)", NULL,
     RELOADS},
    {"kv-load-weight", NULL, CT_SECONDS, OFF(kv_load_weight), "1", 0, 1000000,
     "kv_aware: score lost per prompt token queued or in flight on the engine", NULL, RELOADS},
    {"tokenize-timeout", NULL, CT_SECONDS, OFF(tokenize_timeout), "0.05", 0, 60,
     "seconds an engine's POST /tokenize may take to give a prompt's exact tokens (kv_aware, "
     "or --disagg-min-tokens with --kv-events-port); past it the byte estimate is used (0: "
     "never ask)",
     NULL, AT_START},
    {"tokenize-cache-entries", NULL, CT_INT, OFF(tokenize_cache_entries), "4096", 1, 1048576,
     "prompts whose tokens each worker keeps (prompts of up to 65536 tokens)", NULL, AT_START},
    {"session-header", NULL, CT_STR, OFF(session_header), "x-session-id", 0, 0,
     "request header naming a conversation (else the body's \"user\"): its requests stay on "
     "the decode instance they went to while it is healthy and not overloaded (\"\": the body "
     "only)",
     NULL, AT_START},
    {"session-ttl", NULL, CT_SECONDS, OFF(session_ttl), "600", 0, 86400,
     "seconds a session is remembered after its last request (0: no sessions)", NULL,
     AT_START},
    {"kv-index-max-blocks", NULL, CT_INT, OFF(kv_index_max_blocks), "1048576", 1, 268435456,
     "most KV blocks indexed per backend (about 64 bytes each); stores past it are refused and "
     "counted",
     NULL, AT_START},
    {"kv-index-max-bytes", NULL, CT_INT, OFF(kv_index_max_bytes), "1073741824", 0,
     1099511627776.0,
     "most bytes of KV index tables over all backends; stores past it are refused and counted "
     "(0: no bound but --kv-index-max-blocks per backend)",
     NULL, AT_START},
    {"usage-from", NULL, CT_ENUM, OFF(usage_from), "prefill", 0, 0,
     "whose prompt_tokens_details.cached_tokens a disaggregated answer's usage reports: "
     "prefill's (what was computed from cache) or decode's (as the engine says)",
     "prefill|decode", AT_START},
    {"drain-delay", NULL, CT_SECONDS, OFF(drain_delay), "5", 0, 3600,
     "on SIGTERM, seconds /ready answers 503 before new connections stop", NULL, AT_START},
    {"drain-timeout", NULL, CT_SECONDS, OFF(drain_timeout), "60", 0, 86400,
     "on SIGTERM, seconds in-flight requests get to finish", NULL, AT_START},
    {"tls-cert", NULL, CT_STR, OFF(tls_cert), "", 0, 0, "PEM certificate chain: serve HTTPS", NULL,
     AT_START},
    {"tls-key", NULL, CT_STR, OFF(tls_key), "", 0, 0, "PEM private key for --tls-cert", NULL,
     AT_START},
    {"upstream-ca", NULL, CT_STR, OFF(upstream_ca), "", 0, 0,
     "PEM CA bundle to verify https:// backends (default: the system store)", NULL, AT_START},
    {"upstream-insecure", NULL, CT_FLAG, OFF(upstream_insecure), "false", 0, 0,
     "do not verify https:// backends' certificates", NULL, AT_START},
    {"api-key", NULL, CT_SECRET, OFF(api_key), "", 0, 0,
     "clients must send Authorization: Bearer <key> (401 otherwise)", NULL, AT_START},
    {"api-key-file", NULL, CT_STR, OFF(api_key_file), "", 0, 0,
     "file of accepted API keys, one per line", NULL, AT_START},
    {"upstream-api-key", NULL, CT_SECRET, OFF(upstream_api_key), "", 0, 0,
     "key sent to engines as Bearer (else the client's Authorization, else $OPENAI_API_KEY)", NULL,
     AT_START},
    {"log-level", NULL, CT_ENUM, OFF(log_level), "info", 0, 0, "log verbosity",
     "debug|info|warn|error", AT_START},
    {"log-format", NULL, CT_ENUM, OFF(log_format), "logfmt", 0, 0, "log line format", "logfmt|json",
     AT_START},
    {"access-log", NULL, CT_FLAG, OFF(access_log), "true", 0, 0,
     "one access line per request, at level info whatever --log-level says (false: none; "
     "--log-level warn keeps access lines and drops other info lines)",
     NULL, AT_START},
    {"access-log-buffer", NULL, CT_INT, OFF(access_log_buffer), "65536", 0, 16777216,
     "bytes of access lines each worker gathers before one write, as nginx's access_log "
     "buffer= (0: a write per line)",
     NULL, AT_START},
    {"access-log-flush", NULL, CT_SECONDS, OFF(access_log_flush), "0.2", 0.001, 3600,
     "seconds an access line may wait in that buffer, as nginx's flush=", NULL, AT_START},
    {"log-file", NULL, CT_STR, OFF(log_file), "", 0, 0,
     "append the log (access lines included) to FILE instead of stderr; reopened on SIGUSR1 "
     "and SIGHUP (log rotation)",
     NULL, AT_START},
    {"admin-host", NULL, CT_STR, OFF(admin_host), "127.0.0.1", 0, 0,
     "address of the admin API listener", NULL, AT_START},
    {"admin-port", NULL, CT_INT, OFF(admin_port), "0", 0, 65535,
     "serve the admin API (/admin/...) on this port (0: off); needs --admin-token-file", NULL,
     AT_START},
    {"admin-token-file", NULL, CT_STR, OFF(admin_token_file), "", 0, 0,
     "file holding the admin API's bearer token (never the client API key)", NULL, AT_START},
    {"prefiller-from-header", NULL, CT_FLAG, OFF(prefiller_from_header), "false", 0, 0,
     "sidecar mode: prefill on the instance named by the request's x-prefiller-host-port "
     "header when its host and port are in --prefiller-allowlist (400 otherwise)",
     NULL, AT_START},
    {"prefiller-allowlist", NULL, CT_WORDS, OFF(prefiller_allowlist), "", 0, 0,
     "HOST:PORT targets x-prefiller-host-port may name, comma or space separated: HOST a "
     "CIDR, an address or a host name ([v6] in brackets), PORT a port, a range N-M, or * for "
     "every port (10.0.0.0/8:8000, [fd00::/8]:8000-8003, prefill.example:*)", NULL,
     AT_START},
    {"allow-empty-pools", NULL, CT_FLAG, OFF(allow_empty_pools), "false", 0, 0,
     "accept a reload or admin API change that leaves a pool without a prefill or decode "
     "backend; without it such a change is refused and the running configuration stays",
     NULL, AT_START},
    {"loop-limit", NULL, CT_INT, OFF(loop_limit), "1", 0, 100,
     "answer 508 Loop Detected to a request whose Via already names this proxy more than this "
     "many times (every request to a backend carries this proxy's Via marker)",
     NULL, AT_START},
    {"queue-max", NULL, CT_INT, OFF(queue_max), "0", 0, 10000000,
     "requests that may wait for a saturated pool (split between the worker threads); past "
     "it 429 (0: no queue: a request for a saturated pool gets 429 at once)",
     NULL, AT_START},
    {"queue-max-bytes", NULL, CT_INT, OFF(queue_max_bytes), "67108864", 0, 1099511627776.0,
     "request bodies the waiting requests may hold, split between the worker threads (0: no "
     "bound but --max-buffered-bytes)",
     NULL, AT_START},
    {"queue-timeout", NULL, CT_SECONDS, OFF(queue_timeout), "30", 0.001, 86400,
     "seconds a request may wait for its pool (503 with Retry-After beyond); the request's "
     "x-queue-timeout header (seconds) may shorten it",
     NULL, AT_START},
    {"pool-max-inflight", NULL, CT_INT, OFF(pool_max_inflight), "0", 0, 100000000,
     "a pool is saturated while this many of its requests are sent on (0: no limit; a reload "
     "or POST /admin/admission changes it, for queued requests too)",
     NULL, RELOADS},
    {"saturate-waiting", NULL, CT_INT, OFF(saturate_waiting), "0", 0, 100000000,
     "a pool is saturated while every decode engine reports at least this many requests "
     "waiting (vllm:num_requests_waiting, read every --metrics-interval; 0: not looked at)",
     NULL, AT_START},
    {"saturate-kv-usage", NULL, CT_SECONDS, OFF(saturate_kv_usage), "0", 0, 1,
     "a pool is saturated while every decode engine reports at least this fraction of its KV "
     "cache in use (vllm:kv_cache_usage_perc, 1 = full, read every --metrics-interval; 0: not "
     "looked at)",
     NULL, AT_START},
    {"saturate-ttfb", NULL, CT_SECONDS, OFF(saturate_ttfb), "0", 0, 3600,
     "a pool is saturated while the moving average of its time to first byte (from dispatch "
     "to decode's first byte) is at least this many seconds and some request is sent on (0: "
     "off)",
     NULL, AT_START},
    {"engine-backoff", NULL, CT_SECONDS, OFF(engine_backoff), "1", 0, 3600,
     "seconds a backend that answered 429 or 503 (its queue is full) counts as saturated "
     "rather than failed",
     NULL, AT_START},
    {"tenant-header", NULL, CT_STR, OFF(tenant_header), "x-tenant", 0, 0,
     "request header naming the tenant for fairness and rate limits (absent or unknown: the "
     "default tenant)",
     NULL, AT_START},
    {"priority-header", NULL, CT_STR, OFF(priority_header), "x-priority", 0, 0,
     "request header giving the priority: a number, lower first, or a --priority-class name "
     "(else the body's \"priority\", as vLLM takes it; else 0)",
     NULL, AT_START},
    {"priority-class", NULL, CT_WORDS, OFF(priority_classes), "", 0, 0,
     "priority classes in the order served, each NAME:LO..HI (or NAME:P), the priority values "
     "it takes; a value in none goes to the last class, a header may name a class (none: "
     "classes 0..15 are the priority itself, clamped)",
     NULL, RELOADS},
    {"tenant", NULL, CT_WORDS, OFF(tenants), "", 0, 0,
     "tenants, each NAME[:weight=W][:rpm=N][:tpm=N]: W its share of dispatch out of the queue "
     "(1), N its requests or tokens per minute (0: no limit; 429 with x-ratelimit-* beyond); a "
     "reload or POST /admin/admission changes, adds and removes tenants at once, queued "
     "requests kept",
     NULL, RELOADS},
    {"slo-ttft-ms", NULL, CT_SECONDS, OFF(slo_ttft_ms), "0", 0, 3600000,
     "time-to-first-token target (ms) of a request whose x-slo-ttft-ms header, tenant, "
     "priority class and pool (--slo) give none; counted in pdproxy_slo_attained_total and "
     "used by the latency policy (0: none)",
     NULL, AT_START},
    {"slo-tpot-ms", NULL, CT_SECONDS, OFF(slo_tpot_ms), "0", 0, 3600000,
     "time-per-output-token target (ms), the same way (x-slo-tpot-ms; 0: none)", NULL, AT_START},
    {"slo-miss", NULL, CT_ENUM, OFF(slo_miss), "send", 0, 0,
     "latency policy: a request predicted to miss its TTFT target on every engine is sent "
     "anyway, waits in the admission queue until its prediction fits or the engines are "
     "about idle (queue: needs --queue-max), or is refused at once with Retry-After (refuse); "
     "--slo's miss= per tenant, class or pool",
     "send|queue|refuse", AT_START},
    {"slo-refuse-status", NULL, CT_ENUM, OFF(slo_refuse_status), "503", 0, 0,
     "status of a refusal by prediction (--slo's status=)", "503|429", AT_START},
    {"slo", NULL, CT_WORDS, OFF(slo), "", 0, 0,
     "latency targets, each KIND=NAME:key=value[:...], KIND tenant, class or pool (pool=* for "
     "every pool), keys ttft and tpot (ms), miss (send|queue|refuse), status (503|429); a "
     "header wins, then tenant, class, pool; a reload or POST /admin/slo replaces them",
     NULL, RELOADS},
    {"latency-decode-only", NULL, CT_FLAG, OFF(latency_decode_only), "true", 0, 0,
     "latency policy: send a request to decode alone when that is predicted faster than every "
     "prefill-decode pair (conditional disaggregation by prediction; false: always a pair)",
     NULL, AT_START},
    {"latency-half-life", NULL, CT_SECONDS, OFF(latency_half_life), "30", 0.1, 86400,
     "latency model: seconds after which a sample counts half, so an engine that changes is "
     "relearned and one unused drifts back to the pooled fit",
     NULL, AT_START},
    {"latency-keep", NULL, CT_SECONDS, OFF(latency_keep), "0.95", 0.5, 1,
     "latency model: share of the past kept per new sample (0.95: about the last 20 count)",
     NULL, AT_START},
    {"print-config", NULL, CT_FLAG, OFF(print_config), "false", 0, 0,
     "print the effective configuration as YAML (a --config file) and exit", NULL, AT_START},
};
#define NOPTS (sizeof opts / sizeof *opts)
_Static_assert(NOPTS <= sizeof(((px_config *)0)->set), "grow px_config.set");

void px_strlist_clear(px_strlist *l) {
    for (size_t i = 0; i < l->n; i++)
        free(l->v[i]);
    free(l->v);
    l->v = NULL;
    l->n = 0;
}

static void list_push(px_strlist *l, const char *s, size_t n) {
    l->v = px_xrealloc(l->v, (l->n + 1) * sizeof *l->v);
    l->v[l->n++] = px_xstrndup(s, n);
}
void px_strlist_push(px_strlist *l, const char *s) {
    list_push(l, s, strlen(s));
}

static void list_copy(px_strlist *to, const px_strlist *from) {
    for (size_t i = 0; i < from->n; i++)
        px_strlist_push(to, from->v[i]);
}

/* ---------- allowlists ---------- */

/* Parses "addr/bits" (or a bare address: every bit). */
static int cidr_parse(const char *s, int *fam, unsigned char a[16], int *bits) {
    char buf[64];
    const char *slash = strchr(s, '/');
    size_t n = slash ? (size_t)(slash - s) : strlen(s);
    if (n >= sizeof buf) return -1;
    memcpy(buf, s, n);
    buf[n] = '\0';
    if (inet_pton(AF_INET, buf, a) == 1)
        *fam = AF_INET, *bits = 32;
    else if (inet_pton(AF_INET6, buf, a) == 1)
        *fam = AF_INET6, *bits = 128;
    else
        return -1;
    if (slash) {
        char *end;
        long b = strtol(slash + 1, &end, 10);
        if (*end || end == slash + 1 || b < 0 || b > *bits) return -1;
        *bits = (int)b;
    }
    return 0;
}

static int is_host_name(const char *s) {
    if (!*s || strlen(s) > 253) return 0;
    for (const char *p = s; *p; p++)
        if (!isalnum((unsigned char)*p) && *p != '-' && *p != '.') return 0;
    return 1;
}

/* Splits an allowlist entry HOST:PORTS (HOST a CIDR, an address or a host
 * name, an IPv6 one in brackets; PORTS a port, a range N-M, or * for every
 * port) into host and [lo, hi]. -1 when it is not so written. */
static int allow_split(const char *e, char *host, size_t hn, int *lo, int *hi) {
    const char *colon;
    const char *h = e;
    size_t hl;
    if (e[0] == '[') {
        const char *close = strchr(e, ']');
        if (!close || close[1] != ':') return -1;
        h = e + 1;
        hl = (size_t)(close - h);
        colon = close + 1;
    } else {
        colon = strrchr(e, ':');
        if (!colon || memchr(e, ':', (size_t)(colon - e))) return -1; /* v6: brackets */
        hl = (size_t)(colon - e);
    }
    if (!hl || hl >= hn) return -1;
    memcpy(host, h, hl);
    host[hl] = '\0';
    const char *p = colon + 1;
    if (!strcmp(p, "*")) {
        *lo = 1, *hi = 65535;
        return 0;
    }
    char *end;
    long a = strtol(p, &end, 10), b = a;
    if (end == p || *p == '-' || *p == '+') return -1;
    if (*end == '-') {
        const char *q = end + 1;
        if (*q < '0' || *q > '9') return -1;
        b = strtol(q, &end, 10);
    }
    if (*end || a < 1 || b > 65535 || a > b) return -1;
    *lo = (int)a, *hi = (int)b;
    return 0;
}

int px_target_allowed(const px_strlist *allow, const char *host, int port) {
    unsigned char h[16];
    int hfam = 0;
    if (inet_pton(AF_INET, host, h) == 1)
        hfam = AF_INET;
    else if (inet_pton(AF_INET6, host, h) == 1)
        hfam = AF_INET6;
    for (size_t i = 0; i < allow->n; i++) {
        unsigned char a[16];
        int fam, bits, lo, hi;
        char eh[300];
        if (allow_split(allow->v[i], eh, sizeof eh, &lo, &hi) < 0 || port < lo || port > hi)
            continue;
        if (cidr_parse(eh, &fam, a, &bits) == 0) {
            if (fam != hfam) continue;
            size_t full = (size_t)bits / 8;
            int rest = bits % 8;
            if (memcmp(a, h, full)) continue;
            if (rest && ((a[full] ^ h[full]) & (0xff << (8 - rest)) & 0xff)) continue;
            return 1;
        }
        if (!hfam && !strcasecmp(eh, host)) return 1;
    }
    return 0;
}

static int check_word(const opt *o, const char *v, char *err, size_t errlen) {
    if (!strcmp(o->name, "tenant")) return px_tenant_spec_check(v, err, errlen);
    if (!strcmp(o->name, "priority-class")) return px_prio_spec_check(v, err, errlen);
    if (!strcmp(o->name, "slo")) return px_slo_spec_check(v, err, errlen);
    int fam, bits, lo, hi;
    unsigned char a[16];
    char h[300];
    if (allow_split(v, h, sizeof h, &lo, &hi) < 0) {
        snprintf(err, errlen,
                 "--%s '%s': not HOST:PORT (HOST a CIDR, an address or a host name, an IPv6 "
                 "one in brackets; PORT a port, a range N-M, or * for every port)",
                 o->name, v);
        return -1;
    }
    if (cidr_parse(h, &fam, a, &bits) == 0 || (!strchr(h, '/') && is_host_name(h))) return 0;
    snprintf(err, errlen, "--%s '%s': '%s' is not a CIDR, an address or a host name", o->name, v,
             h);
    return -1;
}

/* ---------- pools ---------- */

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
        list_copy(&o[i].models, &v[i].models);
        list_copy(&o[i].prefill, &v[i].prefill);
        list_copy(&o[i].decode, &v[i].decode);
        list_copy(&o[i].prefill_toy, &v[i].prefill_toy);
        list_copy(&o[i].decode_toy, &v[i].decode_toy);
    }
    return o;
}

static px_pool_spec *pool_new(px_config *c, const char *v, size_t len) {
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
        if (l) list_push(&p->models, m, l);
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
static int toy_in_effect(const px_config *c, int prefill) {
    if (c->npools) return 0;
    int given = prefill ? px_config_is_set(c, "prefiller-hosts") ||
                              px_config_is_set(c, "prefiller-ports")
                        : px_config_is_set(c, "decoder-hosts") ||
                              px_config_is_set(c, "decoder-ports");
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
    if (toy_in_effect(c, 1)) toy_urls(&p->prefill_toy, &c->prefiller_hosts, &c->prefiller_ports);
    if (toy_in_effect(c, 0)) toy_urls(&p->decode_toy, &c->decoder_hosts, &c->decoder_ports);
    list_copy(&p->prefill, &c->prefill_urls);
    list_copy(&p->decode, &c->decode_urls);
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
        const char *missing = !p->decode.n && !p->decode_toy.n                 ? "decode"
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

/* Checks one element of a list against the option's bounds. */
static int check_list_item(const opt *o, const char *v, char *err, size_t errlen) {
    if (!*v) {
        snprintf(err, errlen, "--%s '%s': empty value", o->name, v);
        return -1;
    }
    /* A URL in a toy host flag would become a backend named "http" that
     * never answers: say what was meant instead. */
    if (o->max == 0 && (strstr(v, "://") || strchr(v, '/'))) {
        snprintf(err, errlen, "--%s '%s': a host name or address, not a URL (use --%s %s)", o->name,
                 v, strncmp(o->name, "prefill", 7) ? "decode" : "prefill", v);
        return -1;
    }
    if (o->max > 0) {
        char *end;
        errno = 0;
        long x = strtol(v, &end, 10);
        if (errno || *end || end == v || x < o->min || x > o->max) {
            snprintf(err, errlen, "--%s '%s': not an integer in %.0f..%.0f", o->name, v, o->min,
                     o->max);
            return -1;
        }
    }
    return 0;
}

/* http[s]://host[:port] with nothing after but an optional "/". */
static int check_url(const opt *o, const char *v, char *err, size_t errlen) {
    const char *h = NULL;
    if (!strncmp(v, "http://", 7))
        h = v + 7;
    else if (!strncmp(v, "https://", 8))
        h = v + 8;
    if (!h || !*h || *h == '/' || *h == ':') {
        snprintf(err, errlen, "--%s '%s': expected http://host:port or https://host:port", o->name,
                 v);
        return -1;
    }
    const char *slash = strchr(h, '/');
    if (slash && slash[1]) {
        snprintf(err, errlen, "--%s '%s': a backend URL has no path", o->name, v);
        return -1;
    }
    const char *colon = h[0] == '[' ? strstr(h, "]:") : strrchr(h, ':');
    if (colon) {
        char *end;
        long port = strtol(colon + (h[0] == '[' ? 2 : 1), &end, 10);
        if ((*end && *end != '/') || port < 1 || port > 65535) {
            snprintf(err, errlen, "--%s '%s': bad port", o->name, v);
            return -1;
        }
    }
    return 0;
}

/* Replaces *l by the comma- or space-separated items of v (the text form of
 * defaults and the environment), each checked by `check`. */
static int split_list(const opt *o, px_strlist *l, const char *v,
                      int (*check)(const opt *, const char *, char *, size_t), char *err,
                      size_t errlen) {
    px_strlist_clear(l);
    const char *p = v;
    while (*p) {
        while (*p == ',' || *p == ' ')
            p++;
        const char *s0 = p;
        while (*p && *p != ',' && *p != ' ')
            p++;
        if (p > s0) {
            list_push(l, s0, (size_t)(p - s0));
            if (check(o, l->v[l->n - 1], err, errlen) < 0) return -1;
        }
    }
    return 0;
}

/* Sets a scalar option from text. Lists are handled by the callers. */
static int set_value(px_config *c, const opt *o, const char *v, char *err, size_t errlen) {
    void *field = (char *)c + o->off;
    switch (o->type) {
    case CT_STR:
        free(*(char **)field);
        *(char **)field = px_xstrdup(v);
        return 0;
    case CT_SECRET:
        free(*(char **)field);
        *(char **)field = px_xstrdup(v);
        return 0;
    case CT_ENUM: {
        size_t n = strlen(v);
        const char *p = o->choices;
        while (p && *p) {
            const char *e = strchr(p, '|');
            size_t l = e ? (size_t)(e - p) : strlen(p);
            if (l == n && !strncmp(p, v, n)) {
                free(*(char **)field);
                *(char **)field = px_xstrdup(v);
                return 0;
            }
            p = e ? e + 1 : NULL;
        }
        snprintf(err, errlen, "--%s '%s': expected one of %s", o->name, v, o->choices);
        return -1;
    }
    case CT_URLS:
        /* Text form (env, defaults); each occurrence on the command line
         * appends instead. */
        return split_list(o, field, v, check_url, err, errlen);
    case CT_INT: {
        char *end;
        errno = 0;
        long long x = strtoll(v, &end, 10);
        if (errno || end == v || *end) {
            snprintf(err, errlen, "--%s '%s': not an integer", o->name, v);
            return -1;
        }
        if ((double)x < o->min || (double)x > o->max) {
            snprintf(err, errlen, "--%s '%s': out of range %.0f..%.0f", o->name, v, o->min, o->max);
            return -1;
        }
        *(int64_t *)field = x;
        return 0;
    }
    case CT_SECONDS: {
        char *end;
        errno = 0;
        double x = strtod(v, &end);
        if (errno || end == v || *end || !isfinite(x)) {
            snprintf(err, errlen, "--%s '%s': not a number of seconds", o->name, v);
            return -1;
        }
        if (x < o->min || x > o->max) {
            snprintf(err, errlen, "--%s '%s': out of range %g..%g seconds", o->name, v, o->min,
                     o->max);
            return -1;
        }
        *(double *)field = x;
        return 0;
    }
    case CT_FLAG:
        if (!strcmp(v, "1") || !strcmp(v, "true") || !strcmp(v, "yes") || !strcmp(v, "on")) {
            *(int *)field = 1;
        } else if (!strcmp(v, "0") || !strcmp(v, "false") || !strcmp(v, "no") ||
                   !strcmp(v, "off")) {
            *(int *)field = 0;
        } else {
            snprintf(err, errlen, "--%s '%s': expected true or false", o->name, v);
            return -1;
        }
        return 0;
    case CT_WORDS:
        return split_list(o, field, v, check_word, err, errlen);
    case CT_POOL:
        if (!*v) return 0; /* the default: no pool */
        snprintf(err, errlen, "--%s '%s': pools are given as flags or in the --config file",
                 o->name, v);
        return -1;
    case CT_LIST: {
        px_strlist *l = field;
        if (split_list(o, l, v, check_list_item, err, errlen) < 0) return -1;
        if (!l->n) {
            snprintf(err, errlen, "--%s '%s': needs at least one value", o->name, v);
            return -1;
        }
        return 0;
    }
    }
    return -1;
}

static const opt *find_opt(const char *name, size_t n) {
    for (size_t i = 0; i < NOPTS; i++) {
        if (strlen(opts[i].name) == n && !strncmp(opts[i].name, name, n)) return &opts[i];
        if (opts[i].alias && strlen(opts[i].alias) == n && !strncmp(opts[i].alias, name, n))
            return &opts[i];
    }
    return NULL;
}

static int in_choices(const char *choices, const char *v) {
    size_t n = strlen(v);
    for (const char *p = choices; p && *p;) {
        const char *e = strchr(p, '|');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        if (l == n && !strncmp(p, v, n)) return 1;
        p = e ? e + 1 : NULL;
    }
    return 0;
}

static int check_model(const opt *o, const char *v, char *err, size_t errlen) {
    (void)o, (void)err, (void)errlen, (void)v;
    return 0; /* split_list drops empty items; any other name is a model's */
}

/* ---------- the YAML file ---------- */

typedef struct yctx {
    yaml_document_t doc;
    const char *path;
    char *err;
    size_t errlen;
    px_config *c;
} yctx;

static size_t yline(const yaml_node_t *n) {
    return n->start_mark.line + 1;
}

/* The file's spelling of a key: flags' names, '_' read as '-'. */
static void ykey(const yaml_node_t *k, char *buf, size_t n) {
    size_t l = k->data.scalar.length < n - 1 ? k->data.scalar.length : n - 1;
    memcpy(buf, k->data.scalar.value, l);
    buf[l] = '\0';
    for (char *p = buf; *p; p++)
        if (*p == '_') *p = '-';
}

int px_config_kv_endpoint_check(const char *ep, char *err, size_t errlen) {
    const char *why = NULL;
    for (const char *p = ep; *p && !why; p++)
        if ((unsigned char)*p <= ' ' || *p == 0x7f) why = "no spaces or control characters";
    if (why) {
    } else if (!strncmp(ep, "ipc://", 6)) {
        size_t n = strlen(ep + 6);
        if (!n || n >= 108) why = "ipc:// needs a path of 1 to 107 bytes";
    } else if (strncmp(ep, "tcp://", 6)) {
        why = "expected tcp://HOST:PORT or ipc://PATH";
    } else {
        const char *h = ep + 6, *colon = strrchr(h, ':');
        size_t hl = colon ? (size_t)(colon - h) : 0;
        char *end = NULL;
        long port = colon && colon[1] >= '0' && colon[1] <= '9' ? strtol(colon + 1, &end, 10) : 0;
        if (!colon || !hl || !end || *end || port < 1 || port > 65535)
            why = "expected tcp://HOST:PORT with a port in [1, 65535]";
        else if (h[0] == '[' ? hl < 3 || h[hl - 1] != ']' || memchr(h + 1, ']', hl - 2)
                             : memchr(h, ':', hl) || memchr(h, '*', hl) || memchr(h, ';', hl))
            why = "the host is a name, an IPv4 address or [IPv6] (no wildcard: pdproxy connects)";
    }
    if (!why) return 0;
    snprintf(err, errlen, "'%.200s': %s", ep, why);
    return -1;
}

/* A backend entry of a prefill/decode list written as a mapping: {url: U,
 * dp_size: N, kv_events_endpoint: E, kv_events_replay_endpoint: R}, all
 * but url optional. N: the data-parallel ranks behind that API server,
 * 1..64, over --prefill-dp-size / --decode-dp-size; recorded in
 * c->backend_dp. E and R: where that engine publishes its KV events and
 * answers replays, over what --kv-events-port / --kv-events-replay-port
 * derive from its address; recorded in c->backend_kv. Returns the URL
 * (owned); NULL with the error set. */
static char *ybackend(yctx *y, const char *key, yaml_node_t *m) {
    char *url = NULL, *ep[2] = {NULL, NULL};
    static const char *const epkey[2] = {"kv-events-endpoint", "kv-events-replay-endpoint"};
    long dp = 0;
    for (yaml_node_pair_t *pr = m->data.mapping.pairs.start; pr < m->data.mapping.pairs.top; pr++) {
        yaml_node_t *k = yaml_document_get_node(&y->doc, pr->key);
        yaml_node_t *v = yaml_document_get_node(&y->doc, pr->value);
        char f[32] = "";
        if (k && k->type == YAML_SCALAR_NODE) ykey(k, f, sizeof f);
        int e = !strcmp(f, epkey[0]) ? 0 : !strcmp(f, epkey[1]) ? 1 : -1;
        if (!v || v->type != YAML_SCALAR_NODE ||
            (strcmp(f, "url") && strcmp(f, "dp-size") && e < 0) || (!strcmp(f, "url") && url) ||
            (e >= 0 && ep[e])) {
            snprintf(y->err, y->errlen,
                     "%s:%zu: key '%s': a backend entry is a URL or a mapping of url and "
                     "dp_size, kv_events_endpoint, kv_events_replay_endpoint (each once)",
                     y->path, yline(k ? k : m), key);
            goto fail;
        }
        char *t = px_xstrndup((char *)v->data.scalar.value, v->data.scalar.length);
        if (f[0] == 'u') {
            url = t;
            continue;
        }
        if (e >= 0) {
            char why[300];
            ep[e] = t;
            if (px_config_kv_endpoint_check(t, why, sizeof why) < 0) {
                snprintf(y->err, y->errlen, "%s:%zu: key '%s': %s %s", y->path, yline(v), key,
                         e ? "kv_events_replay_endpoint" : "kv_events_endpoint", why);
                goto fail;
            }
            continue;
        }
        char *end;
        dp = strtol(t, &end, 10);
        int bad = !t[0] || *end || dp < 1 || dp > 64;
        free(t);
        if (bad) {
            snprintf(y->err, y->errlen, "%s:%zu: key '%s': dp_size must be an integer in [1, 64]",
                     y->path, yline(v), key);
            goto fail;
        }
    }
    if (!url || !url[0] || strchr(url, ' ') || strchr(url, ',')) {
        snprintf(y->err, y->errlen, "%s:%zu: key '%s': a backend entry needs one url", y->path,
                 yline(m), key);
        goto fail;
    }
    if (dp > 0) {
        char item[600];
        snprintf(item, sizeof item, "%ld %s", dp, url);
        px_strlist_push(&y->c->backend_dp, item);
    }
    if (ep[0] || ep[1]) {
        px_buf b;
        px_buf_init(&b);
        px_buf_printf(&b, "%s %s %s", url, ep[0] ? ep[0] : "-", ep[1] ? ep[1] : "-");
        px_strlist_push(&y->c->backend_kv, b.data);
        px_buf_cleanup(&b);
    }
    free(ep[0]);
    free(ep[1]);
    return url;
fail:
    free(url);
    free(ep[0]);
    free(ep[1]);
    return NULL;
}

/* A setting's text: a scalar as is, a sequence of scalars joined by spaces
 * (the lists' text form). Returns NULL with the error set otherwise. */
static char *yvalue(yctx *y, const char *key, yaml_node_t *v) {
    if (v->type == YAML_SCALAR_NODE)
        return px_xstrndup((char *)v->data.scalar.value, v->data.scalar.length);
    if (v->type == YAML_SEQUENCE_NODE) {
        px_buf b;
        px_buf_init(&b);
        px_buf_appends(&b, "");
        for (yaml_node_item_t *it = v->data.sequence.items.start; it < v->data.sequence.items.top;
             it++) {
            yaml_node_t *e = yaml_document_get_node(&y->doc, *it);
            if (e && e->type == YAML_MAPPING_NODE && y->c &&
                (!strcmp(key, "prefill") || !strcmp(key, "decode"))) {
                char *u = ybackend(y, key, e);
                if (!u) {
                    px_buf_cleanup(&b);
                    return NULL;
                }
                if (b.len) px_buf_appends(&b, " ");
                px_buf_appends(&b, u);
                free(u);
                continue;
            }
            if (!e || e->type != YAML_SCALAR_NODE ||
                memchr(e->data.scalar.value, ' ', e->data.scalar.length) ||
                memchr(e->data.scalar.value, ',', e->data.scalar.length)) {
                snprintf(y->err, y->errlen, "%s:%zu: key '%s': list items must be plain values",
                         y->path, e ? yline(e) : yline(v), key);
                px_buf_cleanup(&b);
                return NULL;
            }
            if (b.len) px_buf_appends(&b, " ");
            px_buf_append(&b, (char *)e->data.scalar.value, e->data.scalar.length);
        }
        return b.data;
    }
    snprintf(y->err, y->errlen, "%s:%zu: key '%s': expected a value or a list", y->path, yline(v),
             key);
    return NULL;
}

/* set_value's message names the flag ("--port 'x': ..."); in the file the
 * key and line say more. */
static void yerr_from(yctx *y, const char *key, size_t line, const char *msg) {
    char m[512];
    snprintf(m, sizeof m, "%s", msg);
    const char *r = m;
    if (!strncmp(r, "--", 2)) {
        const char *sp = strchr(r, ' ');
        if (sp) r = sp + 1;
    }
    snprintf(y->err, y->errlen, "%s:%zu: key '%s': %s", y->path, line, key, r);
}

static int ylist(yctx *y, const char *key, yaml_node_t *v, px_strlist *l, const opt *chk) {
    char *t = yvalue(y, key, v);
    if (!t) return -1;
    char e[400];
    int rc = split_list(chk, l, t, check_url, e, sizeof e);
    free(t);
    if (rc < 0) yerr_from(y, key, yline(v), e);
    return rc;
}

/* A pool's dispatch: serial|concurrent (dispatch.h). */
static int ypool_dispatch(yctx *y, px_pool_spec *p, yaml_node_t *v) {
    if (v->type != YAML_SCALAR_NODE) {
        snprintf(y->err, y->errlen, "%s:%zu: key 'dispatch': expected a value", y->path, yline(v));
        return -1;
    }
    char *t = px_xstrndup((char *)v->data.scalar.value, v->data.scalar.length);
    if (px_dispatch_parse(t) < 0) {
        snprintf(y->err, y->errlen, "%s:%zu: key 'dispatch': '%s' is none of %s", y->path,
                 yline(v), t, PX_DISPATCH_MODES);
        free(t);
        return -1;
    }
    free(p->dispatch);
    p->dispatch = t;
    return 0;
}

static int ypool(yctx *y, px_config *c, yaml_node_t *m) {
    if (m->type != YAML_MAPPING_NODE) {
        snprintf(y->err, y->errlen,
                 "%s:%zu: key 'pools': each pool is a mapping (name, models, "
                 "prefill, decode)",
                 y->path, yline(m));
        return -1;
    }
    px_pool_spec *p = pool_new(c, "", 0);
    p->line = yline(m);
    for (yaml_node_pair_t *pr = m->data.mapping.pairs.start; pr < m->data.mapping.pairs.top; pr++) {
        yaml_node_t *k = yaml_document_get_node(&y->doc, pr->key);
        yaml_node_t *v = yaml_document_get_node(&y->doc, pr->value);
        if (!k || !v || k->type != YAML_SCALAR_NODE) continue;
        char key[64];
        ykey(k, key, sizeof key);
        if (!strcmp(key, "prefill") || !strcmp(key, "decode")) {
            if (ylist(y, key, v, key[0] == 'p' ? &p->prefill : &p->decode,
                      find_opt(key, strlen(key))) < 0)
                return -1;
        } else if (!strcmp(key, "models")) {
            char *t = yvalue(y, key, v);
            if (!t) return -1;
            char e[400];
            int rc = split_list(find_opt("pool", 4), &p->models, t, check_model, e, sizeof e);
            free(t);
            if (rc < 0) {
                yerr_from(y, "models", yline(v), e);
                return -1;
            }
        } else if (!strcmp(key, "name") || !strcmp(key, "prefill-policy") ||
                   !strcmp(key, "decode-policy")) {
            if (v->type != YAML_SCALAR_NODE) {
                snprintf(y->err, y->errlen, "%s:%zu: key '%s': expected a value", y->path, yline(v),
                         key);
                return -1;
            }
            char *t = px_xstrndup((char *)v->data.scalar.value, v->data.scalar.length);
            char **field = key[0] == 'n'   ? &p->name
                           : key[0] == 'p' ? &p->prefill_policy
                                           : &p->decode_policy;
            if (key[0] != 'n' && !in_choices(PX_POLICIES, t)) {
                snprintf(y->err, y->errlen, "%s:%zu: key '%s': '%s' is none of %s", y->path,
                         yline(v), key, t, PX_POLICIES);
                free(t);
                return -1;
            }
            free(*field);
            *field = t;
        } else if (!strcmp(key, "dispatch")) {
            if (ypool_dispatch(y, p, v) < 0) return -1;
        } else {
            snprintf(y->err, y->errlen,
                     "%s:%zu: unknown key '%s' in a pool (name, models, prefill, decode, "
                     "prefill-policy, decode-policy, dispatch)",
                     y->path, yline(k), key);
            return -1;
        }
    }
    return 0;
}

/* Applies the file's settings, each marked as given. */
/* Reads the whole --config file, refusing at once what would cost too
 * much: anything but a regular file (a FIFO would block the control
 * thread), more than PX_CONFIG_MAX_BYTES, or nesting deeper than
 * PX_CONFIG_MAX_DEPTH (checked on libyaml's events, before any document
 * is built). Returns the bytes (owned) or NULL with err set. */
static char *read_config(const char *path, size_t *len, char *err, size_t errlen) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0) {
        snprintf(err, errlen, "--config '%s': %s", path, strerror(errno));
        if (fd >= 0) close(fd);
        return NULL;
    }
    if (!S_ISREG(st.st_mode) || st.st_size > PX_CONFIG_MAX_BYTES) {
        if (!S_ISREG(st.st_mode))
            snprintf(err, errlen, "--config '%s': not a regular file", path);
        else
            snprintf(err, errlen, "--config '%s': larger than %d bytes", path,
                     PX_CONFIG_MAX_BYTES);
        close(fd);
        return NULL;
    }
    char *buf = px_xmalloc((size_t)st.st_size + 1);
    size_t n = 0;
    while (n < (size_t)st.st_size) {
        ssize_t r = read(fd, buf + n, (size_t)st.st_size - n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break; /* a file that shrank: parse what was read */
        n += (size_t)r;
    }
    close(fd);
    yaml_parser_t parser;
    yaml_parser_initialize(&parser);
    yaml_parser_set_input_string(&parser, (const unsigned char *)buf, n);
    int depth = 0, ok = 1;
    for (;;) {
        yaml_event_t ev;
        if (!yaml_parser_parse(&parser, &ev)) break; /* the load below reports it */
        yaml_event_type_t t = ev.type;
        size_t line = ev.start_mark.line + 1;
        yaml_event_delete(&ev);
        if (t == YAML_SEQUENCE_START_EVENT || t == YAML_MAPPING_START_EVENT) {
            if (++depth > PX_CONFIG_MAX_DEPTH) {
                snprintf(err, errlen, "%s:%zu: nested deeper than %d levels", path, line,
                         PX_CONFIG_MAX_DEPTH);
                ok = 0;
                break;
            }
        } else if (t == YAML_SEQUENCE_END_EVENT || t == YAML_MAPPING_END_EVENT) {
            depth--;
        } else if (t == YAML_STREAM_END_EVENT) {
            break;
        }
    }
    yaml_parser_delete(&parser);
    if (!ok) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

static int load_file(px_config *c, const char *path, char *err, size_t errlen) {
    size_t len;
    char *text = read_config(path, &len, err, errlen);
    if (!text) return -1;
    yaml_parser_t parser;
    yctx y = {.path = path, .err = err, .errlen = errlen, .c = c};
    yaml_parser_initialize(&parser);
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    int rc = -1;
    if (!yaml_parser_load(&parser, &y.doc)) {
        snprintf(err, errlen, "%s:%zu: %s%s%s", path, parser.problem_mark.line + 1,
                 parser.problem ? parser.problem : "malformed YAML", parser.context ? " " : "",
                 parser.context ? parser.context : "");
        yaml_parser_delete(&parser);
        free(text);
        return -1;
    }
    yaml_node_t *root = yaml_document_get_root_node(&y.doc);
    if (!root) {
        rc = 0; /* an empty file: nothing set */
        goto out;
    }
    if (root->type != YAML_MAPPING_NODE) {
        snprintf(err, errlen, "%s:%zu: expected a mapping of settings (key: value)", path,
                 yline(root));
        goto out;
    }
    for (yaml_node_pair_t *pr = root->data.mapping.pairs.start; pr < root->data.mapping.pairs.top;
         pr++) {
        yaml_node_t *k = yaml_document_get_node(&y.doc, pr->key);
        yaml_node_t *v = yaml_document_get_node(&y.doc, pr->value);
        if (!k || !v) continue;
        if (k->type != YAML_SCALAR_NODE) {
            snprintf(err, errlen, "%s:%zu: keys are plain names", path, yline(k));
            goto out;
        }
        char key[64];
        ykey(k, key, sizeof key);
        if (!strcmp(key, "pools")) {
            if (v->type != YAML_SEQUENCE_NODE) {
                snprintf(err, errlen, "%s:%zu: key 'pools': expected a list of pools", path,
                         yline(v));
                goto out;
            }
            for (yaml_node_item_t *it = v->data.sequence.items.start;
                 it < v->data.sequence.items.top; it++) {
                yaml_node_t *m = yaml_document_get_node(&y.doc, *it);
                if (m && ypool(&y, c, m) < 0) goto out;
            }
            continue;
        }
        const opt *o = find_opt(key, strlen(key));
        if (!o || o->type == CT_POOL || !strcmp(o->name, "config") ||
            !strcmp(o->name, "print-config")) {
            snprintf(err, errlen,
                     "%s:%zu: unknown key '%s' (keys are the flags' names, see --help)", path,
                     yline(k), key);
            goto out;
        }
        char *t = yvalue(&y, key, v);
        if (!t) goto out;
        /* "~" and an empty value: the setting's empty text. */
        if (v->type == YAML_SCALAR_NODE && v->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
            (!strcmp(t, "~") || !strcmp(t, "null"))) {
            free(t);
            t = px_xstrdup("");
        }
        char e[400];
        int bad = set_value(c, o, t, e, sizeof e) < 0;
        free(t);
        if (bad) {
            yerr_from(&y, key, yline(v), e);
            goto out;
        }
        c->set[o - opts] = 1;
    }
    rc = 0;
out:
    yaml_document_delete(&y.doc);
    yaml_parser_delete(&parser);
    free(text);
    return rc;
}

/* --help and --help-markdown group the flags by topic; each flag's group
 * and the name of its value (metavar) are here, beside the table above so
 * that its entries stay as they are. A flag missing here is listed under
 * "Other" (a test fails on that). */
static const char *const groups[] = {"Backends",
                                     "Routing",
                                     "Conditional disaggregation and usage",
                                     "Health and failover",
                                     "Listening and client limits",
                                     "Upstream connections",
                                     "Security",
                                     "Sidecar mode (llm-d)",
                                     "Metrics and logs",
                                     "Operations",
                                     "Other"};
#define NGROUPS (sizeof groups / sizeof *groups)
static const struct {
    const char *name;
    unsigned char group; /* index in groups[] */
    const char *metavar; /* NULL: by type */
} opt_meta[] = {
    {"prefiller-hosts", 0, "HOST [HOST...]"},
    {"prefiller-ports", 0, "PORT [PORT...]"},
    {"decoder-hosts", 0, "HOST [HOST...]"},
    {"decoder-ports", 0, "PORT [PORT...]"},
    {"prefill", 0, NULL},
    {"decode", 0, NULL},
    {"pool", 0, NULL},
    {"dns-refresh", 0, NULL},
    {"prefill-policy", 1, "POLICY"},
    {"decode-policy", 1, "POLICY"},
    {"dispatch", 1, "MODE"},
    {"prefix-bytes", 1, "BYTES"},
    {"prefix-load-factor", 1, "FACTOR"},
    {"prefill-dp-size", 1, "N"},
    {"decode-dp-size", 1, "N"},
    {"metrics-interval", 1, NULL},
    {"disagg-min-tokens", 2, "TOKENS"},
    {"disagg-bytes-per-token", 2, "BYTES"},
    {"disagg-index-blocks", 2, NULL},
    {"kv-events-port", 1, "PORT"},
    {"kv-events-replay-port", 1, "PORT"},
    {"kv-index-max-blocks", 1, NULL},
    {"kv-index-max-bytes", 1, "BYTES"},
    {"kv-cache-weight", 1, "WEIGHT"},
    {"session-header", 1, "NAME"},
    {"session-ttl", 1, NULL},
    {"tokenize-timeout", 1, NULL},
    {"tokenize-cache-entries", 1, NULL},
    {"kv-load-weight", 1, "WEIGHT"},
    {"usage-from", 2, "ROLE"},
    {"health-interval", 3, NULL},
    {"health-timeout", 3, NULL},
    {"unhealthy-after", 3, NULL},
    {"healthy-after", 3, NULL},
    {"prefill-retries", 3, NULL},
    {"fallback-decode-only", 3, NULL},
    {"host", 4, "ADDRESS"},
    {"port", 4, "PORT"},
    {"threads", 4, NULL},
    {"reuse-port", 4, NULL},
    {"max-body-bytes", 4, "BYTES"},
    {"max-inflight", 4, NULL},
    {"max-buffered-bytes", 4, "BYTES"},
    {"max-connections", 4, NULL},
    {"client-header-timeout", 4, NULL},
    {"keepalive-timeout", 4, NULL},
    {"send-timeout", 4, NULL},
    {"connect-timeout", 5, NULL},
    {"prefill-timeout", 5, NULL},
    {"decode-idle-timeout", 5, NULL},
    {"upstream-keepalive", 5, NULL},
    {"upstream-ca", 5, "FILE"},
    {"upstream-insecure", 5, NULL},
    {"upstream-api-key", 5, "KEY"},
    {"tls-cert", 6, "FILE"},
    {"tls-key", 6, "FILE"},
    {"api-key", 6, "KEY"},
    {"api-key-file", 6, "FILE"},
    {"metrics-auth", 6, NULL},
    {"prefiller-from-header", 7, NULL},
    {"prefiller-allowlist", 7, "CIDRS"},
    {"loop-limit", 6, NULL},
    {"metrics-host", 8, "ADDRESS"},
    {"metrics-port", 8, "PORT"},
    {"log-level", 8, "LEVEL"},
    {"log-format", 8, "FORMAT"},
    {"access-log", 8, NULL},
    {"access-log-buffer", 8, "BYTES"},
    {"access-log-flush", 8, NULL},
    {"log-file", 8, "FILE"},
    {"config", 9, "FILE"},
    {"print-config", 9, NULL},
    {"drain-delay", 9, NULL},
    {"drain-timeout", 9, NULL},
    {"admin-host", 9, "ADDRESS"},
    {"admin-port", 9, "PORT"},
    {"admin-token-file", 9, "FILE"},
    {"allow-empty-pools", 9, NULL},
    {"queue-max", 4, NULL},
    {"queue-max-bytes", 4, "BYTES"},
    {"queue-timeout", 4, NULL},
    {"pool-max-inflight", 4, NULL},
    {"saturate-waiting", 4, NULL},
    {"saturate-kv-usage", 4, "FRACTION"},
    {"saturate-ttfb", 4, NULL},
    {"engine-backoff", 4, NULL},
    {"tenant-header", 4, "NAME"},
    {"priority-header", 4, "NAME"},
    {"priority-class", 4, "SPECS"},
    {"tenant", 4, "SPECS"},
    {"slo-ttft-ms", 1, "MS"},
    {"slo-tpot-ms", 1, "MS"},
    {"slo-miss", 1, "ACTION"},
    {"slo-refuse-status", 1, "STATUS"},
    {"slo", 1, "SPECS"},
    {"latency-decode-only", 1, NULL},
    {"latency-half-life", 1, NULL},
    {"latency-keep", 1, "FRACTION"},
};

static unsigned opt_group(const opt *o) {
    for (size_t i = 0; i < sizeof opt_meta / sizeof *opt_meta; i++)
        if (!strcmp(opt_meta[i].name, o->name)) return opt_meta[i].group;
    return (unsigned)NGROUPS - 1;
}

static const char *opt_metavar(const opt *o) {
    for (size_t i = 0; i < sizeof opt_meta / sizeof *opt_meta; i++)
        if (!strcmp(opt_meta[i].name, o->name) && opt_meta[i].metavar) return opt_meta[i].metavar;
    switch (o->type) {
    case CT_LIST: return "V [V...]";
    case CT_WORDS: return "LIST";
    case CT_POOL: return "NAME[=MODELS]";
    case CT_URLS: return "URL";
    case CT_ENUM: return "CHOICE";
    case CT_FLAG: return "";
    case CT_SECONDS: return "SECONDS";
    case CT_INT: return "N";
    default: return "VALUE";
    }
}

/* Writes `text` from column `col`, wrapped at 80 columns, continuation
 * lines indented to `indent`. */
static void wrap(FILE *out, const char *text, int col, int indent) {
    const int width = 80;
    const char *p = text;
    while (*p) {
        while (*p == ' ')
            p++;
        size_t n = strcspn(p, " ");
        if (!n) break;
        if (col > indent && col + 1 + (int)n > width) {
            fprintf(out, "\n%*s", indent, "");
            col = indent;
        } else if (col > indent) {
            fputc(' ', out);
            col++;
        }
        fprintf(out, "%.*s", (int)n, p);
        col += (int)n;
        p += n;
    }
    fputc('\n', out);
}

static void usage(FILE *out) {
    fprintf(out, "Usage: pdproxy [OPTION]...\n"
                 "Prefill/decode disaggregation proxy for OpenAI-compatible engines.\n\n");
    wrap(out,
         "Every option is also read from the environment as PDPROXY_<NAME> (dashes become "
         "underscores: PDPROXY_PORT=8000) and, but --config, as a key of the --config file; "
         "flags win over the environment, which wins over the file.",
         0, 0);
    const int col = 30; /* where descriptions start */
    for (unsigned g = 0; g < NGROUPS; g++) {
        int any = 0;
        for (size_t i = 0; i < NOPTS; i++) {
            const opt *o = &opts[i];
            if (opt_group(o) != g) continue;
            if (!any) fprintf(out, "\n%s:\n", groups[g]);
            any = 1;
            char names[128], text[1024];
            const char *mv = opt_metavar(o);
            int n = snprintf(names, sizeof names, "  --%s%s%s", o->name, *mv ? " " : "", mv);
            if (o->type == CT_ENUM) {
                /* a|b|c as "a, b, c": wrap points */
                char ch[256];
                size_t k = 0;
                for (const char *q = o->choices; *q && k + 3 < sizeof ch; q++) {
                    if (*q == '|') {
                        ch[k++] = ',';
                        ch[k++] = ' ';
                    } else {
                        ch[k++] = *q;
                    }
                }
                ch[k] = '\0';
                snprintf(text, sizeof text, "%s: %s (default: %s)", o->help, ch, o->def);
            }
            else if (!o->def[0] || o->type == CT_FLAG)
                snprintf(text, sizeof text, "%s", o->help);
            else
                snprintf(text, sizeof text, "%s (default: %s)", o->help, o->def);
            if (o->alias) {
                size_t l = strlen(text);
                snprintf(text + l, sizeof text - l, "; also --%s", o->alias);
            }
            fputs(names, out);
            if (n + 2 <= col) {
                fprintf(out, "%*s", col - n, "");
                wrap(out, text, col, col);
            } else {
                fprintf(out, "\n%*s", col, "");
                wrap(out, text, col, col);
            }
        }
    }
    fprintf(out, "\nInformation:\n");
    fprintf(out, "  %-28s%s\n", "-h, --help", "show this help and exit");
    fprintf(out, "  %-28s%s\n", "--help-markdown", "the options as Markdown tables");
    fprintf(out, "  %-28s%s\n", "-V, --version", "show the version, commit and build options");
}

static void env_name(const opt *o, char *buf, size_t n);

/* The flags tables of README.md (and pdproxy(1)), one per group, from the
 * same table as --help. */
static void markdown(FILE *out) {
    for (unsigned g = 0; g < NGROUPS; g++) {
        int any = 0;
        for (size_t i = 0; i < NOPTS; i++) {
            const opt *o = &opts[i];
            if (opt_group(o) != g) continue;
            if (!any)
                fprintf(out, "%s**%s**\n\n| flag | environment | default | meaning |\n"
                             "|---|---|---|---|\n",
                        g ? "\n" : "", groups[g]);
            any = 1;
            char env[96];
            env_name(o, env, sizeof env);
            const char *mv = opt_metavar(o);
            fprintf(out, "| `--%s`%s%s", o->name, *mv ? " " : "", mv);
            if (o->alias) fprintf(out, " / `--%s`", o->alias);
            /* Pools are given as flags or in the file: PDPROXY_POOL is refused. */
            if (o->type == CT_POOL)
                fprintf(out, " | (none: flag and file only)");
            else
                fprintf(out, " | `%s`", env);
            fprintf(out, " | %s%s%s | %s", o->def[0] ? "`" : "", o->def, o->def[0] ? "`" : "",
                    o->help);
            if (o->type == CT_ENUM) fprintf(out, ": `%s`", o->choices);
            if (o->type == CT_URLS || o->type == CT_POOL) fprintf(out, " (repeatable)");
            if (o->type == CT_LIST) fprintf(out, " (one or more values)");
            fprintf(out, " |\n");
        }
    }
}

static void env_name(const opt *o, char *buf, size_t n) {
    size_t j = (size_t)snprintf(buf, n, "PDPROXY_");
    for (const char *p = o->name; *p && j + 1 < n; p++)
        buf[j++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
    buf[j] = '\0';
}

static int validate_pools(px_config *c, char *err, size_t errlen) {
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

/* The --config file named by PDPROXY_CONFIG or --config (the flag wins),
 * or NULL. */
static const char *file_named(int argc, char **argv, char **envp) {
    const char *file = NULL;
    for (char **e = envp; e && *e; e++)
        if (!strncmp(*e, "PDPROXY_CONFIG=", 15)) file = *e + 15;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--config") && i + 1 < argc)
            file = argv[++i];
        else if (!strncmp(argv[i], "--config=", 9))
            file = argv[i] + 9;
    }
    return file;
}

/* The PDPROXY_* variables over what is set. 0, or -1 with err. */
static int load_env(px_config *c, char **envp, char *err, size_t errlen) {
    for (size_t i = 0; envp && i < NOPTS; i++) {
        char name[96];
        env_name(&opts[i], name, sizeof name);
        size_t nl = strlen(name);
        for (char **e = envp; *e; e++) {
            if (strncmp(*e, name, nl) == 0 && (*e)[nl] == '=') {
                c->set[i] = 1;
                if (set_value(c, &opts[i], *e + nl + 1, err, errlen) < 0) {
                    size_t l = strlen(err);
                    snprintf(err + l, errlen - l, " (from %s)", name);
                    return -1;
                }
            }
        }
    }
    return 0;
}

/* --help, --help-markdown, --version: printed to out. Returns 1 when `a`
 * is one of them. */
static int informational(const char *a, FILE *out) {
    if (!strcmp(a, "--help") || !strcmp(a, "-h"))
        usage(out);
    else if (!strcmp(a, "--help-markdown"))
        markdown(out);
    else if (!strcmp(a, "--version") || !strcmp(a, "-V"))
        px_version_print(out);
    else
        return 0;
    return 1;
}

/* What the flags seen so far decide for the next ones. */
typedef struct flag_state {
    unsigned char seen_urls[NOPTS]; /* the command line's URLs replace the environment's */
    px_pool_spec *cur;              /* the pool the --prefill/--decode flags go to */
} flag_state;

/* A flag's value: after '=' or the next argument (*i moves past it). */
static const char *flag_value(const char *eq, int argc, char **argv, int *i) {
    return eq ? eq + 1 : (*i + 1 < argc ? argv[++*i] : NULL);
}

/* --pool NAME: the flags after it describe that pool. */
static int flag_pool(px_config *c, const opt *o, const char *v, flag_state *st, char *err,
                     size_t errlen) {
    if (!v || !*v || *v == '=') {
        snprintf(err, errlen, "--%s: missing pool name", o->name);
        return -1;
    }
    if (!st->cur) { /* the command line's pools replace the file's */
        px_pool_specs_free(c->pools, c->npools);
        c->pools = NULL;
        c->npools = 0;
    }
    st->cur = pool_new(c, v, strlen(v));
    return 0;
}

/* --prefill / --decode URL, to the current pool or the unnamed one. */
static int flag_url(px_config *c, const opt *o, const char *v, flag_state *st, char *err,
                    size_t errlen) {
    if (!v) {
        snprintf(err, errlen, "--%s: missing value", o->name);
        return -1;
    }
    if (st->cur) {
        if (check_url(o, v, err, errlen) < 0) return -1;
        px_strlist_push(o->off == OFF(prefill_urls) ? &st->cur->prefill : &st->cur->decode, v);
        return 0;
    }
    px_strlist *l = (px_strlist *)((char *)c + o->off);
    if (!st->seen_urls[o - opts]) px_strlist_clear(l);
    st->seen_urls[o - opts] = 1;
    list_push(l, v, strlen(v));
    return check_url(o, v, err, errlen);
}

/* A list flag, nargs='+' as in the toy proxy: values until the next flag. */
static int flag_list(px_config *c, const opt *o, const char *eq, int argc, char **argv, int *i,
                     char *err, size_t errlen) {
    px_strlist *l = (px_strlist *)((char *)c + o->off);
    px_strlist_clear(l);
    if (eq) return set_value(c, o, eq + 1, err, errlen);
    while (*i + 1 < argc && strncmp(argv[*i + 1], "--", 2) != 0) {
        list_push(l, argv[*i + 1], strlen(argv[*i + 1]));
        if (check_list_item(o, argv[*i + 1], err, errlen) < 0) return -1;
        ++*i;
    }
    if (!l->n) {
        snprintf(err, errlen, "--%s: needs at least one value", o->name);
        return -1;
    }
    return 0;
}

/* The flag argv[*i] (with its values; *i moves past them). 0, or -1 with
 * err. */
static int parse_flag(px_config *c, int argc, char **argv, int *i, flag_state *st, char *err,
                      size_t errlen) {
    const char *a = argv[*i];
    if (strncmp(a, "--", 2) != 0) {
        snprintf(err, errlen, "unexpected argument '%s'", a);
        return -1;
    }
    const char *name = a + 2, *eq = strchr(name, '=');
    size_t nlen = eq ? (size_t)(eq - name) : strlen(name);
    const opt *o = find_opt(name, nlen);
    if (!o) {
        snprintf(err, errlen, "unknown flag '%.*s' (see --help)", (int)(nlen + 2), a);
        return -1;
    }
    c->set[o - opts] = 1;
    if (o->type == CT_FLAG && !eq) {
        *(int *)((char *)c + o->off) = 1;
        return 0;
    }
    if (o->type == CT_POOL) return flag_pool(c, o, flag_value(eq, argc, argv, i), st, err, errlen);
    if (o->type == CT_URLS) return flag_url(c, o, flag_value(eq, argc, argv, i), st, err, errlen);
    if (o->type == CT_LIST) return flag_list(c, o, eq, argc, argv, i, err, errlen);
    const char *v = flag_value(eq, argc, argv, i);
    if (!v) {
        snprintf(err, errlen, "--%s: missing value", o->name);
        return -1;
    }
    return set_value(c, o, v, err, errlen);
}

/* The settings that only make sense together. 0, or -1 with err. */
static int check_together(px_config *c, char *err, size_t errlen) {
    if (!c->tls_cert[0] != !c->tls_key[0]) {
        snprintf(err, errlen, "--tls-cert and --tls-key go together: give both or neither");
        return -1;
    }
    if (c->prefiller_hosts.n != c->prefiller_ports.n) {
        snprintf(err, errlen,
                 "--prefiller-hosts has %zu value(s) but --prefiller-ports has %zu: give one port "
                 "per host",
                 c->prefiller_hosts.n, c->prefiller_ports.n);
        return -1;
    }
    if (c->decoder_hosts.n != c->decoder_ports.n) {
        snprintf(err, errlen,
                 "--decoder-hosts has %zu value(s) but --decoder-ports has %zu: give one port per "
                 "host",
                 c->decoder_hosts.n, c->decoder_ports.n);
        return -1;
    }
    if (validate_pools(c, err, errlen) < 0) return -1;
    if (c->admin_port && !c->admin_token_file[0]) {
        snprintf(err, errlen,
                 "--admin-port needs --admin-token-file: every admin call is "
                 "authenticated with its token");
        return -1;
    }
    if (c->prefiller_from_header && !c->prefiller_allowlist.n) {
        snprintf(err, errlen,
                 "--prefiller-from-header needs --prefiller-allowlist: the hosts "
                 "x-prefiller-host-port may name");
        return -1;
    }
    return 0;
}

px_config_result px_config_load(px_config *c, int argc, char **argv, char **envp, FILE *out,
                                char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    err[0] = '\0';
    for (size_t i = 0; i < NOPTS; i++)
        if (set_value(c, &opts[i], opts[i].def, err, errlen) < 0) return PX_CONFIG_ERROR;
    /* The file first, so that the environment and flags win over it. */
    const char *file = file_named(argc, argv, envp);
    if (file && *file && load_file(c, file, err, errlen) < 0) return PX_CONFIG_ERROR;
    if (load_env(c, envp, err, errlen) < 0) return PX_CONFIG_ERROR;
    flag_state st = {{0}, NULL};
    for (int i = 1; i < argc; i++) {
        if (informational(argv[i], out)) return PX_CONFIG_EXIT_OK;
        if (parse_flag(c, argc, argv, &i, &st, err, errlen) < 0) return PX_CONFIG_ERROR;
    }
    if (check_together(c, err, errlen) < 0) return PX_CONFIG_ERROR;
    if (c->print_config) {
        px_config_dump(c, out);
        return PX_CONFIG_EXIT_OK;
    }
    return PX_CONFIG_RUN;
}

void px_config_cleanup(px_config *c) {
    px_strlist_clear(&c->backend_dp);
    px_strlist_clear(&c->backend_kv);
    px_pool_specs_free(c->pools, c->npools);
    c->pools = NULL;
    c->npools = 0;
    for (size_t i = 0; i < NOPTS; i++) {
        void *field = (char *)c + opts[i].off;
        if (opts[i].type == CT_STR || opts[i].type == CT_ENUM || opts[i].type == CT_SECRET) {
            free(*(char **)field);
            *(char **)field = NULL;
        } else if (opts[i].type == CT_LIST || opts[i].type == CT_URLS || opts[i].type == CT_WORDS) {
            px_strlist_clear(field);
        }
    }
}

/* One setting's value as text, for comparisons. */
static void value_text(const px_config *c, const opt *o, FILE *f) {
    const void *field = (const char *)c + o->off;
    switch (o->type) {
    case CT_STR:
    case CT_ENUM:
    case CT_SECRET:
        fputs(*(char *const *)field, f);
        break;
    case CT_INT:
        fprintf(f, "%lld", (long long)*(const int64_t *)field);
        break;
    case CT_SECONDS:
        fprintf(f, "%.17g", *(const double *)field);
        break;
    case CT_FLAG:
        fputc(*(const int *)field ? '1' : '0', f);
        break;
    case CT_LIST:
    case CT_URLS:
    case CT_WORDS:
        for (size_t j = 0; j < ((const px_strlist *)field)->n; j++)
            fprintf(f, "%s\n", ((const px_strlist *)field)->v[j]);
        break;
    case CT_POOL:
        break;
    }
}

void px_config_changed(const px_config *a, const px_config *b, char *out, size_t cap) {
    size_t len = 0;
    out[0] = '\0';
    for (size_t i = 0; i < NOPTS; i++) {
        const opt *o = &opts[i];
        int skipped = o->type == CT_POOL || o->reloads;
        if (skipped) continue;
        char *ta = NULL, *tb = NULL;
        size_t la = 0, lb = 0;
        FILE *fa = open_memstream(&ta, &la), *fb = open_memstream(&tb, &lb);
        if (fa) {
            value_text(a, o, fa);
            fclose(fa);
        }
        if (fb) {
            value_text(b, o, fb);
            fclose(fb);
        }
        if (ta && tb && strcmp(ta, tb) && len + strlen(o->name) + 2 < cap)
            len += (size_t)snprintf(out + len, cap - len, "%s%s", len ? "," : "", o->name);
        free(ta);
        free(tb);
    }
}

int px_config_is_set(const px_config *c, const char *name) {
    const opt *o = find_opt(name, strlen(name));
    return o ? c->set[o - opts] : 0;
}

static void yaml_str(FILE *out, const char *v) {
    fputc('"', out);
    for (const unsigned char *p = (const unsigned char *)v; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(out, "\\%c", *p);
        else if (*p < 0x20)
            fprintf(out, "\\x%02x", *p);
        else
            fputc(*p, out);
    }
    fputc('"', out);
}

static void yaml_list(FILE *out, const px_strlist *l) {
    fputc('[', out);
    for (size_t j = 0; j < l->n; j++) {
        if (j) fputs(", ", out);
        yaml_str(out, l->v[j]);
    }
    fputc(']', out);
}

/* A prefill/decode list: an entry that declared dp_size or KV-event
 * endpoints as a mapping, so that the output reads back to the same
 * declarations. */
static void yaml_backends(FILE *out, const px_config *c, const px_strlist *l) {
    fputc('[', out);
    for (size_t j = 0; j < l->n; j++) {
        if (j) fputs(", ", out);
        long dp = 0;
        const char *kv = NULL;
        size_t ul = strlen(l->v[j]);
        for (size_t k = 0; k < c->backend_dp.n && !dp; k++) {
            const char *sp = strchr(c->backend_dp.v[k], ' ');
            if (sp && !strcmp(sp + 1, l->v[j])) dp = strtol(c->backend_dp.v[k], NULL, 10);
        }
        for (size_t k = 0; k < c->backend_kv.n && !kv; k++)
            if (!strncmp(c->backend_kv.v[k], l->v[j], ul) && c->backend_kv.v[k][ul] == ' ')
                kv = c->backend_kv.v[k] + ul + 1;
        if (dp || kv) fputs("{url: ", out);
        yaml_str(out, l->v[j]);
        if (dp) fprintf(out, ", dp_size: %ld", dp);
        if (kv) {
            char ep[2][600] = {"", ""};
            if (sscanf(kv, "%599s %599s", ep[0], ep[1]) == 2)
                for (int e = 0; e < 2; e++) {
                    if (!strcmp(ep[e], "-")) continue;
                    fputs(e ? ", kv_events_replay_endpoint: " : ", kv_events_endpoint: ", out);
                    yaml_str(out, ep[e]);
                }
        }
        if (dp || kv) fputc('}', out);
    }
    fputc(']', out);
}

void px_config_dump(const px_config *c, FILE *out) {
    fprintf(out, "# pdproxy %s: the effective configuration (file, environment, flags)\n",
            PDPROXY_VERSION);
    for (size_t i = 0; i < NOPTS; i++) {
        const opt *o = &opts[i];
        const void *field = (const char *)c + o->off;
        if (o->type == CT_POOL || !strcmp(o->name, "print-config") || !strcmp(o->name, "config"))
            continue;
        /* Toy lists shown only when they make backends: read back, a
         * shown list counts as given. */
        if (!strcmp(o->name, "prefiller-hosts") || !strcmp(o->name, "prefiller-ports")) {
            if (!toy_in_effect(c, 1)) continue;
        } else if (!strcmp(o->name, "decoder-hosts") || !strcmp(o->name, "decoder-ports")) {
            if (!toy_in_effect(c, 0)) continue;
        }
        if (o->type == CT_SECRET) {
            /* A comment: a masked value must not read back as the key. */
            fprintf(out, "# %s: %s\n", o->name, (*(char *const *)field)[0] ? "(set)" : "(not set)");
            continue;
        }
        fprintf(out, "%s: ", o->name);
        switch (o->type) {
        case CT_STR:
        case CT_ENUM:
            yaml_str(out, *(char *const *)field);
            break;
        case CT_INT:
            fprintf(out, "%lld", (long long)*(const int64_t *)field);
            break;
        case CT_SECONDS:
            fprintf(out, "%.15g", *(const double *)field);
            break;
        case CT_FLAG:
            fprintf(out, "%s", *(const int *)field ? "true" : "false");
            break;
        case CT_LIST:
        case CT_URLS:
        case CT_WORDS:
            if (o->type == CT_URLS && (!strcmp(o->name, "prefill") || !strcmp(o->name, "decode")))
                yaml_backends(out, c, field);
            else
                yaml_list(out, field);
            break;
        case CT_SECRET:
        case CT_POOL:
            break;
        }
        fputc('\n', out);
    }
    if (!c->npools) {
        fprintf(out, "pools: []\n");
        return;
    }
    fprintf(out, "pools:\n");
    for (size_t i = 0; i < c->npools; i++) {
        const px_pool_spec *p = &c->pools[i];
        fprintf(out, "  - name: ");
        yaml_str(out, p->name);
        fprintf(out, "\n    models: ");
        yaml_list(out, &p->models);
        fprintf(out, "\n    prefill: ");
        yaml_backends(out, c, &p->prefill);
        fprintf(out, "\n    decode: ");
        yaml_backends(out, c, &p->decode);
        fputc('\n', out);
        if (p->prefill_policy[0]) {
            fprintf(out, "    prefill-policy: ");
            yaml_str(out, p->prefill_policy);
            fputc('\n', out);
        }
        if (p->decode_policy[0]) {
            fprintf(out, "    decode-policy: ");
            yaml_str(out, p->decode_policy);
            fputc('\n', out);
        }
        if (p->dispatch[0]) {
            fprintf(out, "    dispatch: ");
            yaml_str(out, p->dispatch);
            fputc('\n', out);
        }
    }
}
