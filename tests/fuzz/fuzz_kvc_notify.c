/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the messages libkvconnector parses off UCX active
 * messages (notification token + "<id>:<tp>", PULL with tokens and run
 * lists, DATA headers) and the kv_transfer_params JSON a consumer receives
 * (with its remote_kv_token).  First byte picks the parser.  Seeds: messages
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
    switch (sel % 4) {
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
