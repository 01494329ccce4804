"""The spin model of the lockstep protocol (protocol_model/, docs/PROTOCOL_MODEL.md).

Each check builds and runs a spin verifier: the properties must hold (one test per configuration),
the finding on the code as it is must still show, and each seeded mutant must give a
counterexample of the property it targets.

Opt-in (PDSERVE_VERIFY_PROTOCOL=1): the whole set builds ~30 verifiers and takes minutes on a
small machine, so `make test` leaves it to `make verify-protocol` (a separate CI step, .ci/run).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "protocol_model"))
import verify  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("PDSERVE_VERIFY_PROTOCOL") != "1",
        reason="opt-in: PDSERVE_VERIFY_PROTOCOL=1 (CI runs `make verify-protocol`)",
    ),
    pytest.mark.skipif(
        not (shutil.which("spin") and shutil.which("cc")),
        reason="needs spin and a C compiler (scripts/setup.sh --test installs them)",
    ),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("spin")


@pytest.mark.parametrize("check", verify.properties_checks(), ids=lambda c: c.name)
def test_property(check, workdir):
    r = verify.run_check(check, workdir)
    if check.known:
        assert r.errors > 0 and verify.classify(r.what) == check.known, (
            f"{check.name}: the finding ({check.known}) no longer shows: {r.what or 'no error'}; "
            "update verify.KNOWN"
        )
        return
    assert r.complete, f"{check.name}: search incomplete ({r.what})"
    assert r.errors == 0, f"{check.name}: {r.what} (states {r.states})"


@pytest.mark.parametrize("check", verify.mutant_checks(), ids=lambda c: c.name)
def test_mutant_gives_counterexample(check, workdir):
    r = verify.run_check(check, workdir)
    assert r.errors > 0, (
        f"{check.name}: the mutant passed; the model no longer checks {check.props[0]}"
    )
    assert verify.classify(r.what) == check.props[0], (
        f"{check.name}: broke {r.what}, not {check.props[0]}"
    )
