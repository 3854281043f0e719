/* SPDX-License-Identifier: Apache-2.0 */
/* The client body's top-level members that the proxy reads (its model,
 * prompt, user, cache_salt, limits, priority), found in the one pass that
 * validates the body: intake, admission and routing look them up here
 * instead of each scanning the body again. Spans borrowed from the body:
 * valid while the request holds it. */
#ifndef PX_BODYIDX_H
#define PX_BODYIDX_H

#include <stddef.h>
#include <stdint.h>

#include "base/json.h"

typedef enum {
    PX_BK_MODEL,
    PX_BK_USER,
    PX_BK_PROMPT,   /* completions */
    PX_BK_MESSAGES, /* chat, messages */
    PX_BK_INPUT,    /* responses */
    PX_BK_TOKEN_IDS, /* generate */
    PX_BK_CACHE_SALT,
    PX_BK_SAMPLING_PARAMS,
    PX_BK_MAX_TOKENS,
    PX_BK_MAX_COMPLETION_TOKENS,
    PX_BK_MAX_OUTPUT_TOKENS,
    PX_BK_PRIORITY,
    PX_BK_N
} px_bkey;

/* Every top-level member in order, for the legs' rewrites (rewrite.c),
 * which copy the body member by member: with the list they do not scan it
 * again (twice per request, prompt included). Offsets into the body; a
 * body with more members, or past 4 GiB, is not listed (scanned). */
#define PX_BODY_IDX_LIST 24
typedef struct px_body_span {
    uint32_t start, key, key_len, val, val_len, type;
} px_body_span;

typedef struct px_body_idx {
    int ok;          /* built from a body that is a valid JSON object, still held */
    const char *src; /* that body's bytes: a lookup on others searches them */
    size_t len;
    px_json_member m[PX_BK_N];
    unsigned nlist; /* members listed; PX_BODY_IDX_LIST + 1: not listed */
    px_body_span list[PX_BODY_IDX_LIST];
} px_body_idx;

/* Validates body[0..n) as a JSON object and finds its members (the last
 * of duplicates, as px_json_find). Returns 0, or -1 (x->ok 0) when it is
 * not a valid object: px_json_validate says why. */
int px_body_idx_build(px_body_idx *x, const char *body, size_t n);

/* The member named by k: 1 with *m set, 0 when absent. x NULL, not ok,
 * or built from other bytes than body[0..n) (a body rewritten since):
 * the answer is px_json_find's on body[0..n). A body rewritten in place
 * must be indexed again (px_body_idx_build). */
int px_body_idx_get(const px_body_idx *x, px_bkey k, const char *body, size_t n,
                    px_json_member *m);

/* The number of members of body[0..n) listed in x, in order, or -1 when x
 * is NULL, not ok, built from other bytes or has no list: the caller
 * iterates the body itself then. */
int px_body_idx_count(const px_body_idx *x, const char *body, size_t n);

/* Member i (< px_body_idx_count) as px_json_iter_next returns it. */
void px_body_idx_member(const px_body_idx *x, unsigned i, px_json_member *m);

/* A span as a member of the bytes at base, and back. */
void px_body_span_set(px_body_span *s, const char *base, const px_json_member *m);
void px_body_span_get(const px_body_span *s, const char *base, px_json_member *m);

/* The members of another JSON object, listed in order while read once
 * (prefill's kv_transfer_params, read for its remote_request_id), so that
 * the copy made of it member by member for decode does not scan it again.
 * Offsets into src[0..len); an object with more members, or past 4 GiB,
 * is not listed. */
#define PX_MEMBER_LIST 16
typedef struct px_member_list {
    const char *src;
    size_t len;
    unsigned n; /* members listed; PX_MEMBER_LIST + 1: not listed */
    px_body_span s[PX_MEMBER_LIST];
} px_member_list;
void px_member_list_start(px_member_list *l, const char *src, size_t len);
void px_member_list_add(px_member_list *l, const px_json_member *m);
/* The number of members of obj[0..n) listed in l, or -1 when l is NULL,
 * lists other bytes or did not list them all. */
int px_member_list_count(const px_member_list *l, const char *obj, size_t n);

/* The key of k as it stands in a body ("model"). */
const char *px_bkey_name(px_bkey k);

#endif
