# make test: install what the tests need on a fresh machine and run them, in TEST_WORKERS processes
#   (pytest-xdist; most tests wait on mounts, stores and sleeps, not on the CPU). TEST_WORKERS=0: one process.
# make demo: prepare a ~1 GiB checkpoint, import it, mount, torch.load cold and warm, compare, unmount.
# make bench: every read/write case of issue 10 side by side (loads cold/warm/mmap/safetensors, peers, remote-like
#   stores, the 1-2-4-8 store series, saves, partial loads), medians of 3; prints a table, writes bench.png.
#   BENCH_ARGS="--size 256MiB --repeat 1 --cases loads,remote".
# make bench-s3: one checkpoint on a loopback S3 server (moto) read 5 ways: cold torch.load through cpfs
#   (2 S3 stores), plain GETs, s3fs, rclone mount, vs the direct local load. BENCH_ARGS="--size 256MiB".
# make bench-s3-client: boto3 vs obstore reads from a loopback S3 server (moto): MiB/s and CPU-s per GiB.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
TEST_WORKERS ?= 4
BENCH_ARGS ?=
CONFORMANCE_ARGS ?=

.PHONY: test demo bench bench-s3 bench-s3-client s3-tools deps venv conformance conformance-tools clean

deps:
	@command -v fusermount3 >/dev/null && [ -f /usr/include/fuse3/fuse_lowlevel.h ] && command -v pkg-config >/dev/null \
	  && command -v rsync >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 libfuse3-dev pkg-config rsync; }

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

venv: deps $(PY)
	$(PY) -m pip install -q -e '.[test]'

test: venv
	$(PY) -m pytest -n $(TEST_WORKERS) --dist load --maxschedchunk 2 $(PYTEST_ARGS)

demo: venv
	$(PY) -m benchmarks.demo

s3-tools:
	@command -v s3fs >/dev/null && command -v rclone >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq s3fs rclone; }

bench: venv s3-tools
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m benchmarks.bench $(BENCH_ARGS)

# make conformance: pjdfstest (cloned and built in a temporary folder, never vendored) run inside a cpfs mount
#   with allow_other, as root; prints passes per syscall folder and the total. CONFORMANCE_ARGS="--only chmod".
conformance-tools:
	@command -v autoreconf >/dev/null && command -v automake >/dev/null && command -v cc >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq autoconf automake build-essential git; }

conformance: venv conformance-tools
	$(PY) -m benchmarks.conformance $(CONFORMANCE_ARGS)

bench-s3: venv s3-tools
	$(PY) -m benchmarks.bench_s3 $(BENCH_ARGS)

bench-s3-client: venv
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m benchmarks.bench_s3_client

clean:
	rm -rf $(VENV) build *.egg-info
