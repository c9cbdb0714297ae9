# Both targets create and use a local virtual environment in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast test-lower-bound quickstart lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# The suite against the oldest transformers pyproject.toml admits (installed beside the venv's
# newer one, in .lower/, with the tokenizers and huggingface_hub it requires).
TRANSFORMERS_LOWER := 5.17.0
test-lower-bound: $(STAMP)
	rm -rf .lower
	$(BIN)/pip install -q --target .lower --no-deps "transformers==$(TRANSFORMERS_LOWER)" \
		"tokenizers>=0.23.1,<0.24" "huggingface_hub>=1.5,<2"
	PYTHONPATH=.lower $(BIN)/python -c "import transformers; print('transformers', transformers.__version__)"
	PYTHONPATH=.lower $(BIN)/python -m pytest -q -p no:cacheprovider

quickstart: $(STAMP)
	$(BIN)/nla quickstart

lint: $(STAMP)
	$(BIN)/ruff check nla tests bench dev

clean:
	rm -rf $(VENV) .lower build *.egg-info
