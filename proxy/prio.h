/* SPDX-License-Identifier: Apache-2.0 */
/* Priority classes of admission control (admission.h): vLLM's `priority`
 * values and --priority-class names mapped to the classes a queue serves
 * in order. Parsing only, so that the config checks it without the queue. */
#ifndef PX_PRIO_H
#define PX_PRIO_H

#include <stddef.h>

#define PX_ADM_CLASSES 16 /* priorities 0..15; outside that range, clamped */

/* Maps a priority (vLLM's `priority`: lower first) to a class. */
int px_adm_class_of(long long priority);

/* --priority-class: named classes, each a range of priority values, in
 * the order they are served (the first listed first), strictly, or, when
 * every class has a share (NAME:LO..HI:share=N), by shares: among classes
 * with requests waiting, each class is served up to its share in a round
 * before the next, so a lower class is never starved. A request's
 * priority (--priority-header, a number or a class's name; else the
 * body's `priority`) goes to the first class whose range holds it, a
 * number in none to the last class. n == 0: the default mapping,
 * px_adm_class_of. */
#define PX_PRIO_NAME_MAX 32
typedef struct px_prio_map {
    size_t n; /* 0..PX_ADM_CLASSES */
    struct {
        char name[PX_PRIO_NAME_MAX];
        long long lo, hi; /* the priorities it holds, both included */
        unsigned share;   /* requests per round; 0: strict order (every class 0) */
    } c[PX_ADM_CLASSES];
} px_prio_map;

/* Parses specs "NAME:LO..HI" (or "NAME:P" for one value), each with an
 * optional ":share=N". 0, or -1 with err naming the spec (m untouched). */
int px_prio_map_parse(char *const *specs, size_t n, px_prio_map *m, char *err, size_t errlen);
/* Checks one spec as px_prio_map_parse would. */
int px_prio_spec_check(const char *spec, char *err, size_t errlen);
/* The class of a priority value. */
int px_prio_map_class(const px_prio_map *m, long long priority);
/* The class named name[0..len), -1 when none. */
int px_prio_map_named(const px_prio_map *m, const char *name, size_t len);
/* A decimal integer filling s..end: 0, or -1 when it is not one. */
int px_prio_number(const char *s, const char *end, long long *out);

/* The maps in use, published newest first and kept until the end (a
 * worker may hold an older one): the head is px_ctx's `prio`. */
struct px_prio_node;
typedef _Atomic(struct px_prio_node *) px_prio_head;
/* Parses specs (as px_prio_map_parse) and publishes the map unless it
 * equals the current one. 0, or -1 with err (nothing changes). */
int px_prio_publish(px_prio_head *head, char *const *specs, size_t n, char *err, size_t errlen);
/* The current map (NULL: none published). Any thread. */
const px_prio_map *px_prio_current(px_prio_head *head);
/* Frees every map published; no reader may be left. */
void px_prio_cleanup(px_prio_head *head);

#endif
