/*
 * config.c - reading a configuration: the file and --set overrides applied
 * key by key through the table (keys.c), errors with their lines and
 * suggestions, then the cross-key rules (rules.c); and reload, which takes
 * the live keys of a new file over a running configuration.
 *
 * The file is read by libinih. Debian's libinih is built without
 * INI_HANDLER_LINENO, so the handler is not told the line number. We feed
 * inih through ini_parse_stream() with our own reader (read_line below):
 * it hands inih one physical line per call and counts them, and inih calls
 * the handler for a line before asking for the next one, so the count is
 * the line of the key being handled. The reader also sees every line first,
 * which is how lines inih would only count as "first error at line N" get
 * their own messages: lines without '=', unclosed or unknown section
 * headers, over-long lines. It strips leading whitespace, so inih never
 * treats an indented line as a continuation of the previous value.
 *
 * Every error is collected; nothing stops at the first.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ini.h>

#include "config/config.h"
#include "config/config_internal.h"

/* cfg_dump fits its lines to CFG_LINE_MAX: it must be what inih can read. */
_Static_assert(CFG_LINE_MAX + 2 <= INI_MAX_LINE, "CFG_LINE_MAX beyond inih's line buffer");

/* --- errors ----------------------------------------------------------------------- */

void cfg_errors_init(struct cfg_errors *errs)
{
    errs->count = 0;
    errs->dropped = 0;
}

static void copy_str(char *dst, size_t size, const char *src)
{
    cfg_fmt(dst, size, "%s", src ? src : "");
}

void cfg_add_error(struct cfg_errors *errs, const char *source, int line, const char *key,
                   const char *format, ...)
{
    if (errs->count >= CFG_MAX_ERRORS) {
        errs->dropped++;
        return;
    }
    struct cfg_error *e = &errs->list[errs->count++];
    copy_str(e->source, sizeof(e->source), source);
    e->line = line;
    copy_str(e->key, sizeof(e->key), key);
    va_list ap;
    va_start(ap, format);
    vsnprintf(e->message, sizeof(e->message), format, ap);
    va_end(ap);
}

int cfg_error_format(const struct cfg_error *e, char *buf, size_t len)
{
    if (e->line > 0)
        return cfg_fmt(buf, len, "%s:%d: %s", e->source, e->line, e->message);
    return cfg_fmt(buf, len, "%s: %s", e->source, e->message);
}

/* --- suggestions -------------------------------------------------------------------- */

/* Folded for comparison: case-insensitive, '-' and '_' alike. */
static int fold(int ch)
{
    if (ch == '-')
        return '_';
    return ch >= 'A' && ch <= 'Z' ? ch - 'A' + 'a' : ch;
}

