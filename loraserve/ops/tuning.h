/* Every tuned constant of the CPU kernels, per ISA where they differ: what it is, why it has
 * this value, and the script that re-measures it (in benchmarks/kernels/; `kernel_ab.py X` is
 * its subcommand X, which A/Bs two builds of a kernel). The figures behind each choice, and
 * the alternatives tried, are in docs/cpu-kernels.md. A value under #ifndef may be set with -D
 * for an A/B (kernel_ab.py --b-flags).
 */
#ifndef LORASERVE_TUNING_H
#define LORASERVE_TUNING_H

#include "simd.h" /* the prefetch hints PF_L1, PF_L2, PF_NT */

/* ---- GEMM register tiles (ops/gemm_tile.h) ----------------------------------------------- */

#ifdef __AVX512F__
/* 8 rows x 2 panels: 16 zmm accumulators, 2 B loads and 8 broadcasts per 16 FMAs
 * (gemm_shapes.py) */
#define TILE_ROWS 8
#define TILE_PANELS 2
#else
/* 6 rows x 1 panel: 12 ymm accumulators, 2 B loads and 6 broadcasts per 12 FMAs, the most
 * the 16 ymm registers hold (gemm_shapes.py) */
#define TILE_ROWS 6
#define TILE_PANELS 1
#endif

/* KB of x rows per GEMM block: the block stays in L2 while every panel passes over it, so the
 * L2 size sets it (gemm_shapes.py, fused_lora.py) */
#ifndef GEMM_XBLOCK
#ifdef __AVX512F__
#define GEMM_XBLOCK 768
#else
#define GEMM_XBLOCK 192
#endif
#endif

/* M * N * K below which a GEMM runs on one thread: waking the team costs more than it saves
 * on a tiny model's products (gemm_shapes.py) */
#define GEMM_PARALLEL_MIN (1 << 18)

/* The next panel (pair) of a GEMM, fetched one line per k step by a column's first row tile
 * when it has more than one: into L2, not L1. With weights coming from memory, as in serving,
 * L2 is as fast or faster at every batch of two or more row tiles, on both ISAs
 * (kernel_ab.py gemm; a GEMM timed on one weight over and over reads it from cache and does
 * not show it). The likely reason: the first tile's K loop is short next to a memory read and
 * L1 tracks only a few misses at once, so into L1 the next panel was still arriving when its
 * tiles began, and it pushed out of L1 the panel the other tiles were still reading. */
#ifndef GEMM_NEXT_PANEL_HINT
#define GEMM_NEXT_PANEL_HINT PF_L2
#endif

/* ---- Quantized-weight GEMM (ops/qgemm_cpu.c) --------------------------------------------- */

/* rows of x per weight row pass: a weight group is unpacked once for this many rows, and
 * their accumulators, the group's weights and its scales fit the registers of either ISA
 * (memory_floor.py prefill) */
#define QGEMM_TILE_ROWS 4
/* KB of quantized x rows per block: the block stays in L1 while the weight rows of a chunk
 * pass over it, each row from L1 for all of its tiles (memory_floor.py prefill) */
#ifndef QGEMM_XBLOCK
#define QGEMM_XBLOCK 24
#endif
/* KB of weight rows per chunk (a thread's unit): the chunk stays in L2 while every block of
 * x passes over it, so a batch reads each weight from memory once (memory_floor.py) */
#ifndef QGEMM_WBLOCK
#define QGEMM_WBLOCK 256
#endif
/* M * N * K below which a product runs on one thread, as GEMM_PARALLEL_MIN */
#define QGEMM_PARALLEL_MIN (1 << 18)

/* ---- Quantized panel GEMM (ops/qpanel_gemm.c) -------------------------------------------- */

/* rows of x per panel pass: per row, one int32 and one float32 accumulator of 16 lanes each,
 * with the panel's weights and the broadcast bytes, within AVX-512's 32 registers. AVX2 tiles
 * take one half of the panel at a time (ops/qpanel_avx2.h), whose 4 rows fit its 16 registers
 * (memory_floor.py; -DQPANEL_TILE_ROWS=n for an A/B) */
#ifndef QPANEL_TILE_ROWS
#define QPANEL_TILE_ROWS 4
#endif
/* M * K below which the activations are quantized on one thread; N * K below which the panels
 * are: under these a parallel region costs more than it splits */
