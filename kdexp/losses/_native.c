/* The student half of a Top-K KD chunk in one pass per row (kdexp/losses/_native.py builds and loads this file).

   The eager code (_sparse.py, student_half on the held-gradient path) makes ~8 passes over each [rows, V] chunk:
   a copy, a -inf scatter at S, a max, sub / floor / exp / sum, a gather of S. Each is a memory-bound torch op. Here
   one row at a time stays in L1/L2 while everything the loss needs is formed from it. The arithmetic is the eager
   code's, term by term (see the comments); exp is a vectorisable Cephes-style expf (about 1 ulp), 0 below -87.3
   (where expf is subnormal: < 1.2e-38), NaN in -> NaN out.

   Build: cc -O3 -march=native -fopenmp -fPIC -shared (no Python or torch headers: plain pointers via ctypes). Linked
   against libgomp.so.1, the soname torch's own OpenMP runtime has, so in a torch process both share one thread
   pool. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float kd_exp(float x) {
    /* exp(x) = 2^n exp(r), n = rint(x log2 e), r = x - n ln 2 in [-ln2/2, ln2/2]; Cephes expf's polynomial */
    float xc = x > 88.7f ? 88.7f : x;
    xc = xc < -87.3f ? -87.3f : xc;
    float n = rintf(xc * 1.44269504088896341f);
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    union { int32_t i; float f; } u;
    u.i = bits;
    y = y * u.f;
    y = x < -87.3f ? 0.0f : y;
    y = x > 88.7f ? INFINITY : y;
    return y;  /* NaN: every comparison is false, r and so y are NaN */
}

/* Forward, per row r of a chunk (strides in elements):
     s[r, :V]    the raw student logits          idx[r, :K] S, global = local column ids (no TP), int64
     held[r, :V] <- exp((s - f) / T) outside S, 0 on S
     e[r, :K]    <- exp(sv), sv = (s[idx] - centre) / T           (centre: the row max, 0 if not finite)
     b[r, :K]    <- sv - lse       (the student's kept log-probs; b NULL: not stored, forward KL needs only the sum)
     row[r, 0..4] <- centre, lns (log-sum-exp outside S, centred), sum of the held row, lse, total
   where total = sum(e) + exp(lns) (as student_half: e.sum(1).add_(lns.exp())). The frame f is the centre: one exp
   pass over the row gives the held exps and, gathered at S, e. Where the mass outside S is below 1e-20 of the row
   max's (a near-converged row: the eager code's case for a log-sum-exp taken in the complement's own frame) the
   held row is recomputed with f = the max outside S, so that its exps stay normal floats and lns keeps relative
   precision down to any residual (exps below -87.3 are 0 here, < 1.2e-38 each: with the sum >= 1e-20 that is
   < 2e-13 relative for 152k entries).
   With a (teacher log-probs of S, stride sa; NULL: none) also
     p[r, :K]    <- exp(a),  row[r, 5] <- sum p (a - b)           (forward KL over S)
   Returns 0, -1 (no memory for a row mask), or 1 + the first row holding an index outside [0, V). */
