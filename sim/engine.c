/* SPDX-License-Identifier: Apache-2.0 */
#include "sim/engine_int.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <event2/event.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "base/conn.h"
#include "base/hash.h"
#include "base/http.h"
#include "base/list.h"
#include "base/log.h"
#include "base/util.h"
#include "include/kvconnector.h"
#include "sim/kvsim.h"
#include "sim/link.h"
#include "sim/sim_request.h"

static void pump_queue(sim_engine *e);
static void pump_seqs(sim_engine *e);
static void start_generation(sim_req *r);

/* ---------------------------------------------------------------- pool -- */

static int take_blocks(sim_engine *e, sim_req *r) {
    if (e->nfree < r->nblocks) return -1;
    r->blocks = px_xmalloc((r->nblocks ? r->nblocks : 1) * sizeof *r->blocks);
    for (size_t i = 0; i < r->nblocks; i++)
        r->blocks[i] = e->free_blocks[--e->nfree];
    r->holds_blocks = 1;
    return 0;
}

static void give_blocks(sim_engine *e, const uint64_t *ids, size_t n) {
    for (size_t i = 0; i < n; i++)
        e->free_blocks[e->nfree++] = ids[i];
}

static void release_req_blocks(sim_req *r) {
    if (r->holds_blocks) {
        give_blocks(r->e, r->blocks, r->nblocks);
        r->holds_blocks = 0;
    }
}

static unsigned char *block_addr(sim_engine *e, uint32_t region, uint64_t block) {
    void *base = NULL;
    kvc_region_base(e->agent, region, &base);
    return (unsigned char *)base + block * e->cfg->block_bytes;
}

/* Block b's prefix hash (one pass over the prompt for all its blocks). */
static uint64_t prefix_hash(sim_req *r, size_t b) {
    if (!r->ph) {
        size_t bt = r->e->cfg->block_tokens, n = (r->ntok + bt - 1) / bt;
        if (n < r->nblocks) n = r->nblocks;
        r->ph = px_xmalloc((n ? n : 1) * sizeof *r->ph);
        kvsim_prefix_hashes(r->e->model_hash, r->tok, r->ntok, bt, r->ph, n);
    }
    return r->ph[b];
}

/* Writes layers [l0, l1) of r's blocks (what its forward pass computes). */
static void compute_layers(sim_req *r, uint32_t l0, uint32_t l1) {
    sim_engine *e = r->e;
    for (size_t b = 0; b < r->nblocks; b++) {
        uint64_t ph = prefix_hash(r, b);
        for (uint32_t l = l0; l < l1; l++)
            for (uint32_t kv = 0; kv < 2; kv++)
                kvsim_fill_block(ph, l, kv, block_addr(e, l * 2 + kv, r->blocks[b]),
                                 e->cfg->block_bytes);
    }
}

static void compute_blocks(sim_req *r) {
    compute_layers(r, 0, r->e->cfg->layers);
}

/* ------------------------------------------------------ prefix cache -- */

/* Like vLLM's prefix caching: only whole blocks count, and never the whole
 * prompt (its last token is always computed). Returns the cached tokens. */
static size_t cache_lookup(sim_engine *e, sim_req *r) {
    size_t bt = e->cfg->block_tokens, full = (r->ntok - 1) / bt;
    prefix_hash(r, 0); /* fills r->ph */
    return sim_prefix_match(e->prefix, r->ph, full) * bt;
}

/* Caches the prompt's whole blocks and publishes what changed as one
 * batch, as vLLM does once per scheduler step. */
static void cache_insert(sim_engine *e, sim_req *r) {
    size_t bt = e->cfg->block_tokens;
    prefix_hash(r, 0);
    sim_prefix_insert(e->prefix, r->ph, r->tok, r->ntok / bt);
    sim_kvev_flush(e->kvev);
}

/* Queues the computation of `tokens` prompt tokens behind every prompt
 * queued before (one engine computes one prompt at a time) and returns
 * the microseconds until it is done. */
static uint64_t compute(sim_engine *e, size_t tokens) {
    uint64_t now = px_now_ns();
    uint64_t start = e->busy_until_ns > now ? e->busy_until_ns : now;
    e->computes++;
    e->compute_wait_ns += start - now; /* 0 on an idle engine */
    e->busy_until_ns = start + (uint64_t)tokens * e->cfg->prefill_us_per_token * 1000u;
    e->tokens_computed += tokens;
    return (e->busy_until_ns - now) / 1000u;
}

/* A prompt this engine computes itself: its cached prefix is skipped. */
static void compute_prompt(sim_req *r) {
    sim_engine *e = r->e;
    r->cached = cache_lookup(e, r);
    e->tokens_cached += r->cached;
    e->prefix_queries += r->ntok;
    e->prefix_hits += r->cached;
    e->prompt_tokens += r->ntok;
    r->compute_us = compute(e, r->ntok - r->cached);
    cache_insert(e, r);
}

/* Returns the number of (block, region) pieces whose bytes are wrong. */
static uint64_t verify_blocks(sim_req *r) {
    sim_engine *e = r->e;
    unsigned char *want = px_xmalloc(e->cfg->block_bytes);
    uint64_t bad = 0;
    for (size_t b = 0; b < r->nblocks; b++) {
        uint64_t ph = prefix_hash(r, b);
        for (uint32_t l = 0; l < e->cfg->layers; l++)
            for (uint32_t kv = 0; kv < 2; kv++) {
                kvsim_fill_block(ph, l, kv, want, e->cfg->block_bytes);
                if (memcmp(want, block_addr(e, l * 2 + kv, r->blocks[b]), e->cfg->block_bytes))
                    bad++;
            }
    }
    free(want);
    return bad;
}

/* ------------------------------------------------------------ requests -- */

static void req_free(sim_req *r) {
    sim_engine *e = r->e;
    release_req_blocks(r);
    PX_LIST_UNLINK(e->reqs, r);
    if (r->timer) event_free(r->timer);
    kvc_free(r->pub_json);
    cJSON_Delete(r->kvp);
    free(r->prev_id);
    free(r->tok);
    free(r->blocks);
    free(r->ph);
    px_buf_cleanup(&r->text);
    free(r);
}

/* The request is over (answered, failed or abandoned). */
static void req_finish(sim_req *r) {
    sim_engine *e = r->e;
    if (r->state == SR_GENERATING || r->state == SR_PREFILL_WAIT || r->state == SR_FETCHING ||
        r->state == SR_SEQ_WAIT) {
        e->nrunning--;
        e->dp_running[r->dp_rank]--;
    }
    int had_seq = r->has_seq;
    if (had_seq) e->ngen--;
    req_free(r);
    pump_queue(e);
    if (had_seq) pump_seqs(e);
}

