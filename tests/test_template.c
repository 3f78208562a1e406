/*
 * test_template.c - the chat-template interpreter: real model templates
 * against their known renderings, the Jinja semantics they rely on, every
 * error path, and the limits that keep hostile templates off the stack.
 *
 * Rendering cases are data: tests/cases/templates/render/NAME.json names a
 * template in models/, a conversation in conversations/, the BOS and EOS
 * texts and the clock, and NAME.expect holds the exact rendering (as
 * Hugging Face's apply_chat_template produces it, with the system-role
 * fallback described in template.h). Error cases are data too:
 * tests/cases/templates/errors/NAME.jinja with NAME.expect, the exact
 * error ("load: L:C: message" or "render: L:C: message"), rendered with
 * the basic conversation.
 */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include <cmocka.h>

#include "template/template.h"

#define CASES "tests/cases/templates"

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = 0;
    fclose(f);
    if (len)
        *len = (size_t)n;
    return buf;
}

static json_t *load_json(const char *path)
{
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j)
        fail_msg("%s:%d: %s", path, je.line, je.text);
    return j;
}

/* Render src as a chat template with ctx-like settings; returns the
 * output (new) or NULL with the error in err. */
static char *chat(const char *src, const json_t *messages, const json_t *tools, const char *bos,
                  const char *eos, bool agp, bool strip_bos, time_t now, struct tpl_error *err)
{
    struct tpl_chat_params p = {.bos_token = bos, .eos_token = eos, .strip_bos = strip_bos};
    tpl_chat *c = tpl_chat_create(src, strlen(src), &p, err);
    if (!c)
        return NULL;
    char *out = NULL;
    size_t n;
    if (tpl_chat_render(c, messages, tools, agp, now, &out, &n, err) < 0)
        out = NULL;
    tpl_chat_destroy(c);
    return out;
}

/* Plain render of src with ctx given as JSON text. */
static char *render(const char *src, const char *ctx_json, struct tpl_error *err)
{
    json_t *ctx = ctx_json ? json_loads(ctx_json, 0, NULL) : NULL;
    if (ctx_json)
        assert_non_null(ctx);
    char *out = NULL;
    size_t n;
    if (tpl_render_source(src, strlen(src), ctx, &out, &n, err) < 0)
        out = NULL;
    json_decref(ctx);
    return out;
}

static void expect_render(const char *src, const char *ctx, const char *want)
{
    struct tpl_error err;
    char *out = render(src, ctx, &err);
    char buf[400];
    if (!out)
        fail_msg("template %s: %s", src, tpl_error_string(&err, buf, sizeof buf));
    if (strcmp(out, want) != 0)
        fail_msg("template %s\n  want [%s]\n  got  [%s]", src, want, out);
    free(out);
}

static void expect_error(const char *src, const char *ctx, const char *want)
{
    struct tpl_error err;
    char *out = render(src, ctx, &err);
    char buf[400];
    if (out)
        fail_msg("template %s rendered [%s], want error %s", src, out, want);
    tpl_error_string(&err, buf, sizeof buf);
    if (!strstr(buf, want))
        fail_msg("template %s\n  want error containing [%s]\n  got [%s]", src, want, buf);
}

static int name_cmp(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Sorted names in dir ending in ext (new array of new strings). */
static char **list_dir(const char *dir, const char *ext, size_t *n)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    char **v = NULL;
    *n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t l = strlen(e->d_name), le = strlen(ext);
        if (l <= le || strcmp(e->d_name + l - le, ext) != 0)
            continue;
        v = realloc(v, (*n + 1) * sizeof *v);
        v[(*n)++] = strndup(e->d_name, l - le);
    }
    closedir(d);
    qsort(v, *n, sizeof *v, name_cmp);
    return v;
}

/* ------------------------------------------------------------------------
 * Real templates
 * ------------------------------------------------------------------------ */

static void test_model_templates(void **state)
{
    (void)state;
    size_t n;
    char **names = list_dir(CASES "/render", ".json", &n);
    json_t *models = json_object();
    int failures = 0;
    for (size_t i = 0; i < n; i++) {
        char path[512];
        snprintf(path, sizeof path, CASES "/render/%s.json", names[i]);
        json_t *c = load_json(path);
        const char *tname = json_string_value(json_object_get(c, "template"));
        snprintf(path, sizeof path, CASES "/models/%s", tname);
        char *src = slurp(path, NULL);
        assert_non_null(src);
        snprintf(path, sizeof path, CASES "/conversations/%s",
                 json_string_value(json_object_get(c, "messages")));
        json_t *msgs = load_json(path);
        json_t *tools = NULL;
        if (json_object_get(c, "tools")) {
            snprintf(path, sizeof path, CASES "/conversations/%s",
                     json_string_value(json_object_get(c, "tools")));
            tools = load_json(path);
        }
        snprintf(path, sizeof path, CASES "/render/%s.expect", names[i]);
        char *want = slurp(path, NULL);
        assert_non_null(want);
        struct tpl_error err;
        char *got = chat(src, msgs, tools, json_string_value(json_object_get(c, "bos_token")),
                         json_string_value(json_object_get(c, "eos_token")),
                         json_is_true(json_object_get(c, "add_generation_prompt")), false,
                         (time_t)json_integer_value(json_object_get(c, "now")), &err);
        char buf[400];
        if (!got) {
            print_error("%s: %s\n", names[i], tpl_error_string(&err, buf, sizeof buf));
            failures++;
        } else if (strcmp(got, want) != 0) {
            size_t k = 0;
            while (got[k] && got[k] == want[k])
                k++;
            print_error("%s: differs at byte %zu\n  want ...%.60s\n  got  ...%.60s\n", names[i], k,
                        want + k, got + k);
            failures++;
        }
        json_object_set_new(models, tname, json_true());
        free(got);
        free(want);
        free(src);
        json_decref(tools);
        json_decref(msgs);
        json_decref(c);
        free(names[i]);
    }
    free(names);
    print_message("%zu renderings of %zu model templates\n", n, json_object_size(models));
    assert_true(json_object_size(models) >= 25);
    json_decref(models);
    assert_int_equal(failures, 0);
}

