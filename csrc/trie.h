/* trie.h: a radix (compressed) trie over int32 token ids, the storage core of
 * rlengine's trace store.
 *
 * Every stored token carries a float32 logprob and an int32 policy version
 * (-1 for prompt and environment tokens). Every node carries the metadata of
 * the segment it was stored by (kind and request id). One trie holds many
 * trees; a tree starts at a root made by rle_trie_new_root (one session's
 * own tree) or rle_trie_new_shared_root (a tree that sessions share).
 *
 * Sharing: a view (rle_trie_new_view) is one session's tree inside a shared
 * tree. Each view holds one shared path, from the shared root to its anchor,
 * and private nodes of its own hanging off that path; node reference counts
 * say how many views hold each shared node. Only data equal for every
 * holder is shared: a prompt segment with request id -1 and logprobs 0.0
 * (versions are then -1), stored at a view's anchor while the view has
 * nothing of its own there, follows and extends the shared path (other
 * views' equal prompts are matched, not stored again) and moves the
 * anchor to its end. Everything else a view stores is private to it, so
 * per-segment metadata stays exactly what each view stored. A view's walk
 * sees only what it holds, so sharing changes no answer: matches, exports,
 * segments and leaves are those of a tree of its own. Dropping a view
 * (rle_trie_prune of its root) frees its private nodes and the shared ones
 * no other view holds. A view's private nodes hang off attachment records,
 * one per shared node it branches at; these are never handed out as
 * handles.
 *
 * Memory: token, logprob and version data live in blocks of three parallel
 * C arrays (an edge is a run in one block, so splitting an edge copies
 * nothing and growing the trie moves nothing); nodes live in one array of
 * records with a free list. Pruning a subtree frees emptied blocks at once
 * and turns the rest into garbage that a compaction reclaims in place; freed
 * node slots are reused. Everything the trie holds from malloc is counted,
 * and an optional bound makes a growing call fail with RLE_ERR_LIMIT,
 * leaving the trie as it was. See trie_arena.c.
 *
 * This header knows nothing of Python: it must not include Python.h. The
 * core stores only values checked as rle_check_* checks them: callers run
 * those checks before rle_trie_insert_at, or call rle_trie_insert_checked,
 * which runs them itself. It is
 * mirrored one to one by rlengine/trace/_trie.pxd; change both together.
 */

#ifndef RLE_TRIE_H
#define RLE_TRIE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What produced a segment of tokens. Only sampled tokens enter the loss. */
#define RLE_KIND_PROMPT 0
#define RLE_KIND_SAMPLED 1
#define RLE_KIND_ENVIRONMENT 2

/* Status codes; every fallible call returns one (0 is success). */
#define RLE_OK 0
#define RLE_ERR_NOMEM (-1)  /* malloc or realloc failed */
#define RLE_ERR_LIMIT (-2)  /* the call would exceed the trie's memory bound */
#define RLE_ERR_HANDLE (-3) /* not a live node of this trie (never made, or pruned) */
#define RLE_ERR_RANGE (-4)  /* a length does not fit: more than INT32_MAX new tokens in one call */
#define RLE_ERR_INPUT (-5)  /* rle_trie_insert_checked: an input value is invalid (see rle_bad_input) */
#define RLE_ERR_VIEW (-6)   /* a shared position without a view, a view not holding it, or not a view / shared root */
#define RLE_ERR_SHARED (-7) /* the call would change or list what other views hold (a shared node) */

/* A node of the trie, as (generation << 32 | index). It names the position
 * at the end of the node's edge, and stays valid until the node is pruned:
 * splitting an edge keeps the lower part under the old index, so positions
 * handed out earlier never move. */
typedef int64_t rle_handle;

/* Where a walk stopped: `matched` tokens of the input lie on the path, and
 * the last of them is at `offset` (1..len) on the edge of node `node`, or
 * the walk matched nothing and stopped at the end of the start node; `view`
 * is the view walked in (-1: none). Valid only until the next call that
 * changes the trie. */
