#!/usr/bin/env bash
# Extra test legs under other transformers releases, each in its own cached virtualenv (.venv-<leg>):
#
#   .ci/compat.sh 4.57   the model files (tests/compat) under 4.57.x, the oldest release setup.py admits
#   .ci/compat.sh 5.17   the whole suite under 5.17.x: the release on the lent GPU machines, and a 5.x from before
#                        the keyword renames (past_key_values -> cache, block_size -> page_size) of later ones
#
# 4.57 needs huggingface_hub<1.0 and tokenizers<0.23 (and a datasets that accepts that hub), which cannot
# live next to 5.x. Each venv sees the system site-packages for everything else, torch included (never
# reinstalled: the check below fails if it was). Delete a venv to start over.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python}"
LEG="${1:?usage: .ci/compat.sh 4.57|5.17}"
case "$LEG" in
  4.57) SPECS=("transformers==4.57.*" "huggingface_hub<1.0" "tokenizers<0.23" "datasets<5"); TESTS=(tests/compat) ;;
  5.17) SPECS=("transformers==5.17.*"); TESTS=(tests) ;;
  *) echo "unknown leg '$LEG': use 4.57 or 5.17" >&2; exit 2 ;;
esac
VENV=".venv-$LEG"

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
"$VENV/bin/python" - "$LEG" "$("$PYTHON" -c 'import torch; print(torch.__file__)')" <<'PY'
import sys
import huggingface_hub, tokenizers, torch, transformers
leg, system_torch = sys.argv[1:]
assert transformers.__version__.startswith(leg + "."), f"transformers {transformers.__version__} is not {leg}.x"
assert torch.__file__ == system_torch, f"torch was reinstalled into the venv: {torch.__file__}"
print(f"compat leg: transformers {transformers.__version__}, huggingface_hub {huggingface_hub.__version__}, "
      f"tokenizers {tokenizers.__version__}, torch {torch.__version__} (shared)")
PY

HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest "${TESTS[@]}" -q -p no:cacheprovider
