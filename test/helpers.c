/* test/helpers.c — shared fixtures for the end-to-end tests (see helpers.h). */
#include "helpers.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "nmt/checkpoint.h"
#include "nmt/data.h"
#include "nmt/rng.h"
#include "test.h"

double nmt_th_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

nmt_status nmt_th_write_synthetic(const char *path, int n_pairs, uint64_t seed) {
  uint64_t *so = malloc((size_t)(n_pairs + 1) * sizeof *so);
  uint64_t *to = malloc((size_t)(n_pairs + 1) * sizeof *to);
  int32_t *src = malloc((size_t)n_pairs * 16 * sizeof *src);
  int32_t *tgt = malloc((size_t)n_pairs * 16 * sizeof *tgt);
  nmt_status s = NMT_ERR_NOMEM;
  if (so && to && src && tgt) {
    so[0] = to[0] = 0;
    for (int i = 0; i < n_pairs; i++) {
      int len = 2 + (int)(nmt_rng_u32(seed, 1, (uint64_t)i) % 11);
      for (int j = 0; j < len; j++) {
        uint32_t r = nmt_rng_u32(seed, 2, (uint64_t)(i * 16 + j));
        int32_t id = 4 + (int32_t)(r % (NMT_TH_VOCAB - 4));
        src[so[i] + (uint64_t)j] = id;
        tgt[to[i] + (uint64_t)(len - 1 - j)] = id;
      }
      so[i + 1] = so[i] + (uint64_t)len;
      to[i + 1] = to[i] + (uint64_t)len;
    }
    s = nmt_shard_write(path, NMT_TH_VOCAB, n_pairs, so, src, to, tgt);
  }
  free(so), free(to), free(src), free(tgt);
  return s;
}

int nmt_th_shard_to_v1(const char *v2_path, const char *v1_path) {
  size_t n = 0;
  char *b = nmt_th_read_file(v2_path, &n);
  uint32_t version = 0;
  if (b && n >= 72) memcpy(&version, b + 8, 4);
  if (!b || version != 2 || memcmp(b, NMT_SHARD_MAGIC, 8) != 0) {
    free(b);
    return -1;
  }
  /* The version 1 layout is version 2's without header bytes 64..71 (the CRCs): the version
   * is 1 and every section offset (target offsets, source ids, target ids, file size, at
   * bytes 32..63) 8 bytes less; 8-byte alignment is kept. */
  version = 1;
  memcpy(b + 8, &version, 4);
  for (int at = 32; at < 64; at += 8) {
    uint64_t v;
    memcpy(&v, b + at, 8);
    v -= 8;
    memcpy(b + at, &v, 8);
  }
  FILE *f = fopen(v1_path, "wb");
  int ok = f && fwrite(b, 1, 64, f) == 64 && fwrite(b + 72, 1, n - 72, f) == n - 72;
  if (f && fclose(f) != 0) ok = 0;
  free(b);
  return ok ? 0 : -1;
}

void nmt_th_shard_reseal(unsigned char *bytes, size_t size) {
  if (size < 72) return;
  uint32_t payload = (uint32_t)crc32(0L, bytes + 72, (uInt)(size - 72));
  memcpy(bytes + 64, &payload, 4);
  uint32_t header = (uint32_t)crc32(0L, bytes, 68);
  memcpy(bytes + 68, &header, 4);
}

/* 1 if the INI text `extra` sets `key` in `section` (a line "key = ..." under "[section]"; lines
 * before its first header continue the base's last section, [parallel]). */
static int extra_sets(const char *extra, const char *section, const char *key) {
  char sec[64] = "parallel";
  size_t kl = strlen(key);
  for (const char *p = extra; p && *p;) {
    const char *e = strchr(p, '\n');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    if (n > 2 && p[0] == '[' && p[n - 1] == ']')
      snprintf(sec, sizeof sec, "%.*s", (int)n - 2, p + 1);
    else if (!strcmp(sec, section) && n > kl && !strncmp(p, key, kl) &&
             (p[kl] == ' ' || p[kl] == '='))
      return 1;
    p = e ? e + 1 : NULL;
  }
  return 0;
}

