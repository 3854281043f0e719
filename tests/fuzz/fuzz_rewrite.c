/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the P/D rewrites (proxy/rewrite.c). A client body
 * becomes the prefill and the decode bodies; a prefill answer yields the
 * kv_transfer_params forwarded to decode.
 *
 * Input: <client body> NUL <prefill answer>; without a NUL byte the whole
 * input is used as both.
 *
 * Invariants (the client must never steer decode's remote_host/remote_port,
 * an SSRF vector):
 *   - from a body that is a valid JSON object, both outputs are valid JSON
 *     objects;
 *   - the prefill body has exactly one kv_transfer_params, the proxy's, and
 *     the stream/max_tokens values the proxy sets, none of the client's;
 *   - the decode body has no kv_transfer_params but the prefill's, byte for
 *     byte, and none at all when the prefill sent none;
 *   - every other client member is kept;
 *   - extracted kv_transfer_params lie inside the answer and are an object. */
#include <string.h>

#include "base/json.h"
#include "proxy/bodyidx.h"
#include "proxy/rewrite.h"
#include "tests/fuzz/fuzz_common.h"

static const char *const dropped[] = {
    "kv_transfer_params",    "stream",     "stream_options",       "max_tokens",
    "max_completion_tokens", "min_tokens", "min_completion_tokens"};
#define NDROPPED (sizeof dropped / sizeof *dropped)

/* Index into `dropped` of a key, or -1. */
static int drop_index(const px_json_member *m, size_t ndrop) {
    for (size_t i = 0; i < ndrop; i++)
        if (px_json_str_eq(m->key, m->key_len, dropped[i])) return (int)i;
    return -1;
}

typedef struct counts {
    size_t members;
    size_t per_drop[NDROPPED];
    const char *last_val[NDROPPED];
    size_t last_len[NDROPPED];
} counts;

static void count_members(const char *s, size_t n, counts *c) {
    px_json_iter it;
    px_json_member m;
    int r;
    memset(c, 0, sizeof *c);
    FZ_CHECK(px_json_iter_init(&it, s, n) == 0);
    while ((r = px_json_iter_next(&it, &m)) == 1) {
        c->members++;
        int i = drop_index(&m, NDROPPED);
        if (i >= 0) {
            c->per_drop[i]++;
            c->last_val[i] = m.val;
            c->last_len[i] = m.val_len;
        }
    }
    FZ_CHECK(r == 0);
}

static int span_is(const char *p, size_t n, const char *lit) {
    return p && strlen(lit) == n && memcmp(p, lit, n) == 0;
}

static void check_prefill(const char *body, size_t n, const counts *in) {
    px_buf out;
    px_buf_init(&out);
    FZ_CHECK(px_rewrite_prefill(body, n, NULL, NULL, &out) == 0);
    char *o = fz_dup(out.data, out.len);
    FZ_CHECK(px_json_validate(o, out.len, NULL, 0) == PX_JSON_OBJECT);
    counts c;
    count_members(o, out.len, &c);
    FZ_CHECK(c.per_drop[0] == 1 && span_is(c.last_val[0], c.last_len[0], PX_PREFILL_KV_PARAMS));
    FZ_CHECK(c.per_drop[1] == 1 && span_is(c.last_val[1], c.last_len[1], "false"));
    FZ_CHECK(c.per_drop[2] == 0);
    FZ_CHECK(c.per_drop[3] == 1 && span_is(c.last_val[3], c.last_len[3], "1"));
    FZ_CHECK(c.per_drop[4] == (in->per_drop[4] ? 1u : 0u));
    if (c.per_drop[4]) FZ_CHECK(span_is(c.last_val[4], c.last_len[4], "1"));
    FZ_CHECK(c.per_drop[5] == 0 && c.per_drop[6] == 0);
    size_t in_dropped = 0;
    for (size_t i = 0; i < NDROPPED; i++)
        in_dropped += in->per_drop[i];
    FZ_CHECK(c.members == in->members - in_dropped + 3 + (in->per_drop[4] ? 1 : 0));
    free(o);
    px_buf_cleanup(&out);
}

/* The proxy's own rewrites copy from the body's index (bodyidx.h): built
 * from these bytes it must accept exactly what validates, and every
 * rewrite made from its member list must equal the one that scans. */
static void same_from_index(const char *body, size_t n, const char *kvp, size_t kvp_len) {
    px_body_idx x;
    FZ_CHECK(px_body_idx_build(&x, body, n) == 0);
    for (int f = 0; f < 5; f++) {
        px_buf s, l;
        px_buf_init(&s);
        px_buf_init(&l);
        int rs, rl;
        if (f == 0) {
            rs = px_rewrite_prefill(body, n, NULL, "xfer-f", &s);
            rl = px_rewrite_prefill(body, n, &x, "xfer-f", &l);
        } else if (f == 1) {
            rs = px_rewrite_prefill_generate(body, n, NULL, NULL, &s);
            rl = px_rewrite_prefill_generate(body, n, &x, NULL, &l);
        } else if (f == 2) {
            rs = px_rewrite_prefill_responses(body, n, NULL, NULL, &s);
            rl = px_rewrite_prefill_responses(body, n, &x, NULL, &l);
        } else if (f == 3) {
            rs = px_rewrite_cache_salt(body, n, NULL, "salt", &s);
            rl = px_rewrite_cache_salt(body, n, &x, "salt", &l);
        } else {
            rs = px_rewrite_decode_xfer(body, n, NULL, NULL, kvp, kvp_len, "xfer-f", &s);
            rl = px_rewrite_decode_xfer(body, n, &x, NULL, kvp, kvp_len, "xfer-f", &l);
        }
        FZ_CHECK(rs == 0 && rl == 0 && s.len == l.len && memcmp(s.data, l.data, s.len) == 0);
        px_buf_cleanup(&s);
        px_buf_cleanup(&l);
    }
    /* Decode's copy of prefill's kv_transfer_params from the members
     * listed while the answer was read equals the scanning copy. */
    px_buf ans, s, l;
    px_buf_init(&ans);
    px_buf_init(&s);
    px_buf_init(&l);
    px_buf_appends(&ans, "{\"kv_transfer_params\":");
    px_buf_append(&ans, kvp, kvp_len);
    px_buf_append(&ans, "}", 1);
    px_prefill_answer a;
    px_prefill_answer_read(&a, ans.data, ans.len);
    if (a.kvp) {
        int rs = px_rewrite_decode_xfer(body, n, &x, NULL, a.kvp, a.kvp_len, "xfer-f", &s);
        int rl = px_rewrite_decode_xfer(body, n, &x, &a.kvl, a.kvp, a.kvp_len, "xfer-f", &l);
        FZ_CHECK(rs == 0 && rl == 0 && s.len == l.len && memcmp(s.data, l.data, s.len) == 0);
    }
    px_buf_cleanup(&ans);
    px_buf_cleanup(&s);
    px_buf_cleanup(&l);
}