/* A chat template of tests/cases/templates/models with BOS <s>, EOS </s>. */
static tpl_chat *model_chat(const char *model)
{
    char path[256];
    snprintf(path, sizeof path, CASES "/models/%s.jinja", model);
    size_t len;
    char *src = slurp(path, &len);
    assert_non_null(src);
    struct tpl_chat_params p = {.bos_token = "<s>", .eos_token = "</s>"};
    struct tpl_error err;
    tpl_chat *c = tpl_chat_create(src, len, &p, &err);
    free(src);
    assert_non_null(c);
    return c;
}

/* The probe finds the templates without a system role, whatever their
 * name: these raise on it, or never print it. */
static void test_system_probe(void **state)
{
    (void)state;
    static const struct {
        const char *model;
        bool system;
    } cases[] = {{"gemma", false},        {"mistral-v0.2", false}, {"orion", false},
                 {"phi-3-mini", false},   {"chatml-openhermes", true},
                 {"llama-3.2", true},     {"qwen3", true},         {"mistral-v7", true}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tpl_chat *c = model_chat(cases[i].model);
        if (tpl_chat_supports_system(c) != cases[i].system)
            fail_msg("%s: supports_system should be %d", cases[i].model, cases[i].system);
        tpl_chat_destroy(c);
    }
}

/* The end-of-turn marker, found by rendering an assistant turn. */
static void test_end_of_turn(void **state)
{
    (void)state;
    static const struct {
        const char *model, *eot;
    } cases[] = {{"chatml-openhermes", "<|im_end|>"}, {"llama-3", "<|eot_id|>"},
                 {"gemma", "<end_of_turn>"},          {"phi-3-small", "<|end|>"},
                 {"mistral-v7", "</s>"},              {"deepseek-coder", "<|EOT|>"},
                 {"zephyr", "</s>"},                  {"command-r-plus", "<|END_OF_TURN_TOKEN|>"},
                 {"openchat", "<|end_of_turn|>"},     {"qwen1.5", "<|im_end|>"},
                 {"llama-2", "</s>"},                 {"qwen3", "<|im_end|>"},
                 {"solar", ""}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tpl_chat *c = model_chat(cases[i].model);
        if (strcmp(tpl_chat_end_of_turn(c), cases[i].eot) != 0)
            fail_msg("%s: end of turn [%s], want [%s]", cases[i].model, tpl_chat_end_of_turn(c),
                     cases[i].eot);
        tpl_chat_destroy(c);
    }
}

static void test_bos_strip(void **state)
{
    (void)state;
    const char *src = "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}";
    json_t *msgs = json_loads("[{\"role\":\"user\",\"content\":\"hi\"}]", 0, NULL);
    struct tpl_error err;
    char *a = chat(src, msgs, NULL, "<s>", "</s>", true, false, 0, &err);
    char *b = chat(src, msgs, NULL, "<s>", "</s>", true, true, 0, &err);
    assert_string_equal(a, "<s>[hi]");
    assert_string_equal(b, "[hi]");
    free(a);
    free(b);
    /* only a leading BOS goes */
    char *c = chat("x{{ bos_token }}", msgs, NULL, "<s>", "", true, true, 0, &err);
    assert_string_equal(c, "x<s>");
    free(c);
    json_decref(msgs);
}

