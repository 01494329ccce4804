/* The prefill node: bootstrap -> waiting -> running (chunked prefill) -> inflight -> released.
 *
 * prefill_node/loop.py PrefillLoop on PP ranks, the PPConsensusStore + leader sync for bootstrap,
 * the release vote; kv_transfer/sender.py KVSender (one per room and rank) with its transfer
 * thread, the decode side's registrations and the faults are the environment process Sender.
 * One page per request and rank; a prompt of CH chunks, the first token sampled with the last.
 */
#include "slotloop.pml"

#ifndef NFAULTY
#define NFAULTY 1
#endif
#ifndef NP
#define NP 1
#endif
#define CH 2            /* prefill chunks of a prompt */

/* PrefillLoop queues of a request on one rank */
#define Q_NONE 0
#define Q_BOOT 1        /* self.bootstrap */
#define Q_WAITING 2     /* scheduler waiting queue */
#define Q_RUNNING 3     /* scheduler slots (chunks) */
#define Q_INFLIGHT 4    /* self.inflight: KV on the wire, pages held */
#define Q_GONE 5

#define K_BOOT 1
#define K_RELEASE 2
#define K_FINISH 3
#define K_ABORTNOW 4
#define K_GUIDE 5       /* WHAT(r, K_GUIDE, 1): room r's guide hold ends (guides_compiled) */
#define WHAT(r, kind, v) (((r) << 4) | ((kind) << 1) | (v))

byte q[PP * NREQ];
byte page[PP * NREQ];           /* req.pages */
byte owner[PP * NP];            /* allocator: room + 1, 0 = free */
bool held[PP * NREQ];           /* scheduler.held (finished, pages kept until release) */
bool aborted[PP * NREQ];        /* pd.aborted */
byte nch[PP * NREQ];            /* chunks scheduled */
byte sent_upto[PP * NREQ];      /* pd.sent_upto, in chunks */
byte rslot[PP * NREQ];
bool in_flight[PP * NREQ];
bool to_finish[PP * NREQ];
bool fin[PP * NREQ];            /* scheduler.just_finished: reported at the end of the iteration */
bool fin_abort[PP * NREQ];
byte batch[PP * L];
bool bvalid[PP * L];
byte store_rep[PP * NREQ];      /* PPConsensusStore: rank k's entry for the room as PP0 holds it */
#ifdef GUIDE
/* Structured output's compile hold (engine/guide_hold.py): every request is guided. */
bool gp[PP * NREQ];             /* req.guide_pending */
bool compiled[NREQ];            /* the last rank's compile thread finished the room's guide */
/* in the scheduler's reqs: waiting or running, not finished */
#define LIVE(x) ((q[x] == Q_WAITING || q[x] == Q_RUNNING) && !fin[x])
/* not guide_hold.held: not held at its last chunk, which samples (nothing without GUIDE, so the
   other checks' model is the code it was) */
#define AND_NOT_HELD(x) && !(gp[x] && nch[x] == CH - 1)
#else
#define AND_NOT_HELD(x)
#endif

byte snd[PP * NREQ];            /* KVSender._status */
byte snd_q[PP * NREQ];          /* _chunks queued */
bool snd_last[PP * NREQ];       /* _last_queued */
bool reading[PP * NREQ];        /* a transfer thread's write reads the pages (_busy, in _send) */
bool dirty[PP * NREQ];          /* the pages were freed while a write read them */

/* kvpoll.update_status */
#define UPDATED(old, new) ((old == FAILED || new == FAILED) -> FAILED : ((old == NONE || new > old) -> new : old))

inline snd_fail(x) {
    if :: snd[x] != FAILED && snd[x] != SUCCESS -> snd[x] = FAILED; snd_q[x] = 0 :: else fi
}

inline free_page(k, x, r) {
    d_step {
#ifdef P_NOLEAK
        assert(page[x] < NOPAGE && owner[k * NP + page[x]] == r + 1);     /* no double free */
#endif
#ifdef P_STRICT_READ
        assert(!reading[x]);    /* stronger than Safety: no write reads the pages when they are freed */
#endif
        if :: reading[x] -> dirty[x] = 1 :: else fi;
        owner[k * NP + page[x]] = 0; page[x] = NOPAGE; held[x] = 0
    }
}

