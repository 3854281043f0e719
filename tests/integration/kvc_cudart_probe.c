/* SPDX-License-Identifier: Apache-2.0 */
/* Registers one CUDA region with the shared libkvconnector and prints the
 * status: on a host without a usable CUDA runtime or driver the library
 * must load, make an agent and refuse the region with KVC_ERR_NO_DEVICE
 * (test_kvc_cudart.sh).  The region's address is never touched: the
 * connector asks CUDA about it first. */
#include "include/kvconnector.h"
#include <stdio.h>

int main(void) {
    kvc_agent_params_t p = {.field_mask = KVC_AGENT_FIELD_ENGINE_ID, .engine_id = "cudart-probe"};
    kvc_agent_t *a = NULL;
    kvc_status_t st = kvc_agent_create(&p, &a);
    if (st != KVC_OK) {
        printf("kvc_agent_create: %s\n", kvc_status_str(st));
        return 1;
    }
    static char fake[4096];
    kvc_region_params_t r = {.field_mask = KVC_REGION_FIELD_BASE | KVC_REGION_FIELD_MEM_TYPE,
                             .len = sizeof fake,
                             .base = fake,
                             .mem_type = KVC_MEM_CUDA};
    st = kvc_agent_register_regions(a, 1, &r, 1);
    printf("register CUDA region: %s\n", kvc_status_str(st));
    kvc_agent_destroy(a);
    return 0;
}