int nmt_th_write_ini(const char *path, const char *out_dir, const char *shard, long max_steps,
                     const char *extra) {
  char base[2048];
  snprintf(base, sizeof base,
           "[run]\nout_dir = \"%s\"\nseed = 7\n"
           "[data]\ntrain = \"%s\"\nvalid = \"\"\nmax_tokens = 64\nmax_len = 16\n"
           "[model]\nvocab = %d\nd_model = 16\nn_heads = 2\nd_ff = 32\nenc_layers = 2\n"
           "dec_layers = 2\nmax_positions = 32\ndropout = 0.1\nattn_dropout = 0.1\n"
           "[train]\nmax_steps = %ld\nlog_every = 1\nvalid_every = 0\nsave_every = 0\n"
           "warmup_steps = 10\n"
           "[parallel]\ndevice = cpu\ndevices = 2\nbucket_mb = 0.01\n",
           out_dir, shard, NMT_TH_VOCAB, max_steps);
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  /* A key set twice is a config error: a key `extra` sets replaces the base line. */
  char sec[64] = "";
  for (char *p = base; *p;) {
    char *e = strchr(p, '\n');
    *e = 0;
    size_t n = strlen(p);
    if (p[0] == '[') {
      snprintf(sec, sizeof sec, "%.*s", (int)n - 2, p + 1);
    } else if (extra) {
      char key[64];
      snprintf(key, sizeof key, "%.*s", (int)strcspn(p, " ="), p);
      if (extra_sets(extra, sec, key)) {
        p = e + 1;
        continue;
      }
    }
    fprintf(f, "%s\n", p);
    p = e + 1;
  }
  if (extra) fputs(extra, f);
  return fclose(f) == 0 ? 0 : -1;
}

pid_t nmt_th_spawn(const char *const *argv, const char *log_path, const char *env_kv) {
  char exe[1024];
  snprintf(exe, sizeof exe, "%s/nmt", nmt_test_build_dir());
  const char *args[64];
  int n = 0;
  args[n++] = exe;
  for (int i = 0; argv[i] && n < 63; i++) args[n++] = argv[i];
  args[n] = NULL;
  fflush(stdout);
  pid_t pid = fork();
  if (pid != 0) return pid;
  /* child: fresh signal state (the test runner blocks nothing, but be explicit) */
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
  int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd >= 0) {
    dup2(fd, 1);
    dup2(fd, 2);
    close(fd);
  }
  if (env_kv) { /* "K=V" assignments separated by spaces; the child's own copy */
    char *copy = strdup(env_kv), *save = NULL;
    for (char *kv = copy ? strtok_r(copy, " ", &save) : NULL; kv; kv = strtok_r(NULL, " ", &save))
      putenv(kv);
  }
  execv(exe, (char *const *)args);
  _exit(127);
}

int nmt_th_wait(pid_t pid, double timeout_s, double *elapsed_s) {
  double t0 = nmt_th_now();
  for (;;) {
    int st;
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) {
      if (elapsed_s) *elapsed_s = nmt_th_now() - t0;
      if (WIFEXITED(st)) return WEXITSTATUS(st);
      if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
      return -1;
    }
    if (r < 0 && errno != EINTR) return -1;
    if (nmt_th_now() - t0 > timeout_s) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      if (elapsed_s) *elapsed_s = nmt_th_now() - t0;
      return -1;
    }
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
  }
}

int nmt_th_capture(const char *cmd, char *out, size_t n) {
  FILE *p = popen(cmd, "r");
  if (!p) return -1;
  size_t k = fread(out, 1, n - 1, p);
  out[k] = 0;
  char sink[4096];
  while (fread(sink, 1, sizeof sink, p) > 0) continue;
  int st = pclose(p);
  return st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

int nmt_th_count(const char *hay, const char *needle) {
  int n = 0;
  for (const char *p = hay; (p = strstr(p, needle)) != NULL; p += strlen(needle)) n++;
  return n;
}

int nmt_th_write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  int ok = fputs(text, f) >= 0;
  return fclose(f) == 0 && ok ? 0 : -1;
}

char *nmt_th_read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 4096, n = 0;
  char *buf = malloc(cap);
  size_t k;
  while (buf && (k = fread(buf + n, 1, cap - n - 1, f)) > 0) {
    n += k;
    if (cap - n - 1 == 0) {
      char *nb = realloc(buf, cap * 2);
      if (!nb) {
        free(buf);
        buf = NULL;
        break;
      }
      buf = nb;
      cap *= 2;
    }
  }
  fclose(f);
  if (buf) buf[n] = 0;
  if (len) *len = n;
  return buf;
}

int nmt_th_wait_for(const char *path, const char *text, pid_t pid, double timeout_s) {
  double t0 = nmt_th_now();
  while (nmt_th_now() - t0 < timeout_s) {
    char *s = nmt_th_read_file(path, NULL);
    int found = s && strstr(s, text);
    free(s);
    if (found) return 1;
    siginfo_t info;
    memset(&info, 0, sizeof info);
    if (pid > 0 && (waitid(P_PID, (id_t)pid, &info, WEXITED | WNOHANG | WNOWAIT) != 0 ||
                    info.si_pid == pid)) {
      /* exited (or error): one last look, the text may have been written just before */
      s = nmt_th_read_file(path, NULL);
      found = s && strstr(s, text);
      free(s);
      return found;
    }
    struct timespec ms = {0, 500000};
    nanosleep(&ms, NULL);
  }
  return 0;
}

