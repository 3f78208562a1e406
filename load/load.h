/*
 * load.h - `kvd load`: the load tester (cmd_load.c), driving a running kvd
 * over HTTP with the blocking client of client.h.
 */
#ifndef KVD_LOAD_H
#define KVD_LOAD_H

/* The subcommand's entry point (argv[0] is "load"); returns the exit status. */
int srv_cmd_load(int argc, char **argv);

#endif /* KVD_LOAD_H */
