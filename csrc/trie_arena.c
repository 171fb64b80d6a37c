/* trie_arena.c: the memory under the token trie: data blocks, node
 * records, compaction, and the memory bound.
 *
 * Blocks are allocated as the trie grows (each about a quarter of what it
 * holds, so the unused tail stays a small part of the 12 bytes a token costs)
 * and never move: growth copies nothing. Each block counts its live tokens;
 * a block whose last edge is pruned is freed at once (sessions dropped in
 * roughly the order they came free whole blocks). What a prune leaves
 * scattered is garbage, which a compaction slides down in place once it
 * outweighs the live data. The index of shared nodes' children is a hash
 * table here too. Everything held from malloc is counted, and with a bound
 * set, a reservation that would exceed it fails before anything changes.
 *
 * This file must not know the tree's shape beyond the node records' links:
 * walking, splitting and exporting live in trie.c.
 */

#include "trie_arena.h"

#include <stdlib.h>
#include <string.h>

static int64_t bytes_for(int64_t arena_cap, int64_t node_cap, int64_t blocks_cap, int64_t index_cap)
{
    return (int64_t)sizeof(rle_trie) + arena_cap * TOKEN_BYTES + node_cap * (int64_t)sizeof(node_t) +
           blocks_cap * (int64_t)sizeof(block_t) + index_cap * (int64_t)sizeof(slot_t);
}

/* -- the shared children's index ------------------------------------------------------- */

static inline uint64_t slot_home(int32_t parent, int32_t first, int64_t cap)
{
    /* splitmix64's finalizer: node indices and token ids are both small and dense. */
    uint64_t k = ((uint64_t)(uint32_t)parent << 32) | (uint32_t)first;
    k ^= k >> 30;
    k *= 0xbf58476d1ce4e5b9ull;
    k ^= k >> 27;
    k *= 0x94d049bb133111ebull;
    k ^= k >> 31;
    return k & (uint64_t)(cap - 1);
}

static int64_t slot_find(const rle_trie *t, int32_t parent, int32_t first)
{
    if (t->index_cap == 0)
        return -1;
    uint64_t mask = (uint64_t)t->index_cap - 1;
    for (uint64_t i = slot_home(parent, first, t->index_cap);; i = (i + 1) & mask) {
        const slot_t *s = &t->index[i];
        if (s->child < 0)
            return -1;
        if (s->parent == parent && s->first == first)
            return (int64_t)i;
    }
}

int32_t rle_index_get(const rle_trie *t, int32_t parent, int32_t first)
{
    int64_t i = slot_find(t, parent, first);
    return i < 0 ? -1 : t->index[i].child;
}

static void slot_place(slot_t *index, int64_t cap, slot_t entry)
{
    uint64_t mask = (uint64_t)cap - 1;
    uint64_t i = slot_home(entry.parent, entry.first, cap);
    while (index[i].child >= 0)
        i = (i + 1) & mask;
    index[i] = entry;
}

void rle_index_put(rle_trie *t, int32_t parent, int32_t first, int32_t child)
{
    int64_t i = slot_find(t, parent, first);
    if (i >= 0) {
        t->index[i].child = child;
        return;
    }
    slot_place(t->index, t->index_cap, (slot_t){parent, first, child});
    t->index_used++;
}

void rle_index_del(rle_trie *t, int32_t parent, int32_t first)
{
    int64_t found = slot_find(t, parent, first);
    if (found < 0)
        return;
    /* Backward-shift deletion: no tombstones, so probes stay short. An entry
     * after the hole moves into it unless its home lies in (hole, entry]. */
    uint64_t mask = (uint64_t)t->index_cap - 1, i = (uint64_t)found, j = i;
    for (;;) {
        j = (j + 1) & mask;
        slot_t *s = &t->index[j];
        if (s->child < 0)
            break;
        uint64_t home = slot_home(s->parent, s->first, t->index_cap);
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            t->index[i] = *s;
            i = j;
        }
    }
    t->index[i].child = -1;
    t->index_used--;
}

/* The index capacity needed to add `more` entries. */
static int64_t index_cap_for(const rle_trie *t, int64_t more)
{
    int64_t cap = t->index_cap;
    if (more == 0 || 2 * (t->index_used + more) <= cap)
        return cap;
    cap = max64(cap, 8);
    while (2 * (t->index_used + more) > cap)
        cap *= 2;
    return cap;
}

