/* The C description of a model that model/native_decode.c runs, as native_decode.py fills it
 * (field for field its ctypes structures): the kernels' function types, a projection, a
 * layer, the model, and one step's LoRA op. Included by native_decode.c alone.
 */
#ifndef LORASERVE_NATIVE_DECODE_H
#define LORASERVE_NATIVE_DECODE_H

#include <stdint.h>

typedef int (*gemm_fn)(int kind, const float *x, int64_t ldx, int64_t M, int64_t K,
                       const void *w, const void *w2, const void *w3, int64_t N, float *y,
                       int64_t ldy, void *work, int nthreads);
typedef void (*rms_norm_fn)(const float *x, int64_t ldx, const float *w, float *out,
                            int64_t ldo, int64_t T, int64_t d, float eps, int nthreads);
typedef void (*add_rms_norm_fn)(float *h, int64_t ldh, const float *r, int64_t ldr,
                                float alpha, const float *w, float *out, int64_t ldo,
                                int64_t T, int64_t d, float eps, int nthreads);
typedef void (*silu_mul_fn)(const float *gu, int64_t ldg, float *out, int64_t ldo, int64_t T,
                            int64_t inter, int nthreads);
typedef void (*rope_fn)(float *x, int64_t ldx, int64_t T, int64_t heads, int64_t hd,
                        const int64_t *positions, const float *cos_t, const float *sin_t,
                        int nthreads);
typedef int (*attention_fn)(const float *q, int64_t q_stride, const int64_t *rows, float *out,
                            int64_t out_stride, const float *k_cache, const float *v_cache,
                            const int64_t *tables, int64_t table_stride, const int64_t *lens,
                            int64_t n, int64_t nh, int64_t kvh, int64_t hd, int64_t block_size,
                            float scale, int64_t window, float softcap, int nthreads);
typedef int (*attention_team_fn)(const float *q, int64_t q_stride, const int64_t *rows,
                                 float *out, int64_t out_stride, const float *k_cache,
                                 const float *v_cache, const int64_t *tables,
                                 int64_t table_stride, const int64_t *lens, int64_t n,
                                 int64_t nh, int64_t kvh, int64_t hd, int64_t block_size,
                                 float scale, int64_t window, float softcap, int nthreads,
                                 int *failed);

/* lora/sgmv_cpu.c's lora_sgmv: y += the segments' LoRA deltas (A, B: the group's slot pools) */
typedef int (*sgmv_fn)(const float *x, int64_t ldx, float *y, int64_t ldy, const void *A,
                       int64_t a_slot, int64_t d_in, const void *B, int64_t b_slot,
                       const int64_t *segs, int64_t nseg, const int64_t *parts, int64_t npart,
                       float *t, int64_t ldt, int64_t tile, int nthreads);

/* One step's LoRA op, as ops/native_lora.py packs it (int64 fields, in that order): per
 * group, this step's segments and parts (nsegs 0: no adapter of the step targets it), and
 * per layer and group the A and B pools' addresses */
typedef struct {
    const int64_t *segs;
    int64_t nsegs;
    const int64_t *parts;
    int64_t nparts, a_slot, b_slot, d_in;
} lora_group_t;

enum { G_QKV, G_O, G_GATE_UP, G_DOWN, N_GROUPS };

typedef struct {
    sgmv_fn fn;
    int64_t tile, ldt, n_layers;
    const void *const (*tables)[N_GROUPS][2]; /* [n_layers][group][A, B] */
    lora_group_t groups[N_GROUPS];
} lora_step_t;

/* ops/gemm_cpu.c's float32 GEMM over its packed panels */
typedef void (*gemm_f32_fn)(const float *x, int64_t ldx, const float *packed, int64_t M,
                            int64_t N, int64_t K, float *y, int64_t ldy, int nthreads);
#define KIND_F32_PANELS (-1)

/* One projection: its kernel and that kernel's weight arguments (w, w2, w3 as the kernel
 * names them: quants and scales and offsets, in panels or in dot order; a float32 weight's
 * panels are w, its kind KIND_F32_PANELS and fn a gemm_f32_fn); team_fn the same kernel for
 * callers inside one team (qpanel_gemm_team, gemm_packed_team), or NULL where the kernel
 * has none */
typedef struct {
    gemm_fn fn, team_fn;
    int64_t kind, n, k;
    const void *w, *w2, *w3;
} projection_t;

typedef struct {
    projection_t qkv, o, gate_up, down;
    const float *post_norm;  /* before the MLP */
    const float *next_norm;  /* the next layer's input norm; NULL after the last layer */
    float *k_cache, *v_cache; /* [slots, kvh, hd] */
    int64_t window;
} layer_t;

typedef struct {
    rms_norm_fn rms_norm;
    add_rms_norm_fn add_rms_norm;
    silu_mul_fn silu_mul;
    rope_fn rope;
    attention_fn attention;
    attention_team_fn attention_team; /* NULL: no step runs in one team */
    int64_t d, nh, kvh, hd, inter, block_size;
    float eps, residual, scale, softcap;
    const float *first_norm, *cos, *sin;
} model_t;

#endif
