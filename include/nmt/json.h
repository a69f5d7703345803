/* nmt/json.h — the few JSON writers the engine's files need (metrics.jsonl, status.json,
 * eval results, bench rows). Writing, never parsing: RFC 8259 strings and numbers.
 *
 * defines: nmt_json_str, nmt_json_num
 */
#ifndef NMT_JSON_H
#define NMT_JSON_H

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Writes s as a JSON string literal: quotes, backslashes and control characters escaped
 * (RFC 8259 §7); other bytes as they are (UTF-8 passes through). */
void nmt_json_str(FILE *f, const char *s);

/* Writes `, "key": v` with printf format fmt, or `, "key": null` where v is not finite (JSON
 * has no NaN or infinity). */
void nmt_json_num(FILE *f, const char *key, double v, const char *fmt);

#ifdef __cplusplus
}
#endif
#endif /* NMT_JSON_H */
