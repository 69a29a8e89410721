/*
 * adaptive-llama's C kernel as other C code sees it: the array API (one row of logits in,
 * k* and its figures out) that native/module.c offers to Python. The llama.cpp samplers in
 * adaptive.c are reached through ctypes (adaptive_llama/native.py) and are not declared here.
 */
#ifndef ADAPTIVE_LLAMA_ADAPTIVE_H
#define ADAPTIVE_LLAMA_ADAPTIVE_H

#include <stddef.h>
#include <stdint.h>

#define AL_EXPORT __attribute__((visibility("default")))

/* The figures of one decision (mirrored by adaptive_llama.native.Stats). */
typedef struct {
    int32_t k;          /* candidate-set size k* */
    int32_t token;      /* chosen token id (sampler only), -1 otherwise */
    double kept_mass;   /* c_{k*}: probability mass of the kept set */
    double entropy;     /* H of the whole distribution, nats (NaN unless asked for) */
    double conf;        /* 1 - H / ln V (NaN unless asked for) */
    double p_chosen;    /* probability of the chosen token in the whole distribution */
    int64_t n_tokens;   /* tokens recorded since the sampler was created or reset */
    int64_t n_fallbacks; /* tokens chosen by arg-max because a buffer could not grow */
} al_stats;

/* Reusable buffers; one per thread, since a call writes into them. */
typedef struct al_workspace al_workspace;

AL_EXPORT al_workspace *al_workspace_new(void);
AL_EXPORT void al_workspace_free(al_workspace *ws);

/* k* of the row x[0..n-1] (Algorithm 1), and its figures into *out unless out is NULL;
 * AL_INVALID_LOGITS for NaN, +inf or an all -inf row, -1 when a buffer cannot grow. */
#define AL_INVALID_LOGITS (-2)
AL_EXPORT int32_t al_adaptive_f32(const float *x, size_t n, double eps, al_workspace *ws,
                                  al_stats *out);
AL_EXPORT int32_t al_adaptive_f64(const double *x, size_t n, double eps, al_workspace *ws,
                                  al_stats *out);

#endif
