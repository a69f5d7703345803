/* config_scan.c — the INI file read once before iniparser reads it (config.c), for the two
 * things iniparser does not report well: a line it would reject (it reads on and prints two
 * lines per bad line, so a 2M-line corpus given as a config printed 4M lines; here the first
 * one is reported, with the file's name), a key set twice (iniparser keeps the last value
 * without a word) and a quoted value that is not closed or has text after its closing quote
 * (iniparser reads it as if it were closed, and drops that text). */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config_impl.h"

/* Up to 60 bytes of a line for a message: control bytes as '?', so that a binary file given
 * as a config does not write them to the terminal. */
static void printable(const char *line, char *out, size_t cap) {
  size_t n = 0;
  for (; line[n] && n < 60 && n + 4 < cap; n++)
    out[n] = (unsigned char)line[n] < 0x20 || line[n] == 0x7f ? '?' : line[n];
  if (line[n] && n + 4 < cap) memcpy(out + n++, "...", 3), n += 2;
  out[n] = 0;
}

/* A key's first line (for a key set twice). Sections and keys are compared lowercased and
 * trimmed, as iniparser stores them. */
typedef struct {
  char name[256]; /* "section:key" */
  int line;
} seen_key;

nmt_status nmt__config_scan_file(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return nmt_errorf(NMT_ERR_CONFIG, "%s: cannot open config: %s", path, strerror(errno));
  enum { KEYS_MAX = 1024 };
  seen_key *keys = malloc(KEYS_MAX * sizeof *keys);
  if (!keys) {
    fclose(f);
    return nmt_errorf(NMT_ERR_NOMEM, "%s: key table", path);
  }
  char line[4096], section[128] = "", shown[80];
  int lineno = 0, continued = 0, n_keys = 0, first = 1;
  nmt_status st = NMT_OK;
  while (st == NMT_OK && fgets(line, sizeof line, f)) {
    lineno++;
    size_t n = strlen(line);
    if (n >= 1024 && line[n - 1] != '\n') {
      st = nmt_errorf(NMT_ERR_CONFIG, "%s: line %d is longer than 1023 bytes%s", path, lineno,
                      first ? " (not an INI config?)" : "");
      break;
    }
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r' || line[n - 1] == ' ' ||
                     line[n - 1] == '\t'))
      line[--n] = 0;
    const char *p = line;
    while (*p == ' ' || *p == '\t') p++;
    int was_continued = continued;
    continued = n > 0 && line[n - 1] == '\\';
    if (was_continued || !*p || *p == ';' || *p == '#') continue;
    if (*p == '[' && line[n - 1] == ']') {
      size_t a = 1, b = strlen(p) - 1;
      while (a < b && (p[a] == ' ' || p[a] == '\t')) a++;
      while (b > a && (p[b - 1] == ' ' || p[b - 1] == '\t')) b--;
      snprintf(section, sizeof section, "%.*s", (int)(b - a), p + a);
      for (char *c = section; *c; c++) *c = (char)tolower((unsigned char)*c);
      first = 0;
      continue;
    }
    const char *eq = strchr(p, '=');
    if (!eq || eq == p) {
      printable(p, shown, sizeof shown);
      st = nmt_errorf(NMT_ERR_CONFIG,
                      "%s: line %d: \"%s\": expected [section], key = value, or a ; comment%s",
                      path, lineno, shown,
                      first ? " (not an INI config: a corpus or other file given in its place?)"
                            : "");
      break;
    }
    first = 0;
    /* iniparser takes `key = "runs/x` as if the quote were closed and drops what follows a
     * closing quote: both would be read as something the file does not say. (A line continued
     * with a backslash is left to iniparser, which joins it first.) */
    const char *v = eq + 1;
    while (*v == ' ' || *v == '\t') v++;
    if (!continued && (*v == '"' || *v == '\'')) {
      const char *close = strchr(v + 1, *v), *rest = close ? close + 1 : NULL;
      while (rest && (*rest == ' ' || *rest == '\t')) rest++;
      if (!close || (*rest && *rest != ';' && *rest != '#')) {
        printable(p, shown, sizeof shown);
        st = nmt_errorf(NMT_ERR_CONFIG, "%s: line %d: \"%s\": %s", path, lineno, shown,
                        close ? "text after the value's closing quote (only a ; or # comment "
                                "may follow it)"
                              : "the value's quote is never closed (close it on this line)");
        break;
      }
    }
    size_t kl = (size_t)(eq - p);
    while (kl > 0 && (p[kl - 1] == ' ' || p[kl - 1] == '\t')) kl--;
    char name[256];
    snprintf(name, sizeof name, "%s:%.*s", section, (int)kl, p);
    for (char *c = name; *c; c++) *c = (char)tolower((unsigned char)*c);
    for (int i = 0; i < n_keys; i++)
      if (!strcmp(keys[i].name, name)) {
        const char *key = strchr(name, ':') + 1;
        st = nmt_errorf(NMT_ERR_CONFIG,
                        "%s: [%s] %s is set twice, on line %d and on line %d: keep one (nmt "
                        "does not pick one of them)",
                        path, section, key, keys[i].line, lineno);
        break;
      }
    if (st == NMT_OK && n_keys < KEYS_MAX) {
      snprintf(keys[n_keys].name, sizeof keys[n_keys].name, "%s", name);
      keys[n_keys++].line = lineno;
    }
  }
  free(keys);
  fclose(f);
  return st;
}