static void req_error(sim_req *r, int status, const char *msg) {
    PX_LOG(PX_LOG_WARN, "req=%s msg=\"%s\" status=%d", r->internal_id, msg, status);
    if (r->conn) {
        px_conn_reply_error(r->conn, status, r->xrid, NULL, msg);
        r->conn = NULL;
    }
    req_finish(r);
}

/* Tells the producer to free the blocks at once: a fetch of zero blocks is
 * a bare notification, what vLLM's decode sends for an aborted request. */
static void notify_only(sim_engine *e, cJSON *kvp) {
    char *json = cJSON_PrintUnformatted(kvp);
    if (!json) return;
    kvc_fetch_params_t fp = {.field_mask = KVC_FETCH_FIELD_JSON | KVC_FETCH_FIELD_LOCAL_BLOCKS,
                             .kv_transfer_params_json = json,
                             .local_block_ids = NULL,
                             .num_local_blocks = 0};
    uint64_t xid;
    kvc_status_t st = kvc_fetch(e->agent, &fp, &xid);
    if (st != KVC_INPROGRESS && st != KVC_OK)
        PX_LOG(PX_LOG_WARN, "msg=\"cannot notify prefill\" status=%s", kvc_status_str(st));
    free(json);
}

static void on_client_gone(void *arg) {
    sim_req *r = arg;
    sim_engine *e = r->e;
    r->conn = NULL;
    switch (r->state) {
    case SR_QUEUED: {
        sim_req **pp = &e->qhead, *prev = NULL;
        while (*pp && *pp != r) {
            prev = *pp;
            pp = &(*pp)->qnext;
        }
        if (*pp) {
            *pp = r->qnext;
            if (e->qtail == r) e->qtail = prev;
            e->nqueued--;
            e->dp_waiting[r->dp_rank]--;
        }
        if (r->mode == SIM_MODE_DECODE) notify_only(e, r->kvp);
        req_free(r);
        return;
    }
    case SR_FETCHING:
        if (!r->fetching) { /* its bytes are crossing a --kv-peer-cost link */
            req_finish(r);
            return;
        }
        r->orphan = 1; /* freed when the fetch reports back */
        return;
    case SR_SEQ_WAIT: {
        sim_req **pp = &e->shead, *prev = NULL;
        while (*pp && *pp != r) {
            prev = *pp;
            pp = &(*pp)->qnext;
        }
        if (*pp) {
            *pp = r->qnext;
            if (e->stail == r) e->stail = prev;
        }
        req_finish(r);
        return;
    }
    default:
        req_finish(r);
        return;
    }
}

static const px_exchange_cbs client_cbs = {on_client_gone, NULL};

/* ---------------------------------------------------------- responses -- */

/* The data-parallel rank the request named, echoed in every answer (so a
 * test sees which engine core served it); NULL without one. */
static const char *dp_header(const sim_req *r) {
    return r->dp_hdr[0] ? r->dp_hdr : NULL;
}

/* As vLLM with --enable-prompt-tokens-details: under P/D, decode counts
 * the prompt it received from prefill as cached (all but its last token). */
static void append_usage(px_buf *b, sim_req *r) {
    px_buf_printf(b,
                  "\"usage\":{\"prompt_tokens\":%zu,\"completion_tokens\":%zu,\"total_tokens\":%zu,"
                  "\"prompt_tokens_details\":{\"cached_tokens\":%zu}}",
                  r->ntok, r->emitted, r->ntok + r->emitted, r->cached);
}

static void chunk_head(px_buf *b, sim_req *r) {
    px_buf_appends(b, "data: {\"id\":");
    px_buf_append_json_str(b, r->resp_id, strlen(r->resp_id));
    px_buf_printf(b, ",\"object\":\"%s\",\"created\":%ld,\"model\":%s,",
                  r->ep == EP_CHAT ? "chat.completion.chunk" : "text_completion", r->created,
                  r->e->model_json);
}

static void send_sse(sim_req *r, px_buf *b) {
    px_conn_stream_write(r->conn, b->data, b->len);
    px_buf_reset(b);
}

/* A generated word as a token id: /inference/v1/generate answers ids. */
static uint32_t word_id(const char *w, size_t wl) {
    return (uint32_t)(px_hash64(w, wl) % 50000u);
}

/* vLLM's ResponsesResponse for `text`, without its closing brace. */
static void append_response(px_buf *b, sim_req *r, const char *text, size_t tlen,
                            const char *status) {
    px_buf_appends(b, "{\"id\":");
    px_buf_append_json_str(b, r->resp_id, strlen(r->resp_id));
    px_buf_printf(b, ",\"object\":\"response\",\"created_at\":%ld,\"model\":%s,\"status\":\"%s\","
                     "\"output\":[{\"id\":\"msg_",
                  r->created, r->e->model_json, status);
    px_buf_appends(b, r->internal_id);
    px_buf_appends(b, "\",\"type\":\"message\",\"role\":\"assistant\",\"status\":\"completed\","
                      "\"content\":[{\"type\":\"output_text\",\"text\":");
    px_buf_append_json_str(b, text, tlen);
    px_buf_appends(b, ",\"annotations\":[]}]}],\"previous_response_id\":");
    if (r->prev_id)
        px_buf_append_json_str(b, r->prev_id, strlen(r->prev_id));
    else
        px_buf_appends(b, "null");
    px_buf_printf(b,
                  ",\"usage\":{\"input_tokens\":%zu,\"input_tokens_details\":{\"cached_tokens\":%zu},"
                  "\"output_tokens\":%zu,\"output_tokens_details\":{\"reasoning_tokens\":0},"
                  "\"total_tokens\":%zu}",
                  r->ntok, r->cached, r->emitted, r->ntok + r->emitted);
}

/* Writes the whole non-streamed answer; `kvp` is raw JSON or NULL. For
 * /inference/v1/generate `text` is the comma-separated token ids. */
