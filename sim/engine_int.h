/* SPDX-License-Identifier: Apache-2.0 */
/* engine-sim's internals, shared by the engine (engine.c: KV block pool,
 * KV transfers, request states, token generation) and its HTTP front
 * (front.c: routes, request parsing, /metrics, the listener). */
#ifndef SIM_ENGINE_INT_H
#define SIM_ENGINE_INT_H

#include <cjson/cJSON.h>
#include <event2/event.h>
#include <stdint.h>

#include "base/conn.h"
#include "base/http.h"
#include "base/listen.h"
#include "base/util.h"
#include "include/kvconnector.h"
#include "sim/engine.h"
#include "sim/kvevents.h"
#include "sim/prefix.h"
#include "sim/sim_request.h"

/* The values of SIM_KIND_* (sim_request.h). */
typedef enum { EP_COMPLETIONS = 0, EP_CHAT = 1, EP_RESPONSES = 2, EP_GENERATE = 3 } sim_ep;
/* SR_SEQ_WAIT: its prompt is ready (computed or received) and it waits for
 * one of --max-num-seqs generation slots. */
typedef enum { SR_QUEUED, SR_FETCHING, SR_PREFILL_WAIT, SR_SEQ_WAIT, SR_GENERATING } sim_state;

typedef struct sim_engine sim_engine;

#define SIM_DP_MAX 64 /* largest --data-parallel-size */

typedef struct sim_req {
    sim_engine *e;               /* borrowed */
    px_conn *conn;               /* borrowed: NULL once the client left */
    struct sim_req *qnext;       /* in the wait queue, or in the slot queue */
    struct sim_req *prev, *next; /* in e->reqs */
    sim_ep ep;
    sim_mode mode;
    sim_state state;
    char xrid[129];
    char internal_id[160];
    char resp_id[160];
    uint32_t *tok; /* owned */
    size_t ntok;
    uint64_t prompt_hash;
    size_t nblocks;
    uint64_t *blocks; /* owned: local block ids while held */
    uint64_t *ph;     /* owned: each block's prefix hash, computed on first use */
    int holds_blocks;
    int max_tokens;
    int stream;
    int include_usage;
    uint64_t seed;
    cJSON *kvp; /* owned: the decode request's kv_transfer_params */
    int fetching;
    int orphan;          /* client left during a fetch: free on its event */
    struct event *timer; /* owned */
    size_t emitted;
    px_buf text; /* owned: non-streamed output */
    long created;
    uint64_t t_fetch0;
    size_t cached;       /* prompt tokens reported as cached (usage) */
    char *prev_id;       /* owned: /v1/responses' previous_response_id, echoed; or NULL */
    char dp_hdr[96];     /* "X-Data-Parallel-Rank: N\r\n" and, after a KV fetch,
                            "X-KV-Wait-Ms: F\r\n", or "" */
    uint64_t compute_us; /* time until its prompt is computed, before time to first token */
    uint32_t layer;      /* prefill: layers computed (--layer-compute-us) */
    char *pub_json;      /* owned: a layer-wise publication's kv_transfer_params, or NULL */
    int dp_rank;         /* the data-parallel rank it runs on (0 when it named none) */
    uint64_t t_queued;   /* when it joined the wait queue for KV blocks (0: never) */
    uint64_t t_seq;      /* when it joined the queue for a generation slot */
    int has_seq;         /* holds one of --max-num-seqs generation slots */
} sim_req;

struct sim_engine {
    const sim_config *cfg;
    struct event_base *base;
    px_listener *lev; /* owned */
    px_conn_list conns;
    px_conn_cfg conn_cfg;
    kvc_agent_t *agent;
    struct event *kv_ev;
    uint64_t *free_blocks;
    size_t nfree;
    sim_req *qhead, *qtail;
    size_t nqueued;
    size_t nrunning;
    sim_req *reqs;
    uint64_t model_hash;
    char model_json[300]; /* the model name as a JSON string literal */
    /* counters for /metrics */
    /* The prefix cache: whole blocks computed or received (sim/prefix.c),
     * its stores and evictions published as KV events when asked. */
    sim_prefix *prefix; /* owned */
    sim_kvev *kvev;     /* owned; NULL without --kv-events-endpoint */
    uint64_t prefix_queries, prefix_hits, prompt_tokens;
    uint64_t busy_until_ns; /* the compute queue: when the last prompt queued is done */
    uint64_t tokens_computed, tokens_cached;
    uint64_t requests_total, blocks_published, blocks_released, blocks_expired, unknown_notify,
        fetch_failures, corrupt_blocks, fetches, bytes_fetched, fetch_ns, invalid_kvp,
        queue_rejects, lease_renewals, kv_load_failed, busy_rejects;
    /* vLLM's NIXL connectors as routers meet them: pull-mode decode
     * requests without remote_block_ids (vLLM's pull scheduler fails an
     * assertion on them and its engine core dies), push-mode legs without
     * a transfer_id (vLLM pairs them by base request id then, deprecated). */
    uint64_t kvp_no_blocks, transfer_id_missing;
    /* Queueing before the engine works on a request (/metrics'
     * engine_sim_queue_*): admitted requests and their wait for free KV
     * blocks; computations and their wait behind those queued before. */
    uint64_t admitted, block_wait_ns, computes, compute_wait_ns;
    /* --max-num-seqs: requests generating (slots held), those waiting for
     * a slot in arrival order, and every generation's wait for its slot. */
    size_t ngen;
    sim_req *shead, *stail;
    uint64_t generations, seq_wait_ns;
    /* --kv-peer-cost: the links, and the fetches they delayed. */
    struct sim_links *links; /* owned; NULL: none */
    uint64_t link_waits, link_wait_ns;
    uint64_t renew_due_ns;            /* next lease renewal of queued decode requests */
    uint64_t dp_requests[SIM_DP_MAX]; /* by the X-data-parallel-rank requests named */
    /* nrunning and nqueued split by rank: /metrics' per-engine series,
     * labelled engine="K" as vLLM labels each DP rank's gauges. */
    size_t dp_running[SIM_DP_MAX], dp_waiting[SIM_DP_MAX];
};

/* Admits a parsed completion request on connection c (`dp_rank`: the
 * data-parallel rank it named, or -1): queues it for KV
 * blocks or starts it; answers c itself on refusal. `pr`'s owned parts
 * move into the request. */
void sim_submit(sim_engine *e, px_conn *c, sim_ep ep, const char *xrid, int dp_rank,
                sim_parsed *pr);

/* POST /tokenize (sim/tokenize.c). */
void sim_handle_tokenize(sim_engine *e, px_conn *c, const px_http_head *h, px_buf *body);

/* The KV agent and its regions; 0, or -1 with a message on stderr. */
int sim_engine_setup_agent(sim_engine *e);
/* The --kv-peer-cost links; 0, or -1 with a message on stderr. */
int sim_engine_setup_links(sim_engine *e);
/* Frees every request (the loop has stopped). */
void sim_engine_free_reqs(sim_engine *e);
/* The prefix cache and its KV event publisher; 0, or -1 with a message on
 * stderr. */
int sim_engine_setup_prefix(sim_engine *e);
/* Empties the prefix cache, publishing AllBlocksCleared (/reset_prefix_cache). */
void sim_engine_reset_prefix(sim_engine *e);
/* Frees the prefix cache and the publisher. */
void sim_engine_free_prefix(sim_engine *e);

#endif
