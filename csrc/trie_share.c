/* trie_share.c: views of shared trees (declared in trie.h): what a view
 * sees, how its shared path grows, and what dropping it frees.
 *
 * A view holds one path of its shared tree, from the shared root to its
 * anchor; each node on it counts the views holding it (refs), so a view's
 * holdings are closed towards the root and a shared node's children never
 * have more holders than it. Its private nodes hang off attachment records
 * (len 0, `parent` the shared node, not in that node's child list), one per
 * shared node the view branches at, listed from the view's root through
 * `sibling`; the view root is itself the attachment at the shared root.
 *
 * Why one path and not any subtree: membership is then the anchor's
 * ancestry, found by walking up a few records, with no per-view set to keep.
 * A view shares what sessions actually have in common (a system prompt, a
 * group's prompt, stored in one or more prompt turns before anything
 * else); a branch inside the shared part, or a prompt after the session's
 * own tokens, is stored privately, which costs memory, never exactness.
 *
 * The shared path grows only where the view has nothing of its own (no
 * private child at the anchor). So at every shared node of the path its
 * shared child is older than its private ones, and a view's leaves come out
 * in creation order without recording when each child was made.
 *
 * This file must not allocate except through trie_arena.c, and must leave
 * the trie unchanged when a call fails: room is reserved before anything is
 * linked.
 */

#include "trie_arena.h"

#include <string.h>

/* The shared node a shared-region position stands at: a view root stands at its shared root. */
static inline int32_t base_of(const rle_trie *t, int32_t node)
{
    return t->nodes[node].flags & NODE_ATTACH ? t->nodes[node].parent : node;
}

/* The child of `x` on the path from the shared root to `anchor`; -1 when x
 * is the anchor (or not on the path). */
static int32_t path_child(const rle_trie *t, int32_t anchor, int32_t x)
{
    const node_t *nodes = t->nodes;
    int32_t c = anchor;
    while (c >= 0 && nodes[c].parent != x)
        c = nodes[c].parent;
    return c;
}

/* The view's attachment at shared node `x`, or -1. */
static int32_t attachment_at(const rle_trie *t, int32_t view, int32_t x)
{
    const node_t *nodes = t->nodes;
    int32_t a = view;
    while (a >= 0 && nodes[a].parent != x)
        a = nodes[a].sibling;
    return a;
}

/* A new attachment of `view` at `x`; room was reserved. */
static int32_t attachment_new(rle_trie *t, int32_t view, int32_t x)
{
    int32_t a = rle_arena_node_alloc(t);
    node_t *nodes = t->nodes;
    nodes[a].flags = NODE_ATTACH;
    nodes[a].parent = x;
    nodes[a].view = view;
    nodes[a].sibling = nodes[view].sibling;
    nodes[view].sibling = a;
    return a;
}

void rle_view_attachment_emptied(rle_trie *t, int32_t a)
{
    node_t *nodes = t->nodes;
    if (nodes[a].flags & NODE_VIEW)
        return;
    int32_t prev = nodes[a].view;
    while (nodes[prev].sibling != a)
        prev = nodes[prev].sibling;
    nodes[prev].sibling = nodes[a].sibling;
    rle_arena_node_release(t, a);
}

int rle_trie_new_shared_root(rle_trie *t, rle_handle *out)
{
    int rc = rle_arena_reserve(t, 0, 1, 0);
    if (rc != RLE_OK)
        return rc;
    int32_t idx = rle_arena_node_alloc(t);
    t->nodes[idx].flags = NODE_SHARED;
    t->roots++;
    *out = handle_of(t, idx);
    return RLE_OK;
}

int rle_trie_new_view(rle_trie *t, rle_handle shared_root, rle_handle *out)
{
    int32_t root = node_of(t, shared_root);
    if (root < 0)
        return RLE_ERR_HANDLE;
    if (!(t->nodes[root].flags & NODE_SHARED) || t->nodes[root].parent >= 0)
        return RLE_ERR_VIEW;
    int rc = rle_arena_reserve(t, 0, 1, 0);
    if (rc != RLE_OK)
        return rc;
    int32_t v = rle_arena_node_alloc(t);
    node_t *nodes = t->nodes;
    nodes[v].flags = NODE_ATTACH | NODE_VIEW;
    nodes[v].parent = root;
    nodes[v].view = v;
    nodes[v].anchor = root;
    nodes[root].refs++;
    t->views++;
    *out = handle_of(t, v);
    return RLE_OK;
}

int32_t rle_view_child(const rle_trie *t, int32_t view, int32_t node, int32_t want)
{
    const node_t *nodes = t->nodes;
    int32_t x = base_of(t, node);
    /* A view's children at x start with distinct tokens: the shared child
     * on its path, and the private ones it made there when none matched. */
    int32_t c = path_child(t, nodes[view].anchor, x);
    if (c >= 0 && nodes[c].first == want)
        return c;
    int32_t a = attachment_at(t, view, x);
    for (c = a >= 0 ? nodes[a].child : -1; c >= 0 && nodes[c].first != want; c = nodes[c].sibling)
        ;
    return c;
}

int rle_view_holds(const rle_trie *t, int32_t view, int32_t n)
{
    const node_t *nodes = t->nodes;
    if (n == view)
        return 1;
    /* A private node: up to the attachment it hangs off, which names its view. */
    while (!in_shared_region(&nodes[n])) {
        n = nodes[n].parent;
        if (n < 0)
            return 0; /* a node of an own tree */
    }
    if (nodes[n].flags & NODE_ATTACH)
        return nodes[n].view == view;
    for (int32_t x = nodes[view].anchor; x >= 0; x = nodes[x].parent)
        if (x == n)
            return 1;
    return 0;
}

