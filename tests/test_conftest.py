"""The suite's own set-up (`conftest.py`): the caches it points the library at are its own and go with it."""

import json
import os
import subprocess
import sys
import tempfile

from conftest import ROOT

VARIABLES = ("HF_MODULES_CACHE", "MINIMIND_CACHE")
SHOW = (  # imports conftest as pytest does and prints the directories it settled on
    "import json, os, sys; sys.path.insert(0, 'tests'); import conftest; "
    "print(json.dumps({v: os.environ[v] for v in %r}))"
)


def _directories(env):
    done = subprocess.run(
        [sys.executable, "-c", SHOW % (VARIABLES,)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_suites_caches_are_removed_when_it_ends():
    env = {key: value for key, value in os.environ.items() if key not in VARIABLES}
    made = _directories(env)
    assert sorted(made) == sorted(VARIABLES)
    for variable, prefix in zip(VARIABLES, ("minimind-hf-modules-", "minimind-cache-")):
        assert os.path.dirname(made[variable]) == tempfile.gettempdir()
        assert os.path.basename(made[variable]).startswith(prefix)
        assert not os.path.exists(made[variable])


def test_caches_the_caller_names_are_used_and_kept(tmp_path):
    mine = {variable: str(tmp_path / variable) for variable in VARIABLES}
    for path in mine.values():
        os.mkdir(path)
    assert _directories({**os.environ, **mine}) == mine
    assert all(os.path.isdir(path) for path in mine.values())
