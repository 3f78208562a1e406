/*
 * spill.c - one session in one file: written atomically, read back only
 * whole and checked (spill.h states the format).
 *
 * Writing streams the sequence through a buffer: the header's place is
 * left zero, the payload goes out in order while its checksum runs, and
 * the header, which holds the payload's size and checksum, is written last
 * into its place. Then fsync, rename over the final name, fsync of the
 * directory: whoever reads the final name sees a whole file of one moment,
 * and a crash at any point leaves at worst a .tmp behind.
 *
 * Reading trusts nothing. The header's own checksum, the file's length
 * against the payload size, the fingerprint (model, K and V types) and the
 * KV shape are checked before a byte of the payload is used; the payload's
 * arrays are sized from the header and must add up to the payload size
 * exactly; the cache checks the state for its invariants
 * (kv_seq_import); the K and V rows are read straight into the pages the
 * import took, and only when the payload's checksum matches at the end is
 * the sequence kept. Any failure empties it again, so a bad file is a cache
 * miss, never a wrong token.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "engine/spill.h"

#define SPILL_MAGIC "KVDSESS1"
#define SPILL_ENDIAN 0x01020304u
#define SPILL_VERSION 2u /* 2: pinned spans */
#define IO_BUF (1u << 20)
#define SHAPE_WORDS 7
#define POLICY_WORDS 9
#define MISC_WORDS 4

/* ------------------------------------------------------------------------
 * The checksum: 8-byte words, each step a bijection of the state
 * ------------------------------------------------------------------------ */

struct sum {
    uint64_t h, word, len;
    int n; /* bytes in word */
};

static void sum_init(struct sum *s)
{
    *s = (struct sum){.h = 0x243F6A8885A308D3ull};
}

static inline uint64_t sum_step(uint64_t h, uint64_t w)
{
    h ^= w;
    h *= 0x9E3779B97F4A7C15ull; /* odd: invertible mod 2^64 */
    return h ^ (h >> 32);       /* invertible: the shift is at least half the width */
}

static inline uint64_t le64(const uint8_t *b)
{
    uint64_t w = 0;
    for (int i = 7; i >= 0; i--)
        w = w << 8 | b[i];
    return w;
}

static void sum_add(struct sum *s, const void *data, size_t n)
{
    const uint8_t *b = data;
    s->len += n;
    while (n > 0 && s->n > 0) { /* finish a word begun by the last call */
        s->word |= (uint64_t)*b++ << (8 * s->n);
        n--;
        if (++s->n == 8) {
            s->h = sum_step(s->h, s->word);
            s->word = 0;
            s->n = 0;
        }
    }
    for (; n >= 8; b += 8, n -= 8)
        s->h = sum_step(s->h, le64(b));
    /* Fewer than 8 left, and no word begun (the first loop finished it or
     * used up the input): start the next one. */
    for (size_t i = 0; i < n; i++)
        s->word |= (uint64_t)b[i] << (8 * i);
    if (n > 0)
        s->n = (int)n;
}

static uint64_t sum_final(const struct sum *s)
{
    uint64_t h = s->n ? sum_step(s->h, s->word) : s->h;
    return sum_step(h, s->len);
}

static uint64_t sum_of(const void *data, size_t n)
{
    struct sum s;
    sum_init(&s);
    sum_add(&s, data, n);
    return sum_final(&s);
}

uint64_t spill_fingerprint(uint64_t model_fp, enum kv_type k_type, enum kv_type v_type)
{
    return sum_step(sum_step(model_fp, (uint64_t)k_type + 1), (uint64_t)v_type + 1);
}

/* ------------------------------------------------------------------------
 * The header
 * ------------------------------------------------------------------------ */

static void put32(uint8_t *b, size_t at, uint32_t v)
{
    memcpy(b + at, &v, 4);
}
static void put64(uint8_t *b, size_t at, uint64_t v)
{
    memcpy(b + at, &v, 8);
}
static uint32_t get32(const uint8_t *b, size_t at)
{
    uint32_t v;
    memcpy(&v, b + at, 4);
    return v;
}
static uint64_t get64(const uint8_t *b, size_t at)
{
    uint64_t v;
    memcpy(&v, b + at, 8);
    return v;
}

