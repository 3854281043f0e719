/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/scrape.h"

#include <dirent.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "base/client.h"
#include "base/logsink.h"
#include "proxy/admission.h"
#include "proxy/discovery.h"
#include "proxy/dp.h"
#include "proxy/kvindex.h"
#include "proxy/latency.h"
#include "proxy/otlp.h"
#include "proxy/slo.h"

static const char *const phase_names[PX_PHASE_COUNT] = {"prefill", "decode", "stream"};

static unsigned long long ld(const atomic_ullong *c) {
    return atomic_load_explicit(c, memory_order_relaxed);
}

/* One histogram series, every worker's summed; `label` (`k="v"`) or NULL. */
static void hist_series(px_buf *o, px_ctx *ctx, const char *name, const char *label,
                        size_t offset) {
    unsigned long long b[PX_HIST_BUCKETS] = {0}, count = 0, sum = 0;
    for (int w = 0; w < ctx->nworkers; w++) {
        const px_hist *h = (const px_hist *)((const char *)&ctx->workers[w]->metrics + offset);
        for (int i = 0; i < PX_HIST_BUCKETS; i++)
            b[i] += ld(&h->bucket[i]);
        count += ld(&h->count);
        sum += ld(&h->sum_us);
    }
    const char *sep = label ? "," : "";
    label = label ? label : "";
    unsigned long long cum = 0;
    for (int i = 0; i < PX_HIST_BUCKETS; i++) {
        cum += b[i];
        px_buf_printf(o, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, label, sep, px_hist_bounds[i],
                      cum);
    }
    px_buf_printf(o, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, label, sep, count);
    if (label[0])
        px_buf_printf(o, "%s_sum{%s} %.6f\n%s_count{%s} %llu\n", name, label, (double)sum / 1e6,
                      name, label, count);
    else
        px_buf_printf(o, "%s_sum %.6f\n%s_count %llu\n", name, (double)sum / 1e6, name, count);
}

