/*
 * adaptive-llama native kernels: adaptive decoding, eta-, p-less and top-H sampling as
 * llama.cpp samplers.
 *
 * Adaptive decoding: Zhu et al., "Improving Open-Ended Text Generation via Adaptive
 * Decoding", ICML 2024, section 4 and Algorithm 1.  With the next-token probabilities
 * sorted p_1 >= ... >= p_V, c_k = p_1 + ... + p_k and R_k = 1 - c_k (natural logs):
 *
 *   dConf_k = [ p_k ln(p_k (V-k) / R_k) + R_{k-1} ln( (R_k/(V-k)) / (R_{k-1}/(V-k+1)) ) ] / ln V
 *   k*      = max(1, the last k with dConf_k > epsilon)
 *
 * Terms: where R_k = 0 (k = V, or every later token masked) dConf_k takes its continuous
 * limit p_k ln(V-k+1) / ln V; a token with p = 0 never counts; V = 1 gives k* = 1.
 *
 * Why O(V) is exact: dConf_k <= p_k (see adaptive_llama/kernel/__init__.py), so the last index above
 * epsilon has p > epsilon.  Passes: (1) max logit, (2) w_i = exp(x_i - max) and their sum,
 * (3) collect the tokens with p > epsilon (fewer than 1/epsilon) and sum the rest directly,
 * then sort only the candidates and scan them.  Tail masses are float64 suffix sums, never
 * 1 - c_k, which cancels catastrophically once c_k is near 1.
 *
 * Eta-sampling: Hewitt et al., "Truncation Sampling as Language Model Desmoothing", 2022:
 * keep the tokens with p > min(eps, sqrt(eps) * exp(-H)), H the entropy in nats.
 *
 * p-less sampling: Tan, Wu and Howard, "p-less Sampling: A Robust Hyperparameter-Free
 * Approach for LLM Decoding", ICLR 2026 (arXiv 2509.23234): keep the tokens with
 *
 *   p_v >= L = sum_u p_u^2      (the probability that two draws agree)
 *
 * The most likely token always stays: L = sum_u p_u p_u <= p_max sum_u p_u = p_max.  In
 * weights w = exp(x - max), S = sum w: keep w_v >= (sum_u w_u^2) / S.
 *
 * Top-H decoding: Potraghloo, Baghaei et al., "Top-H Decoding: Adapting the Creativity and
 * Coherence with Bounded Entropy in Text Generation", 2025 (arXiv 2509.02510), as its
 * authors' code runs it: with p_1 >= ... >= p_N the N = min(top_n, V) likeliest tokens and
 * E_k = - sum_{i <= k} p_i ln p_i (the base cancels),
 *
 *   k* = max(1, the largest k <= N with E_k <= alpha E_N)
 *
 * E_k grows with k (each term is >= 0), so the tokens kept are a prefix of the N.
 *
 * The passes are plain loops written for GCC's vectoriser: compiled with -O3 -ffast-math,
 * expf/exp become calls to glibc's vector math library (libmvec).  Infinite logits are
 * handled without isinf (which -ffast-math would fold away): exponents are clamped at
 * EXP_ARG_MIN, where exp() is already 0 in float32.
 */
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#include "adaptive.h"

/* ---- mirrors of llama.h (llama-cpp-python 0.3.36); layouts checked from Python ---- */

typedef struct { int32_t id; float logit; float p; } al_token_data;

typedef struct {
    al_token_data *data;
    size_t size;
    int64_t selected;
    bool sorted;
} al_token_data_array;

struct llama_sampler;

typedef struct {
    const char *(*name)(const struct llama_sampler *smpl);
    void (*accept)(struct llama_sampler *smpl, int32_t token);
    void (*apply)(struct llama_sampler *smpl, al_token_data_array *cur_p);
    void (*reset)(struct llama_sampler *smpl);
    struct llama_sampler *(*clone)(const struct llama_sampler *smpl);
    void (*free)(struct llama_sampler *smpl);
    void *backend_hooks[6]; /* backend sampling: NULL here; adaptive_llama/llama/graph.py fills
                             a copy's init and apply for a chain run in the graph */
} al_sampler_iface;

struct llama_sampler { const al_sampler_iface *iface; void *ctx; };

typedef struct llama_sampler *(*al_sampler_init_fn)(const al_sampler_iface *iface, void *ctx);

/* ---- reusable buffers ---- */

typedef struct { double w; int32_t idx; } al_cand;

struct al_workspace {
    float *w;       size_t cap_w;     /* exp(x_i - max) in float32, one per token */
    float *x;       size_t cap_x;     /* contiguous copy of a sampler's logits */
    al_cand *cand;  al_cand *tmp;     size_t cap_c;  /* candidates, merge-sort buffer */
    int32_t *ids;   size_t cap_i;     /* candidates' token ids as collect finds them */
    double *tail;   size_t cap_t;     /* suffix sums: tail[j] = mass after candidate j */
    al_token_data *kept; size_t cap_k;  /* kept entries while they move to the front */
    unsigned char *mark; size_t cap_m;  /* flags: candidate tokens, or front slots kept */
    float *gmax, *gsum, *gwd; size_t cap_g;  /* per GROUP of weights: their max, their sum
                                                and sum w_i (x_i - m) */
};

#define EXP_ARG_MIN (-87.3f)  /* below, exp() is subnormal in float32: weigh 0 (masked tokens) */
#define CHUNK 64               /* the scan computes dConf a block of CHUNK at a time */
#define GROUP 256              /* the weights pass records the max and sum of each GROUP */
#define CANDIDATE_SLACK 0.99   /* collect p > 0.99 eps: the float32 sum only estimates S */
#define COLLECT_SPILL 16       /* collect may write 16 ids past the last candidate */

/* Test hook: the next `n` buffer allocations fail, as if memory ran out. */
static int fail_allocations;
AL_EXPORT void al_test_fail_allocations(int n) { fail_allocations = n; }

static int grow(void **buf, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 1;
    if (fail_allocations > 0) {
        fail_allocations--;
        return 0;
    }
    void *p = realloc(*buf, need * elem);
    if (!p) return 0;
    *buf = p;
    *cap = need;
    return 1;
}

AL_EXPORT al_workspace *al_workspace_new(void) { return calloc(1, sizeof(al_workspace)); }

AL_EXPORT void al_workspace_free(al_workspace *ws) {
    if (!ws) return;
    free(ws->w); free(ws->x); free(ws->cand); free(ws->tmp); free(ws->tail); free(ws->ids);
    free(ws->kept); free(ws->mark); free(ws->gmax); free(ws->gsum); free(ws->gwd);
    free(ws);
}

/* The per-token buffers: weights, and one flag per token (collect; move_to_front reuses it). */
static int reserve(al_workspace *ws, size_t n) {
    size_t groups = n / GROUP + 1, cap = ws->cap_g, cap2 = ws->cap_g;
    return grow((void **)&ws->w, &ws->cap_w, n, sizeof(float)) &&
           grow((void **)&ws->mark, &ws->cap_m, n, 1) &&
           grow((void **)&ws->gmax, &cap, groups, sizeof(float)) &&
           grow((void **)&ws->gwd, &cap2, groups, sizeof(float)) &&
           grow((void **)&ws->gsum, &ws->cap_g, groups, sizeof(float));
}