static void reply_json(sim_req *r, const char *text, size_t tlen, const char *finish,
                       const char *kvp) {
    px_buf b;
    px_buf_init(&b);
    if (r->ep == EP_RESPONSES) {
        append_response(&b, r, text, tlen, "completed");
    } else if (r->ep == EP_GENERATE) {
        px_buf_appends(&b, "{\"request_id\":");
        px_buf_append_json_str(&b, r->resp_id, strlen(r->resp_id));
        px_buf_printf(&b,
                      ",\"choices\":[{\"index\":0,\"logprobs\":null,\"finish_reason\":\"%s\","
                      "\"token_ids\":[%.*s]}],\"prompt_logprobs\":null",
                      finish, (int)tlen, text);
    } else {
        px_buf_appends(&b, "{\"id\":");
        px_buf_append_json_str(&b, r->resp_id, strlen(r->resp_id));
        px_buf_printf(&b,
                      ",\"object\":\"%s\",\"created\":%ld,\"model\":%s,\"choices\":[{\"index\":0,",
                      r->ep == EP_CHAT ? "chat.completion" : "text_completion", r->created,
                      r->e->model_json);
        if (r->ep == EP_CHAT) {
            px_buf_appends(&b, "\"message\":{\"role\":\"assistant\",\"content\":");
            px_buf_append_json_str(&b, text, tlen);
            px_buf_appends(&b, "},");
        } else {
            px_buf_appends(&b, "\"text\":");
            px_buf_append_json_str(&b, text, tlen);
            px_buf_appends(&b, ",\"logprobs\":null,");
        }
        px_buf_printf(&b, "\"finish_reason\":\"%s\"}],", finish);
        append_usage(&b, r);
    }
    if (kvp) {
        px_buf_appends(&b, ",\"kv_transfer_params\":");
        px_buf_appends(&b, kvp);
    }
    px_buf_appends(&b, "}");
    px_conn_reply(r->conn, 200, "application/json", r->xrid, dp_header(r), b.data, b.len);
    r->conn = NULL;
    px_buf_cleanup(&b);
}