static void render_hist(px_buf *o, px_ctx *ctx, const char *name, const char *help, size_t offset) {
    px_buf_printf(o, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    hist_series(o, ctx, name, NULL, offset);
}

/* Sums one counter (at `offset` in px_metrics) over every worker. */
static unsigned long long sum_at(px_ctx *ctx, size_t offset) {
    unsigned long long t = 0;
    for (int w = 0; w < ctx->nworkers; w++)
        t += ld((const atomic_ullong *)((const char *)&ctx->workers[w]->metrics + offset));
    return t;
}

#define SUM(field) sum_at(ctx, offsetof(px_metrics, field))

static void counter(px_buf *o, const char *name, const char *help, unsigned long long v) {
    px_buf_printf(o, "# HELP %s %s\n# TYPE %s counter\n%s %llu\n", name, help, name, name, v);
}

/* Label values are backend names and fixed words: escape what the format asks. */
static void label_value(px_buf *o, const char *v) {
    for (; *v; v++) {
        if (*v == '\\' || *v == '"') px_buf_append(o, "\\", 1);
        if (*v == '\n') {
            px_buf_appends(o, "\\n");
            continue;
        }
        px_buf_append(o, v, 1);
    }
}

/* The pool label, when the pools are named (the unnamed pool's metrics
 * keep the labels they always had). */
static void pool_label(px_buf *o, const px_gen *g, size_t p) {
    if (!g->named) return;
    px_buf_appends(o, "pool=\"");
    label_value(o, g->ps[p].name);
    px_buf_appends(o, "\",");
}

/* Starts a backend's sample: name{pool="…",role="…",backend="…", left open
 * after the backend's closing quote for more labels or the value. */
static void backend_series(px_buf *o, const char *name, const px_gen *g, size_t pool,
                           const char *role, const char *backend) {
    px_buf_appends(o, name);
    px_buf_appends(o, "{");
    pool_label(o, g, pool);
    px_buf_printf(o, "role=\"%s\",backend=\"", role);
    label_value(o, backend);
}

static void render_backends(px_buf *o, px_ctx *ctx) {
    px_gen *g = px_ctx_gen(ctx);
    size_t np = 2 * g->nps;
    px_pool **pools = px_xcalloc(np ? np : 1, sizeof *pools);
    size_t *n = px_xcalloc(np ? np : 1, sizeof *n);
    px_backend ***m = px_xcalloc(np ? np : 1, sizeof *m);
    for (size_t r = 0; r < np; r++) {
        pools[r] = r % 2 ? &g->ps[r / 2].decode : &g->ps[r / 2].prefill;
        m[r] = px_pool_members(pools[r], &n[r]);
    }

    px_buf_appends(o, "# HELP pdproxy_backend_up Whether a backend receives traffic (1) or is "
                      "ejected (0).\n# TYPE pdproxy_backend_up gauge\n");
    for (size_t r = 0; r < np; r++)
        for (size_t i = 0; i < n[r]; i++) {
            backend_series(o, "pdproxy_backend_up", g, r / 2, pools[r]->role, m[r][i]->name);
            px_buf_printf(o, "\"} %d\n",
                          atomic_load(&m[r][i]->healthy) && !atomic_load(&m[r][i]->drained) ? 1
                                                                                            : 0);
        }
    px_buf_appends(o, "# HELP pdproxy_backend_inflight Requests in flight to a backend.\n"
                      "# TYPE pdproxy_backend_inflight gauge\n");
    for (size_t r = 0; r < np; r++)
        for (size_t i = 0; i < n[r]; i++) {
            backend_series(o, "pdproxy_backend_inflight", g, r / 2, pools[r]->role, m[r][i]->name);
            px_buf_printf(o, "\"} %d\n", atomic_load(&m[r][i]->inflight));
        }
    px_buf_appends(o, "# HELP pdproxy_upstream_requests_total Requests sent to backends, by "
                      "outcome.\n# TYPE pdproxy_upstream_requests_total counter\n");
    for (size_t r = 0; r < np; r++)
        for (size_t i = 0; i < n[r]; i++)
            for (int k = 0; k < PX_OUT_COUNT; k++) {
                unsigned long long v = ld(&m[r][i]->outcomes[k]);
                if (!v && k != PX_OUT_OK) continue;
                backend_series(o, "pdproxy_upstream_requests_total", g, r / 2, pools[r]->role,
                               m[r][i]->name);
                px_buf_printf(o, "\",outcome=\"%s\"} %llu\n", px_outcome_name((px_outcome)k), v);
            }
    {
        static const char *const kvg[2][2] = {
            {"pdproxy_kv_index_blocks", "KV blocks the index holds for the backend (from its "
                                        "KV-cache events)."},
            {"pdproxy_kv_index_bytes", "Memory of the backend's KV index tables."}};
        for (int q = 0; q < 2; q++) {
            px_buf_printf(o, "# HELP %s %s\n# TYPE %s gauge\n", kvg[q][0], kvg[q][1], kvg[q][0]);
            for (size_t r = 0; r < np; r++)
                for (size_t i = 0; i < n[r]; i++) {
                    px_kvindex_stats st = {0};
                    if (ctx->kvindex) /* without --kv-events-port: 0 */
                        px_kvindex_stats_get(ctx->kvindex,
                                             px_kvindex_slot(ctx->kvindex, m[r][i]->name, 0),
                                             &st);
                    backend_series(o, kvg[q][0], g, r / 2, pools[r]->role, m[r][i]->name);
                    px_buf_printf(o, "\"} %zu\n", q ? st.bytes : st.blocks);
                }
        }
    }
    px_buf_appends(o, "# HELP pdproxy_panic_routed_total Requests routed to an ejected backend "
                      "because every backend of the role was ejected for request failures.\n"
                      "# TYPE pdproxy_panic_routed_total counter\n");
    for (size_t r = 0; r < np; r++) {
        px_buf_appends(o, "pdproxy_panic_routed_total{");
        pool_label(o, g, r / 2);
        px_buf_printf(o, "role=\"%s\"} %llu\n", pools[r]->role,
                      (unsigned long long)atomic_load(&pools[r]->panic_routed));
    }
    px_buf_printf(o,
                  "# HELP pdproxy_config_generation Configuration generation serving new "
                  "requests (1 at start, one more per reload).\n"
                  "# TYPE pdproxy_config_generation gauge\npdproxy_config_generation %llu\n",
                  (unsigned long long)g->id);
    px_buf_printf(o,
                  "# HELP pdproxy_config_reloads_total Reloads of the --config file (SIGHUP, POST "
                  "/admin/reload) by result; a failed one leaves the running configuration.\n"
                  "# TYPE pdproxy_config_reloads_total counter\n"
                  "pdproxy_config_reloads_total{result=\"ok\"} %llu\n"
                  "pdproxy_config_reloads_total{result=\"failed\"} %llu\n"
                  "# HELP pdproxy_config_last_reload_successful 0 when the last reload of the "
                  "--config file failed, else 1.\n"
                  "# TYPE pdproxy_config_last_reload_successful gauge\n"
                  "pdproxy_config_last_reload_successful %d\n",
                  ld(&ctx->reloads_ok), ld(&ctx->reloads_failed),
                  !atomic_load(&ctx->last_reload_failed));
    for (size_t r = 0; r < np; r++) {
        for (size_t i = 0; i < n[r]; i++)
            px_backend_release(m[r][i]);
        free(m[r]);
    }
    free(m);
    free(n);
    free(pools);
    px_gen_release(g);
}

/* Start of this process in seconds since the epoch: its start in clock
 * ticks after boot (/proc/self/stat, field 22) plus the boot time. Read
 * once (workers render /metrics at the same time). */
static double start_s;

static void read_start_time(void) {
    char buf[1024];
    FILE *f = fopen("/proc/self/stat", "r");
    if (!f) return;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    /* Fields after the command name, which may hold spaces and ')'. */
    char *p = strrchr(buf, ')');
    if (!p) return;
    unsigned long long ticks = 0;
    int field = 2;
    char *save = NULL;
    for (char *tok = strtok_r(p + 1, " ", &save); tok; tok = strtok_r(NULL, " ", &save))
        if (++field == 22) {
            ticks = strtoull(tok, NULL, 10);
            break;
        }
    unsigned long long btime = 0;
    f = fopen("/proc/stat", "r");
    if (!f) return;
    char line[256];
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "btime %llu", &btime) == 1) break;
    fclose(f);
    long hz = sysconf(_SC_CLK_TCK);
    if (btime && hz > 0) start_s = (double)btime + (double)ticks / (double)hz;
}