static int reserve_candidates(al_workspace *ws, size_t n) {
    size_t cap = ws->cap_c;
    if (!grow((void **)&ws->cand, &cap, n, sizeof(al_cand))) return 0;
    cap = ws->cap_c;
    if (!grow((void **)&ws->tmp, &cap, n, sizeof(al_cand))) return 0;
    ws->cap_c = cap;
    return grow((void **)&ws->tail, &ws->cap_t, n + 1, sizeof(double)) &&
           grow((void **)&ws->ids, &ws->cap_i, n + COLLECT_SPILL, sizeof(int32_t));
}

/* ---- host threads for the passes over every token ---- */

/*
 * The passes over all V tokens (the max, the temperature, the weights) may run on several
 * threads: while the host samples, llama.cpp's own threads (the same OpenMP pool, libgomp,
 * which libggml-cpu uses) wait for the next decode. Each thread takes whole GROUPs and every
 * sum is added in group order afterwards, so the results are the same bits on any number
 * of threads. A pass uses at most one thread per MIN_TOKENS_PER_THREAD tokens (waking a
 * thread costs about a microsecond), and runs on one thread while another call holds the
 * pool (chains sampled from several Python threads at once).
 */
#define MIN_TOKENS_PER_THREAD 16384
static int pass_threads_max = 1; /* al_set_threads */
static int pool_busy;

/* How many threads the passes may use (1: none besides the caller's). Returns the number
 * set, which is 1 where the library was built without OpenMP. */
AL_EXPORT int al_set_threads(int n) {
#ifdef _OPENMP
    pass_threads_max = n > 1 ? n : 1;
#else
    (void)n;
#endif
    return pass_threads_max;
}

/* Threads for a pass over n tokens; a result above 1 holds the pool until release_threads. */
static int claim_threads(size_t n) {
    size_t fit = n / MIN_TOKENS_PER_THREAD;
    int t = (size_t)pass_threads_max < fit ? pass_threads_max : (int)fit;
    if (t <= 1 || __atomic_exchange_n(&pool_busy, 1, __ATOMIC_ACQUIRE)) return 1;
    return t;
}

static void release_threads(int t) {
    if (t > 1) __atomic_store_n(&pool_busy, 0, __ATOMIC_RELEASE);
}

static size_t group_count(size_t n) { return (n + GROUP - 1) / GROUP; }

/* ---- pass 1 and 2: max, weights, normaliser (and optionally the entropy sum) ---- */

/*
 * exp(d) in float32 for d <= 0, within 1 ulp: d = n ln 2 + r with |r| <= ln(2)/2 (the
 * reduction in two fused steps, Cody-Waite), exp(r) by Cephes' degree-7 polynomial, 2^n from
 * the exponent bits; exactly 0 below EXP_ARG_MIN. Branch-free, so the passes vectorise it.
 * Why not glibc's vector expf: it takes a scalar slow path for a whole vector as soon as one
 * argument is below about -87 (every masked token), which made a row with masked tokens
 * several times slower, and it is about 1.5x slower than this even without them.
 */
static inline float exp_weight(float d) {
    const float c = d >= EXP_ARG_MIN ? d : EXP_ARG_MIN; /* NaN too: n stays an integer */
    const float n = floorf(c * 1.44269504088896341f + 0.5f);
    float r = fmaf(n, -0.693359375f, c);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return d < EXP_ARG_MIN ? 0.0f : p * scale;
}

static float max_f32(const float *x, size_t n) {
    const size_t groups = group_count(n);
    const int t = claim_threads(n);
    float m = x[0];
#pragma omp parallel for num_threads(t) if (t > 1) schedule(static) reduction(max : m)
    for (size_t g = 0; g < groups; g++) {
        const size_t b = g * GROUP, end = b + GROUP < n ? b + GROUP : n;
        float group_max = x[b];
        for (size_t i = b; i < end; i++) group_max = x[i] > group_max ? x[i] : group_max;
        m = group_max > m ? group_max : m;
    }
    release_threads(t);
    return m;
}

/*
 * Pass 2: w_i = exp(x_i - m) stored in float32, and for each GROUP of tokens the max and the
 * float32 sum of its weights (ws->gmax, ws->gsum): collect skips a group whose max is below
 * its threshold and takes the group's sum as tail mass. Returns S = sum w_i; a float32 sum
 * within a group is enough: S only places the candidate threshold, which has slack.
 */
#define DEFINE_PASSES(T, SUFFIX)                                                            \
    static double weights_##SUFFIX(const T *x, size_t n, T m, al_workspace *ws) {           \
        float *w = ws->w;                                                                    \
        const size_t groups = group_count(n);                                                \
        const int t = claim_threads(n);                                                      \
        _Pragma("omp parallel for num_threads(t) if (t > 1) schedule(static)")               \
        for (size_t g = 0; g < groups; g++) {                                                \
            const size_t b = g * GROUP, end = b + GROUP < n ? b + GROUP : n;                 \
            float group_sum = 0.0f, group_max = 0.0f;                                        \
            for (size_t i = b; i < end; i++) {                                               \
                float v = exp_weight((float)(x[i] - m));                                     \
                w[i] = v;                                                                    \
                group_sum += v;                                                              \
                group_max = v > group_max ? v : group_max;                                   \
            }                                                                                \
            ws->gsum[g] = group_sum;                                                         \
            ws->gmax[g] = group_max;                                                         \
        }                                                                                    \
        release_threads(t);                                                                  \
        double s = 0.0;                                                                      \
        for (size_t g = 0; g < groups; g++) s += (double)ws->gsum[g];                        \
        return s;                                                                            \
    }                                                                                        \
    /* As weights_, and *wd = sum w_i (x_i - m), so H = ln S - wd / S: one more float32     \
     * multiply-add per token in the same loop, summed per GROUP and then in float64 like   \
     * S, so that the statistics cost next to nothing (a float64 product per token halved  \
     * the loop's vector width). */                                                         \
    static double weights_entropy_##SUFFIX(const T *x, size_t n, T m, al_workspace *ws,     \
                                           double *wd) {                                     \
        float *w = ws->w;                                                                    \
        const size_t groups = group_count(n);                                                \
        const int t = claim_threads(n);                                                      \
        _Pragma("omp parallel for num_threads(t) if (t > 1) schedule(static)")               \
        for (size_t g = 0; g < groups; g++) {                                                \
            const size_t b = g * GROUP, end = b + GROUP < n ? b + GROUP : n;                 \
            float group_sum = 0.0f, group_max = 0.0f, group_wd = 0.0f;                       \
            for (size_t i = b; i < end; i++) {                                               \
                float d = (float)(x[i] - m);                                                 \
                float v = exp_weight(d);                                                     \
                w[i] = v;                                                                    \
                group_sum += v;                                                              \
                group_max = v > group_max ? v : group_max;                                   \
                d = d < EXP_ARG_MIN ? EXP_ARG_MIN : d; /* 0 * -inf would be NaN */           \
                group_wd += v * d;                                                           \
            }                                                                                \
            ws->gsum[g] = group_sum;                                                         \
            ws->gmax[g] = group_max;                                                         \
            ws->gwd[g] = group_wd;                                                           \
        }                                                                                    \
        release_threads(t);                                                                  \
        double s = 0.0, sd = 0.0;                                                            \
        for (size_t g = 0; g < groups; g++) {                                                \
            s += (double)ws->gsum[g];                                                        \
            sd += (double)ws->gwd[g];                                                        \
        }                                                                                    \
        *wd = sd;                                                                            \
        return s;                                                                            \
    }

