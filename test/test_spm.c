/* test_spm.c — SentencePiece in process (include/nmt/spm.h): the ids it gives the Bible test
 * text equal the shard's, which tools/prepare-data.sh wrote through the spm_encode CLI (an
 * independent path); text survives encode + decode; bad models, bad ids and a vocabulary that
 * does not match are errors naming what is wrong, never a crash (exceptions stay in C++). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nmt/data.h"
#include "nmt/spm.h"
#include "test.h"

#define DIR "data/bible"

static int have_model(void) {
  if (access(DIR "/spm.model", R_OK) == 0 && access(DIR "/test.shard", R_OK) == 0) return 1;
  nmt_test_fail(__FILE__, __LINE__,
                DIR "/spm.model missing: run tools/prepare-bible.sh (make test does) from the "
                    "repository root");
  return 0;
}

/* Line k (0-based) of path without its newline, in buf. */
static int nth_line(const char *path, long k, char *buf, size_t cap) {
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  long i = 0;
  int ok = 0;
  while (fgets(buf, (int)cap, f)) {
    if (i++ == k) {
      buf[strcspn(buf, "\n")] = 0;
      ok = 1;
      break;
    }
  }
  fclose(f);
  return ok;
}

NMT_TEST(spm_encode_matches_shard) {
  if (!have_model()) return;
  nmt_spm *sp;
  nmt_shard *sh;
  NMT_ASSERT_OK(nmt_spm_load(DIR "/spm.model", &sp));
  NMT_ASSERT_EQ_INT(nmt_spm_vocab(sp), 8000);
  NMT_ASSERT_OK(nmt_spm_check_vocab(sp, 8000));
  NMT_ASSERT_OK(nmt_shard_open(DIR "/test.shard", 8000, &sh));
  const long n = nmt_shard_num_pairs(sh);
  const long picks[] = {0, 1, n / 2, n - 1};
  int32_t want[1024], got[1024];
  char line[8192];
  for (int side = 0; side < 2; side++)
    for (size_t p = 0; p < sizeof picks / sizeof picks[0]; p++) {
      long i = picks[p];
      NMT_ASSERT(nth_line(side ? DIR "/test.es" : DIR "/test.en", i, line, sizeof line));
      int len = side ? nmt_shard_tgt_len(sh, i) : nmt_shard_src_len(sh, i), k;
      NMT_ASSERT(len < 1024);
      if (side) nmt_shard_copy_tgt(sh, i, want);
      else nmt_shard_copy_src(sh, i, want);
      NMT_ASSERT_OK(nmt_spm_encode(sp, line, strlen(line), got, 1024, &k));
      NMT_ASSERT_EQ_INT(k, len);
      for (int j = 0; j < len; j++) NMT_ASSERT_EQ_INT(got[j], want[j]);
      /* Too small a buffer: the full count comes back, nothing is written past cap. */
      int32_t small[3] = {-1, -1, -1};
      NMT_ASSERT_OK(nmt_spm_encode(sp, line, strlen(line), small, 2, &k));
      NMT_ASSERT_EQ_INT(k, len);
      NMT_ASSERT_EQ_INT(small[2], -1);
    }
  nmt_shard_close(sh);
  nmt_spm_free(sp);
}