static void test_default_chatml(void **state)
{
    (void)state;
    json_t *msgs = json_loads("[{\"role\":\"system\",\"content\":\"S\"},"
                              "{\"role\":\"user\",\"content\":\"U\"},"
                              "{\"role\":\"assistant\",\"content\":null}]",
                              0, NULL);
    struct tpl_error err;
    char *out = chat(tpl_chatml_source, msgs, NULL, "", "", true, false, 0, &err);
    assert_non_null(out);
    assert_string_equal(out, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                             "<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    json_decref(msgs);
}

static void test_chat_input_errors(void **state)
{
    (void)state;
    struct tpl_error err;
    static const struct {
        const char *messages;
        const char *want;
    } cases[] = {
        {"{\"role\":\"user\"}", "messages must be an array"},
        {"[{\"content\":\"x\"}]", "messages[0] must be an object with a string \"role\""},
        {"[{\"role\":\"user\",\"content\":5}]",
         "messages[0].content must be a string, null or an array of text parts"},
        {"[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]",
         "messages[0].content[0]: only parts"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        json_t *m = json_loads(cases[i].messages, 0, NULL);
        assert_non_null(m);
        char *out = chat(tpl_chatml_source, m, NULL, "", "", true, false, 0, &err);
        assert_null(out);
        if (!strstr(err.msg, cases[i].want))
            fail_msg("case %zu: got [%s]", i, err.msg);
        json_decref(m);
    }
    json_t *m = json_loads("[{\"role\":\"user\",\"content\":\"x\"}]", 0, NULL);
    json_t *tools = json_loads("{\"a\":1}", 0, NULL);
    struct tpl_chat_params p = {0};
    tpl_chat *c = tpl_chat_create(tpl_chatml_source, strlen(tpl_chatml_source), &p, &err);
    char *out;
    assert_int_equal(tpl_chat_render(c, m, tools, true, 0, &out, NULL, &err), -1);
    assert_string_equal(err.msg, "tools must be an array");
    tpl_chat_destroy(c);
    json_decref(tools);
    json_decref(m);
}

/* ------------------------------------------------------------------------
 * Jinja semantics
 * ------------------------------------------------------------------------ */

static void test_whitespace(void **state)
{
    (void)state;
    /* trim_blocks drops the newline after a block tag; lstrip_blocks the
     * indentation before one; neither applies to {{ }} */
    expect_render("{% if true %}\n  a\n  {% endif %}\n{{ 'b' }}\n c", NULL, "  a\nb\n c");
    expect_render("x  {%- if true -%}  y  {%- endif -%}  z", NULL, "xyz");
    expect_render("a\n  {{- 'b' -}}  \nc", NULL, "abc");
    /* {%+ keeps the indentation, +%} keeps the newline */
    expect_render("  {%+ if true %}a{% endif +%}\nb", NULL, "  a\nb");
    /* lstrip only when the tag starts its line */
    expect_render("a  {% if true %}b{% endif %}", NULL, "a  b");
    /* comments: removed, with the same rules */
    expect_render("a\n  {# note #}\nb{#- x -#}  c", NULL, "a\nbc");
    /* one trailing newline of the source is dropped, \r\n normalised */
    expect_render("a\r\nb\n", NULL, "a\nb");
    expect_render("{% raw %}{{ x }}{% endraw %}", NULL, "{{ x }}");
}

static void test_expressions(void **state)
{
    (void)state;
    expect_render("{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }}",
                  NULL, "7 3 -4 1 2 1024");
    expect_render("{{ 1 / 2 }} {{ 4 / 2 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1.5e-7 }}", NULL,
                  "0.5 2.0 0.30000000000000004 1e+20 1.5e-07");
    expect_render("{{ 'a' ~ 1 ~ none ~ true }} {{ 'ab' * 3 }}", NULL, "a1NoneTrue ababab");
    expect_render("{{ [1, 'a', none, true, {'k': [2.5]}] }}", NULL,
                  "[1, 'a', None, True, {'k': [2.5]}]");
    expect_render("{{ \"it's\" }} {{ [\"it's\"] }} {{ ['a\\nb'] }}", NULL,
                  "it's [\"it's\"] ['a\\nb']");
    expect_render("{{ 'x' if false }}|{{ 'y' if 0 else 'z' }}|{{ none or 'd' }}|{{ 1 and 2 }}", NULL,
                  "|z|d|2");
    expect_render("{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [3] }}",
                  NULL, "True True True False");
    expect_render("{{ 1 == 1.0 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ none == none }}", NULL,
                  "True True True True");
    expect_render("{{ 'h\\u00e9\\x41\\t' }}", NULL, "h\xc3\xa9" "A\t");
    expect_render("{{ 'ab' 'cd' }} {{ (1, 2) }} {{ () }}", NULL, "abcd [1, 2] []");
    /* slices count code points and follow Python's rules */
    expect_render("{{ 'h\xc3\xa9llo'[1:3] }} {{ [1,2,3,4][::-1] }} {{ [1,2,3,4][-2:] }} "
                  "{{ 'abcdef'[::2] }} {{ [1,2,3][5:] }} {{ 'abc'[-1] }}",
                  NULL, "\xc3\xa9l [4, 3, 2, 1] [3, 4] ace [] c");
    expect_render("{{ x.y }}|{{ x['y'] }}|{{ x.z is defined }}|{{ l[10] is defined }}",
                  "{\"x\":{\"y\":1},\"l\":[1]}", "1|1|False|False");
    expect_render("{{ d.items() | list }} {{ d.keys() | list }} {{ d.get('b', 9) }} {{ d.get('a') }}",
                  "{\"d\":{\"a\":1}}", "[['a', 1]] ['a'] 9 1");
}

static void test_statements(void **state)
{
    (void)state;
    expect_render("{% for x in [1,2,3] %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}"
                  "{{ loop.last }}{{ loop.length }}{{ loop.revindex }}|{% endfor %}",
                  NULL, "10TrueFalse33|21FalseFalse32|32FalseTrue31|");
    expect_render("{% for x in [1,2,3] %}{{ loop.previtem }}{{ loop.nextitem }}{{ loop.cycle('a','b') }}"
                  "{% endfor %}",
                  NULL, "2a13b2a");
    expect_render("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}", NULL,
                  "a=1;b=2;");
    expect_render("{% for x in [1,2,3,4] if x is even %}{{ x }}/{{ loop.length }} {% endfor %}", NULL,
                  "2/2 4/2 ");
    expect_render("{% for x in [] %}x{% else %}empty{% endfor %}", NULL, "empty");
    expect_render("{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}"
                  "{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}",
                  NULL, "013");
    expect_render("{% if 0 %}a{% elif '' %}b{% elif [1] %}c{% else %}d{% endif %}", NULL, "c");
    /* set inside a loop stays in the loop; namespaces carry state out */
    expect_render("{% set x = 1 %}{% set ns = namespace(n=0) %}{% for i in range(3) %}"
                  "{% set x = i %}{% set ns.n = ns.n + i %}{% endfor %}{{ x }} {{ ns.n }}",
                  NULL, "1 3");
    expect_render("{% set a, b = [1, 2] %}{{ b }}{{ a }}", NULL, "21");
    expect_render("{% set s %}in{{ 1 + 1 }}{% endset %}[{{ s }}]", NULL, "[in2]");
    expect_render("{% macro m(a, b='d') %}<{{ a }}{{ b }}>{% endmacro %}{{ m(1) }}{{ m(1, 2) }}"
                  "{{ m(b=3, a=4) }}",
                  NULL, "<1d><12><43>");
    expect_render("{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                  "{{ f(3) }}",
                  NULL, "321");
    expect_render("{% generation %}g{% endgeneration %}", NULL, "g");
    expect_render("{{ strftime_now('%d %b %Y') }}", NULL, "01 Jan 1970");
    expect_render("{% set d = dict(a=1, b='x') %}{{ d | tojson }}", NULL, "{\"a\": 1, \"b\": \"x\"}");
}

static void test_filters_and_methods(void **state)
{
    (void)state;
    expect_render("[{{ '  a b  ' | trim }}] [{{ 'xxaxx'.strip('x') }}] [{{ '  a '.lstrip() }}] "
                  "[{{ ' a  '.rstrip() }}]",
                  NULL, "[a b] [a] [a ] [ a]");
    expect_render("{{ 'aBc' | upper }} {{ 'aBc' | lower }} {{ 'hello wORLD' | title }} "
                  "{{ 'hello wORLD'.title() }} {{ 'aBC' | capitalize }}",
                  NULL, "ABC abc Hello World Hello World Abc");
    expect_render("{{ 'a,b,,c'.split(',') }} {{ '  a  b '.split() }} {{ 'a-b-c'.split('-', 1) }}",
                  NULL, "['a', 'b', '', 'c'] ['a', 'b'] ['a', 'b-c']");
    expect_render("{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'c')) }} "
                  "{{ 'aaa'.replace('a', 'b', 2) }} {{ 'aaa' | replace('a', 'xy') }} "
                  "{{ 'abc'.find('c') }} {{ '-'.join(['a', 'b']) }}",
                  NULL, "True True bba xyxyxy 2 a-b");
    expect_render("{{ [1, 2] | length }} {{ 'h\xc3\xa9' | length }} {{ {'a': 1} | count }} "
                  "{{ undefined_name | length }}",
                  NULL, "2 2 1 0");
    expect_render("{{ x | default('d') }} {{ '' | default('d') }} {{ '' | default('d', true) }} "
                  "{{ none | d('n', boolean=true) }}",
                  NULL, "d  d n");
    expect_render("{{ {'b': 1, 'a': [1, 2.5, none]} | tojson }}|{{ 'h\xc3\xa9\"\\n' | tojson }}", NULL,
                  "{\"b\": 1, \"a\": [1, 2.5, null]}|\"h\xc3\xa9\\\"\\n\"");
    expect_render("{{ {'a': [1], 'b': {}} | tojson(indent=2) }}", NULL,
                  "{\n  \"a\": [\n    1\n  ],\n  \"b\": {}\n}");
    expect_render("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}", NULL, "{\"a\": 2, \"b\": 1}");
    expect_render("{{ [1, 2, 3] | join(', ') }} {{ [{'n': 'a'}, {'n': 'b'}] | join('+', attribute='n') }}",
                  NULL, "1, 2, 3 a+b");
    expect_render("{{ {'a': 1} | items | list }} {{ {'b': 1, 'A': 2} | dictsort }}", NULL,
                  "[['a', 1]] [['A', 2], ['b', 1]]");
    expect_render("{{ [3, 1, 2] | sort }} {{ [3, 1, 2] | sort(reverse=true) }} {{ [1, 1, 2] | unique }} "
                  "{{ [1, 2] | reverse }} {{ [1, 2, 3] | first }} {{ [1, 2, 3] | last }}",
                  NULL, "[1, 2, 3] [3, 2, 1] [1, 2] [2, 1] 1 3");
    expect_render("{{ [1, 2, 3] | sum }} {{ [3, 1] | min }} {{ [3, 1] | max }} {{ -2 | abs }} "
                  "{{ 2.567 | round(1) }} {{ '42' | int }} {{ 'x' | int(7) }} {{ '1.5' | float }}",
                  NULL, "6 1 3 2 2.6 42 7 1.5");
    /* a string beyond the doubles is not a number: the default, as for 'x' */
    expect_render("{{ '1e999' | float }} {{ 'inf' | float(2.5) }}", NULL, "0.0 2.5");
    const char *people = "{\"p\":[{\"n\":\"a\",\"r\":\"u\"},{\"n\":\"b\",\"r\":\"s\"},{\"n\":\"c\"}]}";
    expect_render("{{ p | selectattr('r', 'equalto', 'u') | map(attribute='n') | list }} "
                  "{{ p | rejectattr('r') | map(attribute='n') | join }} "
                  "{{ p | selectattr('r', 'defined') | list | length }}",
                  people, "['a'] c 2");
    expect_render("{{ [1, 2, 3, 4] | select('odd') | list }} {{ [1, 0, 2] | reject | list }} "
                  "{{ ['a', 'B'] | map('upper') | list }}",
                  NULL, "[1, 3] [0] ['A', 'B']");
    expect_render("{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'x\\ny' | indent(2, true) }}", NULL,
                  "a\n  b\n\n  c|  x\n  y");
    expect_render("{{ '<a&b>' | e }} {{ 'x' | safe }} {{ 5 | string }} {{ {'a': 1} | attr('a') }}",
                  NULL, "&lt;a&amp;b&gt; x 5 1");
}

static void test_tests(void **state)
{
    (void)state;
    expect_render("{{ x is defined }} {{ y is undefined }} {{ none is none }} {{ 'a' is string }} "
                  "{{ {} is mapping }} {{ [] is iterable }} {{ 1 is number }} {{ 1.5 is float }} "
                  "{{ 1 is integer }} {{ true is boolean }} {{ false is false }} {{ 3 is odd }} "
                  "{{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 'AB' is upper }} {{ 'ab' is lower }}",
                  "{\"x\":1}", "True True True True True True True True True True True True True True True True");
    expect_render("{{ 1 is eq 1 }} {{ 1 is ne 2 }} {{ 1 is lt 2 }} {{ 2 is ge 2 }} {{ 'a' is in 'abc' }} "
                  "{{ x is not none }} {{ none is sameas none }} {{ range is callable }}",
                  "{\"x\":null}", "True True True True True False True True");
}

/* ------------------------------------------------------------------------
 * Errors and limits
 * ------------------------------------------------------------------------ */

static void test_error_cases(void **state)
{
    (void)state;
    size_t n;
    char **names = list_dir(CASES "/errors", ".jinja", &n);
    json_t *msgs = load_json(CASES "/conversations/basic.json");
    int failures = 0;
    for (size_t i = 0; i < n; i++) {
        char path[512];
        snprintf(path, sizeof path, CASES "/errors/%s.jinja", names[i]);
        char *src = slurp(path, NULL);
        snprintf(path, sizeof path, CASES "/errors/%s.expect", names[i]);
        char *want = slurp(path, NULL);
        assert_non_null(want);
        want[strcspn(want, "\n")] = 0;
        struct tpl_chat_params p = {.bos_token = "<s>", .eos_token = "</s>"};
        struct tpl_error err;
        char got[400], msg[320];
        tpl_chat *c = tpl_chat_create(src, strlen(src), &p, &err);
        char *out = NULL;
        if (!c) {
            snprintf(got, sizeof got, "load: %s", tpl_error_string(&err, msg, sizeof msg));
        } else if (tpl_chat_render(c, msgs, NULL, true, 0, &out, NULL, &err) < 0) {
            snprintf(got, sizeof got, "render: %s", tpl_error_string(&err, msg, sizeof msg));
        } else {
            snprintf(got, sizeof got, "rendered: %.80s", out);
        }
        if (strcmp(got, want) != 0) {
            print_error("%s:\n  want [%s]\n  got  [%s]\n", names[i], want, got);
            failures++;
        }
        free(out);
        tpl_chat_destroy(c);
        free(src);
        free(want);
        free(names[i]);
    }
    free(names);
    json_decref(msgs);
    print_message("%zu error cases\n", n);
    assert_true(n >= 20);
    assert_int_equal(failures, 0);
}

static void test_runtime_errors(void **state)
{
    (void)state;
    expect_error("{{ 1 + 'a' }}", NULL, "1:6: unsupported operand types for '+'");
    expect_error("{{ 1 // 0 }}", NULL, "division by zero");
    expect_error("{{ 9223372036854775807 + 1 }}", NULL, "integer overflow");
    expect_error("{{ x.y }}", NULL, "cannot read 'y' of an undefined value");
    expect_error("{{ x[0] }}", NULL, "cannot index 'x': it is undefined");
    expect_error("{{ 1 < 'a' }}", NULL, "cannot be ordered");
    expect_error("{% for x in 5 %}{% endfor %}", NULL, "a number is not iterable");
    expect_error("{% set x = 1 %}{% set x.y = 2 %}", NULL, "'x' is not a namespace");
    expect_error("{{ raise_exception('no ' ~ 'way') }}", NULL,
                 "1:4: template raised an exception: no way");
    expect_error("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", NULL, "macro 'm' takes 1 arguments");
    expect_error("{% macro m(a) %}{% endmacro %}{{ m(b=1) }}", NULL, "macro 'm' has no parameter 'b'");
    expect_error("{{ m() }}{% macro m() %}{% endmacro %}", NULL, "'m' is undefined, not a function");
    expect_error("{{ x | tojson }}", NULL, "tojson: an undefined value is not JSON data");
    expect_error("{{ [1][::0] }}", NULL, "slice step cannot be zero");
    expect_error("{{ 5 | length }}", NULL, "'length' needs a string, a list or a dict");
    expect_error("{{ 'a'.split('') }}", NULL, "split: empty separator");
    expect_error("{{ {1: 2} }}", NULL, "dict keys must be strings");
    expect_error("{{ 5 | trim }}", NULL, "'trim' needs a string");
    expect_error("{{ [1, 'a'] | sort }}", NULL, "cannot be ordered");
    expect_error("{{ range(1, 2, 0) }}", NULL, "range step cannot be zero");
    /* a long number (and one ending in an exponent at the buffer's edge) */
    char num[300] = "{{ ";
    memset(num + 3, '1', 200);
    strcpy(num + 203, " }}");
    expect_error(num, NULL, "1:4: number literal too long");
    memset(num + 3, '1', 125);
    strcpy(num + 128, "e+5 }}");
    expect_error(num, NULL, "number literal too long");
    /* a float literal beyond the doubles (it was a NULL constant and an abort) */
    expect_error("{{ messages[1e666666666] }}", NULL, "1:13: float literal out of range");
    expect_error("{{ 1.5e308 * 10 }}", NULL, "1:12: float result of '*' out of range");
    expect_error("{{ 10.0 ** 400 }}", NULL, "float result of '**' out of range");
    expect_error("{{ [1.5e308, 1.5e308] | sum }}", NULL, "float result of 'sum' out of range");
    /* the context must be an object */
    char *out;
    struct tpl_error err;
    json_t *arr = json_array();
    tpl_template *t = tpl_load("x", 1, NULL, &err);
    assert_int_equal(tpl_render(t, arr, 0, &out, NULL, &err), -1);
    assert_string_equal(err.msg, "the render context must be a JSON object");
    tpl_free(t);
    json_decref(arr);
}

static void test_limits(void **state)
{
    (void)state;
    struct tpl_error err;
    char *out;
    /* unbounded recursion ends at the depth limit, not the C stack */
    expect_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", NULL,
                 "evaluation nested deeper than 200 levels");
    /* deep nesting in the source is refused at load */
    size_t k = 5000;
    char *deep = malloc(2 * k + 16);
    strcpy(deep, "{{ ");
    memset(deep + 3, '(', k);
    strcpy(deep + 3 + k, "1");
    memset(deep + 4 + k, ')', k);
    strcpy(deep + 4 + 2 * k, " }}");
    assert_null(tpl_load(deep, strlen(deep), NULL, &err));
    assert_non_null(strstr(err.msg, "nesting deeper than"));
    free(deep);
    /* a long operator chain parses flat and fails at the depth limit */
    char *chain = malloc(4 * k + 16);
    strcpy(chain, "{{ 1");
    for (size_t i = 0; i < k; i++)
        strcat(chain + 4 * i, " + 1");
    strcat(chain, " }}");
    assert_int_equal(tpl_render_source(chain, strlen(chain), NULL, &out, NULL, &err), -1);
    assert_non_null(strstr(err.msg, "deeper than"));
    free(chain);
    /* loops, output and string sizes */
    struct tpl_limits lim = {.max_iterations = 1000, .max_output = 4096};
    const char *loop = "{% for i in range(2000) %}x{% endfor %}";
    tpl_template *t = tpl_load(loop, strlen(loop), &lim, &err);
    assert_non_null(t);
    assert_int_equal(tpl_render(t, NULL, 0, &out, NULL, &err), -1);
    assert_non_null(strstr(err.msg, "loop iterations over the limit of 1000"));
    tpl_free(t);
    const char *nested = "{% for i in range(40) %}{% for j in range(40) %}x{% endfor %}{% endfor %}";
    t = tpl_load(nested, strlen(nested), &lim, &err);
    assert_int_equal(tpl_render(t, NULL, 0, &out, NULL, &err), -1);
    assert_non_null(strstr(err.msg, "loop iterations over the limit of 1000"));
    tpl_free(t);
    const char *big = "{% for i in range(500) %}xxxxxxxxxx{% endfor %}";
    t = tpl_load(big, strlen(big), &lim, &err);
    assert_int_equal(tpl_render(t, NULL, 0, &out, NULL, &err), -1);
    assert_non_null(strstr(err.msg, "output larger than the limit of 4096 bytes"));
    tpl_free(t);
    const char *doubling = "{% set ns = namespace(s='x') %}{% for i in range(30) %}"
                           "{% set ns.s = ns.s + ns.s %}{% endfor %}";
    t = tpl_load(doubling, strlen(doubling), &lim, &err);
    assert_int_equal(tpl_render(t, NULL, 0, &out, NULL, &err), -1);
    assert_non_null(strstr(err.msg, "string longer than the limit of 4096 bytes"));
    tpl_free(t);
    expect_error("{{ 'x' * 100000000000 }}", NULL, "repetition larger than the limit");
    expect_error("{{ range(100000000000) }}", NULL, "loop iterations over the limit of 1000000");
    expect_error("{{ range(-9223372036854775807, 9223372036854775807) }}", NULL,
                 "items is over the iteration limit");
}

/* Render time is linear in the output: a conversation ten times longer
 * takes about ten times the work. Measured as loop iterations and bytes,
 * never wall-clock: the limit on iterations is met exactly at n messages. */
static void test_linear_work(void **state)
{
    (void)state;
    json_t *msgs = json_array();
    for (int i = 0; i < 2000; i++)
        json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", i % 2 ? "assistant" : "user",
                                              "content", "some message text"));
    size_t len;
    char *src = slurp(CASES "/models/qwen3.jinja", &len);
    struct tpl_chat_params p = {.eos_token = "<|im_end|>"};
    struct tpl_error err;
    tpl_chat *c = tpl_chat_create(src, len, &p, &err);
    assert_non_null(c);
    char *out;
    size_t n;
    char eb[300];
    if (tpl_chat_render(c, msgs, NULL, true, 0, &out, &n, &err) < 0)
        fail_msg("%s", tpl_error_string(&err, eb, sizeof eb));
    assert_true(n > 2000 * 17);
    free(out);
    tpl_chat_destroy(c);
    /* qwen3 loops twice over the messages: 2 * 2000 iterations fit 4000 exactly */
    p.limits.max_iterations = 4000;
    c = tpl_chat_create(src, len, &p, &err);
    assert_int_equal(tpl_chat_render(c, msgs, NULL, true, 0, &out, &n, &err), 0);
    free(out);
    json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "user", "content", "one more"));
    assert_int_equal(tpl_chat_render(c, msgs, NULL, true, 0, &out, &n, &err), -1);
    tpl_chat_destroy(c);
    free(src);
    json_decref(msgs);
}


