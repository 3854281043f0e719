/* libFuzzer target: the messages libkvconnector parses off UCX active
 * messages (notification "<id>:<tp>", PULL run lists, DATA headers) and the
 * kv_transfer_params JSON a consumer receives.  First byte picks the parser. */
#include <stdlib.h>
#include <string.h>

#include "kvc_int.h"

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
        kvc_wire_parse_notify(buf, size, &id, &tp);
        break;
    }
    case 1: {
        uint64_t xid;
        kvc_run_t *runs;
        size_t n;
        uint16_t fl;
        if (kvc_wire_parse_pull(buf, size, &xid, &fl, &runs, &n) == KVC_OK) free(runs);
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
