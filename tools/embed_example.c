/* tools/embed_example.c — embedding libnmt in another program, through include/nmt/nmt.h only.
 *
 *   build/embed_example CONFIG [CONFIG ...] [section.key=value ...]
 *
 * Trains in chunks of 10 optimizer steps, evaluating on [data] valid (if set) after each
 * chunk, saves a checkpoint at the end, and leaves the process exit code to the library's
 * table (0 done, 75 stopped by a signal with a checkpoint written, ...). Log lines arrive
 * through a callback and are re-prefixed, to show where they would go in a host program;
 * metrics arrive through another. Several CONFIGs apply in order, a later file's keys
 * replacing an earlier one's (nmt_session_open_files), as `nmt train` takes them. `make test`
 * builds this against build/libnmt.so and runs it (test/test_api.c, api_embed_example_runs). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "nmt/nmt.h"

typedef struct {
  long log_lines;
  long metrics_records;
  double last_loss;
} host_state;

static void on_log(void *user, nmt_log_level level, const char *line) {
  host_state *h = user;
  h->log_lines++;
  fprintf(stderr, "[host] nmt/%d: %s\n", (int)level, line);
}

static void on_metrics(void *user, const nmt_metrics *m) {
  host_state *h = user;
  h->metrics_records++;
  h->last_loss = m->train_loss;
}

/* Prints the failing call and the library's message; returns the exit code to use. */
static int report(const char *call, nmt_status s) {
  fprintf(stderr, "embed_example: %s: %s (%s): %s\n", call, nmt_status_str(s), nmt_status_desc(s),
          nmt_last_error());
  return nmt_status_exit_code(s);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: embed_example CONFIG [CONFIG ...] [section.key=value ...]\n");
    return 2;
  }
  host_state h = {0, 0, NAN};
  nmt_session_options opt;
  nmt_session_options_default(&opt);
  opt.handle_signals = 1;
  opt.quiet = 1;
  opt.on_log = on_log;
  opt.on_metrics = on_metrics;
  opt.user = &h;
  nmt_session *s;
  /* The CONFIG files come first; the overrides (section.key=value) after them. */
  int n_configs = 1;
  while (1 + n_configs < argc && !strchr(argv[1 + n_configs], '=')) n_configs++;
  const char *const *args = (const char *const *)argv + 1;
  nmt_status st = nmt_session_open_files(args, n_configs, args + n_configs, argc - 1 - n_configs,
                                         &opt, &s);
  if (st != NMT_OK) return report("nmt_session_open", st);

  long step = 0, max_steps = 0;
  int has_valid = 1;
  for (;;) {
    st = nmt_session_train(s, 10);
    if (st != NMT_OK) break;
    nmt_session_progress(s, &step, &max_steps);
    double loss = NAN, nll = NAN;
    if (has_valid) {
      nmt_status e = nmt_session_evaluate(s, &loss, &nll);
      if (e == NMT_ERR_CONFIG) has_valid = 0; /* no [data] valid: skip evaluation */
      else if (e != NMT_OK) {
        st = e;
        break;
      }
    }
    printf("step %ld/%ld train_loss %.4f valid_loss %.4f valid_ppl %.2f\n", step, max_steps,
           h.last_loss, loss, exp(nll));
    if (step >= max_steps) break;
  }
  int code = 0;
  nmt_session_progress(s, &step, NULL);
  if (st == NMT_OK) {
    char path[1024];
    st = nmt_session_save(s, path, sizeof path);
    if (st == NMT_OK) printf("saved %s\n", path);
  }
  if (st == NMT_STOPPED) printf("stopped by a signal at step %ld; checkpoint written\n", step);
  else if (st != NMT_OK) code = report("training", st);
  if (st == NMT_STOPPED) code = nmt_status_exit_code(st);
  printf("log lines %ld, metrics records %ld\n", h.log_lines, h.metrics_records);
  nmt_session_close(s);
  return code;
}
