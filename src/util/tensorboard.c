/* tensorboard.c — TensorBoard event files (nmt/tensorboard.h): TFRecord framing around
 * protobuf-c's packing of the Event messages of tb_event.proto (generated at build time into
 * the build directory). */
#include "nmt/tensorboard.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <isa-l/crc.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nmt/log.h"
#include "tb_event.pb-c.h"

#define EVENTS_PREFIX "events.out.tfevents."

struct nmt_tb_writer {
  FILE *f;
  char path[PATH_MAX + 256];
  uint8_t *buf; /* one packed Event, reused */
  size_t cap;
  int failed;   /* a write failed: warned once, nothing more is written */
};

uint32_t nmt_tb_crc32c(const void *p, size_t n) {
  /* ISA-L's crc32_iscsi leaves the initial value and the final XOR to the caller (iSCSI
   * feeds a running CRC through); it takes an int length, hence the chunks. */
  uint32_t crc = 0xffffffffu;
  const unsigned char *b = p;
  while (n > 0) {
    const int len = n > (1u << 30) ? 1 << 30 : (int)n;
    crc = crc32_iscsi((unsigned char *)b, len, crc);
    b += len, n -= (size_t)len;
  }
  return crc ^ 0xffffffffu;
}

uint32_t nmt_tb_mask_crc(uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

static void put_le(uint8_t *p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void fail(nmt_tb_writer *w, const char *what) {
  if (!w->failed)
    nmt_log(NMT_LOG_WARN, "cannot %s %s: %s; TensorBoard's view of the run stops here "
            "(metrics.jsonl goes on)", what, w->path, strerror(errno));
  w->failed = 1;
}

/* One TFRecord of the packed event e. */
static void write_event(nmt_tb_writer *w, const Nmt__Tb__Event *e) {
  if (w->failed) return;
  const size_t n = nmt__tb__event__get_packed_size(e);
  if (n > w->cap) {
    uint8_t *b = realloc(w->buf, n);
    if (!b) {
      errno = ENOMEM;
      fail(w, "pack an event for");
      return;
    }
    w->buf = b, w->cap = n;
  }
  nmt__tb__event__pack(e, w->buf);
  uint8_t head[12], foot[4];
  put_le(head, n, 8);
  put_le(head + 8, nmt_tb_mask_crc(nmt_tb_crc32c(head, 8)), 4);
  put_le(foot, nmt_tb_mask_crc(nmt_tb_crc32c(w->buf, n)), 4);
  if (fwrite(head, 1, sizeof head, w->f) != sizeof head || fwrite(w->buf, 1, n, w->f) != n ||
      fwrite(foot, 1, sizeof foot, w->f) != sizeof foot)
    fail(w, "write");
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A new file events.out.tfevents.<seconds>.<host>.<pid>.<k>: never one that exists (two
 * writers in one process and second, a resume in the same second). */
static nmt_status create_file(nmt_tb_writer *w, const char *dir) {
  char host[256] = "localhost";
  if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "localhost");
  host[sizeof host - 1] = 0;
  for (char *c = host; *c; c++)
    if (*c == '/') *c = '_';
  const long sec = (long)time(NULL), pid = (long)getpid();
  for (int k = 0; k < 1000; k++) {
    snprintf(w->path, sizeof w->path, "%s/" EVENTS_PREFIX "%ld.%s.%ld.%d", dir, sec, host, pid,
             k);
    int fd = open(w->path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno == EEXIST) continue;
    if (fd < 0) return nmt_errorf(NMT_ERR_IO, "cannot create %s: %s", w->path, strerror(errno));
    w->f = fdopen(fd, "w");
    if (!w->f) {
      close(fd);
      return nmt_errorf(NMT_ERR_IO, "cannot open %s: %s", w->path, strerror(errno));
    }
    return NMT_OK;
  }
  return nmt_errorf(NMT_ERR_IO, "cannot create an event file in %s: 1000 names taken", dir);
}

nmt_status nmt_tb_open(const char *dir, long resume_step, nmt_tb_writer **out) {
  *out = NULL;
  if (mkdir(dir, 0777) != 0 && errno != EEXIST)
    return nmt_errorf(NMT_ERR_IO, "cannot create directory %s: %s", dir, strerror(errno));
  nmt_tb_writer *w = calloc(1, sizeof *w);
  if (!w) return nmt_errorf(NMT_ERR_NOMEM, "out of memory for the TensorBoard writer");
  nmt_status s = create_file(w, dir);
  if (s != NMT_OK) {
    free(w);
    return s;
  }
  Nmt__Tb__Event e = NMT__TB__EVENT__INIT;
  e.wall_time = now_s();
  e.what_case = NMT__TB__EVENT__WHAT_FILE_VERSION;
  e.file_version = "brain.Event:2";
  write_event(w, &e);
  if (resume_step > 0) {
    Nmt__Tb__SessionLog start = NMT__TB__SESSION_LOG__INIT;
    start.status = NMT__TB__SESSION_LOG__SESSION_STATUS__START;
    e.step = resume_step + 1;
    e.what_case = NMT__TB__EVENT__WHAT_SESSION_LOG;
    e.session_log = &start;
    write_event(w, &e);
  }
  nmt_tb_flush(w);
  if (w->failed) {
    nmt_tb_close(w);
    return nmt_errorf(NMT_ERR_IO, "cannot write the TensorBoard event file in %s", dir);
  }
  *out = w;
  return NMT_OK;
}

void nmt_tb_write(nmt_tb_writer *w, long step, double wall_time, const nmt_tb_scalar *v, int n) {
  if (w->failed || n <= 0) return;
  Nmt__Tb__Summary__Value *vals = calloc((size_t)n, sizeof *vals);
  Nmt__Tb__Summary__Value **ptrs = calloc((size_t)n, sizeof *ptrs);
  if (!vals || !ptrs) {
    free(vals), free(ptrs);
    errno = ENOMEM;
    fail(w, "write");
    return;
  }
  size_t k = 0;
  for (int i = 0; i < n; i++) {
    if (!isfinite(v[i].value)) continue;
    Nmt__Tb__Summary__Value one = NMT__TB__SUMMARY__VALUE__INIT;
    one.tag = (char *)v[i].tag;
    one.value_case = NMT__TB__SUMMARY__VALUE__VALUE_SIMPLE_VALUE;
    one.simple_value = (float)v[i].value;
    vals[k] = one;
    ptrs[k] = &vals[k];
    k++;
  }
  if (k > 0) {
    Nmt__Tb__Summary sum = NMT__TB__SUMMARY__INIT;
    sum.n_value = k;
    sum.value = ptrs;
    Nmt__Tb__Event e = NMT__TB__EVENT__INIT;
    e.wall_time = wall_time;
    e.step = step;
    e.what_case = NMT__TB__EVENT__WHAT_SUMMARY;
    e.summary = &sum;
    write_event(w, &e);
  }
  free(vals), free(ptrs);
}

void nmt_tb_flush(nmt_tb_writer *w) {
  if (!w->failed && fflush(w->f) != 0) fail(w, "write");
}

const char *nmt_tb_path(const nmt_tb_writer *w) { return w->path; }

void nmt_tb_close(nmt_tb_writer *w) {
  if (!w) return;
  nmt_tb_flush(w);
  if (fclose(w->f) != 0) fail(w, "close");
  free(w->buf);
  free(w);
}

nmt_status nmt_tb_remove_events(const char *dir, int *removed) {
  *removed = 0;
  DIR *d = opendir(dir);
  if (!d) return NMT_OK;
  nmt_status s = NMT_OK;
  struct dirent *e;
  while (s == NMT_OK && (e = readdir(d))) {
    if (strncmp(e->d_name, EVENTS_PREFIX, strlen(EVENTS_PREFIX))) continue;
    char p[PATH_MAX + 300];
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    if (unlink(p) == 0) (*removed)++;
    else if (errno != ENOENT)
      s = nmt_errorf(NMT_ERR_IO, "cannot delete %s: %s", p, strerror(errno));
  }
  closedir(d);
  return s;
}
