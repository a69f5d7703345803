/* nmt/tensorboard.h — TensorBoard event files: the trainer's metrics as scalars that
 * `tensorboard --logdir runs/` shows while a run lives (rundir.c writes them where it writes
 * metrics.jsonl). One file is a sequence of TFRecords (TensorFlow's
 * tensorflow/core/lib/io/record_writer.cc): uint64 length (little endian), uint32 masked
 * CRC-32C of those 8 bytes, the data, uint32 masked CRC-32C of the data; each record's data a
 * tensorflow.Event (src/util/tb_event.proto, packed by protobuf-c), the first holding the file
 * version "brain.Event:2". CRC-32C (Castagnoli) comes from ISA-L (crc32_iscsi).
 *
 * defines: nmt_tb_writer, nmt_tb_scalar, nmt_tb_crc32c, nmt_tb_mask_crc, nmt_tb_open,
 *          nmt_tb_write, nmt_tb_flush, nmt_tb_path, nmt_tb_close, nmt_tb_remove_events
 */
#ifndef NMT_TENSORBOARD_H
#define NMT_TENSORBOARD_H

#include <stddef.h>
#include <stdint.h>

#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nmt_tb_writer nmt_tb_writer;

typedef struct {
  const char *tag;   /* "train/loss": TensorBoard groups tags by the part before '/' */
  double value;      /* written as float32 (simple_value); not finite: left out */
} nmt_tb_scalar;

/* CRC-32C (Castagnoli, reflected polynomial 0x82f63b78, initial and final XOR 0xffffffff; RFC
 * 3720 §B.4) of n bytes: 0xe3069283 for "123456789". */
uint32_t nmt_tb_crc32c(const void *p, size_t n);

/* TFRecord's mask of a CRC stored next to the data it covers: ((crc >> 15) | (crc << 17)) +
 * 0xa282ead8 (mod 2^32). */
uint32_t nmt_tb_mask_crc(uint32_t crc);

/* Creates directory `dir` if needed and a new event file in it,
 * events.out.tfevents.<unix seconds>.<hostname>.<pid>.<n> (n: the first that does not exist;
 * a file is never reopened or appended to), buffered, and writes its file-version record.
 * resume_step > 0 (a run continued after that step) also writes a SessionLog START at step
 * resume_step + 1, so TensorBoard drops what a crashed run logged past its checkpoint from the
 * files before this one. Errors: NMT_ERR_IO (directory or file), NMT_ERR_NOMEM. */
nmt_status nmt_tb_open(const char *dir, long resume_step, nmt_tb_writer **out);

/* Appends one event at `step` holding the n scalars whose values are finite (none: nothing is
 * written), wall_time in seconds since the epoch. Buffered: nmt_tb_flush makes it visible. A
 * write error is logged once as a warning and the writer writes nothing more: losing the
 * TensorBoard view must not end a run (metrics.jsonl keeps the record). */
void nmt_tb_write(nmt_tb_writer *w, long step, double wall_time, const nmt_tb_scalar *v, int n);

/* Hands the buffered records to the kernel (no fsync), so a reader sees them now. */
void nmt_tb_flush(nmt_tb_writer *w);

/* The event file's path. */
const char *nmt_tb_path(const nmt_tb_writer *w);

/* Flushes and closes; NULL is a no-op. */
void nmt_tb_close(nmt_tb_writer *w);

/* Deletes the event files (events.out.tfevents.*) in dir, as a run that starts over from step
 * 0 rewrites metrics.jsonl; other files are left. A missing dir is not an error; *removed gets
 * how many were deleted. Errors: NMT_ERR_IO (one that could not be). */
nmt_status nmt_tb_remove_events(const char *dir, int *removed);

#ifdef __cplusplus
}
#endif
#endif /* NMT_TENSORBOARD_H */
