"""What pdctl's commands do: the service functions the command line calls, one concern each.

Deploy, status, endpoint, logs and destroy of a service; a fleet's registration and checks;
the quick drift check, the hosts' holdings, the model and image prefetch, the fabric check.
Each works through a session (session.py: one fleet read, one SSH pool per command) and the
doors (pdctl/doors/), from the plans and rules of the core (pdctl/core/).
"""