/* A word of the answer as the endpoint streams it. */
static void stream_word(px_buf *b, sim_req *r, const char *w, size_t wl, int last) {
    if (r->ep == EP_RESPONSES) {
        if (r->emitted == 1) {
            px_buf_appends(b, "event: response.created\ndata: {\"type\":\"response.created\","
                              "\"sequence_number\":0,\"response\":");
            append_response(b, r, "", 0, "in_progress");
            px_buf_appends(b, "}}\n\n");
        }
        px_buf_printf(b,
                      "event: response.output_text.delta\ndata: {\"type\":"
                      "\"response.output_text.delta\",\"sequence_number\":%zu,\"item_id\":\"msg_%s\","
                      "\"output_index\":0,\"content_index\":0,\"delta\":",
                      r->emitted, r->internal_id);
        px_buf_append_json_str(b, w, wl);
        px_buf_appends(b, ",\"logprobs\":[]}\n\n");
        px_buf_append(&r->text, w, wl); /* response.completed carries the whole text */
        return;
    }
    if (r->ep == EP_GENERATE) {
        px_buf_appends(b, "data: {\"request_id\":");
        px_buf_append_json_str(b, r->resp_id, strlen(r->resp_id));
        px_buf_printf(b,
                      ",\"choices\":[{\"index\":0,\"logprobs\":null,\"finish_reason\":%s,"
                      "\"token_ids\":[%u]}]}\n\n",
                      last ? "\"length\"" : "null", word_id(w, wl));
        return;
    }
    if (r->emitted == 1 && r->ep == EP_CHAT) {
        chunk_head(b, r);
        px_buf_appends(b, "\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\","
                          "\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
    }
    chunk_head(b, r);
    if (r->ep == EP_CHAT) {
        px_buf_appends(b, "\"choices\":[{\"index\":0,\"delta\":{\"content\":");
        px_buf_append_json_str(b, w, wl);
        px_buf_appends(b, "},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
    } else {
        px_buf_appends(b, "\"choices\":[{\"index\":0,\"text\":");
        px_buf_append_json_str(b, w, wl);
        px_buf_printf(b, ",\"logprobs\":null,\"finish_reason\":%s}]}\n\n",
                      last ? "\"length\"" : "null");
    }
}

/* The stream's end: the endpoint's last events. */
static void stream_end(px_buf *b, sim_req *r) {
    if (r->ep == EP_RESPONSES) {
        px_buf_printf(b,
                      "event: response.completed\ndata: {\"type\":\"response.completed\","
                      "\"sequence_number\":%zu,\"response\":",
                      r->emitted + 1);
        append_response(b, r, r->text.data ? r->text.data : "", r->text.len, "completed");
        px_buf_appends(b, "}}\n\n");
        return;
    }
    if (r->ep == EP_CHAT) {
        chunk_head(b, r);
        px_buf_appends(b, "\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,"
                          "\"finish_reason\":\"length\"}]}\n\n");
    }
    if (r->include_usage && r->ep != EP_GENERATE) {
        chunk_head(b, r);
        px_buf_appends(b, "\"choices\":[],");
        append_usage(b, r);
        px_buf_appends(b, "}\n\n");
    }
    px_buf_appends(b, "data: [DONE]\n\n");
}

/* ---------------------------------------------------------- generation -- */

static void schedule_us(sim_req *r, uint64_t us) {
    struct timeval tv = {(time_t)(us / 1000000), (suseconds_t)(us % 1000000)};
    evtimer_add(r->timer, &tv);
}

/* The time between two output tokens: --decode-us-per-token, else
 * --itl-ms. */
static uint64_t itl_us(const sim_engine *e) {
    return e->cfg->decode_us_per_token ? e->cfg->decode_us_per_token
                                       : (uint64_t)e->cfg->itl_ms * 1000u;
}

static void emit_tokens(evutil_socket_t fd, short what, void *arg) {
    sim_req *r = arg;
    sim_engine *e = r->e;
    px_buf b;
    px_buf_init(&b);
    /* With no inter-token latency, everything goes out in this turn. */
    do {
        char w[32];
        size_t wl = kvsim_word(r->prompt_hash, r->seed, r->emitted, w);
        r->emitted++;
        int last = r->emitted >= (size_t)r->max_tokens;
        if (!r->stream && r->ep == EP_GENERATE)
            px_buf_printf(&r->text, "%s%u", r->emitted > 1 ? "," : "", word_id(w, wl));
        else if (!r->stream)
            px_buf_append(&r->text, w, wl);
        else
            stream_word(&b, r, w, wl, last);
        if (last) break;
    } while (itl_us(e) == 0);

    if (r->emitted < (size_t)r->max_tokens) {
        if (r->stream) send_sse(r, &b);
        px_buf_cleanup(&b);
        schedule_us(r, itl_us(e));
        return;
    }
    if (!r->stream) {
        reply_json(r, r->text.data ? r->text.data : "", r->text.len, "length", NULL);
    } else {
        stream_end(&b, r);
        send_sse(r, &b);
        px_conn_stream_end(r->conn);
        r->conn = NULL;
    }
    px_buf_cleanup(&b);
    req_finish(r);
}

/* Generates with a slot held; `waited_us`: its wait for the slot, during
 * which its prompt's computation went on. */
static void run_generation(sim_req *r, uint64_t waited_us) {
    r->has_seq = 1;
    r->e->ngen++;
    r->state = SR_GENERATING;
    if (r->stream) px_conn_stream_start(r->conn, 200, "text/event-stream", r->xrid, dp_header(r));
    event_assign(r->timer, r->e->base, -1, 0, emit_tokens, r);
    uint64_t left = r->compute_us > waited_us ? r->compute_us - waited_us : 0;
    schedule_us(r, left + (uint64_t)r->e->cfg->ttft_ms * 1000u);
}

/* The prompt is ready: generate, or wait for one of --max-num-seqs slots
 * behind those waiting already (vLLM's scheduler adds no request to the
 * running ones past max_num_seqs). */
static void start_generation(sim_req *r) {
    sim_engine *e = r->e;
    e->generations++;
    uint32_t cap = e->cfg->max_num_seqs;
    if (!cap || (e->ngen < cap && !e->shead)) {
        run_generation(r, 0);
        return;
    }
    r->state = SR_SEQ_WAIT;
    r->t_seq = px_now_ns();
    r->qnext = NULL;
    if (e->stail)
        e->stail->qnext = r;
    else
        e->shead = r;
    e->stail = r;
}

/* A slot was freed: the requests waiting longest take the free ones. */
static void pump_seqs(sim_engine *e) {
    while (e->shead && e->ngen < e->cfg->max_num_seqs) {
        sim_req *r = e->shead;
        e->shead = r->qnext;
        if (!e->shead) e->stail = NULL;
        r->qnext = NULL;
        uint64_t waited = px_now_ns() - r->t_seq;
        e->seq_wait_ns += waited;
        run_generation(r, waited / 1000u);
    }
}

/* --------------------------------------------------------------- modes -- */

static int push_mode(const sim_engine *e) {
    return !strcmp(e->cfg->kv_transfer_mode, "push");
}

/* Publishes r's blocks: its kv_transfer_params, or NULL (answered with an
 * error).  Push mode: under the caller's id and token, which decode's held
 * fetch already names; its registration is served at once.  Layer-wise:
 * before the first layer is computed (prefill_layer marks them). */
static const char *pub_token(const sim_req *r) {
    const cJSON *pid = cJSON_GetObjectItemCaseSensitive(r->kvp, "remote_request_id");
    const cJSON *ptok = cJSON_GetObjectItemCaseSensitive(r->kvp, "remote_kv_token");
    return cJSON_IsString(pid) && cJSON_IsString(ptok) ? ptok->valuestring : NULL;
}

static const char *pub_id(const sim_req *r) {
    return pub_token(r) ? cJSON_GetObjectItemCaseSensitive(r->kvp, "remote_request_id")->valuestring
                        : r->internal_id;
}

static char *prefill_publish(sim_req *r, int layerwise) {
    sim_engine *e = r->e;
    char *json = NULL;
    kvc_publish_params_t pp = {
        .field_mask = (pub_token(r) ? KVC_PUBLISH_FIELD_TOKEN : 0) |
                      (layerwise ? KVC_PUBLISH_FIELD_LAYERWISE : 0),
        .kv_token = pub_token(r)};
    kvc_status_t st = kvc_publish(e->agent, pub_id(r), r->blocks, r->nblocks, &pp, &json);
    if (st != KVC_OK) {
        char msg[160];
        snprintf(msg, sizeof msg, "cannot publish KV blocks: %s", kvc_status_str(st));
        req_error(r, 500, msg);
        return NULL;
    }
    /* The blocks now belong to the publication until released or expired. */
    r->holds_blocks = 0;
    e->blocks_published += r->nblocks;
    return json;
}

static void prefill_reply(evutil_socket_t fd, short what, void *arg) {
    sim_req *r = arg;
    sim_engine *e = r->e;
    char *json = r->pub_json;
    r->pub_json = NULL;
    if (!json && !(json = prefill_publish(r, 0))) return; /* r is gone */
    /* The keys vLLM's NIXL schedulers write today (sim_kvp_answer). */
    char *ans = sim_kvp_answer(json, push_mode(e), r->ntok);
    char w[32];
    size_t wl = kvsim_word(r->prompt_hash, r->seed, 0, w);
    r->emitted = 1;
    char idtxt[16];
    if (r->ep == EP_GENERATE) {
        snprintf(idtxt, sizeof idtxt, "%u", word_id(w, wl));
        reply_json(r, idtxt, strlen(idtxt), "length", ans ? ans : json);
    } else {
        reply_json(r, w, wl, "length", ans ? ans : json);
    }
    cJSON_free(ans);
    kvc_free(json);
    req_finish(r);
}

/* Layer r->layer of the forward pass is computed (--layer-compute-us): with
 * --kv-layerwise its K and V regions are ready; after the last, the
 * answer. */
static void prefill_layer(evutil_socket_t fd, short what, void *arg) {
    sim_req *r = arg;
    sim_engine *e = r->e;
    compute_layers(r, r->layer, r->layer + 1);
    kvc_status_t st =
        r->pub_json ? kvc_publish_ready(e->agent, pub_id(r), (size_t)r->layer * 2, 2, NULL) : KVC_OK;
    if (st != KVC_OK)
        PX_LOG(PX_LOG_WARN, "req=%s msg=\"layer not marked ready\" layer=%u status=%s",
               r->internal_id, r->layer, kvc_status_str(st));
    if (++r->layer < e->cfg->layers) {
        schedule_us(r, e->cfg->layer_compute_us);
        return;
    }
    event_assign(r->timer, e->base, -1, 0, prefill_reply, r);
    schedule_us(r, (uint64_t)e->cfg->ttft_ms * 1000u);
}

static void start_local(sim_req *r) {
    compute_blocks(r);
    compute_prompt(r);
    start_generation(r);
}

/* --kv-load-failure-policy fail: as vLLM's decode, the request ends with
 * finish_reason "error", which its OpenAI front turns into a
 * GenerationError: HTTP 500 with an InternalServerError body, or (headers
 * sent) an error event and [DONE]. Prefill's blocks are let go. */
static void kv_load_failed(sim_req *r) {
    static const char body[] = "{\"error\":{\"message\":\"Internal server error\","
                               "\"type\":\"InternalServerError\",\"param\":null,\"code\":500}}";
    r->e->kv_load_failed++;
    PX_LOG(PX_LOG_WARN, "req=%s msg=\"KV load failed: failing the request "
                        "(--kv-load-failure-policy fail)\"",
           r->internal_id);
    notify_only(r->e, r->kvp);
    if (r->conn && r->stream) {
        px_conn_stream_start(r->conn, 200, "text/event-stream", r->xrid, dp_header(r));
        static const char ev[] = "data: {\"error\":{\"message\":\"Internal server error\","
                                 "\"type\":\"InternalServerError\",\"param\":null,"
                                 "\"code\":500}}\n\ndata: [DONE]\n\n";
        px_conn_stream_write(r->conn, ev, sizeof ev - 1);
        px_conn_stream_end(r->conn);
    } else if (r->conn) {
        px_conn_reply(r->conn, 500, "application/json", r->xrid, dp_header(r), body,
                      sizeof body - 1);
    }
    r->conn = NULL;
    req_finish(r);
}

static int fail_on_load_error(const sim_req *r) {
    return !strcmp(r->e->cfg->kv_load_failure_policy, "fail");
}

/* How long a push-mode fetch waits at prefill for its publication (the
 * producer bounds it too: its pending_fetch_ms, 30 s by default). */
#define PUSH_WAIT_MS 30000u

static void start_decode(sim_req *r) {
    sim_engine *e = r->e;
    cJSON *ids = cJSON_GetObjectItemCaseSensitive(r->kvp, "remote_block_ids");
    /* Per KV-cache group, as vLLM sends them: one group here (libkvconnector
     * refuses more: a hybrid model's). */
    cJSON *g0 = cJSON_GetArrayItem(ids, 0);
    size_t nremote = (size_t)cJSON_GetArraySize(cJSON_IsArray(g0) ? g0 : ids);
    if (cJSON_IsArray(g0) && cJSON_GetArraySize(ids) != 1) nremote = 0;
    int push = !ids; /* push mode (sim_request.c): held until prefill publishes */
    if (!push && nremote != r->nblocks) {
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"remote has %zu blocks, prompt needs %zu: recomputing locally\"",
               r->internal_id, nremote, r->nblocks);
        notify_only(e, r->kvp);
        start_local(r);
        return;
    }
    /* Push mode: an empty list asks for the publication's last blocks (and
     * keeps the notifications and lease renewals sent with r->kvp valid). */
    if (push) cJSON_AddItemToObject(r->kvp, "remote_block_ids", cJSON_CreateArray());
    char *json = cJSON_PrintUnformatted(r->kvp);
    kvc_fetch_params_t fp = {
        .field_mask =
            KVC_FETCH_FIELD_JSON | KVC_FETCH_FIELD_LOCAL_BLOCKS | KVC_FETCH_FIELD_USER_DATA |
            (push ? KVC_FETCH_FIELD_WAIT : 0),
        .kv_transfer_params_json = json,
        .local_block_ids = r->blocks,
        .num_local_blocks = r->nblocks,
        .user_data = (uint64_t)(uintptr_t)r,
        .wait_ms = PUSH_WAIT_MS,
    };
    uint64_t xid;
    r->t_fetch0 = px_now_ns();
    kvc_status_t st = json ? kvc_fetch(e->agent, &fp, &xid) : KVC_ERR_NO_MEMORY;
    free(json);
    if (st != KVC_INPROGRESS && st != KVC_OK) {
        e->fetch_failures++;
        PX_LOG(PX_LOG_WARN, "req=%s msg=\"KV fetch refused\" status=%s", r->internal_id,
               kvc_status_str(st));
        if (fail_on_load_error(r))
            kv_load_failed(r);
        else
            start_local(r);
        return;
    }
    r->state = SR_FETCHING;
    r->fetching = 1;
    /* Heterogeneous TP: with a larger TP than the prefill, each decode rank
     * reads its slice and notifies; the prefill frees after all of them.  This
     * one process reads everything and sends the other ranks' notifications. */
    uint64_t rtp = 1;
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(r->kvp, "tp_size");
    if (cJSON_IsNumber(t) && t->valuedouble >= 1 && t->valuedouble <= 1024)
        rtp = (uint64_t)t->valuedouble;
    for (uint64_t k = 1; e->cfg->tp_size > rtp && k < e->cfg->tp_size / rtp; k++)
        notify_only(e, r->kvp);
}

static void start_req(sim_req *r) {
    r->e->admitted++;
    if (r->t_queued) r->e->block_wait_ns += px_now_ns() - r->t_queued;
    r->e->nrunning++;
    r->e->dp_running[r->dp_rank]++;
    switch (r->mode) {
    case SIM_MODE_PREFILL:
        if (!r->e->cfg->layer_compute_us) compute_blocks(r); /* else layer by layer */
        compute_prompt(r);
        r->state = SR_PREFILL_WAIT;
        if (r->e->cfg->layer_compute_us) { /* the forward pass, layer by layer */
            char *json = r->e->cfg->kv_layerwise ? prefill_publish(r, 1) : NULL;
            if (r->e->cfg->kv_layerwise && !json) break; /* answered, r is gone */
            r->pub_json = json;
            event_assign(r->timer, r->e->base, -1, 0, prefill_layer, r);
            schedule_us(r, r->compute_us + r->e->cfg->layer_compute_us);
            break;
        }
        event_assign(r->timer, r->e->base, -1, 0, prefill_reply, r);
        schedule_us(r, r->compute_us + (uint64_t)r->e->cfg->ttft_ms * 1000u);
        break;
    case SIM_MODE_DECODE:
        start_decode(r);
        break;
    case SIM_MODE_LOCAL:
        start_local(r);
        break;
    }
}

static void pump_queue(sim_engine *e) {
    while (e->qhead && e->nfree >= e->qhead->nblocks) {
        sim_req *r = e->qhead;
        e->qhead = r->qnext;
        if (!e->qhead) e->qtail = NULL;
        e->nqueued--;
        e->dp_waiting[r->dp_rank]--;
        take_blocks(e, r);
        start_req(r);
    }
}

/* ----------------------------------------------------- connector events -- */

/* The fetch's outcome reached decode (after its link's cost, when one
 * applies): X-KV-Wait-Ms, then generation from the received KV, or the
 * policy of a failed load. */
static void fetch_landed(sim_req *r, int ok) {
    sim_engine *e = r->e;
    /* How long decode waited for prefill's KV (in push mode: the prefill
     * too), for the proxy's access line. */
    size_t hl = strlen(r->dp_hdr);
    snprintf(r->dp_hdr + hl, sizeof r->dp_hdr - hl, "X-KV-Wait-Ms: %.3f\r\n",
             (double)(px_now_ns() - r->t_fetch0) / 1e6);
    if (ok) {
        uint64_t bad = verify_blocks(r);
        if (bad) {
            e->corrupt_blocks += bad;
            char msg[160];
            snprintf(msg, sizeof msg, "KV blocks received from prefill are corrupt (%llu pieces)",
                     (unsigned long long)bad);
            req_error(r, 500, msg);
            return;
        }
        /* vLLM's scheduler counts the received prompt as computed tokens
         * (all but the last, which decode computes) and reports them as
         * cached; the blocks enter decode's prefix cache. */
        r->cached = r->ntok - 1;
        e->tokens_cached += r->cached;
        e->prompt_tokens += r->ntok;
        r->compute_us = compute(e, 1);
        cache_insert(e, r);
        start_generation(r);
    } else if (fail_on_load_error(r)) {
        kv_load_failed(r);
    } else {
        start_local(r);
    }
}

static void on_link_landed(evutil_socket_t fd, short what, void *arg) {
    fetch_landed(arg, 1);
}

/* --kv-peer-cost: when the bytes fetched from r's prefill have crossed
 * its link; 0 when no link applies. */
static uint64_t link_land_ns(sim_req *r, uint64_t bytes) {
    sim_engine *e = r->e;
    if (!e->links) return 0;
    const cJSON *eid = cJSON_GetObjectItemCaseSensitive(r->kvp, "remote_engine_id");
    const cJSON *host = cJSON_GetObjectItemCaseSensitive(r->kvp, "remote_host");
    const cJSON *port = cJSON_GetObjectItemCaseSensitive(r->kvp, "remote_port");
    char hp[300] = "";
    if (cJSON_IsString(host) && cJSON_IsNumber(port))
        snprintf(hp, sizeof hp, "%s:%d", host->valuestring, port->valueint);
    return sim_link_land(e->links, cJSON_IsString(eid) ? eid->valuestring : NULL,
                         hp[0] ? hp : NULL, bytes, px_now_ns());
}

static void on_fetch_event(sim_engine *e, const kvc_event_t *ev) {
    sim_req *r = (sim_req *)(uintptr_t)ev->user_data;
    if (!r) return; /* a bare notification */
    r->fetching = 0;
    if (ev->type == KVC_EV_FETCH_DONE) {
        uint64_t ns = px_now_ns() - r->t_fetch0;
        e->fetches++;
        e->bytes_fetched += ev->bytes;
        e->fetch_ns += ns;
        PX_LOG(PX_LOG_INFO,
               "req=%s msg=\"kv fetch done\" remote_request_id=%s blocks=%zu bytes=%llu ms=%.3f "
               "gbps=%.2f",
               r->internal_id, ev->request_id ? ev->request_id : "-", ev->num_blocks,
               (unsigned long long)ev->bytes, (double)ns / 1e6,
               ns ? (double)ev->bytes / (double)ns : 0.0);
    } else {
        e->fetch_failures++;
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"kv fetch failed, recomputing locally\" status=%s detail=\"%s\"",
               r->internal_id, kvc_status_str(ev->status), ev->message ? ev->message : "");
    }
    if (r->orphan) {
        req_finish(r);
        return;
    }
    uint64_t land = ev->type == KVC_EV_FETCH_DONE ? link_land_ns(r, ev->bytes) : 0;
    uint64_t now = px_now_ns();
    if (land > now) {
        /* The bytes are here, but the link says they are still on their
         * way: decode goes on when they would have landed. */
        e->link_waits++;
        e->link_wait_ns += land - now;
        event_assign(r->timer, e->base, -1, 0, on_link_landed, r);
        schedule_us(r, (land - now) / 1000u);
        return;
    }
    fetch_landed(r, ev->type == KVC_EV_FETCH_DONE);
}

