/* The decode node: prealloc -> transfer -> running -> finished, failed rooms in quarantine.
 *
 * decode_node/loop.py DecodeLoop on PP ranks; kv_transfer/receiver.py KVReceiver (one per room and
 * rank); the prefill rank that writes a decode rank's layers, the bootstrap route look-up and the
 * heartbeat thread are the environment process Peer. One page per request and rank (the aux slot
 * shares the page's life: allocated with it at prealloc, freed with it from quarantine).
 * Build: spin -a -DPP=2 [-DP_AGREEMENT|-DP_SAFETY|-DP_NOLEAK] decode.pml (see verify.py).
 *
 * -DTP=2: each PP stage is a TP group (pd_common/loop_base.py PDLoop.stage_ballots). The group is
 * one Rank process: its ranks take the same decisions from the same agreed ballots (tp.pml checks
 * the replay and the collectives that make them so). But each TP rank t has its own receiver of
 * every room and its own Peer (the prefill writer of its heads), which fail, stall and die on
 * their own. The stage's ballots combine them: good where good on every TP rank, bad where Failed
 * on one and final on all, quiesced where quiesced on all. With TP 1 the TP code expands to the
 * model as it was, statement for statement (the PP 3 supertrace searches depend on it).
 */
#include "slotloop.pml"

#ifndef NFAULTY
#define NFAULTY 1       /* rooms a fault may strike (the others are healthy) */
#endif
#ifndef NP
#define NP 1            /* pages per rank: small, so a freed page is reused at once */
#endif
#ifndef TP
#define TP 1            /* TP ranks per PP stage, each with its own receiver and Peer per room */
#endif
#ifndef MAXLATE
#define MAXLATE 1       /* ROUTE: receivers of a run whose route look-up is answered late */
#endif
#define NRX (PP * TP * NREQ)
#define RX(k, t, r) (((k) * TP + (t)) * NREQ + (r))    /* room r's receiver on TP rank t of stage k */

/* A statement or condition over the TP ranks t of a stage, unrolled (no loop variable, no new
   statement with TP 1): EACH_T(S) runs S(t) for each, ALL_T(C) / ANY_T(C) are C(t) and / or. */
#if TP == 1
#define EACH_T(S) S(0)
#define ALL_T(C) C(0)
#define ANY_T(C) C(0)
#elif TP == 2
#define EACH_T(S) S(0); S(1)
#define ALL_T(C) (C(0) && C(1))
#define ANY_T(C) (C(0) || C(1))
#elif TP == 3
#define EACH_T(S) S(0); S(1); S(2)
#define ALL_T(C) (C(0) && C(1) && C(2))
#define ANY_T(C) (C(0) || C(1) || C(2))
#else
#error "TP 1, 2 or 3"
#endif

/* DecodeLoop queues of a request on one rank */
#define Q_NONE 0
#define Q_PREALLOC 1    /* self.prealloc */
#define Q_TRANSFER 2    /* self.transfer */
#define Q_RUNNING 3     /* in the scheduler (decoding) */
#define Q_QUAR 4        /* self.quarantine */
#define Q_GONE 5

/* decisions, for the agreement log */
#define K_PREALLOC 1
#define K_TRANSFERRED 2
#define K_QRELEASE 3
#define K_FINISH 4
#define K_ABORTNOW 5
#define WHAT(r, kind, v) (((r) << 4) | ((kind) << 1) | (v))

/* Peer: the prefill rank writing into this decode rank's pages */
#define W_IDLE 0
#define W_WRITING 1     /* a Mooncake write into the pages is on the wire */
#define W_STALLED 2     /* SIGSTOP / long pause in the middle of a write: silent, resumes later */
#define W_DONE 4        /* sent its terminal message (KVStatus Success/Failed, KVAbort) */
#define W_DEAD 5        /* SIGKILL: never writes again, never says so */

byte q[PP * NREQ];              /* which DecodeLoop queue the request is in */
byte page[PP * NREQ];           /* pd.pages */
byte owner[PP * NP];            /* the allocator: room + 1 holding the page, 0 = free */
bool aborted[PP * NREQ];        /* pd.aborted */
byte rslot[PP * NREQ];          /* scheduler.slots: the slot a running request belongs to */
bool in_flight[PP * NREQ];      /* req.in_flight: scheduled in a slot not harvested yet */
bool to_finish[PP * NREQ];      /* req.to_finish (abort while in flight) */
byte batch[PP * L];             /* rooms scheduled in slot mb, not harvested yet */
bool bvalid[PP * L];

