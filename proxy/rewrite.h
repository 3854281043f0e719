/* SPDX-License-Identifier: Apache-2.0 */
/* The JSON edits of the P/D flow (docs/ARCHITECTURE.md §1), as pure functions over
 * byte spans: every value the client or the prefill sent is copied as the
 * exact bytes it arrived in. */
#ifndef PX_REWRITE_H
#define PX_REWRITE_H

#include <stddef.h>

#include "base/json.h"
#include "base/util.h"
#include "proxy/bodyidx.h"

/* The kv_transfer_params the proxy sends to prefill. */
#define PX_PREFILL_KV_PARAMS                                                                       \
    "{\"do_remote_decode\":true,\"do_remote_prefill\":false,\"remote_engine_id\":null,"            \
    "\"remote_block_ids\":null,\"remote_host\":null,\"remote_port\":null}"

struct px_body_idx;

/* The rewrites of the client's body take its index (bodyidx.h) as x: built
 * from these very bytes, its member list is copied from without scanning
 * the body again; NULL, or built from other bytes: the body is scanned.
 * The output is the same either way. */

/* Appends to `out` the prefill request built from the client's body (a
 * validated JSON object): its members minus kv_transfer_params, stream,
 * stream_options, max_tokens, max_completion_tokens, min_tokens and
 * min_completion_tokens, then the proxy's kv_transfer_params (with
 * "transfer_id":"<transfer_id>" when transfer_id is not NULL: the id the
 * router mints for both legs of one dispatch, by which vLLM's push
 * connector pairs them; a printable string without quotes or
 * backslashes), "stream":false, "max_tokens":1 and, when the client sent
 * the key, "max_completion_tokens":1. Returns 0, or -1 when body is not an
 * object. */
int px_rewrite_prefill(const char *body, size_t n, const struct px_body_idx *x,
                       const char *transfer_id, px_buf *out);

/* The same for vLLM's /v1/responses (ResponsesRequest): without stream,
 * stream_options, max_output_tokens, background and store, then the
 * proxy's kv_transfer_params, "stream":false, "max_output_tokens":1 and
 * "store":false. */
int px_rewrite_prefill_responses(const char *body, size_t n, const struct px_body_idx *x,
                                 const char *transfer_id, px_buf *out);

/* The same for vLLM's token-in /inference/v1/generate (GenerateRequest):
 * without stream and stream_options, its sampling_params object copied
 * without max_tokens and min_tokens and given "max_tokens":1 (a
 * sampling_params that is absent or no object becomes {"max_tokens":1}). */
int px_rewrite_prefill_generate(const char *body, size_t n, const struct px_body_idx *x,
                                const char *transfer_id, px_buf *out);

/* Appends to `out` the decode request: the client's members minus any
 * kv_transfer_params of its own, then "kv_transfer_params":<kvp> with kvp's
 * bytes as they are (kvp NULL: none added). Returns 0, or -1 when body is
 * not an object. */
int px_rewrite_decode(const char *body, size_t n, const struct px_body_idx *x, const char *kvp,
                      size_t kvp_len, px_buf *out);

/* px_rewrite_decode with prefill's kv_transfer_params (kvp, an object)
 * given "transfer_id":"<transfer_id>": every member of kvp is copied as the
 * exact bytes prefill sent (nested per-group remote_block_ids included),
 * but a transfer_id of its own, which the router's replaces. transfer_id
 * NULL, or kvp NULL or not an object: px_rewrite_decode as is. kl: kvp's
 * members as read already (px_prefill_answer), or NULL: kvp is scanned. */
int px_rewrite_decode_xfer(const char *body, size_t n, const struct px_body_idx *x,
                           const px_member_list *kl, const char *kvp, size_t kvp_len,
                           const char *transfer_id, px_buf *out);

/* Appends to `out` the body with every member whose key decodes to
 * cache_salt removed and "cache_salt":"<salt>" added (tenant.h: the salt
 * is the proxy's, derived from the client's credentials). Returns 0, or -1
 * when body is not an object. */
int px_rewrite_cache_salt(const char *body, size_t n, const struct px_body_idx *x, const char *salt,
                          px_buf *out);

