#!/usr/bin/env python3
"""Extract an aligned English-Spanish verse corpus from two SWORD modules.

Usage:
  tools/prepare-bible.py --en RAW_EN.imp --es RAW_ES.imp --out data/bible

RAW_*.imp are the outputs of `mod2imp engWEB2015eb` (World English Bible, 2015) and
`mod2imp spaRV1909eb` (Reina-Valera 1909). Each entry starts with a line "$$$Book C:V"; the
text is OSIS XML fragments. Writes OUT/{train,valid,test}.{en,es,ref}: one verse per line, in
canonical book order; .ref holds "Book C:V" for each line.

Text cleaning (see docs/formats.md "Bible corpus"):
  * footnotes and cross references (<note>), non-canonical headings (<title>) and speaker
    labels (<speaker>) are dropped with their content; canonical psalm superscriptions
    (<title canonical="true">) are kept, because the Spanish module has them as plain text of
    verse 1 and dropping them on one side only would misalign the pair;
  * every other tag is removed. Where markup sat between two characters with no whitespace,
    a space is inserted only if the markup marked a boundary: a dropped element, a structural
    tag (div, l, lg, lb, milestone, chapter, ... or any self-closing tag), or one inline element
    ending and another starting (WEB "God</w><note>..</note><w>created", RV
    "allí</w><transChange>también</transChange><w>bdelio"). An inline element that merely opens
    or closes inside a word ("preguntándo<transChange>le</transChange>") inserts nothing.
    Such a boundary never puts a space after opening punctuation or before closing punctuation.
  * RV1909 enclitic pronouns split off into <transChange> are joined back to their verb
    ("sáca</w><transChange>lo</transChange>" -> "sácalo"; see ENCLITIC_RE).
  * XML entities are decoded, pilcrows removed, whitespace collapsed, no space is left before
    , . ; : ? ! ) and text after the end of a book (the WEB glossary) is cut off.

Verse 0 (book and chapter introductions) is skipped; references missing or empty on either
side are dropped, and so are books only one module has. The two modules number some verses
differently (RV1909 moves chapter boundaries in Numbers 13, Job 39-41, Jonah 2, ...; merges
verses elsewhere), so a Gale & Church (1993) length-based alignment per book keeps only the
pairs its best path aligns 1-1 with the same reference on both sides (about 300 are dropped).
Stdlib only, so it runs with any python3 >= 3.5.
"""

import argparse
import html
import math
import os
import re
import sys

VALID_BOOKS = ["Ruth", "Jonah", "Philippians", "Titus"]
TEST_BOOKS = ["Micah", "Joel", "Esther", "Colossians", "James", "I Peter"]

GEN_1_1_EN = "In the beginning, God created the heavens and the earth."
GEN_1_1_ES = "EN el principio crió Dios los cielos y la tierra."
FORBIDDEN = ["Godcreated", "Yahweh\u2019sword"]

# Elements dropped together with their content.
DROP = {"note", "title", "speaker"}
# Elements whose tags separate text (block structure); any self-closing tag counts too.
BLOCK = {"title", "div", "l", "lg", "lb", "milestone", "chapter", "p", "list", "item",
         "table", "row", "cell", "head", "verse"}
# RV1909 marks pronouns the translators added as <transChange>; an enclitic pronoun then sits
# in its own element right after the verb's <w> ("sáca</w><transChange>lo</transChange>", that
# is "sácalo"). It is joined to the verb when the verb looks like one that takes enclitics:
# infinitive (-r), plural imperative (-d), gerund (-ndo), a short imperative or preterite, or a
# form whose written accent only makes sense with the pronoun attached (sáca, díjo, plantó).
ENCLITIC_RE = re.compile(r"([^\W\d_]+)</w><transChange\b[^>]*>"
                         r"(lo|la|los|las|le|les|me|te|se|nos|os)</transChange>")
SHORT_VERBS = {"da", "di", "haz", "vi", "ve", "ten", "pon", "sal", "ven", "he", "fué"}
NOT_VERBS = {"cuánto", "cuán", "qué", "cómo", "dónde", "quién", "más", "aún", "también",
             "sí"}