typedef struct {
    int32_t node;
    int32_t offset;
    int64_t matched;
    int32_t view;
} rle_cursor;

/* A run of a path stored with the same metadata, [start, end) in tokens. */
typedef struct {
    int64_t start;
    int64_t end;
    int64_t request_id;
    int32_t kind;
} rle_segment;

/* Which input value rle_trie_insert_checked refused: the first invalid
 * one, tokens before logprobs before versions, as rle_check_* define them. */
#define RLE_FIELD_TOKENS 0
#define RLE_FIELD_LOGPROBS 1
#define RLE_FIELD_VERSIONS 2
typedef struct {
    int32_t field;
    int64_t index; /* into the call's arrays (not counted from the match) */
} rle_bad_input;

typedef struct {
    int64_t memory_bytes;   /* everything held from malloc */
    int64_t max_bytes;      /* the bound; 0 means none */
    int64_t live_tokens;    /* tokens on live edges */
    int64_t garbage_tokens; /* slots no live edge holds (pruned, or a block's skipped tail) */
    int64_t arena_capacity; /* token slots allocated */
    int64_t blocks;         /* data blocks allocated */
    int64_t live_nodes;     /* roots included */
    int64_t node_capacity;
    int64_t roots;          /* own and shared roots (not views) */
    int64_t views;
    int64_t shared_tokens;  /* tokens on shared edges, each counted once */
} rle_trie_stats;

typedef struct rle_trie rle_trie;

/* A new empty trie; max_bytes 0 means unbounded. NULL if out of memory. */
rle_trie *rle_trie_new(int64_t max_bytes);
void rle_trie_free(rle_trie *t);

/* A new empty tree; its root has an empty edge. */
int rle_trie_new_root(rle_trie *t, rle_handle *out);
/* A new empty shared tree. It is freed with its last view (or pruned while it has none). */
int rle_trie_new_shared_root(rle_trie *t, rle_handle *out);
/* A new empty view of the shared tree of `shared_root`; *out is the view's
 * root (depth 0, its anchor the shared root). RLE_ERR_VIEW if `shared_root`
 * is not a shared root. */
int rle_trie_new_view(rle_trie *t, rle_handle shared_root, rle_handle *out);

/* Follow `tokens` from the end of `at` as far as the stored paths go. */
int rle_trie_walk(const rle_trie *t, rle_handle at, const int32_t *tokens, int64_t n, rle_cursor *cur);
/* rle_trie_walk in view `view` (-1: the view of `at` if it is a view root,
 * none if it is an own tree's node), seeing only what the view holds.
 * RLE_ERR_VIEW if `at` is a shared node and no view is given, or the view
 * does not hold `at`; `at` = the view's shared root stands for the view's
 * root. */
int rle_trie_walk_view(const rle_trie *t, rle_handle view, rle_handle at, const int32_t *tokens, int64_t n,
                       rle_cursor *cur);

/* Store tokens[cur->matched:n] after the cursor's position and set *out to
 * the node ending at token n (splitting an edge when that point lies inside
 * one). With n == cur->matched nothing is stored and *out marks the match
 * end. `cur` must come from rle_trie_walk(_view) of the same tokens with no
 * change to the trie in between. logprobs and versions are indexed like
 * tokens; NULL stores 0.0 and -1. In a view, a shareable segment at the
 * view's anchor extends its shared path (see the top of this file). */
int rle_trie_insert_at(rle_trie *t, const rle_cursor *cur, const int32_t *tokens, const float *logprobs,
                       const int32_t *versions, int64_t n, int32_t kind, int64_t request_id, rle_handle *out);

/* rle_trie_insert_at for input not checked yet: the new (unmatched)
 * tokens, logprobs and versions are checked as rle_check_* check them (for
 * `kind`; NULL arrays are not checked) before anything is stored. An
 * invalid value gives RLE_ERR_INPUT with *bad naming it, the trie
 * unchanged. When the current block and node array have room, the values
 * are checked while they are copied into place (one pass over the input);
 * otherwise they are checked first, so bad input never grows the trie. */
