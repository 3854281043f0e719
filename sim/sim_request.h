/* SPDX-License-Identifier: Apache-2.0 */
/* engine-sim's parsing of a completion request body, as a pure function:
 * no engine, no connection, no clock. The engine calls it for every
 * /v1/completions and /v1/chat/completions request, and the fuzzer
 * (tests/fuzz/fuzz_sim_request.c) calls it on arbitrary bytes. */
#ifndef SIM_REQUEST_H
#define SIM_REQUEST_H

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>

typedef enum { SIM_MODE_LOCAL, SIM_MODE_PREFILL, SIM_MODE_DECODE } sim_mode;

/* Which endpoint's body is parsed (sim_ep has the same values). */
enum {
    SIM_KIND_COMPLETIONS = 0, /* /v1/completions: prompt, max_tokens */
    SIM_KIND_CHAT = 1,        /* /v1/chat/completions: messages, max_(completion_)tokens */
    SIM_KIND_RESPONSES = 2,   /* /v1/responses: input, instructions, max_output_tokens */
    SIM_KIND_GENERATE = 3     /* /inference/v1/generate: token_ids, sampling_params.max_tokens */
};

typedef struct sim_parsed {
    uint32_t *tok;  /* owned: the prompt's token ids (may be NULL when ntok is 0) */
    size_t ntok;    /* 0: empty prompt; the engine answers 400 */
    int max_tokens; /* 1..100000, 16 when absent or null */
    int stream;
    int include_usage;
    uint64_t seed;
    sim_mode mode;
    cJSON *kvp;            /* owned: decode's kv_transfer_params, or prefill's in push mode
                              (caller's remote_request_id and remote_kv_token) */
    int kvp_invalid;       /* do_remote_prefill with unusable params: recompute locally */
    int kvp_no_blocks;     /* do_remote_prefill without remote_block_ids (push-shaped) */
    char transfer_id[129]; /* kv_transfer_params' transfer_id (the router's), or "" */
    char *prev_id;         /* owned: /v1/responses' previous_response_id, echoed; or NULL */
} sim_parsed;

/* Parses body[0..len) for the endpoint `kind` (SIM_KIND_*; 0 and 1 are
 * /v1/completions and /v1/chat/completions, so a chat flag reads right). `model` is the served model name: a request naming
 * another one is refused. Returns 0 with *out filled (release it with
 * sim_parsed_cleanup), or the HTTP status to answer (400, 404) with the
 * client-facing message in err; *out then holds nothing to release. */
int sim_parse_request(int kind, const char *body, size_t len, const char *model, sim_parsed *out,
                      char *err, size_t errlen);

void sim_parsed_cleanup(sim_parsed *p);

/* A prefill's kv_transfer_params as vLLM's NIXL schedulers write them
 * today, from libkvconnector's (`json`, as kvc_publish returns it):
 * remote_block_ids as a list per KV-cache group (one group here), plus
 * transfer_mode ("push" or "pull"), pp_size 1, remote_num_tokens
 * (`num_tokens`) and, for pull, dcp_size 1 and remote_blocks_expiry_time
 * null (a prefill's blocks have a lease, not an expiry, in vLLM's pull
 * scheduler). Returns the text (release it with cJSON_free), or NULL when
 * json is no object (or out of memory). */
char *sim_kvp_answer(const char *json, int push, size_t num_tokens);

/* Parses a /tokenize body, vLLM's TokenizeCompletionRequest ({"prompt"})
 * or TokenizeChatRequest ({"messages", "add_generation_prompt": true}),
 * into the token ids the completion endpoints would use for the same
 * prompt. Returns 0 with *tok (owned, free()) and *ntok, or the HTTP
 * status (400, 404) with the message in err. */
int sim_parse_tokenize(const char *body, size_t len, const char *model, uint32_t **tok,
                       size_t *ntok, char *err, size_t errlen);

#endif
