/* translate.c — `nmt translate`: streaming translation of a file, a pipe or a terminal
 * (include/nmt/translate.h). Lines are read into windows, decoded in length-sorted batches by
 * the rig of translate_batch.c, and written in input order, a window at a time.
 *
 * Batches of a window are decoded by parallel.devices rigs at once, one thread each (one
 * device each; on the CPU, workers of one core each: OpenBLAS then runs one thread per call, as
 * in training, instead of splitting every small GEMM of a decoding step across the cores,
 * whose idle threads spin). Each rig writes its batches' slots of the window; the main thread
 * reads, writes and encodes.
 *
 * Reading uses read(2) and poll(2) on the descriptor rather than stdio, for two reasons: a
 * window must close when the input pauses (poll with a zero timeout says whether more is
 * ready), and a stop request must be seen while waiting for input (waits are polls of at most
 * STOP_POLL_MS, since the signal may be delivered to another thread, such as an OpenBLAS one,
 * and then interrupts no read of ours). */
#include "nmt/translate.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nmt/log.h"
#include "translate_impl.h"

/* The reference backend's GEMMs are OpenBLAS's (src/engine/trainer.c sets it the same way). */
void openblas_set_num_threads(int num_threads);

enum {
  STOP_POLL_MS = 100,   /* longest wait for input between looks at the stop flag */
  FILE_WINDOWS = 16,    /* a regular file's window: this many batches (length sorting) */
  READ_CHUNK = 1 << 16,
};

void nmt_translate_options_default(nmt_translate_options *o) {
  memset(o, 0, sizeof *o);
  o->size = sizeof *o;
  o->input = "-";
  o->output = "-";
}

static int stopped(const nmt_translate_options *o) { return o->stop && atomic_load(o->stop); }

/* ------------------------------------------------------------------------------------------ */
/* input lines */

typedef struct {
  const char *name;
  int fd, own, eof, regular;
  char *buf;
  size_t pos, len, cap;
  long line; /* lines returned so far */
  long bad_utf8; /* raw-text lines that were not valid UTF-8 */
} line_reader;

static nmt_status reader_open(line_reader *r, const char *path) {
  memset(r, 0, sizeof *r);
  r->name = strcmp(path, "-") ? path : "stdin";
  r->fd = strcmp(path, "-") ? open(path, O_RDONLY | O_CLOEXEC) : STDIN_FILENO;
  if (r->fd < 0) return nmt_errorf(NMT_ERR_IO, "cannot read %s: %s", path, strerror(errno));
  r->own = r->fd != STDIN_FILENO;
  struct stat sb;
  if (fstat(r->fd, &sb) == 0 && S_ISDIR(sb.st_mode))
    return nmt_errorf(NMT_ERR_IO, "cannot read %s: it is a directory", path);
  r->regular = fstat(r->fd, &sb) == 0 && S_ISREG(sb.st_mode);
  return NMT_OK;
}

static void reader_close(line_reader *r) {
  if (r->own && r->fd >= 0) close(r->fd);
  free(r->buf);
}

static int have_line(const line_reader *r) {
  return memchr(r->buf + r->pos, '\n', r->len - r->pos) != NULL;
}

/* 1 if next_line would return without waiting: a whole line is buffered, the input ended, or
 * the descriptor has data (or end of file) ready. */
static int line_ready(const line_reader *r) {
  if (r->eof || (r->buf && have_line(r))) return 1;
  struct pollfd p = {.fd = r->fd, .events = POLLIN};
  return poll(&p, 1, 0) > 0;
}

