/*
 * kvd_run.h - for tests that run the kvd binary ($KVD_BIN, which `make
 * test` sets) as a command and read what it says on stderr. Include after
 * <cmocka.h>.
 */
#ifndef KVD_TESTS_KVD_RUN_H
#define KVD_TESTS_KVD_RUN_H

#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

/*
 * Run `env VARS $KVD_BIN ARGS` (vars: "NAME='value' ...", may be ""), its
 * stderr kept in dir/err.txt and returned in *err (malloc'd, at most 64
 * KiB, the caller frees). Returns the exit status (128: killed).
 */
static inline int kvd_run(const char *vars, const char *args, const char *dir, char **err)
{
    char cmd[1400], pe[256];
    snprintf(pe, sizeof(pe), "%s/err.txt", dir);
    snprintf(cmd, sizeof(cmd), "env %s %s %s >/dev/null 2>'%s' </dev/null", vars, getenv("KVD_BIN"),
             args, pe);
    int st = system(cmd);
    FILE *f = fopen(pe, "rb");
    assert_non_null(f);
    *err = calloc(1, 65536);
    assert_non_null(*err);
    size_t n = fread(*err, 1, 65535, f);
    (*err)[n] = '\0';
    fclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

#endif /* KVD_TESTS_KVD_RUN_H */