static uint32_t renew_interval_ms(const sim_engine *e) {
    uint32_t ms = e->cfg->kv_lease_ms / 6; /* as vLLM's NIXL heartbeats: lease // 6 */
    return ms < 50 ? 50 : ms;
}

/* Decode requests waiting for KV blocks renew the lease of their
 * publication on the prefill, so that it is not freed while they queue. */
static void renew_queued(sim_engine *e) {
    uint64_t now = px_now_ns();
    if (!e->cfg->kv_lease_ms || now < e->renew_due_ns) return;
    e->renew_due_ns = now + (uint64_t)renew_interval_ms(e) * 1000000ull;
    for (sim_req *r = e->qhead; r; r = r->qnext) {
        if (r->mode != SIM_MODE_DECODE || !r->kvp) continue;
        /* A push-mode request names no blocks yet, and libkvconnector
         * reads none from a renewal: renewed all the same, by the
         * remote_request_id its params name (as vLLM's decode heartbeats
         * every queued request). */
        int named = cJSON_HasObjectItem(r->kvp, "remote_block_ids");
        if (!named) cJSON_AddItemToObject(r->kvp, "remote_block_ids", cJSON_CreateArray());
        char *json = cJSON_PrintUnformatted(r->kvp);
        /* start_decode still reads the request as push mode (no ids). */
        if (!named) cJSON_DeleteItemFromObjectCaseSensitive(r->kvp, "remote_block_ids");
        kvc_fetch_params_t fp = {.field_mask = KVC_FETCH_FIELD_JSON,
                                 .kv_transfer_params_json = json};
        kvc_status_t st = json ? kvc_lease_renew(e->agent, &fp) : KVC_ERR_NO_MEMORY;
        free(json);
        if (st == KVC_OK)
            e->lease_renewals++;
        else
            PX_LOG(PX_LOG_DEBUG, "req=%s msg=\"lease renewal not sent\" status=%s", r->internal_id,
                   kvc_status_str(st));
    }
}

