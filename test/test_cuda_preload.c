/* test/test_cuda_preload.c — every kernel of cuda/ is preloaded (cuda/common.cuh, "Kernel
 * preload"): a source scan, so it runs without a GPU and in CPU-only builds.
 *
 * Lazy loading makes a kernel's first launch wait for the whole context; ctx_create loads the
 * kernels registered with NMT_CUDA_PRELOAD, so a kernel without an entry brings the hazard
 * back silently (on the H100, an op launched behind a held stream blocked until it was
 * released). The scan reads the .cu and .cuh files of cuda/ (from the repository root, where
 * the suite runs), without comments, string literals and preprocessor lines, and requires:
 *  - every __global__ function (its name: the last identifier before the parameter list,
 *    __launch_bounds__(...) skipped) has an entry in the same file, NMT_CUDA_PRELOAD(name) or
 *    NMT_CUDA_PRELOAD(name<...>);
 *  - every launch with explicit template arguments, name<args><<<...>>>, has the entry
 *    NMT_CUDA_PRELOAD(name<args>) (blanks ignored), unless an argument is a template
 *    parameter of the file (a launch inside a template, such as fill_kernel<T>: its
 *    instantiations are the ones to list). A launch whose arguments are deduced cannot be
 *    checked: the first rule still asks for an entry.
 * cuda_preload_scan_reports_missing runs the scanner on sources that break each rule. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"

enum { MAX_NAMES = 256, NAME_MAX_LEN = 128 };

typedef struct {
  char name[NAME_MAX_LEN];
  int line;
} named;

typedef struct {
  named kernels[MAX_NAMES];   /* __global__ functions */
  int n_kernels;
  named entries[MAX_NAMES];   /* NMT_CUDA_PRELOAD arguments, blanks removed */
  int n_entries;
  named launches[MAX_NAMES];  /* name<args> of launches with explicit arguments, no blanks */
  int n_launches;
  named params[MAX_NAMES];    /* template parameter names */
  int n_params;
  int unparsed;               /* __global__ tokens no name was found for */
} scan;

static int ident_start(char c) {
  return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}