static double start_time(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, read_start_time);
    return start_s;
}

static void render_process(px_buf *o) {
    long page = sysconf(_SC_PAGESIZE);
    unsigned long vsz = 0, rss = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f) {
        if (fscanf(f, "%lu %lu", &vsz, &rss) != 2) vsz = rss = 0;
        fclose(f);
    }
    int fds = 0;
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)))
            if (e->d_name[0] != '.') fds++;
        closedir(d);
        fds--; /* the directory's own fd */
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
                 (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    px_buf_printf(o,
                  "# HELP process_resident_memory_bytes Resident memory size in bytes.\n"
                  "# TYPE process_resident_memory_bytes gauge\n"
                  "process_resident_memory_bytes %lu\n"
                  "# HELP process_virtual_memory_bytes Virtual memory size in bytes.\n"
                  "# TYPE process_virtual_memory_bytes gauge\n"
                  "process_virtual_memory_bytes %lu\n"
                  "# HELP process_open_fds Number of open file descriptors.\n"
                  "# TYPE process_open_fds gauge\n"
                  "process_open_fds %d\n"
                  "# HELP process_max_fds Maximum number of open file descriptors.\n"
                  "# TYPE process_max_fds gauge\n"
                  "process_max_fds %llu\n"
                  "# HELP process_cpu_seconds_total Total user and system CPU time in seconds.\n"
                  "# TYPE process_cpu_seconds_total counter\n"
                  "process_cpu_seconds_total %.3f\n"
                  "# HELP process_start_time_seconds Start time of the process since the Unix "
                  "epoch in seconds.\n"
                  "# TYPE process_start_time_seconds gauge\n"
                  "process_start_time_seconds %.2f\n",
                  rss * (unsigned long)page, vsz * (unsigned long)page, fds,
                  (unsigned long long)rl.rlim_cur, cpu, start_time());
}

/* Limits that hold memory and connections, and what routing did when every
 * backend of a role was out. */