static int index_resize(rle_trie *t, int64_t cap)
{
    slot_t *fresh = malloc((size_t)cap * sizeof(slot_t));
    if (fresh == NULL)
        return RLE_ERR_NOMEM;
    memset(fresh, 0xff, (size_t)cap * sizeof(slot_t)); /* child -1: empty */
    for (int64_t i = 0; i < t->index_cap; i++)
        if (t->index[i].child >= 0)
            slot_place(fresh, cap, t->index[i]);
    free(t->index);
    t->index = fresh;
    t->index_cap = cap;
    return RLE_OK;
}

/* -- blocks ------------------------------------------------------------------------------ */

static void block_release(rle_trie *t, int32_t b)
{
    block_t *blk = &t->blocks[b];
    free(blk->tok);
    free(blk->lp);
    free(blk->ver);
    t->arena_cap -= blk->cap;
    t->garbage -= blk->used - blk->live;
    memset(blk, 0, sizeof(*blk));
    if (t->cur == b)
        t->cur = -1;
    while (t->nblocks > 0 && t->blocks[t->nblocks - 1].cap == 0)
        t->nblocks--;
}

static void blocks_release_all(rle_trie *t)
{
    for (int32_t b = 0; b < t->nblocks; b++)
        if (t->blocks[b].cap > 0)
            block_release(t, b);
    free(t->blocks);
    t->blocks = NULL;
    t->nblocks = t->blocks_cap = 0;
    t->cur = -1;
    t->arena_cap = t->garbage = 0;
}

static int32_t free_block_entry(const rle_trie *t)
{
    for (int32_t b = 0; b < t->nblocks; b++)
        if (t->blocks[b].cap == 0)
            return b;
    return t->nblocks;
}

/* The block table capacity needed to add one block. */
static int64_t blocks_cap_for_one_more(const rle_trie *t)
{
    if (free_block_entry(t) < t->blocks_cap)
        return t->blocks_cap;
    return max64((int64_t)t->blocks_cap * 2, BLOCKS_MIN);
}

/* Make a block of `cap` slots the current one; the old current block's tail
 * stays unused (garbage) until a compaction. */
static int block_add(rle_trie *t, int64_t cap)
{
    int64_t table = blocks_cap_for_one_more(t);
    if (table > INT32_MAX)
        return RLE_ERR_RANGE;
    if (table > t->blocks_cap) {
        block_t *grown = realloc(t->blocks, (size_t)table * sizeof(block_t));
        if (grown == NULL)
            return RLE_ERR_NOMEM;
        memset(grown + t->blocks_cap, 0, (size_t)(table - t->blocks_cap) * sizeof(block_t));
        t->blocks = grown;
        t->blocks_cap = (int32_t)table;
    }
    block_t fresh = {malloc((size_t)cap * sizeof(int32_t)), malloc((size_t)cap * sizeof(float)),
                     malloc((size_t)cap * sizeof(int32_t)), cap, 0, 0};
    if (fresh.tok == NULL || fresh.lp == NULL || fresh.ver == NULL) {
        free(fresh.tok);
        free(fresh.lp);
        free(fresh.ver);
        return RLE_ERR_NOMEM;
    }
    if (t->cur >= 0) {
        block_t *old = &t->blocks[t->cur];
        t->garbage += old->cap - old->used;
        old->used = old->cap;
    }
    int32_t b = free_block_entry(t);
    t->blocks[b] = fresh;
    if (b == t->nblocks)
        t->nblocks++;
    t->cur = b;
    t->arena_cap += cap;
    return RLE_OK;
}

/* Give the current block's unused tail back to the allocator. */
static void block_shrink_current(rle_trie *t, int64_t keep)
{
    if (t->cur < 0)
        return;
    block_t *blk = &t->blocks[t->cur];
    int64_t cap = max64(blk->used, keep);
    if (cap >= blk->cap)
        return;
    if (cap == 0) {
        block_release(t, t->cur);
        return;
    }
    /* A failed shrink keeps the old, larger array: still valid for `cap`. */
    int32_t *tok = realloc(blk->tok, (size_t)cap * sizeof(int32_t));
    float *lp = realloc(blk->lp, (size_t)cap * sizeof(float));
    int32_t *ver = realloc(blk->ver, (size_t)cap * sizeof(int32_t));
    blk->tok = tok ? tok : blk->tok;
    blk->lp = lp ? lp : blk->lp;
    blk->ver = ver ? ver : blk->ver;
    t->arena_cap -= blk->cap - cap;
    blk->cap = cap;
}

