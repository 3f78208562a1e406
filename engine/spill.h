/*
 * spill.h - sessions on disk: one file per session, and the directory that
 * holds them.
 *
 * A session the engine would otherwise lose (the pool's LRU drops it,
 * max_sessions or the idle timeout ends it, the daemon stops) is written
 * to [sessions] dir instead, and read back on its next request, in this or
 * a later process. Two layers:
 *
 *   spill.c        the file: write one session sequence, read one back
 *                  into an empty session sequence, read a file's header;
 *   spill_store.c  the directory: names, the index (built lazily, from
 *                  headers only), the size cap with the least recently
 *                  used file removed first, listing and removal.
 *
 * The file, stated once (host byte order; a file from a host of the other
 * order fails the endianness tag and is refused):
 *
 *   header, SPILL_HEAD_BYTES:
 *     0   magic "KVDSESS1"           8   u32 0x01020304 (byte order)
 *     12  u32 version (2)            16  u64 fingerprint (spill_fingerprint)
 *     24  u64 payload bytes          32  u64 payload checksum
 *     40  i64 last used (unix ms)    48  i32 history tokens
 *     52  i32 retained tokens        56  i32 id length (1..SPILL_ID_MAX)
 *     60  id bytes (not terminated), zero padding to byte 248
 *     248 u64 header checksum (bytes 0..247)
 *   payload:
 *     shape: i32 n_layer, n_kv_head, head_dim, k_type, v_type, k row bytes,
 *            v row bytes
 *     the policy the session ran under: i32 kind, max_cache_tokens,
 *            sink_tokens, window_tokens, heavy_tokens, observe_tokens,
 *            pool_tokens, knorm_smallest, renumber
 *     i32 next position, turns, turn low-water mark, pinned spans
 *     i32 history [history tokens]
 *     i32 ids, positions, history indices [retained tokens each]
 *     f32 scores [retained tokens]
 *     i32 turns [turns][3]: history start, tokens, messages
 *     i32 pinned spans [pinned spans][2]: history start, end (excluded)
 *     K and V rows in their stored type: for each layer, for each KV
 *     head, the K rows of every retained token, then their V rows.
 *
 * The checksums are a 64-bit multiply-xorshift hash over 8-byte words in
 * which every step is a bijection of the running state, so a file that
 * differs from what was written in any one word never passes, and two
 * differences pass with odds of about 2^-64. A write goes to NAME.tmp,
 * is fsync'd, renamed over NAME and the directory fsync'd: a crash leaves
 * the old file or the new one, never half of one (a stale .tmp is removed
 * when the directory is indexed).
 *
 * Errors are negative errno codes with the reason in err: -ENOENT no such
 * file; -EBADMSG truncated or corrupted (a checksum, a size, or a state
 * the cache refuses); -ESTALE written for another model or another KV
 * layout; -ENOSPC / -ENOMEM no room in the pool (or too many tokens for
 * the policy); file system errors as they come (-EROFS, -EACCES, -ENOSPC
 * for a full disk, -EIO). A file of another format version (1 had no
 * pinned spans) is -ESTALE and left alone, as another model's is; the
 * session's next save writes over it. Pinned spans the policy in effect
 * has no room for (a reload shrank the budget) are -ESTALE too. Every
 * refusal leaves the sequence empty and the engine goes on with a cache
 * miss. Engine thread only.
 */
#ifndef KVD_ENGINE_SPILL_H
#define KVD_ENGINE_SPILL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/kv_cache.h"
#include "engine/engine.h"

#define SPILL_HEAD_BYTES 256
#define SPILL_ID_MAX 188 /* the longest id a header holds */

/* What a file's header says. */
struct spill_head {
    uint64_t fingerprint;
    uint64_t payload_bytes, payload_sum;
    int64_t last_used_ms; /* unix ms */
    int32_t n_hist, n_tokens;
    char id[SPILL_ID_MAX + 1]; /* NUL-terminated */
};

