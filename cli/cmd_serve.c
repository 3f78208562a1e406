/*
 * cmd_serve.c - `kvd serve`: the daemon's command line and configuration.
 *
 * The configuration is built as config/ builds it everywhere: defaults <
 * the file (--config) < command-line overrides (--set section.key=value,
 * --model FILE, --listen ADDR:PORT), every error reported at once. This
 * file then maps the operator's struct cfg onto the params of each server
 * module and hands them to srv_serve_run. On SIGHUP the same sequence runs
 * again on the same file and overrides; cfg_reload decides which changes
 * apply live and which wait for a restart.
 *
 * Derived values come from config/, never recomputed here: the eviction
 * window (cfg_window_tokens, which reads the cache's own budget through the
 * hook wiring.c installs) and the memory rule
 * (cfg_check_memory, with the model's real KV bytes per token, read once
 * at start by loading the model's header and shapes). The memory rule is
 * checked again on every reload, since max_cache_tokens applies live while
 * the pool's size needs a restart.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/cli_internal.h"
#include "config/args.h"
#include "config/config.h"
#include "server/chat_template.h"
#include "server/daemon.h"
#include "server/log.h"

#define MAX_SETS 256

/* What SIGHUP needs to rebuild the config (loop thread only). */
struct serve_state {
    struct cfg running;          /* the config being served */
    struct cfg pending;          /* a reload that passed, not yet committed */
    uint64_t kv_bytes_per_token; /* K and V of one token, every layer and KV head */
    struct model_info info;      /* the loaded model (its strings are not kept valid) */
    struct kv_cache_params shape; /* its cache shape; layer_window points at windows */
    int32_t *windows;            /* [n_layer] copy of the model's sliding windows, or NULL */
    const char *sets[MAX_SETS + 2];
    int n_sets;
    char api_key[CFG_KEY_MAX + CFG_PATH_MAX];
    char *config_json; /* what GET /v1/config shows for `running` (owned) */
    char *staged_json; /* ... for a reload that passed, until the next one */
};

static void serve_usage(FILE *f)
{
    fprintf(f, "usage: kvd serve [--config FILE] [--model FILE] [--listen ADDR:PORT]\n"
               "                 [--set SECTION.KEY=VALUE ...]\n"
               "  --config FILE      the config file (see config/kvd.conf; reloaded on SIGHUP)\n"
               "  --model FILE       GGUF model to serve (model.path)\n"
               "  --listen ADDR:PORT address to accept HTTP on (server.listen; port 0 = any free\n"
               "                     port, printed at start)\n"
               "  --set S.K=V        override one config key, e.g. --set limits.max_running=16\n"
               "Precedence: defaults < config file < command line. SIGTERM/SIGINT drain and\n"
               "exit; SIGHUP reloads the config file.\n");
}

static void report_errors(const struct cfg_errors *errs)
{
    for (int i = 0; i < errs->count; i++) {
        char line[1024];
        cfg_error_format(&errs->list[i], line, sizeof(line));
        srv_log(SRV_LOG_ERROR, "config: %s", line);
    }
    if (errs->dropped)
        srv_log(SRV_LOG_ERROR, "config: ... and %d more errors", errs->dropped);
}

static void print_errors(const struct cfg_errors *errs)
{
    for (int i = 0; i < errs->count; i++) {
        char line[1024];
        cfg_error_format(&errs->list[i], line, sizeof(line));
        fprintf(stderr, "kvd serve: %s\n", line);
    }
    if (errs->dropped)
        fprintf(stderr, "kvd serve: ... and %d more errors\n", errs->dropped);
}

/* "HOST:PORT" or "[V6]:PORT". Returns 0 or -1. */
static int split_listen(const char *s, char *host, size_t hostlen, int *port)
{
    const char *colon;
    const char *h = s;
    size_t hl;
    if (s[0] == '[') {
        const char *end = strchr(s, ']');
        if (!end || end[1] != ':')
            return -1;
        h = s + 1;
        hl = (size_t)(end - h);
        colon = end + 1;
    } else {
        colon = strrchr(s, ':');
        if (!colon)
            return -1;
        hl = (size_t)(colon - s);
    }
    if (hl == 0 || hl >= hostlen)
        return -1;
    memcpy(host, h, hl);
    host[hl] = '\0';
    long p;
    if (srv_parse_long(colon + 1, 0, 65535, &p))
        return -1;
    *port = (int)p;
    return 0;
}

/* The API key: inline, or the first line of api_key_file. Returns 0, or
 * -1 with the reason in err. */
