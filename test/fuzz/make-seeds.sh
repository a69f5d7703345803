#!/usr/bin/env bash
# test/fuzz/make-seeds.sh — writes the committed seed corpora of the fuzz targets
# (test/fuzz/corpus/{ini,shard,ckpt}); run from the repository root after `make` (it uses
# build/nmt to write shards). The first byte of ini and ckpt inputs selects the harness's mode
# (see test/fuzz/fuzz_ini.c, fuzz_ckpt.c).
set -euo pipefail
cd "$(dirname "$0")/../.."
NMT=${NMT:-build/nmt}
C=test/fuzz/corpus
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p $C/ini $C/shard $C/ckpt

# ini: the shipped configs as files (mode 0), quoting/comment corners, and override lists (mode 1)
for f in conf/*.ini; do { printf '\0'; cat "$f"; } > $C/ini/conf-$(basename "$f" .ini); done
printf '\0[run]\nout_dir = "a b ; c"   ; trailing comment\nseed = 18446744073709551615\n[train]\nmax_steps = 10\nlabel_smoothing = 1e-3\n[model]\nnorm = pre\n' > $C/ini/quoting
printf '\0[train\nmax_steps\n=3\n[]\n' > $C/ini/broken
printf '\1train.max_steps=5\nmodel.norm=pre\nrun.out_dir=x{job}y\nparallel.device=cpu\ndata.valid=' > $C/ini/overrides

# shard: 2-byte ids, 4-byte ids, and zero pairs (version 2)
printf '5 6 7\n8 9\n4\n' > $tmp/a.ids; printf '7 6 5\n9 8\n4 4 4 4\n' > $tmp/b.ids
$NMT shard --vocab 10 $tmp/a.ids $tmp/b.ids $C/shard/small-u16
printf '70000 6\n99999\n' > $tmp/c.ids; printf '6 70000\n5\n' > $tmp/d.ids
$NMT shard --vocab 100000 $tmp/c.ids $tmp/d.ids $C/shard/small-u32
: > $tmp/e.ids; : > $tmp/f.ids
$NMT shard --vocab 10 $tmp/e.ids $tmp/f.ids $C/shard/empty
# and the version 1 layout of the first (no checksums, the 64-byte header: docs/formats.md),
# which nmt still reads
/usr/bin/env python3 - "$C/shard/small-u16" "$C/shard/v1-small-u16" <<'PY'
import struct, sys
b = open(sys.argv[1], "rb").read()
h = bytearray(b[:64])
struct.pack_into("<I", h, 8, 1)
for at in range(32, 64, 8):
    struct.pack_into("<Q", h, at, struct.unpack_from("<Q", h, at)[0] - 8)
open(sys.argv[2], "wb").write(bytes(h) + b[72:])
PY

# ckpt: valid files (layout: src/engine/checkpoint.c, docs/formats.md "Checkpoint format")
/usr/bin/env python3 - "$C/ckpt" <<'PY'
import struct, sys, zlib
out = sys.argv[1]
def ckpt(n, moments, step=7):
    h = bytearray(128)
    h[0:8] = b"NMTCKPT1"
    struct.pack_into("<II7if", h, 8, 1, moments, 40, 16, 2, 32, 2, 2, 0, 1.0)
    struct.pack_into("<Qqqqqq", h, 48, n, step, 0, 3, 7, 0)
    body = b"".join(struct.pack("<f", 0.25 * i - 1) for i in range(n * (3 if moments else 1)))
    data = bytes(h) + body
    return data + struct.pack("<I", zlib.crc32(data) & 0xffffffff)
def ckpt2(n, records):
    meta = b"".join(struct.pack("<I", len(k)) + k + struct.pack("<Q", len(v)) + v
                    for k, v in records)
    h = bytearray(128)
    h[0:8] = b"NMTCKPT1"
    struct.pack_into("<II7if", h, 8, 2, 0, 40, 16, 2, 32, 2, 2, 0, 1.0)
    struct.pack_into("<QqqqqqqQ", h, 48, n, 9, 0, 3, 7, 0, 0, len(meta))
    body = b"".join(struct.pack("<f", 0.5 * i) for i in range(n))
    data = bytes(h) + meta + body
    return data + struct.pack("<I", zlib.crc32(data) & 0xffffffff)
def put(name, data):
    open(f"{out}/{name}", "wb").write(data)
put("v2-meta-3", b"\0" + ckpt2(3, [(b"config", b"[model]\nvocab = 40\n"),
                                   (b"spm_model_path", b"a.model"), (b"spm_model", b"\0\1\2")]))
# the data record (the order a resume position refers to): shard bytes, crc32, max_tokens,
# max_len, world, accum, zero, n_pairs, n_batches, seed, then data.train
data = struct.pack("<QIiiiiIqqQ", 4096, 0x1234abcd, 64, 16, 2, 1, 0, 96, 15, 7) + b"a.shard"
put("v2-data-3", b"\0" + ckpt2(3, [(b"config", b"[model]\nvocab = 40\n"), (b"data", data)]))
put("moments-5", b"\0" + ckpt(5, 1))
put("params-3", b"\0" + ckpt(3, 0))
put("empty-0", b"\0" + ckpt(0, 0))
put("dir-latest", b"\1" + bytes([12]) + b"step_7.ckpt\n" + ckpt(4, 1))
put("dir-escape", b"\1" + bytes([4]) + b"../x" + ckpt(4, 1))
PY
ls $C/*
