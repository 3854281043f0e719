/* SPDX-License-Identifier: Apache-2.0 */
/* One upstream exchange of a client request: the call to an engine's
 * /tokenize, the prefill leg or the decode leg. A leg owns what it sends
 * (body, header lines), what it keeps of the answer, and its attempts: the
 * backend of the attempt in flight (chosen from its pool, with kv_aware's
 * charge and a data-parallel rank), the transfer, the backends tried,
 * retries with a jittered backoff inside one deadline, its timer (that
 * backoff, a grace to answer, or the idle limit), the outcome of each
 * attempt and the one hand-back of its backend. It maps a failed answer
 * to the client's status and words. It reports to its owner through a
 * callback table and knows nothing of the request: what an answer means
 * for the request is the owner's to decide (request.c's state machine).
 * Worker thread only. */
#ifndef PX_LEG_H
#define PX_LEG_H

#include <stddef.h>
#include <stdint.h>

#include "base/util.h"
#include "proxy/ctx.h"
#include "proxy/route.h"
#include "proxy/upstream.h"

typedef enum { PX_LEG_TOKENIZE = 0, PX_LEG_PREFILL, PX_LEG_DECODE } px_leg_role;

#define PX_LEG_MAX_TRIES 16

/* What a leg tells its owner (`owner` as given to px_leg_init). head, data
 * and done are the transfer's (upstream.h: they run inside its callbacks
 * and must not cancel or resume it); by then the leg has noted the status
 * and Content-Type (head), and has let go of the transfer and its rank,
 * and stopped its idle timer (done): the backend is still held, for the
 * owner to hand back with px_leg_done. data NULL: the answer is kept in
 * the leg's `resp`, up to its max_resp (past it too_big is set and the
 * transfer aborted). retry, grace and idle are the leg's timer: a backoff
 * over (px_leg_backoff), a grace over (px_leg_grace), and no byte within
 * idle_s (px_leg_touch): the transfer is then cancelled and the backend
 * handed back as timed out before idle is called. */
typedef struct px_leg_cbs {
    void (*head)(void *owner, int status, const char *ctype);
    int (*data)(void *owner, const char *p, size_t n);
    void (*done)(void *owner, px_up_result rc, const char *why, int connected);
    void (*retry)(void *owner);
    void (*grace)(void *owner);
    void (*idle)(void *owner);
} px_leg_cbs;

typedef struct px_leg {
    px_leg_role role;
    int rank;              /* the attempt's data-parallel rank (dp.h) on b, -1: none */
    px_wctx *w;            /* borrowed: the worker */
    px_pool *pool;         /* borrowed: where its backends come from; NULL: not yet known */
    const px_leg_cbs *cbs; /* borrowed: static tables; the owner may swap them */
    void *owner;           /* borrowed */
    const char *lid;       /* borrowed: the request's id as a logfmt value, for log lines */
    const char *rid;       /* borrowed: the X-Request-Id sent, which answers must echo (or NULL) */
    px_backend *b;         /* owned reference while an attempt holds it */
    px_upstream *up;       /* owned: the attempt's transfer in flight */
    char name[128];        /* the last attempt's backend, for logs after the hand-back */
    px_backend *tried[PX_LEG_MAX_TRIES]; /* identity only, never dereferenced */
    size_t ntried;
    long charge;       /* prompt tokens charged on b (kv_aware's load) */
    px_buf hdrs;       /* owned: header lines of its requests */
    px_buf body;       /* owned: what it sends */
    px_buf resp;       /* owned: the answer, when kept (cbs->data NULL) */
    size_t max_resp;   /* the most of an answer kept */
    int status;        /* the answer's status; 0: none yet */
    char ctype[128];   /* its Content-Type ("application/json" when it had none) */
    uint64_t t_start;  /* when its first attempt left; 0: never */
    uint64_t t_end;    /* when its answer ended the leg (prefill); 0: not yet */
    uint64_t deadline; /* every attempt ends by then; 0: no deadline */
    double idle_s;     /* px_leg_touch's limit; 0: none */
    uint64_t idle_since_ns;
    struct event *timer; /* owned */
    char span[17];       /* its span id (otlp.h), "" without */
    unsigned char timer_kind;
    unsigned char https;   /* the last attempt's backend's scheme, for the spans' url.full */
    unsigned char named;   /* b is the backend the request named (px_leg_take) */
    unsigned char too_big; /* the answer passed max_resp */
    unsigned char busy;    /* the engine answered that its queue is full: no failure */
    unsigned char beside;  /* prefill under --dispatch concurrent: decode waits for its KV */
} px_leg;

/* Sets up a leg of `role` for worker w, reporting to owner; lid: the
 * request's id for log lines (borrowed). The leg must be zeroed (its
 * owner's calloc). Its span id is drawn; a prefill
 * keeps answers of up to 8 MiB, a decode goes idle after
 * --decode-idle-timeout. */
void px_leg_init(px_leg *l, px_leg_role role, px_wctx *w, const px_leg_cbs *cbs, void *owner,
                 const char *lid);
/* Stops everything (px_leg_stop as cancelled) and frees what it owns. */
void px_leg_cleanup(px_leg *l);

/* The role's name: "tokenize", "prefill", "decode". */
const char *px_leg_role_name(px_leg_role role);

/* Chooses the backend of the next attempt from l->pool with `k` (the
 * tried ones excluded; kv_aware's charge kept). Returns it (held in l->b),
 * or NULL when none can be chosen (*nmembers: how many there are). */