static int read_api_key(const struct cfg *c, char *out, size_t outlen, char *err, size_t errlen)
{
    out[0] = '\0';
    if (c->auth.api_key[0]) {
        snprintf(out, outlen, "%s", c->auth.api_key);
        return 0;
    }
    if (!c->auth.api_key_file[0])
        return 0;
    FILE *f = fopen(c->auth.api_key_file, "r");
    if (!f) {
        snprintf(err, errlen, "[auth] api_key_file %s: %s", c->auth.api_key_file, strerror(errno));
        return -1;
    }
    /* Room for a key one byte too long, so a long one is seen (not cut). */
    char line[CFG_KEY_MAX + 2] = "";
    if (!fgets(line, sizeof(line), f))
        line[0] = '\0';
    fclose(f);
    size_t n = strcspn(line, "\r\n");
    if (n >= CFG_KEY_MAX) {
        snprintf(err, errlen, "[auth] api_key_file %s: the key is longer than %d bytes",
                 c->auth.api_key_file, CFG_KEY_MAX - 1);
        return -1;
    }
    line[n] = '\0';
    if (!line[0]) {
        snprintf(err, errlen, "[auth] api_key_file %s: the first line is empty",
                 c->auth.api_key_file);
        return -1;
    }
    snprintf(out, outlen, "%s", line);
    return 0;
}

/* Map the operator config onto the server's params. Returns 0, or -1 with
 * the reason in err. */
static int map_config(const struct cfg *c, struct serve_state *st, struct srv_serve_config *o,
                      char *err, size_t errlen)
{
    if (split_listen(c->server.listen, o->host, sizeof(o->host), &o->port)) {
        snprintf(err, errlen, "[server] listen = %s: expected HOST:PORT or [IPV6]:PORT",
                 c->server.listen);
        return -1;
    }
    o->drain_timeout_ms = c->server.drain_timeout_ms;
    o->http = (struct srv_http_params){
        .max_header_bytes = c->limits.max_header_bytes,
        .max_headers = (int)c->limits.max_headers,
        .max_body_bytes = c->limits.max_body_bytes,
        .header_timeout_ms = c->limits.header_timeout_ms,
        .idle_timeout_ms = c->limits.idle_timeout_ms,
        .body_timeout_ms = c->limits.body_timeout_ms,
        .max_connections = (int)c->server.max_connections,
        .write_buffer = c->limits.write_buffer,
        /* A stream's producer pauses at write_buffer; this much more is
         * one event's worth of slack at most, so reaching it means the
         * pause did not happen. */
        .max_write_queue = 8 * c->limits.write_buffer,
    };
    struct kv_policy pol;
    srv_cfg_policy(c, &pol);
    if (read_api_key(c, st->api_key, sizeof(st->api_key), err, errlen))
        return -1;
    o->api = (struct srv_api_params){
        .max_prompt_tokens = (int)c->limits.max_prompt_tokens,
        .max_tokens = (int)c->limits.max_tokens,
        .default_max_tokens = (int)c->limits.max_tokens,
        .max_choices = (int)c->limits.max_choices,
        .api_key = st->api_key,
        .policy = pol,
        .page_tokens = (int)c->cache.page_tokens,
        .max_session_id = 128,
        .chat_template = c->model.chat_template,
        .chat_turns = c->eviction.unit == CFG_UNIT_TURN,
        .engine_stall_ms = c->limits.engine_stall_timeout_ms,
    };
    o->sched.model = (struct model_params){
        .path = c->model.path,
        .alibi_max_bias = (float)c->model.alibi_max_bias,
        .t5_num_buckets = (int)c->model.t5_num_buckets,
        .t5_max_distance = (int)c->model.t5_max_distance,
        .tokenizer_pre = c->model.tokenizer_pre[0] ? c->model.tokenizer_pre : NULL,
        .small_pages = !c->model.huge_pages,
    };
    o->sched.cache_memory = c->cache.memory;
    o->sched.page_tokens = (int)c->cache.page_tokens;
    o->sched.k_type = srv_cfg_kv_type(cfg_k_type(c));
    o->sched.v_type = srv_cfg_kv_type(cfg_v_type(c));
    o->sched.mlock = c->cache.mlock;
    o->sched.prefix_cache = c->cache.prefix_cache;
    o->sched.prefix_cache_share = (int)c->cache.prefix_cache_share;
    o->sched.n_threads = (int)c->server.threads;
    o->sched.spill_dir = c->sessions.dir;
    o->sched.spill_max_bytes = c->sessions.max_disk;
    o->sched.limits = (struct engine_limits){
        .policy = pol,
        .max_running = (int)c->limits.max_running,
        .step_tokens = (int)c->limits.step_tokens,
        .step_budget_ms = c->limits.step_budget_ms,
        .queue_length = (int)c->limits.queue_length,
        .session_idle_ms = c->eviction.session_idle_timeout_ms,
        .max_sessions = (int)c->eviction.max_sessions,
    };
    return 0;
}

