/* SPDX-License-Identifier: Apache-2.0 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "proxy/bodyidx.h"
#include "proxy/rewrite.h"

static void check_prefill(const char *in, const char *want)
{
    px_buf b;
    px_buf_init(&b);
    assert_int_equal(px_rewrite_prefill(in, strlen(in), NULL, NULL, &b), 0);
    assert_string_equal(b.data, want);
    px_buf_cleanup(&b);
}

#define KVP PX_PREFILL_KV_PARAMS

static void test_prefill_rewrite(void **state)
{
    check_prefill("{}", "{\"kv_transfer_params\":" KVP ",\"stream\":false,\"max_tokens\":1}");
    check_prefill("{\"prompt\":\"hi\",\"stream\":true,\"stream_options\":{\"include_usage\":true},"
                  "\"max_tokens\":50,\"min_tokens\":3,\"seed\":18446744073709551615}",
                  "{\"prompt\":\"hi\",\"seed\":18446744073709551615,\"kv_transfer_params\":" KVP
                  ",\"stream\":false,\"max_tokens\":1}");
    /* max_completion_tokens only when the client sent it; min_completion_tokens dropped. */
    check_prefill("{\"messages\":[],\"max_completion_tokens\":9,\"min_completion_tokens\":2}",
                  "{\"messages\":[],\"kv_transfer_params\":" KVP
                  ",\"stream\":false,\"max_tokens\":1,\"max_completion_tokens\":1}");
    /* A client's kv_transfer_params, even spelled with escapes or repeated, is dropped. */
    check_prefill("{\"kv_transfer_params\":{\"remote_host\":\"evil\"},\"a\" : 1,"
                  "\"kv_transfer_\\u0070arams\":{\"x\":1}}",
                  "{\"a\":1,\"kv_transfer_params\":" KVP ",\"stream\":false,\"max_tokens\":1}");
    /* Fuzzer find: an escaped NUL ends a key for cJSON-based engines, which
     * would take the first of these as their kv_transfer_params and stream. */
    check_prefill("{\"kv_transfer_params\\u0000x\":{\"remote_host\":\"evil\"},"
                  "\"stream\\u0000\":true,\"b\":2}",
                  "{\"b\":2,\"kv_transfer_params\":" KVP ",\"stream\":false,\"max_tokens\":1}");
}

/* fn on `in`, scanned and copied from its index: both give `want`. */
static void check_with(int (*fn)(const char *, size_t, const px_body_idx *, const char *, px_buf *),
                       const char *in, const char *want) {
    px_body_idx x;
    assert_int_equal(px_body_idx_build(&x, in, strlen(in)), 0);
    for (int i = 0; i < 2; i++) {
        px_buf b;
        px_buf_init(&b);
        assert_int_equal(fn(in, strlen(in), i ? &x : NULL, NULL, &b), 0);
        px_buf_append(&b, "", 1);
        assert_string_equal(b.data, want);
        px_buf_cleanup(&b);
    }
}

/* /v1/responses: max_output_tokens, not max_tokens (vLLM would ignore
 * that and generate on); no background, no store; the rest as sent. */
static void test_prefill_responses(void **state)
{
    check_with(px_rewrite_prefill_responses,
               "{\"input\":\"hi\",\"stream\":true,\"max_output_tokens\":50,\"store\":true,"
               "\"background\":true,\"previous_response_id\":\"resp_1\","
               "\"kv_transfer_params\":{\"x\":1}}",
               "{\"input\":\"hi\",\"previous_response_id\":\"resp_1\",\"kv_transfer_params\":" KVP
               ",\"stream\":false,\"max_output_tokens\":1,\"store\":false}");
    px_buf b;
    px_buf_init(&b);
    assert_int_equal(px_rewrite_prefill_responses("[1]", 3, NULL, NULL, &b), -1);
    px_buf_cleanup(&b);
}

