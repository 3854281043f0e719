/* SPDX-License-Identifier: Apache-2.0 */
/* Exact prompt tokens from the engines: the body of vLLM's POST /tokenize
 * for a request ({"model","prompt"} for completions, {"model","messages"}
 * for chat: vllm/entrypoints/openai/protocol.py, TokenizeCompletionRequest
 * and TokenizeChatRequest), its answer's "tokens" (TokenizeResponse: count,
 * max_model_len, tokens), and a bounded per-worker cache of the answers
 * keyed by the prompt's bytes. The request itself is an upstream exchange
 * of the request that needs it (request.c), on the worker's loop. */
#ifndef PX_TOKENIZE_H
#define PX_TOKENIZE_H

#include <stddef.h>
#include <stdint.h>

#include "base/util.h"
#include "proxy/endpoint.h"
#include "proxy/metrics.h"

/* Appends to out the /tokenize body for a request to `ep` with the JSON
 * object body[0..len), and sets *key to the cache key of its prompt.
 * Returns 0, or -1 when the request has no prompt to tokenize (token ids
 * already, an endpoint without a prompt). */
int px_tokenize_body(px_endpoint ep, const char *body, size_t len, px_buf *out, uint64_t *key);

/* The "tokens" of a /tokenize answer: a new array in *out (the caller
 * frees) and its count; -1 when the answer has none or more than max. */
long px_tokenize_parse(const char *body, size_t len, size_t max, uint32_t **out);

typedef struct px_tokcache px_tokcache;
/* At most `entries` prompts of at most `max_tokens` tokens each. */
px_tokcache *px_tokcache_create(size_t entries, size_t max_tokens);
void px_tokcache_destroy(px_tokcache *c); /* NULL is a no-op */
/* A copy of the tokens cached for key (the caller frees), and their count;
 * -1 when none. */
long px_tokcache_get(px_tokcache *c, uint64_t key, uint32_t **out);
/* Keeps a copy (a longer prompt than max_tokens is not kept). */
void px_tokcache_put(px_tokcache *c, uint64_t key, const uint32_t *tok, size_t n);

/* The most of an engine's /tokenize answer read, and of the tokens taken. */
#define PX_TOKENIZE_MAX_ANSWER (16u << 20)
#define PX_TOKENIZE_MAX_TOKENS (1u << 20)

/* A request's prompt (to `ep`, the JSON object body[0..len)) in the
 * worker's cache (*c, made on first use with `entries` entries of at most
 * 65,536 tokens): 1 with a copy of its tokens in *tok (the caller frees)
 * and their count in *ntok; 0 when an engine is to be asked, with the
 * /tokenize body appended to `out` and the prompt's cache key in *key; -1
 * when the request has no prompt to tokenize. */
int px_tokenize_lookup(px_tokcache **c, size_t entries, px_endpoint ep, const char *body,
                       size_t len, px_buf *out, uint64_t *key, uint32_t **tok, size_t *ntok);

/* An engine's /tokenize answer for the prompt of `key`: `rc_ok` (the
 * transfer completed) or `timed_out`, its status and body. The tokens go
 * to *tok and *ntok, and into the cache; returns how the call went (the
 * metrics' result). */
px_tokresult px_tokenize_answer(px_tokcache *c, uint64_t key, int rc_ok, int timed_out, int status,
                                const px_buf *resp, uint32_t **tok, size_t *ntok);

#endif