ACCENTED = set("áéíóú")
# No boundary space after these ...
OPEN_PUNCT = set("\u201c\u2018([{\u00bf\u00a1\u2014\u2013-/")
# ... nor before these.
CLOSE_PUNCT = set(",.;:?!)]}\u201d\u2019\u2014\u2013-/\u2026")

TAG_RE = re.compile(r"<(/?)([A-Za-z][\w:.-]*)([^>]*?)(/?)>")
KEY_RE = re.compile(r"^\$\$\$(.+) (\d+):(\d+)\s*$")
# The end of a book: whatever follows (the WEB glossary after Revelation 22:21) is not verse text.
BOOK_END_RE = re.compile(r"<div\b[^>]*\beID=[^>]*\btype=\"book\"[^>]*/>")


def die(msg):
    sys.stderr.write("prepare-bible.py: error: %s\n" % msg)
    sys.exit(1)


def verb_like(word):
    """True if `word` is a Spanish verb form an enclitic pronoun attaches to (see ENCLITIC_RE)."""
    w = word.lower()
    if w in NOT_VERBS:
        return False
    if w in SHORT_VERBS or w.endswith(("r", "d", "ndo")):
        return True
    if not ACCENTED & set(w):
        return False
    # A capitalised word ending in an accented vowel is a name (Jehová, Josué), not a verb.
    return not (word[0].isupper() and word[-1] in ACCENTED)


def join_enclitic(m):
    if verb_like(m.group(1)):
        return m.group(1) + m.group(2) + "</w>"
    return m.group(0)


def clean(fragment):
    """Returns the plain text of one verse's OSIS fragment (rules in the module docstring)."""
    if "</w><transChange" in fragment:
        fragment = ENCLITIC_RE.sub(join_enclitic, fragment)
    out = []           # emitted text pieces
    brk = False        # a boundary is pending before the next text
    closed = False     # the current run of tags contains a closing inline tag
    drop_name = None   # name of the element being dropped
    drop_depth = 0
    for i, part in enumerate(re.split(r"(<[^>]*>)", fragment)):
        if i % 2 == 0:  # text
            if drop_name is not None or not part:
                continue
            text = html.unescape(part).replace("\u00b6", "")
            if not text:
                continue
            if brk and out:
                prev = out[-1][-1]
                nxt = text[0]
                if (not prev.isspace() and not nxt.isspace() and prev not in OPEN_PUNCT and
                        nxt not in CLOSE_PUNCT):
                    out.append(" ")
            out.append(text)
            brk = False
            closed = False
            continue
        m = TAG_RE.match(part)
        if not m:
            die("unparseable markup %r in %r" % (part, fragment[:200]))
        is_close, name, attrs, is_self = m.group(1) == "/", m.group(2), m.group(3), m.group(4)
        if drop_name is not None:
            if name == drop_name and not is_self:
                drop_depth += -1 if is_close else 1
                if drop_depth == 0:
                    drop_name = None
                    brk = True
            continue
        if (name in DROP and not is_close and not is_self and
                not (name == "title" and 'canonical="true"' in attrs)):
            drop_name, drop_depth = name, 1
            continue
        if is_self or name in BLOCK:
            brk = True
        elif is_close:
            closed = True
        elif closed:
            brk = True  # one inline element ended and another starts: a word boundary
    if drop_name is not None:
        die("unterminated <%s> in %r" % (drop_name, fragment[:200]))
    text = re.sub(r"\s+", " ", "".join(out)).strip()
    # WEB sometimes has whitespace around a note that precedes "?" ("coins</q> <note>..</note>
    # <q>? Not"); no such space is meant in either language.
    return re.sub(r" ([,.;:?!)])", r"\1", text)


def read_module(path):
    """Returns (books in order, {(book, chapter, verse): text}) of one mod2imp dump."""
    if not os.path.isfile(path):
        die("%s: no such file (run mod2imp first, see tools/prepare-bible.sh)" % path)
    books, verses = [], {}
    key, lines = None, []

    def flush():
        if key is not None and key[2] > 0:
            verses[key] = clean(BOOK_END_RE.split(" ".join(lines))[0])

    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("$$$"):
                flush()
                key, lines = None, []
                m = KEY_RE.match(line)
                if m:
                    book = m.group(1)
                    key = (book, int(m.group(2)), int(m.group(3)))
                    if not books or books[-1] != book:
                        if book in books:
                            die("%s: book %r appears twice, not contiguous" % (path, book))
                        books.append(book)
                continue
            lines.append(line.rstrip("\n"))
    flush()
    if not verses:
        die("%s: no verses found (is it mod2imp output?)" % path)
    return books, verses


