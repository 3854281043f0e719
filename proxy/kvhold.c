/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/kvhold.h"

#include <string.h>

#include "base/json.h"

void px_kvhold_init(px_kvhold *k) {
    memset(k, 0, sizeof *k);
    px_buf_init(&k->held);
}

void px_kvhold_cleanup(px_kvhold *k) {
    px_buf_cleanup(&k->held);
    k->active = 0;
}

int px_kvhold_wanted(const px_kvhold *k, int status, int sse) {
    return !k->retried && (status == 500 || (status == 200 && sse));
}

void px_kvhold_start(px_kvhold *k, int sse) {
    k->active = 1;
    k->sse = sse;
}

int px_kvhold_is_generation_error(const char *p, size_t n) {
    static const char want[] = "\"InternalServerError\"";
    px_json_member e, t;
    return px_json_find(p, n, "error", &e) && e.type == PX_JSON_OBJECT &&
           px_json_find(e.val, e.val_len, "type", &t) && t.val_len == sizeof want - 1 &&
           !memcmp(t.val, want, sizeof want - 1);
}

/* The held answer so far: 1 when it is a failed KV load, 0 when it is
 * not, -1 when more is needed to tell. `whole`: the answer ended. */
static int classify(const px_kvhold *k, int whole) {
    const char *p = k->held.data ? k->held.data : "";
    size_t n = k->held.len;
    char err[8];
    if (!k->sse) {
        if (!whole && n < PX_KVHOLD_MAX) return -1;
        return whole && px_json_validate(p, n, err, sizeof err) == PX_JSON_OBJECT &&
               px_kvhold_is_generation_error(p, n);
    }
    /* The first event, whole: "data: {...}" up to its blank line. */
    const char *end = NULL;
    for (size_t i = 0; i + 1 < n; i++)
        if (p[i] == '\n' && p[i + 1] == '\n') {
            end = p + i;
            break;
        }
    if (!end) return whole || n >= PX_KVHOLD_MAX ? 0 : -1;
    if (n < 6 || memcmp(p, "data: ", 6)) return 0;
    size_t len = (size_t)(end - p) - 6;
    return px_json_validate(p + 6, len, err, sizeof err) == PX_JSON_OBJECT &&
           px_kvhold_is_generation_error(p + 6, len);
}

int px_kvhold_feed(px_kvhold *k, const char *p, size_t n) {
    px_buf_append(&k->held, p, n);
    int v = classify(k, 0);
    if (v > 0) k->failed = 1;
    return v;
}

int px_kvhold_end(const px_kvhold *k, int whole) {
    return k->failed ? 1 : whole ? classify(k, 1) : 0;
}

void px_kvhold_take(px_kvhold *k, px_buf *out) {
    *out = k->held;
    px_buf_init(&k->held);
    k->active = 0;
}

void px_kvhold_retry(px_kvhold *k) {
    px_buf_reset(&k->held);
    k->active = 0;
    k->failed = 0;
    k->retried = 1;
}
