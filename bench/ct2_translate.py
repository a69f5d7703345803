#!/usr/bin/env python3
"""ct2_translate.py: one timed CTranslate2 decoding run for bench/ctranslate2.sh.

  ct2_translate.py CT2_DIR SRC.ids OUT.ids BEAM INTER INTRA DEVICE MAX_LEN [LENGTH_PENALTY]

SRC.ids: one sentence of SentencePiece ids per line (nmt translate --ids's input, without EOS);
each becomes its pieces plus "</s>", as nmt's sources are `x EOS`. OUT.ids: the best hypothesis
of each line as ids. BEAM 1 is greedy. INTER, INTRA: CTranslate2's inter_threads (batches
decoded at once) and intra_threads (threads per batch). DEVICE: cpu or cuda. MAX_LEN: the longest
output (nmt's data.max_len - 1). LENGTH_PENALTY: the beam's exponent alpha (default 0.6, nmt's
decode.length_penalty; 0: hypotheses ranked by log p alone).
Decoding as nmt's: batches of 64 sentences sorted by length (CTranslate2 sorts when
max_batch_size is set), <pad> and <s> never output (suppress_sequences), length penalty alpha
under the beam (CTranslate2 divides by length^alpha, nmt by GNMT's ((5 + n) / 6)^alpha: the
beams may rank differently unless alpha = 0; greedy has no penalty).
Prints one JSON object: cpu_s (user + system of this process over the decoding calls alone,
getrusage), wall_s, sentences, tokens (output tokens, EOS excluded).
"""
import json
import resource
import sys
import time

import ctranslate2


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv):
    if len(argv) not in (9, 10):
        sys.stderr.write(__doc__.split("\n\n")[1] + "\n")
        return 2
    model, src, out, beam, inter, intra, device, max_len = argv[1:9]
    beam, inter, intra, max_len = int(beam), int(inter), int(intra), int(max_len)
    alpha = float(argv[9]) if len(argv) == 10 else 0.6
    translator = ctranslate2.Translator(model, device=device, compute_type="float32",
                                        inter_threads=inter, intra_threads=intra)
    with open(model + "/shared_vocabulary.json", encoding="utf-8") as f:
        pieces = json.load(f)
    index = {p: i for i, p in enumerate(pieces)}
    batch = []
    with open(src) as f:
        for line in f:
            batch.append([pieces[int(x)] for x in line.split()] + ["</s>"])
    opts = dict(beam_size=beam, max_batch_size=64, batch_type="examples",
                max_decoding_length=max_len, suppress_sequences=[["<pad>"], ["<s>"]])
    if beam > 1:
        opts["length_penalty"] = alpha
    c0, t0 = cpu_seconds(), time.perf_counter()
    results = translator.translate_batch(batch, **opts)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    tokens = 0
    with open(out, "w") as f:
        for r in results:
            ids = [index[p] for p in r.hypotheses[0]]
            tokens += len(ids)
            f.write(" ".join(map(str, ids)) + "\n")
    print(json.dumps({"cpu_s": round(cpu, 3), "wall_s": round(wall, 3), "sentences": len(batch),
                      "tokens": tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
