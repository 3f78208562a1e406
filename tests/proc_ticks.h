/*
 * proc_ticks.h - CPU time of some of a process's threads, from /proc: the
 * tests that check idle pool workers sleep (test_pool in-process, test_api
 * on a running `kvd serve`) compare two readings a second apart. A
 * resource check in clock ticks, not a wall-clock assertion.
 */
#ifndef KVD_TESTS_PROC_TICKS_H
#define KVD_TESTS_PROC_TICKS_H

#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

/*
 * User + system clock ticks (sysconf(_SC_CLK_TCK) per second) of the
 * threads of process pid (0: this process) whose name starts with prefix,
 * their number in *n_threads; -1 when /proc cannot be read.
 */
static __attribute__((unused)) long pt_thread_ticks(pid_t pid, const char *prefix, int *n_threads)
{
    char dir[64];
    if (pid)
        snprintf(dir, sizeof(dir), "/proc/%d/task", (int)pid);
    else
        snprintf(dir, sizeof(dir), "/proc/self/task");
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    long ticks = 0;
    *n_threads = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.')
            continue;
        char path[400], buf[1024];
        snprintf(path, sizeof(path), "%s/%s/comm", dir, e->d_name);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        int match = fgets(buf, sizeof(buf), f) && !strncmp(buf, prefix, strlen(prefix));
        fclose(f);
        snprintf(path, sizeof(path), "%s/%s/stat", dir, e->d_name);
        if (!match || !(f = fopen(path, "r")))
            continue;
        size_t len = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[len] = '\0';
        /* after "(comm) ": state, then utime and stime are the 12th and 13th numbers */
        char *p = strrchr(buf, ')');
        unsigned long ut = 0, st = 0;
        if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut,
                         &st) != 2)
            continue;
        ticks += (long)(ut + st);
        (*n_threads)++;
    }
    closedir(d);
    return ticks;
}

#endif /* KVD_TESTS_PROC_TICKS_H */