/* /inference/v1/generate: the limit inside sampling_params. */
static void test_prefill_generate(void **state)
{
    check_with(px_rewrite_prefill_generate,
               "{\"token_ids\":[1,2],\"sampling_params\":{\"temperature\":0,\"max_tokens\":9,"
               "\"min_tokens\":2,\"seed\":7},\"stream\":true}",
               "{\"token_ids\":[1,2],\"kv_transfer_params\":" KVP
               ",\"stream\":false,\"sampling_params\":{\"temperature\":0,\"seed\":7,"
               "\"max_tokens\":1}}");
    check_with(px_rewrite_prefill_generate, "{\"token_ids\":[1]}",
               "{\"token_ids\":[1],\"kv_transfer_params\":" KVP
               ",\"stream\":false,\"sampling_params\":{\"max_tokens\":1}}");
    check_with(px_rewrite_prefill_generate, "{\"token_ids\":[1],\"sampling_params\":null}",
               "{\"token_ids\":[1],\"kv_transfer_params\":" KVP
               ",\"stream\":false,\"sampling_params\":{\"max_tokens\":1}}");
    px_buf b;
    px_buf_init(&b);
    assert_int_equal(px_rewrite_prefill_generate("[1]", 3, NULL, NULL, &b), -1);
    px_buf_cleanup(&b);
}

static void test_prefill_rejects_non_object(void **state)
{
    px_buf b;
    px_buf_init(&b);
    assert_int_equal(px_rewrite_prefill("[1]", 3, NULL, NULL, &b), -1);
    px_buf_cleanup(&b);
}

static void test_decode_rewrite(void **state)
{
    const char *client = "{\"prompt\":\"h\\u00e9\",\"stream\":true,\"kv_transfer_params\":{\"evil\":1}}";
    const char *kvp = "{\"remote_request_id\":\"cmpl-1-0-abcd\",\"n\":9007199254740993,\"f\":1e-7}";
    px_buf b;
    px_buf_init(&b);
    assert_int_equal(px_rewrite_decode(client, strlen(client), NULL, kvp, strlen(kvp), &b), 0);
    assert_string_equal(b.data, "{\"prompt\":\"h\\u00e9\",\"stream\":true,\"kv_transfer_params\":"
                                "{\"remote_request_id\":\"cmpl-1-0-abcd\",\"n\":9007199254740993,"
                                "\"f\":1e-7}}");
    px_buf_reset(&b);
    assert_int_equal(px_rewrite_decode(client, strlen(client), NULL, NULL, 0, &b), 0);
    assert_string_equal(b.data, "{\"prompt\":\"h\\u00e9\",\"stream\":true}");
    px_buf_reset(&b);
    assert_int_equal(px_rewrite_decode("{}", 2, NULL, NULL, 0, &b), 0);
    assert_string_equal(b.data, "{}");
    px_buf_reset(&b);
    assert_int_equal(px_rewrite_decode("{\"kv_transfer_params\":1}", 24, NULL, NULL, 0, &b), 0);
    assert_string_equal(b.data, "{}");
    px_buf_reset(&b);
    const char *nul = "{\"kv_transfer_params\\u0000\":{\"remote_host\":\"evil\"},\"a\":1}";
    assert_int_equal(px_rewrite_decode(nul, strlen(nul), NULL, NULL, 0, &b), 0);
    assert_string_equal(b.data, "{\"a\":1}");
    px_buf_cleanup(&b);
}

/* kv_transfer_params inside the objects where vLLM reads them too:
 * vllm_xargs (merged into extra_args) and a generate request's
 * sampling_params.extra_args; stripped on every leg, the rest as sent. */