/* ------------------------------------------------------------------------
 * Turn-aware fitting
 * ------------------------------------------------------------------------ */

static int count_bytes(const char *text, size_t len, void *ctx)
{
    (void)text;
    (*(int *)ctx)++;
    return (int)len;
}

/* A conversation: a system message, n answered turns (a system note in
 * turn 2), and a last user message. */
static json_t *long_chat(int n)
{
    json_t *m = json_pack("[{s:s,s:s}]", "role", "system", "content", "SYS");
    for (int i = 0; i < n; i++) {
        char u[32], a[32];
        snprintf(u, sizeof u, "question %02d", i);
        snprintf(a, sizeof a, "answer %02d", i);
        json_array_append_new(m, json_pack("{s:s,s:s}", "role", "user", "content", u));
        if (i == 2)
            json_array_append_new(m, json_pack("{s:s,s:s}", "role", "system", "content", "NOTE"));
        json_array_append_new(m, json_pack("{s:s,s:s}", "role", "assistant", "content", a));
    }
    json_array_append_new(m, json_pack("{s:s,s:s}", "role", "user", "content", "last"));
    return m;
}

static void test_fit(void **state)
{
    (void)state;
    struct tpl_chat_params p = {0};
    struct tpl_error err;
    tpl_chat *c = tpl_chat_create(tpl_chatml_source, strlen(tpl_chatml_source), &p, &err);
    json_t *msgs = long_chat(10);
    char *full, *out;
    size_t full_len, len;
    assert_int_equal(tpl_chat_render(c, msgs, NULL, true, 0, &full, &full_len, &err), 0);
    struct tpl_fit fit;
    int calls = 0;
    /* fits: nothing leaves */
    assert_int_equal(tpl_chat_fit(c, msgs, NULL, true, 0, 100000, 50000, 0, count_bytes, &calls,
                                  &out, &len, &fit, &err), 0);
    assert_string_equal(out, full);
    assert_int_equal(fit.dropped_turns, 0);
    assert_int_equal(fit.prompt_tokens, (int)full_len);
    free(out);
    /* too big: whole turns leave, oldest first, down to the low-water mark */
    int budget = (int)full_len - 1, low = (int)full_len / 2;
    calls = 0;
    assert_int_equal(tpl_chat_fit(c, msgs, NULL, true, 0, budget, low, 0, count_bytes, &calls,
                                  &out, &len, &fit, &err), 0);
    assert_true(fit.prompt_tokens <= low);
    assert_true(fit.dropped_turns > 0 && fit.dropped_turns < 10);
    assert_true(calls <= 8); /* O(log turns) renders */
    /* the prompt is the template's rendering of exactly the messages kept:
     * the system messages (the note too), the later turns, the last user turn */
    json_t *kept = json_array();
    json_array_append(kept, json_array_get(msgs, 0));
    json_array_append_new(kept, json_pack("{s:s,s:s}", "role", "system", "content", "NOTE"));
    for (int i = fit.dropped_turns; i < 10; i++) {
        char u[32], a[32];
        snprintf(u, sizeof u, "question %02d", i);
        snprintf(a, sizeof a, "answer %02d", i);
        json_array_append_new(kept, json_pack("{s:s,s:s}", "role", "user", "content", u));
        if (i == 2) /* the note stays where it was */
            json_array_remove(kept, 1), json_array_append_new(kept, json_pack("{s:s,s:s}", "role", "system", "content", "NOTE"));
        json_array_append_new(kept, json_pack("{s:s,s:s}", "role", "assistant", "content", a));
    }
    json_array_append(kept, json_array_get(msgs, json_array_size(msgs) - 1));
    char *want;
    assert_int_equal(tpl_chat_render(c, kept, NULL, true, 0, &want, NULL, &err), 0);
    assert_string_equal(out, want);
    assert_int_equal(fit.dropped_messages, 2 * fit.dropped_turns);
    /* as few turns as fit: one turn fewer than that does not */
    struct tpl_fit fit2;
    char *out2;
    assert_int_equal(tpl_chat_fit(c, msgs, NULL, true, 0, fit.prompt_tokens, fit.prompt_tokens,
                                  fit.dropped_turns - 1, count_bytes, &calls, &out2, &len, &fit2,
                                  &err), 0);
    assert_int_equal(fit2.dropped_turns, fit.dropped_turns);
    free(out2);
    /* and below the low-water mark one more goes */
    assert_int_equal(tpl_chat_fit(c, msgs, NULL, true, 0, fit.prompt_tokens, fit.prompt_tokens - 1,
                                  fit.dropped_turns - 1, count_bytes, &calls, &out2, &len, &fit2,
                                  &err), 0);
    assert_int_equal(fit2.dropped_turns, fit.dropped_turns + 1);
    free(out2);
    free(want);
    json_decref(kept);
    /* a session's earlier decision holds while the prompt fits */
    assert_int_equal(tpl_chat_fit(c, msgs, NULL, true, 0, 100000, 50000, 3, count_bytes, &calls,
                                  &out2, &len, &fit2, &err), 0);
    assert_int_equal(fit2.dropped_turns, 3);
    assert_int_equal(fit2.dropped_messages, 6);
    free(out2);
    /* the pinned part alone too big: refused with both numbers */
    assert_int_equal(tpl_chat_fit(c, msgs, NULL, true, 0, 20, 10, 0, count_bytes, &calls, &out2,
                                  &len, &fit2, &err), -1);
    assert_non_null(strstr(err.msg, "with every earlier turn left out"));
    assert_non_null(strstr(err.msg, "the budget is 20"));
    free(out);
    free(full);
    json_decref(msgs);
    tpl_chat_destroy(c);
}

