/* trie_arena.h: the trie's internal layout, shared by trie.c (the tree),
 * trie_share.c (views of shared trees) and trie_arena.c (the memory under
 * them). Not part of the API: nothing outside csrc/ may include it, and
 * rlengine/trace/_trie.pxd does not mirror it.
 *
 * Edge data (token ids, logprobs, versions) lives in blocks of three
 * parallel arrays; an edge is a run inside one block, named by (block,
 * offset). Nodes live in one array of fixed-size records linked by index.
 * Roots and attachments have no edge (len 0), so a view root keeps its
 * anchor and an attachment its view where an edge keeps its data. The
 * children of a shared node are not linked through child/sibling: an index
 * (parent, first token) -> child finds them, so a shared node with a child
 * per session costs O(1) per lookup, insert and removal.
 */

#ifndef RLE_TRIE_ARENA_H
#define RLE_TRIE_ARENA_H

#include "trie.h"

#define KIND_FREE 255
#define GEN_MASK 0x7fffffffu
#define BLOCK_MAX 1048576 /* token slots in the largest block, unless one edge needs more */
#define NODES_MIN 64      /* node records in a fresh node array */
#define BLOCKS_MIN 8      /* entries in a fresh block table */
/* Overridable at build time: the sanitizer build (make asan) makes them tiny
 * so the tests' small tries cross blocks and compact all the time. */
#ifndef RLE_BLOCK_MIN
#define RLE_BLOCK_MIN 16384 /* token slots in the smallest block (192 KiB) */
#endif
#ifndef RLE_COMPACT_MIN
#define RLE_COMPACT_MIN 65536 /* garbage below this is not worth a pass after a prune */
#endif
#define TOKEN_BYTES ((int64_t)(sizeof(int32_t) + sizeof(float) + sizeof(int32_t)))

typedef struct {
    int32_t *tok;
    float *lp;
    int32_t *ver;
    int64_t cap;  /* token slots; 0 marks an unused table entry */
    int64_t used; /* slots handed out: live, pruned, or skipped at the end */
    int64_t live;
} block_t;

/* node_t.flags */
#define NODE_SHARED 1 /* in a shared tree (its root included): `refs` views hold it */
#define NODE_ATTACH 2 /* a view's attachment: where its private nodes hang off the shared node `parent` */
#define NODE_VIEW 4   /* a view's root: also its attachment at the shared root, and the head of its list */

typedef struct {
    union {
        int32_t block; /* where the edge's data starts: block ... */
        int32_t view;  /* an attachment (a view root too): the view's root */
    };
    union {
        int32_t off;    /* ... and slot */
        int32_t anchor; /* a view root: the end of the view's shared path */
    };
    int64_t request_id; /* of the segment that stored the edge */
    int32_t len;        /* edge length; 0 only for roots and attachments */
    int32_t first;      /* the edge's first token id */
    int32_t parent;     /* -1 for roots; an attachment's: the shared node it hangs off */
    int32_t child;      /* first child, -1 if none */
    int32_t sibling;    /* next sibling; an attachment's: the view's next one; on the free list, the next free record */
    uint32_t gen;       /* bumped on free so stale handles are refused */
    int32_t refs;       /* a shared node: views holding it */
    uint8_t kind;       /* RLE_KIND_* or KIND_FREE */
    uint8_t flags;      /* NODE_* */
} node_t;

/* An entry of the shared children's index (open addressing, linear probing); child -1: empty. */
typedef struct {
    int32_t parent;
    int32_t first;
    int32_t child;
} slot_t;

struct rle_trie {
    block_t *blocks;
    int32_t nblocks; /* table entries in use, the last one non-empty */
    int32_t blocks_cap;
    int32_t cur;        /* the block new edges go to, -1 if none */
    int64_t arena_cap;  /* token slots over all blocks */
    int64_t live_tokens;
    int64_t garbage;    /* handed-out slots no live edge holds */

    node_t *nodes;
    int32_t node_used; /* records ever handed out since the array was made */
    int32_t node_cap;
    int32_t free_head;
    int32_t free_count;
    uint32_t gen_floor; /* generation of fresh records; raised when the array is released */
    int64_t live_nodes;
    int64_t roots;
    int64_t views;
    int64_t shared_tokens;

    slot_t *index;      /* the children of shared nodes */
    int64_t index_cap;  /* slots, a power of two (0: none); at most half used */
    int64_t index_used;

    int64_t max_bytes;
};

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static inline rle_handle handle_of(const rle_trie *t, int32_t idx)
{
    return ((int64_t)t->nodes[idx].gen << 32) | (int64_t)(uint32_t)idx;
}

static inline int32_t node_of(const rle_trie *t, rle_handle h)
{
    if (h < 0)
        return -1;
    uint32_t idx = (uint32_t)(h & 0xffffffff);
    uint32_t gen = (uint32_t)(h >> 32);
    if (idx >= (uint32_t)t->node_used)
        return -1;
    const node_t *n = &t->nodes[idx];
    /* An attachment is no position of its own (it stands at its shared
     * node's end): never a handle. */
    if (n->kind == KIND_FREE || n->gen != gen || (n->flags & (NODE_ATTACH | NODE_VIEW)) == NODE_ATTACH)
        return -1;
    return (int32_t)idx;
}