#define QPANEL_QUANTIZE_PARALLEL_MIN 8192
#define QPANEL_PARALLEL_MIN 65536
/* Bytes ahead of each 64-byte step of a panel's quants that the step fetches (into L1), per
 * quant width; 0: none. At batch 1 a product is a memory stream with little arithmetic per
 * byte, and the hardware prefetchers alone left the 4-bit stream short of the copy rate on
 * both ISAs, and the 8-bit one on AVX2; AVX-512's 8-bit stream reached it without, and was
 * slower with (kernel_ab.py qpanel, --b-flags=-DQPANEL_FETCH_AHEAD_4BIT=0) */
#ifndef QPANEL_FETCH_AHEAD_4BIT
#define QPANEL_FETCH_AHEAD_4BIT 4096
#endif
#ifndef QPANEL_FETCH_AHEAD_8BIT
#ifdef __AVX512F__
#define QPANEL_FETCH_AHEAD_8BIT 0
#else
#define QPANEL_FETCH_AHEAD_8BIT 4096
#endif
#endif

/* A second fetch per 64-byte step, further ahead and into L2, beside the one above: each
 * fetch into L1 holds one of the core's few L1 miss slots until its line arrives, so the L1
 * fetches alone keep only about 4 KB in flight, and where a core has a way to memory of its
 * own (the Zen 4 host's two cores on two dies of the package) that is under what it can
 * read. The L2 fetch keeps the lines coming into L2 before the L1 fetch asks for them. 12 KB
 * was faster than 8 or 24 on both ISAs; AVX-512's 8-bit stream, which fetches nothing into
 * L1, was slower with it (memory_floor.py by placement, docs/cpu-kernels.md; 0: none) */
#ifndef QPANEL_FETCH_L2_4BIT
#define QPANEL_FETCH_L2_4BIT 12288
#endif
#ifndef QPANEL_FETCH_L2_8BIT
#ifdef __AVX512F__
#define QPANEL_FETCH_L2_8BIT 0
#else
#define QPANEL_FETCH_L2_8BIT 12288
#endif
#endif

/* ---- The fused decode op's fetch streams (lora/fused_tile.h) ----------------------------- */

/* A stream fetches one line every FETCH_STRIDE k steps, or every FETCH_STRIDE / 2, or every
 * step: the widest that fits its lines in K, so the fetches spread over the tile's K loop (a
 * line per step, all at the start of K, was slower) (kernel_ab.py decode-op) */
#define FETCH_STRIDE 4
#ifdef __AVX512F__
/* the next unit's panels and the adapter lines both into L2: L1 measured the same, and
 * non-temporal slower (kernel_ab.py decode-op) */
#define FETCH_PANEL_HINT PF_L2
#define FETCH_LORA_HINT PF_L2
#else
/* a unit is one panel: into L1, where the next unit's tiles read it; the adapter lines
 * non-temporal, so they do not evict the panel (kernel_ab.py decode-op, imitated AVX2) */
#define FETCH_PANEL_HINT PF_L1
#define FETCH_LORA_HINT PF_NT
#endif

/* ---- The LoRA kernels (lora/sgmv_tiles.h, lora/sgmv_cpu.c) ------------------------------- */

/* The slot pool's tile width (A tiles, B strips) each build reads fastest: 4 zmm vectors a
 * row with AVX-512; 16 on AVX2, where a 16-column register tile then reads its strip as one
 * sequential stream (kernel_ab.py lora --a-tile 64 --b-tile 16) */
#ifdef __AVX512F__
#define LORA_PREFERRED_TILE 64
#else
#define LORA_PREFERRED_TILE 16
#endif
/* tokens per shrink and expand register tile: 6 rows of accumulators fit the registers with
 * the B vectors and a broadcast (the tiles' macros are written for 6) (kernel_ab.py lora) */
#define LORA_TILE_TOKENS 6
/* weights of A (shrink) or B (expand) fetched ahead of the tile's first pass over them (4 KB
 * in float32), into one level only (PF_NT): the rows are read once per token chunk, then from
 * cache. A distance in bytes, not rows: a decode step's items are short streams (a rank-8 A
 * tile or B strip is a few KB), and eight rows ahead of a rank-8 tile was 256 bytes, too close
 * to hide memory's latency (kernel_ab.py lora) */