/* One receiver and Peer per (stage, TP rank, room), indexed RX(k, t, r) (k * NREQ + r with TP 1).
   Queues, pages and batches stay per stage: the same on each of its TP ranks (each rank has its
   own pool of its heads, allocated and freed by the same decisions in the same iteration). */
byte rcv[NRX];                  /* KVReceiver._status */
bool rcv_regd[NRX];             /* _page_ids set (register) */
bool rcv_route[NRX];            /* _route known */
bool rcv_sent[NRX];             /* _sent: the registration went to the prefill rank */
bool rcv_quiet[NRX];            /* _quiet: the prefill rank sent its terminal message */
bool rcv_peer_dead[NRX];        /* failed by the heartbeat thread (reason peer_dead) */
bool grace[NRX];                /* quarantine_s passed since finished_at */
bool rcv_abort_sent[NRX];       /* KVAbort sent to the prefill rank */
bool peer_fail[NRX];            /* the prefill sender failed: its terminal message is Failed */
bool abort_done[NRX];           /* the prefill sender processed our KVAbort */
byte peer[NRX];                 /* Peer state */
#ifdef ROUTE
byte late;                      /* receivers whose route came late so far */
#endif
#if TP > 1
hidden byte tpsplit;            /* scratch: a stage's TP ranks split a verdict (not in the state) */
#endif

/* KVReceiver.quiesced: no prefill write can land in the room's pages any more */
#ifdef M_PEER_DEAD_QUIESCED
#define QUIESCED(x) (rcv[x] == SUCCESS || (rcv[x] == FAILED && (!rcv_sent[x] || rcv_quiet[x] || grace[x] || rcv_peer_dead[x])))
#else
#define QUIESCED(x) (rcv[x] == SUCCESS || (rcv[x] == FAILED && (!rcv_sent[x] || rcv_quiet[x] || grace[x])))
#endif

/* KVReceiver._fail (under its lock): a KVAbort goes to the prefill rank once the registration went
   out, unless it sent its terminal message (_quiet: a failure it reported is not echoed back).
   `notify` is 1 for every caller in the code; it is 0 only under the mutant below. */
inline rcv_fail(x, notify) {
    if
    :: rcv[x] != FAILED && rcv[x] != SUCCESS ->
        rcv[x] = FAILED;
        if :: notify && rcv_sent[x] && !rcv_quiet[x] -> rcv_abort_sent[x] = 1 :: else fi
    :: else
    fi
}

/* Failures the decode side finds itself (its timeouts, peer_dead, bootstrap_lost) tell the prefill
   rank like a client abort does. M_NO_NOTIFY_OWN re-introduces finding 1 of docs/PROTOCOL_MODEL.md
   (fixed): only a client abort sent KVAbort, so a prefill sender that is alive and never told
   writes on after the quarantine grace ran out, into a freed page. */
#ifdef M_NO_NOTIFY_OWN
#define NOTIFY_OWN 0
#else
#define NOTIFY_OWN 1
#endif

/* In Rank (room r of stage k, x = k * NREQ + r in scope), the room's receiver on TP rank t: with
   TP 1 the rank's own, x, as before (spin resets dead variables, so the same variables keep the
   same states hash for hash). */
#if TP > 1
#define RXT(t) RX(k, t, r)
#else
#define RXT(t) x
#endif
#define RCV(t) rcv[RXT(t)]
#define FAILED_T(t) (RCV(t) == FAILED)
#define GOOD_PRE_T(t) (RCV(t) >= WAITING && RCV(t) != NONE)   /* done_for(PREALLOC), not Failed */
#define GOOD_TR_T(t) (RCV(t) == SUCCESS)                      /* done_for(TRANSFERRED), not Failed */
#define FINAL_PRE_T(t) (FAILED_T(t) || GOOD_PRE_T(t))
#define FINAL_TR_T(t) (FAILED_T(t) || GOOD_TR_T(t))
#define QUIESCED_T(t) QUIESCED(RXT(t))

