/* SPDX-License-Identifier: Apache-2.0 */
#include "sim/sim_request.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "sim/kvsim.h"

/* A chat message's or a Responses input item's content: a string, or a
 * list of parts with text (null: nothing). `item`: a Responses item, whose
 * content may be absent (tool outputs). Returns an error or NULL. */
static const char *content_text(const cJSON *content, px_buf *out, int item) {
    if (cJSON_IsString(content)) {
        px_buf_appends(out, content->valuestring);
    } else if (cJSON_IsArray(content)) {
        const cJSON *part;
        cJSON_ArrayForEach(part, content) {
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(part, "text");
            if (!cJSON_IsString(t))
                return item ? "input content parts need 'text'" : "message content parts need 'text'";
            px_buf_appends(out, t->valuestring);
        }
    } else if ((content || !item) && !cJSON_IsNull(content)) {
        return item ? "input 'content' must be a string or a list of parts"
                    : "message 'content' must be a string or a list of parts";
    }
    return NULL;
}

/* Appends the prompt's text (completions) or rendered messages (chat).
 * Returns NULL or an error message. */
static const char *prompt_text(int chat, const cJSON *body, int add_generation_prompt,
                               px_buf *out) {
    if (!chat) {
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(body, "prompt");
        if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1) p = cJSON_GetArrayItem(p, 0);
        if (!cJSON_IsString(p)) return "'prompt' must be a string";
        px_buf_appends(out, p->valuestring);
        return NULL;
    }
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(body, "messages");
    if (!cJSON_IsArray(msgs) || cJSON_GetArraySize(msgs) == 0)
        return "'messages' must be a non-empty array";
    const cJSON *m;
    cJSON_ArrayForEach(m, msgs) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (!cJSON_IsString(role)) return "each message needs a string 'role'";
        px_buf_printf(out, "<|%s|>\n", role->valuestring);
        const char *err = content_text(content, out, 0);
        if (err) return err;
        px_buf_appends(out, "\n");
    }
    if (add_generation_prompt) px_buf_appends(out, "<|assistant|>\n");
    return NULL;
}

/* /v1/responses: the instructions (a system turn), then the input: a
 * string (one user turn) or a list of items with a role and a content
 * (a string or parts with text); items without a role (tool outputs,
 * reasoning) are rendered by their type. */
static const char *responses_text(const cJSON *body, px_buf *out) {
    const cJSON *ins = cJSON_GetObjectItemCaseSensitive(body, "instructions");
    if (ins && !cJSON_IsNull(ins)) {
        if (!cJSON_IsString(ins)) return "'instructions' must be a string";
        px_buf_printf(out, "<|system|>\n%s\n", ins->valuestring);
    }
    const cJSON *in = cJSON_GetObjectItemCaseSensitive(body, "input");
    if (cJSON_IsString(in)) {
        px_buf_printf(out, "<|user|>\n%s\n<|assistant|>\n", in->valuestring);
        return NULL;
    }
    if (!cJSON_IsArray(in) || cJSON_GetArraySize(in) == 0)
        return "'input' must be a string or a non-empty list of items";
    const cJSON *it;
    cJSON_ArrayForEach(it, in) {
        if (!cJSON_IsObject(it)) return "each 'input' item must be an object";
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(it, "role");
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(it, "type");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(it, "content");
        if (!cJSON_IsString(role) && !cJSON_IsString(type))
            return "each 'input' item needs a string 'role' or 'type'";
        px_buf_printf(out, "<|%s|>\n", cJSON_IsString(role) ? role->valuestring : type->valuestring);
        const char *err = content_text(content, out, 1);
        if (err) return err;
        const cJSON *o = cJSON_GetObjectItemCaseSensitive(it, "output");
        if (cJSON_IsString(o)) px_buf_appends(out, o->valuestring);
        px_buf_appends(out, "\n");
    }
    px_buf_appends(out, "<|assistant|>\n");
    return NULL;
}

