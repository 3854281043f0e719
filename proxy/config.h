/* SPDX-License-Identifier: Apache-2.0 */
/* pdproxy's settings. One static table (config_opts.c, one row per option
 * with every column) drives the command-line flags, the PDPROXY_*
 * environment variables, the --config file's keys, --help and
 * --print-config. */
#ifndef PX_CONFIG_H
#define PX_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct px_strlist {
    char **v; /* owned, each string owned */
    size_t n;
} px_strlist;

/* One model pool: the models it serves and its own backends. The config's
 * top-level backends (toy flags, --prefill/--decode outside any pool) form
 * the unnamed pool that serves every model; it exists only when no named
 * pool is configured. */
typedef struct px_pool_spec {
    char *name;             /* owned */
    px_strlist models;      /* models routed here; empty: the pool's name */
    px_strlist prefill;     /* backend URLs */
    px_strlist decode;      /* backend URLs */
    px_strlist prefill_toy; /* effective specs only: toy-form URLs, resolved once */
    px_strlist decode_toy;
    char *prefill_policy; /* owned; "": the global --prefill-policy */
    char *decode_policy;  /* owned; "": the global --decode-policy */
    char *dispatch;       /* owned; "": the global --dispatch */
    size_t line;          /* where the file defined it (0: a flag) */
} px_pool_spec;

