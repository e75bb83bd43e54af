# make test: install what the tests need on a fresh machine and run them.
# make demo: prepare a ~1 GiB checkpoint, import it, mount, torch.load cold and warm, compare, unmount.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: test demo deps venv clean

deps:
	@command -v fusermount3 >/dev/null && [ -f /usr/include/fuse3/fuse_lowlevel.h ] && command -v pkg-config >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 libfuse3-dev pkg-config; }

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

venv: deps $(PY)
	$(PY) -m pip install -q -e '.[test]'

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

demo: venv
	$(PY) -m benchmarks.demo

clean:
	rm -rf $(VENV) build *.egg-info
