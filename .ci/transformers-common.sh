#!/usr/bin/env bash
# transformers' own common model tests (ModelTesterMixin, ConfigTester, TrainingTesterMixin) on MiniMind, with
# Qwen3 and Qwen3-MoE as the reference: tests/model/test_transformers_common.py.
#
# The test sources come from the sdist of the installed transformers release, downloaded here with pip into
# .cache/transformers-tests/<version>/ (git-ignored, reused) and never copied into the repository. Downloading
# here, not in the test module, makes a network failure fail this leg instead of skipping it.
#
#   .ci/transformers-common.sh                      everything: 40 s on a quiet 2-core machine, up to 6 min on a busy one
#   RUN_TRAINING_TESTS=0 .ci/transformers-common.sh without the four 300-step overfit runs
#   .ci/transformers-common.sh -k MiniMind          extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python}"
VERSION="$("$PYTHON" -c 'import transformers; print(transformers.__version__)')"
CACHE="${MINIMIND_TRANSFORMERS_TESTS_CACHE:-.cache/transformers-tests}/$VERSION"

"$PYTHON" -m pip install -q --disable-pip-version-check parameterized  # the mixin's only extra dependency
if [ ! -e "$CACHE/transformers-$VERSION.tar.gz" ]; then
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --no-binary transformers \
    "transformers==$VERSION" -d "$CACHE"
fi

MINIMIND_TRANSFORMERS_COMMON=1 HF_HUB_OFFLINE=1 "$PYTHON" -m pytest tests/model/test_transformers_common.py -q -rf \
  -p no:randomly -p no:cacheprovider -W ignore::pytest.PytestUnknownMarkWarning "$@"
