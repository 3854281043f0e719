/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the proxy's JSON scanner (base/json.c), which decides
 * what a client body is and which keys the proxy strips before forwarding.
 *
 * Invariants: validation never reads out of bounds and its error text is a
 * terminated string; a document that validates as an object iterates to
 * the end without error, every member's spans lie inside the buffer, every
 * value validates alone as the type the iterator reported, and key
 * comparison agrees with decoding the key; px_json_object_find agrees with
 * px_json_validate and px_json_find. */
#include <string.h>

#include "base/json.h"
#include "tests/fuzz/fuzz_common.h"

/* Decodes a validated key and checks px_json_str_eq and px_json_find
 * against the decoded text. */
static void check_key(const char *buf, size_t n, const px_json_member *m) {
    char *dec = malloc(m->key_len + 1);
    if (!dec) abort();
    long dl = px_json_str_decode(m->key, m->key_len, dec, m->key_len + 1);
    /* A valid JSON string decodes, and never grows: an escape is at least
     * as long as the UTF-8 it stands for. */
    FZ_CHECK(dl >= 0 && (size_t)dl <= m->key_len);
    FZ_CHECK(dec[dl] == '\0');
    int ascii = 1;
    for (long i = 0; i < dl; i++)
        if ((unsigned char)dec[i] >= 0x80) ascii = 0;
    if (ascii && strlen(dec) == (size_t)dl) {
        /* str_eq compares with ASCII literals; it must agree with decoding. */
        FZ_CHECK(px_json_str_eq(m->key, m->key_len, dec));
        px_json_member f;
        FZ_CHECK(px_json_find(buf, n, dec, &f) == 1);
        FZ_CHECK(px_json_str_eq(f.key, f.key_len, dec));
        FZ_CHECK(f.start >= m->start); /* the last of duplicates wins */
    }
    static const char *const lits[] = {"kv_transfer_params", "stream", "max_tokens", ""};
    for (size_t i = 0; i < sizeof lits / sizeof *lits; i++) {
        int eq = px_json_str_eq(m->key, m->key_len, lits[i]);
        /* Equal when the decoded key is the literal; an escaped NUL may end
         * the key early, as it does for C consumers (cJSON). */
        int want = strcmp(dec, lits[i]) == 0;
        FZ_CHECK(!want || eq);
        if (eq && !want) FZ_CHECK(0);
    }
    free(dec);
}

static void walk_object(const char *buf, size_t n, const char *obj, size_t len, int depth) {
    px_json_iter it;
    px_json_member m;
    int r, count = 0;
    FZ_CHECK(px_json_iter_init(&it, obj, len) == 0);
    while ((r = px_json_iter_next(&it, &m)) == 1) {
        count++;
        FZ_CHECK(fz_inside(m.start, 1, obj, len) && m.start[0] == '"');
        FZ_CHECK(m.key == m.start + 1);
        FZ_CHECK(fz_inside(m.key, m.key_len + 1, obj, len) && m.key[m.key_len] == '"');
        FZ_CHECK(m.val_len > 0 && fz_inside(m.val, m.val_len, obj, len));
        FZ_CHECK(m.val > m.key + m.key_len);
        FZ_CHECK(px_json_validate(m.val, m.val_len, NULL, 0) == m.type);
        FZ_CHECK(px_json_validate(m.start, m.key_len + 2, NULL, 0) == PX_JSON_STRING);
        if (depth == 0) check_key(buf, n, &m);
        if (m.type == PX_JSON_OBJECT && depth < 8) walk_object(buf, n, m.val, m.val_len, depth + 1);
        if (count > 100000) break;
    }
    /* A validated object iterates without error. */
    FZ_CHECK(r == 0 || count > 100000);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = fz_dup(data, size);
    char err[48];
    memset(err, 'x', sizeof err);
    px_json_type t = px_json_validate(buf, size, err, sizeof err);
    FZ_CHECK(memchr(err, '\0', sizeof err) != NULL);
    if (t == PX_JSON_INVALID)
        FZ_CHECK(err[0] != '\0');
    else
        FZ_CHECK(t >= PX_JSON_OBJECT && t <= PX_JSON_NULL);

    /* One pass (validation and finds together) says what validation and a
     * find per key say. */
    static const char *const keys[] = {"kv_transfer_params", "usage", "a"};
    px_json_member found[3], f;
    FZ_CHECK(px_json_object_find(buf, size, keys, 3, found) == (t == PX_JSON_OBJECT ? 0 : -1));
    for (size_t k = 0; t == PX_JSON_OBJECT && k < 3; k++) {
        int has = px_json_find(buf, size, keys[k], &f);
        FZ_CHECK(has == (found[k].val != NULL));
        FZ_CHECK(!has || (f.val == found[k].val && f.val_len == found[k].val_len));
    }

    if (t == PX_JSON_OBJECT) {
        walk_object(buf, size, buf, size, 0);
    } else {
        /* The iterator meets unvalidated text too (px_json_find on a
         * prefill answer's nested values): it must fail cleanly. */
        px_json_iter it;
        px_json_member m;
        if (px_json_iter_init(&it, buf, size) == 0) {
            int r, k = 0;
            while ((r = px_json_iter_next(&it, &m)) == 1 && k++ < 100000) {
                FZ_CHECK(fz_inside(m.key, m.key_len, buf, size));
                FZ_CHECK(fz_inside(m.val, m.val_len, buf, size));
            }
        }
    }

    /* The raw input as the body of a string: decode into buffers of every
     * small size and one that always fits; str_eq must not overread. */
    size_t cap = size + 1;
    char *out = malloc(cap);
    if (!out) abort();
    long dl = px_json_str_decode(buf, size, out, cap);
    if (dl >= 0) FZ_CHECK((size_t)dl < cap && out[dl] == '\0');
    for (size_t c = 0; c < 8 && c < cap; c++) {
        long l = px_json_str_decode(buf, size, out, c);
        if (l >= 0) FZ_CHECK((size_t)l < c && out[l] == '\0' && l == dl);
    }
    (void)px_json_str_eq(buf, size, "kv_transfer_params");
    free(out);
    free(buf);
    return 0;
}