long kd_topk_forward(long n, long V, long K, const float *s, long ss, const int64_t *idx, long si, float inv_t,
                     float *held, long hs, float *e, float *b, const float *a, long sa, float *p, float *row,
                     int nthreads) {
    long bad = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *mask = NULL;  /* the far-tail rows' scratch, allocated on first need */
        float *kb = b == NULL ? (float *)malloc(sizeof(float) * (size_t)K) : NULL;  /* b when not wanted */
#pragma omp for schedule(static)
        for (long r = 0; r < n; r++) {
            const float *x = s + r * ss;
            const int64_t *ix = idx + r * si;
            float *h = held + r * hs, *er = e + r * K, *br = b != NULL ? b + r * K : kb;
            if (br == NULL) {
#pragma omp critical
                bad = -1;
                continue;
            }
            float m = -INFINITY;
#pragma omp simd reduction(max : m)
            for (long i = 0; i < V; i++) m = x[i] > m ? x[i] : m;
            float centre = isfinite(m) ? m : 0.0f;
#pragma omp simd
            for (long i = 0; i < V; i++) h[i] = kd_exp((x[i] - centre) * inv_t);
            int ok = 1;
            for (long j = 0; j < K; j++) {  /* S: its logits and exps, then out of the held row */
                int64_t c = ix[j];
                if (c < 0 || c >= V) { ok = 0; c = 0; }
                br[j] = x[c];
                er[j] = h[c];
                h[c] = 0.0f;
            }
            if (!ok) {
#pragma omp critical
                if (bad == 0 || r + 1 < bad) bad = r + 1;
                continue;
            }
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (long i = 0; i < V; i++) sum += h[i];
            float lns;
            if (K >= V) {  /* nothing outside S: no residual; 1 keeps the backward's held / sum finite */
                lns = -INFINITY;
                sum = 1.0f;
            } else if (sum >= 1e-20f || isnan(sum)) {
                lns = logf(sum);
            } else {  /* far tail: the complement in its own frame */
                if (mask == NULL) mask = (float *)malloc(sizeof(float) * (size_t)V);
                if (mask == NULL) {
#pragma omp critical
                    bad = -1;
                    continue;
                }
                for (long i = 0; i < V; i++) mask[i] = 1.0f;
                for (long j = 0; j < K; j++) mask[ix[j]] = 0.0f;
                float mo = -INFINITY;
                for (long i = 0; i < V; i++) mo = (mask[i] != 0.0f && x[i] > mo) ? x[i] : mo;
                if (isfinite(mo)) {
                    sum = 0.0f;
                    for (long i = 0; i < V; i++) {
                        h[i] = mask[i] != 0.0f ? kd_exp((x[i] - mo) * inv_t) : 0.0f;  /* S is above mo: inf */
                        sum += h[i];
                    }
                    lns = logf(sum) + (mo - centre) * inv_t;
                } else {  /* everything outside S is -inf */
                    for (long i = 0; i < V; i++) h[i] = 0.0f;
                    lns = -INFINITY;
                    sum = 1.0f;
                }
            }
            float esum = 0.0f;
#pragma omp simd reduction(+ : esum)
            for (long j = 0; j < K; j++) {
                br[j] = (br[j] - centre) * inv_t;
                esum += er[j];
            }
            float total = esum + expf(lns);
            float lse = logf(total);
#pragma omp simd
            for (long j = 0; j < K; j++) br[j] -= lse;
            float *o = row + r * 6;
            o[0] = centre;
            o[1] = lns;
            o[2] = sum;
            o[3] = lse;
            o[4] = total;
            o[5] = 0.0f;
            if (a != NULL) {
                const float *ar = a + r * sa;
                float *pr = p + r * K;
                float kl = 0.0f;
#pragma omp simd reduction(+ : kl)
                for (long j = 0; j < K; j++) {
                    float pv = kd_exp(ar[j]);
                    pr[j] = pv;
                    kl += pv == 0.0f ? 0.0f : pv * (ar[j] - br[j]);  /* 0 log 0 = 0: a -inf teacher entry adds 0 */
                }
                o[5] = kl;
            }
        }
        free(mask);
        free(kb);
    }
    return bad;
}

/* Backward of forward KL with every candidate kept (_SplitGrad), per row r, in place on the held rows:
     g[r, i] *= f_out[r]                          (outside S: exp((s - centre) / T - lns) (h - G r_s) sc, held / sum)
     g[r, idx[r, j]] = e[r, j] f_s[r] - p[r, j] sc[r]     (on S: e (w sc + gl / total) - p sc)
   Every id is checked before a row is written (the ids are the caller's memory): returns 0, or 1 + the first row
   holding an id outside [0, V), whose row is left as it was. */
