/* SPDX-License-Identifier: Apache-2.0 */
/* engine-sim: an OpenAI-compatible engine that behaves like one vLLM
 * instance of a P/D pair, moving real KV blocks with libkvconnector. */
#ifndef SIM_ENGINE_H
#define SIM_ENGINE_H

#include <stddef.h>
#include <stdint.h>

typedef struct sim_config {
    const char *role; /* prefill | decode | both (informational + defaults) */
    const char *host;
    int port;
    const char *model;
    const char *kv_host; /* side channel bind and advertised address */
    int kv_port;         /* 0: any free port */
    uint64_t num_blocks;
    uint32_t block_tokens;
    uint32_t layers;
    uint32_t block_bytes; /* bytes per block per region (K or V of a layer) */
    uint32_t ttft_ms;
    uint32_t itl_ms;
    const char *engine_id;
    uint32_t max_queue;                    /* requests waiting for KV blocks; 503 beyond */
    uint32_t kv_expiry_ms;                 /* published blocks expire after this */
    uint32_t kv_lease_ms;                  /* published blocks not renewed for this long are freed;
                                              decode renews its queued requests' every lease/6 */
    int log_level;                         /* 0 debug, 1 info, 2 warn, 3 error */
    const char *kv_secret_file;            /* cluster secret for the KV side channel; NULL:
                                              the connector reads KVC_SECRET_FILE / KVC_SECRET */
    uint32_t tp_size;                      /* this engine's tensor-parallel size (1) */
    uint32_t prefill_us_per_token;         /* compute time of one prompt token, microseconds (0):
                                              prompts are computed one at a time, like one GPU */
    uint64_t prefix_cache_blocks;          /* prefix cache capacity in blocks; 0: num_blocks */
    const char *kv_events_endpoint;        /* ZeroMQ PUB bind address; NULL: no events */
    const char *kv_events_replay_endpoint; /* ZeroMQ ROUTER bind address for replays */
    const char *kv_events_topic;           /* topic frame ("") */
    uint32_t kv_events_buffer_steps;       /* batches kept for replay (10000) */
    const char *kv_events_encoding;        /* array | map (array) */
    int kv_events_drop_seq;                /* test aid: batch not sent on PUB; -1 none */
    const char *kv_load_failure_policy;    /* "recompute" (default) or "fail": vLLM's
                                              kv_transfer_config key of that name */
    uint32_t dp_size;                      /* --data-parallel-size: ranks a request may name (1) */
    uint32_t max_num_queued_reqs;          /* vLLM's --max-num-queued-reqs (PR 49445): past this
                                              many requests in the engine (waiting + running),
                                              429; 0: no cap */
    uint32_t decode_us_per_token;          /* time between output tokens, us; 0: --itl-ms */
    const char *kv_peer_cost;              /* "PEER=DELAY_MS[/MB_PER_S],...": what a KV fetch
                                              from each prefill costs beyond the copy (link.h) */
    uint32_t max_num_seqs;                 /* vLLM's --max-num-seqs: requests generating at
                                              once; the others wait for a slot; 0: no cap */
    const char *kv_transfer_mode;          /* "pull" (vLLM's NixlConnector, the default) or
                                              "push" (its NixlPushConnector), as answers say in
                                              transfer_mode */
    uint32_t layer_compute_us;             /* prefill's forward pass: this long per layer, after
                                              its prompt compute, before its answer (0) */
    uint32_t kv_layerwise;                 /* with layer_compute_us: publish before the first
                                              layer, each layer ready as it is computed
                                              (kvc_publish_ready) (0) */
} sim_config;

/* Runs the engine until SIGINT/SIGTERM. Returns the process exit status. */
int sim_engine_run(const sim_config *cfg);

#endif