/*
 * One line with the eviction settings in effect (the window resolved), at
 * start and after each reload: what `kvd check-config` would say, from the
 * running server.
 */
static void log_eviction(const char *when, const struct cfg *c)
{
    char policy[32], positions[32];
    cfg_format_value(c, CFG_EVICTION_POLICY, policy, sizeof(policy));
    cfg_format_value(c, CFG_EVICTION_POSITIONS, positions, sizeof(positions));
    bool on = c->eviction.policy != CFG_EVICT_NONE;
    srv_log(
        SRV_LOG_INFO,
        "config %s (%s): eviction policy %s, max_cache_tokens %lld, sink_tokens %lld, "
        "window_tokens %lld%s, heavy_tokens %lld, positions %s",
        when, c->file[0] ? c->file : "no file: built-in defaults", policy,
        (long long)c->eviction.max_cache_tokens, (long long)c->eviction.sink_tokens,
        (long long)cfg_window_tokens(c), on && c->eviction.window_tokens == 0 ? " (automatic)" : "",
        (long long)(cfg_policy_scored(c->eviction.policy) ? c->eviction.heavy_tokens : 0),
        positions);
}

/* The positions a sequence of the config can reach (0 = no bound). */
static int positions_bound(const struct cfg *c)
{
    struct kv_policy p;
    srv_cfg_policy(c, &p);
    return srv_run_positions(&p, 0);
}

/*
 * The LongRoPE table was chosen at start by the positions the policy
 * allows; a reload that would need the other one (max_cache_tokens past
 * the original context, or positions = preserve) is refused: the table of
 * cached keys cannot change under them, and serving with the wrong one
 * would be a silent fallback. 0, or -1 with the reason in err.
 */
static int check_rope_table(const struct serve_state *st, const struct cfg *c, char *err,
                            size_t errlen)
{
    int n_ctx = positions_bound(c);
    if (!st->info.rope_orig_ctx || model_rope_long(&st->info, n_ctx) == st->info.rope_long)
        return 0;
    const char *had = st->info.rope_long ? "long" : "short";
    const char *needs = st->info.rope_long ? "short" : "long";
    if (n_ctx > 0)
        snprintf(err, errlen,
                 "[eviction] max_cache_tokens %d needs the model's %s LongRoPE factors (original "
                 "context %d); it runs the %s ones chosen at start: restart kvd serve to change "
                 "them",
                 n_ctx, needs, st->info.rope_orig_ctx, had);
    else
        snprintf(err, errlen,
                 "[eviction] positions = preserve has no bound and needs the model's %s LongRoPE "
                 "factors (context_length %d, original context %d); it runs the %s ones chosen "
                 "at start: restart kvd serve to change them",
                 needs, st->info.n_ctx_train, st->info.rope_orig_ctx, had);
    return -1;
}

/*
 * The memory rule needs the model's KV bytes per token. Load the model
 * (header, tensor table, tokenizer; the weights stay mapped and untouched)
 * and take the shape the cache will get; the model then goes to the engine
 * (*loaded, for sched.loaded), which does not load it again. Returns 0; 1
 * when the model cannot be loaded;
 * 2 when the pool cannot hold one sequence at its full budget. Errors are
 * printed.
 */