static void head_pack(const struct spill_head *h, uint8_t b[SPILL_HEAD_BYTES])
{
    memset(b, 0, SPILL_HEAD_BYTES);
    memcpy(b, SPILL_MAGIC, 8);
    put32(b, 8, SPILL_ENDIAN);
    put32(b, 12, SPILL_VERSION);
    put64(b, 16, h->fingerprint);
    put64(b, 24, h->payload_bytes);
    put64(b, 32, h->payload_sum);
    put64(b, 40, (uint64_t)h->last_used_ms);
    put32(b, 48, (uint32_t)h->n_hist);
    put32(b, 52, (uint32_t)h->n_tokens);
    size_t n = strlen(h->id);
    put32(b, 56, (uint32_t)n);
    memcpy(b + 60, h->id, n);
    put64(b, 248, sum_of(b, 248));
}

static int head_unpack(const uint8_t b[SPILL_HEAD_BYTES], struct spill_head *h, char *err,
                       size_t errlen)
{
    if (memcmp(b, SPILL_MAGIC, 8) != 0) {
        snprintf(err, errlen, "not a kvd session file (no %s magic)", SPILL_MAGIC);
        return -EBADMSG;
    }
    if (get32(b, 8) != SPILL_ENDIAN || get32(b, 12) != SPILL_VERSION) {
        snprintf(err, errlen, "written by another byte order or format version (%u)",
                 get32(b, 12));
        return -ESTALE;
    }
    if (get64(b, 248) != sum_of(b, 248)) {
        snprintf(err, errlen, "header checksum mismatch (corrupted)");
        return -EBADMSG;
    }
    uint32_t n = get32(b, 56);
    int32_t nh = (int32_t)get32(b, 48), nt = (int32_t)get32(b, 52);
    if (n < 1 || n > SPILL_ID_MAX || nh < 0 || nt < 0 || nt > nh) {
        snprintf(err, errlen, "header out of range (id of %u bytes, %d of %d tokens)", n, nt, nh);
        return -EBADMSG;
    }
    h->fingerprint = get64(b, 16);
    h->payload_bytes = get64(b, 24);
    h->payload_sum = get64(b, 32);
    h->last_used_ms = (int64_t)get64(b, 40);
    h->n_hist = nh;
    h->n_tokens = nt;
    memcpy(h->id, b + 60, n);
    h->id[n] = '\0';
    return 0;
}

/* ------------------------------------------------------------------------
 * Buffered, checksummed I/O
 * ------------------------------------------------------------------------ */

struct io {
    int fd;
    uint8_t *buf;
    size_t n, at;  /* write: bytes buffered; read: bytes in buf, next byte */
    struct sum sum;
    uint64_t bytes; /* payload bytes so far */
    uint64_t limit; /* read: payload bytes the header promised */
    int err;        /* first error (negative errno), sticky */
};

static int write_all(int fd, const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return w < 0 ? -errno : -EIO;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static void out_flush(struct io *o)
{
    if (!o->err && o->n > 0)
        o->err = write_all(o->fd, o->buf, o->n);
    o->n = 0;
}

static void out_put(struct io *o, const void *data, size_t n)
{
    const uint8_t *p = data;
    sum_add(&o->sum, p, n);
    o->bytes += n;
    while (n > 0 && !o->err) {
        size_t k = IO_BUF - o->n < n ? IO_BUF - o->n : n;
        memcpy(o->buf + o->n, p, k);
        o->n += k;
        p += k;
        n -= k;
        if (o->n == IO_BUF)
            out_flush(o);
    }
}

static void out_i32(struct io *o, int32_t v)
{
    out_put(o, &v, 4);
}

/* Read n payload bytes into dst (checksummed). A file that ends early, or
 * a read past the promised payload, is -EBADMSG. */
static void in_get(struct io *in, void *dst, size_t n)
{
    uint8_t *p = dst;
    if (!in->err && in->bytes + n > in->limit)
        in->err = -EBADMSG;
    while (n > 0 && !in->err) {
        if (in->at == in->n) {
            ssize_t r = read(in->fd, in->buf, IO_BUF);
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0) {
                in->err = r < 0 ? -errno : -EBADMSG;
                break;
            }
            in->n = (size_t)r;
            in->at = 0;
        }
        size_t k = in->n - in->at < n ? in->n - in->at : n;
        memcpy(p, in->buf + in->at, k);
        sum_add(&in->sum, p, k);
        in->bytes += k;
        in->at += k;
        p += k;
        n -= k;
    }
}