/* /inference/v1/generate: the prompt is token ids already. */
static const char *generate_tokens(const cJSON *body, uint32_t **tok, size_t *ntok) {
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(body, "token_ids");
    if (!cJSON_IsArray(ids)) return "'token_ids' must be a list of integers";
    int n = cJSON_GetArraySize(ids);
    if (n > 1 << 22) return "'token_ids' is too long";
    *tok = n ? px_xmalloc((size_t)n * sizeof **tok) : NULL;
    *ntok = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, ids) {
        if (!cJSON_IsNumber(t) || t->valuedouble < 0 || t->valuedouble > 2147483647.0 ||
            t->valuedouble != (double)(int)t->valuedouble) {
            free(*tok);
            *tok = NULL;
            return "'token_ids' must be a list of integers in 0..2147483647";
        }
        (*tok)[(*ntok)++] = (uint32_t)t->valuedouble;
    }
    return NULL;
}

static int kvp_valid_for_decode(const cJSON *kvp) {
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(kvp, "remote_block_ids");
    const cJSON *eid = cJSON_GetObjectItemCaseSensitive(kvp, "remote_engine_id");
    const cJSON *rid = cJSON_GetObjectItemCaseSensitive(kvp, "remote_request_id");
    const cJSON *host = cJSON_GetObjectItemCaseSensitive(kvp, "remote_host");
    const cJSON *port = cJSON_GetObjectItemCaseSensitive(kvp, "remote_port");
    /* Push mode: registered before prefill publishes, decode learns the
     * blocks when served (the publication's last ones), so none are named. */
    const cJSON *mode = cJSON_GetObjectItemCaseSensitive(kvp, "transfer_mode");
    int push = cJSON_IsString(mode) && !strcmp(mode->valuestring, "push") && !ids;
    return (cJSON_IsArray(ids) || push) && cJSON_IsString(eid) && cJSON_IsString(rid) &&
           cJSON_IsString(host) && cJSON_IsNumber(port);
}

/* A JSON number as a 64-bit seed. Converting a double the integer type
 * cannot hold is undefined behaviour in C, so only integral values in
 * range are converted: negatives wrap as they would in int64_t (what the
 * plain cast did on x86-64), anything else (fractions aside) gives 0. */
static uint64_t seed_from_double(double v) {
    if (v >= 0 && v < 18446744073709551616.0) return (uint64_t)v;
    if (v < 0 && v > -9223372036854775808.0) return (uint64_t)(int64_t)v;
    return 0;
}