static void render_limits(px_buf *o, px_ctx *ctx) {
    px_conn_shared *sh = &ctx->shared;
    pthread_mutex_lock(&ctx->gen_mu);
    uint64_t failures = px_discovery_failures(ctx->gen->disc);
    size_t unresolved = px_discovery_unresolved(ctx->gen->disc);
    pthread_mutex_unlock(&ctx->gen_mu);
    px_buf_printf(o,
                  "# HELP pdproxy_buffered_bytes Request bodies held and client output queued, "
                  "in bytes (bounded by --max-buffered-bytes).\n"
                  "# TYPE pdproxy_buffered_bytes gauge\npdproxy_buffered_bytes %lld\n"
                  "# HELP pdproxy_buffered_bytes_limit The --max-buffered-bytes budget (0: none).\n"
                  "# TYPE pdproxy_buffered_bytes_limit gauge\npdproxy_buffered_bytes_limit %lld\n"
                  "# HELP pdproxy_client_connections Client connections open.\n"
                  "# TYPE pdproxy_client_connections gauge\npdproxy_client_connections %ld\n",
                  (long long)atomic_load(&sh->buffered), (long long)sh->max_buffered,
                  (long)atomic_load(&sh->conns));
    counter(o, "pdproxy_buffer_budget_rejected_total",
            "Request bodies refused with 503 because --max-buffered-bytes was spent.",
            (unsigned long long)atomic_load(&sh->budget_rejected));
    counter(o, "pdproxy_connections_refused_total",
            "Connections answered 503 and closed past --max-connections.",
            (unsigned long long)atomic_load(&sh->conns_refused));
    counter(o, "pdproxy_log_lines_dropped_total",
            "Log lines dropped because the log's sink (a pipe whose reader stalled) did not "
            "take them; the proxy never waits for it.",
            (unsigned long long)px_logsink_dropped());
    counter(o, "pdproxy_send_timeouts_total",
            "Client connections closed because the client read nothing for --send-timeout.",
            (unsigned long long)atomic_load(&sh->send_timeouts));
    counter(o, "pdproxy_dns_resolution_failures_total",
            "Resolutions of backend names that failed (the last addresses are kept).",
            (unsigned long long)failures);
    px_buf_printf(o,
                  "# HELP pdproxy_backend_names_unresolved Backend names whose last resolution "
                  "failed.\n# TYPE pdproxy_backend_names_unresolved gauge\n"
                  "pdproxy_backend_names_unresolved %zu\n",
                  unresolved);
}

