/* prof_trace.c — the profiler's Chrome trace (trace.json, for Perfetto and chrome://tracing):
 * nmt_prof_write_trace (include/nmt/prof.h) over every track's closed events, after the
 * threads are joined. */
#include <stdio.h>

#include "nmt/prof.h"
#include "prof_impl.h"

/* JSON string contents: quote, backslash and every byte outside printable ASCII escaped
 * (bytes >= 0x7f as \u00XX, i.e. read as Latin-1), so the file is valid JSON whatever the
 * names hold. */
static void json_escaped(FILE *f, const char *s) {
  for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
    if (*c == '"' || *c == '\\')
      fprintf(f, "\\%c", *c);
    else if (*c < 0x20 || *c >= 0x7f)
      fprintf(f, "\\u%04x", *c);
    else
      fputc(*c, f);
  }
}

nmt_status nmt_prof_write_trace(const nmt_prof *p, const char *path) {
  FILE *f = fopen(path, "w");
  if (!f) return nmt_errorf(NMT_ERR_IO, "profiler: cannot write the trace '%s'", path);
  fprintf(f, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
  fprintf(f, "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 1, \"tid\": 0, "
             "\"args\": {\"name\": \"nmt\"}}");
  for (int k = 0; k < p->n_tracks; k++) {
    const nmt_prof_track *t = p->tracks[k];
    fprintf(f, ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 1, \"tid\": %d, "
               "\"args\": {\"name\": \"", k + 1);
    json_escaped(f, t->name);
    fprintf(f, "\"}},\n{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": 1, \"tid\": %d, "
               "\"args\": {\"sort_index\": %d}}", k + 1, k);
  }
  for (int k = 0; k < p->n_tracks; k++) {
    const nmt_prof_track *t = p->tracks[k];
    for (size_t i = 0; i < t->n; i++) {
      const nmt__prof_event *e = &t->ev[i];
      if (!nmt__prof_closed(e)) continue;
      const char *ph = nmt_prof_phase_str((nmt_prof_phase)e->phase);
      fprintf(f, ",\n{\"name\": \"");
      json_escaped(f, p->names[e->name]);
      fprintf(f,
              "\", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": 1, \"tid\": %d, \"ts\": %.3f, "
              "\"dur\": %.3f, \"args\": {\"step\": %ld, \"phase\": \"%s\", \"flops\": %.17g, "
              "\"bytes\": %.17g}}",
              ph, k + 1, (double)(e->t0 - p->epoch) / 1e3, (double)(e->t1 - e->t0) / 1e3, e->step,
              ph, nmt__prof_finite_or_zero(e->flops), nmt__prof_finite_or_zero(e->bytes));
    }
  }
  fprintf(f, "\n]}\n");
  int bad = ferror(f);
  if (fclose(f) != 0 || bad)
    return nmt_errorf(NMT_ERR_IO, "profiler: error writing the trace '%s'", path);
  return NMT_OK;
}
