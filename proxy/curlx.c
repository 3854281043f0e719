/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/curlx.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>

#include <string.h>

#include "base/log.h"

static px_curl_api api;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static atomic_int ok;

/* dlsym's object pointer into a function pointer, as POSIX allows. */
#define LOAD(field, name)                                                                          \
    do {                                                                                           \
        void *sym = dlsym(h, name);                                                                \
        if (!sym) {                                                                                \
            PX_LOG(PX_LOG_ERROR, "msg=\"libcurl lacks %s: https backends unusable\"", name);       \
            return;                                                                                \
        }                                                                                          \
        memcpy(&api.field, &sym, sizeof sym);                                                      \
    } while (0)

static void load(void) {
    /* The library the build linked against (Debian: libcurl4, OpenSSL). */
    void *h = dlopen("libcurl.so.4", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        PX_LOG(PX_LOG_ERROR, "msg=\"cannot load libcurl: https backends unusable\" error=\"%s\"",
               dlerror());
        return;
    }
    LOAD(global_init, "curl_global_init");
    LOAD(easy_init, "curl_easy_init");
    LOAD(easy_cleanup, "curl_easy_cleanup");
    LOAD(easy_setopt, "curl_easy_setopt");
    LOAD(easy_getinfo, "curl_easy_getinfo");
    LOAD(easy_pause, "curl_easy_pause");
    LOAD(easy_strerror, "curl_easy_strerror");
    LOAD(easy_perform, "curl_easy_perform");
    LOAD(multi_init, "curl_multi_init");
    LOAD(multi_cleanup, "curl_multi_cleanup");
    LOAD(multi_setopt, "curl_multi_setopt");
    LOAD(multi_add_handle, "curl_multi_add_handle");
    LOAD(multi_remove_handle, "curl_multi_remove_handle");
    LOAD(multi_socket_action, "curl_multi_socket_action");
    LOAD(multi_info_read, "curl_multi_info_read");
    LOAD(multi_assign, "curl_multi_assign");
    LOAD(slist_append, "curl_slist_append");
    LOAD(slist_free_all, "curl_slist_free_all");
    if (api.global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        PX_LOG(PX_LOG_ERROR, "msg=\"curl_global_init failed: https backends unusable\"");
        return;
    }
    atomic_store(&ok, 1);
}

const px_curl_api *px_curl(void) {
    pthread_once(&once, load);
    return atomic_load(&ok) ? &api : NULL;
}
