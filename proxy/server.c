/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/server.h"

#include <errno.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <netdb.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/http.h"
#include "base/listen.h"
#include "base/log.h"
#include "base/logsink.h"
#include "proxy/admin.h"
#include "proxy/admission.h"
#include "proxy/ctx.h"
#include "proxy/discovery.h"
#include "proxy/dispatch.h"
#include "proxy/dp.h"
#include "proxy/health.h"
#include "proxy/intake.h"
#include "proxy/kvevents.h"
#include "proxy/reload.h"
#include "proxy/request.h"
#include "proxy/routes.h"

/* Commands the control thread posts to workers. */
enum { PX_CMD_DRAIN = 1, PX_CMD_STOP = 2, PX_CMD_RETIRE = 4 };

/* A worker thread: its loop, listener and client connections; what its
 * requests see of it is wc. */
typedef struct px_worker {
    px_wctx wc;
    px_server *srv;           /* borrowed: outlives the worker */
    px_listener *lev;         /* owned; NULL once draining */
    struct event *wake;       /* owned: commands from the control thread */
    int wake_fd;              /* owned eventfd */
    atomic_int cmd;           /* PX_CMD_* bits */
    struct event *drain_poll; /* owned: while draining, exits when idle */
    px_conn_list conns;       /* owned: open client connections */
    px_conn_cfg conn_cfg;
    pthread_t thread;
} px_worker;

struct px_server {
    px_ctx ctx;         /* what requests, health, metrics and the admin API see */
    px_registry reg;    /* the process-wide tables ctx points to */
    px_reloader rl;     /* the generations (control thread) */
    px_admin *admin;    /* owned, or NULL */
    SSL_CTX *tls;       /* owned, or NULL */
    px_worker *workers; /* owned array */
    int nworkers;
    struct event_base *ctl_base; /* owned: the control loop (signals, DNS, health) */
    px_listener *mlev;           /* owned: --metrics-port listener, or NULL */
    px_conn_list mconns;         /* owned: its connections (control thread) */
    px_conn_cfg mconn_cfg;
    atomic_int workers_running;
    pthread_mutex_t live_mu; /* guards live */
    px_addrset *live;        /* owned: the members' addresses as of the last swap */
};

/* ---------- workers ---------- */

static void on_drain_poll(evutil_socket_t fd, short what, void *arg) {
    px_worker *w = arg;
    /* Requests whose client left may still be releasing prefill's blocks. */
    if (w->conns.n == 0 && w->wc.nreqs == 0) event_base_loopbreak(w->wc.base);
}

/* Whether an address belongs to a backend (ctx: the members' px_addrset). */
static int is_backend_addr(void *ctx, const struct sockaddr *sa, socklen_t salen) {
    return px_addrset_has(ctx, sa, salen);
}

static void on_wake(evutil_socket_t fd, short what, void *arg) {
    px_worker *w = arg;
    uint64_t v;
    if (read(fd, &v, sizeof v) < 0 && errno != EAGAIN) return;
    int cmd = atomic_exchange(&w->cmd, 0);
    if (cmd & PX_CMD_STOP) {
        event_base_loopbreak(w->wc.base);
        return;
    }
    if (cmd & PX_CMD_RETIRE) {
        /* The backends changed: connections to those gone close after
         * their last request. */
        pthread_mutex_lock(&w->srv->live_mu);
        px_addrset *live = px_addrset_ref(w->srv->live);
        pthread_mutex_unlock(&w->srv->live_mu);
        px_uploop_retire(w->wc.up, is_backend_addr, live);
        px_addrset_release(live);
    }
    if ((cmd & PX_CMD_DRAIN) && w->lev) {
        /* Stop accepting, answer what is in flight with Connection: close,
         * and leave once no connection is left. */
        px_listener_free(w->lev);
        w->lev = NULL;
        w->conn_cfg.draining = 1;
        px_conn_list_close_idle(&w->conns);
        struct timeval tv = {0, 50000};
        w->drain_poll = event_new(w->wc.base, -1, EV_PERSIST, on_drain_poll, w);
        event_add(w->drain_poll, &tv);
        on_drain_poll(-1, 0, w);
    }
}

static void *worker_main(void *arg) {
    px_worker *w = arg;
    event_base_dispatch(w->wc.base);
    atomic_fetch_sub(&w->srv->workers_running, 1);
    return NULL;
}

