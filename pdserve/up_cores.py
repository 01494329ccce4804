"""`pdserve up`'s core plan: every rank of every node on the host's cores, the fronts, the router
and the launcher on the cores left for I/O (runtime/placement.py plans; this orders the roles)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from pdserve.runtime.placement import bind_cores, plan_placement
from pdserve.up_args import UpConfig


def plan_cluster_cores(
    cfg: UpConfig, n_models: int, say: Callable[[str], None]
) -> Callable[[str, int], list[str]]:
    """Plans every rank's cores, binds this launcher (and the router it starts) to the I/O
    cores, and returns `cpus(role, n)`: the core flags of the next node of `role` started, of
    `n` ranks (its PP x TP).

    The prefill ranks come first in the plan (an uneven split gives them the extra core),
    unless no core is left over for I/O. Then the decode ranks take the first cores: the
    fronts, the router and a co-located client share the last core (the one the plan keeps for
    I/O whenever it can, and the one vLLM-CPU reserves), bound there, and a prefill rank there
    loses only throughput, while a decode rank would add their scheduling delay to each
    token. An elastic node also gets its cores in each role (--prefill-cpus, --decode-cpus): as
    the other role's newest node, so that a prefill node that becomes a decode node leaves the
    decode ranks' cores (on 2 cores, 2 prefill + 1 decode: prefill-1 shares decode-0's core as a
    prefill node, and moves to prefill-0's as a decode node)."""
    a, m = cfg, n_models
    ranks = {
        "prefill": _rank_names("prefill", a.prefill_nodes * m, a.prefill_pp, a.prefill_tp),
        "decode": _rank_names("decode", a.decode_nodes * m, a.decode_pp, a.decode_tp),
    }
    n_ranks = len(ranks["prefill"]) + len(ranks["decode"])
    plan = plan_placement(n_ranks, sorted(os.sched_getaffinity(0)), a.threads)
    order = ("prefill", "decode") if plan.io_cores else ("decode", "prefill")
    names = ranks[order[0]] + ranks[order[1]]
    # with no core left over, on the last rank's (a prefill rank's): off the decode ranks'
    # cores, where their wake-ups would delay tokens
    fronts = plan.front_cores(last_rank_shares=order[1] == "prefill")
    say(
        f"{a.prefill_nodes} prefill node(s) x PP {a.prefill_pp} x TP {a.prefill_tp}, "
        f"{a.decode_nodes} decode node(s) x PP {a.decode_pp} x TP {a.decode_tp} per model, "
        f"{m} model(s): {n_ranks} rank "
        f"processes on {len(os.sched_getaffinity(0))} cores; placement: "
        f"{plan.describe(names, fronts)}"
    )
    bind_cores(fronts)  # this launcher and the router it starts
    io = ["--io-cpus", ",".join(map(str, plan.io_cores))] if plan.io_cores else []
    if fronts and not plan.io_cores:  # the fronts' cores, not I/O cores a helper may use
        io = ["--front-cpus", ",".join(map(str, fronts))]
    at = {order[0]: 0, order[1]: len(ranks[order[0]])}  # the plan index of a role's next rank
    roles = [name.split("-")[0] for name in names]  # each plan index's role

    def cpus(role: str, n: int) -> list[str]:
        at[role] += n
        start = at[role] - n
        flags = ["--cpus", plan.flag(start, n), *io]
        if a.elastic:
            other = "decode" if role == "prefill" else "prefill"
            alt = other_role_cores(plan.rank_cores, roles, range(start, start + n), other)
            flags += [f"--{role}-cpus", plan.flag(start, n), f"--{other}-cpus", alt]
        return flags

    return cpus


def _rank_names(role: str, nodes: int, pp: int, tp: int) -> list[str]:
    """The plan's names of a role's ranks, node by node, a stage's TP ranks side by side (the
    order a node's `--cpus` lists them in: runtime/node_ranks.py make_specs)."""
    return [
        f"{role}-{i} pp{r}" + (f" tp{t}" if tp > 1 else "")
        for i in range(nodes)
        for r in range(pp)
        for t in range(tp)
    ]


def other_role_cores(
    rank_cores: Sequence[tuple[int, ...]], roles: Sequence[str], mine: range, other: str
) -> str:
    """An elastic node's cores in its `other` role (`--cpus` form), for its ranks at plan indexes
    `mine`: each rank keeps its cores unless a rank of `other` runs there; then it takes the cores
    where the fewest ranks of `other` run (then the fewest ranks, then the plan's order). So a
    prefill node turned decode leaves the decode rank it shared a core with, and a decode node
    turned prefill stays on the core it had to itself. Its own ranks that moved count as `other`."""
    placed: list[tuple[int, ...]] = []  # this node's ranks already given cores in `other`

    def load(cores: tuple[int, ...], role: str | None) -> int:
        hits = [
            j
            for j, c in enumerate(rank_cores)
            if j not in mine and set(c) & set(cores) and role in (None, roles[j])
        ]
        return len(hits) + sum(bool(set(c) & set(cores)) for c in placed)

    for i in mine:
        if load(rank_cores[i], other) == 0:
            placed.append(rank_cores[i])
            continue
        candidates = list(dict.fromkeys(rank_cores))
        best = min(candidates, key=lambda c: (load(c, other), load(c, None), candidates.index(c)))
        placed.append(best)
    return ";".join(",".join(map(str, c)) for c in placed)
