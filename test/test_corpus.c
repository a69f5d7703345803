/* test_corpus.c — the embedded English->Spanish Bible corpus as tools/prepare-bible.sh leaves it
 * in data/bible (make test runs that script first): the text, the book split, and the shards. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nmt/data.h"
#include "test.h"

#define DIR "data/bible"

static const char *const valid_books[] = {"Ruth", "Jonah", "Philippians", "Titus", NULL};
static const char *const test_books[] = {"Micah", "Joel", "Esther", "Colossians", "James",
                                         "I Peter", NULL};
static const char *const splits[] = {"train", "valid", "test"};

typedef struct {
  char **line;
  long n;
} lines;

static int read_lines(const char *path, lines *out) {
  out->line = NULL;
  out->n = 0;
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  long cap = 0;
  char *buf = NULL;
  size_t bcap = 0;
  ssize_t len;
  while ((len = getline(&buf, &bcap, f)) >= 0) {
    if (len > 0 && buf[len - 1] == '\n') buf[--len] = 0;
    if (out->n == cap) {
      cap = cap ? 2 * cap : 1024;
      out->line = realloc(out->line, (size_t)cap * sizeof *out->line);
    }
    out->line[out->n++] = strdup(buf);
  }
  free(buf);
  fclose(f);
  return 1;
}

static void free_lines(lines *l) {
  for (long i = 0; i < l->n; i++) free(l->line[i]);
  free(l->line);
}

/* Fails the test (and returns 0) unless prepare-bible.sh has run. */
static int have_corpus(void) {
  if (access(DIR "/train.en", R_OK) == 0) return 1;
  nmt_test_fail(__FILE__, __LINE__,
                DIR "/train.en missing: run tools/prepare-bible.sh (make test does) from the "
                    "repository root");
  return 0;
}

static int load(const char *split, const char *ext, lines *out) {
  char path[256];
  snprintf(path, sizeof path, DIR "/%s.%s", split, ext);
  if (read_lines(path, out)) return 1;
  nmt_test_fail(__FILE__, __LINE__, "cannot read %s: run tools/prepare-bible.sh", path);
  return 0;
}

/* "I Peter 1:3" -> is the book ("I Peter") in the list? */
static int book_in(const char *ref, const char *const *books) {
  const char *sp = strrchr(ref, ' ');
  if (!sp) return 0;
  size_t n = (size_t)(sp - ref);
  for (int i = 0; books[i]; i++)
    if (strlen(books[i]) == n && !strncmp(ref, books[i], n)) return 1;
  return 0;
}

NMT_TEST(corpus_genesis_1_1_exact) {
  if (!have_corpus()) return;
  lines ref, en, es;
  if (!load("train", "ref", &ref)) return;
  if (!load("train", "en", &en) || !load("train", "es", &es)) return;
  long at = -1;
  for (long i = 0; i < ref.n; i++)
    if (!strcmp(ref.line[i], "Genesis 1:1")) at = i;
  int ok = at >= 0 && at < en.n && at < es.n &&
           !strcmp(en.line[at], "In the beginning, God created the heavens and the earth.") &&
           !strcmp(es.line[at], "EN el principio crió Dios los cielos y la tierra.");
  if (!ok)
    nmt_test_fail(__FILE__, __LINE__, "Genesis 1:1 at line %ld: \"%s\" / \"%s\"", at + 1,
                  at >= 0 && at < en.n ? en.line[at] : "(none)",
                  at >= 0 && at < es.n ? es.line[at] : "(none)");
  free_lines(&ref);
  free_lines(&en);
  free_lines(&es);
}

NMT_TEST(corpus_no_glued_words_or_markup) {
  if (!have_corpus()) return;
  static const char *const bad[] = {"Godcreated", "Yahweh\xe2\x80\x99sword", "<", ">", "strong:",
                                    "\xc2\xb6" /* pilcrow */, "  ", NULL};
  for (int s = 0; s < 3; s++)
    for (int side = 0; side < 2; side++) {
      lines l;
      if (!load(splits[s], side ? "es" : "en", &l)) return;
      for (long i = 0; i < l.n; i++) {
        for (int k = 0; bad[k]; k++)
          if (strstr(l.line[i], bad[k])) {
            nmt_test_fail(__FILE__, __LINE__, "%s.%s:%ld contains \"%s\": %s", splits[s],
                          side ? "es" : "en", i + 1, bad[k], l.line[i]);
            free_lines(&l);
            return;
          }
        size_t len = strlen(l.line[i]);
        if (len == 0 || l.line[i][0] == ' ' || l.line[i][len - 1] == ' ') {
          nmt_test_fail(__FILE__, __LINE__, "%s.%s:%ld is empty or has edge spaces", splits[s],
                        side ? "es" : "en", i + 1);
          free_lines(&l);
          return;
        }
      }
      free_lines(&l);
    }
}