/* Levenshtein distance of two short strings (inputs beyond 63 bytes: far). */
static int edit_distance(const char *a, const char *b)
{
    size_t n = strlen(a), m = strlen(b);
    if (n > 63 || m > 63)
        return 1000;
    int row[64];
    for (size_t j = 0; j <= m; j++)
        row[j] = (int)j;
    for (size_t i = 1; i <= n; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= m; j++) {
            int up = row[j];
            int cost = fold((unsigned char)a[i - 1]) != fold((unsigned char)b[j - 1]);
            int best = diag + cost;
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[m];
}

/* How far a misspelling may be from a name to be suggested. */
static int max_distance(const char *s)
{
    int n = (int)strlen(s) / 3;
    return n < 1 ? 1 : n > 3 ? 3 : n;
}

/*
 * The key closest to `name`: keys of `section` first, then a key of that
 * spelling in another section. Returns the key or -1 if nothing is close.
 */
static int suggest_key(const char *section, const char *name)
{
    int best = -1, best_score = 1 << 30, limit = max_distance(name);
    for (int k = 0; k < CFG_N_KEYS; k++) {
        int d = edit_distance(name, cfg_keys[k].name);
        if (d > limit)
            continue;
        int score = 2 * d + (strcmp(cfg_keys[k].section, section) ? 1 : 0);
        if (score < best_score) {
            best_score = score;
            best = k;
        }
    }
    return best;
}

static const char *suggest_section(const char *name)
{
    const char *best = NULL;
    int best_d = max_distance(name) + 1;
    for (size_t i = 0; i < CFG_N_SECTIONS; i++) {
        int d = edit_distance(name, cfg_sections[i]);
        if (d < best_d) {
            best_d = d;
            best = cfg_sections[i];
        }
    }
    return best;
}

/* --- applying one key = value ------------------------------------------------------------ */

/* State of one parse: a file, a string, or the command line. */
struct load_ctx {
    struct cfg *c;
    struct cfg_errors *errs;
    const char *source;   /* file name as given, or "command line" */
    bool cli;             /* --set: origins CFG_FROM_CMDLINE, suggestions as section.key */
    int line;             /* file: the line being handled */
    bool *failed;         /* [CFG_N_KEYS]: keys whose value was rejected; may be NULL */
    int seen[CFG_N_KEYS]; /* file: the line that set each key, 0 = not yet */

    /* The reader's position in the text (files and strings). */
    const char *text;
    size_t len, pos;
    bool bad_section; /* the current section header was rejected: skip its keys */
};

/* A value for an error message: secrets hidden, long values shortened. */
static void echo(const struct cfg_key_def *d, const char *value, char *buf, size_t len)
{
    if (d && d->secret)
        cfg_fmt(buf, len, "(hidden)");
    else if (strlen(value) > 60)
        cfg_fmt(buf, len, "%.57s...", value);
    else
        cfg_fmt(buf, len, "%s", value);
}

static void report_unknown_key(struct load_ctx *x, const char *section, const char *name)
{
    char key[96], hint[160] = "";
    cfg_fmt(key, sizeof(key), "%s.%s", section, name);
    int s = suggest_key(section, name);
    if (s >= 0 && (x->cli || strcmp(cfg_keys[s].section, section)))
        cfg_fmt(hint, sizeof(hint), x->cli ? "; did you mean %s.%s?" : "; did you mean [%s] %s?",
                cfg_keys[s].section, cfg_keys[s].name);
    else if (s >= 0)
        cfg_fmt(hint, sizeof(hint), "; did you mean %s?", cfg_keys[s].name);
    else {
        /* Nothing close: list the section's keys. */
        int n = cfg_fmt(hint, sizeof(hint), " (keys in [%s]:", section);
        bool first = true;
        for (int k = 0; k < CFG_N_KEYS && n < (int)sizeof(hint); k++) {
            if (strcmp(cfg_keys[k].section, section))
                continue;
            n += cfg_fmt(hint + n, sizeof(hint) - (size_t)n, "%s %s", first ? "" : ",",
                         cfg_keys[k].name);
            first = false;
        }
        if (n < (int)sizeof(hint))
            cfg_fmt(hint + n, sizeof(hint) - (size_t)n, ")");
    }
    if (!*section)
        cfg_add_error(x->errs, x->source, x->line, key, "%s: key outside any section%s", name,
                      s >= 0 ? hint : "");
    else
        cfg_add_error(x->errs, x->source, x->line, key, "[%s] %s: unknown key%s", section, name,
                      hint);
}

static void report_unknown_section(struct load_ctx *x, const char *section)
{
    const char *s = suggest_section(section);
    char hint[128];
    if (s)
        cfg_fmt(hint, sizeof(hint), "; did you mean %s%s%s?", x->cli ? "" : "[", s,
                x->cli ? "" : "]");
    else
        cfg_fmt(hint, sizeof(hint),
                " (sections: server, model, cache, eviction, limits, auth, log)");
    char key[96];
    cfg_fmt(key, sizeof(key), "[%s]", section);
    cfg_add_error(x->errs, x->source, x->line, key, "[%s]: unknown section%s", section, hint);
}

/* Set one key from text: the common path of the file and of --set. */
static int apply(struct load_ctx *x, const char *section, const char *name, const char *value)
{
    int k = cfg_key_find(section, name);
    if (k < 0) {
        if (*section && !cfg_section_known(section))
            report_unknown_section(x, section);
        else
            report_unknown_key(x, section, name);
        return -EINVAL;
    }
    const struct cfg_key_def *d = &cfg_keys[k];
    char key[96], shown[80], why[320];
    cfg_fmt(key, sizeof(key), "%s.%s", d->section, d->name);
    echo(d, value, shown, sizeof(shown));
    if (!x->cli && x->seen[k]) {
        cfg_add_error(x->errs, x->source, x->line, key,
                      "[%s] %s = %s: duplicate key, first set on line %d", d->section, d->name,
                      shown, x->seen[k]);
        return -EINVAL;
    }
    if (!x->cli)
        x->seen[k] = x->line;
    if (cfg_key_parse(k, value, x->c, why, sizeof(why))) {
        cfg_add_error(x->errs, x->source, x->line, key, "[%s] %s = %s: %s", d->section, d->name,
                      shown, why);
        if (x->failed)
            x->failed[k] = true;
        return -EINVAL;
    }
    if (x->failed)
        x->failed[k] = false;
    x->c->origin[k] = x->cli ? (struct cfg_origin){CFG_FROM_CMDLINE, 0}
                             : (struct cfg_origin){CFG_FROM_FILE, x->line};
    return 0;
}

/* --- reading INI text through libinih ------------------------------------------------------ */

static bool is_space(char ch)
{
    return ch == ' ' || ch == '\t' || ch == '\r' || ch == '\f' || ch == '\v';
}

/*
 * Where inih would end a key: at the first of '=' or ':', or at an inline
 * comment (';' after whitespace). Mirrors inih's find_chars_or_comment().
 */
static size_t key_end(const char *t, size_t n)
{
    bool was_space = false;
    for (size_t i = 0; i < n; i++) {
        if (t[i] == '=' || t[i] == ':' || (was_space && t[i] == ';'))
            return i;
        was_space = is_space(t[i]);
    }
    return n;
}

/*
 * The ini_reader: hands inih the next physical line, normalised, and counts
 * lines in x->line. Lines that inih would reject or misread are reported
 * here with their own message and handed over as blank lines; comments are
 * blanked too. Section headers are checked here (inih has no hook for
 * them) and passed on as "[name]".
 */
static char *read_line(char *str, int num, void *stream)
{
    struct load_ctx *x = stream;
    if (x->pos >= x->len)
        return NULL;
    const char *t = x->text + x->pos;
    const char *nl = memchr(t, '\n', x->len - x->pos);
    size_t n = nl ? (size_t)(nl - t) : x->len - x->pos;
    x->pos += n + (nl ? 1 : 0);
    x->line++;

    if (x->line == 1 && n >= 3 && !memcmp(t, "\xEF\xBB\xBF", 3)) { /* UTF-8 byte order mark */
        t += 3;
        n -= 3;
    }
    while (n && is_space(*t))
        t++, n--;
    while (n && is_space(t[n - 1]))
        n--;

    cfg_fmt(str, (size_t)num, "\n");
    if (n == 0 || *t == '#' || *t == ';')
        return str;
    if (memchr(t, '\0', n)) {
        cfg_add_error(x->errs, x->source, x->line, "", "line contains a NUL byte");
        return str;
    }
    if (n > CFG_LINE_MAX || n + 2 > (size_t)num) {
        cfg_add_error(x->errs, x->source, x->line, "", "line longer than %d characters",
                      CFG_LINE_MAX);
        return str;
    }
    if (*t == '[') {
        const char *close = memchr(t, ']', n);
        x->bad_section = true;
        if (!close) {
            cfg_add_error(x->errs, x->source, x->line, "", "section header without a closing ']'");
            return str;
        }
        const char *rest = close + 1, *end = t + n;
        while (rest < end && is_space(*rest))
            rest++;
        if (rest < end && *rest != ';' && *rest != '#') {
            cfg_add_error(x->errs, x->source, x->line, "", "text after the section header: '%.*s'",
                          (int)(end - rest), rest);
            return str;
        }
        /* The name, trimmed. */
        const char *a = t + 1, *b = close;
        while (a < b && is_space(*a))
            a++;
        while (b > a && is_space(b[-1]))
            b--;
        char name[64];
        cfg_fmt(name, sizeof(name), "%.*s", (int)(b - a), a);
        if (!cfg_section_known(name)) {
            report_unknown_section(x, name);
            return str;
        }
        x->bad_section = false;
        cfg_fmt(str, (size_t)num, "[%s]\n", name);
        return str;
    }
    size_t e = key_end(t, n);
    if (e == n || t[e] != '=') {
        cfg_add_error(x->errs, x->source, x->line, "", "not a 'key = value' line: '%.*s'",
                      n > 60 ? 60 : (int)n, t);
        return str;
    }
    if (e == 0 || is_space(*t)) {
        cfg_add_error(x->errs, x->source, x->line, "", "missing key before '='");
        return str;
    }
    cfg_fmt(str, (size_t)num, "%.*s\n", (int)n, t);
    return str;
}

/* The ini_handler: one key = value of the line x->line. */
static int on_pair(void *user, const char *section, const char *name, const char *value)
{
    struct load_ctx *x = user;
    if (!x->bad_section)
        apply(x, section, name, value);
    return 1; /* keep going: errors are ours to collect, not inih's */
}

static bool has_error_at(const struct cfg_errors *errs, int first, int line)
{
    for (int i = first; i < errs->count; i++)
        if (errs->list[i].line == line)
            return true;
    return errs->dropped > 0;
}

/* Parse INI text of len bytes as the file `name`. */
static int parse_text(struct cfg *c, const char *text, size_t len, const char *name,
                      struct cfg_errors *errs, bool *failed)
{
    struct load_ctx *x = calloc(1, sizeof(*x));
    if (!x) {
        cfg_add_error(errs, name, 0, "", "out of memory");
        return -ENOMEM;
    }
    *x = (struct load_ctx){
        .c = c, .errs = errs, .source = name, .failed = failed, .text = text, .len = len};
    copy_str(c->file, sizeof(c->file), name);
    int before = errs->count + errs->dropped, first = errs->count;
    int rc = ini_parse_stream(read_line, x, on_pair, x);
    if (rc == -2)
        cfg_add_error(errs, name, 0, "", "out of memory while parsing");
    else if (rc > 0 && !has_error_at(errs, first, rc))
        cfg_add_error(errs, name, rc, "", "malformed line");
    free(x);
    return errs->count + errs->dropped > before ? -EINVAL : 0;
}

int cfg_load_string(struct cfg *c, const char *text, const char *name, struct cfg_errors *errs)
{
    return parse_text(c, text, strlen(text), name, errs, NULL);
}

#define FILE_MAX (1 << 20)

/* Read the file whole (at most FILE_MAX bytes). 0 or -errno, reported. */
static int read_file(const char *path, char **text, size_t *len, struct cfg_errors *errs)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        int err = errno ? errno : EIO;
        cfg_add_error(errs, path, 0, "", "cannot open: %s", strerror(err));
        return -err;
    }
    char *buf = malloc(FILE_MAX + 1);
    if (!buf) {
        fclose(f);
        cfg_add_error(errs, path, 0, "", "out of memory");
        return -ENOMEM;
    }
    size_t n = fread(buf, 1, FILE_MAX + 1, f);
    int err = ferror(f) ? (errno ? errno : EIO) : 0;
    fclose(f);
    if (err) {
        free(buf);
        cfg_add_error(errs, path, 0, "", "cannot read: %s", strerror(err));
        return -err;
    }
    if (n > FILE_MAX) {
        free(buf);
        cfg_add_error(errs, path, 0, "", "larger than %d bytes; not a config file?", FILE_MAX);
        return -EFBIG;
    }
    *text = buf;
    *len = n;
    return 0;
}