static int32_t in_i32(struct io *in)
{
    int32_t v = 0;
    in_get(in, &v, 4);
    return v;
}

/* KVD_FAULT_SPILL_STALL_MS: a write sleeps this long halfway through its
 * rows (for the test that kills the daemon mid-spill; the store logs it). */
static void fault_stall(void)
{
    const char *s = getenv("KVD_FAULT_SPILL_STALL_MS");
    long ms = s && *s ? strtol(s, NULL, 10) : 0;
    if (ms > 0) {
        struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
}

/* ------------------------------------------------------------------------
 * Writing
 * ------------------------------------------------------------------------ */

/* The payload, in the order spill.h gives. */
static void put_payload(struct io *o, kv_seq *seq)
{
    struct kv_layout l;
    kv_cache_layout(kv_seq_cache(seq), &l);
    const struct kv_policy *p = kv_seq_policy(seq);
    struct kv_seq_state st;
    kv_seq_get_state(seq, &st);
    int32_t shape[SHAPE_WORDS] = {l.n_layer, l.n_kv_head, l.head_dim, (int32_t)l.k_type,
                                  (int32_t)l.v_type, (int32_t)l.k_row_bytes,
                                  (int32_t)l.v_row_bytes};
    int32_t pol[POLICY_WORDS] = {(int32_t)p->kind,  p->max_cache_tokens, p->sink_tokens,
                                 p->window_tokens,  p->heavy_tokens,     p->observe_tokens,
                                 p->pool_tokens,    p->knorm_smallest,   p->renumber};
    int32_t misc[MISC_WORDS] = {st.next_pos, st.n_turns, st.turn_low, st.n_pins};
    out_put(o, shape, sizeof(shape));
    out_put(o, pol, sizeof(pol));
    out_put(o, misc, sizeof(misc));
    size_t n = (size_t)st.n_tokens;
    out_put(o, st.hist, sizeof(int32_t) * (size_t)st.n_hist);
    out_put(o, st.ids, sizeof(int32_t) * n);
    out_put(o, st.pos, sizeof(int32_t) * n);
    out_put(o, st.hidx, sizeof(int32_t) * n);
    out_put(o, st.mass, sizeof(float) * n);
    for (int t = 0; t < st.n_turns; t++) {
        out_i32(o, st.turns[t].hist_start);
        out_i32(o, st.turns[t].n_tokens);
        out_i32(o, st.turns[t].n_messages);
    }
    for (int k = 0; k < st.n_pins; k++) {
        out_i32(o, st.pins[k].start);
        out_i32(o, st.pins[k].end);
    }
    for (int layer = 0; layer < l.n_layer; layer++) {
        if (layer == l.n_layer / 2)
            fault_stall();
        for (int h = 0; h < l.n_kv_head; h++) {
            for (int i = 0; i < st.n_tokens; i++)
                out_put(o, kv_seq_k(seq, layer, h, i), l.k_row_bytes);
            for (int i = 0; i < st.n_tokens; i++)
                out_put(o, kv_seq_v(seq, layer, h, i), l.v_row_bytes);
        }
    }
}

static int sync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    int rc = fsync(fd) == 0 ? 0 : -errno;
    close(fd);
    return rc;
}

