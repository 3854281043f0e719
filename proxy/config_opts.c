/* SPDX-License-Identifier: Apache-2.0 */
/* The option table: one row per option with every column (name, type,
 * field, default, bounds, help, choices, reload, --help group, metavar),
 * and how a value's text becomes a setting. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "proxy/config_int.h"
#include "proxy/dispatch.h"
#include "proxy/k8s_url.h"
#include "proxy/prio.h"
#include "proxy/ratelimit.h"
#include "proxy/slo.h"
#include "proxy/tenant.h"

const opt px_cfg_opts[] = {
    {"config", NULL, CT_STR, OFF(config_file), "", 0, 0,
     "YAML file of settings, keys named as the flags (pools: a list of name, models, prefill, "
     "decode, prefill-policy, decode-policy); the environment and flags win over it; SIGHUP "
     "and POST /admin/reload read it again",
     NULL, RELOADS, G_OPERATIONS, "FILE"},
    {"host", NULL, CT_STR, OFF(host), "127.0.0.1", 0, 0, "address to listen on", NULL, AT_START,
     G_LISTEN, "ADDRESS"},
    {"port", NULL, CT_INT, OFF(port), "8000", 1, 65535, "port to listen on", NULL, AT_START,
     G_LISTEN, "PORT"},
    {"prefiller-hosts", "prefiller-host", CT_LIST, OFF(prefiller_hosts), "localhost", 0, 0,
     "prefill instance hosts (one or more; toy-proxy form)", NULL, RELOADS, G_BACKENDS,
     "HOST [HOST...]"},
    {"prefiller-ports", "prefiller-port", CT_LIST, OFF(prefiller_ports), "8100", 1, 65535,
     "prefill instance ports, one per host", NULL, RELOADS, G_BACKENDS, "PORT [PORT...]"},
    {"decoder-hosts", "decoder-host", CT_LIST, OFF(decoder_hosts), "localhost", 0, 0,
     "decode instance hosts (one or more; toy-proxy form)", NULL, RELOADS, G_BACKENDS,
     "HOST [HOST...]"},
    {"decoder-ports", "decoder-port", CT_LIST, OFF(decoder_ports), "8200", 1, 65535,
     "decode instance ports, one per host", NULL, RELOADS, G_BACKENDS, "PORT [PORT...]"},
    {"prefill", NULL, CT_URLS, OFF(prefill_urls), "", 0, 0,
     "prefill backend URL http[s]://host:port, repeatable; a host name is re-resolved every "
     "--dns-refresh and each address is a backend (with any --prefill or --decode, the toy "
     "flags' defaults apply to neither role)",
     NULL, RELOADS, G_BACKENDS, NULL},
    {"decode", NULL, CT_URLS, OFF(decode_urls), "", 0, 0,
     "decode backend URL, repeatable, as --prefill", NULL, RELOADS, G_BACKENDS, NULL},
    {"pool", NULL, CT_POOL, 0, "", 0, 0,
     "starts a model pool NAME[=MODEL,MODEL...] (models default to NAME): the --prefill and "
     "--decode after it are its backends, and requests whose body names one of its models go "
     "to it (flag and file only; without any pool one unnamed pool serves every model)",
     NULL, RELOADS, G_BACKENDS, NULL},
    {"dns-refresh", NULL, CT_SECONDS, OFF(dns_refresh), "10", 0.1, 86400,
     "seconds between DNS re-resolutions of backend names", NULL, RELOADS, G_BACKENDS, NULL},
    {"k8s-api", NULL, CT_STR, OFF(k8s_api), "", 0, 0,
     "Kubernetes API server for k8s://[NAMESPACE]/SERVICE[?port=P] and "
     "k8s://[NAMESPACE]/?selector=LABELS backends, whose EndpointSlices are listed and watched "
     "(default: the pod's service account, else --kubeconfig)",
     NULL, AT_START, G_BACKENDS, "URL"},
    {"k8s-token-file", NULL, CT_STR, OFF(k8s_token_file), "", 0, 0,
     "bearer token file for the Kubernetes API, read again for every request (default: the "
     "service account's)",
     NULL, AT_START, G_BACKENDS, "FILE"},
    {"k8s-ca-file", NULL, CT_STR, OFF(k8s_ca_file), "", 0, 0,
     "PEM CA bundle of the Kubernetes API server (default: the service account's)", NULL,
     AT_START, G_BACKENDS, "FILE"},
    {"kubeconfig", NULL, CT_STR, OFF(kubeconfig), "", 0, 0,
     "kubeconfig file whose current context names the Kubernetes API server, outside a pod "
     "(server, certificate-authority, insecure-skip-tls-verify, token, tokenFile)",
     NULL, AT_START, G_BACKENDS, "FILE"},
    {"threads", NULL, CT_INT, OFF(threads), "0", 0, 1024,
     "worker threads, each with its own event loop (0: one per CPU)", NULL, AT_START, G_LISTEN,
     NULL},
    {"max-body-bytes", NULL, CT_INT, OFF(max_body_bytes), "33554432", 1, 1099511627776.0,
     "largest request body accepted (413 beyond)", NULL, AT_START, G_LISTEN, "BYTES"},
    {"max-inflight", NULL, CT_INT, OFF(max_inflight), "0", 0, 100000000,
     "most requests in flight at once; beyond, 503 with Retry-After (0: unlimited)", NULL, AT_START,
     G_LISTEN, NULL},
    {"connect-timeout", NULL, CT_SECONDS, OFF(connect_timeout), "5", 0.001, 3600,
     "seconds to wait for an upstream TCP connection (504 beyond)", NULL, AT_START, G_UPSTREAM,
     NULL},
    {"prefill-timeout", NULL, CT_SECONDS, OFF(prefill_timeout), "600", 0, 86400,
     "seconds a prefill request may take in all (504 beyond; 0: no limit)", NULL, AT_START,
     G_UPSTREAM, NULL},
    {"decode-idle-timeout", NULL, CT_SECONDS, OFF(decode_idle_timeout), "600", 0, 86400,
     "seconds decode may go without sending a byte, before its response head (counted from "
     "the request) and between body bytes alike, before the request is failed: 504 before "
     "the head, the stream cut after (0: no limit)",
     NULL, AT_START, G_UPSTREAM, NULL},
    {"client-header-timeout", NULL, CT_SECONDS, OFF(client_header_timeout), "30", 0.001, 3600,
     "seconds a client has to send a complete request (408 beyond)", NULL, AT_START, G_LISTEN,
     NULL},
    {"keepalive-timeout", NULL, CT_SECONDS, OFF(keepalive_timeout), "75", 0.001, 86400,
     "seconds an idle client connection is kept open", NULL, AT_START, G_LISTEN, NULL},
    {"upstream-keepalive", NULL, CT_INT, OFF(upstream_keepalive), "256", 1, 65536,
     "idle keep-alive connections kept per backend address and worker thread (idle ones "
     "close after 4 s, before the backends' own keep-alive timeouts)",
     NULL, AT_START, G_UPSTREAM, NULL},
    {"send-timeout", NULL, CT_SECONDS, OFF(send_timeout), "30", 0, 86400,
     "seconds a client may read none of the output queued for it before it is closed (0: no "
     "limit)",
     NULL, AT_START, G_LISTEN, NULL},
    {"max-buffered-bytes", NULL, CT_INT, OFF(max_buffered_bytes), "268435456", 0, 1099511627776.0,
     "process-wide budget for request bodies held and responses queued; new bodies beyond it "
     "get 503 with Retry-After (0: no budget)",
     NULL, AT_START, G_LISTEN, "BYTES"},
    {"max-connections", NULL, CT_INT, OFF(max_connections), "0", 0, 100000000,
     "most client connections open at once; past it a connection is answered 503 and closed "
     "(0: no limit but the descriptor limit)",
     NULL, AT_START, G_LISTEN, NULL},
    {"reuse-port", NULL, CT_FLAG, OFF(reuse_port), "false", 0, 0,
     "share the port with other processes that also set it (SO_REUSEPORT, one socket per "
     "worker); without it a port already served is an error and no other process can join "
     "this one (the workers share one socket)",
     NULL, AT_START, G_LISTEN, NULL},
    {"metrics-host", NULL, CT_STR, OFF(metrics_host), "", 0, 0,
     "address of the separate metrics listener (default: --host)", NULL, AT_START, G_METRICS,
     "ADDRESS"},
    {"metrics-port", NULL, CT_INT, OFF(metrics_port), "0", 0, 65535,
     "serve /metrics (with /health and /ready) on this port only, not on --port (0: on --port)",
     NULL, AT_START, G_METRICS, "PORT"},
    {"metrics-auth", NULL, CT_FLAG, OFF(metrics_auth), "false", 0, 0,
     "/metrics on --port requires the API key like the API (probes /health, /ready stay open)",
     NULL, AT_START, G_SECURITY, NULL},
    {"health-interval", NULL, CT_SECONDS, OFF(health_interval), "5", 0, 3600,
     "seconds between active health checks, GET /health (0: none)", NULL, AT_START, G_HEALTH, NULL},
    {"health-timeout", NULL, CT_SECONDS, OFF(health_timeout), "2", 0.001, 600,
     "seconds a health check may take", NULL, AT_START, G_HEALTH, NULL},
    {"unhealthy-after", NULL, CT_INT, OFF(unhealthy_after), "3", 1, 1000,
     "consecutive failures (checks, connect errors, resets, 5xx) that eject a backend", NULL,
     RELOADS, G_HEALTH, NULL},
    {"healthy-after", NULL, CT_INT, OFF(healthy_after), "2", 1, 1000,
     "consecutive successful checks that readmit an ejected backend", NULL, RELOADS, G_HEALTH,
     NULL},
    {"prefill-retries", NULL, CT_INT, OFF(prefill_retries), "2", 0, 100,
     "retries of a prefill refused, reset or answering 5xx, each on another instance", NULL,
     AT_START, G_HEALTH, NULL},
    {"fallback-decode-only", NULL, CT_FLAG, OFF(fallback_decode_only), "false", 0, 0,
     "send a request to decode alone when no prefill is healthy (else 503) or when its prefill "
     "failed with 5xx or a connection error, retries spent (else 502)",
     NULL, AT_START, G_HEALTH, NULL},
    {"prefill-policy", NULL, CT_ENUM, OFF(prefill_policy), "round_robin", 0, 0,
     "how to choose a prefill instance", PX_POLICIES, RELOADS, G_ROUTING, "POLICY"},
    {"decode-policy", NULL, CT_ENUM, OFF(decode_policy), "round_robin", 0, 0,
     "how to choose a decode instance", PX_POLICIES, RELOADS, G_ROUTING, "POLICY"},
    {"dispatch", NULL, CT_ENUM, OFF(dispatch), "serial", 0, 0,
     "serial: prefill, then decode with prefill's kv_transfer_params; concurrent: both at once "
     "for a push connector (pdproxy mints the request id and token; a prefill whose identity "
     "is not known yet is sent serial)",
     PX_DISPATCH_MODES, RELOADS, G_ROUTING, "MODE"},
    {"prefill-dp-size", NULL, CT_INT, OFF(prefill_dp_size), "1", 1, 64,
     "data-parallel ranks behind each prefill (vLLM --data-parallel-size with one API server), "
     "unless its config entry declares dp_size: each request names the least loaded rank "
     "(pdproxy's requests in flight, corrected by the engine's per-rank /metrics) in "
     "X-data-parallel-rank (1: no header, the engine balances)",
     NULL, AT_START, G_ROUTING, "N"},
    {"decode-dp-size", NULL, CT_INT, OFF(decode_dp_size), "1", 1, 64,
     "data-parallel ranks behind each decode, chosen the same way (may differ from "
     "--prefill-dp-size)",
     NULL, AT_START, G_ROUTING, "N"},
    {"prefix-bytes", NULL, CT_INT, OFF(prefix_bytes), "256", 1, 1048576,
     "prefix_affinity_bytes: bytes of the prompt (or first chat messages) that are hashed; "
     "prefix_affinity: the same for a prompt shorter than one 128-byte block (longer ones "
     "follow their whole block chain)",
     NULL, RELOADS, G_ROUTING, "BYTES"},
    {"prefix-load-factor", NULL, CT_SECONDS, OFF(prefix_load_factor), "1.25", 1, 100,
     "prefix_affinity: an instance takes at most this times the mean in-flight load", NULL, RELOADS,
     G_ROUTING, "FACTOR"},
    {"metrics-interval", NULL, CT_SECONDS, OFF(metrics_interval), "2", 0.05, 3600,
     "load_aware: seconds between load probes of each engine's /metrics", NULL, AT_START, G_ROUTING,
     NULL},
    /* Per-request decisions: conditional disaggregation and usage. */
    {"disagg-min-tokens", NULL, CT_INT, OFF(disagg_min_tokens), "0", 0, 100000000,
     "send a request straight to decode when its estimated uncached prompt is shorter than this "
     "many tokens (0: always disaggregate)",
     NULL, AT_START, G_DISAGG, "TOKENS"},
    {"disagg-bytes-per-token", NULL, CT_SECONDS, OFF(disagg_bytes_per_token), "4", 0.5, 64,
     "prompt bytes (as the JSON body spells them) per token in the prompt length estimate", NULL,
     AT_START, G_DISAGG, "BYTES"},
    {"disagg-index-blocks", NULL, CT_INT, OFF(disagg_index_blocks), "65536", 1, 16777216,
     "entries of each worker's LRU index of prompt prefixes recently sent to each decode "
     "instance (one entry per 128 prompt bytes)",
     NULL, AT_START, G_DISAGG, NULL},
    {"kv-events-port", NULL, CT_INT, OFF(kv_events_port), "0", 0, 65535,
     "subscribe to each backend's vLLM KV-cache events (ZeroMQ PUB, --kv-events-config) at "
     "tcp://<backend host>:PORT and index what each engine holds (0: off; a config entry's "
     "kv_events_endpoint, or the admin API's, overrides it for that backend)",
     NULL, AT_START, G_ROUTING, "PORT"},
    {"kv-events-replay-port", NULL, CT_INT, OFF(kv_events_replay_port), "0", 0, 65535,
     "port of the engines' KV-event replay socket (ROUTER), asked for missed batches after a "
     "sequence gap (0: none; a gap drops that backend's index, rebuilt from later events; a "
     "config entry's kv_events_replay_endpoint overrides it)",
     NULL, AT_START, G_ROUTING, "PORT"},
    {"kv-cache-weight", NULL, CT_SECONDS, OFF(kv_cache_weight), "1", 0, 1000000,
     "kv_aware: score per prompt token the engine holds in its KV cache (its KV events)", NULL,
     RELOADS, G_ROUTING, "WEIGHT"},
    {"kv-load-weight", NULL, CT_SECONDS, OFF(kv_load_weight), "1", 0, 1000000,
     "kv_aware: score lost per prompt token queued or in flight on the engine", NULL, RELOADS,
     G_ROUTING, "WEIGHT"},
    {"tokenize-timeout", NULL, CT_SECONDS, OFF(tokenize_timeout), "0.05", 0, 60,
     "seconds an engine's POST /tokenize may take to give a prompt's exact tokens (kv_aware, "
     "or --disagg-min-tokens with --kv-events-port); past it the byte estimate is used (0: "
     "never ask)",
     NULL, AT_START, G_ROUTING, NULL},
    {"tokenize-cache-entries", NULL, CT_INT, OFF(tokenize_cache_entries), "4096", 1, 1048576,
     "prompts whose tokens each worker keeps (prompts of up to 65536 tokens)", NULL, AT_START,
     G_ROUTING, NULL},
    {"session-header", NULL, CT_STR, OFF(session_header), "x-session-id", 0, 0,
     "request header naming a conversation (else the body's \"user\"): its requests stay on "
     "the decode instance they went to while it is healthy and not overloaded (\"\": the body "
     "only)",
     NULL, AT_START, G_ROUTING, "NAME"},
    {"session-ttl", NULL, CT_SECONDS, OFF(session_ttl), "600", 0, 86400,
     "seconds a session is remembered after its last request (0: no sessions)", NULL, AT_START,
     G_ROUTING, NULL},
    {"kv-index-max-blocks", NULL, CT_INT, OFF(kv_index_max_blocks), "1048576", 1, 268435456,
     "most KV blocks indexed per backend (about 64 bytes each); stores past it are refused and "
     "counted",
     NULL, AT_START, G_ROUTING, NULL},
    {"kv-index-max-bytes", NULL, CT_INT, OFF(kv_index_max_bytes), "1073741824", 0, 1099511627776.0,
     "most bytes of KV index tables over all backends; stores past it are refused and counted "
     "(0: no bound but --kv-index-max-blocks per backend)",
     NULL, AT_START, G_ROUTING, "BYTES"},
    {"usage-from", NULL, CT_ENUM, OFF(usage_from), "prefill", 0, 0,
     "whose prompt_tokens_details.cached_tokens a disaggregated answer's usage reports: "
     "prefill's (what was computed from cache) or decode's (as the engine says)",
     "prefill|decode", AT_START, G_DISAGG, "ROLE"},
    {"drain-delay", NULL, CT_SECONDS, OFF(drain_delay), "5", 0, 3600,
     "on SIGTERM, seconds /ready answers 503 before new connections stop", NULL, AT_START,
     G_OPERATIONS, NULL},
    {"drain-timeout", NULL, CT_SECONDS, OFF(drain_timeout), "60", 0, 86400,
     "on SIGTERM, seconds in-flight requests get to finish", NULL, AT_START, G_OPERATIONS, NULL},
    {"tls-cert", NULL, CT_STR, OFF(tls_cert), "", 0, 0, "PEM certificate chain: serve HTTPS", NULL,
     AT_START, G_SECURITY, "FILE"},
    {"tls-key", NULL, CT_STR, OFF(tls_key), "", 0, 0, "PEM private key for --tls-cert", NULL,
     AT_START, G_SECURITY, "FILE"},
    {"tls-client-ca", NULL, CT_STR, OFF(tls_client_ca), "", 0, 0,
     "PEM CA bundle: ask HTTPS clients for a certificate and verify it (mutual TLS); needs "
     "--tls-cert",
     NULL, AT_START, G_SECURITY, "FILE"},
    {"tls-client-verify", NULL, CT_ENUM, OFF(tls_client_verify), "require", 0, 0,
     "with --tls-client-ca: require a verified client certificate (the handshake fails "
     "without one), or optional (a client without one is served; one that sends a certificate "
     "the CA does not verify still fails)",
     "require|optional", AT_START, G_SECURITY, "MODE"},
    {"upstream-ca", NULL, CT_STR, OFF(upstream_ca), "", 0, 0,
     "PEM CA bundle to verify https:// backends (default: the system store)", NULL, AT_START,
     G_UPSTREAM, "FILE"},
    {"upstream-insecure", NULL, CT_FLAG, OFF(upstream_insecure), "false", 0, 0,
     "do not verify https:// backends' certificates", NULL, AT_START, G_UPSTREAM, NULL},
    {"api-key", NULL, CT_SECRET, OFF(api_key), "", 0, 0,
     "clients must send Authorization: Bearer <key> (401 otherwise)", NULL, AT_START, G_SECURITY,
     "KEY"},
    {"api-key-file", NULL, CT_STR, OFF(api_key_file), "", 0, 0,
     "file of accepted API keys, one per line", NULL, AT_START, G_SECURITY, "FILE"},
    {"upstream-api-key", NULL, CT_SECRET, OFF(upstream_api_key), "", 0, 0,
     "key sent to engines as Bearer (else the client's Authorization, else $OPENAI_API_KEY)", NULL,
     AT_START, G_UPSTREAM, "KEY"},
    {"log-level", NULL, CT_ENUM, OFF(log_level), "info", 0, 0, "log verbosity",
     "debug|info|warn|error", AT_START, G_METRICS, "LEVEL"},
    {"log-format", NULL, CT_ENUM, OFF(log_format), "logfmt", 0, 0, "log line format", "logfmt|json",
     AT_START, G_METRICS, "FORMAT"},
    {"access-log", NULL, CT_FLAG, OFF(access_log), "true", 0, 0,
     "one access line per request, at level info whatever --log-level says (false: none; "
     "--log-level warn keeps access lines and drops other info lines)",
     NULL, AT_START, G_METRICS, NULL},
    {"access-log-buffer", NULL, CT_INT, OFF(access_log_buffer), "65536", 0, 16777216,
     "bytes of access lines each worker gathers before one write, as nginx's access_log "
     "buffer= (0: a write per line)",
     NULL, AT_START, G_METRICS, "BYTES"},
    {"access-log-flush", NULL, CT_SECONDS, OFF(access_log_flush), "0.2", 0.001, 3600,
     "seconds an access line may wait in that buffer, as nginx's flush=", NULL, AT_START,
     G_METRICS, NULL},
    {"log-file", NULL, CT_STR, OFF(log_file), "", 0, 0,
     "append the log (access lines included) to FILE instead of stderr; reopened on SIGUSR1 "
     "and SIGHUP (log rotation)",
     NULL, AT_START, G_METRICS, "FILE"},
    {"admin-host", NULL, CT_STR, OFF(admin_host), "127.0.0.1", 0, 0,
     "address of the admin API listener", NULL, AT_START, G_OPERATIONS, "ADDRESS"},
    {"admin-port", NULL, CT_INT, OFF(admin_port), "0", 0, 65535,
     "serve the admin API (/admin/...) on this port (0: off); needs --admin-token-file", NULL,
     AT_START, G_OPERATIONS, "PORT"},
    {"admin-token-file", NULL, CT_STR, OFF(admin_token_file), "", 0, 0,
     "file holding the admin API's bearer token (never the client API key)", NULL, AT_START,
     G_OPERATIONS, "FILE"},
    {"prefiller-from-header", NULL, CT_FLAG, OFF(prefiller_from_header), "false", 0, 0,
     "sidecar mode: prefill on the instance named by the request's x-prefiller-host-port "
     "header when its host and port are in --prefiller-allowlist (400 otherwise)",
     NULL, AT_START, G_SIDECAR, NULL},
    {"prefiller-allowlist", NULL, CT_WORDS, OFF(prefiller_allowlist), "", 0, 0,
     "HOST:PORT targets x-prefiller-host-port may name, comma or space separated: HOST a "
     "CIDR, an address or a host name ([v6] in brackets), PORT a port, a range N-M, or * for "
     "every port (10.0.0.0/8:8000, [fd00::/8]:8000-8003, prefill.example:*)",
     NULL, AT_START, G_SIDECAR, "CIDRS"},
    {"allow-empty-pools", NULL, CT_FLAG, OFF(allow_empty_pools), "false", 0, 0,
     "accept a reload or admin API change that leaves a pool without a prefill or decode "
     "backend; without it such a change is refused and the running configuration stays",
     NULL, AT_START, G_OPERATIONS, NULL},
    {"loop-limit", NULL, CT_INT, OFF(loop_limit), "1", 0, 100,
     "answer 508 Loop Detected to a request whose Via already names this proxy more than this "
     "many times (every request to a backend carries this proxy's Via marker)",
     NULL, AT_START, G_SECURITY, NULL},
    {"queue-max", NULL, CT_INT, OFF(queue_max), "0", 0, 10000000,
     "requests that may wait for a saturated pool (split between the worker threads); past "
     "it 429 (0: no queue: a request for a saturated pool gets 429 at once)",
     NULL, AT_START, G_LISTEN, NULL},
    {"queue-max-bytes", NULL, CT_INT, OFF(queue_max_bytes), "67108864", 0, 1099511627776.0,
     "request bodies the waiting requests may hold, split between the worker threads (0: no "
     "bound but --max-buffered-bytes)",
     NULL, AT_START, G_LISTEN, "BYTES"},
    {"queue-timeout", NULL, CT_SECONDS, OFF(queue_timeout), "30", 0.001, 86400,
     "seconds a request may wait for its pool (503 with Retry-After beyond); the request's "
     "x-queue-timeout header (seconds) may shorten it",
     NULL, AT_START, G_LISTEN, NULL},
    {"pool-max-inflight", NULL, CT_INT, OFF(pool_max_inflight), "0", 0, 100000000,
     "a pool is saturated while this many of its requests are sent on (0: no limit; a reload "
     "or POST /admin/admission changes it, for queued requests too)",
     NULL, RELOADS, G_LISTEN, NULL},
    {"saturate-waiting", NULL, CT_INT, OFF(saturate_waiting), "0", 0, 100000000,
     "a pool is saturated while every decode engine reports at least this many requests "
     "waiting (vllm:num_requests_waiting, read every --metrics-interval; 0: not looked at)",
     NULL, AT_START, G_LISTEN, NULL},
    {"saturate-kv-usage", NULL, CT_SECONDS, OFF(saturate_kv_usage), "0", 0, 1,
     "a pool is saturated while every decode engine reports at least this fraction of its KV "
     "cache in use (vllm:kv_cache_usage_perc, 1 = full, read every --metrics-interval; 0: not "
     "looked at)",
     NULL, AT_START, G_LISTEN, "FRACTION"},
    {"saturate-ttfb", NULL, CT_SECONDS, OFF(saturate_ttfb), "0", 0, 3600,
     "a pool is saturated while the moving average of its time to first byte (from dispatch "
     "to decode's first byte) is at least this many seconds and some request is sent on (0: "
     "off)",
     NULL, AT_START, G_LISTEN, NULL},
    {"engine-backoff", NULL, CT_SECONDS, OFF(engine_backoff), "1", 0, 3600,
     "seconds a backend that answered 429 or 503 (its queue is full) counts as saturated "
     "rather than failed",
     NULL, AT_START, G_LISTEN, NULL},
    {"tenant-header", NULL, CT_STR, OFF(tenant_header), "x-tenant", 0, 0,
     "request header naming the tenant, read only from --tenant-header-from peers (absent or "
     "unknown: the default tenant)",
     NULL, AT_START, G_LISTEN, "NAME"},
    {"tenant-header-from", NULL, CT_WORDS, OFF(tenant_header_from), "", 0, 0,
     "addresses or CIDRs of trusted gateways whose --tenant-header is believed; from any other "
     "peer a request carrying the header gets 403 (empty: the header is never read)",
     NULL, AT_START, G_SECURITY, "CIDRS"},
    {"tenant-keys", NULL, CT_STR, OFF(tenant_keys), "", 0, 0,
     "file of TENANT:KEY lines: a request with Authorization: Bearer KEY is that tenant's, "
     "whatever its headers say; the keys are accepted API keys too (compared in constant "
     "time, never logged)",
     NULL, AT_START, G_SECURITY, "FILE"},
    {"tenant-certs", NULL, CT_STR, OFF(tenant_certs), "", 0, 0,
     "file of TENANT:NAME lines: a request over a connection whose client certificate "
     "(verified by --tls-client-ca) has NAME as its subject CN or a subjectAltName (DNS, URI "
     "or email) is that tenant's, unless its API key names one (--tenant-keys)",
     NULL, AT_START, G_SECURITY, "FILE"},
    {"cache-salt", NULL, CT_ENUM, OFF(cache_salt), "auto", 0, 0,
     "the cache_salt P/D requests carry, which keeps engines' prefix caches apart: one per "
     "tenant, one per API key, or off (the client's own passes); auto: tenant when "
     "--tenant-keys, --tenant-certs or --tenant-header-from is set, else off; a client's own salt only "
     "splits its share further",
     "auto|tenant|key|off", AT_START, G_SECURITY, "MODE"},
    {"default-max-tokens", NULL, CT_INT, OFF(default_max_tokens), "4096", 1, 100000000,
     "completion tokens assumed for a request that sets no max_tokens: reserved from its "
     "tenant's tpm= at admission, and the most its usage may count beyond the prompt",
     NULL, AT_START, G_LISTEN, "TOKENS"},
    {"priority-header", NULL, CT_STR, OFF(priority_header), "x-priority", 0, 0,
     "request header giving the priority: a number, lower first, or a --priority-class name "
     "(else the body's \"priority\", as vLLM takes it; else 0)",
     NULL, AT_START, G_LISTEN, "NAME"},
    {"priority-class", NULL, CT_WORDS, OFF(priority_classes), "", 0, 0,
     "priority classes in the order served, each NAME:LO..HI (or NAME:P), the priority values "
     "it takes, and :share=N on every class to serve them by shares (N requests a round, so "
     "none starves) instead of strictly in order; a value in none goes to the last class, a "
     "header may name a class (none: classes 0..15 are the priority itself, clamped)",
     NULL, RELOADS, G_LISTEN, "SPECS"},
    {"tenant", NULL, CT_WORDS, OFF(tenants), "", 0, 0,
     "tenants, each NAME[:weight=W][:rpm=N][:tpm=N][:floor=P]: W its share of dispatch out of "
     "the queue (1), N its requests or tokens per minute (0: no limit; 429 with x-ratelimit-* "
     "beyond), P the best priority it may claim (a better claim is served as P); "
     "NAME default sets the default tenant's (callers no key or gateway names); a reload or "
     "POST /admin/admission changes, adds and removes tenants at once, queued requests kept",
     NULL, RELOADS, G_LISTEN, "SPECS"},
    {"slo-ttft-ms", NULL, CT_SECONDS, OFF(slo_ttft_ms), "0", 0, 3600000,
     "time-to-first-token target (ms) of a request whose x-slo-ttft-ms header, tenant, "
     "priority class and pool (--slo) give none; counted in pdproxy_slo_attained_total and "
     "used by the latency policy (0: none)",
     NULL, AT_START, G_ROUTING, "MS"},
    {"slo-tpot-ms", NULL, CT_SECONDS, OFF(slo_tpot_ms), "0", 0, 3600000,
     "time-per-output-token target (ms), the same way (x-slo-tpot-ms; 0: none)", NULL, AT_START,
     G_ROUTING, "MS"},
    {"slo-miss", NULL, CT_ENUM, OFF(slo_miss), "send", 0, 0,
     "latency policy: a request predicted to miss its TTFT target on every engine is sent "
     "anyway, waits in the admission queue until its prediction fits or the engines are "
     "about idle (queue: needs --queue-max), or is refused at once with Retry-After (refuse); "
     "--slo's miss= per tenant, class or pool",
     "send|queue|refuse", AT_START, G_ROUTING, "ACTION"},
    {"slo-refuse-status", NULL, CT_ENUM, OFF(slo_refuse_status), "503", 0, 0,
     "status of a refusal by prediction (--slo's status=)", "503|429", AT_START, G_ROUTING,
     "STATUS"},
    {"slo", NULL, CT_WORDS, OFF(slo), "", 0, 0,
     "latency targets, each KIND=NAME:key=value[:...], KIND tenant, class or pool (pool=* for "
     "every pool), keys ttft and tpot (ms), miss (send|queue|refuse), status (503|429); a "
     "header wins, then tenant, class, pool; a reload or POST /admin/slo replaces them",
     NULL, RELOADS, G_ROUTING, "SPECS"},
    {"latency-decode-only", NULL, CT_FLAG, OFF(latency_decode_only), "true", 0, 0,
     "latency policy: send a request to decode alone when that is predicted faster than every "
     "prefill-decode pair (conditional disaggregation by prediction; false: always a pair)",
     NULL, AT_START, G_ROUTING, NULL},
    {"latency-half-life", NULL, CT_SECONDS, OFF(latency_half_life), "30", 0.1, 86400,
     "latency model: seconds after which a sample counts half, so an engine that changes is "
     "relearned and one unused drifts back to the pooled fit",
     NULL, AT_START, G_ROUTING, NULL},
    {"latency-keep", NULL, CT_SECONDS, OFF(latency_keep), "0.95", 0.5, 1,
     "latency model: share of the past kept per new sample (0.95: about the last 20 count)",
     NULL, AT_START, G_ROUTING, "FRACTION"},
    {"print-config", NULL, CT_FLAG, OFF(print_config), "false", 0, 0,
     "print the effective configuration as YAML (a --config file) and exit", NULL, AT_START,
     G_OPERATIONS, NULL},
    {"check-config", NULL, CT_FLAG, OFF(check_config), "false", 0, 0,
     "check the configuration as start-up does (files read, certificates and keys loaded, "
     "backends that are this proxy refused, ports free, names resolved) without binding "
     "anything, then exit: 0 when pdproxy would start, 2 with the reason when not",
     NULL, AT_START, G_OPERATIONS, NULL},
};
const size_t px_cfg_nopts = sizeof px_cfg_opts / sizeof *px_cfg_opts;
_Static_assert(sizeof px_cfg_opts / sizeof *px_cfg_opts <= PX_CFG_MAX_OPTS, "grow px_config.set");