static void worker_cleanup(px_worker *w) {
    px_conn_list_close_all(&w->conns);
    px_req_free_all(&w->wc);
    px_spare_drain(&w->wc.spare_reqs);
    px_adm_worker_destroy(w->wc.adm);
    /* Workers cleaned up later still close requests that look at every
     * worker's queue (admission.c, wake_others). */
    w->wc.adm = NULL;
    px_listener_free(w->lev);
    if (w->drain_poll) event_free(w->drain_poll);
    px_uploop_destroy(w->wc.up);
    if (w->wake) event_free(w->wake);
    if (w->wake_fd >= 0) close(w->wake_fd);
    if (w->wc.base) event_base_free(w->wc.base);
}

static void post_cmd(px_server *s, int cmd) {
    for (int i = 0; i < s->nworkers; i++) {
        uint64_t one = 1;
        atomic_fetch_or(&s->workers[i].cmd, cmd);
        if (write(s->workers[i].wake_fd, &one, sizeof one) < 0) continue;
    }
}

/* ---------- setup ---------- */

/* Why the last OpenSSL call failed, as text: a missing or unreadable file
 * is a system error, whose reason OpenSSL has no string for (it printed
 * "(null)"). Empties the error queue. */
static const char *ssl_why(char *buf, size_t n) {
    /* The queue's first entry is the cause (open() failed, no PEM start
     * line); the later ones are the layers above it. */
    unsigned long e, sys = 0, last = 0;
    while ((e = ERR_get_error()))
        if (ERR_SYSTEM_ERROR(e)) {
            if (!sys) sys = e;
        } else if (!last) {
            last = e;
        }
    const char *r = last ? ERR_reason_error_string(last) : NULL;
    if (sys)
        snprintf(buf, n, "%s", strerror(ERR_GET_REASON(sys)));
    else if (r)
        snprintf(buf, n, "%s", r);
    else if (last)
        ERR_error_string_n(last, buf, n);
    else
        snprintf(buf, n, "unknown error");
    return buf;
}

/* --tls-client-ca: clients are asked for a certificate (the CA's names are
 * sent as the acceptable issuers) and it is verified against the bundle;
 * with --tls-client-verify require, a handshake without one fails. */
static int setup_client_verify(px_server *s, char *err, size_t errlen) {
    const px_config *c = s->ctx.cfg;
    if (!c->tls_client_ca[0]) return 0;
    char ca[4096], why[256];
    if (px_cred_path(c->tls_client_ca, "--tls-client-ca", ca, sizeof ca, err, errlen) < 0)
        return -1;
    ERR_clear_error();
    STACK_OF(X509_NAME) *names = SSL_load_client_CA_file(ca);
    if (!names || SSL_CTX_load_verify_locations(s->tls, ca, NULL) != 1) {
        if (names) sk_X509_NAME_pop_free(names, X509_NAME_free);
        snprintf(err, errlen, "--tls-client-ca '%s': %s", ca, ssl_why(why, sizeof why));
        return -1;
    }
    SSL_CTX_set_client_CA_list(s->tls, names);
    int mode = SSL_VERIFY_PEER;
    if (strcmp(c->tls_client_verify, "optional")) mode |= SSL_VERIFY_FAIL_IF_NO_PEER_CERT;
    SSL_CTX_set_verify(s->tls, mode, NULL);
    /* Resumed sessions keep the verified certificate; OpenSSL refuses to
     * resume without a context id once clients are verified. */
    static const unsigned char sid[] = "pdproxy";
    SSL_CTX_set_session_id_context(s->tls, sid, sizeof sid - 1);
    return 0;
}

static int setup_tls(px_server *s, char *err, size_t errlen) {
    const px_config *c = s->ctx.cfg;
    if (!c->tls_cert[0]) return 0;
    char cert[4096], key[4096], why[256];
    if (px_cred_path(c->tls_cert, "--tls-cert", cert, sizeof cert, err, errlen) < 0 ||
        px_cred_path(c->tls_key, "--tls-key", key, sizeof key, err, errlen) < 0)
        return -1;
    s->tls = SSL_CTX_new(TLS_server_method());
    if (!s->tls) goto fail;
    SSL_CTX_set_min_proto_version(s->tls, TLS1_2_VERSION);
    SSL_CTX_set_options(s->tls, SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE);
    ERR_clear_error();
    if (SSL_CTX_use_certificate_chain_file(s->tls, cert) != 1) {
        snprintf(err, errlen, "--tls-cert '%s': %s", cert, ssl_why(why, sizeof why));
        return -1;
    }
    if (SSL_CTX_use_PrivateKey_file(s->tls, key, SSL_FILETYPE_PEM) != 1 ||
        SSL_CTX_check_private_key(s->tls) != 1) {
        snprintf(err, errlen, "--tls-key '%s': %s", key, ssl_why(why, sizeof why));
        return -1;
    }
    return setup_client_verify(s, err, errlen);
fail:
    snprintf(err, errlen, "cannot create the TLS context");
    return -1;
}

