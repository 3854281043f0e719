#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "util.h"

#define PX_POLICIES "round_robin|least_inflight|power_of_two|prefix_affinity|load_aware"

typedef enum { CT_STR, CT_INT, CT_SECONDS, CT_LIST, CT_URLS, CT_FLAG, CT_ENUM, CT_SECRET } ctype_t;

typedef struct opt {
    const char *name;  /* long flag without dashes */
    const char *alias; /* second spelling (toy proxy's singular forms), or NULL */
    ctype_t type;
    size_t off;
    const char *def; /* default, as text */
    double min, max; /* bounds for numbers */
    const char *help;
    const char *choices; /* CT_ENUM: "a|b|c" */
} opt;

#define OFF(f) offsetof(px_config, f)

static const opt opts[] = {
    {"host", NULL, CT_STR, OFF(host), "127.0.0.1", 0, 0, "address to listen on", NULL},
    {"port", NULL, CT_INT, OFF(port), "8000", 1, 65535, "port to listen on", NULL},
    {"prefiller-hosts", "prefiller-host", CT_LIST, OFF(prefiller_hosts), "localhost", 0, 0,
     "prefill instance hosts (one or more; toy-proxy form)", NULL},
    {"prefiller-ports", "prefiller-port", CT_LIST, OFF(prefiller_ports), "8100", 1, 65535,
     "prefill instance ports, one per host", NULL},
    {"decoder-hosts", "decoder-host", CT_LIST, OFF(decoder_hosts), "localhost", 0, 0,
     "decode instance hosts (one or more; toy-proxy form)", NULL},
    {"decoder-ports", "decoder-port", CT_LIST, OFF(decoder_ports), "8200", 1, 65535,
     "decode instance ports, one per host", NULL},
    {"prefill", NULL, CT_URLS, OFF(prefill_urls), "", 0, 0,
     "prefill backend URL http[s]://host:port, repeatable; a host name is re-resolved every "
     "--dns-refresh and each address is a backend (replaces the toy flags' defaults)",
     NULL},
    {"decode", NULL, CT_URLS, OFF(decode_urls), "", 0, 0,
     "decode backend URL, repeatable, as --prefill", NULL},
    {"dns-refresh", NULL, CT_SECONDS, OFF(dns_refresh), "10", 0.1, 86400,
     "seconds between DNS re-resolutions of backend names", NULL},
    {"threads", NULL, CT_INT, OFF(threads), "0", 0, 1024,
     "worker threads, each with its own event loop (0: one per CPU)", NULL},
    {"max-body-bytes", NULL, CT_INT, OFF(max_body_bytes), "33554432", 1, 1099511627776.0,
     "largest request body accepted (413 beyond)", NULL},
    {"max-inflight", NULL, CT_INT, OFF(max_inflight), "0", 0, 100000000,
     "most requests in flight at once; beyond, 503 with Retry-After (0: unlimited)", NULL},
    {"connect-timeout", NULL, CT_SECONDS, OFF(connect_timeout), "5", 0.001, 3600,
     "seconds to wait for an upstream TCP connection (504 beyond)", NULL},
    {"prefill-timeout", NULL, CT_SECONDS, OFF(prefill_timeout), "600", 0, 86400,
     "seconds a prefill request may take in all (504 beyond; 0: no limit)", NULL},
    {"decode-idle-timeout", NULL, CT_SECONDS, OFF(decode_idle_timeout), "600", 0, 86400,
     "seconds without a byte from decode before the request is failed (0: no limit)", NULL},
    {"client-header-timeout", NULL, CT_SECONDS, OFF(client_header_timeout), "30", 0.001, 3600,
     "seconds a client has to send a complete request (408 beyond)", NULL},
    {"keepalive-timeout", NULL, CT_SECONDS, OFF(keepalive_timeout), "75", 0.001, 86400,
     "seconds an idle client connection is kept open", NULL},
    {"send-timeout", NULL, CT_SECONDS, OFF(send_timeout), "30", 0, 86400,
     "seconds a client may read none of the output queued for it before it is closed (0: no "
     "limit)",
     NULL},
    {"max-buffered-bytes", NULL, CT_INT, OFF(max_buffered_bytes), "268435456", 0, 1099511627776.0,
     "process-wide budget for request bodies held and responses queued; new bodies beyond it "
     "get 503 with Retry-After (0: no budget)",
     NULL},
    {"max-connections", NULL, CT_INT, OFF(max_connections), "0", 0, 100000000,
     "most client connections open at once; past it a connection is answered 503 and closed "
     "(0: no limit but the descriptor limit)",
     NULL},
    {"reuse-port", NULL, CT_FLAG, OFF(reuse_port), "false", 0, 0,
     "share the port with other processes (SO_REUSEPORT); without it a port already served is "
     "an error",
     NULL},
    {"metrics-host", NULL, CT_STR, OFF(metrics_host), "", 0, 0,
     "address of the separate metrics listener (default: --host)", NULL},
    {"metrics-port", NULL, CT_INT, OFF(metrics_port), "0", 0, 65535,
     "serve /metrics (with /health and /ready) on this port only, not on --port (0: on --port)",
     NULL},
    {"metrics-auth", NULL, CT_FLAG, OFF(metrics_auth), "false", 0, 0,
     "/metrics on --port requires the API key like the API (probes /health, /ready stay open)",
     NULL},
    {"health-interval", NULL, CT_SECONDS, OFF(health_interval), "5", 0, 3600,
     "seconds between active health checks, GET /health (0: none)", NULL},
    {"health-timeout", NULL, CT_SECONDS, OFF(health_timeout), "2", 0.001, 600,
     "seconds a health check may take", NULL},
    {"unhealthy-after", NULL, CT_INT, OFF(unhealthy_after), "3", 1, 1000,
     "consecutive failures (checks, connect errors, resets, 5xx) that eject a backend", NULL},
    {"healthy-after", NULL, CT_INT, OFF(healthy_after), "2", 1, 1000,
     "consecutive successful checks that readmit an ejected backend", NULL},
    {"prefill-retries", NULL, CT_INT, OFF(prefill_retries), "2", 0, 100,
     "retries of a prefill refused, reset or answering 5xx, each on another instance", NULL},
    {"fallback-decode-only", NULL, CT_FLAG, OFF(fallback_decode_only), "false", 0, 0,
     "send a request to decode alone when no prefill is healthy (else 503) or when its prefill "
     "failed with 5xx or a connection error, retries spent (else 502)",
     NULL},
    {"prefill-policy", NULL, CT_ENUM, OFF(prefill_policy), "round_robin", 0, 0,
     "how to choose a prefill instance", PX_POLICIES},
    {"decode-policy", NULL, CT_ENUM, OFF(decode_policy), "round_robin", 0, 0,
     "how to choose a decode instance", PX_POLICIES},
    {"prefix-bytes", NULL, CT_INT, OFF(prefix_bytes), "256", 1, 1048576,
     "prefix_affinity: bytes of the prompt (or first chat messages) that are hashed", NULL},
    {"prefix-load-factor", NULL, CT_SECONDS, OFF(prefix_load_factor), "1.25", 1, 100,
     "prefix_affinity: an instance takes at most this times the mean in-flight load", NULL},
    {"metrics-interval", NULL, CT_SECONDS, OFF(metrics_interval), "2", 0.05, 3600,
     "load_aware: seconds between scrapes of each engine's /metrics", NULL},
    /* Per-request decisions: conditional disaggregation and usage. */
    {"disagg-min-tokens", NULL, CT_INT, OFF(disagg_min_tokens), "0", 0, 100000000,
     "send a request straight to decode when its estimated uncached prompt is shorter than this "
     "many tokens (0: always disaggregate)",
     NULL},
    {"disagg-bytes-per-token", NULL, CT_SECONDS, OFF(disagg_bytes_per_token), "4", 0.5, 64,
     "prompt bytes (as the JSON body spells them) per token in the prompt length estimate", NULL},
    {"disagg-index-blocks", NULL, CT_INT, OFF(disagg_index_blocks), "65536", 1, 16777216,
     "entries of each worker's LRU index of prompt prefixes recently sent to each decode "
     "instance (one entry per 128 prompt bytes)",
     NULL},
    {"usage-from", NULL, CT_ENUM, OFF(usage_from), "prefill", 0, 0,
     "whose prompt_tokens_details.cached_tokens a disaggregated answer's usage reports: "
     "prefill's (what was computed from cache) or decode's (as the engine says)",
     "prefill|decode"},
    {"drain-delay", NULL, CT_SECONDS, OFF(drain_delay), "5", 0, 3600,
     "on SIGTERM, seconds /ready answers 503 before new connections stop", NULL},
    {"drain-timeout", NULL, CT_SECONDS, OFF(drain_timeout), "60", 0, 86400,
     "on SIGTERM, seconds in-flight requests get to finish", NULL},
    {"tls-cert", NULL, CT_STR, OFF(tls_cert), "", 0, 0, "PEM certificate chain: serve HTTPS", NULL},
    {"tls-key", NULL, CT_STR, OFF(tls_key), "", 0, 0, "PEM private key for --tls-cert", NULL},
    {"upstream-ca", NULL, CT_STR, OFF(upstream_ca), "", 0, 0,
     "PEM CA bundle to verify https:// backends (default: the system store)", NULL},
    {"upstream-insecure", NULL, CT_FLAG, OFF(upstream_insecure), "false", 0, 0,
     "do not verify https:// backends' certificates", NULL},
    {"api-key", NULL, CT_SECRET, OFF(api_key), "", 0, 0,
     "clients must send Authorization: Bearer <key> (401 otherwise)", NULL},
    {"api-key-file", NULL, CT_STR, OFF(api_key_file), "", 0, 0,
     "file of accepted API keys, one per line", NULL},
    {"upstream-api-key", NULL, CT_SECRET, OFF(upstream_api_key), "", 0, 0,
     "key sent to engines as Bearer (else the client's Authorization, else $OPENAI_API_KEY)", NULL},
    {"log-level", NULL, CT_ENUM, OFF(log_level), "info", 0, 0, "log verbosity",
     "debug|info|warn|error"},
    {"log-format", NULL, CT_ENUM, OFF(log_format), "logfmt", 0, 0, "log line format",
     "logfmt|json"},
    {"print-config", NULL, CT_FLAG, OFF(print_config), "false", 0, 0,
     "print the effective configuration and exit", NULL},
};
#define NOPTS (sizeof opts / sizeof *opts)
_Static_assert(NOPTS <= sizeof(((px_config *)0)->set), "grow px_config.set");

