/* Every decoder layer of a decode-only, base-only step in one call: the same kernels the
 * model's Python loop calls one by one (the float32 or quantized GEMM, ops/fused_cpu.c's
 * norms, rope and silu, the paged decode attention), called here in the same order on the same buffers.
 *
 * Why: at batch 1 a layer's projections are a few tens of microseconds of weight streaming,
 * and the loop around them (a dozen torch dispatches, ctypes calls and allocations a layer)
 * cost about as much again (docs/cpu-kernels.md). Here a layer costs its kernels only.
 *
 * Why function pointers, not the kernels' code: each kernel stays the one compiled object the
 * Python loop calls, with its own build flags (fused_cpu.c rounds as torch does under
 * -ffp-contract=off, the GEMMs are built with contraction), so a row's result is bit for bit
 * the same whichever path its step took. The caller (native_decode.py) checks the shapes.
 *
 * Rows: B decode tokens, rows 0..B-1 of every buffer (unit stride, row strides as below).
 */
#include <stdint.h>
#include <string.h>

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

/* ops/gemm_cpu.c's float32 GEMM over its packed panels */
typedef void (*gemm_f32_fn)(const float *x, int64_t ldx, const float *packed, int64_t M,
                            int64_t N, int64_t K, float *y, int64_t ldy, int nthreads);
#define KIND_F32_PANELS (-1)

/* One projection: its kernel and that kernel's weight arguments (w, w2, w3 as the kernel
 * names them: quants and scales and offsets, in panels or in dot order; a float32 weight's
 * panels are w, its kind KIND_F32_PANELS and fn a gemm_f32_fn) */
typedef struct {
    gemm_fn fn;
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
    int64_t d, nh, kvh, hd, inter, block_size;
    float eps, residual, scale, softcap;
    const float *first_norm, *cos, *sin;
} model_t;

/* Scratch floats for B rows (native_decode.py allocates it; the GEMMs' own work is `work`). */
int64_t native_decode_scratch_floats(const model_t *m, int64_t B) {
    const int64_t qkv = (m->nh + 2 * m->kvh) * m->hd;
    return B * (m->d + qkv + m->nh * m->hd + m->d + 3 * m->inter);
}

static int project(const projection_t *p, const float *x, int64_t ldx, int64_t B, float *y,
                   void *work, int nthreads) {
    if (p->kind == KIND_F32_PANELS) {
        ((gemm_f32_fn)(void *)p->fn)(x, ldx, (const float *)p->w, B, p->n, p->k, y, p->n,
                                     nthreads);
        return 0;
    }
    return p->fn((int)p->kind, x, ldx, B, p->k, p->w, p->w2, p->w3, p->n, y, p->n, work,
                 nthreads);
}

/* h [B, d] (the embeddings in; the last layer's residual stream out). Returns 0, or the
 * 1-based layer whose kernel refused (a GEMM's shape, the attention's scratch). */
int native_decode(const model_t *m, const layer_t *layers, int64_t n_layers, float *h,
                  int64_t B, const int64_t *positions, const int64_t *slots,
                  const int64_t *rows, const int64_t *tables, int64_t table_stride,
                  const int64_t *lens, float *scratch, void *work, int nthreads) {
    const int64_t d = m->d, nh = m->nh, kvh = m->kvh, hd = m->hd, inter = m->inter;
    const int64_t q_size = nh * hd, kv_size = kvh * hd, ld_qkv = q_size + 2 * kv_size;
    float *x = scratch, *qkv = x + B * d, *a = qkv + B * ld_qkv, *o = a + B * q_size;
    float *gu = o + B * d, *mlp = gu + B * 2 * inter;
    m->rms_norm(h, d, m->first_norm, x, d, B, d, m->eps, nthreads);
    for (int64_t li = 0; li < n_layers; li++) {
        const layer_t *L = &layers[li];
        if (project(&L->qkv, x, d, B, qkv, work, nthreads)) return (int)li + 1;
        m->rope(qkv, ld_qkv, B, nh + kvh, hd, positions, m->cos, m->sin, nthreads);
        for (int64_t t = 0; t < B; t++) {
            memcpy(L->k_cache + slots[t] * kv_size, qkv + t * ld_qkv + q_size, 4 * kv_size);
            memcpy(L->v_cache + slots[t] * kv_size, qkv + t * ld_qkv + q_size + kv_size,
                   4 * kv_size);
        }
        if (m->attention(qkv, ld_qkv, rows, a, q_size, L->k_cache, L->v_cache, tables,
                         table_stride, lens, B, nh, kvh, hd, m->block_size, m->scale,
                         L->window, m->softcap, nthreads))
            return (int)li + 1;
        if (project(&L->o, a, q_size, B, o, work, nthreads)) return (int)li + 1;
        m->add_rms_norm(h, d, o, d, m->residual, L->post_norm, x, d, B, d, m->eps, nthreads);
        if (project(&L->gate_up, x, d, B, gu, work, nthreads)) return (int)li + 1;
        m->silu_mul(gu, 2 * inter, mlp, inter, B, inter, nthreads);
        if (project(&L->down, mlp, inter, B, o, work, nthreads)) return (int)li + 1;
        m->add_rms_norm(h, d, o, d, m->residual, L->next_norm, x, d, B, d, m->eps, nthreads);
    }
    return 0;
}
