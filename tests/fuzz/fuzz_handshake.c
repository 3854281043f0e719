/* libFuzzer target: the side-channel messages libkvconnector parses from the
 * network (header, HELLO, HANDSHAKE), exactly as peer.c feeds them.  The
 * input is copied into an exact-size heap buffer so any overread trips ASan. */
#include <stdlib.h>
#include <string.h>

#include "kvc_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    memcpy(buf, data, size);
    kvc_wire_hdr_t h;
    if (kvc_wire_parse_hdr(buf, size, KVC_WIRE_MAX_BODY, &h) == KVC_OK &&
        size >= KVC_WIRE_HDR_LEN + (size_t)h.body_len) {
        const uint8_t *body = buf + KVC_WIRE_HDR_LEN;
        if (h.type == KVC_MSG_HELLO) {
            kvc_span_t id, addr;
            kvc_wire_parse_hello(body, h.body_len, &id, &addr);
        } else {
            kvc_wire_hs_t hs;
            if (kvc_wire_parse_handshake(body, h.body_len, &hs) == KVC_OK) {
                /* touch what the consumer reads */
                volatile uint64_t sink = hs.num_blocks;
                for (uint32_t i = 0; i < hs.n_regions; i++)
                    sink += hs.regions[i].base + hs.regions[i].rkey.len +
                            (hs.regions[i].rkey.len ? hs.regions[i].rkey.p[0] : 0);
                (void)sink;
                kvc_wire_hs_cleanup(&hs);
            }
        }
    }
    /* The body parser alone, on the raw input (no header). */
    kvc_wire_hs_t hs;
    if (kvc_wire_parse_handshake(buf, size, &hs) == KVC_OK) kvc_wire_hs_cleanup(&hs);
    free(buf);
    return 0;
}
