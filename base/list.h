/* SPDX-License-Identifier: Apache-2.0 */
/* Intrusive doubly linked lists: any struct with `prev` and `next` pointers
 * to its own type, reached from a head pointer that is NULL when the list is
 * empty.  Walk with `for (x = head; x; x = x->next)`; to unlink while
 * walking, read `next` first.  Macros so that one pair serves every element
 * type with no casts; `head` and `x` are evaluated more than once and must
 * have no side effects. */
#ifndef PX_LIST_H
#define PX_LIST_H

#include <stddef.h>

/* Puts x at the front of the list. */
#define PX_LIST_PUSH(head, x)                                                                      \
    do {                                                                                           \
        (x)->prev = NULL;                                                                          \
        (x)->next = (head);                                                                        \
        if (head) (head)->prev = (x);                                                              \
        (head) = (x);                                                                              \
    } while (0)

/* Takes x, which must be on the list, out of it; x's links are cleared. */
#define PX_LIST_UNLINK(head, x)                                                                    \
    do {                                                                                           \
        if ((x)->prev)                                                                             \
            (x)->prev->next = (x)->next;                                                           \
        else                                                                                       \
            (head) = (x)->next;                                                                    \
        if ((x)->next) (x)->next->prev = (x)->prev;                                                \
        (x)->prev = (x)->next = NULL;                                                              \
    } while (0)

#endif