static void test_nested_owned_keys(void **state)
{
    check_prefill("{\"vllm_xargs\":{\"kv_transfer_params\":\"x\",\"a\":1},\"m\":1}",
                  "{\"vllm_xargs\":{\"a\":1},\"m\":1,\"kv_transfer_params\":" KVP
                  ",\"stream\":false,\"max_tokens\":1}");
    check_prefill("{\"vllm_xargs\":{\"kv_transfer_\\u0070arams\":\"x\"}}",
                  "{\"vllm_xargs\":{},\"kv_transfer_params\":" KVP
                  ",\"stream\":false,\"max_tokens\":1}");
    /* Untouched bytes when nothing is stripped inside. */
    check_prefill("{\"vllm_xargs\":{ \"a\" : 1 }}",
                  "{\"vllm_xargs\":{ \"a\" : 1 },\"kv_transfer_params\":" KVP
                  ",\"stream\":false,\"max_tokens\":1}");
    check_with(px_rewrite_prefill_generate,
               "{\"token_ids\":[1],\"sampling_params\":{\"max_tokens\":9,\"extra_args\":"
               "{\"kv_transfer_params\":{\"remote_host\":\"169.254.169.254\"},\"k\":2}}}",
               "{\"token_ids\":[1],\"kv_transfer_params\":" KVP
               ",\"stream\":false,\"sampling_params\":{\"extra_args\":{\"k\":2},"
               "\"max_tokens\":1}}");
    const char *gen = "{\"token_ids\":[1],\"sampling_params\":{\"kv_transfer_params\":1,"
                      "\"extra_args\":{\"kv_transfer_params\":{\"remote_host\":\"evil\"}}}}";
    px_buf b;
    px_buf_init(&b);
    assert_int_equal(px_rewrite_decode(gen, strlen(gen), NULL, "{\"r\":1}", 7, &b), 0);
    px_buf_append(&b, "", 1);
    assert_string_equal(b.data, "{\"token_ids\":[1],\"sampling_params\":{\"extra_args\":{}},"
                                "\"kv_transfer_params\":{\"r\":1}}");
    /* Passthrough: rewritten when something nested was stripped... */
    px_buf_reset(&b);
    const char *fw = "{\"vllm_xargs\":{\"kv_transfer_params\":\"x\"},\"input\":\"a\"}";
    assert_int_equal(px_rewrite_forwarded(fw, strlen(fw), &b), 1);
    px_buf_append(&b, "", 1);
    assert_string_equal(b.data, "{\"vllm_xargs\":{},\"input\":\"a\"}");
    /* ...and left alone where no engine reads the key. */
    px_buf_reset(&b);
    const char *other = "{\"metadata\":{\"kv_transfer_params\":1},\"vllm_xargs\":\"s\"}";
    assert_int_equal(px_rewrite_forwarded(other, strlen(other), &b), 0);
    px_buf_cleanup(&b);
}

/* Bodies an engine's json.loads decodes but the proxy cannot read: a
 * byte-order mark, UTF-16 or UTF-32 (json.detect_encoding's rules). */
static void test_foreign_encodings_refused(void **state)
{
    static const struct {
        const char *b;
        size_t n;
    } bad[] = {
        {"\xEF\xBB\xBF{\"kv_transfer_params\":{}}", 25}, /* UTF-8 BOM */
        {"\xFE\xFF\0{", 4},                               /* UTF-16 BE BOM */
        {"\xFF\xFE{\0", 4},                               /* UTF-16 LE BOM, UTF-32 LE's too */
        {"\0\0\xFE\xFF", 4},                             /* UTF-32 BE BOM */
        {"{\0\"\0", 4},                                   /* UTF-16 LE */
        {"\0{\0\"", 4},                                   /* UTF-16 BE */
        {"{\0\0\0", 4},                                   /* UTF-32 LE */
    };
    px_buf b;
    px_buf_init(&b);
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_true(px_body_foreign_encoding(bad[i].b, bad[i].n));
        assert_int_equal(px_rewrite_forwarded(bad[i].b, bad[i].n, &b), -2);
    }
    assert_false(px_body_foreign_encoding("{\"a\":1}", 7));
    assert_false(px_body_foreign_encoding(" {}", 3));
    assert_false(px_body_foreign_encoding("", 0));
    assert_false(px_body_foreign_encoding("--boundary\r\n", 12));
    px_buf_cleanup(&b);
}

/* The router's transfer_id on the prefill leg, in the proxy's
 * kv_transfer_params, on every endpoint's rewrite. */