/* PDLoop.stage_ballots: each TP rank's Ballot.from_statuses on its own receiver (Failed bad, final
   for the kind and not Failed good), combined: the stage's ballot is good where good on every TP
   rank, bad where Failed on one and final (for the kind) on every one. RELEASE (`quiet`): the
   room's receiver quiesced on every TP rank. With TP 1: the rank's own ballot. */
#define STAGE_GOOD(GOOD_T) ALL_T(GOOD_T)
#ifndef M_TP_LOCAL_BAD
#define STAGE_BAD(FINAL_T) (ANY_T(FAILED_T) && ALL_T(FINAL_T))
#else
#define STAGE_BAD(FINAL_T) ANY_T(FAILED_T)   /* mutant: Failed on one TP rank, final on all or not */
#endif
#ifndef M_TP_LEAD_QUIESCED
#define STAGE_QUIESCED ALL_T(QUIESCED_T)
#else
#define STAGE_QUIESCED QUIESCED_T(0)         /* mutant: the lead's own flag alone */
#endif

/* Verdict.partition on each TP rank: a rank applies room r where its own receiver is final for the
   kind. A stage's ranks apply the same verdicts, so where one does, all must (agreement). Nothing
   with TP 1. */
#if TP > 1 && defined(P_AGREEMENT)
#define SAME_SPLIT(FINAL_T) ; tpsplit = !ALL_T(FINAL_T); assert(!tpsplit)
#else
#define SAME_SPLIT(FINAL_T)
#endif

/* A new room's receiver on TP rank t: the route look-up is not modelled (known at once); with
   ROUTE, MAXLATE receivers of the run (in a room a fault may strike) get it later from their Peer. */
#ifdef ROUTE
#define OPEN_T(t) rcv[RX(k, t, r)] = BOOTSTRAPPING; \
    if :: late < MAXLATE && r < NFAULTY -> late++ :: true -> rcv_route[RX(k, t, r)] = 1 fi
#else
#define OPEN_T(t) rcv[RX(k, t, r)] = BOOTSTRAPPING; rcv_route[RX(k, t, r)] = 1
#endif
/* KVReceiver.register -> _maybe_send_registration, on TP rank t */
#define REGISTER_T(t) rcv_regd[RXT(t)] = 1; \
    if :: rcv_route[RXT(t)] && RCV(t) == BOOTSTRAPPING -> rcv_sent[RXT(t)] = 1; RCV(t) = WAITING :: else fi
/* KVReceiver.abort on TP rank t (a client abort; DecodeLoop._fail) */
#define ABORT_T(t) rcv_fail(RXT(t), 1)
/* DecodeLoop._fail after a verdict failed the room: every TP rank ends its own receiver (abort
   FAILED_ELSEWHERE); one still waiting sends KVAbort to its writer, whose final word quiesces it
   before the grace. With TP 1 a verdict fails a room only once every rank's receiver is final (the
   route is known at once), so there it changes nothing and is left out. */
#if TP > 1
#define FAIL_ENDS ; EACH_T(ABORT_T)
#else
#define FAIL_ENDS
#endif

inline free_page(k, x, r) {
    d_step {
#ifdef P_NOLEAK
        assert(page[x] < NOPAGE && owner[k * NP + page[x]] == r + 1);     /* no double free */
#endif
        owner[k * NP + page[x]] = 0; page[x] = NOPAGE
    }
}

/* A lone stage (PP 1): PP0 is the last rank, so the verdict it sends PP0 in pass 1 and the outputs
   it sends round the ring are for itself (RingVote keeps them, pass 2 returns the kept verdict);
   the slot loop's messages to itself are dropped. Called only with PP 1. */
inline lone_stage_drop() {
    do
    :: nempty(ring_in[0]) -> ring_in[0] ? tag, m, xv[0], xv[1], xv[2], xv[3], xv[4], xv[5]
    :: empty(ring_in[0]) -> break
    od;
    do
    :: nempty(output_in[0]) -> output_in[0] ? m
    :: empty(output_in[0]) -> break
    od;
    m = 0
}

#ifdef FLIP
/* At the flip of rank k: it holds no page, no request is in any of its queues (quarantine
   included) or in a batch (the drained-at-flip property). */
