/* Tensor parallelism inside a PP stage: a colocated node of PP stages of TP 2
 * (runtime/rank/tp_group.py, docs/ARCHITECTURE.md section 15).
 *
 * Each stage is a lead (t = 0), the stage's member of the PP chain, and a follower (t = 1), a
 * replica of its lead's scheduler: it takes every message its lead received, in order, from the
 * replay channel, and sends nothing. What the model checks is what TP adds to the slot loop
 * (slotloop.pml models the loop and the ring in full, for one process per stage):
 * - the replay: PP0's meta, the hidden states and the output ring, shared by the lead as it
 *   receives them; the lead's `commit` waits, at the start of each iteration, until its
 *   follower took what it shared in the previous one;
 * - the forward's all-reduce: both ranks of a stage meet in it once per forward;
 * - the last stage's samples and its report of compiled guides (engine/guide_hold.py): the lead
 *   samples and compiles, and shares both; its compiles end at any time; a hold ends on the
 *   lead's report, on a lone stage before the schedule, in a pipeline on the ring;
 * - the consensus checker's comparison every iteration: MIN over the TP group, MIN over the
 *   leads, then the lead's result to its follower.
 * Every request is guided, its prompt is one chunk, and it ends at its first sample. Decisions
 * (a hold ended, a request scheduled, a request finished) go to one agreement log: every process
 * must take the same ones in the same slots.
 */
#ifndef PP
#define PP 2
#endif
#ifndef NREQ
#define NREQ 2
#endif
#define TP 2
#define N (PP * TP)            /* processes: id = stage * TP + t */
#define L PP                   /* slots (async_depth 0) */
#define LAST (PP - 1)
#define NLOG (NREQ * 3)

#define S_NONE 0
#define S_WAITING 1
#define S_RUNNING 2
#define S_DONE 3

#define K_GUIDE 1
#define K_SCHED 2
#define K_FINISH 3
#define WHAT(r, kind) (((r) << 2) | (kind))

#define R_META 1
#define R_HIDDEN 2
#define R_OUTPUT 3
#define R_SAMPLE 4
#define R_REPORT 5

chan meta_in[PP] = [1] of { byte };             /* Msg.META from lead k-1: add mask */
chan hidden_in[PP] = [1] of { byte };           /* Msg.HIDDEN from lead k-1: the slot */
chan output_in[PP] = [PP] of { byte, byte };    /* Msg.OUTPUT: the slot, the report's mask */
chan rep[PP] = [4] of { byte, byte, byte };     /* the replay: kind, value, value */
chan to_f[PP] = [1] of { byte, byte };          /* the TP group's collectives: tag, value */
chan to_l[PP] = [1] of { byte, byte };
chan pp_ar[PP] = [1] of { byte };               /* the leads' all-reduce (consensus checker) */

byte st[N * NREQ];              /* the request's state on process id */
bool gp[N * NREQ];              /* req.guide_pending */
bool compiled[TP * NREQ];       /* rank t of the sampling stage finished the room's guide (the
                                   lead's; a follower compiles only in the mutant M_TP_LOCAL) */
byte batch[N * L];              /* scheduled mask per slot */
bool bawait[N * L];             /* ScheduledBatch.awaits_guides per slot */
byte lrep[N * L];               /* the sampling stage's report of slot mb, kept for its harvest */

byte log_what[NLOG];
byte log_slot[NLOG];
byte nlogged;
byte ndec[N];

byte nadd;                      /* PP0's lead: requests the front delivered */
byte pending;                   /* added and not ended (PP0's lead answers) */

#define TAG_AR 1                /* a collective's tag: the model asserts both ranks are in the same one */
#define TAG_CHECK 2
#define TAG_BCAST 3

inline decide(id, what, slot) {
    d_step {
        if
        :: ndec[id] == nlogged -> log_what[nlogged] = what; log_slot[nlogged] = slot; nlogged++
        :: else ->
#ifdef P_AGREEMENT
            assert(log_what[ndec[id]] == what && log_slot[ndec[id]] == slot)
#else
            skip
#endif
        fi;
        ndec[id]++
    }
}

