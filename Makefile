# k3 -- hand-written Makefile. `make help` lists the targets.
#
# Layout: src/<subsystem>/*.c -> build/libk3.a; cli/*.c -> build/k3;
# tests/*.c -> build/k3-test. Files named *_avx2.c / *_avx512.c get their ISA
# flags; everything else is plain x86-64 so the binary runs anywhere and picks
# its kernels at run time.

# `make` runs as many jobs as there are CPUs unless -j is given.
ifeq ($(MAKELEVEL)$(filter -j% j% --jobserver%,$(MAKEFLAGS)),0)
MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 2)
endif

CC      ?= cc
# -O2, with the vectorizer's cost model of -O3: the plain loops of the
# non-kernel files (residual adds, copies, x + 128) become SSE2 code; every
# element is computed as before, so results do not change.
OPT     ?= -O2 -fvect-cost-model=dynamic
CFLAGS  ?= $(OPT) -g
WARN    := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wvla -Wno-unused-parameter -Wno-missing-field-initializers -Werror
DEPS_PC := libpcre2-8 jansson libpng libjpeg libwebp libwebpdemux libmicrohttpd libcurl libxxhash libzmq msgpack libcrypto
K3_CFLAGS := -std=c11 -D_GNU_SOURCE -Iinclude -Isrc $(WARN) -pthread -MMD -MP
# giflib ships no pkg-config file: its header is checked by the deps step.
LDLIBS  := -lgif -lm -pthread

BUILD   := build
DEPS_OK := $(BUILD)/.deps-ok