DEFINE_PASSES(float, f32)
DEFINE_PASSES(double, f64)

/* ---- pass 3: candidates (w > threshold) and the directly summed rest ---- */

/*
 * The tokens b..end-1 of one group: appends the ids of those with w > threshold to ids (from
 * nc on), adds the float32 sum of the others to *rest and returns the new count, or cap + 1
 * when more than cap qualify. ids has room for cap + COLLECT_SPILL entries.
 */
#if defined(__AVX2__)
/* set_bits[m]: the positions of the set bits of the byte m, in order (zero padded). */
static uint8_t set_bits[256][8];

__attribute__((constructor)) static void fill_set_bits(void) {
    for (int m = 0; m < 256; m++)
        for (int bit = 0, j = 0; bit < 8; bit++)
            if (m >> bit & 1) set_bits[m][j++] = (uint8_t)bit;
}

/* Eight weights a step, without a branch on the data: one compare gives the mask that leaves
 * the candidates out of the sum and, through movemask, a byte whose set bits are the
 * candidates' positions; their 8 ids are stored at once (from the table) and the count moves
 * by the byte's popcount. A branch per candidate would be mispredicted nearly every time on
 * rows with hundreds of candidates spread over the vocabulary. Two vectors an iteration, each
 * adding into its own sum, so that the adds' latency does not set the pace. */
static size_t collect_group(const float *w, size_t b, size_t end, float threshold,
                            int32_t *ids, size_t nc, size_t cap, double *rest) {
    const __m256 bar = _mm256_set1_ps(threshold);
    __m256 sums[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}; /* two chains of adds */
    size_t i = b;
    for (; i + 16 <= end; i += 16) {
        if (nc > cap) return cap + 1;
        for (int half = 0; half < 2; half++) {
            const size_t at = i + 8 * (size_t)half;
            const __m256 v = _mm256_loadu_ps(w + at);
            const __m256 hot = _mm256_cmp_ps(v, bar, _CMP_GT_OQ);
            sums[half] = _mm256_add_ps(sums[half], _mm256_andnot_ps(hot, v));
            const unsigned bits = (unsigned)_mm256_movemask_ps(hot);
            const __m256i offsets =
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)set_bits[bits]));
            _mm256_storeu_si256((__m256i *)(ids + nc),
                                _mm256_add_epi32(_mm256_set1_epi32((int32_t)at), offsets));
            nc += (size_t)__builtin_popcount(bits);
        }
    }
    float lanes[8], group_rest = 0.0f;
    _mm256_storeu_ps(lanes, _mm256_add_ps(sums[0], sums[1]));
    for (int j = 0; j < 8; j++) group_rest += lanes[j];
    for (; i < end; i++) {
        if (w[i] <= threshold) { group_rest += w[i]; continue; }
        if (nc >= cap) return cap + 1;
        ids[nc++] = (int32_t)i;
    }
    *rest += (double)group_rest;
    return nc > cap ? cap + 1 : nc;
}
#else
/* Portable: a loop GCC vectorises flags every token and sums the unflagged ones, then the
 * flags are read 8 at a time as one word, which is 0 nearly everywhere. */
static size_t collect_group(const float *w, size_t b, size_t end, float threshold,
                            int32_t *ids, size_t nc, size_t cap, double *rest,
                            unsigned char *flags) {
    float group_rest = 0.0f;
    for (size_t i = b; i < end; i++) {
        const int hot = w[i] > threshold;
        flags[i] = (unsigned char)hot;
        group_rest += hot ? 0.0f : w[i];
    }
    *rest += (double)group_rest;
    for (size_t i0 = b; i0 < end; i0 += 8) {
        uint64_t word = 0;
        if (i0 + 8 <= end) memcpy(&word, flags + i0, sizeof word);
        else for (size_t j = i0; j < end; j++) word |= flags[j];
        if (!word) continue;
        for (size_t j = i0; j < i0 + 8 && j < end; j++) {
            if (!flags[j]) continue;
            if (nc == cap) return cap + 1;
            ids[nc++] = (int32_t)j;
        }
    }
    return nc;
}
#endif

/*
 * Returns the number of candidates (their ids in ws->ids), or cap + 1 when more than cap
 * qualify. A group whose max weight is at most the threshold holds no candidate: its sum
 * (from pass 2) is tail mass, and its weights are not read again.
 */
static size_t collect(al_workspace *ws, size_t n, float threshold, size_t cap, double *rest) {
    double tail = 0.0; /* float32 sums within a group, float64 across */
    size_t nc = 0;
    for (size_t g = 0, b = 0; b < n && nc <= cap; g++, b += GROUP) {
        if (ws->gmax[g] <= threshold) {
            tail += (double)ws->gsum[g];
            continue;
        }
        const size_t end = b + GROUP < n ? b + GROUP : n;
#if defined(__AVX2__)
        nc = collect_group(ws->w, b, end, threshold, ws->ids, nc, cap, &tail);
#else
        nc = collect_group(ws->w, b, end, threshold, ws->ids, nc, cap, &tail, ws->mark);
#endif
    }
    *rest = tail;
    return nc;
}

/* Where the search for the max can start: the first group holding a weight of 1 (the max
 * itself has w = exp(0) = 1 exactly, and no earlier group can hold it); 0 if none does. */
static size_t first_group_at_one(const al_workspace *ws, size_t n) {
    for (size_t g = 0, b = 0; b < n; g++, b += GROUP)
        if (ws->gmax[g] >= 1.0f) return b;
    return 0;
}

/* Index of the first entry equal to m at or after `from`; 0 if none is (NaN logits): never
 * reads past n. A block of CHUNK is tested at once (vectorised) before it is searched token
 * by token. */
#define DEFINE_INDEX_OF_MAX(T, SUFFIX)                                                      \
    static size_t index_of_max_##SUFFIX(const T *x, size_t n, T m, size_t from) {           \
        for (size_t b = from; b < n; b += CHUNK) {                                           \
            const size_t end = b + CHUNK < n ? b + CHUNK : n;                                \
            int hit = 0;                                                                     \
            for (size_t i = b; i < end; i++) hit |= x[i] == m;                               \
            if (!hit) continue;                                                              \
            for (size_t i = b; i < end; i++)                                                 \
                if (x[i] == m) return i;                                                     \
        }                                                                                    \
        return 0;                                                                            \
    }