/* An all-reduce of the stage's two ranks: both send, then both receive; `v` becomes the MIN
   (AND of masks) of both. */
inline allreduce(s, t, tag, v) {
    if
    :: t == 0 -> to_f[s] ! tag, v; to_l[s] ? gtag, w
    :: else -> to_l[s] ! tag, v; to_f[s] ? gtag, w
    fi;
    assert(gtag == tag);        /* both ranks are in the same collective (P: collective-order) */
    v = v & w; gtag = 0
}

/* The compile report of the sampling stage (SlotLoop.compiled_guides): its pending, live requests
   whose guide the lead compiled, shared with its follower (TPGroup.same). */
inline report(s, t, v) {
    v = 0; x = 0;
    for (r : 0 .. NREQ - 1) {
        if
        :: gp[id * NREQ + r] && st[id * NREQ + r] == S_WAITING ->
            x = x | (1 << r);
            if :: compiled[t * NREQ + r] -> v = v | (1 << r) :: else fi
        :: else
        fi
    };
#ifdef M_TP_LOCAL
    skip        /* mutant: each rank of the group takes its own compile for the report */
#else
    if
#ifdef M_TP_SKIP_EMPTY
    :: t == 0 && v != 0 -> rep[s] ! R_REPORT, v, 0  /* mutant: the lead shares no empty report */
    :: t == 0 && v == 0 -> skip
#else
    :: t == 0 -> rep[s] ! R_REPORT, v, 0
#endif
    :: else -> rep[s] ? kind, v, m; assert(kind == R_REPORT)
    fi
#endif
}

inline apply_report(v) {
    for (r : 0 .. NREQ - 1) {
        if
        :: (v & (1 << r)) && gp[id * NREQ + r] && st[id * NREQ + r] == S_WAITING ->
            gp[id * NREQ + r] = 0; decide(id, WHAT(r, K_GUIDE), mb)
        :: else
        fi
    }
}

