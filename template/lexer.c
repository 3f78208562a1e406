/*
 * lexer.c - template source to tokens, with Jinja's whitespace rules.
 *
 * The source alternates data and tags: {{ expression }}, {% statement %}
 * and {# comment #}. Whitespace handling is entirely the lexer's, so the
 * parser and evaluator see data exactly as it will be printed:
 *
 *   - newlines are normalised to "\n", and one trailing newline of the
 *     whole source is dropped (Jinja's keep_trailing_newline = False);
 *   - "{%-", "{{-", "{#-" strip all whitespace before the tag, "-%}",
 *     "-}}", "-#}" all whitespace after it;
 *   - trim_blocks: the first newline after "%}" or "#}" is dropped
 *     ("+%}" keeps it);
 *   - lstrip_blocks: spaces and tabs from the start of a line up to "{%" or
 *     "{#" are dropped ("{%+" keeps them), as Jinja does: only when the
 *     tag is the first thing on its line.
 *
 * Inside a tag, "}}" closes the tag only outside brackets, so dict literals
 * such as {{ {'a': {'b': 1}} }} lex as Jinja lexes them. {% raw %} ...
 * {% endraw %} passes its body through as data.
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/template_internal.h"

struct lexer {
    const char *s; /* normalised source */
    size_t n;
    size_t pos;
    size_t *line_start; /* offsets of line starts, for line:column */
    size_t n_lines;
    struct arena *arena;
    struct token_list *out;
    struct tpl_error *err;
};

/* --- positions and errors --- */

static void where(const struct lexer *lx, size_t pos, int *line, int *col)
{
    size_t lo = 0, hi = lx->n_lines;
    while (hi - lo > 1) {
        size_t mid = (lo + hi) / 2;
        if (lx->line_start[mid] <= pos)
            lo = mid;
        else
            hi = mid;
    }
    *line = (int)lo + 1;
    *col = (int)(pos - lx->line_start[lo]) + 1;
}

static int lex_fail(struct lexer *lx, size_t pos, const char *msg)
{
    where(lx, pos, &lx->err->line, &lx->err->col);
    snprintf(lx->err->msg, sizeof lx->err->msg, "%s", msg);
    return -1;
}

static struct token *push(struct lexer *lx, enum tk_kind kind, size_t pos)
{
    struct token_list *l = lx->out;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 256;
        struct token *v = realloc(l->v, cap * sizeof *v);
        if (!v) {
            fprintf(stderr, "template: out of memory (%zu tokens)\n", cap);
            abort();
        }
        l->v = v;
        l->cap = cap;
    }
    struct token *t = &l->v[l->n++];
    memset(t, 0, sizeof *t);
    t->kind = kind;
    where(lx, pos, &t->line, &t->col);
    return t;
}

static bool is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

/* --- data --- */

/* Emit data s[a, b) after the rules: lstrip_next (the previous tag ended
 * with '-'), then the next tag's own rule on the text's end. */
static void emit_text(struct lexer *lx, size_t a, size_t b)
{
    if (b > a) {
        struct token *t = push(lx, TK_TEXT, a);
        t->s = tpl_arena_strndup(lx->arena, lx->s + a, b - a);
        t->len = b - a;
    }
}

/* Where the data before a tag at `tag` ends, given the tag's marker
 * character (the one after "{%", "{{" or "{#") and whether lstrip_blocks
 * applies to this tag kind. line_starting: the data starts a line. */
static size_t data_end(const struct lexer *lx, size_t a, size_t tag, char marker, bool lstrip,
                       bool line_starting)
{
    size_t b = tag;
    if (marker == '-') {
        while (b > a && is_ws(lx->s[b - 1]))
            b--;
        return b;
    }
    if (marker == '+' || !lstrip)
        return b;
    size_t l = b;
    while (l > a && lx->s[l - 1] != '\n')
        l--;
    if (l == a && !line_starting)
        return b;
    for (size_t i = l; i < b; i++)
        if (!is_ws(lx->s[i]))
            return b;
    return l;
}

/* --- inside a tag --- */