/* --metrics-port: /metrics, /health and /ready on a listener of their own,
 * served by the control thread (so a busy worker does not delay a scrape). */
static int setup_metrics_listener(px_server *s, char *err, size_t errlen) {
    const px_config *cfg = s->ctx.cfg;
    if (!cfg->metrics_port) return 0;
    const char *host = cfg->metrics_host[0] ? cfg->metrics_host : cfg->host;
    if (px_listen_port_free(host, (int)cfg->metrics_port, "--metrics-port", err, errlen) < 0)
        return -1;
    s->mconn_cfg = px_ctx_control_conn_cfg(cfg, px_routes_dispatch_local, &s->ctx);
    s->mlev = px_listen(s->ctl_base, host, (int)cfg->metrics_port, 0, "--metrics-port",
                        &s->mconn_cfg, &s->mconns, err, errlen);
    return s->mlev ? 0 : -1;
}

/* Reload's call after a swap: connections to backends the new generation
 * dropped close after their last request. */
static void retire_backends(void *arg) {
    px_server *s = arg;
    /* Built once here, on the control thread, for every worker: the
     * workers' loops only look addresses up. */
    px_addrset *live = px_addrset_create();
    px_gen *g = s->ctx.gen;
    for (size_t i = 0; i < g->nps; i++) {
        px_addrset_add_pool(live, &g->ps[i].prefill);
        px_addrset_add_pool(live, &g->ps[i].decode);
    }
    pthread_mutex_lock(&s->live_mu);
    px_addrset *old = s->live;
    s->live = live;
    pthread_mutex_unlock(&s->live_mu);
    px_addrset_release(old);
    post_cmd(s, PX_CMD_RETIRE);
}

void px_server_set_args(px_server *s, int argc, char **argv, char **envp) {
    s->rl.argc = argc;
    s->rl.argv = argv;
    s->rl.envp = envp;
}

/* A host to listen on that does not resolve fails at px_listen; the check
 * finds it first. */
static int host_resolves(const char *host, const char *what, char *err, size_t errlen) {
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    int rc = getaddrinfo(host, "0", &hints, &res);
    if (res) freeaddrinfo(res);
    if (rc) snprintf(err, errlen, "cannot listen on %s (%s): %s", host, what, gai_strerror(rc));
    return rc ? -1 : 0;
}

/* --check-config: what create() does before its first listener opens, then
 * the listeners' addresses and ports (tested by a bind closed at once). */
static int check_listeners(const px_config *cfg, char *err, size_t errlen) {
    const char *mhost = cfg->metrics_host[0] ? cfg->metrics_host : cfg->host;
    if (host_resolves(cfg->host, "--host", err, errlen) < 0 ||
        (cfg->metrics_port && host_resolves(mhost, "--metrics-host", err, errlen) < 0) ||
        (cfg->admin_port && host_resolves(cfg->admin_host, "--admin-host", err, errlen) < 0))
        return -1;
    if (cfg->metrics_port &&
        px_listen_port_free(mhost, (int)cfg->metrics_port, "--metrics-port", err, errlen) < 0)
        return -1;
    return px_admin_check(cfg, err, errlen);
}

static px_server *create(const px_config *cfg, int check, char *err, size_t errlen);

int px_server_check(const px_config *cfg, char *err, size_t errlen) {
    px_server *s = create(cfg, 1, err, errlen);
    if (!s) return -1;
    px_server_destroy(s);
    return 0;
}

px_server *px_server_create(const px_config *cfg, char *err, size_t errlen) {
    return create(cfg, 0, err, errlen);
}

