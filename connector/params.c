/* SPDX-License-Identifier: Apache-2.0 */
/* kv_transfer_params: the JSON object a producer returns (docs/ARCHITECTURE.md §1)
 * and the consumer's reading of it, with the publication's token
 * ("remote_kv_token", 32 hex digits).  Unknown keys are ignored; block ids may
 * be a flat list or, as newer engines send, a list of per-group lists (one
 * group only: hybrid models with several groups are refused, INCOMPATIBLE). */
#include "connector/kvc_int.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kvc_remote_cleanup(kvc_remote_t *r) {
    free(r->engine_id);
    free(r->request_id);
    free(r->host);
    free(r->block_ids);
    memset(r, 0, sizeof(*r));
}

char *kvc_params_to_json(const char *engine_id, const char *request_id, const char *host,
                         uint16_t port, const uint64_t *blocks, size_t n, uint32_t tp_size,
                         const uint8_t token[KVC_TOKEN_LEN]) {
    /* Written by hand, not with cJSON numbers: block ids stay exact integers. */
    kvc_buf_t b = {0};
    char num[32];
    cJSON *s;
    char *txt;
    static const char head[] =
        "{\"do_remote_prefill\":true,\"do_remote_decode\":false,\"remote_block_ids\":[";
    kvc_buf_put(&b, head, sizeof(head) - 1);
    for (size_t i = 0; i < n; i++) {
        int k = snprintf(num, sizeof(num), "%s%llu", i ? "," : "", (unsigned long long)blocks[i]);
        kvc_buf_put(&b, num, (size_t)k);
    }
    const char *keys[3] = {
        "],\"remote_engine_id\":", ",\"remote_request_id\":", ",\"remote_host\":"};
    const char *vals[3] = {engine_id, request_id, host};
    for (int i = 0; i < 3; i++) {
        kvc_buf_put(&b, keys[i], strlen(keys[i]));
        s = cJSON_CreateString(vals[i]);
        txt = s ? cJSON_PrintUnformatted(s) : NULL;
        cJSON_Delete(s);
        if (!txt) {
            kvc_buf_cleanup(&b);
            return NULL;
        }
        kvc_buf_put(&b, txt, strlen(txt));
        cJSON_free(txt);
    }
    int k = snprintf(num, sizeof(num), ",\"remote_port\":%u", port);
    kvc_buf_put(&b, num, (size_t)k);
    k = snprintf(num, sizeof(num), ",\"tp_size\":%u", tp_size);
    kvc_buf_put(&b, num, (size_t)k);
    char hex[2 * KVC_TOKEN_LEN + 1];
    kvc_token_hex(token, hex);
    static const char tk[] = ",\"remote_kv_token\":\"";
    kvc_buf_put(&b, tk, sizeof(tk) - 1);
    kvc_buf_put(&b, hex, 2 * KVC_TOKEN_LEN);
    kvc_buf_put(&b, "\"}", 3); /* with the NUL */
    if (b.failed) {
        kvc_buf_cleanup(&b);
        return NULL;
    }
    return (char *)b.p;
}

static bool get_uint(const cJSON *v, uint64_t max, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!(d >= 0) || d > (double)max || floor(d) != d || d >= 9007199254740992.0) return false;
    *out = (uint64_t)d;
    return true;
}

static bool get_str(const cJSON *o, const char *key, char **out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsString(v) || !v->valuestring) return false;
    return (*out = kvc_strdup(v->valuestring)) != NULL;
}

kvc_status_t kvc_params_parse_json(const char *json, kvc_remote_t *r, char *err, size_t errlen) {
    kvc_remote_t t;
    memset(&t, 0, sizeof(t));
    kvc_status_t st = KVC_ERR_INVALID_PARAM;
    cJSON *o = cJSON_Parse(json);
    if (!cJSON_IsObject(o)) {
        snprintf(err, errlen, "not a JSON object");
        goto err_parse;
    }
    if (!get_str(o, "remote_engine_id", &t.engine_id) ||
        !get_str(o, "remote_request_id", &t.request_id) || !get_str(o, "remote_host", &t.host)) {
        snprintf(err, errlen,
                 "missing or non-string remote_engine_id/remote_request_id/remote_host");
        goto err_fields;
    }
    uint64_t v;
    if (!get_uint(cJSON_GetObjectItemCaseSensitive(o, "remote_port"), 65535, &v) || v == 0) {
        snprintf(err, errlen, "remote_port missing or not in 1..65535");
        goto err_fields;
    }
    t.port = (uint16_t)v;
    const cJSON *tok = cJSON_GetObjectItemCaseSensitive(o, "remote_kv_token");
    if (!cJSON_IsString(tok) || kvc_token_parse(tok->valuestring, t.token) != KVC_OK) {
        snprintf(err, errlen, "remote_kv_token missing or not 32 hex digits");
        goto err_fields;
    }
    t.tp_size = 1;
    if (get_uint(cJSON_GetObjectItemCaseSensitive(o, "tp_size"), UINT32_MAX, &v))
        t.tp_size = (uint32_t)v;
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(o, "remote_block_ids");
    if (cJSON_IsArray(ids) && cJSON_IsArray(cJSON_GetArrayItem(ids, 0))) {
        /* Per-group ids.  A hybrid model (several KV-cache groups: full and
         * sliding-window attention, mamba state...) has a block list per
         * group over other regions; fetching only the first group would hand
         * the engine a half-filled cache.  Refused until supported. */
        int groups = cJSON_GetArraySize(ids);
        if (groups != 1) {
            st = KVC_ERR_INCOMPATIBLE;
            snprintf(err, errlen,
                     "remote_block_ids has %d KV-cache groups (hybrid model); only one group is "
                     "supported",
                     groups);
            goto err_fields;
        }
        ids = cJSON_GetArrayItem(ids, 0);
    }
    if (!cJSON_IsArray(ids)) {
        snprintf(err, errlen, "remote_block_ids missing or not a list");
        goto err_fields;
    }
    size_t n = (size_t)cJSON_GetArraySize(ids);
    if (n) {
        t.block_ids = malloc(n * sizeof(uint64_t));
        if (!t.block_ids) {
            st = KVC_ERR_NO_MEMORY;
            snprintf(err, errlen, "out of memory");
            goto err_fields;
        }
    }
    size_t i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, ids) {
        if (!get_uint(it, UINT64_MAX, &t.block_ids[i])) {
            snprintf(err, errlen, "remote_block_ids[%zu] is not a non-negative integer", i);
            goto err_fields;
        }
        i++;
    }
    t.num_blocks = n;
    cJSON_Delete(o);
    *r = t;
    return KVC_OK;

err_fields:
    kvc_remote_cleanup(&t);
err_parse:
    cJSON_Delete(o);
    return st;
}