NMT_TEST(corpus_splits_counts_and_books) {
  if (!have_corpus()) return;
  long total = 0;
  for (int s = 0; s < 3; s++) {
    lines ref, en, es;
    if (!load(splits[s], "ref", &ref)) return;
    if (!load(splits[s], "en", &en) || !load(splits[s], "es", &es)) return;
    if (ref.n != en.n || ref.n != es.n)
      nmt_test_fail(__FILE__, __LINE__, "%s: %ld refs, %ld en, %ld es lines", splits[s], ref.n,
                    en.n, es.n);
    for (long i = 0; i < ref.n && !nmt_test_failed(); i++) {
      int v = book_in(ref.line[i], valid_books), t = book_in(ref.line[i], test_books);
      int want_v = s == 1, want_t = s == 2;
      if (v != want_v || t != want_t)
        nmt_test_fail(__FILE__, __LINE__, "%s.ref:%ld: \"%s\" is in the wrong split", splits[s],
                      i + 1, ref.line[i]);
    }
    if (!nmt_test_failed() && ref.n == 0)
      nmt_test_fail(__FILE__, __LINE__, "%s is empty", splits[s]);
    total += ref.n;
    free_lines(&ref);
    free_lines(&en);
    free_lines(&es);
    if (nmt_test_failed()) return;
  }
  if (total < 30000 || total > 32000)
    nmt_test_fail(__FILE__, __LINE__, "%ld pairs in all; expected 30,000..32,000", total);
}

/* Ids of one line through spm_encode, for an independent check of the shard contents. */
static int spm_ids(const char *text, int32_t *ids, int max) {
  char tmp[512], cmd[1024];
  snprintf(tmp, sizeof tmp, "%s/line.txt", nmt_test_tmpdir());
  FILE *f = fopen(tmp, "w");
  if (!f) return -1;
  fprintf(f, "%s\n", text);
  fclose(f);
  snprintf(cmd, sizeof cmd, "spm_encode --model=" DIR "/spm.model --output_format=id < '%s'", tmp);
  FILE *p = popen(cmd, "r");
  if (!p) return -1;
  int n = 0;
  long v;
  while (n < max && fscanf(p, "%ld", &v) == 1) ids[n++] = (int32_t)v;
  return pclose(p) == 0 ? n : -1;
}

NMT_TEST(corpus_shards_match_text) {
  if (!have_corpus()) return;
  for (int s = 0; s < 3; s++) {
    char path[256];
    snprintf(path, sizeof path, DIR "/%s.shard", splits[s]);
    nmt_shard *sh;
    NMT_ASSERT_OK(nmt_shard_open(path, 8000, &sh));
    lines en, es;
    if (!load(splits[s], "en", &en) || !load(splits[s], "es", &es)) {
      nmt_shard_close(sh);
      return;
    }
    int ok = nmt_shard_num_pairs(sh) == en.n;
    if (!ok)
      nmt_test_fail(__FILE__, __LINE__, "%s: %ld pairs, %ld text lines", path,
                    nmt_shard_num_pairs(sh), en.n);
    /* First and last pair: the shard holds exactly what spm_encode makes of the text. */
    long probe[2] = {0, en.n - 1};
    for (int k = 0; ok && k < 2; k++) {
      long i = probe[k];
      int32_t want[1024], got[1024];
      for (int side = 0; ok && side < 2; side++) {
        int n = spm_ids(side ? es.line[i] : en.line[i], want, 1024);
        int len = side ? nmt_shard_tgt_len(sh, i) : nmt_shard_src_len(sh, i);
        if (n < 0 || len != n || len > 1024) {
          nmt_test_fail(__FILE__, __LINE__, "%s pair %ld side %d: %d ids, spm_encode gives %d",
                        path, i, side, len, n);
          ok = 0;
          break;
        }
        if (side) nmt_shard_copy_tgt(sh, i, got);
        else nmt_shard_copy_src(sh, i, got);
        if (memcmp(got, want, (size_t)n * sizeof *got)) {
          nmt_test_fail(__FILE__, __LINE__, "%s pair %ld side %d: ids differ from spm_encode",
                        path, i, side);
          ok = 0;
        }
      }
    }
    nmt_shard_close(sh);
    free_lines(&en);
    free_lines(&es);
    if (!ok) return;
  }
}