px_backend *px_leg_pick(px_leg *l, px_pick k, size_t *nmembers);
/* Holds b (a reference taken by the caller or here with `take`) for the
 * next attempt: a backend named by the request, counted as a pick. */
void px_leg_take(px_leg *l, px_backend *b);
/* Tokenize: any healthy, undrained member of `pool`, the one `key` names
 * first, with a reference and no in-flight count. NULL: none. */
px_backend *px_leg_pick_any(px_leg *l, px_pool *pool, uint64_t key);

/* Sends an attempt to l->b: method, path, body (NULL: none; a decode's is
 * tracked for px_leg_abort_after_upload), the header lines `hdrs` (NULL:
 * none), within `total` seconds (0: no limit; with a deadline, what is
 * left of it). Notes the backend's name and scheme and the attempt among
 * the tried. Returns 0; -1 when it cannot start, PX_LEG_PAST when the
 * deadline has passed: nothing will be called back then, and the backend
 * is still held. */
#define PX_LEG_PAST (-2)
int px_leg_send(px_leg *l, const char *method, const char *path, const px_buf *body,
                const px_buf *hdrs, double total);

/* Keeps p[0..n) of the answer in l->resp; -1 (too_big set) past max_resp. */
int px_leg_keep(px_leg *l, const char *p, size_t n);

/* The prefill leg's answer ended it: t_end, and the prefill histogram's
 * observation since the request's start t0. */
void px_leg_answered(px_leg *l, uint64_t t0);

/* Takes back the kv_aware charge on the backend held, which stays held. */
void px_leg_uncharge(px_leg *l);
/* The one hand-back of the attempt's backend: its kv_aware charge taken
 * back, then counted with outcome o (an attempt on a backend this leg
 * tried before is not one more failure toward --unhealthy-after);
 * tokenize's is only released. No-op without a backend. */
void px_leg_done(px_leg *l, px_outcome o);
/* Ends whatever runs: the transfer cancelled (nothing called back), the
 * rank and the timer let go, the backend handed back with o. */
void px_leg_stop(px_leg *l, px_outcome o);

/* How the attempt went: the transfer's result and the answer's status
 * (too_big: a server error). */
px_outcome px_leg_outcome(const px_leg *l, px_up_result rc);
/* Whether the leg's 2xx answer, whose remote_request_id is `rid` (read
 * from it: px_prefill_answer_read), names another request than `id` (an
 * engine's late extra answer, px_upstream_answer_foreign): counted and
 * logged when it does. */
int px_leg_answer_foreign(px_leg *l, const px_json_member *rid, const char *id);
/* A failed attempt (outcome o; rc and why: the transfer's) is retried,
 * with at most `retries` retries: when refused, reset or 5xx, and its
 * answer fit. Then it is logged and counted, its answer dropped, and the
 * jittered backoff armed (px_leg_backoff). Returns 1 when it is. */
int px_leg_retry(px_leg *l, px_outcome o, long long retries, px_up_result rc, const char *why);
/* An attempt the backend never saw (`connected` 0) goes to another member
 * while untried members remain: logged and counted. Returns 1 when it may. */
int px_leg_resend(px_leg *l, int connected, const char *why);
/* Arms the jittered backoff before the next attempt: 10 ms doubling per
 * attempt up to 320 ms, half to one and a half of it; cbs->retry then. */
void px_leg_backoff(px_leg *l);
/* How long a prefill leg is let answer once nothing else waits for it
 * (decode answered, or the client left): concurrent.c and release.c. */
#define PX_LEG_ANSWER_GRACE_US 2000000
/* Arms a grace of `us` microseconds; cbs->grace then. */
void px_leg_grace(px_leg *l, long us);
/* Notes a byte (or the start): no byte for idle_s ends the attempt
 * (cbs->idle). Armed once; a byte only notes the time. The leg notes each
 * answer head and delivery itself. */
void px_leg_touch(px_leg *l);

/* The client's status and message (cap bytes) for a failed answer: an
 * answer too big (502), a failed transfer (502, 504 for a timeout), or an
 * engine's status that is not passed on (502, 508 for a loop). */
int px_leg_error(const px_leg *l, px_up_result rc, const char *why, char *msg, size_t cap);
/* The status (504) and message for an attempt that went idle past idle_s
 * (px_leg_touch): the client reading nothing (`client_paused`), no
 * answer head, or a stall after `bytes_out` bytes. */
int px_leg_idle_error(const px_leg *l, int client_paused, size_t bytes_out, char *msg, size_t cap);
/* The message for an engine's 4xx answer relayed as a status only:
 * "<role> NAME answered HTTP N" and the engine's words when its answer
 * was an OpenAI (or vLLM) error object. */
void px_leg_rejection(const px_leg *l, char *msg, size_t cap);

/* The transfer in flight (upstream.h): from inside cbs->head only, a
 * header of the answer; whether the engine has started answering; abort
 * once the request is sent (1: it is already); resume a paused answer. */
int px_leg_header(px_leg *l, const char *name, char *out, size_t cap);
int px_leg_answering(px_leg *l);
int px_leg_abort_after_upload(px_leg *l);
void px_leg_resume(px_leg *l);

/* The message of an engine's JSON error: {"error": {"message": M}}
 * (OpenAI) or {"message": M} (vLLM's older ErrorResponse). "" when the
 * body is neither; at most outlen - 1 bytes (cut on a UTF-8 boundary). */
void px_engine_error_message(const char *body, size_t n, char *out, size_t outlen);

#endif