#ifdef FLIP
/* At the flip of rank k: it holds no page, no request is in any of its queues, in a batch or
   finished and unreported (the drained-at-flip property). */
inline nothing_held(k) {
    heldnow = 0;
    for (i : 0 .. NP - 1) { heldnow = heldnow || owner[k * NP + i] != 0 };
    for (r : 0 .. NREQ - 1) {
        x = k * NREQ + r;
        heldnow = heldnow || (q[x] != Q_NONE && q[x] != Q_GONE) || in_flight[x] || held[x] || fin[x] || page[x] != NOPAGE
    };
    for (i : 0 .. L - 1) { heldnow = heldnow || batch[k * L + i] != 0 };
#ifdef P_DRAINED
    assert(!heldnow);
#endif
    heldnow = 0
}
#endif

proctype Rank(byte k) {
    byte mb, hb, addm, abm, r, x, i, j, m, pend, nseen, fm, rm;
    byte rg[NK], rb[NK], tg[NK], tb[NK], bg[NK], bb[NK], ba[NK], vg[NK], vb[NK], xv[6];
    byte sq[L + 1], sqn;
    bool sqneed[L], busy, hneeds, alldone, sampling;
    mtype tag;
#ifdef GUIDE
    byte grep, hrep, lrep[L], sqrep[L + 1];     /* reports: this turn's, received, kept, queued */
    bool awaits;                                /* ScheduledBatch.awaits_guides */
#endif
#ifdef FLIP
    byte ctl;
    bool hbusy, dr, heldnow, nrseen;
#endif
    /* One iteration is one atomic step, interrupted only where a receive blocks. */
    do
    :: atomic {
#ifdef FLIP
        /* every request of the start role came (or none comes any more: flipped), none left,
           not leaving, and after a flip the new role's request came */
        alldone = (nseen == NREQ || role[k]) && !leaving[k] && (!role[k] || nrseen);
        for (r : 0 .. NREQ - 1) { alldone = alldone && (q[k * NREQ + r] == Q_GONE || q[k * NREQ + r] == Q_NONE) };
#else
        alldone = (nseen == NREQ);
        for (r : 0 .. NREQ - 1) { alldone = alldone && (q[k * NREQ + r] == Q_GONE) };
#endif
        if :: alldone -> break :: else fi;

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
                q[k * NREQ + r] = Q_BOOT; snd[k * NREQ + r] = BOOTSTRAPPING; nseen++
#else
            :: addm & (1 << r) -> q[k * NREQ + r] = Q_BOOT; snd[k * NREQ + r] = BOOTSTRAPPING; nseen++
#ifdef GUIDE
                ; gp[k * NREQ + r] = 1      /* hold_for_guide */
#endif
#endif
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
#ifdef M_SKIP_ABORT
            :: (abm & (1 << r)) && k == LAST -> skip                 /* mutant: this rank skips it */
#endif
            :: (abm & (1 << r)) && q[x] == Q_WAITING && !fin[x] ->     /* Scheduler.abort, waiting */
                fin[x] = 1; fin_abort[x] = 1
            :: (abm & (1 << r)) && q[x] == Q_RUNNING && !fin[x] ->
                if
                :: in_flight[x] -> to_finish[x] = 1
                :: else -> fin[x] = 1; fin_abort[x] = 1; held[x] = 1
                fi
            :: (abm & (1 << r)) && (q[x] == Q_BOOT || q[x] == Q_INFLIGHT) ->   /* abort_elsewhere */
                aborted[x] = 1; snd_fail(x)
            :: else
            fi
        };

        /* before_schedule: the bootstrap step (store + leader sync), then the release ballot */
        fm = 0; rm = 0; busy = 0;
        for (r : 0 .. NREQ - 1) { if :: q[k * NREQ + r] == Q_BOOT -> busy = 1 :: else fi };
        if
        :: busy ->
            for (r : 0 .. NREQ - 1) {
                x = k * NREQ + r;
                if :: q[x] == Q_BOOT -> store_rep[x] = UPDATED(store_rep[x], snd[x]) :: else fi
            };
            if
            :: k == 0 ->                        /* PPConsensusStore.statuses: min over ranks */
                for (r : 0 .. NREQ - 1) {
                    if
                    :: q[r] == Q_BOOT ->
                        m = SUCCESS;
                        for (i : 0 .. PP - 1) {
                            if
                            :: store_rep[i * NREQ + r] == NONE -> m = BOOTSTRAPPING; break   /* no entry yet */
                            :: store_rep[i * NREQ + r] != NONE && store_rep[i * NREQ + r] < m -> m = store_rep[i * NREQ + r]
                            :: else
                            fi
                        };
                        if :: m == FAILED -> fm = fm | (1 << r) :: m >= WAITING -> rm = rm | (1 << r) :: else fi
                    :: else
                    fi
                }
            :: else -> ring_in[k] ? tag, m, fm, rm, xv[2], xv[3], xv[4], xv[5]; assert(tag == LEAD)
            fi;
            if :: k != LAST -> ring_in[k + 1] ! LEAD, 0, fm, rm, 0, 0, 0, 0 :: else fi;
            for (r : 0 .. NREQ - 1) {         /* _apply_bootstrap */
                x = k * NREQ + r;
                if
                :: q[x] == Q_BOOT && (fm & (1 << r)) ->
                    decide(k, WHAT(r, K_BOOT, 0)); q[x] = Q_GONE; emit_end(k, r)
                :: q[x] == Q_BOOT && (rm & (1 << r)) ->
                    decide(k, WHAT(r, K_BOOT, 1)); q[x] = Q_WAITING
                :: else
                fi
            }
        :: else
        fi;
        for (r : 0 .. NREQ - 1) {
            x = k * NREQ + r;
            if
            :: q[x] == Q_INFLIGHT ->
                if :: snd[x] == FAILED -> bb[0] = bb[0] | (1 << r)
#ifdef M_RELEASE_EARLY
                   :: snd[x] >= WAITING && snd[x] != NONE -> bg[0] = bg[0] | (1 << r)   /* mutant */
#else
                   :: snd[x] == SUCCESS -> bg[0] = bg[0] | (1 << r)
#endif
                   :: else fi;
                if :: aborted[x] -> ba[0] = ba[0] | (1 << r) :: else fi
            :: else
            fi
        };
        vote_pass1(k, mb);

        /* schedule(mb): waiting requests get their page (first come first served) and join slot
           mb; every request of slot mb not in flight gets its next chunk */
        busy = 0; sampling = 0;
#ifdef GUIDE
#ifdef M_GUIDE_LOCAL
        /* mutant: each rank ends the hold on its own view of the compile, not the ring's report */
        for (r : 0 .. NREQ - 1) {
            x = k * NREQ + r;
            if :: gp[x] && LIVE(x) && compiled[r] -> gp[x] = 0; decide(k, WHAT(r, K_GUIDE, 1)) :: else fi
        };
#endif
        awaits = 0;
        for (r : 0 .. NREQ - 1) { if :: gp[k * NREQ + r] && LIVE(k * NREQ + r) -> awaits = 1 :: else fi };
#endif
        for (r : 0 .. NREQ - 1) {
            x = k * NREQ + r;
            if
            :: q[x] == Q_WAITING && !fin[x] ->
                for (i : 0 .. NP - 1) {
                    if :: page[x] == NOPAGE && owner[k * NP + i] == 0 -> page[x] = i; owner[k * NP + i] = r + 1 :: else fi
                };
                if :: page[x] != NOPAGE -> q[x] = Q_RUNNING; rslot[x] = mb :: else -> break fi
            :: else
            fi
        };
        for (r : 0 .. NREQ - 1) {
            x = k * NREQ + r;
            if
            :: q[x] == Q_RUNNING && !fin[x] && rslot[x] == mb && !in_flight[x] && !to_finish[x] && nch[x] < CH AND_NOT_HELD(x) ->
                nch[x]++; in_flight[x] = 1; batch[k * L + mb] = batch[k * L + mb] | (1 << r); busy = 1;
                if :: nch[x] == CH -> sampling = 1 :: else fi
            :: else
            fi
        };
        bvalid[k * L + mb] = 1;
        sqneed[mb] = sampling;      /* skip_pure_chunk_comm: a pure chunk batch has no ring message */
        hb = (mb + 1) % L;
#if defined(GUIDE) && !defined(M_GUIDE_NO_RING)
        /* _needs_ring: while a request is held, every batch's message goes round, empty or not */
        sqneed[mb] = sampling || awaits;
        hneeds = bvalid[k * L + hb] && sqneed[hb];
#else
        hneeds = bvalid[k * L + hb] && batch[k * L + hb] != 0 && sqneed[hb];
#endif
        /* forward; after_forward hands each chunk's pages to the sender */
        if :: busy && k != 0 -> hidden_in[k] ? m; assert(m == mb) :: else fi;
        for (r : 0 .. NREQ - 1) {
            x = k * NREQ + r;
            if
            :: (batch[k * L + mb] & (1 << r)) && !aborted[x] ->
                if :: snd[x] != FAILED -> snd_q[x]++ :: else fi;
                sent_upto[x]++
            :: else
            fi
        };
#ifdef GUIDE
        /* the last rank's forward: its report of the held requests whose compile ended */
        if
        :: k == LAST && awaits ->
            for (r : 0 .. NREQ - 1) {
                x = k * NREQ + r;
                if :: gp[x] && LIVE(x) && compiled[r] -> grep = grep | (1 << r) :: else fi
            };
            lrep[mb] = grep
        :: else
        fi;
#endif
        exchange(k, mb, hb, busy, hneeds);

        /* harvest slot hb: the last chunk's first token finishes the request (max_tokens 1) */
        if
        :: bvalid[k * L + hb] ->
#ifdef FLIP
            hbusy = (batch[k * L + hb] != 0);
#endif
#ifdef GUIDE
            /* Scheduler.guides_compiled: the report that came with this slot's outputs */
            if :: k == LAST -> hrep = lrep[hb]; lrep[hb] = 0 :: else fi;
            for (r : 0 .. NREQ - 1) {
                x = k * NREQ + r;
                if :: (hrep & (1 << r)) && gp[x] && LIVE(x) -> gp[x] = 0; decide(k, WHAT(r, K_GUIDE, 1)) :: else fi
            };
#endif
            for (r : 0 .. NREQ - 1) {
                x = k * NREQ + r;
                if
                :: batch[k * L + hb] & (1 << r) ->
                    in_flight[x] = 0;
                    if
                    :: to_finish[x] -> fin[x] = 1; fin_abort[x] = 1; held[x] = 1
                    :: !to_finish[x] && nch[x] == CH -> fin[x] = 1; held[x] = 1
                    :: else
                    fi
                :: else
                fi
            };
            batch[k * L + hb] = 0; bvalid[k * L + hb] = 0
        :: else
        fi;

        /* after_harvest: the release verdict frees the pages on every rank in this iteration */
        vote_pass2(k, hb);
#if defined(FLIP) && defined(P_DRAINED)
        /* after a flip the shared vote hands the new role's loop the verdicts still in flight:
           none may name a room of the old role (the new role's rooms are not modelled) */
        heldnow = role[k] && (vg[0] | vb[0]) != 0; assert(!heldnow); heldnow = 0;
#endif
        for (r : 0 .. NREQ - 1) {
            x = k * NREQ + r;
            if
#ifdef M_RELEASE_EARLY
            :: ((vg[0] | vb[0]) & (1 << r)) && q[x] == Q_INFLIGHT && snd[x] != NONE && (snd[x] == FAILED || snd[x] >= WAITING) ->
#else
            :: ((vg[0] | vb[0]) & (1 << r)) && q[x] == Q_INFLIGHT && (snd[x] == FAILED || snd[x] == SUCCESS) ->
#endif
                decide(k, WHAT(r, K_RELEASE, ((vg[0] >> r) & 1) && !aborted[x]));
                if :: held[x] -> free_page(k, x, r) :: else fi;
                q[x] = Q_GONE; emit_end(k, r)
            :: else
            fi
        };

        /* report -> on_finished */
        for (r : 0 .. NREQ - 1) {
            x = k * NREQ + r;
            if
            :: fin[x] && fin_abort[x] ->
                decide(k, WHAT(r, K_FINISH, 0));
                fin[x] = 0; aborted[x] = 1; snd_fail(x);
#ifdef M_FREE_AT_ABORT
                if :: held[x] -> free_page(k, x, r); held[x] = 1 :: else fi;     /* mutant: at the abort */
#else
                if :: sent_upto[x] == 0 && held[x] -> free_page(k, x, r) :: else fi;
#endif
                if :: held[x] -> q[x] = Q_INFLIGHT :: else -> q[x] = Q_GONE; emit_end(k, r) fi
            :: fin[x] && !fin_abort[x] ->
                decide(k, WHAT(r, K_FINISH, 1));
                fin[x] = 0;
                if :: snd[x] != FAILED -> snd_q[x]++; snd_last[x] = 1 :: else fi;   /* last chunk + aux */
                q[x] = Q_INFLIGHT
            :: else
            fi
        };
#ifdef FLIP
        /* PDLoop.drained: no request in bootstrap, the scheduler or inflight, no batch with
           entries, and the batch harvested now was empty; then ElasticLoop's quiet count */
        dr = !hbusy;
        for (r : 0 .. NREQ - 1) { dr = dr && (q[k * NREQ + r] == Q_NONE || q[k * NREQ + r] == Q_GONE) };
        for (i : 0 .. L - 1) { dr = dr && batch[k * L + i] == 0 };
        flip_end(k);
#endif
        mb = (mb + 1) % L;
        busy = 0; hneeds = 0; hb = 0; sampling = 0; fm = 0; rm = 0;
#ifdef GUIDE
        grep = 0; hrep = 0; awaits = 0;
#endif
        scrub()
    }
    od;
