"""Agreement between PP ranks: KVPoll, PPConsensusStore, two-pass ring votes, leader sync (no torch)."""
