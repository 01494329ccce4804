"""Model-checks the lockstep protocol with spin: every property, PP 2 and PP 3, and the mutants.

    python protocol_model/verify.py              # the properties (what `make verify-protocol` runs)
    python protocol_model/verify.py --mutants    # the seeded bugs, each must give a counterexample
    python protocol_model/verify.py --only decode-pp2-reuse

One line per (property, configuration): states explored and time. Exit status 1 if a property
fails (or a mutant passes). Each check is spin -a, gcc pan.c, ./pan in a temporary directory.
The safety properties (agreement, safety, no double free / no leak, deadlock freedom) are checked
by one exhaustive run per configuration with all their assertions on; liveness is a separate
acceptance-cycle run under weak fairness (-a -f) against the model's LTL formula. The role flip
of an elastic node (-DFLIP) is checked in its own PP 2 configurations, with two more properties:
every rank has the same role in every iteration, and nothing is held at a flip. Tensor
parallelism (tp.pml: stages of TP 2, a lead and a follower that replays it) adds two: a follower
takes from the replay what its lead shared, in order, and both ranks of a stage are in the same
collective. The decode node with TP 2 stages (decode.pml -DTP=2: each TP rank its own receiver and
prefill writer per room, the group's ballots combined before the vote) is checked at PP 1 and 2
for the decode properties; there agreement includes that the ranks of a group split each verdict
alike.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAFETY_PROPS = ("agreement", "safety", "no-double-free-no-leak", "deadlock-freedom")
# with the role flip (-DFLIP): every rank's role is PP0's in every iteration; at a flip the rank
# holds no page and no request
FLIP_PROPS = (*SAFETY_PROPS, "role-agreement", "drained-at-flip")
# tensor parallelism (tp.pml): the follower's replay in its lead's order, the stage's two ranks in
# the same collective
TP_PROPS = ("agreement", "deadlock-freedom", "replay-order", "collective-order")
PROP_MACROS = {
    "agreement": "P_AGREEMENT",
    "safety": "P_SAFETY",
    "no-double-free-no-leak": "P_NOLEAK",
    "role-agreement": "P_ROLE",
    "drained-at-flip": "P_DRAINED",
}

# Bounded scenarios (see docs/PROTOCOL_MODEL.md): faults and aborts multiply the state space, so
# each scenario spends the budget where its property needs it.
SCENARIOS = {
    "faults": dict(NREQ=1, MAXF=1, MAXAB=1),  # any one fault + an abort at any stage
    "reuse": dict(NREQ=2, MAXF=1, MAXAB=0),  # a fault in room 0, room 1 reuses its pages
    # room 0 aborted at any point, room 1 runs
    "aborts": dict(NREQ=2, MAXF=0, MAXAB=1, NABORTABLE=1),
    # the role flip (SetRole in the meta at any iteration, the drain, the flip, one request of the
    # new role): it multiplies the state space by about 20, so one request and PP 2 only
    "flip": dict(NREQ=1, MAXF=1, MAXAB=1, FLIP=1),  # a fault and an abort around the drain
    "flip-fault": dict(NREQ=1, MAXF=1, MAXAB=0, FLIP=1),  # decode: a fault, the quarantine drains
    "flip-abort-async1": dict(NREQ=1, MAXF=0, MAXAB=1, ASYNC=1, FLIP=1),  # L = 3 slots
    # structured output's compile hold (prefill): two guided rooms, their compiles end at any
    # time, room 0 aborted at any point (held included)
    "guide": dict(NREQ=2, MAXF=0, MAXAB=1, NABORTABLE=1, GUIDE=1),
    "guide-async1": dict(NREQ=2, MAXF=0, MAXAB=1, NABORTABLE=1, GUIDE=1, ASYNC=1),  # L = 3
    # tensor parallelism: two guided requests, the lead's compiles end at any time
    "tp": dict(NREQ=2),
    # the decode node with TP 2 stages (decode.pml -DTP=2): each TP rank has its own receiver and
    # writer per room; one fault (on a stage's last TP rank: the ranks are symmetric) and one
    # receiver whose route look-up is answered late (ROUTE), both in room 0
    "tp2-faults": dict(NREQ=1, MAXF=1, MAXAB=1, TP=2, ROUTE=1),  # and an abort at any stage
    "tp2-faults-noabort": dict(NREQ=1, MAXF=1, MAXAB=0, TP=2, ROUTE=1),  # PP 2: no abort
    "tp2-reuse": dict(NREQ=2, MAXF=1, MAXAB=0, TP=2, ROUTE=1),  # room 1 reuses room 0's pages
}


# Findings: the model of the code as it is breaks a property in this check, in this way. Reported
# as KNOWN-BUG (not a pass): the run must fail exactly so; FIXED models the proposed fix (a -D
# macro per model), which must pass everything. When the code is fixed, make the fix the model's
# behaviour, drop both entries and keep the old behaviour as a mutant. Finding 1 went that way
# (M_NO_NOTIFY_OWN); finding 2 (prefill strict read) is its own check, below.
BITS = 22  # PP 2 "aborts" supertrace: 2^22 bits (512 KiB)
BITS3 = 20  # PP 3 supertrace: 2^20 bits, a partial search
KNOWN: dict[str, str] = {}  # model -> the property its finding breaks
FIXED: dict[str, dict] = {}  # model -> the macros of the proposed fix


@dataclass
class Check:
    name: str
    model: str  # decode | prefill
    pp: int
    scenario: str
    kind: str  # safety | liveness
    props: tuple = SAFETY_PROPS  # what a pass proves (safety runs) / the mutant's target
    bitstate: int = 0  # 0: exhaustive (COLLAPSE); else -w of a supertrace run
    mutant: str | None = None
    timeout_s: int = 600  # the largest run took 115 s under load 4-7; CI must not fail on time
    extra: dict = field(default_factory=dict)
    known: str | None = None  # a finding: this property must fail, and only it


@dataclass
class Result:
    ok: bool  # spin found no error and the search was complete
    errors: int
    what: str  # first error, in spin's words
    states: int
    seconds: float
    complete: bool
    trail: str = ""


def properties_checks() -> list[Check]:
    out = []
    for model in ("decode", "prefill"):
        if not (HERE / f"{model}.pml").exists():
            continue
        fx = FIXED.get(model, {})
        out += _finding_checks(model) + _pp2_checks(model, fx) + _pp3_checks(model, fx)
        out += _flip_checks(model, fx)
        out += _guide_checks(model, fx)
        out += _decode_tp_checks(model, fx)
    return out + _tp_checks()


def _decode_tp_checks(model: str, fx: dict) -> list[Check]:
    """The decode node with TP 2 stages (-DTP=2): at PP 1 the safety properties and liveness,
    exhaustive (a fault, a late route and an abort; two rooms); at PP 2 the safety properties
    without the abort exhaustive (11 M states, about 30 s), two rooms and liveness partial."""
    if model != "decode":
        return []
    out = []
    for pp, sc, bits in (
        (1, "tp2-faults", 0),
        (1, "tp2-reuse", 0),
        (2, "tp2-faults-noabort", 0),
        (2, "tp2-reuse", BITS),
    ):
        out.append(Check(f"{model}-pp{pp}-{sc}", model, pp, sc, "safety", bitstate=bits, extra=fx))
    for pp, sc, bits in (
        (1, "tp2-faults", 0),
        (1, "tp2-reuse", 0),
        (2, "tp2-faults-noabort", BITS),
    ):
        out.append(
            Check(
                f"{model}-pp{pp}-{sc}-live",
                model,
                pp,
                sc,
                "liveness",
                ("liveness",),
                bitstate=bits,
                extra=fx,
            )
        )
    return out


def _tp_checks() -> list[Check]:
    """Tensor parallelism (tp.pml), exhaustive: the safety properties at PP 1, 2 and 3 (3.4 M
    states, about 15 s), liveness at PP 1 and 2."""
    out = [Check(f"tp-pp{pp}", "tp", pp, "tp", "safety", TP_PROPS) for pp in (1, 2, 3)]
    out += [Check(f"tp-pp{pp}-live", "tp", pp, "tp", "liveness", ("liveness",)) for pp in (1, 2)]
    return out


def _guide_checks(model: str, fx: dict) -> list[Check]:
    """The compile hold (-DGUIDE, prefill: the node whose last chunk samples): the safety
    properties and liveness at PP 2, with async_depth 1 too, a partial search at PP 3."""
    if model != "prefill":
        return []
    return [
        Check(f"{model}-pp2-guide", model, 2, "guide", "safety", bitstate=BITS, extra=fx),
        Check(
            f"{model}-pp2-guide-live",
            model,
            2,
            "guide",
            "liveness",
            ("liveness",),
            bitstate=BITS,
            extra=fx,
        ),  # fmt: skip
        Check(f"{model}-pp3-guide", model, 3, "guide", "safety", bitstate=BITS3, extra=fx),
        Check(
            f"{model}-pp2-guide-async1", model, 2, "guide-async1", "safety", bitstate=BITS, extra=fx
        ),  # fmt: skip
    ]


def _flip_checks(model: str, fx: dict) -> list[Check]:
    """The role flip of an elastic node (-DFLIP), PP 2, exhaustive: the safety properties and the
    two of the flip in one run, liveness in another. Prefill with async_depth 0 and 1; decode
    with a fault (its quarantine must drain before the flip)."""
    scs = ["flip", "flip-abort-async1"] if model == "prefill" else ["flip-fault"]
    out = [Check(f"{model}-pp2-{sc}", model, 2, sc, "safety", FLIP_PROPS, extra=fx) for sc in scs]
    out.append(
        Check(f"{model}-pp2-{scs[0]}-live", model, 2, scs[0], "liveness", ("liveness",), extra=fx)
    )
    return out


def _finding_checks(model: str) -> list[Check]:
    """The model of the code as it is: each finding must show (and only it)."""
    out = []
    if model in KNOWN:
        out.append(
            Check(f"{model}-pp2-faults-as-is", model, 2, "faults", "safety", known=KNOWN[model])
        )
    if model == "prefill":
        # finding 2: the stronger "no write reads a page when it is freed" does not hold
        out.append(
            Check(
                "prefill-pp2-faults-strict-read",
                model,
                2,
                "faults",
                "safety",
                ("strict-read",),
                known="strict-read",
                extra={"P_STRICT_READ": 1},
            )
        )
    return out


def _pp2_checks(model: str, fx: dict) -> list[Check]:
    # prefill "reuse" is 4.7 M states exhaustive (about a minute): supertrace here
    reuse_bits = BITS if model == "prefill" else 0
    return [
        Check(f"{model}-pp2-faults", model, 2, "faults", "safety", extra=fx),
        Check(f"{model}-pp2-reuse", model, 2, "reuse", "safety", bitstate=reuse_bits, extra=fx),
        Check(f"{model}-pp2-aborts", model, 2, "aborts", "safety", bitstate=BITS, extra=fx),
        Check(f"{model}-pp2-faults-live", model, 2, "faults", "liveness", ("liveness",), extra=fx),
        Check(
            f"{model}-pp2-reuse-live",
            model,
            2,
            "reuse",
            "liveness",
            ("liveness",),
            bitstate=reuse_bits,
            extra=fx,
        ),
    ]


def _pp3_checks(model: str, fx: dict) -> list[Check]:
    """PP 3: a supertrace (bitstate) search in a small bit array, bounded in time: a partial search
    (see the docs for its coverage), not a proof."""
    return [
        Check(f"{model}-pp3-faults", model, 3, "faults", "safety", bitstate=BITS3, extra=fx),
        # 2^22 for "reuse": at 2^20 the search misses M_PEER_DEAD_QUIESCED
        # (found at 2^22, 2.1 M states)
        Check(f"{model}-pp3-reuse", model, 3, "reuse", "safety", bitstate=BITS, extra=fx),
        Check(f"{model}-pp3-aborts", model, 3, "aborts", "safety", bitstate=BITS3, extra=fx),
        Check(
            f"{model}-pp3-faults-live",
            model,
            3,
            "faults",
            "liveness",
            ("liveness",),
            bitstate=BITS3,
            extra=fx,
        ),
    ]


def mutant_checks() -> list[Check]:
    m = [
        # (mutant macro, model, scenario, target property)
        ("M_NO_PASS2", "decode", "faults", "agreement"),
        ("M_NO_NOTIFY_OWN", "decode", "faults", "safety"),  # finding 1, fixed: must stay caught
        ("M_PEER_DEAD_QUIESCED", "decode", "reuse", "safety"),
        ("M_FREE_AT_ABORT", "decode", "faults", "no-double-free-no-leak"),
        ("M_SKIP_ABORT", "decode", "faults", "deadlock-freedom"),
        ("M_NO_GRACE", "decode", "reuse", "liveness"),
    ]
    if (HERE / "prefill.pml").exists():
        m += [
            ("M_NO_PASS2", "prefill", "faults", "agreement"),
            ("M_RELEASE_EARLY", "prefill", "faults", "safety"),
            ("M_FREE_AT_ABORT", "prefill", "faults", "no-double-free-no-leak"),
            ("M_SKIP_ABORT", "prefill", "faults", "deadlock-freedom"),
        ]
    m += [
        # the role flip: the last rank flips one iteration early / at SetRole, without the drain
        ("M_FLIP_EARLY", "prefill", "flip", "role-agreement"),
        ("M_FLIP_EARLY", "decode", "flip-fault", "role-agreement"),
        ("M_FLIP_UNDRAINED", "prefill", "flip", "drained-at-flip"),
        ("M_FLIP_UNDRAINED", "decode", "flip-fault", "drained-at-flip"),
        # the compile hold: ranks end it on their own view of the compile (they take the decision
        # in different slots), or the report does not go round with a batch that samples nothing
        # (the last rank alone ends the hold and waits for hidden states PP0 never sends)
        ("M_GUIDE_LOCAL", "prefill", "guide", "agreement"),
        ("M_GUIDE_NO_RING", "prefill", "guide", "deadlock-freedom"),
        # tensor parallelism: each rank of the group takes its own compile for the report (the
        # two schedules part); the lead shares no empty report (its follower waits for it)
        ("M_TP_LOCAL", "tp", "tp", "agreement"),
        ("M_TP_SKIP_EMPTY", "tp", "tp", "deadlock-freedom"),
    ]
    m = [x for x in m if (HERE / f"{x[1]}.pml").exists()]
    out = [_mutant(mac, model, 2, sc, prop) for mac, model, sc, prop in m]
    # and the PP 3 partial search finds them too (one per property class it runs)
    out.append(_mutant("M_NO_PASS2", "decode", 3, "faults", "agreement", bitstate=BITS3))
    out.append(_mutant("M_PEER_DEAD_QUIESCED", "decode", 3, "reuse", "safety", bitstate=BITS))
    # a lone stage: the ranks' own reports send one into a forward's all-reduce alone
    out.append(_mutant("M_TP_LOCAL", "tp", 1, "tp", "collective-order"))
    # the decode node with TP 2 stages: a stage's ballot counts a room bad once one TP rank has it
    # Failed, final on the others or not (the group's ranks split the verdict); the lead's own
    # quiesced flag releases the quarantine (a follower's writer lands in a freed page)
    if (HERE / "decode.pml").exists():
        for pp, sc in ((1, "tp2-faults"), (2, "tp2-faults-noabort")):
            out.append(_mutant("M_TP_LOCAL_BAD", "decode", pp, sc, "agreement", tp=2))
            out.append(_mutant("M_TP_LEAD_QUIESCED", "decode", pp, sc, "safety", tp=2))
        # and the liveness check sees a dead writer's room stay in quarantine with TP too
        out.append(_mutant("M_NO_GRACE", "decode", 1, "tp2-reuse", "liveness", tp=2))
    return out


def _mutant(
    mac: str, model: str, pp: int, scenario: str, prop: str, bitstate: int = 0, tp: int = 1
) -> Check:
    # Mutants go on top of the fixed model, so each counterexample is the mutant's own.
    kind = "liveness" if prop == "liveness" else "safety"
    name = f"{model}-pp{pp}-{mac}" if tp == 1 else f"{model}-pp{pp}-tp{tp}-{mac}"
    fx = FIXED.get(model, {})
    return Check(name, model, pp, scenario, kind, (prop,), bitstate, mutant=mac, extra=fx)


def run_check(c: Check, workdir: Path) -> Result:
    """spin -a, cc pan.c and ./pan for one check, in its own folder under `workdir`."""
    d = workdir / c.name
    d.mkdir(parents=True, exist_ok=True)
    for f in HERE.glob("*.pml"):
        shutil.copy(f, d)
    t0 = time.monotonic()
    _build_pan(c, d)
    try:
        p = subprocess.run(
            _pan_command(c), cwd=d, capture_output=True, text=True, timeout=c.timeout_s
        )
        out = p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Result(
            False, 0, f"timed out after {c.timeout_s} s", _states(out), time.monotonic() - t0, False
        )
    secs = time.monotonic() - t0
    errors = int(m.group(1)) if (m := re.search(r"errors: (\d+)", out)) else -1
    complete = "Search not completed" not in out and "-DMEMLIM bound" not in out and errors >= 0
    trail = ""
    if errors > 0 and (d / f"{c.model}.pml.trail").exists():
        trail = str(d / f"{c.model}.pml.trail")
    return Result(
        errors == 0 and complete, errors, _first_error(out), _states(out), secs, complete, trail
    )


def _build_pan(c: Check, d: Path) -> None:
    """The verifier of the check's model and properties: pan.c from spin, compiled to ./pan."""
    defs = {"PP": c.pp, **SCENARIOS[c.scenario], **c.extra}
    args = [f"-D{k}={v}" for k, v in defs.items()]
    if c.kind == "liveness":
        args.append("-DP_LIVENESS")
    else:
        args += [f"-D{PROP_MACROS[p]}" for p in c.props if p in PROP_MACROS]
    if c.mutant:
        args.append(f"-D{c.mutant}")
    subprocess.run(
        ["spin", "-a", *args, f"{c.model}.pml"],
        cwd=d,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    cflags = ["-O1", "-w", "-DMEMLIM=1024"]  # -O1: most of -O2's speed for half its compile time
    cflags += ["-DBITSTATE"] if c.bitstate else ["-DCOLLAPSE"]
    if c.kind == "safety":
        cflags.append("-DSAFETY")
    else:
        cflags.append("-DNFAIR=3")
    subprocess.run(
        ["cc", *cflags, "-o", "pan", "pan.c"],
        cwd=d,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _pan_command(c: Check) -> list[str]:
    pan = ["./pan", "-m400000"]
    if c.bitstate:
        pan.append(f"-w{c.bitstate}")
    if c.kind == "liveness":
        pan += ["-a", "-f"]
    return pan


def _first_error(out: str) -> str:
    """The first error pan reports, in spin's words ("" when none)."""
    for pat in (
        r"pan:\d+: (assertion violated .*?) \(at depth",
        r"pan:\d+: (invalid end state)",
        r"pan:\d+: (acceptance cycle)",
        r"pan:\d+: (non-progress cycle)",
        r"(pan: reached -DMEMLIM bound)",
        r"(error: max search depth too small)",
    ):
        if mm := re.search(pat, out):
            return mm.group(1)
    return ""


def _states(out: str) -> int:
    m = re.search(r"(\d+) states, stored", out)
    return int(m.group(1)) if m else 0


def classify(what: str) -> str:
    """The property a spin error breaks, from the assertion's text (see the model's asserts)."""
    if "invalid end state" in what:
        return "deadlock-freedom"
    if "gtag==" in what:
        return "collective-order"  # tp.pml: the stage's two ranks in different collectives
    if "kind==" in what:
        return "replay-order"  # tp.pml: a follower took another message than its lead shared
    if "role[k]" in what:
        return "role-agreement"  # a rank's role is not PP0's in this iteration (P_ROLE)
    if "heldnow" in what:
        return "drained-at-flip"  # a rank flipped while it held something (P_DRAINED)
    if "acceptance cycle" in what:
        return "liveness"
    if "log_what" in what or "tpsplit" in what:
        return "agreement"  # tpsplit: the TP ranks of a decode stage split a verdict (-DTP)
    if "page[x]<255" in what or re.search(r"owner\[.*\]==0\)", what):
        return "no-double-free-no-leak"  # free_page's double-free check, the leak check at exit
    if "!(reading[x])" in what:
        return "strict-read"  # finding 2 (P_STRICT_READ only)
    if re.search(r"page\[[^\]]+\]!=255", what) or "dirty" in what:
        return "safety"  # a transfer write landing in a page not its room's
    return what or "?"


def main(argv: list[str] | None = None) -> int:
    a = _parse_args(argv)
    if not shutil.which("spin") or not shutil.which("cc"):
        print(
            "verify-protocol: needs spin and a C compiler (scripts/setup.sh --test installs spin)",
            file=sys.stderr,
        )
        return 2
    checks = mutant_checks() if a.mutants else properties_checks()
    if a.only:
        checks = [c for c in checks if c.name in a.only]
    work = Path(tempfile.mkdtemp(prefix="pdserve-spin-"))
    failed = 0
    t_all = time.monotonic()
    try:
        for c in checks:
            r = run_check(c, work)
            failed += _report_mutant(c, r, a.keep) if c.mutant else _report_properties(c, r)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work directory kept: {work}")
    print(
        f"total {time.monotonic() - t_all:.1f}s, "
        f"{'all passed' if not failed else f'{failed} failed'}"
    )
    return 1 if failed else 0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--mutants", action="store_true", help="run the mutants instead of the properties"
    )
    ap.add_argument("--only", action="append", default=[], help="check name (repeatable)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (trails)")
    return ap.parse_args(argv)


def _config(c: Check) -> str:
    return f"{c.model} PP{c.pp} {c.scenario}" + (f" {c.mutant}" if c.mutant else "")


def _report_mutant(c: Check, r: Result, keep: bool) -> int:
    """Prints the mutant's line; returns 1 if it failed (no counterexample for its target)."""
    hit = classify(r.what)
    good = r.errors > 0 and hit in c.props
    print(
        f"{'OK  ' if good else 'FAIL'} mutant {_config(c):38s} target={c.props[0]:24s} "
        f"spin: {r.what or 'no error'} -> {hit}  states={r.states} {r.seconds:.1f}s"
        + (f" trail={r.trail}" if r.trail and keep else ""),
        flush=True,
    )
    return int(not good)


def _report_properties(c: Check, r: Result) -> int:
    """Prints one line per property of the check; returns how many failed."""
    cfg = _config(c)
    if c.extra:
        cfg += " " + " ".join(c.extra)
    mode = f"bitstate -w{c.bitstate}" if c.bitstate else "exhaustive"
    failed = 0
    for prop in c.props:
        broken = r.errors > 0 and classify(r.what) == prop
        ok = r.complete and r.errors == 0
        if c.known:
            # the finding must show, as this property's counterexample; the others are not
            # proved by a run that stopped at it
            ok = r.errors > 0 and classify(r.what) == c.known
            status = ("KNOWN-BUG" if prop == c.known else "UNPROVED ") if ok else "FAIL     "
            failed += not ok
            print(
                f"{status} {prop:24s} {cfg:24s} {mode:14s} states={r.states:<9d} "
                f"{r.seconds:6.1f}s  "
                f"({r.what or 'no error: the finding no longer shows; update KNOWN'})",
                flush=True,
            )
            continue
        failed += not ok
        status = "OK  " if ok else "FAIL"
        why = "" if ok else f"  ({r.what or 'incomplete search'})"
        print(
            f"{status} {prop:24s} {cfg:24s} {mode:14s} states={r.states:<9d} "
            f"{r.seconds:6.1f}s{why}" + ("  <- this property" if broken else ""),
            flush=True,
        )
    return failed


if __name__ == "__main__":
    sys.exit(main())
