/* trie.c: the radix trie declared in trie.h: walking, inserting,
 * splitting, exporting and pruning the tree. Views of shared trees (what a
 * view sees, how a shared path grows and is released) are in trie_share.c;
 * the walk and insert here hand positions in the shared region to it.
 *
 * Matching is a memcmp over contiguous token ids (an edge's data is one run
 * in a block, see trie_arena.c) and splitting an edge is arithmetic on
 * offsets. A node's first token is cached in its record, so a child scan
 * stays inside the node array.
 *
 * Invariants: the children of a node start with distinct tokens; every
 * non-root edge is non-empty and lies in one block; edges never share slots.
 * A shared node's children are shared nodes (a view's private nodes hang
 * off attachments, not off the shared node itself), found through the
 * index of trie_arena.c rather than sibling links.
 *
 * This file must not allocate (trie_arena.c does), must not call into
 * Python, and must leave the trie unchanged when a call fails: capacity is
 * reserved before anything is linked.
 */

#include "trie_arena.h"

#include <string.h>

/* Index of the first position where a and b differ, or n. memcmp on the
 * whole range first: on a hit (the common case: a resent conversation) that
 * is one call into libc's vectorized compare. */
static int64_t first_mismatch(const int32_t *a, const int32_t *b, int64_t n)
{
    if (memcmp(a, b, (size_t)n * sizeof(int32_t)) == 0)
        return n;
    int64_t i = 0;
    while (n - i >= 16 && memcmp(a + i, b + i, 16 * sizeof(int32_t)) == 0)
        i += 16;
    while (a[i] == b[i])
        i++;
    return i;
}

/* Split `c` after `k` tokens. The new record takes the upper part and c's
 * place among its siblings (or in the index, under a shared parent); c
 * keeps the lower part and its children, so a handle to the end of c still
 * names the same position. */
int32_t rle_tree_split(rle_trie *t, int32_t c, int32_t k)
{
    int32_t p = rle_arena_node_alloc(t);
    node_t *nodes = t->nodes;
    node_t *up = &nodes[p], *lo = &nodes[c];
    up->block = lo->block;
    up->off = lo->off;
    up->len = k;
    up->first = lo->first;
    up->parent = lo->parent;
    up->kind = lo->kind;
    up->request_id = lo->request_id;
    /* Every view holding the lower part holds the upper one. */
    up->flags = lo->flags & NODE_SHARED;
    up->refs = lo->refs;
    lo->off += k;
    lo->len -= k;
    lo->first = edge_tokens(t, lo)[0];
    lo->parent = p;
    if (up->flags & NODE_SHARED) {
        rle_index_put(t, up->parent, up->first, p);
        rle_index_put(t, p, lo->first, c);
        return p;
    }
    up->child = c;
    up->sibling = lo->sibling;
    int32_t *link = &nodes[up->parent].child;
    while (*link != c)
        link = &nodes[*link].sibling;
    *link = p;
    lo->sibling = -1;
    return p;
}

int32_t rle_tree_append(rle_trie *t, int32_t parent, const int32_t *tokens, const float *logprobs,
                        const int32_t *versions, int32_t n, int32_t kind, int64_t request_id, int staged)
{
    int32_t idx = rle_arena_node_alloc(t);
    node_t *nodes = t->nodes;
    node_t *c = &nodes[idx];
    rle_arena_store(t, c, tokens, logprobs, versions, n, staged);
    c->parent = parent;
    c->kind = (uint8_t)kind;
    c->request_id = request_id;
    if (nodes[parent].flags & NODE_SHARED) {
        /* A shared node's children are shared; their order is never
         * observed (a view lists leaves along its own path). */
        c->flags = NODE_SHARED;
        t->shared_tokens += n;
        rle_index_put(t, parent, c->first, idx);
        return idx;
    }
    /* Appended last: children stay in creation order, which fixes the
     * order of exported leaves. */
    int32_t *link = &nodes[parent].child;
    while (*link >= 0)
        link = &nodes[*link].sibling;
    *link = idx;
    return idx;
}

int rle_trie_new_root(rle_trie *t, rle_handle *out)
{
    int rc = rle_arena_reserve(t, 0, 1, 0);
    if (rc != RLE_OK)
        return rc;
    int32_t idx = rle_arena_node_alloc(t);
    t->roots++;
    *out = handle_of(t, idx);
    return RLE_OK;
}

