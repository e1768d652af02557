# stripefs: make run (local cluster at ./mnt), make test, make fuzz (long fuzzing), make bench (bench/*.py: run, ec, tier, dataloader, meta, fuse_floor, data_wait, snapshot, passthrough), make stop.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UV_PIP := $(PY) -m uv pip install -q --python $(PY)
STATE ?= ./.stripefs
MNT ?= ./mnt
NODES ?= 4
DATASET_MNT ?=

.PHONY: install run stop status test unit inprocess cluster bench fuzz fuzz-resume clean csi-proto

$(VENV)/.installed: pyproject.toml
	@# Debian packages, those missing only, in one apt-get (one index update: ~10 s each on a fresh machine):
	@#  fuse3: fusermount3, with which the mount mounts when not root, and users unmount;
	@#  libfuse3-dev, pkg-config: pyfuse3's build (the bench's reference mount; installed with the rest,
	@#   the index update being the cost);
	@#  systemd: systemd-analyze verifies the units in deploy/;
	@#  postgresql: initdb and pg_ctl for --meta-store postgresql and its tests (Debian's server binaries
	@#   live in /usr/lib/postgresql/<version>/bin: stripefs/local_postgres.py finds them);
	@#  python3: the security tests run attacks as uid 65534 with Debian's interpreter;
	@#  tmux: the tests watch 'stripefs top' in a terminal.
	@missing=""; \
	command -v fusermount3 >/dev/null || missing="$$missing fuse3"; \
	pkg-config --exists fuse3 2>/dev/null || missing="$$missing libfuse3-dev pkg-config"; \
	command -v systemd-analyze >/dev/null || missing="$$missing systemd"; \
	ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || missing="$$missing postgresql"; \
	[ -x /usr/bin/python3 ] || missing="$$missing python3"; \
	command -v tmux >/dev/null || missing="$$missing tmux"; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# uv installs the same packages from PyPI as pip, about 3x faster (30 s against 92 s on a fresh
	@# machine here: parallel downloads, no byte-compiling): CI's 10 minutes are for the tests
	$(PY) -m pip install -q uv
	$(UV_PIP) -e '.[test]'
	@# erasure coding: the pyeclib wheel bundles liberasurecode and ISA-L; where pip had to build it
	@# from source (no wheel for this platform) the C libraries come from Debian, then pyeclib is rebuilt
	@if ! $(PY) -m stripefs.common.erasure; then \
		echo "installing liberasurecode-dev, libisal-dev and rebuilding pyeclib"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq liberasurecode-dev libisal-dev >/dev/null; \
		$(PY) -m pip install -q --force-reinstall --no-binary pyeclib pyeclib && $(PY) -m stripefs.common.erasure; \
	fi
	@touch $@

install: $(VENV)/.installed

# the bench extra (torch, Pillow) only for make bench: tests do not need it
$(VENV)/.bench-installed: $(VENV)/.installed
	@# pip, not uv: only pip looks in this machine's wheel folder for the CPU build of torch (uv would
	@# download a CUDA build of several GB)
	$(PY) -m pip install -q -e '.[test,bench]'
	@touch $@

run: install
	$(VENV)/bin/stripefs local up --dir $(STATE) --mount $(MNT) --nodes $(NODES) $(if $(DATASET_MNT),--dataset-mount $(DATASET_MNT))
	@echo
	@echo "stripefs is mounted at $(MNT). Try: cp -r /usr/share/doc $(MNT)/ && ls $(MNT)"
	@echo "Status: $(VENV)/bin/stripefs local status --dir $(STATE)    Stop: make stop"

stop:
	@if [ -x $(VENV)/bin/stripefs ]; then $(VENV)/bin/stripefs local down --dir $(STATE); else echo "stripefs is not installed here ($(VENV)): nothing to stop"; fi

status: install
	$(VENV)/bin/stripefs local status --dir $(STATE)