static px_server *create(const px_config *cfg, int check, char *err, size_t errlen) {
    int shared_fd = -1; /* the workers' one socket without --reuse-port */
    px_server *s = px_xcalloc(1, sizeof *s);
    pthread_mutex_init(&s->live_mu, NULL);
    s->live = px_addrset_create();
    px_http_via_marker(); /* drawn before the workers start */
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    s->nworkers = cfg->threads > 0 ? (int)cfg->threads : (ncpu > 0 ? (int)ncpu : 1);
    s->workers = px_xcalloc((size_t)s->nworkers, sizeof *s->workers);
    s->ctx.workers = px_xcalloc((size_t)s->nworkers, sizeof *s->ctx.workers);
    s->ctx.nworkers = s->nworkers;
    s->reg = (px_registry){px_pf_cache_create(), px_dp_table_create(), px_kv_decls_create()};
    s->ctx.reg = &s->reg;
    for (int i = 0; i < s->nworkers; i++) {
        s->workers[i].wake_fd = -1;
        s->workers[i].wc.ctx = &s->ctx;
        s->ctx.workers[i] = &s->workers[i].wc;
    }
    if (px_ctx_init(&s->ctx, cfg, err, errlen) < 0 || setup_tls(s, err, errlen) < 0) goto err;
    s->ctl_base = event_base_new();
    if (!s->ctl_base) {
        snprintf(err, errlen, "cannot create an event loop");
        goto err;
    }
    if (!cfg->reuse_port &&
        px_listen_port_free(cfg->host, (int)cfg->port, "--port", err, errlen) < 0)
        goto err;
    if (check) {
        /* The generation as start-up builds it (pools, backends that are
         * this proxy, names resolved), then the listeners' settings. */
        s->rl.ctx = &s->ctx;
        s->rl.base = s->ctl_base;
        if (px_reload_start(&s->rl, err, errlen) < 0 || check_listeners(cfg, err, errlen) < 0)
            goto err;
        return s;
    }
    if (setup_metrics_listener(s, err, errlen) < 0) goto err;
    s->rl.ctx = &s->ctx;
    s->rl.base = s->ctl_base;
    s->rl.retired = retire_backends;
    s->rl.arg = s;
    if (px_reload_start(&s->rl, err, errlen) < 0) goto err;
    px_admin_host ah = {.ctx = &s->ctx, .base = s->ctl_base};
    px_reload_admin_calls(&s->rl, &ah);
    if (px_admin_start(&ah, cfg, &s->admin, err, errlen) < 0) goto err;
    for (int i = 0; i < s->nworkers; i++) {
        px_worker *w = &s->workers[i];
        w->srv = s;
        w->conn_cfg = (px_conn_cfg){
            .max_body_bytes = cfg->max_body_bytes,
            .header_timeout = cfg->client_header_timeout,
            .keepalive_timeout = cfg->keepalive_timeout,
            .send_timeout = cfg->send_timeout,
            .shared = &s->ctx.shared,
            .dispatch = px_routes_dispatch,
            .ctx = &w->wc,
            .tls = s->tls,
        };
        struct event_config *ec = event_config_new();
        event_config_set_flag(ec, EVENT_BASE_FLAG_NOLOCK);
        w->wc.base = event_base_new_with_config(ec);
        event_config_free(ec);
        if (!w->wc.base) {
            snprintf(err, errlen, "cannot create an event loop");
            goto err;
        }
        /* With --reuse-port each worker has a socket of its own in the
         * port's SO_REUSEPORT group, which other processes that set it may
         * join. Without it the workers share one socket that has not set
         * it: no other process can ever join. */
        if (cfg->reuse_port) {
            w->lev = px_listen(w->wc.base, cfg->host, (int)cfg->port, 1, "--port", &w->conn_cfg,
                               &w->conns, err, errlen);
        } else {
            if (shared_fd < 0)
                shared_fd = px_listen_socket(cfg->host, (int)cfg->port, "--port", err, errlen);
            w->lev = shared_fd < 0 ? NULL
                                   : px_listen_fd(w->wc.base, shared_fd, cfg->host, (int)cfg->port,
                                                  "--port", &w->conn_cfg, &w->conns, err, errlen);
        }
        if (!w->lev) goto err;
        w->wc.up = px_uploop_create(w->wc.base, (int)cfg->upstream_keepalive);
        w->wc.adm = px_adm_worker_create(&w->wc);
        w->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (!w->wc.up || w->wake_fd < 0) {
            snprintf(err, errlen, "cannot create the upstream loop");
            goto err;
        }
        w->wake = event_new(w->wc.base, w->wake_fd, EV_READ | EV_PERSIST, on_wake, w);
        event_add(w->wake, NULL);
    }
    if (shared_fd >= 0) close(shared_fd); /* each worker holds a duplicate */
    return s;
err:
    if (shared_fd >= 0) close(shared_fd);
    px_server_destroy(s);
    return NULL;
}