/* Shareable: equal for every view that stores the same tokens here, so one
 * copy serves them all (a prompt without request id, logprobs all +0.0;
 * its versions are -1, as checked for prompts). */
static int shareable(int32_t kind, int64_t request_id, const float *logprobs, int64_t n)
{
    if (kind != RLE_KIND_PROMPT || request_id != -1)
        return 0;
    if (logprobs == NULL)
        return 1;
    uint32_t bits = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, logprobs + i, sizeof(b));
        bits |= b;
    }
    return bits == 0;
}

/* Store tokens[0:n] (shareable) after the view's anchor in the shared tree:
 * follow what other views stored there, store the rest once, and move the
 * anchor to the end, the view now holding every node up to it. */
static int extend(rle_trie *t, int32_t view, const int32_t *tokens, int64_t n, rle_handle *out)
{
    int32_t anchor = t->nodes[view].anchor;
    rle_cursor sc;
    rle_tree_walk_from(t, -1, anchor, tokens, n, &sc);
    int need_split = sc.offset < t->nodes[sc.node].len;
    int64_t rest = n - sc.matched;
    int rc = rle_arena_reserve(t, rest, need_split + (rest > 0), need_split + (rest > 0));
    if (rc != RLE_OK)
        return rc;
    int32_t end = sc.node;
    if (need_split)
        end = rle_tree_split(t, end, sc.offset);
    if (rest > 0)
        end = rle_tree_append(t, end, tokens + sc.matched, NULL, NULL, (int32_t)rest, RLE_KIND_PROMPT, -1, 0);
    node_t *nodes = t->nodes;
    for (int32_t x = end; x != anchor; x = nodes[x].parent)
        nodes[x].refs++;
    nodes[view].anchor = end;
    *out = handle_of(t, end);
    return RLE_OK;
}

int rle_view_insert(rle_trie *t, const rle_cursor *cur, const int32_t *tokens, const float *logprobs,
                    const int32_t *versions, int64_t n, int32_t kind, int64_t request_id, rle_handle *out)
{
    int32_t view = cur->view, node = cur->node;
    int64_t m = cur->matched, extra = n - m;
    if (extra < 0 || extra > INT32_MAX)
        return RLE_ERR_RANGE;
    int need_split = cur->offset < t->nodes[node].len;
    int32_t base = base_of(t, node);
    int32_t a = attachment_at(t, view, base);
    if (extra > 0 && !need_split && base == t->nodes[view].anchor && (a < 0 || t->nodes[a].child < 0) &&
        shareable(kind, request_id, logprobs ? logprobs + m : NULL, extra))
        return extend(t, view, tokens + m, extra, out);
    /* Private to the view: after a split the upper part is a new shared
     * node, which no attachment hangs off yet. */
    if (need_split)
        a = -1;
    int need_attach = extra > 0 && a < 0;
    /* A split node is shared: its upper part takes an index entry. */
    int rc = rle_arena_reserve(t, extra, need_split + need_attach + (extra > 0), need_split);
    if (rc != RLE_OK)
        return rc;
    if (need_split)
        node = base = rle_tree_split(t, node, cur->offset);
    if (extra == 0) {
        *out = handle_of(t, node);
        return RLE_OK;
    }
    if (need_attach)
        a = attachment_new(t, view, base);
    int32_t c = rle_tree_append(t, a, tokens + m, logprobs ? logprobs + m : NULL, versions ? versions + m : NULL,
                                (int32_t)extra, kind, request_id, 0);
    *out = handle_of(t, c);
    return RLE_OK;
}

int64_t rle_view_leaves(const rle_trie *t, int32_t view, rle_handle *out, int64_t cap)
{
    /* Depth first from the shared root, the path child first at each node:
     * so bottom up, the anchor's subtree first, then each node's private
     * subtrees on the way up. */
    const node_t *nodes = t->nodes;
    int32_t anchor = nodes[view].anchor;
    int64_t count = 0;
    for (int32_t x = anchor; x >= 0; x = nodes[x].parent) {
        int32_t a = attachment_at(t, view, x);
        if (a >= 0 && nodes[a].child >= 0) {
            count = rle_tree_leaves_below(t, a, out, cap, count);
        } else if (x == anchor && nodes[x].parent >= 0) {
            if (count < cap)
                out[count] = handle_of(t, x);
            count++;
        }
    }
    return count;
}

int64_t rle_view_drop(rle_trie *t, int32_t view)
{
    node_t *nodes = t->nodes;
    int64_t freed = 0;
    for (int32_t a = view; a >= 0;) {
        int32_t next = nodes[a].sibling;
        int32_t c;
        while ((c = nodes[a].child) >= 0) {
            nodes[a].child = nodes[c].sibling;
            freed += rle_tree_free_below(t, c);
        }
        if (a != view)
            rle_arena_node_release(t, a);
        a = next;
    }
    /* Bottom up, so a node whose last holder this was has no child left:
     * its children have no more holders than it. */
    for (int32_t x = nodes[view].anchor; x >= 0;) {
        int32_t p = nodes[x].parent;
        if (--nodes[x].refs == 0) {
            if (p >= 0)
                rle_tree_unlink(t, p, x);
            else
                t->roots--;
            freed += nodes[x].len;
            t->shared_tokens -= nodes[x].len;
            rle_arena_node_release(t, x);
        }
        x = p;
    }
    rle_arena_node_release(t, view);
    t->views--;
    rle_arena_settle(t);
    return freed;
}
