# The README's commands are the contract: `make demo` and `make test` on a fresh clone.
PY := .venv/bin/python
STAMP := .venv/.setup-stamp
export OMP_NUM_THREADS ?= 1

.PHONY: setup test test-all demo bench typecheck docs clean

CSRC := $(wildcard torchrec_dtensor_bridge/csrc/*.c torchrec_dtensor_bridge/csrc/*.h torchrec_dtensor_bridge/csrc/*.cpp)

# setup.sh also runs when the built extension (torchrec_dtensor_bridge/_C*.so) is missing
setup: $(STAMP)
	@ls torchrec_dtensor_bridge/_C*.so >/dev/null 2>&1 || bash scripts/setup.sh

$(STAMP): requirements/lock.txt requirements/nodeps.txt pyproject.toml setup.py $(CSRC) scripts/setup.sh
	bash scripts/setup.sh

# The package compiled to bytecode first: where PYTHONDONTWRITEBYTECODE is set, every interpreter a test
# starts would compile it again from source (the dependencies in .venv were compiled by their install).
test: setup
	@$(PY) -m compileall -q torchrec_dtensor_bridge >/dev/null
	$(PY) -m pytest -q

test-all: setup
	@$(PY) -m compileall -q torchrec_dtensor_bridge >/dev/null
	$(PY) -m pytest -q -m ""

typecheck: setup
	$(PY) -m mypy torchrec_dtensor_bridge

demo: setup
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=4 examples/demo.py

# The documentation site (mkdocs.yml, docs/) into site/; any warning is an error.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

BENCH_OUT := bench/results.json

bench: setup
	mkdir -p bench
	$(PY) scripts/bench_convert.py --out $(BENCH_OUT)
	$(PY) scripts/bench_checkpoint.py --gib 2 --reps 5 --out $(BENCH_OUT)
	$(PY) scripts/bench_checkpoint_s3.py --gib 2 --reps 3 --incremental --out $(BENCH_OUT)
	$(PY) scripts/bench_incremental.py --reps 3 --out $(BENCH_OUT)
	$(PY) scripts/bench_incremental.py --dmp --tracked --targets 0.01 --reps 3 --out $(BENCH_OUT)
	$(PY) scripts/bench_lookup.py --reps 5 --out $(BENCH_OUT)
	$(PY) scripts/bench_lookup_gpu.py --out $(BENCH_OUT)
	$(PY) scripts/bench_collectives.py --reps 9 --out $(BENCH_OUT)
	$(PY) scripts/bench_sparse_update.py --reps 7 --out $(BENCH_OUT)
	$(PY) scripts/bench_kernel_calls.py --out $(BENCH_OUT)
	$(PY) scripts/bench_train.py --reps 5 --out $(BENCH_OUT)
	$(PY) scripts/bench_train.py --dtype fp16 --reps 5 --out $(BENCH_OUT)
	$(PY) scripts/bench_torch_optim.py --reps 7 --out $(BENCH_OUT)
	$(PY) scripts/bench_reshard.py --reps 2 --out $(BENCH_OUT)
	$(PY) scripts/plot_bench.py --results $(BENCH_OUT) --out bench

clean:
	rm -rf .venv bench/*.json .pytest_cache site build torchrec_dtensor_bridge/_C*.so