static void on_kv(evutil_socket_t fd, short what, void *arg) {
    sim_engine *e = arg;
    kvc_event_t ev;
    renew_queued(e);
    kvc_agent_progress(e->agent);
    while (kvc_agent_next_event(e->agent, &ev) == KVC_OK) {
        switch (ev.type) {
        case KVC_EV_FETCH_DONE:
        case KVC_EV_FETCH_FAILED:
            on_fetch_event(e, &ev);
            break;
        case KVC_EV_RELEASED:
            e->blocks_released += ev.num_blocks;
            give_blocks(e, ev.block_ids, ev.num_blocks);
            PX_LOG(PX_LOG_DEBUG, "msg=\"kv blocks released by consumer\" request=%s blocks=%zu",
                   ev.request_id, ev.num_blocks);
            break;
        case KVC_EV_EXPIRED:
            e->blocks_expired += ev.num_blocks;
            give_blocks(e, ev.block_ids, ev.num_blocks);
            PX_LOG(PX_LOG_WARN, "msg=\"Releasing expired KV blocks for request %s\" blocks=%zu",
                   ev.request_id, ev.num_blocks);
            break;
        case KVC_EV_UNKNOWN_NOTIFY:
            e->unknown_notify++;
            PX_LOG(PX_LOG_WARN, "msg=\"unrecognized kv notification\" request=%s",
                   ev.request_id ? ev.request_id : "-");
            break;
        }
    }
    pump_queue(e);
}

