/* test/helpers.h — shared fixtures for the end-to-end tests (test_api.c, test_reliability.c):
 * a synthetic corpus, a tiny-model INI, spawning build/nmt with a log file, and reading the
 * files a run writes.
 *
 * defines: nmt_th_write_synthetic, nmt_th_shard_to_v1, nmt_th_shard_reseal, nmt_th_write_ini,
 *          nmt_th_tiny_config, nmt_th_spawn, nmt_th_wait, nmt_th_wait_for, nmt_th_capture,
 *          nmt_th_count, nmt_th_write_file, nmt_th_read_file, nmt_th_json_num, nmt_th_json_str,
 *          nmt_th_ckpt_diff, NMT_TH_VOCAB
 */
#ifndef NMT_TEST_HELPERS_H
#define NMT_TEST_HELPERS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "nmt/config.h"
#include "nmt/status.h"
#include "nmt/trainer.h"

enum { NMT_TH_VOCAB = 40 };

/* A "reverse the sequence" shard of n_pairs pairs of 2..12 ids (vocab NMT_TH_VOCAB). */
nmt_status nmt_th_write_synthetic(const char *path, int n_pairs, uint64_t seed);

/* Writes to v1_path the version 1 shard (docs/formats.md: the 64-byte header, no checksums)
 * holding what the version 2 shard at v2_path holds, as nmt wrote shards before version 2:
 * the old shards users keep in data/. Returns 0 on success, -1 if v2_path is not a version 2
 * shard or a file cannot be read or written. */
int nmt_th_shard_to_v1(const char *v2_path, const char *v1_path);

/* Makes the CRC-32s in the `size` bytes of a version 2 shard right again after a test edited
 * them (docs/formats.md: the payload's, of bytes 72 to the end, at 64; then the header's, of
 * bytes 0..67, at 68), so that the edit reaches the checks behind them: a file whose CRCs are
 * right may still be wrong (made by hand, or by a writer's bug). Shorter inputs: left alone. */
void nmt_th_shard_reseal(unsigned char *bytes, size_t size);

/* An INI for a tiny model (d_model 16, 2+2 layers) on `shard`, run.out_dir = out_dir,
 * train.max_steps = max_steps, CPU workers; `extra` (may be NULL) is appended verbatim, one
 * "[section]\nkey = value" block per override the test needs, and a key it sets is left out
 * of the base (nmt refuses a key set twice). Returns 0 on success. */
int nmt_th_write_ini(const char *path, const char *out_dir, const char *shard, long max_steps,
                     const char *extra);

/* The engine tests' tiny setup in *c: defaults, then run.out_dir = out_dir, data.train = shard,
 * no validation set, max_tokens 64, max_len 16, vocab NMT_TH_VOCAB, d_model 16, 2 heads,
 * d_ff 32, 2+2 layers, max_positions 32, no dropout, 1 step, a log line per step, no
 * validation or checkpoint steps, warmup 10, one CPU worker, no accumulation, 0.01 MiB buckets,
 * seed 7. Tests override what they vary. */
void nmt_th_tiny_config(nmt_config *c, const char *out_dir, const char *shard);

/* The tiny setup on fresh data: a synthetic shard of n_pairs pairs (seed) written to
 * dir/syn.shard, and nmt_th_tiny_config(c, dir/run, that shard). Errors: the write's. */
nmt_status nmt_th_tiny_run(const char *dir, int n_pairs, uint64_t seed, nmt_config *c);

/* nmt_trainer_create with quiet default options and metrics going to on_metrics(user, ...)
 * (NULL: none). Errors: nmt_trainer_create's. */
nmt_status nmt_th_trainer_quiet(const nmt_config *c, nmt_metrics_fn on_metrics, void *user,
                                nmt_trainer **t);

/* Starts `nmt_build_dir()/nmt argv...` (argv NULL-terminated, without argv[0]) with stdout and
 * stderr appended to log_path, and optional extra environment "K=V" assignments separated by
 * spaces (NULL for none).
 * Returns the pid, or -1. */
pid_t nmt_th_spawn(const char *const *argv, const char *log_path, const char *env_kv);

/* Waits for pid up to timeout_s. Returns its exit code, 128+signal if killed, or -1 on
 * timeout (the child is then SIGKILLed and reaped). *elapsed_s (may be NULL) gets the time. */
int nmt_th_wait(pid_t pid, double timeout_s, double *elapsed_s);

/* Sends `sig` to every thread of pid (tgkill), as a signal sent to each thread arrives: one
 * copy per thread, none merged with another. Returns the number of threads signalled. */
int nmt_th_signal_each_thread(pid_t pid, int sig);

/* Polls until file `path` contains `text` (1) or timeout_s passes or pid exits (0). */
int nmt_th_wait_for(const char *path, const char *text, pid_t pid, double timeout_s);

/* Runs the shell command `cmd` (its own redirections decide what is captured), keeps the first
 * n-1 bytes of its stdout in out (NUL-terminated) and reads the rest to its end (a command
 * that floods its output still exits as itself, not by SIGPIPE). Returns its exit code, -1 if
 * it could not start or did not exit. */
int nmt_th_capture(const char *cmd, char *out, size_t n);

/* Non-overlapping occurrences of needle in hay. */
int nmt_th_count(const char *hay, const char *needle);

/* Writes text to path (replacing it). Returns 0 on success. */
int nmt_th_write_file(const char *path, const char *text);

/* The whole file as a NUL-terminated string (caller frees), NULL if unreadable. */
char *nmt_th_read_file(const char *path, size_t *len);

/* The number after "key": in a flat JSON object; NAN if absent or null. */
double nmt_th_json_num(const char *json, const char *key);
/* Copies the string value of "key" (unescaped only for plain text) to out; 0 if absent/null. */
int nmt_th_json_str(const char *json, const char *key, char *out, size_t cap);

/* Reads two checkpoints and compares their parameter and moment arrays bitwise: returns the
 * number of differing floats, or -1 if either cannot be read (message in nmt_last_error). */
long nmt_th_ckpt_diff(const char *a, const char *b);

/* Seconds on the monotonic clock. */
double nmt_th_now(void);

#endif /* NMT_TEST_HELPERS_H */
