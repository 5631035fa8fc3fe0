/* The rows that describe a step's LoRA work to the C kernels: Python passes them as int64
 * tensors of 4 and 6 columns (lora/backends/cpu_kernel.py, plan_group), read here as arrays of
 * these structs (same layout: int64 fields, no padding). */
#ifndef LORASERVE_LORA_ROWS_H
#define LORASERVE_LORA_ROWS_H

#include <stdint.h>

/* One segment: rows [start, end) of x are tokens of the adapter in slot `slot`, rank `rank`.
 * Segments come in token order. */
typedef struct {
    int64_t slot, start, end, rank;
} lora_seg;

/* One module block of a segment's adapter: rank rows [o0, o1) of t go to output columns
 * [c0, c1) of y, through the block of B at B[slot] + boff. Parts come in segment order. */
typedef struct {
    int64_t seg, o0, o1, c0, c1, boff;
} lora_part;

_Static_assert(sizeof(lora_seg) == 4 * sizeof(int64_t), "lora_seg: an int64 [n, 4] row");
_Static_assert(sizeof(lora_part) == 6 * sizeof(int64_t), "lora_part: an int64 [n, 6] row");

static inline int64_t pad8(int64_t r) { return (r + 7) / 8 * 8; } /* layout.padded_rank */

#endif