/* ------------------------------------------------------------------------
 * kvd chat-template
 * ------------------------------------------------------------------------ */

/* Run `$KVD_BIN chat-template ARGS` (stderr into the output when
 * with_stderr); returns its output (new) and exit status. */
static char *run_cli(const char *args, bool with_stderr, int *status)
{
    const char *bin = getenv("KVD_BIN");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s chat-template %s %s", bin, args,
             with_stderr ? "2>&1" : "2>/dev/null");
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    size_t r;
    while ((r = fread(buf + n, 1, cap - n - 1, p)) > 0)
        n += r;
    buf[n] = 0;
    int st = pclose(p);
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return buf;
}

static void expect_cli(const char *args, const char *expect_file)
{
    int st;
    char *got = run_cli(args, false, &st);
    char *want = slurp(expect_file, NULL);
    assert_non_null(want);
    if (st != 0 || strcmp(got, want) != 0)
        fail_msg("kvd chat-template %s: status %d\n  want [%s]\n  got  [%s]", args, st, want, got);
    free(got);
    free(want);
}

static void expect_cli_error(const char *args, int status, const char *want)
{
    int st;
    char *got = run_cli(args, true, &st);
    if (st != status || !strstr(got, want))
        fail_msg("kvd chat-template %s: status %d (want %d)\n  want [%s]\n  got  [%s]", args, st,
                 status, want, got);
    free(got);
}