static void kvc_log(void *arg, kvc_log_level_t level, const char *msg) {
    px_log_level_t l = level == KVC_LOG_ERROR  ? PX_LOG_ERROR
                       : level == KVC_LOG_WARN ? PX_LOG_WARN
                       : level == KVC_LOG_INFO ? PX_LOG_INFO
                                               : PX_LOG_DEBUG;
    PX_LOG(l, "component=kvconnector msg=\"%s\"", msg);
}

/* ---------------------------------------------------------- admission -- */

void sim_submit(sim_engine *e, px_conn *c, sim_ep ep, const char *xrid, int dp_rank,
                sim_parsed *parsed) {
    char msg[256];
    sim_parsed pr = *parsed;
    sim_req *r = px_xcalloc(1, sizeof *r);
    if (dp_rank >= 0) {
        snprintf(r->dp_hdr, sizeof r->dp_hdr, "X-Data-Parallel-Rank: %d\r\n", dp_rank);
        e->dp_requests[dp_rank]++;
        r->dp_rank = dp_rank;
    }
    r->e = e;
    r->ep = ep;
    px_buf_init(&r->text);
    snprintf(r->xrid, sizeof r->xrid, "%s", xrid);
    r->tok = pr.tok;
    r->ntok = pr.ntok;
    r->created = (long)time(NULL);
    PX_LIST_PUSH(e->reqs, r);
    r->timer = evtimer_new(e->base, emit_tokens, r);
    r->max_tokens = pr.max_tokens;
    r->stream = pr.stream;
    r->include_usage = pr.include_usage;
    r->seed = pr.seed;
    r->prompt_hash = px_hash64_seed(r->tok, r->ntok * sizeof *r->tok, e->model_hash);
    snprintf(r->internal_id, sizeof r->internal_id, "cmpl-%s-%08x", xrid,
             (unsigned)(px_rand64() & 0xffffffffu));
    static const char *const id_prefix[] = {"cmpl-", "chatcmpl-", "resp_", ""};
    snprintf(r->resp_id, sizeof r->resp_id, "%s%s", id_prefix[ep], xrid);
    r->prev_id = pr.prev_id; /* ownership moves to r */
    r->mode = pr.mode;
    r->kvp = pr.kvp; /* ownership moves to r */
    int push = push_mode(e);
    if (!push && r->mode == SIM_MODE_PREFILL && r->kvp) {
        /* A pull prefill (vLLM's NixlConnector) ignores a router's id and
         * token: it publishes under its own id, and its answer says pull. */
        cJSON_Delete(r->kvp);
        r->kvp = NULL;
    }
    if (r->mode == SIM_MODE_PREFILL || r->mode == SIM_MODE_DECODE || pr.kvp_invalid)
        PX_LOG(PX_LOG_INFO, "req=%s msg=\"kv_transfer_params\" role=%s transfer_mode=%s "
                            "transfer_id=%s",
               r->internal_id, r->mode == SIM_MODE_PREFILL ? "prefill" : "decode",
               e->cfg->kv_transfer_mode, pr.transfer_id[0] ? pr.transfer_id : "-");
    if (push && (r->mode == SIM_MODE_PREFILL || r->mode == SIM_MODE_DECODE) &&
        !pr.transfer_id[0]) {
        e->transfer_id_missing++;
        PX_LOG(PX_LOG_WARN, "req=%s msg=\"No valid transfer_id in kv_transfer_params; pairing P "
                            "and D by base request id, which is deprecated\"",
               r->internal_id);
    }
    if (!push && pr.kvp_no_blocks) {
        /* vLLM's pull scheduler: do_remote_prefill with tokens to load and
         * no remote_block_ids fails `assert num_external_tokens == 0` in
         * update_state_after_alloc, and the engine core dies. */
        e->kvp_no_blocks++;
        PX_LOG(PX_LOG_ERROR,
               "req=%s msg=\"AssertionError: num_external_tokens == 0: do_remote_prefill without "
               "remote_block_ids reached a pull decode (vLLM's engine core dies here)\"",
               r->internal_id);
        req_free(r);
        px_conn_reply_error(c, 500, xrid, NULL,
                            "EngineCore encountered an issue: do_remote_prefill without "
                            "remote_block_ids on a pull connector");
        return;
    }
    if (pr.kvp_invalid) {
        e->invalid_kvp++;
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"Got invalid KVTransferParams: invalid kv_transfer_params, "
               "recomputing the prefill locally\"",
               r->internal_id);
    }
    e->requests_total++;

    if (r->ntok == 0) {
        req_free(r);
        px_conn_reply_error(c, 400, xrid, NULL, "the prompt is empty");
        return;
    }
    r->nblocks = (r->ntok + e->cfg->block_tokens - 1) / e->cfg->block_tokens;
    if (r->nblocks > e->cfg->num_blocks) {
        snprintf(msg, sizeof msg, "prompt of %zu tokens needs %zu KV blocks; the pool has %llu",
                 r->ntok, r->nblocks, (unsigned long long)e->cfg->num_blocks);
        if (r->mode == SIM_MODE_DECODE) notify_only(e, r->kvp);
        req_free(r);
        px_conn_reply_error(c, 400, xrid, NULL, msg);
        return;
    }
    /* vLLM's --max-num-queued-reqs (PR 49445): checked as the request
     * arrives, before it takes anything; n > 1 counts n times there, and
     * this engine serves n = 1. */
    if (e->cfg->max_num_queued_reqs && e->nrunning + e->nqueued >= e->cfg->max_num_queued_reqs) {
        e->busy_rejects++;
        /* Refused before the engine saw it, as vLLM does: a decode does not
         * touch prefill's blocks, which stay for a retry (or expire). */
        req_free(r);
        snprintf(msg, sizeof msg,
                 "the engine holds %zu requests (--max-num-queued-reqs %u); retry later",
                 e->nrunning + e->nqueued, (unsigned)e->cfg->max_num_queued_reqs);
        px_conn_reply_error(c, 429, xrid, NULL, msg);
        return;
    }
    r->conn = c;
    px_conn_bind(c, &client_cbs, r);
    if (!e->qhead && take_blocks(e, r) == 0) {
        start_req(r);
        return;
    }
    if (e->nqueued >= e->cfg->max_queue) {
        e->queue_rejects++;
        if (r->mode == SIM_MODE_DECODE) notify_only(e, r->kvp);
        r->conn = NULL;
        req_free(r);
        px_conn_reply_error(c, 503, xrid, "Retry-After: 1\r\n",
                            "KV cache full and the wait queue is full");
        return;
    }
    r->state = SR_QUEUED;
    r->t_queued = px_now_ns();
    if (e->qtail)
        e->qtail->qnext = r;
    else
        e->qhead = r;
    e->qtail = r;
    e->nqueued++;
    e->dp_waiting[r->dp_rank]++;
}