/* A pruned edge's slots become garbage; an emptied block goes at once. */
static void release_tokens(rle_trie *t, const node_t *n)
{
    if (n->len == 0)
        return;
    block_t *blk = &t->blocks[n->block];
    blk->live -= n->len;
    t->live_tokens -= n->len;
    t->garbage += n->len;
    if (blk->live > 0)
        return;
    if (n->block == t->cur) {
        t->garbage -= blk->used;
        blk->used = 0;
    } else {
        block_release(t, n->block);
    }
}

static int nodes_resize(rle_trie *t, int64_t cap)
{
    if (cap == 0) {
        free(t->nodes);
        t->nodes = NULL;
        t->node_cap = 0;
        return RLE_OK;
    }
    node_t *p = realloc(t->nodes, (size_t)cap * sizeof(node_t));
    if (p == NULL)
        return RLE_ERR_NOMEM;
    t->nodes = p;
    t->node_cap = (int32_t)cap;
    return RLE_OK;
}

typedef struct {
    int64_t at; /* block << 32 | offset: the order of slots over the table */
    int32_t node;
} span_t;

static int span_cmp(const void *a, const void *b)
{
    int64_t x = ((const span_t *)a)->at, y = ((const span_t *)b)->at;
    return (x > y) - (x < y);
}

/* Slide every live edge down to the lowest free slots, in table order, so
 * each move goes to an earlier place and can be done in place (no second
 * arena at peak). An edge that does not fit the rest of a block starts the
 * next one; it always fits by the time it reaches its own block. Blocks left
 * empty are freed, and the last one written becomes current. */
static int compact(rle_trie *t)
{
    if (t->garbage == 0)
        return RLE_OK;
    int64_t count = 0;
    for (int32_t i = 0; i < t->node_used; i++)
        if (t->nodes[i].kind != KIND_FREE && t->nodes[i].len > 0)
            count++;
    if (count == 0) {
        for (int32_t b = 0; b < t->nblocks; b++)
            if (t->blocks[b].cap > 0)
                block_release(t, b);
        return RLE_OK;
    }
    span_t *spans = malloc((size_t)count * sizeof(span_t));
    if (spans == NULL)
        return RLE_ERR_NOMEM;
    int64_t k = 0;
    for (int32_t i = 0; i < t->node_used; i++) {
        const node_t *n = &t->nodes[i];
        if (n->kind != KIND_FREE && n->len > 0)
            spans[k++] = (span_t){((int64_t)n->block << 32) | (int64_t)n->off, i};
    }
    qsort(spans, (size_t)count, sizeof(span_t), span_cmp);
    for (int32_t b = 0; b < t->nblocks; b++)
        t->blocks[b].used = t->blocks[b].live = 0;
    int32_t db = 0;
    int64_t dw = 0;
    for (k = 0; k < count; k++) {
        node_t *n = &t->nodes[spans[k].node];
        while (t->blocks[db].cap - dw < n->len) {
            do
                db++;
            while (t->blocks[db].cap == 0);
            dw = 0;
        }
        block_t *dst = &t->blocks[db], *src = &t->blocks[n->block];
        if (db != n->block || dw != n->off) {
            memmove(dst->tok + dw, src->tok + n->off, (size_t)n->len * sizeof(int32_t));
            memmove(dst->lp + dw, src->lp + n->off, (size_t)n->len * sizeof(float));
            memmove(dst->ver + dw, src->ver + n->off, (size_t)n->len * sizeof(int32_t));
            n->block = db;
            n->off = (int32_t)dw;
        }
        dw += n->len;
        dst->used = dw;
        dst->live += n->len;
    }
    free(spans);
    t->garbage = 0;
    t->cur = db;
    for (int32_t b = t->nblocks - 1; b >= 0; b--)
        if (t->blocks[b].cap > 0 && t->blocks[b].used == 0)
            block_release(t, b);
    return RLE_OK;
}

