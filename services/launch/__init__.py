"""Putting the cluster together: every service started, on Ray (``on_ray``: actors, restarts, ``tessera up``'s
own Ray head) or as local processes (``local``), from one plan (``plan``); the ``tessera up/down/certs/demo``
and ``tessera chaos`` commands. The top layer: it imports every worker, and nothing but ``services.cli``
imports it."""