typedef struct px_config {
    char *config_file; /* --config: YAML, below the environment and flags */
    char *host;
    int64_t port;
    /* Backends: the toy proxy's parallel host/port lists, and URLs. */
    px_strlist prefiller_hosts;
    px_strlist prefiller_ports;
    px_strlist decoder_hosts;
    px_strlist decoder_ports;
    px_strlist prefill_urls; /* --prefill, repeatable */
    px_strlist decode_urls;  /* --decode, repeatable */
    double dns_refresh;      /* seconds between re-resolutions of backend names */
    int64_t threads;         /* 0: one per CPU */
    int64_t max_body_bytes;
    double connect_timeout;     /* seconds */
    double prefill_timeout;     /* seconds, 0: none */
    double decode_idle_timeout; /* seconds without a byte from decode, 0: none */
    double client_header_timeout;
    double keepalive_timeout;
    int64_t upstream_keepalive; /* idle upstream connections kept per backend and worker */
    int64_t max_inflight;       /* 0: unlimited */
    double send_timeout;        /* seconds a client may read nothing of its output, 0: none */
    int64_t max_buffered_bytes; /* bodies held + output queued, all connections; 0: none */
    int64_t max_connections;    /* 0: unlimited */
    int reuse_port;
    char *metrics_host;   /* "": --host */
    int64_t metrics_port; /* 0: /metrics on --port */
    int metrics_auth;     /* /metrics needs the API key */
    /* Health and failover. */
    double health_interval; /* 0: no active checks */
    double health_timeout;
    int64_t unhealthy_after;
    int64_t healthy_after;
    int64_t prefill_retries;
    int fallback_decode_only;
    /* Routing. */
    char *prefill_policy;
    char *decode_policy;
    char *dispatch; /* serial|concurrent (dispatch.h) */
    int64_t prefix_bytes;
    double prefix_load_factor;
    double metrics_interval;
    /* Per-request decisions. */
    int64_t disagg_min_tokens;     /* 0: always disaggregate */
    int64_t prefill_dp_size;       /* data-parallel ranks behind each prefill (1: none) */
    int64_t decode_dp_size;        /* and behind each decode */
    double disagg_bytes_per_token; /* prompt bytes per estimated token */
    int64_t disagg_index_blocks;   /* per worker */
    /* KV-cache events (kvevents.c) and the index they feed (kvindex.c). */
    int64_t kv_events_port;        /* 0: no subscription */
    int64_t kv_events_replay_port; /* 0: gaps drop the backend's index */
    int64_t kv_index_max_blocks;   /* per backend */
    int64_t kv_index_max_bytes;    /* over all backends; 0: none */
    double kv_cache_weight;        /* kv_aware */
    double tokenize_timeout;       /* 0: no /tokenize */
    int64_t tokenize_cache_entries; /* per worker */
    char *session_header;           /* "": none (the body's "user" still counts) */
    double session_ttl;             /* 0: no sessions */
    double kv_load_weight;
    char *usage_from;              /* "prefill" | "decode" */
    /* Shutdown. */
    double drain_delay;
    double drain_timeout;
    /* Security. */
    char *tls_cert;
    char *tls_key;
    char *upstream_ca;
    int upstream_insecure;
    char *api_key;
    char *api_key_file;
    char *upstream_api_key;
    /* Logging. */
    char *log_level;
    char *log_format;
    int access_log; /* access lines on (independent of log_level) */
    int64_t access_log_buffer; /* bytes of access lines a worker gathers per write */
    double access_log_flush;   /* seconds an access line may wait in that buffer */
    char *log_file;            /* "": stderr */
    int print_config;
    int check_config; /* --check-config: start-up's checks, nothing bound, then exit */
    /* Kubernetes API for k8s:// backends (k8s.h). */
    char *k8s_api;
    char *k8s_token_file;
    char *k8s_ca_file;
    char *kubeconfig;
    /* Model pools (--pool, or pools: in the file); none: the unnamed pool. */
    px_pool_spec *pools; /* owned array */
    size_t npools;
    /* Admin API. */
    char *admin_host;
    int64_t admin_port; /* 0: off */
    char *admin_token_file;
    /* Sidecar mode: the prefill named by the request's header. */
    int prefiller_from_header;
    px_strlist prefiller_allowlist; /* CIDRs and host names */
    /* Issue 30: a reload may leave a pool without backends only when
     * allowed; a request carrying this proxy's Via marker more than
     * loop_limit times is refused (508). */
    int allow_empty_pools;
    int64_t loop_limit;
    /* Issue 26, admission control (admission.h, ratelimit.h). */
    int64_t queue_max;         /* requests waiting for a saturated pool, all workers; 0: none */
    int64_t queue_max_bytes;   /* bodies held by waiting requests, all workers */
    double queue_timeout;      /* seconds a request may wait */
    int64_t pool_max_inflight; /* a pool is saturated with this many sent on; 0: no limit */
    int64_t saturate_waiting;  /* ... or when its engines report this many waiting; 0: off */
    double saturate_kv_usage;  /* ... or this fraction of their KV cache used; 0: off */
    double saturate_ttfb;      /* ... or its TTFB average is this many seconds; 0: off */
    double engine_backoff;     /* seconds a backend that answered 429/503 is left alone */
    char *tenant_header;       /* names the request's tenant */
    char *priority_header;     /* the request's priority (else the body's "priority") */
    px_strlist tenants;        /* --tenant specs */
    px_strlist priority_classes; /* --priority-class specs */
    /* Issue 41: tenants from credentials (tenant.h). */
    px_strlist tenant_header_from; /* trusted gateways: addresses and CIDRs */
    char *tenant_keys;             /* TENANT:KEY file; "": none */
    char *tenant_certs;            /* TENANT:NAME file (client certificates); "": none */
    char *tls_client_ca;           /* PEM CA bundle clients' certificates are verified by */
    char *tls_client_verify;       /* require|optional */
    char *cache_salt;              /* tenant|key|off */
    int64_t default_max_tokens;    /* a request without max_tokens is assumed to produce this */
    /* Issue 42, routing and admission by predicted latency (predict.h). */
    double slo_ttft_ms;        /* a request's TTFT target when nothing else gives one; 0: none */
    double slo_tpot_ms;        /* its TPOT target, the same way */
    char *slo_miss;            /* send|queue|refuse: a request predicted to miss its TTFT */
    char *slo_refuse_status;   /* "503" | "429" */
    px_strlist slo;            /* --slo specs: targets per tenant, class, pool */
    int latency_decode_only;   /* decode alone when predicted faster */
    double latency_half_life;  /* seconds: the model forgets a sample this fast */
    double latency_keep;       /* and keeps this much of the past per new sample */
    /* Issue 25: DP sizes backend entries of the file declare (dp_size), items
     * "N URL"; proxy/dp.c applies them once the configuration is accepted. */
    px_strlist backend_dp;
    /* Issue 24: KV-event endpoints backend entries of the file declare
     * (kv_events_endpoint, kv_events_replay_endpoint), items "URL EP REPLAY"
     * with "-" for one not given; proxy/kvevents.c applies them once the
     * configuration is accepted, over the --kv-events-port derived ones. */
    px_strlist backend_kv;
    unsigned char set[128];         /* set[i]: option i was given by flag or environment */
} px_config;