proctype Proc(byte s; byte t) {
    byte id, nit, mb, hb, addm, r, x, m, w, v, got, kind, gtag;   /* nit: iterations, up to L */
    bool busy, needs;
    id = s * TP + t;
    do
    :: atomic {
        x = 1;
        for (r : 0 .. NREQ - 1) { x = x && st[id * NREQ + r] == S_DONE };
        if :: x -> break :: else fi;
        hb = (mb + 1) % L;
        if :: t == 0 -> empty(rep[s]) :: else fi;      /* commit: the follower took the last turn's */

        /* ingest meta: PP0's lead polls the front, a follower takes its lead's list */
        addm = 0;
        if
        :: s == 0 && t == 0 ->
            if :: nadd < NREQ -> addm = 1 << nadd; nadd++; pending++ :: true fi
        :: s > 0 && t == 0 -> meta_in[s] ? addm
        :: t == 1 -> rep[s] ? kind, addm, x; assert(kind == R_META)
        fi;
        if :: t == 0 -> rep[s] ! R_META, addm, 0 :: else fi;
        if :: t == 0 && s != LAST -> meta_in[s + 1] ! addm :: else fi;
        for (r : 0 .. NREQ - 1) {
            if :: addm & (1 << r) -> st[id * NREQ + r] = S_WAITING; gp[id * NREQ + r] = 1 :: else fi
        };

        /* a lone stage samples: its report before the schedule */
        if :: PP == 1 -> report(s, t, v); apply_report(v) :: else fi;

        /* schedule: every waiting request that is not held joins slot mb, and samples in it */
        batch[id * L + mb] = 0; bawait[id * L + mb] = 0;
        for (r : 0 .. NREQ - 1) {
            x = id * NREQ + r;
            if
            :: st[x] == S_WAITING && !gp[x] ->
                st[x] = S_RUNNING; batch[id * L + mb] = batch[id * L + mb] | (1 << r);
                decide(id, WHAT(r, K_SCHED), mb)
            :: st[x] == S_WAITING && gp[x] -> bawait[id * L + mb] = 1
            :: else
            fi
        };
        busy = batch[id * L + mb] != 0;

        /* forward: hidden states in (shared), the all-reduce; the sampling stage's report */
        if
        :: busy && s > 0 ->
            if
            :: t == 0 -> hidden_in[s] ? m; rep[s] ! R_HIDDEN, m, 0
            :: else -> rep[s] ? kind, m, x; assert(kind == R_HIDDEN)
            fi;
            assert(m == mb)
        :: else
        fi;
        if :: busy -> v = 1; allreduce(s, t, TAG_AR, v) :: else fi;
        if      /* the lead samples, its follower takes its tokens (SlotLoop._sample) */
        :: busy && s == LAST && t == 0 -> rep[s] ! R_SAMPLE, batch[id * L + mb], 0
        :: busy && s == LAST && t == 1 -> rep[s] ? kind, m, x; assert(kind == R_SAMPLE && m == batch[id * L + mb])
        :: else
        fi;
        if
        :: s == LAST && PP > 1 && bawait[id * L + mb] -> report(s, t, v); lrep[id * L + mb] = v
        :: s == LAST && !(PP > 1 && bawait[id * L + mb]) -> lrep[id * L + mb] = 0
        :: else
        fi;

        /* exchange: hidden states on, the ring of slot hb round (lead to lead, shared) */
        needs = nit + 1 >= L && (batch[id * L + hb] != 0 || bawait[id * L + hb]);
        if :: t == 0 && s != LAST && busy -> hidden_in[s + 1] ! mb :: else fi;
        got = 0;
        if
        :: s != LAST && PP > 1 && needs ->
            if
            :: t == 0 -> output_in[s] ? m, got; rep[s] ! R_OUTPUT, m, got
            :: else -> rep[s] ? kind, m, got; assert(kind == R_OUTPUT)
            fi;
            assert(m == hb);
            if :: t == 0 && s + 1 < LAST -> output_in[s + 1] ! m, got :: else fi
        :: s == LAST && PP > 1 && t == 0 && (busy || bawait[id * L + mb]) -> output_in[0] ! mb, lrep[id * L + mb]
        :: else
        fi;
        if :: s == LAST && PP > 1 -> got = lrep[id * L + hb] :: else fi;

        /* harvest slot hb: the report, then its requests' first token ends them */
        if
        :: nit + 1 >= L ->
            v = got; x = mb; mb = hb; apply_report(v); mb = x;
            for (r : 0 .. NREQ - 1) {
                if
                :: batch[id * L + hb] & (1 << r) ->
                    st[id * NREQ + r] = S_DONE; decide(id, WHAT(r, K_FINISH), hb);
                    if :: id == 0 -> pending-- :: else fi
                :: else
                fi
            };
            batch[id * L + hb] = 0; bawait[id * L + hb] = 0
        :: else
        fi;

        /* the consensus checker: MIN over the group, over the leads, the lead's to its follower */
        v = 1;
        allreduce(s, t, TAG_CHECK, v);
        if
        :: t == 0 && PP > 1 -> pp_ar[(s + 1) % PP] ! v; pp_ar[s] ? w; v = v & w
        :: else
        fi;
        if
        :: t == 0 -> to_f[s] ! TAG_BCAST, v
        :: else -> to_f[s] ? gtag, v; assert(gtag == TAG_BCAST); gtag = 0
        fi;
        mb = hb;
        if :: nit < L -> nit++ :: else fi;
        m = 0; w = 0; v = 0; x = 0; r = 0; kind = 0; got = 0; addm = 0
    }
    od
}

/* The sampling stage's lead (and, in the mutant, its follower) finishes room r's compile at any
   time after the room reached it. */
proctype Compile(byte t; byte r) {
    atomic { st[(LAST * TP + t) * NREQ + r] != S_NONE -> compiled[t * NREQ + r] = 1 }
}

init {
    byte s, t, r;
    atomic {
        for (s : 0 .. PP - 1) {
            for (t : 0 .. TP - 1) { run Proc(s, t) }
        };
        for (r : 0 .. NREQ - 1) { run Compile(0, r) }
#ifdef M_TP_LOCAL
        ; for (r : 0 .. NREQ - 1) { run Compile(1, r) }
#endif
    }
}

#ifdef P_LIVENESS
ltl live { [] ((pending > 0) -> <> (pending == 0)) }
#endif