static int ident_char(char c) { return ident_start(c) || (c >= '0' && c <= '9'); }
static int blank(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* Comments, string and character literals and preprocessor lines (with their continuations)
 * become blanks; newlines stay, so offsets keep their line numbers. In place. */
static void strip(char *s) {
  int bol = 1; /* only blanks since the last newline */
  for (char *p = s; *p;) {
    if (bol && *p == '#') {
      for (char prev = 0; *p && !(*p == '\n' && prev != '\\'); p++) {
        if (*p != '\n') prev = *p, *p = ' ';
      }
      continue;
    }
    if (p[0] == '/' && p[1] == '/') {
      while (*p && *p != '\n') *p++ = ' ';
      continue;
    }
    if (p[0] == '/' && p[1] == '*') {
      *p++ = ' ', *p++ = ' ';
      while (*p && !(p[0] == '*' && p[1] == '/')) {
        if (*p != '\n') *p = ' ';
        p++;
      }
      if (*p) *p++ = ' ', *p++ = ' ';
      continue;
    }
    if (*p == '"' || *p == '\'') {
      const char q = *p;
      *p++ = ' ';
      while (*p && *p != q && *p != '\n') {
        if (*p == '\\' && p[1]) *p++ = ' ';
        *p++ = ' ';
      }
      if (*p == q) *p++ = ' ';
      continue;
    }
    if (*p == '\n') bol = 1;
    else if (!blank(*p)) bol = 0;
    p++;
  }
}

static int line_of(const char *s, const char *p) {
  int n = 1;
  for (; s < p; s++) n += *s == '\n';
  return n;
}

/* Copies [a, b) without blanks into out (NAME_MAX_LEN). */
static void squeeze(char *out, const char *a, const char *b) {
  size_t n = 0;
  for (; a < b && n + 1 < NAME_MAX_LEN; a++)
    if (!blank(*a)) out[n++] = *a;
  out[n] = 0;
}

static void add(named *arr, int *n, const char *s, const char *a, const char *b, const char *at) {
  if (*n >= MAX_NAMES) return;
  squeeze(arr[*n].name, a, b);
  arr[*n].line = line_of(s, at);
  ++*n;
}

static int is_word(const char *s, const char *p, const char *w) {
  const size_t n = strlen(w);
  return !strncmp(p, w, n) && !ident_char(p[n]) && (p == s || !ident_char(p[-1]));
}

/* The closing bracket matching *p (one of "(<"), or NULL. */
static const char *match(const char *p) {
  const char open = *p, close = open == '(' ? ')' : '>';
  int depth = 0;
  for (; *p; p++) {
    if (*p == open) depth++;
    else if (*p == close && --depth == 0) return p;
  }
  return NULL;
}

/* Fills *sc from stripped source s. */
static void scan_text(const char *s, scan *sc) {
  memset(sc, 0, sizeof *sc);
  for (const char *p = s; *p; p++) {
    if (is_word(s, p, "__global__")) {
      const char *q = p + strlen("__global__"), *name = NULL, *name_end = NULL;
      while (*q && *q != '(' && *q != ';' && *q != '{') {
        if (is_word(s, q, "__launch_bounds__")) {
          q += strlen("__launch_bounds__");
          while (blank(*q)) q++;
          const char *e = *q == '(' ? match(q) : NULL;
          if (!e) break;
          q = e + 1;
        } else if (ident_start(*q) && (q == s || !ident_char(q[-1]))) {
          name = q;
          while (ident_char(*q)) q++;
          name_end = q;
        } else {
          q++;
        }
      }
      if (*q == '(' && name) add(sc->kernels, &sc->n_kernels, s, name, name_end, p);
      else sc->unparsed++;
    } else if (is_word(s, p, "NMT_CUDA_PRELOAD")) {
      const char *q = p + strlen("NMT_CUDA_PRELOAD");
      while (blank(*q)) q++;
      const char *e = *q == '(' ? match(q) : NULL;
      if (e) add(sc->entries, &sc->n_entries, s, q + 1, e, p);
    } else if (is_word(s, p, "template")) {
      /* template <typename A, class B, int N>: the names before ',' or '>' */
      const char *q = p + strlen("template");
      while (blank(*q)) q++;
      const char *e = *q == '<' ? match(q) : NULL;
      for (const char *a = q + 1; e && a < e;) {
        const char *c = a;
        while (c < e && *c != ',') c++;
        const char *last = NULL, *last_end = NULL;
        for (const char *t = a; t < c; t++)
          if (ident_start(*t) && !ident_char(t[-1])) {
            last = t;
            while (t < c && ident_char(*t)) t++;
            last_end = t--;
          }
        if (last) add(sc->params, &sc->n_params, s, last, last_end, p);
        a = c + 1;
      }
    } else if (!strncmp(p, "<<<", 3)) {
      const char *b = p;
      while (b > s && blank(b[-1])) b--;
      if (b > s && b[-1] == '>') {
        int depth = 0; /* back to the '<' that opens the template arguments */
        const char *lt = b - 1;
        for (; lt >= s; lt--) {
          if (*lt == '>') depth++;
          else if (*lt == '<' && --depth == 0) break;
        }
        const char *id = lt;
        while (id > s && blank(id[-1])) id--;
        const char *id_end = id;
        while (id > s && ident_char(id[-1])) id--;
        if (lt >= s && id < id_end) add(sc->launches, &sc->n_launches, s, id, b, p);
      }
      p += 2;
    }
  }
}

static int has(const named *arr, int n, const char *name) {
  for (int i = 0; i < n; i++)
    if (!strcmp(arr[i].name, name)) return 1;
  return 0;
}

/* 1 when one of the template arguments "<a,b,...>" (no blanks) is a template parameter of the
 * file (the launch sits inside a template: its instantiations are what must be listed). */
static int dependent(const scan *sc, const char *args) {
  char a[NAME_MAX_LEN];
  snprintf(a, sizeof a, "%s", args + 1);
  a[strlen(a) - 1] = 0; /* the closing '>' */
  for (char *save = NULL, *t = strtok_r(a, ",", &save); t; t = strtok_r(NULL, ",", &save))
    if (has(sc->params, sc->n_params, t)) return 1;
  return 0;
}

/* The rules of the header on stripped source s of `path`: each violation is reported as a
 * "# path:line: ..." line; returns their number. *n_kernels (may be NULL) gets the kernels
 * found. */
static int check_text(const char *path, const char *s, int *n_kernels) {
  static scan sc; /* large: not on the stack */
  scan_text(s, &sc);
  int bad = 0;
  if (sc.unparsed) {
    printf("# %s: %d __global__ without a name the scan can read\n", path, sc.unparsed);
    bad += sc.unparsed;
  }
  for (int i = 0; i < sc.n_kernels; i++) {
    const char *k = sc.kernels[i].name;
    const size_t n = strlen(k);
    int found = 0;
    for (int j = 0; j < sc.n_entries && !found; j++) {
      const char *e = sc.entries[j].name;
      found = !strncmp(e, k, n) && (e[n] == 0 || e[n] == '<');
    }
    if (!found) {
      printf("# %s:%d: kernel %s has no NMT_CUDA_PRELOAD(%s) entry\n", path,
             sc.kernels[i].line, k, k);
      bad++;
    }
  }
  for (int i = 0; i < sc.n_launches; i++) {
    const char *l = sc.launches[i].name;
    if (dependent(&sc, strchr(l, '<')) || has(sc.entries, sc.n_entries, l)) continue;
    printf("# %s:%d: launch of %s has no NMT_CUDA_PRELOAD(%s) entry\n", path,
           sc.launches[i].line, l, l);
    bad++;
  }
  if (n_kernels) *n_kernels = sc.n_kernels;
  return bad;
}

static char *slurp(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  char *s = NULL;
  if (fseek(f, 0, SEEK_END) == 0) {
    long n = ftell(f);
    if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (s = malloc((size_t)n + 1))) {
      if (fread(s, 1, (size_t)n, f) == (size_t)n) s[n] = 0;
      else free(s), s = NULL;
    }
  }
  fclose(f);
  return s;
}

