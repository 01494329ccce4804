"""Process and channel hygiene every pdserve process shares: the cluster secret, sealed ZMQ frames,
bearer checks, the HTTP server set-up and child-process reaping. Imports nothing else of pdserve."""
