/* Decode steps of one to CONVEYOR_MAX_ROWS rows on CPU (fp32): every layer of a dense decoder in
 * one call, built at load time by executor/cpu_decode.py with the machine's C compiler.
 *
 * Why C: at a few rows a step streams every weight once and is bound by memory, so the matmuls
 * take what they must; what is left is the dispatch of ~60 small torch ops per layer from Python,
 * each of which, right after a matmul has streamed megabytes through the caches, finds the
 * interpreter's and the dispatcher's code and data evicted. Here the small ops are a few loops.
 *
 * Layouts: weights in panels of 16 rows (PANEL_GROUP below; the kernel's own copy), the rest as the
 * executor has them: paged K/V [num_blocks, block_size, kv_heads, head_dim], the rotary table
 * [max_pos, rot_dim] = cat(cos, sin) (neox style on the first rot_dim channels of each head).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CONVEYOR_MAX_ROWS 8
#define MAX_REP 64 /* query heads per KV head */
#define VEC 16
/* Weights in panels: W [N, K] as [P, K, VEC], panel p holding rows p VEC .. p VEC + VEC - 1
 * interleaved (row-major within a k), P padded with zero rows to a multiple of PANEL_GROUP / VEC
 * (what `panels` in executor/cpu_decode.py writes). */
#define PANEL_GROUP 64

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));
typedef float vec_u __attribute__((vector_size(VEC * sizeof(float)), aligned(4)));

typedef struct {                       /* matrices [out, in] as panels; biases [out] or NULL */
    const float *in_norm, *post_norm;  /* [hidden] */
    const float *qkv, *qkv_bias;       /* [(heads + 2 kv_heads) head_dim, hidden] */
    const float *q_norm, *k_norm;      /* [head_dim] or NULL (both or neither) */
    const float *o, *o_bias;           /* [hidden, heads head_dim] */
    const float *gate_up, *gate_up_bias; /* [2 inter, hidden] */
    const float *down, *down_bias;     /* [hidden, inter] */
    float *k_cache, *v_cache;          /* [num_blocks, block_size, kv_heads, head_dim] */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, rot_dim, inter, block_size, num_layers;
    double eps, scale;
} Dims;

int conveyor_max_rows(void) { return CONVEYOR_MAX_ROWS; }
int conveyor_panel_rows(void) { return VEC; }
int conveyor_panel_group(void) { return PANEL_GROUP; }

static inline vec load(const float *p) { return *(const vec_u *)p; }

static inline vec splat(float x) { return (vec){0} + x; }

/* Y[b, n] = X[b, :] . W[n, :] (+ bias[n]) for NB rows of X, with W in panels (`conveyor_decode`):
 * each k adds x[b][k] times 16 consecutive rows' weights to 16 outputs held in one register, so
 * there is no horizontal sum, and NP panels stream at once (more loads in flight). Each weight is
 * read once for all rows of X. Work-sharing loops: called inside a parallel region, ending at its
 * barrier; chunks are handed out dynamically, as the two halves of a static split finish far apart
 * on a shared machine (and the early thread sleeps). */