void px_strlist_clear(px_strlist *l) {
    for (size_t i = 0; i < l->n; i++)
        free(l->v[i]);
    free(l->v);
    l->v = NULL;
    l->n = 0;
}

void px_cfg_list_push(px_strlist *l, const char *s, size_t n) {
    l->v = px_xrealloc(l->v, (l->n + 1) * sizeof *l->v);
    l->v[l->n++] = px_xstrndup(s, n);
}

void px_strlist_push(px_strlist *l, const char *s) {
    px_cfg_list_push(l, s, strlen(s));
}

void px_cfg_list_copy(px_strlist *to, const px_strlist *from) {
    for (size_t i = 0; i < from->n; i++)
        px_strlist_push(to, from->v[i]);
}

static int check_word(const opt *o, const char *v, char *err, size_t errlen) {
    if (!strcmp(o->name, "tenant")) return px_tenant_spec_check(v, err, errlen);
    if (!strcmp(o->name, "priority-class")) return px_prio_spec_check(v, err, errlen);
    if (!strcmp(o->name, "tenant-header-from")) return px_cidr_check(v, err, errlen);
    if (!strcmp(o->name, "slo")) return px_slo_spec_check(v, err, errlen);
    return px_cfg_allow_check(o->name, v, err, errlen);
}