void px_scrape_render(px_ctx *ctx, px_buf *o) {
    px_buf_appends(o, "# HELP pdproxy_requests_total Client requests answered, by endpoint and "
                      "status code.\n# TYPE pdproxy_requests_total counter\n");
    for (int e = 0; e < PX_EP_COUNT; e++)
        for (int c = 0; c < 500; c++) {
            unsigned long long v = 0;
            for (int w = 0; w < ctx->nworkers; w++)
                v += ld(&ctx->workers[w]->metrics.requests[e][c]);
            if (v)
                px_buf_printf(o, "pdproxy_requests_total{endpoint=\"%s\",code=\"%d\"} %llu\n",
                              px_endpoints[e].name, c + 100, v);
        }
    render_hist(o, ctx, "pdproxy_request_duration_seconds",
                "Time from a request's arrival to the end of its answer.",
                offsetof(px_metrics, duration));
    /* Split by stream: for a streamed answer the first byte is the first
     * token; for a whole answer it is nearly the end, and mixing the two
     * would make neither readable. */
    px_buf_appends(o, "# HELP pdproxy_time_to_first_byte_seconds Time from a request's arrival "
                      "to the first byte of decode's answer; stream=\"true\": streamed (SSE) "
                      "answers, where it is the time to first token.\n"
                      "# TYPE pdproxy_time_to_first_byte_seconds histogram\n");
    hist_series(o, ctx, "pdproxy_time_to_first_byte_seconds", "stream=\"false\"",
                offsetof(px_metrics, ttfb[0]));
    hist_series(o, ctx, "pdproxy_time_to_first_byte_seconds", "stream=\"true\"",
                offsetof(px_metrics, ttfb[1]));
    render_hist(o, ctx, "pdproxy_prefill_duration_seconds",
                "Time the prefill request took, retries included.", offsetof(px_metrics, prefill));
    {
        const px_kv_counters *k = &ctx->kvc; /* 0 without --kv-events-port */
        counter(o, "pdproxy_kv_event_batches_total", "KV-event batches applied to the index.",
                ld(&k->batches));
        counter(o, "pdproxy_kv_events_total", "KV-cache events applied to the index.",
                ld(&k->events));
        counter(o, "pdproxy_kv_events_malformed_total",
                "KV-event messages or events refused as malformed.", ld(&k->malformed));
        counter(o, "pdproxy_kv_event_gaps_total", "Sequence gaps in a backend's KV events.",
                ld(&k->gaps));
        counter(o, "pdproxy_kv_event_replays_total",
                "Replays of missed KV-event batches asked of a backend.", ld(&k->replays));
        counter(o, "pdproxy_kv_event_replay_failures_total",
                "Replays that timed out or could not fill their gap.", ld(&k->replay_fail));
        counter(o, "pdproxy_kv_index_resets_total",
                "Backend KV indexes dropped (gap not replayed, restarted engine, ejected or "
                "removed backend).",
                ld(&k->resets));
        counter(o, "pdproxy_kv_index_refused_blocks_total",
                "KV blocks not indexed because the backend's index was full "
                "(--kv-index-max-blocks) or all indexes together were "
                "(--kv-index-max-bytes).",
                ld(&k->refused));
        px_kvindex_stats t = {0};
        if (ctx->kvindex) px_kvindex_totals(ctx->kvindex, &t);
        px_buf_printf(o,
                      "# HELP pdproxy_kv_index_total_blocks KV blocks indexed over all "
                      "backends.\n# TYPE pdproxy_kv_index_total_blocks gauge\n"
                      "pdproxy_kv_index_total_blocks %zu\n"
                      "# HELP pdproxy_kv_index_total_bytes Memory of all backends' KV index "
                      "tables (bounded by --kv-index-max-bytes).\n"
                      "# TYPE pdproxy_kv_index_total_bytes gauge\n"
                      "pdproxy_kv_index_total_bytes %zu\n",
                      t.blocks, t.bytes);
    }
    px_buf_appends(o, "# HELP pdproxy_tokenize_total Prompts' exact tokens, by how they were had "
                      "(timeout, error: the byte estimate was used).\n"
                      "# TYPE pdproxy_tokenize_total counter\n");
    for (int t = 0; t < PX_TOK_COUNT; t++)
        px_buf_printf(o, "pdproxy_tokenize_total{result=\"%s\"} %llu\n", px_tokresult_names[t],
                      SUM(tokenize[t]));
    counter(o, "pdproxy_kv_transfer_params_missing_total",
            "Prefill answers without kv_transfer_params (decode recomputed the prefill).",
            SUM(kvp_missing));
    counter(o, "pdproxy_remote_request_id_missing_total",
            "kv_transfer_params without remote_request_id (decode cannot release the blocks).",
            SUM(rrid_missing));
    px_dp_render(ctx->reg->dp, o);
    px_buf_appends(o, "# HELP pdproxy_client_disconnects_total Clients that left before their "
                      "answer ended, by phase.\n# TYPE pdproxy_client_disconnects_total counter\n");
    for (int p = 0; p < PX_PHASE_COUNT; p++)
        px_buf_printf(o, "pdproxy_client_disconnects_total{phase=\"%s\"} %llu\n", phase_names[p],
                      SUM(disconnects[p]));
    px_buf_appends(o, "# HELP pdproxy_retries_total Upstream requests retried on another "
                      "instance.\n# TYPE pdproxy_retries_total counter\n");
    px_buf_printf(o, "pdproxy_retries_total{role=\"prefill\"} %llu\n", SUM(retries[0]));
    px_buf_printf(o, "pdproxy_retries_total{role=\"decode\"} %llu\n", SUM(retries[1]));
    unsigned long long mism, early;
    px_client_answer_counts(&mism, &early);
    px_buf_appends(o, "# HELP pdproxy_upstream_answers_refused_total Engine answers that named "
                      "another request than the one sent (a late extra answer), by where "
                      "that showed: the X-Request-Id echoed, or prefill's remote_request_id.\n"
                      "# TYPE pdproxy_upstream_answers_refused_total counter\n");
    px_buf_printf(o, "pdproxy_upstream_answers_refused_total{reason=\"request_id\"} %llu\n", mism);
    px_buf_printf(o, "pdproxy_upstream_answers_refused_total{reason=\"remote_request_id\"} %llu\n",
                  SUM(answers_foreign));
    counter(o, "pdproxy_upstream_early_answers_total",
            "Upstream connections closed, not reused, because an answer began before the "
            "request was written whole.",
            early);
    counter(o, "pdproxy_stranded_blocks_released_total",
            "Requests whose client left after prefill answered: decode was sent the request and "
            "aborted so that prefill frees the blocks at once.",
            SUM(stranded_released));
    px_buf_appends(o, "# HELP pdproxy_disagg_decisions_total Requests by how they were sent: "
                      "disaggregated (prefill then decode) or decode_only, and why.\n"
                      "# TYPE pdproxy_disagg_decisions_total counter\n");
    for (int d = 0; d < PX_DEC_COUNT; d++)
        px_buf_printf(
            o, "pdproxy_disagg_decisions_total{decision=\"%s\",reason=\"%s\"} %llu\n",
            px_decision_name((px_decision)d), px_decision_reason((px_decision)d),
            sum_at(ctx, offsetof(px_metrics, decisions) + (size_t)d * sizeof(atomic_ullong)));
    px_buf_appends(o, "# HELP pdproxy_decode_only_fallbacks_total Requests sent to decode alone "
                      "(--fallback-decode-only) because prefill could not serve them.\n"
                      "# TYPE pdproxy_decode_only_fallbacks_total counter\n");
    for (int f = 0; f < PX_FB_COUNT; f++)
        px_buf_printf(
            o, "pdproxy_decode_only_fallbacks_total{reason=\"%s\"} %llu\n",
            px_fallback_name((px_fallback)f),
            sum_at(ctx, offsetof(px_metrics, fallbacks) + (size_t)f * sizeof(atomic_ullong)));
    px_buf_appends(o, "# HELP pdproxy_dispatch_total Disaggregated requests by how their "
                      "legs were sent (--dispatch): serial or concurrent, and why.\n"
                      "# TYPE pdproxy_dispatch_total counter\n");
    for (int k = 0; k < PX_DISP_COUNT; k++)
        px_buf_printf(
            o, "pdproxy_dispatch_total{mode=\"%s\",reason=\"%s\"} %llu\n",
            px_dispatch_kind_mode((px_dispatch_kind)k), px_dispatch_kind_reason((px_dispatch_kind)k),
            sum_at(ctx, offsetof(px_metrics, dispatch) + (size_t)k * sizeof(atomic_ullong)));
    render_hist(o, ctx, "pdproxy_decode_kv_wait_seconds",
                "How long decode waited for prefill's KV, as it reports in X-KV-Wait-Ms.",
                offsetof(px_metrics, kv_wait));
    px_buf_appends(o, "# HELP pdproxy_admission_total Admission control events: requests "
                      "queued for a saturated pool, dispatched, refused (queue full, deadline, "
                      "rate limits) or left; engines that answered 429/503; workers woken by another "
                      "worker that freed a pool slot.\n"
                      "# TYPE pdproxy_admission_total counter\n");
    for (int e = 0; e < PX_ADM_M_COUNT; e++)
        px_buf_printf(o, "pdproxy_admission_total{event=\"%s\"} %llu\n",
                      px_adm_event_name((px_adm_event)e),
                      sum_at(ctx, offsetof(px_metrics, adm) + (size_t)e * sizeof(atomic_ullong)));
    render_hist(o, ctx, "pdproxy_queue_wait_seconds",
                "Time requests waited in the admission queue before leaving it.",
                offsetof(px_metrics, queue_wait));
    px_adm_render_metrics(ctx, o);
    px_slo_render_metrics(ctx->slo, o);
    px_lat_render_metrics(ctx->lat, o);
    unsigned long long inflight = (unsigned long long)atomic_load(&ctx->inflight);
    px_buf_printf(o,
                  "# HELP pdproxy_inflight_requests Client requests in flight.\n"
                  "# TYPE pdproxy_inflight_requests gauge\npdproxy_inflight_requests %llu\n",
                  inflight);
    render_backends(o, ctx);
    px_otlp_stats ts;
    px_otlp_get_stats(&ts);
    counter(o, "pdproxy_trace_spans_exported_total",
            "Spans the OTLP collector accepted (0 when export is off).", ts.exported);
    px_buf_printf(o,
                  "# HELP pdproxy_trace_spans_dropped_total Spans not exported: queue_full (the "
                  "collector is slower than the traffic), export_failed (it refused or did not "
                  "answer).\n# TYPE pdproxy_trace_spans_dropped_total counter\n"
                  "pdproxy_trace_spans_dropped_total{reason=\"queue_full\"} %llu\n"
                  "pdproxy_trace_spans_dropped_total{reason=\"export_failed\"} %llu\n"
                  "# HELP pdproxy_trace_spans_queued Spans waiting for export.\n"
                  "# TYPE pdproxy_trace_spans_queued gauge\npdproxy_trace_spans_queued %llu\n",
                  ts.dropped_full, ts.dropped_error, ts.queued);
    px_buf_appends(o, "# HELP pdproxy_build_info The running build: version and source commit.\n"
                      "# TYPE pdproxy_build_info gauge\n");
    px_buf_printf(o, "pdproxy_build_info{version=\"%s\",commit=\"%s\"} 1\n", PDPROXY_VERSION,
                  PDPROXY_COMMIT);
    render_process(o);
    render_limits(o, ctx);
}