/* ---------- the control loop ---------- */

typedef struct control {
    px_server *s;
    struct event_base *base;
    struct event *drain_timer; /* drain-delay, then drain-timeout */
    struct event *exit_poll;
    int phase; /* 0 running, 1 not ready, 2 draining, 3 stopping */
} control;

static void arm(struct event *ev, double seconds) {
    struct timeval tv = {(time_t)seconds, (suseconds_t)((seconds - (double)(time_t)seconds) * 1e6)};
    event_add(ev, &tv);
}

static void on_drain_timer(evutil_socket_t fd, short what, void *arg) {
    control *k = arg;
    if (k->phase == 1) {
        PX_LOG(PX_LOG_INFO,
               "msg=\"drain: no new connections; waiting for requests in flight\" "
               "timeout_s=%g inflight=%ld",
               k->s->ctx.cfg->drain_timeout, atomic_load(&k->s->ctx.inflight));
        k->phase = 2;
        post_cmd(k->s, PX_CMD_DRAIN);
        arm(k->drain_timer, k->s->ctx.cfg->drain_timeout);
    } else if (k->phase == 2) {
        PX_LOG(PX_LOG_WARN, "msg=\"drain timeout: closing what is left\" inflight=%ld",
               atomic_load(&k->s->ctx.inflight));
        k->phase = 3;
        post_cmd(k->s, PX_CMD_STOP);
    }
}

static void on_exit_poll(evutil_socket_t fd, short what, void *arg) {
    control *k = arg;
    if (atomic_load(&k->s->workers_running) == 0) event_base_loopbreak(k->base);
}

static void sighup_done(void *arg, int rc, const char *err, uint64_t gen, double ms) {
    char q[1100];
    if (rc < 0)
        PX_LOG(PX_LOG_ERROR,
               "msg=\"reload on SIGHUP failed; the running configuration stays\" "
               "error=%s",
               px_log_value(err, q, sizeof q));
}

/* Writes every worker's batched access lines and opens --log-file again
 * (log rotation: it was moved away), as nginx does on SIGUSR1 and on a
 * reload. */
static void reopen_log(void) {
    char err[512], q[600];
    if (px_logsink_reopen(err, sizeof err) < 0)
        PX_LOG(PX_LOG_ERROR, "msg=\"cannot reopen the log file; the old one stays in use\" "
                             "error=%s",
               px_log_value(err, q, sizeof q));
}

static void on_sigusr1(evutil_socket_t sig, short what, void *arg) {
    reopen_log();
    PX_LOG(PX_LOG_INFO, "msg=\"SIGUSR1: log reopened\"");
}

/* Reads the --config file again; on any error the running configuration
 * stays and the log says what is wrong (file, line, key). */
static void on_sighup(evutil_socket_t sig, short what, void *arg) {
    control *k = arg;
    reopen_log();
    if (!px_reload_config(&k->s->rl)->config_file[0]) {
        PX_LOG(PX_LOG_INFO, "msg=\"SIGHUP received: nothing to reload (no --config file); "
                            "ignored\"");
        return;
    }
    /* Read on a helper thread: the control loop (signals, health checks,
     * the admin API) goes on meanwhile, and a newer SIGHUP supersedes it. */
    if (px_reload_request(&k->s->rl, sighup_done, NULL) < 0) {
        char err[512];
        if (px_reload(&k->s->rl, 1, NULL, err, sizeof err) < 0) sighup_done(NULL, -1, err, 0, 0);
    }
}

static void on_signal(evutil_socket_t sig, short what, void *arg) {
    control *k = arg;
    if (sig == SIGTERM && k->phase == 0) {
        /* Readiness turns 503 at once; load balancers get drain-delay to
         * notice before the listeners close. */
        PX_LOG(PX_LOG_INFO, "msg=\"SIGTERM: draining\" drain_delay_s=%g drain_timeout_s=%g",
               k->s->ctx.cfg->drain_delay, k->s->ctx.cfg->drain_timeout);
        atomic_store(&k->s->ctx.draining, 1);
        k->phase = 1;
        arm(k->drain_timer, k->s->ctx.cfg->drain_delay);
        return;
    }
    PX_LOG(PX_LOG_INFO, "msg=\"stopping now\" signal=%d", (int)sig);
    atomic_store(&k->s->ctx.draining, 1);
    k->phase = 3;
    post_cmd(k->s, PX_CMD_STOP);
}

