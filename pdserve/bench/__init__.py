"""`pdserve bench`: a streaming load client for any OpenAI-compatible endpoint.

workload (what to send) -> client (one streamed request) -> runner (a load: concurrency or Poisson
rate) -> report (stats, goodput, JSON) -> plot (an optional PNG of a sweep). `main` wires them.
"""