int spill_write(const char *dir, const char *path, const char *id, kv_seq *seq,
                uint64_t fingerprint, int64_t last_used_ms, uint64_t *bytes, char *err,
                size_t errlen)
{
    struct spill_head h = {.fingerprint = fingerprint, .last_used_ms = last_used_ms};
    size_t id_len = strlen(id);
    if (id_len < 1 || id_len > SPILL_ID_MAX) {
        snprintf(err, errlen, "a session id of %zu bytes does not fit a file header (max %d)",
                 id_len, SPILL_ID_MAX);
        return -ENAMETOOLONG;
    }
    if (kv_cache_window(kv_seq_cache(seq)) > 0) {
        snprintf(err, errlen, "the model has sliding-window layers, whose rows of tokens past "
                              "their window are gone: a file holds every layer's rows");
        return -EOPNOTSUPP;
    }
    memcpy(h.id, id, id_len + 1);
    h.n_hist = kv_seq_history(seq, NULL);
    h.n_tokens = kv_seq_n_tokens(seq);

    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp)) {
        snprintf(err, errlen, "path too long: %s", path);
        return -ENAMETOOLONG;
    }
    struct io o = {.fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)};
    if (o.fd < 0) {
        int rc = -errno;
        snprintf(err, errlen, "cannot create %s: %s", tmp, strerror(-rc));
        return rc;
    }
    o.buf = malloc(IO_BUF);
    if (!o.buf) {
        o.err = -ENOMEM;
        goto out_fail;
    }
    /* The header's place, then the payload (checksummed from here). */
    memset(o.buf, 0, SPILL_HEAD_BYTES);
    o.n = SPILL_HEAD_BYTES;
    sum_init(&o.sum);
    put_payload(&o, seq);
    out_flush(&o);
    if (o.err)
        goto out_fail;
    h.payload_bytes = o.bytes;
    h.payload_sum = sum_final(&o.sum);
    uint8_t head[SPILL_HEAD_BYTES];
    head_pack(&h, head);
    if (pwrite(o.fd, head, SPILL_HEAD_BYTES, 0) != SPILL_HEAD_BYTES) {
        o.err = errno ? -errno : -EIO;
        goto out_fail;
    }
    if (fsync(o.fd) != 0) {
        o.err = -errno;
        goto out_fail;
    }
    if (close(o.fd) != 0) {
        o.fd = -1;
        o.err = -errno;
        goto out_fail;
    }
    o.fd = -1;
    if (rename(tmp, path) != 0) {
        o.err = -errno;
        goto out_fail;
    }
    int rc = sync_dir(dir);
    if (rc) /* the file is whole; only its name may not survive a power cut */
        snprintf(err, errlen, "fsync of %s: %s", dir, strerror(-rc));
    if (bytes)
        *bytes = SPILL_HEAD_BYTES + h.payload_bytes;
    free(o.buf);
    return 0;

out_fail:
    snprintf(err, errlen, "cannot write %s: %s", tmp, strerror(-o.err));
    if (o.fd >= 0)
        close(o.fd);
    unlink(tmp);
    free(o.buf);
    return o.err;
}

/* ------------------------------------------------------------------------
 * Reading
 * ------------------------------------------------------------------------ */

/* Open path and read its header: the fd (>= 0), or a negative errno. */
static int open_head(const char *path, struct spill_head *h, char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int rc = -errno;
        snprintf(err, errlen, "%s: %s", path, strerror(-rc));
        return rc;
    }
    uint8_t b[SPILL_HEAD_BYTES];
    struct stat sb;
    ssize_t r = pread(fd, b, sizeof(b), 0);
    int rc = 0;
    if (r != (ssize_t)sizeof(b)) {
        snprintf(err, errlen, "%s: truncated (%zd bytes, no whole header)", path, r);
        rc = -EBADMSG;
    } else if ((rc = head_unpack(b, h, err, errlen)) != 0) {
        ;
    } else if (fstat(fd, &sb) != 0) {
        rc = -errno;
        snprintf(err, errlen, "%s: %s", path, strerror(-rc));
    } else if ((uint64_t)sb.st_size != SPILL_HEAD_BYTES + h->payload_bytes) {
        snprintf(err, errlen, "%s: truncated or extended (%lld bytes, the header says %" PRIu64 ")",
                 path, (long long)sb.st_size, SPILL_HEAD_BYTES + h->payload_bytes);
        rc = -EBADMSG;
    }
    if (rc) {
        close(fd);
        return rc;
    }
    return fd;
}

int spill_read_head(const char *path, struct spill_head *h, char *err, size_t errlen)
{
    int fd = open_head(path, h, err, errlen);
    if (fd < 0)
        return fd;
    close(fd);
    return 0;
}

/* The arrays of a payload, sized from the header. */
struct arrays {
    int32_t *hist, *ids, *pos, *hidx;
    float *mass;
    struct kv_turn *turns;
    struct kv_span pins[KV_MAX_PINS];
};

static void arrays_free(struct arrays *a)
{
    free(a->hist);
    free(a->ids);
    free(a->pos);
    free(a->hidx);
    free(a->mass);
    free(a->turns);
}

