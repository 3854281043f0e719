/* SPDX-License-Identifier: Apache-2.0 */
/* engine-sim's HTTP front: routes, OpenAI request parsing, /metrics in
 * vLLM's names, the listener and the run loop. The engine itself (blocks,
 * KV transfers, generation) is engine.c. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "base/hash.h"
#include "base/http.h"
#include "base/listen.h"
#include "base/log.h"
#include "sim/engine_int.h"
#include "sim/kvsim.h"

/* ---------------------------------------------------------- completions -- */

static void handle_completion(sim_engine *e, px_conn *c, sim_ep ep, const px_http_head *h,
                              px_buf *body) {
    char msg[256];
    char xrid[129];
    px_http_request_id(h, xrid);
    sim_parsed pr;
    int status = sim_parse_request(ep == EP_CHAT, body->data, body->len, e->cfg->model, &pr, msg,
                                   sizeof msg);
    if (status) {
        px_conn_reply_error(c, status, xrid, NULL, msg);
        return;
    }
    sim_submit(e, c, ep, xrid, &pr);
}

/* ------------------------------------------------------------- routing -- */

static void reply_metrics(sim_engine *e, px_conn *c) {
    px_buf b;
    px_buf_init(&b);
    const sim_config *cfg = e->cfg;
    double usage = cfg->num_blocks ? 1.0 - (double)e->nfree / (double)cfg->num_blocks : 0;
#define GAUGE(name, help, fmt, v)                                                                  \
    px_buf_printf(&b, "# HELP %s %s\n# TYPE %s gauge\n%s{model_name=%s} " fmt "\n", name, help,    \
                  name, name, e->model_json, v)
#define COUNTER(name, help, v)                                                                     \
    px_buf_printf(&b, "# HELP %s %s\n# TYPE %s counter\n%s %llu\n", name, help, name, name,        \
                  (unsigned long long)(v))
    GAUGE("vllm:num_requests_running", "Requests being processed.", "%zu", e->nrunning);
    GAUGE("vllm:num_requests_waiting", "Requests waiting for KV blocks.", "%zu", e->nqueued);
    GAUGE("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = 100%).", "%.6f", usage);
    px_buf_printf(&b,
                  "# HELP vllm:cache_config_info KV cache configuration.\n"
                  "# TYPE vllm:cache_config_info gauge\n"
                  "vllm:cache_config_info{block_size=\"%u\",num_gpu_blocks=\"%llu\"} 1\n",
                  cfg->block_tokens, (unsigned long long)cfg->num_blocks);
    COUNTER("engine_sim_requests_total", "Completion requests received.", e->requests_total);
    COUNTER("engine_sim_kv_blocks_published_total", "KV blocks published by prefill.",
            e->blocks_published);
    COUNTER("engine_sim_kv_blocks_released_by_consumer_total",
            "Published KV blocks released by the consumer's notification.", e->blocks_released);
    COUNTER("engine_sim_kv_blocks_expired_total", "Published KV blocks freed by expiry.",
            e->blocks_expired);
    COUNTER("engine_sim_kv_unknown_notifications_total",
            "Notifications for unknown or expired request ids.", e->unknown_notify);
    COUNTER("engine_sim_kv_fetch_failures_total", "KV fetches that failed.", e->fetch_failures);
    COUNTER("engine_sim_kv_corrupt_blocks_total", "Fetched KV pieces whose bytes were wrong.",
            e->corrupt_blocks);
    COUNTER("engine_sim_kv_fetches_total", "KV fetches completed.", e->fetches);
    COUNTER("engine_sim_kv_bytes_fetched_total", "Bytes moved by completed KV fetches.",
            e->bytes_fetched);
    px_buf_printf(&b,
                  "# HELP engine_sim_kv_fetch_seconds_total Time spent in completed KV fetches.\n"
                  "# TYPE engine_sim_kv_fetch_seconds_total counter\n"
                  "engine_sim_kv_fetch_seconds_total %.9f\n",
                  (double)e->fetch_ns / 1e9);
    COUNTER("engine_sim_invalid_kv_transfer_params_total",
            "Decode requests whose kv_transfer_params were unusable.", e->invalid_kvp);
    COUNTER("engine_sim_prompt_tokens_computed_total",
            "Prompt tokens this engine computed (cached prefixes and received KV excluded).",
            e->tokens_computed);
    COUNTER("engine_sim_prompt_tokens_cached_total",
            "Prompt tokens reported as cached: prefix cache hits and KV received from prefill.",
            e->tokens_cached);
    COUNTER("engine_sim_queue_rejections_total", "Requests refused with 503: queue full.",
            e->queue_rejects);
    COUNTER("engine_sim_kv_lease_renewals_total",
            "Lease renewals sent for queued decode requests' KV blocks.", e->lease_renewals);
    GAUGE("engine_sim_kv_blocks_free", "Free KV blocks.", "%zu", e->nfree);
#undef GAUGE
#undef COUNTER
    px_conn_reply(c, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, NULL, b.data, b.len);
    px_buf_cleanup(&b);
}