/* The walk's loop; `shared` 0 compiles it without the shared-region test,
 * for the common walk that starts in an own tree (which holds no shared
 * node) and must stay as fast as it was. */
static inline __attribute__((always_inline)) void walk_loop(const rle_trie *t, int32_t view, int32_t node,
                                                            const int32_t *tokens, int64_t n, rle_cursor *cur,
                                                            int shared)
{
    const node_t *nodes = t->nodes;
    int32_t offset = nodes[node].len;
    int64_t i = 0;
    while (i < n) {
        int32_t want = tokens[i];
        int32_t c;
        if (shared && in_shared_region(&nodes[node])) {
            /* In a view, what it sees; otherwise (extending a shared path) every child. */
            c = view >= 0 ? rle_view_child(t, view, node, want) : rle_index_get(t, node, want);
        } else {
            c = nodes[node].child;
            while (c >= 0 && nodes[c].first != want)
                c = nodes[c].sibling;
        }
        if (c < 0)
            break;
        const node_t *nc = &nodes[c];
        /* The next record's address is known now: fetch it while this edge
         * is compared, so a long path pays one DRAM wait per edge, not two
         * (measured with csrc/trie_floor.c: walk / floor 1.36 -> 1.21). */
        if (nc->child >= 0)
            __builtin_prefetch(&nodes[nc->child]);
        int64_t k = first_mismatch(edge_tokens(t, nc), tokens + i, min64(n - i, nc->len));
        node = c;
        offset = (int32_t)k;
        i += k;
        if (k < nc->len)
            break;
    }
    cur->node = node;
    cur->offset = offset;
    cur->matched = i;
    cur->view = view;
}

void rle_tree_walk_from(const rle_trie *t, int32_t view, int32_t node, const int32_t *tokens, int64_t n,
                        rle_cursor *cur)
{
    if (view < 0 && !in_shared_region(&t->nodes[node]))
        walk_loop(t, -1, node, tokens, n, cur, 0);
    else
        walk_loop(t, view, node, tokens, n, cur, 1);
}

int rle_trie_walk_view(const rle_trie *t, rle_handle view_h, rle_handle at, const int32_t *tokens, int64_t n,
                       rle_cursor *cur)
{
    int32_t node = node_of(t, at);
    if (node < 0)
        return RLE_ERR_HANDLE;
    const node_t *nodes = t->nodes;
    int32_t view = -1;
    if (view_h >= 0) {
        view = node_of(t, view_h);
        if (view < 0 || !(nodes[view].flags & NODE_VIEW) || !rle_view_holds(t, view, node))
            return RLE_ERR_VIEW;
        if (node == nodes[view].parent)
            node = view; /* the shared root: the view's root stands there */
    } else if (nodes[node].flags & NODE_VIEW) {
        view = node;
    } else if (nodes[node].flags & NODE_SHARED) {
        return RLE_ERR_VIEW; /* which view's children? */
    }
    /* Below an own tree's node, or a view's private node, every child is
     * the same tree's: the plain walk (view -1 or not, it never asks). */
    rle_tree_walk_from(t, view, node, tokens, n, cur);
    return RLE_OK;
}

int rle_trie_walk(const rle_trie *t, rle_handle at, const int32_t *tokens, int64_t n, rle_cursor *cur)
{
    return rle_trie_walk_view(t, -1, at, tokens, n, cur);
}

/* Link what rle_trie_insert_at stores once room is reserved (and, with
 * `staged`, the new data copied into place). */
static rle_handle link_at(rle_trie *t, const rle_cursor *cur, const int32_t *tokens, const float *logprobs,
                          const int32_t *versions, int64_t extra, int need_split, int32_t kind, int64_t request_id,
                          int staged)
{
    int32_t at = cur->node;
    if (need_split)
        at = rle_tree_split(t, at, cur->offset);
    if (extra > 0) {
        int64_t m = cur->matched;
        at = rle_tree_append(t, at, tokens + m, logprobs ? logprobs + m : NULL, versions ? versions + m : NULL,
                          (int32_t)extra, kind, request_id, staged);
    }
    return handle_of(t, at);
}

