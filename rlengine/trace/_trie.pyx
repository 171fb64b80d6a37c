# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled token trie: a thin binding of csrc/trie.c for rlengine.trace.trie.

Inputs arrive through the buffer protocol (numpy int32 / float32 arrays,
``array('i')`` / ``array('f')``, raw native-endian ``bytes``), read in place
without a copy; a list is accepted as a slow convenience, never required.
Outputs are ``bytes`` holding int32 / float32 / uint8 data, which numpy
views without copying. Every input is validated here, before the C core
sees it; bad input raises ``InvalidRequest`` (a ``ValueError``).

This module must not hold Python objects per node, must not release the GIL
(every call is a few microseconds, less than a GIL round trip would cost),
and must not diverge from ``rlengine.trace._trie_ref``, the pure-Python reference
that the differential tests hold it to.
"""

from cpython.buffer cimport (
    PyBUF_FORMAT,
    PyBUF_STRIDES,
    PyBuffer_IsContiguous,
    PyBuffer_Release,
    PyObject_CheckBuffer,
    PyObject_GetBuffer,
)
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uint8_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from array import array

from rlengine.errors import InvalidRequest
from rlengine.trace.errors import TraceMemoryExceeded

__all__ = ["KIND_ENVIRONMENT", "KIND_PROMPT", "KIND_SAMPLED", "TokenTrie"]

KIND_PROMPT = RLE_KIND_PROMPT
KIND_SAMPLED = RLE_KIND_SAMPLED
KIND_ENVIRONMENT = RLE_KIND_ENVIRONMENT

cdef enum _Dtype:
    _INT32
    _FLOAT32

cdef enum:
    _SEGMENTS_ON_STACK = 32


# The converters below take the common case (an exact int in range) in C
# and leave everything else, errors included, to the general checks.

cdef inline bint _exact_int(object obj, long long *out) noexcept:
    """True and the value if ``obj`` is exactly an int (not a bool) that fits int64."""
    cdef int overflow = 0
    if type(obj) is not int:
        return False
    out[0] = PyLong_AsLongLongAndOverflow(obj, &overflow)
    return overflow == 0


cdef rle_handle _handle(object h) except -1:
    cdef long long v
    if _exact_int(h, &v) and v >= 0:
        return <rle_handle>v
    if not isinstance(h, int) or isinstance(h, bool):
        raise InvalidRequest("handle", h, "must be an int handle returned by this trie")
    if h < 0 or h > INT64_MAX:
        raise InvalidRequest("handle", h, "not a handle of this trie")
    return <rle_handle>h


cdef int32_t _kind(object kind) except -1:
    cdef long long v
    if _exact_int(kind, &v) and (v == RLE_KIND_PROMPT or v == RLE_KIND_SAMPLED or v == RLE_KIND_ENVIRONMENT):
        return <int32_t>v
    if not isinstance(kind, int) or isinstance(kind, bool) or kind not in (KIND_PROMPT, KIND_SAMPLED,
                                                                           KIND_ENVIRONMENT):
        raise InvalidRequest("kind", kind, "must be KIND_PROMPT, KIND_SAMPLED or KIND_ENVIRONMENT")
    return <int32_t>kind


cdef int64_t _request_id(object request_id) except? -2:
    cdef long long v
    if _exact_int(request_id, &v) and v >= -1:
        return <int64_t>v
    if not isinstance(request_id, int) or isinstance(request_id, bool) or not -1 <= request_id <= INT64_MAX:
        raise InvalidRequest("request_id", request_id, "must be an int in [-1, 2**63) (-1: none)")
    return <int64_t>request_id


cdef object _from_sequence(object obj, _Dtype want, str field):
    """The slow convenience path: a list or tuple copied into an array."""
    if not isinstance(obj, (list, tuple)):
        raise InvalidRequest(field, type(obj).__name__,
                             "must be a buffer (numpy array, array('i'/'f'), bytes) or a list")
    try:
        return array("i" if want == _INT32 else "f", obj)
    except (TypeError, OverflowError) as exc:
        raise InvalidRequest(field, obj, f"not a sequence of {'int32' if want == _INT32 else 'float32'} ({exc})") \
            from None


cdef char _format_code(const char *fmt) noexcept:
    """The struct code of a one-item native or little-endian format, else 0."""
    if fmt == NULL:
        return b"B"
    if fmt[0] == b"@" or fmt[0] == b"=" or fmt[0] == b"<":
        fmt += 1
    if fmt[0] == 0 or fmt[1] != 0:
        return 0
    return fmt[0]


cdef int64_t _acquire(object obj, Py_buffer *view, _Dtype want, str field) except -1:
    """Acquire ``obj`` as a C-contiguous run of 4-byte items; returns their count.

    On success the caller owns ``view`` and must release it.
    """
    cdef char code
    cdef bint ok
    cdef Py_ssize_t size
    if type(obj) is bytes:
        # The common case (token ids as they arrive over IPC), without the
        # buffer protocol: the caller's reference keeps the bytes alive for
        # the call, and a NULL view.obj makes PyBuffer_Release a no-op.
        size = PyBytes_GET_SIZE(obj)
        if size % 4 == 0 and (<uintptr_t>PyBytes_AS_STRING(obj)) % 4 == 0:
            memset(view, 0, sizeof(Py_buffer))
            view.buf = PyBytes_AS_STRING(obj)
            view.len = size
            return size // 4
    if not PyObject_CheckBuffer(obj):
        obj = _from_sequence(obj, want, field)
    # Only objects that are plainly raw memory are reinterpreted; a numpy
    # uint8 array also exports format "B", and reading it as int32 would
    # silently turn a dtype mistake into garbage tokens.
    cdef bint raw = isinstance(obj, (bytes, bytearray, memoryview))
    try:
        PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_STRIDES)
    except (BufferError, ValueError, TypeError) as exc:
        raise InvalidRequest(field, type(obj).__name__, f"cannot be read as a buffer ({exc})") from None
    try:
        if view.ndim != 1:
            raise InvalidRequest(field, f"ndim={view.ndim}", "must be one-dimensional")
        if not PyBuffer_IsContiguous(view, b"C"):
            raise InvalidRequest(field, "strided buffer", "must be C-contiguous (numpy.ascontiguousarray)")
        code = _format_code(view.format)
        if raw and view.itemsize == 1 and (code == b"B" or code == b"b" or code == b"c"):
            if view.len % 4:
                raise InvalidRequest(field, view.len, "raw bytes must hold whole 4-byte items")
            if (<uintptr_t>view.buf) % 4:
                # A slice of a bytes object can start anywhere; the core reads
                # aligned int32 and float32, so copy this rare case.
                copy = array("i" if want == _INT32 else "f")
                copy.frombytes((<char *>view.buf)[:view.len])
                PyBuffer_Release(view)
                PyObject_GetBuffer(copy, view, PyBUF_FORMAT | PyBUF_STRIDES)
            return view.len // 4
        if want == _INT32:
            ok = view.itemsize == 4 and (code == b"i" or code == b"l")
        else:
            ok = view.itemsize == 4 and code == b"f"
        if not ok:
            fmt = (<bytes>view.format).decode("ascii", "replace") if view.format != NULL else "B"
            raise InvalidRequest(field, f"format {fmt!r}, itemsize {view.itemsize}",
                                 "must be int32" if want == _INT32 else "must be float32")
    except BaseException:
        PyBuffer_Release(view)
        raise
    return view.len // 4


cdef int _check_tokens(const int32_t *tokens, int64_t start, int64_t n) except -1:
    """Refuse a negative id in tokens[start:n].

    Called after the walk with start = the tokens matched: those equal stored
    ids, which are never negative, so only the rest needs a look, and a
    resent conversation is read once, not twice.
    """
    cdef int64_t bad = rle_check_tokens(tokens + start, n - start)
    if bad >= 0:
        _refuse(RLE_FIELD_TOKENS, start + bad, tokens, NULL, NULL, 0)
    return 0


cdef int _refuse(int32_t field, int64_t i, const int32_t *tokens, const float *logprobs, const int32_t *versions,
                 int32_t kind) except -1:
    """Raise the InvalidRequest for value ``i`` of ``field``, which rle_check_* refused."""
    if field == RLE_FIELD_TOKENS:
        raise InvalidRequest(f"tokens[{i}]", tokens[i], "token ids must be >= 0")
    if field == RLE_FIELD_LOGPROBS:
        raise InvalidRequest(f"logprobs[{i}]", logprobs[i], "logprobs must be <= 0 and not NaN")
    raise InvalidRequest(f"versions[{i}]", versions[i], "sampled tokens need a version >= 0"
                         if kind == RLE_KIND_SAMPLED else "prompt and environment tokens carry version -1")


cdef int _view_refused(object view, object at) except -1:
    """Raise the InvalidRequest for RLE_ERR_VIEW from a walk of ``at`` in ``view``."""
    if view is None:
        raise InvalidRequest("view", None, f"at={at} is a shared node: pass the view to walk it in")
    raise InvalidRequest("view", view, f"not a view of this trie that holds at={at}")


cdef int _shared_refused(object handle, str what) except -1:
    raise InvalidRequest("handle", handle, f"a shared node, held by views: {what}")


cdef class TokenTrie:
    """A forest of radix tries over int32 token ids, held in C arrays.

    See ``rlengine.trace.trie`` for the contract; ``max_bytes`` 0 means unbounded.
    Not thread-safe: use it from one thread (the engine's loop thread).
    """

    cdef rle_trie *_t

    def __cinit__(self, max_bytes=0):
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or not 0 <= max_bytes <= INT64_MAX:
            raise InvalidRequest("max_bytes", max_bytes, "must be an int >= 0 (0: unbounded)")
        self._t = rle_trie_new(max_bytes)
        if self._t == NULL:
            raise MemoryError("the token trie could not allocate its header")

    def __dealloc__(self):
        rle_trie_free(self._t)

    cdef int _fail(self, int rc, object handle, int64_t tokens) except -1:
        cdef rle_trie_stats st
        if rc == RLE_ERR_HANDLE:
            raise InvalidRequest("handle", handle, "not a live node of this trie (never made here, or pruned)")
        if rc == RLE_ERR_LIMIT:
            rle_trie_stats_get(self._t, &st)
            raise TraceMemoryExceeded(st.max_bytes, st.memory_bytes, tokens)
        if rc == RLE_ERR_RANGE:
            raise InvalidRequest("tokens", tokens, "beyond the trie's limits (2**31 - 1 new tokens in one call, "
                                 "2**31 - 1 nodes)")
        raise MemoryError("the token trie could not allocate memory")

    def new_root(self):
        cdef rle_handle out
        cdef int rc = rle_trie_new_root(self._t, &out)
        if rc != RLE_OK:
            self._fail(rc, None, 0)
        return out

    def new_shared_root(self):
        cdef rle_handle out
        cdef int rc = rle_trie_new_shared_root(self._t, &out)
        if rc != RLE_OK:
            self._fail(rc, None, 0)
        return out

    def new_view(self, shared_root):
        cdef rle_handle out
        cdef int rc = rle_trie_new_view(self._t, _handle(shared_root), &out)
        if rc == RLE_ERR_VIEW:
            raise InvalidRequest("shared_root", shared_root, "not a shared root (new_shared_root)")
        if rc != RLE_OK:
            self._fail(rc, shared_root, 0)
        return out

    def insert(self, at, tokens, logprobs=None, versions=None, kind=KIND_PROMPT, request_id=-1, view=None):
        cdef rle_handle h = _handle(at)
        cdef rle_handle vh = -1 if view is None else _handle(view)
        cdef int32_t k = _kind(kind)
        cdef int64_t rid = _request_id(request_id)
        cdef Py_buffer tv, lv, vv
        cdef bint has_l = False, has_v = False
        cdef int64_t n, m
        cdef rle_bad_input bad
        cdef rle_cursor cur
        cdef rle_handle out
        cdef int rc
        cdef const int32_t *tp
        cdef const float *lp = NULL
        cdef const int32_t *vp = NULL
        if k == RLE_KIND_SAMPLED and (logprobs is None or versions is None):
            raise InvalidRequest("logprobs" if logprobs is None else "versions", None,
                                 "sampled tokens need their logprobs and versions")
        n = _acquire(tokens, &tv, _INT32, "tokens")
        try:
            tp = <const int32_t *>tv.buf
            if logprobs is not None:
                m = _acquire(logprobs, &lv, _FLOAT32, "logprobs")
                has_l = True
                lp = <const float *>lv.buf
                if m != n:
                    raise InvalidRequest("logprobs", f"length {m}", f"must match the {n} tokens")
            if versions is not None:
                m = _acquire(versions, &vv, _INT32, "versions")
                has_v = True
                vp = <const int32_t *>vv.buf
                if m != n:
                    raise InvalidRequest("versions", f"length {m}", f"must match the {n} tokens")
            rc = rle_trie_walk_view(self._t, vh, h, tp, n, &cur)
            if rc == RLE_ERR_VIEW:
                _view_refused(view, at)
            if rc != RLE_OK:
                self._fail(rc, at, n)
            # Only the new tokens' values are checked: the stored prefix keeps
            # its own data, and a resent conversation may carry anything there.
            rc = rle_trie_insert_checked(self._t, &cur, tp, lp, vp, n, k, rid, &out, &bad)
            if rc == RLE_ERR_INPUT:
                _refuse(bad.field, bad.index, tp, lp, vp, k)
            if rc != RLE_OK:
                self._fail(rc, at, n - cur.matched)
            return (out, cur.matched)
        finally:
            PyBuffer_Release(&tv)
            if has_l:
                PyBuffer_Release(&lv)
            if has_v:
                PyBuffer_Release(&vv)

    def longest_prefix(self, at, tokens, view=None):
        cdef rle_handle h = _handle(at)
        cdef rle_handle vh = -1 if view is None else _handle(view)
        cdef Py_buffer tv
        cdef rle_cursor cur
        cdef int rc
        cdef int64_t n = _acquire(tokens, &tv, _INT32, "tokens")
        try:
            rc = rle_trie_walk_view(self._t, vh, h, <const int32_t *>tv.buf, n, &cur)
            if rc == RLE_ERR_VIEW:
                _view_refused(view, at)
            if rc != RLE_OK:
                self._fail(rc, at, 0)
            _check_tokens(<const int32_t *>tv.buf, cur.matched, n)
            return cur.matched
        finally:
            PyBuffer_Release(&tv)

    def seek(self, at, tokens, view=None):
        cdef rle_handle h = _handle(at)
        cdef rle_handle vh = -1 if view is None else _handle(view)
        cdef Py_buffer tv
        cdef rle_cursor cur
        cdef rle_handle out
        cdef int rc
        cdef int64_t n = _acquire(tokens, &tv, _INT32, "tokens")
        try:
            rc = rle_trie_walk_view(self._t, vh, h, <const int32_t *>tv.buf, n, &cur)
            if rc == RLE_ERR_VIEW:
                _view_refused(view, at)
            if rc != RLE_OK:
                self._fail(rc, at, 0)
            _check_tokens(<const int32_t *>tv.buf, cur.matched, n)
            # Insert nothing past the match: this only marks its end, which
            # may split an edge (a node), never store a token.
            rc = rle_trie_insert_at(self._t, &cur, <const int32_t *>tv.buf, NULL, NULL, cur.matched,
                                    RLE_KIND_PROMPT, -1, &out)
            if rc != RLE_OK:
                self._fail(rc, at, 0)
            return (out, cur.matched)
        finally:
            PyBuffer_Release(&tv)

    def depth(self, handle):
        cdef int64_t d
        cdef int rc = rle_trie_depth(self._t, _handle(handle), &d)
        if rc != RLE_OK:
            self._fail(rc, handle, 0)
        return d

    def root_of(self, handle):
        cdef rle_handle out
        cdef int rc = rle_trie_root_of(self._t, _handle(handle), &out)
        if rc != RLE_OK:
            self._fail(rc, handle, 0)
        return out

    def parent(self, handle):
        cdef rle_handle out
        cdef int rc = rle_trie_parent(self._t, _handle(handle), &out)
        if rc != RLE_OK:
            self._fail(rc, handle, 0)
        return None if out < 0 else out

    def is_live(self, handle):
        if not isinstance(handle, int) or isinstance(handle, bool) or not 0 <= handle <= INT64_MAX:
            return False
        return bool(rle_trie_is_live(self._t, <rle_handle>handle))

    def holds(self, root, handle):
        cdef int rc = rle_trie_holds(self._t, _handle(root), _handle(handle))
        if rc < 0:
            self._fail(rc, handle if self.is_live(root) else root, 0)
        return bool(rc)

    def refs(self, handle):
        cdef int64_t out
        cdef int rc = rle_trie_refs(self._t, _handle(handle), &out)
        if rc != RLE_OK:
            self._fail(rc, handle, 0)
        return out

    def path_tokens(self, handle):
        cdef rle_handle h = _handle(handle)
        cdef int64_t d
        cdef int rc = rle_trie_depth(self._t, h, &d)
        if rc != RLE_OK:
            self._fail(rc, handle, 0)
        cdef bytes tb = PyBytes_FromStringAndSize(NULL, d * 4)
        rle_trie_export_path(self._t, h, <int32_t *>PyBytes_AS_STRING(tb), NULL, NULL, NULL)
        return tb

    def export_path(self, handle):
        cdef rle_handle h = _handle(handle)
        cdef int64_t d
        cdef int rc = rle_trie_depth(self._t, h, &d)
        if rc != RLE_OK:
            self._fail(rc, handle, 0)
        cdef bytes tb = PyBytes_FromStringAndSize(NULL, d * 4)
        cdef bytes lb = PyBytes_FromStringAndSize(NULL, d * 4)
        cdef bytes vb = PyBytes_FromStringAndSize(NULL, d * 4)
        cdef bytes mb = PyBytes_FromStringAndSize(NULL, d)
        rle_trie_export_path(self._t, h, <int32_t *>PyBytes_AS_STRING(tb), <float *>PyBytes_AS_STRING(lb),
                             <int32_t *>PyBytes_AS_STRING(vb), <uint8_t *>PyBytes_AS_STRING(mb))
        return (tb, lb, vb, mb)

    def path_segments(self, handle):
        cdef rle_handle h = _handle(handle)
        cdef rle_segment on_stack[_SEGMENTS_ON_STACK]
        cdef rle_segment *segs = on_stack
        cdef int64_t count = rle_trie_path_segments(self._t, h, on_stack, _SEGMENTS_ON_STACK)
        cdef int64_t i
        if count < 0:
            self._fail(<int>count, handle, 0)
        if count > _SEGMENTS_ON_STACK:
            segs = <rle_segment *>malloc(count * sizeof(rle_segment))
            if segs == NULL:
                raise MemoryError("the token trie could not allocate memory")
            rle_trie_path_segments(self._t, h, segs, count)
        try:
            return [(segs[i].start, segs[i].end, segs[i].kind, segs[i].request_id) for i in range(count)]
        finally:
            if segs != on_stack:
                free(segs)

    def leaves(self, handle):
        cdef rle_handle h = _handle(handle)
        cdef int64_t count = rle_trie_leaves(self._t, h, NULL, 0)
        cdef int64_t i
        cdef rle_handle *out
        if count == RLE_ERR_SHARED:
            _shared_refused(handle, "list a view's leaves from its view root")
        if count < 0:
            self._fail(<int>count, handle, 0)
        if count == 0:
            return []
        out = <rle_handle *>malloc(count * sizeof(rle_handle))
        if out == NULL:
            raise MemoryError("the token trie could not allocate memory")
        try:
            rle_trie_leaves(self._t, h, out, count)
            return [out[i] for i in range(count)]
        finally:
            free(out)

    def prune(self, handle):
        cdef int64_t freed = rle_trie_prune(self._t, _handle(handle))
        if freed == RLE_ERR_SHARED:
            _shared_refused(handle, "it goes when the last view holding it is dropped (prune the view roots)")
        if freed < 0:
            self._fail(<int>freed, handle, 0)
        return freed

    def compact(self):
        if rle_trie_compact(self._t) != RLE_OK:
            raise MemoryError("the token trie could not allocate memory to compact")

    def stats(self):
        cdef rle_trie_stats st
        rle_trie_stats_get(self._t, &st)
        return {
            "memory_bytes": st.memory_bytes,
            "max_bytes": st.max_bytes,
            "live_tokens": st.live_tokens,
            "garbage_tokens": st.garbage_tokens,
            "arena_capacity": st.arena_capacity,
            "blocks": st.blocks,
            "live_nodes": st.live_nodes,
            "node_capacity": st.node_capacity,
            "roots": st.roots,
            "views": st.views,
            "shared_tokens": st.shared_tokens,
        }

    @property
    def memory_bytes(self):
        cdef rle_trie_stats st
        rle_trie_stats_get(self._t, &st)
        return st.memory_bytes

    @property
    def max_bytes(self):
        cdef rle_trie_stats st
        rle_trie_stats_get(self._t, &st)
        return st.max_bytes

    @property
    def live_tokens(self):
        cdef rle_trie_stats st
        rle_trie_stats_get(self._t, &st)
        return st.live_tokens

    @property
    def node_count(self):
        cdef rle_trie_stats st
        rle_trie_stats_get(self._t, &st)
        return st.live_nodes

    @property
    def root_count(self):
        cdef rle_trie_stats st
        rle_trie_stats_get(self._t, &st)
        return st.roots
