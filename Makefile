# nmt — see README.md. `make` builds build/nmt and build/libnmt.a; `make test` runs the suite;
# `make run` is the whole main job on a fresh machine (install, data, build, train, translate, BLEU).

CC      ?= gcc
BUILD   ?= build
CFLAGS  ?= -O3 -g
CFLAGS  += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -Iinclude -I/usr/include/iniparser \
           -pthread -MMD -MP
LDLIBS  += -liniparser -lopenblas -lz -lpthread -lm

LIB_SRCS  := $(sort $(wildcard src/*.c src/*/*.c))
LIB_SRCS  := $(filter-out src/main.c,$(LIB_SRCS))
LIB_OBJS  := $(LIB_SRCS:%.c=$(BUILD)/%.o)
TEST_SRCS := $(sort $(wildcard test/*.c))
TEST_OBJS := $(TEST_SRCS:%.c=$(BUILD)/%.o)

.PHONY: all test run deps data clean bench
all: $(BUILD)/nmt $(BUILD)/libnmt.a

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/libnmt.a: $(LIB_OBJS)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/nmt: $(BUILD)/src/main.o $(BUILD)/libnmt.a
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

# Tests link every object of the library directly (not the archive), so that each test file's
# constructor-registered tests and every op are present.
$(BUILD)/test_nmt: $(TEST_OBJS) $(LIB_OBJS)
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

test:
	@tools/install-deps.sh
	$(MAKE) --no-print-directory $(BUILD)/test_nmt $(BUILD)/nmt
	@tools/prepare-bible.sh
	NMT_BUILD_DIR=$(BUILD) $(BUILD)/test_nmt $(T)

deps:
	tools/install-deps.sh

data: $(BUILD)/nmt
	tools/prepare-bible.sh

run:
	tools/run.sh

bench: $(BUILD)/nmt
	bench/cpu-throughput.sh

clean:
	rm -rf $(BUILD)

-include $(LIB_OBJS:.o=.d) $(TEST_OBJS:.o=.d) $(BUILD)/src/main.d