int px_server_run(px_server *s) {
    control k = {.s = s};
    k.base = s->ctl_base;
    struct event *sigterm = evsignal_new(k.base, SIGTERM, on_signal, &k);
    struct event *sigint = evsignal_new(k.base, SIGINT, on_signal, &k);
    struct event *sighup = evsignal_new(k.base, SIGHUP, on_sighup, &k);
    struct event *sigusr1 = evsignal_new(k.base, SIGUSR1, on_sigusr1, &k);
    event_add(sigterm, NULL);
    event_add(sigint, NULL);
    event_add(sighup, NULL);
    event_add(sigusr1, NULL);
    k.drain_timer = evtimer_new(k.base, on_drain_timer, &k);
    k.exit_poll = event_new(k.base, -1, EV_PERSIST, on_exit_poll, &k);
    arm(k.exit_poll, 0.05);
    /* Workers must not take the signals: the control loop handles them. */
    sigset_t set, old;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &set, &old);
    atomic_store(&s->workers_running, s->nworkers);
    for (int i = 0; i < s->nworkers; i++)
        pthread_create(&s->workers[i].thread, NULL, worker_main, &s->workers[i]);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    px_health *h = px_health_start(&s->ctx, k.base);
    px_kvsub *kv = px_kvsub_start(&s->ctx, k.base);
    size_t pn = 0, dn = 0;
    for (size_t i = 0; i < s->ctx.gen->nps; i++) {
        size_t n;
        px_pool_counts(&s->ctx.gen->ps[i].prefill, &n, NULL);
        pn += n;
        px_pool_counts(&s->ctx.gen->ps[i].decode, &n, NULL);
        dn += n;
    }
    PX_LOG(PX_LOG_INFO,
           "msg=\"listening\" addr=%s:%lld tls=%s threads=%d pools=%zu prefill_backends=%zu "
           "decode_backends=%zu "
           "prefill_policy=%s decode_policy=%s",
           s->ctx.cfg->host, (long long)s->ctx.cfg->port, s->tls ? "on" : "off", s->nworkers,
           s->ctx.gen->nps, pn, dn, s->ctx.cfg->prefill_policy, s->ctx.cfg->decode_policy);
    px_intake_announce();
    event_base_dispatch(k.base);
    px_health_stop(h);
    px_kvsub_stop(kv);
    for (int i = 0; i < s->nworkers; i++)
        pthread_join(s->workers[i].thread, NULL);
    /* Freeing the signal events gives SIGTERM and SIGINT back their default
     * action: a late second signal (a supervisor repeating its SIGTERM)
     * would then kill a proxy that is already exiting cleanly.  They are
     * ignored from here on, blocked while the handlers change hands. */
    sigset_t stop, prev;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop, &prev);
    event_free(sigterm);
    event_free(sigint);
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    pthread_sigmask(SIG_SETMASK, &prev, NULL);
    event_free(sighup);
    event_free(sigusr1);
    signal(SIGUSR1, SIG_IGN); /* a late rotation must not kill an exiting proxy */
    event_free(k.drain_timer);
    event_free(k.exit_poll);
    PX_LOG(PX_LOG_INFO, "msg=\"stopped\"");
    return 0;
}

void px_server_destroy(px_server *s) {
    if (!s) return;
    for (int i = 0; i < s->nworkers; i++)
        worker_cleanup(&s->workers[i]);
    free(s->workers);
    px_admin_stop(s->admin);
    px_reload_cleanup(&s->rl);
    px_addrset_release(s->live);
    pthread_mutex_destroy(&s->live_mu);
    px_conn_list_close_all(&s->mconns);
    px_listener_free(s->mlev);
    if (s->ctl_base) event_base_free(s->ctl_base);
    if (s->tls) SSL_CTX_free(s->tls);
    px_ctx_cleanup(&s->ctx);
    px_pf_cache_destroy(s->reg.identities);
    px_dp_table_destroy(s->reg.dp);
    px_kv_decls_destroy(s->reg.kv_decls);
    free(s);
}