inline nothing_held(k) {
    heldnow = 0;
    for (i : 0 .. NP - 1) { heldnow = heldnow || owner[k * NP + i] != 0 };
    for (r : 0 .. NREQ - 1) {
        x = k * NREQ + r;
        heldnow = heldnow || (q[x] != Q_NONE && q[x] != Q_GONE) || in_flight[x] || page[x] != NOPAGE
    };
    for (i : 0 .. L - 1) { heldnow = heldnow || batch[k * L + i] != 0 };
#ifdef P_DRAINED
    assert(!heldnow);
#endif
    heldnow = 0
}
#endif

proctype Rank(byte k) {
    byte mb, hb, addm, abm, r, x, i, j, m, pend, nfree, reserve, nrun, nseen;
    byte rg[NK], rb[NK], tg[NK], tb[NK], bg[NK], bb[NK], ba[NK], vg[NK], vb[NK], xv[6];
    byte sq[L + 1], sqn;
    bool sqneed[L], busy, hneeds, alldone;
    mtype tag;
#ifdef FLIP
    byte ctl;
    bool hbusy, dr, heldnow, nrseen;
#endif
    /* One iteration is one atomic step, interrupted only where a receive blocks: the transfer
       threads (Peer) act between steps. Scratch variables are zeroed at its end. */
    do
    :: atomic {
        /* the node has nothing left: every rank sees the same, so all stop in the same turn */
#ifdef FLIP
        /* (and it is not leaving; after a flip, the new role's request came) */
        alldone = (nseen == NREQ || role[k]) && !leaving[k] && (!role[k] || nrseen);
        for (r : 0 .. NREQ - 1) { alldone = alldone && (q[k * NREQ + r] == Q_GONE || q[k * NREQ + r] == Q_NONE) };
#else
        alldone = (nseen == NREQ);
        for (r : 0 .. NREQ - 1) { alldone = alldone && (q[k * NREQ + r] == Q_GONE) };
#endif
        if :: alldone -> break :: else fi;

        /* ingest + apply meta (SlotLoop.apply_meta, DecodeLoop._on_meta / abort_elsewhere) */
        ingest_meta(k, addm, abm);
#ifdef FLIP
        if :: (ctl & C_ROLE) && (ctl & C_ROLE_FIRST) -> set_role(k) :: else fi;
#endif
        for (r : 0 .. NREQ - 1) {
            if
#ifdef FLIP
            :: (addm & (1 << r)) && (leaving[k] || role[k]) ->     /* refused: role_change */
                decide(k, FWHAT(r, K_ADMIT, 0)); q[k * NREQ + r] = Q_GONE; nseen++; emit_end(k, r)
            :: (addm & (1 << r)) && !leaving[k] && !role[k] ->
#else
            :: addm & (1 << r) ->       /* a receiver per TP rank (OPEN_T) */
#endif
                q[k * NREQ + r] = Q_PREALLOC; EACH_T(OPEN_T); nseen++
            :: else
            fi
        };
#ifdef FLIP
        if :: (ctl & C_ROLE) && !(ctl & C_ROLE_FIRST) -> set_role(k) :: else fi;
        new_role_request(k);
#endif
        for (r : 0 .. NREQ - 1) {
            x = k * NREQ + r;
            if
            :: (abm & (1 << r)) && q[x] == Q_RUNNING ->          /* Scheduler.abort */
                if
                :: in_flight[x] -> to_finish[x] = 1
                :: else -> decide(k, WHAT(r, K_ABORTNOW, 1)); free_page(k, x, r); q[x] = Q_GONE; emit_end(k, r)
                fi
#ifndef M_SKIP_ABORT
            :: (abm & (1 << r)) && (q[x] == Q_PREALLOC || q[x] == Q_TRANSFER) ->
#else
            :: (abm & (1 << r)) && (q[x] == Q_PREALLOC || q[x] == Q_TRANSFER) && k != LAST ->
#endif
                aborted[x] = 1;
                EACH_T(ABORT_T);        /* every TP rank aborts its own receiver */
#ifdef M_FREE_AT_ABORT
                if :: page[x] != NOPAGE -> free_page(k, x, r) :: else fi;   /* mutant: not at the vote */
#endif
                if
                :: q[x] == Q_PREALLOC && page[x] == NOPAGE ->   /* never registered */
                    decide(k, WHAT(r, K_ABORTNOW, 0)); q[x] = Q_GONE; emit_end(k, r)
                :: else
                fi
            :: else
            fi
        };

        /* before_schedule: _preallocate (first come first served, one page of headroom per
           running request), then the three ballots */
        nfree = 0; nrun = 0;
        for (i : 0 .. NP - 1) { if :: owner[k * NP + i] == 0 -> nfree++ :: else fi };
        for (r : 0 .. NREQ - 1) { if :: q[k * NREQ + r] == Q_RUNNING -> nrun++ :: else fi };
        reserve = nrun;
        for (r : 0 .. NREQ - 1) {
            x = k * NREQ + r;
            if
            :: q[x] == Q_PREALLOC && page[x] == NOPAGE && nfree >= 1 + reserve ->
                for (i : 0 .. NP - 1) {
                    if :: page[x] == NOPAGE && owner[k * NP + i] == 0 -> page[x] = i; owner[k * NP + i] = r + 1 :: else fi
                };
                nfree--;
                EACH_T(REGISTER_T)
            :: q[x] == Q_PREALLOC && page[x] == NOPAGE && nfree < 1 + reserve -> break   /* first come first served */
            :: else
            fi
        };
        for (r : 0 .. NREQ - 1) {
            x = k * NREQ + r;
            if
            :: q[x] == Q_PREALLOC && page[x] != NOPAGE ->            /* PREALLOC ballot */
                if :: STAGE_BAD(FINAL_PRE_T) -> bb[0] = bb[0] | (1 << r)
                   :: STAGE_GOOD(GOOD_PRE_T) -> bg[0] = bg[0] | (1 << r)
                   :: else fi;
                if :: aborted[x] -> ba[0] = ba[0] | (1 << r) :: else fi
            :: q[x] == Q_TRANSFER ->                                   /* TRANSFERRED ballot */
                if :: STAGE_BAD(FINAL_TR_T) -> bb[1] = bb[1] | (1 << r)
                   :: STAGE_GOOD(GOOD_TR_T) -> bg[1] = bg[1] | (1 << r)
                   :: else fi;
                if :: aborted[x] -> ba[1] = ba[1] | (1 << r) :: else fi
            :: q[x] == Q_QUAR ->                                       /* RELEASE ballot */
                if :: STAGE_QUIESCED -> bg[2] = bg[2] | (1 << r) :: else fi
            :: else
            fi
        };
        /* pass 1 (PP0 sends at once; the others block on the receive inside) */
        vote_pass1(k, mb);

        /* schedule(mb): the running requests of slot mb decode one token */
        busy = 0;
        for (r : 0 .. NREQ - 1) {
            x = k * NREQ + r;
            if
            :: q[x] == Q_RUNNING && rslot[x] == mb && !in_flight[x] && !to_finish[x] ->
                in_flight[x] = 1; batch[k * L + mb] = batch[k * L + mb] | (1 << r); busy = 1
            :: else
            fi
        };
        bvalid[k * L + mb] = 1;
        sqneed[mb] = busy;          /* every decode entry samples */
        hb = (mb + 1) % L;
        hneeds = bvalid[k * L + hb] && batch[k * L + hb] != 0;
        /* forward: hidden states from k-1 */
        if :: busy && k != 0 -> hidden_in[k] ? m; assert(m == mb) :: else fi;
        /* exchange (sends, ring receive) */
        exchange(k, mb, hb, busy, hneeds);
#if PP == 1
        lone_stage_drop();
#endif

        /* harvest slot hb */
        if
        :: bvalid[k * L + hb] ->
#ifdef FLIP
            hbusy = (batch[k * L + hb] != 0);
#endif
            for (r : 0 .. NREQ - 1) {
                x = k * NREQ + r;
                if
                :: batch[k * L + hb] & (1 << r) ->
                    in_flight[x] = 0;
                    /* its token; max_tokens is reached (finish "length"), or the abort lands */
                    decide(k, WHAT(r, K_FINISH, to_finish[x]));
                    free_page(k, x, r); q[x] = Q_GONE; emit_end(k, r)
                :: else
                fi
            };
            batch[k * L + hb] = 0; bvalid[k * L + hb] = 0
        :: else
        fi;

        /* after_harvest: the three verdicts, applied on every rank in this iteration */
        vote_pass2(k, hb);
#if defined(FLIP) && defined(P_DRAINED)
        /* after a flip the shared vote hands the new role's loop the verdicts still in flight:
           none may name a room of the old role (the new role's rooms are not modelled) */
        heldnow = role[k] && (vg[0] | vb[0] | vg[1] | vb[1] | vg[2] | vb[2]) != 0; assert(!heldnow); heldnow = 0;
#endif
        for (r : 0 .. NREQ - 1) {          /* _apply_prealloc */
            x = k * NREQ + r;
            if
            :: ((vg[0] | vb[0]) & (1 << r)) && q[x] == Q_PREALLOC && page[x] != NOPAGE && ANY_T(FINAL_PRE_T) ->
                decide(k, WHAT(r, K_PREALLOC, (vg[0] >> r) & 1)) SAME_SPLIT(FINAL_PRE_T);
                if
                :: vg[0] & (1 << r) -> q[x] = Q_TRANSFER
                :: else -> q[x] = Q_QUAR; emit_end(k, r) FAIL_ENDS      /* _fail */
                fi
            :: else
            fi
        };
        for (r : 0 .. NREQ - 1) {          /* _apply_transferred */
            x = k * NREQ + r;
            if
            :: ((vg[1] | vb[1]) & (1 << r)) && q[x] == Q_TRANSFER && ANY_T(FINAL_TR_T) ->
                decide(k, WHAT(r, K_TRANSFERRED, (vg[1] >> r) & 1)) SAME_SPLIT(FINAL_TR_T);
                if
                :: vg[1] & (1 << r) -> q[x] = Q_RUNNING; rslot[x] = hb    /* _start_decoding */
                :: else -> q[x] = Q_QUAR; emit_end(k, r) FAIL_ENDS      /* _fail */
                fi
            :: else
            fi
        };
        for (r : 0 .. NREQ - 1) {          /* _release_quarantine */
            x = k * NREQ + r;
            if
            :: (vg[2] & (1 << r)) && q[x] == Q_QUAR ->
                decide(k, WHAT(r, K_QRELEASE, 1));
                free_page(k, x, r); q[x] = Q_GONE
            :: else
            fi
        };
#ifdef FLIP
        /* DecodeLoop.drained: no request in prealloc, transfer, the scheduler or quarantine, no
           batch with entries, and the batch harvested now was empty; then ElasticLoop's count */
        dr = !hbusy;
        for (r : 0 .. NREQ - 1) { dr = dr && (q[k * NREQ + r] == Q_NONE || q[k * NREQ + r] == Q_GONE) };
        for (i : 0 .. L - 1) { dr = dr && batch[k * L + i] == 0 };
        flip_end(k);
#endif
        mb = (mb + 1) % L;
        busy = 0; hneeds = 0; hb = 0;
        scrub()
    }
    od;
#ifdef P_NOLEAK
    for (i : 0 .. NP - 1) { assert(owner[k * NP + i] == 0) }     /* no leak */
#endif
}