static int check_model_memory(struct serve_state *st, struct cfg_errors *errs, model **loaded)
{
    const struct cfg *c = &st->running;
    struct model_params mp = {
        .path = c->model.path,
        .alibi_max_bias = (float)c->model.alibi_max_bias,
        .t5_num_buckets = (int)c->model.t5_num_buckets,
        .t5_max_distance = (int)c->model.t5_max_distance,
        .tokenizer_pre = c->model.tokenizer_pre[0] ? c->model.tokenizer_pre : NULL,
        .small_pages = !c->model.huge_pages,
        .n_ctx = positions_bound(c),
    };
    char err[1024];
    model *m = model_load(&mp, err, sizeof(err));
    if (!m) {
        fprintf(stderr, "kvd serve: %s\n", err);
        return 1;
    }
    model_get_info(m, &st->info);
    srv_log(SRV_LOG_INFO, "model weights: %s", model_pack_describe(m, err, sizeof(err)));
    srv_rope_note(&st->info, mp.n_ctx, err, sizeof(err));
    if (err[0])
        srv_log(SRV_LOG_INFO, "model: %s", err);
    /* The operator's chat template must load: refused here with its line
     * and column. The model's own may fail (chat answers 500 then). */
    char source[1200];
    struct srv_chat_template_opts to = {.path = c->model.chat_template};
    tpl_chat *chat = srv_chat_template_load(m, &to, source, sizeof(source), err, sizeof(err));
    if (!chat && c->model.chat_template[0]) {
        fprintf(stderr, "kvd serve: [model] chat_template: %s\n", err);
        model_free(m);
        return 1;
    }
    tpl_chat_destroy(chat);
    struct kv_cache_params shape = {.k_type = srv_cfg_kv_type(cfg_k_type(c)),
                                    .v_type = srv_cfg_kv_type(cfg_v_type(c))};
    model_kv_shape(m, &shape);
    *loaded = m;
    if (shape.layer_window) { /* kept for reloads: the model goes to the engine */
        st->windows = malloc(sizeof(int32_t) * (size_t)shape.n_layer);
        if (!st->windows) {
            fprintf(stderr, "kvd serve: out of memory\n");
            return 1;
        }
        memcpy(st->windows, shape.layer_window, sizeof(int32_t) * (size_t)shape.n_layer);
        shape.layer_window = st->windows;
    }
    st->shape = shape;
    st->kv_bytes_per_token = kv_cache_token_bytes(&shape);
    if (!st->kv_bytes_per_token) { /* a block type the head size cannot take */
        fprintf(stderr,
                "kvd serve: [cache] k_type %s / v_type %s cannot store the model's head_dim %d "
                "(q8_0 and q4_0 need a multiple of 32)\n",
                kv_type_name(shape.k_type), kv_type_name(shape.v_type), shape.head_dim);
        return 2;
    }
    cfg_errors_init(errs);
    char note[400];
    srv_cfg_session_note(c, &shape, note, sizeof(note));
    if (note[0])
        srv_log(SRV_LOG_INFO, "cache: %s", note);
    if (cfg_check_memory(c, st->kv_bytes_per_token, srv_cfg_window_bytes(c, &shape), errs) != 0) {
        print_errors(errs);
        return 2;
    }
    return 0;
}

static void apply_log(const struct cfg *c)
{
    static const enum srv_log_level lv[] = {SRV_LOG_DEBUG, SRV_LOG_INFO, SRV_LOG_WARN,
                                            SRV_LOG_ERROR};
    srv_log_setup(lv[c->log.level], c->log.format == CFG_LOG_JSON);
}

/* SIGHUP: the file again, the same overrides, then cfg_reload's merge. */
static int serve_reload(const char *path, struct srv_serve_config *out, void *ud)
{
    struct serve_state *st = ud;
    struct cfg_errors *errs = malloc(sizeof(*errs));
    struct cfg *loaded = malloc(sizeof(*loaded));
    int rc = -1;
    if (!errs || !loaded) {
        srv_log(SRV_LOG_ERROR, "config: out of memory");
        goto out;
    }
    cfg_errors_init(errs);
    if (cfg_load(loaded, path, st->sets, st->n_sets, errs) != 0) {
        report_errors(errs);
        goto out;
    }
    struct cfg_diff diff;
    if (cfg_reload(&st->running, loaded, &st->pending, &diff, errs) != 0) {
        report_errors(errs);
        goto out;
    }
    /* max_cache_tokens applies live, the pool's size only at restart. */
    if (cfg_check_memory(&st->pending, st->kv_bytes_per_token,
                         srv_cfg_window_bytes(&st->pending, &st->shape), errs) != 0) {
        report_errors(errs);
        goto out;
    }
    char why[512];
    if (check_rope_table(st, &st->pending, why, sizeof(why)) != 0) {
        srv_log(SRV_LOG_ERROR, "config: %s; the old config stays", why);
        goto out;
    }
    for (int i = 0; i < diff.n_restart; i++) {
        enum cfg_key k = diff.restart[i];
        char now[CFG_PATH_MAX], then[CFG_PATH_MAX], at[CFG_PATH_MAX + 32];
        cfg_format_value(loaded, k, now, sizeof(now));
        cfg_format_value(&st->running, k, then, sizeof(then));
        cfg_format_origin(loaded, k, at, sizeof(at));
        srv_log(SRV_LOG_WARN, "config: %s.%s = %s (%s): ignored until restart; still %s",
                cfg_key_section(k), cfg_key_name(k), now, at, then);
    }
    for (int i = 0; i < diff.n_live; i++) {
        char v[256];
        cfg_format_value(&st->pending, diff.live[i], v, sizeof(v));
        srv_log(SRV_LOG_INFO, "config: %s.%s = %s", cfg_key_section(diff.live[i]),
                cfg_key_name(diff.live[i]), diff.live[i] == CFG_AUTH_API_KEY ? "(set)" : v);
    }
    char err[2048];
    /* the new key, if any, goes to a staging buffer until committed */
    static char staged_key[sizeof(st->api_key)];
    struct serve_state tmp;
    if (map_config(&st->pending, &tmp, out, err, sizeof(err)) != 0) {
        srv_log(SRV_LOG_ERROR, "config: %s", err);
        goto out;
    }
    snprintf(staged_key, sizeof(staged_key), "%s", tmp.api_key);
    out->api.api_key = staged_key; /* copied by srv_api_set_params */
    free(st->staged_json);
    st->staged_json = srv_config_view_json(&st->pending);
    out->api.config_json = st->staged_json; /* copied by srv_api_set_params */
    /* Restart-only values stay as running (cfg_reload kept them). */
    rc = 0;
out:
    free(errs);
    free(loaded);
    return rc;
}

