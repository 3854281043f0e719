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
#include "sim/link.h"

/* ---------------------------------------------------------- completions -- */

static void handle_completion(sim_engine *e, px_conn *c, sim_ep ep, const px_http_head *h,
                              px_buf *body) {
    char msg[256];
    char xrid[129];
    px_http_request_id(h, xrid);
    /* vLLM's _get_data_parallel_rank: a header that is no integer counts as
     * absent; a rank outside the engine's cores is refused. */
    int rank = -1;
    const px_http_header *dr = px_http_find(h, "x-data-parallel-rank");
    if (dr) {
        char v[24];
        char *end;
        snprintf(v, sizeof v, "%.*s", (int)(dr->value_len < 23 ? dr->value_len : 23), dr->value);
        long n = strtol(v, &end, 10);
        if (end != v && !*end) {
            if (n < 0 || n >= (long)e->cfg->dp_size) {
                snprintf(msg, sizeof msg, "data_parallel_rank %ld is out of range [0, %u)", n,
                         e->cfg->dp_size);
                px_conn_reply_error(c, 400, xrid, NULL, msg);
                return;
            }
            rank = (int)n;
        }
    }
    sim_parsed pr;
    int status = sim_parse_request((int)ep, body->data, body->len, e->cfg->model, &pr, msg,
                                   sizeof msg);
    if (status) {
        px_conn_reply_error(c, status, xrid, NULL, msg);
        return;
    }
    sim_submit(e, c, ep, xrid, rank, &pr);
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
    /* One series per data-parallel rank, labelled engine="K" as vLLM's
     * PrometheusStatLogger labels each engine core's scheduler gauges. */
    uint32_t ndp = cfg->dp_size > 1 ? cfg->dp_size : 1;
    if (ndp > SIM_DP_MAX) ndp = SIM_DP_MAX;
    px_buf_appends(&b, "# HELP vllm:num_requests_running Requests being processed.\n"
                       "# TYPE vllm:num_requests_running gauge\n");
    for (uint32_t k = 0; k < ndp; k++)
        px_buf_printf(&b, "vllm:num_requests_running{engine=\"%u\",model_name=%s} %zu\n", k,
                      e->model_json, e->dp_running[k]);
    px_buf_appends(&b, "# HELP vllm:num_requests_waiting Requests waiting for KV blocks.\n"
                       "# TYPE vllm:num_requests_waiting gauge\n");
    for (uint32_t k = 0; k < ndp; k++)
        px_buf_printf(&b, "vllm:num_requests_waiting{engine=\"%u\",model_name=%s} %zu\n", k,
                      e->model_json, e->dp_waiting[k]);
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
    COUNTER("engine_sim_kv_load_failed_requests_total",
            "Requests failed because their KV load failed (--kv-load-failure-policy fail).",
            e->kv_load_failed);
    COUNTER("engine_sim_kv_bytes_fetched_total", "Bytes moved by completed KV fetches.",
            e->bytes_fetched);
    px_buf_printf(&b,
                  "# HELP engine_sim_kv_fetch_seconds_total Time spent in completed KV fetches.\n"
                  "# TYPE engine_sim_kv_fetch_seconds_total counter\n"
                  "engine_sim_kv_fetch_seconds_total %.9f\n",
                  (double)e->fetch_ns / 1e9);
    /* Queueing before the engine works on a request; a mean is seconds
     * over entries (bench/pd_mixed.py: decode's queueing time). */
    px_buf_printf(&b,
                  "# HELP engine_sim_queue_seconds_total Time waited before the engine worked: "
                  "queue=\"kv_blocks\", admitted requests in the wait queue for free KV blocks; "
                  "queue=\"compute\", computations (a prompt, or a decode's last prompt token) "
                  "behind those queued before them; queue=\"seqs\", requests whose prompt was "
                  "ready waiting for one of --max-num-seqs generation slots.\n"
                  "# TYPE engine_sim_queue_seconds_total counter\n"
                  "engine_sim_queue_seconds_total{queue=\"kv_blocks\"} %.9f\n"
                  "engine_sim_queue_seconds_total{queue=\"compute\"} %.9f\n"
                  "engine_sim_queue_seconds_total{queue=\"seqs\"} %.9f\n"
                  "# HELP engine_sim_queue_entries_total What passed each queue, waiting or "
                  "not: requests admitted (kv_blocks), computations queued (compute), "
                  "generations started (seqs).\n"
                  "# TYPE engine_sim_queue_entries_total counter\n"
                  "engine_sim_queue_entries_total{queue=\"kv_blocks\"} %llu\n"
                  "engine_sim_queue_entries_total{queue=\"compute\"} %llu\n"
                  "engine_sim_queue_entries_total{queue=\"seqs\"} %llu\n",
                  (double)e->block_wait_ns / 1e9, (double)e->compute_wait_ns / 1e9,
                  (double)e->seq_wait_ns / 1e9, (unsigned long long)e->admitted,
                  (unsigned long long)e->computes, (unsigned long long)e->generations);
    COUNTER("engine_sim_kv_link_delays_total",
            "KV fetches held back by a --kv-peer-cost link (its delay or bandwidth cap).",
            e->link_waits);
    px_buf_printf(&b,
                  "# HELP engine_sim_kv_link_delay_seconds_total Time KV fetches were held back "
                  "by --kv-peer-cost links.\n"
                  "# TYPE engine_sim_kv_link_delay_seconds_total counter\n"
                  "engine_sim_kv_link_delay_seconds_total %.9f\n",
                  (double)e->link_wait_ns / 1e9);
    COUNTER("engine_sim_invalid_kv_transfer_params_total",
            "Decode requests whose kv_transfer_params were unusable.", e->invalid_kvp);
    COUNTER("engine_sim_kv_params_without_blocks_total",
            "Pull-mode decode requests with do_remote_prefill and no remote_block_ids "
            "(vLLM's engine core dies on one).",
            e->kvp_no_blocks);
    COUNTER("engine_sim_kv_transfer_id_missing_total",
            "Push-mode prefill and decode requests without a transfer_id.", e->transfer_id_missing);
    COUNTER("engine_sim_prompt_tokens_computed_total",
            "Prompt tokens this engine computed (cached prefixes and received KV excluded).",
            e->tokens_computed);
    COUNTER("engine_sim_prompt_tokens_cached_total",
            "Prompt tokens reported as cached: prefix cache hits and KV received from prefill.",
            e->tokens_cached);
    COUNTER("engine_sim_queue_rejections_total", "Requests refused with 503: queue full.",
            e->queue_rejects);
    COUNTER("engine_sim_busy_rejections_total",
            "Requests refused with 429: --max-num-queued-reqs in the engine.", e->busy_rejects);
    COUNTER("engine_sim_kv_lease_renewals_total",
            "Lease renewals sent for queued decode requests' KV blocks.", e->lease_renewals);
    COUNTER("vllm:prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache (computed by this engine).",
            e->prefix_queries);
    COUNTER("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
            e->prefix_hits);
    COUNTER("vllm:prompt_tokens_total", "Prompt tokens of the requests processed.",
            e->prompt_tokens);
    COUNTER("engine_sim_kv_events_batches_total", "KV event batches published.",
            sim_kvev_batches(e->kvev));
    COUNTER("engine_sim_kv_events_replays_total", "KV event replay requests served.",
            sim_kvev_replays(e->kvev));
    GAUGE("engine_sim_prefix_cache_blocks", "Blocks in the prefix cache.", "%zu",
          sim_prefix_size(e->prefix));
    GAUGE("engine_sim_kv_blocks_free", "Free KV blocks.", "%zu", e->nfree);
    px_buf_appends(&b, "# HELP engine_sim_dp_rank_requests_total Requests that named a "
                       "data-parallel rank (X-data-parallel-rank).\n"
                       "# TYPE engine_sim_dp_rank_requests_total counter\n");
    for (uint32_t k = 0; k < cfg->dp_size && k < SIM_DP_MAX; k++)
        px_buf_printf(&b, "engine_sim_dp_rank_requests_total{rank=\"%u\"} %llu\n", k,
                      (unsigned long long)e->dp_requests[k]);
#undef GAUGE
#undef COUNTER
    px_conn_reply(c, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, NULL, b.data, b.len);
    px_buf_cleanup(&b);
}

