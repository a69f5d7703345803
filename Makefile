# nmt — see README.md. `make` builds build/nmt, build/libnmt.a and build/libnmt.so; `make test`
# runs the suite (test-asan, test-tsan, test-long, test-slurm and fuzz: below, near their rules);
# `make run` is the whole main job on a fresh machine (install, data, build, train, translate, BLEU).
# Quiet by default (a line per file); V=1 prints the command lines.

.DEFAULT_GOAL := all
# One short line per file ("  CC      src/api.c"), as the Linux kernel's Kbuild prints; V=1 prints
# every command line instead. A failing command's own messages show in full either way.
V ?= 0
ifeq ($(V),1)
  Q :=
  say = :
else
  Q := @
  say = printf '  %-7s %s\n' '$(1)' '$(2)'
endif
CC      ?= gcc
BUILD   ?= build
CFLAGS  ?= -O3 -g
CFLAGS  += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -Iinclude -I/usr/include/iniparser \
           -pthread -MMD -MP
LDLIBS  += -liniparser -lopenblas -lz -lpthread -lm
# Gloo (the communicator across processes, src/comm/gloo.cc) is a C++ library: a hard
# dependency like OpenBLAS (tools/install-deps.sh installs libgloo-dev).
LDLIBS  += -lgloo -lstdc++
# libnmt.so holds the same objects as libnmt.a, hence position-independent code everywhere.
CFLAGS  += -fPIC

