/*
 * spill_store.c - the session directory: one file per session, named by a
 * hash of its id, indexed lazily, kept under a size cap by removing the
 * least recently used file first.
 *
 * Names. A session id may be up to SPILL_ID_MAX bytes of [A-Za-z0-9._:-],
 * longer than some file systems allow and not always a safe name, so a
 * file is named by the 64-bit FNV-1a hash of the id in hex ("<16 hex>.kvs")
 * and its header carries the id itself: a lookup opens exactly one file,
 * and the (astronomically rare) collision reads as "another session's
 * file", a miss, never the wrong session.
 *
 * The index. A restart must not read every file before it serves: at start
 * nothing is read. A request naming a session that is not in memory opens
 * its one file. Only what needs the whole directory builds the index, the
 * first time: the size cap (at the first save) and the listing. It reads
 * headers only (256 bytes a file), removes stale .tmp files (a write that
 * a crash cut short) and corrupted files, and leaves files of another model
 * alone, out of the index and out of the cap. From then on the store keeps
 * the index as it writes and removes.
 *
 * The cap. After a save, files go oldest last use first (not the one just
 * written) until the directory's session files fit max_bytes; a session
 * file larger than the cap alone is removed again and the save reported as
 * failed. Engine thread only; the directory belongs to one daemon.
 */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/engine_internal.h"
#include "engine/spill.h"

struct spill_store {
    char *dir;
    uint64_t max_bytes; /* 0: no cap */
    uint64_t fingerprint;
    const struct engine_hooks *hooks;
    bool indexed;
    struct spill_entry *ents; /* [n] files of this model, when indexed */
    int n, cap;
    uint64_t total; /* their bytes */
};

static uint64_t id_hash(const char *id)
{
    uint64_t h = 14695981039346656037ull; /* FNV-1a 64 */
    for (const char *p = id; *p; p++)
        h = (h ^ (uint8_t)*p) * 1099511628211ull;
    return h;
}

static void path_of(const spill_store *st, const char *id, char *out, size_t n)
{
    snprintf(out, n, "%s/%016" PRIx64 ".kvs", st->dir, id_hash(id));
}

spill_store *spill_store_create(const char *dir, uint64_t max_bytes, uint64_t fingerprint,
                                const struct engine_hooks *hooks, char *err, size_t errlen)
{
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        snprintf(err, errlen, "[sessions] dir %s: %s", dir, strerror(errno));
        return NULL;
    }
    if (!S_ISDIR(sb.st_mode)) {
        snprintf(err, errlen, "[sessions] dir %s: not a directory", dir);
        return NULL;
    }
    spill_store *st = calloc(1, sizeof(*st));
    if (!st || !(st->dir = strdup(dir))) {
        free(st);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    st->max_bytes = max_bytes;
    st->fingerprint = fingerprint;
    st->hooks = hooks;
    if (access(dir, W_OK) != 0)
        engine_log(hooks, ENGINE_LOG_WARN,
                   "sessions: %s is not writable (%s): sessions cannot be saved there", dir,
                   strerror(errno));
    const char *stall = getenv("KVD_FAULT_SPILL_STALL_MS");
    if (stall && *stall)
        engine_log(hooks, ENGINE_LOG_WARN,
                   "fault injection: every session write stalls %s ms halfway "
                   "(KVD_FAULT_SPILL_STALL_MS)",
                   stall);
    return st;
}

void spill_store_destroy(spill_store *st)
{
    if (!st)
        return;
    free(st->ents);
    free(st->dir);
    free(st);
}

/* ------------------------------------------------------------------------
 * The index
 * ------------------------------------------------------------------------ */

static int find_ent(const spill_store *st, const char *id)
{
    for (int i = 0; i < st->n; i++)
        if (!strcmp(st->ents[i].id, id))
            return i;
    return -1;
}

static void drop_ent(spill_store *st, int i)
{
    st->total -= st->ents[i].bytes;
    st->ents[i] = st->ents[--st->n];
}

/* Add or replace; out of memory, the index forgets (it is rebuilt on the
 * next need). */
static void put_ent(spill_store *st, const struct spill_entry *e)
{
    int i = find_ent(st, e->id);
    if (i >= 0)
        drop_ent(st, i);
    if (st->n == st->cap) {
        int cap = st->cap ? st->cap * 2 : 64;
        struct spill_entry *p = realloc(st->ents, sizeof(*p) * (size_t)cap);
        if (!p) {
            st->indexed = false;
            return;
        }
        st->ents = p;
        st->cap = cap;
    }
    st->ents[st->n++] = *e;
    st->total += e->bytes;
}

static bool has_suffix(const char *s, const char *suf)
{
    size_t n = strlen(s), k = strlen(suf);
    return n >= k && !strcmp(s + n - k, suf);
}

/* One directory entry while indexing. */
static void index_file(spill_store *st, const char *name)
{
    char path[4096], why[512];
    snprintf(path, sizeof(path), "%s/%s", st->dir, name);
    if (has_suffix(name, ".kvs.tmp")) {
        engine_log(st->hooks, ENGINE_LOG_WARN, "sessions: removing %s, a write cut short", path);
        unlink(path);
        return;
    }
    if (!has_suffix(name, ".kvs"))
        return;
    struct spill_head h;
    int rc = spill_read_head(path, &h, why, sizeof(why));
    if (rc == -EBADMSG) {
        engine_log(st->hooks, ENGINE_LOG_WARN, "sessions: removing %s: %s", path, why);
        unlink(path);
        return;
    }
    if (rc == 0 && h.fingerprint != st->fingerprint)
        snprintf(why, sizeof(why), "written for another model or KV type");
    if (rc != 0 || h.fingerprint != st->fingerprint) {
        engine_log(st->hooks, ENGINE_LOG_INFO, "sessions: %s left alone: %s", path, why);
        return;
    }
    struct spill_entry e = {.n_hist = h.n_hist,
                            .n_tokens = h.n_tokens,
                            .last_used_ms = h.last_used_ms,
                            .bytes = SPILL_HEAD_BYTES + h.payload_bytes};
    memcpy(e.id, h.id, sizeof(e.id));
    put_ent(st, &e);
}

