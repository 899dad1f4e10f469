# Two commands do everything on a fresh machine:
#   make demo   set up, prepare the embedded offline dataset, run the main job
#   make test   set up, prepare the dataset, run the default test suite
#               (make test-all: the slow tests and the tutorials too)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Where `nvidia-smi` works, setup also installs JAX's CUDA 12 build (the cuda12
# extra, pinned to the locked jax) under its own stamp, so a .venv made before
# the GPU was visible gets it too. Elsewhere nothing changes.
GPU := $(shell nvidia-smi >/dev/null 2>&1 && echo cuda12)
STAMP := $(VENV)/.installed-stamp$(if $(GPU),-$(GPU))
# The lock is installed with uv where this machine's pip configuration allows
# (its indexes, find-links and constraints passed on), else with pip
# (tools/install.py): faster than pip's 60-120 s on 2 cores. Bytecode is
# compiled at install, the library's own too (an editable install's is not):
# where PYTHONDONTWRITEBYTECODE is set every process would compile from source.
FMNIST_DIR ?= /usr/share/datasets/fashion-mnist
export FEDJAX_DG_DATA_DIR ?= $(abspath .data)
export FEDJAX_DG_FASHION_MNIST_DIR ?= $(FMNIST_DIR)

.PHONY: setup fashion-mnist data demo test test-slow test-notebooks test-protocols test-all docs bench mutation clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock tools/install.py
	$(PYTHON) -m venv $(VENV)
	$(PYTHON) tools/install.py $(PY) -q -r requirements.lock
	$(PYTHON) tools/install.py $(PY) -q --no-deps -e .
	$(PY) -m compileall -q -j 0 fedjax_dg >/dev/null
	$(if $(GPU),$(PY) -m pip install -q -e ".[$(GPU)]")
	touch $@

# Fashion-MNIST ships as a Debian package (IDX files under $(FMNIST_DIR)).
# Installed here when we are root with apt; otherwise `prepare` falls back to the
# TFDS download, and if that fails too, it says exactly what to do.
fashion-mnist:
	@if [ ! -e $(FMNIST_DIR)/train-images-idx3-ubyte.gz ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing the Debian package dataset-fashion-mnist ..."; \
	  apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1; } \
	  || echo "apt-get could not install dataset-fashion-mnist; prepare will try the TFDS download"; \
	fi

data: setup fashion-mnist
	$(PY) -m fedjax_dg.cli prepare rotated_fashion_mnist

demo: data
	$(PY) -m fedjax_dg.cli demo

# The default suite (not `slow`, not `notebooks`) on TEST_WORKERS pytest-xdist
# processes (a test file stays on one worker, so its module fixtures are built
# once; ~1.6x faster on 2 cores than one process, docs/testing.md);
# TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: data
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The tests marked `slow`: longer variants, and end-to-end runs that confirm
# what faster default tests pin (docs/testing.md says which and why). They run
# XLA's optimized code, as they were written (their runs are long, compiling
# less of their time than the default suite's).
test-slow: data
	JAX_DISABLE_MOST_OPTIMIZATIONS=0 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m slow

# The colab/ tutorials, executed at their tiny settings (colab/README.md has
# their times); they prepare fashion_mnist / styled_fashion_mnist on first use.
test-notebooks: data
	$(PY) -m pytest -q -m notebooks tests/test_colab.py

# The papers' protocols, one round each at the real model, image size and
# batch on generated data of the real layout (tests/test_protocols.py; minutes
# and GiB per case, so one process, and not yet part of CI: docs/testing.md).
test-protocols: data
	JAX_DISABLE_MOST_OPTIMIZATIONS=0 $(PY) -m pytest -q -m protocols tests/test_protocols.py

# Everything CI runs: the default suite, the slow tests, the tutorials.
test-all: test test-slow test-notebooks

# The documentation site, from docs/ into docs/_build/html (open index.html
# there). Sphinx with warnings as errors: a broken link, a page in no table of
# contents or a docstring that does not parse fails the build. The reference
# pages (config fields, algorithms, CLI) are generated from the code as it
# builds (docs/_ext/fedjax_dg_docs.py); the notebooks are shown, not executed.
DOCS_STAMP := $(VENV)/.docs-stamp
$(DOCS_STAMP): $(STAMP) docs/requirements.txt
	$(PYTHON) tools/install.py $(PY) -q -r docs/requirements.txt
	touch $@

docs: $(DOCS_STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

# Benchmarks (not part of `make test`): installs the CPU PyTorch build for the reference
# loop, and the torchvision and timm that the weights tests compare with (MobileNetV3, ViT).
# Flower (benchmarks/scale.py --flower) goes to its own folder, $(FLWR_DIR): its pins
# (protobuf < 7, packaging < 26, rich < 15) conflict with requirements.lock, so only
# the Flower worker process puts it on its path.
FLWR_DIR := $(VENV)/flwr
bench: setup
	$(PY) -m pip install -q 'torch==2.13.0' 'torchvision==0.28.0' 'timm==1.0.31'
	$(PY) -m pip install -q --target $(FLWR_DIR) 'flwr[simulation]==1.42.0'
	$(PY) benchmarks/round_time.py

# Mutation testing (not part of `make test`; docs/testing.md): mutmut mutates
# fedjax_dg/server, client and algorithms ([tool.mutmut] in pyproject.toml) and
# runs, per mutant, the tests that call the mutated function. All ~9,900 mutants
# take days on 2 cores: SAMPLE=N checks a seeded random sample of N per package
# (SEED=S picks another), MUTATE='fedjax_dg.server.*' the mutants whose names
# match. Results stay in mutants/, so a second run resumes.
MUTATE ?=
SAMPLE ?=
SEED ?= 0
mutation: data
	$(PY) -m pip install -q 'mutmut==3.8.1'
	$(PY) tests/mutation_report.py --preflight
	$(if $(SAMPLE),$(PY) tests/mutation_report.py --sample $(SAMPLE) --seed $(SEED),rm -f mutants/sample.txt)
	nice -n 10 $(VENV)/bin/mutmut run $(if $(SAMPLE),$$(cat mutants/sample.txt),$(if $(MUTATE),'$(MUTATE)'))
	$(PY) tests/mutation_report.py $(if $(MUTATE),'$(MUTATE)')

clean:
	rm -rf $(VENV) .data runs mutants docs/_build docs/reference/generated docs/tutorials