int sim_parse_request(int kind, const char *body, size_t len, const char *model, sim_parsed *out,
                      char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    cJSON *doc = cJSON_ParseWithLength(body ? body : "", len);
    if (!cJSON_IsObject(doc)) {
        cJSON_Delete(doc);
        snprintf(err, errlen, "request body must be a JSON object");
        return 400;
    }
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(doc, "model");
    if (m && (!cJSON_IsString(m) || strcmp(m->valuestring, model) != 0)) {
        snprintf(err, errlen, "The model `%.100s` does not exist.",
                 cJSON_IsString(m) ? m->valuestring : "?");
        cJSON_Delete(doc);
        return 404;
    }
    int chat = kind == SIM_KIND_CHAT;
    px_buf text;
    px_buf_init(&text);
    const char *why = kind == SIM_KIND_RESPONSES  ? responses_text(doc, &text)
                      : kind == SIM_KIND_GENERATE ? generate_tokens(doc, &out->tok, &out->ntok)
                                                  : prompt_text(chat, doc, 1, &text);
    if (why) {
        px_buf_cleanup(&text);
        cJSON_Delete(doc);
        snprintf(err, errlen, "%s", why);
        return 400;
    }

    const cJSON *mt;
    const char *mt_name = "max_tokens";
    if (kind == SIM_KIND_RESPONSES) {
        mt_name = "max_output_tokens";
        mt = cJSON_GetObjectItemCaseSensitive(doc, mt_name);
    } else if (kind == SIM_KIND_GENERATE) {
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(doc, "sampling_params");
        if (!cJSON_IsObject(sp)) {
            free(out->tok);
            out->tok = NULL;
            cJSON_Delete(doc);
            snprintf(err, errlen, "'sampling_params' must be an object");
            return 400;
        }
        mt_name = "sampling_params.max_tokens";
        mt = cJSON_GetObjectItemCaseSensitive(sp, "max_tokens");
    } else {
        mt = cJSON_GetObjectItemCaseSensitive(doc, "max_completion_tokens");
        if (!chat || !mt) mt = cJSON_GetObjectItemCaseSensitive(doc, "max_tokens");
    }
    out->max_tokens = 16;
    if (mt && !cJSON_IsNull(mt)) {
        if (!cJSON_IsNumber(mt) || mt->valuedouble < 1 || mt->valuedouble > 100000 ||
            mt->valuedouble != (double)(int)mt->valuedouble) {
            px_buf_cleanup(&text);
            free(out->tok);
            out->tok = NULL;
            out->ntok = 0;
            cJSON_Delete(doc);
            snprintf(err, errlen, "%s must be an integer in 1..100000", mt_name);
            return 400;
        }
        out->max_tokens = (int)mt->valuedouble;
    }
    if (kind != SIM_KIND_GENERATE)
        out->ntok = kvsim_tokenize(text.data ? text.data : "", text.len, &out->tok, 0);
    px_buf_cleanup(&text);
    const cJSON *prev = cJSON_GetObjectItemCaseSensitive(doc, "previous_response_id");
    if (kind == SIM_KIND_RESPONSES && cJSON_IsString(prev))
        out->prev_id = px_xstrdup(prev->valuestring);
    out->stream = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(doc, "stream"));
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(doc, "stream_options");
    out->include_usage = so && cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(so, "include_usage"));
    const cJSON *seed = cJSON_GetObjectItemCaseSensitive(doc, "seed");
    out->seed = cJSON_IsNumber(seed) ? seed_from_double(seed->valuedouble) : 0;

    out->mode = SIM_MODE_LOCAL;
    const cJSON *kvp = cJSON_GetObjectItemCaseSensitive(doc, "kv_transfer_params");
    if (cJSON_IsObject(kvp)) {
        /* vLLM's push connector pairs the legs by it (nixl/utils.py
         * get_transfer_id: a non-empty string, else none). */
        const cJSON *tid = cJSON_GetObjectItemCaseSensitive(kvp, "transfer_id");
        if (cJSON_IsString(tid) && tid->valuestring[0] &&
            strlen(tid->valuestring) < sizeof out->transfer_id)
            snprintf(out->transfer_id, sizeof out->transfer_id, "%s", tid->valuestring);
        out->kvp_no_blocks =
            cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(kvp, "do_remote_prefill")) &&
            !cJSON_GetObjectItemCaseSensitive(kvp, "remote_block_ids");
        if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(kvp, "do_remote_decode"))) {
            out->mode = SIM_MODE_PREFILL;
            /* Push mode: the caller (the proxy) minted the id and token. */
            if (cJSON_IsString(cJSON_GetObjectItemCaseSensitive(kvp, "remote_request_id")) &&
                cJSON_IsString(cJSON_GetObjectItemCaseSensitive(kvp, "remote_kv_token")))
                out->kvp = cJSON_Duplicate(kvp, 1);
        } else if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(kvp, "do_remote_prefill"))) {
            if (kvp_valid_for_decode(kvp)) {
                out->mode = SIM_MODE_DECODE;
                out->kvp = cJSON_Duplicate(kvp, 1);
            } else {
                out->kvp_invalid = 1;
            }
        }
    }
    cJSON_Delete(doc);
    return 0;
}