static void test_prefill_transfer_id(void **state)
{
    static const char want_kvp[] =
        "{\"do_remote_decode\":true,\"do_remote_prefill\":false,\"remote_engine_id\":null,"
        "\"remote_block_ids\":null,\"remote_host\":null,\"remote_port\":null,"
        "\"transfer_id\":\"xfer-1\"}";
    px_buf b;
    px_buf_init(&b);
    const char *in = "{\"prompt\":\"hi\",\"kv_transfer_params\":{\"transfer_id\":\"client\"}}";
    assert_int_equal(px_rewrite_prefill(in, strlen(in), NULL, "xfer-1", &b), 0);
    px_buf_append(&b, "", 1);
    assert_string_equal(b.data, "{\"prompt\":\"hi\",\"kv_transfer_params\":" ""
                                "{\"do_remote_decode\":true,\"do_remote_prefill\":false,"
                                "\"remote_engine_id\":null,\"remote_block_ids\":null,"
                                "\"remote_host\":null,\"remote_port\":null,"
                                "\"transfer_id\":\"xfer-1\"},\"stream\":false,\"max_tokens\":1}");
    assert_null(strstr(b.data, "client"));
    px_buf_reset(&b);
    assert_int_equal(px_rewrite_prefill_responses("{\"input\":\"x\"}", 13, NULL, "xfer-1", &b), 0);
    px_buf_append(&b, "", 1);
    assert_non_null(strstr(b.data, want_kvp));
    px_buf_reset(&b);
    assert_int_equal(px_rewrite_prefill_generate("{\"token_ids\":[1]}", 17, NULL, "xfer-1", &b), 0);
    px_buf_append(&b, "", 1);
    assert_non_null(strstr(b.data, want_kvp));
    px_buf_cleanup(&b);
}

/* Decode gets prefill's kv_transfer_params byte for byte (nested
 * per-group remote_block_ids as vLLM sends them for hybrid models, numbers
 * as written), prefill's own transfer_id replaced by the router's. */
static void test_decode_transfer_id(void **state)
{
    const char *client = "{\"prompt\":\"p\",\"kv_transfer_params\":{\"transfer_id\":\"evil\"}}";
    const char *kvp = "{\"remote_block_ids\":[[1, 2,3],[],[ 7 ]],\"transfer_id\":\"p-echo\","
                      "\"remote_num_tokens\":1e3,\"remote_blocks_expiry_time\":null,"
                      "\"transfer_mode\":\"pull\",\"pp_size\":1,\"dcp_size\":1}";
    px_buf b;
    px_buf_init(&b);
    assert_int_equal(
        px_rewrite_decode_xfer(client, strlen(client), NULL, NULL, kvp, strlen(kvp), "xfer-9", &b),
        0);
    px_buf_append(&b, "", 1);
    assert_string_equal(b.data, "{\"prompt\":\"p\",\"kv_transfer_params\":"
                                "{\"remote_block_ids\":[[1, 2,3],[],[ 7 ]],"
                                "\"remote_num_tokens\":1e3,\"remote_blocks_expiry_time\":null,"
                                "\"transfer_mode\":\"pull\",\"pp_size\":1,\"dcp_size\":1,"
                                "\"transfer_id\":\"xfer-9\"}}");
    px_buf_reset(&b);
    assert_int_equal(
        px_rewrite_decode_xfer(client, strlen(client), NULL, NULL, "{}", 2, "xfer-9", &b), 0);
    px_buf_append(&b, "", 1);
    assert_string_equal(b.data,
                        "{\"prompt\":\"p\",\"kv_transfer_params\":{\"transfer_id\":\"xfer-9\"}}");
    /* No kv_transfer_params from prefill: none to decode, no transfer_id. */
    px_buf_reset(&b);
    assert_int_equal(
        px_rewrite_decode_xfer(client, strlen(client), NULL, NULL, NULL, 0, "xfer-9", &b), 0);
    px_buf_append(&b, "", 1);
    assert_string_equal(b.data, "{\"prompt\":\"p\"}");
    px_buf_cleanup(&b);
}