/* The environment of one (decode rank, room): the bootstrap route look-up, the prefill rank
   that writes this decode rank's layers (its KVSender: writes, terminal message, on_decode_abort),
   the decode manager's heartbeat thread (peer_dead), the reaper's timeouts and the quarantine
   clock. */
/* The sender's terminal message, sent only once its last write returned (KVSender._drain /
   _notify): KVStatus Success (try_finish) or Failed / KVAbort (note_quiet + _fail). */
inline TERMINAL(x) {
    peer[x] = W_DONE; rcv_quiet[x] = 1;
    if
    :: peer_fail[x] -> rcv_fail(x, 1)           /* quiet: nothing is echoed back */
    :: else -> if :: rcv[x] == WAITING -> rcv[x] = SUCCESS :: else fi
    fi
}

/* A fault may strike this (rank, room): one budget for the run, rooms below NFAULTY only. With TP,
   on a stage's last TP rank only: the model is symmetric in the TP ranks of a stage (its ballots
   are AND / OR over them), so a fault on another is the same run with the ranks renamed. */
#if TP > 1
#define FAULT (faults < MAXF && r < NFAULTY && g % TP == TP - 1)
#define SK (g / TP)                     /* the Peer's stage */
#define PX (SK * NREQ + r)              /* the room's queue and page on that stage */
#else
#define FAULT (faults < MAXF && r < NFAULTY)
#define SK g
#define PX x
#endif