int sim_parse_tokenize(const char *body, size_t len, const char *model, uint32_t **tok,
                       size_t *ntok, char *err, size_t errlen) {
    *tok = NULL;
    *ntok = 0;
    cJSON *doc = cJSON_ParseWithLength(body ? body : "", len);
    if (!cJSON_IsObject(doc)) {
        cJSON_Delete(doc);
        snprintf(err, errlen, "request body must be a JSON object");
        return 400;
    }
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(doc, "model");
    if (m && !cJSON_IsNull(m) && (!cJSON_IsString(m) || strcmp(m->valuestring, model) != 0)) {
        snprintf(err, errlen, "The model `%.100s` does not exist.",
                 cJSON_IsString(m) ? m->valuestring : "?");
        cJSON_Delete(doc);
        return 404;
    }
    int chat = cJSON_HasObjectItem(doc, "messages");
    if (!chat && !cJSON_HasObjectItem(doc, "prompt")) {
        cJSON_Delete(doc);
        snprintf(err, errlen, "either 'prompt' or 'messages' is required");
        return 400;
    }
    const cJSON *agp = cJSON_GetObjectItemCaseSensitive(doc, "add_generation_prompt");
    const cJSON *cfm = cJSON_GetObjectItemCaseSensitive(doc, "continue_final_message");
    const cJSON *rts = cJSON_GetObjectItemCaseSensitive(doc, "return_token_strs");
    const char *why = NULL;
    if (agp && !cJSON_IsBool(agp))
        why = "'add_generation_prompt' must be a boolean";
    else if (cJSON_IsTrue(cfm) && (!agp || cJSON_IsTrue(agp)))
        why = "Cannot set both `continue_final_message` and `add_generation_prompt` to True.";
    else if (cJSON_IsTrue(rts))
        why = "'return_token_strs' is not supported by engine-sim";
    px_buf text;
    px_buf_init(&text);
    if (!why) why = prompt_text(chat, doc, !agp || cJSON_IsTrue(agp), &text);
    cJSON_Delete(doc);
    if (why) {
        px_buf_cleanup(&text);
        snprintf(err, errlen, "%s", why);
        return 400;
    }
    *ntok = kvsim_tokenize(text.data ? text.data : "", text.len, tok, 0);
    px_buf_cleanup(&text);
    return 0;
}

void sim_parsed_cleanup(sim_parsed *p) {
    free(p->tok);
    free(p->prev_id);
    cJSON_Delete(p->kvp);
    memset(p, 0, sizeof *p);
}

char *sim_kvp_answer(const char *json, int push, size_t num_tokens) {
    cJSON *o = cJSON_Parse(json ? json : "");
    if (!cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return NULL;
    }
    cJSON *ids = cJSON_DetachItemFromObjectCaseSensitive(o, "remote_block_ids");
    cJSON *groups = cJSON_CreateArray();
    if (ids && cJSON_IsArray(cJSON_GetArrayItem(ids, 0))) {
        cJSON_Delete(groups); /* already per group */
        groups = ids;
    } else if (groups) {
        cJSON_AddItemToArray(groups, ids ? ids : cJSON_CreateArray());
    } else {
        cJSON_Delete(ids);
    }
    cJSON_AddItemToObject(o, "remote_block_ids", groups);
    if (!cJSON_HasObjectItem(o, "tp_size")) cJSON_AddNumberToObject(o, "tp_size", 1);
    if (!push) cJSON_AddNumberToObject(o, "dcp_size", 1);
    cJSON_AddNumberToObject(o, "pp_size", 1);
    cJSON_AddNumberToObject(o, "remote_num_tokens", (double)num_tokens);
    if (!push) cJSON_AddNullToObject(o, "remote_blocks_expiry_time");
    cJSON_AddStringToObject(o, "transfer_mode", push ? "push" : "pull");
    char *txt = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return txt;
}
