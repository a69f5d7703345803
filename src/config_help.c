/* config_help.c — the schema table (config_schema.c) as text for people: `nmt config --help`
 * and docs/config.md (nmt_config_help), with each key's range as the parser's messages word it
 * (nmt__config_format_range, config.c). */
#include <stdio.h>
#include <string.h>

#include "config_impl.h"

/* The table of config_schema.c under a short name. */
static const key_spec *const schema = nmt__config_schema;

static const char *type_name(key_type t) {
  switch (t) {
    case T_INT: return "int";
    case T_LONG: return "long";
    case T_U64: return "u64";
    case T_FLOAT: return "float";
    case T_BOOL: return "bool";
    case T_STRING: return "string";
    case T_ENUM: return "enum";
    case T_DEVICES: return "count or list";
  }
  return "?";
}

/* Writes s with '|' escaped, for a markdown table cell. */
static void md_cell(FILE *out, const char *s) {
  for (; *s; s++) {
    if (*s == '|') fputc('\\', out);
    fputc(*s, out);
  }
}

void nmt_config_help(FILE *out, int markdown) {
  char range[256];
  if (markdown) {
    fputs("# nmt configuration reference\n\n"
          "<!-- Generated from the schema in src/config.c by nmt_config_help(out, 1). Do not "
          "edit by hand: the test config_docs_up_to_date fails when this file and the schema "
          "disagree. -->\n\n"
          "A run is configured by one or more INI files (`conf/*.ini`, and a corpus's "
          "`data.ini` from `tools/prepare-data.sh`) plus command-line overrides "
          "`section.key=value`: the files apply in the order given, a later file's value of a "
          "key replacing an earlier one's (`nmt train conf/bible-small.ini data/x/data.ini`, "
          "as Marian's `--config a.yml b.yml`), then the overrides in order. Only the value "
          "that takes effect is parsed, so a bad value that a later file or override replaces "
          "is no error. Every key has a default, so a file sets only what it changes; the "
          "trainer writes the effective configuration, every key with its doc, to "
          "`run.out_dir/config.ini`, which loads again as the only CONFIG.\n\n"
          "Parsing is strict, and every error names the file (or `command line`, or the "
          "checkpoint whose embedded config holds the value), section, key and value; a long "
          "value or path is shown cut in its middle, so the reason always ends the message:\n\n"
          "- unknown sections and keys are errors; sections and keys are case-insensitive in "
          "files (iniparser lowercases them) and lowercase in overrides;\n"
          "- a key set twice in a file (in any case) is an error naming both lines; a section "
          "may appear twice; among files and overrides the last one wins;\n"
          "- an empty file, or a line that is not `[section]`, `key = value` or a `;`/`#` "
          "comment, is an error naming the file and the first such line;\n"
          "- integers are decimal: `abc`, `12x`, `1e3`, an empty value and a leading zero "
          "(`042`, which C would read as octal 34) are rejected; `0` is fine;\n"
          "- floats are decimal (`0.1`, `1e-9`): `nan`, `inf`, hex floats and trailing junk are "
          "rejected;\n"
          "- bools are exactly one of `true false on off yes no 1 0`;\n"
          "- strings may be written in double quotes (needed when they contain `;` or `#`) and "
          "may not contain a double quote; a quote opened must be closed on its line, with "
          "nothing but a `;`/`#` comment after it;\n"
          "- values outside the range below are rejected, and after loading, cross-key "
          "constraints are checked: `model.d_model` divisible by `model.n_heads` and even, "
          "`data.max_tokens >= data.max_len`, `model.max_positions >= data.max_len`.\n\n"
          "Ranges: `[a, b]` includes both ends, `(` or `)` excludes that end.\n\n"
          "| section | key | type | default | range | doc |\n"
          "|---|---|---|---|---|---|\n",
          out);
    for (int i = 0; i < nmt__config_n_keys; i++) {
      const key_spec *k = &schema[i];
      nmt__config_format_range(k, range, sizeof range, 1);
      fprintf(out, "| %s | %s | %s | ", k->section, k->key, type_name(k->type));
      if (k->type == T_STRING)
        fprintf(out, "`\"%s\"`", k->def);
      else
        fprintf(out, "`%s`", k->def);
      fputs(" | ", out);
      md_cell(out, range);
      fputs(" | ", out);
      md_cell(out, k->doc);
      fputs(" |\n", out);
    }
    return;
  }
  fputs("Configuration keys (INI file sections; override with section.key=value):\n", out);
  for (int i = 0; i < nmt__config_n_keys; i++) {
    const key_spec *k = &schema[i];
    if (i == 0 || strcmp(schema[i - 1].section, k->section)) fprintf(out, "\n[%s]\n", k->section);
    nmt__config_format_range(k, range, sizeof range, 0);
    const char *label = k->type == T_ENUM || k->type == T_BOOL ? "one of "
                        : k->type == T_STRING                  ? ""
                                                               : "range ";
    fprintf(out, "  %s  (%s, default %s%s%s, %s%s)\n      %s\n", k->key, type_name(k->type),
            k->type == T_STRING ? "\"" : "", k->def, k->type == T_STRING ? "\"" : "", label,
            range, k->doc);
  }
}
