/* SPDX-License-Identifier: Apache-2.0 */
/* Heterogeneous TP (KVC_FETCH_FIELD_SLICE), pure: the part length both
 * sides move per block, and where part p of block b lies in a region.  The
 * producer (push.c) reads its part of each remote block there, the
 * consumer (xfer.c) writes its part of each local block there, for pushed
 * data and one-sided reads alike; a part never reaches outside its block. */
#include "connector/kvc_int.h"

kvc_status_t kvc_slice_len(uint64_t rbl, uint32_t rparts, uint64_t lbl, uint32_t lparts,
                           uint64_t *len) {
    if (rparts == 0 || lparts == 0 || rbl == 0 || lbl == 0 || rbl % rparts || lbl % lparts ||
        rbl / rparts != lbl / lparts)
        return KVC_ERR_INCOMPATIBLE;
    *len = rbl / rparts;
    return KVC_OK;
}

bool kvc_slice_at(uint64_t block_len, uint64_t nblocks, uint64_t b, uint64_t part, uint64_t len,
                  uint64_t *off) {
    /* part * len + len <= block_len, and block b within the region; every
     * product below is then at most nblocks * block_len, the region's
     * length, which the caller has in memory. */
    if (b >= nblocks || len == 0 || len > block_len || part > (block_len - len) / len ||
        nblocks > UINT64_MAX / block_len)
        return false;
    *off = b * block_len + part * len;
    return true;
}