NMT_TEST(spm_round_trip_and_controls) {
  if (!have_model()) return;
  nmt_spm *sp;
  NMT_ASSERT_OK(nmt_spm_load(DIR "/spm.model", &sp));
  const char *text = "In the beginning, God created the heavens and the earth.";
  int32_t ids[256];
  int n;
  NMT_ASSERT_OK(nmt_spm_encode(sp, text, strlen(text), ids, 256, &n));
  NMT_ASSERT(n > 3 && n < 64);
  /* Control ids (pad, bos, eos) decode to nothing, as spm_decode does. */
  int32_t with_controls[260];
  with_controls[0] = 2;
  memcpy(with_controls + 1, ids, (size_t)n * sizeof *ids);
  with_controls[n + 1] = 3;
  with_controls[n + 2] = 0;
  char out[512];
  size_t len;
  NMT_ASSERT_OK(nmt_spm_decode(sp, with_controls, n + 3, out, sizeof out, &len));
  NMT_ASSERT(!strcmp(out, text));
  NMT_ASSERT_EQ_INT(len, strlen(text));
  /* A short buffer: truncated, NUL-terminated, full length reported. */
  char tiny[8];
  NMT_ASSERT_OK(nmt_spm_decode(sp, ids, n, tiny, sizeof tiny, &len));
  NMT_ASSERT_EQ_INT(len, strlen(text));
  NMT_ASSERT_EQ_INT(strlen(tiny), 7);
  /* Empty input and empty output. */
  NMT_ASSERT_OK(nmt_spm_encode(sp, "", 0, ids, 256, &n));
  NMT_ASSERT_EQ_INT(n, 0);
  NMT_ASSERT_OK(nmt_spm_decode(sp, ids, 0, out, sizeof out, &len));
  NMT_ASSERT_EQ_INT(len, 0);
  /* Bytes that are not UTF-8 still encode (the library maps them), without a crash. */
  const char bad[] = {'a', (char)0xff, (char)0xfe, 'b', 0};
  NMT_ASSERT_OK(nmt_spm_encode(sp, bad, 4, ids, 256, &n));
  nmt_spm_free(sp);
}

NMT_TEST(spm_errors_name_the_problem) {
  if (!have_model()) return;
  const char *dir = nmt_test_tmpdir();
  char path[512];
  nmt_spm *sp = NULL;
  snprintf(path, sizeof path, "%s/missing.model", dir);
  NMT_ASSERT_EQ_STATUS(nmt_spm_load(path, &sp), NMT_ERR_IO);
  NMT_ASSERT(strstr(nmt_last_error(), "missing.model") != NULL);
  NMT_ASSERT(sp == NULL);
  snprintf(path, sizeof path, "%s/garbage.model", dir);
  FILE *f = fopen(path, "w");
  NMT_ASSERT(f != NULL);
  fputs("this is not a protobuf\n", f);
  fclose(f);
  NMT_ASSERT_EQ_STATUS(nmt_spm_load(path, &sp), NMT_ERR_DATA);
  NMT_ASSERT(strstr(nmt_last_error(), "garbage.model") != NULL);
  NMT_ASSERT_EQ_STATUS(nmt_spm_load_bytes("\x0a\xff\xff\xff", 4, "blob", &sp), NMT_ERR_DATA);
  NMT_ASSERT(strstr(nmt_last_error(), "blob") != NULL);
  NMT_ASSERT_EQ_STATUS(nmt_spm_load(dir, &sp), NMT_ERR_DATA); /* a directory */
  /* Bytes of the real model load; a wrong vocabulary and ids outside it are refused. */
  size_t n = 0;
  char *bytes = NULL;
  f = fopen(DIR "/spm.model", "rb");
  NMT_ASSERT(f != NULL);
  fseek(f, 0, SEEK_END);
  n = (size_t)ftell(f);
  rewind(f);
  bytes = malloc(n);
  NMT_ASSERT(bytes && fread(bytes, 1, n, f) == n);
  fclose(f);
  NMT_ASSERT_OK(nmt_spm_load_bytes(bytes, n, "ckpt (embedded)", &sp));
  free(bytes);
  NMT_ASSERT(!strcmp(nmt_spm_name(sp), "ckpt (embedded)"));
  NMT_ASSERT_EQ_STATUS(nmt_spm_check_vocab(sp, 40), NMT_ERR_CONFIG);
  NMT_ASSERT(strstr(nmt_last_error(), "8000") && strstr(nmt_last_error(), "vocab = 40"));
  int32_t ids[2] = {5, 8000};
  char out[64];
  size_t len;
  NMT_ASSERT_EQ_STATUS(nmt_spm_decode(sp, ids, 2, out, sizeof out, &len), NMT_ERR_DATA);
  NMT_ASSERT(strstr(nmt_last_error(), "id 8000") != NULL);
  ids[1] = -1;
  NMT_ASSERT_EQ_STATUS(nmt_spm_decode(sp, ids, 2, out, sizeof out, &len), NMT_ERR_DATA);
  nmt_spm_free(sp);
}
