/* SPDX-License-Identifier: Apache-2.0 */
/* Where log lines go once px_logsink_start() ran (log.c hands them here;
 * before, and in programs that never start it, lines are written at once to
 * stderr): stderr or a file, through a descriptor of the sink's own that
 * never blocks the caller.
 *
 * Batched lines (the access log) gather in a buffer per thread and are
 * written when it is full, when the oldest has waited flush_s (the sink's
 * thread writes them), on px_logsink_flush/_reopen, when the thread exits
 * and on px_logsink_stop: the way nginx's `access_log ... buffer= flush=`
 * writes. Other lines are written at once, behind the caller's batched
 * lines (a thread's lines keep their order).
 *
 * When the sink cannot take more (a pipe whose reader stalled), what it
 * refused waits in a bounded queue that the sink's thread writes as the
 * sink drains; past the bound, lines are dropped and counted
 * (px_logsink_dropped), and a warning says so, at most once a second, once
 * the sink takes lines again. No call here waits for the sink.
 *
 * Thread-safe: any thread may log; start, reopen and stop are called by one
 * thread (the program's control thread). */
#ifndef PX_LOGSINK_H
#define PX_LOGSINK_H

#include <stddef.h>
#include <stdint.h>

typedef struct px_logsink_cfg {
    const char *path;    /* append to this file (created 0644); NULL or "": stderr */
    size_t buffer_bytes; /* each thread's buffer for batched lines; 0: written at once */
    double flush_s;      /* the longest a batched line waits (0: 1 s) */
    /* Lines were dropped (n since the last call) and the sink takes lines
     * again: called from the sink's thread, no lock held, at most once a
     * second, to log a warning. May be NULL. */
    void (*on_dropped)(uint64_t n);
} px_logsink_cfg;

/* Opens the sink and starts its thread. 0, or -1 with a message in err
 * (the file cannot be opened). Lines logged before go to stderr directly. */
int px_logsink_start(const px_logsink_cfg *cfg, char *err, size_t errlen);

/* One line, '\n'-terminated, of n bytes. `batched`: it may wait in this
 * thread's buffer. A no-op (returns 0) when the sink is not started. */
int px_logsink_put(const char *line, size_t n, int batched);

/* Every thread's batched lines to the sink now. */
void px_logsink_flush(void);

/* Flushes, then opens the file again (log rotation: the old name was moved
 * away). 0, or -1 with a message in err: the old file stays in use. With
 * no path, only flushes. */
int px_logsink_reopen(char *err, size_t errlen);

/* Flushes, waits at most timeout_s for the sink to take what was queued,
 * and stops the thread. Later lines are written at once (never batched),
 * to the same sink. */
void px_logsink_stop(double timeout_s);

/* Lines dropped since the start because the sink could not take them. */
uint64_t px_logsink_dropped(void);

#endif