static void test_extract(void **state)
{
    const char *kvp;
    size_t n;
    char err[64];
    const char *ok = "{\"id\":\"x\",\"kv_transfer_params\":{\"remote_request_id\":\"r:1\",\"b\":[[1],[2]]}}";
    assert_int_equal(px_extract_kv_params(ok, strlen(ok), &kvp, &n, err, sizeof err), PX_KVP_OK);
    assert_int_equal(n, strlen("{\"remote_request_id\":\"r:1\",\"b\":[[1],[2]]}"));
    const char *norid = "{\"kv_transfer_params\":{\"remote_block_ids\":[1]}}";
    assert_int_equal(px_extract_kv_params(norid, strlen(norid), &kvp, &n, err, sizeof err),
                     PX_KVP_NO_REQUEST_ID);
    const char *nullrid = "{\"kv_transfer_params\":{\"remote_request_id\":null}}";
    assert_int_equal(px_extract_kv_params(nullrid, strlen(nullrid), &kvp, &n, err, sizeof err),
                     PX_KVP_NO_REQUEST_ID);
    const char *none = "{\"choices\":[]}";
    assert_int_equal(px_extract_kv_params(none, strlen(none), &kvp, &n, err, sizeof err),
                     PX_KVP_MISSING);
    const char *nul = "{\"kv_transfer_params\":null}";
    assert_int_equal(px_extract_kv_params(nul, strlen(nul), &kvp, &n, err, sizeof err),
                     PX_KVP_MISSING);
    assert_int_equal(px_extract_kv_params("<html>", 6, &kvp, &n, err, sizeof err),
                     PX_KVP_BAD_RESPONSE);
    assert_int_equal(px_extract_kv_params("[]", 2, &kvp, &n, err, sizeof err),
                     PX_KVP_BAD_RESPONSE);
    assert_string_equal(err, "not a JSON object");
    /* Found in the one pass that validates: bytes after the object, or a
     * bad value after the member, still make the answer bad, with the
     * reason px_json_validate gives. */
    char trail[128];
    snprintf(trail, sizeof trail, "%s x", ok);
    assert_int_equal(px_extract_kv_params(trail, strlen(trail), &kvp, &n, err, sizeof err),
                     PX_KVP_BAD_RESPONSE);
    assert_non_null(strstr(err, "trailing data"));
    const char *late = "{\"kv_transfer_params\":{\"remote_request_id\":\"r\"},\"x\":[1,]}";
    assert_int_equal(px_extract_kv_params(late, strlen(late), &kvp, &n, err, sizeof err),
                     PX_KVP_BAD_RESPONSE);
    /* The usage member comes from the same pass (the last one, as JSON
     * readers take it). */
    px_json_member u;
    const char *both = "{\"usage\":1,\"kv_transfer_params\":{\"remote_request_id\":\"r:1\"},"
                       "\"usage\":{\"prompt_tokens\":9}}";
    assert_int_equal(px_extract_prefill_answer(both, strlen(both), &kvp, &n, &u, err, sizeof err),
                     PX_KVP_OK);
    assert_int_equal(u.type, PX_JSON_OBJECT);
    assert_int_equal(u.val_len, strlen("{\"prompt_tokens\":9}"));
    assert_int_equal(px_extract_prefill_answer(none, strlen(none), &kvp, &n, &u, err, sizeof err),
                     PX_KVP_MISSING);
    assert_null(u.val);
}

/* Issue 41: the tenant's cache_salt replaces every spelling of the
 * client's; a stream that does not ask for usage is made to. */
static void test_cache_salt_and_usage(void **state)
{
    (void)state;
    px_buf out;
    px_buf_init(&out);
    const char *b = "{\"cache_salt\":\"mine\",\"m\":1,\"cache_\\u0073alt\":2}";
    px_body_idx x;
    assert_int_equal(px_body_idx_build(&x, b, strlen(b)), 0);
    for (int i = 0; i < 2; i++) { /* scanned, and copied from the index */
        px_buf_reset(&out);
        assert_int_equal(px_rewrite_cache_salt(b, strlen(b), i ? &x : NULL, "abc", &out), 0);
        px_buf_append(&out, "", 1);
        assert_string_equal(out.data, "{\"m\":1,\"cache_salt\":\"abc\"}");
    }
    const struct {
        const char *in, *want; /* want NULL: unchanged */
    } u[] = {
        {"{\"stream\":true}", "{\"stream\":true,\"stream_options\":{\"include_usage\":true}}"},
        {"{\"stream\":true,\"stream_options\":{\"include_usage\":false,\"x\":1,"
         "\"continuous_usage_stats\":true}}",
         "{\"stream\":true,\"stream_options\":{\"x\":1,\"include_usage\":true}}"},
        {"{\"stream\":true,\"stream_options\":null}",
         "{\"stream\":true,\"stream_options\":{\"include_usage\":true}}"},
        {"{\"stream\":true,\"stream_options\":{\"include_usage\":true}}", NULL},
        {"{\"stream\":false}", NULL},
        {"{\"prompt\":\"x\"}", NULL},
    };
    for (size_t i = 0; i < sizeof u / sizeof *u; i++) {
        px_buf_reset(&out);
        int rc = px_rewrite_include_usage(u[i].in, strlen(u[i].in), &out);
        assert_int_equal(rc, u[i].want ? 1 : 0);
        if (!u[i].want) continue;
        px_buf_append(&out, "", 1);
        assert_string_equal(out.data, u[i].want);
    }
    px_buf_cleanup(&out);
}

