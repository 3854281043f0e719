/* SPDX-License-Identifier: Apache-2.0 */
/* W3C Trace Context: the traceparent header of the upstream legs. */
#ifndef PX_TRACE_H
#define PX_TRACE_H

#include <stddef.h>

/* Parses a W3C traceparent value; returns 1 with its trace id and flags, 0
 * when it is not valid (then a new trace starts). */
int px_trace_parse(const char *tp, size_t n, char trace[33], char flags[3]);
/* A fresh random trace id (32 lowercase hex digits, never all zero). */
void px_trace_new(char trace[33]);
/* A new span id: 16 lowercase hex digits, never all zero. */
void px_trace_span_new(char sp[17]);
/* The traceparent of a child span: version 00, the trace's id and flags,
 * `span` as parent id. */
void px_trace_child(const char *trace, const char *span, const char *flags, char out[56]);

#endif