int rle_trie_insert_at(rle_trie *t, const rle_cursor *cur, const int32_t *tokens, const float *logprobs,
                       const int32_t *versions, int64_t n, int32_t kind, int64_t request_id, rle_handle *out)
{
    if (cur->view >= 0 && in_shared_region(&t->nodes[cur->node]))
        return rle_view_insert(t, cur, tokens, logprobs, versions, n, kind, request_id, out);
    int64_t extra = n - cur->matched;
    if (extra < 0 || extra > INT32_MAX)
        return RLE_ERR_RANGE;
    int need_split = cur->offset < t->nodes[cur->node].len;
    int rc = rle_arena_reserve(t, extra, need_split + (extra > 0), 0);
    if (rc != RLE_OK)
        return rc;
    *out = link_at(t, cur, tokens, logprobs, versions, extra, need_split, kind, request_id, 0);
    return RLE_OK;
}

/* The first invalid value of tokens/logprobs/versions[from:n], if any. */
static int find_bad(const int32_t *tokens, const float *logprobs, const int32_t *versions, int64_t from, int64_t n,
                    int32_t kind, rle_bad_input *bad)
{
    int64_t i;
    if ((i = rle_check_tokens(tokens + from, n - from)) >= 0)
        bad->field = RLE_FIELD_TOKENS;
    else if (logprobs != NULL && (i = rle_check_logprobs(logprobs + from, n - from)) >= 0)
        bad->field = RLE_FIELD_LOGPROBS;
    else if (versions != NULL && (i = rle_check_versions(versions + from, n - from, kind)) >= 0)
        bad->field = RLE_FIELD_VERSIONS;
    else
        return 0;
    bad->index = from + i;
    return 1;
}

int rle_trie_insert_checked(rle_trie *t, const rle_cursor *cur, const int32_t *tokens, const float *logprobs,
                            const int32_t *versions, int64_t n, int32_t kind, int64_t request_id, rle_handle *out,
                            rle_bad_input *bad)
{
    int64_t m = cur->matched, extra = n - m;
    if (cur->view >= 0 && in_shared_region(&t->nodes[cur->node])) {
        /* What is stored here may be shared or private, and only part of it
         * new to the trie: check first, then store. */
        if (extra > 0 && find_bad(tokens, logprobs, versions, m, n, kind, bad))
            return RLE_ERR_INPUT;
        return rle_view_insert(t, cur, tokens, logprobs, versions, n, kind, request_id, out);
    }
    if (extra > 0 && extra <= INT32_MAX) {
        int need_split = cur->offset < t->nodes[cur->node].len;
        /* Copied into slots not handed out yet: if a value is bad, dropping
         * them is doing nothing. With room already there, nothing below can
         * fail, grow, or move the staged slots. */
        int ok = rle_arena_stage(t, tokens + m, logprobs ? logprobs + m : NULL, versions ? versions + m : NULL,
                                 (int32_t)extra, kind, need_split + 1);
        if (ok > 0) {
            *out = link_at(t, cur, tokens, logprobs, versions, extra, need_split, kind, request_id, 1);
            return RLE_OK;
        }
        if (ok == 0) {
            find_bad(tokens, logprobs, versions, m, n, kind, bad);
            return RLE_ERR_INPUT;
        }
    }
    /* No room (storing grows the trie), or nothing new to store. */
    if (find_bad(tokens, logprobs, versions, m, n, kind, bad))
        return RLE_ERR_INPUT;
    return rle_trie_insert_at(t, cur, tokens, logprobs, versions, n, kind, request_id, out);
}

int rle_trie_depth(const rle_trie *t, rle_handle h, int64_t *depth)
{
    int32_t n = node_of(t, h);
    if (n < 0)
        return RLE_ERR_HANDLE;
    int64_t d = 0;
    for (; n >= 0; n = t->nodes[n].parent)
        d += t->nodes[n].len;
    *depth = d;
    return RLE_OK;
}

/* The root a node's tree is named by: a view's root for its private nodes
 * (the first attachment up the path says which view), else the root. */
static int32_t root_index(const rle_trie *t, int32_t n)
{
    for (;;) {
        const node_t *nd = &t->nodes[n];
        if (nd->flags & NODE_ATTACH)
            return nd->view;
        if (nd->parent < 0)
            return n;
        n = nd->parent;
    }
}

int rle_trie_root_of(const rle_trie *t, rle_handle h, rle_handle *root)
{
    int32_t n = node_of(t, h);
    if (n < 0)
        return RLE_ERR_HANDLE;
    *root = handle_of(t, root_index(t, n));
    return RLE_OK;
}