static int lex_string(struct lexer *lx)
{
    size_t start = lx->pos;
    char q = lx->s[lx->pos++];
    char *buf = malloc(lx->n - start + 1);
    if (!buf)
        abort();
    size_t n = 0;
    while (lx->pos < lx->n && lx->s[lx->pos] != q) {
        char c = lx->s[lx->pos++];
        if (c != '\\' || lx->pos >= lx->n) {
            buf[n++] = c;
            continue;
        }
        char e = lx->s[lx->pos++];
        unsigned long cp = 0;
        int hex = 0;
        switch (e) {
        case 'n': buf[n++] = '\n'; break;
        case 't': buf[n++] = '\t'; break;
        case 'r': buf[n++] = '\r'; break;
        case 'b': buf[n++] = '\b'; break;
        case 'f': buf[n++] = '\f'; break;
        case 'v': buf[n++] = '\v'; break;
        case 'a': buf[n++] = '\a'; break;
        case '\\': buf[n++] = '\\'; break;
        case '\'': buf[n++] = '\''; break;
        case '"': buf[n++] = '"'; break;
        case '\n': break; /* line continuation */
        case 'x': hex = 2; break;
        case 'u': hex = 4; break;
        case 'U': hex = 8; break;
        default:
            if (e >= '0' && e <= '7') {
                cp = (unsigned long)(e - '0');
                for (int k = 0; k < 2 && lx->pos < lx->n && lx->s[lx->pos] >= '0' &&
                                lx->s[lx->pos] <= '7';
                     k++)
                    cp = cp * 8 + (unsigned long)(lx->s[lx->pos++] - '0');
                hex = -1;
            } else {
                buf[n++] = '\\'; /* Python keeps unknown escapes */
                buf[n++] = e;
            }
        }
        if (hex > 0) {
            for (int k = 0; k < hex; k++) {
                char h = lx->pos < lx->n ? lx->s[lx->pos] : 0;
                if (!isxdigit((unsigned char)h)) {
                    free(buf);
                    return lex_fail(lx, start, "malformed \\x, \\u or \\U escape in a string");
                }
                cp = cp * 16 + (unsigned long)(isdigit((unsigned char)h) ? h - '0'
                                                                         : (tolower(h) - 'a' + 10));
                lx->pos++;
            }
        }
        if (hex != 0) {
            if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
                free(buf);
                return lex_fail(lx, start, "escape names no Unicode scalar value");
            }
            if (cp < 0x80) {
                buf[n++] = (char)cp;
            } else if (cp < 0x800) {
                buf[n++] = (char)(0xC0 | (cp >> 6));
                buf[n++] = (char)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                buf[n++] = (char)(0xE0 | (cp >> 12));
                buf[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                buf[n++] = (char)(0x80 | (cp & 0x3F));
            } else {
                buf[n++] = (char)(0xF0 | (cp >> 18));
                buf[n++] = (char)(0x80 | ((cp >> 12) & 0x3F));
                buf[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                buf[n++] = (char)(0x80 | (cp & 0x3F));
            }
        }
    }
    if (lx->pos >= lx->n) {
        free(buf);
        return lex_fail(lx, start, "unterminated string literal");
    }
    lx->pos++;
    struct token *t = push(lx, TK_STRING, start);
    t->s = tpl_arena_strndup(lx->arena, buf, n);
    t->len = n;
    free(buf);
    return 0;
}

static int lex_number(struct lexer *lx)
{
    size_t start = lx->pos;
    char digits[128];
    size_t k = 0;
    bool is_float = false;
    const char *s = lx->s;
    while (lx->pos < lx->n) {
        if (k + 2 >= sizeof digits) /* room for an exponent's two chars and the NUL */
            return lex_fail(lx, start, "number literal too long");
        char c = s[lx->pos];
        if (isdigit((unsigned char)c)) {
            digits[k++] = c;
        } else if (c == '_' && lx->pos + 1 < lx->n && isdigit((unsigned char)s[lx->pos + 1])) {
            /* digit separator */
        } else if (c == '.' && !is_float && lx->pos + 1 < lx->n &&
                   isdigit((unsigned char)s[lx->pos + 1])) {
            is_float = true;
            digits[k++] = c;
        } else if ((c == 'e' || c == 'E') && lx->pos + 1 < lx->n &&
                   (isdigit((unsigned char)s[lx->pos + 1]) ||
                    ((s[lx->pos + 1] == '-' || s[lx->pos + 1] == '+') && lx->pos + 2 < lx->n &&
                     isdigit((unsigned char)s[lx->pos + 2])))) {
            is_float = true;
            digits[k++] = c;
            digits[k++] = s[++lx->pos];
        } else {
            break;
        }
        lx->pos++;
    }
    digits[k] = 0;
    struct token *t = push(lx, is_float ? TK_FLOAT : TK_INT, start);
    char *end;
    if (is_float) {
        t->fval = strtod(digits, &end);
        if (!isfinite(t->fval)) /* JSON, the values' form, has no infinity */
            return lex_fail(lx, start, "float literal out of range");
    } else {
        errno = 0;
        t->ival = strtoll(digits, &end, 10);
        if (errno)
            return lex_fail(lx, start, "integer literal out of range");
    }
    return 0;
}

static int op_at(const char *s, size_t left, int *len)
{
    static const struct {
        const char *text;
        int op;
    } two[] = {{"==", OP_EQ}, {"!=", OP_NE}, {"<=", OP_LE},
               {">=", OP_GE}, {"//", OP_FLOORDIV}, {"**", OP_POW}};
    if (left >= 2)
        for (size_t i = 0; i < sizeof two / sizeof two[0]; i++)
            if (s[0] == two[i].text[0] && s[1] == two[i].text[1]) {
                *len = 2;
                return two[i].op;
            }
    if (strchr("+-*/%~<>=()[]{},.:|", s[0])) {
        *len = 1;
        return (unsigned char)s[0];
    }
    return 0;
}

/*
 * Lex the inside of a tag opened at lx->pos (after the opener and its
 * marker) up to its closer ("}}" for variables, "%}" for blocks). Sets
 * *strip_after when the closer had '-', *keep_nl when it had '+'.
 */
static int lex_tag(struct lexer *lx, bool is_var, size_t open_pos, bool *strip_after,
                   bool *keep_nl)
{
    int depth = 0;
    const char *s = lx->s;
    for (;;) {
        while (lx->pos < lx->n && is_ws(s[lx->pos]))
            lx->pos++;
        if (lx->pos >= lx->n)
            return lex_fail(lx, open_pos, is_var ? "unclosed '{{'" : "unclosed '{%'");
        size_t left = lx->n - lx->pos;
        const char *p = s + lx->pos;
        char closer = is_var ? '}' : '%';
        /* closers, with their whitespace markers */
        if (depth == 0) {
            if (left >= 3 && (p[0] == '-' || p[0] == '+') && p[1] == closer && p[2] == '}') {
                if (p[0] == '+' && is_var)
                    return lex_fail(lx, lx->pos, "'+}}' is not valid: '+' applies to blocks");
                *strip_after = p[0] == '-';
                *keep_nl = p[0] == '+';
                push(lx, is_var ? TK_VAR_END : TK_BLOCK_END, lx->pos);
                lx->pos += 3;
                return 0;
            }
            if (left >= 2 && p[0] == closer && p[1] == '}') {
                push(lx, is_var ? TK_VAR_END : TK_BLOCK_END, lx->pos);
                lx->pos += 2;
                return 0;
            }
        }
        unsigned char c = (unsigned char)p[0];
        if (isalpha(c) || c == '_') {
            size_t a = lx->pos;
            while (lx->pos < lx->n && (isalnum((unsigned char)s[lx->pos]) || s[lx->pos] == '_'))
                lx->pos++;
            struct token *t = push(lx, TK_NAME, a);
            t->s = tpl_arena_strndup(lx->arena, s + a, lx->pos - a);
            t->len = lx->pos - a;
        } else if (isdigit(c)) {
            if (lex_number(lx) < 0)
                return -1;
        } else if (c == '\'' || c == '"') {
            if (lex_string(lx) < 0)
                return -1;
        } else {
            int len = 0, op = op_at(p, left, &len);
            if (!op) {
                char msg[64];
                snprintf(msg, sizeof msg, "unexpected character '%c' in a tag",
                         isprint(c) ? c : '?');
                return lex_fail(lx, lx->pos, msg);
            }
            if (op == '(' || op == '[' || op == '{')
                depth++;
            else if ((op == ')' || op == ']' || op == '}') && depth > 0)
                depth--;
            struct token *t = push(lx, TK_OP, lx->pos);
            t->op = op;
            lx->pos += (size_t)len;
        }
    }
}

/* {% raw %}: if the block tag at lx->pos (after "{%" and marker) is "raw",
 * consume up to and including the matching endraw tag, emitting its body,
 * and return 1; 0 when it is another tag. */
static int try_raw(struct lexer *lx, size_t open_pos, bool *strip_after, bool *keep_nl)
{
    const char *s = lx->s;
    size_t p = lx->pos;
    while (p < lx->n && is_ws(s[p]))
        p++;
    if (lx->n - p < 3 || memcmp(s + p, "raw", 3) != 0 ||
        (p + 3 < lx->n && (isalnum((unsigned char)s[p + 3]) || s[p + 3] == '_')))
        return 0;
    p += 3;
    while (p < lx->n && is_ws(s[p]))
        p++;
    bool strip_start = false;
    if (p < lx->n && s[p] == '-') {
        strip_start = true;
        p++;
    }
    if (lx->n - p < 2 || s[p] != '%' || s[p + 1] != '}')
        return lex_fail(lx, open_pos, "malformed {% raw %} tag");
    p += 2;
    size_t body = p;
    if (strip_start)
        while (body < lx->n && is_ws(s[body]))
            body++;
    else if (body < lx->n && s[body] == '\n')
        body++; /* trim_blocks */
    for (size_t q = body; q + 1 < lx->n; q++) {
        if (s[q] != '{' || s[q + 1] != '%')
            continue;
        size_t r = q + 2;
        bool strip_before = r < lx->n && s[r] == '-';
        if (r < lx->n && (s[r] == '-' || s[r] == '+'))
            r++;
        while (r < lx->n && is_ws(s[r]))
            r++;
        if (lx->n - r < 6 || memcmp(s + r, "endraw", 6) != 0)
            continue;
        r += 6;
        while (r < lx->n && is_ws(s[r]))
            r++;
        *strip_after = r < lx->n && s[r] == '-';
        *keep_nl = r < lx->n && s[r] == '+';
        if (*strip_after || *keep_nl)
            r++;
        if (lx->n - r < 2 || s[r] != '%' || s[r + 1] != '}')
            return lex_fail(lx, q, "malformed {% endraw %} tag");
        size_t end = q;
        if (strip_before)
            while (end > body && is_ws(s[end - 1]))
                end--;
        emit_text(lx, body, end);
        lx->pos = r + 2;
        return 1;
    }
    return lex_fail(lx, open_pos, "{% raw %} without {% endraw %}");
}

/* --- driver --- */

/* Newlines to "\n"; one trailing newline dropped. New buffer. */
static char *normalise(const char *src, size_t len, size_t *out_len)
{
    char *d = malloc(len + 1);
    if (!d)
        abort();
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            d[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n')
                i++;
        } else {
            d[n++] = src[i];
        }
    }
    if (n > 0 && d[n - 1] == '\n')
        n--;
    d[n] = 0;
    *out_len = n;
    return d;
}