# three tiers, each its own pytest run (each has its own conftest): unit, the mount's handlers without a
# kernel (tests/inprocess: real daemon and node processes), then real mounts (tests/cluster).
# Each in pytest-xdist workers (tests/util.py keeps their ports and the page cache apart): units of work
# go whole to a worker in the order each tier's conftest sets (--no-loadscope-reorder), a unit being a
# test, or a group (xdist_group: a file with clusters of its own, the tests on a PostgreSQL cluster).
# Measured on 2 cores, each tier alone keeps the cores about half busy (CPU seconds of the tier and its
# processes against twice its wall time: unit 142/2x99, in-process 100/2x104, cluster ~330/2x464): the
# unit and in-process tiers run side by side, each in a port range of its own (the unit tier's output
# follows the in-process tier's), and the cluster tier in 3 workers. One at a time: make unit, inprocess,
# cluster (or XDIST_UNIT= etc. for no workers).
XDIST_UNIT ?= -n 4 --dist loadgroup --no-loadscope-reorder
XDIST_INPROCESS ?= -n 2 --dist loadgroup --no-loadscope-reorder
XDIST_CLUSTER ?= -n 3 --dist loadgroup --no-loadscope-reorder
UNIT_PORTS ?= 10000-20999
INPROCESS_PORTS ?= 21000-31999
test: install
	@unit_log=$$(mktemp); \
	STRIPEFS_LOCAL_PORTS=$(UNIT_PORTS) $(PY) -m pytest -q -x $(XDIST_UNIT) tests/unit >$$unit_log 2>&1 & unit=$$!; \
	STRIPEFS_LOCAL_PORTS=$(INPROCESS_PORTS) $(PY) -m pytest -q -x $(XDIST_INPROCESS) tests/inprocess; inprocess_rc=$$?; \
	wait $$unit; unit_rc=$$?; \
	echo "---- tests/unit (run beside tests/inprocess) ----"; cat $$unit_log; rm -f $$unit_log; \
	[ $$unit_rc -eq 0 ] && [ $$inprocess_rc -eq 0 ]
	$(PY) -m pytest -q $(XDIST_CLUSTER) tests/cluster

unit: install
	$(PY) -m pytest -q $(XDIST_UNIT) tests/unit

inprocess: install
	$(PY) -m pytest -q $(XDIST_INPROCESS) tests/inprocess

cluster: install
	$(PY) -m pytest -q $(XDIST_CLUSTER) tests/cluster

# long fuzzing runs: random seeds, FUZZ_EXAMPLES examples per endpoint (make test runs a fixed, short set);
# then the data path against a model (tests/datapath_model.py): FUZZ_DATAPATH_OPS operations per layout
# (replicas=2 and ec=4+2) and mmap mode (with and without: 2x that per layout), each cut into FUZZ_DATAPATH_SPLIT
# runs of a seed each (random, printed, with the line that replays a failure), served heaviest first (EC, mmap on)
# to four clusters at once so that they end close together; a storage node kill -9ed and restarted every
# FUZZ_DATAPATH_KILL_EVERY operations of a run, the directory snapshotted every FUZZ_DATAPATH_SNAPSHOT_EVERY
# operations and each snapshot checked against the models' history. The run's figures (wall time, each run's
# CPU per operation by role) are in docs/design.md, the latest "million-operation run"; each run saves a checkpoint
# in FUZZ_CHECKPOINTS every 10,000 operations, and `make fuzz-resume` finishes a run that was stopped.
FUZZ_EXAMPLES ?= 20000
FUZZ_DATAPATH_OPS ?= 500000
FUZZ_DATAPATH_SPLIT ?= 2
FUZZ_DATAPATH_KILL_EVERY ?= 50000
FUZZ_DATAPATH_SNAPSHOT_EVERY ?= 2000
FUZZ_CHECKPOINTS ?= .fuzz-checkpoints
fuzz: install
	@# two runs: each tier's tests import their own conftest by that name
	STRIPEFS_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s tests/cluster/test_fuzz.py
	STRIPEFS_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) STRIPEFS_FUZZ_META_STORE=postgresql $(PY) -m pytest -q -s tests/cluster/test_fuzz.py -k metadata_daemon
	STRIPEFS_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s tests/unit/test_feed_fuzz.py
	$(PY) tests/datapath_model.py --layout both --parallel --mmap both --ops $(FUZZ_DATAPATH_OPS) --split $(FUZZ_DATAPATH_SPLIT) \
		--kill-every $(FUZZ_DATAPATH_KILL_EVERY) --snapshot-every $(FUZZ_DATAPATH_SNAPSHOT_EVERY) --checkpoint $(FUZZ_CHECKPOINTS) --progress 60

fuzz-resume: install
	$(PY) tests/datapath_model.py --resume $(FUZZ_CHECKPOINTS) --parallel --progress 60

bench: install $(VENV)/.bench-installed
	$(PY) bench/run.py
	$(PY) bench/ec.py
	$(PY) bench/tier.py
	$(PY) bench/dataloader.py
	$(PY) bench/meta.py
	$(PY) bench/meta_scale.py
	$(PY) bench/fuse_floor.py
	$(PY) bench/data_wait.py
	$(PY) bench/snapshot.py
	$(PY) bench/passthrough.py

# the CSI plugin's gRPC code (stripefs/csi/csi_pb2.py, csi_pb2_grpc.py) from stripefs/csi/csi.proto; checked in,
# so neither an install nor the plugin needs grpcio-tools (the test extra has it: a unit test checks they match)
csi-proto: install
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. stripefs/csi/csi.proto

clean: stop
	rm -rf $(VENV) *.egg-info