/* The client body's members, found in the pass that validates it: what
 * px_json_find would find (the last of duplicates, escaped keys), nothing
 * for a body that is no object, and a search of the bytes asked about
 * when they are not the ones indexed (a body rewritten since). */
static void test_body_index(void **state)
{
    (void)state;
    const char *b = "{\"model\":\"a\",\"prompt\":[1,2],\"mod\\u0065l\":\"b\",\"user\":\"u\","
                    "\"sampling_params\":{\"max_tokens\":3}}";
    size_t n = strlen(b);
    px_body_idx x;
    px_json_member m;
    assert_int_equal(px_body_idx_build(&x, b, n), 0);
    for (int k = 0; k < PX_BK_N; k++) {
        px_json_member f;
        int want = px_json_find(b, n, px_bkey_name((px_bkey)k), &f);
        assert_int_equal(px_body_idx_get(&x, (px_bkey)k, b, n, &m), want);
        if (want) assert_ptr_equal(m.val, f.val);
    }
    assert_true(px_body_idx_get(&x, PX_BK_MODEL, b, n, &m));
    assert_memory_equal(m.val, "\"b\"", 3); /* the last "model", escaped or not */
    assert_false(px_body_idx_get(&x, PX_BK_MAX_TOKENS, b, n, &m)); /* nested: not top-level */
    /* Other bytes (a copy, as a rewritten body is): searched, never the index. */
    char copy[256];
    memcpy(copy, b, n + 1);
    memcpy(copy + strlen("{\"model\":\""), "z", 1);
    assert_true(px_body_idx_get(&x, PX_BK_MODEL, copy, n, &m));
    assert_ptr_equal(m.val, copy + (strstr(b, "\"b\"") - b));
    assert_true(px_body_idx_get(&x, PX_BK_USER, copy, n - 1, &m) == px_json_find(copy, n - 1,
                                                                                 "user", &m));
    /* Not an object, or not JSON: no index; lookups search. */
    assert_int_equal(px_body_idx_build(&x, "[1]", 3), -1);
    assert_false(x.ok);
    assert_int_equal(px_body_idx_build(&x, "{\"model\":", 9), -1);
    assert_false(px_body_idx_get(&x, PX_BK_MODEL, "{\"model\":", 9, &m));
    assert_int_equal(px_body_idx_build(&x, NULL, 0), -1);
    assert_false(px_body_idx_get(NULL, PX_BK_MODEL, NULL, 0, &m));
}

/* {"k0":0,...,"k<n-1>":n-1 and then tail: an object with more members
 * than a list holds. */
static void many_members(char *big, size_t cap, int n, const char *tail) {
    size_t o = 0;
    big[o++] = '{';
    for (int i = 0; i < n; i++)
        o += (size_t)snprintf(big + o, cap - o, "%s\"k%d\":%d", i ? "," : "", i, i);
    snprintf(big + o, cap - o, "%s", tail);
}

/* Two rewrites' outputs are byte-equal; both are freed. */
static void same_bytes_then_free(px_buf *s, px_buf *l) {
    assert_int_equal(s->len, l->len);
    assert_memory_equal(s->data, l->data, s->len);
    px_buf_cleanup(s);
    px_buf_cleanup(l);
}

/* The legs' rewrites copied from the index's member list equal the ones
 * that scan the body, for every endpoint's rewrite: whitespace, escaped
 * keys, duplicates, nested owned keys, and a body with more members than
 * the list holds (scanned). A list built from other bytes is never used. */