/* The shape and policy words, checked against the cache: 0, or -ESTALE
 * (another layout) / -EBADMSG with the reason in err. */
static int get_prologue(struct io *in, kv_seq *seq, int32_t pol[POLICY_WORDS],
                        int32_t misc[MISC_WORDS], char *err, size_t errlen)
{
    struct kv_layout l;
    kv_cache_layout(kv_seq_cache(seq), &l);
    int32_t want[SHAPE_WORDS] = {l.n_layer, l.n_kv_head, l.head_dim, (int32_t)l.k_type,
                                 (int32_t)l.v_type, (int32_t)l.k_row_bytes,
                                 (int32_t)l.v_row_bytes};
    int32_t shape[SHAPE_WORDS];
    in_get(in, shape, sizeof(shape));
    in_get(in, pol, sizeof(int32_t) * POLICY_WORDS);
    in_get(in, misc, sizeof(int32_t) * MISC_WORDS);
    if (in->err) {
        snprintf(err, errlen, "truncated payload");
        return -EBADMSG;
    }
    if (memcmp(shape, want, sizeof(want)) != 0) {
        snprintf(err, errlen,
                 "KV layout differs: the file has %d layers x %d KV heads x %d (%s/%s), the "
                 "cache %d x %d x %d (%s/%s)",
                 shape[0], shape[1], shape[2], kv_type_name((enum kv_type)shape[3]),
                 kv_type_name((enum kv_type)shape[4]), l.n_layer, l.n_kv_head, l.head_dim,
                 kv_type_name(l.k_type), kv_type_name(l.v_type));
        return -ESTALE;
    }
    return 0;
}

/* Read the arrays (n_turns and n_pins from misc) after checking that they
 * and the rows add up to the payload exactly. */
static int get_arrays(struct io *in, const struct spill_head *h, kv_seq *seq, int32_t n_turns,
                      int32_t n_pins, struct arrays *a, char *err, size_t errlen)
{
    struct kv_layout l;
    kv_cache_layout(kv_seq_cache(seq), &l);
    uint64_t nt = (uint64_t)h->n_tokens, nh = (uint64_t)h->n_hist;
    uint64_t want = 4ull * (SHAPE_WORDS + POLICY_WORDS + MISC_WORDS) + 4 * nh + 16 * nt;
    if (n_turns < 0 || (uint64_t)n_turns > nh) {
        snprintf(err, errlen, "%d turns in a history of %" PRIu64, n_turns, nh);
        return -EBADMSG;
    }
    if (n_pins < 0 || n_pins > KV_MAX_PINS) {
        snprintf(err, errlen, "%d pinned spans (at most %d)", n_pins, KV_MAX_PINS);
        return -EBADMSG;
    }
    want += 12ull * (uint64_t)n_turns + 8ull * (uint64_t)n_pins;
    want += nt * (uint64_t)l.n_layer * (uint64_t)l.n_kv_head * (l.k_row_bytes + l.v_row_bytes);
    if (want != h->payload_bytes) {
        snprintf(err, errlen, "payload of %" PRIu64 " bytes, its counts make %" PRIu64,
                 h->payload_bytes, want);
        return -EBADMSG;
    }
    a->hist = malloc(4 * nh + 4);
    a->ids = malloc(4 * nt + 4);
    a->pos = malloc(4 * nt + 4);
    a->hidx = malloc(4 * nt + 4);
    a->mass = malloc(4 * nt + 4);
    a->turns = malloc(sizeof(struct kv_turn) * ((size_t)n_turns + 1));
    if (!a->hist || !a->ids || !a->pos || !a->hidx || !a->mass || !a->turns) {
        snprintf(err, errlen, "out of memory for a session of %" PRIu64 " tokens", nh);
        return -ENOMEM;
    }
    in_get(in, a->hist, 4 * nh);
    in_get(in, a->ids, 4 * nt);
    in_get(in, a->pos, 4 * nt);
    in_get(in, a->hidx, 4 * nt);
    in_get(in, a->mass, 4 * nt);
    for (int t = 0; t < n_turns; t++) {
        a->turns[t].hist_start = in_i32(in);
        a->turns[t].n_tokens = in_i32(in);
        a->turns[t].n_messages = in_i32(in);
    }
    for (int k = 0; k < n_pins; k++) {
        a->pins[k].start = in_i32(in);
        a->pins[k].end = in_i32(in);
    }
    if (in->err) {
        snprintf(err, errlen, "truncated payload");
        return -EBADMSG;
    }
    return 0;
}