int rle_trie_parent(const rle_trie *t, rle_handle h, rle_handle *parent)
{
    int32_t n = node_of(t, h);
    if (n < 0)
        return RLE_ERR_HANDLE;
    const node_t *nodes = t->nodes;
    int32_t p = nodes[n].flags & NODE_VIEW ? -1 : nodes[n].parent;
    /* An attachment stands at the end of its shared node. */
    if (p >= 0 && (nodes[p].flags & (NODE_ATTACH | NODE_VIEW)) == NODE_ATTACH)
        p = nodes[p].parent;
    *parent = p >= 0 ? handle_of(t, p) : -1;
    return RLE_OK;
}

int rle_trie_holds(const rle_trie *t, rle_handle root, rle_handle h)
{
    int32_t r = node_of(t, root), n = node_of(t, h);
    if (r < 0 || n < 0)
        return RLE_ERR_HANDLE;
    if (t->nodes[r].flags & NODE_VIEW)
        return rle_view_holds(t, r, n);
    return root_index(t, n) == r;
}

int rle_trie_refs(const rle_trie *t, rle_handle h, int64_t *refs)
{
    int32_t n = node_of(t, h);
    if (n < 0)
        return RLE_ERR_HANDLE;
    *refs = t->nodes[n].flags & NODE_SHARED ? t->nodes[n].refs : 1;
    return RLE_OK;
}

int rle_trie_is_live(const rle_trie *t, rle_handle h) { return node_of(t, h) >= 0; }

int rle_trie_export_path(const rle_trie *t, rle_handle h, int32_t *tokens, float *logprobs, int32_t *versions,
                         uint8_t *loss_mask)
{
    int64_t pos;
    int rc = rle_trie_depth(t, h, &pos);
    if (rc != RLE_OK)
        return rc;
    /* Filled back to front: the walk goes leaf to root. */
    for (int32_t n = node_of(t, h); n >= 0; n = t->nodes[n].parent) {
        const node_t *nd = &t->nodes[n];
        size_t len = (size_t)nd->len;
        if (len == 0)
            continue; /* a root: no data, and maybe no arena to point into */
        pos -= nd->len;
        const block_t *blk = &t->blocks[nd->block];
        if (tokens != NULL)
            memcpy(tokens + pos, blk->tok + nd->off, len * sizeof(int32_t));
        if (logprobs != NULL)
            memcpy(logprobs + pos, blk->lp + nd->off, len * sizeof(float));
        if (versions != NULL)
            memcpy(versions + pos, blk->ver + nd->off, len * sizeof(int32_t));
        if (loss_mask != NULL)
            memset(loss_mask + pos, nd->kind == RLE_KIND_SAMPLED, len);
    }
    return RLE_OK;
}

int64_t rle_trie_path_segments(const rle_trie *t, rle_handle h, rle_segment *out, int64_t cap)
{
    int64_t depth;
    int rc = rle_trie_depth(t, h, &depth);
    if (rc != RLE_OK)
        return rc;
    int32_t leaf = node_of(t, h);
    /* Two passes leaf to root: count the runs, then fill them back to front. */
    int64_t runs = 0;
    const node_t *prev = NULL;
    for (int32_t n = leaf; n >= 0; n = t->nodes[n].parent) {
        const node_t *nd = &t->nodes[n];
        if (nd->len == 0)
            continue;
        if (prev == NULL || nd->kind != prev->kind || nd->request_id != prev->request_id)
            runs++;
        prev = nd;
    }
    int64_t r = runs, pos = depth;
    prev = NULL;
    for (int32_t n = leaf; n >= 0; n = t->nodes[n].parent) {
        const node_t *nd = &t->nodes[n];
        if (nd->len == 0)
            continue;
        if (prev == NULL || nd->kind != prev->kind || nd->request_id != prev->request_id) {
            r--;
            if (r < cap)
                out[r] = (rle_segment){pos - nd->len, pos, nd->request_id, nd->kind};
        } else if (r < cap) {
            out[r].start = pos - nd->len;
        }
        pos -= nd->len;
        prev = nd;
    }
    return runs;
}