/* Make room for `tokens` more slots in the current block and `nodes` more
 * node records, or fail with nothing linked. Near the memory bound, reclaim
 * all garbage and grow by exactly the need before refusing. */
int rle_arena_reserve(rle_trie *t, int64_t tokens, int64_t nodes, int64_t shared)
{
    int64_t node_need = (int64_t)t->node_used + nodes - t->free_count;
    int64_t node_cap = t->node_cap;
    if (node_need > node_cap)
        node_cap = min64(max64(node_need, max64(node_cap + node_cap / 2, NODES_MIN)), INT32_MAX);
    if (node_need > node_cap)
        return RLE_ERR_RANGE;

    int64_t index_cap = index_cap_for(t, shared);
    int fits = tokens == 0 || (t->cur >= 0 && t->blocks[t->cur].cap - t->blocks[t->cur].used >= tokens);
    int64_t block = fits ? 0 : max64(tokens, min64(max64(t->arena_cap / 4, RLE_BLOCK_MIN), BLOCK_MAX));
    int64_t table = fits ? t->blocks_cap : blocks_cap_for_one_more(t);

    if (t->max_bytes > 0 && bytes_for(t->arena_cap + block, node_cap, table, index_cap) > t->max_bytes) {
        int rc = compact(t);
        if (rc != RLE_OK)
            return rc;
        fits = tokens == 0 || (t->cur >= 0 && t->blocks[t->cur].cap - t->blocks[t->cur].used >= tokens);
        block = fits ? 0 : tokens;
        table = fits ? t->blocks_cap : blocks_cap_for_one_more(t);
        node_cap = max64(t->node_cap, node_need);
        if (bytes_for(t->arena_cap + block, node_cap, table, index_cap) > t->max_bytes)
            return RLE_ERR_LIMIT;
    }

    int rc;
    if (block > 0 && (rc = block_add(t, block)) != RLE_OK)
        return rc;
    if (node_cap > t->node_cap && (rc = nodes_resize(t, node_cap)) != RLE_OK)
        return rc;
    if (index_cap > t->index_cap && (rc = index_resize(t, index_cap)) != RLE_OK)
        return rc;
    return RLE_OK;
}

/* A record from the free list or the unused tail; rle_arena_reserve() came first. */
int32_t rle_arena_node_alloc(rle_trie *t)
{
    int32_t idx;
    if (t->free_head >= 0) {
        idx = t->free_head;
        t->free_head = t->nodes[idx].sibling;
        t->free_count--;
    } else {
        idx = t->node_used++;
        t->nodes[idx].gen = t->gen_floor;
    }
    node_t *n = &t->nodes[idx];
    n->block = 0;
    n->off = 0;
    n->request_id = -1;
    n->len = 0;
    n->first = -1;
    n->parent = -1;
    n->child = -1;
    n->sibling = -1;
    n->refs = 0;
    n->kind = RLE_KIND_PROMPT;
    n->flags = 0;
    t->live_nodes++;
    return idx;
}

void rle_arena_node_release(rle_trie *t, int32_t idx)
{
    node_t *n = &t->nodes[idx];
    release_tokens(t, n);
    n->kind = KIND_FREE;
    n->gen = (n->gen + 1) & GEN_MASK;
    n->child = -1;
    n->sibling = t->free_head;
    t->free_head = idx;
    t->free_count++;
    t->live_nodes--;
}

int rle_arena_stage(rle_trie *t, const int32_t *tokens, const float *logprobs, const int32_t *versions, int32_t n,
                    int32_t kind, int64_t nodes)
{
    if (t->cur < 0 || t->blocks[t->cur].cap - t->blocks[t->cur].used < n ||
        (int64_t)t->node_used + nodes - t->free_count > t->node_cap)
        return -1;
    block_t *blk = &t->blocks[t->cur];
    int32_t *tok = blk->tok + blk->used;
    float *lp = blk->lp + blk->used;
    int32_t *ver = blk->ver + blk->used;
    /* Branch-free loops: they vectorize (gcc unswitches the one on kind). */
    int bad = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t v = tokens[i];
        bad |= bad_token(v);
        tok[i] = v;
    }
    if (logprobs != NULL) {
        for (int32_t i = 0; i < n; i++) {
            float x = logprobs[i];
            bad |= bad_logprob(x);
            lp[i] = x;
        }
    } else {
        memset(lp, 0, (size_t)n * sizeof(float));
    }
    if (versions == NULL) {
        for (int32_t i = 0; i < n; i++)
            ver[i] = -1;
    } else {
        for (int32_t i = 0; i < n; i++) {
            int32_t v = versions[i];
            bad |= bad_version(v, kind);
            ver[i] = v;
        }
    }
    return !bad;
}

