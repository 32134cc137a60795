# The two commands of the README. Both build the environment first (fast when it exists).
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: setup quickstart distill-quickstart test test-quick bench

setup:
	@bash tools/setup_env.sh

quickstart: setup
	$(VENV)/bin/moe-rl train configs/quickstart.yaml

# on-policy distillation from the quickstart's trained policy: `make quickstart`'s final checkpoint,
# exported to Hugging Face format (the quickstart is trained first where that checkpoint is missing)
TEACHER = runs/quickstart/teacher_hf
TEACHER_FROM = runs/quickstart/checkpoints/step_000480/policy
distill-quickstart: setup
	@test -f $(TEACHER)/config.json || { { test -d $(TEACHER_FROM) || \
	  $(VENV)/bin/moe-rl train configs/quickstart.yaml; } && \
	  $(VENV)/bin/moe-rl convert mcore-to-hf $(TEACHER_FROM) $(TEACHER); }
	$(VENV)/bin/moe-rl train configs/distill_quickstart.yaml

test: setup
	@bash tools/setup_slurm.sh
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

# the contributors' inner loop (README): the tests not marked slow (math, configs, batches, plans) and the
# slow ones marked quick (the layouts at one rank, one short loop)
test-quick: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow or quick" --durations=5 $(PYTEST_ARGS)
