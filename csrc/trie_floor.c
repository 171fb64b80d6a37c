/* trie_floor.c: a benchmark driver, not part of the extension. It runs the
 * token-trie workload of bench/test_trie.py in C alone (no Python) and
 * measures, in the same process and memory, what any store keeping that
 * data must spend: the floor the trie's cold figures are held to.
 *
 * Usage: trie_floor SESSIONS TURNS SYSTEM TASK NEW_MIN NEW_MAX VOCAB QUERY ROUNDS
 * Prints one JSON object (microseconds per call, medians over ROUNDS):
 *
 *   insert_trie_us   what the binding does per call: rle_trie_walk, then
 *                    rle_trie_insert_checked (the input checked as stored),
 *                    sessions in lockstep, whole conversation per call;
 *   insert_floor_us  the least an insert can do: compare the stored prefix
 *                    (already-laid-out runs, no tree) and append the new suffix's
 *                    tokens, logprobs and versions to memory mapped beforehand
 *                    (no page faults: a lower bound for any allocator);
 *   match_trie_us    rle_trie_walk of a 1,800-token query, sessions in random order;
 *   match_floor_us   memcmp of the query against the same stored edges, their
 *                    addresses known in advance (no walk, no node records),
 *                    so all of their first lines are requested up front;
 *   match_query_us   reading the query alone, which every matcher must do.
 *
 * Every call gets its own input buffers, allocated in call order, as in the
 * Python benchmark; neither the trie nor the inputs fit in cache, so these
 * are DRAM figures. Built and run by bench/trie_floor.py, for the benchmarks in
 * bench/test_trie.py and for `make floor`.
 * It may include trie_arena.h: it lives in csrc/.
 */

#include "trie_arena.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL) {
        fprintf(stderr, "trie_floor: out of memory\n");
        exit(2);
    }
    return p;
}

