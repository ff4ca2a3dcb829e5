# `make demo` and `make test` do all the set-up: each builds .venv from constraints.txt on first use.
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export HF_EVALUATE_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test lint clean

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hf-earlyexit demo

# pytest exits 5 when it collects no test, which fails this target like any other failure.
test: $(STAMP)
	$(PYTHON) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) out