DEFINE_INDEX_OF_MAX(float, f32)
DEFINE_INDEX_OF_MAX(double, f64)

/*
 * Stable sort by weight, descending: insertion sort in runs of SORT_RUN, then merges of
 * neighbouring runs, each skipped when the two are already in order (the last weight of the
 * left run is at least the first of the right). nc < 1/epsilon, so this is cheap; tied
 * candidates (a many-way tie at the top) are already in order and cost one pass.
 */
#define SORT_RUN 16
static void sort_desc(al_cand *a, al_cand *tmp, size_t n) {
    for (size_t lo = 0; lo < n; lo += SORT_RUN) {
        const size_t hi = lo + SORT_RUN < n ? lo + SORT_RUN : n;
        for (size_t i = lo + 1; i < hi; i++) {
            const al_cand key = a[i];
            size_t j = i;
            for (; j > lo && a[j - 1].w < key.w; j--) a[j] = a[j - 1];
            a[j] = key;
        }
    }
    for (size_t width = SORT_RUN; width < n; width *= 2) {
        for (size_t lo = 0; lo + width < n; lo += 2 * width) {
            const size_t mid = lo + width, hi = lo + 2 * width < n ? lo + 2 * width : n;
            if (a[mid - 1].w >= a[mid].w) continue;
            size_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi) tmp[o++] = a[j].w > a[i].w ? a[j++] : a[i++];
            while (i < mid) tmp[o++] = a[i++];
            while (j < hi) tmp[o++] = a[j++];
            memcpy(a + lo, tmp + lo, (hi - lo) * sizeof(al_cand));
        }
    }
}

/*
 * dConf_k ln V for k = k_first .. k_first + len - 1, from the sorted weights w (w[j] is
 * candidate k_first + j) and tail[j] = S R_{k-1}, tail[j + 1] = S R_k. Branch-free so that
 * the loop vectorises (log and log1p from libmvec); where R_k = 0 or k = V the formula's
 * operands are replaced by harmless ones and the limit p_k ln(V-k+1) is taken instead.
 */
static void gains(const double *w, const double *tail, int len, double k_first, double V,
                  double S, double *gain) {
    for (int j = 0; j < len; j++) { /* an int counter: AVX2 converts int32, not size_t, to double */
        const double p = w[j] / S, R_prev = tail[j] / S, R_raw = tail[j + 1] / S;
        const double n_raw = V - (k_first + (double)j); /* V - k */
        const int at_limit = R_raw <= 0.0 || n_raw <= 0.0;
        const double R = at_limit ? 1.0 : R_raw, n_after = at_limit ? 1.0 : n_raw;
        /* p_k ln(p_k (V-k)/R_k) + R_{k-1} ln((R_k/(V-k)) / (R_{k-1}/(V-k+1))); the second log
         * is ln(R_k/R_{k-1}) + ln((V-k+1)/(V-k)), each ratio taken by log1p when it is near 1
         * (R_k = R_{k-1} - p_k), where a plain log would lose its digits. */
        const double tail_ratio_log = R < 0.5 * R_prev ? log(R / R_prev) : log1p(-p / R_prev);
        const double formula =
            p * log(p * n_after / R) + R_prev * (tail_ratio_log + log1p(1.0 / n_after));
        gain[j] = at_limit ? p * log(n_raw + 1.0) : formula;
    }
}

/*
 * Whether no k in k0+1..end can have dConf_k > eps: dConf_k ln V <= p_k ln(p_k (V-k+1) /
 * R_{k-1}) (the KL bound in adaptive_llama/kernel's docstring), and over the block p_k <= p_{k0+1},
 * V-k+1 <= V-k0 and R_{k-1} >= R_{end-1}, so one logarithm bounds the whole block. The
 * margin keeps rounding in the bound from ever skipping a block the exact formula would not.
 */
static int block_below(const al_cand *cand, const double *tail, size_t k0, size_t end,
                       size_t V, double bar) {
    const double p_top = cand[k0].w / tail[0], R_least = tail[end - 1] / tail[0];
    return R_least > 0.0 &&
           p_top * log(p_top * (double)(V - k0) / R_least) < bar * (1.0 - 1e-9);
}

/*
 * Algorithm 1 over the sorted candidates. tail[j] holds S R_j (mass after the j-th candidate;
 * tail[0] = S); returns k* >= 1 (0 when there is no candidate).
 */
static int32_t scan(const al_cand *cand, const double *tail, size_t nc, size_t V, double eps) {
    const double bar = eps * log((double)V); /* dConf_k > eps  <=>  dConf_k ln V > eps ln V */
    /* From the back, a block at a time: the first k found above is k*. Blocks of candidates
     * with p just above eps (most of them on broad rows) are passed over by their bound. */
    for (size_t end = nc; end > 0;) {
        size_t k0 = end > CHUNK ? end - CHUNK : 0, len = end - k0;
        if (block_below(cand, tail, k0, end, V, bar)) {
            end = k0;
            continue;
        }
        double w[CHUNK], gain[CHUNK];
        for (size_t j = 0; j < len; j++) w[j] = cand[k0 + j].w;
        gains(w, tail + k0, (int)len, (double)(k0 + 1), (double)V, tail[0], gain);
        for (size_t j = len; j-- > 0;)
            if (gain[j] > bar) return (int32_t)(k0 + j + 1);
        end = k0;
    }
    return 0;
}

/*
 * The kernel shared by the array API and the sampler.  w must hold the weights from pass 2,
 * S their sum.  Leaves the sorted candidates in ws->cand (exact float64 weights) and, when
 * there are none, the argmax in ws->cand[0].  Returns k* and fills the kept mass.
 */
/* Room for the candidates: fewer than 1/(eps slack) tokens can have p > eps slack, but
 * never more than n; computed in double, so a tiny, zero or NaN epsilon cannot overflow. */
static size_t candidate_capacity(double eps, size_t n) {
    double want = 1.0 / (eps * CANDIDATE_SLACK) + 2.0;
    return (want >= 1.0 && want < (double)n) ? (size_t)want : n;
}

/* The exact (float64) weights of the tokens that decide k*: gathered into scratch first, so
 * that the exponentials run as one vectorised loop (libmvec) rather than a scalar call each. */
#define DEFINE_EXACT_WEIGHTS(T, SUFFIX)                                                     \
    static void exact_weights_##SUFFIX(const T *x, T m, const int32_t *ids, al_cand *cand,  \
                                       size_t nc, double *scratch) {                         \
        for (size_t j = 0; j < nc; j++) scratch[j] = (double)x[ids[j]] - (double)m;          \
        for (size_t j = 0; j < nc; j++) scratch[j] = exp(scratch[j]);                         \
        for (size_t j = 0; j < nc; j++) cand[j] = (al_cand){scratch[j], ids[j]};              \
    }