static void dispatch(void *ctx, px_conn *c, const px_http_head *h, px_buf *body) {
    sim_engine *e = ctx;
    int is_get = h->method_len == 3 && !memcmp(h->method, "GET", 3);
    int is_post = h->method_len == 4 && !memcmp(h->method, "POST", 4);
    if (px_http_path_is(h, "/v1/completions") || px_http_path_is(h, "/v1/chat/completions")) {
        if (!is_post) {
            px_conn_reply_error(c, 405, NULL, "Allow: POST\r\n", "method not allowed");
            return;
        }
        handle_completion(
            e, c, px_http_path_is(h, "/v1/chat/completions") ? EP_CHAT : EP_COMPLETIONS, h, body);
        return;
    }
    if (!is_get && (px_http_path_is(h, "/health") || px_http_path_is(h, "/metrics") ||
                    px_http_path_is(h, "/v1/models"))) {
        px_conn_reply_error(c, 405, NULL, "Allow: GET\r\n", "method not allowed");
        return;
    }
    if (px_http_path_is(h, "/health")) {
        px_conn_reply(c, 200, "application/json", NULL, NULL, "{}", 2);
    } else if (px_http_path_is(h, "/metrics")) {
        reply_metrics(e, c);
    } else if (px_http_path_is(h, "/v1/models")) {
        px_buf b;
        px_buf_init(&b);
        px_buf_printf(&b,
                      "{\"object\":\"list\",\"data\":[{\"id\":%s,\"object\":\"model\",\"created\":"
                      "%ld,\"owned_by\":\"engine-sim\",\"root\":%s,\"max_model_len\":%llu}]}",
                      e->model_json, (long)time(NULL), e->model_json,
                      (unsigned long long)(e->cfg->num_blocks * e->cfg->block_tokens));
        px_conn_reply(c, 200, "application/json", NULL, NULL, b.data, b.len);
        px_buf_cleanup(&b);
    } else {
        px_conn_reply_error(c, 404, NULL, NULL, "not found");
    }
}

/* --------------------------------------------------------------- setup -- */

static void on_signal(evutil_socket_t sig, short what, void *arg) {
    sim_engine *e = arg;
    PX_LOG(PX_LOG_INFO, "msg=\"stopping\" signal=%d", (int)sig);
    event_base_loopbreak(e->base);
}

static int setup_listener(sim_engine *e) {
    char err[256];
    e->lev = px_listen(e->base, e->cfg->host, e->cfg->port, 0, "--port", &e->conn_cfg, &e->conns,
                       err, sizeof err);
    if (!e->lev) fprintf(stderr, "engine-sim: %s\n", err);
    return e->lev ? 0 : -1;
}

int sim_engine_run(const sim_config *cfg) {
    sim_engine *e = px_xcalloc(1, sizeof *e);
    int rc = 1;
    e->cfg = cfg;
    e->model_hash = px_hash64_seed(cfg->model, strlen(cfg->model), 0x5eed);
    {
        px_buf b;
        px_buf_init(&b);
        px_buf_append_json_str(&b, cfg->model, strlen(cfg->model));
        snprintf(e->model_json, sizeof e->model_json, "%s", b.data);
        px_buf_cleanup(&b);
    }
    e->free_blocks = px_xmalloc(cfg->num_blocks * sizeof *e->free_blocks);
    /* Hand out low ids first: popping from the end of a descending stack. */
    for (uint64_t i = 0; i < cfg->num_blocks; i++)
        e->free_blocks[i] = cfg->num_blocks - 1 - i;
    e->nfree = cfg->num_blocks;
    /* About one entry per KV block, as an engine's prefix cache holds. */
    size_t sets = 1;
    while (sets * SIM_PCACHE_WAYS < cfg->num_blocks)
        sets <<= 1;
    e->pcache = px_xcalloc(sets * SIM_PCACHE_WAYS, sizeof *e->pcache);
    e->pcache_mask = sets - 1;
    e->base = event_base_new();
    e->conn_cfg = (px_conn_cfg){.max_body_bytes = 64 << 20,
                                .header_timeout = 30,
                                .keepalive_timeout = 75,
                                .dispatch = dispatch,
                                .ctx = e};
    struct event *sigint = evsignal_new(e->base, SIGINT, on_signal, e);
    struct event *sigterm = evsignal_new(e->base, SIGTERM, on_signal, e);
    event_add(sigint, NULL);
    event_add(sigterm, NULL);
    if (sim_engine_setup_agent(e) < 0 || setup_listener(e) < 0) goto out;
    uint16_t kvport = 0;
    kvc_agent_get_port(e->agent, &kvport);
    PX_LOG(PX_LOG_INFO,
           "msg=\"engine-sim ready\" role=%s addr=%s:%d model=%s engine_id=%s kv=%s:%u "
           "num_blocks=%llu block_tokens=%u layers=%u block_bytes=%u",
           cfg->role, cfg->host, cfg->port, cfg->model, cfg->engine_id, cfg->kv_host, kvport,
           (unsigned long long)cfg->num_blocks, cfg->block_tokens, cfg->layers, cfg->block_bytes);
    event_base_dispatch(e->base);
    rc = 0;
out:
    px_conn_list_close_all(&e->conns);
    sim_engine_free_reqs(e);
    px_listener_free(e->lev);
    if (e->kv_ev) event_free(e->kv_ev);
    kvc_agent_destroy(e->agent);
    event_free(sigint);
    event_free(sigterm);
    event_base_free(e->base);
    free(e->free_blocks);
    free(e->pcache);
    free(e);
    return rc;
}