#define DEFINE_LINEAR(NB, NP)                                                                    \
    static void linear_##NB(const float *W, const float *bias, const float *X, float *Y,        \
                            int64_t N, int64_t K) {                                              \
        const int64_t panels = (N + PANEL_GROUP - 1) / PANEL_GROUP * (PANEL_GROUP / VEC);        \
        _Pragma("omp for schedule(dynamic, 1)") for (int64_t p0 = 0; p0 < panels; p0 += NP) {   \
            vec a[NP][NB];                                                                       \
            for (int p = 0; p < NP; ++p)                                                         \
                for (int b = 0; b < NB; ++b) a[p][b] = (vec){0};                                 \
            const float *w = W + p0 * K * VEC;                                                   \
            for (int64_t k = 0; k < K; ++k) {                                                    \
                vec x[NB];                                                                       \
                for (int b = 0; b < NB; ++b) x[b] = splat(X[b * K + k]);                         \
                for (int p = 0; p < NP; ++p) {                                                   \
                    const vec wv = load(w + (p * K + k) * VEC);                                  \
                    for (int b = 0; b < NB; ++b) a[p][b] += wv * x[b];                           \
                }                                                                                \
            }                                                                                    \
            for (int p = 0; p < NP; ++p) {                                                       \
                const int64_t n0 = (p0 + p) * VEC;                                               \
                for (int b = 0; b < NB; ++b) {                                                   \
                    vec out = a[p][b];                                                           \
                    if (n0 + VEC <= N) {                                                         \
                        if (bias) out += load(bias + n0);                                        \
                        *(vec_u *)(Y + b * N + n0) = out;                                        \
                    } else {                                                                     \
                        for (int64_t i = 0; n0 + i < N; ++i)                                     \
                            Y[b * N + n0 + i] = bias ? out[i] + bias[n0 + i] : out[i];           \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }
DEFINE_LINEAR(1, 4)
DEFINE_LINEAR(2, 4)
DEFINE_LINEAR(3, 4)
DEFINE_LINEAR(4, 4)
DEFINE_LINEAR(5, 2)
DEFINE_LINEAR(6, 2)
DEFINE_LINEAR(7, 2)
DEFINE_LINEAR(8, 2)

typedef void (*linear_fn)(const float *, const float *, const float *, float *, int64_t, int64_t);
static const linear_fn LINEAR[CONVEYOR_MAX_ROWS + 1] = {
    0, linear_1, linear_2, linear_3, linear_4, linear_5, linear_6, linear_7, linear_8,
};

/* out = x / rms(x) * w over n channels (the sum of squares in double, as torch's fp32 kernel
 * accumulates wide). */
static void rms_norm(const float *x, const float *w, float *out, int64_t n, double eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += (double)x[i] * x[i];
    const float inv = (float)(1.0 / sqrt(ss / (double)n + eps));
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

static void rotate(float *x, const float *cos_sin, int64_t rot) {
    const int64_t half = rot / 2;
    const float *c = cos_sin, *s = cos_sin + half;
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
    }
}

/* Floats of scratch memory `conveyor_decode` needs for `rows` rows and contexts up to `max_ctx`. */
int64_t conveyor_work_floats(const Dims *d, int64_t rows, int64_t max_ctx) {
    const int64_t qkv = (d->heads + 2 * d->kv_heads) * d->head_dim;
    return rows * (2 * d->hidden + qkv + d->heads * d->head_dim + 3 * d->inter) + rows * d->heads * max_ctx;
}

/* One decode step of `rows` sequences through every layer.
 * h [rows, hidden]: the embeddings in, the last hidden states (block output + residual) out.
 * block_tables [rows, bt_stride] (int32), slots / positions / ctx_lens [rows] (int64: where the
 * new K/V goes, the rotary position, the context including the new token). With `logits` (else
 * NULL), also the head: logits [rows, vocab] = rms_norm(h, norm) lm_head^T, in the same region. */
int conveyor_decode(const Dims *d, const Layer *layers, int64_t rows, float *h, const int32_t *block_tables,
                    int64_t bt_stride, const int64_t *slots, const int64_t *positions, const int64_t *ctx_lens,
                    const float *rope_table, float *work, const float *norm, const float *lm_head, int64_t vocab,
                    float *logits, int threads) {
    if (rows < 1 || rows > CONVEYOR_MAX_ROWS) return -1;
    const int64_t H = d->hidden, hq = d->heads, hkv = d->kv_heads, hd = d->head_dim, I = d->inter;
    const int64_t qkv_n = (hq + 2 * hkv) * hd, kv_row = hkv * hd, rep = hq / hkv, bs = d->block_size;
    if (rep > MAX_REP) return -2;
    /* Whole groups of query heads per attention job when that still gives every thread one. */
    const int64_t per_job = rows * hkv >= threads ? rep : 1;
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < rows; ++b) max_ctx = ctx_lens[b] > max_ctx ? ctx_lens[b] : max_ctx;
    float *residual = work, *x = residual + rows * H, *qkv = x + rows * H, *attn = qkv + rows * qkv_n;
    float *gu = attn + rows * hq * hd, *act = gu + rows * 2 * I, *scores = act + rows * I;
    const linear_fn linear = LINEAR[rows];
    memset(residual, 0, sizeof(float) * rows * H);

    /* One parallel region for the whole step: the small serial parts run on one thread while the
     * others wait at the barrier, spinning, rather than the team being woken for every matmul. */
    _Pragma("omp parallel num_threads(threads)") {
    for (int64_t l = 0; l < d->num_layers; ++l) {
        const Layer *L = &layers[l];
        _Pragma("omp single") for (int64_t b = 0; b < rows; ++b) {
            float *r = residual + b * H;
            for (int64_t i = 0; i < H; ++i) r[i] += h[b * H + i];
            rms_norm(r, L->in_norm, x + b * H, H, d->eps);
        }
        linear(L->qkv, L->qkv_bias, x, qkv, qkv_n, H);
        _Pragma("omp single") for (int64_t b = 0; b < rows; ++b) {
            float *q = qkv + b * qkv_n, *k = q + hq * hd, *v = k + kv_row;
            if (L->q_norm) {
                for (int64_t i = 0; i < hq; ++i) rms_norm(q + i * hd, L->q_norm, q + i * hd, hd, d->eps);
                for (int64_t i = 0; i < hkv; ++i) rms_norm(k + i * hd, L->k_norm, k + i * hd, hd, d->eps);
            }
            const float *cs = rope_table + positions[b] * d->rot_dim;
            for (int64_t i = 0; i < hq; ++i) rotate(q + i * hd, cs, d->rot_dim);
            for (int64_t i = 0; i < hkv; ++i) rotate(k + i * hd, cs, d->rot_dim);
            memcpy(L->k_cache + slots[b] * kv_row, k, sizeof(float) * kv_row);
            memcpy(L->v_cache + slots[b] * kv_row, v, sizeof(float) * kv_row);
        }
        /* Attention over each row's context: a job takes `per_job` query heads of one KV head
         * (all of them when there are enough jobs for the threads), so the K/V rows it reads
         * serve them all; each head has its own slice of scores. */
        _Pragma("omp for schedule(static)") for (int64_t job = 0; job < rows * hq / per_job; ++job) {
            const int64_t b = job / (hq / per_job), head0 = job % (hq / per_job) * per_job, g = head0 / rep;
            const int64_t ctx = ctx_lens[b];
            const int32_t *bt = block_tables + b * bt_stride;
            const float *q = qkv + b * qkv_n + head0 * hd;
            float *s = scores + (b * hq + head0) * max_ctx, *out = attn + (b * hq + head0) * hd;
            float mx[MAX_REP], sum[MAX_REP];
            for (int64_t i = 0; i < per_job; ++i) mx[i] = -INFINITY, sum[i] = 0.f;
            for (int64_t p = 0; p < ctx; ++p) {
                const float *kp = L->k_cache + ((int64_t)bt[p / bs] * bs + p % bs) * kv_row + g * hd;
                for (int64_t i = 0; i < per_job; ++i) {
                    const float *qi = q + i * hd;
                    float dot = 0.f;
                    _Pragma("omp simd reduction(+ : dot)") for (int64_t j = 0; j < hd; ++j) dot += qi[j] * kp[j];
                    const float sc = dot * (float)d->scale;
                    s[i * max_ctx + p] = sc;
                    mx[i] = sc > mx[i] ? sc : mx[i];
                }
            }
            for (int64_t i = 0; i < per_job; ++i) {
                float *si = s + i * max_ctx;
                for (int64_t p = 0; p < ctx; ++p) sum[i] += (si[p] = expf(si[p] - mx[i]));
                for (int64_t p = 0; p < ctx; ++p) si[p] /= sum[i];
            }
            for (int64_t j = 0; j < per_job * hd; ++j) out[j] = 0.f;
            for (int64_t p = 0; p < ctx; ++p) {
                const float *vp = L->v_cache + ((int64_t)bt[p / bs] * bs + p % bs) * kv_row + g * hd;
                for (int64_t i = 0; i < per_job; ++i) {
                    const float pr = s[i * max_ctx + p];
                    float *oi = out + i * hd;
                    _Pragma("omp simd") for (int64_t j = 0; j < hd; ++j) oi[j] += pr * vp[j];
                }
            }
        }
        linear(L->o, L->o_bias, attn, h, H, hq * hd);
        _Pragma("omp single") for (int64_t b = 0; b < rows; ++b) {
            float *r = residual + b * H;
            for (int64_t i = 0; i < H; ++i) r[i] += h[b * H + i];
            rms_norm(r, L->post_norm, x + b * H, H, d->eps);
        }
        linear(L->gate_up, L->gate_up_bias, x, gu, 2 * I, H);
        _Pragma("omp for schedule(static)") for (int64_t j = 0; j < rows * I; ++j) {
            const float gate = gu[(j / I) * 2 * I + j % I], up = gu[(j / I) * 2 * I + I + j % I];
            act[j] = gate / (1.f + expf(-gate)) * up;
        }
        linear(L->down, L->down_bias, act, h, H, I);
    }
    _Pragma("omp single") for (int64_t b = 0; b < rows; ++b) {
        for (int64_t i = 0; i < H; ++i) h[b * H + i] += residual[b * H + i];
        if (logits) rms_norm(h + b * H, norm, x + b * H, H, d->eps);
    }
    if (logits) linear(lm_head, 0, x, logits, vocab, H);
    }
    return 0;
}

/* Y [rows, N] = X [rows, K] W^T (+ bias), W in panels: the kernel's matrix product on its own. The
 * entry points take the thread count: an OpenMP thread count set elsewhere (torch's) belongs to
 * the thread that set it. */
int conveyor_linear(const float *W, const float *bias, const float *X, float *Y, int64_t rows, int64_t N, int64_t K,
                    int threads) {
    if (rows < 1 || rows > CONVEYOR_MAX_ROWS) return -1;
    _Pragma("omp parallel num_threads(threads)") LINEAR[rows](W, bias, X, Y, N, K);
    return 0;
}

/* logits [rows, vocab] = rms_norm(hidden) lm_head^T (lm_head in panels): the model's head. */
int conveyor_logits(const Dims *d, const float *norm, const float *lm_head, int64_t vocab, int64_t rows,
                    const float *hidden, float *normed, float *logits, int threads) {
    if (rows < 1 || rows > CONVEYOR_MAX_ROWS) return -1;
    for (int64_t b = 0; b < rows; ++b) rms_norm(hidden + b * d->hidden, norm, normed + b * d->hidden, d->hidden, d->eps);
    _Pragma("omp parallel num_threads(threads)") LINEAR[rows](lm_head, 0, normed, logits, vocab, d->hidden);
    return 0;
}