DEFINE_EXACT_WEIGHTS(float, f32)
DEFINE_EXACT_WEIGHTS(double, f64)

#define DEFINE_SELECT(T, SUFFIX)                                                       \
    static int32_t select_##SUFFIX(const T *x, size_t n, T m, double S, double eps,          \
                                   al_workspace *ws, size_t *n_cand, double *kept_mass) {    \
        size_t cap = candidate_capacity(eps, n);                                             \
        if (!reserve_candidates(ws, cap)) return -1;                                         \
        double rest;                                                                          \
        float threshold = (float)(eps * CANDIDATE_SLACK * S);                                \
        size_t nc = collect(ws, n, threshold, cap, &rest);                                   \
        if (nc > cap) { /* the float32 S was low by over 1%: make room for every token */   \
            cap = n;                                                                         \
            if (!reserve_candidates(ws, cap)) return -1;                                     \
            nc = collect(ws, n, threshold, cap, &rest);                                      \
        }                                                                                    \
        if (nc == 0) { /* p_max <= eps: k* = 1, the argmax */                                \
            ws->cand[0].idx =                                                                \
                (int32_t)index_of_max_##SUFFIX(x, n, m, first_group_at_one(ws, n));          \
            ws->cand[0].w = 1.0;                                                             \
            *n_cand = 1;                                                                     \
            *kept_mass = 1.0 / S;                                                            \
            return 1;                                                                        \
        }                                                                                    \
        exact_weights_##SUFFIX(x, m, ws->ids, ws->cand, nc, ws->tail);                                \
        sort_desc(ws->cand, ws->tmp, nc);                                                    \
        ws->tail[nc] = rest;                                                                  \
        for (size_t j = nc; j > 0; j--) ws->tail[j - 1] = ws->tail[j] + ws->cand[j - 1].w;   \
        int32_t k = scan(ws->cand, ws->tail, nc, n, eps);                                    \
        if (k < 1) k = 1;                                                                    \
        double kept = 0.0;                                                                   \
        for (int32_t j = 0; j < k; j++) kept += ws->cand[j].w;                               \
        *n_cand = nc;                                                                        \
        *kept_mass = kept / ws->tail[0];                                                     \
        return k;                                                                            \
    }

DEFINE_SELECT(float, f32)
DEFINE_SELECT(double, f64)

/* ---- array API (adaptive_llama.adaptive_k / adaptive_stats) ---- */

/* Bad logits, found in the max pass at the cost of one add per token: +inf or an all -inf
 * row leave the max infinite, and a NaN makes the plain sum NaN (the max may step over it:
 * vectorised max instructions drop NaN operands). Read from the bits, because -ffast-math
 * lets the compiler assume isnan() and isinf() are always false. */
static int is_finite(double v) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    return ((bits >> 52) & 0x7FF) != 0x7FF;
}
static int is_nan(double v) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    return ((bits >> 52) & 0x7FF) == 0x7FF && (bits & 0xFFFFFFFFFFFFFull) != 0;
}
#define DEFINE_MAX_SUM(T, SUFFIX)                                                           \
    static T max_sum_##SUFFIX(const T *x, size_t n, double *total) {                        \
        T m = x[0], sum = 0;                                                                 \
        for (size_t i = 0; i < n; i++) {                                                     \
            m = x[i] > m ? x[i] : m;                                                         \
            sum += x[i];                                                                     \
        }                                                                                    \
        *total = (double)sum;                                                                \
        return m;                                                                            \
    }
DEFINE_MAX_SUM(float, f32)
DEFINE_MAX_SUM(double, f64)

#define DEFINE_ARRAY_API(T, SUFFIX)                                                         \
    AL_EXPORT int32_t al_adaptive_##SUFFIX(const T *x, size_t n, double eps,                \
                                           al_workspace *ws, al_stats *out) {               \
        if (n == 1) {                                                                         \
            if (!is_finite((double)x[0])) return AL_INVALID_LOGITS;                           \
            if (out) { out->k = 1; out->kept_mass = 1.0; out->entropy = 0.0; out->conf = NAN; } \
            return 1;                                                                        \
        }                                                                                    \
        if (!reserve(ws, n)) return -1;                                                      \
        double total;                                                                        \
        T m = max_sum_##SUFFIX(x, n, &total);                                                \
        if (!is_finite((double)m) || is_nan(total)) return AL_INVALID_LOGITS;                \
        double wd = 0.0;                                                                     \
        double S = out ? weights_entropy_##SUFFIX(x, n, m, ws, &wd)                          \
                       : weights_##SUFFIX(x, n, m, ws);                                      \
        size_t nc;                                                                           \
        double kept;                                                                         \
        int32_t k = select_##SUFFIX(x, n, m, S, eps, ws, &nc, &kept);                        \
        if (out && k > 0) {                                                                  \
            out->k = k;                                                                      \
            out->token = -1;                                                                 \
            out->kept_mass = kept;                                                           \
            out->entropy = log(S) - wd / S;                                                  \
            out->conf = 1.0 - out->entropy / log((double)n);                                 \
            out->p_chosen = NAN;                                                             \
        }                                                                                    \
        return k;                                                                            \
    }

DEFINE_ARRAY_API(float, f32)
DEFINE_ARRAY_API(double, f64)

/* llama.cpp's greedy loop, whose answer on a row with NaN depends on where the NaN is
 * (compiled without -ffast-math, which may assume there is none). */
__attribute__((optimize("no-fast-math")))
static int32_t greedy_loop(const float *logits, size_t n) {
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    return (int32_t)best;
}

/* llama.cpp's greedy sampler on a row of logits: the first token with the highest logit,
 * found by a vectorised max and a search for it; llama.cpp's loop when the row holds a NaN
 * (then the sum is NaN). */
AL_EXPORT int32_t al_greedy_row(const float *logits, size_t n) {
    double total;
    const float m = max_sum_f32(logits, n, &total);
    if (is_nan(total)) return greedy_loop(logits, n);
    return (int32_t)index_of_max_f32(logits, n, m, 0);
}

/* ---- samplers ---- */

static al_sampler_init_fn sampler_init; /* llama_sampler_init from libllama, set once */

AL_EXPORT void al_set_sampler_init(al_sampler_init_fn fn) { sampler_init = fn; }

/* splitmix64: a small, seedable, well-mixed generator; same seed, same tokens. */
static double next_uniform(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1.0p-53;
}

typedef struct {
    double eps;
    int uniform;        /* sample uniformly inside the kept set (the paper's "random") */
    uint64_t seed, rng;
    int record;         /* compute entropy and Conf for the statistics */
    al_stats last;
    al_workspace *ws;
} al_adaptive_ctx;

/* Gather the logits into a contiguous buffer so the passes vectorise (the array is AoS). */
static float *gather_logits(al_workspace *ws, const al_token_data_array *cur) {
    if (!grow((void **)&ws->x, &ws->cap_x, cur->size, sizeof(float))) return NULL;
    for (size_t i = 0; i < cur->size; i++) ws->x[i] = cur->data[i].logit;
    return ws->x;
}

