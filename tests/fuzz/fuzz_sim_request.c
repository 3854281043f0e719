/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: engine-sim's request parsing (sim/sim_request.c, cJSON),
 * alone and behind the proxy's rewrites.
 *
 * Input: first byte: bit 0 picks /v1/chat/completions over /v1/completions;
 * the rest is the request body.
 *
 * Beyond memory safety, this checks what the proxy promises an engine that
 * parses JSON differently from the proxy (cJSON: first duplicate wins,
 * C strings for keys): whatever a client sends, the decode body the proxy
 * builds never puts the engine in decode mode with the client's
 * kv_transfer_params (SSRF toward remote_host), and the prefill body puts
 * it in prefill mode, not streaming, with max_tokens 1. */
#include <string.h>

#include "base/json.h"
#include "proxy/rewrite.h"
#include "sim/sim_request.h"
#include "tests/fuzz/fuzz_common.h"

#define MODEL "fuzz-model"

/* What the proxy would forward from a well-behaved prefill. */
static const char good_kvp[] =
    "{\"do_remote_prefill\":true,\"do_remote_decode\":false,\"remote_block_ids\":[1,2],"
    "\"remote_engine_id\":\"p0\",\"remote_request_id\":\"cmpl-x-1\","
    "\"remote_host\":\"10.0.0.7\",\"remote_port\":5600,\"tp_size\":1}";

static int parse(int kind, const char *body, size_t len, sim_parsed *p) {
    char err[256];
    memset(err, 'x', sizeof err);
    char *b = fz_dup(body, len);
    int st = sim_parse_request(kind, b, len, MODEL, p, err, sizeof err);
    free(b);
    FZ_CHECK(st == 0 || st == 400 || st == 404);
    if (st) {
        FZ_CHECK(memchr(err, '\0', sizeof err) != NULL && err[0] != '\0');
        FZ_CHECK(p->tok == NULL && p->kvp == NULL && p->prev_id == NULL);
        return st;
    }
    FZ_CHECK(p->max_tokens >= 1 && p->max_tokens <= 100000);
    FZ_CHECK(p->ntok == 0 || p->tok != NULL);
    /* Token-in generate takes the client's ids as they are. */
    for (size_t i = 0; kind != SIM_KIND_GENERATE && i < p->ntok; i++)
        FZ_CHECK(p->tok[i] >= 1 && p->tok[i] <= 32000);
    if (kind != SIM_KIND_RESPONSES) FZ_CHECK(p->prev_id == NULL);
    FZ_CHECK(p->mode == SIM_MODE_LOCAL || p->mode == SIM_MODE_PREFILL ||
             p->mode == SIM_MODE_DECODE);
    if (p->mode != SIM_MODE_DECODE) FZ_CHECK(p->kvp == NULL);
    if (p->kvp_invalid) FZ_CHECK(p->mode == SIM_MODE_LOCAL);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    int chat = data[0] & 3; /* SIM_KIND_*: completions, chat, responses, generate */
    const char *body = (const char *)data + 1;
    size_t len = size - 1;

    sim_parsed p;
    parse(chat, body, len, &p);
    sim_parsed_cleanup(&p);

    /* The same body behind the proxy, which forwards only valid objects. */
    char *b = fz_dup(body, len);
    if (px_json_validate(b, len, NULL, 0) == PX_JSON_OBJECT) {
        px_buf out;
        px_buf_init(&out);

        if (chat == SIM_KIND_RESPONSES)
            px_rewrite_prefill_responses(b, len, NULL, NULL, &out);
        else if (chat == SIM_KIND_GENERATE)
            px_rewrite_prefill_generate(b, len, NULL, NULL, &out);
        else
            px_rewrite_prefill(b, len, NULL, NULL, &out);
        if (parse(chat, out.data, out.len, &p) == 0) {
            FZ_CHECK(p.mode == SIM_MODE_PREFILL);
            FZ_CHECK(!p.stream && p.max_tokens == 1);
        }
        sim_parsed_cleanup(&p);

        /* Prefill answered without kv_transfer_params: decode must
         * recompute, never fetch from where the client pointed. */
        px_buf_reset(&out);
        px_rewrite_decode(b, len, NULL, NULL, 0, &out);
        if (parse(chat, out.data, out.len, &p) == 0) {
            FZ_CHECK(p.mode == SIM_MODE_LOCAL && !p.kvp_invalid);
        }
        sim_parsed_cleanup(&p);

        /* Prefill's params present: decode fetches from prefill's host. */
        px_buf_reset(&out);
        px_rewrite_decode(b, len, NULL, good_kvp, sizeof good_kvp - 1, &out);
        if (parse(chat, out.data, out.len, &p) == 0) {
            FZ_CHECK(p.mode == SIM_MODE_DECODE && p.kvp != NULL);
            const cJSON *host = cJSON_GetObjectItemCaseSensitive(p.kvp, "remote_host");
            const cJSON *port = cJSON_GetObjectItemCaseSensitive(p.kvp, "remote_port");
            FZ_CHECK(cJSON_IsString(host) && strcmp(host->valuestring, "10.0.0.7") == 0);
            FZ_CHECK(cJSON_IsNumber(port) && port->valuedouble == 5600);
        }
        sim_parsed_cleanup(&p);
        px_buf_cleanup(&out);
    }
    free(b);
    return 0;
}
