# kvd - one flat Makefile.
#
#   make            build ./kvd (objects in build/)
#   make deps       install the Debian packages the build and tests need
#   make run        deps, build, make the default model, start the daemon
#   make test       deps, build and run every test program, print a summary
#   make asan       the tests under AddressSanitizer + UBSan (build-asan/)
#   make tsan       the thread pool's tests under ThreadSanitizer (build-tsan/)
#   make bench      build and run the benchmarks in tests/bench/, then the
#                   speed table (bench-table: BEFORE=, FULL=1, CTX=, see below)
#   make fuzz       build the libFuzzer targets in tests/fuzz/ and run each
#                   FUZZ_SECONDS (default 60) under ASan + UBSan
#   make soak       an hour (SOAK_SECONDS) of mixed traffic against kvd serve,
#                   sampled into build/soak/soak.csv and .png; fails on a leak
#   make format     clang-format every source file
#   make clean
#
# Overridable: CC, OPT, ARCH (the base architecture of everything but the
# SIMD kernels, which are built for every level and chosen at run time, see
# "kernel levels" below; ARCH=x86-64-v2 makes a binary that runs on any
# x86-64 of the last fifteen years at the kernels' full speed),
# BUILD (object directory), WERROR=1 (warnings are errors; CI sets it),
# THREADS (pool: kvd's own thread pool, cpu/pool.h, the default; omp: the
# same parallel regions on OpenMP's team, objects in build-omp/),
# TESTS (build and run only these test programs, e.g. TESTS="attention cache"),
# LLHTTP_DIR (where Debian's node-llhttp puts its C sources), RUN_ARGS (what
# `make run` passes to `kvd serve`), DEPS_CMD (what `make deps` runs).

CC      ?= gcc
ARCH    ?= native
OPT     ?= -O3
THREADS ?= pool
BUILD   ?= build$(if $(filter omp,$(THREADS)),-omp)
WERROR  ?=
SHARED  ?= ../shared

LLHTTP_DIR     ?= /usr/share/llhttp
LLHTTP_INCLUDE ?= /usr/share/include/llhttp

