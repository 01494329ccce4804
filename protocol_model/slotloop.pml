/* The engine's slot loop and the consensus ring, shared by the prefill and decode node models.
 *
 * engine/pp_loop.py SlotLoop.iteration, consensus/vote.py RingVote, consensus/leader_sync.py.
 * One process per PP rank runs the same code; everything a rank decides on lives in arrays
 * indexed [rank * NREQ + room] so the properties can compare ranks.
 */
#ifndef PP
#define PP 2            /* LoopConfig.pp_size */
#endif
#ifndef NREQ
#define NREQ 2          /* requests (rooms) in one run */
#endif
#ifndef ASYNC
#define ASYNC 0         /* LoopConfig.async_depth */
#endif
#ifndef MAXAB
#define MAXAB 1         /* client aborts PP0 may inject in one run */
#endif
#ifndef NABORTABLE
#define NABORTABLE NREQ /* rooms PP0 may abort (the first ones) */
#endif
#ifndef MAXF
#define MAXF 1          /* transfer faults (timeouts, errors, stalls, deaths) in one run */
#endif
#define L (PP + ASYNC)  /* LoopConfig.num_slots */
#define LAST (PP - 1)
#define NK 3            /* vote kinds on the wire (the prefill node uses kind 0 only) */
#define NOPAGE 255
#ifdef FLIP
#define NLOG (NREQ * 4 + 3)   /* + SetRole, the flip, the new role's request */
#elif defined(GUIDE)
#define NLOG (NREQ * 5)       /* + each request's guide hold ending (K_GUIDE) */
#else
#define NLOG (NREQ * 4)
#endif

/* KVPoll (consensus/kvpoll.py); NONE = no sender/receiver yet */
#define FAILED 0
#define BOOTSTRAPPING 1
#define WAITING 2
#define TRANSFERRING 3
#define SUCCESS 4
#define NONE 5

mtype = { V1, V2, LEAD };

/* PPComm links (engine/pp_comm.py), indexed by the receiving rank. isend does not block until
   `commit_after` turns later: a buffered channel of about that capacity; recv blocks. */
#ifdef FLIP
chan meta_in[PP] = [1] of { byte, byte, byte };  /* Msg.META from k-1: add mask, abort mask, ctl */
#else
chan meta_in[PP] = [1] of { byte, byte };        /* Msg.META from k-1: add mask, abort mask */
#endif
chan hidden_in[PP] = [1] of { byte };            /* Msg.HIDDEN from k-1: the slot */
#ifdef GUIDE
/* Msg.OUTPUT with the last rank's report of compiled guides (messages.py ring_to_wire): the slot
   and a mask of rooms. The model's Rank declares hrep (received), sqrep (the send queue's) and
   grep (this turn's report). */
chan output_in[PP] = [PP] of { byte, byte };
#define RING_RECV(c) c ? m, hrep
#define RING_SEND(c, s, rep) c ! s, rep
/* each expands to nothing without GUIDE, so the other checks' models are the code they were */
#define SQ_PUSH(n) ; sqrep[n] = grep
#define SQ_SHIFT(i) ; sqrep[i - 1] = sqrep[i]
#define SQ_DROP(n) ; sqrep[n] = 0
#else
chan output_in[PP] = [PP] of { byte };           /* Msg.OUTPUT: into 0 from LAST, into k from k-1 */
#define RING_RECV(c) c ? m
#define RING_SEND(c, s, rep) c ! s
#define SQ_PUSH(n)
#define SQ_SHIFT(i)
#define SQ_DROP(n)
#endif
chan ring_in[PP] = [2 * L + 2] of { mtype, byte, byte, byte, byte, byte, byte, byte };  /* Msg.VOTE */

/* RingVote state */
bool voted[PP * L];                 /* RingVote._voted, per rank */
byte kept_g[NK * L];                /* RingVote._kept on the last rank: verdict (good, bad) per slot */
byte kept_b[NK * L];
bool kept_ok[L];
#ifdef M_NO_PASS2
byte p1_g[PP * NK * L];             /* mutant: each rank's own pass-1 tally per slot */
byte p1_b[PP * NK * L];
#endif

/* Agreement log: the first rank to take its n-th decision writes it and the slot it was taken
   in; every other rank's n-th decision must be the same, in the same slot. */