static int load_file(struct cfg *c, const char *path, struct cfg_errors *errs, bool *failed)
{
    char *text = NULL;
    size_t len = 0;
    int rc = read_file(path, &text, &len, errs);
    if (rc)
        return rc;
    rc = parse_text(c, text, len, path, errs, failed);
    free(text);
    return rc;
}

int cfg_load_file(struct cfg *c, const char *path, struct cfg_errors *errs)
{
    return load_file(c, path, errs, NULL);
}

/* --- command-line overrides ------------------------------------------------------------- */

/* Copy s[0..n) trimmed into buf. */
static void trimmed(char *buf, size_t size, const char *s, size_t n)
{
    while (n && is_space(*s))
        s++, n--;
    while (n && is_space(s[n - 1]))
        n--;
    cfg_fmt(buf, size, "%.*s", (int)n, s);
}

static int set_one(struct cfg *c, const char *assignment, struct cfg_errors *errs, bool *failed)
{
    struct load_ctx x = {
        .c = c, .errs = errs, .source = "command line", .cli = true, .failed = failed};
    const char *eq = strchr(assignment, '=');
    char key[128], section[64], value[CFG_PATH_MAX];
    if (!eq) {
        cfg_add_error(errs, x.source, 0, "", "--set %s: expected section.key=value", assignment);
        return -EINVAL;
    }
    trimmed(key, sizeof(key), assignment, (size_t)(eq - assignment));
    trimmed(value, sizeof(value), eq + 1, strlen(eq + 1));
    if (strlen(eq + 1) >= sizeof(value)) {
        cfg_add_error(errs, x.source, 0, key, "--set %s: value longer than %zu bytes", key,
                      sizeof(value) - 1);
        return -EINVAL;
    }
    const char *dot = strchr(key, '.');
    if (!dot) {
        /* No section: find the key anywhere to suggest section.key. */
        int s = suggest_key("", key);
        if (s >= 0)
            cfg_add_error(errs, x.source, 0, key, "--set %s: missing section; did you mean %s.%s?",
                          key, cfg_keys[s].section, cfg_keys[s].name);
        else
            cfg_add_error(errs, x.source, 0, key, "--set %s: expected section.key=value", key);
        return -EINVAL;
    }
    cfg_fmt(section, sizeof(section), "%.*s", (int)(dot - key), key);
    return apply(&x, section, dot + 1, value);
}

