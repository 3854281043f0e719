/* SPDX-License-Identifier: Apache-2.0 */
/* Conditional disaggregation: whether a request goes through a prefill
 * or to decode alone, decided from its body before any backend sees it.
 * Pure but for the prefix index (pindex.h), which belongs to the calling
 * worker. */
#ifndef PX_DISAGG_H
#define PX_DISAGG_H

#include <stddef.h>
#include <stdint.h>

#include "base/json.h"
#include "proxy/bodyidx.h"
#include "proxy/config.h"
#include "proxy/endpoint.h"
#include "proxy/metrics.h"
#include "proxy/pindex.h"

/* ---------- the decision ---------- */

typedef struct px_disagg {
    px_decision decision;
    int disagg;     /* 1: prefill, then decode; 0: decode alone */
    int estimated;  /* tokens and uncached are set */
    long tokens;    /* the prompt's length in tokens */
    long uncached;  /* how much of it the decode lacks */
    uint64_t *hash; /* owned by the caller (free): the prompt's prefix hashes, to list
                     * for the decode once it has the request (px_pindex_add); or NULL */
    size_t nhash;
} px_disagg;

/* Decides for a request to `ep` with the JSON object body[0..len): decode
 * alone when what the decode lacks of the prompt is under
 * --disagg-min-tokens (always disaggregated when that is 0). The prompt's
 * tokens are exact for a prompt of token ids, else its bytes as the body
 * spells them (the prompt, or the messages with their JSON around the
 * text, standing in for the chat template's tokens) over
 * --disagg-bytes-per-token. The cached part is what `index` lists for the
 * decode whose key_hash is *decode_key, in whole PX_PINDEX_BLOCK_BYTES
 * pieces. `index` NULL or `decode_key` NULL (no decode chosen): nothing
 * counts as cached. */
void px_disagg_decide(const px_config *cfg, px_endpoint ep, const char *body, size_t len,
                      px_pindex *index, const uint64_t *decode_key, px_disagg *out);

/* The prompt's length in tokens as px_disagg_decide estimates it (exact
 * for token ids, else from its bytes over --disagg-bytes-per-token). */
long px_disagg_estimate(const px_config *cfg, px_endpoint ep, const char *body, size_t len);

/* The prompt of a /v1/completions body given as token ids ([1,2,3]):
 * its ids in a new array (*out, the caller frees) and their count. 0 and
 * *out NULL for anything else (text, a batch, ids out of range, more than
 * `max`). */
size_t px_disagg_token_ids(px_endpoint ep, const char *body, size_t len, size_t max,
                           uint32_t **out);

/* The member of the body that holds the prompt ("prompt", "messages",
 * "input", "token_ids" by endpoint): 1 with it in *m, 0 when absent. */
int px_disagg_prompt(px_endpoint ep, const char *body, size_t len, px_json_member *m);
/* The member that holds endpoint ep's prompt. */
px_bkey px_disagg_prompt_key(px_endpoint ep);
/* px_disagg_token_ids on the member px_disagg_prompt found (one parse of
 * the body serves prefix_affinity's key and kv_aware's tokens). */
size_t px_disagg_prompt_ids(px_endpoint ep, const px_json_member *m, size_t max, uint32_t **out);

/* A JSON array of token ids v[0..n) ([1,2,3]): the ids in a new array
 * (*out, the caller frees) and their count; 0 and *out NULL when it is not
 * one or has more than max. */
size_t px_token_list(const char *v, size_t n, size_t max, uint32_t **out);

/* Replaces the estimate in `out` with exact figures: the prompt has
 * `tokens` tokens of which the decode holds `cached` (its KV events). */
void px_disagg_exact(const px_config *cfg, long tokens, long cached, px_disagg *out);

/* The bytes prefix_affinity hashes: the first `max` bytes of the prompt, or
 * of the messages, as the client spelled them (identical requests,
 * identical keys, in every replica). Returns 1 with the span in body, or
 * 0 when the body has neither. */
int px_disagg_key(px_endpoint ep, const char *body, size_t len, size_t max, const char **key,
                  size_t *key_len);

#endif