static int lex_all(struct lexer *lx)
{
    const char *s = lx->s;
    bool strip_next = false;   /* previous tag ended with '-' */
    bool line_starting = true; /* the data about to be read starts a line */
    for (;;) {
        size_t a = lx->pos;
        if (strip_next)
            while (a < lx->n && is_ws(s[a]))
                a++;
        size_t tag = a;
        while (tag + 1 < lx->n &&
               !(s[tag] == '{' && (s[tag + 1] == '{' || s[tag + 1] == '%' || s[tag + 1] == '#')))
            tag++;
        if (tag + 1 >= lx->n) {
            emit_text(lx, a, lx->n);
            push(lx, TK_EOF, lx->n);
            return 0;
        }
        char kind = s[tag + 1];
        char marker = tag + 2 < lx->n ? s[tag + 2] : 0;
        bool ls = a > lx->pos ? s[a - 1] == '\n' : line_starting;
        size_t end = data_end(lx, a, tag, marker, kind != '{', ls);
        emit_text(lx, a, end);
        lx->pos = tag + 2 + (marker == '-' || marker == '+');
        bool strip_after = false, keep_nl = false;
        if (kind == '#') {
            const char *close = NULL;
            for (size_t q = lx->pos; q + 1 < lx->n; q++)
                if (s[q] == '#' && s[q + 1] == '}') {
                    close = s + q;
                    break;
                }
            if (!close)
                return lex_fail(lx, tag, "unclosed comment '{#'");
            size_t q = (size_t)(close - s);
            strip_after = q > lx->pos && s[q - 1] == '-';
            keep_nl = q > lx->pos && s[q - 1] == '+';
            lx->pos = q + 2;
        } else {
            int raw = kind == '%' ? try_raw(lx, tag, &strip_after, &keep_nl) : 0;
            if (raw < 0)
                return -1;
            if (!raw) {
                push(lx, kind == '{' ? TK_VAR_BEGIN : TK_BLOCK_BEGIN, tag);
                if (lex_tag(lx, kind == '{', tag, &strip_after, &keep_nl) < 0)
                    return -1;
            }
        }
        /* trim_blocks: blocks and comments drop the newline after them */
        if (kind != '{' && !strip_after && !keep_nl && lx->pos < lx->n && s[lx->pos] == '\n')
            lx->pos++;
        strip_next = strip_after;
        line_starting = lx->pos > 0 && s[lx->pos - 1] == '\n';
    }
}

int tpl_lex(const char *src, size_t len, struct arena *a, struct token_list *out,
            struct tpl_error *err)
{
    struct lexer lx = {.arena = a, .out = out, .err = err};
    char *s = normalise(src, len, &lx.n);
    lx.s = s;
    size_t cap = 64;
    lx.line_start = malloc(cap * sizeof *lx.line_start);
    if (!lx.line_start)
        abort();
    lx.line_start[lx.n_lines++] = 0;
    for (size_t i = 0; i < lx.n; i++) {
        if (s[i] != '\n')
            continue;
        if (lx.n_lines == cap) {
            cap *= 2;
            size_t *v = realloc(lx.line_start, cap * sizeof *v);
            if (!v)
                abort();
            lx.line_start = v;
        }
        lx.line_start[lx.n_lines++] = i + 1;
    }
    int rc = lex_all(&lx);
    free(lx.line_start);
    free(s);
    return rc;
}