static int ends_with(const char *s, const char *suffix) {
  const size_t n = strlen(s), m = strlen(suffix);
  return n >= m && !strcmp(s + n - m, suffix);
}

NMT_TEST(cuda_preload_covers_every_kernel) {
  DIR *d = opendir("cuda");
  if (!d) {
    nmt_test_fail(__FILE__, __LINE__, "cannot open cuda/ (the suite runs from the repository "
                                      "root)");
    return;
  }
  int files = 0, kernels = 0, bad = 0, unreadable = 0;
  for (struct dirent *e; (e = readdir(d));) {
    if (!ends_with(e->d_name, ".cu") && !ends_with(e->d_name, ".cuh")) continue;
    char path[512];
    snprintf(path, sizeof path, "cuda/%s", e->d_name);
    char *s = slurp(path);
    if (!s) {
      printf("# cannot read %s\n", path);
      unreadable++;
      continue;
    }
    strip(s);
    int k = 0;
    bad += check_text(path, s, &k);
    kernels += k;
    files++;
    free(s);
  }
  closedir(d);
  printf("# %d kernels in %d files of cuda/, %d missing preload entries\n", kernels, files, bad);
  NMT_ASSERT_EQ_INT(unreadable, 0);
  /* The scan finds what it should: cuda/ has had 30 and more kernels since the backend was
   * written; a scan that reads none passes nothing. */
  NMT_ASSERT(kernels >= 30);
  NMT_ASSERT_EQ_INT(bad, 0);
}

/* The scanner flags a kernel without an entry (with __launch_bounds__ and a template), an
 * explicit instantiation launched but not listed, and reads neither comments nor strings. */
NMT_TEST(cuda_preload_scan_reports_missing) {
  static const char src[] =
      "#define NMT_CUDA_PRELOAD(...) x(__VA_ARGS__)\n"
      "/* __global__ void in_comment(int); */\n"
      "static const char *s = \"__global__ void in_string(int)\";\n"
      "static __global__ void listed(float *x) {}\n"
      "NMT_CUDA_PRELOAD(listed);\n"
      "static __global__ void __launch_bounds__(256, 2)\n"
      "    unlisted(float *x) {}\n"
      "template <typename T, int N>\n"
      "static __global__ void tmpl(T *x) {}\n"
      "NMT_CUDA_PRELOAD(tmpl<float, 4>);\n"
      "template <typename T> void f(T *x) {\n"
      "  tmpl<T, 4><<<1, 1>>>(x);\n"        /* a template parameter: not checked */
      "  tmpl< float, 4 ><<<1, 1>>>(x);\n"  /* listed (blanks ignored) */
      "  tmpl<double, 4><<<1, 1>>>(x);\n"   /* not listed */
      "  listed<<<1, 1>>>(x);\n"
      "}\n";
  char *s = strdup(src);
  NMT_ASSERT(s);
  strip(s);
  int kernels = 0;
  const int bad = check_text("synthetic.cu", s, &kernels);
  free(s);
  NMT_ASSERT_EQ_INT(kernels, 3); /* listed, unlisted, tmpl */
  NMT_ASSERT_EQ_INT(bad, 2);     /* unlisted; tmpl<double,4> */
}