/* The secret file's bytes, trailing newline stripped; NULL with a message. */
static char *read_secret(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "engine-sim: --kv-secret-file %s: %s\n", path, strerror(errno));
        return NULL;
    }
    char *buf = px_xmalloc(4097);
    size_t n = fread(buf, 1, 4097, f);
    fclose(f);
    while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
        n--;
    if (n == 0 || n > 4096) {
        fprintf(stderr, "engine-sim: --kv-secret-file %s: %s\n", path,
                n ? "longer than 4096 bytes" : "empty");
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

int sim_engine_setup_agent(sim_engine *e) {
    const sim_config *cfg = e->cfg;
    kvc_agent_params_t ap = {
        .field_mask = KVC_AGENT_FIELD_ENGINE_ID | KVC_AGENT_FIELD_LISTEN_HOST |
                      KVC_AGENT_FIELD_LISTEN_PORT | KVC_AGENT_FIELD_LOG | KVC_AGENT_FIELD_EXPIRY |
                      KVC_AGENT_FIELD_TP_SIZE | KVC_AGENT_FIELD_LEASE,
        .tp_size = cfg->tp_size,
        .lease_ms = cfg->kv_lease_ms,
        .engine_id = cfg->engine_id,
        .listen_host = cfg->kv_host,
        .listen_port = (uint16_t)cfg->kv_port,
        .log_cb = kvc_log,
        .log_level = cfg->log_level == 0   ? KVC_LOG_DEBUG
                     : cfg->log_level == 1 ? KVC_LOG_INFO
                     : cfg->log_level == 2 ? KVC_LOG_WARN
                                           : KVC_LOG_ERROR,
        .expiry_ms = cfg->kv_expiry_ms,
    };
    char *secret = NULL;
    if (cfg->kv_secret_file) {
        if (!(secret = read_secret(cfg->kv_secret_file, &ap.secret_len))) return -1;
        ap.secret = secret;
        ap.field_mask |= KVC_AGENT_FIELD_SECRET;
    }
    kvc_status_t st = kvc_agent_create(&ap, &e->agent);
    if (secret) {
        memset(secret, 0, ap.secret_len); /* the agent keeps its own copy */
        free(secret);
    }
    if (st != KVC_OK) {
        fprintf(stderr, "engine-sim: cannot create the KV agent: %s\n", kvc_status_str(st));
        return -1;
    }
    size_t nreg = (size_t)cfg->layers * 2;
    kvc_region_params_t *regs = px_xcalloc(nreg, sizeof *regs);
    for (size_t i = 0; i < nreg; i++)
        regs[i].len = (size_t)cfg->num_blocks * cfg->block_bytes;
    st = kvc_agent_register_regions(e->agent, cfg->num_blocks, regs, nreg);
    free(regs);
    if (st != KVC_OK) {
        fprintf(stderr, "engine-sim: cannot register %zu KV regions of %llu bytes: %s\n", nreg,
                (unsigned long long)cfg->num_blocks * cfg->block_bytes, kvc_status_str(st));
        return -1;
    }
    int fd;
    kvc_agent_get_fd(e->agent, &fd);
    e->kv_ev = event_new(e->base, fd, EV_READ | EV_PERSIST, on_kv, e);
    /* Also woken every renewal interval: queued decode requests renew
     * their publications' leases while they wait (on_kv). */
    struct timeval tv = {renew_interval_ms(e) / 1000, (renew_interval_ms(e) % 1000) * 1000};
    event_add(e->kv_ev, cfg->kv_lease_ms ? &tv : NULL);
    return 0;
}

int sim_engine_setup_links(sim_engine *e) {
    char err[256];
    if (!e->cfg->kv_peer_cost || !e->cfg->kv_peer_cost[0]) return 0;
    e->links = sim_links_parse(e->cfg->kv_peer_cost, err, sizeof err);
    if (!e->links) fprintf(stderr, "engine-sim: --kv-peer-cost %s\n", err);
    return e->links ? 0 : -1;
}

void sim_engine_free_reqs(sim_engine *e) {
    while (e->reqs)
        req_free(e->reqs);
}

/* ------------------------------------------------------ prefix cache -- */

static void on_stored(void *ctx, const uint64_t *hashes, size_t n, int has_parent, uint64_t parent,
                      const uint32_t *tok, size_t ntok) {
    sim_engine *e = ctx;
    sim_kvev_stored(e->kvev, hashes, n, has_parent, parent, tok, ntok);
}

static void on_removed(void *ctx, uint64_t hash) {
    sim_engine *e = ctx;
    sim_kvev_removed(e->kvev, hash);
}

int sim_engine_setup_prefix(sim_engine *e) {
    const sim_config *cfg = e->cfg;
    if (cfg->kv_events_endpoint) {
        char err[512];
        sim_kvev_cfg kc = {.endpoint = cfg->kv_events_endpoint,
                           .replay_endpoint = cfg->kv_events_replay_endpoint,
                           .topic = cfg->kv_events_topic,
                           .buffer_steps = cfg->kv_events_buffer_steps,
                           .encoding = cfg->kv_events_encoding,
                           .drop_seq = cfg->kv_events_drop_seq,
                           .block_size = cfg->block_tokens};
        e->kvev = sim_kvev_new(e->base, &kc, err, sizeof err);
        if (!e->kvev) {
            fprintf(stderr, "engine-sim: %s\n", err);
            return -1;
        }
    }
    sim_prefix_obs obs = {.stored = on_stored, .removed = on_removed, .ctx = e};
    size_t cap = cfg->prefix_cache_blocks ? cfg->prefix_cache_blocks : cfg->num_blocks;
    e->prefix = sim_prefix_new(cap, cfg->block_tokens, &obs);
    return 0;
}

void sim_engine_reset_prefix(sim_engine *e) {
    size_t n = sim_prefix_clear(e->prefix);
    sim_kvev_cleared(e->kvev);
    sim_kvev_flush(e->kvev);
    PX_LOG(PX_LOG_INFO, "msg=\"prefix cache reset\" blocks=%zu", n);
}

void sim_engine_free_prefix(sim_engine *e) {
    sim_prefix_free(e->prefix);
    sim_kvev_free(e->kvev);
    e->prefix = NULL;
    e->kvev = NULL;
}