/* Reads more bytes, waiting in slices of STOP_POLL_MS; NMT_STOPPED when asked to stop. */
static nmt_status fill(line_reader *r, const nmt_translate_options *o) {
  if (r->pos > 0) {
    memmove(r->buf, r->buf + r->pos, r->len - r->pos);
    r->len -= r->pos, r->pos = 0;
  }
  if (r->cap - r->len < READ_CHUNK) {
    size_t nc = r->cap ? 2 * r->cap : 2 * READ_CHUNK;
    char *nb = realloc(r->buf, nc);
    if (!nb) return nmt_errorf(NMT_ERR_NOMEM, "line buffer of %zu bytes (%s)", nc, r->name);
    r->buf = nb, r->cap = nc;
  }
  for (;;) {
    if (stopped(o)) return NMT_STOPPED;
    if (!r->regular) {
      struct pollfd p = {.fd = r->fd, .events = POLLIN};
      int k = poll(&p, 1, STOP_POLL_MS);
      if (k == 0 || (k < 0 && errno == EINTR)) continue;
    }
    /* One byte stays free: next_line ends a last line that has no newline with a NUL. */
    ssize_t k = read(r->fd, r->buf + r->len, r->cap - r->len - 1);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k < 0) return nmt_errorf(NMT_ERR_IO, "cannot read %s: %s", r->name, strerror(errno));
    if (k == 0) r->eof = 1;
    r->len += (size_t)k;
    return NMT_OK;
  }
}

/* The next line without its newline (and '\r') in *line (valid until the next call), *got 0 at
 * the end of the input. */
static nmt_status next_line(line_reader *r, const nmt_translate_options *o, char **line,
                            size_t *n, int *got) {
  *got = 0;
  while (!(r->buf && have_line(r)) && !r->eof) NMT_TRY(fill(r, o));
  if (r->pos == r->len) return NMT_OK; /* eof, nothing left */
  char *s = r->buf + r->pos, *nl = memchr(s, '\n', r->len - r->pos);
  size_t len = nl ? (size_t)(nl - s) : r->len - r->pos;
  r->pos += len + (nl != NULL);
  if (len > 0 && s[len - 1] == '\r') len--;
  s[len] = 0; /* inside the buffer: the newline's byte, or the spare room fill keeps */
  *line = s, *n = len, *got = 1;
  r->line++;
  return NMT_OK;
}

enum { UTF8_WARNINGS = 5 }; /* invalid lines named one by one; the rest are counted */

/* The offset of the first byte of s[0, n) that does not start or continue a well-formed UTF-8
 * sequence (Unicode 15 §3.9, table 3-7: no overlong forms, no surrogates, nothing above
 * U+10FFFF), or n when all of it is well formed. */
static size_t utf8_invalid_at(const unsigned char *s, size_t n) {
  for (size_t i = 0; i < n;) {
    const unsigned c = s[i];
    size_t len;
    unsigned lo = 0x80, hi = 0xBF; /* the range of the second byte */
    if (c < 0x80) len = 1;
    else if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      lo = c == 0xE0 ? 0xA0 : 0x80; /* not overlong */
      hi = c == 0xED ? 0x9F : 0xBF; /* not a surrogate */
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      lo = c == 0xF0 ? 0x90 : 0x80; /* not overlong */
      hi = c == 0xF4 ? 0x8F : 0xBF; /* not above U+10FFFF */
    }
    else return i;
    if (len > n - i) return i;
    for (size_t k = 1; k < len; k++)
      if (s[i + k] < (k == 1 ? lo : 0x80) || s[i + k] > (k == 1 ? hi : 0xBF)) return i;
    i += len;
  }
  return n;
}

/* Warns about a raw-text line that is not valid UTF-8, naming the first few by line and byte
 * (1-based); the line is still translated (docs/decoding.md "Invalid UTF-8"). */
static void check_utf8(line_reader *r, const char *line, size_t len) {
  const size_t at = utf8_invalid_at((const unsigned char *)line, len);
  if (at == len) return;
  if (r->bad_utf8++ < UTF8_WARNINGS)
    nmt_log(NMT_LOG_WARN, "%s:%ld: invalid UTF-8 at byte %zu (0x%02x); translated, "
            "SentencePiece reading each bad byte as U+FFFD%s", r->name, r->line, at + 1,
            (unsigned)(unsigned char)line[at],
            r->bad_utf8 == UTF8_WARNINGS ? "; further such lines are counted at the end" : "");
}