/* The fingerprint a file carries: the model's (model_fingerprint) with
 * the cache's K and V types, which the rows are stored in. */
uint64_t spill_fingerprint(uint64_t model_fp, enum kv_type k_type, enum kv_type v_type);

/*
 * Write session `id` (seq, a session sequence; read through the cache's
 * public accessors, never changed) to path, atomically (path.tmp, fsync,
 * rename, fsync of the directory dir). *bytes (may be NULL) gets the
 * file's size. Returns 0, or a negative errno with the reason in err and
 * no file at path changed (the .tmp removed).
 */
int spill_write(const char *dir, const char *path, const char *id, kv_seq *seq,
                uint64_t fingerprint, int64_t last_used_ms, uint64_t *bytes, char *err,
                size_t errlen);

/* Read and check a file's header (magic, byte order, version, header
 * checksum, and that the file is as long as it says). Returns 0, -ENOENT,
 * or -EBADMSG / an errno with the reason in err. */
int spill_read_head(const char *path, struct spill_head *h, char *err, size_t errlen);

/*
 * Read session `id` from path into seq (an empty session sequence of a
 * cache shaped as the file says), its K and V rows through kv_seq_k /
 * kv_seq_v; the whole payload is checked against its checksum before
 * this returns 0. *h (may be NULL) gets the header. On any error the
 * sequence is left empty (see the codes above).
 */
int spill_read(const char *path, const char *id, uint64_t fingerprint, kv_seq *seq,
               struct spill_head *h, char *err, size_t errlen);

/* ------------------------------------------------------------------------
 * The directory (spill_store.c)
 * ------------------------------------------------------------------------ */

typedef struct spill_store spill_store;

/* One session file of this model, as its header says. */
struct spill_entry {
    char id[SPILL_ID_MAX + 1];
    int32_t n_hist, n_tokens;
    int64_t last_used_ms;
    uint64_t bytes; /* the file's size */
};

/*
 * A store over the directory dir (which must exist and be a directory;
 * one daemon per directory), holding at most max_bytes of session files
 * (0 = no cap), for files of this fingerprint. Nothing is read yet: the
 * index is built on first need. A directory the process cannot write is
 * a warning logged through hooks (every save then fails and says so).
 * Returns NULL with the reason in err.
 */
spill_store *spill_store_create(const char *dir, uint64_t max_bytes, uint64_t fingerprint,
                                const struct engine_hooks *hooks, char *err, size_t errlen);
void spill_store_destroy(spill_store *st);

/*
 * Save session id (seq) with its last use time. Then the cap: the least
 * recently used other files go until the directory fits max_bytes; a file
 * larger than the cap alone is removed again (-EFBIG). Returns 0 or a
 * negative errno with the reason in err; the session's earlier file, if
 * any, is kept on failure.
 */
int spill_store_save(spill_store *st, const char *id, kv_seq *seq, int64_t last_used_ms,
                     char *err, size_t errlen);
/*
 * Read session id into seq (an empty session sequence). On success the
 * file is removed (the session lives in memory again) and *e (may be NULL)
 * describes what was read. A corrupted or truncated file is removed too
 * (-EBADMSG); another model's is left alone (-ESTALE). -ENOENT: none.
 */
int spill_store_load(spill_store *st, const char *id, kv_seq *seq, struct spill_entry *e,
                     char *err, size_t errlen);
/* Whether a file of this model holds session id; *e (may be NULL) gets
 * its header. */
bool spill_store_find(spill_store *st, const char *id, struct spill_entry *e);
/* Remove session id's file: 0, or -ENOENT when there was none. */
int spill_store_remove(spill_store *st, const char *id);
/* The index (built now if it was not): *n entries, borrowed until the next
 * call on the store. */
const struct spill_entry *spill_store_list(spill_store *st, int *n);

#endif /* KVD_ENGINE_SPILL_H */