static void serve_commit(void *ud, bool applied)
{
    struct serve_state *st = ud;
    if (applied) {
        st->running = st->pending;
        apply_log(&st->running);
        log_eviction("reloaded", &st->running);
    }
}

int srv_cmd_serve(int argc, char **argv)
{
    const char *config = NULL;
    struct serve_state *st = calloc(1, sizeof(*st));
    struct cfg_errors *errs = malloc(sizeof(*errs));
    struct srv_serve_config *sc = calloc(1, sizeof(*sc));
    static char model_set[CFG_PATH_MAX + 16], listen_set[CFG_ADDR_MAX + 16];
    int status = 2;
    if (!st || !errs || !sc) {
        fprintf(stderr, "kvd serve: out of memory\n");
        goto out;
    }
    bool bad = false;
    const char *model_path = NULL, *listen = NULL;
    for (int i = 1; i < argc && !bad;) {
        const char *v = NULL;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            serve_usage(stdout);
            status = 0;
            goto out;
        } else if (srv_opt_value(argc, argv, &i, "serve", "--config", &config, &bad) ||
                   srv_opt_value(argc, argv, &i, "serve", "--model", &model_path, &bad) ||
                   srv_opt_value(argc, argv, &i, "serve", "--listen", &listen, &bad)) {
            continue;
        } else if (srv_opt_value(argc, argv, &i, "serve", "--set", &v, &bad)) {
            if (v && st->n_sets >= MAX_SETS) {
                fprintf(stderr, "kvd serve: too many --set options (at most %d)\n", MAX_SETS);
                bad = true;
            } else if (v) {
                st->sets[st->n_sets++] = v;
            }
        } else {
            fprintf(stderr, "kvd serve: unknown option '%s'\n", argv[i]);
            bad = true;
        }
    }
    if (bad) {
        serve_usage(stderr);
        goto out;
    }
    if (model_path) {
        snprintf(model_set, sizeof(model_set), "model.path=%s", model_path);
        st->sets[st->n_sets++] = model_set;
    }
    if (listen) {
        snprintf(listen_set, sizeof(listen_set), "server.listen=%s", listen);
        st->sets[st->n_sets++] = listen_set;
    }

    cfg_errors_init(errs);
    if (cfg_load(&st->running, config, st->sets, st->n_sets, errs) != 0) {
        print_errors(errs);
        goto out;
    }
    apply_log(&st->running);
    char err[2048];
    if (map_config(&st->running, st, sc, err, sizeof(err)) != 0) {
        fprintf(stderr, "kvd serve: %s\n", err);
        goto out;
    }
    if (access(st->running.model.path, R_OK) != 0) {
        fprintf(stderr, "kvd serve: model %s: %s%s\n", st->running.model.path, strerror(errno),
                errno == ENOENT ? " (make one with `kvd mkmodel`, or pass --model FILE)" : "");
        goto out;
    }
    status = check_model_memory(st, errs, &sc->sched.loaded);
    if (status != 0) {
        model_free(sc->sched.loaded);
        goto out;
    }
    log_eviction("in effect", &st->running);
    st->config_json = srv_config_view_json(&st->running);
    sc->api.config_json = st->config_json;
    sc->sched.max_step_tokens = sc->sched.limits.step_tokens;
    if (config)
        snprintf(sc->config_path, sizeof(sc->config_path), "%s", config);
    sc->reload = serve_reload;
    sc->reload_commit = serve_commit;
    sc->reload_ud = st;
    status = srv_serve_run(sc);
out:
    if (st) {
        free(st->config_json);
        free(st->staged_json);
        free(st->windows);
    }
    free(st);
    free(errs);
    free(sc);
    return status;
}