void rle_arena_store(rle_trie *t, node_t *into, const int32_t *tokens, const float *logprobs, const int32_t *versions,
                     int32_t n, int staged)
{
    block_t *blk = &t->blocks[t->cur];
    int64_t off = blk->used;
    if (!staged) {
        memcpy(blk->tok + off, tokens, (size_t)n * sizeof(int32_t));
        if (logprobs != NULL)
            memcpy(blk->lp + off, logprobs, (size_t)n * sizeof(float));
        else
            memset(blk->lp + off, 0, (size_t)n * sizeof(float));
        if (versions != NULL) {
            memcpy(blk->ver + off, versions, (size_t)n * sizeof(int32_t));
        } else {
            for (int32_t i = 0; i < n; i++)
                blk->ver[off + i] = -1;
        }
    }
    blk->used += n;
    blk->live += n;
    t->live_tokens += n;
    into->block = t->cur;
    into->off = (int32_t)off;
    into->len = n;
    into->first = blk->tok[off];
}

/* After a prune: compact when garbage outweighs live data (so the copying
 * is paid for by the tokens freed) and hand the slack back to the
 * allocator; release the node array once the trie is empty. */
void rle_arena_settle(rle_trie *t)
{
    if (t->live_tokens == 0)
        blocks_release_all(t);
    else if (t->garbage >= t->live_tokens && t->garbage >= RLE_COMPACT_MIN && compact(t) == RLE_OK)
        block_shrink_current(t, RLE_BLOCK_MIN);
    if (t->live_nodes == 0 && t->nodes != NULL) {
        /* New records must not reuse a generation a stale handle could hold. */
        uint32_t top = t->gen_floor;
        for (int32_t i = 0; i < t->node_used; i++)
            if (t->nodes[i].gen > top)
                top = t->nodes[i].gen;
        t->gen_floor = (top + 1) & GEN_MASK;
        nodes_resize(t, 0);
        t->node_used = 0;
        t->free_head = -1;
        t->free_count = 0;
        free(t->index); /* no shared node left: no entry either */
        t->index = NULL;
        t->index_cap = t->index_used = 0;
    }
}

/* -- API: lifetime, compaction, accounting ---------------------------------------------- */

rle_trie *rle_trie_new(int64_t max_bytes)
{
    rle_trie *t = calloc(1, sizeof(rle_trie));
    if (t == NULL)
        return NULL;
    t->free_head = -1;
    t->cur = -1;
    t->max_bytes = max_bytes > 0 ? max_bytes : 0;
    return t;
}

void rle_trie_free(rle_trie *t)
{
    if (t == NULL)
        return;
    blocks_release_all(t);
    free(t->nodes);
    free(t->index);
    free(t);
}

int rle_trie_compact(rle_trie *t)
{
    int rc = compact(t);
    if (rc != RLE_OK)
        return rc;
    block_shrink_current(t, 0);
    return RLE_OK;
}

void rle_trie_stats_get(const rle_trie *t, rle_trie_stats *out)
{
    out->memory_bytes = bytes_for(t->arena_cap, t->node_cap, t->blocks_cap, t->index_cap);
    out->max_bytes = t->max_bytes;
    out->live_tokens = t->live_tokens;
    out->garbage_tokens = t->garbage;
    out->arena_capacity = t->arena_cap;
    out->live_nodes = t->live_nodes;
    out->node_capacity = t->node_cap;
    out->roots = t->roots;
    out->views = t->views;
    out->shared_tokens = t->shared_tokens;
    out->blocks = 0;
    for (int32_t b = 0; b < t->nblocks; b++)
        out->blocks += t->blocks[b].cap > 0;
}