static void check_decode(const char *body, size_t n, const counts *in, const char *kvp,
                         size_t kvp_len) {
    px_buf out;
    px_buf_init(&out);
    FZ_CHECK(px_rewrite_decode(body, n, NULL, kvp, kvp_len, &out) == 0);
    char *o = fz_dup(out.data, out.len);
    FZ_CHECK(px_json_validate(o, out.len, NULL, 0) == PX_JSON_OBJECT);
    counts c;
    count_members(o, out.len, &c);
    if (kvp) {
        /* Exactly one, the prefill's bytes as they came. */
        FZ_CHECK(c.per_drop[0] == 1);
        FZ_CHECK(c.last_len[0] == kvp_len && memcmp(c.last_val[0], kvp, kvp_len) == 0);
    } else {
        FZ_CHECK(c.per_drop[0] == 0);
    }
    FZ_CHECK(c.members == in->members - in->per_drop[0] + (kvp ? 1 : 0));
    for (size_t i = 1; i < NDROPPED; i++)
        FZ_CHECK(c.per_drop[i] == in->per_drop[i]);
    free(o);
    px_buf_cleanup(&out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *nul = memchr(data, '\0', size);
    size_t blen = nul ? (size_t)(nul - data) : size;
    const uint8_t *a = nul ? nul + 1 : data;
    size_t alen = nul ? size - blen - 1 : size;
    char *body = fz_dup(data, blen);
    char *ans = fz_dup(a, alen);

    /* The prefill answer. */
    const char *kvp = NULL;
    size_t kvp_len = 0;
    char err[64];
    err[0] = '\0';
    px_kvp_status ks = px_extract_kv_params(ans, alen, &kvp, &kvp_len, err, sizeof err);
    FZ_CHECK(ks == PX_KVP_OK || ks == PX_KVP_MISSING || ks == PX_KVP_NO_REQUEST_ID ||
             ks == PX_KVP_BAD_RESPONSE);
    if (ks == PX_KVP_BAD_RESPONSE) FZ_CHECK(err[0] && memchr(err, '\0', sizeof err));
    if (ks == PX_KVP_OK || ks == PX_KVP_NO_REQUEST_ID) {
        FZ_CHECK(fz_inside(kvp, kvp_len, ans, alen));
        FZ_CHECK(px_json_validate(kvp, kvp_len, NULL, 0) == PX_JSON_OBJECT);
    } else {
        kvp = NULL;
    }
    if (ks == PX_KVP_OK) {
        px_json_member rid;
        FZ_CHECK(px_json_find(kvp, kvp_len, "remote_request_id", &rid) == 1);
        FZ_CHECK(rid.type == PX_JSON_STRING && rid.val_len > 2);
    }

    if (px_json_validate(body, blen, NULL, 0) == PX_JSON_OBJECT) {
        counts in;
        count_members(body, blen, &in);
        check_prefill(body, blen, &in);
        check_decode(body, blen, &in, kvp, kvp_len);
        check_decode(body, blen, &in, NULL, 0);
        /* With the router's transfer_id: still one object, whose
         * transfer_id is the router's, the last one an engine reads. */
        px_buf out;
        px_buf_init(&out);
        FZ_CHECK(px_rewrite_decode_xfer(body, blen, NULL, NULL, kvp, kvp_len, "xfer-f", &out) == 0);
        FZ_CHECK(px_json_validate(out.data, out.len, NULL, 0) == PX_JSON_OBJECT);
        px_json_member k, t;
        if (kvp) {
            FZ_CHECK(px_json_find(out.data, out.len, "kv_transfer_params", &k) == 1);
            FZ_CHECK(px_json_find(k.val, k.val_len, "transfer_id", &t) == 1);
            FZ_CHECK(t.val_len == 8 && memcmp(t.val, "\"xfer-f\"", 8) == 0);
        }
        px_buf_cleanup(&out);
        same_from_index(body, blen, kvp, kvp_len);
    } else {
        /* Callers validate first; the rewrites must still fail cleanly. */
        px_body_idx x;
        FZ_CHECK(px_body_idx_build(&x, body, blen) == -1);
        px_buf out;
        px_buf_init(&out);
        (void)px_rewrite_prefill(body, blen, NULL, "xfer-f", &out);
        px_buf_reset(&out);
        (void)px_rewrite_decode(body, blen, NULL, kvp, kvp_len, &out);
        px_buf_cleanup(&out);
    }
    free(body);
    free(ans);
    return 0;
}
