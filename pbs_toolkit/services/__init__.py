"""Services: several ordinary pbstk servers (replicas) behind one vllm-router, with one URL and one key.

``router`` starts, checks and stops the router process and talks to its admin API; the rest of the package
decides which replicas join or leave it.
"""