SRC     := $(sort $(wildcard src/*/*.c))
CLI_SRC := $(sort $(wildcard cli/*.c))
TEST_SRC:= $(sort $(wildcard tests/*.c))
OBJ     := $(SRC:%.c=$(BUILD)/%.o)
# The chat page at / (src/server/ui/index.html) as a C array in the library:
# tools/embed.c writes it, so the build needs no xxd.
UI_PAGE := src/server/ui/index.html
OBJ     += $(BUILD)/gen/ui_page.o
CLI_OBJ := $(CLI_SRC:%.c=$(BUILD)/%.o)
TEST_OBJ:= $(TEST_SRC:%.c=$(BUILD)/%.o)

# Default model bundled in the repo, and the prompt `make run` uses.
MODEL   ?= models/k3-mini
PROMPT  ?= It is a truth universally acknowledged, that
RUN_ARGS?= -n 64

.PHONY: all help deps run test test-unit test-cli clean asan ubsan format check-reference kbench kdabench qbench xcore stepgap amxbench tcpcopy kvsbench ucxbench test-hosts bench-hosts
all: $(BUILD)/k3 $(BUILD)/k3-test

help:
	@echo "make run         install deps, build, generate text from $(MODEL)"
	@echo "make test        build and run the whole test suite"
	@echo "make asan|ubsan  the suite under AddressSanitizer / UBSan"
	@echo "make check-reference  compare with external references (needs PyPI)"
	@echo "make test-hf-tokenizer  the Hugging Face tokenizer of each checkpoint against k3's (needs PyPI)"
	@echo "make test-browser  the chat page at / in headless Chromium (installs Debian's chromium)"
	@echo "make test-lm-eval  lm-eval local-completions, remote tokenizer, against k3 serve (needs PyPI)"
	@echo "make test-hosts  MPI and prefill/decode across network-namespace hosts, shaped links, hosts lost (root)"
	@echo "make bench-hosts the figures across namespace hosts: UCX and TCP GB/s, MPI bytes per token, PD transfers"
	@echo "make bench-model make the bench checkpoints (bench/bench, bench/bench-dsa; ~2 GB each)"
	@echo "make install     install k3 and the default model under PREFIX (default /usr/local)"
	@echo "make fuzz        run each libFuzzer harness for FUZZ_TIME seconds (default 60)"
	@echo "make clean"

# Installs the Debian packages the build needs when pkg-config cannot find them
# (or the compiler cannot find giflib's header, which has no .pc file).
HAVE_GIF_H = printf '\#include <gif_lib.h>\n' | $(CC) -E -x c - >/dev/null 2>&1
$(DEPS_OK): scripts/install-deps.sh
	@mkdir -p $(BUILD)
	@{ pkg-config --exists $(DEPS_PC) && $(HAVE_GIF_H) && { [ "$(UCX)" = no ] || pkg-config --exists ucx; }; } 2>/dev/null || sh scripts/install-deps.sh
	@pkg-config --exists $(DEPS_PC) || { echo "missing: $(DEPS_PC) (see scripts/install-deps.sh)"; exit 1; }
	@$(HAVE_GIF_H) || { echo "missing: gif_lib.h (libgif-dev, see scripts/install-deps.sh)"; exit 1; }
	@touch $@
deps: $(DEPS_OK)

PC_CFLAGS = $(shell pkg-config --cflags $(DEPS_PC) 2>/dev/null) $(UCX_CFLAGS)
PC_LIBS   = $(shell pkg-config --libs $(DEPS_PC) 2>/dev/null) $(UCX_LIBS)

# UCX (src/comm/ucx.c, Debian's libucx-dev): optional. Found by pkg-config
# when a recipe runs (after the deps step installed it), so the first build
# on a fresh machine has it too; `make UCX=no` builds without it (every
# k3_ucx_* call then says so and the UCX tests skip). Flags are lazy (=).
UCX ?= auto
UCX_FOUND  = $(if $(filter no,$(UCX)),,$(shell pkg-config --exists ucx 2>/dev/null && echo yes))
UCX_CFLAGS = $(if $(UCX_FOUND),-DK3_HAVE_UCX=1 $(shell pkg-config --cflags ucx 2>/dev/null))
UCX_LIBS   = $(if $(UCX_FOUND),$(shell pkg-config --libs ucx 2>/dev/null))

$(BUILD)/%.o: %.c | $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -c $< -o $@

$(BUILD)/%_avx2.o: %_avx2.c | $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -mavx2 -mfma -mf16c -c $< -o $@

$(BUILD)/%_avx512.o: %_avx512.c | $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma -mf16c -c $< -o $@

# AVX-512 with the BF16 dot products (vdpbf16ps): chosen at run time where
# the CPU has AVX512_BF16.
$(BUILD)/%_avx512bf16.o: %_avx512bf16.c | $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -mavx512bf16 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c -c $< -o $@

$(BUILD)/embed: tools/embed.c
	@mkdir -p $(dir $@)
	$(CC) -O2 -o $@ $<
$(BUILD)/gen/ui_page.c: $(UI_PAGE) $(BUILD)/embed
	@mkdir -p $(dir $@)
	$(BUILD)/embed k3_ui_index_html $(UI_PAGE) > $@.tmp && mv $@.tmp $@
$(BUILD)/gen/ui_page.o: $(BUILD)/gen/ui_page.c
	$(CC) $(K3_CFLAGS) $(CFLAGS) -c $< -o $@
# The AMX kernels (src/kernels/*_amx.c): the tile instructions and the
# AVX-512 parts around them; chosen at run time like the others.
$(BUILD)/src/kernels/%_amx.o: src/kernels/%_amx.c | $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -mamx-tile -mamx-bf16 -mamx-int8 -mavx512bf16 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx2 -mfma -mf16c -c $< -o $@

# made afresh, so an object whose source is gone does not stay in the archive
$(BUILD)/libk3.a: $(OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/k3: $(CLI_OBJ) $(BUILD)/libk3.a
	$(CC) $(CFLAGS) -o $@ $(CLI_OBJ) $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)

$(BUILD)/k3-test: $(TEST_OBJ) $(BUILD)/libk3.a
	$(CC) $(CFLAGS) -o $@ $(TEST_OBJ) $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)

run: $(BUILD)/k3
	$(BUILD)/k3 run -m $(MODEL) $(RUN_ARGS) "$(PROMPT)"

test: $(BUILD)/k3 $(BUILD)/k3-test fuzz-build
	@FUZZ_DIR=$(if $(HAVE_CLANG),$(FUZZ_BUILD),no-clang) FUZZ_TEST_TIME=$(FUZZ_TEST_TIME) sh tests/run.sh $(BUILD)/k3-test $(BUILD)/k3

asan:
	$(MAKE) BUILD=build-asan CFLAGS="-O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer" test

ubsan:
	$(MAKE) BUILD=build-ubsan CFLAGS="-O1 -g -fsanitize=undefined -fno-sanitize-recover" test

check-reference:
	sh tools/check-reference.sh

# The Hugging Face tokenizer every checkpoint ships (tools/hf_tokenizer)
# against k3's, id for id: transformers + tiktoken in the project's .venv
# (scripts/venv.sh, PyPI the first time), no torch.
# The chat page at / in headless Chromium (tests/browser_ui.py): Debian's
# chromium by scripts/install-browser-deps.sh (not needed by the build or
# `make test`), the openai client in the project's .venv; screenshots in
# $(BUILD)/test-browser.
.PHONY: test-browser
test-browser: $(BUILD)/k3
	@sh scripts/install-browser-deps.sh
	@PY=$$(sh scripts/venv.sh openai) && "$$PY" tests/browser_ui.py $(BUILD)/k3 $(BUILD)/test-browser

.PHONY: test-hf-tokenizer
test-hf-tokenizer: $(BUILD)/k3
	@PY=$$(sh scripts/venv.sh transformers tiktoken) && "$$PY" tests/hf_tokenizer.py $(BUILD)/k3

# lm-eval's local-completions with tokenizer_backend=remote against k3 serve on
# models/k3-mini (tests/lm_eval_remote.py, tasks in tests/lm_eval/):
# lm-eval[api] 0.4.13 into the project's .venv (PyPI the first time: ~750 MB
# with datasets, pyarrow, pandas, scipy; about 2 minutes), no torch.
LM_EVAL_PKG ?= lm-eval[api]==0.4.13
.PHONY: test-lm-eval
test-lm-eval: $(BUILD)/k3
	@PY=$$(sh scripts/venv.sh numpy openai) && \
	  { "$$PY" -c "import lm_eval, aiohttp, tenacity" 2>/dev/null || "$$PY" -m pip install -q "$(LM_EVAL_PKG)"; } && \
	  "$$PY" tests/lm_eval_remote.py $(BUILD)/k3

format:
	clang-format -i include/*.h src/*/*.[ch] cli/*.[ch] tests/*.[ch]

clean:
	rm -rf $(BUILD) build-asan build-ubsan $(FUZZ_BUILD)

-include $(OBJ:.o=.d) $(CLI_OBJ:.o=.d) $(TEST_OBJ:.o=.d) $(wildcard $(BUILD)/fuzz_*.d)

# Developer tool: the matvec kernels alone against the read bandwidth.
$(BUILD)/kbench: bench/kbench.c $(BUILD)/libk3.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)
kbench: $(BUILD)/kbench

# Developer tool: KDA's recurrent and BF16 chunked forms alone (docs/amx.md).
$(BUILD)/kdabench: bench/kdabench.c $(BUILD)/libk3.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)
kdabench: $(BUILD)/kdabench

# Developer tool: the AMX kernels alone (the unit's peak, the routed experts
# of the bench checkpoint's shapes from DRAM, BF16 trunk products), beside
# the AVX-512 ones (docs/amx.md).
$(BUILD)/amxbench: bench/amxbench.c $(BUILD)/libk3.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)
amxbench: $(BUILD)/amxbench

# Developer tool: the 8-bit prefill products alone (W8A8, W4A8) at the bench
# checkpoint's shapes against the INT8 dot-product peak (docs/performance.md).
$(BUILD)/qbench: bench/qbench.c $(BUILD)/libk3.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)
qbench: $(BUILD)/qbench

# Developer tool: the cost of a hand-off between the two cores, and the read
# bandwidth of one thread and of two (which of the machine's states is on).
$(BUILD)/xcore: bench/xcore.c $(BUILD)/libk3.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)
xcore: $(BUILD)/xcore

# Developer tool: the plain loopback TCP copy the prefill -> decode transfer is held against.
$(BUILD)/tcpcopy: bench/tcpcopy.c | $(DEPS_OK)
	$(CC) $(K3_CFLAGS) $(CFLAGS) -o $@ $< -pthread
tcpcopy: $(BUILD)/tcpcopy

# Developer tool: one-sided UCX transfers (src/comm/ucx) against a plain TCP
# stream of the same bytes, on one host or across two (bench/ucxbench.c).
$(BUILD)/ucxbench: bench/ucxbench.c $(BUILD)/libk3.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)
ucxbench: $(BUILD)/ucxbench
test: $(BUILD)/ucxbench

# Several hosts for real (tests/hosts.sh; network namespaces, needs root):
# `make test` runs its quick part; test-hosts adds the shaped links and the
# hosts lost under mpirun; bench-hosts prints the figures of docs/hosts.md.
# k3-netdelay: the links' delay where the kernel has no netem (tests/hosts/netdelay.c).
$(BUILD)/k3-netdelay: tests/hosts/netdelay.c | $(DEPS_OK)
	$(CC) $(K3_CFLAGS) $(CFLAGS) -o $@ $<
test-hosts: $(BUILD)/k3 $(BUILD)/ucxbench $(BUILD)/k3-netdelay
	sh tests/hosts.sh $(BUILD)/k3 --full
bench-hosts: $(BUILD)/k3 $(BUILD)/ucxbench $(BUILD)/k3-netdelay $(BUILD)/xcore
	sh bench/hosts.sh $(BUILD)/k3 ucx
	sh bench/hosts.sh $(BUILD)/k3 mpi
	sh bench/hosts.sh $(BUILD)/k3 pd

# Developer tool: the engine's decode step against a bare context's, interleaved.
$(BUILD)/stepgap: bench/stepgap.c $(BUILD)/libk3.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)
stepgap: $(BUILD)/stepgap

# ---- install, bench checkpoints, fuzzers (issue 14) --------------------------

# make install [PREFIX=/usr/local] [DESTDIR=]: the binary in PREFIX/bin, the
# default model in PREFIX/share/k3/models/k3-mini, where the binary looks
# for it (BIN/../share/k3/models/k3-mini).
PREFIX  ?= /usr/local
DESTDIR ?=
.PHONY: install uninstall bench-model fuzz fuzz-build
install: $(BUILD)/k3
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/k3/models/k3-mini
	install -m 755 $(BUILD)/k3 $(DESTDIR)$(PREFIX)/bin/k3
	install -m 644 $(MODEL)/* $(DESTDIR)$(PREFIX)/share/k3/models/k3-mini/
uninstall:
	rm -f $(DESTDIR)$(PREFIX)/bin/k3
	rm -rf $(DESTDIR)$(PREFIX)/share/k3

# The random bench checkpoints (tools/make_checkpoint.py, numpy in the
# project's .venv, made by scripts/venv.sh when missing): ~1.9 GB and ~15-40 s each.
BENCH_DIR ?= bench
bench-model: $(BENCH_DIR)/bench/config.json $(BENCH_DIR)/bench-dsa/config.json
$(BENCH_DIR)/bench/config.json $(BENCH_DIR)/bench-dsa/config.json: tools/make_checkpoint.py tools/k3ckpt.py
	@PY=$$(sh scripts/venv.sh numpy) && \
	  "$$PY" tools/make_checkpoint.py --preset $(notdir $(patsubst %/,%,$(dir $@))) --out $(dir $@)

# libFuzzer harnesses (fuzz/*.c) against a clang + ASan/UBSan build of the
# library; skipped, with a line saying so, when clang is missing.
FUZZ_CC     ?= clang
FUZZ_BUILD  ?= build-fuzz
FUZZ_TIME   ?= 60
FUZZ_TEST_TIME ?= 3
FUZZ_SAN    := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
FUZZ_NAMES  := safetensors config tiktoken chat image grammar
HAVE_CLANG  := $(shell command -v $(FUZZ_CC) >/dev/null 2>&1 && echo yes)
# Only the parsers are linked: common/, config, safetensors, tokenizer, image, grammar.
FUZZ_LIB_SRC := $(wildcard src/common/*.c src/tokenizer/*.c) src/model/config.c src/model/safetensors.c
FUZZ_LIB_SRC += src/vision/image.c src/vision/processor.c $(wildcard src/grammar/*.c)
ifeq ($(HAVE_CLANG),yes)
fuzz-build: $(DEPS_OK)
	@$(MAKE) --no-print-directory BUILD=$(FUZZ_BUILD) CC=$(FUZZ_CC) \
	  CFLAGS="-O1 -g $(FUZZ_SAN) -fsanitize=fuzzer-no-link" $(FUZZ_NAMES:%=$(FUZZ_BUILD)/fuzz_%)
$(FUZZ_BUILD)/libk3fuzz.a: $(FUZZ_LIB_SRC:%.c=$(FUZZ_BUILD)/%.o)
	ar rcs $@ $^
$(FUZZ_BUILD)/fuzz_%: fuzz/fuzz_%.c $(FUZZ_BUILD)/libk3fuzz.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) -O1 -g $(FUZZ_SAN) -fsanitize=fuzzer -o $@ $< $(FUZZ_BUILD)/libk3fuzz.a $(PC_LIBS) $(LDLIBS)
else
fuzz-build:
	@echo "fuzz: skipped: clang not found"
endif
fuzz: fuzz-build
	@sh fuzz/run.sh $(FUZZ_BUILD) $(FUZZ_TIME)
# MPI (src/comm: the only code that calls it): build/k3 always links OpenMPI (Debian's
# openmpi-bin + libopenmpi-dev, scripts/install-deps.sh); without mpirun it
# runs as world size 1. Flags from pkg-config ompi-c, else from mpicc.
DEPS_PC += ompi-c
MPI_TESTS := tests/mpi.sh
test-mpi: $(BUILD)/k3 $(BUILD)/k3-test
	sh $(MPI_TESTS) $(BUILD)/k3 $(BUILD)/k3-test
$(BUILD)/k3-cmp: tests/mpi/cmp_logits.c | $(DEPS_OK)
	$(CC) $(K3_CFLAGS) $(CFLAGS) -o $@ $< -lm
$(BUILD)/k3-mpi-exchange: tests/mpi/exchange.c $(BUILD)/libk3.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)
test: $(BUILD)/k3-cmp $(BUILD)/k3-mpi-exchange
$(BUILD)/k3-mpi-batch: tests/mpi/batch.c $(BUILD)/libk3.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)
test: $(BUILD)/k3-mpi-batch
# The disk tier across processes (tests/kvstore.sh).
$(BUILD)/k3-kvs-driver: tests/kvstore/driver.c tests/kvs_harness.h $(BUILD)/libk3.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)
test: $(BUILD)/k3-kvs-driver
$(BUILD)/k3-kvev-driver: tests/kvstore/events_driver.c $(BUILD)/libk3.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)
test: $(BUILD)/k3-kvev-driver
# Developer tool: the disk tier's save and load speed against the directory's raw sequential read.
$(BUILD)/kvsbench: bench/kvsbench.c $(BUILD)/libk3.a
	$(CC) $(K3_CFLAGS) $(PC_CFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libk3.a $(PC_LIBS) $(LDLIBS)
kvsbench: $(BUILD)/kvsbench
