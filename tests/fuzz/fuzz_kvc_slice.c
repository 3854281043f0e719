/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: heterogeneous-TP slices (KVC_FETCH_FIELD_SLICE), part
 * counts and sizes as a hostile pull or an odd pair of engines would give
 * them.  Input: u32 remote block_len, u32 remote parts, u32 remote part,
 * u32 local block_len, u32 local parts, u32 local part, u8 blocks, u8
 * local blocks, then (remote, local) block id pairs of one byte each.
 * Checked:
 *  - kvc_slice_len accepts exactly the geometries whose parts match
 *    (both block lengths cut evenly, one part length, nothing zero);
 *  - kvc_slice_at puts part p of block b wholly inside block b, and
 *    refuses any part or block that is not there; the parts of one block
 *    tile it;
 *  - a transfer of the pairs, producer part -> consumer part through those
 *    offsets (regions allocated to their exact size: ASan sees a byte
 *    beyond), writes exactly the local parts asked for, with the producer's
 *    bytes, and nothing else of the local region;
 *  - a PULL carrying those parts (KVC_PULL_EXT) round-trips through the
 *    wire encoder and parser, and a part not below its part count is
 *    refused. */
#include <stdlib.h>
#include <string.h>

#include "connector/kvc_int.h"

static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

#define MAX_REGION (1u << 18) /* bytes simulated per region */

static uint8_t pat(uint64_t b, uint64_t i) {
    return (uint8_t)(b * 131 + i * 7 + (i >> 8) + 1);
}

static void check_pull(uint32_t parts, uint32_t part, const uint8_t *pairs, size_t npairs) {
    kvc_run_t runs[8];
    size_t n = npairs < 8 ? npairs : 8;
    for (size_t i = 0; i < n; i++)
        runs[i] = (kvc_run_t){pairs[2 * i], pairs[2 * i + 1], 1};
    kvc_wire_pull_t pl = {.xfer_id = 7,
                          .flags = KVC_PULL_EXT,
                          .tp = parts,
                          .request_id = {(const uint8_t *)"req", 3},
                          .runs = runs,
                          .n = n,
                          .wait_ms = part ^ parts,
                          .parts = parts,
                          .part = part};
    kvc_buf_t b = {0};
    kvc_wire_encode_pull(&b, &pl);
    if (b.failed) abort();
    kvc_wire_pull_t back;
    kvc_status_t st = kvc_wire_parse_pull(b.p, b.len, &back);
    if (parts == 0 || part >= parts) {
        if (st == KVC_OK) abort(); /* an impossible part is refused */
    } else {
        if (st != KVC_OK || back.parts != parts || back.part != part || back.n != n ||
            back.wait_ms != pl.wait_ms)
            abort();
        for (size_t i = 0; i < n; i++)
            if (back.runs[i].remote != runs[i].remote || back.runs[i].local != runs[i].local)
                abort();
        free(back.runs);
    }
    kvc_buf_cleanup(&b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 26) return 0;
    uint64_t rbl = rd32(data), lbl = rd32(data + 12);
    uint32_t rparts = rd32(data + 4), rpart = rd32(data + 8);
    uint32_t lparts = rd32(data + 16), lpart = rd32(data + 20);
    uint64_t rnb = data[24], lnb = data[25];
    const uint8_t *pairs = data + 26;
    size_t npairs = (size - 26) / 2;

    check_pull(rparts, rpart, pairs, npairs);

    /* Any block, part and length: an offset given is inside that block. */
    uint64_t off, anyb = npairs ? pairs[0] : 0;
    if (kvc_slice_at(rbl, rnb, anyb, rpart, lbl, &off) &&
        (anyb >= rnb || off < anyb * rbl || off + lbl > (anyb + 1) * rbl))
        abort();

    uint64_t len = 0;
    bool match = rparts && lparts && rbl && lbl && rbl % rparts == 0 && lbl % lparts == 0 &&
                 rbl / rparts == lbl / lparts;
    kvc_status_t st = kvc_slice_len(rbl, rparts, lbl, lparts, &len);
    if ((st == KVC_OK) != match) abort();
    if (st != KVC_OK) return 0;
    if (len != rbl / rparts || len != lbl / lparts || len == 0) abort();

    /* Where each part lies: inside its block; the parts of a block tile it. */
    uint64_t prev_end = 0;
    for (uint32_t p = 0; p < rparts && p < 64; p++) {
        if (!kvc_slice_at(rbl, 1, 0, p, len, &off) || off != prev_end || off + len > rbl) abort();
        prev_end = off + len;
    }
    if (rparts <= 64 && prev_end != rbl) abort();
    if (kvc_slice_at(rbl, rnb, rnb, 0, len, &off)) abort();        /* block past the region */
    if (kvc_slice_at(rbl, rnb + 1, 0, rparts, len, &off)) abort(); /* part past its block */
    bool rok = kvc_slice_at(rbl, rnb, 0, rpart, len, &off);
    if (rok != (rpart < rparts && rnb > 0)) abort();

    /* A transfer: remote part rpart of each named remote block into local
     * part lpart of each named local block. */
    if (rpart >= rparts || lpart >= lparts || rnb == 0 || lnb == 0 || rnb * rbl > MAX_REGION ||
        lnb * lbl > MAX_REGION)
        return 0;
    uint8_t *remote = malloc(rnb * rbl), *local = malloc(lnb * lbl);
    uint8_t *want = malloc(lnb * lbl);
    if (!remote || !local || !want) abort();
    for (uint64_t b = 0; b < rnb; b++)
        for (uint64_t i = 0; i < rbl; i++)
            remote[b * rbl + i] = pat(b, i);
    memset(local, 0xee, lnb * lbl);
    memset(want, 0xee, lnb * lbl);
    for (size_t k = 0; k < npairs && k < 256; k++) {
        uint64_t rb = pairs[2 * k], lb = pairs[2 * k + 1];
        uint64_t src, dst;
        bool s_ok = kvc_slice_at(rbl, rnb, rb, rpart, len, &src);
        bool d_ok = kvc_slice_at(lbl, lnb, lb, lpart, len, &dst);
        if (s_ok != (rb < rnb) || d_ok != (lb < lnb)) abort();
        if (!s_ok || !d_ok) continue;
        memcpy(local + dst, remote + src, len);
        for (uint64_t i = 0; i < len; i++) /* what part lpart of lb must now hold */
            want[lb * lbl + lpart * len + i] = pat(rb, rpart * len + i);
    }
    if (memcmp(local, want, lnb * lbl)) abort();
    free(remote);
    free(local);
    free(want);
    return 0;
}