static void same_both_ways(const char *b) {
    size_t n = strlen(b);
    px_body_idx x;
    const char *kx = "{\"transfer_id\":1,\"b\":2}";
    assert_int_equal(px_body_idx_build(&x, b, n), 0);
    for (int f = 0; f < 7; f++) {
        px_buf s, l;
        px_buf_init(&s);
        px_buf_init(&l);
        int rs = 0, rl = 0;
        switch (f) {
        case 0:
            rs = px_rewrite_prefill(b, n, NULL, "t", &s);
            rl = px_rewrite_prefill(b, n, &x, "t", &l);
            break;
        case 1:
            rs = px_rewrite_prefill_responses(b, n, NULL, NULL, &s);
            rl = px_rewrite_prefill_responses(b, n, &x, NULL, &l);
            break;
        case 2:
            rs = px_rewrite_prefill_generate(b, n, NULL, "t", &s);
            rl = px_rewrite_prefill_generate(b, n, &x, "t", &l);
            break;
        case 3:
            rs = px_rewrite_decode(b, n, NULL, "{\"a\":1}", 7, &s);
            rl = px_rewrite_decode(b, n, &x, "{\"a\":1}", 7, &l);
            break;
        case 4:
            rs = px_rewrite_decode(b, n, NULL, NULL, 0, &s);
            rl = px_rewrite_decode(b, n, &x, NULL, 0, &l);
            break;
        case 6:
            rs = px_rewrite_cache_salt(b, n, NULL, "s\"", &s);
            rl = px_rewrite_cache_salt(b, n, &x, "s\"", &l);
            break;
        default:
            rs = px_rewrite_decode_xfer(b, n, NULL, NULL, kx, strlen(kx), "t", &s);
            rl = px_rewrite_decode_xfer(b, n, &x, NULL, kx, strlen(kx), "t", &l);
        }
        assert_int_equal(rs, 0);
        assert_int_equal(rl, 0);
        same_bytes_then_free(&s, &l);
    }
}

static void test_rewrite_from_index(void **state) {
    (void)state;
    same_both_ways("{}");
    same_both_ways(" { \"model\" : \"m\" ,\n\"prompt\":\"a \\\" b\", \"stream\":true,"
                   "\"max_tokens\" :9, \"str\\u0065am\":false } ");
    same_both_ways(
        "{\"kv_transfer_params\":{\"x\":1},\"vllm_xargs\":{\"kv_transfer_params\":2,"
        "\"k\":3},\"sampling_params\":{\"max_tokens\":5,\"extra_args\":{"
        "\"kv_transfer_params\":1}},\"token_ids\":[1,2],\"model\":\"a\",\"model\":\"b\"}");
    char big[2048];
    many_members(big, sizeof big, PX_BODY_IDX_LIST + 3, ",\"stream\":true}");
    same_both_ways(big);
    px_body_idx x;
    assert_int_equal(px_body_idx_build(&x, big, strlen(big)), 0);
    assert_int_equal(px_body_idx_count(&x, big, strlen(big)), -1); /* too many: scanned */
    /* Built from other bytes (a copy): the copy is scanned, its own members
     * copied, not the indexed body's. */
    const char *b = "{\"model\":\"a\",\"stream\":true}";
    char copy[64];
    memcpy(copy, b, strlen(b) + 1);
    copy[10] = 'z';
    assert_int_equal(px_body_idx_build(&x, b, strlen(b)), 0);
    assert_int_equal(px_body_idx_count(&x, b, strlen(b)), 2);
    assert_int_equal(px_body_idx_count(&x, copy, strlen(copy)), -1);
    px_buf out;
    px_buf_init(&out);
    assert_int_equal(px_rewrite_decode(copy, strlen(copy), &x, NULL, 0, &out), 0);
    assert_string_equal(out.data, "{\"model\":\"z\",\"stream\":true}");
    px_buf_cleanup(&out);
}

/* Decode's kv_transfer_params copied from the members listed while the
 * prefill answer was read equal the ones copied by scanning them: spaces
 * around colons, escaped and duplicate keys, prefill's own transfer_id
 * first, last or twice, nested values, an empty object, and one with more
 * members than the list holds (scanned). The answer's remote_request_id is
 * the last one, as before. */
