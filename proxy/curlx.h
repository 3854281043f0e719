/* SPDX-License-Identifier: Apache-2.0 */
/* libcurl, loaded on first use. pdproxy's plain-http path never touches
 * libcurl; only https:// backends (and trace export) do. Loading it with
 * dlopen when the first of those needs it keeps libcurl and what it pulls in
 * (GnuTLS, Kerberos, LDAP, p11-kit: ~2.5 MiB of resident pages) out of a
 * proxy that has none. Include this instead of <curl/curl.h>: the curl_*
 * names below then call through the loaded table. */
#ifndef PX_CURLX_H
#define PX_CURLX_H

#define CURL_DISABLE_TYPECHECK /* the names below are macros of ours */
#include <curl/curl.h>

typedef struct px_curl_api {
    CURLcode (*global_init)(long);
    CURL *(*easy_init)(void);
    void (*easy_cleanup)(CURL *);
    CURLcode (*easy_setopt)(CURL *, CURLoption, ...);
    CURLcode (*easy_getinfo)(CURL *, CURLINFO, ...);
    CURLcode (*easy_pause)(CURL *, int);
    const char *(*easy_strerror)(CURLcode);
    CURLcode (*easy_perform)(CURL *);
    CURLM *(*multi_init)(void);
    CURLMcode (*multi_cleanup)(CURLM *);
    CURLMcode (*multi_setopt)(CURLM *, CURLMoption, ...);
    CURLMcode (*multi_add_handle)(CURLM *, CURL *);
    CURLMcode (*multi_remove_handle)(CURLM *, CURL *);
    CURLMcode (*multi_socket_action)(CURLM *, curl_socket_t, int, int *);
    CURLMsg *(*multi_info_read)(CURLM *, int *);
    CURLMcode (*multi_assign)(CURLM *, curl_socket_t, void *);
    struct curl_slist *(*slist_append)(struct curl_slist *, const char *);
    void (*slist_free_all)(struct curl_slist *);
} px_curl_api;

/* Loads libcurl and runs curl_global_init once (thread-safe). Returns the
 * table, or NULL (with one error logged) when libcurl cannot be loaded. */
const px_curl_api *px_curl(void);

/* curl.h maps these three to themselves to count their arguments. */
#undef curl_easy_setopt
#undef curl_easy_getinfo
#undef curl_multi_setopt
#define curl_easy_init px_curl()->easy_init
#define curl_easy_cleanup px_curl()->easy_cleanup
#define curl_easy_setopt px_curl()->easy_setopt
#define curl_easy_getinfo px_curl()->easy_getinfo
#define curl_easy_pause px_curl()->easy_pause
#define curl_easy_strerror px_curl()->easy_strerror
#define curl_easy_perform px_curl()->easy_perform
#define curl_multi_init px_curl()->multi_init
#define curl_multi_cleanup px_curl()->multi_cleanup
#define curl_multi_setopt px_curl()->multi_setopt
#define curl_multi_add_handle px_curl()->multi_add_handle
#define curl_multi_remove_handle px_curl()->multi_remove_handle
#define curl_multi_socket_action px_curl()->multi_socket_action
#define curl_multi_info_read px_curl()->multi_info_read
#define curl_multi_assign px_curl()->multi_assign
#define curl_slist_append px_curl()->slist_append
#define curl_slist_free_all px_curl()->slist_free_all

#endif