#ifdef P_NOLEAK
    for (i : 0 .. NP - 1) { assert(owner[k * NP + i] == 0) }     /* no leak */
#endif
}

#define FAULT (faults < MAXF && r < NFAULTY)

/* One KVSender and its transfer thread on prefill rank k, with the decode side's registrations
   and the faults the manager's threads report (timeouts, a dead or aborting decode peer). */
proctype Sender(byte k; byte r) {
    byte x = k * NREQ + r;
#ifdef FLIP
    if
    :: snd[x] != NONE
    :: snd[x] == NONE && (q[x] == Q_GONE || role[k]) -> goto gone   /* refused, or never comes */
    fi;
#else
    snd[x] != NONE;
#endif
    do
    :: atomic { snd[x] == BOOTSTRAPPING -> snd[x] = WAITING }            /* every decode rank registered */
    :: atomic { snd[x] == BOOTSTRAPPING && FAULT -> faults++; snd_fail(x) }  /* bootstrap timeout */
    :: atomic { (snd[x] == WAITING || snd[x] == TRANSFERRING) && snd_q[x] > 0 && !reading[x] ->
        snd_q[x]--; snd[x] = TRANSFERRING; reading[x] = 1 }              /* _drain takes a chunk */
    :: atomic { reading[x] ->                                             /* the write returned */
        reading[x] = 0;
        if
        :: snd[x] == TRANSFERRING && snd_last[x] && snd_q[x] == 0 ->
#ifdef P_SAFETY
            assert(!dirty[x]);          /* what reached the decode side was read from its own pages */
#endif
            snd[x] = SUCCESS
        :: else
        fi }
    :: atomic { snd[x] != FAILED && snd[x] != SUCCESS && snd[x] != BOOTSTRAPPING && FAULT ->
        faults++; snd_fail(x) }         /* transfer error / timeout, peer_dead, decode abort (a write in
                                           flight still returns later: _busy, the notice is deferred) */
    :: !reading[x] && q[x] == Q_GONE -> break
    od
#ifdef FLIP
    ; gone: skip
#endif
}

#ifdef GUIDE
/* The last rank's compile thread (GrammarSampler.prepare): it finishes a room's guide at any
   time after the rank applied the request. */
proctype Compile(byte r) {
    atomic { q[LAST * NREQ + r] != Q_NONE -> compiled[r] = 1 }
}
#endif

init {
    byte k, r;
    atomic {
        for (k : 0 .. PP * NREQ - 1) { page[k] = NOPAGE; snd[k] = NONE; store_rep[k] = NONE };
        for (k : 0 .. PP - 1) {
            run Rank(k);
            for (r : 0 .. NREQ - 1) { run Sender(k, r) }
        }
#ifdef GUIDE
        ; for (r : 0 .. NREQ - 1) { run Compile(r) }
#endif
    }
}

#ifdef P_LIVENESS
ltl live { [] ((pending > 0) -> <> (pending == 0)) }
#endif
