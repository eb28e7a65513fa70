# Reference tables in docs/ (flags, environment variables, chart values, make targets), generated from the code.
.PHONY: docs docs-check

docs: setup-python  ## rewrite the generated tables in docs/ from the CLIs, values.yaml and the make targets
	$(PY) tools/gen_docs.py

docs-check: setup-python  ## fail when a generated table in docs/ is out of date
	$(PY) tools/gen_docs.py --check
