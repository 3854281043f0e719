/* SPDX-License-Identifier: Apache-2.0 */
/* A strict, allocation-free JSON scanner (RFC 8259) that works on byte spans.
 *
 * pdproxy never re-serialises the JSON it forwards: values travel as the
 * exact bytes they arrived in, so integers above 2^53, float spellings and
 * string escapes reach the engines unchanged. This module validates a
 * document and walks an object's members as spans of the original text. */
#ifndef PX_JSON_H
#define PX_JSON_H

#include <stddef.h>

typedef enum {
    PX_JSON_INVALID = -1,
    PX_JSON_OBJECT = 1,
    PX_JSON_ARRAY,
    PX_JSON_STRING,
    PX_JSON_NUMBER,
    PX_JSON_TRUE,
    PX_JSON_FALSE,
    PX_JSON_NULL,
} px_json_type;

/* Deepest nesting accepted; deeper documents are rejected, not recursed. */
#define PX_JSON_MAX_DEPTH 256

/* Validates the whole of s[0..n): one value with optional surrounding
 * whitespace, strings valid UTF-8. Returns the root's type, or
 * PX_JSON_INVALID with a reason (and byte offset) written to err. */
px_json_type px_json_validate(const char *s, size_t n, char *err, size_t errlen);

/* One member of an object, as spans of the original text (borrowed). */
typedef struct px_json_member {
    const char *key; /* key text between the quotes, escapes not decoded */
    size_t key_len;
    const char *val; /* the value's exact bytes */
    size_t val_len;
    px_json_type type;
    const char *start; /* the key's opening quote: start..val+val_len is the member */
} px_json_member;

typedef struct px_json_iter {
    const char *p;
    const char *end;
    int done;
} px_json_iter;

/* Starts iterating the object that fills obj[0..n) (leading/trailing space
 * allowed). Returns 0, or -1 when it is not an object. */
int px_json_iter_init(px_json_iter *it, const char *obj, size_t n);

/* Returns 1 with the next member, 0 at the end, -1 on malformed input. */
int px_json_iter_next(px_json_iter *it, px_json_member *m);

/* After px_json_iter_next returned 0: 1 when nothing but whitespace follows
 * the object's closing brace (the object fills its input), else 0. */
int px_json_iter_whole(const px_json_iter *it);

/* Whether a raw (escaped) JSON string body equals the plain text `lit`
 * (ASCII) once its escapes are decoded: "\u0073tream" equals "stream".
 * An escaped NUL ends the string, as it does for engines that decode keys
 * into C strings (cJSON): "stream\u0000x" equals "stream" too, so every
 * spelling some engine reads as `lit` is matched (and stripped). */
int px_json_str_eq_full(const char *raw, size_t len, const char *lit);
/* Most calls compare a key against one that differs in its first byte
 * (a request's keys against a list to strip): that test inline, the rest
 * in px_json_str_eq_full. Unless the raw string's first byte opens an
 * escape, it is the first character; an empty raw string equals only "". */
static inline int px_json_str_eq(const char *raw, size_t len, const char *lit) {
    if (!len) return !*lit;
    if (*raw != '\\' && *raw != *lit) return 0;
    return px_json_str_eq_full(raw, len, lit);
}

/* Finds the LAST member named `key` (duplicate keys resolve as Python's json
 * does). Returns 1 and fills *m, or 0 when absent or obj is not an object. */
int px_json_find(const char *obj, size_t n, const char *key, px_json_member *m);

/* Validates the object that fills obj[0..n) as px_json_validate does and, in
 * the same pass, finds the LAST member named keys[i] (as px_json_find) into
 * found[i] for each of the nkeys keys; found[i].val is NULL for a key that
 * is absent. Returns 0, or -1 when obj is not a valid JSON object (found[]
 * then says nothing; px_json_validate tells why). One pass where a
 * validation and a px_json_find per key would make several. */
int px_json_object_find(const char *obj, size_t n, const char *const *keys, size_t nkeys,
                        px_json_member *found);

/* Decodes a raw JSON string body into UTF-8 at out (at most outcap-1 bytes,
 * NUL-terminated). Returns the decoded length, or -1 when it does not fit or
 * is malformed. */
long px_json_str_decode(const char *raw, size_t len, char *out, size_t outcap);

#endif
