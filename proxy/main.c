/* SPDX-License-Identifier: Apache-2.0 */
/* pdproxy: prefill/decode disaggregation proxy. Everything lives in the
 * proxy library; this only wires configuration to the server. */
#include <signal.h>
#include <stdio.h>
#include <sys/resource.h>

#include "base/log.h"
#include "base/logsink.h"
#include "base/util.h"
#include "proxy/access.h"
#include "proxy/config.h"
#include "proxy/otlp.h"
#include "proxy/server.h"

extern char **environ;

/* The log sink dropped lines (its reader did not keep up): said at most
 * once a second, once it takes lines again. */
static void log_dropped(uint64_t n) {
    PX_LOG(PX_LOG_WARN,
           "msg=\"log lines dropped: the log's reader did not keep up\" dropped=%llu "
           "dropped_total=%llu",
           (unsigned long long)n, (unsigned long long)px_logsink_dropped());
}

int main(int argc, char **argv) {
    px_mem_for_libevent(); /* before anything else touches libevent */
    px_config cfg;
    char err[512];
    px_config_result r = px_config_load(&cfg, argc, argv, environ, stdout, err, sizeof err);
    if (r != PX_CONFIG_RUN) {
        if (r == PX_CONFIG_ERROR) fprintf(stderr, "pdproxy: %s\n", err);
        px_config_cleanup(&cfg);
        return r == PX_CONFIG_ERROR ? 2 : 0;
    }
    px_log_threshold = (px_log_level_t)px_log_level_parse(cfg.log_level);
    px_log_json = cfg.log_format[0] == 'j';
    px_access_enabled = cfg.access_log;
    signal(SIGPIPE, SIG_IGN);
    /* From here on no log line waits for its reader (logsink.h). */
    px_logsink_cfg lc = {.path = cfg.log_file,
                         .buffer_bytes = (size_t)cfg.access_log_buffer,
                         .flush_s = cfg.access_log_flush,
                         .on_dropped = log_dropped};
    if (px_logsink_start(&lc, err, sizeof err) < 0) {
        fprintf(stderr, "pdproxy: %s\n", err);
        px_config_cleanup(&cfg);
        return 2;
    }
    /* Every client and upstream connection is a descriptor: take all the
     * kernel allows rather than the 1024 a shell usually starts with. */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    /* libcurl is loaded (and initialised) on the first https:// request or
     * trace export. */
    if (px_otlp_start(err, sizeof err) < 0) {
        fprintf(stderr, "pdproxy: %s\n", err);
        px_logsink_stop(2.0);
        px_config_cleanup(&cfg);
        return 2;
    }
    if (cfg.check_config) {
        /* What start-up would refuse, refused the same way; nothing bound. */
        int rc = px_server_check(&cfg, err, sizeof err);
        px_otlp_stop();
        if (rc < 0) fprintf(stderr, "pdproxy: %s\n", err);
        else printf("pdproxy: configuration OK\n");
        px_config_cleanup(&cfg);
        return rc < 0 ? 2 : 0;
    }
    px_server *s = px_server_create(&cfg, err, sizeof err);
    if (!s) {
        /* Like a bad flag: what was asked cannot be served (the port is
         * taken, a file is missing). */
        fprintf(stderr, "pdproxy: %s\n", err);
        px_otlp_stop();
        px_logsink_stop(2.0);
        px_config_cleanup(&cfg);
        return 2;
    }
    px_server_set_args(s, argc, argv, environ); /* SIGHUP merges them over the file again */
    int rc = px_server_run(s);
    px_server_destroy(s);
    px_otlp_stop(); /* exports what the last requests left, within its timeout */
    px_logsink_stop(2.0); /* the last lines, unless the log's reader stays stalled */
    px_config_cleanup(&cfg);
    return rc;
}