byte log_what[NLOG];
byte log_slot[NLOG];
byte nlogged;
byte ndec[PP];

/* What the client sees (PP0's events) */
bool added[NREQ];
bool ended[NREQ];                   /* a terminal event (done, finish, error) left PP0 */
byte pending;                       /* added and not ended: the liveness proposition */
byte nadd;                          /* PP0: requests the front delivered so far */
byte nab;                           /* PP0: aborts the front delivered so far */
bool abort_sent[NREQ];
byte faults;                        /* transfer faults used (bounded by MAXF) */

#ifdef FLIP
/* The role flip of an elastic node (elastic_node/loop.py ElasticLoop; pd_common/loop_base.py
   PDLoop._set_role, the refusal in apply_message, drained). Role 0 is the node's role at start
   (the model's prefill or decode loop), role 1 the other one, modelled abstractly: after the flip
   PP0 may deliver one request of the new role, which every rank must admit. */
#define C_ROLE 1            /* meta ctl: SetRole(the other role) is in the list */
#define C_ROLE_FIRST 2      /*   ... before the list's new request (which is then refused) */
#define C_NEWREQ 4          /* meta ctl: a request of the new role */
#define C_ROLE0 8           /* property only: PP0's role in this iteration, carried with the meta */
#define K_ADMIT 6           /* WHAT(r, K_ADMIT, 0): old-role request r refused (role_change);
                               WHAT(NREQ, K_ADMIT, v): the new role's request admitted (v 1) or not */
#define K_ROLE 7            /* WHAT(0, K_ROLE, 0): SetRole applied (pd_set_role); v 1: the flip (pd_role_flip) */
#define FWHAT(r, kind, v) (((r) << 4) | ((kind) << 1) | (v))
bool role[PP];              /* the rank's role: loop.role (0: the start role, 1: the other) */
bool leaving[PP];           /* loop.leaving_for is not None */
byte quiet[PP];             /* ElasticLoop.quiet: iterations in a row drained while leaving */
bool role_sent;             /* PP0: the front delivered SetRole (at most once a run) */
bool nr_sent;               /* PP0: the front delivered the new role's request */
/* ElasticLoop.iteration: the flip once quiet >= num_slots. The mutant M_FLIP_EARLY flips the
   last rank one iteration early. */
#ifdef M_FLIP_EARLY
#define FLIP_AFTER(k) ((k) == LAST -> L - 1 : L)
#else
#define FLIP_AFTER(k) L
#endif
#endif

/* Zeroes a rank's scratch variables at the end of an atomic phase, so they do not split states. */
inline scrub() {
    i = 0; j = 0; m = 0; pend = 0; r = 0; x = 0; addm = 0; abm = 0; tag = 0;
    for (i : 0 .. NK - 1) { rg[i] = 0; rb[i] = 0; tg[i] = 0; tb[i] = 0; bg[i] = 0; bb[i] = 0; ba[i] = 0; vg[i] = 0; vb[i] = 0 };
    for (i : 0 .. 5) { xv[i] = 0 };
#ifdef FLIP
    ctl = 0; hbusy = 0; dr = 0; heldnow = 0;
#endif
    i = 0
}

/* Rank k takes decision `what` (room, kind, verdict) in the iteration of slot mb. */
inline decide(k, what) {
    d_step {
        if
        :: ndec[k] == nlogged ->
            log_what[nlogged] = what; log_slot[nlogged] = mb; nlogged++
        :: else ->
#ifdef P_AGREEMENT
            assert(log_what[ndec[k]] == what && log_slot[ndec[k]] == mb)
#else
            skip
#endif
        fi;
        ndec[k]++
    }
}

/* PP0 tells the front that request r ended (only PP0's events leave the node). */
inline emit_end(k, r) {
    if
    :: k == 0 -> d_step { assert(!ended[r]); ended[r] = 1; pending-- }
    :: else -> skip
    fi
}

/* SlotLoop.ingest_meta: PP0 polls the front (a new request, an abort), the others receive PP0's
   list; forwarded unchanged down the chain, even when empty. With FLIP the list also carries the
   ROLE item and the new role's request (`ctl`, declared by the model's Rank under FLIP). */
