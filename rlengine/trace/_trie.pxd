# Declarations of csrc/trie.h, mirrored one to one for rlengine/trace/_trie.pyx.
#
# This file only declares: no Python-visible names, no logic. Change it
# together with csrc/trie.h, in the same order, so the two read side by side.

from libc.stdint cimport int32_t, int64_t, uint8_t


cdef extern from "trie.h" nogil:
    enum:
        RLE_KIND_PROMPT
        RLE_KIND_SAMPLED
        RLE_KIND_ENVIRONMENT

    enum:
        RLE_OK
        RLE_ERR_NOMEM
        RLE_ERR_LIMIT
        RLE_ERR_HANDLE
        RLE_ERR_RANGE
        RLE_ERR_INPUT
        RLE_ERR_VIEW
        RLE_ERR_SHARED
        RLE_FIELD_TOKENS
        RLE_FIELD_LOGPROBS
        RLE_FIELD_VERSIONS

    ctypedef int64_t rle_handle

    ctypedef struct rle_cursor:
        int32_t node
        int32_t offset
        int64_t matched
        int32_t view

    ctypedef struct rle_segment:
        int64_t start
        int64_t end
        int64_t request_id
        int32_t kind

    ctypedef struct rle_trie_stats:
        int64_t memory_bytes
        int64_t max_bytes
        int64_t live_tokens
        int64_t garbage_tokens
        int64_t arena_capacity
        int64_t blocks
        int64_t live_nodes
        int64_t node_capacity
        int64_t roots
        int64_t views
        int64_t shared_tokens

    ctypedef struct rle_trie:
        pass

    rle_trie *rle_trie_new(int64_t max_bytes)
    void rle_trie_free(rle_trie *t)

    int rle_trie_new_root(rle_trie *t, rle_handle *out)
    int rle_trie_new_shared_root(rle_trie *t, rle_handle *out)
    int rle_trie_new_view(rle_trie *t, rle_handle shared_root, rle_handle *out)

    int rle_trie_walk(const rle_trie *t, rle_handle at, const int32_t *tokens, int64_t n, rle_cursor *cur)
    int rle_trie_walk_view(const rle_trie *t, rle_handle view, rle_handle at, const int32_t *tokens, int64_t n,
                           rle_cursor *cur)

    int rle_trie_insert_at(rle_trie *t, const rle_cursor *cur, const int32_t *tokens, const float *logprobs,
                           const int32_t *versions, int64_t n, int32_t kind, int64_t request_id, rle_handle *out)

    ctypedef struct rle_bad_input:
        int32_t field
        int64_t index

    int rle_trie_insert_checked(rle_trie *t, const rle_cursor *cur, const int32_t *tokens, const float *logprobs,
                                const int32_t *versions, int64_t n, int32_t kind, int64_t request_id,
                                rle_handle *out, rle_bad_input *bad)

    int rle_trie_depth(const rle_trie *t, rle_handle h, int64_t *depth)
    int rle_trie_root_of(const rle_trie *t, rle_handle h, rle_handle *root)
    int rle_trie_parent(const rle_trie *t, rle_handle h, rle_handle *parent)
    int rle_trie_is_live(const rle_trie *t, rle_handle h)
    int rle_trie_holds(const rle_trie *t, rle_handle root, rle_handle h)
    int rle_trie_refs(const rle_trie *t, rle_handle h, int64_t *refs)

    int rle_trie_export_path(const rle_trie *t, rle_handle h, int32_t *tokens, float *logprobs, int32_t *versions,
                             uint8_t *loss_mask)

    int64_t rle_trie_path_segments(const rle_trie *t, rle_handle h, rle_segment *out, int64_t cap)

    int64_t rle_trie_leaves(const rle_trie *t, rle_handle h, rle_handle *out, int64_t cap)

    int64_t rle_trie_prune(rle_trie *t, rle_handle h)

    int rle_trie_compact(rle_trie *t)

    void rle_trie_stats_get(const rle_trie *t, rle_trie_stats *out)

    int64_t rle_check_tokens(const int32_t *tokens, int64_t n)
    int64_t rle_check_logprobs(const float *logprobs, int64_t n)
    int64_t rle_check_versions(const int32_t *versions, int64_t n, int32_t kind)