# Gale & Church (1993), "A program for aligning sentences in bilingual corpora", Computational
# Linguistics 19(1): alignment types and their prior probabilities. Verse numbers are strong
# anchors, so 1-1 dominates far more than for free sentences (Gale & Church use 0.89).
ALIGN_PRIORS = {(1, 1): 0.99, (1, 0): 0.002, (0, 1): 0.002, (2, 1): 0.002, (1, 2): 0.002,
                (2, 2): 0.0001}
ALIGN_BAND = 12  # verses either side of the reference diagonal that the search considers


def length_model(pairs):
    """Returns (c, s2) of Gale & Church's length model from (len_en, len_es) pairs: c is the
    expected target characters per source character, s2 the variance per character. Median
    based, so the misaligned pairs the model is meant to find do not inflate it."""
    c = sum(b for _, b in pairs) / float(sum(a for a, _ in pairs))
    dev = sorted(abs(b - c * a) / math.sqrt((a + b / c) / 2.0) for a, b in pairs)
    s = 1.4826 * dev[len(dev) // 2]
    return c, s * s


def aligned_refs(keys_en, keys_es, len_en, len_es, c, s2):
    """Gale-Church dynamic programme over one book's verses (in order) on both sides; returns
    the set of references whose verses the best path aligns 1-1 with each other. A verse the
    other module numbers differently (shifted chapter boundary, two verses merged) lands on a
    2-1, 1-0 or shifted 1-1 step and is left out."""
    n, m = len(keys_en), len(keys_es)
    pe, ps = [0], [0]
    for x in len_en:
        pe.append(pe[-1] + x)
    for x in len_es:
        ps.append(ps[-1] + x)
    steps = [(di, dj, -math.log(p)) for (di, dj), p in ALIGN_PRIORS.items()]
    inv_sqrt2 = 1.0 / math.sqrt(2.0)

    memo = {}

    def match_cost(l1, l2):
        v = memo.get((l1, l2))
        if v is None:
            if l1 == 0 and l2 == 0:
                v = 0.0
            else:
                z = abs(c * l1 - l2) / math.sqrt(s2 * (l1 + l2 / c) / 2.0)
                v = -math.log(max(math.erfc(z * inv_sqrt2), 1e-300))
            memo[(l1, l2)] = v
        return v

    # Diagonal: for each English index, the Spanish index of the same reference (or the
    # proportional position when that reference is missing there).
    pos_es = {k: j for j, k in enumerate(keys_es)}
    diag = [pos_es.get(k, int(round(i * m / float(max(n, 1))))) for i, k in enumerate(keys_en)]
    diag.append(m)
    # Row i of the table covers Spanish indices [lo[i], hi[i]]; cells hold (cost, step).
    lo = [max(0, diag[i] - ALIGN_BAND) for i in range(n + 1)]
    hi = [min(m, diag[i] + ALIGN_BAND) for i in range(n + 1)]
    hi[n] = m
    rows = []
    for i in range(n + 1):
        row = [None] * (hi[i] - lo[i] + 1)
        for j in range(lo[i], hi[i] + 1):
            if i == 0 and j == 0:
                row[0] = (0.0, None)
                continue
            best, arg = None, None
            for di, dj, prior in steps:
                pi, pj = i - di, j - dj
                if pi < 0 or pj < 0:
                    continue
                if pi == i:
                    cell = row[pj - lo[i]] if pj >= lo[i] else None
                elif lo[pi] <= pj <= hi[pi]:
                    cell = rows[pi][pj - lo[pi]]
                else:
                    cell = None
                if cell is None:
                    continue
                v = cell[0] + prior + match_cost(pe[i] - pe[pi], ps[j] - ps[pj])
                if best is None or v < best:
                    best, arg = v, (di, dj)
            if arg is not None:
                row[j - lo[i]] = (best, arg)
        rows.append(row)
    if rows[n][m - lo[n]] is None:
        return set()
    keep = set()
    i, j = n, m
    while i or j:
        di, dj = rows[i][j - lo[i]][1]
        if (di, dj) == (1, 1) and keys_en[i - 1] == keys_es[j - 1]:
            keep.add(keys_en[i - 1])
        i, j = i - di, j - dj
    return keep


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--en", required=True, help="mod2imp engWEB2015eb output")
    ap.add_argument("--es", required=True, help="mod2imp spaRV1909eb output")
    ap.add_argument("--out", required=True, help="output directory")
    args = ap.parse_args()

    en_books, en = read_module(args.en)
    es_books, es = read_module(args.es)
    es_set = set(es_books)
    books = [b for b in en_books if b in es_set]
    only = sorted(set(en_books) ^ es_set)
    for b in VALID_BOOKS + TEST_BOOKS:
        if b not in books:
            die("held-out book %r is not in both modules (books: %s)" % (b, ", ".join(books)))

    book_rank = {b: i for i, b in enumerate(books)}
    order = lambda k: (book_rank[k[0]], k[1], k[2])
    both = [k for k in en if k[0] in book_rank and en[k] and es.get(k)]
    dropped = sum(1 for k in set(en) | set(es) if k[0] in book_rank) - len(both)
    c, s2 = length_model([(len(en[k]), len(es[k])) for k in both])
    keep = set()
    for book in books:
        ke = sorted((k for k in en if k[0] == book and en[k]), key=order)
        ks = sorted((k for k in es if k[0] == book and es[k]), key=order)
        keep |= aligned_refs(ke, ks, [len(en[k]) for k in ke], [len(es[k]) for k in ks], c, s2)
    misaligned = [k for k in both if k not in keep]

    splits = {"train": [], "valid": [], "test": []}
    for key in sorted(keep, key=order):
        book = key[0]
        e, s = en[key], es[key]
        split = "valid" if book in VALID_BOOKS else "test" if book in TEST_BOOKS else "train"
        splits[split].append(("%s %d:%d" % key, e, s))

    # Fail loudly on the checks the rest of the project relies on.
    gen = [p for p in splits["train"] if p[0] == "Genesis 1:1"]
    if len(gen) != 1 or gen[0][1] != GEN_1_1_EN or gen[0][2] != GEN_1_1_ES:
        die("Genesis 1:1 came out wrong: %r" % (gen,))
    for name, pairs in splits.items():
        for ref, e, s in pairs:
            for side in (e, s):
                for bad in FORBIDDEN:
                    if bad in side:
                        die("%s: glued words %r in %r" % (ref, bad, side))
                if "<" in side or ">" in side or "strong:" in side or "\n" in side:
                    die("%s: markup left in %r" % (ref, side))
    total = sum(len(p) for p in splits.values())
    if not 30000 <= total <= 32000:
        die("%d pairs in all; expected about 31,000" % total)

    os.makedirs(args.out, exist_ok=True)
    for name, pairs in splits.items():
        for ext, col in (("ref", 0), ("en", 1), ("es", 2)):
            path = os.path.join(args.out, "%s.%s" % (name, ext))
            text = "".join(p[col] + "\n" for p in pairs)
            # An unchanged file keeps its mtime, so the SentencePiece model and shards built
            # from it stay up to date (tools/prepare-data.sh compares mtimes).
            if os.path.isfile(path):
                with open(path, encoding="utf-8", newline="") as f:
                    if f.read() == text:
                        continue
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
            os.replace(tmp, path)
    print("prepare-bible: %d shared books (dropped, one side only: %s)" %
          (len(books), ", ".join(only) or "none"))
    print("prepare-bible: %d refs missing or empty on one side; %d pairs the Gale-Church check "
          "(c=%.3f, s2=%.2f) found misaligned, e.g. %s" %
          (dropped, len(misaligned), c, s2,
           ", ".join("%s %d:%d" % k for k in sorted(misaligned, key=order)[:4])))
    print("prepare-bible: pairs train %d, valid %d, test %d, total %d" %
          (len(splits["train"]), len(splits["valid"]), len(splits["test"]), total))


if __name__ == "__main__":
    main()