inline ingest_meta(k, addm, abm) {
    addm = 0; abm = 0;
    if
    :: k == 0 ->
        if
#ifdef FLIP
        :: nadd < NREQ && !role[0] -> d_step { addm = 1 << nadd; added[nadd] = 1; pending++; nadd++ }
        :: role[0] && !nr_sent -> d_step { ctl = C_NEWREQ; nr_sent = 1; pending++ }
#else
        :: nadd < NREQ -> d_step { addm = 1 << nadd; added[nadd] = 1; pending++; nadd++ }
#endif
        :: true
        fi;
        if
        :: nab < MAXAB ->
            select(r : 0 .. NABORTABLE - 1);
            if
            :: added[r] && !ended[r] && !abort_sent[r] -> abm = 1 << r; abort_sent[r] = 1; nab++
            :: else
            fi
        :: true
        fi
#ifdef FLIP
        ;
        if      /* SetRole, at most once; after the list's new request or before it */
        :: !role[0] && !role_sent -> role_sent = 1; ctl = ctl | C_ROLE;
            if :: addm != 0 -> ctl = ctl | C_ROLE_FIRST :: true fi
        :: true
        fi;
        if :: role[0] -> ctl = ctl | C_ROLE0 :: else fi
    :: else -> meta_in[k] ? addm, abm, ctl
#else
    :: else -> meta_in[k] ? addm, abm
#endif
    fi;
#if defined(FLIP) && defined(P_ROLE)
    /* every rank has PP0's role in every iteration (at its start: a flip ends an iteration) */
    assert(((ctl & C_ROLE0) != 0) == role[k]);
#endif
    if
#ifdef FLIP
    :: k != LAST -> meta_in[k + 1] ! addm, abm, ctl
#else
    :: k != LAST -> meta_in[k + 1] ! addm, abm
#endif
    :: else
    fi
}

#ifdef FLIP
/* ElasticLoop._flip: the role becomes the other one; the vote (its messages in flight, voted[],
   the last rank's _kept) is the same object, so nothing of it changes. `nothing_held(k)` is the
   model's: the drained-at-flip property. */
inline do_flip(k) {
    nothing_held(k);
    decide(k, FWHAT(0, K_ROLE, 1));
    role[k] = 1; leaving[k] = 0; quiet[k] = 0
}

/* PDLoop._set_role: from here this rank refuses new requests of its role */
inline set_role(k) {
    decide(k, FWHAT(0, K_ROLE, 0));
    leaving[k] = 1
#ifdef M_FLIP_UNDRAINED
    ; if :: k == LAST -> do_flip(k) :: else fi      /* mutant: the last rank flips at once */
#endif
}

/* ElasticLoop.iteration, after the loop's iteration: `dr` is the model's drained() */
inline flip_end(k) {
    if
    :: leaving[k] ->
        if :: dr -> quiet[k]++ :: else -> quiet[k] = 0 fi;
        if :: quiet[k] >= FLIP_AFTER(k) -> do_flip(k) :: else fi
    :: else
    fi
}

/* The new role's request (abstract): admitted by a rank that serves the new role, refused
   (role_change) otherwise; answered by PP0 at once. */
inline new_role_request(k) {
    if
    :: ctl & C_NEWREQ ->
        nrseen = 1;
        decide(k, FWHAT(NREQ, K_ADMIT, role[k] && !leaving[k]));
        if :: k == 0 -> pending-- :: else fi
    :: else
    fi
}
#endif

