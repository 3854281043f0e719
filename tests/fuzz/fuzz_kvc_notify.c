/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the messages libkvconnector parses off UCX active
 * messages (notification token + "<id>:<tp>", PULL with tokens and run
 * lists, DATA headers, the staged-shm READY, POOL and SLOT headers) and the
 * kv_transfer_params JSON a consumer receives (with its remote_kv_token).
 * First byte picks the parser (modulo 8: 0 notify, 1 PULL, 2 DATA, 3 and 7
 * JSON, 4 READY, 5 POOL, 6 SLOT).  Seeds: messages
 * captured from real transfers (tests/integration/kvc_hostile.c,
 * KVC_CAPTURE_DIR) and a real kvc_publish answer. */
#include <stdlib.h>
#include <string.h>

#include "connector/kvc_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    uint8_t sel = data[0];
    size--;
    uint8_t *buf = malloc(size + 1);
    if (!buf) return 0;
    memcpy(buf, data + 1, size);
    switch (sel % 8) {
    case 0: {
        kvc_span_t id;
        uint32_t tp;
        const uint8_t *tok;
        if (kvc_wire_parse_notify(buf, size, &tok, &id, &tp) == KVC_OK &&
            (tok != buf || id.len == 0 || !kvc_printable((const char *)id.p, id.len)))
            abort();
        break;
    }
    case 1: {
        kvc_wire_pull_t pl;
        if (kvc_wire_parse_pull(buf, size, &pl) == KVC_OK) {
            if (pl.request_id.len == 0) abort();
            volatile uint64_t sink = pl.xfer_token[0] + pl.pub_token[KVC_TOKEN_LEN - 1];
            for (size_t i = 0; i < pl.n; i++)
                sink += pl.runs[i].remote + pl.runs[i].count;
            (void)sink;
            free(pl.runs);
        }
        break;
    }
    case 2: {
        kvc_wire_data_hdr_t h;
        kvc_wire_parse_data_hdr(buf, size, &h);
        break;
    }
    case 4: {
        kvc_wire_ready_t r;
        if (kvc_wire_parse_ready(buf, size, &r) == KVC_OK &&
            (size != KVC_WIRE_READY_LEN || r.h.status || r.h.region == KVC_DATA_END || !r.h.count))
            abort();
        break;
    }
    case 5: {
        /* the rkey's length (the message's data) from the selector's high bits */
        kvc_wire_pool_t p;
        size_t hi = sel >> 3;
        size_t rkey_len = hi == 31 ? KVC_WIRE_MAX_BLOB + 1 : hi == 30 ? 0 : (hi + 1) * 1031;
        if (kvc_wire_parse_pool(buf, size, rkey_len, &p) == KVC_OK &&
            (size != KVC_WIRE_POOL_LEN || !p.len || !p.slot_bytes || p.len % p.slot_bytes ||
             p.base > UINT64_MAX - p.len || !rkey_len || rkey_len > KVC_WIRE_MAX_BLOB))
            abort();
        break;
    }
    case 6: {
        kvc_wire_slot_t m;
        if (kvc_wire_parse_slot(buf, size, &m) == KVC_OK &&
            (size != KVC_WIRE_SLOT_LEN || m.kind < KVC_SLOT_POOL_OK || m.kind > KVC_SLOT_FREE))
            abort();
        break;
    }
    default: {
        buf[size] = '\0'; /* JSON text arrives NUL-terminated */
        kvc_remote_t r;
        char err[128];
        if (kvc_params_parse_json((const char *)buf, &r, err, sizeof(err)) == KVC_OK)
            kvc_remote_cleanup(&r);
        break;
    }
    }
    free(buf);
    return 0;
}