static void list_clear(px_strlist *l) {
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
    list_clear(l);
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

static void usage(FILE *out) {
    fprintf(out,
            "Usage: pdproxy [options]\n"
            "Prefill/decode disaggregation proxy for OpenAI-compatible engines.\n\n"
            "Options (each also as environment variable PDPROXY_<NAME>, e.g. PDPROXY_PORT):\n");
    for (size_t i = 0; i < NOPTS; i++) {
        const opt *o = &opts[i];
        char names[96];
        const char *arg = o->type == CT_LIST      ? " V [V...]"
                          : o->type == CT_URLS    ? " URL"
                          : o->type == CT_ENUM    ? " CHOICE"
                          : o->type == CT_FLAG    ? ""
                          : o->type == CT_SECONDS ? " SECONDS"
                          : o->type == CT_INT     ? " N"
                                                  : " VALUE";
        if (o->alias)
            snprintf(names, sizeof names, "--%s/--%s%s", o->name, o->alias, arg);
        else
            snprintf(names, sizeof names, "--%s%s", o->name, arg);
        if (o->type == CT_ENUM)
            fprintf(out, "  %-44s %s: %s (default: %s)\n", names, o->help, o->choices, o->def);
        else if (!o->def[0])
            fprintf(out, "  %-44s %s\n", names, o->help);
        else
            fprintf(out, "  %-44s %s (default: %s)\n", names, o->help, o->def);
    }
    fprintf(out, "  %-44s %s\n  %-44s %s\n", "--help", "show this help and exit", "--version",
            "show the version and exit");
}

static void env_name(const opt *o, char *buf, size_t n);

/* The flags table of README.md, from the same table as --help. */
static void markdown(FILE *out) {
    fprintf(out, "| flag | environment | default | meaning |\n|---|---|---|---|\n");
    for (size_t i = 0; i < NOPTS; i++) {
        const opt *o = &opts[i];
        char env[96];
        env_name(o, env, sizeof env);
        fprintf(out, "| `--%s`", o->name);
        if (o->alias) fprintf(out, " / `--%s`", o->alias);
        fprintf(out, " | `%s` | %s%s%s | %s", env, o->def[0] ? "`" : "", o->def,
                o->def[0] ? "`" : "", o->help);
        if (o->type == CT_ENUM) fprintf(out, ": `%s`", o->choices);
        if (o->type == CT_URLS) fprintf(out, " (repeatable)");
        if (o->type == CT_LIST) fprintf(out, " (one or more values)");
        fprintf(out, " |\n");
    }
}

static void env_name(const opt *o, char *buf, size_t n) {
    size_t j = (size_t)snprintf(buf, n, "PDPROXY_");
    for (const char *p = o->name; *p && j + 1 < n; p++)
        buf[j++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
    buf[j] = '\0';
}

px_config_result px_config_load(px_config *c, int argc, char **argv, char **envp, FILE *out,
                                char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    err[0] = '\0';
    for (size_t i = 0; i < NOPTS; i++)
        if (set_value(c, &opts[i], opts[i].def, err, errlen) < 0) return PX_CONFIG_ERROR;

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
                    return PX_CONFIG_ERROR;
                }
            }
        }
    }

    unsigned char seen_urls[NOPTS] = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(out);
            return PX_CONFIG_EXIT_OK;
        }
        if (!strcmp(a, "--help-markdown")) {
            markdown(out);
            return PX_CONFIG_EXIT_OK;
        }
        if (!strcmp(a, "--version")) {
            fprintf(out, "pdproxy %s\n", PDPROXY_VERSION);
            return PX_CONFIG_EXIT_OK;
        }
        if (strncmp(a, "--", 2) != 0) {
            snprintf(err, errlen, "unexpected argument '%s'", a);
            return PX_CONFIG_ERROR;
        }
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t nlen = eq ? (size_t)(eq - name) : strlen(name);
        const opt *o = find_opt(name, nlen);
        if (!o) {
            snprintf(err, errlen, "unknown flag '%.*s' (see --help)", (int)(nlen + 2), a);
            return PX_CONFIG_ERROR;
        }
        c->set[o - opts] = 1;
        if (o->type == CT_FLAG && !eq) {
            *(int *)((char *)c + o->off) = 1;
            continue;
        }
        if (o->type == CT_URLS) {
            px_strlist *l = (px_strlist *)((char *)c + o->off);
            if (!seen_urls[o - opts]) list_clear(l); /* the command line replaces the env */
            seen_urls[o - opts] = 1;
            const char *v = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
            if (!v) {
                snprintf(err, errlen, "--%s: missing value", o->name);
                return PX_CONFIG_ERROR;
            }
            list_push(l, v, strlen(v));
            if (check_url(o, v, err, errlen) < 0) return PX_CONFIG_ERROR;
            continue;
        }
        if (o->type == CT_LIST) {
            /* nargs='+' as in the toy proxy: values until the next flag. */
            px_strlist *l = (px_strlist *)((char *)c + o->off);
            list_clear(l);
            if (eq) {
                if (set_value(c, o, eq + 1, err, errlen) < 0) return PX_CONFIG_ERROR;
                continue;
            }
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
                list_push(l, argv[i + 1], strlen(argv[i + 1]));
                if (check_list_item(o, argv[i + 1], err, errlen) < 0) return PX_CONFIG_ERROR;
                i++;
            }
            if (!l->n) {
                snprintf(err, errlen, "--%s: needs at least one value", o->name);
                return PX_CONFIG_ERROR;
            }
            continue;
        }
        const char *v;
        if (eq) {
            v = eq + 1;
        } else if (i + 1 < argc) {
            v = argv[++i];
        } else {
            snprintf(err, errlen, "--%s: missing value", o->name);
            return PX_CONFIG_ERROR;
        }
        if (set_value(c, o, v, err, errlen) < 0) return PX_CONFIG_ERROR;
    }

    if (!c->tls_cert[0] != !c->tls_key[0]) {
        snprintf(err, errlen, "--tls-cert and --tls-key go together: give both or neither");
        return PX_CONFIG_ERROR;
    }
    if (c->prefiller_hosts.n != c->prefiller_ports.n) {
        snprintf(err, errlen,
                 "--prefiller-hosts has %zu value(s) but --prefiller-ports has %zu: give one port "
                 "per host",
                 c->prefiller_hosts.n, c->prefiller_ports.n);
        return PX_CONFIG_ERROR;
    }
    if (c->decoder_hosts.n != c->decoder_ports.n) {
        snprintf(err, errlen,
                 "--decoder-hosts has %zu value(s) but --decoder-ports has %zu: give one port per "
                 "host",
                 c->decoder_hosts.n, c->decoder_ports.n);
        return PX_CONFIG_ERROR;
    }
    if (c->print_config) {
        px_config_dump(c, out);
        return PX_CONFIG_EXIT_OK;
    }
    return PX_CONFIG_RUN;
}