/* RingVote.pass1 (with Ballot.resolved and merge): ballots in bg/bb/ba, per kind. */
inline vote_pass1(k, mb) {
    for (i : 0 .. NK - 1) {
        rg[i] = bg[i] & ~(bb[i] | ba[i]) & 255;
        rb[i] = bb[i] | (bg[i] & ba[i])
    }
    if
    :: k == 0 ->
        for (i : 0 .. NK - 1) { tg[i] = rg[i]; tb[i] = rb[i] }
    :: else ->
        ring_in[k] ? tag, m, xv[0], xv[1], xv[2], xv[3], xv[4], xv[5];
        assert(tag == V1 && m == mb);       /* RingVote._recv: ranks out of step otherwise */
        for (i : 0 .. NK - 1) {
            tb[i] = (xv[2 * i + 1] & (rg[i] | rb[i])) | (xv[2 * i] & rb[i]);
            tg[i] = xv[2 * i] & rg[i]
        }
    fi;
#ifdef M_NO_PASS2
    for (i : 0 .. NK - 1) { p1_g[(k * NK + i) * L + mb] = tg[i]; p1_b[(k * NK + i) * L + mb] = tb[i] }
#endif
    voted[k * L + mb] = 1;
    if
    :: k == LAST ->
        for (i : 0 .. NK - 1) {         /* _without_pending */
            pend = 0;
            for (j : 0 .. L - 1) {
                if
                :: kept_ok[j] && j != mb -> pend = pend | kept_g[i * L + j] | kept_b[i * L + j]
                :: else
                fi
            }
            kept_g[i * L + mb] = tg[i] & ~pend & 255;
            kept_b[i * L + mb] = tb[i] & ~pend & 255
        }
        kept_ok[mb] = 1;
        ring_in[0] ! V2, mb, kept_g[mb], kept_b[mb], kept_g[L + mb], kept_b[L + mb],
                     kept_g[2 * L + mb], kept_b[2 * L + mb]
    :: else ->
        ring_in[k + 1] ! V1, mb, tg[0], tb[0], tg[1], tb[1], tg[2], tb[2]
    fi
}

/* RingVote.pass2: the verdict of slot hb's latest pass 1 into vg/vb, the same on every rank. */
inline vote_pass2(k, hb) {
    if
    :: !voted[k * L + hb] ->
        for (i : 0 .. NK - 1) { vg[i] = 0; vb[i] = 0 }
    :: else ->
        if
        :: k == LAST ->
            for (i : 0 .. NK - 1) {
                vg[i] = kept_g[i * L + hb]; vb[i] = kept_b[i * L + hb];
                kept_g[i * L + hb] = 0; kept_b[i * L + hb] = 0
            };
            kept_ok[hb] = 0
        :: else ->
            ring_in[k] ? tag, m, xv[0], xv[1], xv[2], xv[3], xv[4], xv[5];
            assert(tag == V2 && m == hb);
            for (i : 0 .. NK - 1) { vg[i] = xv[2 * i]; vb[i] = xv[2 * i + 1] };
            if
            :: k + 1 < LAST -> ring_in[k + 1] ! V2, hb, xv[0], xv[1], xv[2], xv[3], xv[4], xv[5]
            :: else
            fi
#ifdef M_NO_PASS2
            /* mutant: a rank applies the tally it saw in pass 1, not the ring's final verdict */
            ; for (i : 0 .. NK - 1) { vg[i] = p1_g[(k * NK + i) * L + hb]; vb[i] = p1_b[(k * NK + i) * L + hb] }
#endif
        fi;
        voted[k * L + hb] = 0
    fi
}

/* SlotLoop.exchange_and_harvest, the message part: hidden states of this slot go on, the sampled
   outputs of slot hb come round the ring (last -> PP0 -> PP1 ...), async_depth turns late. */
inline exchange(k, mb, hb, busy, hneeds) {
    /* even ranks send-then-receive, odd ranks receive-then-send */
    if
    :: k % 2 == 0 ->
        if :: k != LAST && busy -> hidden_in[k + 1] ! mb :: else fi;
        if :: k != LAST && hneeds -> RING_RECV(output_in[k]); assert(m == hb) :: else fi
    :: else ->
        if :: k != LAST && hneeds -> RING_RECV(output_in[k]); assert(m == hb) :: else fi;
        if :: k != LAST && busy -> hidden_in[k + 1] ! mb :: else fi
    fi;
    if
    :: k == LAST ->
        /* send_queue: the outputs of the slot scheduled ASYNC turns ago leave now */
        sq[sqn] = mb SQ_PUSH(sqn); sqn++;
        if
        :: sqn > ASYNC ->
            if :: sqneed[sq[0]] -> RING_SEND(output_in[0], sq[0], sqrep[0]) :: else fi;
            for (i : 1 .. sqn - 1) { sq[i - 1] = sq[i] SQ_SHIFT(i) };
            sqn-- SQ_DROP(sqn)
        :: else
        fi
    :: else
    fi;
    if :: k != LAST && hneeds && k + 1 < LAST -> RING_SEND(output_in[k + 1], hb, hrep) :: else fi
}