int rle_trie_insert_checked(rle_trie *t, const rle_cursor *cur, const int32_t *tokens, const float *logprobs,
                            const int32_t *versions, int64_t n, int32_t kind, int64_t request_id, rle_handle *out,
                            rle_bad_input *bad);

/* Tokens from the root to the end of `h`. */
int rle_trie_depth(const rle_trie *t, rle_handle h, int64_t *depth);
/* The root of the tree holding `h`: for a view's private node or its root,
 * the view's root; for a shared node, the shared root. */
int rle_trie_root_of(const rle_trie *t, rle_handle h, rle_handle *root);
/* The node whose end is where the edge of `h` starts; -1 when `h` is a
 * root (a view's root included). */
int rle_trie_parent(const rle_trie *t, rle_handle h, rle_handle *parent);
int rle_trie_is_live(const rle_trie *t, rle_handle h);
/* 1 if `h` is a position of the tree rooted at `root` (a view root: one
 * the view holds, shared or its own; any other root: rle_trie_root_of(h)
 * is `root`), 0 if not, or RLE_ERR_HANDLE. */
int rle_trie_holds(const rle_trie *t, rle_handle root, rle_handle h);
/* How many views hold `h` if it is a shared node (a shared root: its
 * views), else 1. */
int rle_trie_refs(const rle_trie *t, rle_handle h, int64_t *refs);

/* Copy the path from the root to the end of `h` into arrays of
 * rle_trie_depth tokens; any output may be NULL. loss_mask gets 1 for
 * sampled tokens and 0 otherwise. */
int rle_trie_export_path(const rle_trie *t, rle_handle h, int32_t *tokens, float *logprobs, int32_t *versions,
                         uint8_t *loss_mask);

/* The path's runs of equal (kind, request id), root first. Returns how many
 * there are (or a negative status) and writes the first min(count, cap). */
int64_t rle_trie_path_segments(const rle_trie *t, rle_handle h, rle_segment *out, int64_t cap);

/* The leaves under `h` (h itself when it is a childless non-root), in
 * depth-first order with children in creation order; for a view root, the
 * view's leaves (at a shared node, its shared child on the view's path comes
 * first: it was held before any private child there was made). Returns how
 * many there are (or a negative status: RLE_ERR_SHARED for a shared node)
 * and writes the first min(count, cap). */
int64_t rle_trie_leaves(const rle_trie *t, rle_handle h, rle_handle *out, int64_t cap);

/* Free `h`, its edge and everything below it; a root frees its whole tree,
 * a view root drops the view (its private nodes, and the shared nodes no
 * other view holds). A shared node, or a shared root that views hold, is
 * refused (RLE_ERR_SHARED). Returns the number of tokens freed or a
 * negative status. */
int64_t rle_trie_prune(rle_trie *t, rle_handle h);

/* Move live data together and release the garbage. Pruning compacts on its
 * own once garbage outweighs live data; this forces it. */
int rle_trie_compact(rle_trie *t);

void rle_trie_stats_get(const rle_trie *t, rle_trie_stats *out);

/* Input checks for callers, so the core never stores invalid values. Each
 * returns the index of the first offending element, or -1 if none. A walk
 * may run before rle_check_tokens: a negative id never matches a stored one,
 * so only the unmatched rest needs checking. */
int64_t rle_check_tokens(const int32_t *tokens, int64_t n);          /* negative ids */
int64_t rle_check_logprobs(const float *logprobs, int64_t n);        /* NaN or > 0 */
int64_t rle_check_versions(const int32_t *versions, int64_t n, int32_t kind); /* sampled: < 0; else != -1 */

#ifdef __cplusplus
}
#endif

#endif /* RLE_TRIE_H */