/*
 * Move the entries at positions pos[0..k) to the front, in that order, keeping every
 * other entry somewhere in the array (llama.cpp's truncating samplers are permutations).
 */
static int move_to_front(al_workspace *ws, al_token_data *data, const al_cand *pos, size_t k) {
    if (!grow((void **)&ws->kept, &ws->cap_k, k, sizeof(al_token_data)) ||
        !grow((void **)&ws->mark, &ws->cap_m, k, 1))
        return 0;
    unsigned char *mark = ws->mark;
    memset(mark, 0, k);
    for (size_t j = 0; j < k; j++) {
        ws->kept[j] = data[pos[j].idx];
        if ((size_t)pos[j].idx < k) mark[pos[j].idx] = 1;
    }
    size_t front = 0; /* next front slot whose entry is not kept and must move out */
    for (size_t j = 0; j < k; j++) {
        if ((size_t)pos[j].idx < k) continue;
        while (mark[front]) front++;
        data[pos[j].idx] = data[front++];
    }
    memcpy(data, ws->kept, k * sizeof(al_token_data));
    return 1;
}

static const char *adaptive_name(const struct llama_sampler *smpl) {
    (void)smpl;
    return "adaptive";
}

/* A choice with nothing left to decide: k = 1, all the mass on `token`. */
static void record_certain(al_adaptive_ctx *c, int32_t token) {
    al_stats *s = &c->last;
    s->k = 1;
    s->token = token;
    s->kept_mass = s->p_chosen = 1.0;
    s->entropy = c->record ? 0.0 : NAN;
    s->conf = NAN; /* 1 - H / ln V is undefined for V = 1 */
    s->n_tokens++;
}

/* Out of memory: no buffer is needed to keep the most likely token, so that is the choice
 * (llama.cpp aborts when a sampler leaves no selection). Counted in n_fallbacks. */
static void choose_argmax(al_adaptive_ctx *c, al_token_data_array *cur) {
    size_t best = 0;
    for (size_t i = 1; i < cur->size; i++)
        if (cur->data[i].logit > cur->data[best].logit) best = i;
    al_token_data t = cur->data[best];
    cur->data[best] = cur->data[0];
    cur->data[0] = t;
    cur->size = 1;
    cur->selected = 0;
    cur->sorted = true;
    cur->data[0].p = 1.0f;
    al_stats *s = &c->last;
    s->k = 1;
    s->token = t.id;
    s->kept_mass = s->p_chosen = s->entropy = s->conf = NAN; /* not computed */
    s->n_tokens++;
    s->n_fallbacks++;
}

/*
 * The sampler's decision on the contiguous row x[0..n) (n >= 2, its max m): k*, the draw
 * inside the kept set, and the record in c->last but for the token and the count, which the
 * caller sets once the choice stands.
 * Returns the position of the choice among the sorted candidates ws->cand (whose idx is the
 * token's position in x) and the kept weight in *kept_w; -1 when a buffer could not grow.
 * Both ways in run it: the llama.cpp array (adaptive_apply) and the logits row
 * (al_adaptive_sample_row), so that they choose alike.
 */
static int32_t decide(al_adaptive_ctx *c, const float *x, size_t n, float m, double *kept_w) {
    al_workspace *ws = c->ws;
    double wd = 0.0;
    double S = c->record ? weights_entropy_f32(x, n, m, ws, &wd) : weights_f32(x, n, m, ws);
    size_t nc;
    double kept_mass;
    int32_t k = select_f32(x, n, m, S, c->eps, ws, &nc, &kept_mass);
    if (k < 1) return -1;

    double kept = 0.0;
    for (int32_t j = 0; j < k; j++) kept += ws->cand[j].w;
    double u = next_uniform(&c->rng);
    int32_t chosen = 0;
    if (c->uniform) {
        chosen = (int32_t)(u * k);
        if (chosen >= k) chosen = k - 1;
    } else {
        double target = u * kept, acc = 0.0;
        for (chosen = 0; chosen < k - 1; chosen++) {
            acc += ws->cand[chosen].w;
            if (acc > target) break;
        }
    }
    al_stats *s = &c->last;
    s->k = k;
    s->kept_mass = kept_mass;
    s->p_chosen = ws->cand[chosen].w * kept_mass / kept;
    if (c->record) {
        s->entropy = log(S) - wd / S;
        s->conf = 1.0 - s->entropy / log((double)n);
    }
    *kept_w = kept;
    return chosen;
}

static void adaptive_apply(struct llama_sampler *smpl, al_token_data_array *cur) {
    al_adaptive_ctx *c = smpl->ctx;
    al_workspace *ws = c->ws;
    size_t n = cur->size;
    if (n == 0) return; /* nothing to choose: llama.cpp reports the empty array */
    if (n == 1) {       /* one candidate: it is the choice, and the stats say so */
        cur->selected = 0;
        record_certain(c, cur->data[0].id);
        return;
    }
    const float *x = gather_logits(ws, cur);
    if (!x || !reserve(ws, n)) return choose_argmax(c, cur);
    double kept_w;
    int32_t chosen = decide(c, x, n, max_f32(x, n), &kept_w);
    int32_t k = c->last.k;
    if (chosen < 0 || !move_to_front(ws, cur->data, ws->cand, (size_t)k))
        return choose_argmax(c, cur);
    for (int32_t j = 0; j < k; j++)
        cur->data[j].p = c->uniform ? (float)(1.0 / k) : (float)(ws->cand[j].w / kept_w);
    cur->size = (size_t)k;
    cur->sorted = true;
    cur->selected = chosen;
    c->last.token = cur->data[chosen].id;
    c->last.n_tokens++;
}

/*
 * x_i = logits_i / temp into ws->x: llama.cpp's temperature sampler, bit for bit. A true
 * division: under -ffast-math GCC would multiply by 1/temp, which rounds some quotients
 * differently (and a max in this loop would keep the loop from vectorising without it).
 */
__attribute__((optimize("no-fast-math")))
static void scale_row(const float *logits, size_t n, float temp, float *x) {
    const size_t groups = group_count(n);
    const int t = claim_threads(n);
#pragma omp parallel for num_threads(t) if (t > 1) schedule(static)
    for (size_t g = 0; g < groups; g++) {
        const size_t b = g * GROUP, end = b + GROUP < n ? b + GROUP : n;
        for (size_t i = b; i < end; i++) x[i] = logits[i] / temp;
    }
    release_threads(t);
}

/* choose_argmax on the row: the first token with the highest logit / temp (true
 * divisions: two logits can round to one quotient), and the same record. */
__attribute__((optimize("no-fast-math")))
static int32_t choose_argmax_row(al_adaptive_ctx *c, const float *logits, size_t n,
                                 float temp) {
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (logits[i] / temp > logits[best] / temp) best = i;
    al_stats *s = &c->last;
    s->k = 1;
    s->token = (int32_t)best;
    s->kept_mass = s->p_chosen = s->entropy = s->conf = NAN; /* not computed */
    s->n_tokens++;
    s->n_fallbacks++;
    return s->token;
}