/* Checks backend lists before they become a generation (at start, on
 * reload and for each admin API change): no URL may name one of this
 * proxy's own listen addresses (requests would loop through it), and, when
 * `reloading` and unless --allow-empty-pools, every pool keeps a decode
 * backend and a prefill backend (not needed with --fallback-decode-only or
 * --prefiller-from-header): a reload must not take away what runs. At
 * start an incomplete pool is allowed and /ready says what it misses.
 * Returns 0, or -1 with the reason in err. */
int px_config_check_pools(const px_config *c, const px_pool_spec *v, size_t n, int reloading,
                          char *err, size_t errlen);

/* A ZeroMQ endpoint pdproxy may connect a KV-event socket to:
 * tcp://HOST:PORT (HOST a name, an IPv4 address or [IPv6], PORT 1..65535)
 * or ipc://PATH (shorter than a socket path's 108 bytes). -1 with the
 * reason in err otherwise. */
int px_config_kv_endpoint_check(const char *ep, char *err, size_t errlen);

/* Whether `url` (http[s]://host[:port]) names one of c's listen addresses:
 * the port of --port, --metrics-port or --admin-port on a literal address
 * this host answers on (loopback, 0.0.0.0, or an interface's address when
 * listening on every address), or the listen host as written. Host names
 * other than localhost are not resolved here: the Via marker catches those. */
int px_config_url_is_self(const px_config *c, const char *url);

/* What a --config file may cost (fixed; README "Configuration file"):
 * larger files and deeper nesting are refused before a document is built. */
#define PX_CONFIG_MAX_BYTES (16 * 1024 * 1024)
#define PX_CONFIG_MAX_DEPTH 16

/* Whether two backend URLs name the same backend: scheme, host and port
 * compared after spelling is undone (case, a trailing '/', the default
 * port, 127.1 for 127.0.0.1, v4-mapped v6, localhost for 127.0.0.1). */
int px_config_url_same(const char *a, const char *b);
/* The form px_config_url_same compares, into out: two URLs name the same
 * backend exactly when their keys are equal (for hash sets of backends).
 * 0, or -1 when malformed or out is too small. */
int px_config_url_key(const char *url, char *out, size_t outlen);

typedef enum { PX_CONFIG_RUN = 0, PX_CONFIG_EXIT_OK = 1, PX_CONFIG_ERROR = -1 } px_config_result;

/* Fills c from defaults, then the --config file (YAML; --config or
 * PDPROXY_CONFIG names it), then PDPROXY_* variables of `envp`, then argv.
 * --help and --version print to `out` and return PX_CONFIG_EXIT_OK. On a bad
 * flag or value returns PX_CONFIG_ERROR with "--flag 'value': reason" in err.
 * c must be released with px_config_cleanup() whatever the result. */
px_config_result px_config_load(px_config *c, int argc, char **argv, char **envp, FILE *out,
                                char *err, size_t errlen);

void px_config_cleanup(px_config *c);

/* Whether the option named `name` was given explicitly (flag or env). */
int px_config_is_set(const px_config *c, const char *name);

/* Writes the effective configuration as YAML that --config reads back to
 * the same settings; secrets appear only as comments saying they are set. */
void px_config_dump(const px_config *c, FILE *out);

/* The pools requests are routed to: the named ones, or else the unnamed
 * pool of the top-level backends. Deep copies; free with
 * px_pool_specs_free(). */
px_pool_spec *px_config_effective_pools(const px_config *c, size_t *n);
void px_pool_specs_free(px_pool_spec *v, size_t n);
void px_strlist_push(px_strlist *l, const char *s);
void px_strlist_clear(px_strlist *l);

/* Whether `host` (a name or an address literal, without brackets) and
 * `port` are in the allowlist of HOST:PORTS entries: HOST a CIDR, address
 * or host name (names compare without case, never resolved), PORTS a port,
 * a range N-M or * (every port). */
int px_target_allowed(const px_strlist *allow, const char *host, int port);

/* Writes to out the comma-separated names of the settings whose values
 * differ between a and b and that a reload does not apply (the option
 * table's reload column says which it does; the pools it always does). */
void px_config_changed(const px_config *a, const px_config *b, char *out, size_t cap);

/* Index of pool spec serving `model` (n bytes), or -1. */
int px_config_pool_for(const px_config *c, const char *model, size_t n);

#endif