static void test_cli(void **state)
{
    (void)state;
    if (!getenv("KVD_BIN")) {
        print_message("KVD_BIN not set (run through `make test`): skipping\n");
        skip();
    }
    expect_cli("--template " CASES "/models/gemma.jinja --messages " CASES
               "/conversations/basic.json",
               CASES "/render/gemma.expect");
    expect_cli("--template " CASES "/models/chatml-openhermes.jinja --no-generation-prompt "
               "--messages " CASES "/conversations/parts.json",
               CASES "/render/chatml-parts.expect");
    expect_cli("--template " CASES "/models/qwen2.5.jinja --eos-token '<|im_end|>' --messages " CASES
               "/conversations/tools.json --tools " CASES "/conversations/tools_spec.json",
               CASES "/render/qwen2.5-tools.expect");
    expect_cli_error("--template " CASES "/errors/unsupported_filter.jinja", 1,
                     "kvd chat-template: chat template (" CASES
                     "/errors/unsupported_filter.jinja): 1:15: unsupported filter 'batch'");
    expect_cli_error("--template " CASES "/errors/raise_exception.jinja", 1,
                     "render: 1:57: template raised an exception: assistant turns are not allowed");
    expect_cli_error("--template /nonexistent.jinja", 1, "cannot open /nonexistent.jinja");
    expect_cli_error("--template " CASES "/models/gemma.jinja --messages " CASES "/README", 1,
                     "--messages " CASES "/README:1:");
    expect_cli_error("--template " CASES "/models/gemma.jinja --tools " CASES
                     "/render/gemma.json", 1, "must hold a JSON array");
    expect_cli_error("", 2, "need --model FILE or --template FILE");
    expect_cli_error("--template", 2, "--template needs a value");
    expect_cli_error("--frob", 2, "unknown option '--frob'");
    expect_cli_error("--template x --name y", 2, "--name picks a template of --model FILE");

    const char *shared = getenv("KVD_SHARED");
    char path[512], args[1024];
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-phi-3.gguf", shared ? shared : "../shared");
    FILE *f = fopen(path, "rb");
    if (!f) {
        print_message("%s absent: the model-template cases are skipped\n", path);
        return;
    }
    fclose(f);
    /* the model's template, without a system role: the probe finds it; BOS
     * is stripped because the tokenizer adds it */
    int st;
    snprintf(args, sizeof args, "--model %s", path);
    char *out = run_cli(args, false, &st);
    assert_int_equal(st, 0);
    assert_string_equal(out, "<|user|>\nYou are a helpful assistant.\nHello!<|end|>\n<|assistant|>\n"
                             "Hi. How can I help?<|end|>\n<|user|>\nTell me a story.<|end|>\n"
                             "<|assistant|>\n");
    free(out);
    out = run_cli(args, true, &st);
    assert_non_null(strstr(out, "template from the model's tokenizer.chat_template; system "
                                "messages joined to the first user message"));
    free(out);
    snprintf(args, sizeof args, "--model %s --name tool_use", path);
    expect_cli_error(args, 1, "the model has no chat template named 'tool_use'");
    /* a model without a template gets ChatML */
    snprintf(args, sizeof args, "--model %s/models/stories260K.gguf --no-generation-prompt",
             shared ? shared : "../shared");
    out = run_cli(args, true, &st);
    assert_int_equal(st, 0);
    assert_non_null(strstr(out, "template from the default (ChatML"));
    assert_non_null(strstr(out, "<|im_start|>user\nTell me a story.<|im_end|>\n"));
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_templates), cmocka_unit_test(test_system_probe),
        cmocka_unit_test(test_end_of_turn),
        cmocka_unit_test(test_bos_strip),       cmocka_unit_test(test_default_chatml),
        cmocka_unit_test(test_chat_input_errors), cmocka_unit_test(test_whitespace),
        cmocka_unit_test(test_expressions),     cmocka_unit_test(test_statements),
        cmocka_unit_test(test_filters_and_methods), cmocka_unit_test(test_tests),
        cmocka_unit_test(test_error_cases),     cmocka_unit_test(test_runtime_errors),
        cmocka_unit_test(test_limits),          cmocka_unit_test(test_linear_work),
        cmocka_unit_test(test_fit),         cmocka_unit_test(test_cli),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