/*
 * The chain temp(temp) -> adaptive, run straight on a row of n logits (token i's logit at
 * logits[i], as llama_get_logits_ith gives it): the token that llama_sampler_sample would
 * choose, from the same random stream, with the same record, without the n-entry
 * llama_token_data array it fills and the chain's passes over it. temp 1: no temperature
 * sampler, and no copy of the row. The caller accepts the token into the chain.
 */
AL_EXPORT int32_t al_adaptive_sample_row(struct llama_sampler *smpl, const float *logits,
                                         size_t n, float temp) {
    al_adaptive_ctx *c = smpl->ctx;
    al_workspace *ws = c->ws;
    if (n == 1) {
        record_certain(c, 0);
        return 0;
    }
    const int scaled = temp != 1.0f;
    if (!reserve(ws, n) || (scaled && !grow((void **)&ws->x, &ws->cap_x, n, sizeof(float))))
        return choose_argmax_row(c, logits, n, temp);
    if (scaled) scale_row(logits, n, temp, ws->x);
    const float *x = scaled ? ws->x : logits;
    const float m = max_f32(x, n); /* the max of the quotients, found among them */
    double kept_w;
    const int32_t chosen = decide(c, x, n, m, &kept_w);
    if (chosen < 0) return choose_argmax_row(c, logits, n, temp);
    c->last.n_tokens++;
    return c->last.token = ws->cand[chosen].idx;
}

static void adaptive_reset(struct llama_sampler *smpl) {
    al_adaptive_ctx *c = smpl->ctx;
    c->rng = c->seed;
    c->last.n_tokens = c->last.n_fallbacks = 0;
}

static void adaptive_free(struct llama_sampler *smpl) {
    al_adaptive_ctx *c = smpl->ctx;
    if (!c) return;
    al_workspace_free(c->ws);
    free(c);
}

static al_adaptive_ctx *adaptive_ctx_new(double eps, int uniform, uint64_t seed, int record) {
    al_adaptive_ctx *c = calloc(1, sizeof(al_adaptive_ctx));
    if (!c) return NULL;
    c->ws = al_workspace_new();
    if (!c->ws) { free(c); return NULL; }
    c->eps = eps;
    c->uniform = uniform;
    c->seed = c->rng = seed;
    c->record = record;
    c->last.entropy = c->last.conf = NAN;
    return c;
}

static struct llama_sampler *adaptive_clone(const struct llama_sampler *smpl);

static const al_sampler_iface adaptive_iface = {
    .name = adaptive_name,
    .accept = NULL,
    .apply = adaptive_apply,
    .reset = adaptive_reset,
    .clone = adaptive_clone,
    .free = adaptive_free,
};

static struct llama_sampler *adaptive_clone(const struct llama_sampler *smpl) {
    const al_adaptive_ctx *c = smpl->ctx;
    if (!sampler_init) return NULL;
    al_adaptive_ctx *copy = adaptive_ctx_new(c->eps, c->uniform, c->seed, c->record);
    if (!copy) return NULL;
    copy->rng = c->rng;
    copy->last = c->last;
    struct llama_sampler *clone = sampler_init(&adaptive_iface, copy);
    if (!clone) {
        al_workspace_free(copy->ws);
        free(copy);
    }
    return clone;
}

/* A new adaptive sampler owned by the caller (or by the chain it is added to). */
AL_EXPORT struct llama_sampler *al_adaptive_sampler_new(double eps, int uniform, uint64_t seed,
                                                        int record) {
    if (!sampler_init) return NULL;
    al_adaptive_ctx *c = adaptive_ctx_new(eps, uniform, seed, record);
    if (!c) return NULL;
    struct llama_sampler *smpl = sampler_init(&adaptive_iface, c);
    if (!smpl) {
        al_workspace_free(c->ws);
        free(c);
    }
    return smpl;
}

/* The statistics of the last token the sampler chose: valid while the sampler lives. */
AL_EXPORT const al_stats *al_adaptive_sampler_stats(const struct llama_sampler *smpl) {
    return &((const al_adaptive_ctx *)smpl->ctx)->last;
}

/* Eta-sampling and p-less sampling: truncation only; a dist sampler after them samples. */

typedef struct {
    double eps;    /* eta's epsilon, top-H's alpha */
    size_t top_n;  /* top-H's */
    al_workspace *ws;
} al_truncation_ctx;

static const char *eta_name(const struct llama_sampler *smpl) {
    (void)smpl;
    return "eta";
}

/*
 * Keep the tokens whose weight passes the threshold (w > threshold; w >= it when inclusive)
 * at the front of cur, a permutation as llama.cpp's truncating samplers make; the most
 * likely token alone where rounding let none pass.
 */
static void keep_passing(al_token_data_array *cur, const al_workspace *ws, const float *x,
                         size_t n, float m, float threshold, int inclusive) {
    size_t kept = 0;
    for (size_t i = 0; i < n; i++) {
        float w = ws->w[i];
        if (w > threshold || (inclusive && w == threshold)) {
            al_token_data t = cur->data[i];
            cur->data[i] = cur->data[kept];
            cur->data[kept++] = t;
        }
    }
    if (kept == 0) { /* keep the most likely token, as transformers does */
        size_t i = index_of_max_f32(x, n, m, first_group_at_one(ws, n));
        al_token_data t = cur->data[i];
        cur->data[i] = cur->data[0];
        cur->data[0] = t;
        kept = 1;
    }
    cur->size = kept;
    cur->sorted = false;
}

static void eta_apply(struct llama_sampler *smpl, al_token_data_array *cur) {
    al_truncation_ctx *c = smpl->ctx;
    al_workspace *ws = c->ws;
    size_t n = cur->size;
    const float *x = gather_logits(ws, cur);
    if (n < 2 || !x || !reserve(ws, n)) return;
    float m = max_f32(x, n);
    double wd;
    double S = weights_entropy_f32(x, n, m, ws, &wd);
    double H = log(S) - wd / S;
    double cut = fmin(c->eps, sqrt(c->eps) * exp(-H)); /* keep p > min(eps, sqrt(eps) e^-H) */
    keep_passing(cur, ws, x, n, m, (float)(cut * S), 0);
}

static void truncation_free(struct llama_sampler *smpl) {
    al_truncation_ctx *c = smpl->ctx;
    if (!c) return;
    al_workspace_free(c->ws);
    free(c);
}

static struct llama_sampler *eta_clone(const struct llama_sampler *smpl);

static const al_sampler_iface eta_iface = {
    .name = eta_name,
    .accept = NULL,
    .apply = eta_apply,
    .reset = NULL,
    .clone = eta_clone,
    .free = truncation_free,
};

