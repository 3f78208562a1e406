/*
 * api_work.c - the API's work off the loop thread: a job runs on libuv's
 * work queue (uv_queue_work) and comes back to the loop thread to answer.
 *
 * What runs there is what costs time in proportion to a request's size:
 * rendering a chat template, tokenizing a prompt or a /tokenize text,
 * decoding tokens to text. The loop thread parses the JSON (the body size
 * is capped) and decodes it; the job gets everything it reads either owned
 * (the decoded request, with its JSON tree: the loop thread does not touch
 * it until the job comes back) or immutable (the model, the chat
 * template). The engine's step is never waited on here.
 *
 * A client that leaves while its job runs: the job is the connection's
 * owner meanwhile, so the connection's on_gone clears j->conn, and the
 * job's done callback then frees what the job holds without answering.
 * libuv keeps the loop running until every queued job has come back, so
 * a job is never lost at shutdown either.
 */
#include <uv.h>

#include "server/api_internal.h"
#include "server/log.h"

static void job_gone(void *owner)
{
    struct srv_api_job *j = owner;
    j->conn = NULL;
}

static void job_run(uv_work_t *w)
{
    struct srv_api_job *j = w->data;
    j->run(j);
}

static void job_after(uv_work_t *w, int status)
{
    struct srv_api_job *j = w->data;
    (void)status; /* jobs are never cancelled (uv_cancel) */
    j->a->jobs--;
    srv_metrics_api_jobs(j->a->metrics, j->a->jobs);
    if (j->conn)
        srv_conn_set_owner(j->conn, NULL, NULL, NULL);
    j->done(j);
}

void srv_api_job_start(srv_api *a, srv_conn *conn, struct srv_api_job *j)
{
    j->a = a;
    j->conn = conn;
    j->work.data = j;
    a->jobs++;
    srv_metrics_api_jobs(a->metrics, a->jobs);
    srv_conn_set_owner(conn, j, job_gone, NULL);
    int rc = a->loop ? uv_queue_work(a->loop, &j->work, job_run, job_after) : UV_ENOSYS;
    if (rc < 0) {
        if (a->loop)
            srv_log(SRV_LOG_WARN, "uv_queue_work: %s; running the job on the loop thread",
                    uv_strerror(rc));
        job_run(&j->work);
        job_after(&j->work, 0);
    }
}