LIB_SRCS  := $(sort $(wildcard src/*.c src/*/*.c))
# The command line (src/main.c, its texts, its shared parsing and the commands in their own
# files) is the nmt binary's, not libnmt's.
CLI_SRCS  := src/main.c src/main_help.c src/cli.c $(sort $(wildcard src/cmd_*.c))
CLI_OBJS  := $(CLI_SRCS:%.c=$(BUILD)/%.o)
LIB_SRCS  := $(filter-out $(CLI_SRCS),$(LIB_SRCS))
LIB_OBJS  := $(LIB_SRCS:%.c=$(BUILD)/%.o)
# C++ sources (only where a C++ library is called: SentencePiece in src/data/spm.cc, Gloo in
# src/comm/), built with the C flags (warnings as errors, PIC, dependency files, sanitizers)
# in C++17.
LIB_CXX_SRCS := $(sort $(wildcard src/*.cc src/*/*.cc))
LIB_OBJS  += $(LIB_CXX_SRCS:%.cc=$(BUILD)/%.o)
CXX       ?= g++
CXXFLAGS  += $(filter-out -std=c11,$(CFLAGS)) -std=c++17
LDLIBS    += -lsentencepiece -lstdc++
# TensorBoard event files (src/util/tensorboard.c): TensorFlow's Event messages, declared in
# src/util/tb_event.proto, as C that protoc-c generates into $(BUILD)/gen (not committed: the
# .proto is the source, and the code matches the installed libprotobuf-c); CRC-32C from ISA-L.
PROTO_SRCS := $(sort $(wildcard src/*/*.proto))
PROTO_GEN  := $(patsubst %.proto,$(BUILD)/gen/%.pb-c.c,$(notdir $(PROTO_SRCS)))
LIB_OBJS  += $(PROTO_GEN:.c=.o)
LDLIBS    += -lprotobuf-c -lisal
TEST_SRCS := $(sort $(wildcard test/*.c test/fuzz/fuzz_*.c))
TEST_OBJS := $(TEST_SRCS:%.c=$(BUILD)/%.o)

# Goals that only print (print-static-ldlibs) leave the build directory as it is, and describe
# the build that is there: its CUDA setting unless CUDA is given.
ONLY_PRINT := $(if $(MAKECMDGOALS),$(if $(filter-out print-%,$(MAKECMDGOALS)),,1),)
ifneq ($(ONLY_PRINT),)
  BUILT_CUDA := $(firstword $(shell cat $(BUILD)/.cuda-flag 2>/dev/null))
  ifneq ($(BUILT_CUDA),)
    CUDA ?= $(BUILT_CUDA)
  endif
endif

# CUDA backend (cuda/*.cu, docs/cuda.md): built when nvcc is found unless CUDA=0 (`make CUDA=0`
# is CPU-only: cuda/none.c stands in and parallel.device = cuda is refused). A fat binary for
# sm_80 (A100), sm_86 (RTX 3090) and sm_90 (H100), built without a GPU, plus the PTX of
# CUDA_PTX (compute_90), which the driver JIT-compiles on a GPU newer than every sm_ above
# (Blackwell, ...) instead of failing with "no kernel image". cudart is linked
# statically; cuBLASLt (540 MB) dynamically through an rpath to the toolkit, so a binary runs
# where the toolkit is (the GPU machines have it at the same place; tools/gpu-check.sh finds it
# elsewhere, e.g. in the pip wheels' nvidia/cu13/lib).
CUDA_HOME  ?= /usr/local/cuda
NVCC       ?= $(firstword $(wildcard $(CUDA_HOME)/bin/nvcc) $(shell command -v nvcc 2>/dev/null))
CUDA       ?= $(if $(NVCC),1,0)
# sm_80 or newer: the fused attention's bf16 tensor-core kernels need it (a lower one is refused).
CUDA_ARCHS ?= 80 86 90
CUDA_PTX   ?= 90
NVCCFLAGS  ?= -O3 -g -lineinfo
NVCCFLAGS  += -std=c++20 -Iinclude $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
              $(foreach a,$(CUDA_PTX),-gencode arch=compute_$(a),code=compute_$(a)) \
              -Xcompiler -Wall,-Wextra,-Werror --Werror all-warnings -MMD -MP
ifeq ($(CUDA),1)
  ifneq ($(filter-out 8% 9% 1%,$(CUDA_ARCHS)),)
    $(error CUDA_ARCHS=$(CUDA_ARCHS): every architecture must be sm_80 or newer (the fused attention's bf16 tensor-core kernels, cuda/attention_fused_mma.cu); build with CUDA=0 for the CPU alone)
  endif
  ifeq ($(NVCC),)
    $(error CUDA=1 but no nvcc: set NVCC or CUDA_HOME, or build with CUDA=0)
  endif
  CUDA_OBJS := $(patsubst %.cu,$(BUILD)/%.o,$(sort $(wildcard cuda/*.cu)))
  # NVTX v3 is header-only (nvtx3/nvToolsExt.h): ranges cost a branch until Nsight injects
  # its library; include/nmt/nvtx.h compiles them out when NMT_NVTX is not defined.
  CFLAGS    += -DNMT_NVTX -DNMT_CUDA -isystem $(CUDA_HOME)/include
  NVCCFLAGS += -DNMT_NVTX
  LDLIBS    += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublasLt -lcudart_static \
               -ldl -lrt -lstdc++
else
  CUDA_OBJS := $(BUILD)/cuda/none.o
endif
LIB_OBJS += $(CUDA_OBJS)
# Switching CUDA on or off (or the archs) changes which objects are linked but leaves every
# object up to date: drop the linked outputs so they are relinked.
CUDA_FLAG := $(CUDA) $(CUDA_ARCHS) ptx $(CUDA_PTX)
# A dry run (make -n) must not delete the outputs either.
DRY_RUN := $(findstring n,$(firstword -$(MAKEFLAGS)))
ifeq ($(ONLY_PRINT)$(DRY_RUN),)
ifneq ($(CUDA_FLAG),$(shell cat $(BUILD)/.cuda-flag 2>/dev/null))
  $(shell mkdir -p $(BUILD) && rm -f $(BUILD)/libnmt.* $(BUILD)/nmt $(BUILD)/test_nmt && \
          echo '$(CUDA_FLAG)' > $(BUILD)/.cuda-flag)
endif
endif

NVCCFLAGS += -Xcompiler -fPIC
# Objects depend on the compiler and its flags: changing them (a sanitizer, -fPIC) rebuilds.
CFLAGS_SIG := $(CC) $(CFLAGS)
ifeq ($(ONLY_PRINT),)
ifneq ($(CFLAGS_SIG),$(shell cat $(BUILD)/.cflags 2>/dev/null))
  $(shell mkdir -p $(BUILD) && echo '$(CFLAGS_SIG)' > $(BUILD)/.cflags)
endif
endif
$(LIB_OBJS) $(TEST_OBJS) $(CLI_OBJS): $(BUILD)/.cflags
# Likewise the CUDA objects and nvcc's flags (the -gencode targets: CUDA_ARCHS, CUDA_PTX).
ifeq ($(CUDA),1)
  NVCCFLAGS_SIG := $(NVCC) $(NVCCFLAGS)
  ifneq ($(NVCCFLAGS_SIG),$(shell cat $(BUILD)/.nvccflags 2>/dev/null))
    $(shell mkdir -p $(BUILD) && echo '$(NVCCFLAGS_SIG)' > $(BUILD)/.nvccflags)
  endif
  $(CUDA_OBJS): $(BUILD)/.nvccflags
endif

# `nmt --version` names the commit it was built from; the stamp changes only when the commit
# (or whether the tree is dirty) does, and then only main.o is rebuilt.
NMT_COMMIT := $(shell git describe --always --dirty --abbrev=10 2>/dev/null || echo unknown)
ifeq ($(ONLY_PRINT),)
ifneq ($(NMT_COMMIT),$(shell cat $(BUILD)/.commit 2>/dev/null))
  $(shell mkdir -p $(BUILD) && echo '$(NMT_COMMIT)' > $(BUILD)/.commit)
endif
endif
$(BUILD)/src/main.o: $(BUILD)/.commit
$(BUILD)/src/main.o: CFLAGS += -DNMT_COMMIT='"$(NMT_COMMIT)"'

.PHONY: all test run deps data clean bench bench-compare bench-sockeye print-static-ldlibs
all: $(BUILD)/nmt $(BUILD)/libnmt.a $(BUILD)/libnmt.so

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@); $(call say,CC,$<)
	$(Q)$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/%.o: %.cc
	@mkdir -p $(dir $@); $(call say,CXX,$<)
	$(Q)$(CXX) $(CXXFLAGS) -c $< -o $@

$(BUILD)/gen/%.pb-c.c $(BUILD)/gen/%.pb-c.h: src/util/%.proto
	@mkdir -p $(BUILD)/gen; $(call say,PROTOC,$<)
	$(Q)protoc-c --proto_path=src/util --c_out=$(BUILD)/gen $<

$(BUILD)/gen/%.o: $(BUILD)/gen/%.c
	@$(call say,CC,$<)
	$(Q)$(CC) $(CFLAGS) -c $< -o $@

# The generated header exists before its users compile (their .d files name it afterwards).
$(BUILD)/src/util/tensorboard.o: $(BUILD)/gen/tb_event.pb-c.h
$(BUILD)/src/util/tensorboard.o: CFLAGS += -I$(BUILD)/gen

$(BUILD)/cuda/%.o: cuda/%.cu
	@mkdir -p $(dir $@); $(call say,NVCC,$<)
	$(Q)$(NVCC) $(NVCCFLAGS) -c $< -o $@

# The fused attention kernels without -lineinfo: their instantiations (3 element types x 3
# head sizes x 4 kernels) carry 5 MB of line tables per architecture, which would take the GPU
# pack over the device tool's carry limit (ncu shows their SASS without source lines).
$(BUILD)/cuda/attention_fused.o $(BUILD)/cuda/attention_fused_mma.o: \
    NVCCFLAGS := $(filter-out -lineinfo,$(NVCCFLAGS))

$(BUILD)/libnmt.a: $(LIB_OBJS)
	@rm -f $@; $(call say,AR,$@)
	$(Q)$(AR) rcs $@ $^

$(BUILD)/nmt: $(CLI_OBJS) $(BUILD)/libnmt.a
	@$(call say,LD,$@)
	$(Q)$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/libnmt.so: $(LIB_OBJS)
	@$(call say,LD,$@)
	$(Q)$(CC) $(CFLAGS) -shared -Wl,-soname,libnmt.so $^ -o $@ $(LDLIBS)

# The fused-attention benchmark (bench/attention_fused.c: unfused vs fused attention fwd+bwd on
# device 0; tools/gpu-check.sh packs it and its `first` stage runs it). Needs a CUDA build.
$(BUILD)/bench/attention_fused: bench/attention_fused.c $(BUILD)/libnmt.a $(BUILD)/.commit
	@mkdir -p $(dir $@); $(call say,LD,$@)
	$(Q)$(CC) $(CFLAGS) -DNMT_COMMIT='"$(NMT_COMMIT)"' $(filter-out %/.commit,$^) -o $@ $(LDLIBS)

# The embedding example links the shared library the way a host program would.
$(BUILD)/embed_example: tools/embed_example.c $(BUILD)/libnmt.so
	@$(call say,LD,$@)
	$(Q)$(CC) $(CFLAGS) $< -o $@ -L$(BUILD) -Wl,-rpath,'$$ORIGIN' -lnmt -lm

# The libraries a program linking build/libnmt.a needs, for README "Embedding":
#   cc app.c -Iinclude build/libnmt.a $(make -s print-static-ldlibs) -o app
print-static-ldlibs:
	@echo $(LDLIBS)

# Tests link every object of the library directly (not the archive), so that each test file's
# constructor-registered tests and every op are present.
$(BUILD)/test_nmt: $(TEST_OBJS) $(LIB_OBJS)
	@$(call say,LD,$@)
	$(Q)$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

# Data preparation writes shards with this build's nmt (prepare-bible.sh's own fallback is
# build/nmt, which has no rule when BUILD names another directory).
PREPARE_BIBLE = NMT=$(abspath $(BUILD)/nmt) tools/prepare-bible.sh

# --bleu: sacreBLEU too; readme_commands_run runs the README's BLEU validation and `nmt eval`,
# so `make test` on a machine where `make run` never ran installs it itself.
test:
	@V=$(V) tools/install-deps.sh --bleu
	$(Q)$(MAKE) --no-print-directory $(BUILD)/test_nmt $(BUILD)/nmt $(BUILD)/embed_example $(FUZZ_LINKS)
	@$(PREPARE_BIBLE)
	$(Q)NMT_BUILD_DIR=$(BUILD) $(BUILD)/test_nmt $(T)

# Reliability: the suite under sanitizers, each in its own build directory; long variants; and
# libFuzzer on the three readers of untrusted files (test/fuzz/README.md). SAN_SKIP names tests
# (substrings, comma-separated) the sanitizer runs leave out: the real-corpus training test is
# ~40x slower under TSan and tests nothing the synthetic engine tests do not.
SAN_SKIP  ?= train_bible
SAN_FLAGS := -O1 -g -fno-omit-frame-pointer
.PHONY: test-asan test-tsan test-long fuzz
test-asan:
	NMT_TEST_SKIP=$(SAN_SKIP) ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1:abort_on_error=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	CFLAGS="$(SAN_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=all" \
	$(MAKE) --no-print-directory BUILD=build-asan CUDA=0 test
test-tsan:
	NMT_TEST_SKIP=$(SAN_SKIP) TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:allocator_may_return_null=1:suppressions=$(abspath test/tsan.supp) \
	CFLAGS="$(SAN_FLAGS) -fsanitize=thread" \
	$(MAKE) --no-print-directory BUILD=build-tsan CUDA=0 test
test-long:
	$(MAKE) --no-print-directory $(BUILD)/test_nmt $(BUILD)/nmt
	NMT_TEST_LONG=1 NMT_BUILD_DIR=$(BUILD) $(BUILD)/test_nmt reliab_

# The suite under other OpenBLAS kernels (docs/determinism.md, "Not a source: the CPU's
# kernels"): OPENBLAS_CORETYPE fixes the sgemm micro-kernels and their blocking, so each core
# type stands for a CPU this machine is not: Haswell (AVX2 and FMA; Zen computes the same bits,
# docs/determinism.md, so it is left out), Sandybridge (AVX, no FMA), Nehalem (SSE only, as on a
# CPU without AVX). A bound that
# holds under one kernel set only fails here. glibc's libm picks its code paths by the CPU too
# (exp, log, pow, sin, cos in double have FMA variants whose last bits differ), so Sandybridge
# and Nehalem also run with glibc told that this CPU lacks FMA and AVX2 (and AVX): the suite
# then runs as on such a CPU, but for nmt's own code, which is baseline x86-64 anyway. Every
# core type runs, then the target fails if any did. CORETYPE_SKIP (substrings, as SAN_SKIP)
# leaves tests out: by default the real-corpus training test, a third of the suite's time,
# whose bounds passed under each of these core types when this target was added.
CORETYPES     ?= Haswell Sandybridge Nehalem
CORETYPE_SKIP ?= train_bible
# glibc >= 2.33 names the features AVX2, FMA; older ones AVX2_Usable, FMA_Usable (an unknown
# name is ignored, so both are given).
NO_AVX2_FMA := glibc.cpu.hwcaps=-AVX2,-FMA,-FMA4,-AVX512F,-AVX2_Usable,-FMA_Usable,-FMA4_Usable,-AVX512F_Usable
.PHONY: test-coretypes
test-coretypes:
	$(Q)$(MAKE) --no-print-directory $(BUILD)/test_nmt $(BUILD)/nmt $(BUILD)/embed_example
	@[ -s data/bible/train.shard ] && [ -s data/bible/test.shard ] || $(PREPARE_BIBLE)
	@failed=""; for ct in $(CORETYPES); do \
	  echo "== OPENBLAS_CORETYPE=$$ct"; t0=$$(date +%s); \
	  log=$(BUILD)/test-coretype-$$ct.log; \
	  case $$ct in \
	    Sandybridge) tun=$(NO_AVX2_FMA);; Nehalem) tun=$(NO_AVX2_FMA),-AVX,-AVX_Usable;; *) tun=;; \
	  esac; \
	  GLIBC_TUNABLES=$$tun OPENBLAS_CORETYPE=$$ct NMT_TEST_SKIP=$(CORETYPE_SKIP) NMT_BUILD_DIR=$(BUILD) \
	    $(BUILD)/test_nmt $(T) >$$log 2>&1 || failed="$$failed $$ct"; \
	  grep -E '^not ok|^# [^ ]+:[0-9]+: |^# kept |passed, .* failed' $$log; \
	  echo "== OPENBLAS_CORETYPE=$$ct took $$(( $$(date +%s) - t0 )) s (the whole output: $$log)"; \
	done; [ -z "$$failed" ] || { echo "test-coretypes: failed under$$failed"; exit 1; }

FUZZ_SECONDS ?= 60
FUZZ_CC      ?= clang
FUZZ_BUILD   ?= build-fuzz
FUZZ_CFLAGS  := -g -O1 -std=c11 -D_GNU_SOURCE -Iinclude -I/usr/include/iniparser -pthread \
                -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -DNMT_FUZZ_MAIN
FUZZ_COMMON  := src/status.c src/util/log.c
FUZZ_SRCS_ini   := test/fuzz/fuzz_ini.c src/config.c src/config_number.c src/config_scan.c \
                   src/config_schema.c $(FUZZ_COMMON)
FUZZ_SRCS_shard := test/fuzz/fuzz_shard.c src/data/shard.c src/data/batch.c src/util/rng.c $(FUZZ_COMMON)
FUZZ_SRCS_ckpt  := test/fuzz/fuzz_ckpt.c src/engine/checkpoint.c src/engine/ckpt_dir.c src/model/params.c \
                   src/config.c src/config_number.c src/config_scan.c src/config_schema.c \
                   src/util/rng.c $(FUZZ_COMMON)
$(FUZZ_BUILD)/fuzz_ini: $(FUZZ_SRCS_ini)
$(FUZZ_BUILD)/fuzz_shard: $(FUZZ_SRCS_shard)
$(FUZZ_BUILD)/fuzz_ckpt: $(FUZZ_SRCS_ckpt)
$(FUZZ_BUILD)/fuzz_%:
	@mkdir -p $(FUZZ_BUILD); $(call say,LD,$@)
	$(Q)$(FUZZ_CC) $(FUZZ_CFLAGS) $^ -o $@ -liniparser -lz -lm
# The same lists linked by `make test` with the regular compiler and a plain main
# (test/fuzz/link_main.c), so a source missing from a list fails there, not only here.
FUZZ_LINKS := $(BUILD)/fuzz-link/fuzz_ini $(BUILD)/fuzz-link/fuzz_shard $(BUILD)/fuzz-link/fuzz_ckpt
$(BUILD)/fuzz-link/fuzz_ini: $(FUZZ_SRCS_ini)
$(BUILD)/fuzz-link/fuzz_shard: $(FUZZ_SRCS_shard)
$(BUILD)/fuzz-link/fuzz_ckpt: $(FUZZ_SRCS_ckpt)
$(BUILD)/fuzz-link/fuzz_%: test/fuzz/link_main.c $(wildcard include/nmt/*.h test/fuzz/*.h)
	@mkdir -p $(@D); $(call say,LD,$@)
	$(Q)$(CC) -O1 -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -Iinclude -I/usr/include/iniparser \
	  -pthread -DNMT_FUZZ_MAIN $(filter %.c,$^) -o $@ -liniparser -lz -lm
# A fixed seed makes a CI run explore as the developer's did (FUZZ_SEED=0: random).
FUZZ_SEED ?= 1
fuzz: $(FUZZ_BUILD)/fuzz_ini $(FUZZ_BUILD)/fuzz_shard $(FUZZ_BUILD)/fuzz_ckpt
	@for t in ini shard ckpt; do \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$t $(FUZZ_BUILD)/crashes && \
	  echo "fuzz_$$t: $(FUZZ_SECONDS) s" && \
	  $(FUZZ_BUILD)/fuzz_$$t -seed=$(FUZZ_SEED) -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=2048 \
	    -print_final_stats=1 -artifact_prefix=$(FUZZ_BUILD)/crashes/$$t- \
	    $(FUZZ_BUILD)/corpus/$$t test/fuzz/corpus/$$t 2>$(FUZZ_BUILD)/fuzz_$$t.log || \
	  { tail -40 $(FUZZ_BUILD)/fuzz_$$t.log; echo "fuzz_$$t found a crash: see $(FUZZ_BUILD)/crashes;" \
	    "fix it and add the input to test/fuzz/regress/$$t/"; exit 1; }; \
	  grep -E "stat::number_of_executed_units|stat::new_units_added" $(FUZZ_BUILD)/fuzz_$$t.log; \
	done

# A real Slurm (test/slurm/run.sh, docs/multinode.md "Slurm"): its own munged, slurmctld and two
# slurmd on loopback in a temporary directory run the documented job script
# test/slurm/train.sbatch in 11 cases, then exactly those daemons are stopped. As root it
# installs munge and Slurm first (tools/install-deps.sh --slurm); not root: "# SKIP". The Bible
# corpus is prepared only when it is missing (`make test` prepares it).
.PHONY: test-slurm
test-slurm:
	@if [ "$$(id -u)" -eq 0 ]; then V=$(V) tools/install-deps.sh --slurm; fi
	$(MAKE) --no-print-directory $(BUILD)/nmt
	@[ -s data/bible/train.shard ] && [ -s data/bible/valid.shard ] || $(PREPARE_BIBLE)
	test/slurm/run.sh $(BUILD)

# GPU checks (docs/gpu-runs.md, "How to run the first GPU session"): `make gpu-pack` on the dev
# box packs build/gpu-pack (stripped binaries with the fat binary's PTX, libraries, shards;
# refused over the device tool's 64 MiB carry limit) for a GPU machine; `make test-gpu
# [GPU_STAGES=test|sanitize|train|train-fp16|...]` there runs tools/gpu-check.sh: the GPU tests,
# compute-sanitizer, base-model training (default: all of them; one device call takes one).
GPU_STAGES ?= all
.PHONY: gpu-pack test-gpu
gpu-pack:
	tools/gpu-check.sh pack
test-gpu:
	tools/gpu-check.sh $(GPU_STAGES)

deps:
	@V=$(V) tools/install-deps.sh

data: $(BUILD)/nmt
	$(PREPARE_BIBLE)

# `make run` installs and builds here, so that a dry run (make -n run) shows what it builds: the
# whole of `all`, the libraries README "Embedding" links against included; tools/run.sh then
# prepares the corpus, trains, translates and scores.
run:
	@V=$(V) tools/install-deps.sh --bleu
	@$(MAKE) --no-print-directory -j2 all
	@NMT=$(abspath $(BUILD)/nmt) tools/run.sh

# Side by side on a GPU: nmt vs PyTorch eager AMP and torch.compile, same model, weights and
# batches (bench/GPU.md); fails fast without a CUDA device (DEVICE=cpu self-tests it on CPU).
bench-compare: $(BUILD)/nmt
	bench/gpu-compare.sh

bench: $(BUILD)/nmt
	bench/cpu-throughput.sh

# nmt next to Sockeye 3.1.34 on the CPU, installed into build/venv-sockeye (bench/README.md):
# throughput, valid perplexity at equal updates, test BLEU; about 40 minutes on 2 idle cores.
bench-sockeye: $(BUILD)/nmt
	bench/peer-sockeye.sh

clean:
	rm -rf $(BUILD) build-asan build-tsan $(FUZZ_BUILD)

-include $(LIB_OBJS:.o=.d) $(TEST_OBJS:.o=.d) $(CLI_OBJS:.o=.d) $(BUILD)/embed_example.d