#ifndef LORA_FETCH_AHEAD_WEIGHTS
#define LORA_FETCH_AHEAD_WEIGHTS 1024
#endif
#define LORA_FETCH_HINT PF_NT
/* shrink work item: tokens of one segment against one A tile (kernel_ab.py lora) */
#define LORA_SHRINK_TOKENS 60
/* expand work item: output columns of one part, for this many tokens of its segment: long
 * prompts keep both threads busy (kernel_ab.py lora) */
#define LORA_EXPAND_COLS 2048
#define LORA_EXPAND_TOKENS 256
/* a batch of at least this many segments per thread, none longer than LORA_FUSE_MAX_TOKENS,
 * gives each thread whole segments (shrink then expand, no barrier) (kernel_ab.py lora) */
#define LORA_SEGS_PER_THREAD 4
#define LORA_FUSE_MAX_TOKENS 8
/* fewer segments too, where whole ones, heaviest first, leave no thread more than this times
 * an even share (up to LORA_SEGS_MAX_THREADS threads): 5 of ranks 8/16 on 2 threads (at most
 * 1.14 of a share) ran faster whole, 3 equal ones (1.33) slower (docs/cpu-kernels.md) */
#define LORA_SEGMENTS_IMBALANCE 1.25
#define LORA_SEGS_MAX_THREADS 64

/* ---- The fused prefill op (lora/gemm_expand_cpu.c) --------------------------------------- */

/* rows of a shrink work item: whole 6-token tiles, short enough that a block's items keep both
 * threads busy whatever the mix of ranks (fused_lora.py) */
#define EXPAND_SHRINK_ROWS 48

/* ---- The interleaved decode op (lora/gemm_lora_decode_*.{c,h}) --------------------------- */

/* B strips per expand work item: items finish soon after their columns (kernel_ab.py decode-op) */
#define DECODE_EXPAND_STRIPS 4
/* a GEMM column's multiply-adds per float of LoRA work a core streams in the same time: weighs
 * the GEMM against the LoRA work when the plan shares them out; work stealing evens out what
 * the estimate misses (kernel_ab.py decode-op) */
#define DECODE_MACS_PER_LORA_FLOAT 16.0

/* ---- Paged decode attention (model/attention/paged_decode.c) ----------------------------- */

/* sequences * kv heads * context * head size below which a step runs on one thread: a batch-1
 * step's few hundred dot products (kernel_ab.py attention) */
#define ATTN_PARALLEL_MIN (1 << 17)
/* with at least this many sequences per thread a work item takes every kv head of its
 * sequence, reading each token's row whole (kernel_ab.py attention) */
#define ATTN_SEQS_PER_THREAD 4
/* K rows fetched this many tokens ahead (two 16-token passes), into L2 for the next score
 * passes; spread over the K transposes so the burst does not overflow the miss buffers. Into L2
 * and this far: long contexts read faster than with 16 tokens into L1, at a cost of a few
 * percent to one short sequence (kernel_ab.py attention) */
#ifndef ATTN_K_AHEAD
#define ATTN_K_AHEAD 32
#endif
#ifndef ATTN_K_HINT
#define ATTN_K_HINT PF_L2
#endif
/* this pass's V rows, read after the whole score pass: into L2 (kernel_ab.py attention) */
#define ATTN_V_HINT PF_L2
/* KB of the next work item's K and V rows fetched into L2 while a thread runs the one
 * before it: two items' rows, this one's and the next's, within L2 (kernel_ab.py attention) */
#ifndef ATTN_NEXT_ITEM_KB
#define ATTN_NEXT_ITEM_KB 384
#endif

/* ---- Element-wise kernels (ops/fused_cpu.c) ---------------------------------------------- */

/* elements below which a kernel runs on one thread (kernel_ab.py elementwise) */
#define ELEMWISE_PARALLEL_MIN (1 << 16)

/* Rows up to which every thread of the native loop's team quantizes x and computes the
 * element-wise kernels on all the rows itself, with no barrier after them
 * (model/native_decode.c, ops/qpanel_gemm.c's qpanel_gemm_team); above, each thread takes a
 * share of the rows and the team meets at a barrier. At one row a share is all or nothing,
 * so the other thread waited anyway; at more, doing every row twice costs more than the
 * barrier it saves, unless a barrier crosses dies (docs/cpu-kernels.md) */
#define TEAM_OWN_ROWS_MAX 1

#endif