static void dispatch(void *ctx, px_conn *c, const px_http_head *h, px_buf *body) {
    sim_engine *e = ctx;
    int is_get = h->method_len == 3 && !memcmp(h->method, "GET", 3);
    int is_post = h->method_len == 4 && !memcmp(h->method, "POST", 4);
    static const struct {
        const char *path;
        sim_ep ep;
    } gen[] = {{"/v1/completions", EP_COMPLETIONS},
               {"/v1/chat/completions", EP_CHAT},
               {"/v1/responses", EP_RESPONSES},
               {"/inference/v1/generate", EP_GENERATE}};
    for (size_t i = 0; i < sizeof gen / sizeof gen[0]; i++)
        if (px_http_path_is(h, gen[i].path)) {
            if (!is_post) {
                px_conn_reply_error(c, 405, NULL, "Allow: POST\r\n", "method not allowed");
                return;
            }
            handle_completion(e, c, gen[i].ep, h, body);
            return;
        }
    if (px_http_path_is(h, "/tokenize") || px_http_path_is(h, "/reset_prefix_cache")) {
        if (!is_post) {
            px_conn_reply_error(c, 405, NULL, "Allow: POST\r\n", "method not allowed");
        } else if (px_http_path_is(h, "/tokenize")) {
            sim_handle_tokenize(e, c, h, body);
        } else {
            sim_engine_reset_prefix(e); /* vLLM answers 200 with no body */
            px_conn_reply(c, 200, "text/plain", NULL, NULL, "", 0);
        }
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
    if (sim_engine_setup_prefix(e) < 0 || sim_engine_setup_links(e) < 0 ||
        sim_engine_setup_agent(e) < 0 || setup_listener(e) < 0)
        goto out;
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
    sim_engine_free_prefix(e);
    sim_links_free(e->links);
    free(e);
    return rc;
}