/* The values the core stores, one test each: rle_check_* (trie.c) and
 * rle_arena_stage both use these, so the rules are written only here. */
static inline int bad_token(int32_t v) { return v < 0; }
static inline int bad_logprob(float x) { return !(x <= 0.0f); } /* NaN too */
static inline int bad_version(int32_t v, int32_t kind) { return kind == RLE_KIND_SAMPLED ? v < 0 : v != -1; }

static inline const int32_t *edge_tokens(const rle_trie *t, const node_t *n)
{
    return t->blocks[n->block].tok + n->off;
}

/* Make room for `tokens` more slots in the current block, `nodes` more
 * node records and `shared` more index entries, or fail (RLE_ERR_*) having
 * linked nothing. */
int rle_arena_reserve(rle_trie *t, int64_t tokens, int64_t nodes, int64_t shared);
/* A fresh node record, unlinked; rle_arena_reserve came first. */
int32_t rle_arena_node_alloc(rle_trie *t);
/* Free a node record and turn its edge's slots into garbage. */
void rle_arena_node_release(rle_trie *t, int32_t idx);
/* Copy n tokens (and logprobs, versions; NULL: 0.0, -1) into the current
 * block and point `into` at them; rle_arena_reserve came first. With
 * `staged`, rle_arena_stage already copied them there: only point. */
void rle_arena_store(rle_trie *t, node_t *into, const int32_t *tokens, const float *logprobs, const int32_t *versions,
                     int32_t n, int staged);
/* Copy n tokens (logprobs, versions as rle_arena_store) into the current
 * block's free slots, checking them for `kind` on the way, without handing
 * the slots out. 1: all valid, rle_arena_store(staged) may take them; 0:
 * some value invalid; -1, nothing copied: the block has no room for n, or
 * the node array none for `nodes` more records (storing would grow). */
int rle_arena_stage(rle_trie *t, const int32_t *tokens, const float *logprobs, const int32_t *versions, int32_t n,
                    int32_t kind, int64_t nodes);
/* After a prune: reclaim garbage and memory as the policy says. */
void rle_arena_settle(rle_trie *t);
/* The shared children's index: the child of shared node `parent` starting
 * with `first` (-1 if none); set it (room reserved for a new entry); remove it. */
int32_t rle_index_get(const rle_trie *t, int32_t parent, int32_t first);
void rle_index_put(rle_trie *t, int32_t parent, int32_t first, int32_t child);
void rle_index_del(rle_trie *t, int32_t parent, int32_t first);

/* -- tree operations (trie.c), for trie_share.c ----------------------------- */

/* Split node c after k tokens; returns the new upper record (see trie.c). */
int32_t rle_tree_split(rle_trie *t, int32_t c, int32_t k);
/* Append a child of n tokens under `parent`, last among its children. */
int32_t rle_tree_append(rle_trie *t, int32_t parent, const int32_t *tokens, const float *logprobs,
                        const int32_t *versions, int32_t n, int32_t kind, int64_t request_id, int staged);
/* Walk from the end of `node` in view `view` (-1: every child). */
void rle_tree_walk_from(const rle_trie *t, int32_t view, int32_t node, const int32_t *tokens, int64_t n,
                        rle_cursor *cur);
/* Remove `c` from the child list of `parent`. */
void rle_tree_unlink(rle_trie *t, int32_t parent, int32_t c);
/* Free an unlinked `top` and everything below it; returns the tokens freed. */
int64_t rle_tree_free_below(rle_trie *t, int32_t top);
/* Write the leaves below `top` (which has children) into out[count..cap); returns the new count. */
int64_t rle_tree_leaves_below(const rle_trie *t, int32_t top, rle_handle *out, int64_t cap, int64_t count);

/* -- views (trie_share.c), for trie.c --------------------------------------- */

/* The child of `node` (a shared node or a view root) that view `view` sees
 * starting with token `want`, or -1. */
int32_t rle_view_child(const rle_trie *t, int32_t view, int32_t node, int32_t want);
/* Whether view `view` holds node `n`. */
int rle_view_holds(const rle_trie *t, int32_t view, int32_t n);
/* rle_trie_insert_at for a cursor at a shared position of a view. */
int rle_view_insert(rle_trie *t, const rle_cursor *cur, const int32_t *tokens, const float *logprobs,
                    const int32_t *versions, int64_t n, int32_t kind, int64_t request_id, rle_handle *out);
/* rle_trie_leaves of a view root. */
int64_t rle_view_leaves(const rle_trie *t, int32_t view, rle_handle *out, int64_t cap);
/* Drop a view: its private nodes and the shared ones no other view holds; returns the tokens freed. */
int64_t rle_view_drop(rle_trie *t, int32_t view);
/* A private node's attachment record lost its last child: free it unless it is a view root. */
void rle_view_attachment_emptied(rle_trie *t, int32_t a);

/* In a view's walk, positions in the shared region (shared nodes, the view
 * root) see the view's children, not every child. */
static inline int in_shared_region(const node_t *n) { return (n->flags & (NODE_SHARED | NODE_ATTACH)) != 0; }

#endif /* RLE_TRIE_ARENA_H */
