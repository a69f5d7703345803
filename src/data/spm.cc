// spm.cc — the C wrapper of include/nmt/spm.h over SentencePiece's C++ library.
//
// Every entry point catches std::exception (and anything else) and turns it into an
// nmt_status with the exception's text: a C caller never sees a C++ exception. The library's
// own errors come back as util::Status and are reported the same way.
#include "nmt/spm.h"

#include <sentencepiece_processor.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

struct nmt_spm {
  sentencepiece::SentencePieceProcessor proc;
  std::string name;
};

namespace {

nmt_status caught(const char *what, const char *name) {
  try {
    throw;
  } catch (const std::bad_alloc &) {
    return nmt_errorf(NMT_ERR_NOMEM, "SentencePiece: %s %s: out of memory", what, name);
  } catch (const std::exception &e) {
    return nmt_errorf(NMT_ERR_DATA, "SentencePiece: %s %s: %s", what, name, e.what());
  } catch (...) {
    return nmt_errorf(NMT_ERR_DATA, "SentencePiece: %s %s: unknown C++ exception", what, name);
  }
}

nmt_status finish_load(nmt_spm *sp, const sentencepiece::util::Status &st, nmt_spm **out) {
  if (!st.ok()) {
    nmt_status s = nmt_errorf(NMT_ERR_DATA, "%s is not a usable SentencePiece model: %s",
                              sp->name.c_str(), st.ToString().c_str());
    delete sp;
    return s;
  }
  if (sp->proc.GetPieceSize() < 1) {
    nmt_status s = nmt_errorf(NMT_ERR_DATA, "%s: SentencePiece model without pieces",
                              sp->name.c_str());
    delete sp;
    return s;
  }
  *out = sp;
  return NMT_OK;
}

}  // namespace

extern "C" nmt_status nmt_spm_load(const char *path, nmt_spm **out) {
  *out = nullptr;
  // The library's "not found" names no errno; say why the file cannot be read first.
  FILE *f = std::fopen(path, "rb");
  if (!f) return nmt_errorf(NMT_ERR_IO, "cannot read SentencePiece model %s: %s", path,
                            std::strerror(errno));
  std::fclose(f);
  nmt_spm *sp = nullptr;
  try {
    sp = new nmt_spm;
    sp->name = path;
    return finish_load(sp, sp->proc.Load(path), out);
  } catch (...) {
    delete sp;
    return caught("loading", path);
  }
}

extern "C" nmt_status nmt_spm_load_bytes(const void *bytes, size_t n, const char *label,
                                         nmt_spm **out) {
  *out = nullptr;
  nmt_spm *sp = nullptr;
  try {
    sp = new nmt_spm;
    sp->name = label ? label : "(bytes)";
    std::string_view view(static_cast<const char *>(bytes), n);
    return finish_load(sp, sp->proc.LoadFromSerializedProto(view), out);
  } catch (...) {
    delete sp;
    return caught("loading", label ? label : "(bytes)");
  }
}

extern "C" void nmt_spm_free(nmt_spm *sp) { delete sp; }

extern "C" int nmt_spm_vocab(const nmt_spm *sp) { return sp->proc.GetPieceSize(); }

extern "C" const char *nmt_spm_name(const nmt_spm *sp) { return sp->name.c_str(); }

extern "C" nmt_status nmt_spm_encode(const nmt_spm *sp, const char *text, size_t len,
                                     int32_t *ids, int cap, int *n_out) {
  *n_out = 0;
  try {
    std::vector<int> v;
    auto st = sp->proc.Encode(std::string_view(text, len), &v);
    if (!st.ok())
      return nmt_errorf(NMT_ERR_DATA, "SentencePiece %s cannot encode \"%.*s\": %s",
                        sp->name.c_str(), len > 60 ? 60 : (int)len, text,
                        st.ToString().c_str());
    if (v.size() > (size_t)(1 << 30))
      return nmt_errorf(NMT_ERR_DATA, "SentencePiece %s: %zu ids for one line", sp->name.c_str(),
                        v.size());
    for (size_t i = 0; i < v.size() && i < (size_t)(cap > 0 ? cap : 0); i++) ids[i] = v[i];
    *n_out = (int)v.size();
    return NMT_OK;
  } catch (...) {
    return caught("encoding with", sp->name.c_str());
  }
}

extern "C" nmt_status nmt_spm_decode(const nmt_spm *sp, const int32_t *ids, int n, char *out,
                                     size_t cap, size_t *len_out) {
  *len_out = 0;
  if (cap > 0) out[0] = 0;
  try {
    const int vocab = sp->proc.GetPieceSize();
    std::vector<int> v((size_t)(n > 0 ? n : 0));
    for (int i = 0; i < n; i++) {
      if (ids[i] < 0 || ids[i] >= vocab)
        return nmt_errorf(NMT_ERR_DATA, "SentencePiece %s: id %d at position %d outside [0, %d)",
                          sp->name.c_str(), (int)ids[i], i, vocab);
      v[(size_t)i] = ids[i];
    }
    std::string text;
    auto st = sp->proc.Decode(v, &text);
    if (!st.ok())
      return nmt_errorf(NMT_ERR_DATA, "SentencePiece %s cannot decode %d ids: %s",
                        sp->name.c_str(), n, st.ToString().c_str());
    *len_out = text.size();
    if (cap > 0) {
      size_t k = text.size() < cap - 1 ? text.size() : cap - 1;
      std::memcpy(out, text.data(), k);
      out[k] = 0;
    }
    return NMT_OK;
  } catch (...) {
    return caught("decoding with", sp->name.c_str());
  }
}

extern "C" nmt_status nmt_spm_check_vocab(const nmt_spm *sp, int vocab) {
  const int pieces = sp->proc.GetPieceSize();
  if (pieces == vocab) return NMT_OK;
  return nmt_errorf(NMT_ERR_CONFIG,
                    "SentencePiece model %s has %d pieces but [model] vocab = %d: the model and "
                    "its vocabulary must come from the same tools/prepare-data.sh run",
                    sp->name.c_str(), pieces, vocab);
}