ifeq ($(filter pool omp,$(THREADS)),)
$(error THREADS=$(THREADS): want pool (kvd's thread pool) or omp (OpenMP))
endif
# OpenMP: the whole build with THREADS=omp; otherwise only the benchmarks
# (their bandwidth probes) and test_pool (which checks the partition against
# OpenMP's) use it.
OMP      := -fopenmp
THR_FLAGS := $(if $(filter omp,$(THREADS)),$(OMP) -DKVD_THREADS_OMP)

WARN     := -Wall -Wextra -Wshadow -Wstrict-prototypes $(if $(WERROR),-Werror)
CPPFLAGS += -D_GNU_SOURCE -I. -I$(LLHTTP_INCLUDE) -MMD -MP
CFLAGS   += -std=c11 $(OPT) -march=$(ARCH) -g $(THR_FLAGS) $(WARN) $(SANITIZE)
LDFLAGS  += $(THR_FLAGS) $(SANITIZE)
LDLIBS   += -luv -ljansson -linih -lpcre2-8 -lm -lpthread
TESTLIBS := -lcmocka

# Debian packages the build, the tests, `make fuzz` (clang's libFuzzer and
# OpenMP, which CI runs) and `make run` need.
DEB_PACKAGES := gcc make pkg-config libuv1-dev libjansson-dev node-llhttp \
                libcmocka-dev libinih-dev libpcre2-dev curl gnuplot-nox haproxy \
                clang libclang-rt-14-dev libomp-14-dev
# The browser tests (tests/test_web.c): Debian's chromium, and node + npm
# for puppeteer-core (npm installs it into $(BUILD)/artefacts at test time).
# A node or npm already on PATH (another packaging of Node.js) is used as it
# is: Debian's npm package would conflict with it.
DEB_PACKAGES += chromium $(if $(shell command -v node 2>/dev/null),,nodejs) \
                $(if $(shell command -v npm 2>/dev/null),,npm)
# What `make deploy-check` needs (haproxy is also in DEB_PACKAGES for the tests).
DEPLOY_PACKAGES := haproxy python3-yaml systemd

# --- kernel levels -------------------------------------------------------------
# The SIMD kernel files are compiled once per level, each copy with its own
# -march and its symbols suffixed by level (cpu/kernel.h), and cpu/cpu.c
# picks one level at start from what the CPU has (printed by the commands;
# KVD_CPU forces a lower one). The base copy (build/x/f.o) is the scalar
# level, compiled for ARCH like the rest. A new kernel file joins by being
# named in KERNEL_SRC and following cpu/kernel.h. Targets other than x86-64
# carry the scalar level only.
KERNEL_SRC    := attention/attn_simd.c model/matmul.c model/matmul_k.c model/matmul_pack.c model/ops.c \
                 model/matmul_bf16.c model/matmul_amx.c model/matmul_pack_avx2.c
KERNEL_SRC    += attention/attn_rope.c
KERNEL_IS_X86 := $(filter x86_64-% i686-% i386-%,$(shell $(CC) -dumpmachine))
KERNEL_LEVELS := $(if $(KERNEL_IS_X86),avx2 avx512)
LEVEL_FLAGS_avx2   := -march=x86-64-v3 -DKVD_LEVEL_AVX2
LEVEL_FLAGS_avx512 := -march=x86-64-v4 -mavx512vnni -DKVD_LEVEL_AVX512
CPPFLAGS += -DKVD_KERNEL_LEVELS=$(words scalar $(KERNEL_LEVELS))
# the per-level copies of the kernel files among $(1)
kvariants = $(foreach l,$(KERNEL_LEVELS),$(patsubst %.c,$(BUILD)/%.$(l).o,$(filter $(KERNEL_SRC),$(1))))

# --- sources, one list per room ---------------------------------------------
CPU_SRC    := $(wildcard cpu/*.c)
ATTN_SRC   := $(wildcard attention/*.c)
CACHE_SRC  := $(wildcard cache/*.c)
MODEL_SRC  := $(wildcard model/*.c)
CONFIG_SRC := $(wildcard config/*.c)
TEMPLATE_SRC := $(wildcard template/*.c)
ENGINE_SRC := $(wildcard engine/*.c)
SERVER_SRC := $(wildcard server/*.c)
LOAD_SRC   := $(wildcard load/*.c)
CLI_SRC    := $(filter-out cli/main.c,$(wildcard cli/*.c))
LLHTTP_SRC := api.c http.c llhttp.c

# The web page's files (server/web/), embedded in the binary: mkassets (a
# build tool in C) writes them into one generated C file.
WEB_FILES  := $(sort $(wildcard server/web/*.html server/web/*.css server/web/*.js))
WEB_OBJ    := $(BUILD)/gen/web_assets.o

obj = $(patsubst %.c,$(BUILD)/%.o,$(1)) $(call kvariants,$(1))
CPU_OBJ    := $(call obj,$(CPU_SRC))
ATTN_OBJ   := $(call obj,$(ATTN_SRC)) $(CPU_OBJ)
CACHE_OBJ  := $(call obj,$(CACHE_SRC))
MODEL_OBJ  := $(call obj,$(MODEL_SRC))
CONFIG_OBJ := $(call obj,$(CONFIG_SRC))
TEMPLATE_OBJ := $(call obj,$(TEMPLATE_SRC))
ENGINE_OBJ := $(call obj,$(ENGINE_SRC))
SERVER_OBJ := $(call obj,$(SERVER_SRC)) $(WEB_OBJ)
LOAD_OBJ   := $(call obj,$(LOAD_SRC))
CLI_OBJ    := $(call obj,$(CLI_SRC))
LLHTTP_OBJ := $(patsubst %.c,$(BUILD)/llhttp/%.o,$(LLHTTP_SRC))
ALL_OBJ    := $(CLI_OBJ) $(LOAD_OBJ) $(SERVER_OBJ) $(ENGINE_OBJ) $(MODEL_OBJ) $(TEMPLATE_OBJ) $(CACHE_OBJ) $(ATTN_OBJ) \
              $(CONFIG_OBJ) $(LLHTTP_OBJ)

# What each test program links: its room and the rooms below it, so a room's
# tests build even while another room is mid-change.
LINK_attention := $(ATTN_OBJ)
LINK_posenc    := $(ATTN_OBJ)
LINK_cache     := $(CACHE_OBJ) $(ATTN_OBJ)
LINK_cache_invariants := $(LINK_cache)
LINK_cache_share := $(LINK_cache)
LINK_model     := $(MODEL_OBJ) $(CACHE_OBJ) $(ATTN_OBJ)
LINK_config    := $(CONFIG_OBJ) $(BUILD)/cli/wiring.o $(CACHE_OBJ) $(ATTN_OBJ)
LINK_template  := $(TEMPLATE_OBJ)
# test_cpu includes cpu/cpu.c itself (white-box)
LINK_cpu       := $(filter-out $(BUILD)/cpu/cpu.o,$(ATTN_OBJ))
LINK_pool      := $(BUILD)/cpu/pool.o
# Model-room pieces with their own test programs (built before forward.c exists).
LINK_gguf      := $(filter $(BUILD)/model/gguf%.o,$(MODEL_OBJ))
LINK_tokenizer := $(filter $(BUILD)/model/gguf%.o $(BUILD)/model/tokenizer%.o,$(MODEL_OBJ))
LINK_ops       := $(filter $(BUILD)/model/ops%.o,$(MODEL_OBJ)) $(CPU_OBJ)
LINK_quant     := $(filter $(BUILD)/model/quant%.o $(BUILD)/model/matmul%.o,$(MODEL_OBJ)) $(CPU_OBJ)
LINK_bf16      := $(LINK_quant)
LINK_sampler   := $(filter $(BUILD)/model/sampler%.o,$(MODEL_OBJ))
LINK_arch      := $(MODEL_OBJ) $(CACHE_OBJ) $(ATTN_OBJ)
LINK_load      := $(LOAD_OBJ) $(CONFIG_OBJ) $(MODEL_OBJ) $(CACHE_OBJ) $(ATTN_OBJ) $(LLHTTP_OBJ)

TEST_SRC   := $(wildcard tests/test_*.c)
TEST_NAMES := $(patsubst tests/test_%.c,%,$(TEST_SRC))
TESTS      ?= $(TEST_NAMES)
TEST_BIN   := $(patsubst %,$(BUILD)/tests/test_%,$(TEST_NAMES))
BENCH_SRC  := $(wildcard tests/bench/bench_*.c)
BENCH_BIN  := $(patsubst tests/bench/%.c,$(BUILD)/bench/%,$(BENCH_SRC))

.PHONY: all deps run test asan tsan bench bench-table format clean tests benches deploy-deps deploy-check \
        fuzz fuzzers soak
all: kvd

kvd: $(BUILD)/kvd
	ln -sf $(BUILD)/kvd kvd

$(BUILD)/kvd: $(BUILD)/cli/main.o $(ALL_OBJ)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -c -o $@ $<

define level_rule
$$(BUILD)/%.$(1).o: %.c
	@mkdir -p $$(dir $$@)
	$$(CC) $$(CPPFLAGS) $$(CFLAGS) $$(LEVEL_FLAGS_$(1)) -c -o $$@ $$<
endef
$(foreach l,$(KERNEL_LEVELS),$(eval $(call level_rule,$(l))))

$(BUILD)/gen/mkassets: server/web/mkassets.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -O1 -Wall -Wextra $(if $(WERROR),-Werror) -o $@ $<

$(BUILD)/gen/web_assets.c: $(BUILD)/gen/mkassets $(WEB_FILES)
	$(BUILD)/gen/mkassets $@ $(WEB_FILES)

$(BUILD)/gen/web_assets.o: $(BUILD)/gen/web_assets.c server/web.h
	$(CC) $(CPPFLAGS) $(CFLAGS) -c -o $@ $<

# llhttp is compiled into the build from Debian's sources, as Debian's own
# packages do; its generated code is not ours to warn about.
$(BUILD)/llhttp/%.o: $(LLHTTP_DIR)/%.c
	@mkdir -p $(dir $@)
	$(CC) -I$(LLHTTP_INCLUDE) -std=c11 $(OPT) -march=$(ARCH) -g $(SANITIZE) -w -c -o $@ $<

# --- tests ---------------------------------------------------------------------
.SECONDEXPANSION:
$(BUILD)/tests/test_%: tests/test_%.c $$(if $$(LINK_$$*),$$(LINK_$$*),$(ALL_OBJ))
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -o $@ $< $(filter %.o,$^) $(LDFLAGS) $(TESTLIBS) $(LDLIBS)

# test_pool compares cpu_pool_for's partition with OpenMP's own.
$(BUILD)/tests/test_pool: private CFLAGS += $(OMP)
$(BUILD)/tests/test_pool: private LDFLAGS += $(OMP)

# test_bench_table runs the speed table's driver (BUILD/bench/) on a tiny model.
$(BUILD)/tests/test_bench_table: $(BUILD)/bench/bench_table

tests: $(TEST_BIN) $(BUILD)/kvd

# `make test` and `make run` install the packages in a make invocation of
# their own, then build in another: GNU make reads a directory's contents
# once, so a build in the same invocation as the install would not see the
# llhttp sources the install just created ("No rule to make target
# build/llhttp/api.o"). tests/test_build.c runs both on a copy of the tree
# whose LLHTTP_DIR appears only during `make deps`.
test:
	@$(MAKE) --no-print-directory deps
	@$(MAKE) --no-print-directory $(patsubst %,$(BUILD)/tests/test_%,$(TESTS)) $(BUILD)/kvd
	@KVD_BIN=$(BUILD)/kvd KVD_SHARED=$(SHARED) KVD_ARTEFACTS=$(BUILD)/artefacts \
	  sh tests/run.sh $(patsubst %,$(BUILD)/tests/test_%,$(TESTS))

asan:
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  $(MAKE) BUILD=build-asan OPT=-O1 \
	  SANITIZE="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" test

# ThreadSanitizer on the thread pool's own tests (build-tsan/; not in CI).
# test_pool compares the partition with OpenMP's, whose runtime is not
# instrumented: tests/tsan.supp names that test; a forked child may start
# threads (die_after_fork=0: the pool's fork test does exactly that).
tsan:
	@$(MAKE) --no-print-directory BUILD=build-tsan OPT=-O1 SANITIZE=-fsanitize=thread \
	  build-tsan/tests/test_pool
	TSAN_OPTIONS="halt_on_error=1 suppressions=tests/tsan.supp die_after_fork=0" \
	  build-tsan/tests/test_pool

# --- benchmarks ----------------------------------------------------------------
$(BUILD)/bench/%: tests/bench/%.c $(ALL_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(OMP) -o $@ $< $(ALL_OBJ) $(LDFLAGS) $(OMP) $(LDLIBS)

benches: $(BENCH_BIN)

# The table (tests/bench/bench_table.c) drives whole kvd binaries, so it
# runs with arguments, after the other benchmarks: decode and prefill
# tokens/s of the SmolLM-135M shape beside their rooflines, then the
# serve-vs-generate comparison on its q8_0 model. Knobs: BEFORE=OLD_KVD (a
# second binary, alternated with this one: both columns and the ratio),
# FULL=1 (512 to 64k for every type; the default runs 512 and 4k, and 16k
# for q8_0), CTX=512,4k (these contexts for every type), TYPES=q8_0,f16,
# f16-bf16 (f16-bf16: the f16 model under KVD_F16=bf16), KV=f16,q8_0,
# ROUNDS=N (the best of N), REAL=1 (a real prompt at 64k too, not a
# fill: tens of minutes per type). `make bench-table` runs only them.
BENCH_TABLE  := $(BUILD)/bench/bench_table
BENCH_MODELS ?= $(BUILD)/bench/models
BENCH_TABLE_ARGS = --kvd $(BUILD)/kvd --models $(BENCH_MODELS) $(if $(BEFORE),--before $(BEFORE)) \
                   $(if $(FULL),--full) $(if $(CTX),--ctx $(CTX)) $(if $(TYPES),--types $(TYPES)) \
                   $(if $(KV),--kv $(KV)) $(if $(ROUNDS),--rounds $(ROUNDS)) $(if $(REAL),--real)

bench: benches $(BUILD)/kvd
	@for b in $(filter-out $(BENCH_TABLE),$(BENCH_BIN)); do echo "== $$b"; \
	  KVD_SHARED=$(SHARED) $$b || exit 1; done
	@$(MAKE) --no-print-directory bench-table

bench-table: $(BENCH_TABLE) $(BUILD)/kvd
	@echo "== $(BENCH_TABLE)"
	@$(BENCH_TABLE) $(BENCH_TABLE_ARGS)
	@m=$(BENCH_MODELS)/576x30_q8_0.gguf; if [ -f $$m ]; then \
	  echo "== serve vs generate"; sh tests/bench/serve_vs_generate.sh $$m 32 $(BEFORE) $(BUILD)/kvd; \
	  else echo "serve vs generate: skipped ($$m is written by the table's q8_0 rows)"; fi

# --- fuzzing -------------------------------------------------------------------
# Each tests/fuzz/fuzz_NAME.c is a libFuzzer target, built with clang and
# ASan + UBSan into build-fuzz/ (the whole tree is compiled there with
# -fsanitize=fuzzer-no-link so coverage reaches every room). `make fuzz`
# runs each for FUZZ_SECONDS from its committed seeds (tests/fuzz/corpus/
# NAME/, and the folders tests/fuzz/NAME.seeds lists) with its dictionary
# (tests/fuzz/NAME.dict) when there is one; new
# inputs go to build-fuzz/corpus/NAME/, never into the tree. A crash stops
# the run, leaving the input in build-fuzz/crash-*. Tokenizer targets read
# the vocabularies in $(SHARED)/vocab (KVD_SHARED). The fuzz_route_*
# targets run the real kvd serve on a thread of the fuzzer and post each
# input to their route over loopback (tests/fuzz/route_fuzz.h).
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 60
FUZZ_BUILD   := build-fuzz
FUZZ_SAN     := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
FUZZ_NAMES   := $(patsubst tests/fuzz/fuzz_%.c,%,$(wildcard tests/fuzz/fuzz_*.c))
FUZZ_BIN     := $(patsubst %,$(BUILD)/fuzz/fuzz_%,$(FUZZ_NAMES))

# clang takes minutes to instrument the SIMD kernels with ASan, and no
# fuzz target reaches them (they are tested against the reference kernel):
# only coverage there, in every level's copy.
ifeq ($(BUILD),$(FUZZ_BUILD))
$(call obj,attention/attn_simd.c): override SANITIZE := -fsanitize=fuzzer-no-link
endif

$(BUILD)/fuzz/fuzz_%: tests/fuzz/fuzz_%.c $(ALL_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -fsanitize=fuzzer -o $@ $< $(ALL_OBJ) $(LDFLAGS) $(LDLIBS)

fuzzers: $(FUZZ_BIN)

fuzz:
	@$(MAKE) --no-print-directory BUILD=$(FUZZ_BUILD) CC=$(FUZZ_CC) OPT=-O1 \
	  SANITIZE="$(FUZZ_SAN) -fsanitize=fuzzer-no-link" fuzzers
	@for n in $(FUZZ_NAMES); do \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$n tests/fuzz/corpus/$$n; \
	  dict=""; [ -f tests/fuzz/$$n.dict ] && dict="-dict=../tests/fuzz/$$n.dict"; \
	  seeds=""; [ -f tests/fuzz/$$n.seeds ] && seeds=$$(sed 's|^|../|' tests/fuzz/$$n.seeds); \
	  echo "== fuzz_$$n: $(FUZZ_SECONDS) s"; \
	  ( cd $(FUZZ_BUILD) && KVD_SHARED=$(abspath $(SHARED)) \
	    ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1 \
	    ./fuzz/fuzz_$$n -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -timeout=20 \
	      -rss_limit_mb=2048 -print_final_stats=1 $$dict corpus/$$n ../tests/fuzz/corpus/$$n $$seeds \
	      > fuzz_$$n.log 2>&1; rc=$$?; tail -n 20 fuzz_$$n.log; exit $$rc ) || exit 1; \
	done

# --- soak ----------------------------------------------------------------------
# Not in `make test` or CI: tests/soak.sh runs kvd serve under kvd load for
# SOAK_SECONDS, samples RSS, descriptors, KV pages, queue depth and sessions
# into build/soak/soak.csv, plots them (soak.png), prints each series' drift
# and fails on a growing RSS, or a server that does not return to rest.
SOAK_SECONDS ?= 3600
soak: kvd
	KVD_BIN=$(BUILD)/kvd KVD_SHARED=$(SHARED) SOAK_SECONDS=$(SOAK_SECONDS) sh tests/soak.sh

# --- setup and run -----------------------------------------------------------------
DEPS_CMD ?= $(MAKE) --no-print-directory install-packages PACKAGES="$(DEB_PACKAGES)"
deps:
	@$(DEPS_CMD)

deploy-deps:
	@$(MAKE) --no-print-directory install-packages PACKAGES="$(DEPLOY_PACKAGES)"

# Install the Debian packages in PACKAGES that are missing (as root), or
# print the command to run.
install-packages:
	@missing=""; for p in $(PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then echo "deps: all Debian packages present"; \
	elif [ "$$(id -u)" = 0 ]; then \
	  echo "deps: installing$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	else echo "deps: missing$$missing; run: sudo apt-get install -y$$missing"; exit 1; fi

# The daemon on 127.0.0.1:8080, serving the default model (made once): the
# constructed retrieval model, which copies a code from far back in a prompt.
RUN_ARGS ?= --config config/kvd.conf
run:
	@$(MAKE) --no-print-directory deps
	@$(MAKE) --no-print-directory kvd
	@test -f models/default.gguf || { mkdir -p models && ./kvd mkmodel --preset retrieval --out models/default.gguf; }
	./kvd serve $(RUN_ARGS)

# Validate Dockerfile, systemd unit, Kubernetes manifests and HAProxy configs.
deploy-check: deploy-deps kvd
	sh deploy/check.sh $(BUILD)/kvd

format:
	clang-format -i $$(git ls-files '*.c' '*.h')

clean:
	rm -rf build build-omp build-asan build-tsan $(FUZZ_BUILD) kvd

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
