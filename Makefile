# k3 -- hand-written Makefile. `make help` lists the targets.
#
# Layout: src/<subsystem>/*.c -> build/libk3.a; cli/*.c -> build/k3;
# tests/*.c -> build/k3-test. Files named *_avx2.c / *_avx512.c get their ISA
# flags; everything else is plain x86-64 so the binary runs anywhere and picks
# its kernels at run time.

CC      ?= cc
# -O2, with the vectorizer's cost model of -O3: the plain loops of the
# non-kernel files (residual adds, copies, x + 128) become SSE2 code; every
# element is computed as before, so results do not change.
OPT     ?= -O2 -fvect-cost-model=dynamic
CFLAGS  ?= $(OPT) -g
WARN    := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wvla -Wno-unused-parameter -Werror
DEPS_PC := libpcre2-8 jansson libmicrohttpd libcurl
K3_CFLAGS := -std=c11 -D_GNU_SOURCE -Iinclude -Isrc $(WARN) -pthread -MMD -MP
LDLIBS  := -lm -pthread

BUILD   := build
DEPS_OK := $(BUILD)/.deps-ok

SRC     := $(sort $(wildcard src/*/*.c))
CLI_SRC := $(sort $(wildcard cli/*.c))
TEST_SRC:= $(sort $(wildcard tests/*.c))
OBJ     := $(SRC:%.c=$(BUILD)/%.o)
CLI_OBJ := $(CLI_SRC:%.c=$(BUILD)/%.o)
TEST_OBJ:= $(TEST_SRC:%.c=$(BUILD)/%.o)

# Default model bundled in the repo, and the prompt `make run` uses.
MODEL   ?= models/k3-mini
PROMPT  ?= It is a truth universally acknowledged, that
RUN_ARGS?= -n 64

.PHONY: all help deps run test test-unit test-cli clean asan ubsan format check-reference kbench xcore
all: $(BUILD)/k3 $(BUILD)/k3-test

help:
	@echo "make run         install deps, build, generate text from $(MODEL)"
	@echo "make test        build and run the whole test suite"
	@echo "make asan|ubsan  the suite under AddressSanitizer / UBSan"
	@echo "make check-reference  compare with external references (needs PyPI)"
	@echo "make clean"

# Installs the Debian packages the build needs when pkg-config cannot find them.
$(DEPS_OK): scripts/install-deps.sh
	@mkdir -p $(BUILD)
	@pkg-config --exists $(DEPS_PC) 2>/dev/null || sh scripts/install-deps.sh
	@pkg-config --exists $(DEPS_PC) || { echo "missing: $(DEPS_PC) (see scripts/install-deps.sh)"; exit 1; }
	@touch $@
deps: $(DEPS_OK)

PC_CFLAGS = $(shell pkg-config --cflags $(DEPS_PC) 2>/dev/null)
PC_LIBS   = $(shell pkg-config --libs $(DEPS_PC) 2>/dev/null)

$(BUILD)/%.o: %.c | $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -c $< -o $@

$(BUILD)/%_avx2.o: %_avx2.c | $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -mavx2 -mfma -mf16c -c $< -o $@

$(BUILD)/%_avx512.o: %_avx512.c | $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma -mf16c -c $< -o $@

$(BUILD)/libk3.a: $(OBJ)
	ar rcs $@ $^

$(BUILD)/k3: $(CLI_OBJ) $(BUILD)/libk3.a
	$(CC) $(CFLAGS) -o $@ $(CLI_OBJ) $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)

$(BUILD)/k3-test: $(TEST_OBJ) $(BUILD)/libk3.a
	$(CC) $(CFLAGS) -o $@ $(TEST_OBJ) $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)

run: $(BUILD)/k3
	$(BUILD)/k3 run -m $(MODEL) $(RUN_ARGS) "$(PROMPT)"

test: $(BUILD)/k3 $(BUILD)/k3-test
	@sh tests/run.sh $(BUILD)/k3-test $(BUILD)/k3

asan:
	$(MAKE) BUILD=build-asan CFLAGS="-O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer" test

ubsan:
	$(MAKE) BUILD=build-ubsan CFLAGS="-O1 -g -fsanitize=undefined -fno-sanitize-recover" test

check-reference:
	sh tools/check-reference.sh

format:
	clang-format -i include/*.h src/*/*.[ch] cli/*.c tests/*.[ch]

clean:
	rm -rf $(BUILD) build-asan build-ubsan

-include $(OBJ:.o=.d) $(CLI_OBJ:.o=.d) $(TEST_OBJ:.o=.d)

# Developer tool: the matvec kernels alone against the read bandwidth.
$(BUILD)/kbench: bench/kbench.c $(BUILD)/libk3.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)
kbench: $(BUILD)/kbench

# Developer tool: the cost of a hand-off between the two cores, and the read
# bandwidth of one thread and of two (which of the machine's states is on).
$(BUILD)/xcore: bench/xcore.c $(BUILD)/libk3.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)
xcore: $(BUILD)/xcore