int64_t rle_tree_leaves_below(const rle_trie *t, int32_t top, rle_handle *out, int64_t cap, int64_t count)
{
    /* Depth first over child/sibling/parent links: no stack to allocate. */
    const node_t *nodes = t->nodes;
    int32_t n = top;
    for (;;) {
        if (nodes[n].child >= 0) {
            n = nodes[n].child;
            continue;
        }
        if (count < cap)
            out[count] = handle_of(t, n);
        count++;
        while (n != top && nodes[n].sibling < 0)
            n = nodes[n].parent;
        if (n == top)
            break;
        n = nodes[n].sibling;
    }
    return count;
}

int64_t rle_trie_leaves(const rle_trie *t, rle_handle h, rle_handle *out, int64_t cap)
{
    int32_t top = node_of(t, h);
    if (top < 0)
        return RLE_ERR_HANDLE;
    const node_t *nodes = t->nodes;
    if (nodes[top].flags & NODE_VIEW)
        return rle_view_leaves(t, top, out, cap);
    if (nodes[top].flags & NODE_SHARED)
        return RLE_ERR_SHARED; /* the views' leaves are the views' to list */
    if (nodes[top].child < 0) {
        if (nodes[top].parent < 0)
            return 0; /* an empty tree has no paths */
        if (cap > 0)
            out[0] = h;
        return 1;
    }
    return rle_tree_leaves_below(t, top, out, cap, 0);
}

void rle_tree_unlink(rle_trie *t, int32_t parent, int32_t c)
{
    node_t *nodes = t->nodes;
    if (nodes[parent].flags & NODE_SHARED) {
        rle_index_del(t, parent, nodes[c].first);
        return;
    }
    int32_t *link = &nodes[parent].child;
    while (*link != c)
        link = &nodes[*link].sibling;
    *link = nodes[c].sibling;
}

int64_t rle_tree_free_below(rle_trie *t, int32_t top)
{
    /* Post-order without a stack: always free a first child, which makes
     * its next sibling the parent's first child. */
    node_t *nodes = t->nodes;
    int64_t freed = 0;
    int32_t n = top;
    for (;;) {
        if (nodes[n].child >= 0) {
            n = nodes[n].child;
            continue;
        }
        int32_t up = nodes[n].parent;
        freed += nodes[n].len;
        if (n == top) {
            rle_arena_node_release(t, n);
            break;
        }
        nodes[up].child = nodes[n].sibling;
        rle_arena_node_release(t, n);
        n = up;
    }
    return freed;
}

int64_t rle_trie_prune(rle_trie *t, rle_handle h)
{
    int32_t top = node_of(t, h);
    if (top < 0)
        return RLE_ERR_HANDLE;
    node_t *nodes = t->nodes;
    if (nodes[top].flags & NODE_VIEW)
        return rle_view_drop(t, top);
    if (nodes[top].flags & NODE_SHARED) {
        /* Shared nodes go when no view holds them; a shared root that no
         * view ever joined (or all left) has nothing below it. */
        if (nodes[top].parent >= 0 || nodes[top].refs > 0)
            return RLE_ERR_SHARED;
        rle_arena_node_release(t, top);
        t->roots--;
        rle_arena_settle(t);
        return 0;
    }
    int32_t parent = nodes[top].parent;
    if (parent >= 0)
        rle_tree_unlink(t, parent, top);
    else
        t->roots--;
    int64_t freed = rle_tree_free_below(t, top);
    if (parent >= 0 && (nodes[parent].flags & NODE_ATTACH) && nodes[parent].child < 0)
        rle_view_attachment_emptied(t, parent);
    rle_arena_settle(t);
    return freed;
}

/* The checks scan everything with a branch-free reduction first (it
 * vectorizes), and look for the index only when something is wrong. */
int64_t rle_check_tokens(const int32_t *tokens, int64_t n)
{
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad |= bad_token(tokens[i]);
    for (int64_t i = 0; bad && i < n; i++)
        if (bad_token(tokens[i]))
            return i;
    return -1;
}

int64_t rle_check_logprobs(const float *logprobs, int64_t n)
{
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad |= bad_logprob(logprobs[i]);
    for (int64_t i = 0; bad && i < n; i++)
        if (bad_logprob(logprobs[i]))
            return i;
    return -1;
}

int64_t rle_check_versions(const int32_t *versions, int64_t n, int32_t kind)
{
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad |= bad_version(versions[i], kind);
    for (int64_t i = 0; bad && i < n; i++)
        if (bad_version(versions[i], kind))
            return i;
    return -1;
}