static void *dup(const void *src, size_t n)
{
    void *p = xmalloc(n);
    memcpy(p, src, n);
    return p;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct {
    int32_t session;
    int64_t n;
    int32_t *tok;
    float *lp;
    int32_t *ver;
} call_t;

/* The floor store: each session's stored data as runs in bump-allocated
 * blocks (three parallel arrays, like the trie's), no nodes, no search. */
typedef struct {
    const int32_t *tok;
    int64_t len;
} run_t;

/* The floor store's memory: one arena of three parallel arrays, allocated
 * and written once before the rounds, so appends never fault a page in. */
typedef struct {
    int32_t *tok;
    float *lp;
    int32_t *ver;
    int64_t used;
} arena_t;

int main(int argc, char **argv)
{
    if (argc != 10) {
        fprintf(stderr, "usage: %s SESSIONS TURNS SYSTEM TASK NEW_MIN NEW_MAX VOCAB QUERY ROUNDS\n", argv[0]);
        return 2;
    }
    int64_t a[9];
    for (int i = 0; i < 9; i++)
        a[i] = atoll(argv[i + 1]);
    const int32_t S = (int32_t)a[0], T = (int32_t)a[1];
    const int64_t SYS = a[2], TASK = a[3], NMIN = a[4], NMAX = a[5], VOCAB = a[6], Q = a[7];
    const int ROUNDS = (int)a[8];
#ifdef __GLIBC__
    /* Keep freed memory in the heap: after the untimed first round the trie
     * reuses pages already mapped, as it does in a long-lived process (and
     * in the Python benchmark), instead of faulting fresh ones in. */
    mallopt(M_MMAP_THRESHOLD, 1 << 30);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
    const int64_t P = SYS + TASK;

    /* Conversations, as in bench/test_trie.py's Workload (other random draws). */
    int32_t *system = xmalloc((size_t)SYS * sizeof(int32_t));
    for (int64_t i = 0; i < SYS; i++)
        system[i] = (int32_t)(rng() % (uint64_t)VOCAB);
    int64_t *ends = xmalloc((size_t)S * (size_t)T * sizeof(int64_t));
    int32_t **conv = xmalloc((size_t)S * sizeof(int32_t *));
    float **conv_lp = xmalloc((size_t)S * sizeof(float *));
    int32_t **conv_ver = xmalloc((size_t)S * sizeof(int32_t *));
    for (int32_t s = 0; s < S; s++) {
        int64_t n = P;
        for (int32_t t = 0; t < T; t++) {
            n += NMIN + (int64_t)(rng() % (uint64_t)(NMAX - NMIN + 1));
            ends[(int64_t)s * T + t] = n;
        }
        conv[s] = xmalloc((size_t)n * sizeof(int32_t));
        conv_lp[s] = xmalloc((size_t)n * sizeof(float));
        conv_ver[s] = xmalloc((size_t)n * sizeof(int32_t));
        memcpy(conv[s], system, (size_t)SYS * sizeof(int32_t));
        for (int64_t i = SYS; i < n; i++)
            conv[s][i] = (int32_t)(rng() % (uint64_t)VOCAB);
        for (int64_t i = 0; i < n; i++) {
            conv_lp[s][i] = i < P ? 0.0f : -(float)(rng() % 1000000) / 1e6f;
            conv_ver[s][i] = -1;
        }
        for (int32_t t = 0, i = (int32_t)P; t < T; t++)
            for (; i < ends[(int64_t)s * T + t]; i++)
                conv_ver[s][i] = t;
    }

    /* Per-call inputs in call order (turn-major), for both stores. */
    int64_t ncalls = (int64_t)S * T, call_tokens = 0;
    call_t *calls[2];
    for (int k = 0; k < 2; k++) {
        calls[k] = xmalloc((size_t)ncalls * sizeof(call_t));
        for (int32_t t = 0; t < T; t++)
            for (int32_t s = 0; s < S; s++) {
                int64_t n = ends[(int64_t)s * T + t];
                calls[k][(int64_t)t * S + s] = (call_t){s, n, dup(conv[s], (size_t)n * 4), dup(conv_lp[s], (size_t)n * 4),
                                                        dup(conv_ver[s], (size_t)n * 4)};
                if (k == 0)
                    call_tokens += n;
            }
    }

    int64_t stored = 0;
    for (int32_t s = 0; s < S; s++)
        stored += ends[(int64_t)s * T + T - 1];
    arena_t store = {xmalloc((size_t)stored * 4), xmalloc((size_t)stored * 4), xmalloc((size_t)stored * 4), 0};
    memset(store.tok, 0, (size_t)stored * 4);
    memset(store.lp, 0, (size_t)stored * 4);
    memset(store.ver, 0, (size_t)stored * 4);
    double *ins_trie = xmalloc((size_t)ROUNDS * sizeof(double)), *ins_floor = xmalloc((size_t)ROUNDS * sizeof(double));
    rle_trie *trie = NULL;
    rle_handle *roots = xmalloc((size_t)S * sizeof(rle_handle));
    for (int r = -1; r < ROUNDS; r++) { /* round -1 is a warm-up, not kept */
        /* The trie: prompts stored untimed, then every call timed. */
        if (trie != NULL)
            rle_trie_free(trie);
        trie = rle_trie_new(0);
        for (int32_t s = 0; s < S; s++) {
            rle_cursor cur;
            rle_handle h;
            rle_trie_new_root(trie, &roots[s]);
            rle_trie_walk(trie, roots[s], conv[s], P, &cur);
            rle_trie_insert_at(trie, &cur, conv[s], NULL, NULL, P, RLE_KIND_PROMPT, -1, &h);
        }
        int64_t bad = 0;
        double t0 = now();
        for (int64_t c = 0; c < ncalls; c++) {
            const call_t *in = &calls[0][c];
            rle_cursor cur;
            rle_handle h;
            rle_bad_input which;
            rle_trie_walk(trie, roots[in->session], in->tok, in->n, &cur);
            bad += rle_trie_insert_checked(trie, &cur, in->tok, in->lp, in->ver, in->n, RLE_KIND_SAMPLED, -1, &h,
                                           &which) != RLE_OK;
        }
        if (r >= 0)
            ins_trie[r] = (now() - t0) / (double)ncalls * 1e6;

        /* The floor store, the same calls on their own input copies. */
        store.used = 0;
        run_t *runs = xmalloc((size_t)S * (size_t)(T + 1) * sizeof(run_t));
        int32_t *nruns = calloc((size_t)S, sizeof(int32_t));
        for (int32_t s = 0; s < S; s++) {
            memcpy(store.tok + store.used, conv[s], (size_t)P * 4);
            memset(store.lp + store.used, 0, (size_t)P * 4);
            memset(store.ver + store.used, 0xff, (size_t)P * 4);
            runs[(int64_t)s * (T + 1)] = (run_t){store.tok + store.used, P};
            nruns[s] = 1;
            store.used += P;
        }
        t0 = now();
        for (int64_t c = 0; c < ncalls; c++) {
            const call_t *in = &calls[1][c];
            run_t *rs = &runs[(int64_t)in->session * (T + 1)];
            int64_t m = 0;
            for (int32_t k = 0; k < nruns[in->session]; k++) {
                bad += memcmp(rs[k].tok, in->tok + m, (size_t)rs[k].len * 4) != 0;
                m += rs[k].len;
            }
            int64_t rest = in->n - m;
            memcpy(store.tok + store.used, in->tok + m, (size_t)rest * 4);
            memcpy(store.lp + store.used, in->lp + m, (size_t)rest * 4);
            memcpy(store.ver + store.used, in->ver + m, (size_t)rest * 4);
            rs[nruns[in->session]++] = (run_t){store.tok + store.used, rest};
            store.used += rest;
        }
        if (r >= 0)
            ins_floor[r] = (now() - t0) / (double)ncalls * 1e6;
        free(runs);
        free(nruns);
        if (bad) {
            fprintf(stderr, "trie_floor: %lld calls went wrong\n", (long long)bad);
            return 1;
        }
    }

    /* Matching: the last round's trie, queries in random session order. */
    int32_t *order = xmalloc((size_t)S * sizeof(int32_t));
    int32_t nq = 0;
    for (int32_t s = 0; s < S; s++)
        if (ends[(int64_t)s * T + T - 1] >= Q)
            order[nq++] = s;
    for (int32_t i = nq - 1; i > 0; i--) {
        int32_t j = (int32_t)(rng() % (uint64_t)(i + 1)), tmp = order[i];
        order[i] = order[j];
        order[j] = tmp;
    }
    /* Only sessions with Q tokens are queried; their queries are allocated
     * in query order, as the Python benchmark's are. */
    int32_t **queries = xmalloc((size_t)S * sizeof(int32_t *));
    for (int32_t i = 0; i < nq; i++)
        queries[order[i]] = dup(conv[order[i]], (size_t)Q * 4);
    /* Each queried session's stored edges along its path, root first, cut at Q. */
    int32_t maxe = T + 2;
    run_t *edges = xmalloc((size_t)S * (size_t)maxe * sizeof(run_t));
    int32_t *nedges = calloc((size_t)S, sizeof(int32_t));
    for (int32_t i = 0; i < nq; i++) {
        int32_t s = order[i];
        rle_cursor cur;
        rle_trie_walk(trie, roots[s], conv[s], Q, &cur);
        int32_t path[64], np = 0;
        for (int32_t n = cur.node; n >= 0 && np < 64; n = trie->nodes[n].parent)
            if (trie->nodes[n].len > 0)
                path[np++] = n;
        int64_t left = Q;
        for (int32_t k = np - 1; k >= 0 && left > 0 && nedges[s] < maxe; k--) {
            const node_t *nd = &trie->nodes[path[k]];
            int64_t len = min64(nd->len, left);
            edges[(int64_t)s * maxe + nedges[s]++] = (run_t){edge_tokens(trie, nd), len};
            left -= len;
        }
    }
    double *m_trie = xmalloc((size_t)ROUNDS * sizeof(double)), *m_floor = xmalloc((size_t)ROUNDS * sizeof(double)),
           *m_query = xmalloc((size_t)ROUNDS * sizeof(double));
    int64_t check = 0;
    for (int r = 0; r < ROUNDS; r++) {
        double t0 = now();
        for (int32_t i = 0; i < nq; i++) {
            rle_cursor cur;
            rle_trie_walk(trie, roots[order[i]], queries[order[i]], Q, &cur);
            check += cur.matched;
        }
        m_trie[r] = (now() - t0) / nq * 1e6;
        t0 = now();
        for (int32_t i = 0; i < nq; i++) {
            int32_t s = order[i];
            const int32_t *q = queries[s];
            /* The addresses are known, so every edge's first lines and the
             * query's are requested at once, and compared after: about 10 %
             * below comparing edge by edge, where each edge's first DRAM wait
             * comes in turn. (One or two lines per edge gained less; the
             * whole path at once, nothing.) */
            for (int32_t k = 0; k < nedges[s]; k++)
                for (int j = 0; j < 4; j++)
                    __builtin_prefetch(edges[(int64_t)s * maxe + k].tok + 16 * j);
            for (int j = 0; j < 8; j++)
                __builtin_prefetch(q + 16 * j);
            for (int32_t k = 0; k < nedges[s]; k++) {
                const run_t *e = &edges[(int64_t)s * maxe + k];
                check += memcmp(e->tok, q, (size_t)e->len * 4) == 0 ? e->len : 0;
                q += e->len;
            }
        }
        m_floor[r] = (now() - t0) / nq * 1e6;
        t0 = now();
        for (int32_t i = 0; i < nq; i++) {
            const int32_t *q = queries[order[i]];
            int32_t acc = 0;
            for (int64_t k = 0; k < Q; k++)
                acc |= q[k];
            check += acc >= 0 ? Q : 0;
        }
        m_query[r] = (now() - t0) / nq * 1e6;
    }
    if (check != 3 * (int64_t)ROUNDS * nq * Q) {
        fprintf(stderr, "trie_floor: matched %lld tokens, expected %lld\n", (long long)check,
                (long long)(3 * (int64_t)ROUNDS * nq * Q));
        return 1;
    }
    rle_trie_stats st;
    rle_trie_stats_get(trie, &st);
    if (st.live_tokens != stored) {
        fprintf(stderr, "trie_floor: the trie holds %lld tokens, the conversations %lld\n", (long long)st.live_tokens,
                (long long)stored);
        return 1;
    }
    printf("{\"calls\": %lld, \"tokens_per_call\": %.1f, \"queries\": %d, \"stored_tokens\": %lld, "
           "\"insert_trie_us\": %.3f, \"insert_floor_us\": %.3f, "
           "\"match_trie_us\": %.3f, \"match_floor_us\": %.3f, \"match_query_us\": %.3f}\n",
           (long long)ncalls, (double)call_tokens / (double)ncalls, nq, (long long)st.live_tokens,
           median(ins_trie, ROUNDS), median(ins_floor, ROUNDS), median(m_trie, ROUNDS), median(m_floor, ROUNDS),
           median(m_query, ROUNDS));
    rle_trie_free(trie);
    return 0;
}