static const char *json_value(const char *json, const char *key) {
  char pat[128];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *p = json ? strstr(json, pat) : NULL;
  if (!p) return NULL;
  p += strlen(pat);
  while (*p == ' ') p++;
  return p;
}

double nmt_th_json_num(const char *json, const char *key) {
  const char *p = json_value(json, key);
  if (!p || !strncmp(p, "null", 4)) return NAN;
  char *end;
  double v = strtod(p, &end);
  return end == p ? NAN : v;
}

int nmt_th_json_str(const char *json, const char *key, char *out, size_t cap) {
  const char *p = json_value(json, key);
  if (!p || *p != '"') return 0;
  p++;
  size_t n = 0;
  while (*p && *p != '"' && n + 1 < cap) {
    if (*p == '\\' && p[1]) p++;
    out[n++] = *p++;
  }
  out[n] = 0;
  return 1;
}

long nmt_th_ckpt_diff(const char *a, const char *b) {
  nmt_ckpt_header ha, hb;
  if (nmt_ckpt_read_header(a, &ha) != NMT_OK || nmt_ckpt_read_header(b, &hb) != NMT_OK) return -1;
  if (ha.n_params != hb.n_params || ha.has_moments != hb.has_moments) return -1;
  size_t n = (size_t)ha.n_params;
  float *pa = malloc(3 * n * sizeof(float) + 1), *pb = malloc(3 * n * sizeof(float) + 1);
  long diff = -1;
  if (pa && pb && nmt_ckpt_read(a, NULL, NULL, pa, pa + n, pa + 2 * n) == NMT_OK &&
      nmt_ckpt_read(b, NULL, NULL, pb, pb + n, pb + 2 * n) == NMT_OK) {
    size_t total = ha.has_moments ? 3 * n : n;
    diff = 0;
    for (size_t i = 0; i < total; i++) diff += memcmp(&pa[i], &pb[i], sizeof(float)) != 0;
  }
  free(pa), free(pb);
  return diff;
}

void nmt_th_tiny_config(nmt_config *c, const char *out_dir, const char *shard) {
  nmt_config_defaults(c);
  snprintf(c->run_out_dir, sizeof c->run_out_dir, "%s", out_dir);
  snprintf(c->data_train, sizeof c->data_train, "%s", shard);
  c->data_valid[0] = 0;
  c->data_max_tokens = 64;
  c->data_max_len = 16;
  c->model_vocab = NMT_TH_VOCAB;
  c->model_d_model = 16;
  c->model_n_heads = 2;
  c->model_d_ff = 32;
  c->model_enc_layers = 2;
  c->model_dec_layers = 2;
  c->model_max_positions = 32;
  c->model_dropout = c->model_attn_dropout = c->model_relu_dropout = 0;
  c->train_max_steps = 1;
  c->train_log_every = 1;
  c->train_valid_every = 0;
  c->train_save_every = 0;
  c->train_warmup_steps = 10;
  c->parallel_device = NMT_DEVICE_CPU;
  c->parallel_devices = 1;
  c->train_accum_steps = 1;
  c->parallel_bucket_mb = 0.01f;
  c->run_seed = 7;
}

nmt_status nmt_th_tiny_run(const char *dir, int n_pairs, uint64_t seed, nmt_config *c) {
  char shard[NMT_PATH_MAX], out[NMT_PATH_MAX];
  snprintf(shard, sizeof shard, "%s/syn.shard", dir);
  snprintf(out, sizeof out, "%s/run", dir);
  NMT_TRY(nmt_th_write_synthetic(shard, n_pairs, seed));
  nmt_th_tiny_config(c, out, shard);
  return NMT_OK;
}

nmt_status nmt_th_trainer_quiet(const nmt_config *c, nmt_metrics_fn on_metrics, void *user,
                                nmt_trainer **t) {
  nmt_trainer_options o;
  nmt_trainer_options_default(&o);
  o.quiet = 1;
  o.on_metrics = on_metrics;
  o.user = user;
  return nmt_trainer_create(c, &o, t);
}

int nmt_th_signal_each_thread(pid_t pid, int sig) {
  char dir[64];
  snprintf(dir, sizeof dir, "/proc/%d/task", (int)pid);
  DIR *d = opendir(dir);
  if (!d) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.' && syscall(SYS_tgkill, (int)pid, atoi(e->d_name), sig) == 0) n++;
  closedir(d);
  return n;
}
