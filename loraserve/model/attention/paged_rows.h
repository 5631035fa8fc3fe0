/* Where a context's tokens lie in the paged KV cache, for the paged decode attention kernel
 * (paged_decode.c): a token's row by its block table, a cursor that walks the tokens in order
 * without a division per token, and the fetch of a work item's K and V rows ahead of use.
 *
 * Layout: k_cache and v_cache [num_slots, kvh, hd], slot = block * block_size + offset; a
 * token's row of every kv head starts at slot * tok_stride floats (tok_stride = kvh * hd).
 */
#ifndef LORASERVE_PAGED_ROWS_H
#define LORASERVE_PAGED_ROWS_H

#include <stdint.h>

#include "../../ops/simd.h"

static inline int64_t slot_of(const int64_t *table, int64_t t, int64_t block_size) {
    return table[t / block_size] * block_size + t % block_size;
}

/* The context's tokens in order, a block at a time: the token's row (slot * tok_stride) with
 * no division per token. */
typedef struct {
    const int64_t *table;
    int64_t block, off, block_size, tok_stride;
} token_cursor;

static inline token_cursor cursor_at(const int64_t *table, int64_t t, int64_t block_size,
                                     int64_t tok_stride) {
    return (token_cursor){table, t / block_size, t % block_size, block_size, tok_stride};
}

static inline int64_t cursor_row(const token_cursor *c) {
    return (c->table[c->block] * c->block_size + c->off) * c->tok_stride;
}

static inline void cursor_next(token_cursor *c) {
    if (++c->off == c->block_size) c->off = 0, c->block++;
}

/* The next work item's K and V rows, token by token, fetched into L2 while the thread runs
 * the one before it: a decode step reads every sequence's context from memory, and within one
 * item the fetches ahead cannot get far enough (an item's first tokens, each item's V rows)
 * to keep the loads from waiting. `lines` left to fetch, at most ATTN_NEXT_ITEM_KB. */
typedef struct {
    token_cursor cur;
    const float *kb, *vb;
    int64_t lpr, line, lines; /* lines per row; next line of this token's K then V rows */
} item_fetch;

static inline void fetch_item_lines(item_fetch *f, int64_t count) {
    for (; count > 0 && f->lines > 0; count--, f->lines--) {
        const int64_t row = cursor_row(&f->cur);
        const float *line = f->line < f->lpr ? f->kb + row + f->line * LINE_FLOATS
                                              : f->vb + row + (f->line - f->lpr) * LINE_FLOATS;
        PREFETCH(line, PF_L2);
        if (++f->line == 2 * f->lpr) f->line = 0, cursor_next(&f->cur);
    }
}

#endif