void px_config_cleanup(px_config *c) {
    for (size_t i = 0; i < NOPTS; i++) {
        void *field = (char *)c + opts[i].off;
        if (opts[i].type == CT_STR || opts[i].type == CT_ENUM || opts[i].type == CT_SECRET) {
            free(*(char **)field);
            *(char **)field = NULL;
        } else if (opts[i].type == CT_LIST || opts[i].type == CT_URLS) {
            list_clear(field);
        }
    }
}

int px_config_is_set(const px_config *c, const char *name) {
    const opt *o = find_opt(name, strlen(name));
    return o ? c->set[o - opts] : 0;
}

void px_config_dump(const px_config *c, FILE *out) {
    for (size_t i = 0; i < NOPTS; i++) {
        const opt *o = &opts[i];
        const void *field = (const char *)c + o->off;
        if (o->type == CT_FLAG && !strcmp(o->name, "print-config")) continue;
        fprintf(out, "%s = ", o->name);
        switch (o->type) {
        case CT_STR:
        case CT_ENUM:
            fprintf(out, "%s", *(char *const *)field);
            break;
        case CT_SECRET:
            fprintf(out, "%s", (*(char *const *)field)[0] ? "(set)" : "");
            break;
        case CT_INT:
            fprintf(out, "%lld", (long long)*(const int64_t *)field);
            break;
        case CT_SECONDS:
            fprintf(out, "%g", *(const double *)field);
            break;
        case CT_FLAG:
            fprintf(out, "%s", *(const int *)field ? "true" : "false");
            break;
        case CT_LIST:
        case CT_URLS: {
            const px_strlist *l = field;
            for (size_t j = 0; j < l->n; j++)
                fprintf(out, "%s%s", j ? " " : "", l->v[j]);
            break;
        }
        }
        fputc('\n', out);
    }
}
