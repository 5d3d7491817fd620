"""Where a request runs and how its choices get there: the policies, the pair rules, the prefix
lookup, the inbox sender, the shared dispatch state, one choice's attempts, and shadow replays.

Modules: ``policies/`` (the policy registry: round_robin, random, least_load, prefix_affinity,
prefix_cache), ``selection`` (model check, pair rules, transfer protocol), ``prefix_lookup`` and
``prompt_ids`` (a prompt's cached prefix per candidate, from its token ids), ``sender`` (coalesced
inbox XADDs), ``dispatch`` (shared routing state, the watcher), ``generation`` (one choice's attempts,
retries, migrations), ``worker_contract`` (what the router sends a worker per attempt and relies on
in return), ``shadow`` (``--verify-fraction``'s replays).
"""