/* g = stage * TP + t: the Peer of room r on TP rank t of stage g / TP (with TP 1, PP rank g) */
proctype Peer(byte g; byte r) {
    byte x = g * NREQ + r;              /* its receiver, RX(g / TP, g % TP, r) */
#ifdef FLIP
    if
    :: rcv[x] != NONE
    :: rcv[x] == NONE && (q[PX] == Q_GONE || role[SK]) -> goto gone   /* refused, or never comes */
    fi;
#else
    rcv[x] != NONE;
#endif
    do
    :: atomic { rcv[x] == BOOTSTRAPPING && FAULT -> /* bootstrap timeout (route look-up) */
        faults++; rcv_fail(x, NOTIFY_OWN) }
#ifdef ROUTE
    /* KVReceiver.on_route, late: the registration goes out if the pages are registered already
       (_maybe_send_registration, either order) */
    :: atomic { rcv[x] == BOOTSTRAPPING && !rcv_route[x] ->
        rcv_route[x] = 1;
        if :: rcv_regd[x] -> rcv_sent[x] = 1; rcv[x] = WAITING :: else fi }
#endif
    :: atomic { rcv[x] == WAITING && FAULT -> faults++; rcv_fail(x, NOTIFY_OWN) }   /* waiting timeout */
    :: atomic { peer[x] == W_IDLE && rcv_sent[x] && !peer_fail[x] -> peer[x] = W_WRITING }  /* a chunk */
    :: atomic { peer[x] == W_IDLE && rcv_sent[x] && !peer_fail[x] && FAULT ->      /* its own failure */
        faults++; peer_fail[x] = 1; TERMINAL(x) }
    :: atomic { rcv_abort_sent[x] && !abort_done[x] && peer[x] != W_STALLED && peer[x] != W_DEAD ->
        abort_done[x] = 1;                  /* KVSender.on_decode_abort: _fail, no new write */
        if
        :: peer[x] == W_IDLE -> peer_fail[x] = 1; TERMINAL(x)
        :: peer[x] == W_WRITING -> peer_fail[x] = 1      /* notice deferred until the write returns */
        :: else                                          /* already final: Failed status again */
        fi }
    :: atomic { peer[x] == W_WRITING ->       /* the write lands, then the terminal message */
#ifdef P_SAFETY
        assert(page[PX] != NOPAGE && owner[SK * NP + page[PX]] == r + 1);
#endif
        TERMINAL(x) }
    :: atomic { peer[x] == W_WRITING && FAULT -> faults++; peer[x] = W_STALLED }
    :: atomic { peer[x] == W_STALLED -> peer[x] = W_WRITING }                        /* resumes */
    :: atomic { (peer[x] == W_STALLED || peer[x] == W_IDLE && rcv_sent[x]) && FAULT ->
        faults++; peer[x] = W_DEAD }
    :: atomic { (peer[x] == W_STALLED || peer[x] == W_DEAD) && rcv[x] != FAILED && rcv[x] != SUCCESS ->
        rcv_peer_dead[x] = 1; rcv_fail(x, NOTIFY_OWN) }                             /* heartbeat */
#ifndef M_NO_GRACE
    /* quarantine_s after finished_at. Assumed to outlast any write in flight or stall and the
       delivery of a KVAbort sent; not the time a prefill rank that was never told may still take. */
    :: atomic { rcv[x] == FAILED && rcv_sent[x] && !grace[x] && (peer[x] == W_DEAD || peer[x] != W_WRITING && peer[x] != W_STALLED && !(rcv_abort_sent[x] && !abort_done[x])) ->
        grace[x] = 1 }
#endif
    :: (peer[x] == W_DONE || peer[x] == W_DEAD || !rcv_sent[x] && rcv[x] == FAILED) && q[PX] == Q_GONE -> break
    od
#ifdef FLIP
    ; gone: skip
#endif
}

#define RUN_PEERS_T(t) for (r : 0 .. NREQ - 1) { run Peer(k * TP + t, r) }
init {
    byte k, r;
    atomic {
        for (k : 0 .. NRX - 1) { page[k % (PP * NREQ)] = NOPAGE; rcv[k] = NONE };
        for (k : 0 .. PP - 1) {
            run Rank(k);
            EACH_T(RUN_PEERS_T)
        }
    }
}

#ifdef P_LIVENESS
ltl live { [] ((pending > 0) -> <> (pending == 0)) }
#endif
