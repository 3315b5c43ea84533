# One command surface for the book. Every target sets up .venv (pinned) on first use.
#   make book     build the executed book (runs every script, captures outputs and figures) -> book/site/, then open
#                 it in headless Chromium where installed (about 10 minutes the first time, up to 15 on a busy machine)
#   make serve    serve the book that make book built on http://127.0.0.1:8000 (builds nothing)
#   make test     the test suite (about 8 minutes of pytest on 2 cores)
#   make sweep    every distributed script at world sizes 1..8, the oracle tests at their extra world sizes, and
#                 the long learning and timing checks (about 30 minutes; CI runs it after make test)
#   make mutate   mutation testing of the mechanism modules: kill rate per module (scripts/mutate.py)
#   make check EX=ch01.1   check your attempt at an exercise (add SOLUTION=1 to check the reference solution)
#   make weights  train the tiny GPT checkpoints into .cache/weights/ and evaluate them (test and book build
#                 what is missing first: 3 to 5 min on 2 cores, once)
# GPU users: make setup TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128  (see README.md)

PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
CONSTRAINTS := requirements/constraints.txt
STAMP := $(VENV)/.installed
TORCH_INDEX_URL ?=
PYTEST_ARGS ?=
# Two pytest workers (pytest-xdist): most tests wait on process start-up and rendezvous, so two at once keep two
# cores busy. PYTEST_WORKERS=0 runs in one process (pytest's -n 0).
PYTEST_WORKERS ?= 2

.PHONY: setup book serve test sweep mutate check progress hint weights browser clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	# torch first and alone, pinned: with no torch present, an unpinned one would pull the CUDA wheels.
	$(PYTHON) -m pip install --quiet -c $(CONSTRAINTS) torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PYTHON) -m pip install --quiet -c $(CONSTRAINTS) -e ".[book,test]"
	touch $(STAMP)

setup: $(STAMP)

book: $(STAMP)
	$(PYTHON) scripts/train_weights.py --if-missing
	$(PYTHON) scripts/build_book.py
	# open what was built in headless Chromium (skipped without it: make browser; CI requires it)
	$(PYTHON) -m pytest -q -p no:cacheprovider -m browser tests/test_book.py

# Serves what make book last built; it builds nothing (run make book first, and again after changes).
serve:
	@test -f book/site/index.html || { echo "no built book in book/site/: run make book first" >&2; exit 2; }
	@test -x $(PYTHON) || { echo "no .venv: run make setup (or make book) first" >&2; exit 2; }
	@echo "Serving book/site on http://127.0.0.1:8000 (Ctrl-C to stop)"
	$(PYTHON) -m http.server --bind 127.0.0.1 --directory book/site 8000

test: $(STAMP)
	$(PYTHON) scripts/train_weights.py --if-missing
	$(PYTHON) -m pytest -n $(PYTEST_WORKERS) --dist worksteal -m "not sweep and not long and not browser" $(PYTEST_ARGS)

sweep: $(STAMP)
	$(PYTHON) -m pytest -n $(PYTEST_WORKERS) --dist worksteal -m "sweep or long" $(PYTEST_ARGS)

# Mutation testing of the mechanism modules (scripts/mutate.py; not part of CI): kill rate per module, goal 90%.
mutate: $(STAMP)
	$(PYTHON) -m pip install --quiet -c $(CONSTRAINTS) -e ".[mutate]"
	$(PYTHON) scripts/train_weights.py --if-missing
	$(PYTHON) scripts/mutate.py

check: $(STAMP)
	@test -n "$(EX)" || { echo "usage: make check EX=ch01.1 [SOLUTION=1]" >&2; exit 2; }
	$(PYTHON) -m mlsys.exercises $(EX) $(if $(SOLUTION),--solution)

progress: $(STAMP)
	$(PYTHON) -m mlsys.workshop progress

hint: $(STAMP)
	@test -n "$(EX)" || { echo "usage: make hint EX=ch05.2 [FOR=function]" >&2; exit 2; }
	$(PYTHON) -m mlsys.workshop hint $(EX) $(if $(FOR),--for $(FOR))

weights: $(STAMP)
	$(PYTHON) scripts/train_weights.py

# Debian's Chromium and its driver, for the test that opens the rendered book (needs root).
browser:
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver

clean:
	rm -rf book/docs book/site .cache .pytest_cache
