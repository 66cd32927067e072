# Every target does its own set-up from a bare clone: a virtualenv in .venv, then the install.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_PROCESSES ?= 3
# The bench's Reverb rows run Reverb from a virtualenv of its own (see its rule below).
REVERB_VENV  ?= bench/.venv-reverb
REVERB_STAMP := $(REVERB_VENV)/.installed
REVERB_LOG   := bench/results/reverb-install.log

.PHONY: demo test docs browser lint protos bench soak clean

$(STAMP): pyproject.toml
	@echo "== set-up: a virtualenv in $(VENV), then pip installs this project with its server,"
	@echo "   dev (test) and docs extras from PyPI: about 2.5 GB installed (ray, jax, torch CPU, ...)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@echo "== torch's CPU build first, alone (the dev extra's range, which the local +cpu wheel"
	@echo "   matches); the install below keeps it. Fails if CUDA libraries come in after all"
	$(PY) -m pip install --quiet "$$($(PY) scripts/check_cpu_torch.py --requirement)"
	$(PY) -m pip install --quiet -e '.[server,dev,docs]'
	$(PY) scripts/check_cpu_torch.py
	@echo "== pip install --no-deps factoriax==0.1.0 (from PyPI): the in-process recorder the"
	@echo "   equivalence tests compare against, without its jax/matplotlib stack"
	$(PY) -m pip install --quiet --no-deps factoriax==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m recorder_server demo

test: $(STAMP) browser
	$(PY) scripts/gen_protos.py --check
	$(PY) -m ruff check .
	$(MAKE) --no-print-directory docs
	# The store's compiled loops: built once (about half a minute), then found in numba's cache,
	# before any test server needs them (the image build does the same).
	$(PY) -m recorder_server.store
	# Three test processes: most scenario tests wait on servers, kills and timeouts rather than
	# compute, so the suite takes about half the time serially on 2 cores. loadscope keeps a
	# module's tests (and its module-scoped servers) in one process.
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadscope

# The docs site (mkdocs.yml) into site/: --strict fails on a broken link or a missing page.
# Its home, API and command-line references are generated from README.md, __all__ and argparse.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The dashboard's browser test drives Debian's chromium: installed here when it is missing and
# apt can (as root); otherwise that one test says why it skips.
browser:
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    echo "== apt-get install chromium chromium-driver (as root, a few hundred MB): the dashboard's" && \
	    echo "   browser test drives a headless Chromium; without it that test skips" && \
	    apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
	  echo "chromium is not installed: the dashboard's browser test will skip"

# Every scenario beside its reference (under 10 minutes on 2 cores), a progress line each;
# regenerates bench/RESULTS.md. A smoke run: make bench BENCH_ARGS=--quick (RESULTS.md kept).
bench: $(STAMP) $(REVERB_STAMP)
	$(PY) -m pip install --quiet -r bench/requirements.txt
	$(PY) bench/run.py $(BENCH_ARGS)

# DeepMind's Reverb for the bench's side-by-side rows, in a virtualenv of its own: it wants
# TensorFlow 2.15, which pins protobuf < 5 and numpy < 2 against our protobuf >= 7 and numpy 2.
# Made once (about a minute, 1.7 GB); when it cannot install, the Reverb rows skip and say why
# (the log: bench/results/reverb-install.log), and the next `make bench` tries again.
$(REVERB_STAMP): bench/requirements-reverb.txt
	@echo "== set-up (once): a virtualenv in $(REVERB_VENV) for DeepMind's Reverb, the reference"
	@echo "   of the bench's Reverb rows: pip install -r bench/requirements-reverb.txt"
	@echo "   (dm-reverb 0.14 and TensorFlow 2.15 from PyPI, about 1.7 GB)"
	@mkdir -p $(dir $(REVERB_LOG)) && rm -rf $(REVERB_VENV) && t0=$$(date +%s) && \
	if $(PYTHON) -m venv $(REVERB_VENV) >$(REVERB_LOG) 2>&1 && \
	   $(REVERB_VENV)/bin/pip install -r bench/requirements-reverb.txt >>$(REVERB_LOG) 2>&1; then \
	  touch $@ && echo "   installed in $$(( $$(date +%s) - t0 )) s"; \
	else \
	  echo "   Reverb did not install: its rows will skip. The end of $(REVERB_LOG):"; \
	  tail -n 5 $(REVERB_LOG) | sed 's/^/   | /'; \
	fi

# 64 workers record, finish and drop sessions for 20 minutes; server RSS and threads must stay
# flat. Shorter: make soak SOAK_ARGS="--minutes 3".
soak: $(STAMP)
	$(PY) bench/soak.py $(SOAK_ARGS)

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) $(REVERB_VENV) .pytest_cache .hypothesis .ruff_cache
