"""Where a request goes: the worker registry and health, circuit breakers, load-balancing
policies, conditional disaggregation, dispatch and one attempt on a (prefill, decode) pair."""
