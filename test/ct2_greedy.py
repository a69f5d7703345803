#!/usr/bin/env python3
"""ct2_greedy.py: CTranslate2's side of test/test_export_ct2.c.

  ct2_greedy.py CT2_DIR SRC.ids MAX_LEN OUT.ids [TGT.ids SCORES]

SRC.ids: one sentence of SentencePiece ids per line (nmt translate --ids's input); each is fed
as its pieces plus "</s>", as nmt feeds `x EOS`. OUT.ids: CTranslate2's greedy output (beam 1,
at most MAX_LEN tokens, <pad> and <s> suppressed, as nmt never outputs them) as ids, one line
each. With TGT.ids (nmt's outputs for the same lines): SCORES gets, per line, the teacher-forced
log p(y|x) in nats of that target as CTranslate2 scores it (score_batch), as the sum over its
tokens and the final </s> when the target ended on one (shorter than MAX_LEN), else over its
tokens alone, as nmt's decoder sums them.
"""
import sys

import ctranslate2


def main(argv):
    if len(argv) not in (5, 7):
        sys.stderr.write(__doc__.split("\n\n")[1] + "\n")
        return 2
    model, src, max_len, out = argv[1], argv[2], int(argv[3]), argv[4]
    tr = ctranslate2.Translator(model, device="cpu", compute_type="default", inter_threads=1,
                                intra_threads=2)
    import json
    with open(model + "/shared_vocabulary.json", encoding="utf-8") as f:
        pieces = json.load(f)
    index = {p: i for i, p in enumerate(pieces)}
    with open(src) as f:
        batch = [[pieces[int(x)] for x in line.split()] + ["</s>"] for line in f]
    res = tr.translate_batch(batch, beam_size=1, max_batch_size=64, batch_type="examples",
                             max_decoding_length=max_len,
                             suppress_sequences=[["<pad>"], ["<s>"]])
    with open(out, "w") as f:
        for r in res:
            f.write(" ".join(str(index[p]) for p in r.hypotheses[0]) + "\n")
    if len(argv) == 7:
        with open(argv[5]) as f:
            tgt = [[pieces[int(x)] for x in line.split()] for line in f]
        scored = tr.score_batch(batch, tgt, max_batch_size=64, batch_type="examples")
        with open(argv[6], "w") as f:
            for t, s in zip(tgt, scored):
                lp = s.log_probs if len(t) < max_len else s.log_probs[: len(t)]
                f.write("%.6f\n" % sum(lp))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