static void build_index(spill_store *st)
{
    if (st->indexed)
        return;
    st->n = 0;
    st->total = 0;
    st->indexed = true;
    DIR *d = opendir(st->dir);
    if (!d) {
        engine_log(st->hooks, ENGINE_LOG_WARN, "sessions: cannot read %s: %s", st->dir,
                   strerror(errno));
        return;
    }
    for (struct dirent *de; (de = readdir(d)) != NULL;)
        index_file(st, de->d_name);
    closedir(d);
    engine_log(st->hooks, ENGINE_LOG_INFO, "sessions: %s holds %d session(s), %" PRIu64 " bytes",
               st->dir, st->n, st->total);
}

/* ------------------------------------------------------------------------
 * Operations
 * ------------------------------------------------------------------------ */

/* Remove the least recently used files but keep_id's until the cap holds. */
static void enforce_cap(spill_store *st, const char *keep_id)
{
    while (st->max_bytes && st->total > st->max_bytes) {
        int victim = -1;
        for (int i = 0; i < st->n; i++)
            if (strcmp(st->ents[i].id, keep_id) &&
                (victim < 0 || st->ents[i].last_used_ms < st->ents[victim].last_used_ms))
                victim = i;
        if (victim < 0)
            return;
        char path[4096];
        path_of(st, st->ents[victim].id, path, sizeof(path));
        engine_log(st->hooks, ENGINE_LOG_INFO,
                   "sessions: %s removed from disk: over max_disk (%" PRIu64 " bytes)",
                   st->ents[victim].id, st->max_bytes);
        unlink(path);
        drop_ent(st, victim);
    }
}

int spill_store_save(spill_store *st, const char *id, kv_seq *seq, int64_t last_used_ms,
                     char *err, size_t errlen)
{
    char path[4096];
    path_of(st, id, path, sizeof(path));
    build_index(st); /* the cap needs the directory's total */
    uint64_t bytes = 0;
    int rc = spill_write(st->dir, path, id, seq, st->fingerprint, last_used_ms, &bytes, err,
                         errlen);
    if (rc)
        return rc;
    if (st->max_bytes && bytes > st->max_bytes) {
        unlink(path);
        int i = find_ent(st, id);
        if (i >= 0)
            drop_ent(st, i);
        snprintf(err, errlen, "%" PRIu64 " bytes exceed max_disk (%" PRIu64 ")", bytes,
                 st->max_bytes);
        return -EFBIG;
    }
    struct spill_entry e = {.n_hist = kv_seq_history(seq, NULL),
                            .n_tokens = kv_seq_n_tokens(seq),
                            .last_used_ms = last_used_ms,
                            .bytes = bytes};
    snprintf(e.id, sizeof(e.id), "%s", id);
    put_ent(st, &e);
    enforce_cap(st, id);
    return 0;
}

int spill_store_load(spill_store *st, const char *id, kv_seq *seq, struct spill_entry *e,
                     char *err, size_t errlen)
{
    char path[4096];
    path_of(st, id, path, sizeof(path));
    struct spill_head h;
    int rc = spill_read(path, id, st->fingerprint, seq, &h, err, errlen);
    if (rc == 0 || rc == -EBADMSG) {
        unlink(path); /* back in memory, or of no use to anyone */
        int i = st->indexed ? find_ent(st, id) : -1;
        if (i >= 0)
            drop_ent(st, i);
    }
    if (rc == 0 && e) {
        *e = (struct spill_entry){.n_hist = h.n_hist,
                                  .n_tokens = h.n_tokens,
                                  .last_used_ms = h.last_used_ms,
                                  .bytes = SPILL_HEAD_BYTES + h.payload_bytes};
        memcpy(e->id, h.id, sizeof(e->id));
    }
    return rc;
}

bool spill_store_find(spill_store *st, const char *id, struct spill_entry *e)
{
    char path[4096], why[512];
    path_of(st, id, path, sizeof(path));
    struct spill_head h;
    if (spill_read_head(path, &h, why, sizeof(why)) != 0 || strcmp(h.id, id) != 0 ||
        h.fingerprint != st->fingerprint)
        return false;
    if (e) {
        *e = (struct spill_entry){.n_hist = h.n_hist,
                                  .n_tokens = h.n_tokens,
                                  .last_used_ms = h.last_used_ms,
                                  .bytes = SPILL_HEAD_BYTES + h.payload_bytes};
        memcpy(e->id, h.id, sizeof(e->id));
    }
    return true;
}

int spill_store_remove(spill_store *st, const char *id)
{
    if (!spill_store_find(st, id, NULL))
        return -ENOENT;
    char path[4096];
    path_of(st, id, path, sizeof(path));
    int rc = unlink(path) == 0 ? 0 : -errno;
    int i = st->indexed ? find_ent(st, id) : -1;
    if (i >= 0)
        drop_ent(st, i);
    return rc;
}

const struct spill_entry *spill_store_list(spill_store *st, int *n)
{
    build_index(st);
    *n = st->n;
    return st->ents;
}