int cfg_set(struct cfg *c, const char *assignment, struct cfg_errors *errs)
{
    return set_one(c, assignment, errs, NULL);
}

int cfg_load(struct cfg *c, const char *path, const char *const *sets, int n_sets,
             struct cfg_errors *errs)
{
    bool failed[CFG_N_KEYS] = {false};
    int before = errs->count + errs->dropped;
    cfg_defaults(c);
    if (path)
        load_file(c, path, errs, failed);
    for (int i = 0; i < n_sets; i++)
        set_one(c, sets[i], errs, failed);
    cfg_validate_failed(c, errs, failed);
    return errs->count + errs->dropped > before ? -EINVAL : 0;
}

/* --- reload ---------------------------------------------------------------------------- */

void cfg_reload_diff(const struct cfg *old, const struct cfg *new_cfg, struct cfg_diff *diff)
{
    diff->n_live = diff->n_restart = 0;
    for (int k = 0; k < CFG_N_KEYS; k++) {
        if (cfg_value_equal(old, new_cfg, (enum cfg_key)k))
            continue;
        if (cfg_keys[k].live)
            diff->live[diff->n_live++] = (enum cfg_key)k;
        else
            diff->restart[diff->n_restart++] = (enum cfg_key)k;
    }
}

int cfg_reload(const struct cfg *running, const struct cfg *loaded, struct cfg *next,
               struct cfg_diff *diff, struct cfg_errors *errs)
{
    cfg_reload_diff(running, loaded, diff);
    *next = *running;
    copy_str(next->file, sizeof(next->file), loaded->file);
    for (int k = 0; k < CFG_N_KEYS; k++) {
        if (!cfg_keys[k].live)
            continue;
        memcpy(cfg_field(next, k), cfg_cfield(loaded, k), cfg_keys[k].size);
        next->origin[k] = loaded->origin[k];
    }
    return cfg_validate(next, errs);
}