/* An id line, strictly: digits separated by spaces or tabs, each < vocab. */
static nmt_status parse_ids(const line_reader *r, const char *s, size_t len, int vocab,
                            nmt__sentence *out) {
  out->ids = malloc((len / 2 + 2) * sizeof(int32_t));
  if (!out->ids) return nmt_errorf(NMT_ERR_NOMEM, "ids of line %ld", r->line);
  const char *p = s;
  for (;;) {
    while (*p == ' ' || *p == '\t') p++;
    if (!*p) return NMT_OK;
    char *end;
    errno = 0;
    long x = strtol(p, &end, 10);
    if (end == p || errno || x < 0 || x >= vocab || *p == '-' || *p == '+' ||
        (*end && *end != ' ' && *end != '\t'))
      return nmt_errorf(NMT_ERR_DATA, "%s:%ld: \"%.*s\" is not an id in [0, %d)", r->name,
                        r->line, (int)strcspn(p, " \t"), p, vocab);
    out->ids[out->len++] = (int32_t)x;
    p = end;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* output */

typedef struct {
  FILE *f;
  const char *name;
  char *text;
  size_t cap;
} writer;

/* One hypothesis as text (SentencePiece) or ids. */
static nmt_status put_hyp(writer *w, const nmt_translate_options *o, const int32_t *ids, int n) {
  if (o->ids) {
    for (int t = 0; t < n; t++) fprintf(w->f, t ? " %d" : "%d", ids[t]);
    return NMT_OK;
  }
  size_t len;
  NMT_TRY(nmt_spm_decode(o->spm, ids, n, w->text, w->cap, &len));
  if (len >= w->cap) {
    free(w->text);
    w->cap = 2 * len + 64;
    if (!(w->text = malloc(w->cap))) return nmt_errorf(NMT_ERR_NOMEM, "hypothesis text");
    NMT_TRY(nmt_spm_decode(o->spm, ids, n, w->text, w->cap, &len));
  }
  fwrite(w->text, 1, len, w->f);
  return NMT_OK;
}

/* Writes the window's translations in input order, up to the first slot not decoded (all of
 * them unless stopped), and flushes. first: the 0-based index of the window's first line. */
static nmt_status write_window(writer *w, nmt_translate_options *o, const nmt__hyps *h, int n,
                               long first) {
  for (int i = 0; i < n && h->n[i] >= 0; i++) {
    const int K = o->nbest ? h->n[i] : 1;
    for (int q = 0; q < K; q++) {
      const size_t s = (size_t)i * h->K + q;
      if (o->nbest) fprintf(w->f, "%ld ||| ", first + i);
      NMT_TRY(put_hyp(w, o, h->ids + s * h->max_out, h->len[s]));
      /* Moses / Marian n-best fields: the raw log p as feature F0, then the length-normalised
       * score the search ranks by (docs/decoding.md "n-best and scores"). */
      if (o->nbest || o->scores)
        fprintf(w->f, " ||| F0= %.4f ||| %.4f", (double)h->logp[s], (double)h->score[s]);
      fputc('\n', w->f);
    }
    o->translated++;
  }
  if (fflush(w->f) != 0 || ferror(w->f))
    return nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", w->name, strerror(errno));
  return NMT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* the loop */

/* Reads one window: up to cap lines; on a pipe or terminal it closes early when no further
 * line is ready. Returns NMT_STOPPED (with the lines read so far) when asked to stop. */
static nmt_status read_window(line_reader *r, nmt_translate_options *o, int vocab, int cap,
                              nmt__sentence *s, int *n, int *end) {
  *n = 0;
  while (*n < cap) {
    if (*n > 0 && !line_ready(r)) break;
    char *line;
    size_t len;
    int got;
    NMT_TRY(next_line(r, o, &line, &len, &got));
    if (!got) {
      *end = 1;
      break;
    }
    nmt__sentence *x = &s[(*n)++];
    memset(x, 0, sizeof *x);
    x->line = r->line;
    if (o->ids) NMT_TRY(parse_ids(r, line, len, vocab, x));
    else {
      check_utf8(r, line, len);
      NMT_TRY(nmt__encode_line(o->spm, line, len, &x->ids, &x->len));
    }
  }
  return NMT_OK;
}

/* One window's batches, taken in turn by the rigs' threads. */
typedef struct {
  struct session *x;
  const nmt_translate_options *o;
  int n, bs;
  atomic_int next;   /* the next batch to take */
  atomic_int failed; /* a rig failed: the others take no more */
} window_job;

typedef struct {
  window_job *job;
  nmt__rig *rig;
  nmt_status st;
  int started;   /* a thread of its own runs it */
  char msg[512]; /* the failing thread's message (nmt_last_error is per thread) */
} decode_worker;

typedef struct session {
  line_reader in;
  writer out;
  nmt__rig *rigs; /* n_rigs decoders, one per device of parallel.devices */
  int n_rigs;
  decode_worker *workers; /* n_rigs: the decoding threads' state */
  pthread_t *threads;
  nmt__hyps hyps;
  nmt__sentence *sents;
  int *order, cap;
  float *host;
  /* an ensemble's further checkpoints: their setups (embedded configs) and parameters */
  nmt_ckpt_setup *mem;
  float **mem_host;
  int n_mem;
} session;

static void session_close(session *x) {
  for (int i = 0; x->rigs && i < x->n_rigs; i++) nmt__rig_close(&x->rigs[i]);
  free(x->rigs), free(x->workers), free(x->threads);
  nmt__hyps_free(&x->hyps);
  reader_close(&x->in);
  if (x->out.f && x->out.f != stdout) fclose(x->out.f);
  free(x->out.text), free(x->sents), free(x->order), free(x->host);
  for (int i = 0; i < x->n_mem; i++) {
    nmt_ckpt_setup_free(&x->mem[i]);
    free(x->mem_host[i]);
  }
  free(x->mem), free(x->mem_host);
}

/* The SentencePiece model a checkpoint was trained with, as nmt_translate compares them. */
static int same_spm(const nmt_ckpt_meta *a, const nmt_ckpt_meta *b) {
  if (a->spm_model && b->spm_model)
    return a->spm_model_bytes == b->spm_model_bytes &&
           !memcmp(a->spm_model, b->spm_model, a->spm_model_bytes);
  return !strcmp(a->spm_model_path ? a->spm_model_path : "",
                 b->spm_model_path ? b->spm_model_path : "");
}

/* An ensemble's further checkpoints (o->ensemble): each one's embedded config and parameters,
 * checked against the first model's (cfg, ckpt). Fills e for nmt__rig_open_ensemble. */
static nmt_status open_members(session *x, const nmt_config *cfg, const char *ckpt,
                               const nmt_translate_options *o, nmt__ensemble *e) {
  memset(e, 0, sizeof *e);
  if (!o->ensemble || o->n_ensemble == 0) return NMT_OK;
  if (o->n_ensemble < 0 || o->n_ensemble > NMT__ENSEMBLE_MAX - 1)
    return nmt_errorf(NMT_ERR_USAGE, "--ensemble: %d checkpoints (at most %d)",
                      o->n_ensemble + 1, NMT__ENSEMBLE_MAX);
  for (int i = 0; o->weights && i <= o->n_ensemble; i++)
    if (!(o->weights[i] > 0 && o->weights[i] < 1e30f))
      return nmt_errorf(NMT_ERR_USAGE, "--weights: weight %d is %g (a positive number needed)",
                        i + 1, (double)o->weights[i]);
  x->mem = calloc((size_t)o->n_ensemble, sizeof *x->mem);
  x->mem_host = calloc((size_t)o->n_ensemble, sizeof *x->mem_host);
  if (!x->mem || !x->mem_host) return nmt_errorf(NMT_ERR_NOMEM, "ensemble");
  nmt_ckpt_header h0;
  nmt_ckpt_meta m0 = {0};
  NMT_TRY(nmt_ckpt_read_meta(ckpt, &h0, &m0));
  nmt_status st = NMT_OK;
  for (int i = 0; i < o->n_ensemble && st == NMT_OK; i++) {
    const char *path = o->ensemble[i];
    st = nmt_ckpt_setup_load(path, NULL, 0, NULL, 0, &x->mem[i]);
    if (st != NMT_OK) break;
    x->n_mem = i + 1;
    const nmt_config *ci = &x->mem[i].cfg;
    if (ci->model_vocab != cfg->model_vocab)
      st = nmt_errorf(NMT_ERR_CHECKPOINT, "--ensemble: %s has model.vocab %d, %s has %d: the "
                      "models of an ensemble share one vocabulary", path, ci->model_vocab, ckpt,
                      cfg->model_vocab);
    else if (!same_spm(&x->mem[i].meta, &m0))
      st = nmt_errorf(NMT_ERR_CHECKPOINT, "--ensemble: %s was trained with the SentencePiece "
                      "model %s, %s with %s (other bytes): the models of an ensemble share one",
                      path, x->mem[i].meta.spm_model_path ? x->mem[i].meta.spm_model_path : "-",
                      ckpt, m0.spm_model_path ? m0.spm_model_path : "-");
    else if (ci->model_max_positions < cfg->model_max_positions)
      st = nmt_errorf(NMT_ERR_CHECKPOINT, "--ensemble: %s has model.max_positions %d, fewer "
                      "than %s's %d", path, ci->model_max_positions, ckpt,
                      cfg->model_max_positions);
    if (st != NMT_OK) break;
    nmt_model_cfg mc;
    nmt_model_cfg_from_config(ci, &mc);
    const size_t n = nmt_model_num_params(&mc);
    nmt_ckpt_header expect, h;
    nmt_ckpt_expect_from_config(ci, &expect);
    if (!(x->mem_host[i] = malloc(n * sizeof(float)))) {
      st = nmt_errorf(NMT_ERR_NOMEM, "%zu parameters of %s", n, path);
      break;
    }
    st = nmt_ckpt_read(x->mem[i].ckpt, &expect, &h, x->mem_host[i], NULL, NULL);
    if (st != NMT_OK) break;
    nmt_log(NMT_LOG_INFO, "ensemble member %d: %s (step %ld)", i + 2, x->mem[i].ckpt,
            (long)h.step);
    e->cfg[i] = ci;
    e->host[i] = x->mem_host[i];
  }
  nmt_ckpt_meta_free(&m0);
  e->n = st == NMT_OK ? o->n_ensemble : 0;
  e->weights = o->weights;
  return st;
}

/* Checkpoint, input, output, rig and window buffers. */
static nmt_status session_open(session *x, const nmt_config *cfg, const char *ckpt,
                               nmt_translate_options *o) {
  nmt_model_cfg mc;
  nmt_model_cfg_from_config(cfg, &mc);
  const size_t n_params = nmt_model_num_params(&mc);
  const int bs = cfg->decode_batch_sentences, K = o->nbest ? o->nbest : 1;
  nmt_ckpt_header expect, h;
  nmt_ckpt_expect_from_config(cfg, &expect);
  if (!(x->host = malloc(n_params * sizeof(float))))
    return nmt_errorf(NMT_ERR_NOMEM, "%zu parameters", n_params);
  NMT_TRY(nmt_ckpt_read(ckpt, &expect, &h, x->host, NULL, NULL));
  nmt_log(NMT_LOG_INFO, "translating with %s (step %ld)", ckpt, (long)h.step);
  nmt__ensemble ens;
  NMT_TRY(open_members(x, cfg, ckpt, o, &ens));
  NMT_TRY(reader_open(&x->in, o->input));
  x->out.name = strcmp(o->output, "-") ? o->output : "stdout";
  x->out.f = strcmp(o->output, "-") ? fopen(o->output, "w") : stdout;
  if (!x->out.f) return nmt_errorf(NMT_ERR_IO, "cannot write %s: %s", o->output, strerror(errno));
  x->cap = x->in.regular ? FILE_WINDOWS * bs : bs;
  x->sents = calloc((size_t)x->cap, sizeof *x->sents);
  x->order = malloc((size_t)x->cap * sizeof *x->order);
  if (!x->sents || !x->order) return nmt_errorf(NMT_ERR_NOMEM, "window of %d lines", x->cap);
  NMT_TRY(nmt__hyps_alloc(&x->hyps, x->cap, K, cfg->data_max_len - 1 > 0 ? cfg->data_max_len - 1 : 1));
  const int n = nmt_device_infer_ranks(cfg);
  const nmt_backend *be;
  NMT_TRY(nmt_device_select(cfg, n, NMT_DEVICE_INFER, &be));
  /* One OpenBLAS thread per CPU decoder, one decoder or several: the decoders are the
   * parallelism (parallel.devices), and a translation does not depend on the machine's core
   * count (OpenBLAS's threaded sgemm picks other kernels for the edges of the blocks it hands
   * each thread, which moved n-best scores in the 4th decimal on some CPUs). */
  if (be->is_host) openblas_set_num_threads(1);
  x->rigs = calloc((size_t)n, sizeof *x->rigs);
  x->workers = calloc((size_t)n, sizeof *x->workers);
  x->threads = calloc((size_t)n, sizeof *x->threads);
  if (!x->rigs || !x->workers || !x->threads) return nmt_errorf(NMT_ERR_NOMEM, "%d decoders", n);
  x->n_rigs = n;
  for (int i = 0; i < n; i++)
    NMT_TRY(nmt__rig_open_ensemble(&x->rigs[i], cfg, be, i, NULL, x->host, K,
                                   o->scores || o->nbest, &ens));
  return NMT_OK;
}

static void *decode_batches(void *p) {
  decode_worker *w = p;
  window_job *j = w->job;
  w->st = NMT_OK;
  while (!atomic_load(&j->failed) && !stopped(j->o)) {
    const int i0 = atomic_fetch_add(&j->next, 1) * j->bs;
    if (i0 >= j->n) break;
    w->st = nmt__rig_decode(w->rig, j->x->sents, j->x->order + i0,
                            j->n - i0 < j->bs ? j->n - i0 : j->bs, &j->x->hyps);
    if (w->st != NMT_OK) {
      snprintf(w->msg, sizeof w->msg, "%s", nmt_last_error());
      atomic_store(&j->failed, 1);
    }
  }
  return NULL;
}

/* Decodes the window's n sorted sentences: rig 0 on this thread, the others on their own. */
static nmt_status decode_window(session *x, const nmt_translate_options *o, int n, int bs) {
  /* Room for the window's longest source first: its sorted batches then share one arena. */
  for (int i = 0; i < x->n_rigs && n > 0; i++)
    NMT_TRY(nmt__rig_prepare(&x->rigs[i], x->sents[x->order[n - 1]].len, n));
  window_job j = {.x = x, .o = o, .n = n, .bs = bs};
  atomic_init(&j.next, 0);
  atomic_init(&j.failed, 0);
  decode_worker *w = x->workers;
  /* No more threads than batches; a thread that cannot start leaves its batches to the rest. */
  const int busy = (n + bs - 1) / bs < x->n_rigs ? (n + bs - 1) / bs : x->n_rigs;
  for (int i = 0; i < x->n_rigs; i++) {
    w[i] = (decode_worker){.job = &j, .rig = &x->rigs[i]};
    w[i].started = i > 0 && i < busy &&
                   pthread_create(&x->threads[i], NULL, decode_batches, &w[i]) == 0;
  }
  decode_batches(&w[0]);
  for (int i = 1; i < x->n_rigs; i++)
    if (w[i].started) pthread_join(x->threads[i], NULL);
  for (int i = 0; i < x->n_rigs; i++)
    if (w[i].st != NMT_OK) return nmt_errorf(w[i].st, "%s", w[i].msg);
  return NMT_OK;
}

static double seconds_between(struct timespec a, struct timespec b) {
  return (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
}

nmt_status nmt_translate(const nmt_config *cfg, const char *ckpt, nmt_translate_options *o) {
  o->translated = 0;
  if (o->nbest < 0 || o->nbest > cfg->decode_beam)
    return nmt_errorf(NMT_ERR_USAGE, "--nbest %d: must be in [1, decode.beam = %d] (raise "
                      "decode.beam for more hypotheses)", o->nbest, cfg->decode_beam);
  if (!o->ids && !o->spm)
    return nmt_errorf(NMT_ERR_USAGE, "raw-text translation needs a SentencePiece model "
                      "([data] spm_model, or one the checkpoint carries), or --ids");
  session x = {0};
  nmt_status st = NMT_OK;
  int end = 0, n = 0;
  long total = 0;
  /* Wall time from the start; the process's CPU time (every thread) at the start and once the
   * decoders are open, so the log can say what decoding itself cost, as a library's
   * translate call is timed (bench/ctranslate2.sh). */
  struct timespec t0, t1, c0, c1, c2;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
  NMT_TRY_GOTO(st, session_open(&x, cfg, ckpt, o), out);
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
  const int bs = cfg->decode_batch_sentences;
  while (!end && st == NMT_OK) {
    st = read_window(&x.in, o, cfg->model_vocab, x.cap, x.sents, &n, &end);
    if (st != NMT_OK && st != NMT_STOPPED) goto out;
    if (st == NMT_STOPPED || n == 0) break;
    nmt__sort_by_len(x.sents, x.order, n);
    for (int i = 0; i < n; i++) x.hyps.n[i] = -1;
    NMT_TRY_GOTO(st, decode_window(&x, o, n, bs), out);
    NMT_TRY_GOTO(st, write_window(&x.out, o, &x.hyps, n, total), out);
    for (int i = 0; i < n; i++) free(x.sents[i].ids), x.sents[i].ids = NULL;
    total += n, n = 0;
    nmt_log(NMT_LOG_DEBUG, "translated %ld lines", total);
    if (stopped(o)) st = NMT_STOPPED;
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c2);
  const double secs = seconds_between(t0, t1), open_cpu = seconds_between(c0, c1);
  const double decode_cpu = seconds_between(c1, c2);
  long cut = 0, tokens = 0;
  for (int i = 0; i < x.n_rigs; i++) cut += x.rigs[i].cut, tokens += x.rigs[i].out_tokens;
  if (cut > 0)
    nmt_log(NMT_LOG_WARN, "%ld sources longer than data.max_len - 1 = %d ids were cut", cut,
            cfg->data_max_len - 1);
  if (x.in.bad_utf8 > 0)
    nmt_log(NMT_LOG_WARN, "%s: %ld input lines were not valid UTF-8 (the first %d are named "
            "above)", x.in.name, x.in.bad_utf8,
            x.in.bad_utf8 < UTF8_WARNINGS ? (int)x.in.bad_utf8 : UTF8_WARNINGS);
  nmt_log(NMT_LOG_INFO,
          "decoded %ld sentences (%ld tokens) in %.2f s on %d %s decoder(s): %.1f sentences/s, "
          "beam %d, length penalty %.2f, %d sentences per batch; CPU time %.2f s decoding, "
          "%.2f s opening (checkpoint, decoders)",
          o->translated, tokens, secs, x.n_rigs, x.rigs[0].dev.be ? x.rigs[0].dev.be->name : "-",
          secs > 0 ? (double)o->translated / secs : 0.0, cfg->decode_beam,
          cfg->decode_beam > 1 ? (double)cfg->decode_length_penalty : 0.0, bs, decode_cpu,
          open_cpu);
out:
  for (int i = 0; i < n; i++) free(x.sents[i].ids);
  session_close(&x);
  return st;
}

nmt_status nmt_translate_file(const nmt_config *cfg, const char *ckpt, const char *in_path,
                              const char *out_path, int ids) {
  nmt_ckpt_setup s;
  nmt_spm *spm = NULL;
  /* The caller's config, and its checkpoint (or the newest of run.out_dir/checkpoints). */
  memset(&s, 0, sizeof s);
  s.cfg = *cfg;
  if (ckpt) {
    snprintf(s.ckpt, sizeof s.ckpt, "%s", ckpt);
  } else {
    char dir[NMT_PATH_MAX + 16];
    snprintf(dir, sizeof dir, "%s/checkpoints", cfg->run_out_dir);
    NMT_TRY(nmt_ckpt_find_latest(dir, s.ckpt));
  }
  nmt_status st = NMT_OK;
  if (!ids) {
    NMT_TRY(nmt_ckpt_read_meta(s.ckpt, &s.header, &s.meta));
    st = nmt_ckpt_setup_spm(&s, &spm);
  }
  nmt_translate_options o;
  nmt_translate_options_default(&o);
  o.input = in_path, o.output = out_path, o.ids = ids, o.spm = spm;
  if (st == NMT_OK) st = nmt_translate(cfg, s.ckpt, &o);
  nmt_spm_free(spm);
  nmt_ckpt_setup_free(&s);
  return st;
}