/* Checks one element of a list against the option's bounds. */
int px_cfg_check_list_item(const opt *o, const char *v, char *err, size_t errlen) {
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
int px_cfg_check_url(const opt *o, const char *v, char *err, size_t errlen) {
    const char *h = NULL;
    if (px_k8s_is_url(v)) return px_k8s_url_check(v, err, errlen);
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
int px_cfg_split_list(const opt *o, px_strlist *l, const char *v,
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
            px_cfg_list_push(l, s0, (size_t)(p - s0));
            if (check(o, l->v[l->n - 1], err, errlen) < 0) return -1;
        }
    }
    return 0;
}

/* Sets a scalar option from text. Lists are handled by the callers. */
int px_cfg_set_value(px_config *c, const opt *o, const char *v, char *err, size_t errlen) {
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
        return px_cfg_split_list(o, field, v, px_cfg_check_url, err, errlen);
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
        return px_cfg_split_list(o, field, v, check_word, err, errlen);
    case CT_POOL:
        if (!*v) return 0; /* the default: no pool */
        snprintf(err, errlen, "--%s '%s': pools are given as flags or in the --config file",
                 o->name, v);
        return -1;
    case CT_LIST: {
        px_strlist *l = field;
        if (px_cfg_split_list(o, l, v, px_cfg_check_list_item, err, errlen) < 0) return -1;
        if (!l->n) {
            snprintf(err, errlen, "--%s '%s': needs at least one value", o->name, v);
            return -1;
        }
        return 0;
    }
    }
    return -1;
}

const opt *px_cfg_find_opt(const char *name, size_t n) {
    for (size_t i = 0; i < px_cfg_nopts; i++) {
        if (strlen(px_cfg_opts[i].name) == n && !strncmp(px_cfg_opts[i].name, name, n))
            return &px_cfg_opts[i];
        if (px_cfg_opts[i].alias && strlen(px_cfg_opts[i].alias) == n &&
            !strncmp(px_cfg_opts[i].alias, name, n))
            return &px_cfg_opts[i];
    }
    return NULL;
}

int px_cfg_in_choices(const char *choices, const char *v) {
    size_t n = strlen(v);
    for (const char *p = choices; p && *p;) {
        const char *e = strchr(p, '|');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        if (l == n && !strncmp(p, v, n)) return 1;
        p = e ? e + 1 : NULL;
    }
    return 0;
}

int px_cfg_check_model(const opt *o, const char *v, char *err, size_t errlen) {
    (void)o, (void)err, (void)errlen, (void)v;
    return 0; /* split_list drops empty items; any other name is a model's */
}

int px_config_is_set(const px_config *c, const char *name) {
    const opt *o = px_cfg_find_opt(name, strlen(name));
    return o ? c->set[o - px_cfg_opts] : 0;
}