long kd_topk_backward(long n, long V, long K, float *g, long gs, const int64_t *idx, long si, const float *e,
                      const float *p, const float *f_out, const float *f_s, const float *sc, int nthreads) {
    long bad = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (long r = 0; r < n; r++) {
        float *x = g + r * gs;
        const int64_t *ix = idx + r * si;
        int ok = 1;
        for (long j = 0; j < K; j++) ok &= ix[j] >= 0 && ix[j] < V;
        if (!ok) {
#pragma omp critical
            if (bad == 0 || r + 1 < bad) bad = r + 1;
            continue;
        }
        const float *er = e + r * K, *pr = p + r * K;
        float fo = f_out[r], fs = f_s[r], c = sc[r];
#pragma omp simd
        for (long i = 0; i < V; i++) x[i] *= fo;
        for (long j = 0; j < K; j++) x[ix[j]] = er[j] * fs - pr[j] * c;
    }
    return bad;
}

/* Sampled KD (sampled.py's _SparseCE), per row r: the student's log-sum-exp and its logits at the drawn ids, both
   centred on the row max (0 if not finite), as the logit losses centre theirs: formed from uncentred logits around
   300 their difference would carry an error of one ulp of 300 (3e-5).
     centre[r] <- max_i z[r, i]
     lse[r] <- log sum_i exp((z[r, i] - centre) inv_t)
     picked[r, j] <- (z[r, ids[r, j]] - centre) inv_t
   A reduction: nothing [V]-sized is written (the eager code writes the log-softmax it then reads one column of).
   Returns 0 or 1 + the first row holding an id outside [0, V). */
long kd_sampled_forward(long n, long V, long S, const float *z, long zs, const int64_t *ids, long is, float inv_t,
                        float *centre_out, float *lse, float *picked, int nthreads) {
    long bad = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (long r = 0; r < n; r++) {
        const float *x = z + r * zs;
        const int64_t *ix = ids + r * is;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (long i = 0; i < V; i++) m = x[i] > m ? x[i] : m;
        float centre = isfinite(m) ? m : 0.0f;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (long i = 0; i < V; i++) acc += kd_exp((x[i] - centre) * inv_t);
        centre_out[r] = centre;
        lse[r] = logf(acc);
        int ok = 1;
        for (long j = 0; j < S; j++) {
            int64_t c = ix[j];
            if (c < 0 || c >= V) { ok = 0; c = 0; }
            picked[r * S + j] = (x[c] - centre) * inv_t;
        }
        if (!ok) {
#pragma omp critical
            if (bad == 0 || r + 1 < bad) bad = r + 1;
        }
    }
    return bad;
}

/* Its backward, per row r, into g:  g[r, i] = exp((z[r, i] - centre[r]) inv_t - lse[r]) coef[r], then
   g[r, ids[r, j]] += wn[r, j] (the student softmax scaled, minus the weights: the eager code's sub / exp / mul passes
   and scatter_add in one). Ids are checked first, as in kd_topk_backward: 0 or 1 + the first bad row. */
long kd_sampled_backward(long n, long V, long S, const float *z, long zs, float inv_t, const float *centre,
                         const float *lse, const float *coef, const int64_t *ids, long is, const float *wn, float *g,
                         long gs, int nthreads) {
    long bad = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (long r = 0; r < n; r++) {
        const float *x = z + r * zs;
        float *o = g + r * gs;
        const int64_t *ix = ids + r * is;
        int ok = 1;
        for (long j = 0; j < S; j++) ok &= ix[j] >= 0 && ix[j] < V;
        if (!ok) {
#pragma omp critical
            if (bad == 0 || r + 1 < bad) bad = r + 1;
            continue;
        }
        float f = centre[r], l = lse[r], c = coef[r];
#pragma omp simd
        for (long i = 0; i < V; i++) o[i] = kd_exp((x[i] - f) * inv_t - l) * c;
        for (long j = 0; j < S; j++) o[ix[j]] += wn[r * S + j];
    }
    return bad;
}
