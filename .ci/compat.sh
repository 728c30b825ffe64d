#!/usr/bin/env bash
# Extra test legs under other transformers releases, each in its own cached virtualenv (.venv-<leg>):
#
#   .ci/compat.sh 4.57   the model files (tests/compat) under 4.57.x, the oldest release setup.py admits
#   .ci/compat.sh 5.17   the whole suite under 5.17.x: the release on CUDA images with transformers 5.17, and a
#                        5.x from before the keyword renames (past_key_values -> cache, block_size -> page_size)
#
# 4.57 needs huggingface_hub<1.0 and tokenizers<0.23 (and a datasets that accepts that hub), which cannot
# live next to 5.x. Everything else, torch included, comes from the environment that runs this script: a
# plain interpreter, a venv, a conda or uv environment alike. The leg's venv holds only the pinned packages,
# and a .pth file appends the running environment's site directories behind them, so the pins shadow the
# running versions and the rest is shared (torch is never reinstalled: the check below fails if it was).
# Delete a venv to start over.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python}"
LEG="${1:?usage: .ci/compat.sh 4.57|5.17}"
case "$LEG" in
  4.57) SPECS=("transformers==4.57.*" "huggingface_hub<1.0" "tokenizers<0.23" "datasets<5"); TESTS=(tests/compat) ;;
  # Checked once, under the installed transformers: the peers benchmark's table, the browser run of the web
  # page, the documented commands (tests/docs/test_docs.py) and which kernels a compiled step runs (torch's
  # choice). The model paths they drive are tested under 5.17 by their own modules (decode, serving, export,
  # training, chat), and together they cost over 4 minutes a leg on 2 cores.
  # PYTEST_PARALLEL (set by `make test`: pytest-xdist's workers) applies to this leg; the 4.57 leg is 8 tests.
  # shellcheck disable=SC2206
  5.17) SPECS=("transformers==5.17.*")
        TESTS=(tests --ignore=tests/bench/test_peers.py --ignore=tests/docs/test_docs.py
               --ignore=tests/decode/test_kernels.py
               --deselect=tests/chat/test_web.py::test_browser_streams_and_folds_thinking
               ${PYTEST_PARALLEL:-}) ;;
  *) echo "unknown leg '$LEG': use 4.57 or 5.17" >&2; exit 2 ;;
esac
VENV=".venv-$LEG"

# The running environment: its interpreter (the leg's venv is made from the same base Python) and every site
# directory on its path, in order (a venv's own, then the ones it inherits, the user site included).
mapfile -t PARENT < <("$PYTHON" - <<'PY'
import os, site, sys
print(sys._base_executable if hasattr(sys, "_base_executable") else sys.executable)
print(f"{sys.version_info.major}.{sys.version_info.minor}")
dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
for d in dict.fromkeys(os.path.realpath(d) for d in dirs):
    if os.path.isdir(d):
        print(d)
PY
)
BASE_PYTHON="${PARENT[0]}" PY_VERSION="${PARENT[1]}" SITE_DIRS=("${PARENT[@]:2}")
MARKER="layout 2, python $PY_VERSION: ${SPECS[*]}"

if [ "$(cat "$VENV/.installed" 2>/dev/null)" != "$MARKER" ]; then
  rm -rf "$VENV"  # an older layout or another Python: start over
  # --without-pip: the running environment's pip installs into it (pip --python), nothing venv-local shadows it.
  "$BASE_PYTHON" -m venv --without-pip "$VENV"
  echo '*' > "$VENV/.gitignore"  # the cache never shows up in `git status`
fi
LEG_SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# Rewritten on every run: the same checkout may be tested from a different environment next time.
for dir in "${SITE_DIRS[@]}"; do echo "import site; site.addsitedir('$dir')"; done \
  > "$LEG_SITE/zz-parent-environment.pth"
if [ "$(cat "$VENV/.installed" 2>/dev/null)" != "$MARKER" ]; then  # skip pip's checks when cached
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip --python "$VENV/bin/python" install -q --disable-pip-version-check "${SPECS[@]}"
  elif command -v uv >/dev/null; then  # a uv environment has no pip of its own
    uv pip install -q --python "$VENV/bin/python" "${SPECS[@]}"
  else
    "$VENV/bin/python" -m ensurepip -q && "$VENV/bin/python" -m pip install -q "${SPECS[@]}"
  fi
  echo "$MARKER" > "$VENV/.installed"
fi

# The venv must shadow the running transformers stack but share the running torch.
"$VENV/bin/python" - "$LEG" "$("$PYTHON" -c 'import os, torch; print(os.path.realpath(torch.__file__))')" <<'PY'
import os, sys
import huggingface_hub, tokenizers, torch, transformers
leg, parent_torch = sys.argv[1:]
assert transformers.__version__.startswith(leg + "."), f"transformers {transformers.__version__} is not {leg}.x"
assert os.path.realpath(torch.__file__) == parent_torch, f"torch was reinstalled into the venv: {torch.__file__}"
print(f"compat leg: transformers {transformers.__version__}, huggingface_hub {huggingface_hub.__version__}, "
      f"tokenizers {tokenizers.__version__}, torch {torch.__version__} (shared)")
PY

HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest "${TESTS[@]}" -q -p no:cacheprovider