static void get_rows(struct io *in, kv_seq *seq)
{
    struct kv_layout l;
    kv_cache_layout(kv_seq_cache(seq), &l);
    int n = kv_seq_n_tokens(seq);
    for (int layer = 0; layer < l.n_layer; layer++)
        for (int h = 0; h < l.n_kv_head; h++) {
            for (int i = 0; i < n; i++)
                in_get(in, kv_seq_k(seq, layer, h, i), l.k_row_bytes);
            for (int i = 0; i < n; i++)
                in_get(in, kv_seq_v(seq, layer, h, i), l.v_row_bytes);
        }
}

int spill_read(const char *path, const char *id, uint64_t fingerprint, kv_seq *seq,
               struct spill_head *hout, char *err, size_t errlen)
{
    struct spill_head h;
    int fd = open_head(path, &h, err, errlen);
    if (fd < 0)
        return fd;
    struct io in = {.fd = fd, .limit = h.payload_bytes};
    struct arrays a = {0};
    int32_t pol[POLICY_WORDS], misc[MISC_WORDS];
    int rc;
    if (strcmp(h.id, id) != 0) {
        snprintf(err, errlen, "%s holds session '%s', not '%s'", path, h.id, id);
        rc = -ESTALE;
        goto out;
    }
    if (h.fingerprint != fingerprint) {
        snprintf(err, errlen,
                 "%s was written for another model or KV type (fingerprint %016" PRIx64
                 ", this one %016" PRIx64 ")",
                 path, h.fingerprint, fingerprint);
        rc = -ESTALE;
        goto out;
    }
    in.buf = malloc(IO_BUF);
    if (!in.buf) {
        snprintf(err, errlen, "out of memory");
        rc = -ENOMEM;
        goto out;
    }
    if (lseek(fd, SPILL_HEAD_BYTES, SEEK_SET) < 0) {
        rc = -errno;
        snprintf(err, errlen, "%s: %s", path, strerror(-rc));
        goto out;
    }
    sum_init(&in.sum);
    if ((rc = get_prologue(&in, seq, pol, misc, err, errlen)) != 0 ||
        (rc = get_arrays(&in, &h, seq, misc[1], misc[3], &a, err, errlen)) != 0)
        goto out;
    /* Scores of knorm (key norms) and of the others (attention mass) do not
     * mix: moving between them starts afresh, as kv_seq_set_policy does. */
    bool knorm_was = pol[0] == KV_EVICT_KNORM;
    if (knorm_was != (kv_seq_policy(seq)->kind == KV_EVICT_KNORM))
        memset(a.mass, 0, sizeof(float) * (size_t)h.n_tokens);
    struct kv_seq_state st = {.n_hist = h.n_hist,
                              .hist = a.hist,
                              .n_tokens = h.n_tokens,
                              .ids = a.ids,
                              .pos = a.pos,
                              .hidx = a.hidx,
                              .mass = a.mass,
                              .next_pos = misc[0],
                              .n_turns = misc[1],
                              .turns = a.turns,
                              .turn_low = misc[2],
                              .n_pins = misc[3],
                              .pins = a.pins};
    char why[256];
    rc = kv_seq_import(seq, &st, why, sizeof(why));
    if (rc) {
        snprintf(err, errlen, "%s: %s", path, why);
        /* a state the cache refuses is a bad file; pins the policy in
         * effect has no room for (a reload shrank it) are this config's */
        rc = rc == -EINVAL ? -EBADMSG : rc == -E2BIG ? -ESTALE : rc;
        goto out;
    }
    get_rows(&in, seq);
    if (in.err || in.bytes != h.payload_bytes || sum_final(&in.sum) != h.payload_sum) {
        snprintf(err, errlen, "%s: %s", path,
                 in.err ? "truncated payload" : "payload checksum mismatch (corrupted)");
        kv_seq_truncate(seq, 0);
        rc = -EBADMSG;
        goto out;
    }
    if (hout)
        *hout = h;
out:
    arrays_free(&a);
    free(in.buf);
    close(fd);
    return rc;
}