/* A truncating sampler of ours (eta, p-less, top-H): its parameters and workspace. */
static struct llama_sampler *truncation_sampler_new(const al_sampler_iface *iface, double eps,
                                                    size_t top_n) {
    if (!sampler_init) return NULL;
    al_truncation_ctx *c = calloc(1, sizeof(al_truncation_ctx));
    if (!c) return NULL;
    c->eps = eps;
    c->top_n = top_n;
    c->ws = al_workspace_new();
    if (!c->ws) { free(c); return NULL; }
    struct llama_sampler *smpl = sampler_init(iface, c);
    if (!smpl) {
        al_workspace_free(c->ws);
        free(c);
    }
    return smpl;
}

AL_EXPORT struct llama_sampler *al_eta_sampler_new(double eps) {
    return truncation_sampler_new(&eta_iface, eps, 0);
}

static struct llama_sampler *eta_clone(const struct llama_sampler *smpl) {
    return al_eta_sampler_new(((const al_truncation_ctx *)smpl->ctx)->eps);
}

/* p-less sampling (truncation only; a dist sampler after it samples). */

static const char *pless_name(const struct llama_sampler *smpl) {
    (void)smpl;
    return "p-less";
}

/* sum of w_i^2: float32 within a GROUP, float64 across groups, as S is summed. */
static double sum_squares(const float *w, size_t n) {
    double q = 0.0;
    for (size_t b = 0; b < n; b += GROUP) {
        const size_t end = b + GROUP < n ? b + GROUP : n;
        float group = 0.0f;
        for (size_t i = b; i < end; i++) group += w[i] * w[i];
        q += (double)group;
    }
    return q;
}

static void pless_apply(struct llama_sampler *smpl, al_token_data_array *cur) {
    al_workspace *ws = ((al_truncation_ctx *)smpl->ctx)->ws;
    size_t n = cur->size;
    const float *x = gather_logits(ws, cur);
    if (n < 2 || !x || !reserve(ws, n)) return;
    float m = max_f32(x, n);
    double S = weights_f32(x, n, m, ws);
    /* p_v >= sum_u p_u^2  <=>  w_v >= sum_u w_u^2 / S */
    keep_passing(cur, ws, x, n, m, (float)(sum_squares(ws->w, n) / S), 1);
}

static struct llama_sampler *pless_clone(const struct llama_sampler *smpl);

static const al_sampler_iface pless_iface = {
    .name = pless_name,
    .accept = NULL,
    .apply = pless_apply,
    .reset = NULL,
    .clone = pless_clone,
    .free = truncation_free,
};

AL_EXPORT struct llama_sampler *al_pless_sampler_new(void) {
    return truncation_sampler_new(&pless_iface, 0.0, 0);
}

static struct llama_sampler *pless_clone(const struct llama_sampler *smpl) {
    (void)smpl;
    return al_pless_sampler_new();
}

/* Top-H decoding (truncation only; a dist sampler after it samples). */

static const char *toph_name(const struct llama_sampler *smpl) {
    (void)smpl;
    return "top-h";
}

/* a before b: the larger weight, and of equal weights the smaller token position */
static int cand_before(al_cand a, al_cand b) {
    return a.w > b.w || (a.w == b.w && a.idx < b.idx);
}

/* Restore the heap below position i of the min-heap h[0..n) (its root the last in order). */
static void sift_down(al_cand *h, size_t n, size_t i) {
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, last = i;
        if (l < n && cand_before(h[last], h[l])) last = l;
        if (r < n && cand_before(h[last], h[r])) last = r;
        if (last == i) return;
        al_cand t = h[i]; h[i] = h[last]; h[last] = t;
        i = last;
    }
}

/* The want likeliest positions of the row (float32 weights ws->w), in ws->cand, in order:
 * a heap of the best so far, which most tokens leave after one comparison with its root. */
static size_t likeliest(al_workspace *ws, size_t n, size_t want) {
    al_cand *h = ws->cand;
    size_t size = 0;
    for (size_t i = 0; i < n; i++) {
        al_cand c = {ws->w[i], (int32_t)i};
        if (size < want) {
            h[size++] = c;
            if (size == want)
                for (size_t j = want / 2; j-- > 0;) sift_down(h, want, j);
        } else if (cand_before(c, h[0])) {
            h[0] = c;
            sift_down(h, want, 0);
        }
    }
    if (size < want)
        for (size_t j = size / 2; j-- > 0;) sift_down(h, size, j);
    for (size_t end = size; end > 1; end--) { /* heap sort: the last in order to the end */
        al_cand t = h[0]; h[0] = h[end - 1]; h[end - 1] = t;
        sift_down(h, end - 1, 0);
    }
    return size;
}

static void toph_apply(struct llama_sampler *smpl, al_token_data_array *cur) {
    al_truncation_ctx *c = smpl->ctx;
    al_workspace *ws = c->ws;
    size_t n = cur->size;
    const float *x = gather_logits(ws, cur);
    size_t want = c->top_n < n ? c->top_n : n;
    if (n < 2 || !x || !reserve(ws, n) || !reserve_candidates(ws, want) ||
        !grow((void **)&ws->tail, &ws->cap_t, want + 1, sizeof(double)))
        return;
    float m = max_f32(x, n);
    double S = weights_f32(x, n, m, ws);
    size_t N = likeliest(ws, n, want);
    double *E = ws->tail; /* E[k] = E_{k+1}, from the exact weights */
    double e = 0.0;
    for (size_t i = 0; i < N; i++) {
        double p = exp((double)x[ws->cand[i].idx] - (double)m) / S;
        e += p > 0.0 ? -p * log(p) : 0.0;
        E[i] = e;
    }
    double bound = c->eps * E[N - 1]; /* alpha E_N */
    size_t k = 1;
    while (k < N && E[k] <= bound) k++; /* E grows: the kept tokens are a prefix */
    if (!move_to_front(ws, cur->data, ws->cand, k)) return;
    cur->size = k;
    cur->sorted = false;
}

static struct llama_sampler *toph_clone(const struct llama_sampler *smpl);

static const al_sampler_iface toph_iface = {
    .name = toph_name,
    .accept = NULL,
    .apply = toph_apply,
    .reset = NULL,
    .clone = toph_clone,
    .free = truncation_free,
};

AL_EXPORT struct llama_sampler *al_toph_sampler_new(double alpha, size_t top_n) {
    return truncation_sampler_new(&toph_iface, alpha, top_n);
}

static struct llama_sampler *toph_clone(const struct llama_sampler *smpl) {
    const al_truncation_ctx *c = smpl->ctx;
    return al_toph_sampler_new(c->eps, c->top_n);
}

/* Layout facts Python compares with llama-cpp-python's ctypes structs at import. */
AL_EXPORT size_t al_sizeof_token_data(void) { return sizeof(al_token_data); }
AL_EXPORT size_t al_sizeof_token_data_array(void) { return sizeof(al_token_data_array); }
AL_EXPORT size_t al_sizeof_sampler_iface(void) { return sizeof(al_sampler_iface); }
AL_EXPORT size_t al_sizeof_stats(void) { return sizeof(al_stats); }
