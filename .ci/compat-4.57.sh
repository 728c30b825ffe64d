#!/usr/bin/env bash
# Second test leg: the model files under transformers 4.57.x (the README promises 4.57 and 5.x).
#
# 4.57 needs huggingface_hub<1.0 and tokenizers<0.23 (and a datasets that accepts that hub), which cannot
# live next to 5.x, so they go into a virtualenv that sees the system site-packages for everything else,
# torch included (never reinstalled: the check below fails if it was). The venv is cached in .venv-4.57;
# delete it to start over. Runs tests/compat, written to pass under both versions.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python}"
VENV=.venv-4.57
SPECS=("transformers==4.57.*" "huggingface_hub<1.0" "tokenizers<0.23" "datasets<5")

if [ ! -x "$VENV/bin/python" ]; then
  # --without-pip: the system pip installs into it, and no venv-local setuptools shadows the system one.
  "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"
  echo '*' > "$VENV/.gitignore"  # the cache never shows up in `git status`
fi
if [ "$(cat "$VENV/.installed" 2>/dev/null)" != "${SPECS[*]}" ]; then  # skip pip's checks when cached
  "$PYTHON" -m pip --python "$VENV/bin/python" install -q --disable-pip-version-check "${SPECS[@]}"
  echo "${SPECS[*]}" > "$VENV/.installed"
fi

# The venv must shadow the system transformers stack but share the system torch.
"$VENV/bin/python" - "$("$PYTHON" -c 'import torch; print(torch.__file__)')" <<'PY'
import sys
import huggingface_hub, tokenizers, torch, transformers
assert transformers.__version__.startswith("4.57."), f"transformers {transformers.__version__} is not 4.57.x"
assert torch.__file__ == sys.argv[1], f"torch was reinstalled into the venv: {torch.__file__}"
print(f"compat leg: transformers {transformers.__version__}, huggingface_hub {huggingface_hub.__version__}, "
      f"tokenizers {tokenizers.__version__}, torch {torch.__version__} (shared)")
PY

HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest tests/compat -q -p no:cacheprovider