static void kvp_both_ways(const char *kvp) {
    char ans[4096];
    snprintf(ans, sizeof ans, "{\"id\":\"p\", \"kv_transfer_params\" : %s ,\"usage\":{}}", kvp);
    px_prefill_answer a;
    px_prefill_answer_read(&a, ans, strlen(ans));
    assert_non_null(a.kvp);
    const char *body = "{\"model\":\"m\",\"prompt\":\"p\"}";
    px_buf s, l;
    px_buf_init(&s);
    px_buf_init(&l);
    assert_int_equal(
        px_rewrite_decode_xfer(body, strlen(body), NULL, NULL, a.kvp, a.kvp_len, "t", &s), 0);
    assert_int_equal(
        px_rewrite_decode_xfer(body, strlen(body), NULL, &a.kvl, a.kvp, a.kvp_len, "t", &l), 0);
    same_bytes_then_free(&s, &l);
}

static void test_decode_from_answer_list(void **state) {
    (void)state;
    kvp_both_ways("{}");
    kvp_both_ways(
        "{ \"remote_request_id\" : \"r1\" , \"transfer_id\":\"own\",\"a\":[1,{\"b\":2}]}");
    kvp_both_ways("{\"transfer_id\":\"x\",\"remote_block_ids\":[[1,2],[3]],\"transfer_id\":\"y\"}");
    kvp_both_ways("{\"a\":1,\"transfer\\u005fid\":\"esc\",\"remote_request_id\":\"r\"}");
    char big[2048];
    many_members(big, sizeof big, PX_MEMBER_LIST + 3,
                 ",\"transfer_id\":\"own\",\"remote_request_id\":\"r\"}");
    kvp_both_ways(big);

    px_prefill_answer a;
    const char *ans = "{\"kv_transfer_params\":{\"remote_request_id\":\"first\",\"x\":1,"
                      "\"remote_request_id\":\"last\"}}";
    px_prefill_answer_read(&a, ans, strlen(ans));
    assert_int_equal(a.ks, PX_KVP_OK);
    assert_int_equal(a.rid.val_len, 6);
    assert_memory_equal(a.rid.val, "\"last\"", 6);
    assert_int_equal(px_member_list_count(&a.kvl, a.kvp, a.kvp_len), 3);
    /* A list of other bytes (a copy of kv_transfer_params, changed) is not
     * used: the copy's own members are copied. */
    char copy[128];
    memcpy(copy, a.kvp, a.kvp_len);
    copy[a.kvp_len] = '\0';
    copy[22] = 'F'; /* "first" -> "First" */
    assert_int_equal(px_member_list_count(&a.kvl, copy, a.kvp_len), -1);
    px_buf out;
    px_buf_init(&out);
    assert_int_equal(px_rewrite_decode_xfer("{}", 2, NULL, &a.kvl, copy, a.kvp_len, "t", &out), 0);
    assert_string_equal(out.data,
                        "{\"kv_transfer_params\":{\"remote_request_id\":\"First\",\"x\":1,"
                        "\"remote_request_id\":\"last\",\"transfer_id\":\"t\"}}");
    px_buf_cleanup(&out);
    /* An answer without kv_transfer_params lists nothing. */
    px_prefill_answer_read(&a, "{\"usage\":{}}", 12);
    assert_int_equal(a.ks, PX_KVP_MISSING);
    assert_int_equal(px_member_list_count(&a.kvl, "{}", 2), -1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefill_rewrite),
        cmocka_unit_test(test_prefill_rejects_non_object),
        cmocka_unit_test(test_prefill_responses),
        cmocka_unit_test(test_prefill_generate),
        cmocka_unit_test(test_decode_rewrite),
        cmocka_unit_test(test_prefill_transfer_id),
        cmocka_unit_test(test_decode_transfer_id),
        cmocka_unit_test(test_extract),
        cmocka_unit_test(test_nested_owned_keys),
        cmocka_unit_test(test_foreign_encodings_refused),
        cmocka_unit_test(test_cache_salt_and_usage),
        cmocka_unit_test(test_body_index),
        cmocka_unit_test(test_rewrite_from_index),
        cmocka_unit_test(test_decode_from_answer_list),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