/* A streamed request ("stream": true) that does not ask for usage: its
 * body with "stream_options":{..., "include_usage":true} (the client's
 * other stream options kept, but continuous_usage_stats) appended to `out`,
 * so that decode ends its stream with a usage chunk (which the proxy
 * drops, usage.h) and the tenant's tokens can be counted. Returns 1 when
 * `out` holds that body, 0 when the body goes as it is (not streamed, or
 * usage asked for), -1 when it is not an object. */
int px_rewrite_include_usage(const char *body, size_t n, px_buf *out);

/* 1 when a body begins the way Python's json.loads (json.detect_encoding)
 * reads as a byte-order mark or as UTF-16/UTF-32: an engine's JSON parser
 * would decode it, the proxy's cannot look inside it, so such bodies are
 * refused (RFC 8259 §8.1: JSON between systems is UTF-8 without a BOM). */
int px_body_foreign_encoding(const char *body, size_t n);

/* The body of a request passed through to an engine as it is, except
 * that members whose key decodes to a key the proxy owns
 * (kv_transfer_params) are removed, however spelled (defence in depth: an
 * engine route the proxy does not know may still read them). Returns 0 when
 * the body is to go unchanged (not a JSON object text, or nothing to
 * remove), 1 when `out` holds the body to send instead, -1 when the body
 * looks like a JSON object ('{' first) but is not valid JSON: the engine
 * might read it more leniently than the proxy, so it is refused; -2 when
 * px_body_foreign_encoding() says so. Members named vllm_xargs,
 * sampling_params and extra_args that hold objects lose their own
 * kv_transfer_params the same way (the engine reads them there too). */
int px_rewrite_forwarded(const char *body, size_t n, px_buf *out);

/* Bytes of the members of a request body (a validated JSON object) that an
 * engine renders into the prompt besides the prompt or messages
 * themselves: tools, functions, documents, chat_template and
 * prompt_embeds (however their keys are spelled). The disaggregation
 * estimate adds them; missed, a short question with a long tool list is
 * sent to decode alone, which then runs the long prefill. */
size_t px_rewrite_rendered_bytes(const char *body, size_t n);

typedef enum {
    PX_KVP_OK = 0,            /* an object with remote_request_id */
    PX_KVP_MISSING = 1,       /* absent, null or not an object */
    PX_KVP_NO_REQUEST_ID = 2, /* an object without a usable remote_request_id */
    PX_KVP_BAD_RESPONSE = -1, /* the prefill answer is not a JSON object */
} px_kvp_status;

/* Finds the top-level kv_transfer_params of a prefill answer. On PX_KVP_OK
 * and PX_KVP_NO_REQUEST_ID, kvp and kvp_len span the object's bytes inside
 * resp (borrowed). err receives the parse error for PX_KVP_BAD_RESPONSE. */
px_kvp_status px_extract_kv_params(const char *resp, size_t n, const char **kvp, size_t *kvp_len,
                                   char *err, size_t errlen);

/* px_extract_kv_params that also gives the answer's top-level usage member
 * (usage->val NULL when it has none), found in the same pass over resp. */
px_kvp_status px_extract_prefill_answer(const char *resp, size_t n, const char **kvp,
                                        size_t *kvp_len, px_json_member *usage, char *err,
                                        size_t errlen);

/* A prefill's answer, read once (one pass over its bytes) for everything
 * the request asks of it: whether it names another request (its
 * remote_request_id), decode's kv_transfer_params, --usage-from prefill's
 * usage. The spans are borrowed from the answer's buffer. */
typedef struct px_prefill_answer {
    int read; /* it holds the answer now in its buffer (its reader says when not) */
    px_kvp_status ks;
    const char *kvp; /* kv_transfer_params' bytes (PX_KVP_OK, PX_KVP_NO_REQUEST_ID) */
    size_t kvp_len;
    px_json_member usage; /* val NULL: none */
    px_json_member rid;   /* kv_transfer_params' remote_request_id; val NULL: none */
    px_member_list kvl;   /* kv_transfer_params' members, listed while rid was sought */
    char err[128];        /* PX_KVP_BAD_RESPONSE: why */
} px_prefill_answer;

/* Reads resp[0..n) into *a (px_extract_prefill_answer, plus the id);
 * sets a->read. */
void px_prefill_answer_read(px_prefill_answer *a, const char *resp, size_t n);

#endif
